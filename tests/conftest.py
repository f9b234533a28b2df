import os
import sys
from pathlib import Path

# the shared test models live beside the tests
sys.path.insert(0, str(Path(__file__).parent))

import importlib.util

import pytest
import torch

import lightning_shardplus  # noqa: F401  (first: it chooses its namespace before the alias below exists)

if importlib.util.find_spec("lightning") is None:  # only pytorch_lightning installed: tests import it as lightning.*
    import _lightning_alias

    _lightning_alias.install()

from _exit_abort import pytest_runtest_makereport  # noqa: E402, F401  (the compat stage's rerun guard)
from _models import in_process_run  # noqa: E402

# The multi-process tests fork this process. A fork taken after an OpenMP thread pool has started can deadlock
# in the child (libgomp is not fork-safe): keep this parent single-threaded. OMP_NUM_THREADS also stops
# Lightning's launchers from raising the thread count of this process (`_set_num_threads_if_needed`), which a
# 1-process run in the test process would otherwise do; the forked workers inherit one thread each.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolate_in_process_runs():
    with in_process_run():
        yield


def pytest_collection_modifyitems(config, items):
    """The unit tier (``-m unit``): the tests that start no process. Every test that starts processes has a timeout
    of its own (the project's rule), so a test without one is a unit test."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.unit)
