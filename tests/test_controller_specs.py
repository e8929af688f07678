"""Built-in controller parameters: type and range checked where a controller is built, counts checked against the store."""
import math

import numpy as np
import pytest

from tmas_nb.autotts.controllers import parse_controller, SelfConsistency, ASC, ESC, ParallelProbe, CMC, SAC
from tmas_nb.autotts.fast import run_fast
from tmas_nb.autotts.evaluation import evaluate, trace_episodes
from tmas_nb.cli import main

from helpers import toy_store

# (spec, controller name, parameter, value as the message shows it, the range as the message words it)
BAD_SPECS = [
    ('sc:k=-1', 'sc', 'k', '-1', '>= 1'),
    ('sc:k=0', 'sc', 'k', '0', '>= 1'),
    ('cmc:beta=nan', 'cmc', 'beta', 'nan', '[0, 1]'),
    ('cmc:beta=-1', 'cmc', 'beta', '-1', '[0, 1]'),
    ('cmc:beta=1e308', 'cmc', 'beta', '1e+308', '[0, 1]'),
    ('cmc:beta=inf', 'cmc', 'beta', 'inf', '[0, 1]'),
    ('asc:max_samples=8,threshold=2', 'asc', 'threshold', '2', '[0, 1]'),
    ('asc:threshold=-0.1', 'asc', 'threshold', '-0.1', '[0, 1]'),
    ('asc:max_samples=0', 'asc', 'max_samples', '0', '>= 1'),
    ('esc:window=0', 'esc', 'window', '0', '>= 1'),
    ('esc:max_samples=0', 'esc', 'max_samples', '0', '>= 1'),
    ('esc:max_samples=8,window=16', 'esc', 'window', '16', 'max_samples=8'),
    ('pp:num_chains=0', 'pp', 'num_chains', '0', '>= 1'),
    ('pp:T=0', 'pp', 'T', '0', '>= 1'),
    ('pp:prune_patience=0', 'pp', 'prune_patience', '0', '>= 1'),
    ('pp:warm_up=-1', 'pp', 'warm_up', '-1', '>= 0'),
    ('pp:max_steps=0', 'pp', 'max_steps', '0', '>= 1'),
    ('sac:n=0', 'sac', 'n', '0', '>= 1'),
    ('sac:streak=-2', 'sac', 'streak', '-2', '>= 1'),
]


@pytest.mark.parametrize('spec,name,param,value,valid', BAD_SPECS)
def test_out_of_range_specs_are_refused_in_one_line(spec, name, param, value, valid):
    with pytest.raises(ValueError) as e:
        parse_controller(spec)
    msg = str(e.value)
    assert '\n' not in msg
    assert f'controller {name}:' in msg and f'{param}={value}' in msg and valid in msg, msg


@pytest.mark.parametrize('build,needle', [
    (lambda: SelfConsistency(k=0), 'k=0'),
    (lambda: SelfConsistency(k=True), 'k=True'),
    (lambda: SelfConsistency(k=2.5), 'an integer'),
    (lambda: ASC(threshold=2.0), 'threshold=2.0'),
    (lambda: ESC(64, 0), 'window=0'),
    (lambda: ParallelProbe(num_chains=0), 'num_chains=0'),
    (lambda: CMC(beta=float('nan')), 'beta=nan'),
    (lambda: CMC(beta='0.5'), "beta='0.5'"),
])
def test_python_api_refuses_at_construction(build, needle):
    with pytest.raises(ValueError, match='must be') as e:
        build()
    assert needle in str(e.value)


def test_edges_of_every_range_are_accepted():
    for spec in ['sc:k=1', 'asc:max_samples=1,threshold=0', 'asc:threshold=1', 'esc:max_samples=8,window=8',
                 'pp:num_chains=1,T=1,prune_patience=1,warm_up=0,max_steps=1', 'cmc:beta=0', 'cmc:beta=1']:
        parse_controller(spec)
    c = CMC(np.float64(1))
    assert type(c.beta) is float and c.describe() == 'cmc:beta=1.0'
    assert type(SelfConsistency(np.int64(3)).k) is int


def test_count_above_the_store_branches_is_refused_not_clamped():
    st = toy_store(n_questions=2)                                   # two branches per question
    assert evaluate('sc:k=2', st, range(2)).avg_tokens == 2000       # all of both branches
    for c in [SelfConsistency(3), ASC(5), ESC(8, 4), ParallelProbe(3), SAC(3)]:
        for run in (lambda: evaluate(c, st, range(2)), lambda: run_fast(c, st, range(2)),
                    lambda: trace_episodes(c, st, range(1))):
            with pytest.raises(ValueError, match='2 branches per question') as e:
                run()
            assert f'controller {c.name}:' in str(e.value) and 'toy' in str(e.value)


def test_changed_parameter_is_checked_again_before_evaluation():
    c = SelfConsistency(2)
    c.k = 0
    with pytest.raises(ValueError, match='k=0'):
        run_fast(c, toy_store(), range(1))


def _eval(data_root, spec):
    return main(['replay', 'eval', '--data-dir', str(data_root), '--model', 'Qwen3-4B', '--benchmark', 'aime24',
                 '--controller', spec, '--seeds', '1', '--json'])


@pytest.mark.parametrize('spec,needle', [
    ('sc:k=-1', 'k=-1'), ('sc:k=0', 'k=0'), ('cmc:beta=nan', 'beta=nan'), ('asc:max_samples=8,threshold=2', 'threshold=2'),
    ('pp:num_chains=0', 'num_chains=0'), ('esc:window=0', 'window=0'),
    ('sc:k=100000', 'more than the 128 branches per question of store Qwen3-4B/aime24'),
])
def test_cli_refuses_bad_specs_with_exit_2(data_root, capsys, spec, needle):
    assert _eval(data_root, spec) == 2
    cap = capsys.readouterr()
    assert cap.out == '' and len(cap.err.strip().splitlines()) == 1
    assert cap.err.startswith('tmas: error: --controller: ') and needle in cap.err, cap.err


def test_cli_grid_refuses_bad_spec(data_root, tmp_path, capsys):
    out = tmp_path / 'g.csv'
    assert main(['replay', 'grid', '--data-dir', str(data_root), '--out', str(out), '--jobs', '1', '--seeds', '1',
                 '--models', 'Qwen3-8B', '--benchmarks', 'aime25', '--controllers', 'sc:k=4;cmc:beta=2']) == 2
    assert 'beta=2' in capsys.readouterr().err and not out.exists()
