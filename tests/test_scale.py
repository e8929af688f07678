"""Calls in flight from `tmas run --backend openai`: `--requests-in-flight`, and its default of problems x candidates.

A small threaded server on 127.0.0.1 answers every chat call after a pause and keeps the most calls it held at once.
"""
import http.server, json, os, subprocess, sys, threading, time

import pytest

PAUSE = 2.0


class _Slow(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    lock, now, most, calls = threading.Lock(), 0, 0, 0

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
        with cls.lock: cls.now += 1; cls.most = max(cls.most, cls.now); cls.calls += 1
        time.sleep(PAUSE)
        with cls.lock: cls.now -= 1
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


def _run(url, out, data_root, *flags):
    _Slow.most = _Slow.calls = 0
    cmd = [sys.executable, '-m', 'tmas_nb.cli', 'run', '--method', 'sampling', '--benchmark', 'demo', '--limit', '20',
           '--n-candidates', '2', '--iterations', '1', '--max-new-tokens', '8', '--concurrency', '20',
           '--backend', 'openai', '--base-url', url, '--quiet', '--out', str(out), *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, 'TMAS_DATA_DIR': str(data_root)})
    assert p.returncode == 0, p.stderr[-3000:]
    return _Slow.most, _Slow.calls


def test_requests_in_flight(slow, tmp_path, data_root):
    most, calls = _run(slow, tmp_path / 'capped', data_root, '--requests-in-flight', '3')
    assert calls == 20 and most == 3                    # twenty problems ready at once, three calls on the wire
    most, calls = _run(slow, tmp_path / 'default', data_root)
    assert calls == 20 and most > 16                    # the default lets every problem's call go at once (it was 16 at most)


def test_a_command_imports_only_its_own_module():
    """A resumed run pays the command line's start-up again: `tmas run` must not import every other command's module
    (the replay evaluation alone pulls in scipy.stats, seconds on a loaded machine)."""
    code = ("import sys; from tmas_nb.cli import build_parser, command_named; "
            "assert command_named(['runs', 'summary', 'R']) == 'runs summary' and command_named(['--help']) is None; "
            "build_parser(command_named(['run', '--method', 'tmas'])); "
            "print(sorted(m for m in ('tmas_nb.replay.evaluation', 'tmas_nb.discovery', 'tmas_nb.rl', 'tmas_nb.runs') if m in sys.modules))")
    p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split('\n')[0] == "['tmas_nb.runs']"
