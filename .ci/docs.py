"""Build the documentation site from the notebooks, offline, without executing them (Sphinx, MyST-NB, the furo theme).

    python .ci/docs.py                   build _docs/ strictly: a broken link, a missing page or picture, a module
                                         that does not import, any Sphinx warning fails the build (exit 1)
    python .ci/docs.py --serve [PORT]    build, then serve _docs/ at http://127.0.0.1:PORT/ (default 8000, or a free
                                         port when 8000 is taken, e.g. by the README's `tmas serve`); the port is
                                         taken before the build, so a PORT in use fails at once
    python .ci/docs.py --pages nbs/guides/03_replay.ipynb ... --out DIR
                                         only these pages and the home page, not strictly (links to the other pages
                                         go to the repository)

The pages: nbs/index.ipynb (the home page; the README is generated from it too), the guides (nbs/guides/), one page
per module notebook with the API reference of what it exports (nbdev's `show_doc`, rendered here, below each export
cell; a module page leaves out the cells that only import, and moves the private helpers, `_name`, with their prose and
tests after the public API) and the report notebooks (reports/). Notebooks are shown with the outputs they were committed with. Cells marked
`#| hide` are left out and `#|` lines dropped, as nbdev does. A relative link is checked against the repository: to a
page of the site it stays a link between pages, to another file of the repository it becomes a link to that file on
the repository's web page (settings.ini's git_url), to nothing it is an error. Besides the HTML, every page is also
written as Markdown (PAGE.html.md) and listed in llms.txt, the index for coding assistants (nbdev's convention).
"""
import argparse, ast, configparser, errno, functools, http.server, importlib, inspect, os, re, shutil, subprocess, sys, time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
WORK, OUT = ROOT / '_proc' / 'docs', ROOT / '_docs'   # WORK: the staged notebooks, Sphinx's caches and its HTML before it moves to OUT
DIRECTIVE = re.compile(r'^\s*#\|\s*(.*)$')
LINK = re.compile(r'(!?\[[^\]\n]*\]\()([^)\s]+)(\))')     # [text](target) and ![alt](target)
CODE = re.compile(r'(```.*?```|`[^`\n]*`)', re.S)          # fenced blocks and code spans: links there are not links


def settings() -> configparser.SectionProxy:
    ini = configparser.ConfigParser(); ini.read(ROOT / 'settings.ini', encoding='utf-8')
    return ini['DEFAULT']


def site_url() -> str:
    "Where the site is published: settings.ini's doc_host + doc_baseurl, with a final slash."
    s = settings()
    return s['doc_host'].rstrip('/') + '/' + s['doc_baseurl'].strip('/') + '/'


# The subpackages, one per system, in the order of their layers; the site's navigation has a section for each.
SYSTEMS = {'llm': 'Models', 'data': 'Benchmarks and grading', 'methods': 'Methods: TMAS, RSE, baselines',
           'autotts': 'AutoTTS: replay and discovery', 'runs': 'Runs', 'analysis': 'Analysis', 'rl': 'Hybrid-RL'}


def module_of(exp: str) -> str:
    "The module a `default_exp` names (a subpackage's face is exported as `pkg.__init__`)."
    return exp[:-len('.__init__')] if exp.endswith('.__init__') else '' if exp == '__init__' else exp


def all_pages() -> list[Path]:
    "Every notebook that is a page: the home page, the guides, the module notebooks, the reports."
    nbs = ROOT / 'nbs'
    return ([nbs / 'index.ipynb'] + sorted((nbs / 'guides').glob('[!_.]*.ipynb')) + sorted(nbs.glob('[0-9]*.ipynb'))
            + [p for pkg in SYSTEMS for p in [nbs / pkg / 'index.ipynb'] + sorted((nbs / pkg).glob('[0-9]*.ipynb'))]
            + sorted((ROOT / 'reports').glob('[!_.]*.ipynb')))


def staged_name(src: Path) -> Path:
    "Where a page or a picture lives in the site: nbs/ is the site's root, reports/ its reports/ folder."
    rel = src.resolve().relative_to(ROOT)
    return Path(*rel.parts[1:]) if rel.parts[0] == 'nbs' else rel


def directives(src: str) -> tuple[list[str], str]:
    "The `#|` directives at the top of a cell, and the source without them."
    lines, flags = src.splitlines(), []
    while lines and (m := DIRECTIVE.match(lines[0])):
        flags += [m.group(1).strip()]; lines.pop(0)
    return flags, '\n'.join(lines).strip('\n')


# ---------------------------------------------------------------- links
class Links:
    "Rewrites the relative links of one notebook's markdown; remembers the ones that lead nowhere."
    def __init__(self, staged: set[Path]):
        s = settings()
        self.staged, self.problems = staged, []
        self.blob = f"{s['git_url'].rstrip('/')}/blob/{s.get('branch', 'main')}/"
        self.tree = f"{s['git_url'].rstrip('/')}/tree/{s.get('branch', 'main')}/"

    def target(self, src: Path, target: str) -> str:
        if re.match(r'^[a-z][a-z0-9+.-]*:', target, re.I) or target.startswith(('#', '/')): return target
        path, _, frag = target.partition('#')
        dest = (src.parent / path).resolve()
        if not dest.is_relative_to(ROOT) or not dest.exists():
            self.problems.append(f"{src.relative_to(ROOT)}: the link {target!r} leads to nothing in the repository")
            return target
        rel = dest.relative_to(ROOT)
        if dest in self.staged:
            here = staged_name(src).parent
            new = os.path.relpath(staged_name(dest), here or '.')
            return new + (f'#{frag}' if frag else '')
        return (self.tree if dest.is_dir() else self.blob) + rel.as_posix() + (f'#{frag}' if frag else '')

    def markdown(self, src: Path, text: str) -> str:
        parts = CODE.split(text)
        for i in range(0, len(parts), 2):   # the even parts are outside code
            parts[i] = LINK.sub(lambda m: m.group(1) + self.target(src, m.group(2)) + m.group(3), parts[i])
        return ''.join(parts)


# ---------------------------------------------------------------- the API reference
def _names(code: str) -> list[str]:
    "The public functions and classes a cell defines, `@patch`ed methods as Class.method (nbdev's naming)."
    import ast
    from nbdev.showdoc import showdoc_nm
    try: tree = ast.parse(code)
    except SyntaxError: return []
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [showdoc_nm(o) for o in tree.body if isinstance(o, kinds) and (not o.name.startswith('_') or o.name.startswith('__'))]


def _source_link(obj) -> str:
    try:
        f = inspect.unwrap(obj)
        path = Path(inspect.getsourcefile(f)).resolve().relative_to(ROOT)
        line = inspect.getsourcelines(f)[1]
    except (TypeError, OSError, ValueError): return ''
    s = settings()
    return f"[source]({s['git_url'].rstrip('/')}/blob/{s.get('branch', 'main')}/{path.as_posix()}#L{line})"


def plain_doc(obj, name: str) -> str:
    "The signature (annotations as written) and docstring of `obj`, for what nbdev's `show_doc` cannot render."
    try: sig = str(inspect.signature(obj))
    except (TypeError, ValueError): sig = ''
    kind = 'class' if inspect.isclass(obj) else 'def'
    return f"### {name}\n\n```python\n{kind} {name.split('.')[-1]}{sig}\n```\n\n" + (inspect.getdoc(obj) or '')


def api_markdown(module, name: str) -> str:
    "nbdev's `show_doc` of `module.name` as Markdown, with a link to its source."
    from nbdev.showdoc import show_doc
    obj = functools.reduce(getattr, name.split('.'), module)
    try: md = show_doc(obj, name=name)._repr_markdown_()
    except (NameError, SyntaxError) as e:   # show_doc evaluates postponed annotations and re-parses sources; it may not
        md = plain_doc(obj, name)
    md = '\n'.join(l for l in md.splitlines() if not l.startswith('[source]('))   # quarto's attribute syntax, a bad line number
    md = re.sub(r'^---\s*', '', md.strip())
    return md + ('\n\n' + _source_link(obj) if _source_link(obj) else '')


# ---------------------------------------------------------------- one page
def import_only(code: str) -> bool:
    "Whether a code cell does nothing but import: a module page leaves it out (the imports are in the module's source)."
    try: body = ast.parse(code).body
    except SyntaxError: return False
    return bool(body) and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in body)


def private_only(code: str) -> bool:
    "Whether an export cell defines names and all of them are private (`_helper`): no public function, class or constant."
    try: body = ast.parse(code).body
    except SyntaxError: return False
    names = []
    for n in body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): names.append(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            names += [t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)]
    return bool(names) and all(x.startswith('_') and not x.startswith('__') for x in names)


PRIVATE_HEADING = ('## Private helpers\n\nThe module\'s own helpers, which the API above calls; each with the prose and the '
                   'tests that stood beside it in the notebook.')


def public_first(items: list[tuple[str, nbformat.NotebookNode]]) -> list[nbformat.NotebookNode]:
    """The cells of a module page with each private export (its cell, the prose just before it, its tests after it) moved to
    the end under `PRIVATE_HEADING`. `items` are (kind, cell), kind one of heading, markdown, export, private, code."""
    main, private, unit, moving, pending = [], [], [], False, []
    def flush():
        (private if moving else main).extend(unit); unit.clear()
    for kind, cell in items:
        if kind == 'heading':            # a section's heading stays where it is; the prose before it ends the unit above
            unit.extend(pending); pending.clear(); flush(); moving = False; main.append(cell)
        elif kind == 'markdown': pending.append(cell)   # closing prose of the unit above, or the next export's introduction
        elif kind in ('export', 'private'):
            flush(); unit.extend(pending); pending.clear(); moving = kind == 'private'; unit.append(cell)
        else: unit.extend(pending); pending.clear(); unit.append(cell)
    unit.extend(pending); flush()
    return main + ([nbformat.v4.new_markdown_cell(PRIVATE_HEADING)] + private if private else [])


def stage_notebook(src: Path, links: Links, problems: list[str]) -> nbformat.NotebookNode:
    nb = nbformat.read(src, as_version=4)
    module = None
    for c in nb.cells:
        if c.cell_type == 'code' and (m := re.search(r'^#\|\s*default_exp\s+(\S+)', c.source, re.M)):
            try: module = importlib.import_module('.'.join(x for x in (settings()['lib_name'], module_of(m.group(1))) if x))
            except Exception as e:
                problems.append(f"{src.relative_to(ROOT)}: its module {m.group(1)} does not import ({type(e).__name__}: {e}); "
                                "its API reference is missing")
                module = False
    items = []
    for c in nb.cells:
        if c.cell_type == 'markdown':
            c.source = links.markdown(src, c.source)
            items.append(('heading' if re.match(r'#{1,3}\s', c.source) else 'markdown', c)); continue
        if c.cell_type != 'code': continue
        flags, code = directives(c.source)
        words = {f.split()[0].rstrip(':') for f in flags if f}
        if 'hide' in words or 'default_exp' in words or not code.strip() or 'nbdev_export(' in code: continue
        if module is not None and import_only(code): continue
        c.source = code
        c.outputs = [o for o in c.outputs if o.get('name') != 'stderr']
        export = bool(words & {'export', 'exports'})
        items.append(('private' if export and private_only(code) else 'export' if export else 'code', c))
        if module and export:
            for name in _names(code):
                try: items.append(('code', nbformat.v4.new_markdown_cell(api_markdown(module, name))))
                except Exception as e: problems.append(f"{src.relative_to(ROOT)}: no API reference for {name} ({type(e).__name__}: {e})")
    nb.cells = public_first(items) if module is not None else [c for _, c in items]
    nb.metadata = {'language_info': {'name': 'python'}}
    return nb


def title_and_summary(nb) -> tuple[str, str]:
    "A notebook's `# title` and its `> summary` line (nbdev's title cell)."
    first = next((c.source for c in nb.cells if c.cell_type == 'markdown'), '')
    t = re.search(r'^#\s+(.+)$', first, re.M)
    s = re.search(r'^>\s*(.+)$', first, re.M)
    return (t.group(1).strip() if t else ''), (s.group(1).strip() if s else '')


def toctree(caption: str, pages: list[Path]) -> str:
    names = '\n'.join(staged_name(p).with_suffix('').as_posix() for p in pages)
    return f"```{{toctree}}\n:hidden:\n:caption: {caption}\n\n{names}\n```"


def sections(pages: list[Path]) -> dict[str, list[Path]]:
    nbs = ROOT / 'nbs'
    return {'Guides': [p for p in pages if p.parent == nbs / 'guides'],
            'API reference': [p for p in pages if p.parent == nbs and p.name != 'index.ipynb'],
            **{f'tmas_nb.{pkg}: {title}': [p for p in pages if p.parent == nbs / pkg] for pkg, title in SYSTEMS.items()},
            'Reports': [p for p in pages if p.parent == ROOT / 'reports']}


# ---------------------------------------------------------------- llms.txt and the Markdown copies
def markdown_copy(nb) -> str:
    from nbconvert import MarkdownExporter
    body, _ = MarkdownExporter().from_notebook_node(nb)
    return re.sub(r'\n{3,}', '\n\n', body).strip() + '\n'


def llms_txt(staged: dict[Path, nbformat.NotebookNode], pages: list[Path]) -> str:
    "nbdev's llms.txt: the project, then a list of links to each page's Markdown, one section per part of the site."
    s, url = settings(), site_url()
    lines = [f"# {s['title']}", '', f"> {s['description']}", '',
             'Notebooks are the source of the library (nbdev); every page below is a notebook, as Markdown with its outputs. '
             'Start with the guides; the API reference has one page per module; the reports regenerate the tables and figures.', '']
    def entry(p):
        t, summ = title_and_summary(staged[p])
        return f"- [{t or p.stem}]({url}{staged_name(p).with_suffix('.html.md').as_posix()})" + (f": {summ}" if summ else '')
    for caption, ps in sections(pages).items():
        if ps: lines += [f'## {caption}', '', *map(entry, ps), '']
    home = ROOT / 'nbs' / 'index.ipynb'
    if home in staged: lines += ['## Optional', '', entry(home), '']
    return '\n'.join(lines)


# ---------------------------------------------------------------- the build
def build(pages: list[Path], out: Path, strict: bool) -> int:
    t0 = time.time()
    work = WORK if out == OUT else out.parent / (out.name + '_work')
    stage, html = work / 'site', work / 'html'     # MyST-NB also writes work/jupyter_execute (beside the HTML)
    shutil.rmtree(work, ignore_errors=True); stage.mkdir(parents=True)
    images = ROOT / 'nbs' / 'images'
    links = Links(set(pages) | {p.resolve() for p in images.glob('*')})
    problems, staged = [], {}
    for p in pages:
        nb = staged[p] = stage_notebook(p, links, problems)
        if p == ROOT / 'nbs' / 'index.ipynb':
            for caption, ps in sections(pages).items():
                if ps: nb.cells.append(nbformat.v4.new_markdown_cell(toctree(caption, ps)))
        dest = stage / staged_name(p); dest.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, dest)
    shutil.copytree(images, stage / 'images')
    problems += links.problems
    for line in problems: print(f"{'error' if strict else 'warning'}: {line}", file=sys.stderr)
    if strict and problems: print(f"the site has {len(problems)} problem(s) above", file=sys.stderr); return 1
    t_stage = time.time()
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, '-m', 'sphinx', '-b', 'html', '-c', str(ROOT / 'docs'), '-E', '-q', '-j', '2',
           '-d', str(work / 'doctrees'), *(['-W', '--keep-going'] if strict else []), str(stage), str(html)]
    r = subprocess.run(cmd, cwd=ROOT)
    if r.returncode: print(f"sphinx failed (exit {r.returncode})", file=sys.stderr); return 1
    shutil.move(html, out)
    t_sphinx = time.time()
    for p, nb in staged.items():
        (out / staged_name(p).with_suffix('.html.md')).write_text(markdown_copy(nb), encoding='utf-8')
    (out / 'llms.txt').write_text(llms_txt(staged, pages), encoding='utf-8')
    t = time.time()
    print(f"built {len(pages)} pages into {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} "
          f"in {t - t0:.0f} s (staging and API reference {t_stage - t0:.0f} s, Sphinx {t_sphinx - t_stage:.0f} s, "
          f"Markdown and llms.txt {t - t_sphinx:.0f} s){'' if strict else ' (not strict)'}")
    return 0


DEFAULT_PORT = 8000


def open_server(out: Path, port: int | None) -> http.server.ThreadingHTTPServer:
    """An HTTP server of the folder `out` on 127.0.0.1, listening before the site is built: on `port`, else on
    `DEFAULT_PORT` or, when something else listens there (the README's `tmas serve` does), on a free port. A `port` in
    use is a `SystemExit` of one line that names it."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    for p in ([port] if port else [DEFAULT_PORT, 0]):
        try: return http.server.ThreadingHTTPServer(('127.0.0.1', p), handler)
        except OSError as e:
            if e.errno != errno.EADDRINUSE: raise
            if port: raise SystemExit(f"docs.py: error: port {port} is taken (another server listens on 127.0.0.1:{port}); "
                                      f"pass another (--serve {port + 1}) or --serve alone for a free one") from None
            print(f"port {DEFAULT_PORT} is taken (the README's `tmas serve` listens there); serving on a free port", file=sys.stderr)


def serve(httpd: http.server.ThreadingHTTPServer, out: Path):
    with httpd:
        print(f"serving {out} at http://127.0.0.1:{httpd.server_address[1]}/ (Ctrl-C stops)")
        try: httpd.serve_forever()
        except KeyboardInterrupt: pass


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog='python .ci/docs.py', description=__doc__.split('\n\n')[0])
    ap.add_argument('--serve', nargs='?', const=0, default=None, type=int, metavar='PORT',
                    help=f'serve the site after building it (default port {DEFAULT_PORT}, or a free one when it is taken)')
    ap.add_argument('--pages', nargs='+', type=Path, help='only these notebooks (not strict)')
    ap.add_argument('--out', type=Path, default=OUT, help='the site folder (default _docs/)')
    a = ap.parse_args(argv)
    pages = [p.resolve() for p in a.pages] if a.pages else all_pages()
    missing = [p for p in pages if not p.is_file()]
    if missing: ap.error(f"no such notebook: {', '.join(map(str, missing))}")
    home = ROOT / 'nbs' / 'index.ipynb'              # the site's home page holds the table of contents: always built
    if home not in pages: pages.insert(0, home)
    httpd = open_server(a.out.resolve(), a.serve) if a.serve is not None else None   # a taken port fails now, not after the build
    rc = build(pages, a.out.resolve(), strict=not a.pages)
    if httpd is not None:
        if rc == 0: serve(httpd, a.out.resolve())
        else: httpd.server_close()
    return rc


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
