"""`tmas discover --agent-cmd`: a scripted coding agent in its sandboxed workspace (bubblewrap, only the workspace
writable). The agent searches everything it can read — the workspace, the system, the Python installation it runs on,
/proc — for the held-out store, for any controller other than the seeds it was given and for the paper's published
answer (CMC's class names and the words of its momentum rule, the paper's accuracy values); it runs the workspace's
evaluation command, which works with none of that in reach, and writes code_base/method.py."""
import json
import os
import shlex
import sys
from pathlib import Path

import pandas as pd
import pytest

from tmas_nb.autotts.discovery import DiscoveryConfig, METHOD_TEMPLATE, run_discovery, synthetic_store
from tmas_nb.autotts.authors_api import store_records
from tmas_nb.sandbox import package_paths, python_paths, sandbox_mode

REPO = Path(__file__).resolve().parent.parent

# what must be nowhere in the agent's reach, hex-encoded so that the agent's own command line and script do not hold it
NEEDLES = ['ConfidenceMomentum', 'Confidence Momentum', 'abandon_patience', 'burst_aligned', 'widen_burst', 'trend_thresh',
           'cmc_schedule', 'PAPER_AIME24', '82.0, 236.7', '83.5, 424.9', '84.3, 255.3', '85.8, 467.4', '80.1, 175.7']
CLASSES = r'\bclass (CMC|MyCMC|CMCMethod|SelfConsistency|ParallelProbe|SelfConsistencyFile)\b'
CONTROLLER_DEF = r'def solve\(self, question|def run\(self, env'

# the agent: a search with grep over the system and the Python installation (text files of the kinds a package copy
# would leave, .pyc included), a search in Python over everything else it can read (the workspace, /etc, /tmp, mounts)
# and over /proc; then the evaluation command, an import of tmas_nb, and a controller written into method.py
AGENT = r'''
import json, os, re, subprocess, sys
from pathlib import Path
ws = Path(os.environ['TMAS_WORKSPACE'])
needles, classes, controller = [bytes.fromhex(x).decode() for x in sys.argv[1:4]]
pattern = '|'.join([re.escape(n) for n in needles.split('\n')] + [classes, controller])
rx = re.compile(pattern.encode())
system = [p for p in ('/usr', '/lib', '/lib64', '/lib32', '/bin', '/sbin') if os.path.isdir(p) and not os.path.islink(p)]
pythons = sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)})
kinds = ['*.py', '*.pyc', '*.md', '*.txt', '*.json', '*.jsonl', '*.csv', '*.ipynb', 'METADATA', '*.html', '*.rst', '*.cfg', '*.toml', '*.pth']
g = subprocess.run(['grep', '-rlE', *[f'--include={k}' for k in kinds], pattern, *system, *pythons], capture_output=True, text=True)
hits = g.stdout.splitlines()
skip = {'/proc', '/sys', '/dev', *system, *pythons}
seen = 0
for root, dirs, files in os.walk('/'):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
    for f in files:
        p = os.path.join(root, f)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            with os.fdopen(fd, 'rb') as fh: data = fh.read(8 << 20)
        except OSError: continue
        seen += 1
        if rx.search(data): hits.append(p)
procs = 0
for root, dirs, files in os.walk('/proc'):
    dirs[:] = [d for d in dirs if d not in ('task', 'map_files', 'fd', 'fdinfo', 'ns', 'net', 'sys', 'bus', 'irq', 'tty', 'driver')]
    for f in files:
        if f in ('mem', 'pagemap', 'kcore', 'kmsg', 'kpagecount', 'kpageflags', 'kpagecgroup', 'clear_refs', 'sysrq-trigger', 'trace_pipe'): continue
        try:
            fd = os.open(os.path.join(root, f), os.O_RDONLY | os.O_NONBLOCK)
            with os.fdopen(fd, 'rb') as fh: data = fh.read(1 << 20)
        except OSError: continue
        procs += 1
        if rx.search(data): hits.append(os.path.join(root, f))
m = ws / 'code_base' / 'method.py'
m.write_text(m.read_text().replace("raise NotImplementedError('OptimalController.solve is not written yet')",
                                   "return _majority_answer([_safe_full_read(question) for _ in range(1 + round(self.beta * 7))])"))
ev = subprocess.run(os.environ['TMAS_EVAL_CMD'].split() + ['--beta', '0.5', '1.0', '--seeds', '1'], capture_output=True, text=True, cwd=ws)
imp = subprocess.run([sys.executable, '-c', 'import tmas_nb.autotts.controllers'], capture_output=True, text=True)
# what the claude CLI's --output-format json prints about its run, where the environment tells the agent to leave it
Path(os.environ['TMAS_USAGE_FILE']).write_text(json.dumps({'type': 'result', 'total_cost_usd': 0.0123, 'usage': {
    'input_tokens': 1200, 'cache_creation_input_tokens': 300, 'cache_read_input_tokens': 500, 'output_tokens': 450}}))
(ws / 'report.json').write_text(json.dumps(dict(hits=hits, seen=seen, procs=procs, grep_rc=g.returncode, grep_err=g.stderr[-500:],
    system=system, pythons=pythons, round=os.environ['TMAS_ROUND'], eval=ev.stdout, eval_err=ev.stderr[-2000:], import_rc=imp.returncode,
    prompt=Path(os.environ['TMAS_PROMPT_FILE']).read_text(), home=os.path.expanduser('~'),
    visible={p: sorted(os.listdir(p)) if os.path.isdir(p) else None for p in sys.argv[4:]})))
print('agent done', seen, procs)
'''


def _hex(s: str) -> str: return s.encode().hex()


@pytest.mark.skipif(sandbox_mode() != 'bwrap', reason='the agent sandbox needs bubblewrap')
def test_scripted_agent_finds_no_answer_no_heldout_and_its_evaluation_still_works(tmp_path):
    data = tmp_path / 'data' / 'autotts_replay' / 'Qwen3-4B'; data.mkdir(parents=True)
    (data / 'syn.json').write_text(json.dumps(store_records(synthetic_store())))
    held = store_records(synthetic_store(n_branches=64, seed=1))
    held[0]['question'] = 'HELDOUT-MARKER-7f3a question'
    (data / 'held.json').write_text(json.dumps(held))
    script = tmp_path / 'agent.py'; script.write_text(AGENT)
    places = [str(tmp_path / 'data'), str(REPO), os.environ.get('TMAS_DATA_DIR', '/nonexistent'), str(Path.home())]
    needles = '\n'.join(NEEDLES + ['HELDOUT-MARKER-7f3a'])
    cmd = ' '.join(shlex.quote(x) for x in [sys.executable, str(script), _hex(needles), _hex(CLASSES), _hex(CONTROLLER_DEF), *places])
    # the script itself must be readable in the sandbox: it comes in through --agent-mount
    cfg = DiscoveryConfig(rounds=1, train=['Qwen3-4B:syn'], heldout=['Qwen3-4B:held'], seeds=2, betas=(0.0, 1.0),
                          agent_cmd=cmd, agent_mounts=[str(script)], agent_timeout=600, price_in=3, price_out=15)
    out = tmp_path / 'run'
    s = run_discovery(None, cfg, out, data_dir=tmp_path / 'data', progress=False)
    ws = out / 'agent' / 'r0000'
    rep = json.loads((ws / 'report.json').read_text())
    unreadable = all('Permission denied' in l for l in rep['grep_err'].strip().splitlines())   # folders the agent cannot read either
    assert (rep['grep_rc'] in (0, 1) or unreadable) and rep['seen'] > 10 and rep['procs'] > 10, rep
    assert rep['system'] and rep['pythons'], rep
    # the only controllers in reach are the seeds in the workspace's template (and the task that names the API)
    allowed = {str((ws / 'code_base' / f).resolve()) for f in ('method.py', 'method.template.py')} | {str((ws / 'PROMPT.md').resolve())}
    # its_hub (a peer library the gateway's benchmark compares with, installed with the dev tools) defines its own generic
    # SelfConsistency class: public, and none of this package's controllers, words or numbers
    peers = {h for h in rep['hits'] if '/site-packages/its_hub/' in h and h.endswith('.py')}
    assert set(rep['hits']) - peers <= allowed, sorted(set(rep['hits']) - peers - allowed)
    assert 'abandon_patience' not in METHOD_TEMPLATE and 'class ASCMethod' in METHOD_TEMPLATE
    assert rep['import_rc'] != 0                       # the package is not importable in the sandbox: it is masked
    # the evaluation command still returns curves: the run's evaluator answered it
    evals = [json.loads(l) for l in rep['eval'].splitlines() if l.startswith('{')]
    assert [(e['store'], e['beta']) for e in evals] == [('Qwen3-4B/syn', 0.5), ('Qwen3-4B/syn', 1.0)], rep['eval_err']
    assert all(e['error'] is None and 0 <= e['acc'] <= 100 and e['avg_tokens'] > 0 for e in evals), evals
    assert 'max_branch = 64' in rep['prompt'] and 'Conservative anchor' in rep['prompt'] and 'Novel' in rep['prompt']
    [rec] = [json.loads(l) for l in (out / 'rounds.jsonl').read_text().splitlines()]
    assert len(rec['drafts'][0]['evaluations']) == 1 and rec['drafts'][0]['evaluations'][0]['seeds'] == 1
    # the data folders are not there; of the repository only the masked package folder and the virtualenv (Python itself)
    venv_in_repo = {Path(sys.prefix).resolve().relative_to(REPO.resolve()).parts[0]} if Path(sys.prefix).resolve().is_relative_to(REPO.resolve()) else set()
    v = rep['visible']
    masked = {Path(p).name for p in package_paths() if Path(p).parent == REPO.resolve()}   # tmas_nb, and an egg-info of an editable install
    assert not v[places[0]] and not v[places[2]] and set(v[places[1]] or []) <= {'tmas_nb'} | masked | venv_in_repo, v
    pythons = python_paths()           # the home folder shows only what Python itself needs (a pyenv install lives there)
    assert all(any(p.startswith(os.path.join(places[3], x)) for p in pythons) for x in v[places[3]] or []), (v, pythons)
    assert rep['round'] == '0' and rep['home'] == str(ws.resolve())
    assert (ws / 'code_base' / 'environment' / 'Qwen3-4B' / 'syn.json').exists()
    assert not list(ws.rglob('held*')) and not (ws / '.tmas').exists()
    # the agent's edit is the round's proposal, evaluated and archived
    assert 'round(self.beta * 7)' in (out / 'rounds' / 'r0000' / 'method.py').read_text()
    assert 'agent done' in (out / 'agent' / 'r0000.log').read_text()
    cur = pd.read_csv(out / 'curves.csv')
    assert set(cur.split) == {'search', 'heldout'} and s['selection']['round'] == 0 and s['statuses']['ok'] == 1
    ho = pd.read_csv(out / 'heldout.csv')          # every row of the held-out table states its controller's ceiling
    assert dict(zip(ho.method, ho.max_branches))['SC@64'] == 64 and dict(zip(ho.method, ho.max_branches))['CMC β=0.5'] == 34
    # the agent's own tokens are the round's cost
    assert (rec['agent_tokens'], rec['tokens_in'], rec['tokens_out'], rec['agent_cost_usd']) == ('reported', 2000, 450, 0.0123)
    assert (s['cost']['tokens_in'], s['cost']['tokens_out'], s['cost']['dollars'], s['cost']['tokens_unknown_rounds']) == (2000, 450, 0.0128, [])


SLOW_AGENT = r'''
import os, sys, time
from pathlib import Path
ws = Path(os.environ['TMAS_WORKSPACE'])
if Path(sys.argv[1]).read_text().strip() == 'sleep':
    print('agent sleeping', flush=True); time.sleep(300)
m = ws / 'code_base' / 'method.py'
m.write_text(m.read_text().replace("raise NotImplementedError('OptimalController.solve is not written yet')",
                                   "return _majority_answer([_safe_full_read(question) for _ in range(1 + round(self.beta * 7))])"))
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
