"""Evaluation across ranks gives the single-process values, evaluates every sample once, and never hangs."""

import json
import warnings
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _models import IndexedDataset, RecordingModule, cpu_trainer, in_external_ranks, read_records
from torch import nn
from torch.multiprocessing import ProcessRaisedException  # what a forked rank raised, in this process
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_shardplus import ShardPlusStrategy
from lightning_shardplus.data.sharding import shard_bounds

ROOT = Path(__file__).parents[1]


class EvalModule(RecordingModule):
    """Logs partition-invariant epoch values from validation_step (weighted mean, sum, max, min) and two
    torchmetrics objects; optionally with BatchNorm and per-step synced logging."""

    def __init__(self, record_dir, sync_dist=False, batch_norm=False, step_sync=False):
        super().__init__(record_dir)
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8) if batch_norm else nn.Identity(), nn.Linear(8, 3))
        self.sync_dist, self.step_sync = sync_dist, step_sync
        self.accuracy = MulticlassAccuracy(3, average="micro")
        self.mean_loss = MeanMetric()

    def validation_step(self, batch, batch_idx):
        inputs, labels, indices = batch
        self.record("sanity" if self.trainer.sanity_checking else "val", indices)
        logits = self(inputs)
        losses = F.cross_entropy(logits, labels, reduction="none")
        n = len(labels)
        self.log("loss", losses.mean(), batch_size=n, sync_dist=self.sync_dist)
        self.log("acc", (logits.argmax(1) == labels).float().mean(), batch_size=n, sync_dist=self.sync_dist)
        self.log("loss_sum", losses.sum(), reduce_fx="sum", sync_dist=self.sync_dist)
        self.log("loss_max", losses.max(), reduce_fx="max", sync_dist=self.sync_dist)
        self.log("loss_min", losses.min(), reduce_fx="min", sync_dist=self.sync_dist)
        if self.step_sync:
            self.log("loss_step", losses.mean(), on_step=True, on_epoch=True, sync_dist=True, batch_size=n)
        self.accuracy(logits, labels)
        self.log("tm_acc", self.accuracy)
        self.mean_loss(losses)
        self.log("tm_loss", self.mean_loss)


NAMES = ["loss", "acc", "loss_sum", "loss_max", "loss_min", "tm_acc", "tm_loss"]


def validate(tmp_path, world_size, n, batch_size, **module_kwargs):
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), world_size)
    (results,) = trainer.validate(
        EvalModule(tmp_path, **module_kwargs), DataLoader(IndexedDataset(n), batch_size=batch_size)
    )
    return results, read_records(tmp_path)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [1, 2, 5, 97, 100, 103])
@pytest.mark.parametrize("batch_size", [1, 4, 7])
def test_validation_values_equal_the_single_process_run(tmp_path, n, batch_size):
    reference, _ = validate(tmp_path / "ref", 1, n, batch_size)
    for world_size in (2, 3):
        for sync_dist in (False, True):
            directory = tmp_path / f"w{world_size}-{sync_dist}"
            results, rows = validate(directory, world_size, n, batch_size, sync_dist=sync_dist)
            for name in NAMES:
                assert results[name] == pytest.approx(reference[name], abs=1e-6, rel=1e-6), (name, world_size)
            seen = Counter(i for r in rows if r["stage"] == "val" for i in r["indices"])
            assert seen == Counter(range(n))  # every sample evaluated exactly once


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_batchnorm_and_per_step_sync_with_uneven_shards_complete_with_exact_epoch_values(tmp_path, world_size):
    # 7 samples in shards of 4/3 (batch 3) or 3/2/2 (batch 2): the ranks hold different numbers of batches
    n, batch = 7, (3 if world_size == 2 else 2)
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), world_size, max_epochs=2, num_sanity_val_steps=0)
    module = EvalModule(tmp_path / "fit", batch_norm=True, step_sync=True)
    trainer.fit(module, DataLoader(IndexedDataset(18), batch_size=3), DataLoader(IndexedDataset(n), batch_size=batch))
    batches = Counter(r["rank"] for r in read_records(tmp_path / "fit") if r["stage"] == "val" and r["epoch"] == 1)
    assert len(set(batches.values())) > 1  # the ranks really had different numbers of batches
    fitted = {k: float(v) for k, v in trainer.callback_metrics.items()}
    # the last validation ran on the final weights (sent back to this process): one rank must agree with it
    module.record_dir = tmp_path / "one"
    module.record_dir.mkdir()
    (one,) = cpu_trainer(ShardPlusStrategy(start_method="fork"), 1).validate(
        module, DataLoader(IndexedDataset(n), batch_size=batch)
    )
    for name in NAMES + ["loss_step_epoch"]:
        assert fitted[name] == pytest.approx(one[name], abs=1e-6), name


@pytest.mark.timeout(120)
@pytest.mark.compat
def test_ranks_without_any_evaluation_sample_join_the_reduction(tmp_path):
    # 2 samples on 3 ranks: rank 2 has none, in validation during fit and in test
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), 3, max_epochs=2)
    module = EvalModule(tmp_path)
    trainer.fit(module, DataLoader(IndexedDataset(6), batch_size=2), DataLoader(IndexedDataset(2), batch_size=1))
    assert {"loss", "tm_acc"} <= set(trainer.callback_metrics)
    rows = read_records(tmp_path)
    assert Counter(i for r in rows if r["stage"] == "val" and r["epoch"] == 1 for i in r["indices"]) == Counter([0, 1])
    assert not [r for r in rows if r["stage"] == "val" and r["rank"] == 2]


def test_a_metric_fed_by_update_syncs_in_compute_until_exact_evaluation_defers_its_sync():
    # torchmetrics copies `sync_on_compute` into what `compute` reads at construction and after `forward` only
    from lightning_shardplus._compat.changes import RunChanges
    from lightning_shardplus.data.exact_evaluation import defer_metric_sync

    gathered = []

    def gather(tensor, group=None):
        gathered.append(tensor)
        return [tensor]

    def available():
        return True

    metric = MeanMetric(dist_sync_fn=gather, distributed_available_fn=available)
    metric.update(torch.tensor([1.0, 3.0]))
    metric.sync_on_compute = False  # the public switch alone: `update` does not copy it
    metric.compute()
    assert gathered  # it synced
    gathered.clear()
    metric.sync_on_compute = True
    changes = RunChanges()
    defer_metric_sync(metric, changes)
    metric.update(torch.tensor([5.0]))
    assert float(metric.compute()) == 3.0 and not gathered
    changes.undo()
    assert metric.sync_on_compute and not metric.dist_sync_on_step and metric.distributed_available_fn is available
    metric.update(torch.tensor([5.0]))
    metric.compute()
    assert gathered


@pytest.mark.timeout(120)
def test_exact_evaluation_false_keeps_lightnings_padded_sampler(tmp_path):
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork", exact_evaluation=False), 2)
    trainer.validate(RecordingModule(tmp_path), DataLoader(IndexedDataset(5), batch_size=2))
    seen = Counter(i for r in read_records(tmp_path) if r["stage"] == "val" for i in r["indices"])
    assert sum(seen.values()) == 6 and seen[0] == 2  # padded with a duplicate, as DistributedSampler does


def _predict_on_this_rank(out: Path, devices: int, n: int, batch: int) -> None:
    """One rank of a ``devices``-process prediction; writes what ``predict`` returned to it."""
    trainer = cpu_trainer("shardplus", devices)
    predictions = trainer.predict(RecordingModule(out), DataLoader(IndexedDataset(n), batch_size=batch))
    returned = [int(i) for batch in predictions for i in batch]
    (out / f"returned{trainer.global_rank}.json").write_text(json.dumps(returned))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("devices", "n", "batch", "per_rank"),
    [(3, 100, 7, [33, 33, 34]), (2, 1, 1, [1]), (3, 2, 1, [1, 1])],
    ids=["100-on-3", "1-on-2", "2-on-3"],
)
def test_predict_returns_every_sample_once_in_dataset_order(tmp_path, devices, n, batch, per_rank):
    # fewer samples than processes: Lightning's own predict sampler asserts that every rank has one, before
    # shardplus puts its exact shards in (issue 18)
    in_external_ranks(partial(_predict_on_this_rank, tmp_path, devices, n, batch), world_size=devices, timeout=200)
    # Lightning returns predictions on every rank where each rank runs the script (popen, torchrun: here, forks with
    # torchrun's variables): rank 0 returns all of them, in order; the others only their own shard (memory per rank
    # does not grow with the dataset)
    assert json.loads((tmp_path / "returned0.json").read_text()) == list(range(n))
    for rank in range(1, devices):
        start, stop = shard_bounds(n, devices, rank)
        assert json.loads((tmp_path / f"returned{rank}.json").read_text()) == list(range(start, stop))
    per_rank_seen = Counter(r["rank"] for r in read_records(tmp_path) for _ in r["indices"])
    assert sorted(per_rank_seen.values()) == per_rank


@pytest.mark.timeout(120)
def test_predict_with_a_custom_sampler_keeps_lightnings_sharding_of_it(tmp_path):
    class Reversed(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(range(5, -1, -1))

        def __len__(self):
            return 6

    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), 2)
    loader = DataLoader(IndexedDataset(6), batch_size=2, sampler=Reversed())
    trainer.predict(RecordingModule(tmp_path), loader, return_predictions=False)
    rows = read_records(tmp_path)
    per_rank = {rank: [i for r in rows if r["rank"] == rank for i in r["indices"]] for rank in range(2)}
    assert per_rank == {0: [5, 3, 1], 1: [4, 2, 0]}  # Lightning's unrepeated sharding of the sampler's order


class RankZeroOnlyValue(RecordingModule):
    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.log("rank0_only", torch.tensor(1.0), rank_zero_only=True)  # not reduced by exact evaluation


@pytest.mark.timeout(120)
def test_lightnings_sync_dist_advice_is_silenced_only_for_values_exact_evaluation_reduces(tmp_path):
    # Lightning reads the epoch values (and advises sync_dist=True) before exact evaluation reduces them at the
    # epoch end: the advice is false for those values. Made an error here (the forked ranks inherit the filter).
    advice = r"It is recommended to use `self\.log\('{}', \.\.\., sync_dist=True\)`"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=advice.format(".*"))
        trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), 2, max_epochs=1)
        train, evaluation = DataLoader(IndexedDataset(8), batch_size=2), DataLoader(IndexedDataset(5))
        trainer.fit(RecordingModule(tmp_path), train, evaluation)
        cpu_trainer(ShardPlusStrategy(start_method="fork"), 2).test(RecordingModule(tmp_path), evaluation)
        # still said where it is true: a value logged on rank 0 only is not reduced
        with pytest.raises(ProcessRaisedException, match=advice.format("rank0_only")):
            cpu_trainer(ShardPlusStrategy(start_method="fork"), 2).validate(
                RankZeroOnlyValue(tmp_path), DataLoader(IndexedDataset(5))
            )


@pytest.mark.parametrize("stage", ["validating", "predicting", "training"])
@pytest.mark.parametrize("exact_evaluation", [True, False])
def test_an_unsharded_evaluation_loader_is_reduced_with_a_warning(stage, exact_evaluation):
    # `Trainer(use_distributed_sampler=False)`: Lightning injects no sampler; exact evaluation still sums over the
    # ranks, right only if the user's loaders split the data: said once the loader is built
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import RunningStage

    from lightning_shardplus._compat.changes import RunChanges
    from lightning_shardplus.data.loaders import ShardedLoaders

    trainer = SimpleNamespace(state=SimpleNamespace(stage=getattr(RunningStage, stage.upper())))
    kwargs = dict(padding="first", seed=0, shuffle=True, exact_evaluation=exact_evaluation, record_indices=False)
    changes = RunChanges()
    loaders = ShardedLoaders(trainer, 2, 0, changes=changes, **kwargs)
    loader = DataLoader(IndexedDataset(9), batch_size=3)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    stream = DataLoader(Stream(), batch_size=None)  # streams split themselves by rank (as litdata's do)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert loaders.process(loader) is loader and loaders.process(stream) is stream
    finally:
        changes.undo()
    said = [str(w.message) for w in caught if "is not sharded" in str(w.message)]
    assert len(said) == (stage != "training" and exact_evaluation)
    assert all("exact_evaluation=False" in message for message in said)
