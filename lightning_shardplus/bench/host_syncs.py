"""``--host-syncs``: the device synchronizations per training batch on a GPU, as torch itself reports them, under
each ``--configs`` row (default ``ddp`` and the shardplus rows compared with it).

Each row is one ``fit`` of the benchmark's workload on ``--accelerator gpu`` with a CSV logger that writes every
``--log-every-n-steps`` steps and no progress bar. During the training batches
``torch.cuda.set_sync_debug_mode("warn")`` is on: torch warns at every operation that makes the host wait for
the device (``.item()``, ``.tolist()``, ``.cpu()``, a copy to the host, ``nonzero``, ...). :class:`SyncCounter`
counts those warnings per batch (from one ``on_train_batch_start`` to the next, so a batch's hooks, its logging and
its optimizer step are in it) and attributes each to the first frame of the Python stack outside torch: the
package (``lightning_shardplus``), Lightning, or anything else (the workload's model, the benchmark). Warnings
raised in autograd's device threads are replayed by torch at the end of ``backward`` and land in Lightning's
``backward`` call. Synchronizations that torch does not route through its check are not seen: an event's
``synchronize()``, or waits inside NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.accelerators.cuda import num_cuda_devices
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

import lightning_shardplus
from lightning_shardplus.bench.quiet import quiet_run
from lightning_shardplus.bench.runner import Workload, bench_trainer, machine, report_settings, thread_callbacks
from lightning_shardplus.bench.workloads import BenchConfig

SYNC_WARNING = "called a synchronizing CUDA operation"
HOST_SYNC_CONFIGS = ("ddp", "shardplus", "shardplus-plain", "shardplus-report", "ddp-stream", "shardplus-stream")
ORIGINS = ("shardplus", "lightning", "other")

def _folder(module: Any) -> str:
    """The folder of ``module``'s package, with a trailing separator (``torch/`` is not ``torchmetrics/``)."""
    return str(Path(module.__file__).parent) + os.sep


_PACKAGE = _folder(lightning_shardplus)
_BENCH = str(Path(__file__).parent) + os.sep
_TORCH = _folder(torch)
_LIGHTNING = str(Path(pl.__file__).parent.parent) + os.sep  # lightning/ (pytorch and fabric)
_SKIPPED = {warnings.__file__, __file__}  # the warnings module and this one: the stack above the sync


def origin(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """Who made the synchronization whose warning was raised with ``stack`` (outermost first): the first frame
    outside torch and the ``warnings`` module, from the innermost, classified as ``"shardplus"`` (the package, not
    this benchmark), ``"lightning"`` or ``"other"``; and that frame as ``file:line function``."""
    for frame in reversed(stack):
        name = frame.filename
        if name.startswith(_TORCH) or name in _SKIPPED:
            continue
        where = f"{Path(name).name}:{frame.lineno} {frame.name}"
        if name.startswith(_PACKAGE) and not name.startswith(_BENCH):
            return "shardplus", where
        if name.startswith(_LIGHTNING):
            return "lightning", where
        return "other", where
    return "other", "?"


class SyncCounter(Callback):
    """Counts torch's synchronization warnings per training batch after ``warmup`` batches, by :func:`origin`,
    and writes them to ``out`` (rank 0) when training ends. torch raises these warnings on CUDA devices only (on
    others the counter sees only warnings of that text raised by hand). The warning filters, ``showwarning`` and
    CUDA's debug mode are as before once training ends or fails."""

    def __init__(self, warmup: int, out: Path) -> None:
        self.warmup, self.out = warmup, out
        self.batches: list[Counter[str]] = []
        self.sites: Counter[str] = Counter()
        self._counting = False
        self._warnings: Any = None  # the catch_warnings context while training: it restores filters and showwarning
        self._show_other: Any = None  # showwarning as it was, for every other warning
        self._debug_mode: Any = None  # CUDA's sync debug mode before training (None: not on CUDA)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        self._show_other, warnings.showwarning = warnings.showwarning, self._show
        if trainer.strategy.root_device.type == "cuda":
            self._debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")

    def _show(
        self, message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if SYNC_WARNING not in str(message):
            self._show_other(message, category, filename, lineno, file, line)
            return
        if not self._counting:
            return
        who, where = origin(traceback.extract_stack())
        self.batches[-1][who] += 1
        self.sites[f"{who}: {where}"] += 1

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, index: int) -> None:
        self._counting = trainer.global_step >= self.warmup
        if self._counting:
            self.batches.append(Counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()
        if trainer.is_global_zero:
            self.out.write_text(json.dumps(summarize(self.batches, self.sites)))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        self._counting = False
        if self._debug_mode is not None:
            torch.cuda.set_sync_debug_mode(self._debug_mode)
            self._debug_mode = None
        if self._warnings is not None:
            self._warnings.__exit__(None, None, None)
            self._warnings = None


def summarize(batches: list[Counter[str]], sites: Counter[str]) -> dict[str, Any]:
    """Per origin, the synchronizations per batch (mean and median) and the batches with any; the sites, most
    frequent first."""
    row: dict[str, Any] = {"batches": len(batches)}
    for who in (*ORIGINS, "all"):
        counts = [sum(b.values()) if who == "all" else b[who] for b in batches]
        row[who] = {
            "per_batch_mean": sum(counts) / len(counts) if counts else 0.0,
            "per_batch_median": statistics.median(counts) if counts else 0.0,
            "batches_with_any": sum(1 for c in counts if c),
        }
    row["sites"] = dict(sites.most_common(12))
    return row


def count_once(config: BenchConfig, args: argparse.Namespace) -> dict[str, Any]:
    """One ``fit`` of the workload under ``config`` (with its ``ScalingReport`` where the row has one) and a
    :class:`SyncCounter`, a CSV logger writing every ``--log-every-n-steps``; rank 0's counts."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        workload = Workload.of(config, args)
        callbacks = [
            SyncCounter(workload.warmup_steps, directory / "syncs.json"),
            *workload.scaling_report(directory / "scaling.json"),
            *thread_callbacks(args),
        ]
        steps = workload.warmup_steps + workload.timed_steps
        with quiet_run():
            trainer = bench_trainer(
                args.accelerator, args.devices, workload.strategy, steps, callbacks,
                logger=CSVLogger(directory), log_every_n_steps=args.log_every_n_steps,
            )  # fmt: skip
            workload.fit(trainer, args)
        return json.loads((directory / "syncs.json").read_text())


def run_host_syncs(configs: list[BenchConfig], args: argparse.Namespace) -> dict[str, Any]:
    """:func:`count_once` for each config; the report (``host_sync_rows``)."""
    if num_cuda_devices() == 0:  # NVML's count: this process must not initialize CUDA before the fits fork
        raise SystemExit("--host-syncs needs a CUDA GPU: torch reports device synchronizations only there")
    rows = {}
    for config in configs:
        rows[config.name] = count_once(config, args)
        print(f"{config.name}: {rows[config.name]['all']['per_batch_mean']:.2f} synchronizations per batch", flush=True)
    return {"settings": report_settings(args), "machine": machine(args), "host_sync_rows": rows}


def format_host_sync_table(report: dict[str, Any]) -> str:
    """The counts per row (mean per batch, batches with any, by origin), then each row's sites."""
    header = "| row | batches | all: per batch (batches with any) | shardplus | Lightning | other |"
    lines = [header, "|" + "---|" * 6]
    for name, row in report["host_sync_rows"].items():
        cells = [f"{row[who]['per_batch_mean']:.2f} ({row[who]['batches_with_any']})" for who in ("all", *ORIGINS)]
        lines.append(f"| {name} | {row['batches']} | " + " | ".join(cells) + " |")
    for name, row in report["host_sync_rows"].items():
        for site, count in row["sites"].items():
            lines.append(f"{name}: {count} x {site}")
    return "\n".join(lines)
