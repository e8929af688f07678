"""Shared pytest fixtures for tmas_nb."""
import os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
# Under pytest-xdist the workers are the parallelism: one math thread each (and for the processes they start), else two
# workers' torch thread pools contend for the same cores (measured: test_llm + test_live 101 s -> 87 s on two cores).
if os.environ.get('PYTEST_XDIST_WORKER'):
    os.environ.setdefault('OMP_NUM_THREADS', '1')
# `tmas run --backend auto` reads engine calibrations; the tests never see (or write) the user's own
import tempfile
os.environ['TMAS_ENGINES_DIR'] = tempfile.mkdtemp(prefix='tmas-engines-')
# the key that signs call-cache entries: the tests' own, never the user's (every test process and its children share it)
os.environ['TMAS_MACHINE_KEY_FILE'] = os.path.join(tempfile.mkdtemp(prefix='tmas-key-'), 'machine.key')

import pytest

from tmas_nb.core import find_data_dir, DATA_HINT

ALLOW_NO_DATA = 'TMAS_ALLOW_NO_DATA'


@pytest.fixture(scope='session')
def data_root():
    """The data folder. A test that needs it fails when it is missing, unless TMAS_ALLOW_NO_DATA=1 (then it skips, saying why)."""
    root = find_data_dir()
    if root is None:
        if os.environ.get(ALLOW_NO_DATA, '') not in ('', '0'):
            pytest.skip(f"no data folder and {ALLOW_NO_DATA}=1: {DATA_HINT}")
        pytest.fail(f"no data folder: {DATA_HINT} (set {ALLOW_NO_DATA}=1 to skip the tests that need it)", pytrace=False)
    return root


# Tests marked `slow` (minutes each: real llama.cpp servers) run only with `--runslow` or TMAS_SLOW=1;
# otherwise they are reported as skipped, with how to run them.
SLOW = 'TMAS_SLOW'


def pytest_addoption(parser):
    parser.addoption('--runslow', action='store_true', default=False, help=f'also run tests marked slow (or set {SLOW}=1)')


def pytest_configure(config):
    config.addinivalue_line('markers', f'slow: minutes-long tests (real llama.cpp servers); run with --runslow or {SLOW}=1')
    # no silent skips: every skipped test is listed with its reason in the summary, even under -q
    if 's' not in config.option.reportchars and 'a' not in config.option.reportchars:
        config.option.reportchars += 's'


def pytest_collection_modifyitems(config, items):
    if config.getoption('--runslow') or os.environ.get(SLOW, '') not in ('', '0'):
        return
    skip = pytest.mark.skip(reason=f'slow test, not run by default: pass --runslow or set {SLOW}=1 to run it')
    for item in items:
        if 'slow' in item.keywords:
            item.add_marker(skip)
