"""Calls in flight from `tmas run --backend openai`: `--requests-in-flight`, and its default of problems x candidates.

A small threaded server on 127.0.0.1 answers every chat call after a pause and keeps the most calls it held at once.
"""
import http.server, json, os, subprocess, sys, threading, time
from pathlib import Path

import pytest

PAUSE = 2.0


class _Slow(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    lock, now, most, calls = threading.Lock(), 0, 0, 0
    fail_first = 0                      # the first this many chat calls are answered with HTTP 500 (retried by the client)

    def log_message(self, *a): pass

    def reply(self, out):
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header('Content-Type', 'application/json'); self.send_header('Content-Length', str(len(data)))
        self.end_headers(); self.wfile.write(data)

    def do_GET(self): self.reply({'object': 'list', 'data': [{'id': 'slow'}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
        cls = type(self)
        with cls.lock: cls.now += 1; cls.most = max(cls.most, cls.now); cls.calls += 1; k = cls.calls
        time.sleep(PAUSE)
        with cls.lock: cls.now -= 1
        if k <= cls.fail_first:
            data = b'{"error": {"message": "busy"}}'
            self.send_response(500); self.send_header('Content-Length', str(len(data))); self.end_headers()
            self.wfile.write(data); return
        n = body.get('n', 1)
        self.reply({'model': 'slow', 'choices': [{'index': i, 'finish_reason': 'stop', 'completion_tokens': 3,
                                                  'message': {'role': 'assistant', 'content': 'so \\boxed{1}'}} for i in range(n)],
                    'usage': {'prompt_tokens': 5, 'completion_tokens': 3 * n}})


@pytest.fixture
def slow():
    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), _Slow)
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True); th.start()
    yield f'http://127.0.0.1:{srv.server_address[1]}/v1'
    srv.shutdown(); srv.server_close()


def _run(url, out, data_root, *flags, quiet=True, stderr=False):
    _Slow.most = _Slow.calls = 0
    cmd = [sys.executable, '-m', 'tmas_nb.cli', 'run', '--method', 'sampling', '--benchmark', 'demo', '--limit', '20',
           '--n-candidates', '2', '--iterations', '1', '--max-new-tokens', '8', '--concurrency', '20',
           '--backend', 'openai', '--base-url', url, *(['--quiet'] if quiet else []), '--out', str(out), *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, 'TMAS_DATA_DIR': str(data_root)})
    assert p.returncode == 0, p.stderr[-3000:]
    return (_Slow.most, _Slow.calls) + ((p.stderr,) if stderr else ())


def test_requests_in_flight(slow, tmp_path, data_root):
    most, calls = _run(slow, tmp_path / 'capped', data_root, '--requests-in-flight', '3')
    assert calls == 20 and most == 3                    # twenty problems ready at once, three calls on the wire
    most, calls = _run(slow, tmp_path / 'default', data_root)
    assert calls == 20 and most > 16                    # the default lets every problem's call go at once (it was 16 at most)


def test_a_run_logs_one_progress_line_per_interval(slow, tmp_path, data_root):
    """With stderr a log file (not a terminal), `tmas run` prints a plain progress line every --progress-every seconds:
    problems done, calls, calls in flight, calls/s, tokens/s, errors retried, time left; status.json carries the same.
    The server holds each call 2 s and refuses the first three with HTTP 500 (retried)."""
    import re
    _Slow.fail_first = 3
    try: most, calls, err = _run(slow, tmp_path / 'r', data_root, '--progress-every', '0.5', quiet=False, stderr=True)
    finally: _Slow.fail_first = 0
    assert calls == 23                                                  # 20 answered + 3 refused and retried
    lines = [l for l in err.splitlines() if l.startswith('sampling (20 problems) [')]
    assert len(lines) >= 3 and '\r' not in err, err[-3000:]
    pat = re.compile(r'problems (\d+)/20 \| calls (\d+)/20 \| (\d+) in flight \| [\d.]+ calls/s \| [\d.]+ tokens/s \| '
                     r'retried (\d+) \| cut \d+/\d+ \| left ')
    got = [pat.search(l) for l in lines]
    assert all(got), lines
    in_flight = [int(m.group(3)) for m in got]
    assert max(in_flight) >= 10, lines                                  # the twenty problems' calls held by the server at once
    # at least the three refusals; a loaded machine may add retried transport errors (a kept-alive connection closed)
    assert int(got[-1].group(4)) >= 3, lines
    st = json.loads((tmp_path / 'r' / 'status.json').read_text())['progress']
    assert (st['problems_done'], st['problems'], st['calls'], st['calls_in_flight']) == (20, 20, 20, 0), st
    assert st['retried'] == int(got[-1].group(4)), (st, lines[-1])
    assert st['iterations_done'] == st['iterations_planned'] == 20 and st['calls_per_s'] > 0


def test_a_command_imports_only_its_own_module():
    """A resumed run pays the command line's start-up again: `tmas run` must not import every other command's module
    (the replay evaluation alone pulls in scipy.stats, seconds on a loaded machine)."""
    code = ("import sys; from tmas_nb.cli import build_parser, command_named; "
            "assert command_named(['runs', 'summary', 'R']) == 'runs summary' and command_named(['--help']) is None; "
            "build_parser(command_named(['run', '--method', 'tmas'])); "
            "print(sorted(m for m in ('tmas_nb.autotts.evaluation', 'tmas_nb.autotts.discovery', 'tmas_nb.rl.train', 'tmas_nb.runs.start') if m in sys.modules))")
    p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split('\n')[0] == "['tmas_nb.runs.start']"


def _reads_of_checkpoints(monkeypatch):
    "Count, per checkpoint file, how often it is read (every checkpoint read goes through `methods.read_untrusted_json`)."
    import collections
    from tmas_nb.methods import solve as methods
    reads, orig = collections.Counter(), methods.read_untrusted_json
    def counting(path, *a, **kw):
        if Path(path).name.startswith('iter_'): reads[str(path)] += 1
        return orig(path, *a, **kw)
    monkeypatch.setattr(methods, 'read_untrusted_json', counting)
    return reads


def test_a_resumed_run_reads_each_checkpoint_once(tmp_path, monkeypatch):
    """Resuming reads each checkpoint once to write the run's files, and a problem's last one again for its state: a
    run of P problems x T iterations reads P*T + P files, not 3*P*T (the problems' own reads, then the records and the
    calls each read everything again). The scripted model only stands in for the control flow."""
    from helpers import ScriptedLLM, REPLIES
    from tmas_nb.llm.core import run_sync
    from tmas_nb.data.benchmarks import demo_problems
    from tmas_nb.methods.tmas import TMASConfig
    from tmas_nb.runs.start import start_run
    probs, cfg = demo_problems()[:3], TMASConfig(n_candidates=2, n_verifications=2, iterations=2, embedder='hashing', max_new_tokens=16)
    run = lambda: run_sync(start_run('tmas', probs, cfg, tmp_path / 'run', llm=ScriptedLLM(REPLIES), progress=False))
    first = run()
    files = sorted((tmp_path / 'run' / 'checkpoints').rglob('iter_*.json'))
    assert len(files) == 2 * len(probs) and len(first.records) == 2 * 2 * len(probs)
    reads = _reads_of_checkpoints(monkeypatch)
    again = run()                                            # a finished run opened again: nothing to ask the model
    assert sum(reads.values()) == len(files) + len(probs) and max(reads.values()) <= 2, dict(reads)
    assert again.records.equals(first.records)
    for p in (tmp_path / 'run' / 'checkpoints').iterdir(): (p / 'iter_1.json').unlink()   # killed before the last iteration
    reads.clear()
    resumed = run()
    assert sum(reads.values()) == len(probs) + 2 * len(probs), dict(reads)   # the last one kept per problem, then all at the end
    assert resumed.records.drop(columns='wall_s').equals(first.records.drop(columns='wall_s'))
