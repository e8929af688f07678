"""A static file server for the `tmas data fetch` tests: serves a folder on loopback, honours `Range: bytes=N-`,
logs every request, and can kill its own process part-way through a response body, or send a body without
Content-Length (ended by closing the connection, as some servers do).

Run as `python loopback_mirror.py ROOT LOG [--port P] [--die-after BYTES] [--no-length]`; it prints its port on stdout.
"""
import argparse, os, signal, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def make_handler(root: Path, log: Path, die_after: int | None, no_length: bool = False):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = 'HTTP/1.1'

        def log_message(self, *a): pass

        def do_GET(self):
            rng = self.headers.get('Range', '')
            with open(log, 'a') as f: f.write(f"GET {self.path} {rng}\n")
            p = (root / self.path.lstrip('/')).resolve()
            if not p.is_file():
                self.send_response(404); self.send_header('Content-Length', '0'); self.end_headers(); return
            data = p.read_bytes()
            start = int(rng[len('bytes='):].split('-')[0]) if rng.startswith('bytes=') else 0
            if start >= len(data) and start:
                self.send_response(416); self.send_header('Content-Range', f'bytes */{len(data)}')
                self.send_header('Content-Length', '0'); self.end_headers(); return
            body = data[start:]
            self.send_response(206 if start else 200)
            if start: self.send_header('Content-Range', f'bytes {start}-{len(data) - 1}/{len(data)}')
            if no_length: self.send_header('Connection', 'close'); self.close_connection = True
            else: self.send_header('Content-Length', str(len(body)))
            self.send_header('Accept-Ranges', 'bytes')
            self.end_headers()
            if die_after is not None:
                self.wfile.write(body[:die_after]); self.wfile.flush()
                with open(log, 'a') as f: f.write(f"KILLED after {die_after} bytes\n")
                os.kill(os.getpid(), signal.SIGKILL)
            self.wfile.write(body)

    return Handler


if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('root'); ap.add_argument('log')
    ap.add_argument('--port', type=int, default=0)
    ap.add_argument('--die-after', type=int, default=None)
    ap.add_argument('--no-length', action='store_true')
    a = ap.parse_args()
    srv = ThreadingHTTPServer(('127.0.0.1', a.port), make_handler(Path(a.root), Path(a.log), a.die_after, a.no_length))
    print(srv.server_address[1], flush=True)
    srv.serve_forever()
