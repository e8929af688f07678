"""`tmas run --base-url` through a real router: two `tmas serve` processes (SmolLM2-135M) behind `vllm-router`
(or `sglang-router`), all on 127.0.0.1.

The router is found through $TMAS_ROUTER (a path to the `vllm-router` or `sglang-router` binary), beside the
interpreter (the environment's bin folder: `vllm-router` is a development dependency in settings.ini) or on PATH;
`pip install vllm-router` (or `sglang-router`) installs either, without torch. Without one the test is skipped,
saying so, except under CI (`CI` set), where a missing router is a failure.
"""
import json, os, shutil, socket, subprocess, sys, time
from pathlib import Path

import httpx
import pytest

from test_llm_server import Server, free_port

ROUTERS = ('vllm-router', 'sglang-router')
INSTALL = 'pip install vllm-router   # or: pip install sglang-router (either brings its binary, no torch)'


def router_binary() -> str | None:
    "The router binary: $TMAS_ROUTER, else the first of ROUTERS beside the interpreter or on PATH."
    given = os.environ.get('TMAS_ROUTER')
    if given: return given if Path(given).is_file() else None
    here = Path(sys.executable).parent
    for name in ROUTERS:
        if (here / name).is_file(): return str(here / name)
        if shutil.which(name): return shutil.which(name)
    return None


def router_command(binary: str, workers: list[str], port: int, policy: str = 'round_robin') -> list[str]:
    "The command line of either router in front of `workers`."
    sub = ['launch'] if Path(binary).name.startswith('sglang') else []
    return [binary, *sub, '--worker-urls', *workers, '--host', '127.0.0.1', '--port', str(port), '--policy', policy]


def wait_for_router(port: int, proc, log: Path, timeout: float = 120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None: pytest.fail(f'the router exited with {proc.returncode}:\n{log.read_text()[-3000:]}')
        try:
            r = httpx.post(f'http://127.0.0.1:{port}/v1/chat/completions', timeout=30,
                           json={'model': 'smollm2', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 1})
            if r.status_code == 200: return
        except httpx.HTTPError: pass
        time.sleep(0.5)
    pytest.fail(f'the router did not answer within {timeout}s:\n{log.read_text()[-3000:]}')


def test_tmas_run_through_a_router_in_front_of_two_servers(tmp_path, data_root):
    binary = router_binary()
    if binary is None:
        why = f'no router binary (vllm-router or sglang-router; or set TMAS_ROUTER): {INSTALL}'
        if os.environ.get('CI'): pytest.fail(why + ' (CI installs it from settings.ini)')
        pytest.skip(why)
    servers = [Server(free_port(), tmp_path), Server(free_port(), tmp_path)]
    router, log = None, tmp_path / 'router.log'
    try:
        for s in servers: s.wait_ready()
        port = free_port()
        with open(log, 'wb') as f:
            router = subprocess.Popen(router_command(binary, [f'http://127.0.0.1:{s.port}' for s in servers], port),
                                      stdout=f, stderr=subprocess.STDOUT)
        wait_for_router(port, router, log)
        before = [httpx.get(s.url + '/usage', timeout=10).json()['total']['samples'] for s in servers]
        out = tmp_path / 'run'
        cmd = [sys.executable, '-m', 'tmas_nb.cli', 'run', '--method', 'tmas', '--benchmark', 'demo', '--limit', '2',
               '--n-candidates', '2', '--n-verifications', '2', '--iterations', '1', '--max-new-tokens', '8',
               '--seed', '7', '--model', 'smollm2', '--backend', 'openai', '--base-url', f'http://127.0.0.1:{port}/v1',
               '--quiet', '--out', str(out)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                           env={**os.environ, 'TMAS_DATA_DIR': str(data_root)})
        assert p.returncode == 0, p.stderr[-3000:]
        # both servers answered the run's calls (the router's round robin), each by its own per-role account
        answered = [httpx.get(s.url + '/usage', timeout=10).json()['total']['samples'] - b for s, b in zip(servers, before)]
        assert all(a > 0 for a in answered), answered
        import pandas as pd
        rec = pd.read_parquet(out / 'records.parquet')
        assert len(rec) == 2 * 2 and rec.solution.notna().all()
        cfg = json.loads((out / 'config.json').read_text())
        assert cfg['config']['seed'] == 7 and cfg['server']['served_model'] == 'smollm2'
        assert json.loads((out / 'status.json').read_text())['complete'] is True
        usage = json.loads((out / 'usage.json').read_text())['total']
        assert usage['samples'] == sum(answered) and usage['completion_tokens'] > 0   # every sample the servers made is recorded
    finally:
        if router is not None: router.kill(); router.wait(timeout=30)
        for s in servers: s.kill()
