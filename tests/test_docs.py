"""The front door: the README's size and test command, every command's guide, and the documentation site in a browser.

The site test builds three pages with `.ci/docs.py --pages` (about 25 s; `.ci/run` builds the whole site strictly) and
opens each in headless chromium (Debian's, as `tests/test_viewer.py`), checking what a reader sees once the page has
loaded: its title, a highlighted code block, and every picture decoded (none broken, at least the figures the page holds).
"""
import configparser
import importlib.util
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from tmas_nb.cli import COMMANDS, DOCS_URL, GROUPS, GUIDES, build_parser, guide_line, guide_of

from test_viewer import chromium

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking',
         '--disable-component-update', '--disable-sync']


def docs_module():
    "`.ci/docs.py`, the site's build script, imported."
    spec = importlib.util.spec_from_file_location('tmas_docs', ROOT / '.ci' / 'docs.py')
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
    return m


# ---- the README ---------------------------------------------------------------------------------------------------
def test_the_readme_is_short_and_holds_the_test_command_ci_runs():
    readme = (ROOT / 'README.md').read_text(encoding='utf-8')
    assert len(readme.splitlines()) <= 250, len(readme.splitlines())
    ci = (ROOT / '.ci' / 'run').read_text(encoding='utf-8').strip().splitlines()[-1]   # the README's test command
    assert ci.startswith('bash .ci/setup && ') and ci in readme, ci
    for g in GUIDES: assert f'(nbs/guides/{g}.ipynb)' in readme, g   # the "I want to" table names every guide


# ---- every command names its guide ---------------------------------------------------------------------------------
def _subparsers(parser):
    for a in parser._actions:
        if hasattr(a, 'choices') and isinstance(a.choices, dict) and a.choices: yield from a.choices.items()


def test_every_command_names_an_existing_guide():
    "`tmas X --help` ends with its guide; the guide is a notebook under nbs/guides/ whose title is the one named."
    for g, title in GUIDES.items():
        nb = nbformat.read(ROOT / 'nbs' / 'guides' / f'{g}.ipynb', as_version=4)
        assert nb.cells[0].source.splitlines()[0] == f'# {title}', g
    on_disk = {p.stem for p in (ROOT / 'nbs' / 'guides').glob('[!_.]*.ipynb')}
    assert on_disk == set(GUIDES), on_disk ^ set(GUIDES)
    top = build_parser()
    helps = {}
    for name, sub in _subparsers(top):
        helps[name] = sub.format_help()
        for leaf, p in _subparsers(sub): helps[f'{name} {leaf}'] = p.format_help()
    assert set(helps) == set(COMMANDS) | set(GROUPS), set(helps) ^ (set(COMMANDS) | set(GROUPS))
    for name, text in helps.items():
        assert guide_of(name) in GUIDES, name
        assert re.sub(r'\s+', ' ', guide_line(name)) in re.sub(r'\s+', ' ', text), (name, text[-300:])
    top_help = top.format_help()
    for g, title in GUIDES.items(): assert f'{g}' in top_help and title in top_help, g


def test_the_site_address_is_the_one_settings_ini_names():
    ini = configparser.ConfigParser(); ini.read(ROOT / 'settings.ini', encoding='utf-8')
    s = ini['DEFAULT']
    assert DOCS_URL == s['doc_host'].rstrip('/') + '/' + s['doc_baseurl'].strip('/') + '/' == docs_module().site_url()
    assert DOCS_URL in (ROOT / 'README.md').read_text(encoding='utf-8')


# ---- the site ----------------------------------------------------------------------------------------------------
def test_a_link_to_nothing_is_a_problem_of_the_strict_build(tmp_path):
    "A broken relative link is reported (the strict build then fails); links to pages stay pages, other files go to the repository."
    d = docs_module()
    links = d.Links({ROOT / 'nbs' / 'guides' / '02_replay.ipynb'})
    src = ROOT / 'nbs' / 'index.ipynb'
    out = links.markdown(src, '[a](guides/02_replay.ipynb#x) [b](../settings.ini) [c](guides/nosuch.ipynb) `[d](nosuch)`')
    assert '[a](guides/02_replay.ipynb#x)' in out and '/blob/main/settings.ini)' in out and '`[d](nosuch)`' in out
    assert len(links.problems) == 1 and "'guides/nosuch.ipynb' leads to nothing" in links.problems[0]


def test_the_navigation_follows_the_subpackages():
    "The site has a section per system, its index page first, then its modules in notebook order; every module notebook is a page."
    d = docs_module()
    pages = d.all_pages()
    secs = d.sections(pages)
    for pkg in ('llm', 'data', 'methods', 'autotts', 'runs', 'analysis', 'rl'):
        [key] = [k for k in secs if k.startswith(f'tmas_nb.{pkg}:')]
        got = [p.relative_to(ROOT / 'nbs').as_posix() for p in secs[key]]
        assert got[0] == f'{pkg}/index.ipynb' and got[1:] == sorted(got[1:]) and len(got) > 2, got
    module_nbs = {p for p in (ROOT / 'nbs').rglob('*.ipynb') if 'guides' not in p.parts and '.ipynb_checkpoints' not in p.parts
                  and 'default_exp' in p.read_text(encoding='utf-8')}
    assert module_nbs <= set(pages), sorted(str(p) for p in module_nbs - set(pages))
    assert d.module_of('autotts.__init__') == 'autotts' and d.module_of('__init__') == '' and d.module_of('runs.start') == 'runs.start'


def test_a_module_page_hides_its_imports_and_puts_the_public_api_first():
    "A module page opens with its public API: no cell that only imports, the private helpers (with their prose and tests) at the end."
    d = docs_module()
    nb = d.stage_notebook(ROOT / 'nbs' / 'runs' / '10_gateway.ipynb', d.Links(set()), [])
    code = [c.source for c in nb.cells if c.cell_type == 'code']
    assert not [c for c in code if d.import_only(c)], [c[:80] for c in code if d.import_only(c)]
    assert code[0].startswith("CONTROLLER_PREFIX = 'controller:'"), code[0][:200]       # the first public definition
    [cut] = [i for i, c in enumerate(nb.cells) if c.cell_type == 'markdown' and c.source.startswith('## Private helpers')]
    before = [c.source for c in nb.cells[:cut] if c.cell_type == 'code']
    after = [c.source for c in nb.cells[cut:] if c.cell_type == 'code']
    assert not [c[:80] for c in before if d.private_only(c)] and after[0].startswith('def _chat_route(app):'), after[:1]
    assert sum(c.startswith(('def ', 'class ', '@')) for c in before) >= 20                     # the public API stayed


def test_serve_names_a_taken_port_before_the_build_and_picks_a_free_one_by_default(tmp_path, monkeypatch):
    "`--serve PORT` on a taken port is one line at once (not an OSError after the build); `--serve` alone moves off a taken 8000."
    d = docs_module()
    with socket.socket() as held:
        held.bind(('127.0.0.1', 0)); held.listen(); port = held.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, '.ci/docs.py', '--serve', str(port), '--pages', 'nbs/index.ipynb', '--out', str(tmp_path / 'site')],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        assert r.returncode == 1 and r.stderr.strip() == (f"docs.py: error: port {port} is taken (another server listens on 127.0.0.1:{port}); "
                                                          f"pass another (--serve {port + 1}) or --serve alone for a free one"), r.stderr[-2000:]
        assert not (tmp_path / 'site').exists() and took < 30, took                  # nothing was built
        monkeypatch.setattr(d, 'DEFAULT_PORT', port)
        httpd = d.open_server(tmp_path, None)
        try: assert httpd.server_address[1] not in (port, 0)
        finally: httpd.server_close()


PROBE = ("<script>window.addEventListener('load', () => { const imgs = [...document.images];"
         " const code = [...document.querySelectorAll('div.highlight pre')].filter(p => p.textContent.trim()).length;"
         " document.title = `${document.title} | code ${code} | images ${imgs.filter(i => i.complete && i.naturalWidth > 0).length}"
         "/${imgs.length}`; });</script>")


@pytest.fixture(scope='module')
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp('site') / 'site'
    pages = ['nbs/index.ipynb', 'nbs/guides/05_hybrid_rl.ipynb', 'nbs/autotts/03_controllers.ipynb']
    r = subprocess.run([sys.executable, '.ci/docs.py', '--pages', *pages, '--out', str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize('page, title, figures', [
    ('index.html', 'tmas_nb', 2),                                                 # the README's pictures
    ('guides/05_hybrid_rl.html', 'Hybrid-RL: from data to Figure 3', 1),          # a plot the notebook drew
    ('autotts/03_controllers.html', 'autotts.controllers', 0)])                     # a module page with its API reference
def test_pages_render_in_a_browser(site, tmp_path, page, title, figures):
    path = site / page
    probe = path.with_name('_probe_' + path.name)                                # beside the page: same relative links
    probe.write_text(path.read_text(encoding='utf-8').replace('</body>', PROBE + '</body>'), encoding='utf-8')
    r = subprocess.run([chromium(), *FLAGS, f'--user-data-dir={tmp_path / "profile"}', '--virtual-time-budget=5000',
                        '--dump-dom', probe.as_uri()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r'<title>(.*?) \| code (\d+) \| images (\d+)/(\d+)</title>', r.stdout)
    assert m, r.stdout[:2000]
    shown, code, loaded, total = m.group(1), *map(int, m.groups()[1:])
    assert shown == f'{title} - tmas_nb' or (title == 'tmas_nb' and shown == 'tmas_nb'), shown
    assert code >= 1 and loaded == total and loaded >= figures, (code, loaded, total)
    if page == 'autotts/03_controllers.html': assert 'CMC' in r.stdout and '[source]' not in r.stdout   # show_doc, rendered


def test_llms_txt_lists_the_pages_as_markdown(site):
    text = (site / 'llms.txt').read_text(encoding='utf-8')
    assert text.startswith('# tmas_nb\n\n> ')
    for md in ('guides/05_hybrid_rl.html.md', 'autotts/03_controllers.html.md', 'index.html.md'):
        assert f'({DOCS_URL}{md})' in text and (site / md).is_file(), md
