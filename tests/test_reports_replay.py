"""Smoke-run the replay reports with papermill on tiny parameters and check what they write."""
import json

import pandas as pd
import pytest

from tmas_nb.analysis.reporting import run_report


def test_autotts_table_report(data_root, tmp_path):
    d = run_report('autotts_table', tmp_path, dict(data_dir=str(data_root), models=['Qwen3-4B', 'Qwen3-8B'],
                                                   datasets=['aime24'], seeds=100, jobs=1), progress=False)
    t = pd.read_csv(d / 'autotts_table.csv')
    assert len(t) == 12 and t.acc.between(0, 100).all() and (t.seq_tokens_k <= t.tokens_k).all()
    s = json.loads((d / 'summary.json').read_text())
    assert s['cells'] == 12 and s['matching'] == 12
    assert '| Qwen3-4B' in (d / 'autotts_table.md').read_text()
    assert (t.ci_low <= t.acc).all() and (t.acc <= t.ci_high).all()
    # every method against SC@64, paired over the 30 questions: the differences are the table's, the p-values Holm-adjusted
    p = pd.read_csv(d / 'paired_vs_sc64.csv')
    assert len(p) == 10 and (p.questions == 30).all() and (p.p_holm >= p.p - 1e-12).all() and p.p_holm.between(0, 1).all()
    acc = t.set_index(['model', 'method']).acc
    for r in p.itertuples(): assert 100 * r.diff == pytest.approx(acc[(r.model, r.method)] - acc[(r.model, 'SC@64')], abs=0.01)
    assert len(s['paired_vs_sc64']) == 10


def test_autotts_scaling_report(data_root, tmp_path):
    d = run_report('autotts_scaling', tmp_path, dict(data_dir=str(data_root), models=['Qwen3-0.6B'], datasets=['aime25'],
                                                     seeds=3, jobs=1), progress=False)
    pts = pd.read_csv(d / 'scaling_points.csv')
    assert len(pts) == 34 and pts.pareto.any()
    assert (d / 'scaling_curves.png').stat().st_size > 10_000


def test_replay_benchmark_report(data_root, tmp_path):
    d = run_report('replay_benchmark', tmp_path, dict(data_dir=str(data_root), baseline_seeds=1, seeds=2, repeats=1, jobs=1,
                                                      models=['Qwen3-4B'], datasets=['aime24']), progress=False)
    s = json.loads((d / 'summary.json').read_text())
    assert s['grid_wall_s'] > 0 and s['baseline_one_store_s'] > 0 and s['speedup_vs_baseline_estimate'] > 1
    per = pd.read_csv(d / 'per_controller.csv')
    assert len(per) == 34 and (per.speedup > 0).all()


def test_parallel_probe_table_report(data_root, tmp_path):
    "The Parallel-Probe paper's main table on all 12 stores: 178 of 180 printed cells equal ours (180 under the release's rounding)."
    d = run_report('parallel_probe_table', tmp_path, dict(data_dir=str(data_root), seeds=100, jobs=2), progress=False)
    s = json.loads((d / 'summary.json').read_text())
    assert (s['stores'], s['cells'], s['equal'], s['equal_release_rounding']) == (12, 180, 178, 180)
    assert {(r['model'], r['dataset'], r['method'], r['quantity']) for r in s['disagreements']} == {
        ('Qwen3-8B', 'aime25', 'ASC', 'seq_tokens_k'), ('Qwen3-8B', 'aime25', 'ASC', 'tokens_k')}
    t = pd.read_csv(d / 'parallel_probe_table.csv')
    assert len(t) == 180 and set(t.method) == {'SC@64', 'ASC', 'ESC', 'SAC', 'Parallel-Probe'}
    ci = t[t.quantity != 'tokens_k']
    assert (ci.ours_low <= ci.ours + 1e-9).all() and (ci.ours <= ci.ours_high + 1e-9).all()
    assert 'arXiv:2602.03845' in s['source'] and '| SAC' in (d / 'parallel_probe_table.md').read_text()


def test_parallel_probe_table_report_on_some_stores(data_root, tmp_path):
    d = run_report('parallel_probe_table', tmp_path, dict(data_dir=str(data_root), models=['Qwen3-0.6B'], datasets=['aime24'],
                                                         seeds=100, jobs=1), progress=False)
    s = json.loads((d / 'summary.json').read_text())
    assert (s['stores'], s['cells'], s['equal']) == (1, 15, 15)
