"""DataModules whose user sets the *global* batch size; the per-device batch is derived from the world size."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from lightning_shardplus.data.group import data_parallel_size
from lightning_shardplus.validation import check_bool, check_int

_STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


def check_map_style(name: str, dataset: Any) -> None:
    """Refuse a dataset the samplers cannot shard (a stream, or without ``__len__`` and ``__getitem__``)."""
    if dataset is None:
        return
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        stream = isinstance(dataset, IterableDataset)
        kind = "an IterableDataset (a stream)" if stream else f"a {type(dataset).__name__}"
        raise ValueError(
            f"`{name}` is {kind}: ShardPlusDataModule shards map-style datasets (with __len__ and __getitem__). Give a "
            "stream to the Trainer as a DataLoader instead (`trainer.fit(model, train_dataloaders=...)` or your own "
            "datamodule); the strategy's `uneven_inputs` keeps the ranks in step over it (docs/uneven-inputs.md)."
        )


def per_device_batch_size(global_batch_size: int, world_size: int) -> int:
    """``global_batch_size // world_size``, as Determined does; an error if that is zero."""
    global_batch_size = check_int("global_batch_size", global_batch_size, minimum=1)
    world_size = check_int("world_size", world_size, minimum=1)
    if global_batch_size < world_size:
        raise ValueError(
            f"`global_batch_size`={global_batch_size} is smaller than the data-parallel size ({world_size} processes "
            f"that read different samples): each needs at least one sample per step, so use global_batch_size >= "
            f"{world_size}."
        )
    return global_batch_size // world_size


class ShardPlusDataModule(pl.LightningDataModule):
    """Map-style datasets in (or ``build_*_dataset`` overridden), loaders out, each with ``global_batch_size //
    world_size`` samples per batch; the loader arguments go to every DataLoader. The arguments: docs/batch-size.md."""

    def __init__(
        self,
        global_batch_size: int,
        train_dataset: Dataset | None = None,
        val_dataset: Dataset | None = None,
        test_dataset: Dataset | None = None,
        predict_dataset: Dataset | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
    ) -> None:
        global_batch_size = check_int("global_batch_size", global_batch_size, minimum=1)
        num_workers = check_int("num_workers", num_workers, minimum=0)
        check_bool("pin_memory", pin_memory)
        check_bool("persistent_workers", persistent_workers)
        check_bool("shuffle", shuffle)
        if collate_fn is not None and not callable(collate_fn):
            raise ValueError(f"`collate_fn`={collate_fn!r} is not valid: expected a callable or None.")
        given = {"train": train_dataset, "val": val_dataset, "test": test_dataset, "predict": predict_dataset}
        for split, dataset in given.items():
            check_map_style(f"{split}_dataset", dataset)
        self._trainer: pl.Trainer | None = None
        super().__init__()
        self.global_batch_size, self.num_workers, self.pin_memory = global_batch_size, num_workers, pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0
        self.collate_fn, self.shuffle = collate_fn, shuffle
        self._given = given
        self.datasets: dict[str, Dataset | None] = {}
        self.world_size = 1
        self._warned_uneven: tuple[int, int] | None = None  # (global batch, world size) warned about

    # The trainer is attached before any process group starts: check the batch against the world size then.
    @property
    def trainer(self) -> pl.Trainer | None:
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: pl.Trainer | None) -> None:
        self._trainer = trainer
        if trainer is not None:
            self.world_size = data_parallel_size(trainer)  # tensor-parallel peers read the same batch
            per_device_batch_size(self.global_batch_size, self.world_size)  # raises on a bad combination
            uneven = (self.global_batch_size, self.world_size)
            # once: with the fork launcher each worker attaches the copy of a datamodule that warned already
            if self.effective_global_batch_size != self.global_batch_size and self._warned_uneven != uneven:
                self._warned_uneven = uneven
                rank_zero_warn(
                    f"global_batch_size={self.global_batch_size} is not divisible by the data-parallel size "
                    f"({self.world_size}): each data-parallel process uses {self.per_device_batch_size} samples per "
                    f"step, so the effective global batch is {self.effective_global_batch_size}."
                )

    @property
    def per_device_batch_size(self) -> int:
        """Samples per step on each process: ``global_batch_size // world_size``."""
        return per_device_batch_size(self.global_batch_size, self.world_size)

    @property
    def effective_global_batch_size(self) -> int:
        """Samples per step over all processes: ``per_device_batch_size * world_size``."""
        return self.per_device_batch_size * self.world_size

    def build_train_dataset(self) -> Dataset | None:
        return self._given["train"]

    def build_val_dataset(self) -> Dataset | None:
        return self._given["val"]

    def build_test_dataset(self) -> Dataset | None:
        return self._given["test"]

    def build_predict_dataset(self) -> Dataset | None:
        return self._given["predict"]

    def setup(self, stage: str) -> None:
        for split in _STAGE_SPLITS.get(stage, ()):
            if split not in self.datasets:
                dataset = getattr(self, f"build_{split}_dataset")()
                check_map_style(f"build_{split}_dataset()", dataset)
                self.datasets[split] = dataset
        if stage == "fit":
            train = self.datasets["train"]
            if train is None:
                raise ValueError(f"{type(self).__name__} has no training dataset: pass `train_dataset` or "
                                 "override `build_train_dataset`.")
            if len(train) == 0:  # type: ignore[arg-type]
                raise ValueError("`train_dataset` is empty (len 0): give it at least one sample.")

    def _loader(self, split: str, shuffle: bool) -> DataLoader | list:
        dataset = self.datasets.get(split)
        if dataset is None:
            return []
        return DataLoader(
            dataset, batch_size=self.per_device_batch_size, shuffle=shuffle, num_workers=self.num_workers,
            pin_memory=self.pin_memory, persistent_workers=self.persistent_workers, collate_fn=self.collate_fn,
        )  # fmt: skip

    def train_dataloader(self) -> DataLoader | list:
        return self._loader("train", self.shuffle)

    def val_dataloader(self) -> DataLoader | list:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader | list:
        return self._loader("test", False)

    def predict_dataloader(self) -> DataLoader | list:
        return self._loader("predict", False)


class SyntheticDataModule(ShardPlusDataModule):
    """Random inputs of ``input_shape`` with learnable labels (a fixed random linear rule), the same from ``seed``
    on every process and run: for benchmarks and smoke tests, no download, no disk."""

    def __init__(
        self,
        global_batch_size: int = 64,
        num_samples: int = 2048,
        val_samples: int = 512,
        input_shape: Sequence[int] = (32,),
        num_classes: int = 10,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        num_samples = check_int("num_samples", num_samples, minimum=1)
        val_samples = check_int("val_samples", val_samples, minimum=0)
        num_classes = check_int("num_classes", num_classes, minimum=2)
        seed = check_int("seed", seed, minimum=0)
        a_sequence = isinstance(input_shape, Sequence) and not isinstance(input_shape, str) and bool(input_shape)
        if not a_sequence or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in input_shape):
            raise ValueError(f"`input_shape`={input_shape!r} is not valid: expected a sequence of integers >= 1.")
        super().__init__(global_batch_size, num_workers=num_workers)
        self.num_samples, self.val_samples, self.input_shape = num_samples, val_samples, tuple(input_shape)
        self.num_classes, self.seed = num_classes, seed
        generator = torch.Generator().manual_seed(seed)
        features = int(torch.tensor(self.input_shape).prod())
        self._rule = torch.randn(features, num_classes, generator=generator)

    def _make(self, count: int, offset: int) -> TensorDataset:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + offset)
        inputs = torch.randn(count, *self.input_shape, generator=generator)
        return TensorDataset(inputs, (inputs.reshape(count, -1) @ self._rule).argmax(dim=1))

    def build_train_dataset(self) -> Dataset:
        return self._make(self.num_samples, 1)

    def build_val_dataset(self) -> Dataset | None:
        return self._make(self.val_samples, 2) if self.val_samples else None

    def build_test_dataset(self) -> Dataset | None:
        return self.build_val_dataset()

    def build_predict_dataset(self) -> Dataset | None:
        return self.build_val_dataset()
