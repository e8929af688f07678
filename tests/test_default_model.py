"""The `default` model (Qwen2.5-Coder-0.5B-Instruct) that the README's runs use: it loads, answers, and runs one TMAS iteration.

The notebooks' cells that load it are flagged `slow` and do not run in CI; these tests keep the model in CI.
"""
import asyncio

import pytest

from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.llm.core import Request
from tmas_nb.llm.loading import load_llm
from tmas_nb.methods.tmas import TMASConfig
from tmas_nb.runs.folder import load_run
from tmas_nb.runs.start import start_run


@pytest.fixture(scope='module')
def default_llm():
    llm = load_llm('default', num_threads=2)
    yield llm
    llm.close()


def test_default_model_answers_a_short_question(default_llm):
    "Greedy decoding of a one-number question: the model says 42, and stops well before the token limit."
    req = Request.from_prompt('What is 6 times 7? Reply with the number only.', temperature=0.0, max_new_tokens=8)
    [[c]] = default_llm.generate_sync([req])
    assert '42' in c.text, c.raw
    assert c.finish_reason == 'stop' and 0 < c.completion_tokens < 8


def test_default_model_runs_one_tmas_iteration(default_llm, tmp_path):
    "One problem, one candidate with one review, one iteration, short answers: a complete run folder with solution and verification at work."
    cfg = TMASConfig(n_candidates=1, n_verifications=1, iterations=1, max_new_tokens=16, embedder='hashing', seed=0)
    problems = demo_problems()[:1]
    run = asyncio.run(start_run('tmas', problems, cfg, tmp_path / 'run', llm=default_llm, progress=False))
    again = load_run(tmp_path / 'run')
    assert run.complete and again.complete
    s = again.summary()
    assert s['problems'] == 1 and [i['iteration'] for i in s['iterations']] == list(range(len(s['iterations'])))
    assert s['iterations'][0]['candidates'] == cfg.n_candidates
    assert {'solution', 'verification'} <= set(s['tokens_by_role'])
    assert all(n > 0 for n in s['tokens_by_role'].values())
    assert set(again.records.problem_id) == {problems[0].id}
