"""The discovery loop as the paper runs it (§3.2, Appendix C): the built-in explorer starts each round from the
template with the seed controllers as code, reads the contract with the 64-branch ceiling and every earlier round's
traces, and keeps its best-scoring draft; the ceiling reaches the evaluator; the command line says what it does. The
proposer here is scripted (control flow only); every evaluation is real and sandboxed."""
import json
import re

import pandas as pd
import pytest

from tmas_nb.autotts import discovery
from tmas_nb.cli import build_parser, main
from tmas_nb.autotts.discovery import (
    DiscoveryConfig, METHOD_TEMPLATE, ScriptedLLM, config_from_args, run_discovery, summary_line, synthetic_store,
    takes_keyword, traces_history_text)
from tmas_nb.autotts.authors_api import store_records
from tmas_nb.autotts.files import evaluate_file_configs
from tmas_nb.sandbox import sandbox_mode

STUB = "raise NotImplementedError('OptimalController.solve is not written yet')"

def controller(body: str) -> str:
    "The template with OptimalController.solve written as `body` (one expression returned)."
    assert STUB in METHOD_TEMPLATE
    return METHOD_TEMPLATE.replace(STUB, f"return {body}")

def reply(code: str) -> str: return f"Here is the controller.\n```python\n{code}```\n"

MAJORITY = lambda m: controller(f"_majority_answer([_safe_full_read(question) for _ in range(1 + round(self.beta * {m}))])")


def _store(tmp_path, name='syn', **kw):
    f = tmp_path / 'Qwen3-4B' / f'{name}.json'; f.parent.mkdir(exist_ok=True)
    f.write_text(json.dumps(store_records(synthetic_store(**kw)))); return f


def test_builtin_proposer_starts_from_the_template_with_the_seeds_and_reads_the_appendix_c_contract(tmp_path):
    cfg = DiscoveryConfig(rounds=1, train=[str(_store(tmp_path))], seeds=2, betas=(0.0, 1.0), turns=1)
    run_discovery(ScriptedLLM([reply(MAJORITY(15))]), cfg, tmp_path / 'run', progress=False)
    p = (tmp_path / 'run' / 'rounds' / 'r0000' / 'prompt_0.txt').read_text()
    assert METHOD_TEMPLATE in p
    for seed in ('class SCMethod(', 'class ASCMethod(', 'class ESCMethod(', 'class Parallel_Probe('): assert seed in p, seed
    for clause in ('max_branch = 64', 'opening branch number 65', 'Conservative anchor', 'beta = 1 is the careful end',
                   'Monotone', 'Adaptive width and depth', 'Novel', 'def _schedule(self, beta) -> dict'):
        assert clause in p, clause
    assert not re.search(r'CMC|[Mm]omentum', p)


def test_a_rounds_proposal_is_its_best_scoring_draft_not_its_last(tmp_path):
    good, bad = MAJORITY(15), controller("'never the answer'")
    cfg = DiscoveryConfig(rounds=1, train=[str(_store(tmp_path))], seeds=3, betas=(0.0, 1.0), turns=2)
    run_discovery(ScriptedLLM([reply(good), reply(bad)]), cfg, tmp_path / 'run', progress=False)
    [rec] = [json.loads(l) for l in (tmp_path / 'run' / 'rounds.jsonl').read_text().splitlines()]
    assert [d['chosen'] for d in rec['drafts']] == [True, False], rec['drafts']
    assert rec['drafts'][0]['score']['acc'] > rec['drafts'][1]['score']['acc'] == 0
    assert (tmp_path / 'run' / 'rounds' / 'r0000' / 'method.py').read_text() == good
    assert (tmp_path / 'run' / 'rounds' / 'r0000' / 'prompt_1.txt').exists()          # the second draft was asked for and scored


def test_the_explorer_reads_the_traces_of_every_round_newest_first_within_its_context(tmp_path):
    train = _store(tmp_path)
    cfg = DiscoveryConfig(rounds=3, train=[str(train)], seeds=2, betas=(0.0, 1.0), turns=1)
    out = tmp_path / 'run'
    run_discovery(ScriptedLLM([reply(MAJORITY(m)) for m in (15, 7, 3)]), cfg, out, progress=False)
    p = (out / 'rounds' / 'r0002' / 'prompt_0.txt').read_text()
    tr = p[p.index('# Execution traces of earlier rounds'):p.index('# The current method.py')]
    assert '## Round 1' in tr and '## Round 0' in tr and tr.index('## Round 1') < tr.index('## Round 0'), tr[:500]
    recs = [json.loads(l) for l in (out / 'rounds.jsonl').read_text().splitlines()]
    from tmas_nb.autotts.discovery import resolve_store
    st = [resolve_store(str(train))]
    full = traces_history_text(out, recs[:2], st, 10 ** 6)
    short = traces_history_text(out, recs[:2], st, len(full) // 2 + 10)   # room for one round: the newest
    assert '## Round 1' in short and '## Round 0' not in short


def _recording_evaluator(monkeypatch):
    "evaluate_file_configs with its own `max_branches` keyword: records it, and passes it on where the real one takes it."
    seen, real = [], evaluate_file_configs
    def ev(path, class_name, configs, store, seeds=range(100), settings=None, keep_logs=False, max_branches=None, **kw):
        seen.append(max_branches)
        extra = dict(max_branches=max_branches) if max_branches and takes_keyword(real, 'max_branches') else {}
        return real(path, class_name, configs, store, seeds, settings, keep_logs=keep_logs, **extra, **kw)
    monkeypatch.setattr(discovery, 'evaluate_file_configs', ev)
    return seen


def test_the_ceiling_goes_to_the_evaluator_64_by_default_none_when_off(tmp_path, monkeypatch):
    seen = _recording_evaluator(monkeypatch)
    cfg = DiscoveryConfig(rounds=1, train=[str(_store(tmp_path))], seeds=2, betas=(0.0, 1.0), turns=1)
    s = run_discovery(ScriptedLLM([reply(MAJORITY(15))]), cfg, tmp_path / 'a', progress=False)
    assert seen and set(seen) == {64} and (s['max_branches'], s['ceiling_enforced']) == (64, True)
    seen.clear()
    s = run_discovery(ScriptedLLM([reply(MAJORITY(15))]), DiscoveryConfig(**{**cfg.__dict__, 'max_branches': None}), tmp_path / 'b', progress=False)
    assert seen and set(seen) == {None} and (s['max_branches'], s['ceiling_enforced']) == (None, False)
    assert DiscoveryConfig().max_branches == 64 and discovery.PRESETS['paper']['max_branches'] == 64


def test_a_65th_branch_is_an_error_of_the_episode_shown_to_the_explorer_next_round(tmp_path):
    wide = _store(tmp_path, 'wide', n_branches=80)
    greedy = controller("_majority_answer([question.get_new_branch_final_answer() for _ in range(1 + round(self.beta * 69))])")
    cfg = DiscoveryConfig(rounds=2, train=[str(wide)], seeds=2, betas=(0.0, 1.0), turns=1)
    out = tmp_path / 'run'
    run_discovery(ScriptedLLM([reply(greedy), reply(MAJORITY(15))]), cfg, out, progress=False)
    rec = json.loads((out / 'rounds.jsonl').read_text().splitlines()[0])
    assert [h['beta'] for h in rec['ceiling_hits']] == [1.0] and rec['ceiling_hits'][0]['episodes'] > 0, rec
    assert 'past the branch ceiling' in (out / 'rounds' / 'r0001' / 'prompt_0.txt').read_text()


def _args(*extra):
    return build_parser('discover').parse_args(['discover', '--agent-cmd', 'true', '--train', 'x.json', '--out', 'o', *extra])


def test_discover_flags_agent_allow_disk_and_max_branches():
    cfg = config_from_args(_args('--agent-allow', '127.0.0.1:8000', '--agent-allow', 'localhost:11434', '--agent-disk-mb', '512',
                                 '--max-branches', '0'))
    assert (cfg.agent_allow, cfg.agent_disk_mb, cfg.max_branches) == (['127.0.0.1:8000', 'localhost:11434'], 512, None)
    cfg = config_from_args(_args())
    assert (cfg.agent_allow, cfg.agent_disk_mb, cfg.max_branches) == ([], 4096, 64)
    assert config_from_args(_args('--preset', 'paper', '--max-branches', '32')).max_branches == 32
    assert config_from_args(_args('--from-history', 'h')).max_branches is None           # re-scored as the history's evaluator ran


@pytest.mark.parametrize('flags, message', [(['--agent-allow', 'localhost'], '--agent-allow'), (['--max-branches', '-3'], '--max-branches'),
                                            (['--agent-disk-mb', '2'], '--agent-disk-mb')])
def test_bad_agent_flags_are_one_line(tmp_path, capsys, flags, message):
    rc = main(['discover', '--agent-cmd', 'true', '--train', str(_store(tmp_path)), '--out', str(tmp_path / 'o'), '--quiet', *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith('tmas: error: ') and message in err[0], err


def test_discover_help_describes_the_loop_as_it_runs(capsys):
    with pytest.raises(SystemExit): main(['discover', '--help'])
    h = ' '.join(capsys.readouterr().out.split())
    assert 'scored against SC and CMC' not in h and 'reviewed by a critic call' not in h
    for words in ('template', 'seed controllers', 'execution traces', 'highest search accuracy', 'held-out', '--max-branches',
                  '--agent-allow', '--agent-disk-mb'):
        assert words in h, words


def test_the_summary_says_cost_unknown_not_dollar_none():
    s = dict(rounds=1, statuses={'ok': 0, 'no_code': 1}, selection=None,
             cost=dict(tokens_in=0, tokens_out=0, tokens_unknown_rounds=[0], minutes=0.1, dollars=None))
    line = summary_line(s, 'runs/x')
    assert '$None' not in line and 'cost unknown' in line and '1 no_code' in line
    assert '$0.0128' in summary_line({**s, 'cost': {**s['cost'], 'dollars': 0.0128, 'tokens_unknown_rounds': []}}, 'runs/x')


@pytest.mark.skipif(sandbox_mode() != 'bwrap', reason='the agent sandbox needs bubblewrap')
def test_tmas_discover_prints_no_dollar_none_when_the_agent_reported_no_tokens(tmp_path, capsys):
    rc = main(['discover', '--agent-cmd', 'true', '--train', str(_store(tmp_path)), '--seeds', '1', '--rounds', '1',
               '--out', str(tmp_path / 'o'), '--quiet'])
    out = capsys.readouterr().out
    assert rc == 0 and '$None' not in out and 'cost unknown' in out, out


def test_episodes_past_the_ceiling_reach_the_round_record_and_the_next_prompt(tmp_path, monkeypatch):
    # the evaluator's count (control flow only: a stand-in for the count the evaluator keeps, 5 episodes at β = 1)
    monkeypatch.setattr(discovery, 'ceiling_hits', lambda r: 5 if '"beta": 1.0' in r.controller else 0)
    cfg = DiscoveryConfig(rounds=2, train=[str(_store(tmp_path))], seeds=2, betas=(0.0, 1.0), turns=1)
    out = tmp_path / 'run'
    s = run_discovery(ScriptedLLM([reply(MAJORITY(15)), reply(MAJORITY(7))]), cfg, out, progress=False)
    rec = json.loads((out / 'rounds.jsonl').read_text().splitlines()[0])
    assert rec['ceiling_hits'] == [dict(store='Qwen3-4B:syn', beta=1.0, episodes=5)] and s['ceiling_hits'] == {0: 5, 1: 5}
    p = (out / 'rounds' / 'r0001' / 'prompt_0.txt').read_text()
    assert 'past the branch ceiling (each such question was an error, counted wrong): Qwen3-4B:syn β=1: 5 episodes' in p


def test_a_round_whose_every_configuration_fails_is_recorded_and_the_run_goes_on_and_resumes(tmp_path):
    raises = controller("(_ for _ in ()).throw(RuntimeError('always fails'))")
    store, out = str(_store(tmp_path)), tmp_path / 'run'
    cfg = DiscoveryConfig(rounds=1, train=[store], seeds=2, betas=(0.0, 1.0), turns=1)
    s = run_discovery(ScriptedLLM([reply(raises)]), cfg, out, progress=False)
    [rec] = [json.loads(l) for l in (out / 'rounds.jsonl').read_text().splitlines()]
    assert rec['status'] == 'all_failed' and 'always fails' in rec['error'], rec
    assert s['statuses']['all_failed'] == 1 and (out / 'summary.json').exists()
    csv = next((out / 'code_base' / 'history').glob('r0000_*/matrix_results_*/syn_raw_new_api.csv'))
    assert pd.read_csv(csv).Acc.isna().all()                                  # no number where there was none
    s = run_discovery(ScriptedLLM([reply(MAJORITY(15))]), DiscoveryConfig(**{**vars(cfg), 'rounds': 2}), out, progress=False)
    recs = [json.loads(l) for l in (out / 'rounds.jsonl').read_text().splitlines()]
    assert [r['status'] for r in recs] == ['all_failed', 'ok'] and s['rounds'] == 2 and s['selection']['round'] == 1
