"""A paper run is the paper's run, part 3: RSE and TMAS as their releases grade, prompt and budget them. RSE's cut
rollouts read as its eval/ script reads them, its prompts with every rule of the release and templates from a file,
TMAS's calls fitted to a real served context, the guideline rule and the arm's ε recorded, RSE's rounds de-duplicated
as the release does, its retries and ablations, and the guide's table of assumed values. Each test fails on the code
before these changes."""
import asyncio
import contextlib
import io
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from tmas_nb.cli import main
from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.llm.core import LLM, Completion, Request
from tmas_nb.methods.rse import RSEConfig
from tmas_nb.methods.tmas import TMASConfig
from tmas_nb.methods.solve import run_method

from helpers import REPLIES, ScriptedLLM

REPO = Path(__file__).resolve().parents[1]


def _cli(*argv):
    "(exit code, stdout, stderr) of `tmas ARGV`, in process."
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err): rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


class CutLLM(LLM):
    "Every sample stops at the token limit inside its thinking (a control-flow stand-in: the grading is what is tested)."
    async def _generate(self, requests):
        text = '<think>Six sevens: 6 * 7 = 42. Checking by adding: 7 + 7 + 7 + 7 + 7 + 7 = 42'
        return [[Completion.from_raw(text, finish_reason='length', completion_tokens=20) for _ in range(r.n)] for r in requests]


# ------------------------------------------------------------------ 1. RSE grades a cut rollout as its release does

def test_rse_paper_grades_a_cut_rollout_as_the_release(tmp_path):
    from tmas_nb.runs.protocol import layer_settings
    from tmas_nb.runs.start import start_run
    cfg, rec = layer_settings('sampling', 'rse-paper', flags={'n_candidates': 2}, model='Qwen3-4B-Thinking-2507', backend='openai')
    assert cfg.answer_from_truncated == 'release' and rec['protocol']['cut_outputs']['value'] == 'release'
    from tmas_nb.data.benchmarks import Problem
    problem = Problem('six-sevens', 'What is 6 times 7?', '42', {})
    run = asyncio.run(start_run('sampling', [problem], cfg, tmp_path / 'release', llm=CutLLM('cut'), progress=False, record=rec))
    assert run.records.answer.tolist() == ['42', '42'] and run.records.correct.all()       # its last number
    assert run.config['protocol']['cut_outputs']['value'] == 'release'
    strict, rec = layer_settings('sampling', flags={'n_candidates': 2}, backend='openai')
    run = asyncio.run(start_run('sampling', [problem], strict, tmp_path / 'strict', llm=CutLLM('cut'), progress=False, record=rec))
    assert run.records.answer.isna().all() and not run.records.correct.any()            # without it a cut rollout has no answer
    assert run.config['protocol']['cut_outputs']['value'] == 'none'


# ------------------------------------------------------------------ 2. the RSE prompts, templates from a file, the parser

def test_templates_from_a_file_run_and_are_recorded(tmp_path):
    from tmas_nb.methods.prompts import template_set
    f = tmp_path / 'strict_distiller.json'
    mine = {'rse_distill': 'Distil the attempt {solution} at {question} into JSON with verified_propositions and critical_pitfalls.'}
    f.write_text(json.dumps(mine))
    rc, out, err = _cli('run', '--method', 'rse', '--benchmark', 'demo', '--limit', '1', '--backend', 'openai', '--templates', f, '--print-config')
    assert rc == 0, err
    cfg = json.loads(out)
    assert cfg['config']['templates'] == mine
    assert cfg['protocol']['templates']['value'] == template_set(mine, 'strict_distiller')
    assert cfg['protocol']['templates']['value']['changed'] == ['rse_distill']
    f.write_text('{"rse_distil": "x"}')
    rc, _, err = _cli('run', '--method', 'rse', '--benchmark', 'demo', '--backend', 'openai', '--templates', f, '--print-config')
    assert rc == 2 and err.count('\n') == 1 and 'strict_distiller.json' in err and "unknown prompt template 'rse_distil'" in err


def test_typed_pitfalls_and_source_tags_reach_the_bank(tmp_path):
    reply = json.dumps({'verified_propositions': [{'statement': 'For integers a, b: 6 * 7 = 42', 'source': 'the times table'},
                                                  '<a statement with its conditions> (Source: <how it was obtained>)'],
                        'critical_pitfalls': ['Adding 6 and 7 -> Fatal flaw -> trigger: "six sevens"; added instead of multiplied; 13',
                                              {'step': 'Listing every multiple of 7', 'type': 'Dead end', 'explanation': 'slow, no insight'}]})
    llm = ScriptedLLM({**REPLIES, 'distillation': reply})
    cfg = RSEConfig(n_candidates=1, iterations=2, embedder='hashing', max_new_tokens=16)
    asyncio.run(run_method('rse', demo_problems()[:1], llm, cfg, tmp_path / 'r', progress=False))
    system = llm.by_role('solution')[-1].messages[0]['content']
    assert '- For integers a, b: 6 * 7 = 42 (Source: the times table)' in system and '<a statement' not in system
    assert '- Listing every multiple of 7 -> Dead end -> slow, no insight' in system
    assert 'structural hypothesis' in system and 'Never repeat a pitfall' in system     # the guided search's rules
    distill = llm.by_role('distillation')[0].messages[-1]['content']
    assert 'strictly neutral' in distill and 'Potential risk' in distill and '(Source:' in distill


# ------------------------------------------------------------------ 3. calls fitted to a real served context

@pytest.fixture(scope='module')
def small_server(tmp_path_factory):
    from test_llm_server import Server, free_port
    srv = Server(free_port(), tmp_path_factory.mktemp('serve'), flags=('--max-model-len', '512', '--max-n', '4'))
    srv.wait_ready()
    yield srv
    srv.kill()


def _long_prompt(words: int) -> Request:
    text = ' '.join(f'w{i % 50}' for i in range(words))
    return Request.from_prompt(f'{text}\nRepeat the first word.', max_new_tokens=128_000, temperature=0.0, stop=['\n'], role='solution')


def test_a_call_asks_for_the_room_its_prompt_leaves_in_the_served_context(small_server):
    from tmas_nb.llm.openai_backend import LLMRequestError, OpenAIBackend
    req = _long_prompt(156)                                    # about 465 tokens with SmolLM2's chat template: near the 512 served
    old = OpenAIBackend('smollm2', base_url=small_server.url, fit_context=False)   # the client before: the budget as it is
    with pytest.raises(LLMRequestError) as e: old.generate_sync([req])
    assert e.value.status_code == 400
    b = OpenAIBackend('smollm2', base_url=small_server.url)
    n = asyncio.run(b.prompt_tokens(req))                      # the server's own count, with its chat template
    [[c]] = b.generate_sync([req])
    assert (b.context, c.max_new_tokens, c.context_retry) == (512, 512 - n - 16, False) and 0 < c.max_new_tokens < 64
    assert b.stats['context_fits'] == 1 and b.stats['failures'] == 0
    wrong = OpenAIBackend('smollm2', base_url=small_server.url, context=4096)      # a wrong context: the server's 400 shrinks it
    [[c]] = wrong.generate_sync([req])
    assert c.context_retry and c.max_new_tokens == 512 - n - 16 and wrong.stats['context_retries'] == 1   # the context read again


def test_a_run_records_the_fitted_budget_of_each_call(small_server, tmp_path):
    rc, _, err = _cli('run', '--method', 'sampling', '--benchmark', 'demo', '--limit', '1', '--n-candidates', '1', '--preset',
                      'tmas-paper', '--base-url', small_server.url, '--model', 'smollm2', '--max-n-per-call', '4', '--temperature', '0',
                      '--quiet', '--out', tmp_path / 'run')
    assert rc == 0, err
    cfg = json.loads((tmp_path / 'run' / 'config.json').read_text())
    assert cfg['config']['max_new_tokens'] == 128_000 and cfg['protocol']['context_fit']['value'].startswith('per call')
    calls = pd.read_parquet(tmp_path / 'run' / 'calls.parquet')
    assert (calls.max_new_tokens < 512).all() and not calls.context_retry.any() and cfg['server']['served_context'] == 512


# ------------------------------------------------------------------ 6. the guideline rule, the arm's ε

def _guidelines(tmp_path, name, **kw):
    lists = [['multiply 6 by 7'], ['add 7 six times']]       # the agent drops the first strategy in its second reply
    llm = ScriptedLLM({**REPLIES, 'guideline': lambda req, k: json.dumps({'updated_guidelines': lists[min(k, 1)]})})
    cfg = TMASConfig(n_candidates=1, n_verifications=1, iterations=3, epsilon=0.0, embedder='hashing', max_new_tokens=16, **kw)
    asyncio.run(run_method('tmas', demo_problems()[:1], llm, cfg, tmp_path / name, progress=False))
    last = json.loads(next((tmp_path / name / 'checkpoints').rglob('iter_2.json')).read_text())
    return last['banks']['guideline']


def test_the_guideline_bank_is_append_only_unless_the_release_rule_is_asked(tmp_path):
    from tmas_nb.runs.protocol import layer_settings
    assert _guidelines(tmp_path, 'paper') == ['multiply 6 by 7', 'add 7 six times']
    assert _guidelines(tmp_path, 'release', guideline_update='replace') == ['add 7 six times']
    t, rec = layer_settings('tmas', 'tmas-paper', flags={'n_candidates': 2}, backend='openai')
    assert rec['protocol']['guideline_bank']['value'] == 'append' and t.guideline_update == 'append'
    f = tmp_path / 'noguide.json'; f.write_text('{"use_guidelines": false}')
    _, rec = layer_settings('tmas', 'tmas-paper', f, backend='openai')
    assert 'inferred' in rec['protocol']['assumed']['value']['epsilon']     # ε = 0 of the arm without guidelines: assumed


# ------------------------------------------------------------------ 8. RSE: one round at a time, retries, ablations

def test_a_round_merges_old_items_into_this_rounds_as_the_release(tmp_path):
    said = [['the sum of the roots is 4'], ['If a + b = 4 for the roots a and b, then the sum of the roots is 4']]
    llm = ScriptedLLM({**REPLIES, 'distillation': lambda req, k: json.dumps({'verified_propositions': said[min(k, 1)], 'critical_pitfalls': []})})
    cfg = RSEConfig(n_candidates=1, iterations=3, embedder='hashing', max_new_tokens=16)
    asyncio.run(run_method('rse', demo_problems()[:1], llm, cfg, tmp_path / 'r', progress=False))
    bank = json.loads(next((tmp_path / 'r' / 'checkpoints').rglob('iter_1.json')).read_text())['banks']['rse']
    assert bank == ['Proposition: If a + b = 4 for the roots a and b, then the sum of the roots is 4']   # the old item left


def test_rse_paper_asks_a_distillation_again_five_times(tmp_path):
    from tmas_nb.runs.protocol import layer_settings
    cfg, _ = layer_settings('rse', 'rse-paper', flags={'n_candidates': 1, 'iterations': 2, 'max_new_tokens': 16, 'embedder': 'hashing'},
                            model='Qwen3-4B-Thinking-2507', backend='openai')
    replies = ['no JSON yet'] * 5 + [REPLIES['distillation']]
    llm = ScriptedLLM({**REPLIES, 'distillation': lambda req, k: replies[k]})
    asyncio.run(run_method('rse', demo_problems()[:1], llm, cfg, tmp_path / 'r', progress=False))
    last = json.loads(next((tmp_path / 'r' / 'checkpoints').rglob('iter_0.json')).read_text())
    assert cfg.memory_retries == 5 and [(m['ok'], m['attempts']) for m in last['memory']] == [(True, 6)]


def test_table_9_noise_is_judged_invalid_items(tmp_path):
    rc, _, err = _cli('run', '--method', 'rse', '--benchmark', 'demo', '--backend', 'openai', '--config',
                      _write(tmp_path / 'noise.json', {'noise': 0.2}), '--print-config')
    assert rc == 2 and 'set validate_items: true' in err and err.count('\n') == 1
    items = {'verified_propositions': ['6 * 7 = 42', '6 * 7 = 43'], 'critical_pitfalls': ['adding 6 and 7 -> Fatal flaw -> 13']}
    judge = lambda req, k: 'INVALID' if '43' in req.messages[-1]['content'].split('Item:')[1] else 'VALID'
    llm = ScriptedLLM({**REPLIES, 'distillation': json.dumps(items), 'validation': judge})
    cfg = RSEConfig(n_candidates=1, iterations=2, embedder='hashing', max_new_tokens=16, validate_items=True, noise=0.0)
    asyncio.run(run_method('rse', demo_problems()[:1], llm, cfg, tmp_path / 'r', progress=False))
    state = json.loads(next((tmp_path / 'r' / 'checkpoints').rglob('iter_1.json')).read_text())['state']
    assert state['validity']['propositions'] == {'6 * 7 = 42': True, '6 * 7 = 43': False}
    assert state['noise'] == {'capacity': 3, 'valid': 2, 'invalid': 0, 'invalid_asked': 0}      # Table 9's noise-free bank
    assert '6 * 7 = 43' not in llm.by_role('solution')[-1].messages[0]['content']


def _write(path, d):
    path.write_text(json.dumps(d)); return path


# ------------------------------------------------------------------ the guide lists every assumed value

def test_the_guide_lists_every_value_a_preset_assumes():
    from tmas_nb.presets import preset_table
    nb = json.loads((REPO / 'nbs' / 'guides' / '01_your_model.ipynb').read_text())
    text = '\n'.join(''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'markdown')
    rows = [[x.strip() for x in l.strip('|').split('|')] for l in text.splitlines() if l.startswith('| ') and l.count('|') >= 6]
    t = pd.concat([preset_table(), preset_table('microsoft/Phi-4-reasoning')])
    missing = []
    for r in t[t.assumed].drop_duplicates(['preset', 'method', 'setting']).itertuples():
        if not any(p in (r.preset, 'both') and re.search(rf'\b{re.escape(r.method)}\b', m) and r.setting in s.split(', ') and why
                   for p, m, s, _, why in (row[:5] for row in rows if len(row) >= 5)):
            missing.append((r.preset, r.method, r.setting))
    assert not missing, f"the guide's table of assumed values lacks {missing}"
