"""The papers' protocols: per-role sampling, RSE trajectory distillation, incremental de-duplication, the experience
agent's empty reply, majority vote by equivalence, early stop without survivorship bias, the paradox sign, presets and
problem-id lists."""
import argparse
import asyncio
import json

import pandas as pd
import pytest

from tmas_nb.agents import AgentContext, SamplingConfig, distill, update_experience
from tmas_nb.data import demo_problems
from tmas_nb.llm.core import Completion
from tmas_nb.memory import ExperienceBank, HashingEmbedder, RSEBank
from tmas_nb.methods import RSEConfig, TMASConfig, majority_answer, run_method

from helpers import ScriptedLLM


REPLIES = {
    'solution': '<think>First I tried adding, a dead end.</think>So the answer is \\boxed{42}.',
    'verification': 'Score: \\boxed{1}', 'summary': 'It multiplies.',
    'experience': '{"verified_anchors": ["6 times 7 is 42"], "error_avoidance_heuristics": []}',
    'guideline': '{"updated_guidelines": ["multiply"]}',
    'distillation': '{"verified_propositions": ["6 times 7 is 42"], "critical_pitfalls": []}',
}


# ------------------------------------------------------------------ sampling settings, defined once, per role

def test_tmas_roles_sample_as_the_paper_states(tmp_path):
    llm = ScriptedLLM(REPLIES)
    cfg = TMASConfig(n_candidates=2, n_verifications=2, iterations=2, embedder='hashing', max_new_tokens=16)
    asyncio.run(run_method('tmas', demo_problems()[:1], llm, cfg, tmp_path, progress=False))
    temps = {r.role: (r.temperature, r.top_p) for r in llm.requests}
    assert temps == {'solution': (1.0, 0.95), 'verification': (1.0, 0.95), 'summary': (0.6, 0.95),
                     'experience': (0.6, 0.95), 'guideline': (0.6, 0.95)}


def test_a_role_is_overridden_in_the_config(tmp_path):
    cfg = TMASConfig.from_dict({'role_sampling': {'verification': {'temperature': 0.3, 'top_k': 20}}})
    s = cfg.sampling()
    assert isinstance(s, SamplingConfig)
    r = s.request([{'role': 'user', 'content': 'x'}], 'verification', 'p', 0, 0)
    assert (r.temperature, r.top_k, r.top_p) == (0.3, 20, 0.95)
    assert s.request([{'role': 'user', 'content': 'x'}], 'summary', 'p', 0, 0).temperature == 0.6
    with pytest.raises(ValueError, match='role_sampling'):
        TMASConfig.from_dict({'role_sampling': {'verification': {'temprature': 0.3}}})


# ------------------------------------------------------------------ RSE distils the whole trajectory

def test_rse_distillation_sees_the_reasoning_and_keeps_the_end_of_long_reasoning():
    llm = ScriptedLLM(REPLIES)
    s = SamplingConfig()
    c = Completion.from_raw('<think>' + 'filler ' * 2000 + 'Adding 6 and 7 was a dead end.</think>The answer is \\boxed{42}.')
    asyncio.run(distill(llm, AgentContext(s, 'p', 'What is 6*7?', 0), c, None, 0, max_chars=3000))
    prompt = llm.requests[-1].messages[-1]['content']
    assert 'Adding 6 and 7 was a dead end.' in prompt and 'The answer is' in prompt
    assert prompt.count('filler') < 600


# ------------------------------------------------------------------ incremental de-duplication

def test_rse_bank_never_shrinks_and_admitted_items_stay():
    b = RSEBank(embedder=HashingEmbedder())
    b.update(['the sum of the roots is 4'], ['do not divide by zero'], round=0)
    first = b.texts('propositions') + b.texts('pitfalls')
    sizes = [len(b)]
    b.update(['The sum of the roots is 4, by Vieta', 'the product of the roots is 3'], ['do not divide by zero here'], round=1)
    sizes.append(len(b))
    assert all(t in b.texts('propositions') + b.texts('pitfalls') for t in first)
    assert sizes == sorted(sizes)
    assert b.texts('propositions')[0] == 'the sum of the roots is 4'


# ------------------------------------------------------------------ experience agent's empty reply

def test_an_empty_experience_reply_keeps_the_previous_bank():
    bank = ExperienceBank(embedder=HashingEmbedder())
    bank.update(['x = 2 works'], ['check x = 0'], round=0)
    llm = ScriptedLLM({**REPLIES, 'experience': '{"verified_anchors": [], "error_avoidance_heuristics": []}'})
    u = asyncio.run(update_experience(llm, AgentContext(SamplingConfig(), 'p', 'q', 1), [], bank))
    assert bank.texts('anchors') == ['x = 2 works'] and bank.texts('heuristics') == ['check x = 0']
    assert u.added == 0


# ------------------------------------------------------------------ majority vote by equivalence

def test_majority_vote_clusters_equivalent_answers():
    texts = ['\\boxed{1/2}', '\\boxed{\\frac12}', '\\boxed{0.5}', '\\boxed{3}', '\\boxed{3}']
    i, ans = majority_answer(texts)
    assert i == 0


# ------------------------------------------------------------------ early stop without survivorship bias

def _records(rows):
    return pd.DataFrame([dict(problem_id=p, iteration=i, candidate=k, correct=c, mean_score=None) for p, i, k, c in rows])


def test_a_problem_that_stopped_early_keeps_counting():
    from tmas_nb.analysis import pass_at_1_by_iteration
    rec = _records([('a', 0, 0, True), ('b', 0, 0, False), ('b', 1, 0, False), ('b', 2, 0, False)])
    curve = pass_at_1_by_iteration(rec)
    assert list(curve.pass_at_1) == [0.5, 0.5, 0.5]
    from tmas_nb.runs import pass_at_1_by_iteration as run_curve
    assert run_curve is pass_at_1_by_iteration      # one Pass@1 for the reports and `tmas runs summary`
    assert list(curve.carried_problems) == [0, 1, 1]


# ------------------------------------------------------------------ the paradox's sign

def test_paradox_delta_is_never_minus_ever():
    from tmas_nb.analysis import verification_paradox
    rec = pd.DataFrame([dict(problem_id=p, iteration=0, candidate=0, correct=c, mean_score=s)
                        for p, c, s in [('a', True, 0.2), ('b', True, 0.4), ('c', False, 0.9), ('d', False, 0.7)]])
    row = verification_paradox(rec).iloc[-1]
    assert row.delta == pytest.approx(0.8 - 0.3)


# ------------------------------------------------------------------ presets and problem-id lists

def test_presets_set_the_papers_settings_and_flags_override_them():
    from tmas_nb.runs import config_from_args
    args = argparse.Namespace(preset='paper', config=None, n_candidates=None, iterations=None, max_new_tokens=None)
    c = config_from_args('tmas', args)
    assert (c.n_candidates, c.n_verifications, c.iterations, c.epsilon) == (8, 8, 20, 0.2)
    r = config_from_args('rse', args)
    assert (r.n_candidates, r.iterations, r.temperature, r.top_p, r.top_k, r.max_new_tokens) == (32, 4, 0.6, 0.95, 20, 38_000)
    args.n_candidates = 3
    assert config_from_args('rse', args).n_candidates == 3


def test_run_help_prints_the_presets():
    from tmas_nb.cli import build_parser
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices['run'].format_help()
    assert '--preset' in text and 'paper' in text and 'cpu-demo' in text and 'N=8' in text


def test_problem_id_list_selects_problems(tmp_path):
    from tmas_nb.data import read_problem_ids, select_problems, write_problem_ids
    f = write_problem_ids(tmp_path / 'ids.txt', ['demo-03', 'demo-01'], {'seed': 7})
    assert read_problem_ids(f) == ['demo-03', 'demo-01']
    assert [p.id for p in select_problems(demo_problems(), read_problem_ids(f))] == ['demo-01', 'demo-03']
    with pytest.raises(ValueError, match='demo-99'):
        select_problems(demo_problems(), ['demo-99'])
