"""Lightning callbacks: checks and reports that run beside training."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_shardplus.sharding import PaddedShardSampler, check_epoch_shards


def _dataloaders(loaders: Any) -> Iterator[DataLoader]:
    """The DataLoaders inside what ``trainer.train_dataloader`` returns (a loader, or a list/dict of them)."""
    if isinstance(loaders, DataLoader):
        yield loaders
    elif isinstance(loaders, dict):
        for value in loaders.values():
            yield from _dataloaders(value)
    elif isinstance(loaders, (list, tuple)):
        for value in loaders:
            yield from _dataloaders(value)


class VerifySharding(Callback):
    """At the end of each training epoch, check across ranks that the shards were disjoint and, if the epoch
    ran to its end, covered the whole dataset. Added by ``ShardPlusStrategy(verify_sharding=True)``."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        samplers = [
            dl.sampler for dl in _dataloaders(trainer.train_dataloader) if isinstance(dl.sampler, PaddedShardSampler)
        ]
        for sampler in samplers:
            local = (sampler.yielded_indices[: sampler.num_real_samples], sampler.completed_epoch)
            gathered: list[Any] = [None] * trainer.world_size
            if dist.is_available() and dist.is_initialized():
                dist.all_gather_object(gathered, local)
            else:
                gathered = [local]
            check_epoch_shards(
                trainer.current_epoch,
                [indices for indices, _ in gathered],
                sampler.dataset_length,
                expect_full_coverage=all(done for _, done in gathered) and not sampler.drop_last,
            )
