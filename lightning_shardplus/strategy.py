"""``ShardPlusStrategy``: DDP whose overrides wire components into Lightning's hooks. It holds one frozen
:class:`~lightning_shardplus.config.ShardPlusConfig`; the components (:mod:`lightning_shardplus.components`) are
built in ``setup`` for one Trainer run, own that run's state and are dropped in ``teardown``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shardplus import _lightning
from lightning_shardplus.aggregation import check_aggregation, effective_batch_size
from lightning_shardplus.carrier import GradientCarrier
from lightning_shardplus.components import DistributedSetup, RunComponents, checkpointed_states, remove_checkpoint_files
from lightning_shardplus.compression import GradientCompression
from lightning_shardplus.config import ShardPlusConfig, at_ddp_defaults, check_ddp_arguments, registered_names
from lightning_shardplus.fusion import BucketSetting, FusionResult
from lightning_shardplus.launch import LaunchAfterCheck, check_accelerator, check_trainer_call
from lightning_shardplus.loaders import gather_predictions
from lightning_shardplus.metrics import share_rank_zero_buffers
from lightning_shardplus.sharding import PaddingMode
from lightning_shardplus.uneven import NO_BATCH, UnevenInputs


class ShardPlusStrategy(DDPStrategy):
    """DDP for synchronous data-parallel training, with the training optimizations of Horovod, Determined and
    NVIDIA Clara Train. Each argument has a page in ``docs/``; the README has one line per argument.

    Args:
        aggregation_frequency: micro-batches per optimizer step; the gradients of all but the last stay local
            (Horovod's ``backward_passes_per_step``). Replaces the Trainer's ``accumulate_grad_batches``.
        average_aggregated_gradients: the mean of the aggregated gradients (True) or their sum (False).
        gradient_compression: the DDP communication hook on every device type: ``"none"``, ``"fp16"``, ``"bf16"``
            or ``"powersgd"`` (a ``PowerSGDState`` as ``ddp_comm_state`` configures it). Not with ``ddp_comm_hook``.
        shard_padding: short training shards are filled with the dataset's first element (``"first"``, as Clara)
            or the epoch order's first indices (``"wrap"``, as torch's ``DistributedSampler``).
        shuffle_seed: seed of the training epoch permutation; None: the ``seed_everything`` seed, else 0.
        exact_evaluation: evaluation loaders get unpadded shards and epoch metrics equal a single-process run.
        verify_sharding: debug aid: after each training epoch, check that the shards were disjoint and complete.
        tensor_fusion_threshold_mb: DDP's bucket size (``bucket_cap_mb``, < 2**43 MB); None: DDP's default.
        auto_tune_tensor_fusion: choose the bucket size by measuring the first optimizer steps (cached per setup).
        autotune_log: CSV file with one row per measured sample, or one saying why nothing was raced (written by
            rank 0); None: no log.
        autotune_candidates_mb: bucket sizes raced. None (printed ``null``): chosen from the model's gradient size,
            its gradient bytes over 1, 2, 4, 8 and 16 buckets, and 25 MB (``fusion.default_candidates_mb``).
        autotune_first_bucket_candidates_mb: first-bucket sizes raced against the chosen size (None: 1 MB).
        autotune_steps_per_sample: timed optimizer steps per sample.
        autotune_warmup_steps: optimizer steps not timed after each re-wrap.
        autotune_cache: JSON cache of tuned results: True (``~/.cache/lightning_shardplus/fusion.json``), a path,
            or False. An existing file that is not such a cache is refused, never overwritten; an entry that is not
            valid (edited by hand) is ignored with a warning and the bucket size searched again.
        average_training_metrics: training values logged with ``on_step=True`` are averaged over all ranks once per
            optimizer step, inside DDP's gradient all-reduce where it can be; False: Lightning's behaviour.
        uneven_inputs: training streams (iterable datasets) of different lengths per rank: ``"join"`` (every sample
            once; ranks that ran out take part without data) or ``"drop"`` (every rank stops at the shortest).
        find_unused_parameters, static_graph, gradient_as_bucket_view, broadcast_buffers: passed to
            ``DistributedDataParallel``, as are other keyword arguments it accepts (``find_unused_parameters`` and
            ``broadcast_buffers`` only where given: None leaves DDP's default).

    The others are ``DDPStrategy``'s; its ``ddp_comm_hook`` and ``ddp_comm_wrapper`` work on every device type.
    """

    strategy_name = "shardplus"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[Any] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        aggregation_frequency: int = 1,
        average_aggregated_gradients: bool = True,
        gradient_compression: GradientCompression = "none",
        shard_padding: PaddingMode = "first",
        shuffle_seed: int | None = None,
        exact_evaluation: bool = True,
        verify_sharding: bool = False,
        tensor_fusion_threshold_mb: float | None = None,
        auto_tune_tensor_fusion: bool = False,
        autotune_log: str | None = None,
        autotune_candidates_mb: list[float] | None = None,
        autotune_first_bucket_candidates_mb: list[float] | None = None,
        autotune_steps_per_sample: int = 8,
        autotune_warmup_steps: int = 1,
        autotune_cache: str | bool = True,
        average_training_metrics: bool = True,
        uneven_inputs: UnevenInputs = "join",
        find_unused_parameters: bool | None = None,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        config = ShardPlusConfig.from_arguments(locals())
        flags = dict(static_graph=static_graph, gradient_as_bucket_view=gradient_as_bucket_view)
        if find_unused_parameters is not None:  # only when given, kept as given (as DDPStrategy keeps it)
            ddp_kwargs["find_unused_parameters"] = find_unused_parameters
        if broadcast_buffers is not None:
            ddp_kwargs["broadcast_buffers"] = broadcast_buffers  # only when given: torch 2.13 deprecates it
        timeout = check_ddp_arguments(
            config, start_method, timeout, process_group_backend, ddp_comm_hook, ddp_comm_state, {**flags, **ddp_kwargs}
        )
        super().__init__(  # DDPStrategy's arguments, in its order
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, ddp_comm_state,
            ddp_comm_hook, ddp_comm_wrapper, model_averaging_period, process_group_backend, timeout, start_method,
            # None: DDP's own default (25 MB buckets, the first 1 MB), as with strategy="ddp". Passed by name even
            # then: LightningCLI (jsonargparse) would otherwise offer DDP's `bucket_cap_mb` among `**ddp_kwargs`.
            bucket_cap_mb=config.tensor_fusion_threshold_mb, **flags, **ddp_kwargs,
        )  # fmt: skip
        # DDP gets its own defaults by leaving them out (as with strategy="ddp"), not by passing them again
        given = {"bucket_cap_mb": config.tensor_fusion_threshold_mb, **flags}
        _lightning.set_ddp_kwargs(self, dict.fromkeys(at_ddp_defaults(given)))  # None: left out
        self.config = config
        self._components: RunComponents | None = None  # this Trainer run's, from `setup` to `teardown`
        self._checkpointed: dict[str, Any] = {}  # component states of a checkpoint loaded before `setup`

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, (description, init_params) in registered_names().items():
            strategy_registry.register(name, cls, description=description, override=True, **init_params)

    # ------------------------------------------------------------------ what the run sees

    @property
    def num_replicas(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches per optimizer step: ``aggregation_frequency`` (or, with it left at 1, the Trainer's
        ``accumulate_grad_batches``)."""
        aggregation = self._components and self._components.aggregation
        return aggregation.micro_batches_per_step if aggregation else self.config.aggregation_frequency

    @property
    def effective_batch_size(self) -> int | None:
        """Samples per optimizer step over all processes (``per-device batch x world size x micro-batches per
        step``) once the training data is known; None before. ``ScaleLearningRate`` scales with it."""
        trainer = _lightning.attached_trainer(self.lightning_module)
        return None if trainer is None else effective_batch_size(trainer)

    @property
    def fusion_result(self) -> FusionResult | None:
        """What tensor-fusion tuning decided in this fit (rank 0 holds the timings); None without tuning."""
        return fusion.result if (fusion := self._components and self._components.fusion) else None

    @property
    def fusion_tuning(self) -> bool:
        """Whether tensor-fusion autotuning is still measuring (DDP may be re-wrapped at the next step)."""
        return bool((fusion := self._components and self._components.fusion) and fusion.tuning)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        kwargs = {**super().distributed_sampler_kwargs, "seed": _lightning.InjectedSeed(self.config.epoch_seed)}
        return self._components.loaders.injection_kwargs(kwargs) if self._components is not None else kwargs

    @property
    def _exact_across_ranks(self) -> bool:
        return self.config.exact_evaluation and self.num_replicas > 1

    # ------------------------------------------------------------------ before the run

    @property
    @override
    def accelerator(self) -> pl.accelerators.Accelerator | None:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: pl.accelerators.Accelerator) -> None:
        # the Trainer sets the accelerator it resolved here: refuse MPS as Lightning refuses the DDP family
        check_accelerator(accelerator, self.strategy_name, self._start_method)
        self._accelerator = accelerator

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        # checks in the launching process, before any worker starts (the launcher keeps its type for Lightning)
        self._launcher.launch = LaunchAfterCheck(partial(check_trainer_call, self), self._launcher.launch)

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        if self.config.exact_evaluation:
            # Exact evaluation shards are empty on some ranks when the dataset is smaller than the world size.
            model.allow_zero_length_dataloader_with_multiple_devices = True
        trainer = _lightning.attached_trainer(model)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            static_graph = bool(_lightning.ddp_kwargs(self).get("static_graph"))
            check_aggregation(self.config.aggregation_frequency, trainer, model, static_graph)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            _lightning.destroy_process_group_at_exit()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        setup = DistributedSetup(
            self.num_replicas, self.global_rank, self._backend(), self.root_device,
            self._ddp_comm_hook, self._ddp_comm_state, self._ddp_comm_wrapper, _lightning.ddp_kwargs(self),
        )  # fmt: skip
        self._components = RunComponents.build(self.config, trainer, setup)
        for key, component in self._components.stateful().items():
            if key in self._checkpointed:
                component.load_state_dict(self._checkpointed.pop(key))
        super().setup(trainer)

    @override
    def teardown(self) -> None:
        if self._components is not None:
            self._components.close()
        self._components, self._checkpointed = None, {}
        super().teardown()

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Add each component's state under its own key (training checkpoints only, not weights-only ones). Called on
        every rank (a collective mid aggregation window): each writes its PowerSGD state beside ``filepath``."""
        if self._components is not None and "loops" in checkpoint:
            checkpoint.update(self._components.checkpoint_states(filepath))
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # passes on what this Lightning release gives (2.6 added `weights_only`; 2.4 and 2.5 give the path only)
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        # DDP restores checkpoints before `setup`, which builds the components that take these states
        self._checkpointed = checkpointed_states(checkpoint, checkpoint_path)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        remove_checkpoint_files(filepath, self.global_rank)  # every rank: its files beside the checkpoint

    def compression_state_dict(self) -> dict[str, Any] | None:
        """This rank's gradient-compression state (PowerSGD's); None for stateless compression or outside fit."""
        return hook.local_state_dict() if (hook := self._components and self._components.hook) else None

    # ------------------------------------------------------------------ data

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Put shardplus samplers into the loaders Lightning prepared (``loaders.ShardedLoaders``); training streams
        go in steps every rank takes together (``uneven.EvenSteps``)."""
        dataloader = super().process_dataloader(dataloader)
        if (parts := self._components) is not None:
            dataloader = parts.loaders.process(dataloader)
            if parts.even is not None and self.lightning_module.trainer.training:
                dataloader = parts.even.wrap(dataloader)
        return dataloader

    # ------------------------------------------------------------------ training

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        parts = self._components
        assert parts is not None and parts.aggregation is not None and parts.fusion is not None
        parts.loaders.training_loaders_built()
        if parts.even is not None:
            parts.even.check_combination(*_lightning.training_loaders_combination(self.lightning_module.trainer))
        parts.aggregation.on_train_start(self.config.gradient_compression)
        parts.fusion.on_train_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if batch_idx == 0:
            # Lightning reads the loaders' lengths once per fit: a resharded resumed epoch has another length
            _lightning.refresh_training_batch_count(self.lightning_module.trainer)
        parts = self._components
        assert parts is not None and parts.fusion is not None
        if parts.even is not None:
            parts.even.batch_taken()
        if (setting := parts.fusion.at_batch_start(batch_idx)) is not None:
            self.rewrap_ddp(setting)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if args and args[0] is NO_BATCH:  # this rank's stream ran out: DDP's step without running the model
            with self.precision_plugin.train_step_context():
                output = self._components.even.train_without_data(self.model, self.lightning_module)  # type: ignore
        else:
            output = super().training_step(*args, **kwargs)
        # the loss carries the averaged training metrics into DDP's gradient all-reduce (`carrier.GradientCarrier`)
        return carrier.join(output) if (carrier := self._metrics_carrier) else output

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if aggregation := self._components and self._components.aggregation:
            closure = aggregation.wrap_closure(optimizer, closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if fusion := self._components and self._components.fusion:
            fusion.on_train_end()

    # ------------------------------------------------------------------ DDP wrapping and its hook

    def _backend(self) -> str:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return str(torch.distributed.get_backend())
        return self._get_process_group_backend()

    @override
    def configure_ddp(self) -> None:
        """Wrap in DDP; with ``auto_tune_tensor_fusion``, with the tuned setting or the first one to measure."""
        if (fusion := self._components and self._components.fusion) and self.config.auto_tune_tensor_fusion:
            setting = fusion.initial_setting(self.lightning_module, self.world_size, self.root_device, self._backend())
            _lightning.set_ddp_kwargs(self, setting.ddp_kwargs())
        with self._carrier_registered():
            super().configure_ddp()

    @property
    def _metrics_carrier(self) -> GradientCarrier | None:
        return self._components.carrier if self._components is not None else None

    def _carrier_registered(self) -> AbstractContextManager[None]:
        """While DDP is built, the metrics carrier is one of the module's parameters (none without a carrier)."""
        carrier = self._metrics_carrier
        return carrier.registered_on(self.lightning_module) if carrier else nullcontext()

    @override
    def _register_ddp_hooks(self) -> None:
        # The stock implementation registers hooks on CUDA only; ours on every device type.
        self.register_communication_hook()

    def register_communication_hook(self) -> None:
        """Register the gradient communication hook on the current DDP wrapper (``self.model``); call it again
        after re-wrapping DDP (see :class:`~lightning_shardplus.compression.CommunicationHook`)."""
        if isinstance(self.model, DistributedDataParallel) and self._components is not None:
            assert self._components.hook is not None
            self._components.hook.register(self.model)

    def rewrap_ddp(self, setting: BucketSetting) -> None:
        """Wrap the module in a new DDP with ``setting``'s buckets and register the communication hook on it. A
        collective: call it on every rank at the same optimizer-step boundary (outside ``no_sync``)."""
        with self._carrier_registered():
            _lightning.rewrap_ddp(self, setting.ddp_kwargs())
        self.register_communication_hook()

    # ------------------------------------------------------------------ evaluation

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if fusion := self._components and self._components.fusion:
            fusion.interrupt()  # the training step in progress is not timed
        if self._exact_across_ranks and isinstance(self.model, DistributedDataParallel):
            share_rank_zero_buffers(self.lightning_module, _lightning.ddp_kwargs(self))

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if (exact := self._components and self._components.exact) and exact.deferring:
            # Exact evaluation: no per-batch collective (ranks hold different numbers of batches); the logged
            # values are reduced once at the epoch end by `metrics.ExactEvaluation`.
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def _evaluation_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        """Exact evaluation runs ``step`` of the LightningModule directly, not through the DDP forward: there are
        no gradients to reduce, and DDP's forward may broadcast buffers (BatchNorm statistics) at every batch."""
        if not self._exact_across_ranks:
            return getattr(super(), step)(*args, **kwargs)
        contexts = {"validation_step": "val_step_context", "test_step": "test_step_context"}
        with getattr(self.precision_plugin, contexts.get(step, "predict_step_context"))():
            return getattr(self.lightning_module, step)(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict_step", *args, **kwargs)

    @override
    def on_predict_end(self) -> None:
        """Where Lightning returns predictions, rank 0 returns every rank's, in dataset order; the others their
        own (``loaders.gather_predictions``)."""
        super().on_predict_end()
        if self._exact_across_ranks:
            gather_predictions(self.lightning_module.trainer.predict_loop, self.num_replicas)
