"""Generate README.md (and README_files/) from nbs/index.ipynb, offline, with nbconvert.

    python .ci/readme.py           write README.md and README_files/
    python .ci/readme.py --check   exit 1 when README.md or README_files/ differ from what index.ipynb gives

Cells whose first lines carry `#| hide` are left out; `#|` directive lines are dropped from the cells kept; the
stored outputs are kept (the notebook is committed with them), and images become files under README_files/.
"""
import re, sys
from pathlib import Path

import nbformat
from nbconvert import MarkdownExporter

ROOT = Path(__file__).resolve().parent.parent
NB, README, FILES = ROOT / 'nbs' / 'index.ipynb', ROOT / 'README.md', 'README_files'
DIRECTIVE = re.compile(r'^\s*#\|\s*(.*)$')


def _directives(src: str) -> tuple[list[str], str]:
    "The `#|` directives at the top of a cell, and the source without them."
    lines, flags = src.splitlines(), []
    while lines and (m := DIRECTIVE.match(lines[0])):
        flags += m.group(1).split(); lines.pop(0)
    return flags, '\n'.join(lines).strip('\n')


def render() -> tuple[str, dict[str, bytes]]:
    "README text and its image files {relative path: bytes}."
    nb = nbformat.read(NB, as_version=4)
    cells = []
    for c in nb.cells:
        if c.cell_type == 'code':
            flags, src = _directives(c.source)
            if 'hide' in flags or 'export' in flags or not src.strip(): continue
            c.source = src
            c.outputs = [o for o in c.outputs if o.get('name') != 'stderr']
        cells.append(c)
    nb.cells = cells
    nb.metadata['language_info'] = {'name': 'python'}   # fenced code blocks say python
    exp = MarkdownExporter()
    body, res = exp.from_notebook_node(nb, resources={'output_files_dir': FILES, 'unique_key': 'README'})
    body = re.sub(r'\n{3,}', '\n\n', body).strip() + '\n'
    for folder in ('images/', 'guides/'):   # pictures and guides beside the notebook, seen from the repository root
        body = body.replace(f'](' + folder, f'](nbs/' + folder)
    note = '<!-- Generated from nbs/index.ipynb by `python .ci/readme.py`; edit the notebook, not this file. -->\n'
    return note + body, dict(res.get('outputs', {}))


def main(argv) -> int:
    text, files = render()
    if '--check' in argv:
        bad = [] if README.exists() and README.read_text(encoding='utf-8') == text else ['README.md']
        have = {str(p.relative_to(ROOT)) for p in (ROOT / FILES).glob('*')} if (ROOT / FILES).is_dir() else set()
        bad += sorted(have ^ set(files)) + [f for f in files if f in have and (ROOT / f).read_bytes() != files[f]]
        if bad:
            print(f"README is out of date with nbs/index.ipynb ({', '.join(bad)}): run `python .ci/readme.py` and commit")
            return 1
        return 0
    README.write_text(text, encoding='utf-8')
    d = ROOT / FILES
    if d.is_dir():
        for p in d.glob('*'):
            if str(p.relative_to(ROOT)) not in files: p.unlink()
    for name, data in files.items():
        (ROOT / name).parent.mkdir(parents=True, exist_ok=True)
        (ROOT / name).write_bytes(data)
    print(f"wrote README.md and {len(files)} file(s) under {FILES}/")
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
