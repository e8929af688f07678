"""Grading against real benchmark answers (IMO-AnswerBench v2, HMMT Feb 2024/2025) and the `tmas grade` contract."""
import argparse, asyncio, concurrent.futures, json, logging, subprocess, sys, time

import pytest

from tmas_nb.data import grading
from tmas_nb.data.grading import (
    grade, grade_detail, grade_many, grade_many_detail, extract_answer_detail, answer_kind, clean_answer, pass_at_1,
    parse_verdict, judge, grade_cli, shutdown_pool)


@pytest.fixture(scope='module')
def golds(data_root):
    "Raw reference answers by (benchmark, id), read straight from the data files."
    import csv
    root = data_root / 'benchmarks'
    out = {}
    with open(root / 'imo_answerbench_v2.csv', encoding='utf-8', newline='') as f:
        for row in csv.DictReader(f): out['imo', row['Problem ID']] = row['Short Answer']
    for name in ('hmmt24', 'hmmt25'):
        for line in (root / f'{name}.jsonl').read_text(encoding='utf-8').splitlines():
            if line.strip():
                d = json.loads(line); out[name, str(d['question_id'])] = d['answer']
    yield out
    shutdown_pool()


# (benchmark, id, the raw answer as released, a correct prediction, a wrong prediction)
CASES = [
    # `$...$` wrapping, trailing period / newline / spaces
    ('imo', 'imo-bench-algebra-002', '$\\left\\lfloor \\log_{2}a\\right\\rfloor +1$.',
     r'The answer is $\boxed{\lfloor \log_2 a \rfloor + 1}$.', r'\boxed{\lceil \log_2 a \rceil}'),
    ('imo', 'imo-bench-algebra-012', '$\\frac{1}{2}$', r'\boxed{0.5}', r'\boxed{\frac{1}{3}}'),
    ('imo', 'imo-bench-number_theory-026', '$2^n$\n', r'\boxed{2^{n}}', r'\boxed{2^{n-1}}'),
    ('imo', 'imo-bench-number_theory-013', ' $(n-2)2^n +1$\n', r'\boxed{2^n (n-2) + 1}', r'\boxed{(n-1)2^n + 1}'),
    ('imo', 'imo-bench-algebra-014', '$2025^2 a(a-1)$ ', r'\boxed{2025^2(a^2-a)}', r'\boxed{2025 a(a-1)}'),
    # prose answers: compared as text, never by math-verify
    ('imo', 'imo-bench-algebra-051', 'odd $n$', r'\boxed{\text{all odd } n}', r'\boxed{\text{even } n}'),
    ('imo', 'imo-bench-algebra-069', 'even $n$', r'so the answer is $n$ even.', r'\boxed{\text{odd } n}'),
    ('imo', 'imo-bench-number_theory-034', 'All powers of 2\n', r'\boxed{\text{All powers of } 2}', r'\boxed{\text{All powers of } 3}'),
    ('imo', 'imo-bench-number_theory-007', 'n is prime\n', r'\boxed{n \text{ is prime}}', r'\boxed{n \text{ is odd}}'),
    ('imo', 'imo-bench-combinatorics-064', 'No positive integers', r'\boxed{\text{No positive integers.}}', r'\boxed{\text{All positive integers}}'),
    ('imo', 'imo-bench-number_theory-081', 'no solutions', r'Final answer: no solutions', r'\boxed{1}'),
    # intervals, unions and relations
    ('imo', 'imo-bench-algebra-028', '$(-\\infty , 0]$', r'\boxed{x \le 0}', r'\boxed{x < 0}'),
    ('imo', 'imo-bench-algebra-072', '$x\\geq-\\frac{6}{5}$  ', r'\boxed{[-\tfrac{6}{5}, \infty)}', r'\boxed{(-\frac{6}{5}, \infty)}'),
    ('imo', 'imo-bench-algebra-086', '$0 < k \\le \\frac{4}{9}$', r'\boxed{\left(0, \frac{4}{9}\right]}', r'\boxed{(0, \frac{4}{9})}'),
    ('imo', 'imo-bench-algebra-027', '$(-\\infty,-4)\\cup (-4,-\\frac{8}{3})$', r'\boxed{(-\infty,-4)\cup(-4,-8/3)}', r'\boxed{(-\infty,-8/3)}'),
    ('imo', 'imo-bench-algebra-048', '$[-6,5]$', r'\boxed{-6 \le x \le 5}', r'\boxed{[-5,6]}'),
    ('imo', 'imo-bench-algebra-065', '$0<c<1$', r'\boxed{c \in (0, 1)}', r'\boxed{c > 1}'),
    # fractions, decimals, \frac vs \dfrac, surds
    ('imo', 'imo-bench-combinatorics-011', '0.5', r'\boxed{\frac{1}{2}}', r'\boxed{0.25}'),
    ('imo', 'imo-bench-geometry-032', '1.75', r'\boxed{\dfrac{7}{4}}', r'\boxed{\frac{7}{5}}'),
    ('imo', 'imo-bench-number_theory-051', '6.5', r'\boxed{13/2}', r'\boxed{6}'),
    ('hmmt24', '4', '\\dfrac{24}{17}', r'so $f(0)=\boxed{\frac{24}{17}}$', r'\boxed{\frac{17}{24}}'),
    ('hmmt24', '28', '64(2-\\sqrt{3})', r'\boxed{128 - 64\sqrt{3}}', r'\boxed{64(2+\sqrt{3})}'),
    ('hmmt25', '8', '1-\\frac{2}{\\pi}', r'\boxed{\frac{\pi - 2}{\pi}}', r'\boxed{1-\frac{1}{\pi}}'),
    ('hmmt25', '30', '\\sqrt{\\frac{95}{24}}', r'\boxed{\frac{\sqrt{570}}{12}}', r'\boxed{\sqrt{\frac{95}{23}}}'),
    ('imo', 'imo-bench-algebra-043', '$\\sqrt{2}-1$', r'\boxed{\frac{1}{1+\sqrt{2}}}', r'\boxed{\sqrt{2}+1}'),
    ('imo', 'imo-bench-algebra-096', '$4\\cdot3^{2023}$', r'\boxed{4 \times 3^{2023}}', r'\boxed{4 \cdot 3^{2024}}'),
    ('imo', 'imo-bench-combinatorics-015', '$12^{10}$', r'\boxed{61917364224}', r'\boxed{12^{11}}'),
    ('imo', 'imo-bench-combinatorics-012', '$\\binom{2k}{k}^2$', r'\boxed{{2k \choose k}^2}', r'\boxed{\binom{2k}{k}}'),
    ('imo', 'imo-bench-geometry-028', '$180 - 2\\alpha$', r'\boxed{180^\circ - 2\alpha}', r'\boxed{180 - \alpha}'),
    ('imo', 'imo-bench-algebra-021', '-768', r'Answer: $-768$', r'\boxed{768}'),
    # tuples (ordered) and lists of all solutions (any order)
    ('imo', 'imo-bench-algebra-033', '$(4, 1, 2, 5, 134, 718240)$', r'\boxed{(4,1,2,5,134,718240)}', r'\boxed{(1,4,2,5,134,718240)}'),
    ('imo', 'imo-bench-algebra-067', '$(2, \\frac{1}{2}, \\frac{9}{4})$', r'\boxed{(2, 0.5, 2.25)}', r'\boxed{(0.5, 2, 2.25)}'),
    ('imo', 'imo-bench-number_theory-019', '(2,251,252)\n', r'\boxed{(2, 251, 252)}', r'\boxed{(2, 252, 251)}'),
    ('imo', 'imo-bench-number_theory-074', '(0, 0)', r'\boxed{(0,0)}', r'\boxed{(1,1)}'),
    ('hmmt24', '5', '-\\dfrac{13}{96}, \\dfrac{13}{40}', r'\boxed{\left(-\frac{13}{96}, \frac{13}{40}\right)}', r'\boxed{\left(\frac{13}{40}, -\frac{13}{96}\right)}'),
    ('imo', 'imo-bench-algebra-018', '2026, 2030', r'\boxed{2030, 2026}', r'\boxed{2026}'),
    ('imo', 'imo-bench-algebra-074', '3, 4', r'\boxed{3 \text{ and } 4}', r'\boxed{3, 4, 5}'),
    ('imo', 'imo-bench-number_theory-041', '2, 3, 4, 6, 8, 12, 24\n', r'\boxed{\{24, 12, 8, 6, 4, 3, 2\}}', r'\boxed{2, 3, 4, 6, 8, 12}'),
    ('hmmt24', '9', '0,i\\sqrt{6},-i\\sqrt{6}', r'\boxed{-i\sqrt{6}, 0, i\sqrt{6}}', r'\boxed{0, \sqrt{6}, -\sqrt{6}}'),
    ('imo', 'imo-bench-algebra-006', '$P(x)=-1, P(x)=x+1$', r'\boxed{P(x) = x + 1, P(x) = -1}', r'\boxed{P(x)=x-1, P(x)=-1}'),
    ('imo', 'imo-bench-number_theory-084', '5,-3', r'\boxed{-3, 5}', r'\boxed{5, 3}'),
]


def _id(c): return f'{c[0]}:{c[1]}'


def test_cases_are_many_and_real(golds):
    assert len(CASES) >= 30
    for bench, pid, raw, *_ in CASES: assert golds[bench, pid] == raw, f'{bench} {pid}: the data file now says {golds[bench, pid]!r}'


@pytest.mark.parametrize('case', CASES, ids=_id)
def test_real_answer_positive(golds, case):
    bench, pid, _, good, _bad = case
    r = grade_detail(good, golds[bench, pid])
    assert r.correct, r


@pytest.mark.parametrize('case', CASES, ids=_id)
def test_real_answer_negative(golds, case):
    bench, pid, _, _good, bad = case
    r = grade_detail(bad, golds[bench, pid])
    assert not r.correct, r


def test_every_gold_equals_itself_and_not_its_neighbour(golds):
    "All 460 released answers, boxed as written, grade as correct; the next problem's answer (when different) does not."
    keys = sorted(golds)
    raw = [golds[k] for k in keys]
    assert len(raw) == 460
    own = grade_many_detail([r'\boxed{' + clean_answer(a) + '}' for a in raw], raw, progress=False)
    assert [r for r in own if not r.correct] == []
    nxt = [clean_answer(raw[(i + 1) % len(raw)]) for i in range(len(raw))]
    other = grade_many([r'\boxed{' + b + '}' for b in nxt], raw, progress=False)
    wrongly = [(keys[i], raw[i], nxt[i]) for i, ok in enumerate(other) if ok and clean_answer(raw[i]) != nxt[i]]
    assert wrongly == []


def test_text_answers_never_reach_math_verify():
    assert answer_kind('No') == 'text' and answer_kind('Yes') == 'text'
    assert grade(r'\boxed{No}', 'No') and grade(r'\boxed{\text{no}}', 'No.')
    assert not grade(r'\boxed{On}', 'No') and not grade(r'\boxed{Yes}', 'No')
    assert grade(r'The final answer is \textbf{Yes}.', 'Yes')


def test_letters():
    assert answer_kind('(C)') == 'choice'
    assert grade(r'\boxed{C}', '(C)') and grade(r'\boxed{\text{(C)}}', 'C') and grade(r'\boxed{(C) 42}', 'C')
    assert not grade(r'\boxed{D}', 'C') and not grade(r'\boxed{Circle}', 'C')


def test_extraction_rules():
    assert extract_answer_detail(r'\boxed{1} then \boxed{\frac{a}{\sqrt{b}}}') == (r'\frac{a}{\sqrt{b}}', 'boxed')
    assert extract_answer_detail(r'\fbox{7}') == ('7', 'boxed')
    assert extract_answer_detail(r'so $\boxed 9$') == ('9', 'boxed')
    assert extract_answer_detail(r'\boxed{\{1, 2\}}') == (r'\{1, 2\}', 'boxed')
    assert extract_answer_detail('Thus the final answer is 12.') == ('12', 'answer_line')
    assert extract_answer_detail('lots of work\n\nAnswer: $\\frac{3}{4}$') == (r'\frac{3}{4}', 'answer_line')
    assert extract_answer_detail(r'we get \boxed{\frac{3}{') == (None, 'unclosed_box')
    assert extract_answer_detail('First, let us set up\nthe equations and') == (None, 'none')


def test_truncated_output_is_never_credited_without_a_box():
    assert not grade('... so the answer is 29', '29', finish_reason='length')
    assert grade('... so the answer is 29', '29', finish_reason='stop')
    assert not grade(r'... \boxed{29}. Let me double check this by', '29', finish_reason='length')
    assert grade(r'... \boxed{29}. Let me double check this by', '29', finish_reason='length', extract_truncated=True)
    assert grade_many(['the answer is 29'] * 2, ['29'] * 2, finish_reasons=['stop', 'length']) == [True, False]


def test_pool_works_from_threads():
    "math-verify's signal.alarm fails in threads; the process pool makes grading thread-safe."
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        res = list(ex.map(lambda i: grade(r'\boxed{' + f'\\frac{{{2 * i}}}{{{4 * i}}}' + '}', '0.5'), range(1, 9)))
    assert res == [True] * 8


def _sleepy(*args):
    time.sleep(60)


def test_timeout_counts_as_wrong_and_recovers(monkeypatch, caplog):
    shutdown_pool(); grading.clear_grading_memo()
    monkeypatch.setattr(grading, 'math_equal_job', _sleepy)
    with caplog.at_level(logging.WARNING, logger='tmas_nb.data.grading'):
        r = grade_detail(r'\boxed{0.5}', '1/2', timeout=1)
    assert (r.correct, r.reason) == (False, 'timeout after 1 s')
    assert 'took over 1 s' in caplog.text
    monkeypatch.undo()
    assert grade(r'\boxed{0.5}', '1/2')


def test_each_distinct_comparison_runs_once_and_a_timeout_is_not_remembered(monkeypatch):
    "Eight candidates with two distinct answers cost two comparisons; a verdict from a time-out is asked again."
    grading.clear_grading_memo()
    texts = [r'\boxed{\frac{2}{4}}', r'\boxed{0.25}'] * 4
    assert grade_many(texts, ['0.5'] * 8) == [True, False] * 4
    assert dict(grading.COMPARISONS) == {'run': 2, 'remembered': 6}
    assert grade_many(texts[:2], ['0.5'] * 2) == [True, False]
    assert dict(grading.COMPARISONS) == {'run': 2, 'remembered': 8}
    shutdown_pool()
    monkeypatch.setattr(grading, 'math_equal_job', _sleepy)
    assert grade_detail(r'\boxed{0.7}', '0.7', timeout=1).reason == 'timeout after 1 s'
    monkeypatch.undo(); shutdown_pool()
    assert grade_detail(r'\boxed{0.7}', '0.7', timeout=1).correct      # compared again, not the remembered time-out
    assert grade_detail(r'\boxed{7}', '7').reason == 'integers'
    grading.clear_grading_memo()


def test_grade_errors_are_clear():
    with pytest.raises(ValueError, match='reference answer is empty'): grade(r'\boxed{1}', '')
    with pytest.raises(ValueError, match='2 predictions but 1 reference'): grade_many(['a', 'b'], ['1'])


def test_cli_contract_subprocess():
    def run(*args, stdin=None):
        return subprocess.run([sys.executable, '-m', 'tmas_nb.cli', 'grade', *args], capture_output=True, text=True, input=stdin, timeout=120)
    r = run('--gold', '$\\frac{1}{2}$', '--pred', r'so the answer is \boxed{0.5}')
    assert (r.returncode, r.stdout) == (0, 'true\n'), r.stderr
    r = run('--gold', 'No', '--pred', r'\boxed{On}')
    assert (r.returncode, r.stdout) == (0, 'false\n'), r.stderr
    r = run('--gold', '29', '--pred', '-', '--json', stdin='the answer is 29')
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d['correct'] is True and d['method'] == 'answer_line'
    r = run('--gold', '29', '--pred', 'the answer is 29', '--finish-reason', 'length')
    assert (r.returncode, r.stdout) == (0, 'false\n')
    r = run('--gold', ' ', '--pred', '1')
    assert r.returncode == 2 and r.stderr.startswith('tmas: error: ') and 'reference answer is empty' in r.stderr


def test_cli_grade_cli_on_own_parser(capsys):
    parser = argparse.ArgumentParser(prog='tmas grade')
    grade_cli(parser)
    assert '--gold' in parser.format_help()
    args = parser.parse_args(['--gold', '(-\\infty, 0]', '--pred', r'\boxed{x \le 0}'])
    assert args.func(args) == 0 and capsys.readouterr().out == 'true\n'
    from tmas_nb.cli import main
    assert main(['grade', '--gold', '3', '--pred', r'\boxed{4}']) == 0 and capsys.readouterr().out == 'false\n'


def test_judge_control_flow_and_pass_at_1():
    from helpers import ScriptedLLM
    llm = ScriptedLLM(['**CORRECT**', 'This is incorrect.', 'no verdict here', 'Correct'])
    out = asyncio.run(judge(llm, 'Find all n.', r'... \boxed{\text{odd } n}', 'odd $n$', runs=4))
    assert out == [True, False, False, True]
    req = llm.requests[0]
    assert (req.role, req.n) == ('judge', 4) and 'odd $n$' in req.messages[0]['content']
    assert parse_verdict('INCORRECT') is False and parse_verdict('') is None
    table = [[[1, 1, 0, 0], [1, 1, 1, 1]], [[0, 0, 0, 0], [1, 1, 1, 1]]]
    assert pass_at_1(table) == pytest.approx((0.75 + 0.5) / 2)


def test_judge_with_a_real_small_model():
    "The judge prompt through the packaged 135M model: one request with n=runs, one verdict (a bool) per run."
    from tmas_nb.llm.loading import load_llm
    llm = load_llm('smollm2')
    replies, generate = [], llm._generate

    async def recorded(requests):
        out = await generate(requests)
        replies.extend(c.text for cs in out for c in cs)
        return out
    llm._generate = recorded
    try: out = asyncio.run(judge(llm, 'What is 2 + 3?', r'2 + 3 = 5, so \boxed{5}', '5', runs=2, max_new_tokens=8))
    finally: llm.close()
    # each verdict is the model's own reply read by parse_verdict (no verdict counts as not correct)
    assert len(replies) == 2 and out == [parse_verdict(t) is True for t in replies], (replies, out)
    assert llm.usage.by_role['judge']['samples'] == 2


# ---------------------------------------------------------------- outputs of thinking models
def test_truncated_generation_has_no_answer():
    "A box written mid-thought before the token limit is not an answer (the CLI case of a new user)."
    cut = r'First try \boxed{7}. Hmm, let me recheck'
    assert extract_answer_detail(cut, 'length') == (None, 'truncated')
    r = grade_detail(cut, '7', finish_reason='length')
    assert (r.correct, r.answer, r.method) == (False, None, 'truncated')
    assert grade(cut, '7', finish_reason='length', extract_truncated=True)      # the lenient option keeps the old reading
    assert grade_many([cut, cut], ['7', '7'], ['length', 'stop']) == [False, True]


def test_cli_truncated_prediction_is_wrong():
    from tmas_nb.cli import main
    import contextlib, io
    args = ['grade', '--gold', '7', '--pred', 'First try \\boxed{7}. Hmm, let me recheck…', '--finish-reason', 'length']
    for extra, want in (([], 'false\n'), (['--answer-from-truncated'], 'true\n')):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf): assert main(args + extra) == 0
        assert buf.getvalue() == want


def test_answer_is_read_after_the_last_think_close_only():
    # the template opened <think>, so the output has only the closing tag
    assert extract_answer_detail(r'Maybe \boxed{3}? No.</think> So the answer is \boxed{4}.') == ('4', 'boxed')
    # closed twice: the answer follows the last one
    assert extract_answer_detail(r'a \boxed{1}</think>b \boxed{2}</think>\boxed{3}') == ('3', 'boxed')
    # finished inside an unclosed block: no response, so no answer
    assert extract_answer_detail(r'<think>I guess \boxed{5}') == (None, 'none')
    assert grade(r'<think>\boxed{5}</think> The answer is 6.', '6') and not grade(r'<think>\boxed{5}</think> The answer is 6.', '5')
    assert parse_verdict('CORRECT so far... </think> INCORRECT') is False


def test_run_option_answer_from_truncated_is_recorded_and_used(tmp_path):
    "`tmas run --answer-from-truncated` lands in the run config and switches the lenient reading on for that run."
    from helpers import ScriptedLLM
    from tmas_nb.cli import build_parser
    from tmas_nb.data.benchmarks import demo_problems
    from tmas_nb.methods.solve import run_method
    from tmas_nb.runs.start import config_from_args
    from tmas_nb.llm.core import Completion
    base = ['run', '--method', 'sampling', '--benchmark', 'demo', '--out', str(tmp_path / 'x')]
    assert config_from_args('sampling', build_parser().parse_args(base)).answer_from_truncated is False
    cfg = config_from_args('sampling', build_parser().parse_args(base + ['--answer-from-truncated']))
    assert cfg.answer_from_truncated is True and cfg.to_dict()['answer_from_truncated'] is True
    p = demo_problems()[0]
    class CutOff(ScriptedLLM):
        def _completion(self, text): return Completion.from_raw(text, opens_in_prompt=True, finish_reason='length', completion_tokens=9)
    for lenient in (False, True):
        llm = CutOff({'solution': rf'So \boxed{{{p.answer}}}, let me check again'})
        df = asyncio.run(run_method('sampling', [p], llm, {'n_candidates': 2, 'iterations': 1, 'answer_from_truncated': lenient},
                                    run_dir=tmp_path / str(lenient), progress=False))
        assert list(df.correct) == [lenient] * 2 and (df.finish_reason == 'length').all()
        assert df.solution.str.contains('let me check again').all()     # the cut-off text is kept in the record
