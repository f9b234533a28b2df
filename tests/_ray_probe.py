"""What each Ray Train worker runs in tests/test_ray.py: a regression fit under a given strategy, as Ray documents its
Lightning integration (``devices="auto"``, ``RayLightningEnvironment``, ``RayTrainReportCallback``,
``prepare_trainer``); each rank appends what it saw to its own JSON-lines file. ``resumable_train_function``: a fit
that reports checkpoints mid-epoch and resumes from Ray's latest one after a restart (a worker killed once, at a
given step). ``ray_data_train_function``: fits on Ray Data shards (``ray.train.get_dataset_shard``)."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
import warnings
from pathlib import Path

import lightning.pytorch as pl
import ray.train
import torch
import torch.nn.functional as F
from ray.train import CheckpointConsistencyMode, DataConfig
from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_shardplus.ray import RayShardPlusModelParallelStrategy, RayShardPlusStrategy


class RegressionData(Dataset):
    """Sample ``i``: ``(x_i, y_i, i)``, fixed by the index and the seed."""

    def __init__(self, length: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(length, 4, generator=generator)
        self.targets = torch.randn(length, generator=generator)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        return self.inputs[index], self.targets[index], index


class RayRegression(pl.LightningModule):
    def __init__(self, record_dir: str) -> None:
        super().__init__()
        self.record_dir = Path(record_dir)
        self.layer = nn.Linear(4, 1)
        self.attempt = "fresh"  # "resumed" where the fit resumes a checkpoint

    def record(self, **row) -> None:
        row = {"rank": self.global_rank, "epoch": self.current_epoch, "step": self.global_step, **row}
        with open(self.record_dir / f"rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"attempt": self.attempt, **row}) + "\n")

    def on_train_start(self) -> None:
        """Where this fit starts (a resumed one: the checkpoint's epoch and step) and on how many workers."""
        self.record(stage="start", world_size=self.trainer.world_size)

    def forward(self, inputs):
        return self.layer(inputs).squeeze(-1)

    def training_step(self, batch, batch_idx):
        inputs, targets, indices = batch
        loss = F.mse_loss(self(inputs), targets)
        self.record(stage="train", indices=indices.tolist(), loss=loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, targets, indices = batch
        if not self.trainer.sanity_checking:
            self.record(stage="val", indices=indices.tolist())
        self.log("val_mse", F.mse_loss(self(inputs), targets), sync_dist=True)
        self.log("val_count", float(len(indices)), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ShardedRayRegression(RayRegression):
    """The same model under FSDP2 over the data-parallel dimension of the strategy's mesh."""

    def configure_model(self) -> None:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        fully_shard(self, mesh=self.device_mesh["data_parallel"])


STRATEGIES = {"shardplus": RayShardPlusStrategy, "ray_ddp": RayDDPStrategy}


def train_function(config: dict) -> None:
    """One fit: ``config`` names the strategy, the sizes and where to record."""
    record_dir = Path(config["record_dir"])
    record_dir.mkdir(parents=True, exist_ok=True)
    if config.get("mesh_refusal"):  # a mesh that does not fit Ray's workers, refused before training
        strategy = RayShardPlusModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
        try:
            _trainer(strategy, prepare=False).fit(RayRegression(str(record_dir)), _loader(4, 1, 2))
        except ValueError as error:
            _write(record_dir, "refusal", str(error))
    pl.seed_everything(0)
    model = RayRegression(str(record_dir))
    trainer = _trainer(STRATEGIES[config["strategy"]](), max_epochs=config["epochs"])
    batch_size = config["batch_size"]
    if config.get("model_parallel"):  # FSDP2 over Ray's workers, without prepare_trainer (it refuses the class)
        _fit_model_parallel(record_dir, config)
    trainer.fit(
        model, _loader(config["train_size"], 1, batch_size, shuffle=True), _loader(config["val_size"], 2, batch_size)
    )


class RayReportEveryNSteps(pl.Callback):
    """Reports a checkpoint to Ray every ``n`` optimizer steps, as ``RayTrainReportCallback`` does at epoch ends:
    what a restarted worker group resumes mid-epoch from (``ray.train.get_checkpoint()``)."""

    def __init__(self, every_n_train_steps: int) -> None:
        self.every_n_train_steps = every_n_train_steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every_n_train_steps:
            return
        with tempfile.TemporaryDirectory() as directory:  # every worker reports (Ray merges the folders); rank 0 saves
            trainer.save_checkpoint(Path(directory, RayTrainReportCallback.CHECKPOINT_NAME), weights_only=False)
            metrics = {"epoch": trainer.current_epoch, "step": trainer.global_step, "mid_epoch": 1}
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
        trainer.strategy.barrier()


class KillOnce(pl.Callback):
    """Ends ``rank``'s process (``os._exit``) before training step ``step``, once: the marker file says it happened.
    It waits until Ray committed the checkpoints reported so far, so the restart resumes the latest one."""

    def __init__(self, rank: int, step: int, marker: str) -> None:
        self.rank, self.step, self.marker = rank, step, Path(marker)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step or self.marker.exists():
            return
        ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
        self.marker.write_text(json.dumps({"epoch": trainer.current_epoch, "step": trainer.global_step}))
        os._exit(1)


@ray.remote(num_cpus=0)
class Gate:
    """An event between the training function and the test's driver: ``open`` releases ``wait`` (both coroutines,
    on the actor's event loop)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def open(self) -> None:
        self.event.set()

    async def wait(self) -> None:
        await self.event.wait()


class WaitForResize(pl.Callback):
    """On ``world_size`` workers, before step ``step``: once Ray committed the checkpoints reported so far, rank 0
    opens ``gate`` (the driver adds a node) and every rank waits for Ray to replace the worker group; no step past
    ``step`` runs on ``world_size`` workers, whenever Ray resizes."""

    def __init__(self, world_size: int, step: int, gate) -> None:
        self.world_size, self.step, self.gate = world_size, step, gate

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.world_size != self.world_size or trainer.global_step != self.step:
            return
        ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
        if trainer.global_rank == 0:
            ray.get(self.gate.open.remote())
        threading.Event().wait()  # until Ray ends this process to start the resized group


def resumable_train_function(config: dict) -> None:
    """A shardplus fit that reports a checkpoint every ``every_n_steps`` steps and resumes from
    ``ray.train.get_checkpoint()`` after a restart or a resize; ``kill`` = ``(rank, step, marker)`` ends that
    rank's process once, before that step; ``grow`` = ``(world_size, step, gate)`` stops there for a resize
    (``WaitForResize``)."""
    record_dir = Path(config["record_dir"])
    record_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = ray.train.get_checkpoint()
    pl.seed_everything(0)
    model = RayRegression(str(record_dir))
    callbacks = [RayTrainReportCallback(), RayReportEveryNSteps(config["every_n_steps"])]
    if config.get("kill") and checkpoint is None:
        callbacks.append(KillOnce(*config["kill"]))
    if config.get("grow"):
        callbacks.append(WaitForResize(*config["grow"]))
    trainer = _trainer(RayShardPlusStrategy(), callbacks=callbacks, max_epochs=config["epochs"])
    batch_size = config["batch_size"]
    loaders = (
        _loader(config["train_size"], 1, batch_size, shuffle=True), _loader(config["val_size"], 2, batch_size)
    )  # fmt: skip
    if checkpoint is None:
        trainer.fit(model, *loaders)
        return
    model.attempt = "resumed"
    with checkpoint.as_directory() as directory:
        trainer.fit(model, *loaders, ckpt_path=Path(directory, RayTrainReportCallback.CHECKPOINT_NAME))


def _loader(size: int, seed: int, batch_size: int, shuffle: bool = False) -> DataLoader:
    return DataLoader(RegressionData(size, seed), batch_size=batch_size, shuffle=shuffle)


def _fit_model_parallel(record_dir: Path, config: dict) -> None:
    """A fit under ``RayShardPlusModelParallelStrategy``: each rank's ``callback_metrics`` and the full final weights
    (rank 0) in ``record_dir/model_parallel``."""
    directory = record_dir / "model_parallel"
    directory.mkdir(exist_ok=True)
    pl.seed_everything(0)
    strategy = RayShardPlusModelParallelStrategy(save_distributed_checkpoint=False)
    trainer = _trainer(strategy, prepare=False, callbacks=[], max_epochs=1)
    batch_size = config["batch_size"]
    trainer.fit(
        ShardedRayRegression(str(directory)),
        _loader(config["train_size"], 1, batch_size, shuffle=True),
        _loader(config["val_size"], 2, batch_size),
    )
    metrics = {name: value.item() for name, value in trainer.callback_metrics.items()}
    _write(directory, f"metrics{trainer.global_rank}", json.dumps(metrics))
    trainer.save_checkpoint(directory / "final.ckpt")


def _trainer(strategy, prepare: bool = True, callbacks=None, **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(
        devices="auto", accelerator="cpu", strategy=strategy, plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback()] if callbacks is None else callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip
    return prepare_trainer(trainer) if prepare else trainer


def _write(record_dir: Path, name: str, text: str) -> None:
    (record_dir / f"{name}.txt").write_text(text)


# Ray Data: shards of different lengths, read as a Lightning user does


def ray_data_rows(length: int, seed: int) -> list[dict]:
    """``RegressionData``'s samples as Ray Data rows (``ray.data.from_items``): columns ``id``, ``x``, ``y``."""
    data = RegressionData(length, seed)
    return [{"id": i, "x": data.inputs[i].numpy(), "y": float(data.targets[i])} for i in range(length)]


class UnequalSplit(DataConfig):
    """Ray's ``DataConfig``, but the datasets named in ``unequal`` are split without dropping rows
    (``streaming_split(equal=False)``; Ray's own split is ``equal=True``, which drops up to W-1 rows): the workers'
    shards then differ in length, which shardplus's ``uneven_inputs`` makes safe."""

    def __init__(self, unequal: list[str], **kwargs) -> None:
        super().__init__(**kwargs)
        self.unequal = set(unequal)

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        rest = {name: ds for name, ds in datasets.items() if name not in self.unequal}
        output = super().configure(rest, world_size, worker_handles, worker_node_ids, **kwargs)
        for name in self.unequal & datasets.keys():  # as docs/ray.md shows it
            dataset = datasets[name].copy(datasets[name])
            dataset.context.execution_options = DataConfig.default_ingest_options()
            splits = dataset.streaming_split(world_size, equal=False, locality_hints=worker_node_ids)
            for rank, split in enumerate(splits):
                output[rank][name] = split
        return output


class RayDataRegression(RayRegression):
    """``RayRegression`` on Ray Data's batches (dicts of columns); records each training epoch's end step."""

    def training_step(self, batch, batch_idx):
        return super().training_step(_columns(batch), batch_idx)

    def validation_step(self, batch, batch_idx):
        return super().validation_step(_columns(batch), batch_idx)

    def on_train_epoch_end(self) -> None:
        self.record(stage="epoch_end")


def _columns(batch: dict) -> tuple:
    return batch["x"].float(), batch["y"].float(), batch["id"]


class RayShardStream(IterableDataset):
    """A Ray Data shard as a torch ``IterableDataset`` of batches (``DataLoader(..., batch_size=None)``): each pass
    is a new epoch of the shard; ``on_batch`` is told each batch's ids."""

    def __init__(self, name: str, batch_size: int, on_batch) -> None:
        self.name, self.batch_size, self.on_batch = name, batch_size, on_batch

    def __iter__(self):
        for batch in ray.train.get_dataset_shard(self.name).iter_torch_batches(batch_size=self.batch_size):
            self.on_batch(batch["id"].tolist())
            yield batch


class SaveAt(pl.Callback):
    """Saves ``epoch_end.ckpt`` at the end of epoch 0 (where ``RayTrainReportCallback`` saves) and ``mid_epoch.ckpt``
    after epoch 1's first batch, in ``directory``; records the step of each."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.directory / "epoch_end.ckpt")
            pl_module.record(stage="saved", name="epoch_end")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch == 1 and batch_idx == 0:
            trainer.save_checkpoint(self.directory / "mid_epoch.ckpt")
            pl_module.record(stage="saved", name="mid_epoch")


def ray_data_train_function(config: dict) -> None:
    """Fits of ``RayShardPlusStrategy`` on the shards of Ray Data's ``train`` (split unequally), ``train_equal``
    (Ray's equal split) and ``val`` (unequally): ``join`` (2 epochs, validation, checkpoints saved at epoch 0's end
    and in epoch 1), ``drop`` (1 epoch), ``equal`` (1 epoch, ``join``), then a resume of each saved checkpoint. Each
    fit's records carry its name (``attempt``); the warnings of each fit are saved per rank."""
    record_dir = Path(config["record_dir"])
    record_dir.mkdir(parents=True, exist_ok=True)
    batch_size = config["batch_size"]
    fits = [
        ("join", "train", 2, True, None), ("drop", "train", 1, False, None),
        ("equal", "train_equal", 1, False, None), ("from_epoch_end", "train", 2, False, "epoch_end.ckpt"),
        ("from_mid_epoch", "train", 2, False, "mid_epoch.ckpt"),
    ]  # fmt: skip
    for name, dataset, epochs, first, checkpoint in fits:
        pl.seed_everything(0)
        model = RayDataRegression(str(record_dir))
        model.attempt = name
        stream = RayShardStream(dataset, batch_size, lambda ids, m=model: m.record(stage="yielded", indices=ids))
        strategy = RayShardPlusStrategy(uneven_inputs="drop" if name == "drop" else "join")
        callbacks = [RayTrainReportCallback(), SaveAt(record_dir)] if first else []
        trainer = _trainer(strategy, callbacks=callbacks, max_epochs=epochs)
        # validation as Ray documents it for Lightning: the shard's iterable itself
        val = ray.train.get_dataset_shard("val").iter_torch_batches(batch_size=batch_size) if first else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resume = checkpoint and record_dir / checkpoint
            trainer.fit(model, DataLoader(stream, batch_size=None), val, ckpt_path=resume)
        _write(record_dir, f"warnings_{name}_{trainer.global_rank}", json.dumps([str(w.message) for w in caught]))
        if first:
            metrics = {key: value.item() for key, value in trainer.callback_metrics.items()}
            _write(record_dir, f"metrics_{trainer.global_rank}", json.dumps(metrics))
