from collections import Counter
from controller_api import LLMDesignedMethod

class SCMethod(LLMDesignedMethod):
    "Self-consistency: read k whole branches, answer the most frequent final answer."
    NAME = 'sc'
    def solve(self, question):
        answers = []
        for _ in range(int(self.config.get('k', 64))):
            try: answers.append(question.get_new_branch_final_answer())
            except (IndexError, ValueError): break
        return Counter(answers).most_common(1)[0][0] if answers else None
