"""``--fusion``: tensor-fusion autotuning, measured.

Per model shape, one fit on ``--devices`` CPU ranks that tunes the bucket size (``auto_tune_tensor_fusion``, no
cache) and then, in the same processes, measures the fixed candidates and the tuned setting interleaved (DDP
re-wrapped between samples): the tuned setting's throughput relative to the best fixed candidate and to DDP's
default (what ``strategy="ddp"`` uses), and what tuning cost relative to a 2,000-step run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_shardplus.bench.quiet import quiet_run
from lightning_shardplus.bench.runner import bench_trainer, report_settings, thread_callbacks
from lightning_shardplus.data.datamodule import SyntheticDataModule
from lightning_shardplus.demo import ClassifierModule
from lightning_shardplus.gradients.ddp.fusion import (
    DDP_DEFAULT,
    DEFAULT_BUCKET_CAP_MB,
    AutotuneSettings,
    BucketSetting,
    default_candidates_mb,
)
from lightning_shardplus.strategies.ddp import ShardPlusStrategy

FUSION_SHAPES = "many-small:256:256:24,few-large:1024:2048:3"
FUSION_REFERENCE_RUN_STEPS = 2000


class _InterleavedBuckets(Callback):
    """Once tuning is over: samples of ``warmup + steps`` optimizer steps under each setting (``fixed``, and the
    tuned one where it is not among them) and, as a control, the tuned setting a second time (``CONTROL``: what
    two measurements of one setting differ by is the noise of this run), in rounds of alternating order, DDP
    re-wrapped between samples; then stops the fit. A sample's time is the median step on each rank, MAX over
    ranks; rank 0 writes them to ``out``."""

    CONTROL = "tuned, measured again"

    def __init__(self, fixed: list[Any], steps: int, warmup: int, rounds: int, out: Path) -> None:
        self.fixed, self.steps, self.warmup, self.rounds, self.out = fixed, steps, warmup, rounds, out
        self.schedule: list[Any] | None = None
        self.samples: list[list[float]] = []
        self.boundaries = 0
        self.last = 0.0
        self.done = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ShardPlusStrategy)
        if strategy.fusion_result is None or i % trainer.accumulate_grad_batches:
            return
        now = time.perf_counter()
        last, self.last = self.last, now
        if self.schedule is None:  # the first step after tuning
            tuned = strategy.fusion_result.setting
            self.settings = {self.CONTROL: tuned} | {s.label: s for s in self.fixed} | {tuned.label: tuned}
            labels = list(self.settings)
            self.schedule = [s for r in range(self.rounds) for s in (labels if r % 2 == 0 else labels[::-1])]
            self.samples = [[] for _ in self.schedule]
            strategy.rewrap_ddp(self.settings[self.schedule[0]])
            return
        if self.done:
            return
        # boundary k ends step k after the first re-wrap: step k belongs to sample (k - 1) // length
        self.boundaries += 1
        length = self.warmup + self.steps
        sample, position = divmod(self.boundaries - 1, length)
        if position >= self.warmup and i > 0:  # a step that spans an epoch end is not timed
            self.samples[sample].append(now - last)
        if self.boundaries % length == 0:
            following = self.boundaries // length
            if following == len(self.schedule):
                self.done = trainer.should_stop = True
            elif self.schedule[following] != self.schedule[following - 1]:
                strategy.rewrap_ddp(self.settings[self.schedule[following]])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.schedule is not None, "tuning did not finish: raise max_steps"
        assert self.done, "the interleaved measurement did not finish: raise max_steps"
        medians = [statistics.median(s) if s else 0.0 for s in self.samples]
        tensor = torch.tensor(medians, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        if trainer.is_global_zero:
            result = trainer.strategy.fusion_result
            per_setting: dict[str, list[float]] = {}
            for label, seconds in zip(self.schedule, tensor.tolist(), strict=False):
                per_setting.setdefault(label, []).append(seconds)
            self.out.write_text(
                json.dumps(
                    {
                        "settings": list(self.settings),
                        "tuned": result.setting.label,
                        "samples_s": per_setting,
                        "tuning_steps": result.tuning_steps,
                        "tuning_s": result.tuning_s,
                        "tuning_step_ms": None if result.step_s is None else 1000 * result.step_s,
                        "summary": result.summary(),
                    }
                )
            )


def run_fusion_shape(shape: tuple[str, int, int, int], rounds: int, args: argparse.Namespace) -> dict[str, Any]:
    """Tune, then measure ``rounds`` interleaved rounds, on one model shape; returns the row."""
    name, input_dim, hidden_dim, layers = shape
    model = ClassifierModule(input_dim=input_dim, hidden_dims=[hidden_dim] * layers)
    parameters = list(model.parameters())
    candidates = list(args.fusion_candidates or default_candidates_mb(parameters))
    autotune = AutotuneSettings(
        candidates_mb=tuple(candidates), steps_per_sample=args.fusion_steps, warmup_steps=args.fusion_warmup
    )
    fixed = autotune.candidates  # what tuning races: the candidates and DDP's default
    report = _tune_and_measure(model, input_dim, candidates, autotune, fixed, rounds, args)
    return _fusion_row(name, sum(p.numel() for p in parameters), fixed, report)


def _tune_and_measure(
    model: pl.LightningModule,
    input_dim: int,
    candidates: list[float],
    autotune: AutotuneSettings,
    fixed: list[BucketSetting],
    rounds: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One fit: tune among ``candidates`` (no cache), then measure ``fixed`` and the tuned setting in ``rounds``
    interleaved rounds; rank 0's measurements, with the tuner's CSV log (``"csv"``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "fusion.json", Path(tmp) / "samples.csv"
        pl.seed_everything(0, verbose=False)
        strategy = ShardPlusStrategy(
            start_method="fork",
            auto_tune_tensor_fusion=True,
            autotune_candidates_mb=candidates,
            autotune_steps_per_sample=args.fusion_steps,
            autotune_warmup_steps=args.fusion_warmup,
            autotune_cache=False,
            autotune_log=str(log),
        )
        measured = (len(fixed) + 2) * rounds * (args.fusion_warmup + args.fusion_steps)
        max_steps = autotune.max_tuning_steps + measured + 10
        interleaved = _InterleavedBuckets(fixed, args.fusion_steps, args.fusion_warmup, rounds, out)
        with quiet_run():
            trainer = bench_trainer("cpu", args.devices, strategy, max_steps, [interleaved, *thread_callbacks(args)])
        datamodule = SyntheticDataModule(
            global_batch_size=args.global_batch_size,
            num_samples=args.global_batch_size * (max_steps + 1),
            val_samples=0,
            input_shape=(input_dim,),
        )
        with quiet_run():
            trainer.fit(model, datamodule)
        report = json.loads(out.read_text())
        report["csv"] = log.read_text().splitlines()
    return report


def _fusion_row(name: str, parameters: int, fixed: list[BucketSetting], report: dict[str, Any]) -> dict[str, Any]:
    """The row of one shape from its measurements: step times per setting and the tuned setting's ratios."""
    step_s = {label: statistics.median(values) for label, values in report["samples_s"].items()}
    fixed_s = {s.label: step_s[s.label] for s in fixed}
    best_fixed = min(fixed_s, key=fixed_s.__getitem__)
    tuned_s = step_s[report["tuned"]]
    default_label = DDP_DEFAULT.label
    uniform = BucketSetting(DEFAULT_BUCKET_CAP_MB)
    uniform_label = uniform.label if uniform in fixed else None  # None when 25 MB is not among the candidates
    control = _InterleavedBuckets.CONTROL
    return {
        "shape": name,
        "parameters": parameters,
        "tuned": report["tuned"],
        "best_fixed": best_fixed,
        "ms_per_step": {label: 1000 * seconds for label, seconds in step_s.items()},
        "samples_ms": {
            label: [round(1000 * v, 2) for v in values] for label, values in report["samples_s"].items()
        },
        # throughput ratios (tuned / other): from the medians, and paired round by round; the default is DDP's
        # (25 MB, first bucket 1 MB: what strategy="ddp" uses), the uniform 25 MB beside it
        "tuned_vs_best_fixed": fixed_s[best_fixed] / tuned_s,
        "tuned_vs_default": step_s[default_label] / tuned_s,
        "tuned_vs_uniform_25": step_s[uniform_label] / tuned_s if uniform_label else None,
        "tuned_vs_best_fixed_paired": _paired(report, best_fixed),
        # the control: the tuned setting measured twice in each round; how far from 1 this is, is this run's noise
        "tuned_vs_itself": step_s[control] / tuned_s,
        "tuned_vs_itself_paired": _paired(report, control),
        "tuned_vs_default_paired": _paired(report, default_label),
        "tuned_vs_uniform_25_paired": _paired(report, uniform_label) if uniform_label else None,
        "tuning_steps": report["tuning_steps"],
        "tuning_cost_of_2000_steps": _tuning_cost(report, tuned_s),
        "samples_per_setting": len(next(iter(report["samples_s"].values()))),
        "csv_rows": len(report["csv"]) - 1,
        "csv": report["csv"],
        "summary": report["summary"],
    }


def _paired(report: dict[str, Any], label: str) -> float:
    """Median over rounds of (label's step time / tuned step time) within the same round: drift cancels."""
    rounds = zip(report["samples_s"][label], report["samples_s"][report["tuned"]], strict=True)
    return statistics.median(other / tuned for other, tuned in rounds)


def _tuning_cost(report: dict[str, Any], tuned_s: float) -> float:
    """What the tuning steps cost beyond running them all at the tuned speed (re-wraps and bucket rebuilds
    included), relative to a 2,000-step run; the tuned speed as measured while tuning, against the same drift."""
    during = report["tuning_step_ms"] / 1000 if report["tuning_step_ms"] else tuned_s
    return (report["tuning_s"] - report["tuning_steps"] * during) / (FUSION_REFERENCE_RUN_STEPS * during)


def run_fusion(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--fusion`` rows: every shape of ``--fusion-shapes`` with its number of ``--fusion-rounds``."""
    rounds = args.fusion_rounds * len(args.fusion_shapes) if len(args.fusion_rounds) == 1 else args.fusion_rounds
    if len(rounds) != len(args.fusion_shapes):
        raise SystemExit(
            f"--fusion-rounds={','.join(map(str, args.fusion_rounds))}: expected one number, or one per shape "
            f"({len(args.fusion_shapes)})"
        )
    rows = [run_fusion_shape(shape, n, args) for shape, n in zip(args.fusion_shapes, rounds, strict=True)]
    return {"settings": report_settings(args), "fusion_rows": rows}
