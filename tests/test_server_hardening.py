"""`tmas serve` against careless and hostile clients, on 127.0.0.1 with SmolLM2-135M behind the real server.

Every test sends what a client could send beside ordinary requests, and checks that the bad request alone is refused
(a 4xx, at once), that the others are answered, and that the server stays up and stops on SIGTERM. Queueing and
disconnects are control flow, shown with stand-in backends in an in-process server; everything else uses the model.
"""
import asyncio, json, random, signal, threading, time

import httpx
import pytest

from tmas_nb.llm.core import LLM, Completion
from tmas_nb.llm.server import ServerLimits, ServerThread
from test_llm_server import Server, free_port

CONTEXT = 8192                      # SmolLM2-135M's max_position_embeddings
HI = [{'role': 'user', 'content': 'Say hi.'}]
CHAT = {'messages': HI, 'max_tokens': 4, 'temperature': 0}
JSON = {'content-type': 'application/json'}


@pytest.fixture(scope='module')
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp('server-logs')


@pytest.fixture(scope='module')
def server(log_dir):
    s = Server(free_port(), log_dir, flags=())          # the defaults: the limits every `tmas serve` has
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
    assert code == 400 and 'context is' in msg and secs < 10 and code2 == 200, (code, secs, msg, code2)
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
    assert out[0][0] != 200 and llm.seen == ['running'], out


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
    s = Server(free_port(), log_dir, flags=('--shutdown-timeout', '2'))
    s.wait_ready()
    try:
        rng = random.Random(0)
        work = [('good', *rng.choice(GOOD)) if i % 3 else ('poison', *POISON[(i // 3) % len(POISON)]) for i in range(36)]
        base, results, t0 = f'http://127.0.0.1:{s.port}', [], time.monotonic()
        def client(k):
            for kind, path, body in work[k::6]:
                raw = body if isinstance(body, str) else json.dumps(body)
                results.append((kind, path, body, post(base + path, raw=raw, timeout=60)))
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
        assert post(base + '/v1/chat/completions', CHAT)[0] == 200               # still serving
        # SIGTERM with a long generation in flight: the server stops within its 2 s shutdown timeout
        long = threading.Thread(target=post, args=(base + '/v1/completions',
                                                   {'prompt': 'Count: 1, 2, 3,', 'max_tokens': 2000, 'temperature': 0}))
        long.start(); time.sleep(1.0)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=15)
        stopped = time.monotonic() - t0
        long.join(timeout=10)
        print(f'stopped {stopped:.1f}s after SIGTERM (exit {s.proc.returncode})')
        assert stopped < 6, stopped
    finally:
        s.kill()
