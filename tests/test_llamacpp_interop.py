"""OpenAIBackend and `tmas run` against llama.cpp's own servers, on 127.0.0.1, with the packaged default model's GGUF.

`llama-server` is built from the llama.cpp sources in llama-cpp-python's source distribution by
`tmas engines build-llama` (about 7 minutes on 2 cores); `find_llama_server` finds it through $TMAS_LLAMA_SERVER or
~/.cache/tmas_nb/llama.cpp/. `python -m llama_cpp.server`
needs `pip install "llama-cpp-python[server]"`. The tests take minutes, so they are marked slow: run them with
`pytest tests/test_llamacpp_interop.py --runslow` (or TMAS_SLOW=1). Where a server is not available they are skipped
with the reason and the way to get it, never silently.
"""
import asyncio, json, os, subprocess, sys, time

import httpx
import pytest

from tmas_nb.llm.core import Request
from tmas_nb.llm.llamacpp import BUILD_HINT, LlamaServer, find_llama_server, packaged_gguf, _free_port
from tmas_nb.llm.openai_backend import OpenAIBackend, LLMRequestError

pytestmark = pytest.mark.slow

SLOTS = 4
NAME = 'qwen2.5-coder-0.5b'        # the packaged default model's own name, given to the server as its alias


def ask(prompt, **kw):
    return Request.from_prompt(prompt, **kw)


@pytest.fixture(scope='module')
def binary():
    b = find_llama_server()
    if b is None:
        pytest.skip(f'no llama-server binary: {BUILD_HINT}')
    return b


@pytest.fixture(scope='module')
def llama(binary, tmp_path_factory):
    s = LlamaServer('default', n_parallel=SLOTS, ctx_per_slot=1024, threads=1, binary=binary,
                    log_dir=tmp_path_factory.mktemp('llama'), start=False)
    print(f'llama-server ready in {s.start():.1f}s')
    yield s
    s.close()


def test_chat_n_seeds_top_k_and_stop(llama):
    llm = OpenAIBackend(base_url=llama.base_url)
    assert llm.model_id == NAME                                   # discovered from /v1/models
    r = ask('Write a short poem about the sea.', n=3, max_new_tokens=16, temperature=1.0, seed=11)
    [a], [b] = llm.generate_sync([r]), llm.generate_sync([r])
    assert len(a) == 3 and [c.raw for c in a] == [c.raw for c in b]          # seeded: repeats exactly
    assert len({c.raw for c in a}) > 1                                        # the choices differ from each other
    [other] = llm.generate_sync([ask('Write a short poem about the sea.', n=3, max_new_tokens=16, seed=12)])
    assert [c.raw for c in other] != [c.raw for c in a]
    [k1] = llm.generate_sync([ask('Write a short poem about the sea.', n=3, max_new_tokens=16, temperature=1.0,
                                  top_k=1, seed=5)])
    assert len({c.raw for c in k1}) == 1                                      # top_k=1 leaves one choice: greedy
    [st] = llm.generate_sync([ask('List the numbers 1 to 5, one per line.', max_new_tokens=40, temperature=0,
                                  stop=['3'])])
    assert '3' not in st[0].text and st[0].finish_reason == 'stop' and '2' in st[0].text
    assert llm.served_model == NAME and llm.record()['served_model'] == NAME


def test_token_counts_per_choice(llama):
    body = {'model': NAME, 'n': 4, 'seed': 3, 'max_tokens': 24, 'temperature': 1.0,
            'messages': [{'role': 'user', 'content': 'Tell me about prime numbers.'}]}
    raw = httpx.post(llama.base_url + '/chat/completions', json=body, timeout=300).json()
    reported = raw['usage']['completion_tokens']
    llm = OpenAIBackend(base_url=llama.base_url)
    [cs] = llm.generate_sync([ask('Tell me about prime numbers.', n=4, max_new_tokens=24, temperature=1.0, seed=3)])
    counts = [c.completion_tokens for c in cs]
    print('server total:', reported, '| per choice:', counts, '| source:', llm.token_count_source)
    assert llm.token_count_source in ('tokenize', 'length') and llm.stats['estimated_samples'] == 0
    assert all(c.completion_tokens == 24 for c in cs if c.finish_reason == 'length')   # the limit, not re-tokenised
    assert all(1 <= k <= 24 for k in counts) and sum(counts) > reported        # the server's total is one choice's
    assert reported in [k for k in counts] or abs(reported - counts[0]) <= 1
    # the same counts by the other two ways: per-choice logprobs, and the model's tokenizer in this process
    by_lp = OpenAIBackend(base_url=llama.base_url, token_counts='logprobs')
    [lp] = by_lp.generate_sync([ask('Tell me about prime numbers.', n=4, max_new_tokens=24, temperature=1.0, seed=3)])
    assert by_lp.token_count_source == 'logprobs'
    by_tok = OpenAIBackend(base_url=llama.base_url, tokenizer='default')
    [tk] = by_tok.generate_sync([ask('Tell me about prime numbers.', n=4, max_new_tokens=24, temperature=1.0, seed=3)])
    assert by_tok.token_count_source == 'tokenizer'
    for x, y, z in zip(cs, lp, tk):
        if x.raw == y.raw: assert abs(x.completion_tokens - y.completion_tokens) <= 1
        if x.raw == z.raw: assert abs(x.completion_tokens - z.completion_tokens) <= 1
    # a sample that hit the limit holds exactly max_tokens tokens by the server's own count
    assert all(c.completion_tokens == 24 for c in lp if c.finish_reason == 'length')


def test_samples_cut_by_the_limit_count_exactly_the_limit(llama, tmp_path, data_root):
    """4 samples all cut at 32 tokens are 128 generated tokens, whatever re-tokenising their texts would give."""
    llm = OpenAIBackend(base_url=llama.base_url)
    [cs] = llm.generate_sync([ask('Write a very long essay about the history of the number zero.', n=4,
                                  max_new_tokens=32, temperature=1.0, seed=4)])
    cut = [c for c in cs if c.finish_reason == 'length']
    assert len(cut) >= 3 and all(c.completion_tokens == 32 for c in cut) and llm.token_sources['length'] == len(cut)
    out = tmp_path / 'run'
    cmd = [sys.executable, '-m', 'tmas_nb.cli', 'run', '--method', 'mv', '--benchmark', 'demo', '--limit', '1',
           '--n-candidates', '4', '--max-new-tokens', '32', '--backend', 'openai', '--base-url', llama.base_url,
           '--quiet', '--out', str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, 'TMAS_DATA_DIR': str(data_root)})
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = json.loads((out / 'config.json').read_text())
    sources = cfg['server']['token_sources']
    assert sources.get('estimated', 0) == 0 and sum(sources.values()) == 4
    usage = json.loads((out / 'usage.json').read_text())['total']
    if sources.get('length') == 4: assert usage['completion_tokens'] == 128     # all four cut: exactly 4 x 32


def test_n_above_the_slots_is_split(llama):
    body = {'model': NAME, 'n': SLOTS + 2, 'max_tokens': 4, 'messages': [{'role': 'user', 'content': 'hi'}]}
    r = httpx.post(llama.base_url + '/chat/completions', json=body, timeout=120)
    assert r.status_code == 400 and f"Field 'n': Value must be between 1 <= value <= {SLOTS}" in r.text, r.text
    llm = OpenAIBackend(base_url=llama.base_url)
    [cs] = llm.generate_sync([ask('Name an animal.', n=10, max_new_tokens=6, seed=1)])
    assert len(cs) == 10 and llm.n_per_call == SLOTS and llm.stats['n_refusals'] == 1
    [again] = llm.generate_sync([ask('Name an animal.', n=10, max_new_tokens=6, seed=1)])
    assert len(again) == 10 and llm.stats['n_refusals'] == 1          # the learnt limit is kept: no second refusal
    # The texts are not compared: llama-server's seeded samples depend on what shares the slots' batch with them
    # (after the other tests of this module, 1 of the 10 came back different on the repeat in every run).
    assert sum(a.raw == b.raw for a, b in zip(again, cs)) >= 5


def test_server_killed_mid_run_then_restarted(binary, tmp_path):
    s = LlamaServer('default', n_parallel=2, ctx_per_slot=1024, threads=1, binary=binary, log_dir=tmp_path)
    try:
        llm = OpenAIBackend(base_url=s.base_url, max_retries=40, backoff_base=0.5, backoff_max=2.0)
        requests = [ask(f'Write a long essay about the number {i}.', n=2, max_new_tokens=64, seed=i) for i in range(2)]

        async def kill_and_restart():
            job = asyncio.ensure_future(llm.generate(requests))
            while llm.stats['http_calls'] < len(requests):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            s.kill()                                            # kill -9 with requests in flight
            while llm.stats['retries'] < 2:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(s.start)                    # back on the same port
            try: return await job
            finally: await llm.aclose()

        out = asyncio.run(kill_and_restart())
        assert [len(cs) for cs in out] == [2, 2] and llm.stats['failures'] == 0 and llm.stats['retries'] >= 2
        kinds = {e.split(':')[0] for _, _, e in llm.errors}
        # requests cut off by the kill, then refused connections or 503 (llama-server loading) until it is back
        assert kinds & {'RemoteProtocolError', 'ReadError'} and kinds & {'ConnectError', 'HTTP 503'}, kinds
    finally:
        s.close()


def test_tmas_run_against_llama_server(llama, tmp_path, data_root):
    out = tmp_path / 'run'
    cmd = [sys.executable, '-m', 'tmas_nb.cli', 'run', '--method', 'tmas', '--benchmark', 'demo', '--limit', '1',
           '--n-candidates', '2', '--n-verifications', '1', '--iterations', '1', '--max-new-tokens', '48',
           '--backend', 'openai', '--base-url', llama.base_url, '--quiet', '--out', str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, 'TMAS_DATA_DIR': str(data_root)})
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = json.loads((out / 'config.json').read_text())
    assert cfg['model_id'] == NAME and cfg['server']['served_model'] == NAME
    assert cfg['server']['token_count_source'] in ('tokenize', 'usage', 'length')
    status = json.loads((out / 'status.json').read_text())
    assert status['complete'] is True
    usage = json.loads((out / 'usage.json').read_text())
    assert usage['total']['completion_tokens'] > 0


def test_llama_cpp_python_server_ignores_n(tmp_path):
    """`python -m llama_cpp.server` answers one choice whatever `n` is: the client tops up, and seeded runs repeat."""
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as e:
        pytest.skip(f'llama_cpp.server is not installed ({e}): pip install "llama-cpp-python[server]==0.3.36"')
    port = _free_port()
    log = tmp_path / 'llama_cpp_server.log'
    with open(log, 'wb') as f:
        proc = subprocess.Popen([sys.executable, '-m', 'llama_cpp.server', '--model', str(packaged_gguf('default')),
                                 '--host', '127.0.0.1', '--port', str(port), '--n_threads', '1', '--n_ctx', '2048',
                                 '--model_alias', NAME], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, 'OMP_NUM_THREADS': '1'})
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() - t0 < 300, log.read_text()[-3000:]
            try:
                if httpx.get(f'http://127.0.0.1:{port}/v1/models', timeout=1).status_code == 200: break
            except httpx.HTTPError: pass
            time.sleep(0.3)
        llm = OpenAIBackend(base_url=f'http://127.0.0.1:{port}/v1')
        r = ask('Name a colour.', n=3, max_new_tokens=6, temperature=1.0, seed=21)
        [a], [b] = llm.generate_sync([r]), llm.generate_sync([r])
        assert len(a) == 3 and llm.n_per_call == 1 and llm.stats['top_up_calls'] >= 2
        assert [c.raw for c in a] == [c.raw for c in b]
        assert llm.token_count_source == 'usage' and all(c.completion_tokens > 0 for c in a)
    finally:
        proc.kill(); proc.wait(timeout=30)


def test_replay_build_through_llama_server(llama, tmp_path):
    """`build_store` with a base URL against llama-server's /v1/completions: token-id prompts, 31-bit seeds, its /tokenize."""
    from tmas_nb.autotts.build import build_store, parts_dir, sidecar_path
    from tmas_nb.autotts.store import load_store_file
    kw = dict(limit=1, branches=2, probe_every=8, max_new_tokens=24, progress=False)
    for tokenizer, source in ((None, 'tokenizer'), ('server', 'tokenize')):
        out = tmp_path / f'{source}.json'
        t0 = time.monotonic()
        build_store(llama.base_url, 'demo', out=out, tokenizer=tokenizer, **kw)
        store = load_store_file(out)
        side = json.loads(sidecar_path(out).read_text())
        print(f'{source}: {time.monotonic() - t0:.1f}s', json.loads(out.read_text())[0]['each_branch'])
        assert (store.n_questions, int(store.n_branches.max()), int(store.probe_freq[0])) == (1, 2, 8)
        # the packaged model's own tokenizer is used (and checked against the server's), or the server's template and tokens
        assert (side['served_model'], side['token_source'], side['complete']) == (NAME, source, True)
        part = json.loads((parts_dir(out) / 'q00000.json').read_text())
        for (probes, tokens, final), how in zip(part['record']['each_branch'], part['finish_reasons']):
            assert 0 < tokens and len(probes) == (tokens - (how == 'stop')) // 8
