"""The AutoTTS replay environment: exact reproduction of the paper's table, the authors' outputs, errors and CLI."""
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from tmas_nb.autotts.store import load_store, load_store_file, ReplayStore, ReplayStoreError, MODELS, DATASETS
from tmas_nb.autotts.environment import ReplayEnv, IllegalAction
from tmas_nb.autotts.controllers import parse_controller, CMC, ParallelProbe, ASC, ESC, SelfConsistency
from tmas_nb.autotts.fast import check_against_reference
from tmas_nb.autotts.evaluation import (
    evaluate, run_grid, table_controllers, PAPER_AIME24, load_reference, canonical_spec, standard_grid)
from tmas_nb.cli import main

from helpers import toy_store as _toy

# The one AIME24 cell of the paper that the released stores do not give: the paper prints 68.1 % at 748.5k tokens,
# the authors' own released outputs (autotts_reference/) say 66.03 % at 745,425 tokens, and so do we.
KNOWN_UNREPRODUCIBLE = {('Qwen3-1.7B', 'Parallel-Probe'): (66.0, 745.4)}


@pytest.fixture(scope='module')
def aime24_table(data_root):
    specs = sorted({canonical_spec(s) for m in MODELS for s in table_controllers(m).values()})
    return run_grid(data_root, MODELS, ['aime24'], specs, range(100), jobs=2, progress=False)


@pytest.mark.parametrize('model', MODELS)
def test_paper_table_aime24(aime24_table, model):
    for col, spec in table_controllers(model).items():
        r = aime24_table[(aime24_table.model == model) & (aime24_table.spec == canonical_spec(spec))].iloc[0]
        acc, tok = PAPER_AIME24[model][col]
        got = (round(r.acc, 1), round(r.avg_tokens / 1000, 1))
        if (model, col) in KNOWN_UNREPRODUCIBLE:
            assert got == KNOWN_UNREPRODUCIBLE[model, col] and got != (acc, tok), got
            continue
        assert got == (acc, tok), f"{model} {col}: ours {got} vs paper {(acc, tok)}"


def test_matches_authors_outputs_every_configuration(data_root):
    """Every configuration in the authors' AIME24 output files, to their printed precision."""
    ref = load_reference(data_root)
    assert len(ref) >= 60
    for model, g in ref.groupby('model'):
        st = load_store(model, 'aime24', data_root)
        for r in g.itertuples():
            res = evaluate(r.spec, st, range(100), n_boot=10)
            assert round(res.acc, 2) == pytest.approx(r.acc, abs=1e-9), (model, r.spec, res.acc, r.acc)
            assert round(res.avg_tokens) == pytest.approx(round(r.avg_tokens), abs=1), (model, r.spec, res.avg_tokens, r.avg_tokens)


@pytest.mark.parametrize('spec', ['sc:k=8', 'asc:max_samples=16', 'esc:max_samples=32', 'pp:num_chains=32', 'cmc:beta=0.0', 'cmc:beta=0.7'])
def test_compiled_equals_reference_on_heldout(data_root, spec):
    for model, dataset in [('Qwen3-0.6B', 'aime25'), ('Qwen3-1.7B', 'hmmt25')]:
        assert check_against_reference(parse_controller(spec), load_store(model, dataset, data_root), seeds=[3, 42]) == 60


def test_bootstrap_interval_brackets_accuracy(data_root):
    r = evaluate('cmc:beta=0.5', load_store('Qwen3-8B', 'aime24', data_root))
    assert r.ci_low < r.acc < r.ci_high
    assert 5 < r.ci_high - r.ci_low < 40
    assert len(r.per_question_acc) == 30


def test_grid_covers_standard_configurations(data_root):
    df = run_grid(data_root, ['Qwen3-0.6B'], ['hmmt25'], seeds=range(3), jobs=1, progress=False)
    assert len(df) == len(standard_grid()) == 34
    assert df.acc.between(0, 100).all() and (df.avg_tokens > 0).all()
    # more samples never cost fewer tokens for SC
    sc = df[df.spec.str.startswith('sc:')].avg_tokens.to_numpy()
    assert (np.diff(sc) > 0).all()


# ---- environment rules ----------------------------------------------------------------------------------

def test_illegal_actions_cost_nothing():
    env = ReplayEnv(_toy(), 0, seed=None)
    env.branch(); env.advance(0); env.advance(0)
    assert env.tokens_read == [1800]
    for bad in (lambda: env.advance(0), lambda: env.advance(1), lambda: env.probe(5)):
        with pytest.raises(IllegalAction):
            bad()
    assert env.cost == 1800
    env.branch(); env.prune(1)
    with pytest.raises(IllegalAction, match='pruned'):
        env.probe(1)
    assert env.cost == 2000


def test_probe_cost_counts_revealed_probes():
    env = ReplayEnv(_toy(), 0, seed=None, probe_cost=7)
    env.branch(); env.probe(0); env.probe(0)
    assert env.cost == 500 + 14 and len(env.state()['Omega']) == 2


# ---- bad store files -------------------------------------------------------------------------------------

GOOD = {'question': 'q', 'gold_answer': '1', 'probe_freq': 500, 'final_answers_trace': ['1'],
        'each_branch': [[['1'], 900, '1']]}


@pytest.mark.parametrize('content,needle', [
    ('[{"question": "q",', 'not valid JSON'),
    ([GOOD, {**GOOD, 'each_branch': []}], "question 1, field 'each_branch'"),
    ([{k: v for k, v in GOOD.items() if k != 'probe_freq'}], "question 0, field 'probe_freq'"),
    ([{**GOOD, 'gold_answer': 5}], "field 'gold_answer'"),
    ([{**GOOD, 'each_branch': [[['1'], 900]]}], "field 'each_branch[0]'"),
    ([{**GOOD, 'each_branch': [[[1], 900, '1']]}], "each_branch[0][0]"),
    ({'question': 'q'}, 'JSON list'),
])
def test_bad_store_files_name_file_question_and_field(tmp_path, content, needle):
    p = tmp_path / 'm' / 'bad.json'
    p.parent.mkdir()
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ReplayStoreError) as e:
        load_store_file(p)
    assert needle in str(e.value) and str(p) in str(e.value)


# ---- CLI -------------------------------------------------------------------------------------------------

def test_cli_eval_json_contract(data_root):
    out = subprocess.run([sys.executable, '-m', 'tmas_nb.cli', 'replay', 'eval', '--data-dir', str(data_root),
                          '--model', 'Qwen3-4B', '--benchmark', 'aime24', '--controller', 'cmc:beta=0.5', '--json'],
                         capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    assert round(d['acc'], 2) == 81.97 and round(d['avg_tokens']) == 236735
    assert d['ci_low'] < d['acc'] < d['ci_high']


@pytest.mark.parametrize('args,needle', [
    (['--controller', 'mcts:depth=2'], 'known controllers: sc'),
    (['--controller', 'cmc:gamma=2'], "no parameter 'gamma'"),
    (['--controller', 'sc:k=abc'], 'k must be int'),
    (['--controller', 'sc:k=4', '--model', 'Qwen9-1B'], 'Available: Qwen3-0.6B/aime24'),
    (['--controller', 'sc:k=4', '--seeds', '0'], '--seeds must be >= 1'),
])
def test_cli_bad_arguments_are_clear_errors(data_root, capsys, args, needle):
    base = {'--model': 'Qwen3-4B', '--benchmark': 'aime24'}
    argv = ['replay', 'eval', '--data-dir', str(data_root)]
    for k, v in base.items():
        if k not in args:
            argv += [k, v]
    assert main(argv + args) == 2
    assert needle in capsys.readouterr().err


def test_cli_grid_writes_file(data_root, tmp_path):
    out = tmp_path / 'g.csv'
    assert main(['replay', 'grid', '--data-dir', str(data_root), '--out', str(out), '--jobs', '1', '--seeds', '2',
                 '--models', 'Qwen3-8B', '--benchmarks', 'aime25', '--controllers', 'sc:k=4;cmc:beta=0.5']) == 0
    df = pd.read_csv(out)
    assert list(df.spec) == ['sc:k=4', 'cmc:beta=0.5'] and df.seeds.tolist() == [2, 2]


@pytest.mark.parametrize('cmd', [[], ['replay'], ['replay', 'eval'], ['replay', 'grid'], ['report']])
def test_every_subcommand_has_help(cmd):
    out = subprocess.run([sys.executable, '-m', 'tmas_nb.cli', *cmd, '--help'], capture_output=True, text=True)
    assert out.returncode == 0 and 'usage: tmas' in out.stdout


def test_trace_is_columnar_and_small(data_root, tmp_path):
    out = tmp_path / 't.parquet'
    assert main(['replay', 'eval', '--data-dir', str(data_root), '--model', 'Qwen3-4B', '--benchmark', 'aime24',
                 '--controller', 'pp:num_chains=64', '--seeds', '1', '--trace', str(out), '--json']) == 0
    df = pd.read_parquet(out)
    assert (df.action == 'ANSWER').sum() == 30 and len(df) > 10000
    assert out.stat().st_size < 2_000_000


def _eval_argv(data_root, *extra):
    return ['replay', 'eval', '--data-dir', str(data_root), '--model', 'Qwen3-4B', '--benchmark', 'aime24',
            '--controller', 'sc:k=4', '--seeds', '2', '--json', *extra]


@pytest.mark.parametrize('n', ['0', '-3'])
def test_trace_seeds_below_one_is_refused_and_nothing_written(data_root, tmp_path, capsys, n):
    out = tmp_path / 't.parquet'
    assert main(_eval_argv(data_root, '--trace', str(out), '--trace-seeds', n)) == 2
    cap = capsys.readouterr()
    assert f'--trace-seeds must be >= 1, got {n}' in cap.err and len(cap.err.strip().splitlines()) == 1
    assert cap.out == '' and not out.exists()


def test_trace_seeds_above_seeds_is_refused(data_root, tmp_path, capsys):
    out = tmp_path / 't.csv'
    assert main(_eval_argv(data_root, '--trace', str(out), '--trace-seeds', '5')) == 2
    assert '--trace-seeds 5 is more than --seeds 2' in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize('name', ['x.txt', 'trace', 'x.parquet.gz'])
def test_trace_file_must_be_parquet_or_csv(data_root, tmp_path, capsys, name):
    out = tmp_path / name
    assert main(_eval_argv(data_root, '--trace', str(out))) == 2
    err = capsys.readouterr().err
    assert '--trace' in err and 'must end in .parquet or .csv' in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_trace_csv_holds_the_traced_seeds(data_root, tmp_path):
    out = tmp_path / 't.csv'
    assert main(_eval_argv(data_root, '--trace', str(out), '--trace-seeds', '2')) == 0
    df = pd.read_csv(out)
    assert sorted(df.seed.unique()) == [0, 1] and (df.action == 'ANSWER').sum() == 60


def test_grid_out_must_be_parquet_or_csv(data_root, tmp_path, capsys):
    out = tmp_path / 'g.txt'
    assert main(['replay', 'grid', '--data-dir', str(data_root), '--out', str(out), '--jobs', '1', '--seeds', '1',
                 '--models', 'Qwen3-8B', '--benchmarks', 'aime25', '--controllers', 'sc:k=4']) == 2
    assert '--out' in capsys.readouterr().err and not out.exists()
