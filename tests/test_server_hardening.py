"""`tmas serve` against careless and hostile clients, on 127.0.0.1 with SmolLM2-135M behind the real server.

Every test sends what a client could send beside ordinary requests, and checks that the bad request alone is refused
(a 4xx, at once), that the others are answered, and that the server stays up and stops on SIGTERM. Queueing and
disconnects are control flow, shown with stand-in backends in an in-process server; everything else uses the model.

Section 5 is the load tests of clients that abuse the server's resources rather than its parser: each attack runs
beside a legitimate request whose latency is measured against the same server's quiet latency, with margins for a
loaded machine. The module's server runs in a memory-capped cgroup (where one can be made: root with cgroups here and
in CI), its memory sampled while an attack runs, with a soft open-file limit of 1,024 and a hard one of 1,200.
"""
import asyncio, json, os, random, resource, signal, socket, threading, time
from pathlib import Path

import httpx
import pytest

from tmas_nb.llm.core import LLM, Completion
from tmas_nb.llm.server import ServerLimits, ServerThread
from tmas_nb.sandbox import SandboxLimits, make_cgroup
from test_llm_server import Server, free_port

CONTEXT = 8192                      # SmolLM2-135M's max_position_embeddings
LONGEST = 81                        # characters of its tokenizer's longest token
HI = [{'role': 'user', 'content': 'Say hi.'}]
CHAT = {'messages': HI, 'max_tokens': 4, 'temperature': 0}
JSON = {'content-type': 'application/json'}
MEMORY_MB = 2048                    # the cap of the module's server (its baseline is about 400 MB)
FILES = (1024, 1200)                # its soft and hard open-file limits at start
HEADER_TIMEOUT, KEEP_ALIVE = 3, 2   # seconds


@pytest.fixture(scope='module')
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp('server-logs')


class Capped:
    "A cgroup capping a server's memory (when one can be made here) and a sampler of the server's resident memory."
    def __init__(self, memory_mb):
        self.cgroup = make_cgroup(SandboxLimits(memory_mb=memory_mb, max_procs=1024))
        self.pid = None

    def preexec(self):
        if self.cgroup: self.cgroup.join()
        resource.setrlimit(resource.RLIMIT_NOFILE, FILES)

    def rss_mb(self) -> float:
        for line in Path(f'/proc/{self.pid}/status').read_text().splitlines():
            if line.startswith('VmRSS:'): return int(line.split()[1]) / 1024
        return 0.0

    def peak_during(self, work):
        "(result of `work()`, the server's peak resident MB while it ran, sampled every 20 ms)."
        peak, done = [self.rss_mb()], threading.Event()
        def sample():
            while not done.is_set():
                try: peak.append(self.rss_mb())
                except OSError: return                       # the server died
                time.sleep(0.02)
        t = threading.Thread(target=sample, daemon=True); t.start()
        try: return work(), max(peak)
        finally: done.set(); t.join()


@pytest.fixture(scope='module')
def capped():
    c = Capped(MEMORY_MB)
    yield c
    if c.cgroup: c.cgroup.close()


@pytest.fixture(scope='module')
def server(log_dir, capped):
    flags = ('--max-n', '64', '--header-timeout', str(HEADER_TIMEOUT), '--keep-alive', str(KEEP_ALIVE))
    s = Server(free_port(), log_dir, flags=flags, preexec=capped.preexec)
    capped.pid = s.proc.pid
    s.wait_ready()
    yield s
    s.kill()


def post(url, body=None, raw=None, headers=None, timeout=30):
    "(status or the transport error's name, seconds, JSON error message or None)."
    t0 = time.monotonic()
    try:
        r = httpx.post(url, json=body, headers=headers, timeout=timeout) if raw is None else \
            httpx.post(url, content=raw, headers=JSON if headers is None else headers, timeout=timeout)
    except httpx.HTTPError as e:
        return type(e).__name__, time.monotonic() - t0, None
    msg = r.json().get('error', {}).get('message') if r.headers.get('content-type') == 'application/json' else None
    return r.status_code, time.monotonic() - t0, msg


def together(calls):
    "Run `(url, kwargs)` posts at the same time (so the server batches them); their results in order."
    out = [None] * len(calls)
    def one(i, url, kw): out[i] = post(url, **kw)
    threads = [threading.Thread(target=one, args=(i, u, kw)) for i, (u, kw) in enumerate(calls)]
    for t in threads: t.start()
    for t in threads: t.join()
    return out


# ---------------------------------------------------------------------------------------------------------------
# 1. one request must fail alone, and never take the model's worker down

def test_huge_temperature_fails_alone_and_the_worker_lives(server):
    poison = json.dumps(CHAT)[:-1] + ', "temperature": 1' + '0' * 400 + '}'   # a 401-digit integer
    chat = server.url + '/chat/completions'
    out = together([(chat, dict(raw=poison, timeout=20))] + [(chat, dict(body=CHAT, timeout=20))] * 3)
    assert out[0][0] == 400 and 'temperature: must be a finite number' in out[0][2], out[0]
    assert [o[0] for o in out[1:]] == [200] * 3, out
    assert post(chat, CHAT)[0] == 200                                          # and the next one too


def test_token_id_outside_the_vocabulary_fails_alone(server):
    bad = {'prompt': [1_000_000_000], 'max_tokens': 4, 'temperature': 0}     # same settings: the same batch as the others
    out = together([(server.url + '/completions', dict(body=bad))] + [(server.url + '/chat/completions', dict(body=CHAT))] * 3)
    assert out[0][0] == 400 and "outside this model's vocabulary" in out[0][2], out[0]
    assert [o[0] for o in out[1:]] == [200] * 3, out


class Batcher(LLM):
    """Decodes its first `first` requests as one batch (then each batch as it comes), which fails as a whole when any
    prompt is 'boom' (as a model's batch would). Counting, not a timer, closes the first batch: a loaded machine may take
    longer than any fixed window to deliver four posts; 10 s is only the fallback."""
    model_id = 'batcher'

    def __init__(self, first=4):
        super().__init__(); self.batch, self.batches, self.first = None, [], first

    async def _generate(self, requests):
        loop = asyncio.get_running_loop()
        if self.batch is None:
            self.batch = []; self.timer = loop.call_later(10.0, self._flush)
        fut = loop.create_future(); self.batch.append((requests[0], fut))
        if len(self.batch) >= (self.first if not self.batches else 1): self.timer.cancel(); self._flush()
        return [await fut]

    def _flush(self):
        batch, self.batch = self.batch, None
        self.batches.append(sorted(r.messages[-1]['content'] for r, _ in batch))
        broken = any(r.messages[-1]['content'] == 'boom' for r, _ in batch)
        for r, f in batch:
            if broken: f.set_exception(RuntimeError('index out of range in self'))
            else: f.set_result([Completion.from_raw('ok', completion_tokens=1)] * r.n)


def test_a_failing_batch_fails_only_its_culprit():
    llm = Batcher()
    with ServerThread(llm) as srv:
        chat = srv.base_url + '/chat/completions'
        out = together([(chat, dict(body={'messages': [{'role': 'user', 'content': t}]})) for t in ('a', 'boom', 'b', 'c')])
    assert [o[0] for o in out] == [200, 500, 200, 200], out
    assert 'index out of range' in out[1][2]
    assert llm.batches[0] == ['a', 'b', 'boom', 'c'] and sorted(llm.batches[1:]) == [['a'], ['b'], ['boom'], ['c']]


# ---------------------------------------------------------------------------------------------------------------
# 2. what would take the model for minutes (or its memory) is refused at once

def test_work_past_the_limits_is_refused_at_once(server):
    chat, comp = server.url + '/chat/completions', server.url + '/completions'
    cases = [(chat, {**CHAT, 'n': 10_000}, 400, 'n must be at most 64'),
             (chat, {**CHAT, 'max_tokens': 10**9}, 400, f'max_tokens must be at most {CONTEXT}'),
             (comp, {'prompt': [100] * 9000, 'max_tokens': 2}, 400, f"this model's context is {CONTEXT} tokens"),
             (comp, {'prompt': [100] * 8190, 'max_tokens': 10}, 400, 'lower max_tokens to 2')]
    for url, body, status, needle in cases:
        code, secs, msg = post(url, body, timeout=20)
        assert code == status and needle in msg and secs < 2, (body.get('n'), code, secs, msg)
    # a 1 MB prompt is counted in a thread and refused; a request sent beside it is answered meanwhile
    big = {'prompt': 'word ' * 200_000, 'max_tokens': 2}
    (code, secs, msg), (code2, _, _) = together([(comp, dict(body=big, timeout=20)), (chat, dict(body=CHAT, timeout=20))])
    assert code == 400 and 'context of 8,192 tokens' in msg and secs < 10 and code2 == 200, (code, secs, msg, code2)
    code, secs, msg = post(comp, {'prompt': 'x' * (5 << 20)}, timeout=20)      # 5 MB: over the body limit
    assert code == 413 and '--max-body-mb' in msg and secs < 5, (code, secs)
    assert post(chat, CHAT)[0] == 200


class Slow(LLM):
    "Answers after `delay` seconds and records every prompt it was given; `max_batch_size=1` gates it to 2 samples at once."
    model_id, max_batch_size = 'slow', 1

    def __init__(self, delay):
        super().__init__(); self.delay, self.seen = delay, []

    async def _generate(self, requests):
        self.seen += [r.messages[-1]['content'] for r in requests]
        await asyncio.sleep(self.delay)
        return [[Completion.from_raw('done', completion_tokens=1)] * r.n for r in requests]


def ask(text, **kw): return {'messages': [{'role': 'user', 'content': text}], **kw}


def test_a_full_queue_answers_503_and_a_client_that_leaves_costs_nothing():
    llm = Slow(delay=1.0)
    with ServerThread(llm, limits=ServerLimits(max_queue=2)) as srv:
        async def clients():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=10) as c:
                first = asyncio.ensure_future(c.post('/chat/completions', json=ask('first', n=2)))   # takes the gate
                await asyncio.sleep(0.1)
                with pytest.raises(httpx.TimeoutException):                                       # waits, then leaves
                    await c.post('/chat/completions', json=ask('left', n=2), timeout=0.2)
                await asyncio.sleep(0.2)
                waiting = asyncio.ensure_future(c.post('/chat/completions', json=ask('waiting')))
                await asyncio.sleep(0.05)
                t0 = time.monotonic()
                full = await c.post('/chat/completions', json=ask('one too many'))
                secs = time.monotonic() - t0
                return (await first).status_code, (await waiting).status_code, full, secs
        first, waiting, full, secs = asyncio.run(clients())
        health = httpx.get(f'http://127.0.0.1:{srv.port}/health').json()
    assert (first, waiting, full.status_code, full.headers['retry-after']) == (200, 200, 503, '1')
    assert '--max-queue' in full.json()['error']['message'] and secs < 0.5
    assert llm.seen == ['first', 'waiting']                  # the client that left never reached the model
    assert (health['disconnected'], health['in_flight'], health['waiting']) == (1, 0, 0)


def test_shutdown_sends_waiting_requests_away_and_cancels_running_ones_after_the_timeout():
    llm = Slow(delay=30)
    srv = ServerThread(llm, limits=ServerLimits(shutdown_timeout_s=1.0))
    chat = srv.base_url + '/chat/completions'
    out = [None, None]
    def go(i, text): out[i] = post(chat, ask(text, n=2), timeout=20)
    threads = [threading.Thread(target=go, args=(i, t)) for i, t in enumerate(('running', 'waiting'))]
    for t in threads: t.start(); time.sleep(0.2)
    t0 = time.monotonic()
    srv.stop()
    stopped = time.monotonic() - t0
    for t in threads: t.join(timeout=10)
    assert stopped < 5, stopped                              # 1 s of grace for the running one, not its 30 s
    assert out[1][0] == 503 and 'shutting down' in out[1][2], out
    assert out[0][0] == 503 and 'shutdown timeout' in out[0][2] and llm.seen == ['running'], out   # answered, not dropped


# ---------------------------------------------------------------------------------------------------------------
# 3. lenient parsing: every one of these is the client's mistake, so a 4xx that names it

LENIENT = [  # (path, raw body or dict, headers, status, words in the message)
    ('/v1/chat/completions', {**CHAT, 'stop': 5}, None, 400, 'stop: must be a string or a list'),
    ('/tokenize', {'messages': HI, 'chat_template_kwargs': {'tokenize': False}}, None, 400, 'chat_template_kwargs.tokenize'),
    ('/detokenize', {'tokens': [2**70]}, None, 400, "'tokens' as a list of token ids"),
    ('/detokenize', {'tokens': [10**6]}, None, 400, "'tokens' as a list of token ids"),
    ('/v1/chat/completions', json.dumps(CHAT)[:-1] + ', "temperature": NaN}', JSON, 400, 'NaN is not a JSON number'),
    ('/v1/chat/completions', json.dumps(CHAT)[:-1] + ', "temperature": Infinity}', JSON, 400, 'Infinity is not a JSON number'),
    ('/v1/chat/completions', {**CHAT, 'temperature': -1}, None, 400, 'temperature: must be a finite number >= 0'),
    ('/v1/chat/completions', {**CHAT, 'top_p': 10**400}, None, 400, 'top_p: must be a number in (0, 1]'),
    ('/v1/chat/completions', {**CHAT, 'max_tokens': True}, None, 400, 'max_tokens: must be an integer, got True'),
    ('/v1/chat/completions', {**CHAT, 'n': True}, None, 400, 'n: must be an integer'),
    ('/v1/chat/completions', {**CHAT, 'seed': 2**70}, None, 400, 'seed='),
    ('/v1/chat/completions', json.dumps(CHAT), {'content-type': 'text/plain'}, 415, 'Content-Type: application/json'),
    ('/v1/chat/completions', json.dumps(CHAT), {}, 415, 'Content-Type: application/json'),
    ('/v1/completions', 'prompt=hi', {'content-type': 'application/x-www-form-urlencoded'}, 415, 'application/json'),
    ('/v1/chat/completions', CHAT, {'host': 'rebound.example:8000'}, 403, 'loopback'),
    # deep JSON and text that is not Unicode: 400s, not 500s (RecursionError, UnicodeEncodeError)
    ('/v1/chat/completions', '{"messages": ' + '[' * 100_000 + ']' * 100_000 + '}', JSON, 400, 'levels deep'),
    ('/v1/chat/completions', json.dumps(CHAT)[:-1] + ', "stop": ' + '[' * 40 + ']' * 40 + '}', JSON, 400, 'levels deep'),
    ('/v1/chat/completions', json.dumps(CHAT)[:-1] + ', "model": "\\ud800"}', JSON, 400, 'model: holds a lone surrogate'),
    ('/v1/chat/completions', '{"messages": [{"role": "user", "content": "a\\udc00b"}]}', JSON, 400, 'messages[0].content: holds a lone surrogate'),
    ('/tokenize', '{"prompt": "a\\udc00b"}', JSON, 400, 'prompt: holds a lone surrogate'),
    # fields the server cannot honour are refused by name, never ignored
    ('/v1/chat/completions', {**CHAT, 'logit_bias': {str(i): 1 for i in range(100_000)}}, None, 400, 'logit_bias is not supported'),
    ('/v1/chat/completions', {**CHAT, 'response_format': {'type': 'json_object'}}, None, 400, 'response_format'),
    ('/v1/chat/completions', {**CHAT, 'presence_penalty': 1.0}, None, 400, 'presence_penalty is not supported'),
    ('/v1/chat/completions', {**CHAT, 'frequency_penalty': 0.5}, None, 400, 'frequency_penalty is not supported'),
    ('/v1/chat/completions', {**CHAT, 'tools': [{'type': 'function', 'function': {'name': 'f'}}]}, None, 400, 'tools (function calling)'),
    ('/v1/chat/completions', {**CHAT, 'top_logprobs': 3}, None, 400, '"logprobs": true'),
    ('/v1/completions', {'prompt': 'hi', 'logprobs': 2}, None, 400, 'logprobs are not supported by the completions endpoint'),
]


@pytest.mark.parametrize('path,body,headers,status,needle', LENIENT, ids=[f'{i}-{c[0].split("/")[-1]}' for i, c in enumerate(LENIENT)])
def test_lenient_input_is_a_4xx(server, path, body, headers, status, needle):
    url = f'http://127.0.0.1:{server.port}{path}'
    if isinstance(body, dict): body = json.dumps(body)
    code, secs, msg = post(url, raw=body, headers={**JSON, **headers} if headers and 'host' in headers else headers, timeout=20)
    assert code == status and msg and needle in msg, (code, msg)
    assert secs < 2


# ---------------------------------------------------------------------------------------------------------------
# 4. a bounded load test: concurrent clients, good and bad requests mixed, then SIGTERM

KEY = {'authorization': 'Bearer k3y'}
GOOD = [('/v1/chat/completions', {**CHAT, 'max_tokens': 3}),
        ('/v1/chat/completions', {**CHAT, 'n': 2, 'temperature': 0.7, 'seed': 1, 'max_tokens': 3}),
        ('/v1/completions', {'prompt': 'The capital of France is', 'max_tokens': 3, 'temperature': 0}),
        ('/v1/completions', {'prompt': [504, 3458, 314], 'max_tokens': 3, 'temperature': 0.7, 'top_k': 20})]
POISON = [('/v1/chat/completions', json.dumps(CHAT)[:-1] + ', "temperature": 1' + '0' * 400 + '}'),
          ('/v1/completions', {'prompt': [1_000_000_000], 'max_tokens': 3, 'temperature': 0}),
          ('/v1/chat/completions', {**CHAT, 'n': 10_000}),
          ('/v1/chat/completions', {**CHAT, 'max_tokens': 10**9}),
          ('/v1/completions', {'prompt': [100] * 9000, 'max_tokens': 2}),
          ('/v1/chat/completions', {**CHAT, 'stop': 5}),
          ('/v1/chat/completions', json.dumps(CHAT)[:-1] + ', "temperature": NaN}'),
          ('/v1/chat/completions', {'messages': [{'role': 'wizard', 'content': 'hi'}]}),
          ('/detokenize', {'tokens': [2**70]})]


def test_load_with_poison_then_sigterm(log_dir):
    """A server at its default sizes (measured on this CPU), behind a key: the documentation is behind the key too,
    36 mixed requests from 6 clients, then SIGTERM with requests running and waiting: each gets an answer (200, or 503
    once the 2 s shutdown timeout is over), none a dropped connection, and the process exits promptly."""
    s = Server(free_port(), log_dir, flags=('--shutdown-timeout', '2', '--api-key', 'k3y', '--max-batch-size', '4'))
    s.wait_ready()
    try:
        base = f'http://127.0.0.1:{s.port}'
        # the documentation routes are behind the key, and a client without it is answered and disconnected at once
        for path in ('/docs', '/redoc', '/openapi.json'):
            r = httpx.get(base + path)
            assert (r.status_code, r.headers.get('connection')) == (401, 'close'), (path, r.status_code)
            assert httpx.get(base + path, headers=KEY).status_code == 200, path
        health = httpx.get(base + '/health').json()                              # open without the key
        # CPU defaults sized from the engine's measured speed (the start line says so)
        lim = health['limits']
        assert lim['max_n'] in (1, 2, 4, 8, 16, 32, 64) and lim['default_max_tokens'] in range(64, 513, 64), lim
        assert 'measured' in s.log.read_text() and '--max-n' in s.log.read_text()
        n2 = min(2, lim['max_n'])
        good = [(p, {**b, 'n': n2} if b.get('n') else b) for p, b in GOOD]
        rng = random.Random(0)
        work = [('good', *rng.choice(good)) if i % 3 else ('poison', *POISON[(i // 3) % len(POISON)]) for i in range(36)]
        results, t0 = [], time.monotonic()
        def client(k):
            for kind, path, body in work[k::6]:
                raw = body if isinstance(body, str) else json.dumps(body)
                results.append((kind, path, body, post(base + path, raw=raw, headers={**JSON, **KEY}, timeout=60)))
        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads: t.start()
        for t in threads: t.join(timeout=120)
        took = time.monotonic() - t0
        assert len(results) == 36
        bad = [(kind, path, r) for kind, path, _, r in results
               if (kind == 'good' and r[0] != 200) or (kind == 'poison' and not (isinstance(r[0], int) and 400 <= r[0] < 500))]
        assert not bad, bad
        print(f'36 requests from 6 clients in {took:.1f}s; slowest refusal '
              f'{max(r[1] for kind, _, _, r in results if kind == "poison"):.2f}s')
        health = httpx.get(base + '/health').json()
        assert health['in_flight'] == 0 and health['refused'] >= 11
        assert post(base + '/v1/chat/completions', CHAT, headers=KEY)[0] == 200   # still serving
        # SIGTERM with long generations running (the gate takes 2 batches of 4 samples) and more waiting behind them
        n = min(4, lim['max_n'])
        long = {'messages': [{'role': 'user', 'content': 'Write a very long story about a river.'}], 'n': n,
                'max_tokens': 2000, 'temperature': 1.0}
        answers = [None] * 5
        def ask(i): answers[i] = post(base + '/v1/chat/completions', long, headers=KEY, timeout=60)
        asking = [threading.Thread(target=ask, args=(i,)) for i in range(5)]
        for t in asking: t.start(); time.sleep(0.1)
        time.sleep(1.0)
        busy = httpx.get(base + '/health').json()
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=30)
        stopped = time.monotonic() - t0
        for t in asking: t.join(timeout=30)
        print(f'stopped {stopped:.1f}s after SIGTERM (exit {s.proc.returncode}); answers {[a[:2] for a in answers]}; '
              f'before it: {busy["in_flight"]} in flight, {busy["waiting"]} waiting, engine {busy["engine"]}')
        assert busy['in_flight'] == 5, busy
        assert all(isinstance(a[0], int) and a[0] in (200, 503) for a in answers), answers     # none dropped
        assert sum(a[0] == 503 and 'shutting down' in a[2] for a in answers) >= 3, answers
        assert stopped < 2 + 4, stopped
    finally:
        s.kill()


# ---------------------------------------------------------------------------------------------------------------
# 5. clients that abuse the server's resources: a legitimate request's latency beside each attack, the server's memory

def quiet_latency(base: str) -> float:
    "The best of two legitimate requests to the server with nothing else going on (seconds)."
    return min(post(base + '/v1/chat/completions', CHAT, timeout=60)[1] for _ in range(2))


def bound(quiet: float) -> float:
    "What a legitimate request may take beside an attack: three times its quiet latency and 10 s of margin for a loaded machine."
    return 3 * quiet + 10


def amid(attack_calls, delay: float = 0.5, timeout: float = 60):
    "Start the attack's posts, send a legitimate request `delay` seconds later; (its result, the attack's results)."
    out = [None] * len(attack_calls)
    def one(i, url, kw): out[i] = post(url, **kw)
    threads = [threading.Thread(target=one, args=(i, u, kw)) for i, (u, kw) in enumerate(attack_calls)]
    for t in threads: t.start()
    time.sleep(delay)
    legit = post(attack_calls[0][0].rsplit('/v1/', 1)[0] + '/v1/chat/completions', CHAT, timeout=timeout)
    for t in threads: t.join(timeout=180)
    return legit, out


def test_a_4mb_prompt_is_refused_by_counting_before_templating(server, capped):
    base = f'http://127.0.0.1:{server.port}'
    quiet, before = quiet_latency(base), capped.rss_mb()
    big = {'messages': [{'role': 'user', 'content': 'x ' * 2_000_000}], 'max_tokens': 4}     # 4 MB, under the body limit
    (legit, [refused]), peak = capped.peak_during(lambda: amid([(base + '/v1/chat/completions', dict(body=big, timeout=60))],
                                                                delay=0.2, timeout=bound(quiet) + 5))
    print(f'4 MB prompt: refused in {refused[1]:.2f}s; legitimate request {legit[1]:.2f}s (quiet {quiet:.2f}s); '
          f'server memory {before:.0f} -> {peak:.0f} MB')
    assert refused[0] == 400 and '4,000,000 characters' in refused[2] and refused[1] < 5, refused
    assert legit[0] == 200 and legit[1] < bound(quiet), (legit, quiet)
    assert peak - before < 250, (before, peak)


def test_24_bodies_of_123356_messages_are_refused_by_counting(server, capped):
    base = f'http://127.0.0.1:{server.port}'
    quiet, before = quiet_latency(base), capped.rss_mb()
    raw = json.dumps({'messages': [{'role': 'user', 'content': 'x'}] * 123_356, 'max_tokens': 4})
    assert 4_000_000 < len(raw) < 4 << 20                                  # just under the 4 MB body limit
    calls = [(base + '/v1/chat/completions', dict(raw=raw, timeout=120))] * 24
    (legit, out), peak = capped.peak_during(lambda: amid(calls, delay=0.5, timeout=bound(quiet) + 5))
    print(f'24 x 4 MB of messages: slowest refusal {max(o[1] for o in out):.1f}s; legitimate request {legit[1]:.2f}s '
          f'(quiet {quiet:.2f}s); server memory {before:.0f} -> {peak:.0f} MB (cap {MEMORY_MB} MB)')
    assert server.proc.poll() is None, 'the server died (out of memory?)'
    assert all(o[0] == 400 and '123,356 messages' in o[2] and '--max-messages' in o[2] for o in out), out[:2]
    assert legit[0] == 200 and legit[1] < bound(quiet), (legit, quiet)
    assert peak - before < 600, (before, peak)


def _closed(c: socket.socket) -> bool:
    "Whether the server has answered (408) and closed `c`, or reset it."
    try: data = c.recv(65536)
    except BlockingIOError: return False
    except OSError: return True
    return data == b'' or b' 408 ' in data


def test_1100_idle_or_half_sent_connections_cost_nothing(server):
    base = f'http://127.0.0.1:{server.port}'
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)          # this test process opens 1,100 sockets too
    if soft < 2000: resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 1200, 'the test process needs 1,200 open files'
    quiet = quiet_latency(base)
    socks = []
    try:
        for i in range(1100):
            c = socket.create_connection(('127.0.0.1', server.port), timeout=10)
            if i % 2: c.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100')   # half sent
            socks.append(c)
        time.sleep(0.3)
        legit = post(base + '/v1/chat/completions', CHAT, timeout=bound(quiet) + 5)
        conns = httpx.get(base + '/health', timeout=bound(quiet)).json()['connections']
        t0 = time.monotonic()
        for c in socks: c.setblocking(False)
        open_ = set(range(len(socks)))
        while open_ and time.monotonic() - t0 < HEADER_TIMEOUT + 20:
            open_ = {i for i in open_ if not _closed(socks[i])}
            time.sleep(0.25)
        print(f'1,100 idle connections: legitimate request {legit[1]:.2f}s (quiet {quiet:.2f}s); {conns}; '
              f'{len(socks) - len(open_)} closed {time.monotonic() - t0:.1f}s later')
        assert legit[0] == 200 and legit[1] < bound(quiet), (legit, quiet)
        assert conns['file_limit'] == FILES[1], conns                   # the soft limit was raised to the hard one
        assert conns['open'] <= conns['max'] <= FILES[1] - 128 and conns['evicted'] >= 1, conns
        assert not open_, f'{len(open_)} of 1,100 connections still open {HEADER_TIMEOUT + 20} s later'
    finally:
        for c in socks: c.close()


def test_an_idle_keep_alive_connection_is_closed(server):
    with socket.create_connection(('127.0.0.1', server.port), timeout=KEEP_ALIVE + 10) as c:
        c.sendall(b'GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n')
        head = b''
        while b'\r\n\r\n' not in head: head += c.recv(65536)
        t0 = time.monotonic()
        rest = b''
        while True:                                                     # the body, then the server's close
            chunk = c.recv(65536)
            if not chunk: break
            rest += chunk
        idle = time.monotonic() - t0
    assert head.startswith(b'HTTP/1.1 200') and KEEP_ALIVE - 0.5 < idle < KEEP_ALIVE + 8, idle


def test_clients_that_leave_after_a_second_stop_their_work(server):
    base = f'http://127.0.0.1:{server.port}'
    quiet = quiet_latency(base)
    dropped0 = httpx.get(base + '/health').json()['engine']['rows_dropped']
    body = json.dumps({'messages': HI, 'n': 64, 'max_tokens': 2048, 'temperature': 1.0}).encode()
    clients = []
    for _ in range(2):                                  # two clients send n = 64, max_tokens = 2,048 ...
        c = socket.create_connection(('127.0.0.1', server.port))
        c.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n'
                  b'Content-Length: %d\r\n\r\n%s' % (len(body), body))
        clients.append(c)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:                   # ... and leave after a second, once their rows are decoding
        busy = httpx.get(base + '/health').json()
        if busy['engine']['decoding_rows'] >= 64 and time.monotonic() - t0 >= 1: break
        time.sleep(0.05)
    for c in clients: c.close()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:                   # the engine stops decoding their rows
        health = httpx.get(base + '/health').json()
        if health['engine']['decoding_rows'] == 0 and health['engine']['queued_parts'] == 0 and health['in_flight'] == 0: break
        time.sleep(0.05)
    freed = time.monotonic() - t0
    legit = post(base + '/v1/chat/completions', CHAT, timeout=bound(quiet) + 5)
    print(f'two clients of n=64, max_tokens=2048 left while decoding ({busy["engine"]}): engine idle {freed:.1f}s later '
          f'({health["engine"]}); legitimate request {legit[1]:.2f}s (quiet {quiet:.2f}s)')
    assert busy['engine']['decoding_rows'] >= 64, busy
    assert health['engine']['decoding_rows'] == 0 and health['in_flight'] == 0 and freed < 10, health
    assert health['engine']['rows_dropped'] - dropped0 >= 64, health                      # dropped mid-batch
    assert health['disconnected'] - busy['disconnected'] == 2, (busy, health)
    assert legit[0] == 200 and legit[1] < bound(quiet), (legit, quiet)


def test_chat_logprobs_are_the_models(server):
    r = httpx.post(f'http://127.0.0.1:{server.port}/v1/chat/completions', timeout=60,
                   json={**CHAT, 'max_tokens': 8, 'logprobs': True, 'top_logprobs': 3}).json()
    [choice] = r['choices']
    content = choice['logprobs']['content']
    assert len(content) == choice['completion_tokens'] >= 1
    for e in content:      # greedy: the drawn token is the likeliest one, and log-probabilities are ordered and <= 0
        tops = e['top_logprobs']
        assert len(tops) == 3 and tops[0]['token'] == e['token'] and tops[0]['logprob'] == e['logprob'] <= 0
        assert tops[0]['logprob'] >= tops[1]['logprob'] >= tops[2]['logprob'] and e['bytes'] == list(e['token'].encode())
    assert ''.join(e['token'] for e in content).startswith(choice['message']['content'])
    plain = httpx.post(f'http://127.0.0.1:{server.port}/v1/chat/completions', json={**CHAT, 'max_tokens': 8}, timeout=60).json()
    assert plain['choices'][0]['logprobs'] is None and plain['choices'][0]['message'] == choice['message']
