"""Sequential tokens (latency) in the replay environment: the schedules, the compiled kernels against the reference
path, the Parallel-Probe paper's figures on one store, and the records and command line that carry them."""
import json
import subprocess
import sys

import pytest

from tmas_nb.autotts.store import load_store, ReplayStore
from tmas_nb.autotts.environment import ReplayEnv, seq_tokens, check_schedule
from tmas_nb.autotts.controllers import Controller, SelfConsistency, ASC, ESC, ParallelProbe, CMC
from tmas_nb.autotts.fast import check_against_reference
from tmas_nb.autotts.evaluation import evaluate, run_grid

TOY = {'question': 'q0', 'gold_answer': '7', 'probe_freq': 500, 'final_answers_trace': [],
       'each_branch': [[['7', '7'], 1200, '7'], [['3'], 900, '7'], [[], 300, '3'], [['7', '3', '3'], 1700, '3']]}


def test_schedule_rules():
    t = [1200, 900, 300, 1700]
    assert [seq_tokens(s, t) for s in ('parallel', 'sequential', ('windows', 2), ('windows', 3))] == [1700, 4100, 2900, 2900]
    assert seq_tokens(None, t, [0, 0, 900, 900]) == 2600
    with pytest.raises(ValueError, match='schedule'): check_schedule('fast')


def test_derived_schedule_of_a_file_style_controller():
    "A controller without a schedule: reads in the derived order (a branch starts when the newest answer seen arrived)."
    class TwoThenOne(Controller):
        name = 'two'
        def params(self): return {}
        def run(self, env):
            env.read_whole_id(); env.read_whole_id(); return '7'
    st = ReplayStore.from_records([TOY], name='toy')
    r = evaluate(TwoThenOne(), st, seeds=[0])
    o = st.orders([0])[0, 0]
    assert r.seq_rule == 'derived' and r.avg_seq_tokens == r.avg_tokens == st.tokens[0, o[0]] + st.tokens[0, o[1]]


@pytest.mark.parametrize('ctrl', [SelfConsistency(64), ASC(64), ESC(64, 8), ParallelProbe(64), CMC(0.5), CMC(1.0)],
                         ids=lambda c: c.describe())
def test_kernels_match_reference_sequential_tokens(data_root, ctrl):
    assert check_against_reference(ctrl, load_store('Qwen3-1.7B', 'aime25', data_root), seeds=[0, 5]) == 60


# The Parallel-Probe paper's main table, Qwen3-0.6B on AIME24 (evaluation/table.tex of zhengkid/Parallel-Probe):
# (accuracy %, sequential tokens k, tokens k)
PUBLISHED_06B_AIME24 = {'sc:k=64': (21.4, 32.7, 1008.6), 'asc:max_samples=64,threshold=0.95': (21.4, 805.5, 805.5),
                        'esc:max_samples=64,window=8': (21.4, 192.9, 986.7), 'pp:num_chains=64': (21.8, 20.8, 773.8)}


def test_published_sequential_tokens(data_root):
    st = load_store('Qwen3-0.6B', 'aime24', data_root)
    for spec, want in PUBLISHED_06B_AIME24.items():
        r = evaluate(spec, st)
        assert (round(r.acc, 1), round(r.avg_seq_tokens / 1000, 1), round(r.avg_tokens / 1000, 1)) == want, spec
        assert r.seq_ci_low <= r.avg_seq_tokens <= r.seq_ci_high


def test_grid_and_cli_carry_sequential_tokens(data_root):
    g = run_grid(data_root, ['Qwen3-0.6B'], ['aime24'], ['sc:k=64', 'asc:max_samples=64'], jobs=1, progress=False)
    assert g.seq_rule.tolist() == ['parallel', 'sequential']
    assert (g.avg_seq_tokens.round(-2) == [32700, 805500]).all() and (g.seq_ci_low <= g.avg_seq_tokens).all()
    out = subprocess.run([sys.executable, '-m', 'tmas_nb.cli', 'replay', 'eval', '--data-dir', str(data_root), '--model',
                          'Qwen3-0.6B', '--benchmark', 'aime24', '--controller', 'esc:max_samples=64,window=8', '--json'],
                         capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    assert d['seq_rule'] == 'windows:8' and round(d['avg_seq_tokens'] / 1000, 1) == 192.9
    assert d['seq_ci_low'] < d['avg_seq_tokens'] < d['seq_ci_high']
