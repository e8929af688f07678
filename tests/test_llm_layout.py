"The llm notebooks follow the house layout, and their constructors take settings objects while keeping their keywords."
import ast, inspect, json
from pathlib import Path

import pytest

NBS = Path(__file__).resolve().parent.parent / 'nbs'
NOTEBOOKS = ['llm/02_models.ipynb', 'llm/03_transformers.ipynb', 'llm/04_openai.ipynb', 'llm/06a_llamacpp.ipynb']
MAX_LINES = 45

def layout_problems(path: Path) -> list[str]:
    "Export cells that are too long, hold more than one definition, or are not followed by prose and a test cell."
    cells = json.loads(path.read_text())['cells']
    problems = []
    for i, c in enumerate(cells):
        src = ''.join(c['source'])
        if c['cell_type'] != 'code' or not src.lstrip().startswith('#| export'): continue
        body = [l for l in src.splitlines() if not l.strip().startswith('#|')]
        lines = len([l for l in body if l.strip()])
        defs = [x.name for x in ast.parse('\n'.join(body)).body
                if isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        where = f"{path.name} cell {i} ({c['id']}, {defs[:3]})"
        if lines > MAX_LINES: problems.append(f"{where}: {lines} lines, more than {MAX_LINES}")
        if len([d for d in defs if not d.startswith('_')]) > 1 or len(defs) > 2:
            problems.append(f"{where}: {len(defs)} definitions; put one in each export cell")
        if not defs: continue   # imports and constants
        after = cells[i + 1:i + 3]
        kinds = [(a['cell_type'], ''.join(a['source']).lstrip().startswith('#| export')) for a in after]
        if kinds != [('markdown', False), ('code', False)]:
            problems.append(f"{where}: not followed by a markdown cell and a test cell")
    return problems

@pytest.mark.parametrize('name', NOTEBOOKS)
def test_export_cells_are_small_single_and_tested(name):
    problems = layout_problems(NBS / name)
    assert not problems, '\n'.join(problems)

def test_test_oracle_is_not_exported():
    import tmas_nb.llm.transformers_backend as tb
    assert not hasattr(tb, '_nucleus_reference'), "_nucleus_reference is a test oracle; keep it in a #| hide cell"

def count_params(f) -> int:
    return len([p for p in inspect.signature(f).parameters.values()
                if p.name != 'self' and p.kind is not inspect.Parameter.VAR_KEYWORD])

def test_openai_backend_takes_client_settings_and_old_keywords():
    from tmas_nb.llm.openai_backend import OpenAIBackend, OpenAIClientSettings
    kw = dict(max_concurrency=4, max_retries=2, timeout=30, connect_timeout=3, backoff_base=0.1, backoff_max=1.0,
              max_retry_after=5, max_n_per_call=3)
    old_style = OpenAIBackend('m', base_url='127.0.0.1:9', **kw)
    new_style = OpenAIBackend('m', base_url='127.0.0.1:9', settings=OpenAIClientSettings(**kw))
    assert old_style.settings == new_style.settings
    assert [getattr(old_style, k) for k in kw] == [getattr(new_style, k) for k in kw] == [4, 2, 30.0, 3.0, 0.1, 1.0, 5, 3]
    assert old_style.n_per_call == 3 and old_style.record() == new_style.record()
    assert count_params(OpenAIBackend.__init__) <= 10
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['max_retrys'\]"):
        OpenAIBackend('m', base_url='127.0.0.1:9', max_retrys=1)
    with pytest.raises(ValueError, match='max_concurrency must be >= 1'):
        OpenAIBackend('m', base_url='127.0.0.1:9', settings=OpenAIClientSettings(), max_concurrency=0)

def test_llama_server_takes_settings_and_old_keywords():
    from tmas_nb.llm.llamacpp import LlamaServer, LlamaServerSettings
    kw = dict(host='127.0.0.1', port=8123, n_parallel=2, ctx_per_slot=1024, threads=1, api_key='k', alias='small',
              extra=['--verbose'])
    old_style = LlamaServer('smollm2', binary='/bin/false', start=False, **kw)
    new_style = LlamaServer('smollm2', LlamaServerSettings(**kw), binary='/bin/false', start=False)
    assert old_style.args == new_style.args and old_style.args[-1] == '--verbose'
    assert (old_style.port, old_style.n_parallel, old_style.api_key, old_style.alias) == (8123, 2, 'k', 'small')
    assert count_params(LlamaServer.__init__) <= 10
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['slots'\]"):
        LlamaServer('smollm2', binary='/bin/false', start=False, slots=2)
