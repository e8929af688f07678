"""`tmas judge` on a real run folder: a tiny sampling run recorded with the packaged SmolLM2-135M, judged twice per
candidate by the same packaged model; the columns, judge.json, the Pass@1 over judge runs and a resumed judging that
costs no model call."""
import json
import os
import shutil
import sqlite3
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

ENV = {**os.environ, 'HF_HUB_OFFLINE': '1', 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false'}


def tmas(*args, timeout=1500):
    r = subprocess.run([sys.executable, '-m', 'tmas_nb.cli', *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope='module')
def judged_run(tmp_path_factory):
    d = tmp_path_factory.mktemp('judge') / 'run'
    tmas('run', '--method', 'sampling', '--benchmark', 'demo', '--model', 'smollm2', '--limit', '2', '--n-candidates', '2',
         '--max-new-tokens', '80', '--threads', '1', '--quiet', '--out', str(d))
    first = tmas('judge', str(d), '--judge', 'smollm2', '--repeats', '2', '--max-new-tokens', '6', '--threads', '1', '--quiet')
    return d, first


def test_judge_writes_columns_and_pass_at_1_over_judge_runs(judged_run):
    d, first = judged_run
    t = pq.read_table(d / 'records.parquet').to_pandas()
    assert [c for c in t.columns if c.startswith('correct_judge')] == ['correct_judge0', 'correct_judge1']
    meta = json.loads((d / 'judge.json').read_text())
    assert meta['runs'] == 2 and meta['judge'] == 'smollm2' and meta['judged_candidates'] + meta['rule_based_candidates'] == len(t)
    assert meta['judged_candidates'] >= 1     # 80 tokens: a seeded candidate of demo-01 finishes in 70 (a cut-off one has no answer to judge)
    expected = t.groupby('problem_id')[['correct_judge0', 'correct_judge1']].mean().mean().mean()
    assert meta['pass_at_1']['0'] == pytest.approx(expected)
    from tmas_nb.analysis.tables import read_run, pass_at_1_table
    long = pass_at_1_table([read_run(d)])
    assert long.pass_at_1.iloc[0] == pytest.approx(expected)
    assert long.grading.iloc[0] == 'LLM judge smollm2, mean of 2 runs'
    summary = json.loads(tmas('runs', 'summary', str(d), '--json').stdout)      # the CLI reads the judged Pass@1 too
    assert summary['iterations'][0]['pass_at_1'] == pytest.approx(expected)
    assert summary['iterations'][0]['judges'] == 2 and summary['grading'] == 'LLM judge smollm2, mean of 2 runs'
    assert 'LLM judge smollm2' in first.stdout


def test_judging_again_is_served_from_the_cache(judged_run):
    d, _ = judged_run
    before = pq.read_table(d / 'records.parquet').to_pandas()
    tmas('judge', str(d), '--judge', 'smollm2', '--repeats', '2', '--max-new-tokens', '6', '--threads', '1', '--quiet')
    meta = json.loads((d / 'judge.json').read_text())
    assert meta['cache']['misses'] == 0 and meta['cache']['hits'] == 2 * meta['judged_candidates']
    after = pq.read_table(d / 'records.parquet').to_pandas()
    assert before.correct_judge0.tolist() == after.correct_judge0.tolist()


def test_rerunning_the_finished_run_keeps_the_judge_columns(judged_run):
    d, _ = judged_run
    before = pq.read_table(d / 'records.parquet').to_pandas()
    tmas('run', '--method', 'sampling', '--benchmark', 'demo', '--model', 'smollm2', '--limit', '2', '--n-candidates', '2',
         '--max-new-tokens', '80', '--threads', '1', '--quiet', '--out', str(d))      # the same command again: nothing to do
    after = pq.read_table(d / 'records.parquet').to_pandas()
    cols = [c for c in before.columns if c.startswith('correct_judge')]
    assert cols and [c for c in after.columns if c.startswith('correct_judge')] == cols
    assert after[cols].equals(before[cols]) and after.solution.tolist() == before.solution.tolist()


def test_a_shipped_judge_cache_is_asked_again_and_a_copy_of_ones_own_is_not(judged_run, tmp_path):
    d, _ = judged_run
    judge = ('--judge', 'smollm2', '--repeats', '2', '--max-new-tokens', '6', '--threads', '1', '--quiet')
    own, shipped = tmp_path / 'own', tmp_path / 'shipped'
    shutil.copytree(d, own); shutil.copytree(d, shipped)
    tmas('judge', str(own), *judge)
    meta = json.loads((own / 'judge.json').read_text())
    n = 2 * meta['judged_candidates']
    assert (meta['cache']['hits'], meta['cache']['misses']) == (n, 0)   # one's own folder, copied: free
    with sqlite3.connect(shipped / 'judge_calls.sqlite') as con:      # every verdict rewritten to "correct"
        for key, c in con.execute('SELECT key, completion FROM completions').fetchall():
            con.execute('UPDATE completions SET completion = ? WHERE key = ?',
                        (json.dumps({**json.loads(c), 'text': 'correct', 'raw': 'correct'}), key))
    r = tmas('judge', str(shipped), *judge)
    meta = json.loads((shipped / 'judge.json').read_text())
    assert (meta['cache']['hits'], meta['cache']['misses']) == (0, n)   # asked again, not believed
    assert meta['cache']['foreign'] == n
    assert f'{n} entries not written on this machine were asked again' in r.stdout
    assert 'tmas cache trust' in r.stderr and 'not written on this machine' in r.stderr
    cols = ['correct_judge0', 'correct_judge1']
    honest = pq.read_table(own / 'records.parquet').to_pandas()[cols]
    assert pq.read_table(shipped / 'records.parquet').to_pandas()[cols].equals(honest)   # the judge's own verdicts again
