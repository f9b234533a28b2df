"""``--collective``: what one small extra all_reduce per step costs a training step on the host, when it blocks and
when it is started before the step's work and waited for after it (the averaged training metrics' all_reduce is
the first kind: started and waited for at the batch end).

On ``--devices`` fork processes on gloo, each iteration is the benchmark's MLP forward and backward on one
per-rank batch (no DDP: the model's own work only), alone, then with an all_reduce of ``--collective-floats``
float64 values after it (blocking), then with that all_reduce started before it and waited for after it. The
three variants alternate iteration by iteration; the table gives the median ms per iteration of each and what the
collective adds. On a host whose cores the processes keep busy, the overlapped collective still adds the CPU time
gloo spends on it.
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
import torch.nn.functional as F

from lightning_shardplus.bench.runner import report_settings, rows_from_workers
from lightning_shardplus.demo import ClassifierModule

VARIANTS = ("compute only", "compute, then a blocking all_reduce", "all_reduce started before, waited after")


def _iteration(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], buffer: torch.Tensor, variant: int) -> float:
    """Seconds for one forward and backward, with the all_reduce as ``variant`` says."""
    dist.barrier()
    start = time.perf_counter()
    work = dist.all_reduce(buffer, async_op=True) if variant == 2 else None
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    if variant == 1:
        dist.all_reduce(buffer)
    if work is not None:
        work.wait()
    return time.perf_counter() - start


def _worker(rank: int, world_size: int, store: str, out: str, args: argparse.Namespace) -> None:
    """One rank: every variant ``--steps`` times, alternating; rank 0 writes the medians to ``out``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(rank)
        model = ClassifierModule(input_dim=args.input_dim, hidden_dims=[args.hidden_dim] * args.layers)
        per_rank = args.global_batch_size // world_size
        batch = (torch.randn(per_rank, args.input_dim), torch.randint(0, 10, (per_rank,)))
        buffer = torch.zeros(args.collective_floats, dtype=torch.float64)
        times: list[list[float]] = [[] for _ in VARIANTS]
        for step in range(args.warmup + args.steps):
            for variant in range(len(VARIANTS)):
                seconds = _iteration(model, batch, buffer, variant)
                if step >= args.warmup:
                    times[variant].append(seconds)
        if rank == 0:
            medians = [1000 * statistics.median(t) for t in times]
            pairs = zip(VARIANTS, medians, strict=True)
            rows = [{"variant": variant, "ms": ms, "added_ms": ms - medians[0]} for variant, ms in pairs]
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def run_collective(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--collective`` rows, measured in ``--devices`` fork processes (this process is not one of them)."""
    return {"settings": report_settings(args), "collective_rows": rows_from_workers(_worker, args)}


def format_collective_table(report: dict[str, Any]) -> str:
    """The ``--collective`` rows: ms per iteration and what the all_reduce adds to it."""
    settings = report["settings"]
    lines = [
        "| iteration (forward + backward of the benchmark's MLP) | ms (median) | added by the all_reduce |",
        "|---|---:|---:|",
    ]
    for row in report["collective_rows"]:
        added = "-" if row["variant"] == VARIANTS[0] else f"{row['added_ms']:+.2f} ms"
        lines.append(f"| {row['variant']} | {row['ms']:.2f} | {added} |")
    lines += [
        "",
        f"{settings['devices']} processes (gloo), all_reduce of {settings['collective_floats']} float64, "
        f"{settings['steps']} iterations of each variant, alternating",
    ]
    return "\n".join(lines)
