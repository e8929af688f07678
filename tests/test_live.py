"""Controllers live: the replay environment's actions on a real model (SmolLM2-135M, packaged), checked against replay of
the store `build_store` writes with the same settings and seeds; controller files in the sandbox; `tmas run --method
controller` with its run folder, resume after kill -9 and summary."""
import asyncio, json, os, signal, subprocess, sys, time

import pytest

from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.autotts.authors_api import AuthorsQuestion, example_controller, install_authors_shims, store_records
from tmas_nb.autotts.build import BuildSettings, build_store
from tmas_nb.autotts.controllers import parse_controller
from tmas_nb.autotts.environment import ReplayEnv
from tmas_nb.autotts.live import LiveAuthorsQuestion, LiveEnv, LiveModel
from tmas_nb.autotts.live_files import SandboxedController
from tmas_nb.autotts.live_run import ControllerConfig, open_controller
from tmas_nb.autotts.files import ControllerError

S = BuildSettings(branches=4, probe_every=8, max_new_tokens=16, seed=1)
SPECS = ['sc:k=4', 'esc:max_samples=4,window=2', 'pp:num_chains=4,warm_up=1,prune_patience=1,T=2', 'cmc:beta=0.5']
# ASC reads whole branches like SC and ESC (the same decode path); CMC at beta=1 runs in the split/lookahead pass below


@pytest.fixture(scope='module')
def smol():
    import torch
    torch.set_num_threads(1)
    from tmas_nb.llm.models import load_model_and_tokenizer
    return load_model_and_tokenizer('smollm2', device='cpu')


@pytest.fixture(scope='module')
def built(smol, tmp_path_factory):
    probs = demo_problems()[2:3]
    st = build_store(smol, probs, out=tmp_path_factory.mktemp('live') / 's.json', settings=S, progress=False)
    return st, probs, LiveModel(smol, S)


def live_env(lm, probs, width=4, lookahead=1):
    return LiveEnv(question=0, live=lm, text=probs[0].question, width=width, lookahead=lookahead)


@pytest.mark.parametrize('width,lookahead,specs', [(4, 1, SPECS), (2, 2, ['cmc:beta=1'])])
def test_live_equals_replay_of_the_built_store(built, width, lookahead, specs):
    st, probs, lm = built
    for spec in specs:
        rep = ReplayEnv(st, 0, seed=None, record=True)
        a_rep = parse_controller(spec).run(rep)
        env = live_env(lm, probs, width, lookahead)
        env.record = True
        a_liv = parse_controller(spec).run(env)
        assert (a_liv, env.cost, env.depth, env.pruned) == (a_rep, rep.cost, rep.depth, rep.pruned), spec
        assert [(s.action, s.branch, s.answer, s.cost) for s in env.trace] == [(s.action, s.branch, s.answer, s.cost) for s in rep.trace], spec
        u = env.usage()
        assert u['tokens_generated'] >= u['tokens_charged'] == rep.cost
        if spec.startswith(('pp', 'cmc')): assert u['probe_tokens'] > 0 and u['probe_calls'] > 0


def test_advancing_branches_is_one_batched_step(built):
    st, probs, lm = built
    env = live_env(lm, probs, width=4)
    for _ in range(4): env.read_whole_id()
    # one batch of four: at most L/T decode stretches and no probe on the way, not four sequential decodes
    assert env.decode_calls <= S.max_new_tokens // S.probe_every and env.probe_calls <= 1
    one = live_env(lm, probs, width=1)
    for _ in range(4): one.read_whole_id()
    assert one.decode_calls > env.decode_calls and one.cost == env.cost and one.gen == env.gen
    other = LiveModel((lm.model, lm.tok), BuildSettings(**{**S.to_dict(), 'seed': 2}))    # another run seed, other branches
    b = live_env(other, probs, width=4)
    for _ in range(4): b.read_whole_id()
    assert b.gen != env.gen


def test_authors_api_live_equals_replay(built):
    st, probs, lm = built
    install_authors_shims()
    rec = store_records(st)[0]
    for name, cfg in [('authors_sc', {'k': 4}), ('authors_cmc', {'beta': 0.5})]:
        cls_name, code = example_controller(name)
        ns = {}; exec(code, ns)
        q_rep = AuthorsQuestion(rec, 0); q_rep._branches = list(rec['each_branch'])   # the stored order, which live opens in
        a_rep = ns[cls_name](config=cfg).solve(q_rep)
        q_liv = LiveAuthorsQuestion(live_env(lm, probs))
        a_liv = ns[cls_name](config=cfg).solve(q_liv)
        assert (a_liv, q_liv.tokens_charged, q_liv.get_cost_per_branch_active()) == (a_rep, q_rep.tokens_charged, q_rep.get_cost_per_branch_active()), name


def test_sandboxed_files_live(built, tmp_path):
    st, probs, lm = built
    ref = live_env(lm, probs); a_ref = parse_controller('cmc:beta=0.5').run(ref)
    for name, cfg in [('ours_cmc', {'beta': 0.5}), ('authors_cmc', {'beta': 0.5})]:
        cls_name, code = example_controller(name)
        (tmp_path / f'{name}.py').write_text(code)
        with SandboxedController(tmp_path / f'{name}.py', cls_name, cfg) as ctl:
            env = live_env(lm, probs)
            assert (ctl.run(env), env.cost) == (a_ref, ref.cost), name
            assert ctl.mode != 'none'
    spy = ("import os, socket\nclass Spy:\n    def run(self, env):\n"
           "        try: socket.create_connection(('1.1.1.1', 80), timeout=2); net = 'open'\n"
           "        except OSError: net = 'closed'\n"
           "        if env.question == 1: return env.live.model\n"
           "        i, a, f = env.branch()\n"
           "        return '|'.join([net, str(sorted(os.environ)), str(hasattr(env, 'live')), str(a is None or isinstance(a, str))])\n")
    (tmp_path / 'spy.py').write_text(spy)
    with SandboxedController(tmp_path / 'spy.py', 'Spy') as ctl:
        net, env_vars, has_live, ok = ctl.run(live_env(lm, probs)).split('|')
        with pytest.raises(ControllerError, match="spy.py: AttributeError.*'EnvProxy' object has no attribute 'live'"):
            e = live_env(lm, probs); e.question = 1; ctl.run(e)    # the same child, next question: reaching for the model fails
    assert (net, has_live, ok) == ('closed', 'False', 'True')
    assert 'TMAS_DATA_DIR' not in env_vars


def test_discovery_folder_names_its_selected_controller(tmp_path):
    cls_name, code = example_controller('authors_cmc')
    (tmp_path / 'round_000').mkdir()
    (tmp_path / 'round_000' / 'controller.py').write_text(code.replace(f'class {cls_name}', 'class DiscoveredController'))
    (tmp_path / 'rounds.jsonl').write_text(json.dumps({'round': 0, 'status': 'ok', 'score': 0.1}) + '\n')
    ctl, desc = open_controller(ControllerConfig(controller=f'discovery:{tmp_path}'))
    assert (ctl.config, ctl.class_name) == ({'beta': 0.5}, 'DiscoveredController') and 'no selection.json' in desc['chosen_by']
    (tmp_path / 'selection.json').write_text(json.dumps({'round': 0, 'beta': 1.0, 'acc': 0.0, 'avg_tokens': 0.0}))
    ctl, desc = open_controller(ControllerConfig(controller=f'discovery:{tmp_path}'))
    assert ctl.config == {'beta': 1.0} and desc['chosen_by'] == 'selection.json (round 0, beta 1.0)'
    with pytest.raises(FileNotFoundError, match='neither selection.json nor rounds.jsonl'):
        open_controller(ControllerConfig(controller=f'discovery:{tmp_path / "round_000"}'))


def tmas(*args, **kw):
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    return subprocess.Popen([sys.executable, '-m', 'tmas_nb.cli', *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def test_run_method_controller_resumes_after_kill(tmp_path):
    out = tmp_path / 'run'
    args = ['run', '--method', 'controller', '--controller', 'sc:k=2', '--branches', '2', '--probe-every', '8',
            '--max-new-tokens', '16', '--benchmark', 'demo', '--limit', '2', '--model', 'smollm2', '--backend', 'transformers',
            '--threads', '1', '--concurrency', '1', '--out', str(out), '--quiet']
    p = tmas(*args)
    first = out / 'checkpoints'
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None and not any(first.glob('*/iter_0.json')): time.sleep(0.05)
    if p.poll() is None: os.killpg(p.pid, signal.SIGKILL)       # kill -9 of the run and of any worker it started
    p.wait()
    done = sorted(first.glob('*/iter_0.json'))
    assert done, p.stderr.read()
    stamps = {f: f.stat().st_mtime_ns for f in done}
    p = tmas(*args); _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert all(f.stat().st_mtime_ns == t for f, t in stamps.items())       # a question done before the kill is not redone
    from tmas_nb.runs.folder import load_run
    s = load_run(out).summary()                      # what `tmas runs summary` prints
    assert (s['problems'], s['complete']) == (2, True) and set(s['tokens_by_role']) == {'branch', 'probe'}
    import pandas as pd
    df = pd.read_parquet(out / 'records.parquet')
    for r in df.itertuples():
        u = json.loads(r.summary)
        assert u['controller'] == 'sc:k=2' and u['branches_opened'] == 2 and r.completion_tokens == u['tokens_generated'] + u['probe_tokens']
        assert r.wall_s > 0


@pytest.mark.slow
def test_live_controllers_report(tmp_path):
    """The report end to end on SmolLM2 with tiny sizes (minutes on a busy CPU: run with --runslow)."""
    from tmas_nb.analysis.reporting import run_report
    d = run_report('live_controllers', tmp_path, dict(model='smollm2', problems=1, branches=2, probe_every=8, max_new_tokens=16,
                                                     repeats=1, threads=1), progress=False)
    s = json.loads((d / 'summary.json').read_text())
    assert s['agreement'] == 100.0 and 0 < s['control_overhead'] < 10
    assert (d / 'live_controllers.png').stat().st_size > 10_000
