"""Helpers shared by the tests: a scripted LLM for control-flow tests and a toy replay store.

Tests use the packaged small models wherever behaviour depends on a model; `ScriptedLLM` is only for tests of
control flow (which agent is called, with what, in what order), where a real model's text would make them flaky.
"""
from collections import Counter

from tmas_nb.llm.core import LLM, Completion
from tmas_nb.autotts.store import ReplayStore


class ScriptedLLM(LLM):
    """Answers from a script and records every request.

    `replies` is either a dict `{role: reply}` — a reply is a string, a list (one string per sample) or a function
    `(request, call number of that role) -> reply` — or a list of strings handed out in order, one per sample."""

    def __init__(self, replies, completion_tokens=None):
        super().__init__('scripted')
        self.replies = replies if isinstance(replies, dict) else list(replies)
        self.completion_tokens, self.requests, self.calls = completion_tokens, [], Counter()

    def _completion(self, text):
        n = len(text.split()) if self.completion_tokens is None else self.completion_tokens
        return Completion.from_raw(text, completion_tokens=n, prompt_tokens=10)

    async def _generate(self, requests):
        out = []
        for r in requests:
            self.requests.append(r)
            if isinstance(self.replies, list):
                out.append([self._completion(self.replies.pop(0)) for _ in range(r.n)])
                continue
            k = self.calls[r.role]
            self.calls[r.role] += 1
            rep = self.replies[r.role]
            texts = [rep(r, k) if callable(rep) else rep for _ in range(r.n)]
            texts = [t[i] if isinstance(t, list) else t for i, t in enumerate(texts)]
            out.append([self._completion(t) for t in texts])
        return out

    def by_role(self, role):
        return [r for r in self.requests if r.role == role]


# One scripted problem (6 × 7) answered by every agent role, for control-flow tests of the methods.
REPLIES = {
    'solution': r'Six sevens make 42, so the answer is \boxed{42}.',
    'verification': r'Every step holds. Score: \boxed{1}',
    'summary': 'Direct multiplication; the reviewers confirm 42.',
    'experience': '{"verified_anchors": ["6 times 7 is 42"], "error_avoidance_heuristics": ["do not add 6 and 7"]}',
    'guideline': '{"updated_guidelines": ["compute the product directly"]}',
    'distillation': '{"verified_propositions": ["6 times 7 is 42"], "critical_pitfalls": ["adding instead of multiplying"]}',
    'refine': r'Checked again: \boxed{42}',
}


def toy_store(branches=None, gold='1', n_questions=1, name='toy') -> ReplayStore:
    """A replay store of `n_questions` identical questions; a branch is `[probed answers, tokens, final answer]`.

    The default question has two branches: one probed twice ('1', '2') over 1800 tokens, one never probed (200)."""
    branches = branches if branches is not None else [[['1', '2'], 1800, '1'], [[], 200, '2']]
    return ReplayStore.from_records([{'question': f'q{i}', 'gold_answer': gold, 'probe_freq': 500, 'each_branch': branches}
                                     for i in range(n_questions)], name=name)
