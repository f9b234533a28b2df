"""``--rewrap``: what re-wrapping a model in ``DistributedDataParallel`` costs, with and without the broadcast of
the model from rank 0 (``init_sync=True``, DDP's default, against ``init_sync=False``, what tensor-fusion tuning
re-wraps with: the parameters are identical on every rank at a step boundary already).

On ``--devices`` fork processes on gloo, per model size (the benchmark's MLP with ``--input-dim``, ``--layers``
and each hidden size of ``--rewrap-hidden``), the two constructions are timed alternately on rank 0, after a
barrier, ``--rewrap-repeats`` times each; the table gives the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_shardplus.bench.runner import report_settings, rows_from_workers
from lightning_shardplus.demo import ClassifierModule

REWRAP_HIDDEN = (256, 1024, 2048)  # default hidden sizes: 0.2M, 2.4M and 8.9M parameters (input 256, 3 layers)


def _time_construction(module: torch.nn.Module, init_sync: bool) -> float:
    """Seconds to build one wrapper, from a barrier (every rank starts together) to the end of the constructor."""
    dist.barrier()
    start = time.perf_counter()
    wrapper = DistributedDataParallel(module, init_sync=init_sync)
    seconds = time.perf_counter() - start
    del wrapper
    return seconds


def _worker(rank: int, world_size: int, store: str, out: str, args: argparse.Namespace) -> None:
    """One rank: per hidden size, both constructions alternately; rank 0 writes the medians to ``out``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        rows = []
        for hidden in args.rewrap_hidden:
            torch.manual_seed(rank)  # different weights per rank: the broadcast has real work to do
            module = ClassifierModule(input_dim=args.input_dim, hidden_dims=[hidden] * args.layers)
            times: dict[bool, list[float]] = {True: [], False: []}
            _time_construction(module, True)  # untimed: the first construction allocates
            for repeat in range(args.rewrap_repeats):
                for init_sync in (True, False) if repeat % 2 == 0 else (False, True):
                    times[init_sync].append(_time_construction(module, init_sync))
            parameters = sum(p.numel() for p in module.parameters())
            rows.append(_row(hidden, parameters, module, times))
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _row(hidden: int, parameters: int, module: torch.nn.Module, times: dict[bool, list[float]]) -> dict[str, Any]:
    with_ms, without_ms = (1000 * statistics.median(times[sync]) for sync in (True, False))
    return {
        "model": f"MLP hidden {hidden}",
        "parameters": parameters,
        "mb": sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20,
        "ms_with_broadcast": with_ms,
        "ms_without_broadcast": without_ms,
        "ratio": with_ms / without_ms if without_ms > 0 else None,
        "repeats": len(times[True]),
    }


def run_rewrap(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--rewrap`` rows, measured in ``--devices`` fork processes (this process is not one of them)."""
    return {"settings": report_settings(args), "rewrap_rows": rows_from_workers(_worker, args)}


def format_rewrap_table(report: dict[str, Any]) -> str:
    """The ``--rewrap`` rows: per model, the construction with and without the broadcast from rank 0."""
    devices = report["settings"]["devices"]
    lines = [
        "| model | parameters | MB | ms with broadcast (init_sync=True) | ms without (init_sync=False) | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in report["rewrap_rows"]:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.1f}x"
        lines.append(
            f"| {row['model']} | {row['parameters']:,} | {row['mb']:.3g} | {row['ms_with_broadcast']:.2f} | "
            f"{row['ms_without_broadcast']:.2f} | {ratio} |"
        )
    repeats = report["rewrap_rows"][0]["repeats"] if report["rewrap_rows"] else 0
    lines += ["", f"{devices} processes (gloo), median of {repeats} constructions each, alternating"]
    return "\n".join(lines)
