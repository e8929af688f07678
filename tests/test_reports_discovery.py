"""Smoke-run the discovery and replay-build reports with papermill on small real inputs and check what they write."""
import json
from dataclasses import replace

import pandas as pd
import pytest

from tmas_nb.autotts.discovery import DiscoveryConfig, EXAMPLE_CONTROLLER, ScriptedLLM, run_discovery, synthetic_store
from tmas_nb.autotts.authors_api import store_records
from tmas_nb.analysis.reporting import run_report


def _store_file(tmp_path, **kw):
    p = tmp_path / 'Qwen3-4B' / f"syn{kw.get('n_branches', '')}.json"; p.parent.mkdir(exist_ok=True)
    p.write_text(json.dumps(store_records(synthetic_store(**kw))))
    return p


def test_autotts_discovery_report(tmp_path):
    store = _store_file(tmp_path)
    wide = _store_file(tmp_path, n_branches=64, seed=1)      # the held-out table runs SC@64: a store with 64 branches
    # control flow only: canned proposals (a working file, then no code) in place of a model
    script = [f"```python\n{EXAMPLE_CONTROLLER}```", 'no code here']
    cfg = DiscoveryConfig(rounds=2, train=[str(store)], heldout=[str(wide)], seeds=3, betas=(0.0, 0.5, 1.0), turns=1, price_in=3, price_out=15)
    run, arm = tmp_path / 'run', tmp_path / 'no_traces'
    run_discovery(ScriptedLLM(script), cfg, run, progress=False)
    run_discovery(ScriptedLLM(script), replace(cfg, traces=False), arm, progress=False)
    # the run's own archived CSVs stand in for a published history: re-read beside its curves, they agree point for point
    d = run_report('autotts_discovery', tmp_path / 'out', dict(run_dir=str(run), ablation_dirs=[str(arm)],
                                                               authors_csv_dir=str(run / 'code_base' / 'history')), progress=False)
    s = json.loads((d / 'summary.json').read_text())
    assert s['rounds'] == 2 and s['ok_rounds'] == 1 and s['broken_rounds'] == 1 and s['selection']['round'] == 0
    assert '1 of 2 proposals did not run' in s['verdict']
    assert {(f['split'], f['round']) for f in s['figure4']} == {('search', 0), ('heldout', 0)}
    assert s['ablation_arms'] == ['full', 'no execution traces'] and s['cost']['dollars'] > 0
    ho = pd.read_csv(d / 'heldout_table.csv')
    assert {'SC@64', 'CMC β=0.5'} <= set(ho.method) and ho.method.str.startswith('selected').sum() >= 2
    ceiling = dict(zip(ho.method, ho.ceiling.astype(str)))     # each row states its controller's branch ceiling
    assert (ceiling['SC@64'], ceiling['CMC β=0.5'], ceiling['CMC β=1.0']) == ('64', '34', '64')
    # each controller of the held-out table against the strongest baseline that spends no more tokens, paired over questions
    mc = pd.read_csv(d / 'heldout_matched_cost.csv')
    assert set(mc.controller) == set(ho.method) and (mc.baseline_tokens_k <= mc.tokens_k + 1e-9).all()
    assert (mc.questions == 4).all() and (mc.p_holm >= mc.p - 1e-12).all() and len(s['matched_cost']) == len(ho)
    sel = mc[mc.controller.str.contains('selected β')].iloc[0]                      # its accuracy is the held-out table's
    assert sel.acc == pytest.approx(ho.set_index('method').loc[sel.controller, 'acc'], abs=0.01)
    [c] = s['authors_comparison']
    assert c['round'] == 0 and c['points'] == 3 and c['max_abs_acc_diff'] < 0.006 and abs(c['tokens_ratio_mean'] - 1) < 0.01
    assert (d / 'authors_comparison.png').stat().st_size > 10_000 and len(pd.read_csv(d / 'authors_comparison.csv')) == 3
    assert (d / 'discovery_rounds.png').stat().st_size > 10_000 and (d / 'figure4.png').stat().st_size > 10_000


def test_replay_build_report(tmp_path):
    store = _store_file(tmp_path)
    d = run_report('replay_build', tmp_path / 'out', dict(store_file=str(store), seeds=5), progress=False)
    s = json.loads((d / 'summary.json').read_text())
    assert s['questions'] == 4 and s['branches'] == 16 and s['controllers'] == 22
    t = pd.read_csv(d / 'controllers.csv')
    assert t.acc.between(0, 100).all() and (t.avg_tokens > 0).all()
    assert (d / 'replay_build.png').stat().st_size > 10_000
