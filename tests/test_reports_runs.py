"""Smoke-run the TMAS / RSE report notebooks (papermill) on small runs recorded with the real tiny model, and check what they write."""
import contextlib
import io
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tmas_nb.analysis.reporting import run_report

# Tiny settings: 2 demo problems, N = 2, M = 2, T = 2, 12 new tokens per answer. The hashing embedder keeps the memory banks'
# de-duplication free of a second model load; everything else is the real pipeline with SmolLM2-135M.
TINY = ['--benchmark', 'demo', '--model', 'smollm2', '--limit', '2', '--n-candidates', '2', '--iterations', '2',
        '--max-new-tokens', '12', '--threads', '1', '--quiet']
RUNS = {
    'tmas': ['--method', 'tmas', '--n-verifications', '2'],
    'tmas_no_memory': ['--method', 'tmas', '--n-verifications', '2', '--config', '{cfg_no_memory}'],
    'rse': ['--method', 'rse'],
    'mv': ['--method', 'mv'],
}


def _tmas_command() -> list[str]:
    "`tmas` as a subprocess."
    return [sys.executable, '-m', 'tmas_nb.cli']


# Recorded beside them but kept out of the reports: a sampling run on three problems, which `tmas compare` pairs on the two shared.
OTHER = {'sampling_3': ['--method', 'sampling', '--limit', '3', '--iterations', '1']}


@pytest.fixture(scope='session')
def recorded_all(tmp_path_factory):
    "Every real run folder of RUNS and OTHER, recorded in parallel."
    root = tmp_path_factory.mktemp('recorded_runs')
    cfg = root / 'hashing.json'
    cfg.write_text(json.dumps({'embedder': 'hashing'}))
    no_mem = root / 'no_memory.json'
    no_mem.write_text(json.dumps({'embedder': 'hashing', 'use_experience': False, 'use_guidelines': False}))
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false'}
    procs, t0 = {}, time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    for name, args in {**RUNS, **OTHER}.items():
        args = [a.replace('{cfg_no_memory}', str(no_mem)) for a in args]
        if '--config' not in args: args += ['--config', str(cfg)]
        cmd = _tmas_command() + ['run', *TINY, *args, '--out', str(root / name)]     # a run's own flags win over TINY's
        procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, p in procs.items():
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, f"`tmas run` for {name} failed ({p.returncode}):\n{err[-3000:]}"
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"recorded {len(procs)} runs in {time.perf_counter() - t0:.0f} s wall, "
          f"{cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime:.0f} s CPU")
    return {name: root / name for name in procs}


@pytest.fixture(scope='session')
def recorded_runs(recorded_all):
    "Four real run folders (TMAS, TMAS without both memory banks, RSE, majority vote) on the same two demo problems."
    return {name: recorded_all[name] for name in RUNS}


@pytest.fixture(scope='session')
def summaries(recorded_runs):
    "`tmas runs summary --json` of each recorded run (the command line's own `main`, in this process)."
    from tmas_nb.cli import main
    out = {}
    for name, d in recorded_runs.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf): assert main(['runs', 'summary', str(d), '--json']) == 0
        out[name] = json.loads(buf.getvalue())
        assert out[name]['complete'] is True
    return out


def _finite(df: pd.DataFrame, cols) -> bool:
    return len(df) > 0 and all(math.isfinite(float(v)) for c in cols for v in df[c])


def _png(path) -> None:
    assert path.exists() and path.stat().st_size > 5_000, f"{path} missing or too small"


def _final(summary) -> float:
    return summary['iterations'][-1]['pass_at_1'] * 100


def test_analysis_does_not_import_torch():
    code = "import sys, tmas_nb.analysis.tables; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, '-c', code], check=True, timeout=120)


def test_tmas_iterations_report(recorded_runs, summaries, tmp_path):
    d = run_report('tmas_iterations', tmp_path, dict(runs=[str(p) for p in recorded_runs.values()]), progress=False)
    wide = pd.read_csv(d / 'pass_at_1_table.csv')
    assert set(wide.label) == {'tmas', 'tmas −both', 'rse', 'mv'}
    assert _finite(wide, ['It0', 'It1']) and wide[['It0', 'It1']].stack().between(0, 100).all()
    row = wide.set_index('label').loc['tmas']
    assert row.It1 == pytest.approx(_final(summaries['tmas']), abs=0.01)
    long = pd.read_csv(d / 'pass_at_1_by_iteration.csv')
    assert len(long) == 8 and (long.candidates > 0).all()
    s = json.loads((d / 'summary.json').read_text())
    assert s['runs'] == 4 and 'small model' in s['note']
    _png(d / 'pass_at_1_curves.png')
    paper = pd.read_csv(d / 'paper_comparison.csv')     # the published figures are printed, none matches the demo set
    assert len(paper) == 140 and paper.ours.isna().all() and (paper.setting_differs == 'no run of ours on this benchmark').all()
    assert set(paper.source) == {'TMAS Table 1', 'TMAS §5.2'} and (paper.comparable == 'no run of ours').all()
    assert paper.paper_grading.str.contains('LLM judge DeepSeek-V3.2').all()
    top = paper[(paper.benchmark == 'imo_answerbench') & (paper.label == 'tmas') & (paper.model == 'Qwen3-30B-A3B-Thinking-2507')]
    assert top.paper.tolist() == [22.06, 28.56, 36.5, 37.81, 39.31, 40.5]      # TMAS Table 1 in full: It1/3/9/11/17/19
    # every Pass@1 with its interval over the two problems; the wide table's numbers are the intervals' centres
    iv = pd.read_csv(d / 'pass_at_1_intervals.csv').set_index(['label', 'iteration'])
    assert len(iv) == 8 and (iv.problems == 2).all() and (iv.pass_at_1_low <= iv.pass_at_1).all() and (iv.pass_at_1 <= iv.pass_at_1_high).all()
    assert 100 * iv.loc[('tmas', 1), 'pass_at_1'] == pytest.approx(row.It1, abs=0.01)
    assert 'best_candidate' in iv.columns
    # TMAS against each baseline at the last iteration, paired over the problems, Holm across the table
    pc = pd.read_csv(d / 'paired_comparisons.csv')
    assert set(zip(pc.a, pc.b)) == {('tmas', 'tmas −both'), ('tmas', 'rse'), ('tmas', 'mv')} and (pc.problems == 2).all()
    assert pc.p.between(0, 1).all() and (pc.p_holm >= pc.p - 1e-12).all()
    assert s['comparisons'] and len(s['final_intervals']) == 4


def test_tmas_ablation_report(recorded_runs, summaries, tmp_path):
    d = run_report('tmas_ablation', tmp_path, dict(runs=[str(p) for p in recorded_runs.values()]), progress=False)
    comp = pd.read_csv(d / 'components.csv')
    assert set(comp.variant) == {'full', '−both'} and _finite(comp, ['final_pass_at_1', 'best_pass_at_1', 'final_pass_at_1_low', 'final_pass_at_1_high'])
    both = comp.set_index('variant').loc['−both']                    # the arm against the full system, paired over the problems
    assert both.arm == '−both (ε = 0)' and 0 < both.p <= both.p_holm <= 1 and math.isfinite(both['diff'])
    assert comp.set_index('variant').loc['−both', 'final_pass_at_1'] == pytest.approx(_final(summaries['tmas_no_memory']), abs=1e-6)
    missing = pd.read_csv(d / 'missing_runs.csv')
    assert set(missing.variant) == {'−experience', '−guideline'}
    assert missing.command.str.contains('tmas run --method tmas').all()
    for cmd in missing.command:                     # every setting of the group's run travels: the hashing embedder has no flag
        cfg = Path(cmd.split('--config ')[1].split()[0])
        assert json.loads(cfg.read_text())['embedder'] == 'hashing' and cfg.parent == d / 'commands'
    ug = pd.read_csv(d / 'unique_guidelines.csv')
    assert len(ug) == 1 and _finite(ug, ['epsilon', 'mean_unique_guidelines'])   # only the full run keeps guidelines
    s = json.loads((d / 'summary.json').read_text())
    assert s['missing_sweeps'] == ['epsilon', 'n_verifications', 'n_candidates']
    _png(d / 'ablation.png')


def test_verification_paradox_report(recorded_runs, tmp_path):
    d = run_report('verification_paradox', tmp_path, dict(runs=[str(p) for p in recorded_runs.values()]), progress=False)
    t = pd.read_csv(d / 'verification_paradox.csv')
    assert set(t.label) == {'tmas', 'tmas −both'}
    assert sorted(t.iteration.astype(str).unique()) == ['0', '1', 'all'] and {'delta_low', 'delta_high'} <= set(t.columns)
    assert _finite(t, ['n_ever', 'n_never', 'scored_candidates', 'candidates']) and (t.candidates == 8).all()
    # the groups hold exactly the problems that have scores; Δ is a number whenever both groups are non-empty
    both = t[(t.n_ever > 0) & (t.n_never > 0)]
    assert _finite(both, ['delta']) if len(both) else t.note.str.contains('left out|at least 2').all()
    _png(d / 'verification_paradox.png')
    paper = pd.read_csv(d / 'paper_comparison.csv')
    assert paper.paper.tolist() == [0.110, 0.056] and paper.paper_p.tolist() == [0.00622, 0.448]


def test_rse_tables_report(recorded_runs, summaries, tmp_path):
    # Table 7 picks the strongest of Self-Refine and PaCoRe; the tiny fixtures have neither, so MV stands in for them here
    d = run_report('rse_tables', tmp_path, dict(runs=[str(p) for p in recorded_runs.values()], table7_baselines=['mv']), progress=False)
    w = pd.read_csv(d / 'rse_by_round.csv')
    assert set(w.label) == {'rse', 'mv'} and _finite(w, ['R0', 'R1'])
    assert w.set_index('label').loc['rse', 'R1'] == pytest.approx(_final(summaries['rse']), abs=0.01)
    banks = pd.read_csv(d / 'bank_sizes.csv')
    assert list(banks['round']) == [0, 1] and _finite(banks, ['n_pos', 'n_neg', 'n_items'])
    sig = pd.read_csv(d / 'significance.csv')
    assert len(sig) == 1 and (sig.benchmark[0], sig.method[0], sig.baseline[0]) == ('demo', 'rse', 'mv') and _finite(sig, ['mean_a', 'mean_b', 'delta'])
    assert 'at least 2' in sig.note[0] and sig[['welch_p', 'paired_p']].isna().all(axis=None)   # one seed each: neither run-level test, said plainly
    assert pd.read_csv(d / 'run_level_final_pass_at_1.csv').label.tolist() == ['rse', 'mv']
    assert _finite(sig, ['diff', 'p', 'p_holm']) and sig.problems[0] == 2      # ours: paired over the problems, defined with one run a side
    rounds = pd.read_csv(d / 'pass_at_1_by_round_intervals.csv')
    assert len(rounds) == 4 and (rounds.pass_at_1_low <= rounds.pass_at_1).all()
    tau = pd.read_csv(d / 'pass_at_1_vs_tau.csv')
    assert _finite(tau, ['tau', 'final_pass_at_1'])
    arms = pd.read_csv(d / 'rse_arms.csv')                 # each RSE arm of the folders, with its settings
    assert list(arms.label) == ['rse'] and arms.dedup.tolist() == ['semantic'] and json.loads((d / 'summary.json').read_text())['rse_arms'] == ['rse']
    published = pd.read_csv(d / 'paper_ablation_arms.csv')
    assert set(published.source) == {'RSE Table 9', 'RSE Table 10', 'RSE Table 20'} and published.ours.isna().all()
    t1 = pd.read_csv(d / 'paper_table1.csv')
    assert set(t1.model) == {'Qwen3-30B-A3B-Thinking-2507', 'Qwen3-4B-Thinking-2507', 'Phi-4-reasoning'} and len(t1) == 3 * (2 * 4 + 3 * 16)
    _png(d / 'rse_rounds.png')


@pytest.fixture(scope='session')
def controller_runs(tmp_path_factory):
    "Two live controller runs (SC@2 and CMC β=0.5 on SmolLM2-135M, 2 demo problems, B=2, T=8, L=16), recorded in parallel."
    root = tmp_path_factory.mktemp('controller_runs')
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false'}
    specs = {'sc': 'sc:k=2', 'cmc': 'cmc:beta=0.5'}
    procs = {k: subprocess.Popen(_tmas_command() + ['run', '--method', 'controller', '--controller', spec, '--branches', '2',
                                                   '--probe-every', '8', '--max-new-tokens', '16', '--benchmark', 'demo',
                                                   '--limit', '2', '--model', 'smollm2', '--backend', 'transformers',
                                                   '--threads', '1', '--quiet', '--out', str(root / k)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k, spec in specs.items()}
    for k, p in procs.items():
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"controller run {k} failed:\n{err[-3000:]}"
    return {k: root / k for k in specs}


def test_rl_training_report_figure3(recorded_runs, summaries, tmp_path):
    "Figure 3 alone (no training metrics): TMAS runs as checkpoints, Pass@1 with intervals and each against the first, Holm across the table."
    tmas_runs = {'no RL': str(recorded_runs['tmas_no_memory']), 'Vanilla-RL': str(recorded_runs['tmas']), 'Hybrid-RL': str(recorded_runs['tmas'])}
    d = run_report('rl_training', tmp_path, dict(runs={}, tmas_runs=tmas_runs), progress=False)
    curves = pd.read_csv(d / 'figure3_pass_at_1.csv')
    assert list(curves.run.unique()) == ['no RL', 'Vanilla-RL', 'Hybrid-RL'] and (curves.problems == 2).all()
    mine = curves[curves.run == 'Vanilla-RL'].pass_at_1.tolist()
    assert mine == pytest.approx([i['pass_at_1'] for i in summaries['tmas']['iterations']])
    paired = pd.read_csv(d / 'figure3_paired.csv')
    assert len(paired) == 6 and set(zip(paired.a, paired.b)) == {('Vanilla-RL', 'no RL'), ('Hybrid-RL', 'no RL'), ('Hybrid-RL', 'Vanilla-RL')}
    assert (paired[(paired.a == 'Hybrid-RL') & (paired.b == 'Vanilla-RL')]['diff'] == 0).all() and (paired.p_holm >= paired.p - 1e-12).all()
    _png(d / 'figure3.png')


def test_compute_report(recorded_runs, controller_runs, summaries, tmp_path):
    runs = [str(p) for p in [*recorded_runs.values(), *controller_runs.values()]]
    d = run_report('compute', tmp_path, dict(runs=runs), progress=False)
    c = pd.read_csv(d / 'compute.csv')
    assert len(c) == 6 and _finite(c, ['tokens_per_problem', 'pass_at_1']) and (c.tokens_per_problem > 0).all()
    assert _finite(c, ['pass_at_1_low', 'pass_at_1_high']) and (c.pass_at_1_low <= c.pass_at_1 + 1e-9).all() and (c.pass_at_1 <= c.pass_at_1_high + 1e-9).all()
    assert c.pareto.any() and c.complete.all()
    per_run = pd.read_csv(d / 'compute_per_run.csv').set_index('label')
    tokens = sum(summaries['tmas']['tokens_by_role'].values())
    assert per_run.loc['tmas', 'completion_tokens'] == tokens
    # TMAS spends tokens on verification, summaries and memory updates too: more than its candidates alone
    assert per_run.loc['tmas', 'completion_tokens'] > per_run.loc['tmas', 'candidate_tokens']
    # each live controller is a point of its own, charged the tokens the model decoded: branches + probes, as recorded
    c = c.set_index('label')
    for k, spec in (('sc', 'sc:k=2'), ('cmc', 'cmc:beta=0.5')):
        rec = pd.read_parquet(controller_runs[k] / 'records.parquet')
        use = json.loads((controller_runs[k] / 'usage.json').read_text())['by_role']
        real = sum(json.loads(u)['tokens_generated'] + json.loads(u)['probe_tokens'] for u in rec.summary)
        assert set(use) == {'branch', 'probe'} and per_run.loc[f'controller {spec}', 'completion_tokens'] == real
        row = c.loc[f'controller {spec}']
        assert row.method == 'controller' and row.tokens_per_problem == real / 2 and row.pass_at_1 == 100 * rec.correct.mean()
    s = json.loads((d / 'summary.json').read_text())
    assert {x['label'] for x in s['controllers']} == {'controller sc:k=2', 'controller cmc:beta=0.5'}
    _png(d / 'compute_pareto.png')


# ------------------------------------------------------------------ tmas compare on real runs

def _compare(*argv, timeout=180):
    return subprocess.run(_tmas_command() + ['compare', *map(str, argv)], capture_output=True, text=True, timeout=timeout)


def test_compare_two_real_runs(recorded_runs, summaries, tmp_path):
    "TMAS against TMAS without its memory banks, on the same two demo problems: every number checked against the run folders."
    from tmas_nb.runs.folder import best_candidates
    a, b = recorded_runs['tmas_no_memory'], recorded_runs['tmas']
    r = _compare(a, b, '--json', '--png', tmp_path / 'cmp.png')
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert [x['name'] for x in j['runs']] == ['tmas_no_memory', 'tmas'] and j['reference'] == 'tmas_no_memory' and j['flags'] == []
    assert [x['label'] for x in j['runs']] == ['tmas −both', 'tmas'] and j['problem_ids'] == ['demo-01', 'demo-02']
    every = []
    for it, sa, sb in zip(j['iterations'], summaries['tmas_no_memory']['iterations'], summaries['tmas']['iterations']):
        pa, pb = it['pass_at_1']['tmas_no_memory'], it['pass_at_1']['tmas']
        assert (pa['value'], pb['value']) == (pytest.approx(sa['pass_at_1']), pytest.approx(sb['pass_at_1']))   # = `tmas runs summary`
        [c] = it['comparisons']
        assert c['diff'] == pytest.approx(pb['value'] - pa['value']) and c['problems'] == 2
        for x in (pa, pb): assert x['low'] is None or x['low'] <= x['value'] <= x['high']
        assert 0 < c['p'] <= 1 and c['p'] <= c['p_holm'] <= 1
        every.append(c)
    assert len(j['iterations']) == 2
    # the final answer: each run's best candidate at its last iteration, recomputed from records.parquet
    for name, d in (('tmas_no_memory', a), ('tmas', b)):
        best = best_candidates(pd.read_parquet(d / 'records.parquet'))
        assert j['final_answer']['pass_at_1'][name]['value'] == pytest.approx(best[best.iteration == 1].correct.mean())
    assert 'McNemar' in j['final_answer']['comparisons'][0]['test']
    # tokens: every role's, from calls.parquet, equal to usage.json's total; the ratio is theirs
    per = {n: json.loads((d / 'usage.json').read_text())['total']['completion_tokens'] / 2 for n, d in (('tmas_no_memory', a), ('tmas', b))}
    t = {x['run']: x for x in j['tokens']}
    assert t['tmas']['tokens_per_problem'] == pytest.approx(per['tmas']) and t['tmas']['counts'] == 'all roles'
    assert t['tmas']['ratio'] == pytest.approx(per['tmas'] / per['tmas_no_memory'])
    assert 'Holm-adjusted across the 3 comparisons' in j['notes']['tests']
    assert (tmp_path / 'cmp.png').stat().st_size > 20_000
    text = _compare(a, b)
    assert text.returncode == 0 and 'p_holm (tmas)' in text.stdout and 'final answer' in text.stdout and 'BCa bootstrap interval over 2 problems' in text.stdout


def test_compare_pairs_runs_on_other_problems_on_the_shared_ones(recorded_all):
    "A run of 3 problems beside one of 2: compared on the 2 shared problems, saying how many each lost (was: refused)."
    r = _compare(recorded_all['tmas'], recorded_all['sampling_3'])
    assert r.returncode == 0, r.stderr
    assert 'note: compared on the 2 shared problems: 0 dropped from tmas, 1 dropped from sampling_3' in r.stdout, r.stdout
    assert all(' 2 problems · ' in l for l in r.stdout.splitlines()[:2]), r.stdout
