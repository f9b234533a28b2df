"""``verify_sharding``: the cross-rank check, at each training epoch end, that the shards were disjoint and
complete (:class:`VerifySharding`, added by ``ShardPlusStrategy(verify_sharding=True)``); the digest it sends
and its reading are the samplers' (``sharding.shard_digest``, ``sharding.digest_problem``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_shardplus.aggregation import dataloaders
from lightning_shardplus.sharding import (
    DIGEST_WIDTH,
    PaddedShardSampler,
    ShardingError,
    check_epoch_shards,
    digest_problem,
    shard_digest,
)


class VerifySharding(Callback):
    """At the end of each training epoch, check across ranks that the shards were disjoint, each rank read its own
    positions of the epoch's order and, if the epoch ran to its end, covered every sample left in it. Added by
    ``ShardPlusStrategy(verify_sharding=True)``.

    Each rank sends a fixed-size digest (:func:`~lightning_shardplus.sharding.shard_digest`: counts and keyed
    hash sums), all samplers in one all-reduce, whatever the dataset's length. Only when the digests disagree are
    the index lists gathered, to name the ranks and a sample."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        samplers = [
            dl.sampler for dl in dataloaders(trainer.train_dataloader) if isinstance(dl.sampler, PaddedShardSampler)
        ]
        if not samplers:
            return
        distributed = dist.is_available() and dist.is_initialized()
        # the process group's rank: the one a rank should have read for, whatever its sampler was told
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        own = [shard_digest(sampler, rank, world) for sampler in samplers]
        total = torch.tensor([value for digest in own for value in digest], dtype=torch.int64, device=pl_module.device)
        if distributed:
            dist.all_reduce(total)
        totals = total.tolist()
        for i, sampler in enumerate(samplers):
            problem = digest_problem(totals[i * DIGEST_WIDTH : (i + 1) * DIGEST_WIDTH], own[i], sampler, world)
            if problem is not None:
                _name_the_ranks(trainer.current_epoch, sampler, world, distributed, problem)


def _name_the_ranks(epoch: int, sampler: PaddedShardSampler, world: int, distributed: bool, problem: str) -> None:
    """The second pass, after the digests disagreed (every rank takes it): gather the index lists to name the
    ranks and a sample (:func:`~lightning_shardplus.sharding.check_epoch_shards`), else raise the digest's
    finding."""
    local = (sampler.yielded_indices[: sampler.num_real_samples], sampler.completed_epoch)
    gathered: list[Any] = [None] * world
    if distributed:
        dist.all_gather_object(gathered, local)
    else:
        gathered = [local]
    check_epoch_shards(
        epoch,
        [indices for indices, _ in gathered],
        sampler.dataset_length,
        # a resumed epoch read only what the checkpoint had left
        expect_full_coverage=all(done for _, done in gathered)
        and not sampler.drop_last
        and sampler.start_position == 0,
    )
    raise ShardingError(f"verify_sharding: in epoch {epoch}, {problem}.")
