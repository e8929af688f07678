"""Every agent's words: the calls table of a real tiny TMAS run (SmolLM2), read finished, interrupted and resumed, and
`tmas runs show` over it; scripted TMAS and RSE runs for the bank diffs and the RSE view (pure rendering)."""
import asyncio
import json
import shutil
import time

import pytest

from tmas_nb.data import demo_problems
from tmas_nb.methods import TMASConfig, read_checkpoints
from tmas_nb.prompts import parse_verification_score
from tmas_nb.run_folder import CALL_COLUMNS
from tmas_nb.runs import load_run, start_run

from test_methods import TINY_TEMPLATES

PROBLEM = demo_problems()[:1]
N, M = 2, 1
ROLES = {'solution', 'verification', 'summary', 'experience', 'guideline'}


def tiny_tmas_config():
    return TMASConfig(n_candidates=N, n_verifications=M, iterations=2, embedder='hashing', max_new_tokens=8, seed=3,
                      memory_retries=0, templates=TINY_TEMPLATES)


@pytest.fixture(scope='module')
def tmas_run(tmp_path_factory):
    "One real run: TMAS, N=2, M=1, 2 iterations, 8 tokens, one demo problem, on the packaged SmolLM2."
    out = tmp_path_factory.mktemp('show') / 'tmas_tiny'
    t0 = time.time()
    run = asyncio.run(start_run('tmas', PROBLEM, tiny_tmas_config(), out, model='smollm2', benchmark='demo',
                                progress=False, num_threads=1))
    print(f'tiny TMAS run: {time.time() - t0:.1f} s')
    return run


def test_calls_cover_every_role_tagged_by_problem_iteration_and_candidate(tmas_run):
    calls, rec = tmas_run.calls(), tmas_run.records
    assert list(calls.columns) == list(CALL_COLUMNS)
    assert set(calls.run) == {'tmas_tiny'} and set(calls.problem_id) == {PROBLEM[0].id}
    assert set(calls.role) == ROLES
    per = calls.groupby(['iteration', 'role', 'candidate']).size().to_dict()
    for it in (0, 1):
        for k in range(N):
            assert (per[(it, 'solution', k)], per[(it, 'verification', k)], per[(it, 'summary', k)]) == (1, M, 1)
    # the memory agents serve no one candidate, and run after every iteration but the last
    assert {key: n for key, n in per.items() if key[1] in ('experience', 'guideline')} == \
        {(0, 'experience', -1): 1, (0, 'guideline', -1): 1}
    # tokens and samples per role are those of usage.json
    usage = json.loads((tmas_run.run_dir / 'usage.json').read_text())['by_role']
    sums = calls.groupby('role')[['prompt_tokens', 'completion_tokens']].sum()
    for role, d in usage.items():
        assert (int(sums.loc[role, 'prompt_tokens']), int(sums.loc[role, 'completion_tokens'])) == \
            (d['prompt_tokens'], d['completion_tokens']), role
        assert int((calls.role == role).sum()) == d['samples']
    # each candidate's rows are its record's words: its solution, its reviews' scores, its summary
    for r in rec.itertuples():
        mine = calls[(calls.iteration == r.iteration) & (calls.candidate == r.candidate)]
        assert mine[mine.role == 'solution'].reply.tolist() == [r.solution]
        reviews = mine[mine.role == 'verification']
        readable = [parse_verification_score(t) for t, f in zip(reviews.reply, reviews.finish_reason) if f != 'length']
        assert [s for s in readable if s is not None] == list(r.verification_scores)
        assert [t.strip() for t in mine[mine.role == 'summary'].reply] == [r.summary]
    assert not calls.cached.any()
    assert (calls.start <= calls.end).all() and calls.queue_s.notna().all() and (calls.queue_s >= 0).all()
    assert all(json.loads(p)[-1]['role'] == 'user' for p in calls.prompt)


def interrupted_copy(run, dest):
    "The run folder as it was when killed during iteration 1: its first checkpoint, the call cache, no finished files."
    shutil.copytree(run.run_dir, dest)
    for f in ('records.parquet', 'banks.parquet', 'calls.parquet', 'usage.json'):
        (dest / f).unlink()
    for p in dest.glob('checkpoints/*/iter_1.json'):
        p.unlink()
    (dest / 'status.json').write_text(json.dumps({'complete': False, 'wall_s': 1.0}))
    return dest


def test_an_interrupted_run_reads_its_calls_from_checkpoints_and_resuming_keeps_them(tmas_run, tmp_path):
    done = tmas_run.calls()
    half = load_run(interrupted_copy(tmas_run, tmp_path / 'tmas_tiny'))
    assert not half.complete
    first = done[done.iteration == 0].reset_index(drop=True)
    assert half.calls().to_dict('records') == first.to_dict('records')
    # resume: iteration 0's rows are kept as they were, iteration 1 is replayed from the call cache
    again = asyncio.run(start_run('tmas', PROBLEM, tiny_tmas_config(), tmp_path / 'tmas_tiny', model='smollm2',
                                  benchmark='demo', progress=False, num_threads=1))
    assert again.complete and again.status['last_invocation_cache']['model_loaded'] is False
    resumed = again.calls()
    assert resumed[resumed.iteration == 0].reset_index(drop=True).to_dict('records') == first.to_dict('records')
    later = resumed[resumed.iteration == 1]
    assert later.cached.all() and later.queue_s.isna().all()
    keep = ['problem_id', 'iteration', 'candidate', 'role', 'sample', 'prompt', 'reply', 'completion_tokens']
    in_order = lambda df: df[keep].sort_values(keep[:5]).to_dict('records')   # rows come in the order calls returned
    assert in_order(later) == in_order(done[done.iteration == 1])


def test_a_run_folder_of_an_older_version_loads_with_an_empty_calls_table(tmas_run, tmp_path, capsys):
    old = shutil.copytree(tmas_run.run_dir, tmp_path / 'old')
    (old / 'calls.parquet').unlink()
    for pid, cps in read_checkpoints(old).items():
        for cp in cps:
            del cp['calls']
            (old / 'checkpoints' / pid / f"iter_{cp['iteration']}.json").write_text(json.dumps(cp))
    run = load_run(old)
    assert run.complete and len(run.records) == 2 * N
    calls = run.calls()
    assert list(calls.columns) == list(CALL_COLUMNS) and len(calls) == 0
    assert 'older version' in capsys.readouterr().err
