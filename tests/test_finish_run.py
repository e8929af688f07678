"`finish_run` at the end of a large run: one problem's checkpoints in memory at a time, the same files as before."
import json, tracemalloc

import pandas as pd

from tmas_nb.core import atomic_write_json
from tmas_nb.methods.solve import checkpoint_path
from tmas_nb.runs.folder import ROWS_PER_GROUP, calls_frame, collect_calls, collect_run, finish_run


def _run_folder(d, problems=120, iterations=2, calls=40, chars=1000):
    "A run folder of synthetic checkpoints whose calls (prompt and reply texts) make up nearly all of their size."
    ids = [f'p{i:03d}' for i in range(problems)]
    atomic_write_json(d / 'config.json', {'method': 'tmas', 'problem_ids': ids})
    size = 0
    for pid in ids:
        for it in range(iterations):
            cp = {'version': 1, 'problem_id': pid, 'iteration': it, 'done': False, 'records': [], 'state': {},
                  'bank_files': {}, 'banks': {'guideline': [f'{pid} strategy {it}']}, 'memory': [],
                  'usage': {'solution': {'calls': calls, 'completion_tokens': 10 * calls}},
                  'calls': [{'problem_id': pid, 'iteration': it, 'candidate': k % 8, 'role': 'solution', 'sample': 0,
                             'prompt': f'{pid}/{it}/{k} ' + 'p' * chars if k % 2 == 0 else None,
                             'reply': f'{pid}/{it}/{k} ' + 'r' * chars, 'prompt_tokens': 5, 'completion_tokens': 10,
                             'finish_reason': 'stop', 'cached': False, 'start': 1.0, 'end': 2.0, 'queue_s': None}
                            for k in range(calls)]}
            size += len(json.dumps(cp))
            atomic_write_json(checkpoint_path(d, pid, it), cp, indent=None)
    return ids, size


def test_finish_run_streams_the_checkpoints_and_writes_the_same_tables(tmp_path):
    ids, size = _run_folder(tmp_path)
    assert size > 8_000_000 and 120 * 2 * 40 > 2 * ROWS_PER_GROUP
    tracemalloc.start()
    try:
        finish_run(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # holding every checkpoint (the old way) needs more than their size on disk; one problem and one row group far less
    assert peak < size / 3, (peak, size)
    calls = pd.read_parquet(tmp_path / 'calls.parquet')
    assert len(calls) == 120 * 2 * 40
    pd.testing.assert_frame_equal(calls_frame(calls), calls_frame(collect_calls(tmp_path, ids)))
    assert calls.prompt.notna().all()          # a prompt shared with the row before is filled in
    records, banks, usage, _ = collect_run(tmp_path, ids)
    assert pd.read_parquet(tmp_path / 'banks.parquet').problem_id.tolist() == [b['problem_id'] for b in banks]
    assert json.loads((tmp_path / 'usage.json').read_text())['by_role'] == usage == {'solution': {'calls': 9600, 'completion_tokens': 96000}}
