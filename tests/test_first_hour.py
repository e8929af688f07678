"""The first hour with the package, through the real `tmas` command in a subprocess: what a new user types, and what must
happen. A base URL means the server; a misspelled model or flag is one line before anything is written; a run that
fails or is interrupted says so in its folder; Ctrl-C ends a run at once; stdout holds only a command's output, even
on a machine whose model cache is empty; a count of zero is refused; a report parameter it does not have is refused;
a controller file with one class needs no class name; a benchmark may be spelled either way; the help says what a flag
does; JupyterLab starts as printed; the README notebook runs top to bottom without a long live cell."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def tmas(*args, env=None, timeout=300, cwd=REPO):
    "Run `python -m tmas_nb.cli ARGS` in a new process, as a user would (the console script is the same `main`)."
    return subprocess.run([sys.executable, '-m', 'tmas_nb.cli', *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})


def lines(text: str) -> list[str]:
    return [l for l in text.splitlines() if l.strip()]


def one_error(r) -> str:
    "The one line a refused command prints: status 2, a single `tmas...: error: ...` line, no traceback, no usage dump."
    got = lines(r.stderr)
    assert r.returncode == 2 and len(got) == 1 and ': error: ' in got[0], (r.returncode, r.stderr[-3000:])
    return got[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


# ---- the model and the server -----------------------------------------------------------------------------------

def test_a_base_url_means_the_server_and_a_failed_run_says_why(tmp_path):
    "The vLLM user's command without --backend: the run goes to the URL (nothing listens: one line naming it), not to the hub; the folder, `runs list` and `runs summary` say why it failed."
    url = f'http://127.0.0.1:{free_port()}/v1'
    out = tmp_path / 'runs' / 'r'
    r = tmas('run', '--method', 'sampling', '--benchmark', 'demo', '--limit', '1', '--n-candidates', '1', '--base-url', url,
             '--model', 'x', '--quiet', '--out', out)
    line = one_error(r)
    assert url.rsplit('/', 1)[0] in line and 'huggingface' not in line.lower(), line
    status = json.loads((out / 'status.json').read_text())
    assert status['complete'] is False and url.rsplit('/', 1)[0] in status['failed'] and status['calls_kept'] == 0
    assert json.loads((out / 'config.json').read_text())['backend'] == 'openai'
    listed = tmas('runs', 'list', tmp_path / 'runs')
    assert listed.returncode == 0 and re.search(r'\(failed: .*127\.0\.0\.1', listed.stdout), listed.stdout
    summary = tmas('runs', 'summary', out)
    assert 'failed: ' in one_error(summary) and '127.0.0.1' in summary.stderr
    # a backend that runs the model here does not take a base URL: refused, nothing written
    r = tmas('run', '--method', 'sampling', '--benchmark', 'demo', '--limit', '1', '--base-url', url, '--backend', 'transformers',
             '--model', 'x', '--out', tmp_path / 'no')
    assert '--backend transformers runs the model on this machine' in one_error(r) and not (tmp_path / 'no').exists()


def test_a_misspelled_model_stops_before_the_run_folder_exists(tmp_path):
    r = tmas('run', '--method', 'tmas', '--benchmark', 'demo', '--limit', '1', '--model', 'defualt', '--out', tmp_path / 'r')
    line = one_error(r)
    assert "--model 'defualt' is not a packaged model" in line and "did you mean 'default'?" in line, line
    assert not (tmp_path / 'r').exists() and 'estimate' not in r.stderr


def test_papers_sizes_on_a_cpu_ask_for_yes(tmp_path):
    "No preset, the method's own (paper) sizes, the model on this CPU: hours, so the run does not start without --yes."
    r = tmas('run', '--method', 'tmas', '--benchmark', 'demo', '--limit', '2', '--model', 'smollm2', '--out', tmp_path / 'r')
    note, line = lines(r.stderr)                       # the protocol's one line (paper-shaped, no preset), then the refusal
    assert note.startswith('no --preset: this run has the structure of --preset tmas-paper'), note
    assert r.returncode == 2 and line.startswith('tmas') and ': error: ' in line, r.stderr
    assert 'pass --yes to start it anyway' in line and re.search(r'estimated at [\d.]+ h', line), line
    assert not (tmp_path / 'r').exists()


def test_ctrl_c_ends_a_run_at_once_with_one_line(tmp_path):
    "SIGINT while the packaged model decodes a long answer: the command ends within seconds with status 130, one line saying what was kept, and the folder says interrupted (before: ~60 s, then `terminate called without an active exception`, signal 6)."
    out = tmp_path / 'r'
    cmd = [sys.executable, '-m', 'tmas_nb.cli', 'run', '--method', 'tmas', '--benchmark', 'demo', '--limit', '1', '--model', 'smollm2',
           '--backend', 'transformers', '--n-candidates', '2', '--n-verifications', '1', '--iterations', '1',
           '--max-new-tokens', '4000', '--seed', '0', '--threads', '1', '--quiet', '--progress-every', '1', '--out', str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and p.poll() is None:   # the model is loaded and decoding: calls in flight
            try: prog = json.loads((out / 'status.json').read_text()).get('progress') or {}
            except (OSError, ValueError): prog = {}
            if prog.get('calls_in_flight', 0) > 0 and prog.get('elapsed_s', 0) > 3: break
            time.sleep(0.5)
        assert p.poll() is None, p.communicate()[1][-2000:]
        time.sleep(8)                                         # the model loaded, well inside its first answers of up to 4,000 tokens
        t0 = time.time()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        took = time.time() - t0
    finally:
        if p.poll() is None: p.kill()
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert took < 20, took
    assert 'terminate called' not in err and 'Traceback' not in err, err[-2000:]
    last = lines(err)[-1]
    m = re.fullmatch(r'tmas: interrupted; (\d+) calls kept; rerun the same command to resume', last)
    assert m, err[-2000:]
    st = json.loads((out / 'status.json').read_text())
    assert st['complete'] is False and st['calls_kept'] == int(m.group(1)) and st['interrupted'] == f'cancelled (Ctrl-C, or its caller left); {m.group(1)} calls kept'


def test_stdout_holds_only_the_output_on_a_machine_with_no_converted_model(tmp_path):
    "An empty model cache: --print-config converts nothing (the context is known) and prints only JSON; a --json command that converts the model prints the conversion line on stderr."
    env = {'TMAS_MODEL_CACHE': str(tmp_path / 'models'), 'TMAS_ENGINES_DIR': str(tmp_path / 'engines')}
    r = tmas('run', '--method', 'tmas', '--benchmark', 'demo', '--limit', '1', '--preset', 'tmas-paper', '--model', 'smollm2',
             '--print-config', env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads(r.stdout)
    assert cfg['config']['max_new_tokens'] == 8192 - 4096 and 'capped' in r.stderr
    assert not (tmp_path / 'models').exists() or not any((tmp_path / 'models').iterdir())   # no model was loaded for it
    r = tmas('doctor', '--model', 'smollm2', '--json', '--batch', '1', '--max-new-tokens', '2', env=env, timeout=900)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    assert json.loads(r.stdout)['model'] == 'smollm2'
    assert 'converting SmolLM2-135M-Instruct' in r.stderr


# ---- papercuts --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('k', ['0', '-1'])
def test_a_limit_below_one_is_refused(k, tmp_path):
    r = tmas('run', '--method', 'tmas', '--benchmark', 'demo', '--limit', k, '--print-config')
    line = one_error(r)
    assert line == f"tmas run: error: argument --limit: must be >= 1, got {k} (`tmas run --help` lists them)", line
    assert f'argument --limit: must be >= 1, got {k}' in one_error(tmas('data', 'hard-subset', '--benchmark', 'demo', '--limit', k,
                                                                       '--out', tmp_path / 'ids.txt'))
    assert f'--limit must be >= 1, got {k}' in one_error(tmas('rl', 'teacher', '--limit', k, '--out', tmp_path / 't'))
    assert not (tmp_path / 'ids.txt').exists() and not (tmp_path / 't').exists()


def test_a_misspelled_flag_is_one_line_with_the_closest_one():
    r = tmas('run', '--method', 'tmas', '--benchmark', 'demo', '--limt', '2')
    assert 'unrecognized arguments: --limt 2; did you mean --limit?' in one_error(r)
    assert "did you mean 'summary'?" in one_error(tmas('runs', 'sumary', 'x'))


def test_a_report_parameter_the_report_does_not_have_is_refused(tmp_path):
    r = tmas('report', 'autotts_table', '-p', 'nosuch=1', '--out', tmp_path)
    assert 'report autotts_table has no parameter nosuch; its parameters: ' in one_error(r)
    assert 'seed (did you mean seeds?)' in one_error(tmas('report', 'autotts_table', '-p', 'seed=3', '--out', tmp_path))
    assert not (tmp_path / 'autotts_table').exists()


def test_replay_eval_takes_a_controller_file_like_run_does(data_root):
    "`--controller FILE` (as `tmas run` takes it) with the file's only class found, equal to the explicit --controller-file --controller-class."
    f = REPO / 'tmas_nb' / 'autotts' / 'examples' / 'authors_cmc.py'
    base = ['replay', 'eval', '--data-dir', data_root, '--model', 'Qwen3-0.6B', '--benchmark', 'aime24', '--seeds', '2', '--json',
            '--controller-config', '{"beta": 0.5}']
    short = tmas(*base, '--controller', f, timeout=600)
    assert short.returncode == 0, short.stderr[-2000:]
    long = tmas(*base, '--controller-file', f, '--controller-class', 'CMCMethod', timeout=600)
    a, b = json.loads(short.stdout), json.loads(long.stdout)
    assert (a['acc'], a['avg_tokens'], a['sandbox']) == (b['acc'], b['avg_tokens'], b['sandbox']) and 'CMCMethod' in a['controller']


def test_imo_answerbench_is_one_benchmark_under_either_spelling(data_root):
    got = [json.loads(tmas('run', '--method', 'mv', '--benchmark', b, '--limit', '2', '--print-config').stdout)
           for b in ('imo-answerbench', 'imo_answerbench')]
    assert got[0]['benchmark'] == got[1]['benchmark'] == 'imo_answerbench' and got[0]['problem_ids'] == got[1]['problem_ids']
    names = [d['name'] for d in json.loads(tmas('data', 'list', '--json').stdout)]
    assert 'imo_answerbench' in names and 'imo-answerbench' not in names


def test_a_reader_that_stops_early_is_not_an_error():
    "`tmas data list | head -2`: stdout closed before the command writes is not `tmas: error: connection failed: Broken pipe`."
    p = subprocess.Popen([sys.executable, '-m', 'tmas_nb.cli', 'data', 'list'], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=REPO)
    p.stdout.close()                                   # the reader is gone before the command starts writing
    err = p.stderr.read(); p.wait(timeout=120)
    assert (p.returncode, err) == (0, ''), err


def test_the_no_sandbox_help_says_what_the_flag_does():
    text = ' '.join(tmas('replay', 'eval', '--help').stdout.split())
    assert '--no-sandbox run the file outside the sandbox, for trusted files only' in text, text


# ---- JupyterLab and the README notebook -------------------------------------------------------------------------

def test_the_readme_notebook_runs_top_to_bottom_without_a_long_cell_or_an_export():
    "JupyterLab's Run All ignores nbdev's flags: no cell of nbs/index.ipynb may be a long (slow, gpu) one, and none exports the library."
    nb = json.loads((REPO / 'nbs' / 'index.ipynb').read_text())
    code = [''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'code']
    flagged = [s.splitlines()[0] for s in code if re.match(r'#\|\s*(slow|gpu)', s)]
    assert not flagged and not any('nbdev_export' in s for s in code), flagged


@pytest.mark.skipif(os.geteuid() != 0, reason='JupyterLab refuses only root; as another user there is nothing to check')
def test_jupyter_lab_starts_as_root_as_the_readme_prints_it(tmp_path):
    "`.venv/bin/jupyter lab nbs/index.ipynb` as root: `.ci/setup` allowed root in the environment's own Jupyter config, so it serves."
    port = free_port()
    jupyter = Path(sys.executable).parent / 'jupyter'
    p = subprocess.Popen([str(jupyter), 'lab', 'nbs/index.ipynb', '--no-browser', f'--port={port}', '--ServerApp.open_browser=False'],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, 'JUPYTER_RUNTIME_DIR': str(tmp_path / 'runtime')})
    try:
        served, deadline = False, time.time() + 120
        while time.time() < deadline and p.poll() is None and not served:
            try: urllib.request.urlopen(f'http://127.0.0.1:{port}/api/status', timeout=2); served = True
            except urllib.error.HTTPError: served = True       # 403 without a token: the server is up
            except OSError: time.sleep(0.5)
        log = '' if served else (p.communicate(timeout=5)[0] if p.poll() is not None else '')
        assert served, log[-2000:]
    finally:
        p.terminate()
        try: p.wait(timeout=20)
        except subprocess.TimeoutExpired: p.kill()


# ---- the set-up ---------------------------------------------------------------------------------------------------

FAKE_PYTHON = '''#!/bin/sh
# stands in for the Python `.ci/setup --here` installs into: it records what it is asked to do
echo "$*" >> "$SETUP_LOG"
case "$*" in *torch.version.cuda*) echo "torch 2.13.0+cpu installed: the CPU build";; esac
'''


@pytest.mark.parametrize('index', [None, 'https://download.pytorch.org/whl/cpu'])
def test_setup_takes_the_torch_index_from_the_environment_and_says_which_build(tmp_path, index):
    "`.ci/setup` (its --here route, with a recording Python on PATH): torch from TORCH_INDEX_URL when set, else the default index with the CPU index named; then the build that was installed."
    bin_ = tmp_path / 'bin'; bin_.mkdir()
    for name, text in (('python', FAKE_PYTHON), ('chromium', '#!/bin/sh\n'), ('slirp4netns', '#!/bin/sh\n')):
        (bin_ / name).write_text(text); (bin_ / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ('TORCH_INDEX_URL', 'TORCH_VERSION', 'VIRTUAL_ENV')}
    env |= {'PATH': f"{bin_}:{os.environ['PATH']}", 'SETUP_LOG': str(tmp_path / 'log'), **({'TORCH_INDEX_URL': index} if index else {})}
    r = subprocess.run(['bash', str(REPO / '.ci' / 'setup'), '--here'], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    asked = (tmp_path / 'log').read_text().splitlines()
    torch = [a for a in asked if a.startswith('-m pip install -q torch==')]
    assert torch == ['-m pip install -q torch==2.13.0' + (f' --index-url {index}' if index else '')], asked
    assert asked.index(torch[0]) < next(i for i, a in enumerate(asked) if '-e .[dev]' in a)        # torch before the package
    said = r.stdout.splitlines()
    assert said[0] == (f'torch: torch==2.13.0 from {index} (TORCH_INDEX_URL)' if index else
                       'torch: torch==2.13.0 from the default index (on Linux x86-64 PyPI\'s is the CUDA build; for the CPU '
                       'build set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu)'), said
    assert said[1] == 'torch 2.13.0+cpu installed: the CPU build', said


def test_the_readme_and_the_setup_guide_tell_a_cpu_only_user_how_to_get_the_cpu_build():
    readme = (REPO / 'README.md').read_text(encoding='utf-8')
    guide = json.loads((REPO / 'nbs' / 'guides' / '00_setup.ipynb').read_text())
    guide = '\n'.join(''.join(c['source']) for c in guide['cells'])
    for text in (readme, guide):
        assert 'TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash .ci/setup' in text
        assert '--index-url https://download.pytorch.org/whl/cpu' in text and 'CUDA build' in text


def test_setting_up_the_package_prints_no_licence_warning(tmp_path):
    "The package's metadata as pip builds it for `pip install -e .`: the licence is an SPDX expression, and setuptools warns about nothing licence-related."
    for f in ('setup.py', 'settings.ini', 'README.md', 'pyproject.toml'): (tmp_path / f).write_bytes((REPO / f).read_bytes())
    (tmp_path / 'tmas_nb').mkdir(); (tmp_path / 'tmas_nb' / '__init__.py').write_text(''); (tmp_path / 'meta').mkdir()
    r = subprocess.run([sys.executable, '-W', 'always', '-c', 'import sys; from setuptools import build_meta as b; '
                        'print(b.prepare_metadata_for_build_editable(sys.argv[1]))', str(tmp_path / 'meta')],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'licen' not in r.stderr.lower() and 'licen' not in r.stdout.lower(), (r.stdout + r.stderr)[-2000:]
    meta = (tmp_path / 'meta' / r.stdout.strip().splitlines()[-1] / 'METADATA').read_text()
    assert 'License-Expression: Apache-2.0' in meta and 'Classifier: License' not in meta, meta[:1500]
