"Prompt assembly of the TMAS and RSE agents and the parsers of their answers."
import random

import pytest

from tmas_nb.methods.memory import ExperienceBank, GuidelineBank, HashingEmbedder, RSEBank
from tmas_nb.methods.prompts import (
    DEFAULT_TEMPLATES, DISTILLATION_KEYS, EXPERIENCE_KEYS, GUIDELINE_KEYS, REFINE_PROMPT, SOLUTION_PROMPT, fill,
    get_templates, parse_json_lists, parse_json_object, parse_verification_score, render_distillation_messages,
    render_experience_messages, render_guideline_messages, render_pacore_messages, render_rse_messages,
    render_self_refine_messages, render_solution_messages, render_summary_messages, render_verification_messages,
    render_verify_refine_messages)

Q = 'Let n be a positive integer with n^2 + 1 divisible by 5. Find n mod 5.'
ROLLOUTS = [dict(solution='<think>private scratch work</think>Try n = 2: 5 | 5, so n ≡ 2.', score=0.5,
                 summary='Finds n ≡ 2 but misses n ≡ 3.'),
            dict(solution='Squares mod 5 are 0, 1, 4; n^2 ≡ 4 gives n ≡ 2 or 3.', score=1.0,
                 summary='Complete case check; reviewers agree.')]


@pytest.fixture
def bank():
    b = ExperienceBank(embedder=HashingEmbedder())
    b.update(['Squares modulo 5 are 0, 1 and 4.'], ['Check every residue class, not just one example.'], round=0)
    return b


def user(msgs):
    assert msgs[-1]['role'] == 'user'
    return msgs[-1]['content']


def test_exploit_carries_rollouts_and_experience_but_no_guidelines(bank):
    msgs = render_solution_messages(Q, 'exploit', ROLLOUTS, bank, guidelines=['Try small cases.'])
    assert [m['role'] for m in msgs] == ['system', 'user']
    u = user(msgs)
    assert u.startswith(fill(REFINE_PROMPT, question=Q))
    assert 'Try n = 2' in u and 'Squares mod 5 are 0, 1, 4' in u and 'misses n ≡ 3' in u
    assert 'private scratch work' not in u, 'the think block of a rollout must not be shown'
    assert '(average score 0.5)' in u and '(average score 1)' in u
    assert '- Anchor: Squares modulo 5 are 0, 1 and 4.' in u
    assert '- Heuristic: Check every residue class, not just one example.' in u
    assert 'Strategies already tried' not in u and 'Try small cases.' not in u


def test_explore_carries_guidelines_only(bank):
    guidelines = GuidelineBank()
    guidelines.update(['Try small cases.', 'Use quadratic residues.'], round=0)
    u = user(render_solution_messages(Q, 'explore', ROLLOUTS, bank, guidelines=guidelines))
    assert u.startswith(fill(SOLUTION_PROMPT, question=Q))
    assert 'Strategies already tried' in u and '1. Try small cases.' in u and '2. Use quadratic residues.' in u
    for absent in ('Try n = 2', 'misses n ≡ 3', 'Anchor:', 'Heuristic:', 'Squares modulo 5', 'Earlier attempts'):
        assert absent not in u, absent
    # no guidelines: just the base prompt
    assert user(render_solution_messages(Q, 'explore')) == fill(SOLUTION_PROMPT, question=Q)


def test_refine_prompt_only_when_rollouts_exist(bank):
    assert user(render_solution_messages(Q, 'exploit')) == fill(SOLUTION_PROMPT, question=Q)
    with_exp = user(render_solution_messages(Q, 'exploit', [], bank))
    assert with_exp.startswith(fill(SOLUTION_PROMPT, question=Q)) and 'Anchor:' in with_exp
    assert user(render_solution_messages(Q, 'exploit', ROLLOUTS)).startswith(fill(REFINE_PROMPT, question=Q))
    # max_rollouts=0 shows nothing to refine
    assert user(render_solution_messages(Q, 'exploit', ROLLOUTS, max_rollouts=0)) == fill(SOLUTION_PROMPT, question=Q)


def test_max_rollouts_subsample_is_seeded():
    many = [dict(solution=f'candidate number {i}', summary=f'summary {i}', score=0) for i in range(12)]

    def shown(rng):
        u = user(render_solution_messages(Q, 'exploit', many, max_rollouts=4, rng=rng))
        return [i for i in range(12) if f'candidate number {i}\n' in u]

    a = shown(3)
    assert len(a) == 4 and a == sorted(a)
    assert shown(3) == a and shown(random.Random(3)) == a
    assert len({tuple(shown(s)) for s in range(30)}) > 5
    rng = random.Random(11)
    first, second = shown(rng), shown(rng)   # one generator advances between iterations
    assert len(first) == len(second) == 4
    assert len(shown(None)) == 4 and shown(None) == shown(0)


def test_template_overrides_and_errors():
    msgs = render_solution_messages(Q, templates={'solution': 'Q: {question}', 'solver_system': ''})
    assert msgs == [{'role': 'user', 'content': f'Q: {Q}'}]
    with pytest.raises(ValueError, match='known names'):
        get_templates({'solutoin': '{question}'})
    with pytest.raises(ValueError, match=r'\{question\}'):
        render_verification_messages(Q, 'x', templates={'verification': 'Check {solution}'})
    assert set(DEFAULT_TEMPLATES) >= {'verification', 'summary', 'experience_update', 'guideline_update',
                                      'rse_system', 'rse_distill', 'self_refine', 'verify_refine', 'pacore'}


@pytest.mark.parametrize('text,score', [
    (r'The argument is complete. Score: \boxed{1}', 1.0),
    (r'Score: \boxed{0.5}', 0.5),
    ('**Score:** 1', 1.0),
    ('**Score**: 0', 0.0),
    (r'Score: $\boxed{\frac{1}{2}}$', 0.5),
    ('score = 1/2', 0.5),
    ('Final score: 1.0', 1.0),
    (r'Score: \boxed{1} -- no wait. Score: \boxed{0}', 0.0),
    (r'<think>Score: \boxed{1}</think>Wrong answer. Score: \boxed{0}', 0.0),
    (r'<think>Looks fine. Score: \boxed{1}', None),          # cut off inside the thinking
    (r'Score: \boxed{0.7}', None),                          # off the scale
    ('Score: 2', None),
    (r'Score: \boxed{1}. Later: Score: \boxed{3}', None),   # the last marker decides
    (r'So the answer is \boxed{1}.', None),                 # no score marker
    ('The solution is fine.', None),
    ('', None),
    (None, None),
])
def test_parse_verification_score(text, score):
    assert parse_verification_score(text) == score


def test_verification_prompt_matches_parser():
    u = user(render_verification_messages(Q, ROLLOUTS[0]['solution']))
    assert 'Try n = 2' in u and 'private scratch work' not in u
    assert [parse_verification_score(l) for l in u.rstrip().splitlines()[-3:]] == [1.0, 0.5, 0.0]
    assert '<score>' not in u


@pytest.mark.parametrize('text,obj', [
    ('{"a": 1}', {'a': 1}),
    ('Sure! Here is the bank:\n```json\n{"verified_anchors": ["x"], "error_avoidance_heuristics": [],}\n```', 
     {'verified_anchors': ['x'], 'error_avoidance_heuristics': []}),
    ('first try {"a": 1} then the final {"a": 2, "s": "brace } inside"} end', {'a': 2, 's': 'brace } inside'}),
    ('{"x": [1, 2, ], "y": {"z": 3,},}', {'x': [1, 2], 'y': {'z': 3}}),
    (r'{"p": ["\frac{a}{b} \le \sqrt{ab}"]}', {'p': [r'\frac{a}{b} \le \sqrt{ab}']}),
    (r'{"p": "a\\b"}', {'p': 'a\\b'}),
    ("{'updated_guidelines': ['induction']}", {'updated_guidelines': ['induction']}),
    ('<think>{"a": "draft"}</think>\n{"a": "final"}', {'a': 'final'}),
    ('```\n{"nested": {"k": [1, {"m": 2}]}}\n```', {'nested': {'k': [1, {'m': 2}]}}),
    ('no object at all', None),
    ('[1, 2, 3]', None),
    ('{"unterminated": [1, 2}', None),
    ('<think>{"a": 1}', None),
    (None, None),
])
def test_parse_json_object(text, obj):
    assert parse_json_object(text) == obj


def test_parse_json_lists():
    assert parse_json_lists('{"updated_guidelines": ["a", "", " b "]}', GUIDELINE_KEYS) == {'updated_guidelines': ['a', 'b']}
    assert parse_json_lists('{"verified_propositions": ["p"]}', DISTILLATION_KEYS) == \
        {'verified_propositions': ['p'], 'critical_pitfalls': []}
    assert parse_json_lists('{"other": 1}', EXPERIENCE_KEYS) is None
    assert parse_json_lists('nothing', EXPERIENCE_KEYS) is None


def test_agent_prompts(bank):
    s = user(render_summary_messages(Q, ROLLOUTS[1]['solution'], [('Correct. Score: \\boxed{1}', 1.0),
                                                                  dict(text='Unreadable verdict', score=None)]))
    assert '2 independent reviews' in s and '(score 1)' in s and '(score n/a)' in s
    e = user(render_experience_messages(Q, ROLLOUTS, bank))
    assert '- Squares modulo 5 are 0, 1 and 4.' in e and '"error_avoidance_heuristics"' in e
    assert 'private scratch work' not in e and '(average score 0.5)' in e
    g = user(render_guideline_messages(Q, ROLLOUTS, ['Try small cases.']))
    assert '1. Try small cases.' in g and '"updated_guidelines"' in g


def test_rse_prompts():
    empty = render_rse_messages(Q)
    assert 'Pitfalls' not in empty[0]['content'] and user(empty) == fill(SOLUTION_PROMPT, question=Q)
    b = RSEBank(embedder=HashingEmbedder())
    b.update(['n^2 ≡ 4 (mod 5) means n ≡ ±2.'], ['Stopping after the first residue that works.'], round=0)
    sys_ = render_rse_messages(Q, b)[0]['content']
    i_avoid, i_pit = sys_.index('Critical pitfalls (never repeat these)'), sys_.index('- Stopping after the first residue')
    i_verify, i_prop = sys_.index('Propositions (check each one before you use it)'), sys_.index('- n^2 ≡ 4')
    assert i_avoid < i_pit < i_verify < i_prop
    d = user(render_distillation_messages(Q, ROLLOUTS[0]['solution']))
    assert '"verified_propositions"' in d and '"critical_pitfalls"' in d and 'private scratch work' not in d


def test_baseline_prompts():
    assert 'Your earlier solution:\nTry n = 2' in user(render_self_refine_messages(Q, ROLLOUTS[0]['solution']))
    vr = user(render_verify_refine_messages(Q, 'n ≡ 2', ['Misses n ≡ 3.', '<think>x</think>Incomplete.']))
    assert 'Review 1:\nMisses n ≡ 3.' in vr and 'Review 2:\nIncomplete.' in vr
    pc = user(render_pacore_messages(Q, ['<think>long</think>So n ≡ 2.', 'So n ≡ 2 or 3.', '']))
    assert 'Reference 1:\nSo n ≡ 2.' in pc and 'Reference 2:\nSo n ≡ 2 or 3.' in pc and 'Reference 3' not in pc
    assert user(render_pacore_messages(Q, [f'ans {i}' for i in range(9)], max_references=3, rng=1)).count('Reference ') == 3
