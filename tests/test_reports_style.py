"""The reports' figure style, their paths and their kernel: one style module, outputs where --out says wherever the kernel starts."""
import json
import os
import subprocess
import sys

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import nbformat
import pandas as pd
from PIL import Image

from tmas_nb.core import repo_root
from tmas_nb.analysis.reporting import (
    PATH_PARAMETERS, interval_label, iteration_ticks, list_reports, reports_dir, runs_curve, save_figure, use_style,
    REPORT_INPUTS)


def _report(name):
    return nbformat.read(reports_dir() / f'{name}.ipynb', as_version=4)


def test_iteration_ticks_use_the_papers_numbering():
    fig, ax = plt.subplots()
    assert iteration_ticks(ax, [0, 1, 2]) == [0, 1, 2]
    assert [t.get_text() for t in ax.get_xticklabels()] == ['It0', 'It1', 'It2']     # TMAS §5.3 "It0 … It11"; RSE "It0 = base"
    assert iteration_ticks(ax, range(20))[-1] == 19                                   # TMAS Table 1 ends at It19 (T = 20)
    plt.close(fig)


def test_no_nan_in_a_legend_with_one_run():
    fig, ax = plt.subplots()
    one = pd.DataFrame({'run': ['a', 'a'], 'iteration': [0, 1], 'v': [10.0, 20.0]})
    line = runs_curve(ax, one, 'iteration', 'v', 'tmas')
    label = interval_label('Δ', float('nan'), p=float('nan'))
    assert 'nan' not in line.get_label() and 'nan' not in label and 'not enough runs' in label
    assert 'nan' not in interval_label('Pass@1', 50.0, float('nan'), float('nan'))
    plt.close(fig)


def test_saved_figure_is_at_least_150_dpi(tmp_path):
    use_style()
    fig, ax = plt.subplots(figsize=(3, 2)); ax.plot([0, 1], [0, 1])
    p = save_figure(fig, tmp_path / 'f.png', dpi=72); plt.close(fig)
    assert Image.open(p).info['dpi'][0] >= 149.5


def test_every_report_figure_goes_through_the_style():
    for name in list_reports():
        src = '\n'.join(c.source for c in _report(name).cells if c.cell_type == 'code')
        assert 'savefig(' not in src, f"{name}: write figures with tmas_nb.analysis.reporting.save_figure"
        if 'plt.' in src: assert 'use_style()' in src, f"{name} draws without the reports' style"


def test_report_notebooks_ask_for_the_project_kernel():
    for name in list_reports():
        assert _report(name).metadata.kernelspec['name'] == 'tmas_nb', name


def test_report_outputs_are_git_ignored():
    paths = ['reports/out/compute/compute_pareto.png', 'reports/reports/out/compute/compute.csv']
    r = subprocess.run(['git', 'check-ignore', *paths], cwd=repo_root(), capture_output=True, text=True)
    assert r.stdout.split() == paths, r.stdout + r.stderr


def test_default_paths_come_from_the_repository_wherever_the_kernel_starts(tmp_path):
    "Each report's parameter cell and the cell after it, run in reports/ (where JupyterLab starts a kernel): every path is the repository's."
    code = []
    for name in list_reports():
        cells = _report(name).cells
        [i] = [k for k, c in enumerate(cells) if 'parameters' in c.metadata.get('tags', [])]
        assert 'resolve_paths' in cells[i + 1].source, f"{name}: the cell after the parameters resolves their paths"
        code.append(f"ns = {{}}; exec({cells[i].source + chr(10) + cells[i + 1].source!r}, ns)\n"
                    f"out[{name!r}] = {{k: ns[k] for k in {list(PATH_PARAMETERS)!r} if k in ns}}")
    prog = 'import json\nout = {}\n' + '\n'.join(code) + '\nprint(json.dumps(out))'
    r = subprocess.run([sys.executable, '-c', prog], cwd=reports_dir(), capture_output=True, text=True, timeout=120,
                       env={**os.environ, 'MPLBACKEND': 'Agg'})
    assert r.returncode == 0, r.stderr[-2000:]
    root = str(repo_root())
    for name, params in json.loads(r.stdout).items():
        assert params['out_dir'] == f'{root}/reports/out/{name}', (name, params)
        for k, v in params.items():
            for p in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else [v]):
                assert p is None or os.path.isabs(p), (name, k, p)


def test_report_run_from_another_folder_writes_under_out(tmp_path):
    "`tmas report` called elsewhere: a relative input path means the caller's folder, outputs land under --out, none in reports/reports."
    from tmas_nb.autotts.discovery import synthetic_store
    from tmas_nb.autotts.authors_api import store_records
    work = tmp_path / 'elsewhere'; (work / 'stores').mkdir(parents=True)
    (work / 'stores' / 'syn.json').write_text(json.dumps(store_records(synthetic_store())))
    before = set(os.listdir(reports_dir()))
    r = subprocess.run([sys.executable, '-m', 'tmas_nb.cli', 'report', 'replay_build', '--quiet', '--out', 'out',
                        '-p', 'store_file=stores/syn.json', '-p', 'seeds=2'], cwd=work, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = work / 'out' / 'replay_build'
    assert {'replay_build.png', 'controllers.csv', 'summary.json', 'replay_build.ipynb'} <= set(os.listdir(d))
    assert Image.open(d / 'replay_build.png').info['dpi'][0] >= 149.5
    assert set(os.listdir(reports_dir())) == before and not (reports_dir() / 'reports').exists()
    assert sorted(os.listdir(work)) == ['out', 'stores']
    assert nbformat.read(d / 'replay_build.ipynb', as_version=4).metadata.kernelspec['name'] in ('tmas_nb', 'python3')


def test_the_run_hint_finishes_in_minutes_on_a_cpu():
    for kind, _, make in REPORT_INPUTS.values():
        if kind == 'runs': assert '--preset cpu-demo' in make and '--limit 20' not in make, make
