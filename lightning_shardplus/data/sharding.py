"""Which dataset indices each rank reads: padded equal shards for training, exact shards for evaluation, each a share
of one keyed permutation per ``(seed, epoch)`` computed chunk by chunk; no communication here (docs/sharding.md)."""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterator, Sequence, Sized
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Sampler

from lightning_shardplus.data.permutation import _MASK64, MAX_LENGTH, KeyedPermutation, _splitmix64
from lightning_shardplus.validation import check_bool, check_choice, check_int

PaddingMode = Literal["first", "wrap"]
PADDING_MODES: tuple[str, ...] = ("first", "wrap")
CHUNK_SIZE = 65_536
"""Positions permuted at a time while iterating; the first chunks are smaller so the first index comes fast."""
_FIRST_CHUNK_SIZE = 1_024
UP_FRONT_SIZE = 1 << 20
"""A shard of at most this many indices is built as one list of ints before its first index (under 64 MB)."""


def epoch_permutation(length: int, *, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The global order of ``range(length)`` for one epoch as one tensor (for small datasets): the same on every
    rank for the same seed and epoch."""
    positions = np.arange(length, dtype=np.int64)
    return torch.from_numpy(KeyedPermutation(length, seed, epoch).at(positions) if shuffle else positions)


def _chunks(start: int, count: int, step: int) -> Iterator[np.ndarray]:
    """``start, start + step, ...`` (``count`` values) as int64 arrays of at most :data:`CHUNK_SIZE`, growing
    from :data:`_FIRST_CHUNK_SIZE`."""
    done, size = 0, _FIRST_CHUNK_SIZE
    while done < count:
        n = min(size, count - done)
        chunk = np.arange(n, dtype=np.int64)
        if step != 1:
            chunk *= step
        chunk += start + step * done
        yield chunk
        done, size = done + n, min(CHUNK_SIZE, size * 4)


def _dataset_length(dataset_or_length: Sized | int) -> int:
    if isinstance(dataset_or_length, numbers.Integral) and not isinstance(dataset_or_length, bool):
        length = dataset_or_length
    elif isinstance(dataset_or_length, Sized):
        length = len(dataset_or_length)
    else:
        raise TypeError(
            f"`dataset_or_length`={dataset_or_length!r} is not valid: expected a sized dataset or an int >= 0."
        )
    length = check_int("dataset_or_length", length, minimum=0)
    if length > MAX_LENGTH:
        raise ValueError(f"`dataset_or_length`={length} is not valid: expected at most 2**63 - 1.")
    return length


class _ShardSampler(Sampler[int]):
    """What both samplers share: the arguments, the epoch and the epoch's global order."""

    num_samples: int  # the indices :meth:`_index_chunks` yields in all (set by each sampler)

    def __init__(
        self, dataset_or_length: Sized | int, num_replicas: int, rank: int, *, shuffle: bool, seed: int
    ) -> None:
        num_replicas = check_int("num_replicas", num_replicas, minimum=1)
        rank = check_int("rank", rank, minimum=0)
        if rank >= num_replicas:
            raise ValueError(f"`rank`={rank} is not valid: expected 0 <= rank < num_replicas={num_replicas}.")
        check_bool("shuffle", shuffle)
        seed = check_int("seed", seed, minimum=0)
        self.dataset_length = _dataset_length(dataset_or_length)
        self.num_replicas, self.rank, self.shuffle, self.seed, self.epoch = num_replicas, rank, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation the next iteration uses (Lightning calls this every epoch)."""
        self.epoch = epoch

    def _order(self) -> Any:
        """The current epoch's order as a function of a position array (the identity without shuffling)."""
        if not self.shuffle:
            return lambda positions: positions
        return KeyedPermutation(self.dataset_length, self.seed, self.epoch).at

    def _index_chunks(self) -> Iterator[np.ndarray]:
        """This rank's indices for the current epoch, chunk by chunk (int64 arrays)."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        """The indices as Python ints: one list for a shard of at most :data:`UP_FRONT_SIZE`, else each chunk's
        ``memoryview`` (which makes each int as it is read), chained in C."""
        if self.num_samples <= UP_FRONT_SIZE:
            chunks = list(self._index_chunks())
            return iter(np.concatenate(chunks).tolist() if chunks else [])
        return itertools.chain.from_iterable(map(memoryview, self._index_chunks()))


class PaddedShardSampler(_ShardSampler):
    """Training shards of exactly ``ceil(N / num_replicas)`` indices on every rank, reshuffled each epoch: rank ``r``
    reads positions ``r, r + W, r + 2W, ...`` of the epoch's order, so what all ranks consumed after ``k`` steps is a
    prefix of it. Positions past ``N`` are padding: index 0 (``padding="first"``, as Clara Train) or the order's first
    indices again (``"wrap"``, as torch's ``DistributedSampler``); ``drop_last`` drops them."""

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
        self.padding, self.drop_last = padding, drop_last
        # Mid-epoch resume (see `load_state_dict`): the epoch it applies to, the positions of that epoch's order
        # already consumed, and the per-rank samples the resumed epoch counts as done without yielding them.
        self.resumed_epoch: int | None = None
        self.start_position = self.samples_counted_before_start = 0
        self._set_shard_size()
        # Debug aid for `verify_sharding`: what the last iteration yielded, and whether it ran to the end.
        self.record_indices, self.completed_epoch = record_indices, False
        self.yielded_indices: list[int] = []

    def _set_shard_size(self) -> None:
        """``num_samples`` (this rank's indices) and ``total_size`` (all ranks') from ``start_position`` on."""
        remaining, w = self.dataset_length - self.start_position, self.num_replicas
        self.num_samples = remaining // w if self.drop_last else math.ceil(remaining / w)
        self.total_size = self.num_samples * w

    @property
    def num_real_samples(self) -> int:
        """How many of this rank's indices are real samples; the rest, at the end of the shard, are padding."""
        remaining = self.dataset_length - self.start_position
        real_positions = max(0, min(remaining, self.total_size) - self.rank)
        return min(self.num_samples, math.ceil(real_positions / self.num_replicas))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next iteration; any other epoch than a resumed one is read from its start."""
        super().set_epoch(epoch)
        if self.resumed_epoch is not None and epoch != self.resumed_epoch:
            self.resumed_epoch, self.start_position, self.samples_counted_before_start = None, 0, 0
            self._set_shard_size()

    def positions_consumed(self, samples_done: int) -> int:
        """Positions of the epoch's order consumed once every rank trained on ``samples_done`` indices (counted from
        the epoch's start, a resume's included); at most ``N``: padding counts as the end of the epoch."""
        taken = min(max(samples_done - self.samples_counted_before_start, 0), self.num_samples)
        return min(self.start_position + taken * self.num_replicas, self.dataset_length)

    def state_dict(self, samples_done: int = 0) -> dict[str, int]:
        """What resumes this sampler's epoch on any number of ranks, after every rank trained on ``samples_done``
        indices; ``num_replicas`` is informative."""
        consumed, replicas = self.positions_consumed(samples_done), self.num_replicas
        return {"epoch": self.epoch, "seed": self.seed, "positions_consumed": consumed, "num_replicas": replicas}

    def load_state_dict(self, state: dict[str, int], samples_counted: int = 0) -> None:
        """Continue the epoch of ``state`` (from :meth:`state_dict`, at any world size) where it stopped: the
        positions ``c = positions_consumed`` on are split over this sampler's ranks as a whole epoch is (rank ``r``
        reads ``c + r + j * W``, padded at the end), so every remaining sample is read once. ``samples_counted``:
        the per-rank samples the training loop counts as done already, which ``len()`` adds."""
        check_sampler_state(state)
        consumed = int(state["positions_consumed"])
        check_int("samples_counted", samples_counted, minimum=0)
        if consumed > self.dataset_length:
            raise ValueError(
                f"`positions_consumed`={consumed} is not valid for a dataset of {self.dataset_length} samples: "
                "the checkpoint was written for another training set."
            )
        self.seed, self.epoch, self.resumed_epoch = int(state["seed"]), int(state["epoch"]), int(state["epoch"])
        self.start_position, self.samples_counted_before_start = consumed, samples_counted
        self._set_shard_size()

    def _index_chunks(self) -> Iterator[np.ndarray]:
        """Positions ``start + rank + j * W`` of the order, then the padding."""
        n, w, real = self.dataset_length, self.num_replicas, self.num_real_samples
        start = self.start_position + self.rank
        order = self._order()
        for positions in _chunks(start, real, w):
            yield order(positions)
        # Padding positions p >= N, kept as offsets p - N (p itself may pass 2**63 - 1): index 0, or the order's
        # first indices again (offset modulo N, as torch's DistributedSampler repeats its order).
        for offsets in _chunks(start + real * w - n, self.num_samples - real, w):
            yield np.zeros_like(offsets) if self.padding == "first" else order(offsets % n)

    def __iter__(self) -> Iterator[int]:
        return self._recorded() if self.record_indices else super().__iter__()

    def _recorded(self) -> Iterator[int]:
        """The indices, noting each in ``yielded_indices`` and whether the epoch ran to its end."""
        self.yielded_indices, self.completed_epoch = [], False
        for index in super().__iter__():
            self.yielded_indices.append(index)
            yield index
        self.completed_epoch = True

    def __len__(self) -> int:
        """This rank's indices, plus a resumed epoch's ``samples_counted``: the loader's length is the epoch's."""
        return self.samples_counted_before_start + self.num_samples


class ExactShardSampler(_ShardSampler):
    """Evaluation shards without padding: every index exactly once over all ranks, in contiguous blocks that
    differ in size by at most one (empty when ``N < num_replicas``), so rank order is dataset order."""

    def __init__(
        self, dataset_or_length: Sized | int, num_replicas: int, rank: int, *, shuffle: bool = False, seed: int = 0
    ) -> None:
        super().__init__(dataset_or_length, num_replicas, rank, shuffle=shuffle, seed=seed)
        self.start, self.stop = shard_bounds(self.dataset_length, num_replicas, rank)
        self.num_samples = self.stop - self.start

    def _index_chunks(self) -> Iterator[np.ndarray]:
        order = self._order()
        for positions in _chunks(self.start, self.num_samples, 1):
            yield order(positions)

    def __len__(self) -> int:
        return self.num_samples


class PlaceholderShardSampler(Sampler[int]):
    """An empty evaluation shard that reports one batch and yields none: Lightning skips the evaluation loop (and
    its hooks) on a rank whose loaders have zero length, and the other ranks would wait forever at the epoch-end
    reduction."""

    def __iter__(self) -> Iterator[int]:
        return iter(())

    def __len__(self) -> int:
        return 1


def shard_bounds(length: int, num_replicas: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of rank's contiguous block when ``length`` items are split as evenly as possible."""
    base, extra = divmod(length, num_replicas)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


CHECKPOINT_KEY = "shardplus_training_samplers"
"""Where the strategy stores the training samplers' progress in a Lightning checkpoint."""


_STATE_MINIMUMS = {"epoch": 0, "seed": 0, "positions_consumed": 0}


def check_sampler_state(state: Any, name: str = "state") -> None:
    """Refuse a :meth:`PaddedShardSampler.state_dict` that is not one, saying which field is wrong."""
    expected = f"expected a dict with {', '.join(repr(k) for k in _STATE_MINIMUMS)} (integers >= 0)"
    if not isinstance(state, dict):
        raise TypeError(f"`{name}`={state!r} is not valid: {expected}.")
    for key, minimum in _STATE_MINIMUMS.items():
        if key not in state:
            raise ValueError(f"`{name}` has no {key!r}: {expected}.")
        check_int(f"{name}[{key!r}]", state[key], minimum=minimum)
    for key in ("num_replicas", "global_batch_size"):  # informative; absent from older checkpoints
        if key in state:
            check_int(f"{name}[{key!r}]", state[key], minimum=1)


def check_resumed_epoch(state: dict[str, int], epoch: int, dataset_length: int) -> None:
    """Refuse a sampler state for another epoch than the one the fit loop resumes (``epoch``), naming both. An error,
    not a warning: the sampler would start the loop's epoch over while the loop counts the checkpoint's batches as
    done, so as many samples would be trained twice as are skipped. A state read to its end may be behind the loop
    (a checkpoint saved at the end of training): that epoch is over either way."""
    saved, consumed = int(state["epoch"]), int(state["positions_consumed"])
    if saved == epoch or (saved < epoch and consumed >= dataset_length):
        return
    raise ValueError(
        f"shardplus: the checkpoint's training sampler is in epoch {saved} ({consumed} of {dataset_length} samples "
        f"read), but the fit loop resumes epoch {epoch}: resumed, the epoch's first samples would be trained twice "
        f"and its last ones skipped. The checkpoint's {CHECKPOINT_KEY!r} entry was edited or written by another run."
    )


def check_checkpoint_entry(entry: Any) -> None:
    """Refuse a checkpoint entry :func:`checkpoint_entry` did not write, saying what is wrong (an empty list of
    sampler states would silently restart the epoch)."""
    name = f"checkpoint[{CHECKPOINT_KEY!r}]"
    if not isinstance(entry, dict):
        raise TypeError(f"`{name}`={entry!r} is not valid: expected a dict with 'batches_done' and 'samplers'.")
    for key in ("batches_done", "samplers"):
        if key not in entry:
            raise ValueError(f"`{name}` has no {key!r}: expected a dict with 'batches_done' and 'samplers'.")
    check_int(f"{name}['batches_done']", entry["batches_done"], minimum=0)
    samplers = entry["samplers"]
    expected = "expected a list of one state per training loader (None for a loader without a batch size)"
    if not isinstance(samplers, (list, tuple)):
        raise TypeError(f"`{name}['samplers']`={samplers!r} is not valid: {expected}.")
    if not samplers:
        raise ValueError(f"`{name}['samplers']`={samplers!r} is not valid: {expected}, at least one.")
    for i, state in enumerate(samplers):
        if state is not None:
            check_sampler_state(state, f"{name}['samplers'][{i}]")


def checkpoint_entry(
    batches_done: int, samplers_and_batch_sizes: Sequence[tuple[PaddedShardSampler, int | None]]
) -> dict:
    """The training samplers' progress after ``batches_done`` batches of the epoch: the same on every rank. A
    loader of unknown batch size gets None (its epoch restarts on resume), keeping the states in loader order."""
    return {
        "batches_done": batches_done,
        "samplers": [
            None if batch_size is None else _state_with_batch(sampler, batches_done, batch_size)
            for sampler, batch_size in samplers_and_batch_sizes
        ],
    }


def _state_with_batch(sampler: PaddedShardSampler, batches_done: int, batch_size: int) -> dict[str, int]:
    """The sampler's state after ``batches_done`` batches, with the global batch it was trained with."""
    return {**sampler.state_dict(batches_done * batch_size), "global_batch_size": batch_size * sampler.num_replicas}


class ShardingError(RuntimeError):
    """The indices the ranks iterated in one epoch overlapped or missed part of the dataset."""


def check_epoch_shards(
    epoch: int, real_indices_per_rank: Sequence[Sequence[int]], dataset_length: int, *, expect_full_coverage: bool
) -> None:
    """Raise :class:`ShardingError` if two ranks read the same real sample, or (``expect_full_coverage``) if
    some sample was read by no rank."""
    owner: dict[int, int] = {}
    for rank, indices in enumerate(real_indices_per_rank):
        for index in indices:
            if index in owner:
                twice = f"rank {rank} read sample {index} twice outside padding"
                both = f"ranks {owner[index]} and {rank} both read sample {index}: training shards are not disjoint"
                raise ShardingError(f"verify_sharding: in epoch {epoch}, {twice if owner[index] == rank else both}.")
            owner[index] = rank
    if expect_full_coverage and len(owner) != dataset_length:
        missing = sorted(set(range(dataset_length)) - owner.keys())
        raise ShardingError(
            f"verify_sharding: in epoch {epoch}, ranks 0..{len(real_indices_per_rank) - 1} together read "
            f"{len(owner)} of {dataset_length} samples; missing for example {missing[:10]}."
        )


# ---------------------------------------------------------------------- verify_sharding's fixed-size digest

DIGEST_PRIME = (1 << 61) - 1
"""The hashed lanes are sums modulo this Mersenne prime."""
_DIGEST_KEYS = (0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0)  # one keyed hash per lane
_HALF = 31  # each lane travels as two int64 halves of 31 bits: their sums over 2**32 ranks fit in an int64
_COUNTS = 3  # real samples read, "ran to the end" and "read past the dataset or another world size"
DIGEST_WIDTH = _COUNTS + 2 * (len(_DIGEST_KEYS) + 1)


def _mix(values: Any, key: int) -> Any:
    """splitmix64 of ``values ^ key`` (numpy uint64 array, wrapping), reduced modulo :data:`DIGEST_PRIME`."""
    z = values ^ np.uint64(key)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) % np.uint64(DIGEST_PRIME)


def _hash_lanes(chunks: Iterator[np.ndarray]) -> list[int]:
    """Per key, the sum modulo :data:`DIGEST_PRIME` of the keyed hash of every index: the same for any order of
    the same multiset of indices."""
    sums = [0] * len(_DIGEST_KEYS)
    for chunk in chunks:
        values = np.asarray(chunk, dtype=np.int64).view(np.uint64)
        for lane, key in enumerate(_DIGEST_KEYS):
            hashed = _mix(values, key)  # < 2**61: the 32-bit halves sum without overflow over 2**32 values
            high, low = int((hashed >> np.uint64(32)).sum()), int((hashed & np.uint64(0xFFFFFFFF)).sum())
            sums[lane] = (sums[lane] + (high << 32) + low) % DIGEST_PRIME
    return sums


def _config_hash(*fields: int) -> int:
    z = 0
    for field in fields:
        z = _splitmix64(z ^ (int(field) & _MASK64))[1]
    return z % DIGEST_PRIME


def shard_digest(sampler: PaddedShardSampler, rank: int, world_size: int) -> list[int]:
    """:data:`DIGEST_WIDTH` integers saying what ``sampler`` (with ``record_indices``) read this epoch, to be summed
    over the ranks and read by :func:`digest_problem` (layout and reasoning: docs/sharding.md). Hashed lanes hold
    ``hash(read) - hash(expected)``, expected being what process ``rank`` of the group should have read."""
    real = sampler.yielded_indices[: sampler.num_real_samples]
    n, start, k = sampler.dataset_length, sampler.start_position, len(real)
    misfit = sampler.num_replicas != world_size or (k > 0 and start + rank + (k - 1) * world_size >= n)
    read = (np.asarray(real[i : i + CHUNK_SIZE], dtype=np.int64) for i in range(0, k, CHUNK_SIZE))
    observed = _hash_lanes(read)
    expected = [0] * len(_DIGEST_KEYS)
    if not misfit:
        order = sampler._order()  # the epoch's order at the positions process `rank` should have read
        expected = _hash_lanes(order(positions) for positions in _chunks(start + rank, k, world_size))
    config = _config_hash(n, start, sampler.seed, sampler.epoch, sampler.shuffle, sampler.drop_last, world_size)
    lanes = [(o - e) % DIGEST_PRIME for o, e in zip(observed, expected, strict=True)] + [config]
    digest = [k, int(sampler.completed_epoch), int(misfit)]
    for value in lanes:
        digest += [value >> _HALF, value & ((1 << _HALF) - 1)]
    return digest


def digest_problem(
    total: Sequence[int], own: Sequence[int], sampler: PaddedShardSampler, world_size: int
) -> str | None:
    """What is wrong with the ranks' shards, from ``total`` (the sum of the digests) and this rank's ``own``; None
    when they read disjoint shards, each its own positions, and a finished epoch covered what it had left."""
    count, completed, misfits = total[:_COUNTS]
    lanes = [((total[i] << _HALF) + total[i + 1]) % DIGEST_PRIME for i in range(_COUNTS, DIGEST_WIDTH, 2)]
    config = (own[-2] << _HALF) + own[-1]
    if lanes[-1] != world_size * config % DIGEST_PRIME:
        return "the ranks disagree on the epoch's order (seed, epoch, resume position, dataset length or world size)"
    if misfits or any(lanes[:-1]):
        return (
            f"the samples ranks 0..{world_size - 1} read are not each rank's own positions of the epoch's order: "
            "shards overlap, or a rank read another's samples"
        )
    left = sampler.dataset_length - sampler.start_position
    expected = left // world_size * world_size if sampler.drop_last else left
    if completed == world_size and count != expected:
        return f"ranks 0..{world_size - 1} together read {count} of the {expected} samples of the epoch"
    return None
