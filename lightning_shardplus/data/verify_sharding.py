"""``verify_sharding``: the cross-rank check, at each training epoch end, that the shards were disjoint and
complete; the digest it sends and its reading are the samplers' (``sharding.shard_digest``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_shardplus.data.aggregation import dataloaders
from lightning_shardplus.data.group import DataParallel, data_parallel
from lightning_shardplus.data.sharding import (
    DIGEST_WIDTH,
    PaddedShardSampler,
    ShardingError,
    check_epoch_shards,
    digest_problem,
    shard_digest,
)


class VerifySharding(Callback):
    """At the end of each training epoch, check across ranks that the shards were disjoint, each rank read its own
    positions of the epoch's order and a finished epoch covered every sample left in it: one all-reduce of
    fixed-size digests; the index lists are gathered only when they disagree, to name the ranks and a sample.
    Added by ``ShardPlusStrategy(verify_sharding=True)``; rank 0 says in one line what was checked at the end."""

    def __init__(self) -> None:
        self.epochs_checked = 0  # in this fit
        self.epochs_complete = 0  # of them, run to their end on every rank: coverage checked too

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs_checked = self.epochs_complete = 0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank_zero_info(f"shardplus: verify_sharding {_outcome(self.epochs_checked, self.epochs_complete)}")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = dataloaders(trainer.train_dataloader)
        samplers = [dl.sampler for dl in loaders if isinstance(dl.sampler, PaddedShardSampler)]
        if not samplers:
            return
        # the data-parallel rank: the one a rank should have read for, whatever its sampler was told
        dp = data_parallel(trainer.strategy)
        world = dp.size
        own = [shard_digest(sampler, dp.rank, world) for sampler in samplers]
        total = torch.tensor([value for digest in own for value in digest], dtype=torch.int64, device=pl_module.device)
        if world > 1:
            dist.all_reduce(total, group=dp.group)
        totals = total.tolist()
        sums = [totals[i * DIGEST_WIDTH : (i + 1) * DIGEST_WIDTH] for i in range(len(samplers))]
        for i, sampler in enumerate(samplers):
            if (problem := digest_problem(sums[i], own[i], sampler, world)) is not None:
                _name_the_ranks(trainer.current_epoch, sampler, dp, problem)
        self.epochs_checked += 1
        self.epochs_complete += all(summed[1] == world for summed in sums)  # every rank ran the epoch to its end


def _outcome(checked: int, complete: int) -> str:
    """What the fit's checks found, all of them having passed."""
    if not checked:
        return "checked no epoch: no training epoch that read through a PaddedShardSampler ended"
    epochs = f"checked {checked} epoch{'s' if checked > 1 else ''}"
    if complete == checked:
        return f"{epochs}: shards disjoint and complete"
    return f"{epochs}: shards disjoint; complete in {complete} (the others ended early: their coverage is not checked)"


def _name_the_ranks(epoch: int, sampler: PaddedShardSampler, dp: DataParallel, problem: str) -> None:
    """After the digests disagreed (on every rank): gather the index lists to name the ranks and a sample, else
    raise the digest's finding."""
    local = (sampler.yielded_indices[: sampler.num_real_samples], sampler.completed_epoch)
    gathered: list[Any] = [local]
    if dp.size > 1:
        gathered = [None] * dp.size
        dist.all_gather_object(gathered, local, group=dp.group)
    # a resumed epoch read only what the checkpoint had left
    whole = all(done for _, done in gathered) and not sampler.drop_last and sampler.start_position == 0
    check_epoch_shards(epoch, [indices for indices, _ in gathered], sampler.dataset_length, expect_full_coverage=whole)
    raise ShardingError(f"verify_sharding: in epoch {epoch}, {problem}.")
