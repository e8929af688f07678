"""Bad input fails loudly: one writer per run folder, corrupt caches and records refused before anything is written,
`tmas grade` limits, short downloads refused at once, and the smaller checks (a data folder that is a file, strict
JSON from `tmas discover`, file modes that follow the umask). Real runs use the packaged SmolLM2 model, kept tiny."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tmas_nb.data.fetch import REGISTRY, make_mirror

HERE = Path(__file__).parent
REPO = HERE.parent
ENV = {**os.environ, 'HF_HUB_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1', 'OMP_NUM_THREADS': '1',
       'TOKENIZERS_PARALLELISM': 'false', 'PYTHONPATH': str(REPO)}


def tmas(*args, timeout=180, stdin=None):
    return subprocess.run([sys.executable, '-m', 'tmas_nb.cli', *map(str, args)], capture_output=True, text=True,
                          env=ENV, timeout=timeout, input=stdin)


def run_command(out, iterations=1):
    "A tiny real run: one demo problem, one candidate, four tokens, the packaged SmolLM2 on one thread."
    return [sys.executable, '-m', 'tmas_nb.cli', 'run', '--method', 'sampling', '--benchmark', 'demo', '--limit', '1',
            '--model', 'smollm2', '--backend', 'transformers', '--n-candidates', '1', '--iterations', str(iterations),
            '--max-new-tokens', '4', '--seed', '3', '--threads', '1', '--quiet', '--out', str(out)]


def error_lines(stderr: str) -> list[str]:
    return [l for l in stderr.strip().splitlines() if l.strip()]


def wait_for(cond, what, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond(): return
        time.sleep(0.05)
    raise AssertionError(f'timed out waiting for {what}')


def snapshot(folder: Path) -> dict[str, bytes]:
    "Every file of a folder (but the lock file) and its bytes."
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob('*'))
            if p.is_file() and p.name != '.lock'}


def hold_lock(folder: Path) -> subprocess.Popen:
    "Another process holding the folder's lock until it is killed."
    code = ('import sys, time\nfrom tmas_nb.core import folder_lock\n'
            f'with folder_lock({str(folder)!r}):\n    print("locked", flush=True); time.sleep(600)\n')
    p = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    line = p.stdout.readline()
    assert line.strip() == 'locked', p.stderr.read()
    return p


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
    "One finished tiny run; tests copy it."
    out = tmp_path_factory.mktemp('finished') / 'run'
    r = subprocess.run(run_command(out), capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


# ------------------------------------------------------------------ 1. one writer per run folder

def test_second_run_on_a_running_folder_is_refused_and_summary_says_running(tmp_path):
    out = tmp_path / 'run'
    first = subprocess.Popen(run_command(out), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        wait_for(lambda: (out / 'config.json').exists() or first.poll() is not None, 'the first run to start')
        assert first.poll() is None, first.stderr.read()
        os.killpg(first.pid, signal.SIGSTOP)                  # it stays "running" for as long as the test needs
        second = subprocess.run(run_command(out), capture_output=True, text=True, env=ENV, timeout=180)
        assert second.returncode == 2, second.stderr[-2000:]
        lines = error_lines(second.stderr)
        assert len(lines) == 1 and f'process {first.pid}' in lines[0] and str(out) in lines[0], second.stderr
        s = tmas('runs', 'summary', out)
        assert s.returncode == 0, s.stderr
        assert f'running (process {first.pid})' in s.stdout and 'Rerun' not in s.stdout + s.stderr, s.stdout + s.stderr
        j = tmas('runs', 'summary', out, '--json')
        assert j.returncode == 0 and json.loads(j.stdout)['running_pid'] == first.pid, j.stdout + j.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL); first.wait(30)


def test_lock_of_a_run_killed_by_sigkill_is_taken_over(tmp_path):
    from tmas_nb.core import lock_holder
    out = tmp_path / 'run'
    victim = subprocess.Popen(run_command(out, iterations=2), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        wait_for(lambda: lock_holder(out) == victim.pid or victim.poll() is not None, 'the run to take its lock')
        assert victim.poll() is None, victim.stderr.read()
        os.kill(victim.pid, signal.SIGKILL); victim.wait(30)
        assert (out / '.lock').read_text().split() == [str(victim.pid)]   # the dead process's PID is still written there
        assert lock_holder(out) is None
    finally:
        try: os.killpg(victim.pid, signal.SIGKILL)
        except ProcessLookupError: pass
    again = subprocess.run(run_command(out, iterations=2), capture_output=True, text=True, env=ENV, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / 'status.json').read_text())['complete'] is True


def test_lock_is_not_held_by_forked_children_of_a_killed_holder(tmp_path):
    "Forked workers (the grading pool) outlive a process killed by SIGKILL; they must not keep its lock."
    from tmas_nb.core import lock_holder
    code = ('import os, signal, sys, time\nfrom tmas_nb.core import folder_lock\n'
            f'with folder_lock({str(tmp_path)!r}):\n'
            '    child = os.fork()\n'
            '    if child == 0:\n'
            '        null = os.open(os.devnull, os.O_WRONLY); os.dup2(null, 1); os.dup2(null, 2)   # let the test read EOF\n'
            '        time.sleep(60); os._exit(0)\n'
            '    print(child, flush=True); os.kill(os.getpid(), signal.SIGKILL)\n')
    p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=ENV, timeout=60)
    child = int(p.stdout.split()[0])
    try:
        os.kill(child, 0)                                     # the child is alive
        assert lock_holder(tmp_path) is None
    finally:
        os.kill(child, signal.SIGKILL)


def test_discover_rl_train_and_judge_refuse_a_locked_folder(tmp_path):
    from tmas_nb.autotts.discovery import synthetic_store
    from tmas_nb.autotts.authors_api import store_records
    store = tmp_path / 'syn.json'
    store.write_text(json.dumps(store_records(synthetic_store())))
    for name, args in [('discover', ['discover', '--proposer', 'smollm2', '--rounds', '1', '--train', store,
                                     '--seeds', '1', '--max-new-tokens', '4']),
                       ('train', ['rl', 'train', '--task', 'toy', '--max-steps', '1', '--threads', '1']),
                       ('judge', ['judge', None, '--judge', 'smollm2', '--repeats', '1'])]:
        folder = tmp_path / name
        holder = hold_lock(folder)
        try:
            if name == 'judge':               # judging writes into a run folder: not while its writer holds it
                (folder / 'config.json').write_text('{}')
                r = tmas(*[folder if a is None else a for a in args], timeout=120)
            else: r = tmas(*args, '--out', folder, timeout=120)
            assert r.returncode == 2, r.stderr[-2000:]
            lines = error_lines(r.stderr)
            assert len(lines) == 1 and f'process {holder.pid}' in lines[0], r.stderr
        finally:
            holder.kill(); holder.wait()


# ------------------------------------------------------------------ 2. corrupt cache or records: refused, nothing written

@pytest.mark.parametrize('damage', ['garbage', 'truncated'])
def test_corrupt_call_cache_is_refused_without_touching_the_run_then_rebuilt(finished_run, tmp_path, damage):
    out = tmp_path / 'run'; shutil.copytree(finished_run, out)
    cache = out / 'calls.sqlite'
    body = cache.read_bytes()
    cache.write_bytes(os.urandom(5000) if damage == 'garbage' else body[:len(body) // 2])
    before = snapshot(out)
    r = subprocess.run(run_command(out), capture_output=True, text=True, env=ENV, timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and str(cache) in lines[0] and f'mv {cache} {cache}.bad' in lines[0], r.stderr
    assert snapshot(out) == before                            # status.json still says complete
    assert json.loads((out / 'status.json').read_text())['complete'] is True
    records = pd.read_parquet(out / 'records.parquet')
    cache.rename(out / 'calls.sqlite.bad')                    # what the message says to do
    again = subprocess.run(run_command(out), capture_output=True, text=True, env=ENV, timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    st = json.loads((out / 'status.json').read_text())
    assert st['complete'] is True and st['last_invocation_cache'] == {'hits': 0, 'misses': 0, 'model_loaded': False}
    pd.testing.assert_frame_equal(pd.read_parquet(out / 'records.parquet'), records)


def test_garbage_records_are_refused_without_touching_the_run(finished_run, tmp_path):
    out = tmp_path / 'run'; shutil.copytree(finished_run, out)
    records = pd.read_parquet(out / 'records.parquet')
    (out / 'records.parquet').write_bytes(b'<html>not a parquet file</html>')
    before = snapshot(out)
    r = subprocess.run(run_command(out), capture_output=True, text=True, env=ENV, timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and str(out / 'records.parquet') in lines[0] and 'mv ' in lines[0], r.stderr
    assert snapshot(out) == before
    (out / 'records.parquet').rename(out / 'records.parquet.bad')
    again = subprocess.run(run_command(out), capture_output=True, text=True, env=ENV, timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    pd.testing.assert_frame_equal(pd.read_parquet(out / 'records.parquet'), records)


# ------------------------------------------------------------------ 3. tmas grade

@pytest.mark.parametrize('timeout', ['0', '-1', 'nan'])
def test_grade_refuses_a_timeout_that_is_not_positive(timeout, capsys):
    from tmas_nb.cli import main
    assert main(['grade', '--gold', '42', '--pred', r'\boxed{42}', '--timeout', timeout]) == 2
    cap = capsys.readouterr()
    assert cap.out == '' and error_lines(cap.err) == [f'tmas: error: --timeout {timeout}: give a number of seconds greater than 0']


def test_grade_of_a_100kb_prediction_echoes_a_short_excerpt_once(tmp_path):
    pred = r'\boxed{' + '1+' * 50_000 + '1}'                 # 100 kB; math-verify gives up parsing it
    t0 = time.time()
    r = tmas('grade', '--gold', '42', '--pred', '-', '--timeout', '2', stdin=pred, timeout=90)
    assert r.returncode == 0 and r.stdout.strip() == 'false', r.stderr[-500:]
    assert len(r.stderr) < 1000, f'{len(r.stderr)} characters on stderr'
    assert r.stderr.count('Timeout during parsing') <= 1, r.stderr    # once at most, as an excerpt
    assert r.stderr.count('Timeout during parsing') == r.stderr.count('(100,027 characters)'), r.stderr
    assert time.time() - t0 < 60


# ------------------------------------------------------------------ 4. a mirror serving a shorter file

class Mirror:
    def __init__(self, root, log, *extra):
        self.proc = subprocess.Popen([sys.executable, str(HERE / 'loopback_mirror.py'), str(root), str(log), *extra],
                                     stdout=subprocess.PIPE, text=True)
        self.url, self.log = f'http://127.0.0.1:{int(self.proc.stdout.readline())}', Path(log)
    def gets(self): return [l for l in self.log.read_text().splitlines() if l.startswith('GET')] if self.log.exists() else []
    def __enter__(self): return self
    def __exit__(self, *a): self.proc.kill(); self.proc.wait()


@pytest.mark.parametrize('framing', ['content-length', 'connection-close'])
def test_fetch_of_a_shorter_file_is_refused_at_once_keeping_nothing(data_root, tmp_path, framing):
    mirror = tmp_path / 'mirror'
    [link] = make_mirror(mirror, ['imo-answerbench'], data_root)
    body = link.read_bytes(); link.unlink()
    link.write_bytes(body[:len(body) // 3])                   # a truncated copy
    f = REGISTRY['imo_answerbench'].files[0]
    dest = tmp_path / 'data'
    extra = ['--no-length'] if framing == 'connection-close' else []
    t0 = time.time()
    with Mirror(mirror, tmp_path / 'log', *extra) as m:
        r = tmas('data', 'fetch', 'imo-answerbench', '--dest', dest, '--mirror', m.url, '--quiet', timeout=120)
        gets = m.gets()
    assert r.returncode == 2, r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and f.path in lines[0] and str(f.size) in lines[0] and str(len(body) // 3) in lines[0], r.stderr
    assert 'network' not in lines[0]
    assert len(gets) == 1, gets                                # no retries
    assert [p for p in dest.rglob('*') if p.is_file()] == [] if dest.exists() else True
    assert time.time() - t0 < 30


# ------------------------------------------------------------------ 5. smaller checks

def test_data_dir_that_is_a_file_says_so(tmp_path):
    f = tmp_path / 'not_a_folder.json'; f.write_text('{}')
    for args in [('replay', 'eval', '--data-dir', f, '--model', 'Qwen3-0.6B', '--benchmark', 'aime24', '--controller', 'sc:k=4'),
                 ('data', 'list', '--data-dir', f)]:
        r = tmas(*args, timeout=60)
        assert r.returncode == 2, (args, r.stdout[-500:], r.stderr)
        lines = error_lines(r.stderr)
        assert len(lines) == 1 and f'{f} is a file, not a folder' in lines[0] and 'does not exist' not in lines[0], r.stderr


def test_discover_rounds_are_strict_json(tmp_path):
    from tmas_nb.autotts.discovery import DiscoveryConfig, ScriptedLLM, run_discovery, synthetic_store
    from tmas_nb.autotts.authors_api import store_records
    store = tmp_path / 'syn.json'
    store.write_text(json.dumps(store_records(synthetic_store())))
    out = tmp_path / 'disc'
    run_discovery(ScriptedLLM(["I don't know.", 'notes']), DiscoveryConfig(rounds=1, train=[str(store)], seeds=1),
                  out, progress=False)
    def refuse(name): raise ValueError(f'bare {name} in JSON')
    [line] = (out / 'rounds.jsonl').read_text().splitlines()
    rec = json.loads(line, parse_constant=refuse)
    assert rec['status'] == 'no_code' and rec['error']
    for p in [out / 'selection.json', out / 'summary.json']:
        json.loads(p.read_text(), parse_constant=refuse)


def test_atomic_writes_get_the_mode_open_would_give(tmp_path):
    code = ('import os, sys\nfrom tmas_nb.core import atomic_write_text\n'
            'os.umask(int(sys.argv[2], 8)); p = atomic_write_text(sys.argv[1], "x")\n'
            'print(oct(os.stat(p).st_mode & 0o777))\n')
    def mode(path, umask):
        r = subprocess.run([sys.executable, '-c', code, str(path), umask], capture_output=True, text=True, env=ENV, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()
    assert mode(tmp_path / 'a.json', '022') == '0o644'
    assert mode(tmp_path / 'b.json', '077') == '0o600'
    os.chmod(tmp_path / 'a.json', 0o640)
    assert mode(tmp_path / 'a.json', '022') == '0o640'         # rewriting a file keeps its mode, as open() does
