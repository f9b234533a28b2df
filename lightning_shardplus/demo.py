"""A small classifier and the scikit-learn digits data, used by ``configs/``, the examples and the benchmark."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_shardplus.data.datamodule import ShardPlusDataModule
from lightning_shardplus.validation import check_int


class ClassifierModule(pl.LightningModule):
    """An MLP classifier (optionally with BatchNorm) that logs loss and accuracy for train, val and test; SGD with
    momentum unless the LightningCLI's ``optimizer:`` section chooses another."""

    def __init__(
        self, input_dim: int = 64, num_classes: int = 10, hidden_dims: Sequence[int] = (128,), batch_norm: bool = False,
        lr: float = 0.05, momentum: float = 0.9,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = input_dim
        for hidden in hidden_dims:
            layers.append(nn.Linear(width, hidden))
            if batch_norm:
                layers.append(nn.BatchNorm1d(hidden))
            layers.append(nn.ReLU())
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(nn.Flatten(), *layers)
        self.val_accuracy = MulticlassAccuracy(num_classes, average="micro")
        self.test_accuracy = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, labels = batch[0], batch[1]
        loss = F.cross_entropy(self(inputs), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def _evaluate(self, batch: Sequence[torch.Tensor], split: str, accuracy: MulticlassAccuracy) -> None:
        inputs, labels = batch[0], batch[1]
        logits = self(inputs)
        self.log(f"{split}_loss", F.cross_entropy(logits, labels), prog_bar=True)
        accuracy(logits, labels)
        self.log(f"{split}_acc", accuracy, prog_bar=True)

    def validation_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_accuracy)

    def test_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_accuracy)

    def predict_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(dim=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


class ConfiguredClassifierModule(ClassifierModule):
    """:class:`ClassifierModule` whose optimizer comes from the LightningCLI's ``optimizer:`` section alone (no SGD of
    its own for the CLI to override, with a warning): ``configs/large_batch.yaml``."""

    configure_optimizers = pl.LightningModule.configure_optimizers


class ModelParallelClassifierModule(ClassifierModule):
    """:class:`ClassifierModule` sharded in ``configure_model`` for ``ShardPlusModelParallelStrategy``: its linear
    layers in column/row-parallel pairs over the mesh's ``tensor_parallel`` dimension (an odd last one column-parallel,
    its output gathered), then FSDP2 over ``data_parallel`` (``configs/model_parallel.yaml``; torch 2.6 or newer,
    where ``fully_shard`` is public)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleOutput,
            RowwiseParallel,
            parallelize_module,
        )

        if isinstance(self, FSDPModule):  # sharded by an earlier stage in this process (Lightning asks: idempotent)
            return
        mesh = self.device_mesh
        linears = [name for name, module in self.named_modules() if isinstance(module, nn.Linear)]
        tensor_parallel = mesh["tensor_parallel"].size() > 1
        if tensor_parallel:
            # activations stay DTensors between the layers (`use_local_output=False`): a `fully_shard` unit that
            # returned `to_local()`'s view would draw FSDP2's warning about in-place ops on views
            styles = (ColwiseParallel, RowwiseParallel)
            plan = {name: styles[i % 2](use_local_output=False) for i, name in enumerate(linears)}
            if len(linears) % 2:  # the last one without a row-parallel partner: its output gathered whole
                plan[linears[-1]] = ColwiseParallel(output_layouts=Replicate(), use_local_output=False)
            parallelize_module(self, mesh["tensor_parallel"], plan)
        for name in linears:
            fully_shard(self.get_submodule(name), mesh=mesh["data_parallel"])
        fully_shard(self, mesh=mesh["data_parallel"])
        if tensor_parallel:  # the logits as a plain tensor for the loss and metrics, after FSDP2's own output hook
            logits = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate())
            parallelize_module(self, mesh["tensor_parallel"], logits)


class DigitsDataModule(ShardPlusDataModule):
    """scikit-learn's bundled 8x8 digits (1,797 images, no download): a fixed train/validation split,
    pixels scaled to [0, 1]."""

    def __init__(
        self, global_batch_size: int = 64, val_fraction: float = 0.2, split_seed: int = 0, num_workers: int = 0
    ) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"`val_fraction`={val_fraction!r} is not valid: expected 0 < val_fraction < 1.")
        split_seed = check_int("split_seed", split_seed, minimum=0)
        super().__init__(global_batch_size, num_workers=num_workers)
        self.val_fraction, self.split_seed = val_fraction, split_seed

    def _split(self) -> tuple[TensorDataset, TensorDataset]:
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "DigitsDataModule needs scikit-learn: pip install 'lightning-shardplus[examples]'"
            ) from err
        digits = load_digits()
        inputs = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.int64)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.split_seed))
        n_val = int(len(labels) * self.val_fraction)
        val, train = order[:n_val], order[n_val:]
        return TensorDataset(inputs[train], labels[train]), TensorDataset(inputs[val], labels[val])

    def build_train_dataset(self) -> Dataset:
        return self._split()[0]

    def build_val_dataset(self) -> Dataset:
        return self._split()[1]

    build_test_dataset = build_predict_dataset = build_val_dataset


class DigitsStreamDataModule(pl.LightningDataModule):
    """The digits as a litdata stream (``pip install 'lightning-shardplus[streaming,examples]'``), written once in
    :meth:`prepare_data`. Every sample is kept (``drop_last=False``), so the ranks' streams differ in length and
    ``uneven_inputs`` makes them take the same steps: 1,441 training samples on 3 ranks with 16 per device give one
    rank 31 batches and the others 30. ``data_dir``: where the dataset is written (kept between runs);
    ``val_fraction``, ``split_seed``: as :class:`DigitsDataModule`; ``num_workers``: loader workers per rank."""

    def __init__(
        self, data_dir: str = "data/digits_litdata", global_batch_size: int = 48, val_fraction: float = 0.198,
        split_seed: int = 0, num_workers: int = 0,
    ) -> None:  # fmt: skip
        super().__init__()
        check_int("global_batch_size", global_batch_size, minimum=1)
        check_int("num_workers", num_workers, minimum=0)
        self.digits = DigitsDataModule(val_fraction=val_fraction, split_seed=split_seed)
        self.data_dir, self.global_batch_size, self.num_workers = data_dir, global_batch_size, num_workers

    def prepare_data(self) -> None:
        """Write the train and validation splits as litdata datasets (local rank 0; the others wait)."""
        import litdata

        for split, dataset in zip(("train", "val"), self.digits._split(), strict=True):
            output = Path(self.data_dir) / split
            if (output / "index.json").exists():
                continue
            # `verbose=False` where litdata has it: no progress bar, no account advertisement
            quiet = {"verbose": False} if "verbose" in inspect.signature(litdata.optimize).parameters else {}
            litdata.optimize(
                fn=partial(_digit, dataset=dataset), inputs=list(range(len(dataset))), output_dir=str(output),
                chunk_bytes="256KB", num_workers=1, mode="overwrite", **quiet,
            )

    def _loader(self, split: str, shuffle: bool) -> Any:
        from litdata import StreamingDataLoader, StreamingDataset

        world_size = self.trainer.world_size if self.trainer is not None else 1
        if self.global_batch_size % world_size:
            raise ValueError(
                f"`global_batch_size`={self.global_batch_size} does not divide over {world_size} processes: "
                f"use a multiple of {world_size}."
            )
        stream = StreamingDataset(f"{self.data_dir}/{split}", shuffle=shuffle, drop_last=False, seed=0)
        per_device = self.global_batch_size // world_size
        return StreamingDataLoader(stream, batch_size=per_device, num_workers=self.num_workers)

    def train_dataloader(self) -> Any:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> Any:
        return self._loader("val", shuffle=False)


def _digit(index: int, dataset: Dataset) -> tuple[torch.Tensor, int]:
    """One digit as litdata stores it: (pixels, label)."""
    inputs, label = dataset[index]
    return inputs, int(label)
