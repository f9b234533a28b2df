"""The benchmark's rows (:class:`BenchConfig`: a strategy and what the model logs) and the model each row trains."""

from __future__ import annotations

import argparse
import inspect
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy, Strategy

from lightning_shardplus.demo import ClassifierModule
from lightning_shardplus.strategies.ddp import ShardPlusStrategy


@dataclass(frozen=True)
class BenchConfig:
    """One row of the benchmark: a name, how to build its strategy, and how many scalars the model logs per
    training step (1: the demo classifier's loss), with or without ``sync_dist=True``."""

    name: str
    make_strategy: Callable[[], Strategy]
    logged_scalars: int = 1
    sync_dist: bool = False
    count_gradients: bool = True  # counting runs a Python all-reduce hook: off for the rows compared with ddp
    scaling_report: bool = True  # a ScalingReport callback: off for the rows compared with ddp
    prepare_steps: int = 0  # an untimed run of this many steps before the timed ones (the autotune row tunes in it)
    stream: bool = False  # the training data as an iterable stream per rank (uneven_inputs agrees every step)


def strategy_accepts(**kwargs: object) -> bool:
    """Whether ``ShardPlusStrategy`` takes these keyword arguments (rows of features not there yet are left out)."""
    parameters = inspect.signature(ShardPlusStrategy.__init__).parameters
    return all(name in parameters for name in kwargs)


# The autotune row's cache: one per benchmark process, never the user's `~/.cache` one.
_AUTOTUNE_CACHE = Path(tempfile.gettempdir()) / f"shardplus-bench-fusion-{os.getpid()}.json"


def default_configs() -> list[BenchConfig]:
    """Every row of the benchmark matrix, in order; the first, ddp, is the baseline."""

    def shardplus(**kwargs: object) -> Callable[[], Strategy]:
        return lambda: ShardPlusStrategy(start_method="fork", **kwargs)

    def if_accepted(name: str, **kwargs: object) -> list[BenchConfig]:
        """The row of a strategy argument that may not exist yet on this branch (none or one row)."""
        return [BenchConfig(name, shardplus(**kwargs), prepare_steps=300)] if strategy_accepts(**kwargs) else []

    return [
        BenchConfig("ddp", lambda: DDPStrategy(start_method="fork"), scaling_report=False),
        # shardplus against ddp: its defaults (averaged training metrics: nothing here reads the step values, so no
        # all_reduce per step; one per step with --read-every-step), and without any extra feature; neither runs the
        # counting hook nor the ScalingReport
        BenchConfig("shardplus", shardplus(), count_gradients=False, scaling_report=False),
        BenchConfig(
            "shardplus-plain", shardplus(average_training_metrics=False), count_gradients=False, scaling_report=False
        ),
        # plain ddp again (an A/A row): its paired ratio to "ddp" is the benchmark's own bias and spread here
        BenchConfig("ddp-again", lambda: DDPStrategy(start_method="fork"), scaling_report=False),
        # the same data as one stream per rank (equal lengths, so that plain ddp runs too): "shardplus-stream"
        # against "ddp-stream" is the cost of the uneven-inputs agreement (one all-reduce of 5 integers per block
        # of 4 micro-batches) and of the averaged metrics (as above); "ddp-stream" against "ddp" is the iterable
        # loader's own
        BenchConfig(
            "ddp-stream",
            lambda: DDPStrategy(start_method="fork"),
            count_gradients=False,
            scaling_report=False,
            stream=True,
        ),
        BenchConfig("shardplus-stream", shardplus(), count_gradients=False, scaling_report=False, stream=True),
        # the defaults with the ScalingReport: its overhead is this row against "shardplus"
        BenchConfig("shardplus-report", shardplus(), count_gradients=False),
        # gradient communication, counted: "none" is the uncompressed reference of the bytes
        BenchConfig("none", shardplus()),
        BenchConfig("agg4", shardplus(aggregation_frequency=4)),
        BenchConfig("agg8", shardplus(aggregation_frequency=8)),
        BenchConfig("fp16", shardplus(gradient_compression="fp16")),
        BenchConfig("bf16", shardplus(gradient_compression="bf16")),
        BenchConfig("powersgd", shardplus(gradient_compression="powersgd")),
        # bucket size chosen by measurement: an untimed run of 300 steps tunes (into a cache private to this
        # benchmark); the timed runs start from its result, as a user's second run would
        *if_accepted("autotune", auto_tune_tensor_fusion=True, autotune_cache=str(_AUTOTUNE_CACHE)),
        # 16 scalars logged per step: (a) no sync, (b) Lightning's sync_dist=True, (c) shardplus averaging
        # (no ScalingReport: the rows compare the metrics alone)
        BenchConfig("metrics16-nosync", shardplus(average_training_metrics=False), 16, scaling_report=False),
        BenchConfig(
            "metrics16-sync_dist", shardplus(average_training_metrics=False), 16, sync_dist=True, scaling_report=False
        ),
        BenchConfig("metrics16-averaged", shardplus(), 16, scaling_report=False),
        BenchConfig("metrics16-sync_dist-averaged", shardplus(), 16, sync_dist=True, scaling_report=False),
    ]


def select_configs(names: list[str] | None) -> list[BenchConfig]:
    """The default configs named in ``names`` (all if None), in the default order."""
    configs = default_configs()
    return configs if names is None else [c for c in configs if c.name in names]


class ManyMetricsClassifier(ClassifierModule):
    """The demo classifier, logging ``logged_scalars`` scalars per training step: the loss and loss + k."""

    def __init__(self, logged_scalars: int, sync_dist: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.logged_scalars, self.sync_dist = logged_scalars, sync_dist

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch[0]), batch[1])
        detached = loss.detach()
        self.log("train_loss", detached, prog_bar=True, sync_dist=self.sync_dist)
        for k in range(1, self.logged_scalars):
            self.log(f"train_metric_{k:02d}", detached + k, sync_dist=self.sync_dist)
        return loss


def bench_model(config: BenchConfig, args: argparse.Namespace) -> LightningModule:
    """The MLP of ``args`` for ``config``: the demo classifier, or the one that logs many scalars."""
    shape = {"input_dim": args.input_dim, "hidden_dims": [args.hidden_dim] * args.layers}
    if config.logged_scalars == 1 and not config.sync_dist:
        return ClassifierModule(**shape)
    return ManyMetricsClassifier(config.logged_scalars, config.sync_dist, **shape)


class RankStream(torch.utils.data.IterableDataset):
    """This rank's contiguous share of ``dataset``, streamed: an iterable of the length a sampler would give."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Any:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        share = len(self.dataset) // world
        return (self.dataset[i] for i in range(rank * share, (rank + 1) * share))
