"""Averaged training metrics: multi-process fits where every rank logs values the test can compute itself, and
the logger, ``callback_metrics``, the collectives and the host reads are recorded."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _models import cpu_trainer, uncounted_allreduce_hook
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.multiprocessing import ProcessRaisedException  # what a forked rank raised, in this process
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

import lightning_shardplus  # noqa: F401
from lightning_shardplus import ShardPlusStrategy
from lightning_shardplus.data.training_metrics.callback import (
    AverageTrainingMetrics,
    MetricMismatchError,
    describe_mismatch,
)
from lightning_shardplus.diagnostics import CollectiveCalls


def test_mismatch_text_names_metrics_and_ranks():
    text = describe_mismatch([[("a", "mean", "`a`")], [("a", "mean", "`a`"), ("b", "sum", "`b`")]], "batch 3")
    assert "`b` (reduced as sum): logged on rank(s) [1], not on rank(s) [0]" in text
    assert "`a`" not in text.split("values:")[1].split(". Log")[0]


def test_the_public_names_are_importable_from_the_package():
    import lightning_shardplus

    assert lightning_shardplus.AverageTrainingMetrics is AverageTrainingMetrics
    assert lightning_shardplus.MetricMismatchError is MetricMismatchError


# ----------------------------------------------------------------------------------------------------------
# Multi-process fits. Every rank logs values fixed by (rank, batch, k): the test computes each rank's value.


def value(rank: int, batch: int, k: int = 0) -> float:
    """Exact in float32."""
    return (rank + 1) * (k + 1) + batch / 8


COUNTS = {"all_reduce": 0, "all_gather": 0, "barrier": 0}


@pytest.fixture
def count_collectives(monkeypatch):
    """Count the Python-level collectives in every process forked from here (DDP's own gradient all-reduce
    runs in C++ and is not counted, nor the all_gather inside ``all_gather_object``)."""
    for name in COUNTS:
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            COUNTS[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, counted)


def write(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def scalars(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


class FileLogger(Logger):
    """Writes what Lightning hands to loggers, per rank (Lightning calls ``log_metrics`` on every rank; the
    shipped loggers keep rank 0's)."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    @property
    def name(self) -> str:
        return "file"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        write(self.directory / f"logger{dist.get_rank()}.jsonl", {"step": step, "metrics": metrics})


class Recorder(Callback):
    """After the averaging callback: per batch, the collectives since ``on_train_batch_start`` and what
    ``callback_metrics`` and the progress bar hold; at the end, the final ``callback_metrics``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = dict(COUNTS)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        row = {
            "batch": batch_idx,
            "callback": scalars(trainer.callback_metrics),
            "pbar": dict(trainer.progress_bar_metrics),
            **{name: COUNTS[name] - self.start[name] for name in COUNTS},
        }
        row["collectives"] = row["all_reduce"] + row["all_gather"]
        write(self.directory / f"batches{trainer.global_rank}.jsonl", row)

    def on_train_end(self, trainer, pl_module) -> None:
        write(
            self.directory / f"end{trainer.global_rank}.jsonl",
            {"callback": scalars(trainer.callback_metrics)},
        )


class LoggingModule(pl.LightningModule):
    """A linear model on random data, ``batches`` batches per rank; rank r's batches hold ``batch_sizes[r]``
    samples (its own loader, no sampler injection: use ``use_distributed_sampler=False``). Subclasses log."""

    def __init__(self, batch_sizes: list[int], batches: int = 4) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.batch_sizes = batch_sizes
        self.batches = batches

    def train_dataloader(self):
        size = self.batch_sizes[self.global_rank]
        return DataLoader(TensorDataset(torch.randn(size * self.batches, 2)), batch_size=size)

    def on_train_batch_start(self, batch, batch_idx):
        self.batch_idx = batch_idx

    def training_step(self, batch, batch_idx):
        self.log_values(self.global_rank, batch_idx)
        return self.layer(batch[0]).sum()

    def log_values(self, rank: int, batch: int) -> None:
        raise NotImplementedError

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(tmp_path, module, world_size, strategy=None, **trainer_kwargs):
    trainer = cpu_trainer(
        strategy or ShardPlusStrategy(start_method="fork"),
        world_size,
        use_distributed_sampler=False,
        logger=FileLogger(tmp_path),
        **({"callbacks": [Recorder(tmp_path)], "log_every_n_steps": 1, "max_epochs": 1} | trainer_kwargs),
    )
    trainer.fit(module)
    return trainer


def weighted_mean(values, weights):
    return sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)


class AllKinds(LoggingModule):
    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self.log("from_batch_start", value(self.global_rank, batch_idx, 7))

    def log_values(self, r, i):
        self.log("plain", value(r, i, 0), prog_bar=True)  # weight: the batch size Lightning infers
        self.log("weighted", value(r, i, 1), batch_size=r + 1)
        self.log("epoch_mean", value(r, i, 2), batch_size=r + 1, on_epoch=True)
        self.log("synced", value(r, i, 3), sync_dist=True)
        self.log("total", value(r, i, 4), sync_dist=True, reduce_fx="sum", on_epoch=True)
        self.log("peak", value(r, i, 5), sync_dist=True, reduce_fx="max", on_epoch=True)
        self.log("low", torch.tensor([value(r, i, 6)]), sync_dist=True, reduce_fx="min")

    def on_before_optimizer_step(self, optimizer):
        self.log("from_optimizer_hook", value(self.global_rank, self.batch_idx, 8))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.compat
def test_logged_values_are_means_over_ranks_weighted_by_batch_size(tmp_path, count_collectives, world_size):
    sizes = [2, 3, 5][:world_size]  # unequal batches: the inferred weights differ per rank
    given = [r + 1 for r in range(world_size)]  # `batch_size=` given to self.log
    ranks, batches = range(world_size), 4
    fit(tmp_path, AllKinds(sizes, batches), world_size)

    def expected(i: int) -> dict[str, float]:
        return {
            "plain": weighted_mean([value(r, i, 0) for r in ranks], sizes),
            "weighted": weighted_mean([value(r, i, 1) for r in ranks], given),
            "epoch_mean_step": weighted_mean([value(r, i, 2) for r in ranks], given),
            "synced": weighted_mean([value(r, i, 3) for r in ranks], sizes),
            "total_step": sum(value(r, i, 4) for r in ranks),
            "peak_step": max(value(r, i, 5) for r in ranks),
            "low": min(value(r, i, 6) for r in ranks),
            "from_batch_start": weighted_mean([value(r, i, 7) for r in ranks], sizes),
            "from_optimizer_hook": weighted_mean([value(r, i, 8) for r in ranks], sizes),
        }

    epoch = {
        "epoch_mean_epoch": weighted_mean(
            [value(r, i, 2) for r in ranks for i in range(batches)],
            [given[r] for r in ranks for _ in range(batches)],
        ),
        "total_epoch": sum(value(r, i, 4) for r in ranks for i in range(batches)),
        "peak_epoch": max(value(r, i, 5) for r in ranks for i in range(batches)),
    }
    for rank in ranks:
        logged = read(tmp_path / f"logger{rank}.jsonl")
        steps = [row for row in logged if "plain" in row["metrics"]]
        assert [row["step"] for row in steps] == list(range(batches))
        for i, row in enumerate(steps):
            assert row["metrics"] == pytest.approx(expected(i) | {"epoch": 0}, rel=1e-6)
        assert logged[-1]["metrics"] == pytest.approx(epoch | {"epoch": 0}, rel=1e-6)

        rows = read(tmp_path / f"batches{rank}.jsonl")
        # the first step: the names are agreed and reduced at once (a SUM all_reduce and a MAX one of the max/min
        # values, in flight together); then the same two started when backward begins, and one SUM all_reduce of
        # the value logged after it
        assert [(row["collectives"], row["barrier"]) for row in rows] == [(2, 0)] + [(3, 0)] * (batches - 1)
        for i, row in enumerate(rows):
            for name, mean in expected(i).items():
                assert row["callback"][name] == pytest.approx(mean, rel=1e-6), name
            assert row["callback"]["epoch_mean"] == row["callback"]["epoch_mean_step"]
            assert row["pbar"]["plain"] == pytest.approx(expected(i)["plain"], rel=1e-6)
        end = read(tmp_path / f"end{rank}.jsonl")[0]["callback"]
        assert {k: end[k] for k in epoch} == pytest.approx(epoch, rel=1e-6)


class ManyMetrics(LoggingModule):
    def __init__(self, count: int, sync_dist: bool, batches: int = 3) -> None:
        super().__init__([2, 2], batches)
        self.count, self.sync_dist = count, sync_dist

    def log_values(self, r, i):
        self.log_dict({f"m{k:03d}": value(r, i, k) for k in range(self.count)}, sync_dist=self.sync_dist)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("count", "sync_dist", "settings"),
    [
        (0, False, {}),  # nothing logged: every rank still takes part, no hang
        (1, False, {}),
        (5, False, {}),
        (20, False, {}),
        (20, True, {}),  # Lightning's own sync is folded into the one collective
        (100, False, {}),
        (1, False, {"ddp_comm_hook": uncounted_allreduce_hook}),  # whatever DDP's communication
        (1, False, {"find_unused_parameters": True}),
    ],
)
def test_one_collective_per_step_for_any_number_of_metrics(tmp_path, count_collectives, count, sync_dist, settings):
    fit(tmp_path, ManyMetrics(count, sync_dist), 2, ShardPlusStrategy(start_method="fork", **settings))
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert [row["collectives"] for row in rows] == [1, 1, 1]
        assert [row["barrier"] for row in rows] == [0] * 3
        last = count - 1
        for i, row in enumerate(rows if count else []):
            assert row["callback"][f"m{last:03d}"] == (value(0, i, last) + value(1, i, last)) / 2


class BatchNormModule(LoggingModule):
    """A BatchNorm model on fixed per-rank data (its own loader on each rank), saving its final weights."""

    def __init__(self, directory: Path, name: str) -> None:
        super().__init__([4, 4], batches=4)
        self.directory, self.name = directory, name
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

    def train_dataloader(self):
        inputs = torch.randn(16, 2, generator=torch.Generator().manual_seed(self.global_rank))
        return DataLoader(TensorDataset(inputs), batch_size=4)

    def log_values(self, r, i):
        self.log("loss_value", value(r, i), on_epoch=True)

    def on_train_end(self):
        torch.save(self.state_dict(), self.directory / f"{self.name}{self.global_rank}.pt")


@pytest.mark.timeout(120)
def test_averaging_leaves_the_training_bit_identical_to_plain_ddp(tmp_path):
    from lightning.pytorch.strategies import DDPStrategy

    for name, strategy in (("ddp", DDPStrategy(start_method="fork")), ("shardplus", None)):
        fit(tmp_path, BatchNormModule(tmp_path, name), 2, strategy)
    for rank in range(2):
        ddp, shardplus = (torch.load(tmp_path / f"{name}{rank}.pt") for name in ("ddp", "shardplus"))
        assert list(ddp) == list(shardplus)
        assert all(torch.equal(ddp[key], shardplus[key]) for key in ddp)


@pytest.mark.timeout(120)
def test_without_averaging_lightning_behaviour_is_kept(tmp_path, count_collectives):
    class Module(LoggingModule):
        def log_values(self, r, i):
            self.log("own", value(r, i, 0))
            self.log_dict({f"synced{k}": value(r, i, k) for k in range(1, 4)}, sync_dist=True)

    fit(tmp_path, Module([2, 3]), 2, ShardPlusStrategy(start_method="fork", average_training_metrics=False))
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        # one barrier plus one all_reduce per sync_dist value
        assert [(row["all_reduce"], row["barrier"]) for row in rows] == [(3, 3)] * 4
        for i, row in enumerate(rows):
            assert row["callback"]["own"] == value(rank, i, 0)
            assert row["callback"]["synced2"] == (value(0, i, 2) + value(1, i, 2)) / 2  # unweighted
    logged = [row["metrics"] for row in read(tmp_path / "logger0.jsonl")]
    assert [m["own"] for m in logged] == [value(0, i, 0) for i in range(4)]


class LateFromBatch(LoggingModule):
    """Logs `loss` in training_step, and `grad_stat` in `on_before_optimizer_step` from batch ``first`` on
    (on rank ``only`` alone when given)."""

    def __init__(self, directory: Path, first: int, only: int | None = None) -> None:
        super().__init__([2, 3], batches=5)
        self.directory, self.first, self.only = directory, first, only

    def log_values(self, r, i):
        self.log("loss", value(r, i))

    def on_train_start(self):
        self.catching = warnings.catch_warnings(record=True)
        self.caught = self.catching.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self):
        self.catching.__exit__(None, None, None)
        write(self.directory / f"warnings{self.global_rank}.jsonl", {"warnings": [str(w.message) for w in self.caught]})

    def on_before_optimizer_step(self, optimizer):
        if self.batch_idx >= self.first and self.only in (None, self.global_rank):
            self.log("grad_stat", value(self.global_rank, self.batch_idx, 1))


@pytest.mark.timeout(120)
def test_values_first_logged_after_backward_join_a_second_reduction(tmp_path, count_collectives):
    # the step's collective starts when backward begins: a value first logged in `on_before_optimizer_step` (batch 2)
    # is announced in the next step's collective, whose logging step agrees on the new names and reduces that step
    # again; from then on it has its own collective after the optimizer step, in the steps that log it. No warning.
    fit(tmp_path, LateFromBatch(tmp_path, first=2), 2)
    sizes = [2, 3]
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert [row["collectives"] for row in rows] == [1, 1, 1, 1 + 1, 2]
        for i, row in enumerate(rows):
            assert row["callback"]["loss"] == pytest.approx(weighted_mean([value(0, i), value(1, i)], sizes))
        caught = read(tmp_path / f"warnings{rank}.jsonl")[0]["warnings"]
        assert not any("shardplus" in text for text in caught)
        assert rows[2]["callback"]["grad_stat"] == value(rank, 2, 1)  # its first step: this rank's own, as ddp
        for i in (3, 4):
            mean = weighted_mean([value(0, i, 1), value(1, i, 1)], sizes)
            assert rows[i]["callback"]["grad_stat"] == pytest.approx(mean)


@pytest.mark.timeout(60)
def test_a_value_logged_after_backward_on_one_rank_only_is_that_ranks_value(tmp_path):
    # from batch 1 rank 1 alone logs `grad_stat`: the mean over the ranks that logged it is its own; no error
    fit(tmp_path, LateFromBatch(tmp_path, first=1, only=1), 2)
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        expected = [None] * 5 if rank == 0 else [None] + [value(1, i, 1) for i in range(1, 5)]
        assert [row["callback"].get("grad_stat") for row in rows] == expected


class ExtraOnLastRank(LoggingModule):
    def __init__(self, change: str) -> None:
        super().__init__([2, 2, 2])
        self.change = change

    def log_values(self, r, i):
        last = r == self.trainer.world_size - 1 and i == 1
        if self.change == "extra":
            self.log("loss", value(r, i))
            if last:
                self.log("extra_metric", value(r, i))
        elif self.change == "renamed":
            self.log("renamed_metric" if last else "loss", value(r, i))
        else:  # the same name, reduced differently on the last rank (from the first batch on)
            other = r == self.trainer.world_size - 1
            self.log("loss", value(r, i), sync_dist=other, reduce_fx="max" if other else "mean")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_name_reduced_differently_on_another_rank_raises_a_named_error(tmp_path, world_size):
    last = world_size - 1
    message = rf"batch 0.*`loss` \(from training_step\) \(reduced as max\): logged on rank\(s\) \[{last}\]"
    with pytest.raises(ProcessRaisedException, match=message):
        fit(tmp_path, ExtraOnLastRank("reduction"), world_size)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world_size", "change"), [(2, "extra"), (3, "extra"), (3, "renamed")])
def test_names_logged_on_some_ranks_are_averaged_over_those_ranks(tmp_path, world_size, change):
    # at batch 1 the last rank logs a name the others do not (as ddp trains on): each name's value is the mean over
    # the ranks that logged it; a rank that never logged a name does not show it
    fit(tmp_path, ExtraOnLastRank(change), world_size)
    last, others = world_size - 1, range(world_size - 1)
    for rank in range(world_size):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        name = "extra_metric" if change == "extra" else "renamed_metric"
        assert rows[1]["callback"].get(name) == (value(last, 1) if rank == last else None)
        loss_ranks = range(world_size) if change == "extra" else others
        assert rows[1]["callback"]["loss"] == pytest.approx(sum(value(r, 1) for r in loss_ranks) / len(loss_ranks))


class ExtraBetweenLoggingSteps(LoggingModule):
    """Rank 1 logs ``extra`` more metrics than rank 0, at batch 1 only."""

    def __init__(self, extra: int) -> None:
        super().__init__([2, 2], batches=4)
        self.extra = extra

    def log_values(self, r, i):
        self.log("loss", value(r, i))
        if r == 1 and i == 1:
            self.log_dict({f"extra{k:03d}": value(r, i, k) for k in range(self.extra)})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra", [1, 100])  # 100: rank 1 logs more names than agreed, rank 0 does not
def test_names_new_between_logging_steps_are_own_values_until_the_next_check(tmp_path, extra):
    # no logging step inside the epoch: the names join at its end (one host read); until then rank 1 shows its own
    # values for them, and ranks with different names neither hang nor mix them
    fit(tmp_path, ExtraBetweenLoggingSteps(extra), 2, log_every_n_steps=50)
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert rows[1]["callback"].get("extra000") == (value(1, 1, 0) if rank == 1 else None)
        assert [row["callback"]["loss"] for row in rows] == [(value(0, i) + value(1, i)) / 2 for i in range(4)]


class CountsWithoutReading(Callback):
    """Per batch, the collectives since ``on_train_batch_start``, without reading the step values (it says so:
    ``reads_step_values = False``); ``callback_metrics`` where Lightning's own callbacks read them: when validation
    starts and at the end of the epoch (after the averaging callback)."""

    reads_step_values = False

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = dict(COUNTS)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        counts = {name: COUNTS[name] - self.start[name] for name in COUNTS}
        write(self.directory / f"batches{trainer.global_rank}.jsonl", {"collectives": sum(counts.values())})

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        row = {"batch": pl_module.batch_idx, "callback": scalars(trainer.callback_metrics)}
        write(self.directory / f"validation{trainer.global_rank}.jsonl", row)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        write(self.directory / f"end{trainer.global_rank}.jsonl", {"callback": scalars(trainer.callback_metrics)})


class LossAndValidation(LoggingModule):
    def log_values(self, r, i):
        self.log("loss", value(r, i), on_epoch=True)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)

    def validation_step(self, batch, batch_idx):
        pass


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_steps_nothing_reads_are_averaged_only_where_read(tmp_path, count_collectives, world_size):
    # no progress bar and no callback that reads every step: the steps the logger reads (every 3rd), the first (the
    # names' agreement) and the epoch's last run a collective, the others none; the last step before validation is
    # averaged when validation starts
    sizes, batches = [2, 3, 5][:world_size], 8
    fit(
        tmp_path, LossAndValidation(sizes, batches), world_size, callbacks=[CountsWithoutReading(tmp_path)],
        log_every_n_steps=3, val_check_interval=5, limit_val_batches=1,
    )  # fmt: skip

    def mean(i):
        return weighted_mean([value(r, i) for r in range(world_size)], sizes)

    everything = weighted_mean([value(r, i) for i in range(batches) for r in range(world_size)], sizes * batches)
    for rank in range(world_size):
        collectives = [row["collectives"] for row in read(tmp_path / f"batches{rank}.jsonl")]
        assert collectives == [1, 0, 1, 0, 0, 1, 0, 1]
        logged = [row for row in read(tmp_path / f"logger{rank}.jsonl") if "loss_step" in row["metrics"]]
        assert [row["metrics"]["loss_step"] for row in logged] == pytest.approx([mean(2), mean(5)])
        validation = read(tmp_path / f"validation{rank}.jsonl")
        assert [row["batch"] for row in validation] == [4]
        assert [row["callback"]["loss_step"] for row in validation] == pytest.approx([mean(4)])
        end = read(tmp_path / f"end{rank}.jsonl")[0]["callback"]
        assert end["loss_step"] == pytest.approx(mean(7))
        assert end["loss_epoch"] == pytest.approx(everything)


class SometimesLogged(LoggingModule):
    """``rare`` at batches ``at`` (rank r: reduced as ``reductions[r]``); ``loss`` every batch of 8."""

    def __init__(self, reductions: list[str], at: tuple[int, ...]) -> None:
        super().__init__([2, 2], batches=8)
        self.reductions, self.at = reductions, at

    def log_values(self, r, i):
        self.log("loss", value(r, i))
        if i in self.at:
            reduction = self.reductions[r]
            self.log("rare", value(r, i, 1), sync_dist=reduction != "mean", reduce_fx=reduction)


@pytest.mark.timeout(120)
def test_a_name_logged_only_in_steps_nothing_reads_shows_its_mean_where_it_is_read(tmp_path, count_collectives):
    # `rare` is logged in batch 5, which nothing reads; the logger reads batch 7 (log_every_n_steps=4), where no rank
    # logs it: it shows the mean of each rank's latest value (batch 5), as it did when every step was averaged
    callbacks = [CountsWithoutReading(tmp_path)]
    fit(tmp_path, SometimesLogged(["mean", "mean"], at=(0, 5)), 2, callbacks=callbacks, log_every_n_steps=4)
    for rank in range(2):
        assert [row["collectives"] for row in read(tmp_path / f"batches{rank}.jsonl")] == [1, 0, 0, 1, 0, 0, 0, 1]
        logged = [row["metrics"] for row in read(tmp_path / f"logger{rank}.jsonl") if "loss" in row["metrics"]]
        means = [(value(0, i, 1) + value(1, i, 1)) / 2 for i in (0, 5)]
        assert [row["rare"] for row in logged] == means  # batches 3 and 7
        end = read(tmp_path / f"end{rank}.jsonl")[0]["callback"]
        assert end["rare"] == means[1]
        assert end["loss"] == (value(0, 7) + value(1, 7)) / 2


@pytest.mark.timeout(120)
def test_a_name_reduced_differently_in_steps_nothing_reads_raises_at_the_next_averaged_step(tmp_path):
    # announced in the collective of the next averaged step (the epoch's last, batch 7) and compared there
    callbacks = [CountsWithoutReading(tmp_path)]
    expected = r"at epoch 0, batch 7.*`rare` \(from training_step\) \(reduced as max\)"
    with pytest.raises(ProcessRaisedException, match=expected):
        fit(tmp_path, SometimesLogged(["mean", "max"], at=(5,)), 2, callbacks=callbacks, log_every_n_steps=50)


class LoggedAtDifferentBatches(LoggingModule):
    """``part`` and a sync_dist max ``peak``: rank 1 at batch 4, rank 0 at batch 5; ``rare``: rank r at batch 3 + r."""

    def __init__(self) -> None:
        super().__init__([2, 2], batches=8)

    def log_values(self, r, i):
        self.log("loss", value(r, i))
        if i == 5 - r:
            self.log("part", value(r, i, 1))
            self.log("peak", value(r, i, 2) * (10 if r else 1), sync_dist=True, reduce_fx="max")
        if i == 3 + r:
            self.log("rare", value(r, i, 3))


@pytest.mark.timeout(120)
def test_a_name_logged_in_a_read_step_shows_that_steps_ranks_and_else_each_ranks_latest(tmp_path):
    # read steps: batches 0, 2, 5 (log_every_n_steps=3) and 7; at batch 5 rank 0 logs `part` and `peak`, which rank 1
    # logged at the unread batch 4: the step's value is rank 0's (the ranks that logged it in the step, as when
    # every step was averaged); `rare`, logged by no rank at batch 5, shows the mean of each rank's latest value
    fit(tmp_path, LoggedAtDifferentBatches(), 2, callbacks=[CountsWithoutReading(tmp_path)], log_every_n_steps=3)
    for rank in range(2):
        logged = [row["metrics"] for row in read(tmp_path / f"logger{rank}.jsonl") if "loss" in row["metrics"]]
        assert logged[1]["part"] == value(0, 5, 1) and logged[1]["peak"] == value(0, 5, 2)
        assert logged[1]["rare"] == (value(0, 3, 3) + value(1, 4, 3)) / 2


class StopsEachEpochEarly(LoggingModule):
    """Ends each epoch before its batch 6 of 8 (``on_train_batch_start`` returns -1): Lightning's loader never
    says which batch is the last."""

    def log_values(self, r, i):
        self.log("loss", value(r, i))

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        return -1 if batch_idx == 6 else None


@pytest.mark.timeout(120)
def test_an_epoch_that_ends_early_reduces_its_last_step_at_its_end(tmp_path, count_collectives):
    callbacks = [CountsWithoutReading(tmp_path)]
    fit(tmp_path, StopsEachEpochEarly([2, 3], batches=8), 2, callbacks=callbacks, log_every_n_steps=50)
    for rank in range(2):
        assert [row["collectives"] for row in read(tmp_path / f"batches{rank}.jsonl")] == [1] + [0] * 5
        end = read(tmp_path / f"end{rank}.jsonl")[0]["callback"]
        assert end["loss"] == pytest.approx(weighted_mean([value(0, 5), value(1, 5)], [2, 3]))


class ReadsOnRankZero(Callback):
    """A reader on rank 0 only (as `enable_progress_bar=(rank == 0)` would make one)."""

    def setup(self, trainer, pl_module, stage) -> None:
        self.reads_step_values = trainer.global_rank == 0


@pytest.mark.timeout(120)
def test_ranks_whose_trainers_read_differently_average_every_step(tmp_path, count_collectives):
    # rank 0 reads every step, rank 1 nothing: the first step's agreement finds it, and every rank averages every step
    callbacks = [CountsWithoutReading(tmp_path), ReadsOnRankZero()]
    fit(tmp_path, SometimesLogged(["mean", "mean"], at=()), 2, callbacks=callbacks, log_every_n_steps=50)
    for rank in range(2):
        assert [row["collectives"] for row in read(tmp_path / f"batches{rank}.jsonl")] == [1] * 8
        assert read(tmp_path / f"end{rank}.jsonl")[0]["callback"]["loss"] == (value(0, 7) + value(1, 7)) / 2


def test_what_reads_the_step_values_after_every_step():
    from datetime import timedelta

    from lightning.pytorch.callbacks import LambdaCallback, LearningRateMonitor, ModelCheckpoint, RichProgressBar
    from lightning.pytorch.utilities.types import LRSchedulerConfig

    from lightning_shardplus.data.training_metrics.readers import reading_interval

    class Reads(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            print(trainer.callback_metrics)

    class Says(Reads):
        reads_step_values = False

    class EpochOnly(Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            print(trainer.callback_metrics)

    class EveryStepCheckpoint(ModelCheckpoint):  # a subclass of your own, with a per-batch hook
        def on_train_batch_end(self, trainer, *args) -> None:
            super().on_train_batch_end(trainer, *args)

    class TakesTheIterator(pl.LightningModule):
        def training_step(self, dataloader_iter):
            return next(dataloader_iter)

    class ReadsAfterEachBatch(pl.LightningModule):
        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            print(self.trainer.callback_metrics)

    def reads(*callbacks, module=None, schedulers=(), **kwargs):
        trainer = pl.Trainer(callbacks=list(callbacks), logger=False, **({"enable_progress_bar": False} | kwargs))
        if module is not None:
            trainer.strategy.connect(module)
        trainer.strategy.lr_scheduler_configs = list(schedulers)
        return reading_interval(trainer)

    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    assert reads(schedulers=[LRSchedulerConfig(plateau, interval="step", reduce_on_plateau=True, monitor="loss")])
    assert not reads(schedulers=[LRSchedulerConfig(plateau, interval="epoch", reduce_on_plateau=True, monitor="l")])
    assert reads(module=ReadsAfterEachBatch())
    assert not reads(module=LoggingModule([2, 2]))  # its hooks log (on_train_batch_start): not read
    assert reads(LambdaCallback(on_train_batch_end=print))
    assert not reads(LambdaCallback(on_train_epoch_end=print))
    assert reads(EveryStepCheckpoint())

    assert reads(enable_progress_bar=True) == 1  # the default progress bar refreshes every batch
    assert not reads(TQDMProgressBar(refresh_rate=0), enable_progress_bar=True)
    assert reads(TQDMProgressBar(refresh_rate=5), enable_progress_bar=True) == 5  # every 5th batch and the last
    assert reads(TQDMProgressBar(refresh_rate=5), Reads(), enable_progress_bar=True) == 1
    assert reads(TQDMProgressBar(refresh_rate=5), ModelCheckpoint(every_n_train_steps=5), enable_progress_bar=True) == 1
    # `training_step(dataloader_iter)`: the bar counts the fetcher's batches, not the loop's
    assert reads(TQDMProgressBar(refresh_rate=5), module=TakesTheIterator(), enable_progress_bar=True) == 1
    if importlib.util.find_spec("rich") is not None:  # it reads the values after every batch, whatever its rate
        assert reads(RichProgressBar(refresh_rate=5), enable_progress_bar=True) == 1
    assert not reads()  # the default ModelCheckpoint saves at epoch ends
    assert not reads(LearningRateMonitor(), EpochOnly(), Says(), ModelCheckpoint(every_n_epochs=2))
    assert reads(Reads())
    assert reads(ModelCheckpoint(every_n_train_steps=5))
    assert reads(ModelCheckpoint(train_time_interval=timedelta(minutes=5)))


class RecordingBar(TQDMProgressBar):
    """Lightning's TQDM bar, writing what it reads each time it refreshes its values (rank 0: Lightning disables the
    bar on the other ranks). No per-batch hook of its own: it reads every ``refresh_rate``-th batch, as Lightning's."""

    def __init__(self, directory: Path, refresh_rate: int) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.directory = directory

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        if trainer.training:
            row = {
                "batch": pl_module.batch_idx, "total": self.train_progress_bar.total,
                "metrics": {k: float(v) for k, v in metrics.items() if k != "v_num"},
            }  # fmt: skip
            write(self.directory / f"bar{trainer.global_rank}.jsonl", row)
        return metrics


class ShownInTheBar(LoggingModule):
    def log_values(self, r, i):
        self.log("loss", value(r, i), prog_bar=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("frequency", "max_steps", "by_bar_total"),
    [
        (1, -1, {10: ([0, 2, 5, 8, 9], [2, 5, 8, 9, 9])}),
        (2, -1, {10: ([1, 5, 7, 9], [2, 5, 8, 9, 9])}),
        # (every release: Lightning 2.5 and newer count the bar's total to max_steps, 2.4 to the loader's length)
        pytest.param(2, 4, {4: ([1, 3, 5, 7], [2, 3, 5, 7]), 10: ([1, 5, 7], [2, 5, 7])}, marks=pytest.mark.compat),
    ],
)
def test_a_progress_bar_refreshing_every_third_batch_reads_exact_means_and_only_its_steps_are_averaged(
    tmp_path, count_collectives, frequency, max_steps, by_bar_total
):
    # 10 batches per rank (batch index 0 - 9); the bar reads after batches 3, 6, 9 (from 1) and its total, 10, and
    # once more at the epoch end. Averaged: the first step (the names agreed), each step whose values the bar reads
    # (its last batch, or a batch before the next step's last), and the last. Aggregating 2 micro-batches, steps end
    # at batches 2, 4, ..., 10: batch 3 shows step 2's values, 6 step 6's, 9 step 8's. With max_steps=4 (and
    # max_epochs=-1, as Lightning sets it for max_steps alone) Lightning 2.5 and newer count the bar's total to 4
    # batches: it reads after batch 4, a step averaged for that, while training goes on to batch 8 (4 optimizer steps)
    strategy = ShardPlusStrategy(start_method="fork", aggregation_frequency=frequency)
    callbacks = [CountsWithoutReading(tmp_path), RecordingBar(tmp_path, refresh_rate=3)]
    module = ShownInTheBar([2, 3], batches=10)
    limits = {"max_epochs": -1, "max_steps": max_steps} if max_steps > 0 else {}
    fit(tmp_path, module, 2, strategy, callbacks=callbacks, enable_progress_bar=True, log_every_n_steps=50, **limits)
    read_by_bar = read(tmp_path / "bar0.jsonl")
    averaged_steps, read_at = by_bar_total[read_by_bar[0]["total"]]
    for rank in range(2):
        counts = [row["collectives"] for row in read(tmp_path / f"batches{rank}.jsonl")]
        assert [i for i, count in enumerate(counts) if count] == averaged_steps
    assert [row["batch"] for row in read_by_bar] == read_at
    for row in read_by_bar:
        step_end = row["batch"] // frequency * frequency + frequency - 1  # the batch that ends the step shown
        step_end = step_end if step_end <= row["batch"] else step_end - frequency
        window = range(step_end - frequency + 1, step_end + 1)
        values = [value(r, i) for i in window for r in range(2)]
        assert row["metrics"]["loss"] == pytest.approx(weighted_mean(values, [2, 3] * frequency))


class ExtremesInSomeSteps(LoggingModule):
    def __init__(self) -> None:
        super().__init__([2, 3], batches=6)

    def log_values(self, r, i):
        self.log("loss", value(r, i))
        if i in (2, 3):
            self.log("peak", value(r, i, 1), sync_dist=True, reduce_fx="max")
            self.log("low", value(r, i, 2), sync_dist=True, reduce_fx="min")


@pytest.mark.timeout(120)
def test_max_and_min_cost_one_more_collective_only_in_steps_that_log_them(tmp_path, count_collectives):
    fit(tmp_path, ExtremesInSomeSteps(), 2)
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        # batch 2 brings new names on every rank: that logging step agrees on them and reduces again; from then on
        # a MAX all_reduce beside the SUM one (the layout keeps them)
        assert [row["collectives"] for row in rows] == [1, 1, 1 + 2, 2, 2, 2]
        for i in (2, 3):
            assert rows[i]["callback"]["peak"] == max(value(r, i, 1) for r in range(2))
            assert rows[i]["callback"]["low"] == min(value(r, i, 2) for r in range(2))
        for i, row in enumerate(rows):
            assert row["callback"]["loss"] == pytest.approx(weighted_mean([value(0, i), value(1, i)], [2, 3]))


class NaNsAndZeroWeights(LoggingModule):
    def log_values(self, r, i):
        nan_or_one = math.nan if r == 1 else 1.0
        self.log("peak", nan_or_one, sync_dist=True, reduce_fx="max")
        self.log("low", -math.inf, sync_dist=True, reduce_fx="min")
        self.log("loss", nan_or_one)
        self.log("unweighted", 3.0, batch_size=0)


@pytest.mark.timeout(120)
def test_a_nan_propagates_as_in_torch_and_a_zero_total_weight_gives_the_plain_mean(tmp_path):
    fit(tmp_path, NaNsAndZeroWeights([2, 2], batches=2), 2)
    for rank in range(2):
        for row in read(tmp_path / f"batches{rank}.jsonl"):
            shown = row["callback"]
            assert math.isnan(shown["peak"]) and math.isnan(shown["loss"])
            assert shown["unweighted"] == 3.0  # no weight on any rank: the plain mean, as ddp's sync_dist
            assert shown["low"] == -math.inf


# Host reads: every call of these on a tensor whose first caller outside torch is in lightning_shardplus. On an
# accelerator each one waits for the device; between two logging steps shardplus should make none.
HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
PACKAGE = str(Path(lightning_shardplus.__file__).parent)
TORCH = str(Path(torch.__file__).parent)
READS = {"host": 0}


@pytest.fixture
def count_host_reads(monkeypatch):
    """Count the host reads made by lightning_shardplus in every process forked from here (undone after the
    test)."""

    def counting(original):
        def counted(self, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
                READS["host"] += 1
            return original(self, *args, **kwargs)

        return counted

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))


class HostReads(Callback):
    """The host reads by shardplus between the start and the end of each batch (after the averaging callback,
    which the strategy puts first)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = READS["host"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        write(self.directory / f"reads{trainer.global_rank}.jsonl", {"reads": READS["host"] - self.start})


class EveryKind(LoggingModule):
    def __init__(self, extremes: bool) -> None:
        super().__init__([2, 3], batches=6)
        self.extremes = extremes

    def log_values(self, r, i):
        self.log("loss", value(r, i), on_epoch=True)
        self.log("tokens", value(r, i, 1), sync_dist=True, reduce_fx="sum")
        if self.extremes:
            self.log("peak", value(r, i, 2), sync_dist=True, reduce_fx="max")
            self.log("low", value(r, i, 3), sync_dist=True, reduce_fx="min")


class EveryKindAndAfterBackward(EveryKind):
    """Also logs after backward."""

    def on_before_optimizer_step(self, optimizer):
        self.log("grad_stat", value(self.global_rank, self.batch_idx, 4))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", [EveryKind, EveryKindAndAfterBackward])
@pytest.mark.parametrize("extremes", [False, True])
def test_training_steps_read_nothing_on_the_host(tmp_path, count_host_reads, count_collectives, module, extremes):
    # map-style data: `EvenSteps` (iterable data only) does not run; no logging step inside the epoch (the
    # names are checked on the host at its last step); the first step agrees on the names (`all_gather_object` reads
    # the host), the others read nothing and run one SUM all_reduce (plus a MAX one with max/min values, in flight
    # together), plus one SUM all_reduce of the value logged after backward
    callbacks = [Recorder(tmp_path), HostReads(tmp_path)]
    fit(tmp_path, module(extremes), 2, log_every_n_steps=50, callbacks=callbacks)
    sizes = [2, 3]
    for rank in range(2):
        # the epoch's last step checks the names on the host (the one read the epoch end made before)
        assert [row["reads"] for row in read(tmp_path / f"reads{rank}.jsonl")][1:] == [0] * 4 + [1]
        late = module is EveryKindAndAfterBackward
        expected = [1 + extremes] + [1 + extremes + late] * 5
        assert [row["collectives"] for row in read(tmp_path / f"batches{rank}.jsonl")] == expected
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert len(rows) == 6
        for i, row in enumerate(rows):
            metrics = row["callback"]
            assert metrics["loss_step"] == pytest.approx(weighted_mean([value(0, i), value(1, i)], sizes))
            assert metrics["tokens"] == pytest.approx(value(0, i, 1) + value(1, i, 1))
            if module is EveryKindAndAfterBackward:
                assert metrics["grad_stat"] == pytest.approx(weighted_mean([value(0, i, 4), value(1, i, 4)], sizes))
            if extremes:
                assert metrics["peak"] == value(1, i, 2) and metrics["low"] == value(0, i, 3)


class LogsDuringBackward(LoggingModule):
    """Logs from a tensor hook during backward: a place no Lightning hook override reveals."""

    def __init__(self) -> None:
        super().__init__([2, 3], batches=3)

    def log_values(self, r, i):
        self.log("loss", value(r, i))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        late = torch.tensor(value(self.global_rank, batch_idx, 5))
        loss.register_hook(lambda grad: self.log("during_backward", late) or grad)
        return loss


@pytest.mark.timeout(120)
def test_a_value_logged_during_backward_is_averaged_with_the_rest(tmp_path):
    fit(tmp_path, LogsDuringBackward(), 2)
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert len(rows) == 3
        for i, row in enumerate(rows):
            during = weighted_mean([value(0, i, 5), value(1, i, 5)], [2, 3])
            assert row["callback"]["during_backward"] == pytest.approx(during)
            assert row["callback"]["loss"] == pytest.approx(weighted_mean([value(0, i), value(1, i)], [2, 3]))


class Accumulating(LoggingModule):
    def log_values(self, r, i):
        self.log("acc", value(r, i), on_epoch=True)


@pytest.mark.timeout(120)
def test_with_accumulation_values_are_averaged_per_optimizer_step(tmp_path, count_collectives):
    sizes, batches, window = [2, 3], 7, 3  # windows of micro-batches: 0-2, 3-5, 6 (the epoch's last, smaller)
    fit(tmp_path, Accumulating(sizes, batches), 2, accumulate_grad_batches=window)
    windows = [[0, 1, 2], [3, 4, 5], [6]]

    def window_mean(w):
        return weighted_mean([value(r, i) for i in w for r in range(2)], [sizes[r] for i in w for r in range(2)])

    everything = weighted_mean([value(r, i) for i in range(batches) for r in range(2)], sizes * batches)
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert [row["collectives"] for row in rows] == [0, 0, 1, 0, 0, 1, 1]  # one per optimizer step
        shown = [row["callback"].get("acc_step") for row in rows]
        # between optimizer steps callback_metrics keep the previous step's value (none before the first)
        means = [window_mean(w) for w in windows]
        assert shown[:2] == [None, None]
        assert shown[2:] == pytest.approx([means[0], means[0], means[0], means[1], means[2]], rel=1e-6)
        logged = [row["metrics"] for row in read(tmp_path / f"logger{rank}.jsonl")]
        assert [m["acc_step"] for m in logged[:-1]] == pytest.approx(means, rel=1e-6)
        assert logged[-1]["acc_epoch"] == pytest.approx(everything, rel=1e-6)


@pytest.mark.timeout(120)
def test_manual_optimization_averages_every_batch(tmp_path, count_collectives):
    class Manual(Accumulating):
        def __init__(self):
            super().__init__([2, 3], batches=3)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            optimizer.step()

    fit(tmp_path, Manual(), 2)
    rows = read(tmp_path / "batches0.jsonl")
    assert [row["collectives"] for row in rows] == [1, 1, 1]
    assert [row["callback"]["acc_step"] for row in rows] == pytest.approx(
        [weighted_mean([value(0, i), value(1, i)], [2, 3]) for i in range(3)], rel=1e-6
    )


@pytest.mark.timeout(120)
def test_metric_objects_rank_zero_only_and_late_values_are_left_to_lightning(tmp_path):
    class Module(LoggingModule):
        def __init__(self):
            super().__init__([2, 2], batches=2)
            self.mean_metric = MeanMetric()

        def log_values(self, r, i):
            self.log("loss", value(r, i))
            self.mean_metric(value(r, i, 1))
            self.log("metric_object", self.mean_metric, on_step=False, on_epoch=True)
            if r == 0:
                self.log("rank_zero", value(r, i, 2), rank_zero_only=True)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.log("late", value(self.global_rank, batch_idx, 3))

    fit(tmp_path, Module(), 2)
    for rank in range(2):
        end = read(tmp_path / f"end{rank}.jsonl")[0]["callback"]
        assert end["loss"] == (value(0, 1) + value(1, 1)) / 2
        assert end["late"] == value(rank, 1, 3)  # this rank's own value
        assert ("rank_zero" in end) == (rank == 0)
        # the torchmetrics object syncs itself at epoch end
        assert end["metric_object"] == pytest.approx(sum(value(r, i, 1) for r in range(2) for i in range(2)) / 4)


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    not CollectiveCalls.available(),
    reason="the benchmark counts through ProcessGroup pre-collective hooks (torch >= 2.14); the counts above are "
    "proven by the count_collectives fixture on every torch",
)
def test_bench_counts_the_collectives_of_the_metric_rows():
    from lightning_shardplus import bench

    def per_step(*flags):
        args = bench.parse_args(
            ["--repeats=1", "--steps=3", "--warmup=1", "--global-batch-size=8", "--input-dim=4", "--hidden-dim=8"]
            + ["--layers=1", "--configs=metrics16-nosync,metrics16-sync_dist,metrics16-averaged", *flags]
        )
        report = bench.run(bench.select_configs(args.configs), args)
        assert "| metrics16-averaged |" in bench.format_table(report)
        return {name: (r["all_reduce_per_step"], r["barrier_per_step"]) for name, r in report["results"].items()}

    assert per_step("--read-every-step") == {
        "metrics16-nosync": (0, 0),  # (a)
        "metrics16-sync_dist": (16, 16),  # (b): Lightning syncs each value
        "metrics16-averaged": (1, 0),  # (c)
    }
    # without a reader (no logger, progress bar or callback reading): of the 3 timed steps only the last (max_steps,
    # which the end reads) is averaged
    assert per_step()["metrics16-averaged"] == (1 / 3, 0)


class WideManyMetrics(ManyMetrics):
    """2 MB of parameters more, so that bucket sizes make other buckets (the tuner races them)."""

    def __init__(self, batches: int) -> None:
        super().__init__(1, False, batches)
        self.wide = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + self.wide(torch.zeros(1, 256)).sum() * 0


@pytest.mark.timeout(120)
def test_values_stay_averaged_across_the_ddp_rewraps_of_fusion_tuning(tmp_path, count_collectives):
    # each re-wrap builds a new DDP: the values stay the means over ranks, one all_reduce per step
    log = tmp_path / "autotune.csv"
    strategy = ShardPlusStrategy(
        start_method="fork",
        auto_tune_tensor_fusion=True,
        autotune_cache=False,
        autotune_log=str(log),
        autotune_candidates_mb=[0.3, 25.0],
        autotune_first_bucket_candidates_mb=[],
        autotune_steps_per_sample=1,
        autotune_warmup_steps=1,
    )
    batches = 12
    fit(tmp_path, WideManyMetrics(batches), 2, strategy)
    samples = [line for line in log.read_text().splitlines()[1:] if line[:1].isdigit()]
    assert len(samples) >= 2, log.read_text()  # it raced: DDP was re-wrapped
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert len(rows) == batches
        for i, row in enumerate(rows):
            assert row["callback"]["m000"] == (value(0, i) + value(1, i)) / 2, i


# ----------------------------------------------------------------------------------------------------------
# The cases an outside tester found: each compared with a hand computation.


class RankBatches(torch.utils.data.IterableDataset):
    """Rank r streams ``lengths[r]`` batches of 2 samples (possibly none)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __iter__(self):
        for i in range(self.lengths[dist.get_rank()]):
            yield torch.full((2, 2), float(i))


HOOKS = {"loss": 0, "batch_start": 1, "after_backward": 2, "before_optimizer_step": 3, "before_zero_grad": 4}


class LogsInEveryHook(LoggingModule):
    """Logs from training_step and from hooks a rank without data still runs (`uneven_inputs="join"`)."""

    def __init__(self, lengths: list[int]) -> None:
        super().__init__([2] * len(lengths))
        self.lengths = lengths

    def train_dataloader(self):
        return DataLoader(RankBatches(self.lengths), batch_size=None)

    def training_step(self, batch, batch_idx):
        self.log("loss", value(self.global_rank, batch_idx, HOOKS["loss"]))
        return self.layer(batch).sum()

    def _log_hook(self, name: str, **kwargs) -> None:
        self.log(name, value(self.global_rank, self.batch_idx, HOOKS[name]), **kwargs)

    def on_train_batch_start(self, batch, batch_idx):
        self.batch_idx = batch_idx
        self._log_hook("batch_start")

    def on_after_backward(self):
        self._log_hook("after_backward", on_epoch=True)

    def on_before_optimizer_step(self, optimizer):
        self._log_hook("before_optimizer_step")

    def on_before_zero_grad(self, optimizer):
        self._log_hook("before_zero_grad")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("lengths", "window"), [([3, 0], 1), ([4, 1, 0], 1), ([3, 0], 2), ([5, 2, 0], 2)])
def test_a_rank_without_data_contributes_to_no_value_whatever_hooks_it_runs(tmp_path, lengths, window):
    strategy = ShardPlusStrategy(start_method="fork", uneven_inputs="join", aggregation_frequency=window)
    fit(tmp_path, LogsInEveryHook(lengths), len(lengths), strategy)
    batches = max(lengths)
    windows = [list(range(start, min(start + window, batches))) for start in range(0, batches, window)]
    logged_in = {  # the micro-batches of a window where each name is logged
        "loss": lambda w: w, "batch_start": lambda w: w, "after_backward": lambda w: w,
        "before_optimizer_step": lambda w: w[-1:], "before_zero_grad": lambda w: w[:1],
    }  # fmt: skip
    for rank in range(len(lengths)):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert len(rows) == batches
        for w in windows:
            shown = rows[w[-1]]["callback"]
            for name, micro_batches in logged_in.items():
                ranks = list(range(len(lengths)))
                with_data = [value(r, i, HOOKS[name]) for i in micro_batches(w) for r in ranks if i < lengths[r]]
                shown_as = "after_backward_step" if name == "after_backward" else name
                if name == "loss" and lengths[rank] == 0:  # a rank that never had data never logged it
                    assert name not in shown
                else:
                    assert shown[shown_as] == pytest.approx(sum(with_data) / len(with_data), rel=1e-6), (name, w)
        end = read(tmp_path / f"end{rank}.jsonl")[0]["callback"]
        calls = [value(r, i, HOOKS["after_backward"]) for r in range(len(lengths)) for i in range(lengths[r])]
        assert end["after_backward_epoch"] == pytest.approx(sum(calls) / len(calls), rel=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("lengths", "window"), [([3, 0], 1), ([5, 2, 0], 2), ([6, 3], 1)])
def test_with_join_and_nothing_reading_the_last_step_shows_the_ranks_with_data(tmp_path, lengths, window):
    # no step is read but the first and the epoch's last (Lightning's loader knows it is the last on every rank)
    strategy = ShardPlusStrategy(start_method="fork", uneven_inputs="join", aggregation_frequency=window)
    callbacks = [CountsWithoutReading(tmp_path)]
    fit(tmp_path, LogsInEveryHook(lengths), len(lengths), strategy, callbacks=callbacks, log_every_n_steps=50)
    batches = max(lengths)
    last = list(range(batches - (batches - 1) % window - 1, batches))  # the last window's micro-batches
    for rank in range(len(lengths)):
        end = read(tmp_path / f"end{rank}.jsonl")[0]["callback"]
        for name, micro_batches in {"loss": last, "batch_start": last, "before_optimizer_step": last[-1:]}.items():
            with_data = [value(r, i, HOOKS[name]) for i in micro_batches for r in range(len(lengths)) if i < lengths[r]]
            if name == "loss" and lengths[rank] == 0:
                assert name not in end
            else:
                assert end[name] == pytest.approx(sum(with_data) / len(with_data), rel=1e-6), name


class SumsEveryCall(LoggingModule):
    """Logs a sum-reduced epoch value without sync_dist, and one name twice per step."""

    def log_values(self, r, i):
        self.log("tokens", value(r, i), reduce_fx="sum", on_epoch=True)
        self.log("twice", value(r, i, 1), on_epoch=True)
        self.log("twice", value(r, i, 2), on_epoch=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_epoch_values_aggregate_every_call_and_the_last_call_is_the_step_value(tmp_path, world_size):
    # 7 micro-batches in windows of 3 (the last one short): Lightning's epoch aggregation of every call on each rank
    # (a sum of sums, a weighted mean of both calls), then over the ranks; the step value is each micro-batch's last
    sizes, batches = [2, 3, 4][:world_size], 7
    strategy = ShardPlusStrategy(start_method="fork", aggregation_frequency=3)
    fit(tmp_path, SumsEveryCall(sizes, batches), world_size, strategy)
    ranks, windows = range(world_size), [[0, 1, 2], [3, 4, 5], [6]]
    tokens = sum(sum(value(r, i) for i in range(batches)) for r in ranks) / world_size  # mean over ranks of sums
    both = [(value(r, i, k), sizes[r]) for r in ranks for i in range(batches) for k in (1, 2)]
    for rank in ranks:
        end = read(tmp_path / f"end{rank}.jsonl")[0]["callback"]
        assert end["tokens_epoch"] == pytest.approx(tokens, rel=1e-6)
        assert end["twice_epoch"] == pytest.approx(weighted_mean(*zip(*both, strict=True)), rel=1e-6)
        rows = read(tmp_path / f"batches{rank}.jsonl")
        for w in windows:
            last_calls = [(value(r, i, 2), sizes[r]) for i in w for r in ranks]
            mean = weighted_mean(*zip(*last_calls, strict=True))
            assert rows[w[-1]]["callback"]["twice_step"] == pytest.approx(mean, rel=1e-6)


class TwoOptimizers(LoggingModule):
    """Manual optimization with two optimizers, each logging its gradient norm under one name."""

    def __init__(self) -> None:
        super().__init__([2, 3], batches=3)
        self.other = nn.Linear(2, 1)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizers = self.optimizers()
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(self.layer(batch[0]).sum() + self.other(batch[0]).sum())
        for k, optimizer in enumerate(optimizers):
            self.log("grad_norm", value(self.global_rank, batch_idx, k))
            optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.01), torch.optim.SGD(self.other.parameters(), lr=0.01)


@pytest.mark.timeout(120)
def test_two_manual_optimizers_logging_one_name_show_the_last_call(tmp_path, count_collectives):
    fit(tmp_path, TwoOptimizers(), 2)
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        expected = [weighted_mean([value(0, i, 1), value(1, i, 1)], [2, 3]) for i in range(3)]
        assert [row["callback"]["grad_norm"] for row in rows] == pytest.approx(expected, rel=1e-6)
        # logged after `manual_backward`: one collective per step, after the optimizer steps
        assert [row["collectives"] for row in rows] == [1, 1, 1]


class SwitchesSyncDist(LoggingModule):
    """Logs a max-reduced value, with sync_dist from batch 2 on: the step reduction changes from mean to max."""

    def log_values(self, r, i):
        self.log("peak", value(r, i), reduce_fx="max", sync_dist=i >= 2)


@pytest.mark.timeout(120)
def test_a_name_that_changes_its_reduction_on_every_rank_is_reduced_the_new_way(tmp_path):
    fit(tmp_path, SwitchesSyncDist([2, 3], batches=4), 2)
    for rank in range(2):
        shown = [row["callback"]["peak"] for row in read(tmp_path / f"batches{rank}.jsonl")]
        means = [weighted_mean([value(0, i), value(1, i)], [2, 3]) for i in range(2)]
        assert shown == pytest.approx(means + [value(1, i) for i in (2, 3)], rel=1e-6)


class StopsOnOneRank(LoggingModule):
    """Rank 0 asks to stop at batch 0 (Lightning trains on to `min_epochs`); both ranks log a new name from batch 1."""

    def log_values(self, r, i):
        self.log("loss", value(r, i))
        if i >= 1:
            self.log("extra", value(r, i, 1))
        if r == 0 and i == 0:
            self.trainer.should_stop = True


@pytest.mark.timeout(60)
def test_a_stop_asked_on_one_rank_does_not_desynchronize_the_ranks(tmp_path):
    # the names are checked where every rank decides the same: not where one rank's `should_stop` is set
    fit(tmp_path, StopsOnOneRank([2, 2], batches=3), 2, min_epochs=2, max_epochs=2, log_every_n_steps=50)
    for rank in range(2):
        end = read(tmp_path / f"end{rank}.jsonl")[0]["callback"]
        assert end["extra"] == (value(0, 2, 1) + value(1, 2, 1)) / 2


@pytest.mark.timeout(60)
def test_a_name_whose_reduction_changes_between_checks_shows_its_own_value_not_nan(tmp_path):
    fit(tmp_path, SwitchesSyncDist([2, 3], batches=4), 2, log_every_n_steps=50)
    for rank in range(2):
        shown = [row["callback"]["peak"] for row in read(tmp_path / f"batches{rank}.jsonl")]
        means = [weighted_mean([value(0, i), value(1, i)], [2, 3]) for i in range(2)]
        # own until the check, at the epoch's last step (batch 3): from there the new way, the max over the ranks
        assert shown == pytest.approx(means + [value(rank, 2), value(1, 3)], rel=1e-6)


class CountsInTheLastStep(LoggingModule):
    """Logs a sync_dist sum only in the epoch's last step, after backward: it is not yet agreed at the epoch end."""

    def log_values(self, r, i):
        self.log("loss", value(r, i))

    def on_before_optimizer_step(self, optimizer):
        if self.batch_idx == self.batches - 1:
            self.log("count", float(self.global_rank + 1), sync_dist=True, reduce_fx="sum", on_epoch=True)


@pytest.mark.timeout(60)
def test_a_sync_dist_sum_first_logged_in_the_last_step_is_summed_over_the_ranks_at_the_epoch_end(tmp_path):
    fit(tmp_path, CountsInTheLastStep([2, 2], batches=3), 2, log_every_n_steps=50)
    for rank in range(2):
        assert read(tmp_path / f"end{rank}.jsonl")[0]["callback"]["count_epoch"] == 3.0
