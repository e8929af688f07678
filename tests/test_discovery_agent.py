"""`tmas discover --agent-cmd`: a scripted coding agent in its sandboxed workspace (bubblewrap, network shared, only the
workspace writable). The agent walks the workspace, the home folder, the data folder and the repository, looking for
the held-out store; it runs the workspace's evaluation command and edits code_base/method.py."""
import json
import os
import shlex
import sys
from pathlib import Path

import pandas as pd
import pytest

from tmas_nb.discovery import DiscoveryConfig, EXAMPLE_CONTROLLER, run_discovery, synthetic_store
from tmas_nb.replay.authors_api import store_records
from tmas_nb.sandbox import python_paths, sandbox_mode

REPO = Path(__file__).resolve().parent.parent

AGENT = r'''
import json, os, subprocess, sys
from pathlib import Path
ws = Path(os.environ['TMAS_WORKSPACE']); marker = sys.argv[1]; places = sys.argv[2:]
found, unreadable, seen = [], [], 0
for root in [str(ws), os.path.expanduser('~'), *places]:
    for dirpath, dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f); seen += 1
            try:
                with open(p, 'rb') as fh: data = fh.read(4 << 20)
            except OSError: unreadable.append(p); continue
            if marker.encode() in data: found.append(p)
visible = {p: sorted(os.listdir(p)) if os.path.isdir(p) else None for p in places}
ev = subprocess.run(os.environ['TMAS_EVAL_CMD'].split() + ['--beta', '1.0', '--seeds', '1'], capture_output=True, text=True, cwd=ws)
m = ws / 'code_base' / 'method.py'
m.write_text(m.read_text().replace('self.beta * 15', 'self.beta * 7'))
# what the claude CLI's --output-format json prints about its run, where the environment tells the agent to leave it
Path(os.environ['TMAS_USAGE_FILE']).write_text(json.dumps({'type': 'result', 'total_cost_usd': 0.0123, 'usage': {
    'input_tokens': 1200, 'cache_creation_input_tokens': 300, 'cache_read_input_tokens': 500, 'output_tokens': 450}}))
(ws / 'report.json').write_text(json.dumps(dict(found=found, seen=seen, visible=visible, round=os.environ['TMAS_ROUND'],
                                                eval=ev.stdout, eval_err=ev.stderr[-2000:], home=os.path.expanduser('~'))))
print('agent done', seen)
'''


@pytest.mark.skipif(sandbox_mode() != 'bwrap', reason='the agent sandbox needs bubblewrap')
def test_scripted_agent_cannot_reach_heldout_and_edits_method(tmp_path):
    data = tmp_path / 'data' / 'autotts_replay' / 'Qwen3-4B'; data.mkdir(parents=True)
    (data / 'syn.json').write_text(json.dumps(store_records(synthetic_store())))
    held = store_records(synthetic_store(n_branches=64, seed=1))
    held[0]['question'] = 'HELDOUT-MARKER-7f3a question'
    (data / 'held.json').write_text(json.dumps(held))
    script = tmp_path / 'agent.py'; script.write_text(AGENT)
    places = [str(tmp_path / 'data'), str(REPO), os.environ.get('TMAS_DATA_DIR', '/nonexistent'), str(Path.home())]
    cmd = ' '.join(shlex.quote(x) for x in [sys.executable, str(script), 'HELDOUT-MARKER-7f3a', *places])
    # the script itself must be readable in the sandbox: it comes in through --agent-mount
    cfg = DiscoveryConfig(rounds=1, train=['Qwen3-4B:syn'], heldout=['Qwen3-4B:held'], seeds=2, betas=(0.0, 1.0),
                          agent_cmd=cmd, agent_mounts=[str(script)], agent_timeout=120, price_in=3, price_out=15)
    out = tmp_path / 'run'
    s = run_discovery(None, cfg, out, data_dir=tmp_path / 'data', progress=False)
    ws = out / 'agent' / 'r0000'
    rep = json.loads((ws / 'report.json').read_text())
    assert rep['found'] == [] and rep['seen'] > 10, rep            # the held-out question is nowhere the agent can read
    # a virtualenv inside the checkout is the Python installation itself (read-only, as for any Python)
    venv_in_repo = {Path(sys.prefix).resolve().relative_to(REPO.resolve()).parts[0]} if Path(sys.prefix).resolve().is_relative_to(REPO.resolve()) else set()
    v = rep['visible']      # the data folders are not there; of the repository only the package is (read-only, for Python)
    assert not v[places[0]] and not v[places[2]] and set(v[places[1]] or []) <= {'tmas_nb'} | venv_in_repo, v
    pythons = python_paths()           # the home folder shows only what Python itself needs (a pyenv install lives there)
    assert all(any(p.startswith(os.path.join(places[3], x)) for p in pythons) for x in v[places[3]] or []), (v, pythons)
    assert rep['round'] == '0' and rep['home'] == str(ws.resolve())
    evals = [json.loads(l) for l in rep['eval'].splitlines() if l.startswith('{')]
    assert [e['store'] for e in evals] == ['Qwen3-4B/syn'] and evals[0]['error'] is None, rep['eval_err']
    assert (ws / 'code_base' / 'environment' / 'Qwen3-4B' / 'syn.json').exists()
    assert not list(ws.rglob('held*'))
    # the agent's edit is the round's proposal, evaluated and archived
    assert 'self.beta * 7' in (out / 'code_base' / 'method.py').read_text()
    assert 'agent done' in (out / 'agent' / 'r0000.log').read_text()
    cur = pd.read_csv(out / 'curves.csv')
    assert set(cur.split) == {'search', 'heldout'} and s['selection']['round'] == 0
    assert s['statuses']['ok'] == 1
    # the agent's own tokens are the round's cost
    [rec] = [json.loads(l) for l in (out / 'rounds.jsonl').read_text().splitlines()]
    assert (rec['agent_tokens'], rec['tokens_in'], rec['tokens_out'], rec['agent_cost_usd']) == ('reported', 2000, 450, 0.0123)
    assert (s['cost']['tokens_in'], s['cost']['tokens_out'], s['cost']['dollars'], s['cost']['tokens_unknown_rounds']) == (2000, 450, 0.0128, [])


SLOW_AGENT = r'''
import os, sys, time
from pathlib import Path
ws = Path(os.environ['TMAS_WORKSPACE'])
if Path(sys.argv[1]).read_text().strip() == 'sleep':
    print('agent sleeping', flush=True); time.sleep(300)
m = ws / 'code_base' / 'method.py'; m.write_text(m.read_text().replace('self.beta * 15', 'self.beta * 7'))
'''


def _discover_process(out, store, cmd, mounts):
    import subprocess
    argv = [sys.executable, '-m', 'tmas_nb.cli', 'discover', '--agent-cmd', cmd, '--rounds', '1', '--train', str(store),
            '--seeds', '2', '--out', str(out), '--quiet', *sum((['--agent-mount', m] for m in mounts), [])]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, 'PYTHONPATH': str(REPO)})


def _wait_for(cond, proc, timeout=120):
    import time
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() - t0 < timeout, 'timed out waiting'
        time.sleep(0.05)


@pytest.mark.skipif(sandbox_mode() != 'bwrap', reason='the agent sandbox needs bubblewrap')
def test_resume_after_kill_9_while_the_agent_runs_and_while_evaluating(tmp_path):
    import signal
    store = tmp_path / 'Qwen3-4B' / 'syn.json'; store.parent.mkdir()
    store.write_text(json.dumps(store_records(synthetic_store())))
    script, mode = tmp_path / 'agent.py', tmp_path / 'mode.txt'
    script.write_text(SLOW_AGENT); mode.write_text('sleep')
    cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {shlex.quote(str(mode))}"
    out = tmp_path / 'run'
    # 1. killed while the agent runs
    p = _discover_process(out, store, cmd, [str(script), str(mode)])
    log = out / 'agent' / 'r0000.log'
    _wait_for(lambda: log.exists() and 'agent sleeping' in log.read_text(), p)
    os.kill(p.pid, signal.SIGKILL); p.wait()
    assert not (out / 'rounds.jsonl').exists()
    # 2. killed while the proposal is evaluated (its method.py is written just before)
    mode.write_text('go')
    p = _discover_process(out, store, cmd, [str(script), str(mode)])
    _wait_for(lambda: (out / 'rounds' / 'r0000' / 'method.py').exists(), p)
    os.kill(p.pid, signal.SIGKILL); p.wait()
    # 3. the rerun (here in this process, the settings of the command line) finishes the round once
    s = run_discovery(None, DiscoveryConfig(rounds=1, train=[str(store)], seeds=2, agent_cmd=cmd, agent_mounts=[str(script), str(mode)]),
                      out, progress=False)
    [line] = (out / 'rounds.jsonl').read_text().splitlines()
    rec = json.loads(line)
    assert rec['status'] == 'ok'
    # this agent reports no tokens: the round's cost is unknown, not zero
    assert (rec['agent_tokens'], rec['tokens_in'], rec['tokens_out']) == ('unknown', None, None)
    assert s['cost']['tokens_unknown_rounds'] == [0] and s['cost']['dollars'] is None
    hist = [d.name for d in (out / 'code_base' / 'history').iterdir()]
    assert sorted(h[:5] for h in hist) == ['r0000', 'seed_'], hist          # one archived round, no partial folder
    cur = pd.read_csv(out / 'curves.csv')
    assert len(cur) == 11 and (cur['round'] == 0).all() and cur.error.isna().all()
