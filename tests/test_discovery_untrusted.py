"""What a discovery agent leaves is data, read by a parent that trusts none of it: a real scripted agent in the real
agent sandbox replaces code_base/method.py with a link to the held-out store, to /proc/self/environ, to a file only root
may read, to /dev/zero, or with a FIFO; it writes usage files with Infinity or negative tokens; it cannot start at all.
Each round is recorded failed with the reason (never the template evaluated as a proposal), nothing it pointed at reaches
the run folder or the next workspace, and the run goes on."""
import json
import os
import shlex
import sys
from pathlib import Path

import pandas as pd
import pytest

from tmas_nb.autotts import discovery
from tmas_nb import sandbox
from tmas_nb.autotts.discovery import DiscoveryConfig, run_discovery, synthetic_store
from tmas_nb.autotts.authors_api import store_records
from tmas_nb.sandbox import sandbox_mode

needs_bwrap = pytest.mark.skipif(sandbox_mode() != 'bwrap', reason='the agent sandbox needs bubblewrap')

# round by round, what the agent leaves in place of its proposal (targets are paths on the host, given as arguments)
HOSTILE = r'''
import json, os, sys
from pathlib import Path
k, ws = int(os.environ['TMAS_ROUND']), Path(os.environ['TMAS_WORKSPACE'])
held, secret = sys.argv[1], sys.argv[2]
m, usage = ws / 'code_base' / 'method.py', Path(os.environ['TMAS_USAGE_FILE'])
m.unlink()
if k == 0: m.symlink_to(held); usage.write_text('{"tokens_in": Infinity, "tokens_out": 10}')
if k == 1: m.symlink_to('/proc/self/environ'); usage.write_text('{"tokens_in": -5000000, "tokens_out": 10}')
if k == 2: m.symlink_to(secret); usage.write_text('{"tokens_in": 100, "tokens_out": 10}')
if k == 3: os.mkfifo(m)
if k == 4: m.symlink_to('/dev/zero')
if k == 5: m.write_text('class OptimalController:\n    def solve(self, question): return ' + ' + '.join(['1'] * 100000))   # breaks the parser
print('left', k, flush=True)
'''


def _store(tmp_path, name, **kw):
    f = tmp_path / 'Qwen3-4B' / f'{name}.json'; f.parent.mkdir(exist_ok=True)
    f.write_text(json.dumps(store_records(synthetic_store(**kw)))); return f


@needs_bwrap
def test_links_fifos_and_bad_usage_left_by_the_agent_are_refused_and_the_run_goes_on(tmp_path, monkeypatch):
    train = _store(tmp_path, 'syn')
    held = store_records(synthetic_store(n_branches=64, seed=1)); held[0]['question'] = 'HELDOUT-MARKER-91c2 question'
    held_file = tmp_path / 'Qwen3-4B' / 'held.json'; held_file.write_text(json.dumps(held))
    secret = tmp_path / 'root_only.txt'; secret.write_text('ROOT-ONLY-MARKER-5d1e'); secret.chmod(0o600)
    environ = [e for e in Path('/proc/self/environ').read_bytes().split(b'\0') if len(e) > 12][:3]   # this process's own
    reclaimed = []
    monkeypatch.setattr(sandbox, 'reclaim_tree', lambda p: reclaimed.append(Path(p)), raising=False)
    script = tmp_path / 'agent.py'; script.write_text(HOSTILE)
    cmd = ' '.join(shlex.quote(x) for x in [sys.executable, str(script), str(held_file), str(secret)])
    cfg = DiscoveryConfig(rounds=6, train=[str(train)], heldout=[str(held_file)], seeds=2, betas=(0.0, 1.0), agent_cmd=cmd,
                          agent_mounts=[str(script)], agent_timeout=120, price_in=3, price_out=15)
    out = tmp_path / 'run'
    s = run_discovery(None, cfg, out, progress=False)
    recs = [json.loads(l) for l in (out / 'rounds.jsonl').read_text().splitlines()]
    assert [r['status'] for r in recs] == ['check_failed'] * 6, [(r['status'], r['error']) for r in recs]
    whys = [r['error'] for r in recs]
    # the agent's sandbox returns regular files and folders only, so a link or a FIFO usually never arrives ('no such
    # file'); where one does (a weaker sandbox), the parent refuses to read it
    refused = lambda w, why: why in w or 'no such file' in w
    assert all(refused(whys[i], 'symbolic link') for i in (0, 1, 2, 4)) and refused(whys[3], 'not a regular file'), whys
    assert 'nested too deeply' in whys[5], whys[5]
    assert all(r['digest'] is None and r['folder'] is None for r in recs[:5])     # nothing read, archived or evaluated
    assert [p.parent.name for p in (out / 'rounds').glob('r*/method.py')] == ['r0005']   # the text it wrote, kept as a record
    assert not (out / 'curves.csv').exists() or not len(pd.read_csv(out / 'curves.csv').query("split == 'search'"))
    # nothing the links pointed at is anywhere in the run folder (history, caches, the next rounds' workspaces, logs)
    markers = [b'HELDOUT-MARKER-91c2', b'ROOT-ONLY-MARKER-5d1e', *environ]
    leaks = [(str(p), m) for p in out.rglob('*') if p.is_file() and not p.is_symlink() for m in markers if m in p.read_bytes()]
    assert leaks == [], leaks[:5]
    # usage files with Infinity or negative tokens: unknown, one line why; the cost is unknown, never negative
    assert [r['agent_tokens'] for r in recs[:3]] == ['unknown', 'unknown', 'reported']
    assert all('is not a token count' in r['drafts'][0]['agent_usage_error'] for r in recs[:2])
    assert s['cost']['dollars'] is None and s['cost']['tokens_unknown_rounds'] == [0, 1, 3, 4, 5]
    assert reclaimed == [out / 'agent' / f'r{k:04d}' for k in range(6)]           # every workspace given back after its round
    assert s['selection'] is None and (out / 'heldout.csv').exists()               # the baselines alone on the held-out store


@needs_bwrap
@pytest.mark.parametrize('case', ['command not found', 'sandbox did not start'])
def test_an_agent_that_could_not_run_is_a_failed_round_and_the_template_is_never_evaluated(tmp_path, case):
    train = _store(tmp_path, 'syn')
    cmd, mounts = ('/nonexistent/agent-cli --go', []) if case == 'command not found' else ('true', [str(tmp_path / 'gone')])
    cfg = DiscoveryConfig(rounds=1, train=[str(train)], seeds=2, betas=(0.0, 1.0), agent_cmd=cmd, agent_mounts=mounts, agent_timeout=60)
    out = tmp_path / 'run'
    s = run_discovery(None, cfg, out, progress=False)
    [rec] = [json.loads(l) for l in (out / 'rounds.jsonl').read_text().splitlines()]
    assert rec['status'] == 'agent_failed' and s['statuses']['agent_failed'] == 1, rec
    assert ('status 127' in rec['error'] and 'No such file' in rec['error']) if case == 'command not found' else \
        ("sandbox did not start" in rec['error'] and 'gone' in rec['error']), rec['error']
    assert rec['digest'] is None and not (out / 'rounds' / 'r0000' / 'method.py').exists()
    assert not (out / 'curves.csv').exists() and s['selection'] is None and not list((out / 'cache' / 'evals').glob('*.json'))


@needs_bwrap
def test_an_agent_that_left_the_template_proposed_nothing(tmp_path):
    cfg = DiscoveryConfig(rounds=1, train=[str(_store(tmp_path, 'syn'))], seeds=2, betas=(0.0, 1.0), agent_cmd='echo thinking', agent_timeout=60)
    s = run_discovery(None, cfg, tmp_path / 'run', progress=False)
    [rec] = [json.loads(l) for l in (tmp_path / 'run' / 'rounds.jsonl').read_text().splitlines()]
    assert (rec['status'], s['selection']) == ('no_code', None) and 'template' in rec['error']
    assert not (tmp_path / 'run' / 'curves.csv').exists()


@needs_bwrap
def test_agent_allow_and_disk_mb_reach_the_sandbox_where_it_takes_them(tmp_path, monkeypatch):
    real, got = discovery.agent_sandbox, []
    def with_options(argv, workspace, limits=None, *, mounts=(), env=None, allow=(), disk_mb=None, **kw):
        got.append(dict(allow=list(allow), disk_mb=disk_mb))
        return real(argv, workspace, limits, mounts=mounts, env=env, **kw)
    def without(argv, workspace, limits=None, *, mounts=(), env=None, **kw):
        got.append(dict(kw=sorted(k for k in kw if k in ('allow', 'disk_mb'))))
        return real(argv, workspace, limits, mounts=mounts, env=env, **kw)
    cfg = DiscoveryConfig(rounds=1, train=[str(_store(tmp_path, 'syn'))], seeds=1, betas=(0.0,), agent_cmd='true',
                          agent_allow=['127.0.0.1:8000'], agent_disk_mb=512)
    monkeypatch.setattr(discovery, 'agent_sandbox', with_options)
    run_discovery(None, cfg, tmp_path / 'a', progress=False)
    monkeypatch.setattr(discovery, 'agent_sandbox', without)
    run_discovery(None, cfg, tmp_path / 'b', progress=False)
    assert got == [dict(allow=['127.0.0.1:8000'], disk_mb=512), dict(kw=[])]
    rec = json.loads((tmp_path / 'a' / 'rounds.jsonl').read_text())
    assert rec['drafts'][0]['sandbox_options'] == dict(allow=['127.0.0.1:8000'], disk_mb=512)


@needs_bwrap
def test_an_agent_whose_workspace_did_not_come_back_is_a_failed_round(tmp_path):
    """The agent writes a proposal, then kills the sandbox's supervisor: its workspace is not returned, so the round
    is failed with the reason, and nothing of it (not the half-written proposal, not the template) is evaluated."""
    prog = ("import os; open('code_base/method.py', 'w').write('class OptimalController:\\n    pass\\n'); "
            "os.kill(os.getppid(), 9)")
    cmd = ' '.join(shlex.quote(x) for x in [sys.executable, '-c', prog])
    cfg = DiscoveryConfig(rounds=1, train=[str(_store(tmp_path, 'syn'))], seeds=2, betas=(0.0, 1.0), agent_cmd=cmd, agent_timeout=60)
    if 'disk_mb' not in discovery.agent_sandbox_options(cfg): pytest.skip('this sandbox keeps the workspace in place (no copy to lose)')
    s = run_discovery(None, cfg, tmp_path / 'run', progress=False)
    [rec] = [json.loads(l) for l in (tmp_path / 'run' / 'rounds.jsonl').read_text().splitlines()]
    assert rec['status'] == 'agent_failed' and 'not returned' in rec['error'], rec
    assert rec['digest'] is None and s['selection'] is None and not (tmp_path / 'run' / 'curves.csv').exists()
