"""The hardened sandbox, probed by hostile controller files and agents: no remount, no leaked environment, one budget for
processes, memory and files, no /dev/shm, a checkout anywhere (under /tmp too); and, as root, an ordinary host user with a
read-only /proc/sys, nothing setuid left behind, an agent network without the host's loopback and abstract sockets, and a
size-limited agent workspace. Each runs under the cgroup budget where this machine can make cgroups and under the
fallback without them (TMAS_SANDBOX_LIMITS=rlimit)."""
import http.server
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

from tmas_nb import sandbox
from tmas_nb.autotts.store import ReplayStore
from tmas_nb.autotts.files import evaluate_file, evaluate_file_grid

TOY = {'question': 'q0', 'gold_answer': '7', 'probe_freq': 500, 'final_answers_trace': [],
       'each_branch': [[['7', '7'], 1200, '7'], [['3'], 900, '7'], [[], 300, '3']]}
SECRETS = {'OPENAI_API_KEY': 'sk-probe-openai-0123456789', 'TMAS_API_KEY': 'tmas-probe-key-9876543210',
           'ANTHROPIC_API_KEY': 'sk-ant-probe-5555555555'}


@pytest.fixture(scope='module')
def toy_store():
    return ReplayStore.from_records([TOY], name='toy')


@pytest.fixture(scope='module', autouse=True)
def need_bwrap():
    if sandbox.sandbox_mode() != 'bwrap':
        pytest.fail('bubblewrap cannot run here: the hardened sandbox is not available on this machine', pytrace=False)


@pytest.fixture(params=['cgroup', 'rlimit'])
def enforcement(request, monkeypatch):
    """Each hostile file runs under both ways of enforcing the budget (the cgroup one where cgroups can be made here)."""
    sandbox.limits_enforcement.cache_clear()
    if request.param == 'rlimit':
        monkeypatch.setenv('TMAS_SANDBOX_LIMITS', 'rlimit')
    elif sandbox.limits_enforcement() != 'cgroup':
        sandbox.limits_enforcement.cache_clear()
        pytest.skip('no cgroup can be made on this machine (not root, no delegated cgroup): only the rlimit budget applies')
    sandbox.limits_enforcement.cache_clear()
    yield request.param
    monkeypatch.delenv('TMAS_SANDBOX_LIMITS', raising=False)
    sandbox.limits_enforcement.cache_clear()


def report(tmp_path, name, body, store, memory_mb=1024, timeout=60):
    """Run a controller whose solve() computes `body` into `out` and raises it: returns (the dict it saw, the result row)."""
    code = ("import json, os, sys\nclass A:\n    def __init__(self, config=None): pass\n    def solve(self, question):\n"
            "        out = {}\n" + textwrap.indent(textwrap.dedent(body), ' ' * 8) +
            "\n        raise RuntimeError('REPORT' + json.dumps(out) + 'END')\n")
    p = tmp_path / name; p.write_text(code)
    r = evaluate_file(p, 'A', {}, store, seeds=[0], memory_mb=memory_mb, timeout=timeout)
    err = r['error'] or ''
    assert 'REPORT' in err, err
    return json.loads(err[err.index('REPORT') + 6:err.rindex('END')]), r


def test_remount_setuid_and_nested_namespaces_fail(tmp_path, toy_store, enforcement):
    import tmas_nb
    targets = ['/usr', sys.prefix, str(Path(tmas_nb.__file__).resolve().parent)]
    seen, r = report(tmp_path, 'remount.py', f'''
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        for p in {targets!r}:
            rc = libc.mount(None, p.encode(), None, 32 | 4096, None)      # MS_REMOUNT | MS_BIND, read-write
            try:
                open(os.path.join(p, '.tmas_probe'), 'w').write('x'); os.unlink(os.path.join(p, '.tmas_probe')); w = True
            except OSError: w = False
            out[str(len(out))] = [rc, w]
        out['uid'] = [os.getuid(), os.getgid()]
        out['caps'] = [l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapPrm'))]
        try: os.setuid(0); out['setuid'] = 'ok'
        except OSError: out['setuid'] = 'refused'
        out['userns'] = 'ok' if libc.unshare(0x10000000) == 0 else 'refused'      # CLONE_NEWUSER
    ''', toy_store)
    assert all(seen[str(i)] == [-1, False] for i in range(len(targets))), seen
    assert seen['uid'] == [65534, 65534] and seen['caps'] == ['0000000000000000'] * 2
    assert seen['setuid'] == 'refused' and seen['userns'] == 'refused'
    assert r['limits'] == enforcement


def test_parent_environment_does_not_leak(tmp_path, toy_store, monkeypatch, enforcement):
    for k, v in SECRETS.items(): monkeypatch.setenv(k, v)
    allowed = ['PATH', 'HOME', 'TMPDIR', 'PYTHONPATH', 'PYTHONDONTWRITEBYTECODE', 'PYTHONHASHSEED', 'LANG', 'OMP_NUM_THREADS',
               'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS', 'NUMBA_CACHE_DIR', 'MPLCONFIGDIR', 'LC_CTYPE', 'PWD']
    seen, r = report(tmp_path, 'snoop.py', f'''
        texts = []
        for pid in os.listdir('/proc'):
            if pid.isdigit():
                try: texts.append(open(f'/proc/{{pid}}/environ', 'rb').read().decode(errors='replace'))
                except OSError: pass
        texts.append(repr(dict(os.environ)))
        out['read'] = len(texts)
        out['found'] = [k for k, v in {SECRETS!r}.items() if any(v in t for t in texts)]
        out['extra'] = sorted(set(os.environ) - set({allowed!r}))
    ''', toy_store)
    assert seen['found'] == [] and seen['extra'] == [], seen
    assert seen['read'] >= 3                     # bubblewrap's init, the child itself, its own environment
    assert not any(v in (r['error'] or '') for v in SECRETS.values())


def test_a_printed_secret_is_redacted_in_grid_errors(tmp_path, toy_store, monkeypatch):
    """Defence in depth: even a value that reached the child another way is masked in the grid's error column."""
    monkeypatch.setenv('OPENAI_API_KEY', SECRETS['OPENAI_API_KEY'])
    p = tmp_path / 'leak.py'
    p.write_text(f"class A:\n    def __init__(self, config=None): pass\n    def solve(self, q): raise RuntimeError({SECRETS['OPENAI_API_KEY']!r})\n")
    g = evaluate_file_grid(p, 'A', [{}], [toy_store], seeds=[0])
    assert SECRETS['OPENAI_API_KEY'] not in g.error[0] and '***' in g.error[0]


def test_fork_storm_is_bounded(tmp_path, toy_store, enforcement):
    seen, r = report(tmp_path, 'forks.py', '''
        import time
        pids, failed = [], 0
        for i in range(50):
            try: pid = os.fork()
            except OSError: failed += 1; continue
            if pid == 0:
                try: b = bytearray(40 << 20); time.sleep(2)
                finally: os._exit(0)
            pids.append(pid)
        for p in pids: os.waitpid(p, 0)
        out['forked'], out['failed'] = len(pids), failed
    ''', toy_store)
    limit = sandbox.SandboxLimits().max_procs
    if enforcement == 'cgroup': assert 0 < seen['forked'] <= limit - 2 and seen['failed'] >= 50 - limit, seen
    else: assert seen == {'forked': 0, 'failed': 50}


def test_disk_fill_is_bounded_and_dev_shm_is_read_only(tmp_path, toy_store, enforcement):
    seen, r = report(tmp_path, 'fill.py', '''
        for d in ['/tmp', '/dev/shm', '/dev', '/', '/usr']:
            n = 0
            try:
                for i in range(26):
                    with open(f'{d}/fill{i}', 'wb') as f: f.write(b'\\0' * (60 << 20))
                    n += 60
            except OSError as e: out[d + ' error'] = e.errno
            out[d] = n
    ''', toy_store, memory_mb=1024)
    tmp_mb = sandbox.SandboxLimits(memory_mb=1024).tmp_size_mb
    assert seen['/tmp'] <= tmp_mb and seen['/tmp error'] == 28        # ENOSPC at the /tmp size
    assert all(seen[d] == 0 and seen[d + ' error'] == 30 for d in ('/dev/shm', '/dev', '/', '/usr'))   # EROFS


def test_one_memory_budget_for_all_processes_and_files(tmp_path):
    """Forked children that each touch 60 MB, plus 24 MB of /tmp (its size is 32 MB), under a 256 MB budget: the cgroup's own high-water mark
    stays at the budget (the kernel kills inside the sandbox instead of letting it grow)."""
    lim = sandbox.SandboxLimits(memory_mb=256, max_procs=8)
    prog = textwrap.dedent('''
        import os, time
        open('/tmp/f', 'wb').write(b'1' * (24 << 20))
        kids = []
        for i in range(6):
            try: pid = os.fork()
            except OSError: continue
            if pid == 0:
                b = bytearray(60 << 20)
                for j in range(0, len(b), 4096): b[j] = 1
                time.sleep(2); os._exit(0)
            kids.append(pid)
        codes = [os.waitpid(p, 0)[1] for p in kids]
        print(len(kids), sum(1 for c in codes if c != 0))
    ''')
    sandbox.limits_enforcement.cache_clear()
    sb = sandbox.Sandbox([sys.executable, '-c', prog], lim, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = sb.proc.communicate(timeout=120)
    peak = sb.cgroup.peak_mb() if sb.cgroup else None
    sb.close()
    if sb.enforcement != 'cgroup':
        pytest.skip('no cgroup on this machine: the rlimit budget is tested by the fork and fill probes')
    forked, killed = map(int, out.split()[-2:])
    assert forked == 6 and killed >= 1, (out, err)          # 24 + 6 x 60 MB cannot all fit in 256 MB
    assert peak is not None and peak <= 256 + 1, peak


def test_memory_bomb_in_fallback_stops_at_the_budget(tmp_path, toy_store, monkeypatch):
    monkeypatch.setenv('TMAS_SANDBOX_LIMITS', 'rlimit'); sandbox.limits_enforcement.cache_clear()
    try:
        seen, r = report(tmp_path, 'bomb.py', '''
            x = []
            try:
                while True: x.append(bytearray(16 << 20))
            except MemoryError: out['held_mb'] = 16 * len(x)
        ''', toy_store, memory_mb=512)
    finally:
        monkeypatch.delenv('TMAS_SANDBOX_LIMITS'); sandbox.limits_enforcement.cache_clear()
    tmp_mb = sandbox.SandboxLimits(memory_mb=512).tmp_size_mb
    assert 100 < seen['held_mb'] <= 512 - tmp_mb and r['limits'] == 'rlimit'


def test_a_checkout_under_tmp_works(tmp_path, toy_store):
    """The package, imported from a copy under /tmp (as a clone there would be), still runs its sandboxed children."""
    import tmas_nb
    assert str(tmp_path).startswith('/tmp'), tmp_path
    shutil.copytree(Path(tmas_nb.__file__).resolve().parent, tmp_path / 'tmas_nb',
                    ignore=shutil.ignore_patterns('__pycache__'))
    ctrl = tmp_path / 'sc.py'
    ctrl.write_text("class A:\n    def __init__(self, config=None): pass\n    def solve(self, q): return q.get_new_branch_final_answer()\n")
    script = textwrap.dedent(f'''
        import json, tmas_nb
        from tmas_nb.autotts.store import ReplayStore
        from tmas_nb.autotts.files import evaluate_file
        assert tmas_nb.__file__.startswith({str(tmp_path)!r}), tmas_nb.__file__
        st = ReplayStore.from_records([{TOY!r}], name='toy')
        r = evaluate_file({str(ctrl)!r}, 'A', {{}}, st, seeds=[0, 1])
        print(json.dumps([r['error'], r['sandbox'], r['acc']]))
    ''')
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    res = subprocess.run([sys.executable, '-c', script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    err, mode, acc = json.loads(res.stdout.strip().splitlines()[-1])
    assert err is None and mode == 'bwrap' and acc == 100.0


# ---- the sandbox as an ordinary host user (issue 33): every probe below failed before, as root --------------------------

def host_uids_below(pid):
    """{uid} of `pid` and every process below it, as the host sees them (real, effective, saved, filesystem)."""
    kids = {}
    for d in os.listdir('/proc'):
        if d.isdigit():
            try: line = Path(f'/proc/{d}/stat').read_text()
            except OSError: continue
            kids.setdefault(int(line[line.rindex(')') + 2:].split()[1]), []).append(int(d))
    uids, todo = set(), [pid]
    while todo:
        p = todo.pop(); todo += kids.get(p, [])
        try: uids |= {int(u) for l in Path(f'/proc/{p}/status').read_text().splitlines() if l.startswith('Uid:') for u in l.split()[1:]}
        except OSError: pass
    return uids


def expected_host_uid():
    return sandbox.UNPRIVILEGED_UID if os.geteuid() == 0 else os.getuid()


def test_controller_sandbox_is_an_ordinary_host_user(enforcement):
    """Seen from the host, the launcher, bubblewrap and the command run as nobody, never as root."""
    sb = sandbox.Sandbox([sys.executable, '-c', 'import sys; print("up", flush=True); sys.stdin.readline()'],
                         sandbox.SandboxLimits(memory_mb=256), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert sb.proc.stdout.readline().strip() == b'up'
        uids = host_uids_below(sb.proc.pid)
        sb.proc.communicate(b'\n', timeout=30)
    finally: sb.kill()
    assert uids == {expected_host_uid()}, uids
    assert sb.enforcement == enforcement


KERNEL_SETTINGS = ['/proc/sys/kernel/core_pattern', '/proc/sys/vm/panic_on_oom', '/proc/sys/kernel/panic', '/proc/sys/fs/file-max',
                   '/proc/sysrq-trigger']
PROC_SYS_PROBE = f'''
import os
def w(p):
    try: os.close(os.open(p, os.O_WRONLY)); return 'opened'
    except OSError as e: return e.errno
out['named'] = [w(p) for p in {KERNEL_SETTINGS!r}]       # compact: the report must fit in one error line
writable = [os.path.join(r, f) for r, _, fs in os.walk('/proc/sys') for f in fs if w(os.path.join(r, f)) == 'opened']
out['writable'] = len(writable)
try:
    with open('/proc/sys/fs/file-max', 'w') as f: f.write(open('/proc/sys/fs/file-max').read())
    out['file_max'] = 'written'
except OSError as e: out['file_max'] = e.errno
'''


def test_proc_sys_is_read_only_for_a_controller(tmp_path, toy_store, enforcement):
    seen, r = report(tmp_path, 'sysctl.py', PROC_SYS_PROBE, toy_store)
    assert 'opened' not in seen['named'] and seen['writable'] == 0 and seen['file_max'] != 'written', seen
    assert r['limits'] == enforcement


# ---- the coding agent's sandbox ------------------------------------------------------------------------------------------

def run_agent(tmp_path, body, *args, timeout=120, **kw):
    """Run `body` as a Python agent in a fresh workspace; it fills `out`, written to report.json. Returns (report, sandbox, ws)."""
    ws = tmp_path / 'ws'; ws.mkdir()
    (ws / 'probe.py').write_text("import json, os, socket, subprocess, sys\nout = {}\n" + textwrap.dedent(body) +
                                 "\nopen('report.json', 'w').write(json.dumps(out))\n")
    with sandbox.agent_sandbox([sys.executable, 'probe.py', *map(str, args)], ws, sandbox.SandboxLimits(memory_mb=1024, max_procs=16),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw) as sb:
        out = sb.proc.communicate(timeout=timeout)[0].decode(errors='replace')
    assert getattr(sb, 'error', None) is None and sb.proc.returncode == 0, (sb.error, out)
    return json.loads((ws / 'report.json').read_text()), sb, ws


SETUID_PROBE = '''
out['mounts'] = {l.split()[4]: l.split()[5] for l in open('/proc/self/mountinfo') if l.split()[4] in (os.getcwd(), '/tmp')}
subprocess.run(['cp', '/usr/bin/id', 'id'], check=True); os.chmod('id', 0o4755)
out['mode'] = oct(os.stat('id').st_mode)
out['inside'] = subprocess.run(['./id'], capture_output=True, text=True).stdout
'''


def test_agent_is_an_ordinary_host_user_and_leaves_nothing_setuid(tmp_path, enforcement):
    """The agent is nobody on the host, cannot open a kernel setting for writing, and the setuid copy of `id` it leaves is
    neither setuid nor root's on the host (before: `-rwsr-xr-x root`, and an ordinary user running it got euid=0)."""
    body = 'print("up", flush=True); sys.stdin.readline()\n' + PROC_SYS_PROBE + SETUID_PROBE
    ws = tmp_path / 'ws'; ws.mkdir()
    (ws / 'probe.py').write_text("import json, os, socket, subprocess, sys\nout = {}\n" + body + "\nopen('report.json', 'w').write(json.dumps(out))\n")
    sb = sandbox.agent_sandbox([sys.executable, 'probe.py'], ws, sandbox.SandboxLimits(memory_mb=1024, max_procs=64),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert sb.proc.stdout.readline().strip() == b'up'
        uids = host_uids_below(sb.proc.pid)
        out = sb.proc.communicate(b'\n', timeout=120)[0].decode(errors='replace')
    finally: sb.kill()
    assert uids == {expected_host_uid()}, uids
    seen = json.loads((ws / 'report.json').read_text())
    assert 'opened' not in seen['named'] and seen['writable'] == 0 and seen['file_max'] != 'written', seen
    assert 'euid' not in seen['inside'], seen                    # inside, the bit has no effect (nosuid, and its own file)
    assert all('nosuid' in f and 'nodev' in f for f in seen['mounts'].values()) and len(seen['mounts']) == 2, seen
    st = (ws / 'id').stat()
    assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID) and st.st_uid == os.getuid(), oct(st.st_mode)
    if os.geteuid() == 0:                                         # an ordinary user runs what the agent left (a copy it can reach)
        d = Path(tempfile.mkdtemp(dir='/var/tmp')); d.chmod(0o755)
        try:
            shutil.copy2(ws / 'id', d / 'id')
            res = subprocess.run([str(d / 'id')], capture_output=True, text=True, user=65534, group=65534, extra_groups=[])
        finally: shutil.rmtree(d)
        assert res.returncode == 0 and 'euid=0' not in res.stdout and res.stdout.startswith('uid=65534'), res.stdout


class Served:
    """A loopback HTTP server on the host answering `text` (a local model server, a Jupyter server)."""
    def __init__(self, text):
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self): self.send_response(200); self.end_headers(); self.wfile.write(text.encode())
            def log_message(self, *a): pass
        self.server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
    def close(self): self.server.shutdown(); self.server.server_close()


NETWORK_PROBE = '''
import urllib.request
def get(host, port):
    try: return urllib.request.urlopen(f'http://{host}:{port}/', timeout=5).read().decode()
    except OSError as e: return 'refused: ' + type(e).__name__
ports = [int(x) for x in sys.argv[1:3]]
out['loopback'] = [get('127.0.0.1', p) for p in ports]
out['via_gateway'] = [get('10.0.2.2', p) for p in ports]             # slirp's name for the host
a = socket.socket(socket.AF_UNIX)
try: a.connect(sys.argv[3].encode().replace(b'@', b'\\0', 1)); out['abstract'] = 'connected'
except OSError as e: out['abstract'] = e.errno
out['outbound'] = None
if sys.argv[4] == 'yes':
    for i in range(3):
        try: socket.create_connection(('pypi.org', 443), timeout=10).close(); out['outbound'] = 'connected'; break
        except OSError as e: out['outbound'] = repr(e)
'''


def host_reaches_pypi():
    for _ in range(2):
        try: socket.create_connection(('pypi.org', 443), timeout=10).close(); return True
        except OSError: pass
    return False


@pytest.fixture
def host_services():
    model, jupyter = Served('model server'), Served('jupyter')
    abstract = socket.socket(socket.AF_UNIX); name = f'@tmas-probe-{os.getpid()}'
    abstract.bind(name.encode().replace(b'@', b'\0', 1)); abstract.listen()
    yield model, jupyter, name
    model.close(); jupyter.close(); abstract.close()


def test_agent_cannot_reach_the_hosts_loopback_or_abstract_sockets(tmp_path, host_services, enforcement):
    """Before, the agent shared the host's network: every loopback port and abstract socket here was one connect away."""
    model, jupyter, name = host_services
    online = host_reaches_pypi()
    seen, sb, ws = run_agent(tmp_path, NETWORK_PROBE, model.port, jupyter.port, name, 'yes' if online else 'no')
    assert all(x.startswith('refused') for x in seen['loopback'] + seen['via_gateway']), seen
    assert seen['abstract'] == 111, seen                          # ECONNREFUSED: no such socket in the agent's namespace
    if online: assert seen['outbound'] == 'connected', seen     # its model's API stays reachable (TCP and DNS)
    else: pytest.skip("this machine cannot reach pypi.org:443, so the agent's outbound network was not checked")


def test_allow_opens_one_named_loopback_service(tmp_path, host_services, enforcement):
    model, jupyter, name = host_services
    seen, sb, ws = run_agent(tmp_path, NETWORK_PROBE, model.port, jupyter.port, name, 'no', allow=[f'127.0.0.1:{model.port}'])
    assert seen['loopback'][0] == 'model server' and seen['loopback'][1].startswith('refused'), seen
    assert all(x.startswith('refused') for x in seen['via_gateway']) and seen['abstract'] == 111, seen


def test_agent_workspace_is_size_limited(tmp_path, enforcement):
    """Before, the agent wrote 384 MB into its workspace in 0.13 s with no quota. Now the workspace is a tmpfs of disk_mb:
    writing past it fails with ENOSPC, and what comes back to the host is at most that size."""
    seen, sb, ws = run_agent(tmp_path, '''
        out['fs'] = [l.split(' - ')[1].split()[0] for l in open('/proc/self/mountinfo') if l.split()[4] == os.getcwd()]
        n = 0
        try:
            for i in range(16):
                with open(f'fill{i}', 'wb') as f: f.write(b'x' * (8 << 20))
                n += 8
        except OSError as e: out['errno'] = e.errno
        out['written_mb'] = n
        for i in range(16):                  # keep one whole file, so the rest of the workspace can come back
            if i and os.path.exists(f'fill{i}'): os.unlink(f'fill{i}')
    ''', disk_mb=32)
    assert seen['fs'] == ['tmpfs'] and seen['errno'] == 28 and seen['written_mb'] < 32, seen
    back = sum(p.stat().st_size for p in ws.rglob('*') if p.is_file())
    assert back <= 32 << 20 and (ws / 'fill0').stat().st_size == 8 << 20 and sb.returned['bytes'] == back


def test_a_workspace_larger_than_its_disk_is_refused_before_the_agent_runs(tmp_path):
    ws = tmp_path / 'ws'; ws.mkdir(); (ws / 'big').write_bytes(b'x' * (3 << 20))
    with pytest.raises(sandbox.SandboxError, match=r'does not fit in its disk \(2 MB\)'):
        sandbox.agent_sandbox(['/bin/true'], ws, disk_mb=2)
    assert (ws / 'big').stat().st_size == 3 << 20 and not list(tmp_path.glob('.ws.*'))


def test_a_stopped_agent_keeps_its_work_and_a_lost_workspace_is_said(tmp_path, enforcement):
    """kill() (the caller's timeout) stops the agent but returns its files; an agent that kills its supervisor loses them,
    the workspace is left empty (nothing in it can pass for the agent's work) and `error` says why."""
    ws = tmp_path / 'ws'; ws.mkdir(); (ws / 'method.py').write_text('template\n')
    script = "echo proposal > method.py; echo started; exec sleep 300"
    sb = sandbox.agent_sandbox(['/bin/sh', '-c', script], ws, network='none', stdout=subprocess.PIPE)
    assert sb.proc.stdout.readline().strip() == b'started'
    with pytest.raises(subprocess.TimeoutExpired): sb.proc.wait(timeout=1)
    sb.kill()
    assert sb.error is None and (ws / 'method.py').read_text() == 'proposal\n' and sb.proc.returncode == 128 + 9
    ws2 = tmp_path / 'ws2'; ws2.mkdir(); (ws2 / 'method.py').write_text('template\n')
    with sandbox.agent_sandbox([sys.executable, '-c', 'import os; open("method.py", "w").write("mine"); os.kill(os.getppid(), 9)'],
                               ws2, network='none') as sb:
        sb.proc.wait(timeout=60)
    assert sb.error and 'not returned' in sb.error and list(ws2.iterdir()) == [], (sb.error, list(ws2.iterdir()))


def test_a_missing_network_tool_is_an_error_unless_the_caller_opts_in(monkeypatch, capsys):
    monkeypatch.setattr(sandbox, 'network_tool', lambda: None)
    monkeypatch.delenv('TMAS_AGENT_NETWORK', raising=False)
    with pytest.raises(sandbox.SandboxError, match='needs slirp4netns'): sandbox.agent_network()
    monkeypatch.setattr(sandbox, '_WARNED', set())
    assert sandbox.agent_network('auto') == 'host' and sandbox.agent_network('auto') == 'host'
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('WARNING: the coding agent shares'), err
    monkeypatch.setenv('TMAS_AGENT_NETWORK', 'none'); assert sandbox.agent_network() == 'none'


def test_rw_folders_are_given_for_the_sandbox_life_and_taken_back(tmp_path, enforcement):
    """A writable bind belongs to the sandbox's host user while it runs; afterwards it is the caller's again, without the
    setuid file or the FIFO the sandbox left, and the link it left still points where it did (never followed)."""
    d = tmp_path / 'rw'; d.mkdir(); (d / 'given').write_text('x')
    prog = ("import os; open('/rw/tool', 'w').write('x'); os.chmod('/rw/tool', 0o6755); os.mkfifo('/rw/pipe'); "
            "os.symlink('/etc/shadow', '/rw/link'); print(os.stat('/rw/given').st_uid, os.stat('/rw').st_uid)")
    prog = prog.replace('/rw', str(d))
    with sandbox.Sandbox([sys.executable, '-c', prog], sandbox.SandboxLimits(memory_mb=256), access=sandbox.SandboxAccess(rw=[str(d)]), stdout=subprocess.PIPE) as sb:
        inside = sb.proc.communicate(timeout=60)[0].split()
    assert inside == [b'65534', b'65534'], inside                   # the sandbox's own files, inside and out
    assert sorted(p.name for p in d.iterdir()) == ['given', 'link', 'tool']
    assert all(p.lstat().st_uid == os.getuid() for p in d.iterdir()) and d.stat().st_uid == os.getuid()
    assert stat.S_IMODE((d / 'tool').stat().st_mode) == 0o755 and os.readlink(d / 'link') == '/etc/shadow'


def test_agent_process_count_is_bounded(tmp_path, enforcement):
    """An agent may start processes, up to max_procs. Without a cgroup this is RLIMIT_NPROC, which the kernel never applied
    while the sandbox was the host's root: 50 forks all succeeded. As nobody the count holds in both modes."""
    seen, sb, ws = run_agent(tmp_path, '''
        import time
        ok = failed = 0
        for i in range(50):
            try: pid = os.fork()
            except OSError: failed += 1; continue
            if pid == 0: time.sleep(2); os._exit(0)
            ok += 1
        out['forked'], out['failed'] = ok, failed
    ''', network='none')
    assert 0 < seen['forked'] < 16 and seen['forked'] + seen['failed'] == 50, seen
