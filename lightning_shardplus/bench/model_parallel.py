"""``--model-parallel``: ``ShardPlusModelParallelStrategy`` with its defaults (and without averaged training metrics)
against Lightning's ``ModelParallelStrategy`` on the same FSDP2 model (the demo MLP sharded over ``--devices``
data-parallel ranks), in alternating rounds of one launch: Lightning's launcher re-runs this command on every rank,
which runs the same fits in the same order; rank 0 reports the paired ratios of its samples/s.

    python -m lightning_shardplus.bench --model-parallel --repeats 11 --steps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_shardplus.bench.quiet import quiet_run
from lightning_shardplus.bench.runner import Throughput, bench_trainer, machine, ratio_row, report_settings
from lightning_shardplus.data.datamodule import SyntheticDataModule
from lightning_shardplus.demo import ModelParallelClassifierModule
from lightning_shardplus.strategies.model_parallel import ShardPlusModelParallelStrategy

ROWS = {
    "model_parallel": lambda devices: ModelParallelStrategy(devices, 1),
    "shardplus_model_parallel": lambda devices: ShardPlusModelParallelStrategy(devices, 1),
    # without the averaged training metrics (one all_reduce per step): what the rest of the data side costs
    "shardplus_model_parallel-plain": lambda devices: ShardPlusModelParallelStrategy(
        devices, 1, average_training_metrics=False
    ),
    # ModelParallelStrategy again (an A/A row): what the benchmark reads when there is no difference at all
    "model_parallel-again": lambda devices: ModelParallelStrategy(devices, 1),
}


def run_model_parallel(args: argparse.Namespace) -> dict[str, Any] | None:
    """``args.repeats`` rounds of every row (alternating order); the report on rank 0, None on the others."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ROWS}
    for repeat in range(args.repeats):
        for name in ROWS if repeat % 2 == 0 else reversed(ROWS):
            runs[name].append(_fit_once(name, args))
    if dist.get_rank() != 0:
        return None
    baseline_runs = runs["model_parallel"]
    baseline = statistics.median(r["samples_per_s"] for r in baseline_runs)
    rows = {name: ratio_row(row_runs, baseline, baseline_runs) for name, row_runs in runs.items()}
    return {"settings": report_settings(args), "machine": machine(args), "baseline": "model_parallel", "results": rows}


def _fit_once(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fit of row ``name``: rank 0's samples/s after ``args.warmup`` steps (other ranks: empty)."""
    pl.seed_everything(0, verbose=False)
    data = SyntheticDataModule(
        global_batch_size=args.global_batch_size, num_samples=args.global_batch_size * (args.steps + args.warmup),
        val_samples=0, input_shape=(args.input_dim,),
    )  # fmt: skip
    model = ModelParallelClassifierModule(input_dim=args.input_dim, hidden_dims=[args.hidden_dim] * args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        trainer = bench_trainer(args.accelerator, args.devices, ROWS[name](args.devices), args.steps + args.warmup,
                                [Throughput(args.warmup, out)])  # fmt: skip
        with quiet_run():
            trainer.fit(model, data)
        if not out.exists():
            return {}
        result = json.loads(out.read_text())
    counts = ("bytes_per_step", "rounds_per_step", "collectives_per_step")
    print(f"{name}: {result['samples_per_s']:.0f} samples/s", flush=True)
    return {**result, **dict.fromkeys(counts), "scaling": None}
