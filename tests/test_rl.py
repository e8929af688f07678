"""Hybrid RL: groups that keep the experience bonus through TRL's normalisation, `tmas rl data` from TMAS run folders
written by the project's own writer, and real GRPO steps on the packaged SmolLM2 model, killed with SIGKILL and resumed."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tmas_nb.cli import main
from tmas_nb.data import demo_problems
from tmas_nb.methods import TMASConfig, RSEConfig
from tmas_nb.rewards import experience_utilization_rewards
from tmas_nb.rl import (group_advantages, half_split_sampler, read_rows, rows_from_runs, toy_rows, training_rows,
                        last_checkpoint)
from tmas_nb.runs import start_run

from helpers import REPLIES, ScriptedLLM

REPO = Path(__file__).resolve().parents[1]


def write_run(run_dir, method='tmas', config=None):
    cfg = config or TMASConfig(n_candidates=2, n_verifications=1, iterations=2, embedder='hashing', max_new_tokens=16, seed=1)
    asyncio.run(start_run(method, demo_problems()[:2], cfg, run_dir, model='scripted', benchmark='demo',
                          llm=ScriptedLLM(REPLIES), progress=False))
    return run_dir


@pytest.fixture(scope='module')
def tmas_run(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp('runs') / 'tmas')


# ------------------------------------------------------------------ groups and normalisation

def test_each_group_holds_base_then_bank_rows_of_one_problem():
    rows = training_rows(toy_rows(5))
    idx = list(half_split_sampler(5, 4, batch_size=5, seed=3))
    assert len(idx) == 20
    for k in range(0, 20, 4):
        group = [rows[i] for i in idx[k:k + 4]]
        assert [r['half'] for r in group] == ['base', 'base', 'bank', 'bank']
        assert len({r['problem_id'] for r in group}) == 1
    assert sorted({rows[i]['problem_id'] for i in idx}) == [f'toy-{i}' for i in range(5)]


def test_groups_stay_whole_when_accelerate_shards_batches_over_processes():
    # what `accelerate launch --num_processes 2` does to the sampler's stream: each process gets every other batch of
    # per_device_train_batch_size = G rows (each process builds the sampler with the same seed)
    from torch.utils.data import BatchSampler
    from accelerate.data_loader import BatchSamplerShard
    rows, G, procs = training_rows(toy_rows(6)), 4, 2
    seen = []
    for p in range(procs):
        sampler = half_split_sampler(6, G, batch_size=procs, seed=0)
        for batch in BatchSamplerShard(BatchSampler(sampler, batch_size=G, drop_last=False), num_processes=procs, process_index=p):
            group = [rows[i] for i in batch]
            assert [r['half'] for r in group] == ['base', 'base', 'bank', 'bank']
            assert len({r['problem_id'] for r in group}) == 1
            seen.append(group[0]['problem_id'])
    assert sorted(seen) == [f'toy-{i}' for i in range(6)]


def test_experience_bonus_survives_trls_group_normalisation():
    # one problem, G = 8 laid out by the sampler: 4 base (1 correct, p_base = 1/4), 4 bank (3 correct)
    halves = [r['half'] for r in (training_rows(toy_rows(1))[i] for i in half_split_sampler(1, 8, shuffle=False))]
    correct = [True, False, False, False, True, True, True, False]
    adv = group_advantages(experience_utilization_rewards(correct, halves, beta=0.6), 8)
    plain = group_advantages([1.0 if c else -1.0 for c in correct], 8)
    assert adv[4] - adv[0] > 0.2                      # a correct bank rollout outranks a correct base rollout
    assert plain[4] == pytest.approx(plain[0])        # correctness alone cannot tell them apart
    # a bank-only group: the bonus is normalised away, {1.6, -1} gives the advantages of {1, -1}
    bank_only = [True, True, False, False]
    assert group_advantages([1.6 if c else -1.0 for c in bank_only], 4) == pytest.approx(
        group_advantages([1.0 if c else -1.0 for c in bank_only], 4), abs=1e-3)


# ------------------------------------------------------------------ tmas rl data

def test_rl_data_from_a_tmas_run(tmas_run, tmp_path, capsys):
    out = tmp_path / 'exp.parquet'
    assert main(['rl', 'data', '--runs', str(tmas_run), '--objective', 'exp_util', '--out', str(out)]) == 0
    rows = read_rows(out)
    assert [r['problem_id'] for r in rows] == [p.id for p in demo_problems()[:2]]
    assert rows[0]['gold'] == demo_problems()[0].answer
    assert 'Anchor: 6 times 7 is 42' in rows[0]['experience']
    bank = json.loads(rows[0]['prompt_bank'])[-1]['content']
    assert '6 times 7 is 42' in bank and demo_problems()[0].question in bank
    assert '6 times 7 is 42' not in rows[0]['prompt']
    nov = rows_from_runs([tmas_run], 'novelty')
    assert nov[0]['guidelines'] == ['compute the product directly']
    assert 'compute the product directly' in json.loads(nov[0]['prompt'])[-1]['content']


def test_rl_data_errors(tmas_run, tmp_path, capsys):
    def err(argv):
        assert main(['rl', 'data', '--out', str(tmp_path / 'x.parquet')] + argv) == 2
        return capsys.readouterr().err
    assert 'no config.json' in err(['--runs', str(tmp_path), '--objective', 'exp_util'])
    rse = write_run(tmp_path / 'rse', 'rse', RSEConfig(n_candidates=2, iterations=1, embedder='hashing', max_new_tokens=16))
    assert "'rse' run, not a TMAS run" in err(['--runs', str(rse), '--objective', 'exp_util'])
    plain = write_run(tmp_path / 'plain', config=TMASConfig(n_candidates=2, n_verifications=1, iterations=1, use_experience=False,
                                                            use_guidelines=False, embedder='hashing', max_new_tokens=16))
    assert 'has no experience bank' in err(['--runs', str(plain), '--objective', 'exp_util'])
    with pytest.raises(ValueError, match="objective 'speed' is unknown"):
        rows_from_runs([tmas_run], 'speed')


# ------------------------------------------------------------------ real GRPO steps, kill -9 and resume

def test_grpo_training_survives_kill_9(tmp_path, capsys):
    out = tmp_path / 'train'
    cmd = [sys.executable, '-m', 'tmas_nb.cli', 'rl', 'train', '--model', 'smollm2', '--task', 'toy', '--toy-problems', '4',
           '--reward', 'hybrid', '--max-steps', '2', '--num-generations', '4', '--max-completion-length', '6',
           '--save-steps', '1', '--seed', '0', '--threads', '1', '--out', str(out)]
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'HF_HUB_OFFLINE': '1', 'TQDM_DISABLE': '1'}
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 600
    while last_checkpoint(out) is None and p.poll() is None and time.time() < deadline: time.sleep(0.2)
    first = last_checkpoint(out)
    p.send_signal(signal.SIGKILL); p.wait()
    assert first is not None and first.name == 'checkpoint-1', p.stderr.read().decode()[-2000:]
    m1 = pd.read_csv(out / 'metrics.csv')
    assert list(m1['step']) == [1]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = pd.read_csv(out / 'metrics.csv')
    assert list(m['step']) == [1, 2]                                   # step 1 was not redone
    assert m.loc[0, 'wall_s'] == m1.loc[0, 'wall_s']
    for col in ('reward/correctness', 'reward/experience_utilization', 'loss', 'completion_length', 'clip_ratio/region_mean'):
        assert col in m.columns, list(m.columns)
    assert m['reward/correctness'].between(-1, 1).all() and m['reward/experience_utilization'].between(-1, 1.6).all()
    state = json.loads((last_checkpoint(out) / 'trainer_state.json').read_text())
    assert state['global_step'] == 2
    assert (out / 'model' / 'config.json').exists()
    # a rerun with other settings on the same folder is refused
    assert main([*cmd[3:-2], '--learning-rate', '0.5', '--out', str(out)]) == 2
    assert 'other settings (learning_rate: 1e-05 -> 0.5)' in capsys.readouterr().err
    # the report reads these metrics.csv files only
    from tmas_nb.reporting import run_report
    d = run_report('rl_training', tmp_path / 'report', dict(runs={'vanilla': str(out), 'hybrid': str(out / 'metrics.csv')}, window=1),
                   progress=False)
    s = pd.read_csv(d / 'start_vs_end.csv')
    row = s[(s.run == 'hybrid') & (s.measure == 'reward/experience_utilization')].iloc[0]
    assert row['start'] == pytest.approx(m['reward/experience_utilization'].iloc[0])
    assert row['end'] == pytest.approx(m['reward/experience_utilization'].iloc[-1])
    assert (d / 'rewards.png').exists() and (d / 'accuracy_by_half.png').exists()
