"""Every agent's words: the calls table of a real tiny TMAS run (SmolLM2), read finished, interrupted and resumed, and
`tmas runs show` over it; scripted TMAS and RSE runs for the bank diffs and the RSE view (pure rendering)."""
import asyncio
import json
import shutil
import time

import pytest

from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.methods.tmas import TMASConfig
from tmas_nb.methods.solve import read_checkpoints
from tmas_nb.methods.prompts import parse_verification_score
from tmas_nb.runs.folder import CALL_COLUMNS
from tmas_nb.runs.folder import load_run
from tmas_nb.runs.start import start_run

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


# ------------------------------------------------------------------ tmas runs show

def show(capsys, *args):
    from tmas_nb.cli import main
    code = main(['runs', 'show', *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_runs_show_prints_the_table_and_a_problem_tree_with_the_reviews_taken_from_calls(tmas_run, capsys):
    calls = tmas_run.calls()
    code, table, _ = show(capsys, tmas_run.run_dir)
    assert code == 0
    rec = tmas_run.records
    cells = [f'{int(g.correct.sum())}/{len(g)}' for _, g in rec.groupby('iteration')]
    row = next(l for l in table.splitlines() if l.startswith(PROBLEM[0].id))
    assert row.split()[2:4] == cells and 'Pass@1' in table
    code, tree, _ = show(capsys, tmas_run.run_dir, '--problem', PROBLEM[0].id)
    assert code == 0
    reviews = calls[calls.role == 'verification']
    assert tree.count('review 1 · ') == len(reviews) == 2 * N
    for text in reviews.reply:                      # every review's words, as the model wrote them (first line)
        first = text.strip('\n').splitlines()[0] if text.strip() else '(empty)'
        assert first[:150] in tree
    for it in (0, 1):
        assert f'iteration {it} · ' in tree
        assert f'experience bank after iteration {it} · ' in tree and f'guideline bank after iteration {it} · ' in tree
    only = show(capsys, tmas_run.run_dir, '--problem', PROBLEM[0].id, '--iteration', 1, '--role', 'verification')[1]
    assert 'iteration 0 · ' not in only and only.count('review 1 · ') == N and 'summary · ' not in only


def test_runs_show_of_an_interrupted_run_and_its_errors(tmas_run, tmp_path, capsys):
    half = interrupted_copy(tmas_run, tmp_path / 'half')
    code, out, _ = show(capsys, half, '--problem', PROBLEM[0].id)
    assert code == 0 and 'not complete' in out and 'iteration 1 · ' not in out and out.count('review 1 · ') == N
    code, _, err = show(capsys, half, '--problem', 'nope')
    assert code == 2 and f"no problem 'nope' in this run; its problems: {PROBLEM[0].id}" in err
    code, _, err = show(capsys, half, '--problem', PROBLEM[0].id, '--iteration', 5)
    assert code == 2 and 'has iterations 0 to 0' in err


def scripted_tmas(tmp_path):
    "A scripted TMAS run whose experience agent answers a new anchor each time (kept, added and dropped items)."
    from helpers import REPLIES, ScriptedLLM
    def experience(request, k):
        return json.dumps({'verified_anchors': [f'anchor {k}', '6 times 7 is 42'], 'error_avoidance_heuristics': []})
    long_review = '\n'.join(f'step {i} holds' for i in range(1, 21)) + '\nScore: \\boxed{1}'
    llm = ScriptedLLM({**REPLIES, 'experience': experience, 'verification': long_review})
    cfg = TMASConfig(n_candidates=2, n_verifications=2, iterations=3, embedder='hashing', max_new_tokens=32)
    return asyncio.run(start_run('tmas', PROBLEM, cfg, tmp_path / 'scripted', model='scripted', llm=llm, benchmark='demo',
                                 progress=False))


def test_runs_show_gives_each_bank_what_was_added_kept_and_dropped_and_full_texts(tmp_path, capsys):
    run = scripted_tmas(tmp_path)
    code, tree, _ = show(capsys, run.run_dir, '--problem', PROBLEM[0].id)
    assert code == 0
    it1 = tree[tree.index('iteration 1 · '):tree.index('iteration 2 · ')]
    assert 'experience bank after iteration 1 · 2 item(s) · +1 added · 1 kept · −1 dropped' in it1
    assert '+ Anchor: anchor 1' in it1 and '− Anchor: anchor 0' in it1
    assert 'guideline bank after iteration 1 · 1 item(s) · +0 added · 1 kept · −0 dropped' in it1
    assert 'experience agent · ok · 1 attempt(s)' in it1
    assert '… 15 more lines' in tree and 'step 10 holds' not in tree          # shortened: 4 first, 2 last lines
    full = show(capsys, run.run_dir, '--problem', PROBLEM[0].id, '--iteration', 2, '--full')[1]
    assert 'step 10 holds' in full and '= Anchor: 6 times 7 is 42' in full and '… 15 more lines' not in full


def test_runs_show_of_an_rse_run_gives_each_trajectory_its_distilled_items_and_the_merges(tmp_path, capsys):
    from helpers import REPLIES, ScriptedLLM
    from tmas_nb.methods.rse import RSEConfig
    cfg = RSEConfig(n_candidates=2, iterations=2, embedder='hashing', max_new_tokens=32)
    run = asyncio.run(start_run('rse', PROBLEM, cfg, tmp_path / 'rse', model='scripted', llm=ScriptedLLM(REPLIES),
                                benchmark='demo', progress=False))
    code, tree, _ = show(capsys, run.run_dir, '--problem', PROBLEM[0].id)
    assert code == 0
    r0 = tree[tree.index('iteration 0 · '):tree.index('iteration 1 · ')]
    t0, t1 = r0[r0.index('trajectory 0 · '):r0.index('trajectory 1 · ')], r0[r0.index('trajectory 1 · '):]
    assert 'distilled · 1 proposition(s), 1 pitfall(s) · 2 added to the bank' in t0
    assert '+ proposition: 6 times 7 is 42' in t0 and '+ pitfall: adding instead of multiplying' in t0
    assert "~ proposition: 6 times 7 is 42 merged into '6 times 7 is 42' (exact)" in t1
    assert 'rse bank after iteration 0 · 2 item(s) · +2 added' in r0
    assert 'the prompt carried 1 propositions, 1 pitfalls' in tree[tree.index('iteration 1 · '):]


@pytest.mark.parametrize('name', ['sampling', 'mv', 'self-refine', 'verify-refine', 'pacore', 'rse'])
def test_every_method_tags_its_calls_with_the_candidate_of_the_record(name, tmp_path):
    from helpers import REPLIES, ScriptedLLM
    from tmas_nb.methods.loop import BaselineConfig
    from tmas_nb.methods.rse import RSEConfig
    kw = dict(n_candidates=3, iterations=2, embedder='hashing', max_new_tokens=32)
    cfg = RSEConfig(**kw) if name == 'rse' else BaselineConfig(**kw)
    run = asyncio.run(start_run(name, PROBLEM, cfg, tmp_path / name, model='scripted', llm=ScriptedLLM(REPLIES),
                                benchmark='demo', progress=False))
    calls, rec = run.calls(), run.records
    made = calls[calls.role.isin(['solution', 'refine'])]
    assert sorted(zip(made.iteration, made.candidate)) == \
        sorted((i, k) for i, k, b in zip(rec.iteration, rec.candidate, rec.branch) if b != 'majority')
    for role, d in json.loads((run.run_dir / 'usage.json').read_text())['by_role'].items():
        assert int(calls[calls.role == role].completion_tokens.sum()) == d['completion_tokens'], role
    if name == 'verify-refine':
        assert calls[calls.role == 'verification'].groupby(['iteration', 'candidate']).size().tolist() == [1] * 6
    if name == 'rse':
        assert sorted(calls[calls.role == 'distillation'].candidate) == [0, 1, 2]
