"""How a run is read against the papers: the problem list every run records and the hard subset's grading, the
ablation report's commands, the Hybrid-RL novelty judge, the AutoTTS discovery workspace, and the statistics of RSE
Table 7, TMAS Figure 8 and `tmas compare`. Each test fails on the code before these changes."""
import contextlib
import io
import json

from tmas_nb.cli import main


def _cli(*argv):
    "(exit code, stdout, stderr) of `tmas ARGV`, in process."
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err): rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------ item 4: which problems a number stands on

def test_hard_subset_grades_by_judge_unless_rules_are_asked_for(tmp_path):
    "No --judge and no --rules: refused before any model loads (was: rule grading, which puts solved problems in the hard pool)."
    out = tmp_path / 'ids.txt'
    rc, _, err = _cli('data', 'hard-subset', '--benchmark', 'demo', '--model', 'smollm2', '--limit', '1', '--quiet', '--out', str(out))
    assert rc == 2 and err.strip().startswith('tmas: error: tmas data hard-subset: pass --judge MODEL_OR_URL') and '--rules' in err
    assert not out.exists() and not (tmp_path / 'ids.txt.calls.sqlite').exists()


def test_every_run_records_the_digest_and_origin_of_its_problem_list(tmp_path):
    from tmas_nb.data.benchmarks import problem_list_digest, write_problem_ids
    ids = tmp_path / 'ids.txt'
    write_problem_ids(ids, ['demo-03', 'demo-01'], {'made by': 'tmas data hard-subset', 'model': 'Qwen3-4B-Thinking-2507', 'samples': 8})
    rc, out, err = _cli('run', '--method', 'mv', '--benchmark', 'demo', '--problem-ids', str(ids), '--print-config')
    assert rc == 0, err
    pl = json.loads(out)['protocol']['problem_list']['value']
    assert (pl['problems'], pl['sha256'], pl['whole_benchmark']) == (2, problem_list_digest(['demo-01', 'demo-03']), False)
    assert pl['made_by'] == {'made by': 'tmas data hard-subset', 'model': 'Qwen3-4B-Thinking-2507', 'samples': 8}
    rc, out, _ = _cli('run', '--method', 'mv', '--benchmark', 'demo', '--print-config')
    pl = json.loads(out)['protocol']['problem_list']['value']
    assert (pl['problems'], pl['whole_benchmark']) == (30, True) and 'made_by' not in pl


# ------------------------------------------------------------------ item 5: the ablation report's commands

def test_the_emitted_no_guideline_command_differs_from_the_full_arm_only_in_the_ablated_settings(tmp_path):
    "The −guideline command resolves to the full arm's config but for use_guidelines and ε (was: no preset, the Jaccard bank and a non-flag setting lost)."
    import shlex
    from tmas_nb.analysis.tables import rerun_command
    from tmas_nb.cli import build_parser
    from tmas_nb.data.benchmarks import write_problem_ids
    from tmas_nb.runs.start import plan_run
    ids, own = tmp_path / 'ids.txt', tmp_path / 'own.json'
    write_problem_ids(ids, ['demo-04', 'demo-02'], {'made by': 'hand'})
    own.write_text(json.dumps({'memory_retries': 3, 'role_endpoints': {'verification': 'http://127.0.0.1:9/v1'}}))
    full = plan_run(build_parser().parse_args(['run', '--method', 'tmas', '--preset', 'tmas-paper', '--benchmark', 'demo', '--problem-ids',
                                               str(ids), '--config', str(own), '--n-candidates', '4', '--backend', 'openai', '--base-url',
                                               'http://127.0.0.1:8/v1', '--quiet', '--out', str(tmp_path / 'full')]))
    cmd, files = rerun_command(full.record(), 'runs/no_guideline', tmp_path / 'commands' / 'no_guideline.json', use_guidelines=False, epsilon=0.0)
    (tmp_path / 'commands').mkdir()
    for path, text in files.items(): open(path, 'w').write(text)
    arm = plan_run(build_parser().parse_args(shlex.split(cmd)[1:]))
    a, b = full.config.to_dict(), arm.config.to_dict()
    assert {k for k in a if a[k] != b[k]} == {'use_guidelines', 'epsilon'} and (b['use_guidelines'], b['epsilon']) == (False, 0.0)
    ra, rb = full.record(), arm.record()
    assert rb['preset'] == 'tmas-paper' and rb['protocol']['name']['value'] == 'tmas-paper' and rb['config']['embedder'] == 'jaccard'
    assert rb['protocol']['problem_list']['value']['sha256'] == ra['protocol']['problem_list']['value']['sha256']
    assert (rb['role_endpoints'], rb['base_url'], rb['protocol']['arm']['value']) == (ra['role_endpoints'], ra['base_url'], '−guideline')
    assert {k for k in ra if ra[k] != rb[k]} <= {'config', 'protocol', 'preset_sources', 'preset_notes'}


# ------------------------------------------------------------------ item 7: the Hybrid-RL novelty judge

class _ThinkingJudge:
    "A served judge that thinks whatever it is asked: with a budget under 1,000 tokens its reply ends inside the reasoning."
    def __init__(self): self.requests = []
    async def generate(self, requests):
        from tmas_nb.llm.core import Completion
        self.requests += requests
        out = []
        for r in requests:
            if r.enable_thinking is False: text = 'A new method.' if r.role == 'strategy' else 'NEW'      # the template switched it off
            elif r.max_new_tokens < 1000: text = ''                                                   # cut inside its reasoning
            else: text = 'A new method.' if r.role == 'strategy' else 'NEW'
            out.append([Completion(text=text, finish_reason='stop' if text else 'length')])
        return out


def test_the_novelty_judge_answers_with_thinking_off_and_room(tmp_path):
    "The judge's calls ask for thinking off and 4,096 tokens (were 64 and 8 with thinking on: a thinking judge judged nothing new)."
    import asyncio
    from tmas_nb.rl.rewards import HybridReward, RolloutNoveltyJudge
    llm = _ThinkingJudge()
    hr = HybridReward('hybrid', judge=RolloutNoveltyJudge(llm))
    logged = {}
    got = asyncio.run(hr(['p'] * 2, ['Use a colouring argument. \\boxed{1}'] * 2, gold=['1'] * 2, objective=['novelty'] * 2,
                         guidelines=[['induction on n']] * 2, question=['q'] * 2, log_metric=logged.__setitem__))
    assert got == [1.0, 1.0] and logged['novelty/judged_new'] == 1.0
    assert {(r.role, r.enable_thinking, r.max_new_tokens) for r in llm.requests} == {('strategy', False, 4096), ('novelty_judge', False, 4096)}


def test_a_step_the_judge_answers_nothing_stops_and_paper_training_needs_its_data(tmp_path):
    import asyncio
    import pytest
    from tmas_nb.llm.core import Completion
    from tmas_nb.rl.rewards import HybridReward, RolloutNoveltyJudge

    class Silent:
        async def generate(self, requests): return [[Completion(text='', finish_reason='length')] for _ in requests]
    hr = HybridReward('hybrid', judge=RolloutNoveltyJudge(Silent()))
    with pytest.raises(ValueError, match='no verdict on any of the 2 novelty rollouts of this step'):
        asyncio.run(hr(['p'] * 2, ['Use a colouring argument. \\boxed{1}'] * 2, gold=['1'] * 2, objective=['novelty'] * 2,
                       guidelines=[['induction on n']] * 2, question=['q'] * 2))
    rc, _, err = _cli('rl', 'train', '--config', 'paper', '--judge', 'http://127.0.0.1:9/v1', '--out', str(tmp_path / 'p'), '--dry-run')
    assert rc == 2 and 'the paper trains on its released training rows (RL-training-data.parquet' in err and '--task FILE.parquet' in err


# ------------------------------------------------------------------ item 10: statistics as the papers state them

def test_table7_tests_rse_against_the_stronger_of_self_refine_and_pacore_per_benchmark_and_the_math_average():
    "A stronger sampling or MV run is not Table 7's baseline (was: one strongest over every group); the math average is taken per run first."
    import pandas as pd
    from tmas_nb.analysis.stats import RSE_MATH, table7
    base = {'rse': 70.0, 'pacore': 66.0, 'self-refine': 68.0, 'mv': 95.0, 'sampling': 90.0}
    rows = [dict(benchmark=b, model='m', label=l, seed=s, value=v + (j - 1.5) * 4 + s * (0.5 if l == 'rse' else 0.2) + (l == 'pacore') * j * 1.5)
            for j, b in enumerate(RSE_MATH) for s in range(8) for l, v in base.items()]
    t = table7(pd.DataFrame(rows)).set_index('benchmark')
    assert t.loc[list(RSE_MATH), 'baseline'].tolist() == ['self-refine', 'self-refine', 'pacore', 'pacore']     # chosen per benchmark
    avg = t.loc['math avg']
    assert (avg.baseline, avg.n_a, avg.n_b, avg.paired_runs) == ('pacore', 8, 8, 8)              # pacore's mean over the four: 68.95, self-refine's 68.7
    assert abs(avg.mean_a - (70 + 0.5 * 3.5)) < 1e-9 and abs(avg.mean_b - (66 + 2.25 + 0.2 * 3.5)) < 1e-9
    assert 0 <= avg.paired_p <= 1 and 0 <= avg.welch_p <= 1


def test_the_verification_paradox_splits_problems_by_the_judge_when_a_run_has_its_columns():
    import pandas as pd
    from tmas_nb.analysis.tables import verification_paradox
    rec = pd.DataFrame([dict(problem_id=p, iteration=0, candidate=k, correct=p == 'a', mean_score=s, correct_judge0=p == 'b')
                        for p, ss in (('a', (0.9, 0.7)), ('b', (0.2, 0.4))) for k, s in enumerate(ss)])
    vp = verification_paradox(rec).set_index('iteration')
    assert abs(vp.loc['all', 'mean_ever'] - 0.3) < 1e-9 and abs(vp.loc['all', 'mean_never'] - 0.8) < 1e-9      # b is the judged-solved one
    assert vp.loc['all', 'grading'].startswith('LLM judge') and vp.loc['all', 'delta'] > 0      # by the rules, b is never solved: delta < 0
    assert verification_paradox(rec, judges=None).set_index('iteration').loc['all', 'delta'] < 0


# ------------------------------------------------------------------ item 9: what the AutoTTS explorer sees

def _syn_store(tmp_path):
    from tmas_nb.autotts.discovery import synthetic_store
    from tmas_nb.autotts.authors_api import store_records
    f = tmp_path / 'Qwen3-4B' / 'syn.json'; f.parent.mkdir(exist_ok=True)
    f.write_text(json.dumps(store_records(synthetic_store()))); return f


def test_the_workspace_holds_the_seeds_traces_and_a_round_keeps_the_controllers_own_trace(tmp_path):
    "Seed traces beside the seed curves (none of CMC), the contract and template agree on numpy and scipy, and a round's traces carry the controller's own steps (were: curves only; standard library only; environment only)."
    import re
    from tmas_nb.autotts.discovery import (
        DiscoveryConfig, ENVIRONMENT_API, METHOD_TEMPLATE, RoundContext, ScriptedLLM, make_workspace, run_discovery)
    traced = METHOD_TEMPLATE.replace("import math\n", "import math\nimport numpy as np\n").replace(
        "raise NotImplementedError('OptimalController.solve is not written yet')",
        "self._reset_trace(); self._trace_step('start', beta=self.beta)\n"
        "        answers = [_safe_full_read(question) for _ in range(1 + int(np.round(self.beta * 7)))]\n"
        "        self._trace_step('finish', answer=_majority_answer(answers))\n        return _majority_answer(answers)")
    cfg = DiscoveryConfig(rounds=1, train=[str(_syn_store(tmp_path))], seeds=2, betas=(0.0, 1.0), turns=1)
    out = tmp_path / 'run'
    run_discovery(ScriptedLLM([f"```python\n{traced}```\n"]), cfg, out, progress=False)
    [rec] = [json.loads(l) for l in (out / 'rounds.jsonl').read_text().splitlines()]
    assert rec['status'] == 'ok', rec
    seeds = out / 'code_base' / 'history' / 'seed_algorithms' / 'matrix_results_Qwen3-4B' / 'syn_trace_new_api.jsonl'
    st = [json.loads(l) for l in seeds.read_text().splitlines()]
    assert {t['method'] for t in st} == {'SC', 'ASC', 'ESC', 'Parallel-Probe'} and not re.search(r'cmc|CMC', seeds.read_text())
    assert {t['seed'] for t in st} == {0} and all(t['trace'] for t in st)
    [hist] = [d for d in (out / 'code_base' / 'history').iterdir() if d.name.startswith('r0000')]
    rt = [json.loads(l) for l in (hist / 'matrix_results_Qwen3-4B' / 'syn_trace_new_api.jsonl').read_text().splitlines()]
    assert rt and all([s['event'] for s in t['controller_trace']] == ['start', 'finish'] for t in rt)
    assert all(t['controller_trace'][-1]['answer'] == t['final_answer'] for t in rt) and {t['seed'] for t in rt} == {0}
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['traces_cover'].startswith('branch order 0 of 2') and 'numpy and scipy' in summary['libraries']
    ctx = RoundContext(cfg, out, None, None, [], None)
    ws = make_workspace(ctx, 1)
    task = (ws / 'PROMPT.md').read_text()
    assert 'syn_trace_new_api.jsonl' not in task and '<dataset>_trace_new_api.jsonl beside it: their per-step traces' in task
    assert (ws / 'code_base' / 'history' / 'seed_algorithms' / 'matrix_results_Qwen3-4B' / 'syn_trace_new_api.jsonl').exists()
    assert 'branch order (seed) 0 of the run\'s 2' in task and 'controller_trace' in task
    assert 'the Python standard library, numpy and scipy' in ENVIRONMENT_API and 'TracedMethod' in task


def test_the_published_round0_cell_is_set_beside_ours_with_what_was_checked():
    "Round 0, Qwen3-4B, β 0.8: ours 67,746.27 against the published 67,760 carries its explanation; a truncation is a match."
    import pandas as pd
    from tmas_nb.autotts.history import compare_curves
    theirs = pd.DataFrame(dict(round=0, store=['Qwen3-4B:aime24', 'Qwen3-4B:aime24', 'Qwen3-8B:aime24'], beta=[0.8, 0.9, 0.4],
                               acc=[36.87, 37.1, 20.0], avg_tokens=[67760.0, 76565.0, 24214.0]))
    ours = theirs.assign(avg_tokens=[67746.2663, 76565.4, 24214.9987], split='search', error=None)
    m = compare_curves(ours, theirs)
    assert m.matches.tolist() == [False, True, True]          # sorted by store, then beta: 4B 0.8, 4B 0.9, 8B 0.4
    assert 'gives ours for the archived round-0 method.py' in m.note[0] and m.note[1] == m.note[2] == ''
