"""The papers' protocols: per-role sampling, RSE trajectory distillation, incremental de-duplication, the experience
agent's empty reply, majority vote by equivalence, early stop without survivorship bias, the paradox sign, presets and
problem-id lists."""
import argparse
import asyncio
import json

import pandas as pd
import pytest

from tmas_nb.methods.agents import AgentContext, SamplingConfig, distill, update_experience
from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.llm.core import Completion
from tmas_nb.methods.memory import ExperienceBank, HashingEmbedder, RSEBank
from tmas_nb.methods.rse import RSEConfig
from tmas_nb.methods.tmas import TMASConfig
from tmas_nb.methods.baselines import majority_answer
from tmas_nb.methods.solve import run_method

from helpers import ScriptedLLM


REPLIES = {
    'solution': '<think>First I tried adding, a dead end.</think>So the answer is \\boxed{42}.',
    'verification': 'Score: \\boxed{1}', 'summary': 'It multiplies.',
    'experience': '{"verified_anchors": ["6 times 7 is 42"], "error_avoidance_heuristics": []}',
    'guideline': '{"updated_guidelines": ["multiply"]}',
    'distillation': '{"verified_propositions": ["6 times 7 is 42"], "critical_pitfalls": []}',
}


# ------------------------------------------------------------------ sampling settings, defined once, per role

def test_tmas_roles_sample_as_the_paper_states(tmp_path):
    llm = ScriptedLLM(REPLIES)
    cfg = TMASConfig(n_candidates=2, n_verifications=2, iterations=2, embedder='hashing', max_new_tokens=16)
    asyncio.run(run_method('tmas', demo_problems()[:1], llm, cfg, tmp_path, progress=False))
    temps = {r.role: (r.temperature, r.top_p) for r in llm.requests}
    assert temps == {'solution': (1.0, 0.95), 'verification': (1.0, 0.95), 'summary': (0.6, 0.95),
                     'experience': (0.6, 0.95), 'guideline': (0.6, 0.95)}


def test_a_role_is_overridden_in_the_config(tmp_path):
    cfg = TMASConfig.from_dict({'role_sampling': {'verification': {'temperature': 0.3, 'top_k': 20}}})
    s = cfg.sampling()
    assert isinstance(s, SamplingConfig)
    r = s.request([{'role': 'user', 'content': 'x'}], 'verification', 'p', 0, 0)
    assert (r.temperature, r.top_k, r.top_p) == (0.3, 20, 0.95)
    assert s.request([{'role': 'user', 'content': 'x'}], 'summary', 'p', 0, 0).temperature == 0.6
    with pytest.raises(ValueError, match='role_sampling'):
        TMASConfig.from_dict({'role_sampling': {'verification': {'temprature': 0.3}}})


# ------------------------------------------------------------------ RSE distils the whole trajectory

def test_rse_distillation_sees_the_reasoning_and_keeps_the_end_of_long_reasoning():
    llm = ScriptedLLM(REPLIES)
    s = SamplingConfig()
    c = Completion.from_raw('<think>' + 'filler ' * 2000 + 'Adding 6 and 7 was a dead end.</think>The answer is \\boxed{42}.')
    asyncio.run(distill(llm, AgentContext(s, 'p', 'What is 6*7?', 0), c, None, 0, max_chars=3000))
    prompt = llm.requests[-1].messages[-1]['content']
    assert 'Adding 6 and 7 was a dead end.' in prompt and 'The answer is' in prompt
    assert prompt.count('filler') < 600


# ------------------------------------------------------------------ incremental de-duplication

def test_rse_bank_never_shrinks_and_admitted_items_stay():
    b = RSEBank(embedder=HashingEmbedder())
    b.update(['the sum of the roots is 4'], ['do not divide by zero'], round=0)
    first = b.texts('propositions') + b.texts('pitfalls')
    sizes = [len(b)]
    b.update(['The sum of the roots is 4, by Vieta', 'the product of the roots is 3'], ['do not divide by zero here'], round=1)
    sizes.append(len(b))
    assert all(t in b.texts('propositions') + b.texts('pitfalls') for t in first)
    assert sizes == sorted(sizes)
    assert b.texts('propositions')[0] == 'the sum of the roots is 4'


# ------------------------------------------------------------------ experience agent's empty reply

def test_an_empty_experience_reply_keeps_the_previous_bank():
    bank = ExperienceBank(embedder=HashingEmbedder())
    bank.update(['x = 2 works'], ['check x = 0'], round=0)
    llm = ScriptedLLM({**REPLIES, 'experience': '{"verified_anchors": [], "error_avoidance_heuristics": []}'})
    u = asyncio.run(update_experience(llm, AgentContext(SamplingConfig(), 'p', 'q', 1), [], bank))
    assert bank.texts('anchors') == ['x = 2 works'] and bank.texts('heuristics') == ['check x = 0']
    assert u.added == 0


# ------------------------------------------------------------------ majority vote by equivalence

def test_majority_vote_clusters_equivalent_answers():
    texts = ['\\boxed{1/2}', '\\boxed{\\frac12}', '\\boxed{0.5}', '\\boxed{3}', '\\boxed{3}']
    i, ans = majority_answer(texts)
    assert i == 0


# ------------------------------------------------------------------ early stop without survivorship bias

def _records(rows):
    return pd.DataFrame([dict(problem_id=p, iteration=i, candidate=k, correct=c, mean_score=None) for p, i, k, c in rows])


def test_a_problem_that_stopped_early_keeps_counting():
    from tmas_nb.runs.folder import pass_at_1_by_iteration
    rec = _records([('a', 0, 0, True), ('b', 0, 0, False), ('b', 1, 0, False), ('b', 2, 0, False)])
    curve = pass_at_1_by_iteration(rec)
    assert list(curve.pass_at_1) == [0.5, 0.5, 0.5]
    from tmas_nb.runs.folder import pass_at_1_by_iteration as run_curve
    assert run_curve is pass_at_1_by_iteration      # one Pass@1 for the reports and `tmas runs summary`
    assert list(curve.carried_problems) == [0, 1, 1]


# ------------------------------------------------------------------ the paradox's sign

def test_paradox_delta_is_never_minus_ever():
    from tmas_nb.analysis.tables import verification_paradox
    rec = pd.DataFrame([dict(problem_id=p, iteration=0, candidate=0, correct=c, mean_score=s)
                        for p, c, s in [('a', True, 0.2), ('b', True, 0.4), ('c', False, 0.9), ('d', False, 0.7)]])
    row = verification_paradox(rec).iloc[-1]
    assert row.delta == pytest.approx(0.8 - 0.3)


# ------------------------------------------------------------------ presets and problem-id lists

def _print_config(*argv):
    "The JSON `tmas run ... --print-config` prints, and its stderr."
    import contextlib, io
    from tmas_nb.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(['run', '--benchmark', 'demo', '--limit', '1', *argv, '--print-config']) == 0, err.getvalue()
    return json.loads(out.getvalue()), err.getvalue()


# The papers' comparison settings, written out here from the papers (not read from tmas_nb.presets), one cell per value.
_T = dict(temperature=1.0, top_p=0.95, max_new_tokens=128_000)            # TMAS §4 inference config
_R = dict(temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=38_912)   # RSE App. B.1 Qwen3-Thinking row, run.sh
_ROLES = {'summary': {'temperature': 0.6}, 'experience': {'temperature': 0.6}, 'guideline': {'temperature': 0.6}}
_CUT = dict(answer_from_truncated='release')
PAPERS = {
    'tmas-paper': {
        'tmas': dict(n_candidates=8, n_verifications=8, iterations=20, epsilon=0.2, role_sampling=_ROLES, embedder='jaccard',
                     dedup_threshold=0.7, summary_words=None, guideline_update='append', **_T),   # the release: Jaccard at 0.7, no word cap
        'mv': dict(n_candidates=64, **_T), 'self-refine': dict(n_candidates=8, iterations=20, **_T),
        'verify-refine': dict(n_candidates=8, iterations=20, n_verifications=1, refine_verified=False, **_T),
        'pacore': dict(n_candidates=8, iterations=20, **_T),
        'rse': dict(n_candidates=8, iterations=20, embedder='minilm', dedup_threshold=0.8, memory_retries=5, **_R),   # RSE's official code and row
        'sampling': dict(n_candidates=8, iterations=1, **_T)},
    'rse-paper': {   # every method graded as RSE's release grades a cut rollout
        'rse': dict(n_candidates=32, iterations=4, dedup_threshold=0.8, embedder='minilm', memory_retries=5, **_R, **_CUT),
        'mv': dict(n_candidates=128, **_R, **_CUT), 'sampling': dict(n_candidates=1024, iterations=1, **_R, **_CUT),
        'self-refine': dict(n_candidates=32, iterations=4, **_R, **_CUT),
        'pacore': dict(n_candidates=32, iterations=4, max_references=32, **_R, **_CUT),
        'tmas': dict(n_candidates=32, iterations=4, frame=None, **_R, **_CUT),
        'verify-refine': dict(n_candidates=32, iterations=4, frame=None, **_R, **_CUT)},
}
CELLS = [pytest.param(p, m, k, v, id=f'{p}-{m}-{k}') for p, ms in PAPERS.items() for m, d in ms.items() for k, v in d.items()]
# The values the papers leave open: each preset fixes one, marked assumed with its reason.
ASSUMED = {('tmas-paper', 'verify-refine', 'n_verifications'), ('tmas-paper', 'verify-refine', 'refine_verified'),
           ('tmas-paper', 'rse', 'n_candidates'), ('tmas-paper', 'rse', 'embedder'), ('tmas-paper', 'rse', 'dedup_threshold'),
           *(('tmas-paper', 'rse', k) for k in ('temperature', 'top_p', 'top_k', 'max_new_tokens')), ('tmas-paper', 'rse', 'memory_retries'),
           *(('rse-paper', m, 'answer_from_truncated') for m in ('mv', 'sampling', 'self-refine', 'pacore', 'tmas', 'verify-refine')),
           ('tmas-paper', 'tmas', 'epsilon (use_guidelines: false)')}   # the arm without guidelines: not a value a preset applies


def test_the_preset_table_has_exactly_these_cells():
    from tmas_nb.presets import preset_table
    t = preset_table('Qwen3-30B-A3B-Thinking-2507')
    arm = [('tmas-paper', 'tmas', 'epsilon (use_guidelines: false)')]
    assert sorted(zip(t.preset, t.method, t.setting)) == sorted([(p, m, k) for p, ms in PAPERS.items() for m, d in ms.items() for k in d] + arm)
    assert (t.source.str.len() > 10).all()
    assert {(p, m, k) for p, m, k, a in zip(t.preset, t.method, t.setting, t.assumed) if a} == ASSUMED


@pytest.mark.parametrize('preset,method,setting,value', CELLS)
def test_print_config_gives_each_preset_cell(preset, method, setting, value):
    "One test per cell of the preset table: `--print-config` resolves the paper's value and cites its source."
    c, err = _print_config('--method', method, '--preset', preset, '--model', 'Qwen3-30B-A3B-Thinking-2507', '--backend', 'openai')
    assert c['preset'] == preset
    if setting == 'role_sampling':
        for role, over in value.items(): assert c['sampling_by_role'][role]['temperature'] == over['temperature']
        assert c['sampling_by_role']['solution']['temperature'] == 1.0
    elif setting == 'frame':
        assert value is None and any('same multi-round frame' in n for n in c['preset_notes'])
    else:
        assert c['config'][setting] == value and len(c['preset_sources'][setting]) > 10


@pytest.mark.parametrize('model,row', [('Qwen3-4B-Thinking-2507', (0.6, 0.95, 20, 38_912)),
                                       ('Qwen3-4B-Instruct-2507', (0.7, 0.8, 20, 38_912)),
                                       ('microsoft/Phi-4-reasoning', (0.8, 0.95, 50, 32_768)),
                                       ('deepseek-v3.2', (1.0, 0.95, None, 65_536)),
                                       ('some-other-model', (0.6, 0.95, 20, 38_912))])
def test_rse_sampling_row_follows_the_model(model, row):
    c, err = _print_config('--method', 'rse', '--preset', 'rse-paper', '--model', model, '--backend', 'openai')
    got = c['config']
    assert (got['temperature'], got['top_p'], got['top_k'], got['max_new_tokens']) == row
    unknown = [n for n in c['preset_notes'] if 'gives no sampling' in n]
    assert (len(unknown) == 1) == (model == 'some-other-model')
    if unknown: assert unknown[0] in err and 'Qwen3-Thinking row' in unknown[0]


def test_paper_preset_is_the_methods_own_and_asks_for_a_baseline(capsys):
    from tmas_nb.cli import main
    c, _ = _print_config('--method', 'tmas', '--preset', 'paper', '--backend', 'openai')
    assert (c['config']['n_candidates'], c['config']['iterations'], c['config']['epsilon']) == (8, 20, 0.2)
    assert c['protocol']['grading']['value'] == 'LLM judge DeepSeek-V3.2, mean of 4 runs'
    c, _ = _print_config('--method', 'rse', '--preset', 'paper', '--backend', 'openai')
    assert (c['config']['n_candidates'], c['config']['max_new_tokens'], c['protocol']['independent_runs']['value']) == (32, 38_912, 8)
    assert c['protocol']['grading']['value'] == 'rule-based answer check'
    assert main(['run', '--method', 'pacore', '--benchmark', 'demo', '--preset', 'paper', '--print-config']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'tmas-paper' in err[0] and 'rse-paper' in err[0]


def test_flags_and_config_layer_over_the_preset(tmp_path):
    f = tmp_path / 'c.json'
    f.write_text(json.dumps({'iterations': 2, 'top_k': 5, 'role_endpoints': {'verification': 'http://127.0.0.1:9/v1'}}))
    c, _ = _print_config('--method', 'tmas', '--preset', 'tmas-paper', '--config', str(f), '--top-k', '7', '--backend', 'openai')
    assert (c['config']['n_candidates'], c['config']['iterations'], c['config']['top_k']) == (8, 2, 7)
    assert c['role_endpoints'] == {'verification': {'base_url': 'http://127.0.0.1:9/v1', 'model': None}}
    c, err = _print_config('--method', 'tmas', '--preset', 'tmas-paper')   # the packaged model's context caps 128K
    assert c['config']['max_new_tokens'] < 128_000 and 'capped' in err


def test_print_config_is_what_config_json_records(tmp_path):
    "The JSON of --print-config and the config.json the same command writes agree (but for when it started)."
    from tmas_nb.cli import build_parser
    from tmas_nb.runs.start import plan_run, start_run
    from helpers import REPLIES, ScriptedLLM
    argv = ['run', '--method', 'rse', '--benchmark', 'demo', '--limit', '1', '--preset', 'cpu-demo', '--iterations', '2',
            '--backend', 'transformers']
    printed, _ = _print_config(*argv[1:])
    plan = plan_run(build_parser().parse_args(argv + ['--quiet']))
    run = asyncio.run(start_run(plan.method, plan.problems, plan.config, tmp_path / 'r', model='default', backend='transformers',
                                llm=ScriptedLLM(REPLIES), options=plan.options))
    written = json.loads((tmp_path / 'r' / 'config.json').read_text())
    assert {k: v for k, v in written.items() if k not in ('started', 'quantize')} == printed
    assert run.complete


def test_run_help_prints_the_presets():
    from tmas_nb.cli import build_parser
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices['run'].format_help()
    assert '--preset' in text and 'paper' in text and 'cpu-demo' in text and 'N=8' in text


def test_problem_id_list_selects_problems(tmp_path):
    from tmas_nb.data.benchmarks import read_problem_ids, select_problems, write_problem_ids
    f = write_problem_ids(tmp_path / 'ids.txt', ['demo-03', 'demo-01'], {'seed': 7})
    assert read_problem_ids(f) == ['demo-03', 'demo-01']
    assert [p.id for p in select_problems(demo_problems(), read_problem_ids(f))] == ['demo-01', 'demo-03']
    with pytest.raises(ValueError, match='demo-99'):
        select_problems(demo_problems(), ['demo-99'])


# ------------------------------------------------------------------ RSE: the whole trajectory, and the ablations as settings

def test_rse_distils_a_trajectory_longer_than_the_packaged_models_context():
    "Every part of a ~60K-token trajectory reaches the distiller, in order, each prompt within the packaged model's context."
    from transformers import AutoTokenizer
    from tmas_nb.llm.models import resolve_model
    from tmas_nb.runs.protocol import model_context_length
    from tmas_nb.methods.rse import distill_whole
    context = model_context_length('default')
    tok = AutoTokenizer.from_pretrained(resolve_model('default'))
    reasoning = ''.join(f'line {i}: the running total is now {7 * i} after adding seven.\n' for i in range(3200))
    long = Completion.from_raw('<think>' + reasoning + '</think>So the answer is \\boxed{42}.')
    assert len(tok(long.raw)['input_ids']) > context
    seen = []
    def distiller(req, k):
        seen.append(req.messages[-1]['content'])
        return json.dumps({'verified_propositions': [f'fact from part {k + 1}'], 'critical_pitfalls': []})
    llm = ScriptedLLM({**REPLIES, 'distillation': distiller})
    cfg = RSEConfig(n_candidates=1, iterations=2, embedder='hashing', max_new_tokens=1024, distill_context=context)
    u = asyncio.run(distill_whole(llm, AgentContext(cfg.sampling(), 'p', 'Add sevens.', 0), long, 0, cfg))
    assert len(seen) > 1 and u.ok and u.parts == len(seen)
    assert 'line 0:' in seen[0] and 'line 3199:' in seen[-1] and '\\boxed{42}' in seen[-1]
    firsts = [int(p.split('line ', 1)[1].split(':')[0]) for p in seen]   # the first line of each part
    assert firsts == sorted(firsts)
    for p in seen: assert len(tok(p)['input_ids']) + 1024 <= context
    assert u.answer['verified_propositions'] == [f'fact from part {i}' for i in range(1, len(seen) + 1)]
    bank = RSEBank(embedder=HashingEmbedder())
    from tmas_nb.methods.agents import apply_distillation
    assert apply_distillation(bank, u.answer, 'both', 0) >= 1


def _round1_system(tmp_path, name, validator=None, **kw):
    "The system prompt of RSE's second round after one round whose rollouts distil into near-duplicates."
    items = [['the sum of the roots is 4', 'the product of the roots is 3'],
             ['the sum of the two roots is 4', 'the product of both roots is 3'], ['the sum of roots is 4']]
    reply = lambda req, k: json.dumps({'verified_propositions': items[k % 3], 'critical_pitfalls': ['do not divide by zero']})
    llm = ScriptedLLM({'solution': '\\boxed{42}', 'distillation': reply, **({'validation': validator} if validator else {})})
    cfg = RSEConfig(n_candidates=3, iterations=2, embedder='hashing', max_new_tokens=16, **kw)
    asyncio.run(run_method('rse', demo_problems()[:1], llm, cfg, tmp_path / name, progress=False))
    rec = json.loads(next((tmp_path / name / 'checkpoints').rglob('iter_1.json')).read_text())
    return llm.by_role('solution')[-1].messages[0]['content'], rec['state']['prompt_items']


def test_rse_ablations_are_settings(tmp_path):
    sem, n_sem = _round1_system(tmp_path, 'semantic')
    rnd, n_rnd = _round1_system(tmp_path, 'random', dedup='random')
    raw, n_raw = _round1_system(tmp_path, 'none', dedup='none')
    assert n_rnd == n_sem and n_raw['propositions'] == 5 and n_raw['pitfalls'] == 3 and n_sem['propositions'] < 5
    assert raw.count('do not divide by zero') == 3 and sem.count('do not divide by zero') == 1
    capped, n_cap = _round1_system(tmp_path, 'cap', dedup='none', max_positive=2, max_negative=1)
    assert n_cap == {'propositions': 2, 'pitfalls': 1}
    whole, n_whole = _round1_system(tmp_path, 'whole', dedup='none', max_items=3)      # Table 10: the whole bank
    assert sum(n_whole.values()) == 3
    judge = lambda req, k: 'INVALID' if 'divide' in req.messages[-1]['content'].split('Item:')[1] else 'VALID'
    noisy, n_noisy = _round1_system(tmp_path, 'noise', judge, validate_items=True, noise=0.5)   # Table 9: judged items
    assert sum(n_noisy.values()) == sum(n_sem.values()) and 'do not divide by zero' in noisy   # the capacity holds


def test_the_summary_line_says_how_the_numbers_were_graded():
    from types import SimpleNamespace
    from tmas_nb.runs.protocol import layer_settings
    from tmas_nb.runs.start import summary_line
    s = {'problems': 2, 'iterations': [{'iteration': 0, 'pass_at_1': 0.5}]}
    for preset, expected in [('tmas-paper', 'rule-graded (the paper: LLM judge DeepSeek-V3.2, mean of 4 runs; grade as the paper: '
                                            'tmas judge RUN_DIR --judge URL_OR_MODEL --repeats 4)'),
                             ('rse-paper', 'rule-graded, as the paper;')]:
        _, rec = layer_settings('tmas' if preset == 'tmas-paper' else 'rse', preset, backend='openai')
        run = SimpleNamespace(method='x', run_dir='r', status={}, config={'protocol': rec['protocol']})
        assert expected in summary_line(s, run)
    judged = summary_line({**s, 'grading': 'LLM judge m, mean of 4 runs'}, SimpleNamespace(method='x', run_dir='r', status={}, config={'protocol': rec['protocol']}))
    assert 'LLM judge m, mean of 4 runs;' in judged and 'grade as the paper' not in judged
