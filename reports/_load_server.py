"""A loopback OpenAI-compatible server and a bare client, for the scale benchmark only (never to prove a feature).

The server answers `/v1/chat/completions` and `/v1/completions` after a fixed latency with deterministic text: per
sample, `tokens` filler words (one word is one token) then a boxed answer, both chosen by the request's seed and the
sample's index, so a rerun gets the same text. The reply suits the role named in the `X-TMAS-Role` header: a
`Score: 1` line for verifications, a JSON object for the memory and distillation agents, a boxed answer otherwise.
It honours `n` and `max_tokens` (a sample longer than the limit is cut there and ends by `length`), reports
per-choice `completion_tokens` (off with `--no-per-choice`, as vLLM), counts requests per path and role at
`GET /stats`, keeps the most requests it had in flight, and fails a given share of requests with HTTP 500, HTTP 429
or a dropped connection, drawn from its own seeded generator.

It speaks HTTP/1.1 with keep-alive on plain asyncio streams: a parser of its own, so that the server is cheap next
to the client it measures.

    python reports/_load_server.py serve --port 0 --port-file P [--latency 0.05] [--tokens 500] [--fail-500 0.01] ...
    python reports/_load_server.py raw --url http://127.0.0.1:PORT/v1 --calls 5000 --in-flight 800 [--n 1]
"""
from __future__ import annotations
import argparse, asyncio, hashlib, json, os, random, sys, time
from dataclasses import dataclass, asdict

ANSWER_CHOICES = 4          # boxed answers cycle over this many values: majority votes and clusters have work to do
_WORDS = [f'w{i}' for i in range(997)]


@dataclass
class LoadSettings:
    "How the load server answers."
    latency: float = 0.0          # seconds before each answer
    tokens: int = 500             # filler tokens per sample before its answer
    fail_500: float = 0.0         # share of completion requests answered with HTTP 500
    fail_429: float = 0.0         # ... with HTTP 429 (Retry-After: 0)
    drop: float = 0.0             # ... whose connection is closed without an answer
    per_choice: bool = True       # per-choice completion_tokens (as tmas serve); off: only the total (as vLLM)
    seed: int = 0                 # seed of the failure draws
    model: str = 'load-fixture'
    tokenize: bool = True         # answer /tokenize (one id per word); off: 404, as a server without that route


def filler(tokens: int, offset: int) -> str:
    "`tokens` filler words starting at `offset` in a fixed word list."
    return ' '.join(_WORDS[(offset + i) % len(_WORDS)] for i in range(tokens))


def sample_text(role: str, seed: int, index: int, tokens: int) -> str:
    "The deterministic text of one sample of `role`."
    k = (seed + index) % ANSWER_CHOICES
    body = filler(tokens, seed * 31 + index)
    if role == 'verification': return f'{body}\nScore: 1'
    if role == 'experience':
        return json.dumps({'verified_anchors': [f'anchor {k} {body[:80]}'], 'error_avoidance_heuristics': [f'avoid {k}']})
    if role == 'guideline': return json.dumps({'updated_guidelines': [f'guideline {seed % 97} {body[:80]}']})
    if role.startswith('distill'):
        return json.dumps({'verified_propositions': [f'proposition {seed % 89} {body[:80]}'], 'critical_pitfalls': [f'pitfall {k}']})
    if role == 'summary': return f'{body}\nThe candidate concludes \\boxed{{{k}}}.'
    return f'{body}\nSo the answer is \\boxed{{{k}}}.'


def _request_seed(body: dict) -> int:
    "The request's seed, or one from its content when it has none."
    if body.get('seed') is not None: return int(body['seed']) % (2 ** 31)
    blob = json.dumps(body.get('messages', body.get('prompt')), sort_keys=True).encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=4).digest(), 'little')


def completion_body(body: dict, role: str, s: LoadSettings, chat: bool) -> dict:
    "The response body for one completions request."
    n, limit, seed = int(body.get('n') or 1), body.get('max_completion_tokens') or body.get('max_tokens'), _request_seed(body)
    choices, total = [], 0
    for i in range(n):
        words = sample_text(role, seed, i, s.tokens).split(' ')
        cut = limit is not None and len(words) > int(limit)
        if cut: words = words[:int(limit)]
        text = ' '.join(words)
        total += len(words)
        ch = ({'index': i, 'message': {'role': 'assistant', 'content': text}} if chat else {'index': i, 'text': text})
        ch['finish_reason'] = 'length' if cut else 'stop'
        if s.per_choice: ch['completion_tokens'] = len(words)
        choices.append(ch)
    return {'id': f'load-{seed}', 'object': 'chat.completion' if chat else 'text_completion', 'model': s.model,
            'choices': choices, 'usage': {'prompt_tokens': 16, 'completion_tokens': total, 'total_tokens': 16 + total}}


class LoadServer:
    "The server's state: settings, request counts and the failure generator."
    def __init__(self, settings: LoadSettings):
        self.s, self.rng = settings, random.Random(settings.seed)
        self.counts = {'requests': 0, 'completions': 0, 'samples': 0, 'failed_500': 0, 'failed_429': 0, 'dropped': 0,
                       'by_role': {}, 'in_flight': 0, 'max_in_flight': 0}

    def stats(self) -> dict: return json.loads(json.dumps(self.counts))

    async def answer(self, method: str, path: str, headers: dict, raw: bytes):
        "(status, body, extra headers) for one request; status None drops the connection."
        c = self.counts
        c['requests'] += 1
        path = path.split('?', 1)[0]
        if method == 'GET' and path.endswith('/models'): return 200, {'object': 'list', 'data': [{'id': self.s.model}]}, {}
        if method == 'GET' and path in ('/stats', '/v1/stats'): return 200, self.stats(), {}
        if method == 'GET' and path == '/health': return 200, {'status': 'ok'}, {}
        if method == 'POST' and path in ('/stats/reset', '/v1/stats/reset'):
            for k in c: c[k] = {} if k == 'by_role' else 0
            return 200, {'ok': True}, {}
        if method == 'POST' and path == '/tokenize' and self.s.tokenize:
            return 200, {'tokens': list(range(len(json.loads(raw or b'{}').get('content', '').split())))}, {}
        if method != 'POST' or not path.endswith('/completions'): return 404, {'error': {'message': 'File Not Found'}}, {}
        c['in_flight'] += 1; c['max_in_flight'] = max(c['max_in_flight'], c['in_flight'])
        try:
            if self.s.latency: await asyncio.sleep(self.s.latency)
            x = self.rng.random()
            if x < self.s.drop: c['dropped'] += 1; return None, None, {}
            if x < self.s.drop + self.s.fail_500: c['failed_500'] += 1; return 500, {'error': {'message': 'load fixture: 500'}}, {}
            if x < self.s.drop + self.s.fail_500 + self.s.fail_429:
                c['failed_429'] += 1; return 429, {'error': {'message': 'load fixture: busy'}}, {'Retry-After': '0'}
            body = json.loads(raw)
            role = headers.get('x-tmas-role', 'solution')
            out = completion_body(body, role, self.s, chat=path.endswith('/chat/completions'))
            c['completions'] += 1; c['samples'] += len(out['choices'])
            c['by_role'][role] = c['by_role'].get(role, 0) + 1
            return 200, out, {}
        finally: c['in_flight'] -= 1

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        "Serve one keep-alive connection."
        try:
            while True:
                line = await reader.readline()
                if not line: break
                method, path, _ = line.decode('latin-1').split(' ', 2)
                headers = {}
                while True:
                    h = await reader.readline()
                    if h in (b'\r\n', b'\n', b''): break
                    k, _, v = h.decode('latin-1').partition(':'); headers[k.strip().lower()] = v.strip()
                raw = await reader.readexactly(int(headers.get('content-length') or 0))
                status, out, extra = await self.answer(method, path, headers, raw)
                if status is None: writer.transport.abort(); return
                data = json.dumps(out, separators=(',', ':')).encode()
                head = ''.join(f'{k}: {v}\r\n' for k, v in extra.items())
                writer.write(f'HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n'
                             f'{head}\r\n'.encode('latin-1') + data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError): pass
        finally:
            try: writer.close()
            except RuntimeError: pass


async def serve(settings: LoadSettings, port: int = 0, port_file: str | None = None):
    "Serve forever on 127.0.0.1:`port` (0: any free port, written to `port_file`)."
    srv = LoadServer(settings)
    server = await asyncio.start_server(srv.handle, '127.0.0.1', port, backlog=4096, limit=2 ** 24)
    port = server.sockets[0].getsockname()[1]
    if port_file:
        tmp = port_file + '.tmp'
        with open(tmp, 'w') as f: f.write(str(port))
        os.replace(tmp, port_file)
    print(port, flush=True)
    async with server: await server.serve_forever()


async def raw_client(url: str, calls: int, in_flight: int, n: int = 1, max_tokens: int = 100_000, prompt_chars: int = 2000) -> dict:
    "The anchor: `calls` chat requests through one httpx client, `in_flight` at a time, each answer parsed; no cache."
    import httpx
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    sem, done = asyncio.Semaphore(in_flight), 0
    prompt = filler(prompt_chars // 5, 0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        async def one(i):
            nonlocal done
            body = {'model': 'load-fixture', 'messages': [{'role': 'user', 'content': f'{i} {prompt}'}], 'n': n,
                    'seed': i, 'max_tokens': max_tokens, 'temperature': 1.0, 'top_p': 0.95}
            async with sem:
                for _ in range(20):
                    try:
                        r = await client.post('/chat/completions', json=body, headers={'X-TMAS-Role': 'solution'})
                    except httpx.TransportError: continue
                    if r.status_code == 200: break
            r.json(); done += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(calls)))
        return {'calls': done, 'wall_s': time.perf_counter() - t0}


class Fixture:
    "A load server in its own process (its CPU is not the client's); `url`, `stats()`, `reset()`, `close()`."
    def __init__(self, folder, **settings):
        import subprocess, pathlib
        self.folder = pathlib.Path(folder); self.folder.mkdir(parents=True, exist_ok=True)
        pf = self.folder / f'port-{time.monotonic_ns()}'
        args = [sys.executable, os.path.abspath(__file__), 'serve', '--port-file', str(pf)]
        for k, v in settings.items():
            if k == 'per_choice': args += [] if v else ['--no-per-choice']
            elif k == 'tokenize': args += [] if v else ['--no-tokenize']
            else: args += ['--' + k.replace('_', '-'), str(v)]
        self.log = open(self.folder / f'{pf.name}.log', 'wb')
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while not pf.exists():
            if self.proc.poll() is not None or time.monotonic() - t0 > 30: raise RuntimeError(f'the load server did not start: {args}')
            time.sleep(0.02)
        self.port = int(pf.read_text()); self.url = f'http://127.0.0.1:{self.port}/v1'

    def _get(self, path, method='GET'):
        import httpx
        return httpx.request(method, f'http://127.0.0.1:{self.port}{path}', timeout=30).json()

    def stats(self) -> dict: return self._get('/stats')
    def reset(self): self._get('/stats/reset', 'POST')
    def cpu_s(self) -> float:
        "CPU seconds the server process used so far."
        import psutil
        t = psutil.Process(self.proc.pid).cpu_times(); return t.user + t.system
    def close(self):
        self.proc.kill(); self.proc.wait(); self.log.close()
    def __enter__(self): return self
    def __exit__(self, *exc): self.close()


def measured(cmd: list[str], env: dict | None = None, kill_after: float | None = None, kill_when=None) -> dict:
    "Run `cmd` and return its wall time, CPU time and peak RSS; SIGKILL it after `kill_after` s or once `kill_when()` is true."
    import subprocess, signal, tempfile
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, **(env or {})})
        killed = False
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid: break
            if not killed and ((kill_after is not None and time.perf_counter() - t0 > kill_after) or (kill_when and kill_when())):
                os.kill(proc.pid, signal.SIGKILL); killed = True
            time.sleep(0.2 if kill_when else 0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0); err.seek(0)
        return {'rc': proc.returncode, 'killed': killed, 'wall_s': time.perf_counter() - t0,
                'cpu_s': ru.ru_utime + ru.ru_stime, 'peak_rss_mb': ru.ru_maxrss / 1024,
                'stdout': out.read().decode(errors='replace'), 'stderr': err.read().decode(errors='replace')}


def folder_bytes(path) -> int:
    "Bytes of the files under `path` (a file: its size; missing: 0)."
    import pathlib
    p = pathlib.Path(path)
    if p.is_file(): return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob('*') if f.is_file()) if p.is_dir() else 0


def run_disk(run_dir) -> dict:
    "Bytes on disk of a run folder's parts: the call cache, checkpoints (the records), banks, the finished files."
    import pathlib
    d = pathlib.Path(run_dir)
    return {'calls_sqlite': sum(folder_bytes(d / f) for f in ('calls.sqlite', 'calls.sqlite-wal', 'calls.sqlite-shm')),
            'checkpoints': folder_bytes(d / 'checkpoints'), 'banks': folder_bytes(d / 'banks'),
            'records_parquet': folder_bytes(d / 'records.parquet'), 'banks_parquet': folder_bytes(d / 'banks.parquet')}


def tmas_run(url: str, method: str, problems: int, iterations: int, out, concurrency: int, in_flight: int | None = None,
             width: tuple[int, int] = (8, 8), kill_when=None, extra: tuple = ()) -> dict:
    "`tmas run --backend openai` against `url`, measured (see `measured`); `width` is (N, M) for tmas, (K, -) for rse."
    import pathlib
    cfg = pathlib.Path(out).parent / 'hashing.json'
    cfg.write_text(json.dumps({'embedder': 'hashing'}))
    cmd = [sys.executable, '-m', 'tmas_nb.cli', 'run', '--method', method, '--benchmark', 'imo_answerbench',
           '--limit', str(problems), '--iterations', str(iterations), '--n-candidates', str(width[0]),
           '--max-new-tokens', '128000', '--backend', 'openai', '--base-url', url, '--concurrency', str(concurrency),
           '--config', str(cfg), '--quiet', '--out', str(out), *extra]
    if method == 'tmas': cmd += ['--n-verifications', str(width[1])]
    if in_flight is not None: cmd += ['--requests-in-flight', str(in_flight)]
    return measured(cmd, env={'OMP_NUM_THREADS': '1'}, kill_when=kill_when)


async def backend_client(url: str, calls: int, in_flight: int, n: int = 1, prompt_chars: int = 2000) -> dict:
    "The same calls as `raw_client` through `OpenAIBackend` (no cache): what our HTTP layer costs by itself."
    from tmas_nb.llm.core import Request
    from tmas_nb.llm.openai_backend import OpenAIBackend
    llm = OpenAIBackend('load-fixture', base_url=url, max_concurrency=in_flight, discover=False)
    prompt = filler(prompt_chars // 5, 0)
    reqs = [Request.from_prompt(f'{i} {prompt}', n=n, seed=i, max_new_tokens=100_000, top_p=0.95) for i in range(calls)]
    t0 = time.perf_counter()
    out = await llm.generate(reqs)
    await llm.aclose()
    return {'calls': len(out), 'wall_s': time.perf_counter() - t0}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = p.add_subparsers(dest='cmd', required=True)
    s = sub.add_parser('serve')
    s.add_argument('--port', type=int, default=0); s.add_argument('--port-file')
    for f in ('latency', 'fail_500', 'fail_429', 'drop'): s.add_argument('--' + f.replace('_', '-'), type=float, default=0.0)
    s.add_argument('--tokens', type=int, default=500); s.add_argument('--seed', type=int, default=0)
    s.add_argument('--no-per-choice', action='store_true'); s.add_argument('--model', default='load-fixture')
    s.add_argument('--no-tokenize', action='store_true')
    r = sub.add_parser('raw'); b = sub.add_parser('backend')
    r.add_argument('--url', required=True); r.add_argument('--calls', type=int, required=True)
    r.add_argument('--in-flight', type=int, default=100); r.add_argument('--n', type=int, default=1)
    r.add_argument('--prompt-chars', type=int, default=2000)
    for f, t, d in (('--url', str, None), ('--calls', int, None), ('--in-flight', int, 100), ('--n', int, 1), ('--prompt-chars', int, 2000)):
        b.add_argument(f, type=t, default=d, required=d is None)
    a = p.parse_args(argv)
    if a.cmd == 'serve':
        st = LoadSettings(a.latency, a.tokens, a.fail_500, a.fail_429, a.drop, not a.no_per_choice, a.seed, a.model, not a.no_tokenize)
        asyncio.run(serve(st, a.port, a.port_file))
    else:
        client = raw_client if a.cmd == 'raw' else backend_client
        out = asyncio.run(client(a.url, a.calls, a.in_flight, a.n, prompt_chars=a.prompt_chars))
        print(json.dumps(out))


if __name__ == '__main__':
    main()
