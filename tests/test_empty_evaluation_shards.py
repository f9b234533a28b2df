"""Evaluation with fewer samples than processes: the ranks with an empty exact shard make the same collectives,
in the same order, as the ranks with data (issue 31), and every rank ends with the single-process values."""

import json
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from _models import IndexedDataset, RecordingModule, cpu_trainer
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.utilities import dim_zero_cat

from lightning_shardplus import ShardPlusStrategy


class RowsAndLabels(Metric):
    """A Metric with list ("cat") states: 2-d float rows and 1-d integer labels, as AUROC-like metrics keep."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("rows", default=[], dist_reduce_fx="cat")
        self.add_state("labels", default=[], dist_reduce_fx="cat")

    def update(self, rows: torch.Tensor, labels: torch.Tensor) -> None:
        self.rows.append(rows)
        self.labels.append(labels)

    def compute(self) -> torch.Tensor:
        rows, labels = dim_zero_cat(self.rows), dim_zero_cat(self.labels)
        return rows.sum() / len(rows) + labels.sum()


class MetricsModule(RecordingModule):
    """Logs, from ``validation_step`` and ``test_step``, every kind of value a rank without data must still
    take part in the reduction of: Metrics fed by ``update()`` (the case that hung) and by ``forward``, a Metric
    and a synced value logged per step, a Metric with list states; ``self.all_gather`` at the epoch end.
    Each rank writes its epoch values at the evaluation end."""

    def __init__(self, record_dir, loaders=1):
        super().__init__(record_dir, lr=0.0)  # lr 0: a fit validates the initial weights, as the reference does
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 3)
        self.per_loader = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    mean_loss=MeanMetric(),
                    accuracy=MulticlassAccuracy(3, average="micro"),
                    step_loss=MeanMetric(),
                    rows=RowsAndLabels(),
                )
            )
            for _ in range(loaders)
        )
        self.gathered = []

    def _evaluate(self, batch, stage, dataloader_idx):
        inputs, labels, indices = batch
        self.record(stage, indices)
        logits = self(inputs)
        losses = F.cross_entropy(logits, labels, reduction="none")
        metrics = self.per_loader[dataloader_idx]
        metrics["mean_loss"].update(losses)
        self.log("mean_loss", metrics["mean_loss"])
        metrics["accuracy"](logits, labels)
        self.log("accuracy", metrics["accuracy"])
        metrics["step_loss"](losses)
        self.log("step_loss", metrics["step_loss"], on_step=True, on_epoch=True)
        self.log("synced_loss", losses.mean(), on_step=True, on_epoch=True, sync_dist=True, batch_size=len(labels))
        metrics["rows"].update(logits, labels)
        self.log("rows", metrics["rows"])

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self._evaluate(batch, "sanity" if self.trainer.sanity_checking else "val", dataloader_idx)

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self._evaluate(batch, "test", dataloader_idx)

    def on_validation_epoch_end(self):
        self.gathered.append(self.all_gather(torch.tensor(float(self.global_rank))).sum().item())

    on_test_epoch_end = on_validation_epoch_end

    def on_validation_end(self):
        if not self.trainer.sanity_checking:
            values = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
            values["gathered"] = self.gathered[-1]
            with open(self.record_dir / f"values{self.global_rank}.json", "w") as f:
                json.dump(values, f)

    on_test_end = on_validation_end


def run(stage, record_dir, world_size, sizes=(1,)):
    """``stage`` ("validate", "test" or "fit") on ``world_size`` processes, over evaluation loaders of ``sizes``
    samples; every rank's epoch values. A short process-group timeout: a rank left waiting fails instead of hanging."""
    strategy = ShardPlusStrategy(start_method="fork", timeout=timedelta(seconds=60))
    trainer = cpu_trainer(strategy, world_size, max_epochs=1)
    module = MetricsModule(record_dir, len(sizes))
    evaluation = [DataLoader(IndexedDataset(n, seed=i), batch_size=1) for i, n in enumerate(sizes)]
    if stage == "fit":
        trainer.fit(module, DataLoader(IndexedDataset(2 * world_size), batch_size=1), evaluation)
    else:
        getattr(trainer, stage)(module, evaluation)
    return [json.loads((record_dir / f"values{rank}.json").read_text()) for rank in range(world_size)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", ["validate", "test", "fit"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_metrics_with_an_empty_shard_end_with_the_single_process_values_on_every_rank(tmp_path, stage, world_size):
    (reference,) = run("validate" if stage == "fit" else stage, tmp_path / "one", 1)
    per_rank = run(stage, tmp_path / "many", world_size)
    names = ["mean_loss", "accuracy", "step_loss_epoch", "synced_loss_epoch", "rows"]
    for rank, values in enumerate(per_rank):
        for name in names:
            assert values[name] == pytest.approx(reference[name], rel=1e-6), (rank, name)
        assert values["gathered"] == sum(range(world_size))  # every rank joined the epoch-end all_gather


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("empty", [0, 1])
def test_several_evaluation_loaders_one_with_an_empty_shard(tmp_path, world_size, empty):
    # loader `empty`: one sample (an empty shard on every rank but rank 0); the other: one sample per rank.
    # Every rank reports the values of both loaders (Lightning publishes a loader's values when it moves on).
    sizes = (1, world_size) if empty == 0 else (world_size, 1)
    (reference,) = run("validate", tmp_path / "one", 1, sizes)
    per_rank = run("validate", tmp_path / "many", world_size, sizes)
    for rank, values in enumerate(per_rank):
        for name in ["mean_loss", "accuracy", "step_loss_epoch", "synced_loss_epoch", "rows"]:
            for key in (f"{name}/dataloader_idx_0", f"{name}/dataloader_idx_1"):
                assert values[key] == pytest.approx(reference[key], rel=1e-6), (rank, key)
