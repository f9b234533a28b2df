import sys
from pathlib import Path

# the shared test models live beside the tests
sys.path.insert(0, str(Path(__file__).parent))

import pytest
from _models import in_process_run


@pytest.fixture(autouse=True)
def _isolate_in_process_runs():
    with in_process_run():
        yield
