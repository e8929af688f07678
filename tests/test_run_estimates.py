"""Estimates before a run, progress during it, facts after it (`tmas run --dry-run`, status.json, `tmas runs summary`,
`tmas runs list`, `tmas run --help`).

One real run of the packaged model (one demo problem, TMAS with N=2, M=1, T=1 at 8 tokens, so every output is cut by
the limit) is measured and compared with the dry-run's estimate of the same command, made on the same machine without
an engine calibration (the estimate then times the model for a few seconds)."""
import asyncio
import contextlib
import io
import json
import re

import pytest

from tmas_nb.cli import build_parser, main

ARGS = ['--method', 'tmas', '--benchmark', 'demo', '--model', 'default', '--limit', '1', '--n-candidates', '2',
        '--n-verifications', '1', '--iterations', '1', '--max-new-tokens', '8']


def _seconds(text: str) -> float:
    "The seconds of 'wall time: about 42 s' (or '3.5 min', '2.1 h')."
    m = re.search(r'wall time: about ([\d.]+) (s|min|h)\b', text)
    assert m, text
    return float(m[1]) * {'s': 1, 'min': 60, 'h': 3600}[m[2]]


def _calls(text: str) -> dict:
    "{role: planned calls} from the dry-run's lines '  solution   2 calls, ...'."
    return {m[1]: int(m[2]) for m in re.finditer(r'^\s+(\w+)\s+(\d+) calls', text, re.M)}


def _cli(*argv, log=None) -> str:
    "The stdout of `tmas ARGV`; its stderr (the run's log) goes to the file `log` when given."
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err): assert main(list(argv)) == 0
    if log is not None: log.write_text(err.getvalue())
    return buf.getvalue()


@pytest.fixture(scope='module')
def measured(tmp_path_factory, data_root):
    "(dry-run text, run folder) of the same small command: the estimate first, then the real run."
    root = tmp_path_factory.mktemp('estimates')
    mp = pytest.MonkeyPatch()
    mp.setenv('TMAS_ENGINES_DIR', str(root / 'engines'))   # no calibration: auto stays on float32, the estimate measures
    (root / 'settings.json').write_text(json.dumps({'embedder': 'hashing', 'memory_retries': 0}))
    try:
        dry = _cli('run', *ARGS, '--config', str(root / 'settings.json'), '--dry-run')
        assert not (root / 'run').exists()
        _cli('run', *ARGS, '--config', str(root / 'settings.json'), '--out', str(root / 'run'), '--progress-every', '3600',
             log=root / 'run.log')
    finally: mp.undo()
    return dry, root / 'run'


def test_dry_run_matches_a_real_run(measured):
    """Calls per role exactly as the run made them; the wall time within a factor of 3 of the measured one. Both times are
    taken on a machine whose other test worker runs meanwhile (measured: 65 s estimated vs 75 s taken, and 67 s vs 30 s
    on another run), so the bound is the estimate's order of magnitude; its accuracy is a report's to measure."""
    dry, run = measured
    usage = json.loads((run / 'usage.json').read_text())['by_role']
    assert _calls(dry) == {r: d['calls'] for r, d in usage.items()} == {'solution': 2, 'verification': 2, 'summary': 2}
    wall = json.loads((run / 'status.json').read_text())['wall_s']
    est = _seconds(dry)
    print(f"estimated {est:.0f} s, measured {wall:.0f} s")
    assert wall / 3 <= est <= wall * 3, (est, wall, dry)
    assert 'ours float32' in dry and 'tmas engines calibrate' in dry      # the engine auto takes, and the one-line hint
    assert 'at most 48' in dry                                             # 6 samples x 8 tokens
    # what the run can decide, before it is run (tmas_nb.runs.estimates.power_sentence): one problem decides nothing
    assert '  power: 1 problem × 2 candidates: too few problems for a paired test' in dry


def test_status_carries_the_progress_and_the_estimate(measured):
    "status.json's progress per role equals usage.json (calls, samples, outputs cut); the estimate is kept beside it."
    _, run = measured
    st = json.loads((run / 'status.json').read_text())
    usage = json.loads((run / 'usage.json').read_text())['by_role']
    got = {r: (d['calls'], d['samples'], d['truncated']) for r, d in st['progress']['roles'].items()}
    assert got == {r: (d['calls'], d['samples'], d['truncated_samples']) for r, d in usage.items()}
    assert all(d['calls'] == d['calls_planned'] for d in st['progress']['roles'].values())
    assert st['complete'] and st['progress']['eta_s'] == 0 and st['progress']['tokens_per_s'] > 0
    p = st['progress']                                   # the packaged model in-process: nothing on a wire, nothing retried
    assert (p['problems_done'], p['problems'], p['calls'], p['calls_in_flight'], p['retried']) == (1, 1, 6, 0, 0), p
    assert p['iterations_done'] == p['iterations_planned'] and p['calls_per_s'] > 0
    assert st['estimate']['roles']['solution']['calls'] == 2 and st['estimate']['wall_s'] > 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out): assert main(['runs', 'watch', str(run), '--once']) == 0
    assert out.getvalue().startswith('complete, wall') and '2/2 calls' in out.getvalue()


def test_summary_says_wall_engine_cut_share_and_warns(measured):
    "8 tokens cut every solution: the summary says so per role, warns, and shows the answers per problem."
    _, run = measured
    text = _cli('runs', 'summary', str(run))
    assert re.search(r'wall time \d', text) and 'engine transformers (backend transformers)' in text, text
    assert 'solution 2/2 (100%)' in text and 'warning: 100% of the solution outputs' in text, text
    assert 'answers in the last iteration' in text and '(cut)' in text, text
    j = json.loads(_cli('runs', 'summary', str(run), '--json'))
    assert {'method', 'iterations', 'tokens_by_role', 'complete'} <= set(j)            # the keys it had
    assert j['truncated_by_role']['solution'] == {'truncated': 2, 'samples': 2, 'share': 1.0}
    assert j['engine'] == 'transformers' and j['wall_s'] > 0 and len(j['warnings']) >= 1
    assert [len(a['answers']) for a in j['answers'].values()] == [2]
    # each role's warning says what a cut output of that role costs: only the solutions' has no answer
    assert 'warning: 100% of the verification outputs (2/2)' in text and 'a cut review gives no score' in text, text
    assert 'a cut summary reaches the next iteration unfinished' in text and text.count('has no answer') == 1, text


def test_the_run_log_names_its_engine_once(measured):
    "The log of the measured run says which engine `--backend auto` took in one line, in the estimate's words."
    _, run = measured
    log = (run.parent / 'run.log').read_text()
    said = [l.strip() for l in log.splitlines() if 'engine:' in l]
    assert len(said) == 1 and said[0].startswith('engine: ours float32, as --backend auto chooses: the engines were not measured'), log[:3000]


def test_runs_list_finds_every_run(measured, tmp_path):
    "A second run (scripted) beside a copy of the real one: `tmas runs list` shows both, with method, Pass@1 and path."
    import shutil
    from helpers import REPLIES, ScriptedLLM
    from tmas_nb.data.benchmarks import demo_problems
    from tmas_nb.runs.start import start_run
    _, run = measured
    shutil.copytree(run, tmp_path / 'a' / 'real')
    asyncio.run(start_run('sampling', demo_problems()[:2], {'n_candidates': 2}, tmp_path / 'b' / 'scripted',
                          llm=ScriptedLLM(REPLIES), progress=False))
    text = _cli('runs', 'list', str(tmp_path))
    rows = [l for l in text.splitlines()[1:] if l.strip()]
    assert len(rows) == 2 and rows[0].startswith('tmas') and rows[1].startswith('sampling'), text
    assert str(tmp_path / 'a' / 'real') in rows[0] and ' True ' in rows[1], text


def test_run_help_shows_every_default():
    "No method flag says None: each shows what it resolves to, per method and preset."
    sub = next(a for a in build_parser()._actions if hasattr(a, 'choices') and isinstance(a.choices, dict))
    blocks = {b.split()[0]: ' '.join(b.split()) for b in sub.choices['run'].format_help().split('\n  --')[1:]}
    for flag, shown in [('n-candidates', '(default: 8;'), ('n-verifications', '(default: tmas 8, others 1; cpu-demo: 1)'),
                        ('epsilon', '(default: 0.2)'), ('max-new-tokens', '(default: 4096; tmas-paper: rse 38912, others 128000; rse-paper: 38912; cpu-demo: 256)'),
                        ('concurrency', '(default: 4)'), ('iterations', 'tmas 20'), ('limit', '(default: every problem)')]:
        assert shown in blocks[flag], (flag, blocks[flag])
