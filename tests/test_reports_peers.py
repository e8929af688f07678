"""Smoke-run reports/peers_benchmark.ipynb (papermill) with tiny parameters: its_hub's self-consistency and its Beta
early-stopping variant against the gateway's methods on one real `tmas serve` of the packaged SmolLM2, and the gateway's
overhead against the same request sent upstream directly."""
import pandas as pd
import pytest

from tmas_nb.analysis.reporting import run_report


def test_peers_benchmark_runs_every_contender_on_one_server(tmp_path):
    pytest.importorskip('its_hub', reason="its-hub is a development dependency (pip install -e '.[dev]')")
    out = run_report('peers_benchmark', tmp_path, {'problems': 1, 'budget': 2, 'max_tokens': 12, 'probe_every': 12,
                                                  'model': 'smollm2', 'threads': 1, 'overhead_repeats': 1,
                                                  'overhead_max_tokens': 4}, progress=False)
    t = pd.read_csv(out / 'peers.csv').set_index('contender')
    assert list(t.index) == ['its_hub SelfConsistency', 'its_hub BetaSelfConsistency', 'gateway mv', 'gateway controller:cmc',
                             'gateway controller:asc']
    assert (t.real_tokens_per_question > 0).all() and (t.calls_per_question >= 1).all()
    assert t.loc['its_hub SelfConsistency', 'samples_per_question'] == 2 and t.loc['gateway mv', 'samples_per_question'] == 2
    assert t.accuracy.between(0, 1).all() and (t.client_cpu_ms_per_call > 0).all()
    assert (t.accuracy_lo <= t.accuracy).all() and (t.accuracy <= t.accuracy_hi).all()
    o = pd.read_csv(out / 'overhead.csv')
    assert len(o) == 1 and (o['directly (s)'] > 0).all()        # the same work through the gateway and directly (asserted inside)
    assert {'peers.png', 'goal.csv'} <= {p.name for p in out.iterdir()}
