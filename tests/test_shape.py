"""Cell-level shape: no export cell a reader cannot hold on one screen, no function with more than ten parameters.

Cells are found by the first name they define, not by notebook or position, so notebooks may move into folders and
modules may be renamed without touching this file."""
import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NBS, PKG = ROOT / 'nbs', ROOT / 'tmas_nb'
MAX_CELL_LINES, MAX_PARAMS = 50, 10

# Export cells that are one data definition (a prompt template, a literal table): splitting them would cut a text or a
# table in two. Keyed by the first name the cell defines.
DATA_CELLS = {'METHOD_TEMPLATE', 'NOVELTY_PAIRS', 'COMMANDS'}
# numba kernels (replay.fast): compiled loops over flat arrays, kept whole so the compiled code reads as one piece.
KERNEL_CELLS = {'cmc_kernel', 'serve_kernel'}
# numba njit kernels take flat arrays, one parameter each; they are not called from user code.
EXEMPT_FUNCTIONS = {'pp_kernel', 'cmc_kernel', 'serve_kernel', 'serve_loop'}

_EXPORT = re.compile(r'^\s*#\|\s*exports?\s*$')


def _first_name(source: str) -> str | None:
    "The first name a cell defines: a function, a class, or the target of an assignment."
    code = '\n'.join(l for l in source.splitlines() if not l.lstrip().startswith(('%', '!')))
    try: tree = ast.parse(code)
    except SyntaxError: return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): return node.name
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name): return n.id
    return None


def export_cells():
    "(notebook, cell index, first defined name, source lines) of every export cell under nbs/, in folders too."
    for nb in sorted(NBS.glob('**/*.ipynb')):
        if '.ipynb_checkpoints' in nb.parts: continue
        cells = json.loads(nb.read_text(encoding='utf-8'))['cells']
        for i, c in enumerate(cells):
            if c['cell_type'] != 'code': continue
            src = ''.join(c['source']) if isinstance(c['source'], list) else c['source']
            lines = src.splitlines()
            if any(_EXPORT.match(l) for l in lines): yield nb.relative_to(ROOT), i, _first_name(src), lines


def functions():
    "(module, qualified name, line, parameter count without self/cls) of every function in tmas_nb."
    for py in sorted(PKG.glob('**/*.py')):
        tree = ast.parse(py.read_text(encoding='utf-8'))
        def walk(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = child.args
                    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
                    yield py.relative_to(ROOT), child.name, f'{prefix}{child.name}', child.lineno, \
                        len([n for n in names if n not in ('self', 'cls')])
                    yield from walk(child, f'{prefix}{child.name}.')
                elif isinstance(child, ast.ClassDef): yield from walk(child, f'{prefix}{child.name}.')
                else: yield from walk(child, prefix)
        yield from walk(tree, '')


def test_export_cells_are_short():
    long = [f"{nb} cell {i} ({name}): {len(lines)} lines; split it into smaller export cells (a short class cell, then "
            f"@patch methods; or helpers pulled out)"
            for nb, i, name, lines in export_cells() if len(lines) > MAX_CELL_LINES and name not in DATA_CELLS | KERNEL_CELLS]
    assert not long, '\n'.join(long)


def test_functions_take_at_most_ten_parameters():
    many = [f"{py}:{line} {qual} takes {n} parameters; group related ones into a dataclass"
            for py, name, qual, line, n in functions() if n > MAX_PARAMS and name not in EXEMPT_FUNCTIONS]
    assert not many, '\n'.join(many)


def test_exempt_entries_still_exist():
    cells = {name: (nb, i, len(lines)) for nb, i, name, lines in export_cells()}
    stale = [f"DATA_CELLS/KERNEL_CELLS name {n!r}: no export cell defines it first any more; remove it from tests/test_shape.py"
             for n in sorted(DATA_CELLS | KERNEL_CELLS) if n not in cells]
    stale += [f"DATA_CELLS/KERNEL_CELLS name {n!r} ({cells[n][0]} cell {cells[n][1]}): {cells[n][2]} lines, no longer over "
              f"{MAX_CELL_LINES}; remove it from tests/test_shape.py"
              for n in sorted(DATA_CELLS | KERNEL_CELLS) if n in cells and cells[n][2] <= MAX_CELL_LINES]
    funcs = {name: n for _, name, _, _, n in functions()}
    stale += [f"EXEMPT_FUNCTIONS name {n!r}: no function of tmas_nb has this name; remove it from tests/test_shape.py"
              for n in sorted(EXEMPT_FUNCTIONS) if n not in funcs]
    stale += [f"EXEMPT_FUNCTIONS name {n!r}: takes {funcs[n]} parameters, no longer over {MAX_PARAMS}; remove it"
              for n in sorted(EXEMPT_FUNCTIONS) if n in funcs and funcs[n] <= MAX_PARAMS]
    assert not stale, '\n'.join(stale)
