"""Uneven inputs: training streams of different lengths per rank take the same steps on every rank, never hang,
and with "join" train on every sample once, with the gradient of each step the mean over the ranks that had data.

Each rank records what it trained on (fork workers write JSON lines); the reference runs are single-process
trainings written out in the test itself."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import cpu_trainer, uncounted_allreduce_hook
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.multiprocessing import ProcessRaisedException  # what a forked rank raised, in this process
from torch.utils.data import DataLoader, IterableDataset

from lightning_shardplus import ShardPlusStrategy
from lightning_shardplus.data.group import DataParallel
from lightning_shardplus.data.uneven import AGREEMENT_BLOCK, NO_BATCH, EvenSteps
from lightning_shardplus.gradients.ddp.steps import zero_loss

DIM = 4


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    generator = torch.Generator().manual_seed(i)
    x = torch.randn(DIM, generator=generator)
    return x, x.sum(dim=0, keepdim=True) * 0.5, i


class RankStream(IterableDataset):
    """Rank r streams samples ``offsets[r] .. offsets[r] + lengths[r] - 1`` (its own length; possibly none)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __iter__(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        start = sum(self.lengths[:rank])
        for i in range(start, start + self.lengths[rank]):
            yield sample(i)


class Regression(pl.LightningModule):
    """A linear (optionally BatchNorm) regression that records, per rank, the ids it trained on and its losses."""

    def __init__(self, out: Path, batch_norm: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        self.out, self.lr = Path(out), lr
        self.out.mkdir(parents=True, exist_ok=True)
        self.net = nn.Sequential(nn.BatchNorm1d(DIM), nn.Linear(DIM, 1)) if batch_norm else nn.Linear(DIM, 1)

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss)
        self._write("train", ids=ids.tolist(), loss=loss.item(), step=self.global_step, epoch=self.current_epoch)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, ids = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), batch_size=len(ids))
        self._write("val", ids=ids.tolist())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        logged = self.trainer.callback_metrics.get("loss")
        self._write("batch_end", step=self.global_step, logged=None if logged is None else float(logged))

    def on_train_end(self):
        state = {k: v.tolist() for k, v in self.state_dict().items()}
        self._write("end", state=state, global_step=self.global_step)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def _write(self, kind, **row):
        with open(self.out / f"rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"kind": kind, **row}) + "\n")


def rows(out: Path, rank: int, kind: str) -> list[dict]:
    lines = (out / f"rank{rank}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def fit_streams(
    tmp_path, lengths, batch_size=4, epochs=1, batch_norm=False, val_lengths=None, trainer_kwargs=None, **kwargs
):
    out = tmp_path / "records"
    model = Regression(out, batch_norm=batch_norm)  # first: the tests seed the initial weights
    strategy = ShardPlusStrategy(start_method="fork", **kwargs)
    trainer = cpu_trainer(strategy, len(lengths), max_epochs=epochs, **(trainer_kwargs or {}))
    val = None if val_lengths is None else DataLoader(RankStream(val_lengths), batch_size=batch_size)
    trainer.fit(model, DataLoader(RankStream(lengths), batch_size=batch_size), val)
    return out


def batches_of(lengths, rank, batch_size):
    start = sum(lengths[:rank])
    ids = list(range(start, start + lengths[rank]))
    return [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lengths", [[28, 9], [10, 0], [0, 7], [10, 0, 5], [3, 13, 6]])
def test_join_trains_every_sample_once_in_as_many_steps_as_the_longest_stream(tmp_path, lengths):
    out = fit_streams(tmp_path, lengths, epochs=2)
    world = len(lengths)
    steps_per_epoch = max(len(batches_of(lengths, r, 4)) for r in range(world))
    for epoch in range(2):
        epoch_rows = [row for r in range(world) for row in rows(out, r, "train") if row["epoch"] == epoch]
        trained = [i for row in epoch_rows for i in row["ids"]]
        assert sorted(trained) == list(range(sum(lengths)))  # every sample once in every epoch
    ends = [rows(out, r, "end")[0] for r in range(world)]
    assert {end["global_step"] for end in ends} == {2 * steps_per_epoch}  # the same steps on every rank
    assert all(end["state"] == ends[0]["state"] for end in ends)  # the same parameters on every rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lengths", [[28, 9], [10, 0, 5]])
def test_drop_ends_every_epoch_at_the_shortest_stream(tmp_path, lengths):
    logger = CSVLogger(tmp_path, name="logs", version=0)
    out = fit_streams(tmp_path, lengths, epochs=2, uneven_inputs="drop", trainer_kwargs={"logger": logger})
    world = len(lengths)
    steps_per_epoch = min(len(batches_of(lengths, r, 4)) for r in range(world))
    kept = sum(len(ids) for r in range(world) for ids in batches_of(lengths, r, 4)[:steps_per_epoch])
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        dropped = [float(row["uneven/dropped_samples"]) for row in csv.DictReader(f) if row["uneven/dropped_samples"]]
    assert dropped == [sum(lengths) - kept] * 2  # logged once per epoch: the samples not trained on
    for r in range(world):
        trained = [row["ids"] for row in rows(out, r, "train") if row["epoch"] == 0]
        assert trained == batches_of(lengths, r, 4)[:steps_per_epoch]
    ends = [rows(out, r, "end")[0] for r in range(world)]
    assert {end["global_step"] for end in ends} == {2 * steps_per_epoch}
    assert all(end["state"] == ends[0]["state"] for end in ends)


def single_process_reference(step_batches, batch_norm=False, lr=0.1):
    """SGD with momentum over ``step_batches`` (per step: the ids of every batch that had data in it, one mean loss
    over their concatenation: equal batch sizes make it the mean of the per-batch means)."""
    torch.manual_seed(0)
    model = Regression(Path("/tmp/unused-records"), batch_norm=batch_norm, lr=lr)
    optimizer = model.configure_optimizers()
    for batches in step_batches:
        per_batch = []
        for ids in batches:
            x = torch.stack([sample(i)[0] for i in ids])
            y = torch.stack([sample(i)[1] for i in ids])
            per_batch.append(F.mse_loss(model.net(x), y))
        optimizer.zero_grad()
        torch.stack(per_batch).mean().backward()
        optimizer.step()
    return {k: v.tolist() for k, v in model.state_dict().items()}


def assert_state_close(state, reference, atol=1e-6):
    for key, value in reference.items():
        assert torch.allclose(torch.tensor(state[key]).double(), torch.tensor(value).double(), atol=atol), key


@pytest.mark.timeout(120)
@pytest.mark.compat
def test_once_a_rank_ran_out_the_steps_are_those_of_one_process_on_the_other_ranks_batches(tmp_path):
    # rank 1 has one batch, rank 0 three: step 1 averages both ranks' gradients, steps 2-3 are rank 0's alone
    torch.manual_seed(0)
    out = fit_streams(tmp_path, [12, 4])
    reference = single_process_reference([[[0, 1, 2, 3], [12, 13, 14, 15]], [[4, 5, 6, 7]], [[8, 9, 10, 11]]])
    for rank in range(2):
        assert_state_close(rows(out, rank, "end")[0]["state"], reference)


@pytest.mark.timeout(120)
def test_a_rank_without_data_runs_no_batch_norm_and_changes_no_statistics(tmp_path):
    # rank 1's stream is empty: every step is rank 0's alone, BatchNorm statistics included
    torch.manual_seed(0)
    out = fit_streams(tmp_path, [12, 0], batch_norm=True, broadcast_buffers=False)
    reference = single_process_reference([[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9, 10, 11]]], batch_norm=True)
    assert_state_close(rows(out, 0, "end")[0]["state"], reference)
    rank1 = rows(out, 1, "end")[0]["state"]
    assert rank1["net.0.num_batches_tracked"] == 0 and rank1["net.0.running_mean"] == [0.0] * DIM  # never ran
    assert rank1["net.1.weight"] == rows(out, 0, "end")[0]["state"]["net.1.weight"]


@pytest.mark.timeout(120)
def test_aggregation_windows_average_over_the_micro_batches_that_had_data(tmp_path):
    # windows of 2 micro-batches; rank 1 has 3 batches, rank 0 has 6: window 2 has rank 1 in its first half only
    torch.manual_seed(0)
    out = fit_streams(tmp_path, [24, 12], aggregation_frequency=2)
    b0, b1 = batches_of([24, 12], 0, 4), batches_of([24, 12], 1, 4)
    reference = single_process_reference([[b0[0], b0[1], b1[0], b1[1]], [b0[2], b0[3], b1[2]], [b0[4], b0[5]]])
    for rank in range(2):
        end = rows(out, rank, "end")[0]
        assert end["global_step"] == 3
        assert_state_close(end["state"], reference)


@pytest.mark.timeout(120)
def test_compressed_gradients_pair_up_through_the_ragged_end(tmp_path):
    torch.manual_seed(0)
    out = fit_streams(tmp_path, [20, 4], gradient_compression="fp16")
    b0 = batches_of([20, 4], 0, 4)
    reference = single_process_reference([[b0[0], [20, 21, 22, 23]], *[[b] for b in b0[1:]]])
    for rank in range(2):
        assert_state_close(rows(out, rank, "end")[0]["state"], reference, atol=1e-3)  # fp16 on the wire


class EpochLogged(Regression):
    """Logs its loss per step and per epoch, and records on every rank what its callbacks would read."""

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=True, on_epoch=True)
        self._write("train", ids=ids.tolist(), loss=loss.item(), step=self.global_step, epoch=self.current_epoch)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._write("batch_end", step=self.global_step, logged=float(self.trainer.callback_metrics["loss_step"]))

    def on_train_epoch_end(self):
        logged = float(self.trainer.callback_metrics["loss_epoch"])
        self._write("epoch_end", epoch=self.current_epoch, logged=logged)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lengths", [[12, 4], [4, 12, 8]])
def test_a_rank_without_data_shows_the_same_step_and_epoch_values_as_the_ranks_with_data(tmp_path, lengths):
    """With "join", a rank that ran out logs nothing; its step and epoch values (what its schedulers and
    callbacks read) are still the other ranks', in this epoch and the next."""
    world, out = len(lengths), tmp_path / "records"
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), world, max_epochs=2, log_every_n_steps=1)
    trainer.fit(EpochLogged(out), DataLoader(RankStream(lengths), batch_size=4))
    steps_per_epoch = max(len(batches_of(lengths, r, 4)) for r in range(world))
    trained = [row for r in range(world) for row in rows(out, r, "train")]
    for step in range(1, 2 * steps_per_epoch + 1):
        had_data = [row for row in trained if row["step"] == step - 1]
        expected = sum(row["loss"] * len(row["ids"]) for row in had_data) / sum(len(row["ids"]) for row in had_data)
        shown = [next(row["logged"] for row in rows(out, r, "batch_end") if row["step"] == step) for r in range(world)]
        assert shown == pytest.approx([expected] * world, rel=1e-6)
    for epoch in range(2):
        in_epoch = [row for row in trained if row["epoch"] == epoch]
        expected = sum(row["loss"] * len(row["ids"]) for row in in_epoch) / sum(len(row["ids"]) for row in in_epoch)
        shown = [rows(out, r, "epoch_end")[epoch]["logged"] for r in range(world)]
        assert shown == pytest.approx([expected] * world, rel=1e-6)


@pytest.mark.timeout(120)
def test_averaged_training_metrics_are_the_mean_over_the_ranks_that_had_data(tmp_path):
    out = fit_streams(tmp_path, [16, 4], trainer_kwargs={"log_every_n_steps": 1})
    losses = [{row["step"]: row["loss"] for row in rows(out, r, "train")} for r in range(2)]
    logged = {row["step"]: row["logged"] for row in rows(out, 0, "batch_end")}
    assert logged[1] == pytest.approx((losses[0][0] + losses[1][0]) / 2, rel=1e-6)  # both ranks had data
    for step in (2, 3, 4):  # rank 1 had none: rank 0's own loss, not halved
        assert logged[step] == pytest.approx(losses[0][step - 1], rel=1e-6)


@pytest.mark.timeout(120)
def test_validation_inside_the_epoch_and_max_steps_keep_every_rank_in_step(tmp_path):
    out = fit_streams(
        tmp_path,
        [40, 8],
        epochs=3,
        val_lengths=[6, 13],
        trainer_kwargs={"val_check_interval": 3, "max_steps": 8, "num_sanity_val_steps": 0},
    )
    ends = [rows(out, r, "end")[0] for r in range(2)]
    assert [end["global_step"] for end in ends] == [8, 8] and ends[0]["state"] == ends[1]["state"]


ALL_REDUCES = {"calls": 0}


@pytest.fixture
def count_all_reduces(monkeypatch):
    """Count the Python-level all_reduce calls in every process forked from here (undone after the test)."""
    original = dist.all_reduce

    def counted(*args, **kwargs):
        ALL_REDUCES["calls"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counted)


def agreements(micro_batches: int) -> int:
    """The agreement's all_reduces in one pass over streams of ``micro_batches`` micro-batches (the longest)."""
    return micro_batches // AGREEMENT_BLOCK + 1


class CountingRegression(Regression):
    def setup(self, stage):  # before the first pass fetches (and agrees on) its first batches
        self.calls_at_start = ALL_REDUCES["calls"]

    def on_train_end(self):
        super().on_train_end()
        self._write("calls", calls=ALL_REDUCES["calls"] - self.calls_at_start, steps=self.global_step)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("lengths", "settings", "per_epoch"),
    [
        # one agreement per block of AGREEMENT_BLOCK micro-batches, up to the one that finds a micro-batch without
        # data on every rank; the averaged metrics one per step
        ([28, 9], {}, lambda m, steps: agreements(m) + steps),
        ([5, 16, 30], {}, lambda m, steps: agreements(m) + steps),
        ([28, 9], {"ddp_comm_hook": uncounted_allreduce_hook}, lambda m, steps: agreements(m) + steps),
        ([28, 9], {"average_training_metrics": False}, lambda m, steps: agreements(m)),
        ([28, 9], {"aggregation_frequency": 2}, lambda m, steps: agreements(m) + steps),
        ([32, 9], {}, lambda m, steps: agreements(m) + steps),  # 8 micro-batches: 2 blocks + 1
    ],
)
def test_the_agreement_takes_one_all_reduce_per_block_of_micro_batches_and_the_metrics_one_per_step(
    tmp_path, count_all_reduces, lengths, settings, per_epoch
):
    out = tmp_path / "records"
    model = CountingRegression(out)
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork", **settings), len(lengths), max_epochs=2)
    trainer.fit(model, DataLoader(RankStream(lengths), batch_size=4))
    micro_batches = max(len(batches_of(lengths, r, 4)) for r in range(len(lengths)))
    steps = -(-micro_batches // settings.get("aggregation_frequency", 1))
    for rank in range(len(lengths)):
        (fit,) = rows(out, rank, "calls")
        assert fit["steps"] == 2 * steps
        assert fit["calls"] == 2 * per_epoch(micro_batches, steps)  # Python-level all_reduce calls in the fit
        trained = sorted(i for row in rows(out, rank, "train") if row["epoch"] == 1 for i in row["ids"])
        assert trained == sorted(i for ids in batches_of(lengths, rank, 4) for i in ids)  # every sample


def test_the_agreement_counts_the_ranks_with_data_of_every_micro_batch(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        even = EvenSteps("join", DataParallel(1, 0))
        assert list(even.agreed_batches(iter(range(5)))) == [0, 1, 2, 3, 4]
        assert even.ranks_with_data == [1] * 5
    finally:
        dist.destroy_process_group()


def test_a_bad_policy_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"`uneven_inputs`='wait' is not valid: expected one of 'join', 'drop'"):
        ShardPlusStrategy(uneven_inputs="wait")
    assert not dist.is_initialized()


def test_map_style_loaders_and_single_processes_are_not_wrapped():
    even = EvenSteps("join", DataParallel(2, 0))
    assert even.wrap(DataLoader(list(range(8)))) is not None and even.streams == 0
    assert EvenSteps("join", DataParallel(1, 0)).wrap(DataLoader(RankStream([3]))).__class__ is DataLoader


def test_a_training_stream_that_only_the_workers_see_is_refused_with_manual_optimization_where_it_is_prepared(
    tmp_path,
):
    # a DataModule's or the module's own loader (a stream given to `fit` is refused before any worker starts:
    # tests/test_model_parallel.py)
    model = Regression(tmp_path)
    model.automatic_optimization = False
    even = EvenSteps("drop", DataParallel(2, 0), trainer=SimpleNamespace(lightning_module=model))
    with pytest.raises(ValueError, match=r"`uneven_inputs`='drop' needs automatic optimization .*: Regression sets"):
        even.wrap(DataLoader(RankStream([3, 3])))


class StatefulStream(DataLoader):
    """A stream's loader with a ``state_dict`` that is not litdata's: what it was told to load."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loaded = []

    def state_dict(self):
        return {"position": 0}

    def load_state_dict(self, state):
        self.loaded.append(state)


def test_a_stream_checkpoint_of_another_world_size_restarts_the_epoch_with_a_warning():
    # a litdata stream under model parallel, 2 x 2 to 3 x 1: tests/test_stream_libraries.py
    loader = EvenSteps("join", DataParallel(3, 1)).wrap(StatefulStream(RankStream([3])))
    saved = {"shardplus_per_rank": [{"state": {"position": 4}, "ran_out": False}] * 2}
    with pytest.warns(UserWarning, match="positions of 2 ranks, this run has 3: the streams start again from the"):
        loader.load_state_dict(saved)
    assert loader.loader.loaded == []
    loader.load_state_dict({"shardplus_per_rank": [{"state": {"position": k}, "ran_out": False} for k in range(3)]})
    assert loader.loader.loaded == [{"position": 1}]  # its own, on the same world size
    # on one rank: nothing to agree on, the loader's own state; a checkpoint of 2 ranks restarts, said once
    alone = EvenSteps("join", DataParallel(1, 0)).wrap(StatefulStream(RankStream([3]), batch_size=2))
    assert [batch[2].tolist() for batch in alone] == [[0, 1], [2]] and alone.state_dict() == {"position": 0}
    with pytest.warns(UserWarning, match="positions of 2 ranks, this run has 1: the streams start again from the"):
        alone.load_state_dict(saved)
    alone.load_state_dict({"position": 4})
    assert alone.loader.loaded == [{"position": 4}]


def test_the_loss_of_a_rank_without_data_has_a_zero_gradient_for_every_parameter():
    module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    zero_loss(module).backward()
    assert all(p.grad is not None and not p.grad.any() for p in module.parameters())
    assert repr(NO_BATCH) == "NO_BATCH"


# ------------------------------------------------------------------------------------------ streaming libraries


def write_litdata(directory: Path, count: int) -> Path:
    """A litdata optimized dataset of ``sample(0..count-1)``, written in this process."""
    from litdata.streaming.writer import BinaryWriter

    directory.mkdir(parents=True, exist_ok=True)
    writer = BinaryWriter(str(directory), chunk_bytes="64KB")
    for i in range(count):
        x, y, _ = sample(i)
        writer[i] = {"x": x, "y": y, "id": i}
    writer.done()
    writer.merge()
    return directory


def hf_stream(count: int):
    """A Hugging Face streaming dataset of ``sample(0..count-1)``, split over the ranks by ``split_dataset_by_node``."""
    from datasets import IterableDataset as HFIterableDataset
    from datasets.distributed import split_dataset_by_node

    def generate():
        for i in range(count):
            x, y, _ = sample(i)
            yield {"x": x.tolist(), "y": y.tolist(), "id": i}

    stream = HFIterableDataset.from_generator(generate)
    return split_dataset_by_node(stream, rank=dist.get_rank(), world_size=dist.get_world_size()).with_format("torch")


class StreamRegression(Regression):
    """:class:`Regression` whose loaders are built on each rank (as a datamodule's would: litdata and ``datasets``
    read the distributed setup when the dataset is made), from dict batches."""

    def __init__(
        self, out: Path, source: str, data: Path | None, count: int, batch_size: int, workers=0, shuffle=False
    ) -> None:
        super().__init__(out, lr=0.01)
        self.source, self.data, self.count, self.batch_size, self.workers = source, data, count, batch_size, workers
        self.shuffle = shuffle

    def _loader(self):
        if self.source == "litdata":
            from litdata import StreamingDataLoader, StreamingDataset

            # drop_last=False lets litdata's tail through (it drops it by default when distributed)
            stream = StreamingDataset(str(self.data), shuffle=self.shuffle, drop_last=False)
            return StreamingDataLoader(stream, batch_size=self.batch_size, num_workers=self.workers)
        return DataLoader(hf_stream(self.count), batch_size=self.batch_size, num_workers=self.workers)

    def train_dataloader(self):
        return self._loader()

    def val_dataloader(self):
        return self._loader()

    def training_step(self, batch, batch_idx):
        return super().training_step((batch["x"], batch["y"], batch["id"]), batch_idx)

    def validation_step(self, batch, batch_idx):
        return super().validation_step((batch["x"], batch["y"], batch["id"]), batch_idx)

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self._write("val_end", val_loss=float(self.trainer.callback_metrics["val_loss"]))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("source", "world", "count", "batch_size", "workers"), [
    ("litdata", 2, 103, 1, 0),
    ("litdata", 3, 103, 1, 0),
    ("litdata", 2, 103, 3, 2),
    ("datasets", 2, 105, 4, 0),
    ("datasets", 3, 106, 4, 0),
    ("datasets", 2, 105, 4, 2),
])
def test_streaming_libraries_train_and_evaluate_every_sample_once(tmp_path, source, world, count, batch_size, workers):
    pytest.importorskip(source)
    data = write_litdata(tmp_path / "data", count) if source == "litdata" else None
    out = tmp_path / "records"
    model = StreamRegression(out, source, data, count, batch_size, workers)
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), world, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model)
    per_rank = [[i for row in rows(out, r, "train") for i in row["ids"]] for r in range(world)]
    assert sorted(i for ids in per_rank for i in ids) == list(range(count))  # every sample once
    assert len({len(ids) for ids in per_rank}) > 1  # the streams really were uneven
    longest = max(len(batches_of([len(ids)], 0, batch_size)) for ids in per_rank)
    ends = [rows(out, r, "end")[0] for r in range(world)]
    assert {end["global_step"] for end in ends} == {longest}
    assert all(end["state"] == ends[0]["state"] for end in ends)
    evaluated = sorted(i for r in range(world) for row in rows(out, r, "val") for i in row["ids"])
    assert evaluated == list(range(count))
    # the epoch metric equals one process's over every sample, with the final weights
    state = ends[0]["state"]
    weight, bias = torch.tensor(state["net.weight"]).double(), torch.tensor(state["net.bias"]).double()
    x = torch.stack([sample(i)[0] for i in range(count)]).double()
    y = torch.stack([sample(i)[1] for i in range(count)]).double()
    expected = ((x @ weight.T + bias - y) ** 2).mean(dim=1)  # per-sample MSE; batches weigh by their size
    assert rows(out, 0, "val_end")[0]["val_loss"] == pytest.approx(float(expected.mean()), rel=1e-6, abs=1e-6)


class SaveAtStep(pl.Callback):
    """Saves a checkpoint (every rank takes part, rank 0 writes) once ``step`` optimizer steps are done."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("saved_at", "epochs", "shuffle"), [
    (20, 1, False),
    (51, 1, False),  # the shorter stream has just run out
    (72, 2, True),  # in the second epoch of a shuffled stream: its order is the second epoch's
])
def test_a_litdata_stream_resumes_mid_epoch_with_the_samples_that_were_next_on_every_rank(
    tmp_path, saved_at, epochs, shuffle
):
    pytest.importorskip("litdata")
    data, count, world = write_litdata(tmp_path / "data", 103), 103, 2
    checkpoint = tmp_path / "mid.ckpt"

    def fit(out: Path, **fit_kwargs) -> None:
        torch.manual_seed(0)
        model = StreamRegression(out, "litdata", data, count, batch_size=1, shuffle=shuffle)
        trainer = cpu_trainer(
            ShardPlusStrategy(start_method="fork"), world, max_epochs=epochs, num_sanity_val_steps=0,
            limit_val_batches=0, callbacks=[SaveAtStep(saved_at, checkpoint)],
        )
        trainer.fit(model, **fit_kwargs)

    fit(tmp_path / "whole")
    fit(tmp_path / "resumed", ckpt_path=checkpoint)
    for rank in range(world):
        whole = [row["ids"] for row in rows(tmp_path / "whole", rank, "train") if row["step"] >= saved_at]
        resumed = [row["ids"] for row in rows(tmp_path / "resumed", rank, "train")]
        assert resumed == whole  # the samples that were next, on each rank, and nothing more
    lengths = [len(rows(tmp_path / "whole", rank, "train")) for rank in range(world)]
    assert min(lengths) < max(lengths)  # the streams were uneven (litdata gives the tail to some ranks)
    ends = [rows(tmp_path / d, 0, "end")[0] for d in ("whole", "resumed")]
    assert ends[1]["global_step"] == ends[0]["global_step"]
    assert_state_close(ends[1]["state"], ends[0]["state"])


@pytest.mark.timeout(180)
def test_a_litdata_stream_resumed_twice_in_one_epoch_goes_on_with_the_samples_that_were_next(tmp_path):
    """A checkpoint saved after a resume, in the resumed epoch, holds that point's position (litdata hands out the
    dict it was loaded with and updates it as the stream advances: each noted position must be a copy)."""
    pytest.importorskip("litdata")
    data, count, world = write_litdata(tmp_path / "data", 103), 103, 2
    first, second = tmp_path / "first.ckpt", tmp_path / "second.ckpt"

    def fit(out: Path, save: SaveAtStep | None = None, **fit_kwargs) -> None:
        torch.manual_seed(0)
        model = StreamRegression(out, "litdata", data, count, batch_size=1, shuffle=True)
        trainer = cpu_trainer(
            ShardPlusStrategy(start_method="fork"), world, max_epochs=2, num_sanity_val_steps=0,
            limit_val_batches=0, callbacks=[save] if save else [],
        )
        trainer.fit(model, **fit_kwargs)

    fit(tmp_path / "whole", SaveAtStep(60, first))
    fit(tmp_path / "once", SaveAtStep(80, second), ckpt_path=first)
    fit(tmp_path / "twice", ckpt_path=second)
    for rank in range(world):
        whole = [row["ids"] for row in rows(tmp_path / "whole", rank, "train") if row["step"] >= 80]
        assert [row["ids"] for row in rows(tmp_path / "twice", rank, "train")] == whole
    ends = [rows(tmp_path / d, 0, "end")[0] for d in ("whole", "twice")]
    assert_state_close(ends[1]["state"], ends[0]["state"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["min_size", "max_size_cycle"])
def test_a_stream_combined_with_other_loaders_is_refused_before_the_first_step(tmp_path, mode):
    # where the stream ran out on one rank, the step would still run there with the other loader's batch only
    from lightning.pytorch.utilities import CombinedLoader

    model = Regression(tmp_path / "records")
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork"), 2, max_epochs=1)
    stream = DataLoader(RankStream([4, 12]), batch_size=4)
    mapped = DataLoader([sample(i) for i in range(16)], batch_size=4)
    refused = r"a training stream is combined with 1 other training loader\(s\) \(in any mode"
    with pytest.raises(ProcessRaisedException, match=refused):
        trainer.fit(model, CombinedLoader({"stream": stream, "mapped": mapped}, mode=mode))
    assert not list((tmp_path / "records").glob("rank*.jsonl"))  # no step ran
