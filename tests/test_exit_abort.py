"""`.ci/compat`'s rerun guard (tests/_exit_abort.py) catches exactly a spawned worker's abort at exit under torch
2.3's gloo: a ProcessExitedException by SIGABRT whose captured output has "terminate called without an active
exception"; another signal, or that signal without that line, is not rerun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TEST = '''
import os
from torch.multiprocessing import ProcessExitedException


def test_worker():
    os.write(2, {stderr!r}.encode())  # what a spawned worker prints on the inherited stderr
    raise ProcessExitedException("process 1 terminated with signal {signal}", error_index=1, error_pid=1,
                                 exit_code=-6, signal_name={signal!r})
'''


def _assert_reruns(tmp_path: Path, reruns: int) -> None:
    """Run ``tmp_path/test_it.py`` (one failing test) under the rerun guard; it failed, rerun ``reruns`` times."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_exit_abort", "--reruns", "1",
         "--only-rerun", "WorkerAbortedAtExit", "test_it.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).parent)},
    )  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1]
    assert "1 failed" in summary and (f"{reruns} rerun" in summary) == bool(reruns), result.stdout[-2000:]


@pytest.mark.compat
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("signal", "stderr", "reruns"),
    [
        ("SIGABRT", "`Trainer.fit` stopped.\nterminate called without an active exception\n", 1),
        ("SIGABRT", "something else\n", 0),
        ("SIGSEGV", "terminate called without an active exception\n", 0),
    ],
    ids=["abort-at-exit", "another-abort", "another-signal"],
)
def test_only_a_spawned_workers_abort_at_exit_is_rerun(tmp_path, signal, stderr, reruns):
    pytest.importorskip("pytest_rerunfailures")  # in the compatibility stage's `oldest` environment
    (tmp_path / "test_it.py").write_text(TEST.format(signal=signal, stderr=stderr))
    _assert_reruns(tmp_path, reruns)


SCRIPT_TEST = '''
import subprocess
import sys


def test_script():
    code = "import os, sys; sys.stderr.write(%r); sys.stderr.flush(); os.abort()" % {stderr!r}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr  # as the tests' script helpers assert
'''


@pytest.mark.compat
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stderr", "reruns"),
    [("`Trainer.fit` stopped.\nterminate called without an active exception\n", 1), ("something else\n", 0)],
    ids=["abort-at-exit", "another-abort"],
)
def test_a_scripts_abort_at_exit_is_rerun_too(tmp_path, stderr, reruns):
    pytest.importorskip("pytest_rerunfailures")  # in the compatibility stage's `oldest` environment
    (tmp_path / "test_it.py").write_text(SCRIPT_TEST.format(stderr=stderr))
    _assert_reruns(tmp_path, reruns)
