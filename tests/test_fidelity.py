"""A paper run is the paper's run: the TMAS protocol (hard subset, de-duplication, the ablation arm, runs without a
preset, the summary cap, baseline budgets), Hybrid-RL (the batch, the novelty judge) and RSE (served distillation
context, independent runs, Phi-4's adaptations). Each test fails on the code before these changes."""
import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pandas as pd
import pytest

from tmas_nb.cli import main
from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.llm.core import Completion
from tmas_nb.methods.solve import run_method

from helpers import REPLIES, ScriptedLLM

REPO = Path(__file__).resolve().parents[1]


def _cli(*argv):
    "(exit code, stdout, stderr) of `tmas ARGV`, in process."
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err): rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _config(*argv):
    "The config.json `tmas run ... --print-config` prints, and its stderr lines."
    rc, out, err = _cli('run', '--benchmark', 'demo', '--limit', '1', *argv, '--print-config')
    assert rc == 0, err
    return json.loads(out), [l for l in err.splitlines() if l.strip()]


# ------------------------------------------------------------------ IMO-AnswerBench-50: budget, cut share, judge

HARD = ['data', 'hard-subset', '--benchmark', 'demo', '--model', 'smollm2', '--threads', '1', '--quiet']
RULES = ['--rules']      # the judge is the default grading; these tests of the budget and the cut share grade by rule


def test_hard_subset_defaults_to_the_models_full_budget(tmp_path):
    "Without --max-new-tokens the reference model gets TMAS's 128K capped to its context (was: 4,096 for every model)."
    from tmas_nb.runs.hard_subset import full_budget
    assert full_budget('default', 'transformers')[0] == 32_768 - 4096          # Qwen2.5-Coder-0.5B: a 32K context
    n, why = full_budget('smollm2', 'transformers')                           # smollm2: 8K context, half kept for the prompt
    assert n == 4096 and why.startswith("TMAS's budget of 128000 tokens capped to the model's context of 8192")


def test_hard_subset_refuses_a_subset_of_cut_samples_unless_forced(tmp_path):
    out = tmp_path / 'ids.txt'
    argv = [*HARD, *RULES, '--limit', '2', '--samples', '2', '--k', '1', '--max-new-tokens', '4', '--out', str(out)]
    rc, _, err = _cli(*argv)
    lines = [l for l in err.strip().splitlines() if not l.startswith('Loading weights')]   # transformers' own bar aside
    assert rc == 2 and len(lines) == 1 and lines[0].startswith('tmas: error: 4 of 4 samples (100.0%) cut by the token limit of 4')
    assert '--allow-cut' in lines[0] and not out.exists()
    counts = json.loads((tmp_path / 'ids.txt.counts.json').read_text())
    assert counts['cut'] == {'demo-01': 2, 'demo-02': 2} and counts['cut_share'] == 1.0
    assert counts['samples'] == 2 and set(counts['solved']) == {'demo-01', 'demo-02'}   # per-problem rates: solved / samples
    rc, _, err = _cli(*argv, '--allow-cut')                                    # the samples come from the call cache
    assert rc == 0, err
    text = out.read_text()
    assert '# allow_cut: written with --allow-cut although 100.0% of the samples were cut (above 5%)' in text
    assert '# cut_share: 1.0' in text and '# grading: rule-based answer check (--rules' in text


def test_hard_subset_grades_through_the_judge(tmp_path):
    "With --judge every uncut sample goes to the LLM judge (its own call cache beside the list); the file says so."
    out = tmp_path / 'ids.txt'
    rc, _, err = _cli(*HARD, '--limit', '1', '--samples', '2', '--k', '1', '--max-new-tokens', '48', '--allow-cut',
                      '--judge', 'smollm2', '--out', str(out))
    assert rc == 0, err
    assert '# grading: LLM judge smollm2' in out.read_text()
    counts = json.loads((tmp_path / 'ids.txt.counts.json').read_text())
    uncut = 2 - counts['cut']['demo-01']
    import sqlite3
    judged = sqlite3.connect(tmp_path / 'ids.txt.judge.sqlite').execute('select count(*) from completions').fetchone()[0]
    assert uncut >= 1 and judged == uncut                             # one judge call per uncut sample (seed 0: one of the two)


# ------------------------------------------------------------------ de-duplication, the ablation arm, the summary cap

def _tmas_run(tmp_path, name, *argv):
    "A TMAS run of one demo problem with the settings `tmas run ARGV` resolves, on a scripted model; (config, requests, run folder)."
    from tmas_nb.cli import build_parser
    from tmas_nb.runs.start import plan_run, start_run
    plan = plan_run(build_parser().parse_args(['run', '--method', 'tmas', '--benchmark', 'demo', '--limit', '1', '--backend',
                                               'openai', '--n-candidates', '4', '--n-verifications', '1', '--iterations', '3',
                                               '--max-new-tokens', '32', *argv, '--quiet']))
    llm = ScriptedLLM(REPLIES)
    asyncio.run(start_run('tmas', plan.problems, plan.config, tmp_path / name, llm=llm, options=plan.options))
    return json.loads((tmp_path / name / 'config.json').read_text()), llm.requests, tmp_path / name


def test_tmas_paper_deduplicates_by_word_set_jaccard_and_records_it(tmp_path):
    cfg, _, d = _tmas_run(tmp_path, 'paper', '--preset', 'tmas-paper')
    assert (cfg['config']['embedder'], cfg['config']['dedup_threshold']) == ('jaccard', 0.7)
    banks = [json.loads(f.read_text()) for f in (d / 'banks').rglob('*.json')]
    assert banks and {b['similarity'] for b in banks} == {'jaccard'}
    cfg, _, d = _tmas_run(tmp_path, 'minilm', '--preset', 'tmas-paper', '--config', str(_write(tmp_path, {'embedder': 'hashing'})))
    assert {json.loads(f.read_text())['similarity'] for f in (d / 'banks').rglob('*.json')} == {'cosine:hashing'}


def _write(tmp_path, d, name='c.json'):
    (tmp_path / name).write_text(json.dumps(d))
    return tmp_path / name


def test_the_arm_without_guidelines_has_no_explore_branch_and_the_old_arm_is_a_named_variant(tmp_path):
    no_guide = _write(tmp_path, {'use_guidelines': False})
    cfg, _, d = _tmas_run(tmp_path, 'arm', '--preset', 'tmas-paper', '--config', str(no_guide), '--n-candidates', '16')
    branches = set(pd.read_parquet(d / 'records.parquet').branch)
    assert cfg['config']['epsilon'] == 0.0 and branches == {'exploit'}
    assert cfg['protocol']['arm']['value'] == '−guideline' and 'no explore branch' in cfg['protocol']['arm']['source']
    cfg, _, d = _tmas_run(tmp_path, 'variant', '--preset', 'tmas-paper', '--config', str(no_guide), '--n-candidates', '16', '--epsilon', '0.2')
    assert 'explore' in set(pd.read_parquet(d / 'records.parquet').branch)
    assert cfg['protocol']['arm']['value'] == '−guideline (fresh explore, ε=0.2)'


def test_the_summary_agent_has_no_word_cap_under_tmas_paper(tmp_path):
    _, reqs, _ = _tmas_run(tmp_path, 'paper', '--preset', 'tmas-paper')
    summaries = [r.messages[-1]['content'] for r in reqs if r.role == 'summary']
    assert summaries and not any('at most' in s for s in summaries)
    _, reqs, _ = _tmas_run(tmp_path, 'capped', '--preset', 'tmas-paper', '--config', str(_write(tmp_path, {'summary_words': 200})))
    assert all('Use at most 200 words.' in r.messages[-1]['content'] for r in reqs if r.role == 'summary')


def test_a_run_without_a_preset_that_looks_like_a_paper_run_says_so_in_one_line():
    c, err = _config('--method', 'tmas', '--model', 'default', '--backend', 'transformers')
    assert c['protocol']['name']['value'] == 'custom' and len(err) == 1
    assert err[0].startswith('no --preset: this run has the structure of --preset tmas-paper but differs in max_new_tokens 4096 '
                             '(the paper: 28672), embedder minilm (the paper: jaccard), summary_words 200 (the paper: none)')
    c, err = _config('--method', 'tmas', '--preset', 'tmas-paper', '--model', 'default', '--backend', 'transformers')
    assert c['protocol']['name']['value'] == 'tmas-paper' and not any(l.startswith('no --preset') for l in err)
    c, err = _config('--method', 'tmas', '--n-candidates', '2', '--backend', 'openai')   # not a paper's shape: no line
    assert c['protocol']['name']['value'] == 'custom' and err == []


# ------------------------------------------------------------------ baseline budgets the papers leave open

def test_verify_refine_keeps_a_candidate_every_review_scored_one_under_tmas_paper(tmp_path):
    from tmas_nb.runs.protocol import layer_settings
    cfg, rec = layer_settings('verify-refine', 'tmas-paper', flags={'n_candidates': 2, 'iterations': 3, 'max_new_tokens': 32}, backend='openai')
    assert sorted(rec['protocol']['assumed']['value']) == ['n_verifications', 'refine_verified']
    llm = ScriptedLLM(REPLIES)                                        # every review says Score 1
    recs = asyncio.run(run_method('verify-refine', demo_problems()[:1], llm, cfg, tmp_path / 'vr', progress=False))
    assert list(recs.branch) == ['sample'] * 2 + ['kept'] * 4 and not llm.by_role('refine')
    assert len(llm.by_role('verification')) == 2                      # reviewed once, at iteration 0


def test_rse_under_tmas_paper_samples_with_its_own_row_unless_told():
    c, _ = _config('--method', 'rse', '--preset', 'tmas-paper', '--model', 'Qwen3-4B-Thinking-2507', '--backend', 'openai')
    assert (c['config']['temperature'], c['config']['top_k'], c['config']['max_new_tokens'], c['config']['n_candidates']) == (0.6, 20, 38_912, 8)
    assert c['protocol']['rse_sampling']['value'] == 'rse' and 'temperature' in c['protocol']['assumed']['value']
    c, _ = _config('--method', 'rse', '--preset', 'tmas-paper', '--model', 'Qwen3-4B-Thinking-2507', '--backend', 'openai',
                   '--rse-sampling', 'tmas')
    assert (c['config']['temperature'], c['config']['top_p'], c['config']['max_new_tokens']) == (1.0, 0.95, 128_000)
    rc, _, err = _cli('run', '--method', 'pacore', '--benchmark', 'demo', '--preset', 'tmas-paper', '--rse-sampling', 'tmas', '--print-config')
    assert rc == 2 and '--rse-sampling applies to --method rse' in err


# ------------------------------------------------------------------ Phi-4-reasoning's row

def test_a_phi4_backbone_gets_no_system_turn_and_pacore_fits_its_window(tmp_path):
    c, _ = _config('--method', 'pacore', '--preset', 'rse-paper', '--model', 'microsoft/Phi-4-reasoning', '--backend', 'openai')
    assert (c['config']['system_in_user'], c['config']['reference_max_tokens'], c['config']['prompt_max_tokens']) == (True, 4096, 20_480)
    assert 'Appendix B.2' in c['preset_sources']['system_in_user']
    c, _ = _config('--method', 'rse', '--model', 'Qwen3-4B-Thinking-2507', '--backend', 'openai')
    assert c['config']['system_in_user'] is False
    from tmas_nb.methods.loop import BaselineConfig
    from tmas_nb.methods.rse import estimate_tokens
    cfg = BaselineConfig(n_candidates=2, iterations=2, max_new_tokens=16, system_in_user=True, reference_max_tokens=300,
                         prompt_max_tokens=700)
    long = 'so the sum is ' + 'seven ' * 2000 + '\\boxed{42}'
    llm = ScriptedLLM({'solution': long, 'refine': long})
    asyncio.run(run_method('pacore', demo_problems()[:1], llm, cfg, tmp_path / 'p', progress=False))
    assert all(m['role'] != 'system' for r in llm.requests for m in r.messages)
    last = llm.requests[-1].messages
    assert last[0]['content'].startswith('You are an expert') and estimate_tokens(last[0]['content']) <= 700


# ------------------------------------------------------------------ RSE: the served context, parts per trajectory

def test_rse_distils_through_a_real_server_with_the_context_it_serves(tmp_path):
    from test_llm_server import Server, free_port
    from tmas_nb.methods.agents import AgentContext
    from tmas_nb.llm.loading import load_llm
    from tmas_nb.llm.openai_backend import served_context_length
    from tmas_nb.methods.rse import distill_whole
    from tmas_nb.runs.protocol import layer_settings
    srv = Server(free_port(), tmp_path, flags=('--max-model-len', '2048'))   # the smallest served context RSE takes: a short trajectory overflows it
    try:
        srv.wait_ready()
        assert httpx.get(srv.url + '/models').json()['data'][0]['max_model_len'] == 2048      # as vLLM reports it
        assert served_context_length(srv.url) == (2048, 'max_model_len of GET /v1/models')
        cfg, rec = layer_settings('rse', flags={'n_candidates': 1, 'iterations': 2, 'max_new_tokens': 8, 'memory_retries': 0}, model='smollm2',
                                  backend='openai', base_url=srv.url)
        assert (cfg.distill_context, rec['distill_context_source']) == (2048, 'max_model_len of GET /v1/models')
        # about 2.8K tokens of reasoning: more than the 2K the server holds, far less than the 32K assumed without asking it
        reasoning = ''.join(f'step {i}: the partial sum is now {3 * i} and we add three again.\n' for i in range(140))
        long = Completion.from_raw('<think>' + reasoning + '</think>So the answer is \\boxed{420}.')
        llm = load_llm('smollm2', 'openai', base_url=srv.url)
        u = asyncio.run(distill_whole(llm, AgentContext(cfg.sampling(), 'p', 'Add threes.', 0), long, 0, cfg))
        assert u.parts >= 2 and u.attempts >= u.parts          # every part was answered: none over the served context
        served = httpx.get(srv.url + '/usage').json()['by_role']['distillation']
        assert served['calls'] >= u.parts
    finally:
        srv.kill()


def test_llama_servers_props_give_the_distillers_context(tmp_path):
    "A loopback stub with llama-server's /props (and a /v1/models without a context)."
    import http.server, threading
    class Stub(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_GET(self):
            body = {'/v1/models': {'data': [{'id': 'm.gguf'}]}, '/props': {'default_generation_settings': {'n_ctx': 16384}}}.get(self.path)
            data = json.dumps(body).encode()
            self.send_response(200 if body else 404); self.send_header('Content-Length', str(len(data))); self.end_headers(); self.wfile.write(data)
    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        from tmas_nb.runs.protocol import layer_settings
        url = f'http://127.0.0.1:{srv.server_address[1]}/v1'
        cfg, rec = layer_settings('rse', model='m.gguf', backend='openai', base_url=url)
        assert (cfg.distill_context, rec['distill_context_source']) == (16384, 'n_ctx of GET /props')
        cfg, rec = layer_settings('rse', backend='openai', flags={'role_endpoints': {'distillation': {'base_url': url, 'model': None}}})
        assert cfg.distill_context == 16384
    finally:
        srv.shutdown(); srv.server_close()


def test_the_run_records_the_parts_of_every_distilled_trajectory(tmp_path):
    from tmas_nb.methods.rse import RSEConfig
    from tmas_nb.runs.summary import distillation_parts, run_facts
    from tmas_nb.runs.folder import load_run
    long = '<think>' + ''.join(f'line {i}: nothing new here.\n' for i in range(900)) + '</think>\\boxed{42}'
    llm = ScriptedLLM({**REPLIES, 'solution': [long, 'short \\boxed{42}']})
    cfg = RSEConfig(n_candidates=2, iterations=2, embedder='hashing', max_new_tokens=16, distill_max_chars=6000)
    from tmas_nb.runs.start import start_run
    run = asyncio.run(start_run('rse', demo_problems()[:1], cfg, tmp_path / 'r', llm=llm, progress=False))
    d = distillation_parts(load_run(tmp_path / 'r'))
    assert list(d.parts) == [d.parts.max(), 1] and d.parts.max() > 1
    assert run_facts(run)['distillation']['whole'] == 1


# ------------------------------------------------------------------ independent runs

def test_runs_k_launches_k_seeds_into_one_folder_and_each_resumes(tmp_path):
    from tmas_nb.cli import build_parser
    from tmas_nb.runs.summary import pass_at_1_by_run
    from tmas_nb.runs.start import plan_run
    assert plan_run(build_parser().parse_args(['run', '--method', 'rse', '--benchmark', 'demo', '--preset', 'rse-paper',
                                               '--backend', 'openai'])).runs == 8
    assert plan_run(build_parser().parse_args(['run', '--method', 'rse', '--benchmark', 'demo', '--backend', 'openai'])).runs == 1
    out = tmp_path / 'runs'
    argv = ['run', '--method', 'sampling', '--benchmark', 'demo', '--limit', '2', '--n-candidates', '2', '--max-new-tokens', '8',
            '--model', 'smollm2', '--backend', 'transformers', '--threads', '1', '--runs', '2', '--quiet', '--out', str(out)]
    rc, _, err = _cli(*argv)
    assert rc == 0, err
    index = json.loads((out / 'runs.json').read_text())
    assert (index['runs'], index['seeds'], index['folders']) == (2, [0, 1], ['run-0', 'run-1'])
    seeds = [json.loads((out / f / 'config.json').read_text())['config']['seed'] for f in index['folders']]
    assert seeds == [0, 1]
    df = pass_at_1_by_run(out)
    assert sorted(set(df.run)) == [0, 1] and list(df.seed.unique()) == [0, 1]
    import shutil
    shutil.rmtree(out / 'run-1' / 'checkpoints' / 'demo-02')           # run 1 lost a problem: the rerun redoes it from its cache
    rc, _, err = _cli(*argv)
    lines = [l for l in err.splitlines() if 'call cache this time' in l]
    import re
    hits = [tuple(map(int, re.search(r'(\d+) hits, (\d+) misses', l).groups())) for l in lines]
    assert rc == 0 and hits[0] == (0, 0) and hits[1][0] > 0 and hits[1][1] == 0, err
    rc, summary, _ = _cli('runs', 'summary', str(out), '--json')
    assert rc == 0 and json.loads(summary)['runs'] == 2


# ------------------------------------------------------------------ Hybrid-RL: the novelty judge

def test_the_novelty_heuristic_is_measured_on_the_labelled_pairs():
    from tmas_nb.rl.rewards import NOVELTY_PAIRS, RolloutNoveltyJudge, novelty_agreement
    judge = {'heuristic': RolloutNoveltyJudge()}                      # MiniLM on the first two sentences, tau 0.7
    before, after = novelty_agreement(judge, cut_rule=False).iloc[0], novelty_agreement(judge).iloc[0]
    cut = [p for p in NOVELTY_PAIRS if p['finish_reason'] == 'length']
    assert after.labelled_new == 14 / 30 and after.pairs == 30
    assert after.judged_new <= before.judged_new and after.seen_called_new <= before.seen_called_new
    assert before.judged_new - after.judged_new <= len(cut) / 30 + 1e-9
    # the example: an induction proof against the guideline "Induction on n" is not new, yet the heuristic calls it new
    induction = NOVELTY_PAIRS[:1]
    assert not induction[0]['novel'] and novelty_agreement(judge, induction).iloc[0].seen_called_new == 1


def test_every_training_step_logs_the_share_judged_novel(tmp_path):
    out = tmp_path / 'train'
    cmd = [sys.executable, '-m', 'tmas_nb.cli', 'rl', 'train', '--model', 'smollm2', '--task', 'toy', '--toy-problems', '2',
           '--objectives', 'novelty', '--reward', 'hybrid', '--max-steps', '1', '--num-generations', '2',
           '--max-completion-length', '4', '--save-steps', '1', '--seed', '0', '--threads', '1', '--quiet', '--out', str(out)]
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'HF_HUB_OFFLINE': '1', 'TQDM_DISABLE': '1'}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    m = pd.read_csv(out / 'metrics.csv')
    assert {'novelty/judged_new', 'novelty/cut'} <= set(m.columns), list(m.columns)
    assert (m['novelty/judged_new'] <= 1 - m['novelty/cut'] + 1e-9).all()     # a cut rollout is never new
