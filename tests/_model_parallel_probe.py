"""Runs under Lightning's launcher (``python tests/_model_parallel_probe.py DP TP OUT``): fits, validations, predictions
and uneven streams on ``ShardPlusModelParallelStrategy`` over a DP x TP mesh of CPU processes (FSDP2 over the
data-parallel dimension, tensor parallel over the other); every rank writes what it saw to ``OUT.<rank>.json``. A
reference run on plain tensors in the same process gives the weights one process would reach."""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchmetrics import SumMetric

from lightning_shardplus import ShardPlusModelParallelStrategy

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard


def sample(i: int) -> tuple[int, torch.Tensor, int]:
    return i, torch.randn(4, generator=torch.Generator().manual_seed(i)), i % 2


class Samples(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return sample(i)


class DataParallelStream(IterableDataset):
    """``per_rank[r]`` samples for data-parallel rank r (tensor-parallel peers read the same ones)."""

    def __init__(self, per_rank: list[int], tp: int) -> None:
        self.per_rank, self.tp = per_rank, tp

    def __iter__(self):
        rank = dist.get_rank() // self.tp
        start = sum(self.per_rank[:rank])
        return (sample(i) for i in range(start, start + self.per_rank[rank]))


class Widened(IterableDataset):
    """``stream``'s samples with 6 features (the last two zero)."""

    def __init__(self, stream: IterableDataset) -> None:
        self.stream = stream

    def __iter__(self):
        return ((i, torch.cat([x, torch.zeros(2)]), y) for i, x, y in self.stream)


class Writes(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__("batch")
        self.written: list = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, *args) -> None:
        self.written.append([batch_indices, prediction.tolist() if isinstance(prediction, torch.Tensor) else None])


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
        self.seen: list[int] = []
        self.total, self.trained = SumMetric(), SumMetric()  # samples evaluated, trained

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh["tensor_parallel"].size() > 1:
            parallelize_module(self, mesh["tensor_parallel"], {"l1": ColwiseParallel(), "l2": RowwiseParallel()})
        for module in (self.l1, self.l2, self):
            fully_shard(module, mesh=mesh["data_parallel"])

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        self.seen += idx.tolist()
        self.trained.update(float(len(x)))
        self.log("samples", float(len(x)), reduce_fx="sum", sync_dist=True, batch_size=len(x))
        return F.cross_entropy(self(x), y)

    def on_train_end(self) -> None:
        self.samples_trained = float(self.trained.compute())  # synced over the data-parallel ranks

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        idx, x, y = batch
        if dataloader_idx == 1:  # the wide stream: a stand-in of another stream would fail here
            assert x.shape[1] == 6, x.shape
            x = x[:, :4]
        self(x)
        self.log("index_sum", idx.float().sum(), reduce_fx="sum", batch_size=len(x))
        self.log("index_mean", idx.float().mean(), batch_size=len(x))
        self.log("index_max", idx.float().max(), reduce_fx="max", batch_size=len(x))
        if dataloader_idx == 0:  # (one Metric object per loader would be needed for both)
            self.total.update(idx.float().sum())
            self.log("metric_sum", self.total)

    def predict_step(self, batch, batch_idx):
        return batch[0]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NormModel(Model):
    """With a BatchNorm on the input in its loss (times 0: the weights are Model's): its running statistics count the
    training batches with data, and a stand-in step's backward needs the ones its forward used."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4, affine=False)

    def training_step(self, batch, batch_idx):
        # (an input that requires grad: the norm's backward runs, as one with weights would)
        return super().training_step(batch, batch_idx) + 0.0 * self.norm(batch[1].detach().requires_grad_()).sum()


def full_weights(model: Model) -> list[list[float]]:
    """Every parameter whole (DTensors gathered: a collective on every rank)."""
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist() for p in model.parameters()
    ]


def reference(steps: list[list[int]]) -> list[list[float]]:
    """One process: SGD on the mean loss of each step's samples."""
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for indices in steps:
        _, x, y = (
            torch.stack([torch.as_tensor(v) for v in column]) for column in zip(*map(sample, indices), strict=True)
        )
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


class StepValues(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.values.append(float(trainer.callback_metrics["samples"]))


def main(dp: int, tp: int, out: str) -> None:
    def trainer(**kwargs) -> pl.Trainer:
        fit_options = {key: kwargs.pop(key) for key in ("max_epochs", "callbacks", "precision") if key in kwargs}
        return pl.Trainer(
            accelerator="cpu", devices=dp * tp, strategy=ShardPlusModelParallelStrategy(dp, tp, **kwargs),
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            **{"max_epochs": 1, **fit_options},
        )  # fmt: skip

    found: dict = {"initial": full_weights(Model())}
    # padded equal shards over the data-parallel ranks; sums over them, not over every rank
    model, values = Model(), StepValues()
    trainer(callbacks=[values]).fit(model, DataLoader(Samples(10), batch_size=2, shuffle=True))
    found["fit"] = {"seen": model.seen, "samples": values.values, "trained": model.samples_trained}
    # fewer samples than data-parallel ranks: every rank trains on a copy of sample 0 (padding "first")
    tiny = Model()
    trainer().fit(tiny, DataLoader(Samples(1), batch_size=2))
    found["tiny"] = tiny.seen
    # aggregation windows: one reduce-scatter per window, the weights of one process on the whole batch
    model = Model()
    trainer(aggregation_frequency=2).fit(model, DataLoader(Samples(4 * dp), batch_size=2, shuffle=True))
    found["aggregation"] = {"weights": full_weights(model), "reference": reference([list(range(4 * dp))])}
    # uneven streams: join (data-parallel rank 1 empty) and drop (rank 1 one batch)
    for policy, per_rank in (
        ("join", [6] + [2 * r for r in range(dp - 1)]),
        ("drop", [6] + [2 * r + 2 for r in range(dp - 1)]),
    ):
        model, values = NormModel(), StepValues()
        trainer(uneven_inputs=policy, callbacks=[values]).fit(model, DataLoader(DataParallelStream(per_rank, tp), 2))
        offsets = [sum(per_rank[:r]) for r in range(dp)]
        batches = 3 if policy == "join" else min(n // 2 for n in per_rank)
        steps = [
            [offsets[r] + 2 * b + k for r in range(dp) if 2 * b < per_rank[r] for k in (0, 1)] for b in range(batches)
        ]
        found[policy] = {"samples": values.values, "weights": full_weights(model), "reference": reference(steps),
                         "trained": model.samples_trained,
                         "normalized": int(model.norm.num_batches_tracked)}  # fmt: skip
    # exact evaluation: shards of 2 and 1 samples, an empty one, none
    for n in (2 * dp - 1, 1, 0):
        found[f"validate{n}"] = trainer().validate(Model(), DataLoader(Samples(n), batch_size=2), verbose=False)
    # an evaluation stream: 3 samples on data-parallel rank 0, none on rank 1, 1 on the others
    stream = DataLoader(DataParallelStream([3, 0] + [1] * (dp - 2), tp), batch_size=2)
    found["validate_stream"] = trainer().validate(Model(), stream, verbose=False)
    # two evaluation streams; data-parallel rank 1 empty in the second (which has 6 features): each stream's own
    # stand-in, not the first stream's last batch
    first = DataLoader(DataParallelStream([3, 1] + [1] * (dp - 2), tp), batch_size=2)
    wide = DataLoader(Widened(DataParallelStream([2, 0] + [1] * (dp - 2), tp)), batch_size=2)
    found["two_streams"] = trainer().validate(Model(), [first, wide], verbose=False)
    # the stand-in as the loop prepares a batch: bf16 weights take it (precision's input conversion)
    found["bf16"] = trainer(precision="bf16-true").validate(Model(), stream, verbose=False)
    # checkpoint and early-stopping decisions over every rank of the mesh
    decide = trainer().strategy
    decide.setup_environment = lambda: None  # (the process group runs already)
    rank0 = dist.get_rank() == 0
    found["decisions"] = [
        decide.reduce_boolean_decision(True), decide.reduce_boolean_decision(rank0),
        decide.reduce_boolean_decision(rank0, all=False), decide.reduce_boolean_decision(False, all=False),
    ]  # fmt: skip
    # a prediction writer sees every real batch with its indices, and the stand-ins without any
    writes = Writes()
    trainer(callbacks=[writes]).predict(Model(), DataLoader(Samples(5), batch_size=2), return_predictions=False)
    found["writes"] = writes.written
    found["predict"] = [t.tolist() for t in trainer().predict(Model(), DataLoader(Samples(5), batch_size=2))]
    with open(f"{out}.{dist.get_rank()}.json", "w") as file:
        json.dump(found, file)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
