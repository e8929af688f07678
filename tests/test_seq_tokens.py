"""Sequential tokens (latency) in the replay environment: the schedules, the compiled kernels against the reference
path, the Parallel-Probe paper's figures on one store, and the records and command line that carry them."""
import json
import subprocess
import sys

import pytest

from tmas_nb.autotts.store import load_store, ReplayStore
from tmas_nb.autotts.environment import ReplayEnv, seq_tokens, check_schedule
from tmas_nb.autotts.controllers import Controller, SelfConsistency, ASC, ESC, ParallelProbe, CMC
from tmas_nb.autotts.fast import check_against_reference
from tmas_nb.autotts.evaluation import evaluate, run_grid

TOY = {'question': 'q0', 'gold_answer': '7', 'probe_freq': 500, 'final_answers_trace': [],
       'each_branch': [[['7', '7'], 1200, '7'], [['3'], 900, '7'], [[], 300, '3'], [['7', '3', '3'], 1700, '3']]}


def test_schedule_rules():
    t = [1200, 900, 300, 1700]
    assert [seq_tokens(s, t) for s in ('parallel', 'sequential', ('windows', 2), ('windows', 3))] == [1700, 4100, 2900, 2900]
    assert seq_tokens(None, t, [0, 0, 900, 900]) == 2600
    with pytest.raises(ValueError, match='schedule'): check_schedule('fast')


def test_derived_schedule_of_a_file_style_controller():
    "A controller without a schedule: reads in the derived order (a branch starts when the newest answer seen arrived)."
    class TwoThenOne(Controller):
        name = 'two'
        def params(self): return {}
        def run(self, env):
            env.read_whole_id(); env.read_whole_id(); return '7'
    st = ReplayStore.from_records([TOY], name='toy')
    r = evaluate(TwoThenOne(), st, seeds=[0])
    o = st.orders([0])[0, 0]
    assert r.seq_rule == 'derived' and r.avg_seq_tokens == r.avg_tokens == st.tokens[0, o[0]] + st.tokens[0, o[1]]


@pytest.mark.parametrize('ctrl', [SelfConsistency(64), ASC(64), ESC(64, 8), ParallelProbe(64), CMC(0.5), CMC(1.0)],
                         ids=lambda c: c.describe())
def test_kernels_match_reference_sequential_tokens(data_root, ctrl):
    assert check_against_reference(ctrl, load_store('Qwen3-1.7B', 'aime25', data_root), seeds=[0, 5]) == 60


# The Parallel-Probe paper's main table, Qwen3-0.6B on AIME24 (evaluation/table.tex of zhengkid/Parallel-Probe):
# (accuracy %, sequential tokens k, tokens k)
PUBLISHED_06B_AIME24 = {'sc:k=64': (21.4, 32.7, 1008.6), 'asc:max_samples=64,threshold=0.95': (21.4, 805.5, 805.5),
                        'esc:max_samples=64,window=8': (21.4, 192.9, 986.7), 'pp:num_chains=64': (21.8, 20.8, 773.8)}


def test_published_sequential_tokens(data_root):
    st = load_store('Qwen3-0.6B', 'aime24', data_root)
    for spec, want in PUBLISHED_06B_AIME24.items():
        r = evaluate(spec, st)
        assert (round(r.acc, 1), round(r.avg_seq_tokens / 1000, 1), round(r.avg_tokens / 1000, 1)) == want, spec
        assert r.seq_ci_low <= r.avg_seq_tokens <= r.seq_ci_high


def test_grid_and_cli_carry_sequential_tokens(data_root):
    g = run_grid(data_root, ['Qwen3-0.6B'], ['aime24'], ['sc:k=64', 'asc:max_samples=64'], jobs=1, progress=False)
    assert g.seq_rule.tolist() == ['parallel', 'sequential']
    assert (g.avg_seq_tokens.round(-2) == [32700, 805500]).all() and (g.seq_ci_low <= g.avg_seq_tokens).all()
    out = subprocess.run([sys.executable, '-m', 'tmas_nb.cli', 'replay', 'eval', '--data-dir', str(data_root), '--model',
                          'Qwen3-0.6B', '--benchmark', 'aime24', '--controller', 'esc:max_samples=64,window=8', '--json'],
                         capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    assert d['seq_rule'] == 'windows:8' and round(d['avg_seq_tokens'] / 1000, 1) == 192.9
    assert d['seq_ci_low'] < d['avg_seq_tokens'] < d['seq_ci_high']


# ---- SC@64 + SAC -----------------------------------------------------------------------------------------------
# Two questions, four branches each. Question 0: branches 0 and 1 settle early on the right answer '5' and would change
# their mind later (so reading them whole would vote wrong); branches 2 and 3 are read to their end and say '9'.
SAC_RECORDS = [
    {'question': 'q0', 'gold_answer': '5', 'probe_freq': 100, 'final_answers_trace': [],
     'each_branch': [[['5', '5', '5', '9'], 1000, '9'], [['2', '5', '5', '5', '9'], 1000, '9'],
                     [['9', '2'], 300, '9'], [['5', '9'], 250, '9']]},
    {'question': 'q1', 'gold_answer': '4', 'probe_freq': 100, 'final_answers_trace': [],
     'each_branch': [[['4', '4', '4'], 400, '4'], [[], 50, '1'], [['1', '1', '1', '1'], 900, '4'], [['4'], 150, '4']]},
]


def test_sac_on_a_hand_built_store():
    from tmas_nb.autotts.controllers import parse_controller, SAC
    st = ReplayStore.from_records(SAC_RECORDS, name='sac-toy')
    sac = parse_controller('sac:n=4,streak=3')
    assert sac == SAC(4, 3) and sac.schedule == 'parallel'
    env = ReplayEnv(st, 0, seed=None)
    # branch 0 stops at its 3rd '5' (300); 1 at its 3rd '5' after a '2' (400); 2 reads to its end '9' (300); 3 to '9' (250)
    assert sac.run(env) == '5' and env.tokens_read == [300, 400, 300, 250] and env.seq_tokens(sac.schedule) == 400
    env = ReplayEnv(st, 1, seed=None)
    # '4' (300 tokens), '1' (whole, 50), '1' after three '1's (300), '4' (150): a tie, the answer seen first wins
    assert sac.run(env) == '4' and env.tokens_read == [300, 50, 300, 150]
    assert SelfConsistency(4).run(ReplayEnv(st, 0, seed=None)) == '9'      # reading whole branches votes wrong here
    check_against_reference(sac, st, seeds=range(10))
    r = evaluate('sac:n=4,streak=3', st, seeds=range(10))
    assert r.seq_rule == 'parallel' and r.avg_seq_tokens <= r.avg_tokens


def test_sac_release_parameters(data_root):
    "The paper's SC@64 + SAC row for Qwen3-0.6B on AIME24: 19.5 % at 26.8k sequential and 820.7k tokens."
    r = evaluate('sac:n=64,streak=14', load_store('Qwen3-0.6B', 'aime24', data_root))
    assert (round(r.acc, 1), round(r.avg_seq_tokens / 1000, 1), round(r.avg_tokens / 1000, 1)) == (19.5, 26.8, 820.7)


# ---- controller files (the safe path: the parent serves every action and counts) ---------------------------------
FILE_SRC = '''
from collections import Counter
class EightWhole:
    schedule = 'parallel'
    def run(self, env):
        ids = [env.read_whole_id() for _ in range(min(8, env.n_available))]
        return env.store.answer(env.question, Counter(ids).most_common(1)[0][0])
'''


@pytest.mark.parametrize('trusted', [False, True], ids=['safe', 'trusted'])
@pytest.mark.parametrize('declared,rule', [("    schedule = 'parallel'\n", 'parallel'), ("    schedule = ('windows', 4)\n", 'windows:4'),
                                           ('', 'derived')])
def test_file_schedule_declared_or_derived(data_root, tmp_path, declared, rule, trusted):
    from tmas_nb.autotts.files import evaluate_file
    f = tmp_path / 'eight.py'
    f.write_text(FILE_SRC.replace("    schedule = 'parallel'\n", declared))
    st = load_store('Qwen3-0.6B', 'aime24', data_root)
    r = evaluate_file(str(f), 'EightWhole', {}, st, seeds=range(3), trusted=trusted)
    assert r.error is None and r.seq_rule == rule and r.seq_ci_low <= r.avg_seq_tokens <= r.seq_ci_high
    schedule = {'parallel': 'parallel', 'windows:4': ('windows', 4), 'derived': None}[rule]
    ref = []
    for s in range(3):
        for q in range(st.n_questions):
            env = ReplayEnv(st, q, seed=s); [env.read_whole_id() for _ in range(8)]; ref.append(env.seq_tokens(schedule))
    assert r.avg_seq_tokens == pytest.approx(sum(ref) / len(ref))
    if rule == 'derived': assert r.avg_seq_tokens == pytest.approx(r.avg_tokens)   # whole reads seen one by one: in sequence


@pytest.mark.parametrize('trusted', [False, True], ids=['safe', 'trusted'])
@pytest.mark.parametrize('name', ['ours_cmc', 'authors_sc'])
def test_file_derived_schedule_matches_the_environment(data_root, tmp_path, name, trusted):
    "A file subclassing a built-in takes its schedule, and the parent's count equals the in-process one; a plain file's is derived."
    from tmas_nb.autotts.files import evaluate_file
    from tmas_nb.autotts.authors_api import example_controller
    cls, src = example_controller(name)
    (tmp_path / f'{name}.py').write_text(src)
    st = load_store('Qwen3-1.7B', 'hmmt25', data_root)
    r = evaluate_file(str(tmp_path / f'{name}.py'), cls, {}, st, seeds=range(2), trusted=trusted)
    assert r.error is None and r.seq_rule == {'ours_cmc': 'parallel', 'authors_sc': 'derived'}[name]
    assert 0 < r.avg_seq_tokens <= r.avg_tokens
    if name == 'ours_cmc':
        ns = {}; exec(compile(src, name, 'exec'), ns)
        ctrl = ns[cls]()
        ref = evaluate(ctrl, st, seeds=range(2))
        assert ref.seq_rule == 'parallel' and r.avg_seq_tokens == pytest.approx(ref.avg_seq_tokens)
        assert r.avg_tokens == pytest.approx(ref.avg_tokens)


def test_file_with_a_bad_schedule_fails_in_one_line(data_root, tmp_path):
    from tmas_nb.autotts.files import evaluate_file
    f = tmp_path / 'bad.py'
    f.write_text(FILE_SRC.replace("'parallel'", "'whenever'"))
    r = evaluate_file(str(f), 'EightWhole', {}, ReplayStore.from_records([TOY], name='toy'), seeds=[0])
    assert r.error.startswith("bad.py: class EightWhole: schedule 'whenever' is not valid")


DERIVED_SRC = '''
class OpenAdvance:
    def run(self, env):
        got = [env.branch_id() for _ in range(min(3, env.n_available))]
        last = None
        for i, a, fin in got:
            for _ in range(2):
                if fin: break
                a, fin = env.advance_id(i)
            last = a
        env.probe(0)
        if env.n_available: env.read_whole_id()
        return env.store.answer(env.question, last)
'''


@pytest.mark.parametrize('trusted', [False, True], ids=['safe', 'trusted'])
def test_file_derived_rule_matches_the_environment(data_root, tmp_path, trusted):
    "Branches, continues, a probe and a whole read with no schedule: the serving kernel's starts are `ReplayEnv`'s."
    from tmas_nb.autotts.files import evaluate_file
    (tmp_path / 'oa.py').write_text(DERIVED_SRC)
    st = load_store('Qwen3-4B', 'aime25', data_root)
    r = evaluate_file(str(tmp_path / 'oa.py'), 'OpenAdvance', {}, st, seeds=range(3), trusted=trusted)
    ns = {}; exec(DERIVED_SRC, ns)
    class InProcess(Controller, ns['OpenAdvance']):
        name = 'oa'
        def params(self): return {}
        run = ns['OpenAdvance'].run
    ref = evaluate(InProcess(), st, seeds=range(3))
    assert r.error is None and (r.seq_rule, ref.seq_rule) == ('derived', 'derived')
    assert r.avg_tokens == pytest.approx(ref.avg_tokens) and r.avg_seq_tokens == pytest.approx(ref.avg_seq_tokens)
    assert r.avg_seq_tokens < r.avg_tokens


def test_authors_file_paths_agree(data_root, tmp_path):
    "An authors'-API file without a schedule: the safe path's kernel and the trusted path's replay count the same."
    from tmas_nb.autotts.files import evaluate_file
    from tmas_nb.autotts.authors_api import example_controller
    cls, src = example_controller('authors_cmc')
    (tmp_path / 'a.py').write_text(src)
    st = load_store('Qwen3-8B', 'aime24', data_root)
    safe, trusted = (evaluate_file(str(tmp_path / 'a.py'), cls, {}, st, seeds=range(2), trusted=t) for t in (False, True))
    assert safe.error is None and trusted.error is None and safe.seq_rule == trusted.seq_rule == 'derived'
    assert safe.avg_tokens == trusted.avg_tokens and safe.avg_seq_tokens == trusted.avg_seq_tokens < safe.avg_tokens
