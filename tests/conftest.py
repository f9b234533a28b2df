import sys
from pathlib import Path

# the shared test models live beside the tests
sys.path.insert(0, str(Path(__file__).parent))

import pytest
import torch
from _models import in_process_run

# The multi-process tests fork this process. A fork taken after an OpenMP thread pool has started can deadlock
# in the child (libgomp is not fork-safe): keep this parent single-threaded; the workers set their own threads.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolate_in_process_runs():
    with in_process_run():
        yield
