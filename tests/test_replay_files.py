"""Controller files: the authors' API rules, equality with built-ins, hostile files contained, errors, and the CLI."""
import json
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tmas_nb.core import find_data_dir
from tmas_nb.autotts.store import ReplayStore, load_store, available_stores
from tmas_nb.autotts.authors_api import AuthorsQuestion, example_controller, run_authors_protocol, store_records
from tmas_nb.autotts.evaluation import evaluate
from tmas_nb.autotts.files import ControllerError, check_controller_source, evaluate_file, evaluate_file_grid
from tmas_nb.sandbox import sandbox_mode
from tmas_nb.autotts.safe import presentation_order

TOY = {'question': 'q0', 'gold_answer': '7', 'probe_freq': 500, 'final_answers_trace': [],
       'each_branch': [[['7', '7'], 1200, '7'], [['3'], 900, '7'], [[], 300, '3']]}
# seed 5 keeps the stored order of three branches
RECS = [dict(TOY, question=f'q{i}', each_branch=TOY['each_branch'] + [[['7', '3', '3'], 1700, '7']]) for i in range(3)]


@pytest.fixture(scope='module')
def toy_store():
    return ReplayStore.from_records(RECS, name='toy')


@pytest.fixture(scope='module')
def bwrap():
    if sandbox_mode() != 'bwrap':
        pytest.skip('bubblewrap cannot create namespaces on this machine: containment is not available')
    return True


def write(tmp_path, name, code):
    p = tmp_path / name
    p.write_text(textwrap.dedent(code))
    return p


# --- the authors' API, rule by rule ---------------------------------------------------------------

def test_probe_past_end_recharges_each_time():
    q = AuthorsQuestion(TOY, 5)
    q.probe_new(); q.probe_more(0); q.probe_more(0); q.probe_more(0)
    assert q.tokens_charged == 500 + 500 + 200 + 200


def test_probe_more_accepts_number_opened_and_counts_it_in_total_only():
    q = AuthorsQuestion(TOY, 5)
    q.probe_new()
    assert q.probe_more(1) == ('3', False)
    assert q.get_cost_per_branch_active() == [500] and q.tokens_charged == 1000
    assert q.probe_new() == ('7', 1, True)          # continues after the probe already read


def test_errors_and_no_charge_on_error():
    q = AuthorsQuestion(TOY, 5)
    with pytest.raises(ValueError): q.probe_more(1)
    for _ in range(3): q.get_new_branch_final_answer()
    with pytest.raises(ValueError): q.probe_new()
    with pytest.raises(IndexError): q.get_new_branch_final_answer()
    with pytest.raises(IndexError): q.probe_more(3)
    assert q.tokens_charged == 1200 + 900 + 300
    assert q.get_seq_and_total_tokens() == (1200, 2400)


def test_order_is_random_shuffle_of_the_seed_like_store_orders():
    import random
    rec = dict(TOY, each_branch=[[[str(j)], 600, str(j)] for j in range(17)])
    st = ReplayStore.from_records([rec])
    for s in range(30):
        q = AuthorsQuestion(rec, s)
        perm = list(range(17)); random.Random(s).shuffle(perm)
        got = [q.probe_new()[0] for _ in range(17)]
        assert got == [str(j) for j in perm] == [str(j) for j in st.orders([s])[0, 0]]


def test_one_instance_seed_major_and_exact_string_equality(tmp_path, toy_store):
    p = write(tmp_path, 'stateful.py', '''
        class Counting:
            def __init__(self, config=None): self.seen = []
            def solve(self, question):
                self.seen.append([question.get_new_branch_final_answer() for _ in range(4)])
                return str(len(self.seen)) if len(self.seen) == 7 else ' 7'   # ' 7' never equals '7'
    ''')
    r = evaluate_file(p, 'Counting', {}, toy_store, seeds=range(3), sandbox=False, trusted=True)
    # 9 episodes, seed-major: only episode 7 (seed 2, question 0) answers '7'
    assert r['error'] is None and r['api'] == 'authors' and r['eval_path'] == 'trusted'
    assert r['per_question_acc'] == pytest.approx([100 / 3, 0, 0])
    # the safe path presents each seed's questions in its secret order: episode 7 is seed 2's first question there
    r = evaluate_file(p, 'Counting', {}, toy_store, seeds=range(3), sandbox=False)
    want = [0.0] * 3; want[presentation_order(toy_store, 2)[0]] = 100 / 3
    assert r['error'] is None and r['eval_path'] == 'safe' and r['per_question_acc'] == pytest.approx(want)


# --- the same numbers as the built-ins --------------------------------------------------------------

@pytest.mark.parametrize('name,cfg,spec', [('authors_sc', {'k': 3}, 'sc:k=3'), ('ours_sc', {'k': 2}, 'sc:k=2'),
                                           ('ours_cmc', {'beta': 0.5}, 'cmc:beta=0.5')])
def test_files_equal_builtins_toy(tmp_path, toy_store, name, cfg, spec):
    cls, src = example_controller(name)
    r = evaluate_file(write(tmp_path, f'{name}.py', src), cls, cfg, toy_store, seeds=range(6), jobs=2, stateless=True)
    ref = evaluate(spec, toy_store, range(6))
    assert r['error'] is None
    assert (r['acc'], r['avg_tokens']) == pytest.approx((ref.acc, ref.avg_tokens))


def test_authors_files_equal_builtins_real_store(tmp_path, data_root):
    st = load_store('Qwen3-4B', 'aime24', data_root)
    for name, cfg, spec in [('authors_sc', {'k': 16}, 'sc:k=16'), ('authors_cmc', {'beta': 0.3}, 'cmc:beta=0.3')]:
        cls, src = example_controller(name)
        r = evaluate_file(write(tmp_path, f'{name}.py', src), cls, cfg, st, seeds=range(3), timeout=120)
        ref = evaluate(spec, st, range(3))
        assert r['error'] is None, r['error']
        assert (r['acc'], r['avg_tokens']) == pytest.approx((ref.acc, ref.avg_tokens), rel=1e-12)
        assert r['per_question_tokens'] == pytest.approx(ref.per_question_tokens)


# --- hostile files ------------------------------------------------------------------------------------

def test_writes_outside_tmp_are_contained(tmp_path, toy_store, bwrap):
    targets = [tmp_path / 'escaped.txt', Path(__file__).resolve().parents[1] / 'tmas_nb' / 'escaped.txt', Path.home() / 'escaped.txt']
    p = write(tmp_path, 'writer.py', f'''
        TARGETS = {[str(t) for t in targets]!r}
        class W:
            def __init__(self, config=None): pass
            def solve(self, question):
                for t in TARGETS:
                    try: open(t, 'w').write('x')
                    except OSError: pass
                open('/tmp/inside.txt', 'w').write('ok')      # the private tmpfs is writable
                return question.get_new_branch_final_answer()
    ''')
    r = evaluate_file(p, 'W', {}, toy_store, seeds=[0])
    assert r['error'] is None, r['error']
    assert not any(t.exists() for t in targets)


def test_network_is_unreachable(tmp_path, toy_store, bwrap):
    srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(5); srv.settimeout(0.2)
    port = srv.getsockname()[1]; got = []
    stop = threading.Event()
    def accept():
        while not stop.is_set():
            try: got.append(srv.accept()[0])
            except OSError: pass
    th = threading.Thread(target=accept, daemon=True); th.start()
    p = write(tmp_path, 'net.py', f'''
        import socket
        class N:
            def __init__(self, config=None): pass
            def solve(self, question):
                try: socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'gold?')
                except OSError: pass
                return question.get_new_branch_final_answer()
    ''')
    try:
        r = evaluate_file(p, 'N', {}, toy_store, seeds=[0])
    finally:
        stop.set(); th.join(2); srv.close()
    assert r['error'] is None, r['error']
    assert got == []


def test_data_and_repo_are_invisible(tmp_path, toy_store, bwrap):
    repo = Path(__file__).resolve().parents[1]
    secrets = [str(repo / 'settings.ini'), str(repo / 'nbs'), str(tmp_path / 'secret.txt')]
    home = Path.home()
    # the home folder may hold the Python installation (bound read-only); nothing else of it may show
    allowed = {Path(p).relative_to(home).parts[0] for p in (sys.base_prefix, sys.prefix) if Path(p).is_relative_to(home)}
    (tmp_path / 'secret.txt').write_text('gold')
    data = find_data_dir()
    if data is not None: secrets.append(str(data))
    p = write(tmp_path, 'reader.py', f'''
        import os
        class R:
            def __init__(self, config=None): pass
            def solve(self, question):
                for s in {secrets!r}:
                    if os.path.exists(s) and (os.path.isfile(s) or os.listdir(s)):
                        raise RuntimeError('LEAK ' + s)
                if os.path.isdir({str(home)!r}) and set(os.listdir({str(home)!r})) - {allowed!r}:
                    raise RuntimeError('LEAK home ' + str(os.listdir({str(home)!r})))
                return question.get_new_branch_final_answer()
    ''')
    r = evaluate_file(p, 'R', {}, toy_store, seeds=[0])
    assert r['error'] is None, r['error']


def test_busy_loop_times_out(tmp_path, toy_store):
    p = write(tmp_path, 'busy.py', '''
        class B:
            def __init__(self, config=None): pass
            def solve(self, question):
                while True: pass
    ''')
    r = evaluate_file(p, 'B', {}, toy_store, seeds=[0], timeout=1.5)
    assert 'busy.py: timed out after 1.5 s' in r['error']


def test_memory_bomb_hits_the_limit(tmp_path, toy_store):
    p = write(tmp_path, 'bomb.py', '''
        class M:
            def __init__(self, config=None): pass
            def solve(self, question):
                x = []
                while True: x.append(bytearray(50 << 20))
    ''')
    r = evaluate_file(p, 'M', {}, toy_store, seeds=[0], memory_mb=512, timeout=30)
    assert r['error'].startswith('bomb.py: ') and 'memory' in r['error']


def test_faked_cost_and_peeked_answers_gain_nothing_on_the_trusted_path(tmp_path, toy_store):
    p = write(tmp_path, 'cheat.py', '''
        from collections import Counter
        class C:
            def __init__(self, config=None): pass
            def solve(self, question):
                a, _, _ = question.probe_new()
                question._total = 0; question._cost_per_branch[:] = [0] * len(question._cost_per_branch)
                finals = [b[2] for b in question._branches]          # read every final answer without paying
                return Counter(finals).most_common(1)[0][0]
    ''')
    r = evaluate_file(p, 'C', {}, toy_store, seeds=range(4), trusted=True)
    assert r['error'] is None
    o = toy_store.orders(range(4))
    first = [(toy_store.n_probes[q, o[s, q, 0]] > 0, o[s, q, 0], q) for s in range(4) for q in range(3)]
    cost = [500 if has else int(toy_store.tokens[q, b]) for has, b, q in first]     # what the one logged probe_new costs
    ans = [toy_store.vocab[q][toy_store.probes[q, b, 0] if has else toy_store.finals[q, b]] for has, b, q in first]
    assert r['avg_tokens'] == pytest.approx(sum(cost) / 12)
    # the peeked plurality is '7' everywhere; it counts only where the logged probe revealed '7'
    assert r['acc'] == pytest.approx(100 * ans.count('7') / 12) and r['unrevealed'] == 12 - ans.count('7')
    assert ans.count('7') < 12


def test_ours_api_faked_env_cost(tmp_path, toy_store):
    p = write(tmp_path, 'cheat_ours.py', '''
        class C:
            def run(self, env):
                a = env.read_whole(); env.read_whole()
                env.tokens_read[:] = [0] * len(env.tokens_read)
                return a
    ''')
    r = evaluate_file(p, 'C', {}, toy_store, seeds=range(3))
    ref = evaluate('sc:k=2', toy_store, range(3))
    assert r['error'] is None and r['api'] == 'ours'
    assert r['avg_tokens'] == pytest.approx(ref.avg_tokens)


# --- failures are one line ------------------------------------------------------------------------------

@pytest.mark.parametrize('code,cls,msg', [
    ('class A(:\n', 'A', 'bad.py: syntax error at line 1'),
    ('class A:\n    def solve(self, q): return None\n', 'B', "bad.py: no top-level class 'B'"),
    ('class A:\n    def __init__(self, config=None): pass\n    def solve(self, q):\n        raise KeyError("x")\n', 'A',
     "bad.py: KeyError running A (seed 0, question {q}) at line 4"),
    ('import no_such_module_here\nclass A:\n    def solve(self, q): pass\n', 'A', "bad.py: loading the file failed at line 1: ModuleNotFoundError"),
])
@pytest.mark.parametrize('trusted', [False, True])
def test_failures_are_one_line(tmp_path, toy_store, code, cls, msg, trusted):
    r = evaluate_file(write(tmp_path, 'bad.py', code), cls, {}, toy_store, seeds=[0], trusted=trusted)
    msg = msg.format(q=0 if trusted else presentation_order(toy_store, 0)[0])      # the first question each path presents
    assert msg in r['error'] and '\n' not in r['error']
    assert check_controller_source(code, cls) is None or 'line 1' in msg or 'no top-level' in msg


def test_grid_error_rows(tmp_path, toy_store):
    cls, src = example_controller('authors_sc')
    g = evaluate_file_grid(write(tmp_path, 'sc.py', src), cls, [{'k': 1}, {'k': 'x'}], [toy_store, toy_store], seeds=range(2))
    assert len(g) == 4 and g.error.notna().tolist() == [False, True, False, True]


def test_cli_json_and_exit_code(tmp_path, data_root, capsys):
    from tmas_nb.cli import main
    cls, src = example_controller('authors_sc')
    p = write(tmp_path, 'sc.py', src)
    args = ['replay', 'eval', '--data-dir', str(data_root), '--model', 'Qwen3-4B', '--benchmark', 'aime24', '--seeds', '2',
            '--json', '--controller-file', str(p)]
    assert main(args + ['--controller-class', cls, '--controller-config', '{"k": 4}']) == 0
    d = json.loads(capsys.readouterr().out)
    ref = evaluate('sc:k=4', load_store('Qwen3-4B', 'aime24', data_root), range(2))
    assert {'acc', 'avg_tokens', 'ci_low', 'ci_high'} <= set(d) and d['acc'] == pytest.approx(ref.acc)
    assert d['avg_tokens'] == pytest.approx(ref.avg_tokens)
    bad = subprocess.run([sys.executable, '-m', 'tmas_nb.cli'] + args + ['--controller-class', 'Missing'],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith('tmas: error: sc.py: no top-level class')
    assert 'Traceback' not in bad.stderr
    out = tmp_path / 'g.csv'
    assert main(['replay', 'grid', '--data-dir', str(data_root), '--models', 'Qwen3-4B', '--benchmarks', 'aime24', '--seeds', '2',
                 '--controller-file', str(p), '--controller-class', cls, '--controller-configs', '[{"k": 1}, {"k": "x"}]',
                 '--out', str(out)]) == 0
    import pandas as pd
    g = pd.read_csv(out)
    assert len(g) == 2 and g.error.isna().tolist() == [True, False]


def test_fallback_without_bubblewrap_warns_and_still_limits(tmp_path, toy_store, monkeypatch):
    from tmas_nb.autotts import files
    monkeypatch.setenv('TMAS_SANDBOX', 'rlimits'); files.sandbox_mode.cache_clear(); files._WARNED.clear()
    try:
        with pytest.warns(RuntimeWarning, match='CAN read and write your files'):
            assert files.sandbox_mode() == 'rlimits'
        cls, src = example_controller('authors_sc')
        r = evaluate_file(write(tmp_path, 'sc.py', src), cls, {'k': 3}, toy_store, seeds=range(2))
        assert r['error'] is None and r['sandbox'] == 'rlimits'
        assert r['acc'] == pytest.approx(evaluate('sc:k=3', toy_store, range(2)).acc)
        p = write(tmp_path, 'busy.py', 'class B:\n    def __init__(self, config=None): pass\n    def solve(self, q):\n        while True: pass\n')
        assert 'timed out' in evaluate_file(p, 'B', {}, toy_store, seeds=[0], timeout=1)['error']
    finally:
        monkeypatch.delenv('TMAS_SANDBOX'); files.sandbox_mode.cache_clear()


def test_forged_protocol_lines_gain_nothing(tmp_path, toy_store):
    p = write(tmp_path, 'forge.py', '''
        import os
        class F:
            def __init__(self, config=None): pass
            def solve(self, question):
                line = b'{"t": 0, "s": 0, "a": ["7", "7", "7"], "l": [[], [], []]}\\n{"t": 0, "end": 1}\\n'
                for fd in range(3, 12):
                    try: os.write(fd, line)
                    except OSError: pass
                os._exit(0)
    ''')
    r = evaluate_file(p, 'F', {}, toy_store, seeds=range(2))
    assert r['error'] is not None and 'forge.py: ' in r['error']
    r = evaluate_file(p, 'F', {}, toy_store, seeds=[0])
    # one seed "reported" with unrevealed answers: scored honestly as wrong at zero cost, or refused
    assert r['error'] is not None or (r['acc'] == 0 and r['unrevealed'] == 3)


# --- seeds split over jobs: identical results, split only where provably exact ------------------------

SPLIT_CASES = {
    'Counting': ('''
        class Counting:                  # the instance counts questions: the answer depends on every earlier seed
            def __init__(self, config=None): self.n = 0
            def solve(self, question):
                self.n += 1
                for _ in range(1 + self.n % 3): a = question.get_new_branch_final_answer()
                return a
    ''', [2, 1]),
    'GlobalCount': ('''
        SEEN = []                         # the module keeps what the instance does not
        class GlobalCount:
            def __init__(self, config=None): pass
            def solve(self, question):
                SEEN.append(1)
                return question.probe_new()[0] if len(SEEN) % 5 else '3'
    ''', [2, 1]),
    'LastTrace': ('''
        class LastTrace:                  # keeps only the last question's trace, as the authors' controllers do
            def __init__(self, config=None): self.trace = []
            def solve(self, question):
                self.trace = []
                a, i, _ = question.probe_new(); self.trace.append(a)
                b, _ = question.probe_more(i); self.trace.append(b)
                return b if self.config_k(a, b) else a
            def config_k(self, a, b): return len(self.trace) == 2 and a != b
    ''', [2]),
}


@pytest.mark.parametrize('cls', list(SPLIT_CASES))
def test_jobs_identical_and_split_only_when_exact(tmp_path, toy_store, monkeypatch, cls):
    """The trusted path: seeds split over children with a warm-up question (the safe path's lanes: test_replay_safe.py)."""
    from tmas_nb.autotts import files
    code, expect = SPLIT_CASES[cls]
    p = write(tmp_path, f'{cls}.py', code)
    runs, orig = [], files._run_chunks
    monkeypatch.setattr(files, '_run_chunks', lambda job, configs, chunks, *a: runs.append(len(chunks)) or orig(job, configs, chunks, *a))
    cfgs = [{'b': 1}, {'b': 2}]
    one = files.evaluate_file_configs(p, cls, cfgs, toy_store, seeds=range(6), jobs=1, trusted=True)
    test_runs, runs[:] = list(runs), []
    two = files.evaluate_file_configs(p, cls, cfgs, toy_store, seeds=range(6), jobs=2, trusted=True)
    assert test_runs == [1] and runs == expect          # [2]: the split was proven exact; [2, 1]: redone in one child
    for a, b in zip(one, two):
        assert a.error is None and b.error is None, (a.error, b.error)
        da, db = a.to_dict(), b.to_dict()
        da.pop('seconds'); db.pop('seconds')
        assert da == db


def test_discovery_cache_never_evaluates_an_unchanged_file_beta_and_store_twice(tmp_path, toy_store, monkeypatch):
    from tmas_nb.autotts import discovery
    from tmas_nb.settings import SandboxSettings
    calls, orig = [], discovery.evaluate_file_configs
    monkeypatch.setattr(discovery, 'evaluate_file_configs', lambda *a, **k: calls.append(a[2]) or orig(*a, **k))
    p = write(tmp_path, 'method.py', SPLIT_CASES['LastTrace'][0].replace('LastTrace', discovery.CLASS_NAME))
    ev = lambda st: discovery.cached_evaluation(tmp_path / 'cache', p, [{'beta': 0.5}, {'beta': 1}], st, [0, 1], SandboxSettings(), False)
    first, again = ev(toy_store), ev(toy_store)
    assert len(calls) == 1 and [r.to_dict() for r in first] == [r.to_dict() for r in again]
    other = ReplayStore.from_records([dict(r, gold_answer='3') for r in RECS], name='toy')
    ev(other); assert len(calls) == 2                                   # another store: evaluated
    p.write_text(p.read_text() + '\n# edited\n'); ev(toy_store); assert len(calls) == 3   # an edited file: evaluated


def test_discovery_cache_evaluates_only_the_configurations_it_lacks(tmp_path, toy_store, monkeypatch):
    from tmas_nb.autotts import discovery
    from tmas_nb.settings import SandboxSettings
    calls, orig = [], discovery.evaluate_file_configs
    monkeypatch.setattr(discovery, 'evaluate_file_configs', lambda *a, **k: calls.append([c['beta'] for c in a[2]]) or orig(*a, **k))
    p = write(tmp_path, 'method.py', f'''
        class {discovery.CLASS_NAME}:             # reads 1 + 2*beta whole branches: the cost grows with beta
            def __init__(self, config=None): self.n = 1 + round(2 * (config or {{}}).get('beta', 0))
            def solve(self, question):
                answers = [question.get_new_branch_final_answer() for _ in range(self.n)]
                return max(answers, key=answers.count)
    ''')
    ev = lambda betas, cache='cache': discovery.cached_evaluation(tmp_path / cache, p, [{'beta': b} for b in betas], toy_store, [0, 1, 2],
                                                                   SandboxSettings(), False)
    two, three, back = ev([0, 0.5]), ev([0, 0.5, 1]), ev([1, 0])
    assert calls == [[0, 0.5], [1]]                                  # the added beta alone, once; a reordered list is read back
    fresh = ev([0, 0.5, 1], 'fresh')                                 # an empty cache: the three in one call
    assert calls[-1] == [0, 0.5, 1]
    plain = lambda rs: [dict(r.to_dict(), seconds=None) for r in rs]
    assert all(r.error is None for r in fresh) and len({r.avg_tokens for r in fresh}) == 3   # three different results
    assert plain(three) == plain(fresh) and plain(two) == plain(fresh[:2]) and plain(back) == plain([fresh[2], fresh[0]])
