"""`tmas gateway` driven by real clients (the `openai` SDK, sync and async, streaming on and off; lm-evaluation-harness)
in front of a real `tmas serve` of the packaged SmolLM2 on loopback. Every request is a run folder that `tmas runs summary`
reads; a repeated request makes no upstream call; a client that leaves cancels the inner calls and a retry continues."""
import asyncio, contextlib, io, json, logging, os, re, shlex, signal, socket, subprocess, sys, time
from pathlib import Path

import httpx, openai, pytest

from tmas_nb.cli import main
from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.runs.gateway import Gateway, GatewayThread, gateway_limits, problem_for, problem_index
from tmas_nb.llm.openai_backend import OpenAIBackend
from tmas_nb.runs.folder import load_run, read_status
from test_llm_server import Server, free_port

PROBLEMS = demo_problems()
README = Path(__file__).resolve().parents[1] / 'README.md'


@pytest.fixture(scope='module')
def upstream(tmp_path_factory):
    srv = Server(free_port(), tmp_path_factory.mktemp('logs'), flags=('--max-n', '8', '--default-max-tokens', '64'))   # sizes given: no speed measured at start
    try:
        srv.wait_ready()
        yield srv
    finally: srv.kill()


def upstream_counts(srv) -> dict:
    return httpx.get(f'http://127.0.0.1:{srv.port}/health', timeout=10).json()


@pytest.fixture(scope='module')
def gw(upstream, tmp_path_factory):
    "A gateway (cpu-demo preset, demo problems graded) in a thread of this process, over the upstream server."
    llm = OpenAIBackend(None, base_url=upstream.url, max_concurrency=64)
    gateway = Gateway(llm, tmp_path_factory.mktemp('gateway'), llm.model_id, 'openai', llm.base_url, preset='cpu-demo',
                      benchmark='demo', concurrency=32)
    gateway.expose_grades = True                          # the tests compare the answers' grades with the run folders'
    with GatewayThread(gateway, limits=gateway_limits(max_queue=40)) as t:
        yield t, gateway
    llm.close()


def ask(q: str, model: str = 'mv', **settings) -> dict:
    return dict(model=model, messages=[{'role': 'user', 'content': q}], max_tokens=12,
                extra_body={'tmas': {'n_candidates': 2, **settings}})


def summary_json(run_dir) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf): assert main(['runs', 'summary', str(run_dir), '--json']) == 0
    return json.loads(buf.getvalue())


def test_sdk_sync_answer_is_a_run_folder_and_a_repeat_makes_no_upstream_call(gw, upstream):
    t, g = gw
    client = openai.OpenAI(base_url=t.base_url, api_key='unused')
    before = upstream_counts(upstream)['requests']
    raw = client.chat.completions.with_raw_response.create(**ask(PROBLEMS[0].question))
    r, name = raw.parse(), raw.headers['x-tmas-run']
    ext = r.model_extra['tmas']
    assert ext['run'] == name and ext['problem_id'] == 'demo-01' and ext['method'] == 'mv' and ext['graded']
    assert upstream_counts(upstream)['requests'] - before == 1                  # MV@2: one call of n=2
    run = load_run(g.out / name)
    by = run.usage['by_role']
    assert r.usage.completion_tokens == sum(d['completion_tokens'] for d in by.values()) > 0       # summed over inner calls
    assert r.usage.prompt_tokens == sum(d['prompt_tokens'] for d in by.values()) > 0
    assert ext['tokens_by_role']['solution']['completion_tokens'] == r.usage.completion_tokens
    s = summary_json(g.out / name)                                                # `tmas runs summary` reads it unchanged
    assert s['method'] == 'mv' and s['problems'] == 1 and s['complete']
    vote = run.records[run.records.iteration == 1].iloc[0]
    assert ext['answer'] == vote.answer and s['iterations'][-1]['pass_at_1'] == float(vote.correct)
    if vote.answer is not None: assert r.choices[0].message.content == vote.solution   # the voted sample itself
    n = upstream_counts(upstream)['requests']
    again = client.chat.completions.with_raw_response.create(**ask(PROBLEMS[0].question))
    assert upstream_counts(upstream)['requests'] == n                             # the repeat: no upstream call at all
    a = again.parse()
    assert again.headers['x-tmas-run'] == name and a.choices[0].message.content == r.choices[0].message.content
    assert a.usage.completion_tokens == r.usage.completion_tokens and a.model_extra['tmas']['upstream_samples'] == 0


def test_async_sdk_streams_the_answer_and_matches_the_unstreamed_one(gw, upstream):
    t, g = gw
    async def go():
        client = openai.AsyncOpenAI(base_url=t.base_url, api_key='unused')
        kw = ask(PROBLEMS[1].question, 'sampling', iterations=1)
        stream = await client.chat.completions.create(**kw, stream=True, stream_options={'include_usage': True})
        parts, finish, usage, ext = [], None, None, None
        async for ch in stream:
            if ch.choices:
                parts.append(ch.choices[0].delta.content or '')
                if ch.choices[0].finish_reason: finish, ext = ch.choices[0].finish_reason, ch.model_extra['tmas']
            else: usage = ch.usage
        n = upstream_counts(upstream)['requests']
        plain = await client.chat.completions.create(**kw)               # the same request, not streamed: from its folder
        assert upstream_counts(upstream)['requests'] == n
        await client.close()
        return ''.join(parts), finish, usage, ext, plain
    text, finish, usage, ext, plain = asyncio.run(go())
    assert finish in ('stop', 'length') and text and text == plain.choices[0].message.content
    assert usage.completion_tokens == plain.usage.completion_tokens > 0 and ext['run'] == plain.model_extra['tmas']['run']


def test_stream_sends_progress_comments_then_chunks_and_done(gw):
    t, g = gw
    body = {'model': 'sampling', 'messages': [{'role': 'user', 'content': PROBLEMS[2].question}], 'max_tokens': 24,
            'stream': True, 'tmas': {'n_candidates': 2, 'iterations': 1}}
    with httpx.stream('POST', f'{t.base_url}/chat/completions', json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers['content-type'].startswith('text/event-stream')
        lines = [x for x in r.iter_lines() if x]
    first_data = next(i for i, x in enumerate(lines) if x.startswith('data:'))
    assert first_data > 0 and all(x.startswith(': tmas running') for x in lines[:first_data])   # progress before the answer
    assert lines[-1] == 'data: [DONE]'
    chunks = [json.loads(x[6:]) for x in lines[first_data:-1]]
    assert {c['object'] for c in chunks} == {'chat.completion.chunk'} and chunks[-1]['tmas']['run'] == r.headers['x-tmas-run']


def test_refusals_are_one_line_400s_before_any_upstream_call(gw, upstream):
    t, g = gw
    n, folders = upstream_counts(upstream)['requests'], set(os.listdir(g.out))
    post = lambda body, **kw: httpx.post(f'{t.base_url}/chat/completions', json=body, timeout=30, **kw)
    q = [{'role': 'user', 'content': PROBLEMS[3].question}]
    cases = [({'model': 'mv', 'messages': q, 'tmas': {'n_verification': 2}}, 400, '--n-verification does not apply to --method mv'),
             ({'model': 'tmas', 'messages': q, 'tmas': {'epsilon': 2}}, 400, 'TMASConfig.epsilon: must be in [0, 1]'),
             ({'model': 'mv', 'messages': q, 'max_tokens': 100, 'tmas': {'n_candidates': 4, 'max_total_tokens': 300}}, 400,
              'may generate 400 new tokens, over tmas.max_total_tokens of 300'),
             ({'model': 'mv', 'messages': [{'role': 'system', 'content': 'be brief'}, *q]}, 400, 'a system message cannot be passed'),
             ({'model': 'controller:sc:k=2', 'messages': q, 'tmas': {'controller': 'x.py'}}, 400, 'tmas.controller: cannot be set'),
             ({'model': 'controller:discovery:/tmp', 'messages': q}, 400, 'cannot be named by a client'),
             ({'model': 'gpt-4o', 'messages': q}, 404, 'name a method'),
             ({'model': 'mv', 'messages': q, 'n': 3}, 400, 'n: a method gives one answer per request')]
    for body, status, text in cases:
        r = post(body)
        assert r.status_code == status and text in r.json()['error']['message'], (body, r.text)
        assert '\n' not in r.json()['error']['message']
    assert post({'model': 'mv', 'messages': q}, headers={'content-type': 'text/plain'}).status_code == 415
    assert upstream_counts(upstream)['requests'] == n and set(os.listdir(g.out)) == folders   # nothing ran, nothing written


def test_32_concurrent_tmas_requests_each_get_their_own_run_and_a_poison_request_its_400(gw, upstream):
    t, g = gw
    questions = [p.question for p in PROBLEMS] + ['What is 2 + 2?', 'What is 3 + 5?']
    assert len(set(questions)) == 32
    body = lambda q, **s: {'model': 'tmas', 'messages': [{'role': 'user', 'content': q}], 'max_tokens': 2,   # the smallest TMAS:
                           'seed': 3, 'tmas': {'n_candidates': 1, 'n_verifications': 1, 'iterations': 1, **s}}   # 3 calls each
    poison = body(questions[0], n_verifications=-1)
    async def go():
        async with httpx.AsyncClient(timeout=900) as c:
            return await asyncio.gather(*[c.post(f'{t.base_url}/chat/completions', json=b)
                                          for b in [*map(body, questions[:16]), poison, *map(body, questions[16:])]])
    rs = asyncio.run(go())
    bad = rs.pop(16)
    assert bad.status_code == 400 and 'n_verifications' in bad.json()['error']['message']
    known = problem_index('demo')
    for q, r in zip(questions, rs):
        assert r.status_code == 200, r.text
        name = r.headers['x-tmas-run']
        assert r.json()['tmas']['run'] == name and r.json()['tmas']['problem_id'] == problem_for(q, known).id
        run = load_run(g.out / name)
        assert run.complete and run.config['problem_ids'] == [problem_for(q, known).id]
        prompts = run.calls().prompt.tolist()
        assert prompts and all(q in p for p in prompts)                            # every inner call asked its own question
        assert not any(o in p for p in prompts for o in questions if o != q and o not in q)
        best = run.best()
        assert r.json()['choices'][0]['message']['content'] == best.solution.iloc[0]
    assert len({r.headers['x-tmas-run'] for r in rs}) == 32


def test_a_client_that_leaves_cancels_the_inner_calls_and_a_retry_continues_the_run(gw, upstream, caplog):
    t, g = gw
    caplog.set_level(logging.INFO, logger='tmas_nb.runs.gateway')
    body = {'model': 'self-refine', 'messages': [{'role': 'user', 'content': PROBLEMS[4].question}], 'max_tokens': 4,
            'tmas': {'n_candidates': 1, 'iterations': 4}}
    seen = {d for d in os.listdir(g.out) if d.startswith('self-refine-')}
    def started():
        return [d for d in os.listdir(g.out) if d.startswith('self-refine-') and d not in seen
                and list((g.out / d).glob('checkpoints/*/iter_0.json'))]
    async def leave_after_the_first_iteration():
        async with httpx.AsyncClient(timeout=300) as c:
            job = asyncio.ensure_future(c.post(f'{t.base_url}/chat/completions', json=body))
            while not started() and not job.done(): await asyncio.sleep(0.05)
            while not job.done() and (await c.get(f'http://127.0.0.1:{upstream.port}/health')).json()['in_flight'] < 1:
                await asyncio.sleep(0.05)                    # the next iteration's call is on its way upstream
            job.cancel()                                     # the client goes away: its connection is closed
            return await asyncio.gather(job, return_exceptions=True)
    before = upstream_counts(upstream)
    [gone] = asyncio.run(leave_after_the_first_iteration())
    assert isinstance(gone, asyncio.CancelledError)          # it left before the answer
    deadline = time.monotonic() + 60
    while upstream_counts(upstream)['in_flight'] and time.monotonic() < deadline: time.sleep(0.2)
    after = upstream_counts(upstream)
    assert after['disconnected'] > before['disconnected']          # the call in flight was dropped by the gateway
    time.sleep(2)
    assert upstream_counts(upstream)['requests'] == after['requests']   # and no further inner call was sent
    assert g.counts['cancelled'] >= 1
    [name] = started()
    st = read_status(g.out / name)
    assert not st.get('complete') and (g.out / name / 'checkpoints').is_dir()
    done = sorted((g.out / name / 'checkpoints').rglob('iter_*.json'))
    assert 1 <= len(done) < 4
    mtimes = {p: p.stat().st_mtime_ns for p in done}
    r = httpx.post(f'{t.base_url}/chat/completions', json=body, timeout=300)          # the retry continues the run
    assert r.status_code == 200 and r.headers['x-tmas-run'] == name
    assert r.json()['tmas']['resumed'] == {'attempts': st['invocations'], 'calls_kept': st['calls_kept'], 'stopped': st['interrupted']}
    said = [m for m in caplog.messages if m.startswith(name)]                       # the gateway's log, line by line
    assert said[0].startswith(f'{name}: starting self-refine on ') and 'cancelled after' in said[1], said
    assert said[2].startswith(f"{name}: resuming self-refine on ") and f"the attempt before kept {st['calls_kept']} calls" in said[2], said
    assert said[-1].startswith(f'{name}: answered after '), said
    run = load_run(g.out / name)
    assert run.complete and run.status['invocations'] == 2 and sorted(run.records.iteration.unique()) == list(range(4))
    assert all(p.stat().st_mtime_ns == m for p, m in mtimes.items())          # the finished iterations were kept, not redone
    assert upstream_counts(upstream)['requests'] - after['requests'] == 4 - len(done)


def readme_block(lang: str, start: str) -> str:
    "The README's fenced `lang` block of the gateway section whose first line starts with `start`."
    text = README.read_text(encoding='utf-8').split('## Use any method from any OpenAI client', 1)[1].split('\n## ', 1)[0]
    [block] = [b for b in re.findall(rf'```{lang}\n(.*?)```', text, re.S) if b.startswith(start) or f'\n{start}' in b]
    return block


def test_the_readme_gateway_snippet_completes_with_the_settings_it_gives(upstream, tmp_path):
    """The README's `tmas gateway` line over `tmas serve`, then its Python snippet as printed (only the ports differ): the
    client waits with the timeout and retries the README gives, the request completes, and the gateway's log shows its
    start, progress and answer."""
    snippet = readme_block('python', 'from openai import OpenAI')
    assert 'timeout=' in snippet and 'max_retries=0' in snippet, snippet
    [line] = [l for l in readme_block('bash', 'tmas serve').splitlines() if l.startswith('tmas gateway ')]
    port = free_port()
    argv = shlex.split(line.split('#')[0])[1:]
    argv = [upstream.url if a == 'http://127.0.0.1:8000/v1' else str(port) if a == '8100' else str(tmp_path / 'gateway-runs')
            if a == 'gateway-runs' else a for a in argv]
    assert argv[:3] == ['gateway', '--upstream', upstream.url] and str(port) in argv, argv
    log = tmp_path / 'gateway.log'
    with open(log, 'wb') as f:
        proc = subprocess.Popen([sys.executable, '-m', 'tmas_nb.cli', *argv, '--progress-every', '2'], stdout=f, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            try:
                if httpx.get(f'http://127.0.0.1:{port}/health', timeout=1).status_code == 200: break
            except httpx.HTTPError: time.sleep(0.1)
        code = snippet.replace('127.0.0.1:8100', f'127.0.0.1:{port}')
        r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert 'CompletionUsage(completion_tokens=' in r.stdout and "'method': 'tmas'" in r.stdout and "'resumed': None" in r.stdout, r.stdout[-2000:]
    finally:
        proc.terminate(); proc.wait(timeout=30)
    said = log.read_text()
    run = re.search(r"'run': '([^']+)'", r.stdout)[1]
    assert f'tmas gateway: {run}: starting tmas on demo-01' in said and f'tmas gateway: {run}: answered after ' in said, said
    assert f'tmas gateway: {run}: running ' in said, said                       # progress every 2 s while it ran


def test_dry_run_times_a_server_that_publishes_no_speed(upstream, capsys):
    "This server was given its sizes, so it measured nothing at start: `tmas run --dry-run` times a few short calls (1 and 4 in flight) and estimates from them."
    assert 'tokens_per_s' not in httpx.get(upstream.url + '/models').json()['data'][0]
    before = upstream_counts(upstream)['requests']
    assert main(['run', '--method', 'mv', '--benchmark', 'demo', '--limit', '1', '--n-candidates', '4', '--max-new-tokens', '8',
                 '--concurrency', '1', '--base-url', upstream.url, '--dry-run']) == 0
    out = capsys.readouterr().out
    assert 'wall time: about unknown' not in out and 'from short calls of 16 tokens timed now, 1 and 4 in flight)' in out, out
    assert upstream_counts(upstream)['requests'] - before == 5


LME_TASK = """task: tmas_demo
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: []
  max_gen_toks: 16
  temperature: 1.0
  do_sample: true
  tmas:
    branches: 2
    probe_every: 16
    probe_tokens: 4
filter_list:
  - name: boxed
    filter:
      - function: regex
        regex_pattern: "\\\\\\\\boxed\\\\{{([^{{}}]*)\\\\}}"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def test_lm_evaluation_harness_accuracy_equals_the_run_folders(gw, tmp_path):
    lm_eval = pytest.importorskip('lm_eval', reason='lm-eval is a development dependency (pip install -e ".[dev]")')
    from lm_eval.tasks import TaskManager
    t, g = gw
    probs = PROBLEMS[:2]
    data = tmp_path / 'demo.jsonl'
    data.write_text(''.join(json.dumps({'id': p.id, 'question': p.question, 'answer': p.answer}) + '\n' for p in probs))
    (tmp_path / 'tmas_demo.yaml').write_text(LME_TASK.format(data=data))
    before = set(os.listdir(g.out))
    res = lm_eval.simple_evaluate(
        model='local-chat-completions', tasks=['tmas_demo'], task_manager=TaskManager(include_path=str(tmp_path)),
        model_args=f'base_url={t.base_url}/chat/completions,model=controller:sc:k=2,tokenizer_backend=None,'
                   'tokenized_requests=False,max_retries=1,timeout=600', apply_chat_template=True, log_samples=True)
    acc = res['results']['tmas_demo']['exact_match,boxed']
    new = sorted(set(os.listdir(g.out)) - before)
    assert len(new) == len(probs)
    runs = {load_run(g.out / d).config['problem_ids'][0]: g.out / d for d in new}
    assert sorted(runs) == [p.id for p in probs]
    passes = [summary_json(d)['iterations'][-1]['pass_at_1'] for d in runs.values()]
    assert acc == pytest.approx(sum(passes) / len(passes))                 # the harness's accuracy = `tmas runs summary`'s
    for s in res['samples']['tmas_demo']:                                   # and answer by answer
        got = load_run(runs[s['doc']['id']]).records.answer.iloc[-1]
        assert s['filtered_resps'][0] == (got if got is not None else '[invalid]')


def test_gateway_command_refuses_an_open_host_without_a_key(capsys):
    assert main(['gateway', '--upstream', 'http://127.0.0.1:9/v1', '--host', '0.0.0.0']) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('tmas: error: --host 0.0.0.0 makes the server reachable') and '\n' not in err


def test_sigterm_cancels_the_work_in_flight_and_the_folder_resumes(gw, upstream, tmp_path):
    t, g = gw
    port = free_port()
    log = tmp_path / 'gateway.log'
    with open(log, 'wb') as f:
        proc = subprocess.Popen([sys.executable, '-m', 'tmas_nb.cli', 'gateway', '--upstream', upstream.url, '--port', str(port),
                                 '--out', str(g.out), '--preset', 'cpu-demo', '--benchmark', 'demo', '--shutdown-timeout', '0.5'],
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            try:
                if httpx.get(f'http://127.0.0.1:{port}/health', timeout=1).status_code == 200: break
            except httpx.HTTPError: time.sleep(0.1)
        body = {'model': 'self-refine', 'messages': [{'role': 'user', 'content': PROBLEMS[5].question}], 'max_tokens': 4,
                'tmas': {'n_candidates': 1, 'iterations': 6}}
        async def go():
            async with httpx.AsyncClient(timeout=120) as c:
                job = asyncio.ensure_future(c.post(f'http://127.0.0.1:{port}/v1/chat/completions', json=body))
                while not [d for d in os.listdir(g.out) if d.startswith('self-refine-') and d not in seen
                           and list((g.out / d).glob('checkpoints/*/iter_0.json'))]:
                    await asyncio.sleep(0.1)
                proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(job, return_exceptions=True)
        seen = {d for d in os.listdir(g.out) if d.startswith('self-refine-')}
        [answer] = asyncio.run(go())
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM), log.read_text()[-2000:]   # uvicorn re-raises the signal it handled
        assert not isinstance(answer, Exception), answer                               # answered, not dropped
        assert answer.status_code == 503 and answer.headers['retry-after'] == '1', answer.text   # the run was cancelled
        assert 'shutting down' in answer.json()['error']['message']
        [name] = [d for d in os.listdir(g.out) if d.startswith('self-refine-') and d not in seen]
        assert not read_status(g.out / name).get('complete')
        r = httpx.post(f'{t.base_url}/chat/completions', json=body, timeout=300)      # the same request elsewhere continues it
        assert r.status_code == 200 and r.headers['x-tmas-run'] == name
        run = load_run(g.out / name)
        assert run.complete and run.status['invocations'] == 2
    finally:
        if proc.poll() is None: proc.kill()


def test_a_live_controller_request_reuses_the_tokenizer_of_the_last_one():
    "Each controller request opens a live model that checks the server's tokenizer; the local one is loaded once per process."
    from tmas_nb.autotts.build import _local_tokenizer
    assert _local_tokenizer(None, 'smollm2') is _local_tokenizer(None, 'smollm2')


def test_a_full_queue_answers_503_with_retry_after(gw):
    t, g = gw
    import threading
    with GatewayThread(g, limits=gateway_limits(max_queue=1)) as one:
        body = lambda q: {'model': 'sampling', 'messages': [{'role': 'user', 'content': q}], 'max_tokens': 4,
                          'tmas': {'n_candidates': 1, 'iterations': 2}}
        first = {}
        th = threading.Thread(target=lambda: first.setdefault('r', httpx.post(f'{one.base_url}/chat/completions',
                                                                                 json=body(PROBLEMS[6].question), timeout=300)))
        th.start()
        while httpx.get(f'http://{one.host}:{one.port}/health').json()['admitted'] < 1: time.sleep(0.05)
        r = httpx.post(f'{one.base_url}/chat/completions', json=body(PROBLEMS[7].question), timeout=30)
        assert r.status_code == 503 and r.headers['retry-after'] == '1' and 'busy' in r.json()['error']['message']
        th.join()
        assert first['r'].status_code == 200


def test_hostile_clients_meet_the_guards_of_tmas_serve(tmp_path):
    """The gateway's HTTP side is `tmas serve`'s (tmas_nb.llm.guards): the documentation is behind the key; JSON nested too
    deep, too many messages and a lone surrogate are 400s before any work; a connection that never finishes its headers
    is answered 408 and closed by the header timeout. No model is loaded and no run folder is written."""
    g = Gateway(None, tmp_path / 'runs', 'smollm2', 'transformers', preset='cpu-demo')
    with GatewayThread(g, limits=gateway_limits(header_timeout_s=1.0, max_messages=8), api_key='k3y') as t:
        base, key = f'http://{t.host}:{t.port}', {'authorization': 'Bearer k3y'}
        for path in ('/docs', '/redoc', '/openapi.json', '/v1/models'):
            r = httpx.get(base + path)
            assert (r.status_code, r.headers.get('connection')) == (401, 'close'), path
            assert httpx.get(base + path, headers=key).status_code == 200, path
        assert httpx.get(base + '/health').status_code == 200                         # open, as tmas serve's
        chat, as_json = base + '/v1/chat/completions', {**key, 'content-type': 'application/json'}
        q = [{'role': 'user', 'content': 'What is 2 + 2?'}]
        cases = [('{"model": "mv", "messages": ' + '[' * 100_000 + ']' * 100_000 + '}', 'levels deep'),
                 (json.dumps({'model': 'mv', 'messages': q * 9}), 'messages: 9 messages; this server takes at most 8'),
                 (json.dumps({'model': 'mv', 'messages': q * 400}), 'messages: 400 messages'),    # counted before parsing
                 ('{"model": "\\ud800", "messages": ' + json.dumps(q) + '}', 'model: holds a lone surrogate')]
        for raw, needle in cases:
            r = httpx.post(chat, content=raw, headers=as_json, timeout=30)
            assert r.status_code == 400 and needle in r.json()['error']['message'], (needle, r.text[:300])
        with socket.create_connection((t.host, t.port), timeout=15) as c:
            c.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n')      # the headers never end
            t0, data = time.monotonic(), b''
            while chunk := c.recv(65536): data += chunk
            waited = time.monotonic() - t0
        assert data.startswith(b'HTTP/1.1 408') and b'--header-timeout' in data and 0.8 < waited < 8, (data[:200], waited)
        h = httpx.get(base + '/health').json()
        assert h['connections']['timed_out'] >= 1 and h['refused'] == len(cases) and h['completed'] == 0
    assert not os.listdir(g.out)
