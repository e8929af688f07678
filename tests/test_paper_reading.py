"""How a run is read against the papers: the problem list every run records and the hard subset's grading, the
ablation report's commands, the Hybrid-RL novelty judge, the AutoTTS discovery workspace, and the statistics of RSE
Table 7, TMAS Figure 8 and `tmas compare`. Each test fails on the code before these changes."""
import contextlib
import io
import json

from tmas_nb.cli import main


def _cli(*argv):
    "(exit code, stdout, stderr) of `tmas ARGV`, in process."
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err): rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------ item 4: which problems a number stands on

def test_hard_subset_grades_by_judge_unless_rules_are_asked_for(tmp_path):
    "No --judge and no --rules: refused before any model loads (was: rule grading, which puts solved problems in the hard pool)."
    out = tmp_path / 'ids.txt'
    rc, _, err = _cli('data', 'hard-subset', '--benchmark', 'demo', '--model', 'smollm2', '--limit', '1', '--quiet', '--out', str(out))
    assert rc == 2 and err.strip().startswith('tmas: error: tmas data hard-subset: pass --judge MODEL_OR_URL') and '--rules' in err
    assert not out.exists() and not (tmp_path / 'ids.txt.calls.sqlite').exists()


def test_every_run_records_the_digest_and_origin_of_its_problem_list(tmp_path):
    from tmas_nb.data import problem_list_digest, write_problem_ids
    ids = tmp_path / 'ids.txt'
    write_problem_ids(ids, ['demo-03', 'demo-01'], {'made by': 'tmas data hard-subset', 'model': 'Qwen3-4B-Thinking-2507', 'samples': 8})
    rc, out, err = _cli('run', '--method', 'mv', '--benchmark', 'demo', '--problem-ids', str(ids), '--print-config')
    assert rc == 0, err
    pl = json.loads(out)['protocol']['problem_list']['value']
    assert (pl['problems'], pl['sha256'], pl['whole_benchmark']) == (2, problem_list_digest(['demo-01', 'demo-03']), False)
    assert pl['made_by'] == {'made by': 'tmas data hard-subset', 'model': 'Qwen3-4B-Thinking-2507', 'samples': 8}
    rc, out, _ = _cli('run', '--method', 'mv', '--benchmark', 'demo', '--print-config')
    pl = json.loads(out)['protocol']['problem_list']['value']
    assert (pl['problems'], pl['whole_benchmark']) == (30, True) and 'made_by' not in pl
