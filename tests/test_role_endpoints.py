"""Per-role endpoints against two real `tmas serve` processes on loopback: RSE's rollouts on one server, its distiller
on the other (`--role-endpoint distiller=URL,MODEL`), at RSE's protocol (`--preset rse-paper`) with few tokens."""
import contextlib, io, json, sqlite3

import pytest

from tmas_nb.cli import main
from test_llm_server import Server, free_port


@pytest.fixture(scope='module')
def two_servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp('logs')
    a = Server(free_port(), logs, flags=('--max-n', '4', '--served-model', 'solver'))
    b = Server(free_port(), logs, flags=('--max-n', '4', '--served-model', 'distiller'))
    try:
        a.wait_ready(); b.wait_ready()
        yield a, b
    finally:
        a.kill(); b.kill()


def test_rse_paper_with_solutions_and_distiller_on_two_servers(two_servers, tmp_path):
    a, b = two_servers
    out = tmp_path / 'run'
    argv = ['run', '--method', 'rse', '--benchmark', 'demo', '--limit', '1', '--preset', 'rse-paper', '--n-candidates', '2',
            '--iterations', '2', '--max-new-tokens', '12', '--backend', 'openai', '--base-url', a.url, '--model', 'solver',
            '--role-endpoint', f'distiller={b.url},distiller', '--runs', '1', '--quiet', '--out', str(out)]   # one of rse-paper's 8 runs
    with contextlib.redirect_stderr(io.StringIO()) as err: assert main(argv) == 0, err.getvalue()
    assert 'rule-graded, as the paper;' in err.getvalue()          # RSE checks answers by rule (TMAS: by an LLM judge)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf): assert main(['runs', 'summary', str(out), '--json']) == 0
    s = json.loads(buf.getvalue())
    assert set(s['tokens_by_endpoint']) == {a.url, b.url}
    assert list(s['tokens_by_endpoint'][a.url]) == ['solution'] and list(s['tokens_by_endpoint'][b.url]) == ['distillation']
    assert s['tokens_by_endpoint'][b.url]['distillation'] > 0
    cfg = json.loads((out / 'config.json').read_text())
    assert cfg['role_endpoints'] == {'distillation': {'base_url': b.url, 'model': 'distiller'}}
    assert cfg['role_servers']['distillation']['served_model'] == 'distiller' and cfg['server']['served_model'] == 'solver'
    with sqlite3.connect(out / 'calls.sqlite') as db:
        rows = dict(db.execute("SELECT json_extract(request, '$.role'), model_id FROM completions GROUP BY 1").fetchall())
    assert rows == {'solution': 'solver', 'distillation': f'distiller@{b.url}'}
