"""The example controllers are files shipped inside the package, `build_store` takes its settings as dataclasses (the
keyword call and the `tmas replay build` flags unchanged), and the replay notebooks are written in small cells."""
import argparse
import ast
import inspect
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import tmas_nb.autotts
from tmas_nb.autotts.authors_api import EXAMPLE_CONTROLLERS, example_controller, install_authors_shims
from tmas_nb.autotts.build import BuildSettings, build_cli, build_store

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = Path(tmas_nb.autotts.__file__).parent / 'examples'
NAMES = {'authors_sc': 'SCMethod', 'authors_asc': 'ASCMethod', 'authors_cmc': 'CMCMethod',
         'ours_sc': 'SelfConsistencyFile', 'ours_cmc': 'MyCMC'}


# --- example controllers: files in the package ------------------------------------------------------

def test_examples_are_files_in_the_package():
    assert list(EXAMPLE_CONTROLLERS) == list(NAMES)
    install_authors_shims()
    for name, cls in NAMES.items():
        path = EXAMPLES / f'{name}.py'
        assert path.is_file(), f'{path} is missing'
        assert example_controller(name) == (cls, path.read_text(encoding='utf-8').lstrip())
        ns = {}
        exec(compile(path.read_text(encoding='utf-8'), str(path), 'exec'), ns)
        assert isinstance(ns[cls], type)


def test_cmc_lives_in_the_kernel_the_class_and_the_example_only():
    "The library's modules hold CMC twice (the fast kernel and `controllers.CMC`); the example file is the only other copy."
    lib = Path(tmas_nb.__file__).parent
    holders = sorted(p.relative_to(lib).as_posix() for p in lib.rglob('*.py')
                     if p.name != '_modidx.py' and 'conf_thresh' in p.read_text(encoding='utf-8'))
    assert holders == ['autotts/controllers.py', 'autotts/examples/authors_cmc.py', 'autotts/fast.py']
    assert "'''" not in (lib / 'autotts' / 'authors_api.py').read_text(encoding='utf-8')


def _wheel_names(tmp_path, without_init: bool) -> tuple[Path, list[str]]:
    "Build a wheel from a copy of the package sources; return it and the names it holds."
    src = tmp_path / 'src'
    src.mkdir()
    for f in ('setup.py', 'settings.ini', 'README.md'): shutil.copy(ROOT / f, src / f)
    shutil.copytree(ROOT / 'tmas_nb', src / 'tmas_nb', ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
    if without_init: (src / 'tmas_nb' / 'autotts' / 'examples' / '__init__.py').unlink(missing_ok=True)
    r = subprocess.run([sys.executable, '-m', 'build', '--wheel', '--no-isolation', '--outdir', str(tmp_path / 'dist'), str(src)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    [whl] = (tmp_path / 'dist').glob('*.whl')
    return whl, zipfile.ZipFile(whl).namelist()


@pytest.mark.timeout(180)
@pytest.mark.parametrize('without_init', [False, True], ids=['as_tracked', 'without_examples_init'])
def test_wheel_ships_the_example_files(tmp_path, without_init):
    whl, names = _wheel_names(tmp_path, without_init)
    for name in NAMES: assert f'tmas_nb/autotts/examples/{name}.py' in names, f'{whl.name} lacks examples/{name}.py'
    if without_init: return
    site = tmp_path / 'site'
    zipfile.ZipFile(whl).extractall(site)
    code = ("import json, tmas_nb; from tmas_nb.autotts.authors_api import example_controller as e; "
            f"print(json.dumps([tmas_nb.__file__, [e(n) for n in {list(NAMES)!r}]]))")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={'PYTHONPATH': str(site), 'PATH': '/usr/bin:/bin'})
    assert r.returncode == 0, r.stderr[-2000:]
    where, got = json.loads(r.stdout)
    assert where.startswith(str(site))                       # the installed copy, not the working tree
    assert [tuple(x) for x in got] == [example_controller(n) for n in NAMES]


# --- build_store: settings as dataclasses ------------------------------------------------------------

BUILD_FLAGS = [('--model', 'model', None, True, None), ('--benchmark', 'benchmark', None, True, None),
              ('--limit', 'limit', None, False, 'int'), ('--branches', 'branches', None, True, 'int'),
              ('--probe-every', 'probe_every', None, True, 'int'), ('--max-new-tokens', 'max_new_tokens', None, True, 'int'),
              ('--out', 'out', None, True, None), ('--seed', 'seed', 0, False, 'int'),
              ('--temperature', 'temperature', 0.8, False, 'float'), ('--top-p', 'top_p', 0.95, False, 'float'),
              ('--probe-tokens', 'probe_tokens', 12, False, 'int'), ('--threads', 'threads', None, False, 'int'),
              ('--data-dir', 'data_dir', None, False, None), ('--base-url', 'base_url', None, False, None),
              ('--api-key', 'api_key', None, False, None), ('--tokenizer', 'tokenizer', None, False, None),
              ('--requests-in-flight', 'requests_in_flight', 16, False, 'int'), ('--chunked', 'chunked', False, False, None),
              ('--quiet', 'quiet', False, False, None)]


def test_replay_build_flags_are_as_documented():
    "The flags of `tmas replay build` (renamed ones stay as hidden aliases: see tests/test_cli_flags.py)."
    b = argparse.ArgumentParser(); build_cli(b)
    got = [(a.option_strings[0], a.dest, a.default, a.required, getattr(a.type, '__name__', None)) for a in b._actions
           if a.dest != 'help' and a.help != argparse.SUPPRESS]
    assert got == BUILD_FLAGS


def test_build_store_takes_at_most_ten_parameters():
    params = [p for p in inspect.signature(build_store).parameters.values() if p.kind is not p.VAR_KEYWORD]
    assert len(params) <= 10, [p.name for p in params]
    assert {'settings', 'server'} <= {p.name for p in params}


@pytest.fixture(scope='module')
def smol():
    import torch
    torch.set_num_threads(1)
    from tmas_nb.llm.models import load_model_and_tokenizer
    return load_model_and_tokenizer('smollm2', device='cpu')


@pytest.mark.timeout(300)
def test_keyword_and_dataclass_calls_build_the_same_store(tmp_path, smol):
    kw = dict(branches=1, probe_every=4, max_new_tokens=8, seed=3, probe_tokens=4)
    build_store(smol, 'demo', limit=1, out=tmp_path / 'kw.json', progress=False, **kw)
    build_store(smol, 'demo', limit=1, out=tmp_path / 'dc.json', progress=False, settings=BuildSettings(**kw))
    assert (tmp_path / 'kw.json').read_text() == (tmp_path / 'dc.json').read_text()
    side = json.loads((tmp_path / 'dc.build.json').read_text())
    assert side['settings'] == BuildSettings(**kw).to_dict()
    # a keyword field is applied over the dataclass given; this one matches the checkpoints, so nothing is sampled
    build_store(smol, 'demo', limit=1, out=tmp_path / 'dc.json', progress=False, settings=BuildSettings(**{**kw, 'seed': 0}), seed=3)
    assert json.loads((tmp_path / 'dc.build.json').read_text())['questions_built_now'] == 0
    with pytest.raises(TypeError, match=r'^build_store: unknown setting\(s\) brnaches; BuildSettings has branches'):
        build_store(smol, 'demo', limit=1, out=tmp_path / 'x.json', brnaches=2)


# --- the replay notebooks: small cells --------------------------------------------------------------

NOTEBOOKS = ['autotts/01_store', 'autotts/02_environment', 'autotts/06_authors_api', 'autotts/08_build']


@pytest.mark.parametrize('name', NOTEBOOKS)
def test_replay_notebook_cells_are_small(name):
    "Export cells of at most 45 lines, each with one public definition, followed by prose and then an example."
    cells = json.loads((ROOT / 'nbs' / f'{name}.ipynb').read_text(encoding='utf-8'))['cells']
    def export(c): return c['cell_type'] == 'code' and ''.join(c['source']).lstrip().startswith('#| export')
    bad = []
    for i, c in enumerate(cells):
        if not export(c): continue
        body = [l for l in ''.join(c['source']).splitlines() if not l.strip().startswith('#|')]
        tree = ast.parse('\n'.join(body))
        if all(isinstance(x, (ast.Import, ast.ImportFrom)) for x in tree.body): continue
        public = [x.name for x in tree.body if isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and not x.name.startswith('_')]
        lines = len([l for l in body if l.strip()])
        follows = [d['cell_type'] for d in cells[i + 1:i + 3]]
        if lines > 45 or len(public) > 1 or follows != ['markdown', 'code'] or export(cells[i + 2]):
            bad.append((i, lines, public, follows))
    assert not bad, bad
