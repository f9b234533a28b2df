"""Averaged training metrics: the fused reducer on simulated ranks, then multi-process fits where every rank
logs values the test can compute itself, and the logger, ``callback_metrics`` and the collectives are
recorded."""

from __future__ import annotations

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
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

import lightning_shardplus  # noqa: F401
from lightning_shardplus import ShardPlusStrategy
from lightning_shardplus.callbacks import ScalingReport
from lightning_shardplus.instrumentation import CollectiveCalls
from lightning_shardplus.metrics import (
    FusedMetricReducer,
    MetricMismatchError,
    Reduced,
    combined_epoch_state,
    describe_mismatch,
    logs_only_before_backward,
)

# ----------------------------------------------------------------------------------------------------------
# The reducer, with ranks simulated in one process: pack on every rank, sum, unpack on every rank.


def simulate(reducers: list[FusedMetricReducer]) -> list[dict[str, Reduced] | None]:
    entries = [r.entries() for r in reducers]
    for r in reducers:
        r._all_gather_object = lambda obj, entries=entries: entries
    total = torch.stack([r.pack() for r in reducers]).sum(0)
    extremes = [r.pack_extremes() for r in reducers]  # the MAX collective, at the size the ranks agreed
    maxed = None if extremes[0] is None else torch.stack(extremes).amax(0)
    return [r.unpack(total.clone(), "epoch 0, batch 5", maxed) for r in reducers]


def make_ranks(world: int, capacity: int = 64, extremes: int = 16) -> list[FusedMetricReducer]:
    def unused(*_):
        raise AssertionError("simulate() does the collective")

    return [FusedMetricReducer(world, rank, unused, unused, capacity, extremes) for rank in range(world)]


def test_reducer_steps_with_the_same_names_and_other_weights_or_values_reduce_their_own():
    # the packed constants (header, weights) are reused while a step repeats the last one: not when weights change
    ranks = make_ranks(2)
    steps = [([1.0, 3.0], [2, 2]), ([1.0, 3.0], [1, 3]), ([5.0, -1.0], [1, 3])]
    for values, weights in steps:
        for rank, reducer in enumerate(ranks):
            reducer.observe("training_step.loss", "mean", torch.tensor(values[rank]), weights[rank])
        result = simulate(ranks)[0]["training_step.loss"]
        expected = sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)
        assert result.value == pytest.approx(expected, rel=1e-12) and result.weight == sum(weights)


def test_reducer_computes_weighted_means_sums_and_extremes():
    ranks = make_ranks(3)
    values = [1.5, -2.0, 4.25]
    weights = [2, 3, 5]
    for rank, reducer in enumerate(ranks):
        value = torch.tensor(values[rank])
        reducer.observe("training_step.loss", "mean", value, weights[rank])
        reducer.observe("training_step.tokens", "sum", value)
        reducer.observe("training_step.peak", "max", value)
        reducer.observe("training_step.low", "min", value.reshape(1))
        reducer.observe("training_step.twice", "mean", value, 1.0)
        reducer.observe("training_step.twice", "mean", value + 1, 3.0)  # a second value in the same window
    results = simulate(ranks)
    for other in results[1:]:  # the same values on every rank
        seen = {k: r.value for k, r in other.items()}
        assert seen == {k: r.value for k, r in results[0].items()}
    result = results[0]
    expected_mean = sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)
    assert result["training_step.loss"].value == pytest.approx(expected_mean, rel=1e-12)
    assert result["training_step.loss"].weight == 10
    assert result["training_step.tokens"].value == pytest.approx(sum(values))
    assert result["training_step.peak"].value == max(values)
    assert result["training_step.low"].value == min(values)
    twice = sum(v * 1 + (v + 1) * 3 for v in values) / 12
    assert result["training_step.twice"].value == pytest.approx(twice)
    assert all(r.pending == [] for r in ranks)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "extra",
            r"`extra` \(from training_step\) \(reduced as mean\): logged on rank\(s\) \[1\], not on rank",
        ),
        ("renamed", r"`loss`.*logged on rank\(s\) \[0, 2\], not on rank\(s\) \[1\]; `other`.*\[1\], not on"),
        ("reduction", r"`loss`.*reduced as max\): logged on rank\(s\) \[1\]"),
        ("many_extra", r"`extra0`.*logged on rank\(s\) \[1\]"),  # rank 1 needs more slots than the capacity
    ],
)
def test_reducer_raises_on_every_rank_when_ranks_log_different_names(change, message):
    ranks = make_ranks(3, capacity=8)
    for rank, reducer in enumerate(ranks):
        name, reduction = "loss", "mean"
        if rank == 1 and change == "renamed":
            name = "other"
        if rank == 1 and change == "reduction":
            reduction = "max"
        reducer.observe(f"training_step.{name}", reduction, torch.tensor(1.0), label=f"`{name}` (from training_step)")
        if rank == 1 and change == "extra":
            reducer.observe("training_step.extra", "mean", torch.tensor(1.0), label="`extra` (from training_step)")
        if rank == 1 and change == "many_extra":
            for i in range(10):
                reducer.observe(f"training_step.extra{i}", "mean", torch.tensor(1.0), label=f"`extra{i}`")
    entries = [r.entries() for r in ranks]
    total = torch.stack([r.pack() for r in ranks]).sum(0)
    for reducer in ranks:
        reducer._all_gather_object = lambda obj: entries
        with pytest.raises(MetricMismatchError, match=message) as error:
            reducer.unpack(total.clone(), "epoch 0, batch 5")
        assert "at epoch 0, batch 5" in str(error.value) and "average_training_metrics=False" in str(error.value)


def test_reducer_grows_its_capacity_in_step_on_every_rank():
    ranks = make_ranks(2, capacity=4)
    for reducer in ranks:
        for i in range(5):  # 10 slots
            reducer.observe(f"m{i}", "mean", torch.tensor(float(i) + reducer.rank), 1.0)
    assert simulate(ranks) == [None, None]
    assert [r.capacity for r in ranks] == [16, 16]
    results = simulate(ranks)  # the same values, now in one collective
    assert results[0]["m3"].value == 3.5
    for reducer in ranks:  # later steps fit
        reducer.observe("m0", "mean", torch.tensor(1.0), 1.0)
    assert simulate(ranks)[1]["m0"].value == 1.0


def test_reducer_collective_has_one_size_whatever_each_rank_logged():
    ranks = make_ranks(4)
    for reducer in ranks:
        for i in range(reducer.rank * 7):
            reducer.observe(f"m{i}", "max", torch.tensor(1.0))
    assert len({r.pack().numel() for r in ranks}) == 1
    assert len({r.pack_extremes().numel() for r in ranks}) == 1


def test_reducer_propagates_nan_like_torch_and_a_zero_weight_gives_nan():
    ranks = make_ranks(2)
    for reducer in ranks:
        nan_or_one = torch.tensor(math.nan if reducer.rank == 1 else 1.0)
        reducer.observe("peak", "max", nan_or_one)
        reducer.observe("low", "min", torch.tensor(-math.inf))
        reducer.observe("loss", "mean", nan_or_one, weight=1.0)
        reducer.observe("unweighted", "mean", torch.tensor(3.0), weight=0.0)
    result = simulate(ranks)[0]
    assert math.isnan(result["peak"].value) and math.isnan(result["loss"].value)
    assert result["low"].value == -math.inf and math.isnan(result["unweighted"].value)


def test_reducer_with_nothing_logged_still_takes_part():
    ranks = make_ranks(2)
    assert simulate(ranks) == [{}, {}]


def test_combined_epoch_state_follows_reduce_fx():
    before = (torch.tensor(10.0), torch.tensor(4))
    reduced = Reduced.of(2.5, 15.0, 6.0)
    value, count = combined_epoch_state("mean", before, reduced)
    assert value.item() == 25.0 and count.item() == 10 and count.dtype == torch.int64
    assert combined_epoch_state("sum", (torch.tensor(1.0), None), reduced)[0].item() == 3.5
    assert combined_epoch_state("max", (torch.tensor(-math.inf), None), reduced)[0].item() == 2.5
    assert combined_epoch_state("min", (torch.tensor(1.0), None), reduced)[0].item() == 1.0


def test_mismatch_text_names_metrics_and_ranks():
    text = describe_mismatch([[("a", "mean", "`a`")], [("a", "mean", "`a`"), ("b", "sum", "`b`")]], "batch 3")
    assert "`b` (reduced as sum): logged on rank(s) [1], not on rank(s) [0]" in text
    assert "`a`" not in text.split("values:")[1].split(". Log")[0]


# ----------------------------------------------------------------------------------------------------------
# Multi-process fits. Every rank logs values fixed by (rank, batch, k): the test computes each rank's value.


def value(rank: int, batch: int, k: int = 0) -> float:
    """Exact in float32."""
    return (rank + 1) * (k + 1) + batch / 8


COUNTS = {"all_reduce": 0, "barrier": 0}


@pytest.fixture
def count_collectives(monkeypatch):
    """Count the Python-level collectives in every process forked from here (DDP's own gradient all-reduce
    runs in C++ and is not counted)."""
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


def own_collective() -> ShardPlusStrategy:
    """A strategy under which the training metrics cannot ride in DDP's gradient all-reduce (a user communication
    hook might change the gradients): they take an all_reduce of their own."""
    return ShardPlusStrategy(start_method="fork", ddp_comm_hook=uncounted_allreduce_hook)


# The training metrics' SUM rides in DDP's gradient all-reduce (the default) or takes its own all_reduce.
PATHS = {
    "carried": lambda: None,
    "own": own_collective,
    "find_unused": lambda: ShardPlusStrategy(start_method="fork", find_unused_parameters=True),
}


def fit(tmp_path, module, world_size, strategy=None, **trainer_kwargs):
    trainer = cpu_trainer(
        strategy or ShardPlusStrategy(start_method="fork"),
        world_size,
        max_epochs=1,
        use_distributed_sampler=False,
        logger=FileLogger(tmp_path),
        **({"callbacks": [Recorder(tmp_path)], "log_every_n_steps": 1} | trainer_kwargs),
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
        # one SUM all_reduce for every value, one MAX all_reduce for the max/min values (`peak`, `low`)
        assert [(row["all_reduce"], row["barrier"]) for row in rows] == [(2, 0)] * batches
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
    ("path", "count", "sync_dist", "per_batch"),
    [
        ("own", 1, False, [1, 1, 1]),
        ("own", 5, False, [1, 1, 1]),
        ("own", 20, False, [1, 1, 1]),
        ("own", 20, True, [1, 1, 1]),  # Lightning's own sync is folded into the one collective
        ("own", 100, False, [2, 1, 1]),  # 200 slots > 64: the first step grows the agreed capacity, once
        # in DDP's gradient all-reduce: no collective of their own
        ("carried", 1, False, [0, 0, 0]),
        ("carried", 20, False, [0, 0, 0]),
        ("carried", 20, True, [0, 0, 0]),
        # 200 slots: the first step's header is carried, the larger capacity is agreed from it and the step
        # reduced again; later steps no longer fit the carrier: their own all_reduce
        ("carried", 100, False, [1, 1, 1]),
        # DDP searching for unused parameters: the carrier (joined after DDP's forward) is not used
        ("find_unused", 1, False, [1, 1, 1]),
    ],
)
def test_one_collective_per_step_for_any_number_of_metrics(
    tmp_path, count_collectives, path, count, sync_dist, per_batch
):
    fit(tmp_path, ManyMetrics(count, sync_dist), 2, PATHS[path]())
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert [row["all_reduce"] for row in rows] == per_batch
        assert [row["barrier"] for row in rows] == [0] * 3
        last = count - 1
        for i, row in enumerate(rows):
            assert row["callback"][f"m{last:03d}"] == (value(0, i, last) + value(1, i, last)) / 2


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
def test_values_first_logged_after_backward_are_averaged_in_the_same_step(tmp_path, count_collectives):
    # the collective runs in `on_train_batch_end`, after the backward and optimizer hooks: a value first logged
    # in `on_before_optimizer_step` is in the collective of its own step, with no second one and no warning
    fit(tmp_path, LateFromBatch(tmp_path, first=2), 2)
    sizes = [2, 3]
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert [row["all_reduce"] for row in rows] == [1, 1, 1, 1, 1]
        for i, row in enumerate(rows):
            assert row["callback"]["loss"] == pytest.approx(weighted_mean([value(0, i), value(1, i)], sizes))
        caught = read(tmp_path / f"warnings{rank}.jsonl")[0]["warnings"]
        assert not any("shardplus" in text for text in caught)
        for i in (2, 3, 4):
            mean = weighted_mean([value(0, i, 1), value(1, i, 1)], sizes)
            assert rows[i]["callback"]["grad_stat"] == pytest.approx(mean)


@pytest.mark.timeout(60)
def test_a_value_logged_after_backward_on_one_rank_only_raises_the_named_error(tmp_path):
    # batch 1 reduces `grad_stat` with the other values and finds that rank 0 did not log it
    with pytest.raises(Exception, match=r"batch 1.*`grad_stat` \(from on_before_optimizer_step\).*rank\(s\) \[1\]"):
        fit(tmp_path, LateFromBatch(tmp_path, first=1, only=1), 2)


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
@pytest.mark.parametrize(
    ("world_size", "change", "message"),
    [
        (
            2,
            "extra",
            r"`extra_metric` \(from training_step\) \(reduced as mean\): logged on rank\(s\) \[1\], not",
        ),
        (
            3,
            "extra",
            r"at epoch 0, batch 1.*`extra_metric`.*logged on rank\(s\) \[2\], not on rank\(s\) \[0, 1\]",
        ),
        (3, "renamed", r"`loss`.*on rank\(s\) \[0, 1\], not on rank\(s\) \[2\].*`renamed_metric`.*\[2\]"),
        (
            2,
            "reduction",
            r"batch 0.*`loss` \(from training_step\) \(reduced as max\): logged on rank\(s\) \[1\]",
        ),
    ],
)
def test_ranks_logging_different_metrics_raise_a_named_error(tmp_path, world_size, change, message):
    with pytest.raises(Exception, match=message):
        fit(tmp_path, ExtraOnLastRank(change), world_size)


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
@pytest.mark.parametrize("extra", [1, 100])  # 100: rank 1 needs a larger buffer than agreed, rank 0 does not
def test_a_mismatch_between_logging_steps_raises_at_the_epoch_end_naming_its_step(tmp_path, extra):
    # no logging step inside the epoch: the summed headers are read on the host at its end; the step where the
    # names differed is named, and ranks that needed buffers of different sizes neither hang nor mix them
    message = r"at epoch 0, batch 1.*`extra000` \(from training_step\).*on rank\(s\) \[1\], not on rank\(s\) \[0\]"
    with pytest.raises(Exception, match=message):
        fit(tmp_path, ExtraBetweenLoggingSteps(extra), 2, log_every_n_steps=50)


class ExtremesInSomeSteps(LoggingModule):
    def __init__(self) -> None:
        super().__init__([2, 3], batches=6)

    def log_values(self, r, i):
        self.log("loss", value(r, i))
        if i in (2, 3):
            self.log("peak", value(r, i, 1), sync_dist=True, reduce_fx="max")
            self.log("low", value(r, i, 2), sync_dist=True, reduce_fx="min")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("path", "per_batch"), [("own", [1, 1, 2, 2, 1, 1]), ("carried", [0, 0, 1, 1, 0, 0])])
def test_max_and_min_cost_one_more_collective_only_in_steps_that_log_them(tmp_path, count_collectives, path, per_batch):
    fit(tmp_path, ExtremesInSomeSteps(), 2, PATHS[path]())
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert [row["all_reduce"] for row in rows] == per_batch
        for i in (2, 3):
            assert rows[i]["callback"]["peak"] == max(value(r, i, 1) for r in range(2))
            assert rows[i]["callback"]["low"] == min(value(r, i, 2) for r in range(2))
        for i, row in enumerate(rows):
            assert row["callback"]["loss"] == pytest.approx(weighted_mean([value(0, i), value(1, i)], [2, 3]))


@pytest.mark.parametrize("reduction", ["max", "min"])
def test_max_and_min_buffers_do_not_grow_with_the_world_size(reduction):
    sizes = set()
    for world in (2, 1000):
        ranks = make_ranks(world)
        for reducer in ranks:
            for k in range(3):
                reducer.observe(f"m{k}", reduction, torch.tensor(float((reducer.rank * 7919 + k) % world)))
        sizes.add((ranks[0].pack().numel(), ranks[0].pack_extremes().numel()))
        result = simulate(ranks)[world - 1]
        expected = {"max": world - 1, "min": 0}[reduction]
        assert [result[f"m{k}"].value for k in range(3)] == [expected] * 3
    assert len(sizes) == 1


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
    """Also logs after backward (then the collective starts at the batch end, not when backward starts)."""

    def on_before_optimizer_step(self, optimizer):
        self.log("grad_stat", value(self.global_rank, self.batch_idx, 4))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", [EveryKind, EveryKindAndAfterBackward])
@pytest.mark.parametrize(
    ("extremes", "per_batch"),
    [
        (False, [0] * 6),
        (True, [1, 0, 0, 0, 0, 0]),  # the first step's max/min outgrow the agreed MAX buffer (none): one read
    ],
)
def test_training_steps_read_nothing_on_the_host(tmp_path, count_host_reads, module, extremes, per_batch):
    # map-style data: `EvenSteps` (iterable data only) does not run; no logging step inside the epoch (the
    # names are checked on the host at its end)
    callbacks = [Recorder(tmp_path), HostReads(tmp_path)]
    fit(tmp_path, module(extremes), 2, log_every_n_steps=50, callbacks=callbacks)
    sizes = [2, 3]
    for rank in range(2):
        assert [row["reads"] for row in read(tmp_path / f"reads{rank}.jsonl")] == per_batch
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


class BackwardProbe(LoggingModule):
    """Logs in ``training_step`` and records, per batch, the Python all_reduce calls made between the end of
    ``training_step`` and the moment backward reaches the loss (through a tensor hook)."""

    def __init__(self, directory: Path) -> None:
        super().__init__([2, 3], batches=4)
        self.directory = directory

    def log_values(self, r, i):
        self.log("loss", value(r, i))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        before = COUNTS["all_reduce"]

        def at_backward(grad):
            row = {"batch": batch_idx, "started": COUNTS["all_reduce"] - before}
            write(self.directory / f"backward{self.global_rank}.jsonl", row)
            return grad

        loss.register_hook(at_backward)
        return loss


class BackwardProbeWithOptimizerHook(BackwardProbe):
    def on_before_optimizer_step(self, optimizer):  # logs nothing, but it could
        pass


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("module", "path", "started", "per_step"),
    [
        (BackwardProbe, "own", 1, 1),
        (BackwardProbe, "carried", 0, 0),  # in DDP's gradient all-reduce
        (BackwardProbeWithOptimizerHook, "own", 0, 1),
        (BackwardProbeWithOptimizerHook, "carried", 0, 1),  # a later hook could log: not carried
    ],
)
def test_the_collective_starts_when_backward_starts_unless_a_later_hook_could_log(
    tmp_path, count_collectives, module, path, started, per_step
):
    # no hook after backward overridden: the SUM is packed before backward and reduced during it (carried in
    # DDP's gradient all-reduce, or its own all_reduce issued before backward); otherwise its own all_reduce at
    # the batch end. The same averaged values.
    fit(tmp_path, module(tmp_path), 2, PATHS[path]())
    for rank in range(2):
        assert [row["started"] for row in read(tmp_path / f"backward{rank}.jsonl")] == [started] * 4
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert [row["all_reduce"] for row in rows] == [per_step] * 4
        for i, row in enumerate(rows):
            assert row["callback"]["loss"] == pytest.approx(weighted_mean([value(0, i), value(1, i)], [2, 3]))


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
def test_a_value_logged_after_the_early_start_is_the_ranks_own_and_the_rest_still_averaged(tmp_path):
    fit(tmp_path, LogsDuringBackward(), 2)
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert len(rows) == 3
        for i, row in enumerate(rows):
            assert row["callback"]["during_backward"] == value(rank, i, 5)
            assert row["callback"]["loss"] == pytest.approx(weighted_mean([value(0, i), value(1, i)], [2, 3]))


def test_logs_only_before_backward_reads_the_overridden_hooks():
    class Plain(pl.LightningModule):
        pass

    class Clipping(pl.LightningModule):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            pass

    class Manual(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    class GradientLogger(Callback):
        def on_after_backward(self, trainer, pl_module):
            pass

    def trainer(*callbacks):
        return pl.Trainer(callbacks=list(callbacks), logger=False, enable_progress_bar=False)

    assert logs_only_before_backward(trainer(), Plain())
    assert logs_only_before_backward(trainer(Recorder(Path("."))), Plain())  # batch start/end hooks only
    assert logs_only_before_backward(trainer(ScalingReport()), Plain())  # shardplus's own (logs nothing averaged)
    assert not logs_only_before_backward(trainer(), Clipping())
    assert not logs_only_before_backward(trainer(), Manual())
    assert not logs_only_before_backward(trainer(GradientLogger()), Plain())


class Accumulating(LoggingModule):
    def log_values(self, r, i):
        self.log("acc", value(r, i), on_epoch=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("path", "per_batch"), [("own", [0, 0, 1, 0, 0, 1, 1]), ("carried", [0] * 7)])
def test_with_accumulation_values_are_averaged_per_optimizer_step(tmp_path, count_collectives, path, per_batch):
    sizes, batches, window = [2, 3], 7, 3  # windows of micro-batches: 0-2, 3-5, 6 (the epoch's last, smaller)
    fit(tmp_path, Accumulating(sizes, batches), 2, PATHS[path](), accumulate_grad_batches=window)
    windows = [[0, 1, 2], [3, 4, 5], [6]]

    def window_mean(w):
        return weighted_mean([value(r, i) for i in w for r in range(2)], [sizes[r] for i in w for r in range(2)])

    everything = weighted_mean([value(r, i) for i in range(batches) for r in range(2)], sizes * batches)
    for rank in range(2):
        rows = read(tmp_path / f"batches{rank}.jsonl")
        assert [row["all_reduce"] for row in rows] == per_batch  # own: one per optimizer step
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
    assert [row["all_reduce"] for row in rows] == [1, 1, 1]
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

    args = bench.parse_args(
        ["--repeats=1", "--steps=3", "--warmup=1", "--global-batch-size=8", "--input-dim=4", "--hidden-dim=8"]
        + ["--layers=1", "--configs=metrics16-nosync,metrics16-sync_dist,metrics16-averaged"]
    )
    report = bench.run(bench.select_configs(args.configs), args)
    results = report["results"]
    per_step = {name: (r["all_reduce_per_step"], r["barrier_per_step"]) for name, r in results.items()}
    assert per_step == {
        "metrics16-nosync": (0, 0),  # (a)
        "metrics16-sync_dist": (16, 16),  # (b): Lightning syncs each value
        "metrics16-averaged": (1, 0),  # (c)
    }
    assert "| metrics16-averaged |" in bench.format_table(report)


class WideManyMetrics(ManyMetrics):
    """2 MB of parameters more, so that bucket sizes make other buckets (the tuner races them)."""

    def __init__(self, batches: int) -> None:
        super().__init__(1, False, batches)
        self.wide = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + self.wide(torch.zeros(1, 256)).sum() * 0


@pytest.mark.timeout(120)
def test_values_stay_averaged_across_the_ddp_rewraps_of_fusion_tuning(tmp_path, count_collectives):
    # each re-wrap builds a new DDP: the carrier must be one of its parameters again, or the values would be each
    # rank's own times the world size
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
