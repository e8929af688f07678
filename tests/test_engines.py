"""`tmas engines` and `--backend auto`: measuring the CPU engines on this machine and running each run on the faster one.

The tests without a llama.cpp build run in CI; the ones that start a real `llama-server` are marked slow (see
tests/test_llamacpp_interop.py for how to get the binary).
"""
import asyncio, json, os

import pytest

import tmas_nb.llm.llamacpp as llamacpp
from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.llm.core import Request
from tmas_nb.llm.loading import load_llm
from tmas_nb.llm.engines import (calibrate, calibration_path, choose_engine, machine_fingerprint, read_calibration,
                                 run_width)
from tmas_nb.methods.loop import BaselineConfig
from tmas_nb.runs.start import resolve_auto_backend, start_run
from tests.test_cli import tmas, one_error_line


@pytest.fixture
def engines_dir(tmp_path, monkeypatch):
    d = tmp_path / 'engines'
    monkeypatch.setenv('TMAS_ENGINES_DIR', str(d))
    return d


def test_calibrate_measures_our_engines_and_saves_the_table(engines_dir):
    "A real, short calibration of the in-process engines: positive tokens/s at each width, saved with the machine."
    cal = calibrate('smollm2', threads=1, widths=(1, 4), max_new_tokens=6, engines=['transformers', 'transformers-int8'],
                    progress=False)
    assert set(cal['tokens_per_s']) == {'transformers', 'transformers-int8'}
    assert all(set(row) == {'1', '4'} and all(v > 0 for v in row.values()) for row in cal['tokens_per_s'].values())
    assert read_calibration('smollm2', 1) == cal and calibration_path('smollm2', 1).parent == engines_dir
    assert cal['machine'] == machine_fingerprint() and cal['threads'] == 1
    c = choose_engine('smollm2', 4, 1, device='cpu')       # the faster of the two measured engines, and why
    faster = max(cal['tokens_per_s'], key=lambda e: cal['tokens_per_s'][e]['4'])
    assert c.engine == faster and c.backend == 'transformers' and 'not measured: llama.cpp' in c.reason
    assert (c.kwargs.get('quantize') == 'int8') == (faster == 'transformers-int8')


def test_int8_engine_keeps_seeds_exact():
    "Row-scaled int8 layers on the real model: seeded requests give the same text alone and among 8, and differ by seed."
    llm = load_llm('default', num_threads=1, quantize='int8')
    try:
        assert llm.model_id == 'qwen2.5-coder-0.5b+int8'      # its call-cache entries never mix with float32's
        alone, together = alone_and_together(llm, k=2, others=6)
        assert alone == together, list(zip(alone, together))
        assert len(set(alone)) == len(alone)
        [[g]] = llm.generate_sync([Request.from_prompt('What is 6 times 7? Reply with the number only.', temperature=0.0,
                                                       max_new_tokens=8)])
        assert '42' in g.text, g.raw
    finally: llm.close()


def test_auto_without_a_calibration_runs_float32_and_records_why(engines_dir, tmp_path):
    "A real run with --backend auto on a machine never calibrated: our float32 engine, the reason in config.json, a resume."
    cfg = BaselineConfig(n_candidates=2, max_new_tokens=8, seed=0)
    problems = demo_problems()[:1]
    run = asyncio.run(start_run('mv', problems, cfg, tmp_path / 'run', backend='auto', concurrency=1, progress=False,
                                num_threads=1))
    saved = json.loads((tmp_path / 'run' / 'config.json').read_text())
    assert run.complete and saved['backend'] == 'transformers' and saved['model_id'] == 'qwen2.5-coder-0.5b'
    assert saved['engine_choice']['backend'] == 'transformers' and saved['engine_choice']['width'] == 2
    assert 'were not measured on this machine with 1 thread' in saved['engine_choice']['reason']
    assert saved['engine_choice']['kwargs'] == {'num_threads': 1} and saved['quantize'] is None
    again = asyncio.run(start_run('mv', problems, cfg, tmp_path / 'run', backend='auto', concurrency=1, progress=False))
    assert again.status['last_invocation_cache']['misses'] == 0
    assert json.loads((tmp_path / 'run' / 'config.json').read_text())['engine_choice'] == saved['engine_choice']


def test_a_resumed_auto_run_keeps_its_engine(tmp_path, engines_dir):
    "The engine recorded in config.json wins over a new choice; --threads still applies."
    run_dir = tmp_path / 'r'; run_dir.mkdir()
    choice = {'backend': 'llama.cpp', 'kwargs': {'threads': 2, 'n_parallel': 1}, 'reason': 'measured', 'width': 1}
    (run_dir / 'config.json').write_text(json.dumps({'backend': 'llama.cpp', 'engine_choice': choice}))
    backend, got, kw = resolve_auto_backend(run_dir, 'default', BaselineConfig(n_candidates=64), 4, {'threads': 1})
    assert (backend, got, kw) == ('llama.cpp', choice, {'threads': 1, 'n_parallel': 1})
    # a new folder: chosen now (our engine, since nothing is calibrated in this empty folder)
    backend, got, kw = resolve_auto_backend(tmp_path / 'new', 'default', BaselineConfig(n_candidates=4), 2, {'threads': 1})
    assert backend == 'transformers' and kw == {'num_threads': 1} and got['width'] == 8


def test_run_flags_that_do_not_fit_the_backend_are_refused():
    r = tmas('run', '--method', 'mv', '--benchmark', 'demo', '--out', 'x', '--backend', 'transformers', '--llama-slots', '4')
    assert r.returncode == 2 and '--llama-slots applies to --backend llama.cpp only' in one_error_line(r)
    r = tmas('run', '--method', 'mv', '--benchmark', 'demo', '--out', 'x', '--backend', 'openai', '--threads', '2')
    assert r.returncode == 2 and '--threads applies to the engines run here' in one_error_line(r)
    r = tmas('run', '--method', 'mv', '--benchmark', 'demo', '--out', 'x', '--backend', 'auto', '--quantize', 'int8')
    assert r.returncode == 2 and '--quantize applies to --backend transformers only' in one_error_line(r)
    r = tmas('engines', 'calibrate', '--widths', '1,x')
    assert r.returncode == 2 and '--widths' in one_error_line(r)
    r = tmas('engines', 'calibrate', '--engines', 'vllm')
    assert r.returncode == 2 and "unknown ['vllm']" in one_error_line(r)


def test_engines_show_without_a_calibration(engines_dir):
    r = tmas('engines', 'show', '--threads', '1', '--width', '16')
    assert r.returncode == 0 and 'no calibration for qwen2.5-coder-0.5b with 1 threads' in r.stdout
    assert 'a run 16 wide: transformers (' in r.stdout and 'a run 1 wide: transformers (' in r.stdout


# ---- with a real llama-server (slow)

@pytest.fixture(scope='module')
def binary():
    b = llamacpp.find_llama_server()
    if b is None: pytest.skip(f'no llama-server binary: {llamacpp.BUILD_HINT}')
    return b


POEM = 'Write a short poem about the sea.'


def alone_and_together(llm, k=4, others=8):
    "Texts of k seeded requests sent one at a time, and the same requests sent at once among `others`."
    reqs = [Request.from_prompt(POEM, max_new_tokens=24, temperature=1.0, seed=100 + i) for i in range(others)]
    alone = [llm.generate_sync([r])[0][0].raw for r in reqs[:k]]
    async def together(): return await asyncio.gather(*[llm.generate([r]) for r in reqs])
    return alone, [g[0][0].raw for g in asyncio.run(together())][:k]


@pytest.mark.slow
def test_llama_cpp_with_one_slot_is_seed_exact(binary):
    "One slot, no prompt cache: a seeded request gives the same text alone and among 8 (with 8 slots it need not)."
    llm = load_llm('llama.cpp:default', threads=1)
    try:
        assert llm.record()['seed_exact'] is True and llm.record()['n_parallel'] == 1
        alone, together = alone_and_together(llm)
        assert alone == together, list(zip(alone, together))
        [a] = llm.generate_sync([Request.from_prompt(POEM, n=3, max_new_tokens=24, temperature=1.0, seed=7)])
        assert len({c.raw for c in a}) > 1                      # n is split into separately seeded calls that differ
        [b] = llm.generate_sync([Request.from_prompt(POEM, n=3, max_new_tokens=24, temperature=1.0, seed=7)])
        assert [c.raw for c in a] == [c.raw for c in b]
    finally: llm.close()
    fast = load_llm('llama.cpp:default', threads=1, n_parallel=8)
    try:
        alone, together = alone_and_together(fast)
        print(f'8 slots: {sum(x == y for x, y in zip(alone, together))} of 4 seeded requests the same alone and among 8')
        assert fast.record()['seed_exact'] is False
    finally: fast.close()


@pytest.mark.slow
def test_calibrate_both_engines_and_run_on_the_faster(binary, engines_dir, tmp_path):
    "`tmas engines calibrate` with llama.cpp, then `tmas run --backend auto` runs on the engine measured faster at its width."
    r = tmas('engines', 'calibrate', '--threads', '1', '--widths', '1,8', '--max-new-tokens', '16')
    assert r.returncode == 0, r.stderr
    cal = read_calibration('default', 1)
    print(r.stdout)
    assert set(cal['tokens_per_s']) == {'transformers', 'transformers-int8', 'llama.cpp'}
    for width in (1, 8):
        speeds = {e: cal['tokens_per_s'][e][str(width)] for e in cal['tokens_per_s']}
        c = choose_engine('default', width, 1, device='cpu')
        assert c.engine == max(speeds, key=speeds.get) and c.tokens_per_s == pytest.approx(speeds, abs=0.01)
    out = tmp_path / 'run'
    r = tmas('run', '--method', 'mv', '--benchmark', 'demo', '--limit', '1', '--n-candidates', '1', '--concurrency', '1',
             '--max-new-tokens', '16', '--threads', '1', '--quiet', '--out', out)
    assert r.returncode == 0, r.stderr
    saved = json.loads((out / 'config.json').read_text())
    expected = choose_engine('default', 1, 1, device='cpu')
    assert saved['backend'] == expected.backend == saved['engine_choice']['backend']
    assert saved['engine_choice']['engine'] == expected.engine and saved['quantize'] == expected.kwargs.get('quantize')
    if expected.backend == 'llama.cpp':
        assert saved['server']['engine'] == 'llama.cpp' and saved['server']['seed_exact'] is True
        assert saved['model_id'] == 'qwen2.5-coder-0.5b'


@pytest.mark.slow
def test_build_llama_is_up_to_date_in_seconds(binary):
    "`tmas engines build-llama` on a finished build: cmake and ninja find nothing to do and the same binary comes back."
    import time
    if binary.parent.parent.parent.parent != llamacpp.LLAMA_CACHE:
        pytest.skip(f'{binary} was not built by `tmas engines build-llama` (not under {llamacpp.LLAMA_CACHE})')
    t0 = time.perf_counter()
    r = tmas('engines', 'build-llama', '--quiet')
    assert r.returncode == 0, r.stderr
    assert str(binary) in r.stdout and time.perf_counter() - t0 < 120
