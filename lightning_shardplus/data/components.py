"""``RunComponents``: one Trainer run of ``ShardPlusStrategy``, built from its config in ``setup()`` and dropped in
``teardown()``; every piece of per-run state lives here, checkpointed under one key per component."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus._compat.changes import RunChanges
from lightning_shardplus.data import aggregation, sharding
from lightning_shardplus.data.aggregation import GradientAggregation
from lightning_shardplus.data.config import DataSideConfig
from lightning_shardplus.data.datamodule import ShardPlusDataModule
from lightning_shardplus.data.exact_evaluation import ExactEvaluation
from lightning_shardplus.data.gradient_side import GradientRun, GradientSide
from lightning_shardplus.data.group import DataParallel
from lightning_shardplus.data.loaders import ShardedLoaders
from lightning_shardplus.data.training_metrics.callback import AverageTrainingMetrics
from lightning_shardplus.data.uneven import EvenSteps
from lightning_shardplus.data.verify_sharding import VerifySharding

# Where the data side's stateful components' state goes in a Lightning checkpoint (the gradient side adds its own).
CHECKPOINT_KEYS = (sharding.CHECKPOINT_KEY, aggregation.CHECKPOINT_KEY)


@dataclass
class DistributedSetup:
    """What the components need to know of the strategy's processes, and its gradient side."""

    data_parallel: DataParallel
    backend: str
    device: torch.device
    gradients: GradientSide
    launcher_name: str | None = None  # named in the start-up line where it is not Lightning's or as found (Ray Train)
    saves_outside_callbacks: bool = False  # checkpoints come from elsewhere than Lightning's callbacks (Ray's reports)

    @property
    def num_replicas(self) -> int:
        return self.data_parallel.size


@dataclass
class RunComponents:
    """The components of one Trainer run; ``even``, ``aggregation`` and ``gradients`` exist in fit only."""

    loaders: ShardedLoaders
    exact: ExactEvaluation | None = None  # the callback, when evaluation is exact across more than one rank
    metrics: AverageTrainingMetrics | None = None  # the callback, when training metrics are averaged
    even: EvenSteps | None = None
    evaluation_steps: EvenSteps | None = None  # evaluation in equal steps where the forward is a collective
    aggregation: GradientAggregation | None = None
    gradients: GradientRun | None = None  # the gradient side's state in a fit (DDP: its hook and bucket setting)
    backend: str = "gloo"  # the process group's

    @classmethod
    def build(
        cls, config: DataSideConfig, trainer: pl.Trainer, setup: DistributedSetup, changes: RunChanges
    ) -> RunComponents:
        """The components of ``trainer``'s run, whose changes to Lightning's objects go to ``changes``; the callbacks
        shardplus needs are added to the Trainer's."""
        exact_across_ranks = config.exact_evaluation and setup.num_replicas > 1
        _add_callbacks(config, trainer, exact_across_ranks)
        fitting, communicates = trainer.state.fn == TrainerFn.FITTING, setup.gradients.forward_communicates
        rank_zero_info(features_in_effect(config, setup.num_replicas, fitting, setup.gradients, setup.launcher_name))
        datamodule = getattr(trainer, "datamodule", None)
        # Lightning marks every training loader as shuffled when it injects its sampler: read the datamodule's
        shuffle = not isinstance(datamodule, ShardPlusDataModule) or datamodule.shuffle
        loaders = ShardedLoaders(
            trainer, setup.num_replicas, setup.data_parallel.rank, padding=config.shard_padding, seed=config.epoch_seed,
            shuffle=shuffle, exact_evaluation=config.exact_evaluation, record_indices=config.verify_sharding,
            changes=changes, equal_batches=communicates,
        )  # fmt: skip
        exact = next((cb for cb in trainer.callbacks if isinstance(cb, ExactEvaluation)), None)
        metrics = next((cb for cb in trainer.callbacks if isinstance(cb, AverageTrainingMetrics)), None)
        parts = cls(loaders, exact=exact if exact_across_ranks else None, metrics=metrics, backend=setup.backend)
        if exact_across_ranks and communicates:
            parts.evaluation_steps = EvenSteps("join", setup.data_parallel, setup.backend, keeps_stand_in=True)
        if fitting:
            abstain = metrics.abstain_this_step if metrics is not None else None
            parts.even = EvenSteps(
                config.uneven_inputs, setup.data_parallel, setup.backend, trainer, abstain, keeps_stand_in=communicates,
                saves_outside_callbacks=setup.saves_outside_callbacks,
            )  # fmt: skip
            parts.aggregation = GradientAggregation(
                trainer, config.aggregation_frequency, config.average_aggregated_gradients,
                ranks_correction=parts.even.gradient_correction, gradients=setup.gradients,
                data_parallel=setup.data_parallel, changes=changes,
            )  # fmt: skip
            # once the aggregation frequency is set
            parts.gradients = setup.gradients.start_fit(trainer, setup.backend, setup.device)
        return parts

    def load_states(self, states: dict[str, Any]) -> None:
        """Give each stateful component its entry of ``states`` (a checkpoint loaded before ``setup``), popped."""
        for key, component in self.stateful().items():
            if key in states:
                component.load_state_dict(states.pop(key))
        if self.gradients is not None:
            self.gradients.load_states(states)

    def process_dataloader(self, dataloader: object, training: bool) -> object:
        """shardplus samplers in a loader Lightning prepared; training streams (and model parallel's evaluation
        streams) in steps all ranks take together."""
        dataloader = self.loaders.process(dataloader)
        if training and self.aggregation is not None:
            self.aggregation.announce(dataloader)
        if training and self.even is not None:
            dataloader = self.even.wrap(dataloader)
        elif not training and self.evaluation_steps is not None:
            dataloader = self.evaluation_steps.wrap_evaluation(dataloader)
        return dataloader

    def on_train_start(self, trainer: pl.Trainer) -> None:
        assert self.aggregation is not None and self.even is not None
        self.loaders.training_loaders_built()
        self.even.check_combination(_lightning.training_loader_count(trainer))
        self.aggregation.on_train_start()

    def on_train_batch_start(self, trainer: pl.Trainer, batch_idx: int) -> None:
        assert self.even is not None
        self.loaders.check_first_batch(batch_idx)
        if batch_idx == 0:
            # Lightning reads the loaders' lengths once per fit: a resharded resumed epoch has another length
            _lightning.refresh_training_batch_count(trainer)
        self.even.batch_taken()

    def stateful(self) -> dict[str, Any]:
        """The data side's components with checkpoint state (``state_dict`` / ``load_state_dict``), by key."""
        parts = dict(zip(CHECKPOINT_KEYS, (self.loaders, self.aggregation), strict=True))
        return {key: part for key, part in parts.items() if part is not None}

    def checkpoint_states(self, checkpoint_path: Any) -> dict[str, Any]:
        """Each stateful component's checkpoint entry, by key; on every rank (the gradient side may write files)."""
        states = {key: part.state_dict() for key, part in self.stateful().items()}
        if self.gradients is not None:
            states.update(self.gradients.checkpoint_states(checkpoint_path))
        return {key: state for key, state in states.items() if state is not None}


def checkpointed_states(checkpoint: dict[str, Any], checkpoint_path: Any, gradients: GradientSide) -> dict[str, Any]:
    """The component entries of a loaded checkpoint, by key: the data side's and the gradient side's."""
    states = {key: checkpoint[key] for key in CHECKPOINT_KEYS if key in checkpoint}
    gradients.checkpointed(states, checkpoint, checkpoint_path)
    return states


def process_group_backend(given: str | None, device: torch.device) -> str:
    """The backend of the process group: the one running, else the one DDPStrategy would start."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return str(torch.distributed.get_backend())
    return given or torch.distributed.Backend.default_device_backend_map.get(device.type, "gloo")  # as DDPStrategy


def _add_callbacks(config: DataSideConfig, trainer: pl.Trainer, exact_across_ranks: bool) -> None:
    callbacks = trainer.callbacks
    if config.verify_sharding and not any(isinstance(cb, VerifySharding) for cb in callbacks):
        callbacks.append(VerifySharding())
    # first, so that epoch values are exact, and training metrics averaged, before other callbacks read them
    if exact_across_ranks and not any(isinstance(cb, ExactEvaluation) for cb in callbacks):
        callbacks.insert(0, ExactEvaluation())
    if config.average_training_metrics and not any(isinstance(cb, AverageTrainingMetrics) for cb in callbacks):
        callbacks.insert(0, AverageTrainingMetrics())


def features_in_effect(
    config: DataSideConfig, num_replicas: int, fitting: bool, gradients: GradientSide, launcher_name: str | None = None
) -> str:
    """The start-up line naming what shardplus does in this run (and who started the processes, where named), as
    Lightning names the devices it uses (silenced as those are:
    ``logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)``)."""
    exact = f"exact evaluation {'on' if config.exact_evaluation else 'off'}"
    ranks = f"{num_replicas} {gradients.ranks}"
    ranks += f" started by {launcher_name}" if launcher_name else ""
    if not fitting:
        return f"shardplus: {ranks}, {exact}"
    features = [
        f"padded equal training shards (padding {config.shard_padding!r}, reshuffled each epoch)", exact,
        f"averaged training metrics {'on' if config.average_training_metrics else 'off'}",
        f"{(n := config.aggregation_frequency)} micro-batch{'es' if n > 1 else ''} per optimizer step",
        *gradients.features(),
        f"uneven streams {config.uneven_inputs!r}",
    ]  # fmt: skip
    return f"shardplus: {ranks}: {', '.join(features)}"
