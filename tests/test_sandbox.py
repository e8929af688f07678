"""The hardened sandbox, probed by hostile controller files: no remount, no leaked environment, one budget for processes,
memory and files, no /dev/shm, and a checkout anywhere (under /tmp too). Each runs under the cgroup budget where this machine
can make cgroups and under the fallback without them (TMAS_SANDBOX_LIMITS=rlimit)."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tmas_nb import sandbox
from tmas_nb.replay.store import ReplayStore
from tmas_nb.replay.files import evaluate_file, evaluate_file_grid

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
        from tmas_nb.replay.store import ReplayStore
        from tmas_nb.replay.files import evaluate_file
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
