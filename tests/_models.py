"""Small models and datasets shared by the multi-process tests.

Fork workers cannot hand Python objects back, so each rank appends what it saw to its own JSON-lines file.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import time
import traceback
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import distributed_c10d
from torch.utils.data import Dataset


class IndexedDataset(Dataset):
    """Sample ``i`` is ``(x_i, y_i, i)``: inputs and labels fixed by the index, so every run sees the same data."""

    def __init__(self, length: int, dim: int = 4, num_classes: int = 3, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(length, dim, generator=generator)
        self.labels = torch.randint(0, num_classes, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.inputs[index], self.labels[index], index


class RecordingModule(pl.LightningModule):
    """A linear classifier that records, per rank, the sample indices of every batch of every stage."""

    def __init__(
        self, record_dir: str | os.PathLike, dim: int = 4, num_classes: int = 3, lr: float = 0.1
    ) -> None:
        super().__init__()
        self.record_dir = Path(record_dir)
        self.record_dir.mkdir(parents=True, exist_ok=True)
        self.layer = nn.Linear(dim, num_classes)
        self.lr = lr

    def record(self, stage: str, indices: torch.Tensor, **extra) -> None:
        row = {
            "stage": stage,
            "rank": self.global_rank,
            "epoch": self.current_epoch,
            "indices": indices.tolist(),
        }
        with open(self.record_dir / f"rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row | extra) + "\n")

    def forward(self, inputs):
        return self.layer(inputs)

    def training_step(self, batch, batch_idx):
        inputs, labels, indices = batch
        self.record("train", indices)
        loss = F.cross_entropy(self(inputs), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, labels, indices = batch
        self.record("sanity" if self.trainer.sanity_checking else "val", indices)
        self.log("val_loss", F.cross_entropy(self(inputs), labels))

    def test_step(self, batch, batch_idx):
        inputs, labels, indices = batch
        self.record("test", indices)
        self.log("test_loss", F.cross_entropy(self(inputs), labels))

    def predict_step(self, batch, batch_idx):
        inputs, _, indices = batch
        self.record("predict", indices)
        return indices

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def read_records(record_dir: str | os.PathLike) -> list[dict]:
    rows = []
    for path in sorted(Path(record_dir).glob("rank*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


def uncounted_allreduce_hook(process_group, bucket):
    """DDP's mean all-reduce as a user communication hook (so the averaged training metrics cannot ride in it and
    take an all_reduce of their own), through the c10d function itself: fixtures that count ``dist.all_reduce``
    calls do not see it, as they do not see DDP's built-in all-reduce."""
    tensor = bucket.buffer().div_(torch.distributed.get_world_size())
    return distributed_c10d.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def cpu_trainer(strategy, devices: int, **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(**(defaults | kwargs))


@contextmanager
def in_process_run():
    """Undo what a run inside the test process leaves behind: Lightning's popen launcher sets ``LOCAL_RANK``
    and friends in ``os.environ`` (a later Trainer would then wait for processes launched "externally") and
    does not destroy its process group (a later fork would inherit it). Either makes the next fork test hang."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def kill_leftover_processes(marker: str) -> list[int]:
    """SIGKILL every process whose command line contains ``marker`` (a test's tmp_path): workers a launcher
    leaves behind (Lightning's SIGTERM handler can keep a worker blocked in a collective alive after its
    torchrun agent is gone) would otherwise linger and could join a later job's rendezvous on a reused port."""
    killed = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and int(entry.name) != os.getpid():
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except OSError:
                pass
    return killed


def in_forked_process(function, timeout: float = 120) -> None:
    """Run ``function()`` in a forked child that leaves with ``os._exit``, skipping every destructor; raise what it
    raised. For a test that builds a gloo process group and DDP in one process: torch's ``~ProcessGroupGloo`` joins
    its worker thread holding the GIL while that thread may still free a finished collective, which needs the GIL
    when a Python hook ran in it (a PowerSGD comm hook): the test process hung in CI."""
    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_report_to, args=(writer, function))
    child.start()
    writer.close()
    try:
        if not reader.poll(timeout):
            raise TimeoutError(f"{function!r} did not finish in {timeout} s")
        error = reader.recv()
    finally:
        child.kill()
        child.join()
    if error is not None:
        raise AssertionError(f"in the forked child:\n{error}")


def _report_to(writer, function) -> None:
    try:
        function()
        writer.send(None)
    except BaseException:
        writer.send(traceback.format_exc())
    finally:
        os._exit(0)


def in_external_ranks(
    function, world_size: int = 2, timeout: float = 120, cwd: str | os.PathLike | None = None
) -> None:
    """Run ``function()`` as each rank of a ``world_size``-process job whose processes Lightning finds started
    (``LOCAL_RANK`` and the rendezvous variables set), each a fork of this process: a rank's code runs before and after
    its ``fit``, in the same process, and what it raised comes back (as :func:`in_forked_process`); ``cwd``: each
    rank's working directory (a test's tmp_path: what libraries write beside them stays there)."""
    port = _free_port()
    errors = []
    context = multiprocessing.get_context("fork")
    children = []
    for rank in range(world_size):
        reader, writer = context.Pipe(duplex=False)
        # what Lightning reads (torchrun sets RANK and LOCAL_WORLD_SIZE too: shardplus exports those itself)
        variables = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                         LOCAL_RANK=str(rank), NODE_RANK="0")  # fmt: skip
        child = context.Process(target=_report_to, args=(writer, partial(_as_rank, variables, function, cwd)))
        child.start()
        writer.close()
        children.append((reader, child))
    try:
        for rank, (reader, _) in enumerate(children):
            if not reader.poll(timeout):
                raise TimeoutError(f"rank {rank} of {function!r} did not finish in {timeout} s")
            if (error := reader.recv()) is not None:
                errors.append(f"rank {rank}:\n{error}")
    finally:
        for _, child in children:
            child.kill()
            child.join()
    if errors:
        raise AssertionError("in the forked ranks:\n" + "\n".join(errors))


def _as_rank(variables: dict[str, str], function, cwd) -> None:
    os.environ.update(variables)
    if cwd is not None:
        os.chdir(cwd)
    function()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_commands(commands: list[list[str]], cwd: Path, env: dict[str, str], timeout: float) -> list[tuple[int, str]]:
    """Start the commands together in ``cwd`` (each in a process group of its own) and return each one's exit code and
    output (stderr in it); on a timeout the test fails with every output's tail. Either way every process group is
    killed and every process whose command line names ``cwd`` (a test's tmp_path), so nothing outlives the test."""
    procs = [
        subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for cmd in commands
    ]
    results = []
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, output))
    except subprocess.TimeoutExpired:
        outputs = []
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            outputs.append(proc.communicate()[0] or "")
        tails = "\n".join(f"--- process {i} ---\n{out[-3000:]}" for i, out in enumerate(outputs))
        pytest.fail(f"launch did not finish within {timeout} s: {commands}\n{tails}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        kill_leftover_processes(str(cwd))
    return results
