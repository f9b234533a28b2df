"""``ShardedLoaders``: the shardplus samplers in place of the ``DistributedSampler`` Lightning injects (padded
shards for training, exact ones for evaluation), and the training samplers' progress in checkpoints so that a
resumed run reads exactly the samples that were next. Loaders the user sharded, and streams, pass through."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch.distributed
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler

from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus._compat import warnings as false_warnings
from lightning_shardplus._compat.changes import Change, RunChanges
from lightning_shardplus.data import aggregation
from lightning_shardplus.data.group import DataParallel
from lightning_shardplus.data.sharding import (
    CHECKPOINT_KEY,
    ExactShardSampler,
    PaddedShardSampler,
    PaddingMode,
    PlaceholderShardSampler,
    check_checkpoint_entry,
    check_resumed_epoch,
    checkpoint_entry,
)
from lightning_shardplus.data.uneven import NoBatch

EVALUATION_STAGES = (
    RunningStage.VALIDATING, RunningStage.SANITY_CHECKING, RunningStage.TESTING, RunningStage.PREDICTING
)  # fmt: skip


class ShardedLoaders:
    """Samplers for one Trainer run on ``num_replicas`` data-parallel ranks (``shuffle=False``: a
    ``ShardPlusDataModule(shuffle=False)``; ``equal_batches``: exact evaluation shards padded with stand-in batches
    to the longest one's batches, :class:`EqualBatches`); built by the strategy's ``setup``, dropped at teardown."""

    def __init__(
        self, trainer: pl.Trainer, num_replicas: int, rank: int, *, padding: PaddingMode, seed: int, shuffle: bool,
        exact_evaluation: bool, record_indices: bool, changes: RunChanges, equal_batches: bool = False,
    ) -> None:  # fmt: skip
        self.trainer, self.num_replicas, self.rank, self.equal_batches = trainer, num_replicas, rank, equal_batches
        self.padding, self.seed, self.shuffle = padding, seed, shuffle
        self.exact_evaluation, self.record_indices = exact_evaluation, record_indices
        self._resumed: dict[str, Any] | None = None  # a checkpoint's sampler progress, until the loaders are built
        self._resumed_used = 0  # how many of its sampler states were given to samplers so far
        self._resumed_exactly = 0  # training samplers that continue the checkpoint's epoch
        self._without_state = 0  # training samplers that start their epoch at its beginning: no checkpoint state
        self._first_batch_starts_epoch = False  # from `training_loaders_built` to the first training batch
        self._changes, self._resume_warning_silenced = changes, False
        if exact_evaluation and num_replicas > 1:  # until the run ends
            # Lightning warns that its evaluation sampler replicates samples: not so with exact shards
            changes.apply(Change.WARNING_FILTERS, false_warnings.silence_evaluation_sampler_warning())

    def injection_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The arguments of the sampler Lightning injects. For prediction with exact shards, one replica: Lightning's
        prediction sampler asserts that every rank gets a sample, and :meth:`process` shards the loader anyway."""
        if self.exact_evaluation and self.num_replicas > 1 and self.trainer.state.stage == RunningStage.PREDICTING:
            return {**kwargs, "num_replicas": 1, "rank": 0}
        return kwargs

    def process(self, dataloader: Any) -> Any:
        """``dataloader`` with a shardplus sampler where Lightning injected its ``DistributedSampler``."""
        if not isinstance(dataloader, DataLoader):
            return dataloader
        sampler = _lightning.effective_sampler(dataloader)
        if not _lightning.is_injected(sampler):
            if isinstance(sampler, DistributedSampler):
                rank_zero_warn(
                    "shardplus: a DataLoader already has a DistributedSampler; it is left alone, so padded equal "
                    "shards and exact evaluation do not apply to it. Pass a plain DataLoader to get them."
                )
            elif (
                self.exact_evaluation
                and self.num_replicas > 1
                and self.trainer.state.stage in EVALUATION_STAGES
                and not isinstance(dataloader.dataset, IterableDataset)
            ):  # fmt: skip (streams shard themselves)
                rank_zero_warn(
                    "shardplus: an evaluation DataLoader is not sharded (`Trainer(use_distributed_sampler=False)`): "
                    "exact evaluation still sums its logged values over the ranks and gathers its predictions, which "
                    "counts each sample once only if your loaders split the data between the ranks. If every rank "
                    "reads the whole dataset, pass `exact_evaluation=False`."
                )
            return dataloader
        stage = self.trainer.state.stage
        if not _lightning.injected_over_dataset_order(sampler):
            if stage == RunningStage.PREDICTING and sampler.num_replicas != self.num_replicas:
                # injected over one replica (`injection_kwargs`): Lightning's sharding of the user's sampler
                sampler = _lightning.unrepeated_sampler(sampler, self.num_replicas, self.rank)
                dataloader = _lightning.replace_sampler(dataloader, sampler, stage)
            rank_zero_warn(
                "shardplus: a DataLoader has a custom sampler; Lightning's DistributedSamplerWrapper shards "
                "it, and padded equal shards and exact evaluation do not apply to it."
            )
            return dataloader
        if stage == RunningStage.TRAINING:
            return _lightning.replace_sampler(dataloader, self._training_sampler(dataloader, sampler), stage)
        if stage in EVALUATION_STAGES and self.exact_evaluation:
            exact: Sampler = ExactShardSampler(dataloader.dataset, self.num_replicas, self.rank)
            if self.equal_batches:
                batches = _batches(len(ExactShardSampler(dataloader.dataset, self.num_replicas, 0)), dataloader)
                return EqualBatches(_lightning.replace_sampler(dataloader, exact, stage), batches)
            if len(exact) == 0 and len(dataloader.dataset) > 0:
                exact = PlaceholderShardSampler()
            return _lightning.replace_sampler(dataloader, exact, stage)
        return dataloader

    def training_loaders_built(self) -> None:
        """Training starts: a later reload (``reload_dataloaders_every_n_epochs``) starts its epoch whole. Where the
        samplers of all training loaders continue a checkpoint's epoch, Lightning's warning that the loaders cannot
        resume mid-epoch is not true: it is silenced until the run ends."""
        continued, loaders = self._resumed_exactly, _lightning.training_loader_count(self.trainer)
        if continued and continued == loaders and not self._resume_warning_silenced:
            self._changes.apply(Change.WARNING_FILTERS, false_warnings.silence_not_resumable_warning())
            self._resume_warning_silenced = True
        self._first_batch_starts_epoch = self._without_state > 0
        self._resumed, self._resumed_used, self._resumed_exactly, self._without_state = None, 0, 0, 0

    def check_first_batch(self, batch_idx: int) -> None:
        """Refuse, before the fit's first step, a fit loop that resumes mid-epoch (its first ``batch_idx`` is not 0)
        where a training sampler had no checkpoint state: the checkpoint's positions are unknown (another strategy
        wrote it), the sampler would start the epoch over while the loop counts ``batch_idx`` batches as done."""
        starts_epoch, self._first_batch_starts_epoch = self._first_batch_starts_epoch, False
        if starts_epoch and batch_idx > 0:
            raise ValueError(
                f"shardplus: the checkpoint has no position of shardplus's training sampler (no {CHECKPOINT_KEY!r} "
                "entry: another strategy wrote it, such as Lightning's 'ddp' or 'model_parallel', or a run whose "
                f"training loader had a sampler of its own), but the fit loop resumes epoch "
                f"{self.trainer.current_epoch} after {batch_idx} of its batches. Which samples those batches read "
                "depends on that run's sampler, seed and number of processes, which the checkpoint does not record: "
                f"the sampler would start the epoch over while the loop counts {batch_idx} batches as done, training "
                "some samples twice in this epoch and others never. To go on, resume from a checkpoint saved at "
                "the end of an epoch (`ModelCheckpoint(save_on_train_epoch_end=True)` writes one at every epoch's "
                "end), or start over from the checkpoint's weights alone: `YourModule.load_from_checkpoint(path)`, "
                "then `trainer.fit` without `ckpt_path` (the epoch, step count and optimizer state start anew)."
            )

    def _training_sampler(self, dataloader: DataLoader, injected: Any) -> PaddedShardSampler:
        if len(dataloader.dataset) == 0:
            raise ValueError("The training dataset is empty (len(train dataset) == 0): give it at least one sample.")
        shuffle = bool(injected.shuffle) and self.shuffle
        sampler = PaddedShardSampler(dataloader.dataset, self.num_replicas, self.rank, shuffle=shuffle, seed=self.seed,
                                     padding=self.padding, record_indices=self.record_indices)  # fmt: skip
        self._resume(sampler, aggregation.loader_batch_size(dataloader))
        _warn_if_mostly_padding(sampler)
        return sampler

    def _resume(self, sampler: PaddedShardSampler, batch_size: int | None) -> None:
        """Give ``sampler`` the next of the resumed checkpoint's sampler states, if any (in loader order)."""
        entry = self._resumed
        if entry is None:
            self._without_state += 1
            return
        if self._resumed_used >= len(entry["samplers"]):
            return
        state = entry["samplers"][self._resumed_used]
        self._resumed_used += 1
        if batch_size is None or state is None:
            rank_zero_warn("shardplus: a training loader has no batch size; its epoch restarts from the beginning.")
            return
        check_resumed_epoch(state, self.trainer.current_epoch, sampler.dataset_length)
        saved, now = state.get("global_batch_size"), batch_size * self.num_replicas  # absent in older checkpoints
        if saved is not None and saved != now:  # the same global batch on another world size: the same steps
            rank_zero_warn(
                f"shardplus: the checkpoint was written with a global batch of {saved} samples "
                f"({processes(state.get('num_replicas'))}), this run's is {now} ({processes(self.num_replicas)}): "
                "the rest of the epoch is resharded, every remaining sample read once, in other optimizer steps "
                "than the saved run's."
            )
        if state["seed"] != sampler.seed:
            rank_zero_warn(
                f"shardplus: the checkpoint's training order has seed {state['seed']}, this run's seed is "
                f"{sampler.seed}: the checkpoint's seed is kept for the rest of training, so that the run goes on "
                "in the order it started with (as if it had not stopped)."
            )
        sampler.load_state_dict(state, samples_counted=int(entry["batches_done"]) * batch_size)
        self._resumed_exactly += 1

    def state_dict(self) -> dict[str, Any] | None:
        """The training samplers' progress at the last trained batch; None outside fit or without our samplers."""
        trainer = self.trainer
        if trainer.state.fn != TrainerFn.FITTING:
            return None
        samplers = [
            (loader.sampler, aggregation.loader_batch_size(loader))
            for loader in aggregation.dataloaders(trainer.train_dataloader)
            if isinstance(loader.sampler, PaddedShardSampler)
        ]
        return checkpoint_entry(_lightning.micro_batches_trained_in_epoch(trainer), samplers) if samplers else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The progress of a checkpoint being resumed, checked: the training samplers built next continue its epoch."""
        check_checkpoint_entry(state)
        self._resumed, self._resumed_used = state, 0


PADDING_WARNING_SHARE = 0.25
"""Equal shards that are at least this share padding are warned about (those samples weigh more in training):
e.g. 2 samples on 3 processes (1 of 3), 6 on 4 (2 of 8); 22 on 3 (2 of 24) is not."""


def _warn_if_mostly_padding(sampler: PaddedShardSampler) -> None:
    if sampler.drop_last:
        return
    n, world = sampler.dataset_length, sampler.num_replicas
    read = -(-n // world) * world  # a whole epoch's equal shards
    if read - n >= PADDING_WARNING_SHARE * read:
        what = "copies of sample 0" if sampler.padding == "first" else "repeated samples"
        rank_zero_warn(
            f"shardplus: padding makes up {read - n} of the {read} training samples read per epoch "
            f"({(read - n) / read:.0%}, {what}: {n} samples on {world} processes get equal shards of "
            f"{read // world}). Those samples weigh more in training: use fewer processes or a larger training set."
        )


def gather_predictions(loop: Any, dp: DataParallel) -> None:
    """Where the predict ``loop`` returns predictions, on data-parallel rank 0 (rank 0 among them), replace each
    loader's list of prediction batches by every data-parallel rank's, in dataset order (exact shards are contiguous
    blocks in rank order); the other ranks keep theirs."""
    if not loop.return_predictions:
        return
    for predictions in [loop.predictions] if loop.num_dataloaders == 1 else loop.predictions:
        predictions[:] = [batch for batch in predictions if not isinstance(batch, NoBatch)]  # stand-ins' steps
        gathered: list[Any] | None = [None] * dp.size if dp.rank == 0 else None
        torch.distributed.gather_object(predictions, gathered, dst=dp.global_rank(0), group=dp.group)
        if gathered is not None:
            predictions[:] = [batch for rank_batches in gathered for batch in rank_batches]


class EqualBatches:
    """An exact evaluation loader under model parallel: this rank's batches, then stand-ins (:class:`NoBatch` holding
    the dataset's first sample) up to ``batches``, the longest shard's: every data-parallel rank runs as many forward
    passes, which FSDP needs (its forward is a collective); the strategy counts the stand-ins' steps nowhere."""

    def __init__(self, loader: DataLoader, batches: int) -> None:
        self.loader, self.batches = loader, batches

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets `worker_init_fn` on the processed loader (`seed_everything(workers=True)`): the loader's
        if name in ("loader", "batches"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[Any]:
        yielded = 0
        for yielded, batch in enumerate(self.loader, start=1):  # noqa: B007  (counted after the loop)
            yield batch
        if yielded < self.batches:
            loader, first = self.loader, self.loader.dataset[0]
            stand_in = NoBatch(loader.collate_fn([first] if loader.batch_sampler is not None else first))
            for _ in range(self.batches - yielded):
                _lightning.record_batch_without_indices(loader)  # prediction writers read one entry per batch
                yield stand_in


def _batches(samples: int, loader: DataLoader) -> int:
    """The batches ``loader`` makes of ``samples`` samples."""
    size = aggregation.loader_batch_size(loader)
    if size is None:
        return samples
    return samples // size if loader.drop_last else -(-samples // size)


def processes(count: Any) -> str:
    """``count`` processes, in words ("1 process", "2 processes")."""
    return f"{count} process{'' if count == 1 else 'es'}"
