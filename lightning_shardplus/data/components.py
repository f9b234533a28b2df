"""``RunComponents``: one Trainer run of ``ShardPlusStrategy``, built from its config in ``setup()`` and dropped in
``teardown()``; every piece of per-run state lives here, checkpointed under one key per component."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus.config import ShardPlusConfig
from lightning_shardplus.data import aggregation, sharding
from lightning_shardplus.data.aggregation import FSDP2_WINDOW_GRADIENTS_READABLE, GradientAggregation
from lightning_shardplus.data.datamodule import ShardPlusDataModule
from lightning_shardplus.data.exact_evaluation import ExactEvaluation
from lightning_shardplus.data.group import DataParallel
from lightning_shardplus.data.loaders import ShardedLoaders
from lightning_shardplus.data.training_metrics.callback import AverageTrainingMetrics
from lightning_shardplus.data.uneven import EvenSteps
from lightning_shardplus.diagnostics import CommunicationHookWrapper, VerifySharding
from lightning_shardplus.gradients.ddp import compression, fusion
from lightning_shardplus.gradients.ddp.compression import CommunicationHook

# Where each stateful component's state goes in a Lightning checkpoint.
CHECKPOINT_KEYS = tuple(module.CHECKPOINT_KEY for module in (sharding, compression, fusion, aggregation))


@dataclass
class DistributedSetup:
    """What the components need to know of the strategy's processes and DDP (``ddp``: False under model parallel,
    where the gradient side is FSDP2's: no communication hook, no tensor fusion)."""

    data_parallel: DataParallel
    backend: str
    device: torch.device
    ddp_comm_hook: Callable | None = None
    ddp_comm_state: object | None = None
    ddp_comm_wrapper: Callable | None = None
    ddp_kwargs: dict[str, Any] | None = None
    ddp: bool = True
    launcher_name: str | None = None  # named in the start-up line where it is not Lightning's or as found (Ray Train)

    @property
    def num_replicas(self) -> int:
        return self.data_parallel.size


@dataclass
class RunComponents:
    """The components of one Trainer run; ``even``, ``aggregation``, ``hook`` and ``fusion`` exist in fit only."""

    loaders: ShardedLoaders
    exact: ExactEvaluation | None = None  # the callback, when evaluation is exact across more than one rank
    metrics: AverageTrainingMetrics | None = None  # the callback, when training metrics are averaged
    even: EvenSteps | None = None
    evaluation_steps: EvenSteps | None = None  # model parallel: evaluation streams in equal steps (FSDP's forward)
    aggregation: GradientAggregation | None = None
    hook: CommunicationHook | None = None
    fusion: fusion.TensorFusion | None = None
    backend: str = "gloo"  # the process group's

    @classmethod
    def build(cls, config: ShardPlusConfig, trainer: pl.Trainer, setup: DistributedSetup) -> RunComponents:
        """The components of ``trainer``'s run; the callbacks shardplus needs are added to the Trainer's."""
        exact_across_ranks = config.exact_evaluation and setup.num_replicas > 1
        _add_callbacks(config, trainer, exact_across_ranks)
        fitting = trainer.state.fn == TrainerFn.FITTING
        rank_zero_info(features_in_effect(config, setup.num_replicas, fitting, setup.ddp, setup.launcher_name))
        datamodule = getattr(trainer, "datamodule", None)
        # Lightning marks every training loader as shuffled when it injects its sampler: read the datamodule's
        shuffle = not isinstance(datamodule, ShardPlusDataModule) or datamodule.shuffle
        loaders = ShardedLoaders(
            trainer, setup.num_replicas, setup.data_parallel.rank, padding=config.shard_padding, seed=config.epoch_seed,
            shuffle=shuffle, exact_evaluation=config.exact_evaluation, record_indices=config.verify_sharding,
            equal_batches=not setup.ddp,
        )  # fmt: skip
        exact = next((cb for cb in trainer.callbacks if isinstance(cb, ExactEvaluation)), None)
        metrics = next((cb for cb in trainer.callbacks if isinstance(cb, AverageTrainingMetrics)), None)
        parts = cls(loaders, exact=exact if exact_across_ranks else None, metrics=metrics, backend=setup.backend)
        if exact_across_ranks and not setup.ddp:
            parts.evaluation_steps = EvenSteps("join", setup.data_parallel, setup.backend, keeps_stand_in=True)
        if trainer.state.fn == TrainerFn.FITTING:
            abstain = metrics.abstain_this_step if metrics is not None else None
            parts.even = EvenSteps(
                config.uneven_inputs, setup.data_parallel, setup.backend, trainer, abstain, keeps_stand_in=not setup.ddp
            )
            parts.aggregation = GradientAggregation(
                trainer, config.aggregation_frequency, config.average_aggregated_gradients,
                ranks_correction=parts.even.gradient_correction,
                window_gradients=setup.ddp or FSDP2_WINDOW_GRADIENTS_READABLE,
                data_parallel=None if setup.ddp else setup.data_parallel,
            )  # fmt: skip
            if not setup.ddp:
                return parts
            parts.hook = CommunicationHook(
                config.gradient_compression, backend=setup.backend, device=setup.device, user_hook=setup.ddp_comm_hook,
                user_state=setup.ddp_comm_state, user_wrapper=setup.ddp_comm_wrapper,
                wrappers=[cb.wrap for cb in trainer.callbacks if isinstance(cb, CommunicationHookWrapper)],
            )  # fmt: skip
            parts.fusion = _tensor_fusion(config, trainer, setup)  # once the aggregation frequency is set
        return parts

    def load_states(self, states: dict[str, Any]) -> None:
        """Give each stateful component its entry of ``states`` (a checkpoint loaded before ``setup``), popped."""
        for key, component in self.stateful().items():
            if key in states:
                component.load_state_dict(states.pop(key))

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
        if self.fusion is not None:
            self.fusion.on_train_start()

    def on_train_batch_start(self, trainer: pl.Trainer, batch_idx: int) -> None:
        assert self.even is not None
        self.loaders.check_first_batch(batch_idx)
        if batch_idx == 0:
            # Lightning reads the loaders' lengths once per fit: a resharded resumed epoch has another length
            _lightning.refresh_training_batch_count(trainer)
        self.even.batch_taken()

    def stateful(self) -> dict[str, Any]:
        """The components with checkpoint state (``state_dict`` / ``load_state_dict``), by checkpoint key."""
        parts = dict(zip(CHECKPOINT_KEYS, (self.loaders, self.hook, self.fusion, self.aggregation), strict=True))
        return {key: part for key, part in parts.items() if part is not None}

    def checkpoint_states(self, checkpoint_path: Any) -> dict[str, Any]:
        """Each stateful component's checkpoint entry, by key; on every rank (each writes its PowerSGD file)."""
        states = {
            key: part.state_dict(checkpoint_path) if part is self.hook else part.state_dict()
            for key, part in self.stateful().items()
        }
        return {key: state for key, state in states.items() if state is not None}

    def close(self) -> None:
        """The run ends: what the components changed outside themselves is put back."""
        self.loaders.close()
        if self.aggregation is not None:
            self.aggregation.close()


def checkpointed_states(checkpoint: dict[str, Any], checkpoint_path: Any) -> dict[str, Any]:
    """The component entries of a loaded checkpoint, by key; the compression entry learns the checkpoint's path."""
    states = {key: checkpoint[key] for key in CHECKPOINT_KEYS if key in checkpoint}
    if isinstance(entry := states.get(compression.CHECKPOINT_KEY), dict):
        states[compression.CHECKPOINT_KEY] = {**entry, "checkpoint_path": str(checkpoint_path)}
    return states


def process_group_backend(given: str | None, device: torch.device) -> str:
    """The backend of the process group: the one running, else the one DDPStrategy would start."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return str(torch.distributed.get_backend())
    return given or torch.distributed.Backend.default_device_backend_map.get(device.type, "gloo")  # as DDPStrategy


def _add_callbacks(config: ShardPlusConfig, trainer: pl.Trainer, exact_across_ranks: bool) -> None:
    callbacks = trainer.callbacks
    if config.verify_sharding and not any(isinstance(cb, VerifySharding) for cb in callbacks):
        callbacks.append(VerifySharding())
    # first, so that epoch values are exact, and training metrics averaged, before other callbacks read them
    if exact_across_ranks and not any(isinstance(cb, ExactEvaluation) for cb in callbacks):
        callbacks.insert(0, ExactEvaluation())
    if config.average_training_metrics and not any(isinstance(cb, AverageTrainingMetrics) for cb in callbacks):
        callbacks.insert(0, AverageTrainingMetrics())


def features_in_effect(
    config: ShardPlusConfig, num_replicas: int, fitting: bool, ddp: bool = True, launcher_name: str | None = None
) -> str:
    """The start-up line naming what shardplus does in this run (and who started the processes, where named), as
    Lightning names the devices it uses (silenced as those are:
    ``logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)``)."""
    exact = f"exact evaluation {'on' if config.exact_evaluation else 'off'}"
    ranks = f"{num_replicas} {'processes' if ddp else 'data-parallel ranks (model parallel)'}"
    ranks += f" started by {launcher_name}" if launcher_name else ""
    if not fitting:
        return f"shardplus: {ranks}, {exact}"
    features = [
        f"padded equal training shards (padding {config.shard_padding!r}, reshuffled each epoch)", exact,
        f"averaged training metrics {'on' if config.average_training_metrics else 'off'}",
        f"{(n := config.aggregation_frequency)} micro-batch{'es' if n > 1 else ''} per optimizer step",
        *([f"gradient compression {config.gradient_compression!r}"] if ddp else []),
        f"uneven streams {config.uneven_inputs!r}",
    ]  # fmt: skip
    return f"shardplus: {ranks}: {', '.join(features)}"


def _tensor_fusion(config: ShardPlusConfig, trainer: pl.Trainer, setup: DistributedSetup) -> fusion.TensorFusion:
    ddp_kwargs = setup.ddp_kwargs or {}
    # what the best bucket size depends on, beside the parameters, world size, device, backend and torch
    extra = {
        "gradient_compression": config.gradient_compression,
        "ddp_comm_hook": getattr(setup.ddp_comm_hook, "__qualname__", None),
        "micro_batches_per_step": aggregation.micro_batches_per_step(trainer),
        # (DDP's default, False, where left out: the key is the same whether the flag was passed or not)
        **{k: ddp_kwargs.get(k, False) for k in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")},
    }
    return fusion.TensorFusion(
        trainer, config.autotune_settings, tune=config.auto_tune_tensor_fusion, log_path=config.autotune_log,
        cache=config.autotune_cache, cache_extra=extra,
    )  # fmt: skip
