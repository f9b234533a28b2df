"""A pytest plugin for `.ci/compat`'s rerun guard: a test that failed only because a spawned worker, or a script's
process run by the test, aborted at its exit with torch 2.3's gloo ("terminate called without an active exception",
docs/limitations.md) gets a cause naming that, ``WorkerAbortedAtExit``, which ``--only-rerun WorkerAbortedAtExit``
matches; any other failure does not."""

import pytest
from torch.multiprocessing import ProcessExitedException

EXIT_ABORT = "terminate called without an active exception"


class WorkerAbortedAtExit(Exception):
    """The cause given to a spawned worker's SIGABRT whose output ends a process with ``EXIT_ABORT``."""


@pytest.hookimpl(wrapper=True, trylast=True)  # innermost: before pytest-rerunfailures reads the failure
def pytest_runtest_makereport(item, call):
    report = yield
    error = call.excinfo.value if call.excinfo is not None else None
    if (
        isinstance(error, ProcessExitedException)
        and error.signal_name == "SIGABRT"
        and EXIT_ABORT in report.capstderr
    ):
        error.__cause__ = WorkerAbortedAtExit(f"process {error.error_index} aborted at exit: {EXIT_ABORT}")
    elif isinstance(error, AssertionError) and "returncode=-6" in str(error) and EXIT_ABORT in str(error):
        # a script the test ran (`subprocess.run`, its return code asserted 0, its output in the message) aborted
        error.__cause__ = WorkerAbortedAtExit(f"a script's process aborted at exit: {EXIT_ABORT}")
    return report
