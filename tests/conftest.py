"""Shared pytest fixtures for tmas_nb."""
import os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

import pytest

from tmas_nb.core import find_data_dir, DATA_HINT


@pytest.fixture(scope='session')
def data_root():
    """The data folder; tests that need it skip only when no data folder exists at all."""
    root = find_data_dir()
    if root is None:
        pytest.skip(f"no data folder: {DATA_HINT}")
    return root
