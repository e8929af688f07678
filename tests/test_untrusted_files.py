"""Files we did not write are data: what a model wrote reaches the terminal with its control characters escaped (runs
show, summary, list, watch, replay show, error lines), and a replay store is checked before anything is allocated,
every malformed value refused with one line naming the file, question and field. The commands run through the real
`tmas` entry point of this environment, as root in CI."""
import asyncio
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.methods.tmas import TMASConfig
from tmas_nb.autotts.store import STORE_MAX_CELLS, ReplayStoreError, load_store_file
from tmas_nb.runs.start import start_run

from helpers import REPLIES, ScriptedLLM

TMAS = Path(sys.executable).with_name('tmas')          # the console script installed beside this interpreter
ENV = {**os.environ, 'HF_HUB_OFFLINE': '1', 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false'}
CONTROL = re.compile(r'[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]')   # all but newline and tab
OSC52 = '\x1b]52;c;ZWNobyBwd25lZA==\x07'              # a clipboard write
CLEAR = '\x1b[2J\x1b[H'


def tmas(*args, env=None, timeout=300, **kw):
    assert TMAS.is_file(), f'{TMAS} is missing: install the package into this environment (pip install -e .)'
    return subprocess.run([str(TMAS), *map(str, args)], capture_output=True, text=True, env=env or ENV, timeout=timeout, **kw)


def assert_escaped(r, *shown):
    "No control character but newline and tab in what the command printed; the escaped forms of `shown` are there."
    out = r.stdout + r.stderr
    assert not CONTROL.findall(out), f'raw control characters printed: {sorted(set(CONTROL.findall(out)))!r}\n{out[-2000:]}'
    for s in shown: assert s in out, (s, out[-2000:])


# ------------------------------------------------------------------ a run whose model wrote escape sequences

@pytest.fixture(scope='module')
def hostile_run(tmp_path_factory):
    "A TMAS run folder whose model replies carry terminal escapes (a clipboard write, a screen clear, C1 and bidi controls)."
    def experience(request, k):
        return json.dumps({'verified_anchors': [f'anchor {k} {CLEAR}', '6 times 7 is 42'], 'error_avoidance_heuristics': []})
    replies = {**REPLIES, 'experience': experience,
               'solution': f'{OSC52}Six sevens\r make 42{CLEAR}, \x9b31m so \u202eevil the answer is \\boxed{{42\x1b[0m}}.',
               'verification': f'Every step holds {OSC52}. Score: \\boxed{{1}}',
               'summary': f'Direct multiplication{CLEAR}.'}
    cfg = TMASConfig(n_candidates=2, n_verifications=1, iterations=2, embedder='hashing', max_new_tokens=32)
    out = tmp_path_factory.mktemp('hostile') / 'runs' / 'run'
    run = asyncio.run(start_run('tmas', demo_problems()[:1], cfg, out, model='scripted', llm=ScriptedLLM(replies),
                                benchmark='demo', progress=False))
    status = json.loads((out / 'status.json').read_text())
    status['updated'] = f'now{CLEAR}'
    status['progress']['roles'][f'solution{OSC52}'] = status['progress']['roles'].pop('solution')
    (out / 'status.json').write_text(json.dumps(status))
    return run


def test_runs_show_escapes_what_the_model_wrote(hostile_run):
    d, pid = hostile_run.run_dir, hostile_run.records.problem_id.iloc[0]
    r = tmas('runs', 'show', d)
    assert r.returncode == 0, r.stderr
    assert_escaped(r, '42\\x1b[0m')                                    # the answer column
    r = tmas('runs', 'show', d, '--problem', pid, '--full')
    assert r.returncode == 0, r.stderr
    assert_escaped(r, '\\x1b]52;c;ZWNobyBwd25lZA==\\x07Six sevens', 'make 42\\x1b[2J\\x1b[H', '\\x9b31m', '\\u202eevil',
                   'holds \\x1b]52;c;', 'multiplication\\x1b[2J', '+ Anchor: anchor 0 \\x1b[2J')   # replies, reviews, summaries, banks


def test_runs_summary_list_and_watch_escape_and_json_stays_json(hostile_run):
    d = hostile_run.run_dir
    r = tmas('runs', 'summary', d)
    assert r.returncode == 0, r.stderr
    assert_escaped(r, '42\\x1b[0m')
    r = tmas('runs', 'summary', d, '--json')
    assert r.returncode == 0 and not CONTROL.findall(r.stdout)
    s = json.loads(r.stdout)                                          # the encoder escapes: the text is there, as it was
    assert s['answers'][hostile_run.records.problem_id.iloc[0]]['answers'][0]['answer'] == '42\x1b[0m'
    odd = d.parent / f'copy{CLEAR}'                                   # a folder name a shipped archive may carry
    shutil.copytree(d, odd)
    r = tmas('runs', 'list', d.parent)
    assert r.returncode == 0, r.stderr
    assert_escaped(r, 'copy\\x1b[2J\\x1b[H')
    r = tmas('runs', 'watch', d, '--once')
    assert r.returncode == 0, r.stderr
    assert_escaped(r, 'solution\\x1b]52;c;', 'now\\x1b[2J')


def test_runs_show_reads_no_bank_file_outside_the_folder_or_through_a_link(hostile_run, tmp_path):
    bad = tmp_path / 'bad'
    shutil.copytree(hostile_run.run_dir, bad)
    pid = hostile_run.records.problem_id.iloc[0]
    cp = next(bad.glob('checkpoints/**/iter_0.json'))
    d = json.loads(cp.read_text())
    bank = next(iter(d['bank_files']))
    target = bad / d['bank_files'][bank]
    target.unlink(); os.mkfifo(target)                                # a FIFO in its place: refused, not waited on
    r = tmas('runs', 'show', bad, '--problem', pid, timeout=60)
    assert r.returncode == 2 and 'is not a regular file' in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    cp.write_text(json.dumps({**d, 'bank_files': {**d['bank_files'], bank: '../../../../../../etc/hostname'}}))
    r = tmas('runs', 'show', bad, '--problem', pid, timeout=60)
    assert r.returncode == 2 and 'which is not inside the run folder' in r.stderr, r.stderr

def test_run_files_are_read_without_following_links_or_waiting_on_fifos(hostile_run, tmp_path):
    "A folder from elsewhere: a FIFO as status.json, records.parquet a link to another run's, a checkpoint a link to /dev/zero."
    def one_line(r, *words):
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), r.stderr
    a = tmp_path / 'a'; shutil.copytree(hostile_run.run_dir, a)
    (a / 'status.json').unlink(); os.mkfifo(a / 'status.json')                  # before: the read waited for a writer
    one_line(tmas('runs', 'summary', a, timeout=60), 'status.json', 'not a regular file')
    b = tmp_path / 'b'; shutil.copytree(hostile_run.run_dir, b)
    (b / 'records.parquet').unlink(); (b / 'records.parquet').symlink_to(a / 'records.parquet')   # before: read through the link
    one_line(tmas('runs', 'summary', b, timeout=60), 'records.parquet', 'symbolic link')
    c = tmp_path / 'c'; shutil.copytree(hostile_run.run_dir, c)
    for f in ('records.parquet', 'banks.parquet', 'usage.json', 'calls.parquet'): (c / f).unlink(missing_ok=True)
    cp = next(c.glob('checkpoints/**/iter_0.json')); cp.unlink(); cp.symlink_to('/dev/zero')   # before: read until memory ran out
    one_line(tmas('runs', 'summary', c, timeout=60), 'iter_0.json', 'symbolic link')


def test_error_lines_escape_too(tmp_path):
    r = tmas('runs', 'show', tmp_path / f'gone{CLEAR}')
    assert r.returncode == 2 and r.stderr.startswith('tmas: error: ') and len(r.stderr.strip().splitlines()) == 1
    assert_escaped(r, 'gone\\x1b[2J')


# ------------------------------------------------------------------ replay stores

GOOD = {'question': 'q', 'gold_answer': '7', 'probe_freq': 500, 'each_branch': [[['7', '3'], 1200, '7'], [['3'], 600, '3']]}


def write_store(folder: Path, records, model='M', dataset='ds') -> Path:
    p = folder / model / f'{dataset}.json'
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(records if isinstance(records, str) else json.dumps(records, separators=(',', ':')))
    return p


def test_replay_show_escapes_the_store_and_the_answers(tmp_path):
    q = {**GOOD, 'question': f'What is 6 x 7?{OSC52}', 'gold_answer': f'42{CLEAR}',
         'each_branch': [[[f'42{CLEAR}', f'41{OSC52}'], 1200, f'42{CLEAR}'], [[f'41{OSC52}'], 600, f'41{OSC52}']]}
    write_store(tmp_path, [q])
    r = tmas('replay', 'show', '--data-dir', tmp_path, '--model', 'M', '--benchmark', 'ds', '--controller', 'sc:k=2',
             '--png', tmp_path / 'ep.png')
    assert r.returncode == 0, r.stderr
    assert_escaped(r, 'What is 6 x 7?\\x1b]52;c;ZWNobyBwd25lZA==\\x07', '(gold 42\\x1b[2J\\x1b[H)')
    assert (tmp_path / 'ep.png').is_file()


def cells_bomb() -> list:
    "About 87 KB of JSON whose dense arrays would be 1,000 questions x 1,000 branches x 2,000 probes (8 GB as int32)."
    small = {'question': '', 'gold_answer': '', 'probe_freq': 1, 'each_branch': [[[], 0, '']]}
    wide = {**small, 'each_branch': [[[], 0, '']] * 999 + [[[''] * 2000, 0, '']]}
    return [wide] + [small] * 999


def test_a_small_file_cannot_ask_for_gigabytes(tmp_path, monkeypatch):
    p = write_store(tmp_path, cells_bomb())
    assert p.stat().st_size < 90_000
    limit_as = lambda: resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))   # the old loader died of it
    r = tmas('replay', 'eval', '--data-dir', tmp_path, '--model', 'M', '--benchmark', 'ds', '--controller', 'sc:k=1',
             preexec_fn=limit_as)
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1
    assert (f'{p}: 1,000 questions x 1,000 branches x 2,000 probes = 2,000,000,000 cells, over the limit of '
            f'{STORE_MAX_CELLS:,} (TMAS_STORE_MAX_CELLS)') in r.stderr
    st = write_store(tmp_path, [GOOD] * 3, dataset='small')
    monkeypatch.setenv('TMAS_STORE_MAX_CELLS', '11')                 # 3 x 2 x 2 = 12 cells: over a limit of 11
    with pytest.raises(ReplayStoreError, match='= 12 cells, over the limit of 11'): load_store_file(st)
    monkeypatch.setenv('TMAS_STORE_MAX_CELLS', '12')                 # a real huge store: raise the limit
    assert load_store_file(st).probes.shape == (3, 2, 2)


def nested(depth: int) -> str:
    return '[' * depth + ']' * depth


MALFORMED = {   # name: (file text, where the one line says the problem is)
    'nested-field': (json.dumps([GOOD, {**GOOD, 'probe_freq': 'X'}]).replace('"X"', nested(100_000)), "question 1, field 'probe_freq'"),
    'nested-question': (json.dumps([{**GOOD, 'question': 'X'}]).replace('"X"', nested(100_000)), "question 0, field 'question'"),
    'Infinity': (json.dumps([{**GOOD, 'each_branch': [[['7'], 'X', '7']]}]).replace('"X"', 'Infinity'), "question 0, field 'each_branch[0][1]'"),
    'NaN': (json.dumps([{**GOOD, 'each_branch': [[['7'], 'X', '7']]}]).replace('"X"', 'NaN'), "question 0, field 'each_branch[0][1]'"),
    '1e308': (json.dumps([{**GOOD, 'each_branch': [[['7'], 1e308, '7']]}]), "question 0, field 'each_branch[0][1]'"),
    '4000-digits': (json.dumps([{**GOOD, 'each_branch': [[['7'], 'X', '7']]}]).replace('"X"', '9' * 4000), "question 0, field 'each_branch[0][1]'"),
    '5000-digits': (json.dumps([{**GOOD, 'each_branch': [[['7'], 'X', '7']]}]).replace('"X"', '9' * 5000), "question 0, field 'each_branch[0][1]'"),
    '4000-digit-probe_freq': (json.dumps([GOOD, {**GOOD, 'probe_freq': 'X'}]).replace('"X"', '9' * 4000), "question 1, field 'probe_freq'"),
    'float-probe_freq': (json.dumps([{**GOOD, 'probe_freq': 1e300}]), "question 0, field 'probe_freq'"),
}


@pytest.mark.parametrize('name', list(MALFORMED))
def test_malformed_values_are_one_line_naming_file_question_and_field(tmp_path, name):
    text, where = MALFORMED[name]
    p = write_store(tmp_path, text)
    with pytest.raises(ReplayStoreError) as e: load_store_file(p)
    msg = str(e.value)
    assert msg.startswith(f'{p}, {where}: ') and '\n' not in msg and len(msg) < 400, msg


def test_malformed_stores_through_the_command_line(tmp_path):
    for name in ('nested-field', 'Infinity', '5000-digits'):
        p = write_store(tmp_path / name, MALFORMED[name][0])
        r = tmas('replay', 'eval', '--data-dir', tmp_path / name, '--model', 'M', '--benchmark', 'ds', '--controller', 'sc:k=1',
                 timeout=120)
        assert r.returncode == 2 and r.stderr.startswith(f'tmas: error: {p}, {MALFORMED[name][1]}: '), r.stderr[-2000:]
        assert len(r.stderr.splitlines()) == 1


def test_store_files_are_regular_files_under_a_cap(tmp_path):
    p = write_store(tmp_path, [GOOD])
    link = tmp_path / 'M' / 'link.json'
    link.symlink_to(p)
    assert load_store_file(link).n_questions == 1                     # a path the user gave may be a link
    with pytest.raises(ReplayStoreError, match='is a symbolic link'):   # from a run folder or a workspace it may not
        load_store_file(link, follow_links=False)
    fifo = tmp_path / 'M' / 'fifo.json'
    os.mkfifo(fifo)
    with pytest.raises(ReplayStoreError, match='is not a regular file'): load_store_file(fifo)   # no hang
    with pytest.raises(ReplayStoreError, match=r'holds \d+ bytes, over the limit of 100 \(TMAS_STORE_MAX_BYTES raises it\)'):
        load_store_file(p, max_bytes=100)
    (tmp_path / 'M' / 'latin.json').write_bytes(json.dumps([GOOD]).replace('"q"', '"\\u00e9"').encode().replace(b'\\u00e9', b'\xe9'))
    with pytest.raises(ReplayStoreError, match='not UTF-8'): load_store_file(tmp_path / 'M' / 'latin.json')
