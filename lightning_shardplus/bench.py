"""``python -m lightning_shardplus.bench``: the same synthetic workload under plain ``strategy="ddp"`` and under
shardplus configurations, run alternately and repeated, reported as samples/s (median) and ratio to ddp.

Each run is a fresh ``Trainer.fit`` on CPU processes (fork launcher); the first ``--warmup`` steps are not
timed. Alternating the configurations spreads the machine's drift over all of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, Strategy

from lightning_shardplus.datamodule import SyntheticDataModule
from lightning_shardplus.demo import ClassifierModule
from lightning_shardplus.strategy import ShardPlusStrategy


@dataclass(frozen=True)
class BenchConfig:
    """One row of the benchmark: a name and how to build its strategy."""

    name: str
    make_strategy: Callable[[], Strategy]


def default_configs() -> list[BenchConfig]:
    return [
        BenchConfig("ddp", lambda: DDPStrategy(start_method="fork")),
        BenchConfig("shardplus", lambda: ShardPlusStrategy(start_method="fork")),
    ]


class _Throughput(Callback):
    """Times the training steps after ``warmup`` on rank 0 and writes samples/s to ``out``."""

    def __init__(self, warmup: int, out: Path) -> None:
        self.warmup, self.out, self.start = warmup, out, 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            seconds = time.perf_counter() - self.start
            steps = trainer.global_step - self.warmup
            samples = steps * trainer.datamodule.effective_global_batch_size
            self.out.write_text(json.dumps({"samples_per_s": samples / seconds, "steps": steps}))


def run_once(config: BenchConfig, args: argparse.Namespace) -> float:
    """One ``fit`` of the workload under ``config``; returns rank 0's samples/s."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        pl.seed_everything(0, verbose=False)
        datamodule = SyntheticDataModule(
            global_batch_size=args.global_batch_size,
            num_samples=args.global_batch_size * (args.steps + args.warmup),
            val_samples=0,
            input_shape=(args.input_dim,),
        )
        model = ClassifierModule(input_dim=args.input_dim, hidden_dims=[args.hidden_dim] * args.layers)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=config.make_strategy(),
            max_steps=args.steps + args.warmup,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=[_Throughput(args.warmup, out)],
        )
        trainer.fit(model, datamodule)
        return json.loads(out.read_text())["samples_per_s"]


def run(configs: list[BenchConfig], args: argparse.Namespace) -> dict[str, Any]:
    """Run every config ``args.repeats`` times, alternating; return per-config samples/s and ratios to ddp."""
    samples: dict[str, list[float]] = {c.name: [] for c in configs}
    for repeat in range(args.repeats):
        order = configs if repeat % 2 == 0 else list(reversed(configs))
        for config in order:
            samples[config.name].append(run_once(config, args))
    baseline = statistics.median(samples[configs[0].name])
    rows = {
        name: {
            "median_samples_per_s": statistics.median(values),
            "min_samples_per_s": min(values),
            "max_samples_per_s": max(values),
            "ratio_to_ddp": statistics.median(values) / baseline,
            "runs": values,
        }
        for name, values in samples.items()
    }
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    return {"settings": settings, "results": rows}


def format_table(report: dict[str, Any]) -> str:
    lines = [
        "| configuration | samples/s (median) | min - max | ratio to ddp |",
        "|---|---:|---:|---:|",
    ]
    for name, row in report["results"].items():
        lines.append(
            f"| {name} | {row['median_samples_per_s']:.0f} | {row['min_samples_per_s']:.0f} - "
            f"{row['max_samples_per_s']:.0f} | {row['ratio_to_ddp']:.3f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightning_shardplus.bench", description=__doc__)
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per configuration, alternating (default 5)")
    parser.add_argument("--steps", type=int, default=100, help="timed optimizer steps per run (default 100)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of each run")
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--input-dim", type=int, default=256)
    parser.add_argument("--hidden-dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the report to this JSON file")
    args = parser.parse_args(argv)
    for name in ("devices", "repeats", "steps", "global_batch_size", "input_dim", "hidden_dim", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is not valid: expected >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup} is not valid: expected >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(default_configs(), args)
    print(format_table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
