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
from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.methods.tmas import TMASConfig
from tmas_nb.methods.rse import RSEConfig
from tmas_nb.rl.rewards import experience_utilization_rewards, hybrid_rewards
from tmas_nb.rl.train import group_advantages, half_split_sampler, last_checkpoint
from tmas_nb.rl.data import read_rows, rows_from_runs, toy_rows, training_rows
from tmas_nb.runs.start import start_run
from tmas_nb.runs.folder import load_run
from tmas_nb.methods.prompts import render_solution_messages

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
    adv = group_advantages(hybrid_rewards(['exp_util'] * 8, correct, halves, [None] * 8, beta=0.6), 8)
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
    assert {r['problem_id'] for r in rows} == {p.id for p in demo_problems()[:2]}
    assert rows[0]['gold'] == demo_problems()[0].answer
    assert 'Anchor: 6 times 7 is 42' in rows[0]['experience']
    # Base: the question and the previous iteration's candidates with their summaries, as the solution agent sees them
    run = load_run(tmas_run)
    rec = run.records[(run.records.problem_id == rows[0]['problem_id']) & (run.records.iteration == 0)].sort_values('candidate')
    past = [{'solution': x.solution, 'summary': x.summary, 'score': x.mean_score} for x in rec.itertuples()]
    q = demo_problems()[0].question
    assert json.loads(rows[0]['prompt']) == render_solution_messages(q, rollouts=past)
    base = json.loads(rows[0]['prompt'])[-1]['content']
    assert 'Direct multiplication; the reviewers confirm 42.' in base and 'Six sevens make 42' in base and q in base
    assert '6 times 7 is 42' not in base
    # Bank: the same, with the experience bank
    assert json.loads(rows[0]['prompt_bank']) == render_solution_messages(q, rollouts=past, experience={
        'anchors': ['6 times 7 is 42'], 'heuristics': ['do not add 6 and 7']})
    nov = rows_from_runs([tmas_run], 'novelty')
    assert nov[0]['guidelines'] == ['compute the product directly']
    assert json.loads(nov[0]['prompt']) == render_solution_messages(q, mode='explore', guidelines=['compute the product directly'])


def test_one_mixed_file_and_the_verl_round_trip(tmas_run, tmp_path, capsys):
    ours, verl = tmp_path / 'mix.parquet', tmp_path / 'mix_verl.parquet'
    for path, fmt in ((ours, 'tmas'), (verl, 'verl')):
        assert main(['rl', 'data', '--runs', str(tmas_run), '--objective', 'all', '--mix', 'standard=2,exp_util=2,novelty=1',
                     '--format', fmt, '--out', str(path)]) == 0
    rows = read_rows(ours)
    counts = {o: sum(r['objective'] == o for r in rows) for o in ('standard', 'exp_util', 'novelty')}
    assert counts == {'standard': 2, 'exp_util': 2, 'novelty': 1}, counts
    df = pd.read_parquet(verl)
    assert list(df.columns) == ['prompt', 'data_source', 'reward_model', 'extra_info', '_source']
    assert sorted(df['_source']) == ['experience', 'experience', 'guideline', 'normal', 'normal']
    assert read_rows(verl) == rows                      # the same rows back, Bank prompts rebuilt from extra_info
    assert main(['rl', 'data', '--runs', str(tmas_run), '--objective', 'all', '--mix', 'speed=1', '--out', str(ours)]) == 2
    assert 'objective=weight' in capsys.readouterr().err


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
    for col in ('reward/hybrid', 'rows/standard', 'rows/exp_util', 'rows/novelty', 'loss', 'completion_length', 'clip_ratio/region_mean'):
        assert col in m.columns, list(m.columns)
    assert (m[['rows/standard', 'rows/exp_util', 'rows/novelty']].sum(axis=1) == 4).all()     # one group of G = 4 per step
    assert m['reward/hybrid'].between(-1, 1.6).all()
    state = json.loads((last_checkpoint(out) / 'trainer_state.json').read_text())
    assert state['global_step'] == 2
    assert (out / 'model' / 'config.json').exists()
    settings = json.loads((out / 'settings.json').read_text())
    assert settings['objectives'] == 'standard,exp_util,novelty' and settings['novelty'] == 'judge' and 'trl_notes' in settings
    # the finished run's command again: nothing trained, it says so
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and 'training finished at step 2' in r.stderr, r.stderr[-3000:]
    assert list(pd.read_csv(out / 'metrics.csv')['step']) == [1, 2]
    # a rerun with other settings on the same folder is refused
    assert main([*cmd[3:-2], '--learning-rate', '0.5', '--out', str(out)]) == 2
    assert 'other settings (learning_rate: 1e-05 -> 0.5)' in capsys.readouterr().err
    # the report reads these metrics.csv files only
    from tmas_nb.analysis.reporting import run_report
    d = run_report('rl_training', tmp_path / 'report', dict(runs={'vanilla': str(out), 'hybrid': str(out / 'metrics.csv')}, window=1),
                   progress=False)
    s = pd.read_csv(d / 'start_vs_end.csv')
    row = s[(s.run == 'hybrid') & (s.measure == 'reward/hybrid')].iloc[0]
    assert row['start'] == pytest.approx(m['reward/hybrid'].iloc[0])
    assert row['end'] == pytest.approx(m['reward/hybrid'].iloc[-1])
    assert (d / 'rewards.png').exists() and (d / 'accuracy_by_half.png').exists()


# ------------------------------------------------------------------ the teacher pipeline, the paper's settings, accelerate configs

def test_teacher_pipeline_with_the_packaged_model(tmp_path, capsys):
    # the packaged model as the teacher on one demo problem, tiny sizes: a real TMAS run, then rows from it
    out = tmp_path / 'teacher'
    argv = ['rl', 'teacher', '--model', 'smollm2', '--problems', 'demo', '--limit', '1', '--n-candidates', '2',
            '--n-verifications', '1', '--iterations', '1', '--max-new-tokens', '8', '--threads', '1', '--mix', 'standard=1',
            '--format', 'verl', '--quiet', '--out', str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    run = load_run(out / 'run')
    assert run.complete and run.config['method'] == 'tmas' and run.model == 'smollm2'
    assert list(run.records['iteration']) == [0, 0] and run.records['summary'].notna().all()
    rows = read_rows(out / 'data.parquet')
    assert [(r['problem_id'], r['gold'], r['objective']) for r in rows] == [('demo-01', demo_problems()[0].answer, 'standard')]


def test_teacher_rows_mix_every_objective(tmp_path):
    from tmas_nb.rl.data import TeacherSettings, teacher
    problems = tmp_path / 'problems.jsonl'
    problems.write_text(json.dumps({'question_id': 'a', 'question': 'What is 6 times 7?', 'answer': '42'}) + '\n')
    t = TeacherSettings(model='scripted', problems=str(problems), n_candidates=2, n_verifications=1, iterations=2,
                        max_new_tokens=16, mix='standard=1,exp_util=1,novelty=1', out=str(tmp_path / 't'))
    rows = read_rows(teacher(t, progress=False, llm=ScriptedLLM(REPLIES)))
    assert sorted(r['objective'] for r in rows) == ['exp_util', 'novelty', 'standard']
    exp = next(r for r in rows if r['objective'] == 'exp_util')
    assert 'Direct multiplication' in json.loads(exp['prompt'])[-1]['content'] and exp['question'] == 'What is 6 times 7?'


def test_paper_config_and_the_shipped_accelerate_configs(tmp_path, capsys):
    assert main(['rl', 'train', '--config', 'paper', '--task', 'x.parquet', '--out', str(tmp_path / 'p'), '--dry-run']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('tmas: error: --config paper: the paper judges') and '--judge' in err[0]
    assert main(['rl', 'train', '--config', 'paper', '--task', 'x.parquet', '--judge', 'http://127.0.0.1:9/v1', '--out', str(tmp_path / 'p'),
                 '--dry-run']) == 0
    d = json.loads(capsys.readouterr().out)
    s = d['settings']
    assert (s['model'], s['num_generations'], s['max_completion_length'], s['problems_per_step'], s['learning_rate'],
            s['max_steps'], s['epsilon'], s['epsilon_high'], s['delta'], s['entropy_coef'], s['kl_beta'], s['experience_beta']) == (
        'Qwen/Qwen3-4B-Thinking-2507', 16, 81920, 128, 1e-6, 190, 0.2, 0.255, 10.0, 0.0, 0.0, 0.6)
    # verl's train_batch_size counts prompts: 128 prompts x 16 rollouts a step, 24,320 prompts in 190 steps, ~5.5 epochs of 4.4K rows
    b = d['batch']
    assert (b['prompts_per_step'], b['rollouts_per_step'], b['prompts_seen'], b['epochs_of_paper_rows']) == (128, 2048, 24_320, 5.53)
    assert main(['rl', 'train', '--config', 'paper-rollouts-128', '--task', 'x.parquet', '--judge', 'x', '--out', str(tmp_path / 'q'),
                 '--dry-run']) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d['batch']['rollouts_per_step'], d['batch']['epochs_of_paper_rows']) == (128, 0.35) and 'rollouts per step' in d['reading']
    assert 'SGLang' in d['trl_notes']['rollouts by SGLang with FP8'] and 'GPU' in d['needs']
    from tmas_nb.rl.train import TrainSettings, grpo_config, PRESETS
    import trl
    args = grpo_config(TrainSettings(**{**PRESETS['paper'], 'bf16': False}, out=str(tmp_path / 'p')), world_size=8)
    assert (args.per_device_train_batch_size, args.num_generations, args.epsilon_high, args.delta, args.beta, args.loss_type) == (
        16, 16, 0.255, 10.0, 0.0, 'dapo'), trl.__version__
    from accelerate.commands.config.config_args import load_config_from_file
    for name, kind in (('deepspeed_zero3.yaml', 'DEEPSPEED'), ('fsdp.yaml', 'FSDP')):
        cfg = load_config_from_file(str(REPO / 'configs' / 'accelerate' / name))
        assert str(cfg.distributed_type).endswith(kind) and cfg.mixed_precision == 'bf16'
