"""Which dataset indices each rank reads: padded equal shards for training, exact shards for evaluation.

Both samplers draw their order from :func:`epoch_permutation`, one global permutation per epoch that every
rank computes identically from ``(seed, epoch)``; a rank then takes its share of that order. Nothing here
communicates or imports Lightning, so every property can be checked in one process.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence, Sized
from typing import Literal

import torch
from torch.utils.data import Sampler

from lightning_shardplus._validation import check_bool, check_choice, check_int

PaddingMode = Literal["first", "wrap"]
PADDING_MODES: tuple[str, ...] = ("first", "wrap")


def epoch_permutation(length: int, *, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The global order of ``range(length)`` for one epoch: the same on every rank for the same seed and epoch.

    Kept in one function so that a constant-memory bijection can replace it without touching the samplers.
    """
    if not shuffle:
        return torch.arange(length, dtype=torch.int64)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(length, generator=generator)


def _dataset_length(dataset_or_length: Sized | int) -> int:
    if isinstance(dataset_or_length, int) and not isinstance(dataset_or_length, bool):
        length = dataset_or_length
    elif isinstance(dataset_or_length, Sized):
        length = len(dataset_or_length)
    else:
        raise TypeError(
            f"`dataset_or_length`={dataset_or_length!r} is not valid: expected a sized dataset or an int >= 0."
        )
    check_int("dataset_or_length", length, minimum=0)
    return length


class _ShardSampler(Sampler[int]):
    """What both samplers share: the arguments, the epoch and the epoch's global order."""

    def __init__(
        self, dataset_or_length: Sized | int, num_replicas: int, rank: int, *, shuffle: bool, seed: int
    ) -> None:
        check_int("num_replicas", num_replicas, minimum=1)
        check_int("rank", rank, minimum=0)
        if rank >= num_replicas:
            raise ValueError(f"`rank`={rank} is not valid: expected 0 <= rank < num_replicas={num_replicas}.")
        check_bool("shuffle", shuffle)
        check_int("seed", seed, minimum=0)
        self.dataset_length = _dataset_length(dataset_or_length)
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation the next iteration uses (Lightning calls this every epoch)."""
        self.epoch = epoch

    def _global_order(self) -> torch.Tensor:
        return epoch_permutation(self.dataset_length, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)


class PaddedShardSampler(_ShardSampler):
    """Training shards of exactly ``ceil(N / num_replicas)`` indices on every rank, reshuffled each epoch.

    Rank ``r`` reads positions ``r, r + W, r + 2W, ...`` of the epoch's global order (``W`` = num_replicas), so
    the samples consumed after ``k`` steps are a prefix of that order on every rank. Positions past ``N`` are
    padding: index 0 of the dataset with ``padding="first"`` (as NVIDIA Clara Train), or the order's first
    indices again with ``padding="wrap"`` (as torch's ``DistributedSampler``). ``drop_last=True`` drops the tail
    instead, giving ``N // W`` indices per rank.
    """

    def __init__(
        self,
        dataset_or_length: Sized | int,
        num_replicas: int,
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        padding: PaddingMode = "first",
        drop_last: bool = False,
        record_indices: bool = False,
    ) -> None:
        super().__init__(dataset_or_length, num_replicas, rank, shuffle=shuffle, seed=seed)
        check_choice("padding", padding, PADDING_MODES)
        check_bool("drop_last", drop_last)
        self.padding = padding
        self.drop_last = drop_last
        n, w = self.dataset_length, num_replicas
        self.num_samples = n // w if drop_last else math.ceil(n / w)
        self.total_size = self.num_samples * w
        # Debug aid for `verify_sharding`: what the last iteration yielded, and whether it ran to the end.
        self.record_indices = record_indices
        self.yielded_indices: list[int] = []
        self.completed_epoch = False

    @property
    def num_real_samples(self) -> int:
        """How many of this rank's indices are real samples; the rest, at the end of the shard, are padding."""
        real_positions = max(0, min(self.dataset_length, self.total_size) - self.rank)
        return min(self.num_samples, math.ceil(real_positions / self.num_replicas))

    def shard_indices(self) -> torch.Tensor:
        """This rank's indices for the current epoch, padding included."""
        order = self._global_order()
        pad = self.total_size - self.dataset_length
        if pad < 0:
            order = order[: self.total_size]
        elif pad > 0:
            if self.padding == "first":
                filler = torch.zeros(pad, dtype=order.dtype)
            else:
                filler = order.repeat(math.ceil(pad / self.dataset_length))[:pad]
            order = torch.cat([order, filler])
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        indices = self.shard_indices().tolist()
        if not self.record_indices:
            yield from indices
            return
        self.yielded_indices, self.completed_epoch = [], False
        for index in indices:
            self.yielded_indices.append(index)
            yield index
        self.completed_epoch = True

    def __len__(self) -> int:
        return self.num_samples


class ExactShardSampler(_ShardSampler):
    """Evaluation shards without padding: every index exactly once over all ranks.

    Rank ``r`` reads one contiguous block of the order; block sizes differ by at most one, and a rank gets an
    empty block when ``N < num_replicas``. Contiguous blocks make the concatenation of all ranks' outputs, in
    rank order, the dataset order (with ``shuffle=False``).
    """

    def __init__(
        self,
        dataset_or_length: Sized | int,
        num_replicas: int,
        rank: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(dataset_or_length, num_replicas, rank, shuffle=shuffle, seed=seed)
        self.start, self.stop = shard_bounds(self.dataset_length, num_replicas, rank)

    def shard_indices(self) -> torch.Tensor:
        return self._global_order()[self.start : self.stop]

    def __iter__(self) -> Iterator[int]:
        yield from self.shard_indices().tolist()

    def __len__(self) -> int:
        return self.stop - self.start


class PlaceholderShardSampler(Sampler[int]):
    """An empty evaluation shard that reports one batch and yields none.

    Lightning skips the evaluation loop on a rank whose loaders have zero length, hooks included; the ranks
    that do evaluate would then wait forever in the epoch-end reduction. Reporting one batch makes this rank run
    the loop (no step, since nothing is yielded) and join that reduction.
    """

    def __iter__(self) -> Iterator[int]:
        return iter(())

    def __len__(self) -> int:
        return 1


def shard_bounds(length: int, num_replicas: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of rank's contiguous block when ``length`` items are split as evenly as possible."""
    base, extra = divmod(length, num_replicas)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class ShardingError(RuntimeError):
    """The indices the ranks iterated in one epoch overlapped or missed part of the dataset."""


def check_epoch_shards(
    epoch: int,
    real_indices_per_rank: Sequence[Sequence[int]],
    dataset_length: int,
    *,
    expect_full_coverage: bool,
) -> None:
    """Raise :class:`ShardingError` if two ranks read the same real (non-padding) sample, or, when the epoch
    ran to its end, if some sample was read by no rank."""
    owner: dict[int, int] = {}
    for rank, indices in enumerate(real_indices_per_rank):
        for index in indices:
            if index in owner and owner[index] != rank:
                raise ShardingError(
                    f"verify_sharding: in epoch {epoch}, ranks {owner[index]} and {rank} both read sample {index}: "
                    "training shards are not disjoint."
                )
            if index in owner:
                raise ShardingError(
                    f"verify_sharding: in epoch {epoch}, rank {rank} read sample {index} twice outside padding."
                )
            owner[index] = rank
    if expect_full_coverage and len(owner) != dataset_length:
        missing = sorted(set(range(dataset_length)) - owner.keys())
        raise ShardingError(
            f"verify_sharding: in epoch {epoch}, ranks 0..{len(real_indices_per_rank) - 1} together read "
            f"{len(owner)} of {dataset_length} samples; missing for example {missing[:10]}."
        )
