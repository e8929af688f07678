"""TMAS, RSE and the baselines: the shared loop's control flow (scripted model), run folders, the summary contract,
and an end-to-end TMAS run on the real SmolLM2 model that is killed, resumed and compared with an uninterrupted run."""
import asyncio
import contextlib
import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.methods.registry import METHODS
from tmas_nb.methods.loop import RECORD_COLUMNS, BaselineConfig
from tmas_nb.methods.rse import RSEConfig
from tmas_nb.methods.tmas import TMASConfig
from tmas_nb.methods.solve import read_checkpoints, run_method
from tmas_nb.cli import main
from tmas_nb.runs.folder import RunConfigMismatch, load_run, record_schema
from tmas_nb.runs.start import start_run

from helpers import REPLIES, ScriptedLLM

REPO = Path(__file__).resolve().parents[1]
PROBLEMS = demo_problems()[:2]


def tmas_config(**kw):
    base = dict(n_candidates=3, n_verifications=2, iterations=2, embedder='hashing', max_new_tokens=32, seed=1)
    return TMASConfig(**{**base, **kw})


def run(method, llm, config, run_dir, problems=PROBLEMS):
    return asyncio.run(run_method(method, problems, llm, config, run_dir, concurrency=2, progress=False))


def user_text(request):
    return request.messages[-1]['content']


# ------------------------------------------------------------------ explore / exploit assembly

def test_epsilon_zero_never_explores_and_exploit_requests_carry_rollouts_and_experience(tmp_path):
    llm = ScriptedLLM(REPLIES)
    df = run('tmas', llm, tmas_config(epsilon=0.0, iterations=3), tmp_path)
    assert set(df.branch) == {'exploit'}
    sols = llm.by_role('solution')
    assert len(sols) == 2 * 3 * 3
    first = [r for r in sols if 'Earlier attempts' not in user_text(r)]
    assert len(first) == 2 * 3                                   # iteration 0 has no previous rollouts
    later = [r for r in sols if 'Earlier attempts' in user_text(r)]
    assert len(later) == 2 * 3 * 2
    assert all('Six sevens make 42' in user_text(r) and '6 times 7 is 42' in user_text(r) for r in later)
    assert not any('Strategies already tried' in user_text(r) for r in sols)


def test_epsilon_one_always_explores_with_guidelines_only(tmp_path):
    llm = ScriptedLLM(REPLIES)
    df = run('tmas', llm, tmas_config(epsilon=1.0, iterations=2), tmp_path)
    assert set(df.branch) == {'explore'}
    for r in llm.by_role('solution'):
        t = user_text(r)
        assert 'Earlier attempts' not in t and 'Experience from earlier attempts' not in t
        assert 'Six sevens' not in t and '6 times 7 is 42' not in t
    assert sum('compute the product directly' in user_text(r) for r in llm.by_role('solution')) == 2 * 3


def test_intermediate_epsilon_mixes_branches_reproducibly(tmp_path):
    a = run('tmas', ScriptedLLM(REPLIES), tmas_config(epsilon=0.5, n_candidates=8), tmp_path / 'a')
    b = run('tmas', ScriptedLLM(REPLIES), tmas_config(epsilon=0.5, n_candidates=8), tmp_path / 'b')
    assert set(a.branch) == {'explore', 'exploit'}
    assert list(a.branch) == list(b.branch)


# ------------------------------------------------------------------ memory agents through the loop

STRATEGIES = ['place the figure in coordinates', 'induction on the number of terms',
              'find an invariant modulo three', 'count the complementary cases']


def test_guideline_bank_stays_append_only_through_the_loop(tmp_path):
    # the agent "forgets" the strategies listed in its prompt and returns only a new one; the bank must keep them all
    def guideline(request, k):
        listed = len(re.findall(r'^\d+\. ', user_text(request), flags=re.M))
        return json.dumps({'updated_guidelines': [STRATEGIES[listed]]})
    llm = ScriptedLLM({**REPLIES, 'guideline': guideline})
    run('tmas', llm, tmas_config(iterations=4, use_experience=False), tmp_path)
    cps = read_checkpoints(tmp_path)
    assert sorted(cps) == ['demo-01', 'demo-02']
    for pid, items in cps.items():
        assert [cp['banks']['guideline'] for cp in items] == [STRATEGIES[:1], STRATEGIES[:2], STRATEGIES[:3], STRATEGIES[:3]]
    # later guideline requests still list the strategies the agent dropped
    assert sum(STRATEGIES[0] in user_text(r) and STRATEGIES[1] in user_text(r) for r in llm.by_role('guideline')) == 2


def test_malformed_memory_json_is_retried_then_previous_bank_kept_and_failure_recorded(tmp_path):
    def experience(request, k):
        # first update (iteration 0) parses on its second attempt; every later reply is malformed
        return 'no json' if k != 1 else REPLIES['experience']
    llm = ScriptedLLM({**REPLIES, 'experience': experience, 'guideline': 'still not json {'})
    cfg = tmas_config(iterations=3, memory_retries=2)
    r = asyncio.run(start_run('tmas', PROBLEMS[:1], cfg, tmp_path / 'run', model='scripted', llm=llm,
                              benchmark='demo', progress=False))
    assert r.complete
    assert len(llm.by_role('experience')) == 2 + 3          # iteration 0: fail + success; iteration 1: 3 failures
    assert len(llm.by_role('guideline')) == 3 + 3
    ev = r.memory_events
    assert [(e['iteration'], e['agent'], e['ok'], e['attempts']) for e in ev] == [
        (0, 'experience', True, 2), (0, 'guideline', False, 3), (1, 'experience', False, 3), (1, 'guideline', False, 3)]
    assert 'no JSON object' in ev[2]['error']
    exp = r.banks[r.banks.bank == 'experience'].sort_values('iteration')
    assert [list(x) for x in exp['items']] == [['Anchor: 6 times 7 is 42', 'Heuristic: do not add 6 and 7']] * 3
    assert json.loads((tmp_path / 'run' / 'usage.json').read_text())['memory_failures'] == 3


def test_zero_verifications_skip_verification_scores_and_the_experience_agent(tmp_path):
    llm = ScriptedLLM(REPLIES)
    df = run('tmas', llm, tmas_config(n_verifications=0, iterations=3), tmp_path)
    roles = Counter(r.role for r in llm.requests)
    assert roles['verification'] == 0 and roles['experience'] == 0
    assert roles['solution'] == roles['summary'] == 2 * 3 * 3 and roles['guideline'] == 2 * 2
    assert all(len(s) == 0 for s in df.verification_scores)
    assert df.mean_score.isna().all() and not df.fully_verified.any()


# ------------------------------------------------------------------ fully verified, early stop

@pytest.mark.parametrize('reviews,expected', [
    (['Score: 1'] * 4, True),
    (['Score: 1', 'Score: 1', 'Score: 1', 'no verdict'], True),              # 3 readable >= M - 2
    (['Score: 1', 'Score: 1', 'no verdict', 'no verdict'], True),            # 2 readable >= M - 2
    (['Score: 1', 'no verdict', 'no verdict', 'no verdict'], False),         # 1 readable < M - 2
    (['Score: 1', 'Score: 1', 'Score: 0.5', 'Score: 1'], False),
])
def test_fully_verified_detection(tmp_path, reviews, expected):
    llm = ScriptedLLM({**REPLIES, 'verification': lambda r, k: reviews})
    df = run('tmas', llm, tmas_config(n_verifications=4, iterations=1), tmp_path, PROBLEMS[:1])
    assert df.fully_verified.tolist() == [expected] * 3
    assert [len(s) for s in df.verification_scores] == [sum('Score' in t for t in reviews)] * 3


def test_early_stop_ends_a_problem_after_a_fully_verified_iteration(tmp_path):
    # problem demo-01 is fully verified at once; demo-02 never (its reviews give 0.5)
    def verification(request, k):
        return 'Score: 1' if 'What is 17 + 25' in user_text(request) else 'Score: 0.5'
    llm = ScriptedLLM({**REPLIES, 'verification': verification})
    df = run('tmas', llm, tmas_config(iterations=3, early_stop=True), tmp_path)
    assert sorted(set(df[df.problem_id == 'demo-01'].iteration)) == [0]
    assert sorted(set(df[df.problem_id == 'demo-02'].iteration)) == [0, 1, 2]
    assert read_checkpoints(tmp_path)['demo-01'][0]['done'] is True


# ------------------------------------------------------------------ one schema, the summary contract

def config_for(name):
    kw = dict(n_candidates=2, iterations=2, embedder='hashing', max_new_tokens=32)
    return TMASConfig(**kw) if name == 'tmas' else RSEConfig(**kw) if name == 'rse' else BaselineConfig(**kw)


def test_records_schema_is_identical_for_every_method(tmp_path):
    schemas, branches = {}, {}
    for name in [m for m in METHODS if m != 'controller']:   # the live controller method decodes a model: tests/test_live.py
        r = asyncio.run(start_run(name, PROBLEMS, config_for(name), tmp_path / name, model='scripted',
                                  llm=ScriptedLLM(REPLIES), benchmark='demo', progress=False))
        schemas[name] = pq.read_schema(tmp_path / name / 'records.parquet')
        branches[name] = sorted(set(r.records.branch))
        assert list(r.records.columns) == list(RECORD_COLUMNS)
        rec = r.records
        assert rec[rec.problem_id == 'demo-01'].correct.all() and not rec[rec.problem_id == 'demo-02'].correct.any(), name
    assert len(schemas) == 7
    want = record_schema()
    for name, s in schemas.items():
        assert s.remove_metadata().equals(want), (name, s)
    assert set(branches.pop('tmas')) <= {'exploit', 'explore'}
    assert branches == {'rse': ['rse'], 'sampling': ['sample'], 'mv': ['majority', 'sample'],
                        'self-refine': ['refine', 'sample'], 'verify-refine': ['sample', 'verify-refine'],
                        'pacore': ['pacore', 'sample']}


def summary_json(run_dir):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(['runs', 'summary', str(run_dir), '--json']) == 0
    lines = buf.getvalue().strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_summary_json_contract(tmp_path):
    def solution(request, k):
        return r'\boxed{42}' if 'What is 17 + 25' in user_text(request) else r'\boxed{0}'
    asyncio.run(start_run('sampling', PROBLEMS, BaselineConfig(n_candidates=4, iterations=2), tmp_path / 's',
                          model='scripted', llm=ScriptedLLM({**REPLIES, 'solution': solution}), benchmark='demo',
                          progress=False))
    s = summary_json(tmp_path / 's')
    assert list(s) == ['method', 'problems', 'iterations', 'tokens_by_role', 'tokens_by_endpoint', 'complete', 'wall_s',
                       'engine', 'backend', 'truncated_by_role', 'warnings', 'answers']
    assert s['method'] == 'sampling' and s['problems'] == 2 and s['complete'] is True
    assert s['iterations'] == [{'iteration': 0, 'pass_at_1': 0.5, 'candidates': 8},
                               {'iteration': 1, 'pass_at_1': 0.5, 'candidates': 8}]
    assert s['tokens_by_role'] == {'solution': 16}


def test_a_different_config_on_the_same_folder_is_refused(tmp_path):
    asyncio.run(start_run('tmas', PROBLEMS, tmas_config(), tmp_path / 'r', model='scripted',
                          llm=ScriptedLLM(REPLIES), benchmark='demo', progress=False))
    with pytest.raises(RunConfigMismatch, match='config.epsilon: 0.2 -> 0.5'):
        asyncio.run(start_run('tmas', PROBLEMS, tmas_config(epsilon=0.5), tmp_path / 'r', model='scripted',
                              llm=ScriptedLLM(REPLIES), benchmark='demo', progress=False))


# ------------------------------------------------------------------ the real model: kill, resume, compare

def tmas_command(out, cfg):
    return [sys.executable, '-m', 'tmas_nb.cli', 'run', '--method', 'tmas', '--benchmark', 'demo', '--limit', '2',
            '--model', 'smollm2', '--n-candidates', '2', '--n-verifications', '2', '--iterations', '2',
            '--max-new-tokens', '12', '--seed', '11', '--threads', '1', '--concurrency', '2', '--quiet',
            '--config', str(cfg), '--out', str(out)]


def plain(df):
    "Rows as plain dicts (missing values as None, wall time left out) so that two runs compare exactly."
    df = df.drop(columns=[c for c in ('wall_s',) if c in df.columns]).astype(object)
    return [{k: (None if not isinstance(v, list) and v != v else v) for k, v in row.items()}
            for row in df.where(df.notna(), None).to_dict('records')]


# Short prompts with the same fields as the paper's (`tmas_nb.methods.prompts`), so that the CPU run stays short.
TINY_TEMPLATES = {
    'solver_system': '', 'reviewer_system': '',
    'solution': 'Solve: {question}\nGive the answer as \\boxed{...}.',
    'refine': 'Solve: {question}\nImprove on the attempts below.',
    'rollouts_block': 'Attempts:\n{rollouts}', 'rollout_item': '{index}. {solution} [{score}] {summary}',
    'experience_block': 'Facts: {anchors}\nAvoid: {heuristics}', 'guidelines_block': 'Tried already: {guidelines}',
    'verification': 'Problem: {question}\nSolution: {solution}\nGrade it. Last line: Score: \\boxed{1} or \\boxed{0}',
    'summary': 'Summarise the solution and its reviews.\nSolution: {solution}\nReviews: {verifications}',
    'summary_review_item': '({score}) {text}',
    'experience_update': 'Attempts: {rollouts}\nBank: {bank}\nReply as JSON: '
                         '{"verified_anchors": [...], "error_avoidance_heuristics": [...]}',
    'guideline_update': 'Attempts: {rollouts}\nStrategies: {guidelines}\nReply as JSON: {"updated_guidelines": [...]}',
}


def cache_rows(path):
    if not path.exists(): return 0
    try:
        with contextlib.closing(sqlite3.connect(f'file:{path}?mode=ro', uri=True, timeout=5)) as db:
            return db.execute('SELECT COUNT(*) FROM completions').fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def test_real_model_run_killed_and_resumed_equals_an_uninterrupted_run(tmp_path):
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1', 'OMP_NUM_THREADS': '1',
           'TOKENIZERS_PARALLELISM': 'false', 'PYTHONPATH': str(REPO)}
    cfg = tmp_path / 'settings.json'
    cfg.write_text(json.dumps({'memory_retries': 0, 'templates': TINY_TEMPLATES}))
    ref_dir, res_dir = tmp_path / 'uninterrupted', tmp_path / 'resumed'
    t_start = time.time()
    ref = subprocess.Popen(tmas_command(ref_dir, cfg), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # its own process group, so that kill -9 also takes the grading pool's worker processes with it
    victim = subprocess.Popen(tmas_command(res_dir, cfg), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        # kill -9 once a first checkpoint exists and the cache has grown past it (an iteration is half done)
        deadline, rows_at_checkpoint = time.time() + 600, None
        while time.time() < deadline and victim.poll() is None:
            if rows_at_checkpoint is None and list((res_dir / 'checkpoints').glob('*/iter_0.json')):
                rows_at_checkpoint = cache_rows(res_dir / 'calls.sqlite')
            if rows_at_checkpoint is not None and cache_rows(res_dir / 'calls.sqlite') > rows_at_checkpoint:
                break
            time.sleep(0.2)
        assert victim.poll() is None, f'the run ended before it could be killed: {victim.stderr.read()[-2000:]}'
        t_kill = time.time()
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(30)
        assert victim.returncode == -signal.SIGKILL
        assert json.loads((res_dir / 'status.json').read_text())['complete'] is False
        assert not (res_dir / 'records.parquet').exists()
        partial = summary_json(res_dir)
        assert partial['complete'] is False

        resumed = subprocess.run(tmas_command(res_dir, cfg), env=env, capture_output=True, text=True, timeout=900)
        print(f'killed after {t_kill - t_start:.0f} s; resumed run took {time.time() - t_kill:.0f} s')
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        out, err = ref.communicate(timeout=900)
        assert ref.returncode == 0, err[-3000:]
        print(f'uninterrupted run done after {time.time() - t_start:.0f} s')
    finally:
        for p in (ref, victim):
            if p.poll() is None: p.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(victim.pid, signal.SIGKILL)

    a, b = load_run(ref_dir), load_run(res_dir)
    assert a.complete and b.complete
    assert len(a.records) == 2 * 2 * 2
    assert plain(a.records) == plain(b.records)
    assert plain(a.banks) == plain(b.banks)
    assert (b.records.finish_reason == 'length').any()          # the tiny budget really cut answers
    keys = ('calls', 'samples', 'prompt_tokens', 'completion_tokens')
    assert {r: [d[k] for k in keys] for r, d in a.usage['by_role'].items()} == \
        {r: [d[k] for k in keys] for r, d in b.usage['by_role'].items()}
    # the resumed invocation replayed calls from the cache; the uninterrupted one had none to replay
    assert b.status['last_invocation_cache']['hits'] > 0, b.status
    assert a.status['last_invocation_cache']['hits'] == 0
    assert 'hits' in resumed.stderr

    # rerunning a finished run replays every call and never loads the model
    again = subprocess.run(tmas_command(ref_dir, cfg), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    c = load_run(ref_dir)
    assert c.status['last_invocation_cache'] == {'hits': c.status['last_invocation_cache']['hits'], 'misses': 0,
                                                 'model_loaded': False}
    assert plain(c.records) == plain(a.records)

    s = subprocess.run([sys.executable, '-m', 'tmas_nb.cli', 'runs', 'summary', str(res_dir), '--json'],
                       env=env, capture_output=True, text=True, timeout=120)
    assert s.returncode == 0, s.stderr
    summary = json.loads(s.stdout)
    timeless = lambda d: {k: v for k, v in d.items() if k != 'wall_s'}    # the two runs took their own time
    assert timeless(summary) == timeless(summary_json(ref_dir))
    assert summary['complete'] is True and summary['problems'] == 2
    assert [i['candidates'] for i in summary['iterations']] == [4, 4]
    assert set(summary['tokens_by_role']) == {'solution', 'verification', 'summary', 'experience', 'guideline'}
    assert all(n > 0 for n in summary['tokens_by_role'].values())
    assert all(0.0 <= i['pass_at_1'] <= 1.0 for i in summary['iterations'])
