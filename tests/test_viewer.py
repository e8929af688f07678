"""The run viewer on a real run folder (TMAS with the packaged SmolLM2), checked in a real headless browser.

The browser is Debian's chromium (`apt-get install chromium`; `.ci/setup` installs it). Without it the test fails and
says how to install it, unless TMAS_NO_BROWSER=1 opts out (then it is reported as skipped, with the reason).
"""
import asyncio
import html
import os
import re
import shutil
import subprocess

import pandas as pd
import pytest

from tmas_nb.cli import main
from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.methods.tmas import TMASConfig
from tmas_nb.runs.folder import load_run
from tmas_nb.runs.start import start_run

from test_methods import TINY_TEMPLATES

OPT_OUT = 'TMAS_NO_BROWSER'
HOSTILE = '</script><script>alert(1)</script><img src=x onerror=alert(2)>'


def chromium() -> str:
    "The headless browser's command; fails (or, with TMAS_NO_BROWSER=1, skips) when none is installed."
    for name in ('chromium', 'chromium-browser', 'google-chrome'):
        if shutil.which(name): return shutil.which(name)
    if os.environ.get(OPT_OUT, '') not in ('', '0'):
        pytest.skip(f'no chromium on this machine and {OPT_OUT}=1: the viewer is not checked in a browser')
    pytest.fail(f"the viewer test needs a headless browser: install Debian's chromium (`apt-get install chromium`), "
                f"or set {OPT_OUT}=1 to skip this test", pytrace=False)


def browse(page, fragment: str) -> tuple[str, list[str]]:
    "(the DOM after the page's scripts ran, the console lines) of `page` opened at `#fragment` in headless chromium."
    p = subprocess.run([chromium(), '--headless', '--no-sandbox', '--disable-gpu', '--enable-logging=stderr', '--v=0',
                        '--dump-dom', f'file://{page}#{fragment}'], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout, [line for line in p.stderr.splitlines() if ':CONSOLE' in line or 'Uncaught' in line]


@pytest.fixture(scope='module')
def real_run(tmp_path_factory):
    "TMAS with the packaged SmolLM2 on one demo problem: N=2 candidates, M=1 review each, 2 iterations, short prompts and answers (`default` takes minutes here)."
    cfg = TMASConfig(n_candidates=2, n_verifications=1, iterations=2, epsilon=0.5, max_new_tokens=12, embedder='hashing',
                     memory_retries=0, seed=0, templates=TINY_TEMPLATES)
    run_dir = tmp_path_factory.mktemp('viewer') / 'run'
    asyncio.run(start_run('tmas', demo_problems()[:1], cfg, run_dir, model='smollm2', progress=False, benchmark='demo',
                          num_threads=1))
    return load_run(run_dir)


def candidate_part(dom: str, k: int) -> str:
    "The markup of candidate `k`'s card in the dumped DOM."
    start = dom.index(f'id="candidate-{k}"')
    end = dom.find('id="candidate-', start + 10)
    return dom[dom.rindex('<details', 0, start):end if end > 0 else len(dom)]


def test_the_browser_shows_the_selected_candidates_review_and_no_model_text_runs(real_run, tmp_path):
    "`tmas runs export` of a real run, opened at It1 (the second iteration), candidate 1: the card is open and shows its review text; a reply that closes the script element stays text."
    calls = real_run.calls()
    mine = calls[(calls.iteration == 1) & (calls.candidate == 1) & (calls.role == 'verification')]
    assert len(mine) == 1 and mine.reply.iloc[0].strip(), mine
    review = mine.reply.iloc[0]
    # a hostile copy of the run: candidate 0's solution and a reply of its own call hold markup
    evil = tmp_path / 'evil'
    shutil.copytree(real_run.run_dir, evil)
    rec = pd.read_parquet(evil / 'records.parquet')
    rec.loc[rec.candidate == 0, 'solution'] = HOSTILE
    rec.to_parquet(evil / 'records.parquet', index=False)
    c = pd.read_parquet(evil / 'calls.parquet')
    c.loc[(c.candidate == 0) & (c.role == 'solution'), 'reply'] = HOSTILE
    c.to_parquet(evil / 'calls.parquet', index=False)
    page = tmp_path / 'view.html'
    assert main(['runs', 'export', str(evil), '--html', str(page)]) == 0
    text = page.read_text(encoding='utf-8')
    assert HOSTILE not in text and text.count('<script') == 2

    dom, console = browse(page, 'problem=demo-01&iteration=1&candidate=1')
    assert not console, console                                      # nothing logged: no error, no blocked script
    assert 'data-ready="1"' in dom and 'data-errors' not in dom, dom[:2000]
    assert re.search(r'<div id="errors"[^>]*hidden', dom)
    card = candidate_part(dom, 1)
    assert re.match(r'<details[^>]*\bopen', card) and 'selected' in card
    assert html.escape(review, quote=False) in card                  # the review text, as text
    assert dom.count('<script') == 2 and '<img' not in dom           # the hostile texts made no element
    assert html.escape(HOSTILE, quote=False) in candidate_part(dom, 0)
    assert '>demo-01 · It1<' in dom
    total = sum(d['completion_tokens'] for d in real_run.usage['by_role'].values())
    assert total > 0 and f'{total:,} completion tokens (' in dom     # the header gives the run's token count
    page_text = re.sub(r'<script.*?</script>', '', dom, flags=re.S)
    assert not re.search(r'>\s*(null|undefined)\s*<', page_text)   # no value drawn as the word null


def test_a_selection_the_run_does_not_have_says_so(real_run, tmp_path):
    page = tmp_path / 'view.html'
    assert main(['runs', 'export', str(real_run.run_dir), '--html', str(page)]) == 0
    dom, console = browse(page, 'problem=demo-01&iteration=9')
    assert not console and 'data-ready="1"' in dom
    assert 'No It9 for this problem (it has 2).' in dom and '>demo-01 · It0<' in dom
