from collections import Counter

class SelfConsistencyFile:
    "Self-consistency on the environment's actions: read k whole branches, answer the plurality."
    def __init__(self, k=64): self.k = int(k)
    def run(self, env):
        answers = [env.read_whole() for _ in range(min(self.k, env.n_available))]
        return Counter(answers).most_common(1)[0][0] if answers else None
