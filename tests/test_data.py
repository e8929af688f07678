"""Benchmark loaders on the real files, error messages for bad files, the demo set and subset builders."""
import asyncio, collections, json

import pytest

from tmas_nb.data.benchmarks import (
    Problem, ProblemFileError, load_problems, load_imo_answerbench, load_hmmt, load_jsonl_problems, load_benchmark,
    demo_problems, DEMO_PROBLEMS, first_k, stratified, hard_subset, BENCHMARKS)
from tmas_nb.runs.hard_subset import count_solves
from tmas_nb.data.grading import answer_kind, grade, shutdown_pool


@pytest.fixture(scope='module', autouse=True)
def _pool():
    yield
    shutdown_pool()


def test_imo_answerbench_real_file(data_root):
    ps = load_imo_answerbench()
    assert len(ps) == 400 and len({p.id for p in ps}) == 400
    cats = collections.Counter(p.meta['Category'] for p in ps)
    assert {'Algebra', 'Combinatorics', 'Geometry', 'Number theory'} <= set(cats)
    assert cats['Combinatorics'] == cats['Geometry'] == cats['Number theory'] == 100
    assert all(p.meta['benchmark'] == 'imo_answerbench' for p in ps)
    # one row of the released v2 file has its columns shifted left (no short answer; 'Algebra' in its place)
    shifted = [(p.id, p.answer, p.meta['Category']) for p in ps if p.meta['Source'] is None]
    assert shifted == [('imo-bench-algebra-036', 'Algebra', 'Functional Equation')]
    by_id = {p.id: p for p in ps}
    p = by_id['imo-bench-algebra-002']
    assert p.answer == r'\left\lfloor \log_{2}a\right\rfloor +1' and p.meta['raw_answer'] == '$\\left\\lfloor \\log_{2}a\\right\\rfloor +1$.'
    assert by_id['imo-bench-number_theory-034'].answer == 'All powers of 2'
    assert by_id['imo-bench-algebra-051'].answer == 'odd $n$'
    assert all(p.answer == p.answer.strip() and p.answer and not p.answer.endswith('.') for p in ps)
    assert load_benchmark('imo_answerbench') == ps


def test_hmmt_real_files(data_root):
    for name in ('hmmt24', 'hmmt25'):
        ps = load_hmmt(name)
        assert len(ps) == 30 and [p.id for p in ps] == [str(i) for i in range(1, 31)]
        assert all(p.meta['benchmark'] == name for p in ps)
        assert load_benchmark(name) == ps
        assert load_jsonl_problems(data_root / 'benchmarks' / f'{name}.jsonl') == ps
    assert load_hmmt('hmmt24')[4].answer == r'-\dfrac{13}{96}, \dfrac{13}{40}'


def test_generic_loader_column_mapping(tmp_path):
    f = tmp_path / 'hle_math_100.jsonl'
    f.write_text(''.join(json.dumps({'question_id': f'q{i}', 'question': f'What is {i}+{i}?', 'answer': str(2 * i), 'subject': 'arith'}) + '\n' for i in range(5)))
    ps = load_benchmark(str(f))
    assert [p.answer for p in ps] == ['0', '2', '4', '6', '8'] and ps[0].meta == {'subject': 'arith', 'benchmark': 'hle_math_100'}
    with pytest.raises(FileNotFoundError, match='put hle_math_100.jsonl'): load_benchmark('hle_math_100', data_dir=tmp_path)
    (tmp_path / 'benchmarks').mkdir()
    f.rename(tmp_path / 'benchmarks' / f.name)
    assert load_benchmark('hle_math_100', data_dir=tmp_path) == ps
    c = tmp_path / 'mine.csv'
    c.write_text('key,prompt,gold,level\nk1,"Add 2 and 3.",5,easy\nk2,"Multiply 2 and 3.", $6$ ,easy\n')
    ps = load_problems(c, id_col='key', question_col='prompt', answer_col='gold')
    assert [(p.id, p.answer, p.meta['level']) for p in ps] == [('k1', '5', 'easy'), ('k2', '6', 'easy')]
    assert ps[1].meta['raw_answer'] == ' $6$ '
    ps = load_problems(c, id_col=None, question_col='prompt', answer_col='gold')
    assert [p.id for p in ps] == ['mine-1', 'mine-2']


@pytest.mark.parametrize('content,needle', [
    ('{"question_id": 1, "question": "Q", "answer": "1"}\n{"question_id": 1, "question": "Q2", "answer": "2"}\n',
     "row 2: field 'question_id': id '1' was already used in row 1"),
    ('{"question_id": 1, "question": "Q", "answer": "1"}\n{"question_id": 2, "question": "Q2", "answer": ""}\n',
     "row 2 (id '2'): field 'answer' (the answer) is empty"),
    ('{"question_id": 1, "question": "Q", "answer": "1"}\n{"question_id": 2, "question": "Q2"}\n',
     "row 2 has no field 'answer'"),
    ('{"question_id": 1, "question": "Q", "answer": null}\n', "row 1 (id '1'): field 'answer' (the answer) is empty"),
    ('{"question_id": 1, "question": " ", "answer": "3"}\n', "field 'question' (the question) is empty"),
    ('{"question_id": 1, "question": "Q", "answer": "1"}\n{"question_id": 2, "question": "Q2", "answer": "2"\n',
     'row 2 is not valid JSON'),
    ('', 'holds no problems'),
])
def test_bad_jsonl_rows_are_named(tmp_path, content, needle):
    f = tmp_path / 'bad.jsonl'
    f.write_text(content)
    with pytest.raises(ProblemFileError) as e: load_jsonl_problems(f)
    assert str(f) in str(e.value) and needle in str(e.value)


def test_bad_csv_rows_are_named(tmp_path):
    f = tmp_path / 'imo.csv'
    f.write_text('Problem ID,Problem,Short Answer,Category,Subcategory,Source\n'
                 'a-1,"Find x.",3,Algebra,Sequence,Here\n'
                 'a-2,"Find y.",,Algebra,Sequence,There\n')
    with pytest.raises(ProblemFileError, match=r"row 2 \(id 'a-2'\): field 'Short Answer' \(the answer\) is empty"): load_imo_answerbench(f)
    f.write_text('Problem ID,Problem,Answer\na-1,"Find x.",3\n')
    with pytest.raises(ProblemFileError, match=r"header lacks the column\(s\) \['Short Answer', 'Category'"): load_imo_answerbench(f)
    with pytest.raises(FileNotFoundError, match='no such file'): load_imo_answerbench(f.with_name('absent.csv'))
    with pytest.raises(ValueError, match='neither a benchmark name'): load_benchmark('hmmt2030')


def test_demo_set_sanity():
    ps = demo_problems()
    assert len(ps) == len(DEMO_PROBLEMS) == 30 and len({p.id for p in ps}) == 30
    assert collections.Counter(p.meta['level'] for p in ps) == {1: 6, 2: 7, 3: 9, 4: 8}
    assert all(p.answer.isdigit() and answer_kind(p.answer) == 'math' for p in ps)
    assert len({p.question for p in ps}) == 30
    assert all(grade(r'\boxed{' + p.answer + '}', p.answer) and not grade(r'\boxed{' + str(int(p.answer) + 1) + '}', p.answer) for p in ps)
    assert load_benchmark('demo') == ps and 'demo' in BENCHMARKS


def test_problem_is_frozen_and_round_trips():
    p = demo_problems()[0]
    with pytest.raises(Exception): p.answer = '0'
    assert Problem.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_subsets_on_imo(data_root):
    ps = load_imo_answerbench()
    assert first_k(ps, 5) == ps[:5]
    s = stratified(ps, 40, by='Category', seed=0)
    assert len(s) == 40 and s == stratified(ps, 40, by='Category', seed=0) and s != stratified(ps, 40, by='Category', seed=1)
    cats = collections.Counter(p.meta['Category'] for p in s)
    assert [cats[c] for c in ('Algebra', 'Combinatorics', 'Geometry', 'Number theory')] == [10, 10, 10, 10]
    assert [p.id for p in s] == [p.id for p in ps if p in s]      # original order
    assert stratified(ps, 1000) == ps
    with pytest.raises(KeyError, match="has no meta field 'topic'"): stratified(ps, 3, by='topic')


def test_hard_subset_rule():
    ps = demo_problems()[:4]
    counts = {'demo-01': 8, 'demo-02': 2, 'demo-03': 1, 'demo-04': 0}
    assert [p.id for p in hard_subset(ps, counts)] == ['demo-03', 'demo-04']
    assert [p.id for p in hard_subset(ps, counts, threshold=3)] == ['demo-02', 'demo-03', 'demo-04']
    with pytest.raises(KeyError, match='no solve count for 1 problem'): hard_subset(ps, {k: v for k, v in counts.items() if k != 'demo-04'})


def test_count_solves_control_flow():
    "Pure control flow (batching, per-problem counts, truncated samples) with a scripted stand-in model."
    from tmas_nb.llm.core import LLM, Completion

    class KnowsTheAnswers(LLM):
        def __init__(self, answers): super().__init__('scripted'); self.answers, self.batches = answers, []
        async def _generate(self, requests):
            self.batches.append(len(requests))
            out = []
            for r in requests:
                q = r.messages[-1]['content']
                a = next(v for k, v in self.answers.items() if k in q)
                out.append([Completion(text=rf'\boxed{{{a}}}' if j < 3 else f'answer is {a}', finish_reason='stop' if j < 3 else 'length') for j in range(r.n)])
            return out

    ps = demo_problems()[:5]
    llm = KnowsTheAnswers({p.question: (p.answer if i % 2 == 0 else '0') for i, p in enumerate(ps)})
    c = asyncio.run(count_solves(llm, ps, samples=8, batch_size=2, progress=False))
    assert c == {'demo-01': 3, 'demo-02': 0, 'demo-03': 3, 'demo-04': 0, 'demo-05': 3}
    assert llm.batches == [2, 2, 1]
    assert [p.id for p in hard_subset(ps, c)] == ['demo-02', 'demo-04']


def test_count_solves_with_a_real_small_model():
    "End to end with the packaged 135M model on the CPU: requests go out, samples are graded, counts come back."
    from tmas_nb.llm.loading import load_llm
    ps = demo_problems()[:2]
    llm = load_llm('smollm2')
    try: c = asyncio.run(count_solves(llm, ps, samples=2, max_new_tokens=64, batch_size=2, progress=False))
    finally: llm.close()
    assert sorted(c) == ['demo-01', 'demo-02'] and all(0 <= v <= 2 for v in c.values())
    assert llm.usage.by_role['solution']['samples'] == 4


def test_hle_math_100_loads_by_name_and_the_tmas_input_format_as_a_file(tmp_path):
    hle = load_benchmark('hle_math_100')
    assert len(hle) == 100 and len({p.id for p in hle}) == 100 and all(p.answer for p in hle)
    assert hle[0].meta['benchmark'] == 'hle_math_100' and 'hle_raw_id' in hle[0].meta
    f = tmp_path / 'problems.jsonl'
    f.write_text('{"problem_id": "p-1", "question": "What is 2+2?", "answer": "4"}\n{"problem_id": "p-2", "question": "3*3?", "answer": "9"}\n')
    assert [(p.id, p.answer) for p in load_benchmark(str(f))] == [('p-1', '4'), ('p-2', '9')]
