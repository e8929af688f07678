"""OpenAIBackend against a real OpenAI-compatible server (tmas_nb.llm.server with SmolLM2-135M) on 127.0.0.1.

The server runs as a subprocess; the failure tests kill it with SIGKILL and start it again on the same port.
"""
import asyncio, os, signal, socket, subprocess, sys, tempfile, time
from pathlib import Path

import httpx
import pytest

from tmas_nb.llm.core import Request
from tmas_nb.llm.loading import load_llm
from tmas_nb.llm.openai_backend import OpenAIBackend, LLMRequestError

MODEL = 'smollm2'
MAX_N = 4            # the server refuses n > 4 per call, so n > 4 exercises the client's split at the server's limit
READY_TIMEOUT = 300  # the first start converts the packaged GGUF model into the cache


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class Server:
    """A `python -m tmas_nb.cli serve` subprocess serving the small model on 127.0.0.1:port (with `flags` added);
    `preexec` runs in the child before it starts (to join a cgroup, to lower its file limit)."""
    def __init__(self, port: int, log_dir: Path, flags=('--max-n', str(MAX_N)), preexec=None):
        self.port, self.log = port, log_dir / f'server-{port}-{time.monotonic_ns()}.log'
        env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false'}
        self.t0 = time.monotonic()
        with open(self.log, 'wb') as f:
            self.proc = subprocess.Popen(
                [sys.executable, '-m', 'tmas_nb.cli', 'serve', '--model', MODEL, '--port', str(port),
                 '--threads', '1', *flags], stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec)

    @property
    def url(self) -> str: return f'http://127.0.0.1:{self.port}/v1'

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> float:
        "Seconds from start until /health answered; fails with the server's log if it never does."
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                pytest.fail(f'server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}')
            try:
                if httpx.get(f'http://127.0.0.1:{self.port}/health', timeout=1).status_code == 200:
                    return time.monotonic() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        pytest.fail(f'server not ready after {timeout}s:\n{self.log.read_text()[-3000:]}')

    def kill(self):
        "SIGKILL, as a crash or an OOM killer would."
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture(scope='module')
def log_dir():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


@pytest.fixture(scope='module')
def server(log_dir):
    s = Server(free_port(), log_dir)
    print(f'server ready in {s.wait_ready():.1f}s')
    yield s
    s.kill()


def ask(prompt, **kw):
    return Request.from_prompt(prompt, **kw)


def test_n_samples_usage_and_length(server):
    llm = OpenAIBackend(MODEL, base_url=server.url)
    out = llm.generate_sync([ask('Write a long story about a dragon.', n=3, max_new_tokens=5, role='solution'),
                             ask('Is 7 prime? Answer yes or no.', n=2, max_new_tokens=5, role='verification')])
    assert [len(cs) for cs in out] == [3, 2]
    assert llm.stats['http_calls'] == 2 and llm.stats['top_up_calls'] == 0    # all n samples from one call
    for c in out[0]:
        assert c.finish_reason == 'length' and c.completion_tokens == 5 and c.text
    for c in out[1]:
        assert 1 <= c.completion_tokens <= 5 and c.finish_reason in ('stop', 'length')
    # exact per-sample counts (the server reports them); every sample carries its prompt's token count
    assert llm.stats['estimated_samples'] == 0 and llm.token_count_source == 'per_choice'
    assert llm.record()['token_sources'] == {'per_choice': 5}
    p = out[0][0].prompt_tokens
    assert p > 5 and [c.prompt_tokens for c in out[0]] == [p] * 3
    u = llm.usage.by_role
    assert (u['solution']['calls'], u['solution']['samples'], u['solution']['completion_tokens']) == (1, 3, 15)
    assert u['solution']['prompt_tokens'] == 3 * p
    assert (u['verification']['calls'], u['verification']['samples']) == (1, 2)
    assert u['verification']['completion_tokens'] == sum(c.completion_tokens for c in out[1])
    # the server kept its own per-role account from the X-TMAS-Role header
    served = httpx.get(server.url + '/usage').json()['by_role']
    assert served['solution']['samples'] >= 3 and served['verification']['samples'] >= 2


def test_model_discovered_and_split_at_the_servers_n_limit(server):
    llm = load_llm(backend='openai', base_url=server.url)   # no model name: ask /v1/models
    assert isinstance(llm, OpenAIBackend)
    [cs] = llm.generate_sync([ask('Name a fruit.', n=6, max_new_tokens=3, seed=1)])
    assert llm.model_id == MODEL
    # the server refused n=6 with a 400 naming its limit; the client learnt it and asked for 4 + 2
    assert len(cs) == 6 and llm.n_per_call == MAX_N and llm.stats['n_refusals'] == 1 and llm.stats['top_up_calls'] == 0
    assert llm.usage.by_role['solution']['samples'] == 6
    r = httpx.post(server.url + '/chat/completions', json={'messages': [{'role': 'user', 'content': 'hi'}], 'n': 5})
    assert r.status_code == 400 and f'n must be at most {MAX_N}' in r.json()['error']['message']


def test_the_dry_run_reads_the_speed_the_server_published_and_a_name_it_refuses_is_one_line(server, tmp_path, capsys):
    """`tmas serve` measured its engine at start (these flags leave --default-max-tokens to it) and publishes the speed in
    GET /v1/models; `tmas run --dry-run` estimates the wall time from it without a call of its own. A `--model` the server
    refuses is one line naming what it serves, before any run folder exists."""
    from tmas_nb.cli import main
    card = httpx.get(server.url + '/models').json()['data'][0]
    assert card['tokens_per_s_source'] == 'measured at start' and float(card['tokens_per_s']['1']) > 0, card
    health = lambda: httpx.get(f'http://127.0.0.1:{server.port}/health').json()['requests']
    before = health()
    run = ['run', '--method', 'sampling', '--benchmark', 'demo', '--limit', '2', '--n-candidates', '2', '--max-new-tokens', '16',
           '--base-url', server.url]
    assert main([*run, '--model', MODEL, '--dry-run']) == 0
    out = capsys.readouterr().out
    assert "wall time: about " in out and "from the server's GET /v1/models (measured at start))" in out, out
    assert health() == before                                          # nothing timed: the server's own measurement
    assert main([*run, '--model', 'smollm', '--out', str(tmp_path / 'run')]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"tmas: error: --model smollm: the server at {server.url} serves {MODEL} and refuses this name (HTTP 404: The model "
                   f"`smollm` does not exist; this server serves `{MODEL}`); pass --model {MODEL} (did you mean it?) or leave --model "
                   "out to use the one it serves"), err
    assert not (tmp_path / 'run').exists()


def test_seeded_sampling_is_reproducible(server):
    llm = OpenAIBackend(MODEL, base_url=server.url)
    r = ask('Tell me a word.', n=2, max_new_tokens=6, temperature=1.0, seed=123)
    a, b = llm.generate_sync([r]), llm.generate_sync([r])
    assert [c.raw for c in a[0]] == [c.raw for c in b[0]]


def test_concurrent_requests_keep_their_order(server):
    prompts = [f'Repeat exactly: {w}' for w in ('apple', 'river', 'stone', 'cloud', 'green', 'seven')]
    llm = OpenAIBackend(MODEL, base_url=server.url, max_concurrency=3)
    together = llm.generate_sync([ask(p, temperature=0, max_new_tokens=6) for p in prompts])
    alone = [llm.generate_sync([ask(p, temperature=0, max_new_tokens=6)])[0] for p in prompts[:3]]
    assert [len(cs) for cs in together] == [1] * 6 and llm.stats['http_calls'] == 9
    # greedy outputs of the concurrent run line up with the one-by-one outputs of the same prompts
    assert [cs[0].raw for cs in together[:3]] == [cs[0].raw for cs in alone]
    assert llm.usage.by_role['solution']['calls'] == 9
    # the server saw three requests at once, never more: the client's concurrency limit
    assert httpx.get(f'http://127.0.0.1:{server.port}/health').json()['peak_in_flight'] == 3


def test_bad_request_fails_at_once(server):
    llm = OpenAIBackend(MODEL, base_url=server.url, extra_body={'top_p': 7}, backoff_base=5)
    with pytest.raises(LLMRequestError) as e:
        llm.generate_sync([ask('Hello there', role='judge')])
    assert (e.value.status_code, e.value.attempts, e.value.retryable, e.value.role) == (400, 1, False, 'judge')
    assert 'top_p' in str(e.value) and "'Hello there'" in str(e.value) and llm.stats['retries'] == 0
    wrong = OpenAIBackend('no-such-model', base_url=server.url)
    with pytest.raises(LLMRequestError, match='serves `smollm2`') as e:
        wrong.generate_sync([ask('Hello')])
    assert e.value.status_code == 404 and wrong.stats['retries'] == 0


def test_server_killed_mid_run_then_back_on_same_port(log_dir):
    port = free_port()
    first = Server(port, log_dir)
    first.wait_ready()
    requests = [ask(f'Write a long essay about the number {i}.', n=2, max_new_tokens=400, role='summary')
                for i in range(4)]

    # 1. kill -9 while requests are in flight; the server stays down: bounded retries, then a clear error
    impatient = OpenAIBackend(MODEL, base_url=first.url, max_retries=3, backoff_base=0.05, backoff_max=0.2)

    async def run_and_kill():
        job = asyncio.ensure_future(impatient.generate(requests))
        while impatient.stats['http_calls'] < len(requests):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        first.kill()
        try: return await job
        finally: await impatient.aclose()

    with pytest.raises(LLMRequestError) as e:
        asyncio.run(run_and_kill())
    err = e.value
    assert err.retryable and err.attempts == 4 and err.role == 'summary'
    assert 'gave up after 4 attempts' in str(err) and 'Write a long essay about the number' in str(err)
    assert 'Error' in err.last_error                      # the transport error that ended it (connection refused/reset)
    assert impatient.stats['retries'] >= 3
    kinds = {e.split(':')[0] for _, _, e in impatient.errors}
    # requests cut off mid-generation (the connection dropped), then refused connections while the server is down
    assert kinds & {'RemoteProtocolError', 'ReadError'} and 'ConnectError' in kinds, kinds
    print('retries before giving up:', impatient.stats['retries'], '| last error:', err.last_error)

    # 2. the server comes back on the same port while the client is backing off: the requests succeed
    # (no model name: the server is down now, so the name is looked up, with retries, on the first call)
    patient = OpenAIBackend(base_url=first.url, max_retries=40, backoff_base=0.5, backoff_max=2.0)
    assert patient.model is None
    second = None

    async def restart_while_waiting():
        nonlocal second
        job = asyncio.ensure_future(patient.generate([ask('Say hello.', n=2, max_new_tokens=4, role='summary')]))
        while patient.stats['retries'] < 2:
            await asyncio.sleep(0.05)
        second = Server(port, log_dir)
        try: return await job
        finally: await patient.aclose()

    try:
        [cs] = asyncio.run(restart_while_waiting())
        assert len(cs) == 2 and all(c.completion_tokens > 0 for c in cs)
        assert patient.stats['retries'] >= 2 and patient.stats['failures'] == 0 and patient.model_id == MODEL
        print('retries until the restarted server answered:', patient.stats['retries'])
    finally:
        if second is not None:
            second.kill()


def test_against_transformers_serve(server, log_dir):
    """A server we did not write: `transformers serve` ignores `n` (one choice per call), so the client tops up."""
    from tmas_nb.llm.models import resolve_model
    folder = resolve_model(MODEL)                       # the converted folder (made by the `server` fixture)
    port = free_port()
    log = log_dir / 'transformers-serve.log'
    exe = Path(sys.executable).with_name('transformers')
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'OMP_NUM_THREADS': '1'}
    with open(log, 'wb') as f:
        proc = subprocess.Popen([str(exe), 'serve', folder, '--host', '127.0.0.1', '--port', str(port),
                                 '--device', 'cpu', '--dtype', 'float32'], stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, f'transformers serve exited:\n{log.read_text()[-3000:]}'
            assert time.monotonic() - t0 < 180, f'transformers serve not ready:\n{log.read_text()[-3000:]}'
            try:
                if httpx.get(f'http://127.0.0.1:{port}/v1/models', timeout=1).status_code == 200: break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        print(f'transformers serve ready in {time.monotonic() - t0:.1f}s')
        llm = OpenAIBackend(folder, base_url=f'http://127.0.0.1:{port}/v1')
        [cs] = llm.generate_sync([ask('Name a colour.', n=3, max_new_tokens=4, seed=7, role='experience')])
        assert len(cs) == 3 and all(c.completion_tokens > 0 and c.prompt_tokens > 0 for c in cs)
        u = llm.usage.by_role['experience']
        assert (u['calls'], u['samples']) == (1, 3)
        print('n per call answered by transformers serve:', llm.n_per_call, '| http calls:', llm.stats['http_calls'])
        assert llm.stats['http_calls'] == 1 or (llm.n_per_call == 1 and llm.stats['top_up_calls'] == 2)
    finally:
        proc.kill(); proc.wait(timeout=30)


# ---------------------------------------------------------------------------------------------------------------
# A server that misreports like llama-server: `usage.completion_tokens` counts only the first choice, `n` above its
# slots is refused with llama-server's own message, and `POST /tokenize` counts with the model's real tokenizer.
# Its answers are word salads of seeded random lengths, so every choice has a different, known token count.

SLOTS = 8
SERVED_NAME = 'misreporting/model-q4.gguf'
WORDS = 'the answer is seven because two plus five gives seven and nothing else'.split()


class Misreporting:
    "A FastAPI/uvicorn OpenAI-style server on 127.0.0.1 (in a thread) with llama-server's token and `n` behaviour."
    def __init__(self, tokenize: bool = True):
        import threading, random
        import uvicorn
        from fastapi import FastAPI, Request as HTTPRequest
        from fastapi.responses import JSONResponse
        from transformers import AutoTokenizer
        from tmas_nb.llm.models import resolve_model
        self.tok = AutoTokenizer.from_pretrained(resolve_model(MODEL))
        self.seen, self.true_completion_tokens = [], 0
        tokenize_on = tokenize
        app = FastAPI()

        def count(text): return len(self.tok.encode(text, add_special_tokens=False))

        @app.get('/v1/models')
        async def models(): return {'object': 'list', 'data': [{'id': SERVED_NAME, 'object': 'model'}]}

        async def tokenize(request: HTTPRequest):
            if not tokenize_on: return JSONResponse({'error': 'File Not Found'}, status_code=404)
            body = await request.json()
            return {'tokens': self.tok.encode(body['content'], add_special_tokens=False)}

        async def chat(request: HTTPRequest):
            body = await request.json()
            n = body.get('n', 1)
            self.seen.append((n, body.get('seed')))
            if n > SLOTS:
                return JSONResponse({'error': {'code': 400, 'type': 'invalid_request_error', 'message':
                                     f"Field 'n': Value must be between 1 <= value <= {SLOTS}, but got {n}"}}, status_code=400)
            seed = body.get('seed')
            texts = []
            for i in range(n):
                rng = random.Random(None if seed is None else seed + i)   # like llama-server: child i uses seed + i
                texts.append(' '.join(rng.choice(WORDS) for _ in range(rng.randint(1, body.get('max_tokens', 16)))))
            counts = [count(t) for t in texts]
            self.true_completion_tokens += sum(counts)
            return {'id': 'x', 'object': 'chat.completion', 'model': SERVED_NAME,
                    'choices': [{'index': i, 'finish_reason': 'stop', 'message': {'role': 'assistant', 'content': t}}
                                for i, t in enumerate(texts)],
                    'usage': {'prompt_tokens': 9, 'completion_tokens': counts[0], 'total_tokens': 9 + counts[0]}}

        app.post('/tokenize')(tokenize)
        app.post('/v1/chat/completions')(chat)
        self.sock = socket.socket(); self.sock.bind(('127.0.0.1', 0)); self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level='warning', lifespan='off'))
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]), daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert time.monotonic() - t0 < 30, 'the misreporting server did not start'
            time.sleep(0.01)

    @property
    def url(self) -> str: return f'http://127.0.0.1:{self.port}/v1'

    def stop(self):
        self.server.should_exit = True; self.thread.join(timeout=10); self.sock.close()


@pytest.fixture
def misreporting():
    s = Misreporting()
    yield s
    s.stop()


def test_token_counts_do_not_trust_the_servers_total(misreporting):
    llm = OpenAIBackend(base_url=misreporting.url)
    [cs] = llm.generate_sync([ask('Why is 2 + 5 seven?', n=5, max_new_tokens=12, seed=3)])
    true = [len(misreporting.tok.encode(c.raw, add_special_tokens=False)) for c in cs]
    assert [c.completion_tokens for c in cs] == true and len(set(true)) > 1
    assert sum(true) == misreporting.true_completion_tokens > true[0]     # the server's usage said only true[0]
    assert llm.token_count_source == 'tokenize' and llm.stats['estimated_samples'] == 0
    assert llm.usage.by_role['solution']['completion_tokens'] == sum(true)
    assert llm.served_model == SERVED_NAME and llm.record()['token_count_source'] == 'tokenize'


def test_token_counts_with_a_local_tokenizer_when_the_server_has_no_tokenize():
    s = Misreporting(tokenize=False)
    try:
        blind = OpenAIBackend(base_url=s.url)
        [cs] = blind.generate_sync([ask('Why?', n=4, max_new_tokens=12, seed=5)])
        assert blind.token_count_source == 'estimated' and blind.stats['estimated_samples'] == 4
        assert sum(c.completion_tokens for c in cs) < s.true_completion_tokens   # an estimate from the bad total, flagged
        s.true_completion_tokens = 0
        llm = OpenAIBackend(base_url=s.url, tokenizer=MODEL)
        [cs] = llm.generate_sync([ask('Why?', n=4, max_new_tokens=12, seed=5)])
        assert llm.token_count_source == 'tokenizer'
        assert sum(c.completion_tokens for c in cs) == s.true_completion_tokens
    finally:
        s.stop()


def test_n_above_the_servers_slots_is_split_and_remembered(misreporting):
    llm = OpenAIBackend(base_url=misreporting.url)
    r = ask('Why?', n=20, max_new_tokens=6, seed=100)
    [cs] = llm.generate_sync([r])
    assert len(cs) == 20 and llm.n_per_call == SLOTS and llm.stats['n_refusals'] == 1
    assert sorted(misreporting.seen) == sorted([(20, 100), (8, 100), (8, 108), (4, 116)])
    misreporting.seen.clear()
    [again] = llm.generate_sync([r])                        # the limit is known: no second refusal
    assert [c.raw for c in again] == [c.raw for c in cs] and llm.stats['n_refusals'] == 1
    assert max(n for n, _ in misreporting.seen) == SLOTS
    capped = OpenAIBackend(base_url=misreporting.url, max_n_per_call=3)   # set up front: never refused
    [cs3] = capped.generate_sync([ask('Why?', n=7, max_new_tokens=6, seed=100)])
    assert capped.stats['n_refusals'] == 0 and [c.raw for c in cs3] != [] and len(cs3) == 7


def test_tmas_run_against_the_misreporting_server(misreporting, tmp_path, data_root):
    out = tmp_path / 'run'
    cmd = [sys.executable, '-m', 'tmas_nb.cli', 'run', '--method', 'mv', '--benchmark', 'demo', '--limit', '2',
           '--n-candidates', '9', '--max-new-tokens', '8', '--backend', 'openai', '--base-url', misreporting.url,
           '--quiet', '--out', str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, 'TMAS_DATA_DIR': str(data_root)})
    assert p.returncode == 0, p.stderr[-3000:]
    import json
    cfg = json.loads((out / 'config.json').read_text())
    assert cfg['model_id'] == SERVED_NAME and cfg['server']['served_model'] == SERVED_NAME
    assert cfg['server']['token_count_source'] == 'tokenize' and cfg['server']['n_per_call'] == SLOTS
    assert cfg['server']['token_sources'] == {'tokenize': 16, 'usage': 2}   # 9 = 8 (counted) + 1 (exact total)
    usage = json.loads((out / 'usage.json').read_text())
    assert usage['total']['completion_tokens'] == misreporting.true_completion_tokens
    assert usage['total']['samples'] == 18
    # --max-n-per-call: the server is never asked for more
    misreporting.seen.clear()
    p = subprocess.run(cmd[:-1] + [str(tmp_path / 'run4'), '--max-n-per-call', '4', '--seed', '9'], capture_output=True,
                       text=True, timeout=120, env={**os.environ, 'TMAS_DATA_DIR': str(data_root)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert misreporting.seen and max(n for n, _ in misreporting.seen) == 4
    assert json.loads((tmp_path / 'run4' / 'config.json').read_text())['server']['max_n_per_call'] == 4


# ---------------------------------------------------------------------------------------------------------------
# API keys: `tmas serve --api-key` (or TMAS_API_KEY) and the refusal to listen beyond loopback without one.

def test_api_key_required_when_set(log_dir):
    port = free_port()
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'OMP_NUM_THREADS': '1', 'TMAS_API_KEY': 'k-123'}
    log = log_dir / 'keyed.log'
    with open(log, 'wb') as f:      # beyond loopback (all interfaces) is allowed because there is a key
        proc = subprocess.Popen([sys.executable, '-m', 'tmas_nb.cli', 'serve', '--model', MODEL, '--host', '0.0.0.0',
                                 '--port', str(port), '--threads', '1'], stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() - t0 < READY_TIMEOUT, log.read_text()[-3000:]
            try:
                if httpx.get(f'http://127.0.0.1:{port}/health', timeout=1).status_code == 200: break   # /health is open
            except httpx.HTTPError: pass
            time.sleep(0.2)
        url = f'http://127.0.0.1:{port}/v1'
        for headers in ({}, {'Authorization': 'Bearer wrong'}, {'Authorization': 'k-123'}):
            r = httpx.get(url + '/models', headers=headers)
            assert r.status_code == 401 and r.json()['error']['code'] == 'invalid_api_key', (headers, r.text)
        r = httpx.post(url + '/chat/completions', json={'messages': [{'role': 'user', 'content': 'hi'}]})
        assert r.status_code == 401 and 'Bearer' in r.json()['error']['message']
        assert httpx.get(url + '/models', headers={'Authorization': 'Bearer k-123'}).json()['data'][0]['id'] == MODEL
        wrong = OpenAIBackend(MODEL, base_url=url, api_key='nope', backoff_base=5)
        with pytest.raises(LLMRequestError) as e:
            wrong.generate_sync([ask('Hello')])
        assert e.value.status_code == 401 and wrong.stats['retries'] == 0
        right = OpenAIBackend(base_url=url, api_key='k-123')
        [cs] = right.generate_sync([ask('Hello', max_new_tokens=3)])
        assert right.model_id == MODEL and cs[0].completion_tokens > 0
    finally:
        proc.kill(); proc.wait(timeout=30)


def test_serve_refuses_other_hosts_without_a_key():
    env = {k: v for k, v in os.environ.items() if k != 'TMAS_API_KEY'}
    env['HF_HUB_OFFLINE'] = '1'
    p = subprocess.run([sys.executable, '-m', 'tmas_nb.cli', 'serve', '--host', '0.0.0.0', '--port', str(free_port())],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2 and '--api-key' in p.stderr and '--allow-unauthenticated' in p.stderr, p.stderr
    assert 'loading' not in p.stderr                      # refused before loading anything
    # with explicit consent the check passes (and the command goes on to load the model: here a missing one)
    p = subprocess.run([sys.executable, '-m', 'tmas_nb.cli', 'serve', '--host', '0.0.0.0', '--port', str(free_port()),
                        '--allow-unauthenticated', '--model', '/no/such/model-folder'],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode != 0 and 'tmas serve: loading /no/such/model-folder' in p.stderr, p.stderr[-2000:]
    assert '--allow-unauthenticated' not in p.stderr


def test_serve_on_a_taken_port_fails_before_loading_the_model():
    "The port is taken first: a busy port is one error line at once, with no model loaded."
    env = {**os.environ, 'HF_HUB_OFFLINE': '1'}
    with socket.socket() as busy:
        busy.bind(('127.0.0.1', 0)); busy.listen(1)
        port = busy.getsockname()[1]
        p = subprocess.run([sys.executable, '-m', 'tmas_nb.cli', 'serve', '--model', MODEL, '--port', str(port)],
                           capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and f'cannot listen on 127.0.0.1:{port}' in p.stderr and '--port' in p.stderr, p.stderr[-2000:]
    assert 'loading' not in p.stderr and 'Traceback' not in p.stderr, p.stderr[-2000:]
