"""The `tmas` command line: one error path for every subcommand, `-p` values read like papermill's, `--data-dir`
pointing at the replay folder, and `tmas report all` on a checkout without inputs."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tmas_nb import cli, errors
from tmas_nb.analysis import reporting
from tmas_nb.cli import main

REPO = Path(__file__).resolve().parents[1]


class Result:
    def __init__(self, returncode, stdout, stderr): self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def tmas(*args, cwd=None, env=None):
    "Run `tmas ARGS` in this process (as `main` does for the console script); returns its status, stdout and stderr."
    import contextlib, io
    out, err, old_cwd, old_env = io.StringIO(), io.StringIO(), os.getcwd(), dict(os.environ)
    try:
        if cwd: os.chdir(cwd)
        os.environ.update(env or {})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try: rc = main([str(a) for a in args])
            except SystemExit as e: rc = e.code
    finally:
        os.chdir(old_cwd); os.environ.clear(); os.environ.update(old_env)
    return Result(rc, out.getvalue(), err.getvalue())


def tmas_subprocess(*args, timeout=300):
    "Run `python -m tmas_nb.cli ARGS` in a new process, exactly as a user would."
    return subprocess.run([sys.executable, '-m', 'tmas_nb.cli', *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


def one_error_line(r) -> str:
    "The stderr of a failed command: exactly one line starting with `tmas: error: `."
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith('tmas: error: '), r.stderr
    assert 'Traceback' not in r.stderr
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


# ---- expected failures: one line, exit 2 ------------------------------------------------------------------------

def test_bad_command_line_is_argparse_exit_2():
    r = tmas_subprocess('run', '--method', 'no-such-method', '--benchmark', 'demo', '--out', 'x')
    assert r.returncode == 2 and "tmas run: error: argument --method: invalid choice: 'no-such-method'" in r.stderr


def test_missing_run_folder_is_one_line(tmp_path):
    r = tmas('runs', 'summary', tmp_path / 'nothing')
    assert r.returncode == 2
    assert 'no config.json' in one_error_line(r) and 'tmas run' in r.stderr


def test_value_error_from_a_subcommand(tmp_path):
    bad = tmp_path / 'cfg.json'
    bad.write_text('{"n_candidates": ')
    r = tmas('run', '--method', 'tmas', '--benchmark', 'demo', '--config', bad, '--out', tmp_path / 'r')
    assert r.returncode == 2 and f'--config {bad}: not valid JSON' in one_error_line(r)


def test_grade_error_goes_through_the_one_path():
    r = tmas('grade', '--gold', ' ', '--pred', '1')
    assert r.returncode == 2 and 'reference answer is empty' in one_error_line(r)


def test_server_that_does_not_answer_is_one_line(tmp_path):
    "Nothing listens on the port: the OpenAI-compatible backend gives up after its retries and says so in one line."
    url = f'http://127.0.0.1:{free_port()}/v1'
    r = tmas('run', '--method', 'sampling', '--benchmark', 'demo', '--limit', '1', '--n-candidates', '1',
             '--backend', 'openai', '--base-url', url, '--model', 'm', '--quiet', '--out', tmp_path / 'r')
    assert r.returncode == 2, r.stderr
    line = one_error_line(r)
    assert '127.0.0.1' in line or 'connect' in line.lower(), line


@pytest.mark.parametrize('exc,needle', [
    (KeyError('unknown method sampler'), 'tmas: error: unknown method sampler\n'),
    (OSError(98, 'Address already in use'), 'tmas: error: Address already in use\n'),
    (PermissionError(13, 'Permission denied', '/root/x'), "tmas: error: [Errno 13] Permission denied: '/root/x'\n"),
    (errors.UserError('report compute needs run folders'), 'tmas: error: report compute needs run folders\n'),
])
def test_expected_exceptions_map_to_one_line(monkeypatch, capsys, exc, needle):
    def fail(*a, **k): raise exc
    monkeypatch.setattr('tmas_nb.data.grading.grade_detail', fail)
    assert main(['grade', '--gold', '1', '--pred', '1']) == 2
    assert capsys.readouterr().err == needle


def test_papermill_error_names_the_cell_error(tmp_path):
    "A report whose notebook raises an expected error: one line with the error from inside the notebook, exit 2."
    run = tmp_path / 'runs' / 'broken'
    run.mkdir(parents=True)
    (run / 'config.json').write_text(json.dumps({'method': 'tmas'}))
    r = tmas('report', 'tmas_iterations', '--quiet', '--out', tmp_path / 'out', '-p', f'runs=["{run}"]')
    assert r.returncode == 2, r.stderr[-2000:]
    line = [l for l in r.stderr.splitlines() if l.startswith('tmas: error: ')]
    assert len(line) == 1 and 'Traceback' not in r.stderr and str(run) in line[0], r.stderr[-2000:]
    assert line[0].startswith('tmas: error: report tmas_iterations: ') and 'tmas_iterations.ipynb)' in line[0]


# ---- unexpected failures: a summary and the saved traceback, exit 1 ---------------------------------------------

def test_a_bug_prints_a_summary_and_saves_the_traceback(monkeypatch, capsys, tmp_path):
    def bug(*a, **k): raise TypeError('unsupported operand\nmore detail')
    monkeypatch.setattr('tmas_nb.data.grading.grade_detail', bug)
    monkeypatch.setenv('TMAS_ERROR_DIR', str(tmp_path / 'errors'))
    assert main(['grade', '--gold', '1', '--pred', '1']) == 1
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith('tmas: unexpected error: TypeError: unsupported operand (full traceback: ')
    [saved] = (tmp_path / 'errors').iterdir()
    assert str(saved) in err
    text = saved.read_text()
    assert 'Traceback (most recent call last)' in text and 'more detail' in text and 'def bug' not in err


def test_modules_have_no_entry_points_of_their_own():
    for m in ('tmas_nb.data.grading', 'tmas_nb.runs.start', 'tmas_nb.llm.server', 'tmas_nb.analysis.reporting'):
        mod = __import__(m, fromlist=['x'])
        assert not hasattr(mod, 'main'), f'{m}.main: `tmas` (tmas_nb.cli) is the one entry point'


# ---- report parameters and report all ---------------------------------------------------------------------------

def test_report_params_are_read_like_papermill(monkeypatch, tmp_path):
    seen = {}
    def fake_run_report(name, out, params, progress=True):
        seen.update(name=name, params=params)
        return Path(out) / name
    monkeypatch.setattr(reporting, 'run_report', fake_run_report)
    assert main(['report', 'llm_throughput', '--out', str(tmp_path), '-p', 'generate_engine=False', '-p', 'seed=3',
                 '-p', 'naive_verify_candidates=None', '-p', 'model=default', '-p', 'max_batch_size=6.5']) == 0
    assert seen['params'] == {'generate_engine': False, 'seed': 3, 'naive_verify_candidates': None,
                              'model': 'default', 'max_batch_size': 6.5}
    assert seen['params']['generate_engine'] is False


def test_report_all_on_a_fresh_checkout_says_what_each_report_lacks(tmp_path):
    "No data and no run folders: nothing runs, every report says what it needs and how to make it, and the model benchmark waits to be named."
    empty = tmp_path / 'data'
    empty.mkdir()
    r = tmas('report', 'all', '--quiet', '--out', tmp_path / 'out', cwd=tmp_path, env={'TMAS_DATA_DIR': str(empty)})
    assert r.returncode == 0, r.stderr
    lines = {l.split(':')[0]: l for l in r.stdout.splitlines() if ': ' in l}
    names = reporting.list_reports()
    assert set(names) <= set(lines), r.stdout
    assert 'calls a model; run it by name: tmas report llm_throughput' in lines['llm_throughput']
    assert 'tmas run --method rse' in lines['rse_tables'] and 'tmas run --method tmas' in lines['tmas_iterations']
    assert 'replay stores' in lines['autotts_table']
    assert f'0 reports written, {len(names)} skipped, 0 failed' in r.stdout
    assert not (tmp_path / 'out').exists() or not any((tmp_path / 'out').iterdir())


def test_named_report_without_its_input_is_one_line(tmp_path):
    r = tmas('report', 'rse_tables', '--quiet', '--out', tmp_path / 'out', cwd=tmp_path)
    assert r.returncode == 2 and 'tmas run --method rse' in one_error_line(r)


# ---- --data-dir -------------------------------------------------------------------------------------------------

def test_data_dir_may_be_the_replay_folder(data_root):
    args = ['replay', 'eval', '--model', 'Qwen3-4B', '--benchmark', 'aime24', '--controller', 'sc:k=4', '--seeds', '5', '--json']
    a, b = tmas(*args, '--data-dir', data_root), tmas(*args, '--data-dir', data_root / 'autotts_replay')
    assert a.returncode == b.returncode == 0, (a.stderr, b.stderr)
    assert json.loads(a.stdout) == json.loads(b.stdout)
