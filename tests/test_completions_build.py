"""The completions endpoint of `tmas serve` and `tmas replay build` through it, on 127.0.0.1 with SmolLM2-135M.

One in-process server (`ServerThread` around a `TransformersBackend`) serves every test of this file; the stand-ins
are a port nothing listens on and a server that lists models but has no `/v1/completions`.
"""
import asyncio, http.server, json, socket, threading

import httpx
import pytest

from tmas_nb.llm.core import Request
from tmas_nb.llm.openai_backend import OpenAIBackend
from tmas_nb.llm.server import ServerThread
from tmas_nb.llm.transformers_backend import TransformersBackend
from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.autotts.build import BuildSettings, build_store, parts_dir, prompt_ids, server_branch_seeds, sidecar_path
from tmas_nb.autotts.store import load_store_file

MODEL = 'smollm2'
T, L = 8, 16


@pytest.fixture(scope='module')
def served():
    import torch
    torch.set_num_threads(1)
    llm = TransformersBackend(MODEL, device='cpu')
    with ServerThread(llm, served_model_name=MODEL) as srv:
        yield srv, llm.tokenizer
    llm.close()


def complete(srv, **body):
    r = httpx.post(srv.base_url + '/completions', json={'model': MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_string_and_token_id_prompts_give_the_same_text(served):
    srv, tok = served
    text = complete(srv, prompt='The capital of France is', max_tokens=6, temperature=0)
    ids = httpx.post(f'http://127.0.0.1:{srv.port}/tokenize', json={'model': MODEL, 'prompt': 'The capital of France is'}).json()
    assert ids['tokens'] == tok.encode('The capital of France is') and ids['count'] == len(ids['tokens'])
    by_ids = complete(srv, prompt=ids['tokens'], max_tokens=6, temperature=0)
    assert text['object'] == 'text_completion' and text['choices'][0]['text'] == by_ids['choices'][0]['text']
    assert text['usage']['prompt_tokens'] == len(ids['tokens']) and 1 <= text['usage']['completion_tokens'] <= 6
    back = httpx.post(f'http://127.0.0.1:{srv.port}/detokenize', json={'tokens': ids['tokens']}).json()
    assert back['prompt'] == back['content'] == 'The capital of France is'
    llama_style = httpx.post(f'http://127.0.0.1:{srv.port}/tokenize', json={'content': 'The capital'}).json()
    assert llama_style['tokens'] == tok.encode('The capital', add_special_tokens=False)


def test_seeds_n_and_per_choice_counts(served):
    srv, _ = served
    body = {'model': MODEL, 'prompt': 'Once upon a time', 'max_tokens': 8, 'temperature': 1.0, 'seed': 7}
    alone = complete(srv, **body)['choices'][0]['text']

    async def crowd():                                            # sent together, so the server decodes them in one batch
        bodies = [body, {**body, 'seed': 8}, {**body, 'n': 2}] + [{**body, 'prompt': f'Item {i}:', 'seed': i} for i in range(2)]
        async with httpx.AsyncClient(timeout=120) as c:
            return [r.json() for r in await asyncio.gather(*(c.post(srv.base_url + '/completions', json=b) for b in bodies))]
    same, other, two = asyncio.run(crowd())[:3]
    assert same['choices'][0]['text'] == alone                    # same seed, same text, alone or beside other requests
    assert other['choices'][0]['text'] != alone
    assert [c['index'] for c in two['choices']] == [0, 1] and two['choices'][0]['text'] != two['choices'][1]['text']
    counts = [c['completion_tokens'] for c in two['choices']]
    assert all(1 <= k <= 8 for k in counts) and two['usage']['completion_tokens'] == sum(counts)
    assert two['choices'][0]['text'] == alone                     # sample 0 of seed 7 is seed 7's sample
    client = OpenAIBackend(MODEL, base_url=srv.base_url)          # the client sends raw prompts here too
    [cs] = client.generate_sync([Request.raw('Once upon a time', n=2, max_new_tokens=8, temperature=1.0, seed=7)])
    assert [c.raw for c in cs] == [c['text'] for c in two['choices']] and client.token_count_source == 'per_choice'


def test_stop_and_refusals(served):
    srv, _ = served
    free = complete(srv, prompt='Count: 1, 2, 3, 4,', max_tokens=10, temperature=0)['choices'][0]
    word = free['text'].strip().split()[1] if len(free['text'].split()) > 1 else free['text'].strip()[-1]
    cut = complete(srv, prompt='Count: 1, 2, 3, 4,', max_tokens=10, temperature=0, stop=[word])['choices'][0]
    assert cut['finish_reason'] == 'stop' and word not in cut['text'] and free['text'].startswith(cut['text'])
    for body, needle in [({'prompt': ['a', 'b']}, 'a batch of 2 prompts'), ({'prompt': 'x', 'logprobs': 3}, 'logprobs'),
                         ({'prompt': 'x', 'echo': True}, 'echo'), ({'prompt': []}, 'prompt')]:
        r = httpx.post(srv.base_url + '/completions', json=body)
        assert r.status_code == 400 and needle in r.json()['error']['message'], r.text


@pytest.fixture(scope='module')
def built(served, tmp_path_factory):
    srv, _ = served
    out = tmp_path_factory.mktemp('build') / 'smol.json'
    st = build_store(srv.base_url, 'demo', limit=2, branches=2, probe_every=T, max_new_tokens=L, out=out, progress=False)
    return st, out


def test_build_through_the_server(served, built):
    srv, tok = served
    st, out = built
    store = load_store_file(out)                                  # the ordinary loader validates the file
    assert (store.n_questions, int(store.n_branches.max()), set(store.probe_freq.tolist())) == (2, 2, {T})
    side = json.loads(sidecar_path(out).read_text())
    assert (side['engine'], side['served_model'], side['token_source'], side['base_url']) == ('server', MODEL, 'tokenizer', srv.base_url)
    s = BuildSettings(branches=2, probe_every=T, max_new_tokens=L)
    asks = [(qi, b, {'model': MODEL, 'prompt': prompt_ids(tok, p.question, s), 'max_tokens': L, 'temperature': 0.8,
                     'top_p': 0.95, 'seed': seed})
            for qi, p in enumerate(demo_problems()[:2]) for b, seed in enumerate(server_branch_seeds(0, qi, 2))]

    async def again():                                            # the recorded seeds give the branches again
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*(c.post(srv.base_url + '/completions', json=body) for _, _, body in asks))
            return [(r.json()['choices'][0], r.json()['usage']['completion_tokens']) for r in rs]
    for (qi, b, _), (ch, served_tokens) in zip(asks, asyncio.run(again())):
        part = json.loads((parts_dir(out) / f'q{qi:05d}.json').read_text())
        probes, tokens, final = part['record']['each_branch'][b]
        assert part['finish_reasons'][b] == ch['finish_reason']
        assert tokens == served_tokens <= L                           # the server's own count (n=1), never above the cap
        ran = tokens - (ch['finish_reason'] == 'stop')                # tokens before the end token
        assert len(probes) == ran // T and all(isinstance(a, str) and a for a in probes)
    from tmas_nb.autotts.evaluation import evaluate
    for spec in ('sc:k=2', 'pp:num_chains=2', 'cmc:beta=0.5'):
        assert evaluate(spec, store, range(2), n_boot=20).avg_tokens > 0


def test_resume_rebuilds_only_the_missing_question(served, built):
    srv, _ = served
    _, out = built
    before = out.read_text()
    out.unlink(); (parts_dir(out) / 'q00001.json').unlink()
    build_store(srv.base_url, 'demo', limit=2, branches=2, probe_every=T, max_new_tokens=L, out=out, progress=False)
    assert json.loads(sidecar_path(out).read_text())['questions_built_now'] == 1
    assert json.loads(out.read_text()) == json.loads(before)      # seeded: the question comes back the same
    with pytest.raises(ValueError, match='different settings'):
        build_store(srv.base_url, 'demo', limit=2, branches=3, probe_every=T, max_new_tokens=L, out=out, progress=False)


def test_server_tokenizer_gives_the_same_store(served, built, tmp_path):
    srv, _ = served
    _, out = built
    build_store(srv.base_url, 'demo', limit=1, branches=1, probe_every=T, max_new_tokens=L, out=tmp_path / 's.json',
                tokenizer='server', progress=False)
    assert json.loads(sidecar_path(tmp_path / 's.json').read_text())['token_source'] == 'tokenize'
    [mine], first = json.loads((tmp_path / 's.json').read_text()), json.loads(out.read_text())[0]
    assert mine['each_branch'][0] == first['each_branch'][0]      # branch 0 has the same seed in both builds


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


class _ChatOnly(http.server.BaseHTTPRequestHandler):
    "A server that lists a model and has no completions endpoint (404 for it, as a chat-only server answers)."
    name = MODEL
    def log_message(self, *a): pass
    def reply(self, code, out):
        data = json.dumps(out).encode()
        self.send_response(code); self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self.reply(200, {'object': 'list', 'data': [{'id': type(self).name}]}) if self.path == '/v1/models' else self.reply(404, {'detail': 'Not Found'})
    def do_POST(self):
        self.rfile.read(int(self.headers.get('Content-Length') or 0)); self.reply(404, {'detail': 'Not Found'})


def test_unreachable_and_chat_only_servers_are_one_line(tmp_path, capsys):
    from tmas_nb.cli import main
    rc = main(['replay', 'build', '--base-url', f'http://127.0.0.1:{free_port()}/v1', '--model', MODEL, '--benchmark', 'demo',
               '--limit', '1', '--branches', '1', '--probe-every', '8', '--max-new-tokens', '8', '--out', str(tmp_path / 'x.json')])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith('tmas: error: cannot reach') and '--base-url' in err and len(err.splitlines()) == 1
    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), _ChatOnly)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ValueError, match='has no completions endpoint') as e:
            build_store(f'http://127.0.0.1:{srv.server_address[1]}/v1', 'demo', limit=1, branches=1, probe_every=8,
                        max_new_tokens=8, out=tmp_path / 'y.json', progress=False)
        assert '\n' not in str(e.value) and 'tmas serve' in str(e.value)
        _ChatOnly.name = 'some-org/remote-model'                  # no local tokenizer, and the server has none to offer
        with pytest.raises(ValueError, match='pass --tokenizer NAME'):
            build_store(f'http://127.0.0.1:{srv.server_address[1]}/v1', 'demo', limit=1, branches=1, probe_every=8,
                        max_new_tokens=8, out=tmp_path / 'z.json', progress=False)
    finally:
        _ChatOnly.name = MODEL
        srv.shutdown(); srv.server_close()
