"""Controller files we did not write, evaluated on the safe path: the sandboxed child holds nothing of the store it has
not paid for (no unread branch, no gold answer, no question text, no question order it could map to a remembered answer
key); a ceiling on branches fails the episodes that pass it, counted and traced; the result pipe is a protocol whose
deadlines the child cannot move and whose frames cannot grow the parent. Every test here failed on the evaluator that gave
the child the whole store and read its result lines as JSON."""
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tmas_nb import sandbox
from tmas_nb.autotts.store import ReplayStore
from tmas_nb.autotts.files import evaluate_file, evaluate_file_configs, evaluate_file_grid
from tmas_nb.autotts.safe import presentation_order


def write(tmp_path, name, code):
    p = tmp_path / name
    p.write_text(textwrap.dedent(code))
    return p


def record(q, gold, branches):
    return {'question': f'What is problem {q}?', 'gold_answer': gold, 'probe_freq': 500, 'final_answers_trace': [],
            'each_branch': branches}


# Three of five branches end in the gold '7'; which one a seed opens first decides an honest one-branch reader.
PEEK_BRANCHES = [[['3', '7'], 1400, '7'], [['3'], 2900, '3'], [['7'], 800, '7'], [['5', '3'], 2500, '3'], [[], 300, '7']]


@pytest.fixture(scope='module')
def peek_store():
    return ReplayStore.from_records([record(q, '7', PEEK_BRANCHES) for q in range(4)], name='peek')


@pytest.fixture(params=['cgroup', 'rlimit'])
def enforcement(request, monkeypatch):
    """Under both ways of enforcing the sandbox budget (the cgroup one where cgroups can be made here), in this process and
    in the processes it starts."""
    sandbox.limits_enforcement.cache_clear()
    if request.param == 'rlimit':
        monkeypatch.setenv('TMAS_SANDBOX_LIMITS', 'rlimit')
    elif sandbox.limits_enforcement() != 'cgroup':
        sandbox.limits_enforcement.cache_clear()
        pytest.skip('no cgroup can be made on this machine (not root, no delegated cgroup): only the rlimit budget applies')
    sandbox.limits_enforcement.cache_clear()
    yield request.param
    monkeypatch.delenv('TMAS_SANDBOX_LIMITS', raising=False)
    sandbox.limits_enforcement.cache_clear()


# --- a controller reads what it has not paid for ----------------------------------------------------------------------

PEEK_HELPERS = '''
import gc, sys
def peek_finals(*objs):
    "Final answers of unread branches, wherever the child can reach them without paying; None if nowhere."
    def branches_of(o):
        try:
            br = o.get('each_branch') if isinstance(o, dict) else getattr(o, '_branches', None)
        except Exception: return None
        if isinstance(br, list) and br and all(isinstance(b, (list, tuple)) and len(b) == 3 for b in br): return [b[2] for b in br]
        return None
    for o in objs:
        f = branches_of(o)
        if f: return f
        try: return [o.store.vocab[o.question][int(x)] for x in o.store.finals[o.question][o.order]]   # ours: the store's arrays
        except Exception: pass
    fr = sys._getframe()
    while fr is not None:                                          # the evaluator's frames: records, stores
        for v in list(fr.f_locals.values()):
            f = branches_of(v)
            if f: return f
        fr = fr.f_back
    for o in gc.get_objects():                                     # anything alive in the process
        f = branches_of(o)
        if f: return f
    return None
'''


def test_unread_branches_are_not_in_the_child_authors_api(tmp_path, peek_store, enforcement):
    """The exploit of the issue: look at the unread branches, pick the majority's cheapest branch, read only that one
    (`probe_more` with a negative index reaches any unopened branch). Before: 100 % at one short branch per question."""
    cheat = write(tmp_path, 'peek.py', PEEK_HELPERS + '''
class Peek:
    def __init__(self, config=None): pass
    def solve(self, question):
        finals = peek_finals(question)
        if finals:
            target = max(set(finals), key=finals.count); n = len(finals)
            i = finals.index(target)
            a, fin = question.probe_more(i - n)
            while not fin: a, fin = question.probe_more(i - n)
            return a
        a, i, fin = question.probe_new()                             # nothing to look at: one branch, honestly
        while not fin: a, fin = question.probe_more(i)
        return a
''')
    honest = write(tmp_path, 'honest.py', '''
class One:
    def __init__(self, config=None): pass
    def solve(self, question):
        a, i, fin = question.probe_new()
        while not fin: a, fin = question.probe_more(i)
        return a
''')
    r = evaluate_file(cheat, 'Peek', {}, peek_store, seeds=range(6))
    h = evaluate_file(honest, 'One', {}, peek_store, seeds=range(6))
    assert r.error is None and h.error is None and r.eval_path == 'safe' and r.limits == enforcement
    assert (r.acc, r.avg_tokens, r.per_question_tokens) == (h.acc, h.avg_tokens, h.per_question_tokens)
    assert h.acc < 100


def test_unread_branches_are_not_in_the_child_our_api(tmp_path, peek_store):
    """Ours: `env.store` held every branch's final answer; a file could read whole branches until the peeked majority
    showed up. Now `env.store` turns this episode's answer numbers into strings, and nothing else."""
    cheat = write(tmp_path, 'peek_ours.py', PEEK_HELPERS + '''
class Peek:
    def run(self, env):
        finals = peek_finals(env)
        if finals:
            target = max(set(finals), key=finals.count)
            while True:
                a = env.read_whole()
                if a == target: return a
        return env.read_whole()
''')
    honest = write(tmp_path, 'honest_ours.py', '''
class One:
    def run(self, env): return env.read_whole()
''')
    r = evaluate_file(cheat, 'Peek', {}, peek_store, seeds=range(6))
    h = evaluate_file(honest, 'One', {}, peek_store, seeds=range(6))
    assert r.error is None and h.error is None and r.api == 'ours'
    assert (r.acc, r.avg_tokens) == (h.acc, h.avg_tokens) and h.acc < 100


# Eight questions with different gold answers; every question's branches end in each of the eight, so a file that knows
# the answer key can always read until its remembered answer shows up. It must not know which question it is on.
GOLDS = [str(10 + q) for q in range(8)]


@pytest.fixture(scope='module')
def keyed_store():
    recs = [record(q, GOLDS[q], [[[], 100 + 10 * j, GOLDS[(q + j) % 8]] for j in range(8)]) for q in range(8)]
    return ReplayStore.from_records(recs, name='keyed')


REMEMBER = f'''
GOLDS = {GOLDS!r}                                    # the public answer key, in the benchmark's order
'''


def _fixed_points(store, seeds) -> float:
    "The accuracy of a file that answers position p with the answer key's p-th entry: right where the order keeps p."
    return 100 * sum(sum(q == p for p, q in enumerate(presentation_order(store, s))) for s in seeds) / (len(seeds) * store.n_questions)


def test_no_question_order_or_index_to_map_to_a_remembered_answer_key(tmp_path, keyed_store):
    """The issue's second exploit: an answer key in the benchmark's order, and the question found by counting calls (the
    authors' evaluator presents questions in the store's order) or by `env.question`. Before: 100 % for both APIs. Now
    each seed presents its questions in an order keyed by the store's content, and `env.question` is the position in it:
    the key is right only where that order happens to keep a question in place."""
    authors = write(tmp_path, 'key_authors.py', REMEMBER + '''
class Key:
    def __init__(self, config=None): self.n = 0
    def solve(self, question):
        target = GOLDS[self.n % len(GOLDS)]; self.n += 1
        while True:
            a = question.get_new_branch_final_answer()
            if a == target: return a
''')
    ours = write(tmp_path, 'key_ours.py', REMEMBER + '''
class Key:
    def run(self, env):
        target = GOLDS[env.question]
        while True:
            a = env.read_whole()
            if a == target: return a
''')
    seeds = range(5)
    want = _fixed_points(keyed_store, seeds)
    assert want < 50
    for p in (authors, ours):
        r = evaluate_file(p, 'Key', {}, keyed_store, seeds=seeds)
        assert r.error is None and r.unrevealed == 0
        assert r.acc == pytest.approx(want), (p.name, r.acc, want)
    # the trusted path keeps the authors' order: our own files may rely on it (and only our own files run there)
    assert evaluate_file(authors, 'Key', {}, keyed_store, seeds=seeds, trusted=True).acc == 100


def test_the_child_gets_no_question_text_or_gold(tmp_path, keyed_store):
    "Nothing in the child's memory holds a question's text or a gold answer it has not read."
    spy = write(tmp_path, 'spy.py', '''
import gc
class Spy:
    def __init__(self, config=None): pass
    def solve(self, question):
        found = set()
        for o in gc.get_objects():
            try:
                if isinstance(o, str) and o.startswith('What is problem'): found.add('text')
                if isinstance(o, dict) and 'gold_answer' in o: found.add('record')
                if isinstance(o, (list, tuple)) and len(o) > 2 and all(isinstance(x, str) and x.startswith('What is') for x in o):
                    found.add('questions')
            except Exception: pass
        if found: raise RuntimeError('FOUND ' + ','.join(sorted(found)))
        return question.get_new_branch_final_answer()
''')
    r = evaluate_file(spy, 'Spy', {}, keyed_store, seeds=[0])
    assert r.error is None, r.error


PROBING = '''
from tmas_nb.autotts.controllers import CMC
class Probing:                    # ours: PROBE and PRUNE are told to the parent without a reply
    def run(self, env):
        for _ in range(3): env.branch()
        seen = [env.probe(i) for i in range(3)]
        env.prune(0)
        while not env.finished(1): env.advance(1)
        return env.probe(1) if seen.count(seen[1]) > 1 else env.probe(2)
class MyCMC(CMC): pass            # a built-in as a file
'''


@pytest.mark.parametrize('cls,cfg,spec', [('Probing', {}, None), ('MyCMC', {'beta': 0.5}, 'cmc:beta=0.5')])
def test_probe_and_prune_of_our_api_on_the_safe_path(tmp_path, peek_store, cls, cfg, spec):
    """Ours: PROBE and PRUNE travel in the batch as actions without a reply. Before (a batch listing every told action
    as a note): the parent took them for answers it could not read and stopped the child. Now: the safe path gives the
    trusted path's scores and traces, and the built-ins' numbers."""
    from tmas_nb.autotts.evaluation import evaluate
    p = write(tmp_path, 'probing.py', PROBING)
    safe, trusted = (evaluate_file_configs(p, cls, [cfg], peek_store, seeds=range(4), keep_logs=True, trusted=t)[0] for t in (False, True))
    assert safe.error is None and trusted.error is None, (safe.error, trusted.error)
    assert (safe.eval_path, safe.api) == ('safe', 'ours')
    assert (safe.acc, safe.avg_tokens, safe.per_question_tokens, safe.trace_logs) == \
        (trusted.acc, trusted.avg_tokens, trusted.per_question_tokens, trusted.trace_logs)
    if spec:
        ref = evaluate(spec, peek_store, range(4))
        assert (safe.acc, safe.avg_tokens) == pytest.approx((ref.acc, ref.avg_tokens))


FORGE_MARK = '''
class ForgeMark:                  # on its last question, writes one of the parent's own marks into its requests (and
    def __init__(self, config=None): self.n = 0        # for an answer drops its real answer note: the counts add up)
    def solve(self, question):
        self.n += 1
        a = question.get_new_branch_final_answer()
        if self.n == 4:
            question._req += (question._lid, OP, -2)
            if DROP: question._hub.note = lambda *args, **kw: None
        return a
'''


@pytest.mark.parametrize('mark', ['answered', 'digested'])
def test_the_parents_own_marks_cannot_come_from_the_child(tmp_path, peek_store, mark):
    """The parent marks the answers and digests it has read (OP_ANSWERED with the answer's store id, OP_DIGESTED) before
    the kernel sees them. Before: a child that wrote those marks itself had them taken as read (here an answer given by
    store id, -2, which is never counted as unrevealed; a forged digest mark was skipped). Now: a mark the batch does not
    list as a note ends the child."""
    from tmas_nb.autotts.pipe import OP_ANSWERED, OP_DIGESTED
    op = OP_ANSWERED if mark == 'answered' else OP_DIGESTED
    p = write(tmp_path, 'forge_mark.py', FORGE_MARK.replace('OP,', f'{op},').replace('DROP', str(mark == 'answered')))
    r = evaluate_file(p, 'ForgeMark', {}, peek_store, seeds=[0])
    assert r.error and r.error.startswith('forge_mark.py: broke the protocol') and 'does not list as a note' in r.error, r.error


# --- the ceiling on branches -------------------------------------------------------------------------------------------

GREEDY = '''
class Greedy:                     # opens k branches, catching the refusal; answers the plurality of what it read
    def __init__(self, config=None): self.k = (config or {}).get('k', 99)
    def solve(self, question):
        seen = []
        try:
            for _ in range(self.k): seen.append(question.probe_new()[0])
        except ValueError: pass
        return max(seen, key=seen.count) if seen else None

class GreedyOurs:
    def __init__(self, k=99): self.k = k
    def run(self, env):
        seen = []
        try:
            for _ in range(self.k): seen.append(env.branch()[1])
        except ValueError: pass
        return max(seen, key=seen.count) if seen else None

class Reach:                      # one branch, then probe_more(-1): the last branch, past any ceiling below the width
    def __init__(self, config=None): pass
    def solve(self, question):
        a = question.probe_new()[0]
        try: a = question.probe_more(-1)[0]
        except ValueError: pass
        return a
'''


@pytest.mark.parametrize('trusted', [False, True])
def test_a_branch_past_the_ceiling_fails_its_episode_counted_and_traced(tmp_path, peek_store, trusted):
    """With max_branches=3 a fourth branch is refused, its episode fails (even though the file catches the refusal and
    answers the right plurality), every such episode is counted, and the trace says why. Under the ceiling nothing
    changes. Both APIs, both paths."""
    p = write(tmp_path, 'greedy.py', GREEDY)
    seeds, n = range(3), 3 * peek_store.n_questions
    for cls, over_cfg, under_cfg in [('Greedy', {'k': 5}, {'k': 3}), ('GreedyOurs', {'k': 5}, {'k': 3})]:
        over = evaluate_file_configs(p, cls, [over_cfg], peek_store, seeds, max_branches=3, keep_logs=True, trusted=trusted)[0]
        assert over.error is None, over.error
        assert (over.acc, over.over_max_branches, over.max_branches) == (0.0, n, 3)
        o, st = peek_store.orders(seeds), peek_store                     # the first read of three branches; the fourth is not charged
        want = sum(500 if st.n_probes[q, b] else st.tokens[q, b] for s in range(len(seeds)) for q in range(st.n_questions) for b in o[s, q, :3])
        assert over.avg_tokens == pytest.approx(want / n)
        assert len(over.trace_errors) == peek_store.n_questions
        assert all('max_branches=3' in e and 'the episode counts as failed' in e for e in over.trace_errors), over.trace_errors
        assert all(len(log) == 3 for _, log in over.trace_logs)        # the refused branch is not an action of the log
        under = evaluate_file(p, cls, under_cfg, peek_store, seeds, max_branches=3, trusted=trusted)
        free = evaluate_file(p, cls, under_cfg, peek_store, seeds, trusted=trusted)
        assert (under.acc, under.avg_tokens, under.over_max_branches) == (free.acc, free.avg_tokens, 0)
        assert free.max_branches is None and under.eval_path == over.eval_path == ('trusted' if trusted else 'safe')
    reach = evaluate_file(p, 'Reach', {}, peek_store, seeds, max_branches=2, trusted=trusted)
    assert (reach.acc, reach.over_max_branches) == (0.0, n)


def test_max_branches_flag_of_replay_eval(tmp_path, peek_store, capsys):
    from tmas_nb.cli import main
    from tmas_nb.autotts.authors_api import store_records
    d = tmp_path / 'data' / 'autotts_replay' / 'Toy'; d.mkdir(parents=True)
    (d / 'toy.json').write_text(json.dumps(store_records(peek_store)))
    p = write(tmp_path, 'greedy.py', GREEDY)
    base = ['replay', 'eval', '--data-dir', str(tmp_path / 'data'), '--model', 'Toy', '--benchmark', 'toy', '--seeds', '2']
    assert main(base + ['--controller-file', str(p), '--controller-class', 'Greedy', '--controller-config', '{"k": 5}',
                        '--max-branches', '3', '--json']) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out['eval_path'], out['max_branches'], out['over_max_branches'], out['acc']) == ('safe', 3, 8, 0.0)
    bad = subprocess.run([sys.executable, '-m', 'tmas_nb.cli'] + base + ['--controller', 'sc:k=2', '--max-branches', '3'],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().endswith('--max-branches applies to --controller-file only (a built-in controller has its own width)')


# --- lanes: many episodes in flight, proven to change nothing ------------------------------------------------------------

LANE_CASES = {
    'LastTrace': ('''
        class LastTrace:                  # keeps the last question's trace only, as the authors' controllers do
            def __init__(self, config=None): self.trace = []
            def solve(self, question):
                self.trace = []
                a, i, _ = question.probe_new(); self.trace.append(a)
                b, _ = question.probe_more(i); self.trace.append(b)
                return b if len(self.trace) == 2 and a != b else a
    ''', [(True, True)]),
    'Counting': ('''
        class Counting:                  # the instance counts questions: the answer depends on every earlier one
            def __init__(self, config=None): self.n = 0
            def solve(self, question):
                self.n += 1
                for _ in range(1 + self.n % 3): a = question.get_new_branch_final_answer()
                return a
    ''', [(True, True), (False, False)]),
    'GlobalCount': ('''
        SEEN = []                         # the module keeps what the instance does not
        class GlobalCount:
            def __init__(self, config=None): pass
            def solve(self, question):
                SEEN.append(1)
                return question.probe_new()[0] if len(SEEN) % 5 else '3'
    ''', [(True, True), (False, False)]),
    'UsesScipy': ('''
        from scipy.stats import beta as beta_dist
        class UsesScipy:                  # SciPy's beta in the module (its values are kept per call): still provable
            def __init__(self, config=None): pass
            def solve(self, question):
                a = [question.get_new_branch_final_answer() for _ in range(3)]
                return a[0] if beta_dist.cdf(0.5, 1 + a.count(a[0]), 1) < 0.5 else a[1]
    ''', [(True, True)]),
    'UsesRandom': ('''
        import random
        class UsesRandom:                 # the global generator: shared by the lanes, so never provable
            def __init__(self, config=None): pass
            def solve(self, question):
                for _ in range(1 + random.randrange(3)): a = question.get_new_branch_final_answer()
                return a
    ''', [(True, True), (False, False)]),
}


@pytest.mark.parametrize('cls', list(LANE_CASES))
def test_lanes_identical_to_one_lane_and_kept_only_when_proven(tmp_path, peek_store, monkeypatch, cls):
    """Lanes of 4 episodes (several per child, over 2 children): a file whose instance keeps only its last question's
    state is accepted as split; one that carries more is redone in one lane; the results equal one lane's either way."""
    from tmas_nb.autotts import safe
    code, expect = LANE_CASES[cls]
    p = write(tmp_path, f'{cls}.py', code)
    runs, orig = [], safe._SafeEval.run
    monkeypatch.setattr(safe._SafeEval, 'run', lambda self, lanes_on, check: runs.append((lanes_on, check)) or orig(self, lanes_on, check))
    cfgs = [{'b': 1}, {'b': 2}]
    monkeypatch.setattr(safe, '_EPISODES_PER_LANE', 10 ** 9)             # one lane: the serial run
    one = evaluate_file_configs(p, cls, cfgs, peek_store, seeds=range(6), jobs=1)
    runs.clear(); monkeypatch.setattr(safe, '_EPISODES_PER_LANE', 4)
    split = evaluate_file_configs(p, cls, cfgs, peek_store, seeds=range(6), jobs=2)
    assert runs == expect
    for a, b in zip(one, split):
        assert a.error is None and b.error is None, (a.error, b.error)
        da, db = a.to_dict(), b.to_dict()
        da.pop('seconds'); db.pop('seconds')
        assert da == db


# --- the result pipe is a protocol ---------------------------------------------------------------------------------------

FORGE = '''
import os, struct, time
try:
    from tmas_nb.autotts.pipe import frame, K_START
    START = frame(K_START, struct.pack('<I', 0))
except ImportError: START = b''
class Forge:
    def __init__(self, config=None): pass
    def solve(self, question):
        while True:                   # start lines, old and new, on every descriptor the protocol might use, for ever
            for fd in range(3, 12):
                for msg in ({kind!r}):
                    try: os.write(fd, msg)
                    except OSError: pass
            time.sleep(0.05)
'''


@pytest.mark.parametrize('trusted', [False, True])
@pytest.mark.parametrize('kind', ['lines', 'frames'])
def test_forged_starts_cannot_keep_an_evaluation_alive(tmp_path, peek_store, trusted, kind, enforcement):
    """Before: each forged `{"t": 0, "start": 1}` line restarted the task's deadline, so a `--timeout 2` evaluation never
    ended. Now a start is the parent's (safe path) or one per task (trusted path), and anything else ends the child."""
    msgs = "b'{\"t\": 0, \"start\": 1}\\n'," if kind == 'lines' else 'START,'
    p = write(tmp_path, 'forge.py', FORGE.replace('{kind!r}', msgs))
    out = {}
    th = threading.Thread(target=lambda: out.setdefault('r', evaluate_file(p, 'Forge', {}, peek_store, seeds=[0], timeout=2,
                                                                            trusted=trusted)), daemon=True)
    t0 = time.monotonic(); th.start(); th.join(40)
    assert not th.is_alive(), 'the evaluation is still running 40 s after a 2 s timeout'
    err = out['r'].error
    assert err.startswith('forge.py: ') and ('protocol' in err or 'timed out after 2 s' in err), err
    assert time.monotonic() - t0 < 30 and out['r'].limits == enforcement


FLOOD = '''
import os
class Flood:
    def __init__(self, config=None): pass
    def solve(self, question):
        line = b'{"t": 0, "s": 0, "a": [' + b'[],' * (20 << 20) + b'[]], "l": []}\\n'        # 60 MB of result line
        for _ in range(4):
            for fd in range(3, 12):
                view = memoryview(line)
                try:
                    while view: view = view[os.write(fd, view):]
                except OSError: pass
        return question.get_new_branch_final_answer()
'''

_MEASURE = r'''
import json, resource, sys
from tmas_nb.autotts.store import ReplayStore
from tmas_nb.autotts.files import evaluate_file
path, records, memory_mb = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
st = ReplayStore.from_records(records, name='peek')
ok = path.replace('flood.py', 'ok.py'); open(ok, 'w').write('class Flood:\n    def __init__(self, config=None): pass\n    def solve(self, q): return q.get_new_branch_final_answer()\n')
out = {}
for trusted in (False, True):
    evaluate_file(ok, 'Flood', {}, st, seeds=[0], memory_mb=memory_mb, trusted=trusted)      # load everything first
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = evaluate_file(path, 'Flood', {}, st, seeds=[0], memory_mb=memory_mb, timeout=60, trusted=trusted)
    out[str(trusted)] = dict(grew_mb=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024, error=r.error)
print(json.dumps(out))
'''


def test_result_floods_cannot_grow_the_parent(tmp_path, peek_store, enforcement):
    """Before: 240 MB of crafted result lines (the old line cap was 64 MB, parsed as JSON) took the parent past the
    sandbox's own budget. Now frames are capped before they are read: the parent's peak grows by less than a quarter of
    `memory_mb`, on both paths, under both limit modes."""
    from tmas_nb.autotts.authors_api import store_records
    p = write(tmp_path, 'flood.py', FLOOD)
    env = dict(os.environ, **({'TMAS_SANDBOX_LIMITS': 'rlimit'} if enforcement == 'rlimit' else {}))
    r = subprocess.run([sys.executable, '-c', _MEASURE, str(p), json.dumps(store_records(peek_store)[:1]), '512'],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for path, m in res.items():
        assert m['grew_mb'] < 512 / 4, (path, m)
        assert m['error'] and m['error'].startswith('flood.py: ') and 'protocol' in m['error'], (path, m)


def test_grid_and_results_say_which_path(tmp_path, peek_store):
    p = write(tmp_path, 'greedy.py', GREEDY)
    g = evaluate_file_grid(p, 'Greedy', [{'k': 2}], [peek_store], seeds=range(2), max_branches=4)
    assert g.eval_path.tolist() == ['safe'] and g.max_branches.tolist() == [4] and g.over_max_branches.tolist() == [0]
    g = evaluate_file_grid(p, 'Greedy', [{'k': 2}], [peek_store], seeds=range(2), trusted=True)
    assert g.eval_path.tolist() == ['trusted']


DEEP = '''
import os, struct, time
from tmas_nb.autotts.pipe import frame, K_DIGEST, K_ERROR
DEEP = b'[' * 200_000 + b']' * 200_000
T0 = struct.pack('<I', 0)
FRAMES = [frame(K_DIGEST, T0 + DEEP)] if {trusted} else [frame(K_ERROR, DEEP)]
class Deep:
    def __init__(self, config=None): pass
    def solve(self, question):
        for fd in range(3, 12):          # every descriptor the protocol might use
            for msg in FRAMES:
                view = memoryview(msg)
                try:
                    while view: view = view[os.write(fd, view):]
                except OSError: pass
        time.sleep(5)
        return question.get_new_branch_final_answer()
'''


@pytest.mark.parametrize('trusted', [False, True])
def test_a_frame_of_json_nested_200000_deep_is_a_one_line_protocol_error(tmp_path, peek_store, trusted):
    """Before: the parent read the child's JSON payload with `json.loads`, whose RecursionError at 200,000 levels escaped
    as a traceback out of the evaluation. Now it breaks the protocol: the child is stopped and the error is one line."""
    p = write(tmp_path, 'deep.py', DEEP.replace('{trusted}', str(trusted)))
    r = evaluate_file(p, 'Deep', {}, peek_store, seeds=[0], timeout=20, trusted=trusted)
    assert r.error.startswith('deep.py: ') and 'nested too deeply to read' in r.error and '\n' not in r.error, r.error
