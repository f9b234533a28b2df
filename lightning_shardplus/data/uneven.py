"""Equal steps on every rank over training streams of different lengths (``uneven_inputs``, docs/uneven-inputs.md):
each rank fetches :data:`AGREEMENT_BLOCK` batches ahead, and one host all_reduce counts, for each of those
micro-batches, the ranks that have one. ``"join"``: a rank that ran out trains on :data:`NO_BATCH` (a zero gradient)
until none has data; ``"drop"``: stop at the first gap."""

from __future__ import annotations

import copy
import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

from lightning_shardplus.data.group import DataParallel
from lightning_shardplus.validation import class_name

UnevenInputs = Literal["join", "drop"]
UNEVEN_INPUTS: tuple[str, ...] = ("join", "drop")

# Micro-batches agreed on in one all_reduce: each rank fetches this many batches ahead, and holds up to 2 more from
# the block being trained. Per micro-batch the decision is the same as agreeing on each alone; the collective, which
# costs host CPU on gloo, runs 1/4 as often.
AGREEMENT_BLOCK = 4


class NoBatch:
    """What a rank without data gets in place of a batch (``"join"``): under DDP the strategy trains on nothing; under
    model parallel, where the forward is itself a collective (FSDP's parameter all-gather), it runs the step on
    ``stand_in`` (a copy of a real batch) and counts what it gives nowhere (zero loss, no logged value)."""

    def __init__(self, stand_in: Any = None) -> None:
        self.stand_in = stand_in

    def __repr__(self) -> str:
        return "NO_BATCH"

    def __iter__(self) -> Iterator[torch.Tensor]:
        # no samples: Lightning infers a batch size of 0 for what a hook logs on this rank (``self.log``'s epoch means)
        yield torch.empty(0)


NO_BATCH = NoBatch()


def is_stream(loader: Any) -> bool:
    """Whether ``loader`` is a stream (its length per rank is not known in advance): a torch ``DataLoader`` over an
    iterable-style dataset, or a loader of another kind that is itself an iterable-style dataset (WebDataset's
    ``WebLoader`` is a pipeline around a ``DataLoader``) or has no length."""
    if isinstance(loader, DataLoader):
        return isinstance(loader.dataset, IterableDataset)
    return isinstance(loader, IterableDataset) or not hasattr(loader, "__len__")


def check_automatic_optimization(policy: str, model: Any) -> None:
    """Refuse a training stream over several data-parallel ranks with manual optimization: shardplus cannot stand in
    for a training step it does not drive (docs/uneven-inputs.md)."""
    if not model.automatic_optimization:
        raise ValueError(
            f"`uneven_inputs`={policy!r} needs automatic optimization for a training stream: {class_name(model)} "
            "sets `automatic_optimization = False`. Give each rank the same number of batches yourself, or use a "
            "map-style dataset."
        )


def training_streams(loaders: Any) -> list[Any]:
    """The streams among the training loaders given to ``fit`` (a loader, or a collection of them; None: none given)."""
    if loaders is None or isinstance(loaders, LightningDataModule):  # (`fit(model, datamodule)` by position)
        return []
    combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders)
    return [loader for loader in combined.flattened if is_stream(loader)]


class AgreedLoader:
    """A training loader whose batches all ranks take together; forwards the loader's attributes."""

    def __init__(self, loader: Iterable, owner: EvenSteps) -> None:
        self.loader, self._owner = loader, owner

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "_owner", "state_dict", "load_state_dict"):
            raise AttributeError(name)  # a loader that cannot resume stays one (Lightning checks these names)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        return self._owner.agreed_batches(iter(self.loader))


class ResumableAgreedLoader(AgreedLoader):
    """An :class:`AgreedLoader` over a loader with ``state_dict`` (litdata's): checkpoints hold every rank's position
    (gathered with one ``all_gather_object`` when rank 0's is saved); each rank loads its own on resume."""

    def __init__(self, loader: Iterable, owner: EvenSteps) -> None:
        super().__init__(loader, owner)
        # (batches fetched, loader state before the next): the loop is up to a block and Lightning's one batch behind
        self._positions: deque[tuple[int, Any]] = deque(maxlen=2 * AGREEMENT_BLOCK + 2)
        self._ran_out_at: int | None = None  # batches fetched when the stream ran out, in this pass
        self._resume_exhausted = False  # the checkpoint was saved after this rank's stream had run out
        self._restored: Any = None  # the state loaded from a checkpoint, until the next pass starts from it

    def __iter__(self) -> Iterator[Any]:
        return self._owner.agreed_batches(self._recorded(iter(self.loader)))

    def _recorded(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """``iterator``, noting (copies of) the loader's state before each fetch: Lightning fetches a batch ahead.
        Before a resumed pass's first fetch the state is the one loaded (litdata would answer the fresh epoch's)."""
        self._positions.clear()
        self._ran_out_at, skip, self._resume_exhausted = None, self._resume_exhausted, False
        restored, self._restored = self._restored, None
        if skip:  # the rest of this pass was empty when the checkpoint was saved
            self._ran_out_at = 0
            # Start the pass all the same (what it yields is discarded): Mosaic Streaming makes every rank of a
            # machine meet in a barrier when a pass starts, and counts the passes.
            next(iterator, None)
            return
        for fetched in itertools.count():
            state = restored if fetched == 0 and restored is not None else copy.deepcopy(self.loader.state_dict())
            self._positions.append((fetched, state))
            try:
                batch = next(iterator)
            except StopIteration:
                self._ran_out_at = fetched
                return
            yield batch

    def _own_state(self) -> dict[str, Any]:
        """This rank's loader state after the batches the loop has taken, and whether its stream had run out."""
        taken = self._owner.batches_taken
        if self._ran_out_at is not None and self._ran_out_at <= taken:
            return {"state": self.loader.state_dict(), "ran_out": True}
        state = next((state for fetched, state in self._positions if fetched == taken), None)
        return {"state": self.loader.state_dict() if state is None else state, "ran_out": False}

    def state_dict(self) -> dict[str, Any]:
        """Every rank's loader state after the batches trained so far, in rank order."""
        states: list[Any] = [None] * self._owner.world_size
        dist.all_gather_object(states, self._own_state(), group=self._owner.group)
        return {PER_RANK_KEY: states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load this rank's state; a checkpoint of another world size restarts the streams with one warning."""
        states = state.get(PER_RANK_KEY) if isinstance(state, dict) else None
        if not isinstance(states, list) or len(states) != self._owner.world_size:
            _warn_restart(states, self._owner.world_size)
            return
        own = states[self._owner.data_parallel.rank]
        self.loader.load_state_dict(own["state"])
        self._resume_exhausted, self._restored = own["ran_out"], copy.deepcopy(own["state"])


PER_RANK_KEY = "shardplus_per_rank"


def _warn_restart(states: Any, ranks: int) -> None:
    """The one warning of a checkpoint whose stream positions (``states``: per rank, or not) are not for ``ranks``."""
    saved = f"{len(states)} ranks" if isinstance(states, list) else "one loader state"
    rank_zero_warn(
        f"shardplus: the checkpoint holds the training streams' positions of {saved}, this run has {ranks}: the "
        "streams start again from the beginning of their epoch."
    )


class OneRankLoader(AgreedLoader):
    """A training stream with a ``state_dict`` on a single rank: nothing to agree on, its state its own; a checkpoint
    of several ranks' positions restarts the stream's epoch with one warning (the loader could not read it)."""

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(state, dict) and PER_RANK_KEY in state:
            _warn_restart(state[PER_RANK_KEY], 1)
            return
        self.loader.load_state_dict(state)


class _Block(NamedTuple):
    """The next batches of this rank's stream (at most :data:`AGREEMENT_BLOCK`; fewer once it ran out) and the
    all_reduce in flight that counts, per micro-batch of the block, the ranks that have one (then, last, the ranks
    that will need a stand-in and have none: model parallel, an empty stream)."""

    batches: list[Any]
    exhausted: bool
    count: torch.Tensor
    work: Any


class EvenSteps:
    """The ``uneven_inputs`` component of one fit (``policy`` ``"join"`` or ``"drop"``) over the ranks of
    ``data_parallel``; the agreement runs on a gloo group beside any other ``backend``; ``on_step_without_data`` is
    called where this rank has no batch. ``keeps_stand_in`` (model parallel): a rank without data gets a
    :class:`NoBatch` holding a batch to run the step on (its last one, or another rank's if its stream was empty)."""

    def __init__(
        self, policy: UnevenInputs, data_parallel: DataParallel, backend: str = "gloo", trainer: Any = None,
        on_step_without_data: Callable[[], None] | None = None, keeps_stand_in: bool = False,
        saves_outside_callbacks: bool = False,
    ) -> None:  # fmt: skip
        self.policy, self.data_parallel, self.backend, self.trainer = policy, data_parallel, backend, trainer
        # checkpoints are saved without a Lightning checkpoint callback (Ray's workers report them: ray.train.report)
        self.saves_outside_callbacks = saves_outside_callbacks
        self.world_size = data_parallel.size  # the ranks that read different samples
        self.keeps_stand_in, self.stand_in = keeps_stand_in, None  # model parallel: the batch a rank without data runs
        self.on_step_without_data = on_step_without_data
        self.group: Any = None  # of the agreement: made when the first stream is wrapped
        self.ranks_with_data: list[int] = []  # per micro-batch of this pass over the stream, in yield order
        self.dropped_samples = 0  # in the last epoch that ended early ("drop"), over all ranks
        self.streams = 0  # loaders wrapped
        self.batches_taken = 0  # by the training loop in the current pass over the stream (see ``batch_taken``)

    def wrap(self, loader: Any) -> Any:
        """``loader`` wrapped if it is a stream (on one rank, if it has a ``state_dict``), else ``loader`` itself."""
        if not is_stream(loader):
            return loader
        resumable = hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")
        if self.world_size < 2:
            return OneRankLoader(loader, self) if resumable else loader
        if self.trainer is not None:  # (the launching process refused a stream given to `fit` already)
            check_automatic_optimization(self.policy, self.trainer.lightning_module)
        self._count_stream()
        if resumable:
            return ResumableAgreedLoader(loader, self)
        if self.trainer is None or self.trainer.checkpoint_callbacks or self.saves_outside_callbacks:
            rank_zero_warn(  # only where a checkpoint can be saved
                "shardplus: the training stream's loader has no `state_dict` (a plain iterable, such as Ray Data's "
                "`iter_torch_batches`): a checkpoint saved mid-epoch resumes at the start of the epoch (litdata's "
                "StreamingDataLoader can resume mid-epoch)."
            )
        return AgreedLoader(loader, self)

    def wrap_evaluation(self, loader: Any) -> Any:
        """An evaluation stream under model parallel (``keeps_stand_in``), where every forward is a collective: all
        ranks take its batches together, a rank that ran out runs stand-ins (``"join"``) until none has data."""
        if self.world_size < 2 or not is_stream(loader):
            return loader
        self._count_stream()
        return AgreedLoader(loader, self)

    def _count_stream(self) -> None:
        if self.streams == 0:  # every rank wraps the same loaders: a collective (on another backend)
            self.group = self.data_parallel.gloo_group(self.backend)
        self.streams += 1

    def check_combination(self, loaders: int) -> None:
        """Refuse a training stream combined with other training loaders: a rank whose stream ran out would still step
        with the others' batches. The same answer on every rank, before the first batch."""
        if self.streams and loaders > 1:
            raise ValueError(
                f"`uneven_inputs`={self.policy!r}: a training stream is combined with {loaders - 1} other training "
                "loader(s) (in any mode of Lightning's CombinedLoader); equal steps on every rank need the stream "
                "alone. Combine the data in one stream (e.g. litdata's `CombinedStreamingDataset`), or use map-style "
                "datasets."
            )

    def batch_taken(self) -> None:
        """The training loop took the next batch (called at every training batch start)."""
        self.batches_taken += 1

    def _fetch_and_agree(self, iterator: Iterator[Any], exhausted: bool) -> _Block:
        """Fetch this rank's next block of batches and start the all_reduce that counts, per micro-batch, the ranks
        that have one (:data:`AGREEMENT_BLOCK` + 1 integers on a host tensor: no device is synchronized)."""
        batches = list(itertools.islice(iterator, AGREEMENT_BLOCK)) if not exhausted else []
        exhausted = exhausted or len(batches) < AGREEMENT_BLOCK
        lacks = self.keeps_stand_in and not batches and self.stand_in is None
        count = torch.tensor([int(j < len(batches)) for j in range(AGREEMENT_BLOCK)] + [int(lacks)], dtype=torch.int32)
        return _Block(batches, exhausted, count, dist.all_reduce(count, group=self.group, async_op=True))

    def agreed_batches(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """The batches of ``iterator``, in steps every rank takes together; every rank decides the same from each
        block's counts. The next block's agreement starts when the last micro-batch of this one is handed out, so
        it runs while that micro-batch trains."""
        self.ranks_with_data, self.batches_taken, self.stand_in = [], 0, None  # a stand-in of this stream's
        block = self._fetch_and_agree(iterator, exhausted=False)
        while True:
            block.work.wait()
            *counts, lacking = block.count.tolist()
            if self.keeps_stand_in and block.batches:
                self.stand_in = block.batches[0]
            if lacking and counts[0] and self.policy == "join":  # ("drop" stops before any rank lacks a batch)
                self._share_stand_in()
            current = block
            for j, with_data in enumerate(counts):
                if self.policy == "drop" and with_data < self.world_size:
                    rest = 0 if current.exhausted else sum(_samples(b) for b in iterator)
                    self._report_dropped(sum(_samples(b) for b in current.batches[j:]) + rest)
                    return
                if with_data == 0:
                    return
                if j < len(current.batches):
                    self.stand_in = current.batches[j] if self.keeps_stand_in else None
                    batch = current.batches[j]
                else:
                    batch = NoBatch(self.stand_in) if self.keeps_stand_in else NO_BATCH
                self.ranks_with_data.append(with_data)
                if j == AGREEMENT_BLOCK - 1:
                    block = self._fetch_and_agree(iterator, current.exhausted)
                yield batch

    def _share_stand_in(self) -> None:
        """Every rank, where a rank without data has no batch to stand in (its stream was empty): the first rank with
        one sends it (two collectives, once per such pass)."""
        has: list[Any] = [None] * self.world_size
        dist.all_gather_object(has, self.stand_in is not None, group=self.group)
        sent, source = [self.stand_in], has.index(True)
        dist.broadcast_object_list(sent, src=self.data_parallel.global_rank(source), group=self.group)
        self.stand_in = sent[0]

    def _report_dropped(self, local: int) -> None:
        """``"drop"``: the samples this rank had left, summed over ranks and logged once for the epoch."""
        count = torch.tensor([local], dtype=torch.int64)
        dist.all_reduce(count, group=self.group)
        self.dropped_samples = int(count.item())
        epoch = None if self.trainer is None else self.trainer.current_epoch
        rank_zero_info(
            f"shardplus: uneven_inputs='drop': epoch {epoch} ended when the shortest stream did; "
            f"{self.dropped_samples} samples of the longer streams were not trained on"
        )
        if self.trainer is not None and self.trainer.is_global_zero:
            for logger in self.trainer.loggers:
                logger.log_metrics({"uneven/dropped_samples": self.dropped_samples}, step=self.trainer.global_step)

    def step_without_data(self) -> None:
        """This rank trains on no data in this micro-batch (``"join"``): what it logs counts nowhere."""
        if self.on_step_without_data is not None:
            self.on_step_without_data()

    def gradient_correction(self, aggregated: int, average: bool) -> float:
        """The factor that turns the synchronized gradient of the window just ended (``aggregated`` micro-batches) into
        the mean over the ranks (and, with ``average``, micro-batches) that had data; 1 while all ranks have data."""
        window = self.ranks_with_data[self.batches_taken - aggregated : self.batches_taken]
        if len(window) != aggregated or all(count == self.world_size for count in window):
            return 1.0
        if average:
            return self.world_size * aggregated / sum(window)
        return self.world_size / window[0]  # ranks run out for good: the window's first micro-batch has the most


def _samples(batch: Any) -> int:
    try:
        return int(extract_batch_size(batch))
    except Exception:  # a batch Lightning cannot size: count it as one sample
        return 1


LITDATA_DROP_LAST_WARNING = "You're operating within a distributed environment and have disabled the `drop_last` option"


def silence_litdata_drop_last_warning() -> Callable[[], None]:
    """Drop litdata's warning that ``StreamingDataset(drop_last=False)`` "may lead to training interruptions" when
    distributed (once per dataset and rank): false here, where training streams take equal steps and exact
    evaluation has no per-batch collective. Returns what puts the warning back (at teardown)."""
    litdata_logger = logging.getLogger("litdata.streaming.dataset")

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LITDATA_DROP_LAST_WARNING)

    litdata_logger.addFilter(keep)
    return lambda: litdata_logger.removeFilter(keep)
