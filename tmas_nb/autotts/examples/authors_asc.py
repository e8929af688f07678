from collections import Counter
from scipy.stats import beta

class ASCMethod:
    "Adaptive consistency: whole branches one at a time until the Beta confidence exceeds the threshold."
    def __init__(self, config=None):
        self.config = config or {}
        self.max_samples = int(self.config.get('max_samples', 64)); self.threshold = float(self.config.get('threshold', 0.95))
    def solve(self, question):
        seen = []
        for _ in range(self.max_samples):
            try: seen.append(question.get_new_branch_final_answer())
            except (IndexError, ValueError): break
            if len(seen) >= 2:
                top = Counter(seen).most_common(2)
                v2 = top[1][1] if len(top) > 1 else 0
                if 1 - beta.cdf(0.5, top[0][1] + 1, v2 + 1) > self.threshold: return top[0][0]
        return Counter(seen).most_common(1)[0][0] if seen else None
