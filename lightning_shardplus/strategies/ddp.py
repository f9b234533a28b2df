"""``ShardPlusStrategy``: DDP with shardplus's data side (``data_side``) and its gradient side: communication
hooks, tensor fusion and its tuning, evaluation without DDP's forward."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus.data.sharding import PaddingMode
from lightning_shardplus.data.uneven import NoBatch, UnevenInputs
from lightning_shardplus.gradients.ddp.compression import GradientCompression, remove_rank_states
from lightning_shardplus.gradients.ddp.config import check_arguments
from lightning_shardplus.gradients.ddp.fusion import BucketSetting, FusionResult
from lightning_shardplus.gradients.ddp.side import DDPGradients, DDPRun
from lightning_shardplus.gradients.ddp.steps import forward_without_data, share_rank_zero_buffers
from lightning_shardplus.launch import check_accelerator
from lightning_shardplus.strategies.data_side import ShardPlusDataSide


class ShardPlusStrategy(ShardPlusDataSide, DDPStrategy):
    """DDP with the training optimizations of Horovod, Determined and NVIDIA Clara Train, for Lightning.

    Args:
        accelerator: Lightning's accelerator (an ``Accelerator`` or a name such as ``"cpu"``, ``"gpu"``); None: the
            Trainer's.
        parallel_devices: the devices of this node's processes; None: the Trainer's.
        cluster_environment: how the processes find each other (a ``ClusterEnvironment``); None: the Trainer's.
        checkpoint_io: how checkpoints are written and read (a ``CheckpointIO``); None: Lightning's.
        precision_plugin: the precision (a ``Precision``); None: the Trainer's.
        ddp_comm_state: the state of ``ddp_comm_hook`` (a ``PowerSGDState`` configures
            ``gradient_compression="powersgd"``).
        ddp_comm_hook: DDP's communication hook, registered on every device type.
        ddp_comm_wrapper: a wrapper of ``ddp_comm_hook`` (e.g. fp16 compression of its buckets).
        model_averaging_period: with a ``PostLocalSGDState`` as ``ddp_comm_state``: optimizer steps between model
            averages.
        process_group_backend: the process group's backend (``"gloo"``, ``"nccl"``, ...); None: the device's.
        timeout: the process group's timeout, a ``timedelta`` or seconds.
        start_method: ``"popen"`` (Lightning's subprocess launcher), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        aggregation_frequency: micro-batches per optimizer step (replaces ``accumulate_grad_batches``).
        average_aggregated_gradients: the mean of the aggregated gradients (True) or their sum (False).
        gradient_compression: DDP's communication hook: ``"none"``, ``"fp16"``, ``"bf16"`` or ``"powersgd"``.
        shard_padding: short training shards filled with the first element (``"first"``) or wrapped (``"wrap"``).
        shuffle_seed: seed of the training epoch permutation; None: the ``seed_everything`` seed, else 0.
        exact_evaluation: unpadded evaluation shards; epoch metrics equal a single-process run.
        verify_sharding: debug aid: check after each training epoch that the shards were disjoint and complete.
        tensor_fusion_threshold_mb: DDP's bucket size (``bucket_cap_mb``); None: DDP's default.
        auto_tune_tensor_fusion: choose the bucket size by measuring the first optimizer steps.
        autotune_log: CSV file of the measured samples (rank 0); None: no log.
        autotune_candidates_mb: bucket sizes raced; None: chosen from the model's gradient size.
        autotune_first_bucket_candidates_mb: first-bucket sizes raced; None: 1 MB, DDP's own first bucket.
        autotune_steps_per_sample: timed optimizer steps per sample.
        autotune_warmup_steps: optimizer steps not timed after each re-wrap.
        autotune_cache: JSON cache of tuned results: True (the user cache folder), a path, or False.
        average_training_metrics: training values logged ``on_step`` are averaged over all ranks.
        uneven_inputs: training streams of different lengths per rank: ``"join"`` or ``"drop"``.
        find_unused_parameters: DDP's: find the parameters a step gives no gradient; None: DDP's default (False).
        static_graph: DDP's: the set of used parameters is the same in every step.
        gradient_as_bucket_view: DDP's: the gradients are views into its buckets (saves memory).
        broadcast_buffers: DDP's: rank 0's buffers sent to every rank at each forward; None: DDP's default.

    DistributedDataParallel's other keyword arguments pass through; ``docs/arguments.md``.
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
        config, timeout, ddp_kwargs, ddp_defaults = check_arguments(locals())
        super().__init__(  # in DDPStrategy's order; `bucket_cap_mb` by name, hiding it from LightningCLI's kwargs
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, ddp_comm_state,
            None, None, model_averaging_period, process_group_backend, timeout, start_method,
            bucket_cap_mb=config.tensor_fusion_threshold_mb, **ddp_kwargs,
        )  # fmt: skip (the hook and its wrapper are registered by `register_communication_hook`, on every device)
        _lightning.set_ddp_kwargs(self, dict.fromkeys(ddp_defaults))  # DDP's defaults left out, as with "ddp"
        self._init_data_side(config)
        self._user_hook, self.start_method = (ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper), start_method  # as given

    @property
    def num_replicas(self) -> int:
        return self.started_processes

    @property
    def fusion_result(self) -> FusionResult | None:
        """What tensor-fusion tuning decided in this fit (rank 0 holds the timings); None without tuning."""
        return run.fusion.result if (run := self._ddp_run) else None

    @property
    def fusion_tuning(self) -> bool:
        """Whether tensor-fusion autotuning is still measuring (DDP may be re-wrapped at the next step)."""
        return bool((run := self._ddp_run) and run.fusion.tuning)

    @DDPStrategy.accelerator.setter
    def accelerator(self, accelerator: pl.accelerators.Accelerator) -> None:
        check_accelerator(accelerator, self.strategy_name, self.start_method)  # MPS refused, as for the DDP family
        DDPStrategy.accelerator.fset(self, accelerator)

    @override
    def _gradient_side(self) -> DDPGradients:
        return DDPGradients(self.config, self._user_hook, _lightning.ddp_kwargs(self))

    @property
    def _ddp_run(self) -> DDPRun | None:
        """DDP's state in this fit (its hook and bucket setting); None outside a fit."""
        return self._components.gradients if self._components is not None else None  # type: ignore[return-value]

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        remove_rank_states(filepath, self.global_rank)  # every rank: its files beside the checkpoint

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if (run := self._ddp_run) and (setting := run.fusion.at_batch_start(batch_idx)):
            self.rewrap_ddp(setting)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], NoBatch):  # this rank's stream ran out: DDP's step without running the model
            self._components.even.step_without_data()  # type: ignore[union-attr]  (what it logs counts nowhere)
            with self.precision_plugin.train_step_context():
                return forward_without_data(self.model, self.lightning_module, self._changes)
        return super().training_step(*args, **kwargs)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if run := self._ddp_run:
            run.fusion.on_train_end()

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()  # DDPStrategy registers no hook: it has none (it would, on CUDA only)
        self.register_communication_hook()

    @override
    def on_train_start(self) -> None:
        """With ``auto_tune_tensor_fusion``, DDP re-wrapped with the tuned setting or the race's first, unless it is the
        reference DDP was wrapped with (the cache key holds the per-device batch size: the loaders are built now)."""
        if (run := self._ddp_run) and self.config.auto_tune_tensor_fusion:
            module, device, backend = self.lightning_module, self.root_device, self._components.backend
            setting = run.fusion.initial_setting(module, self.world_size, device, backend)
            if setting != run.fusion.settings.reference:
                self.rewrap_ddp(setting)
        super().on_train_start()
        if run := self._ddp_run:
            run.fusion.on_train_start()

    def register_communication_hook(self) -> None:
        """Register the gradient communication hook on the current DDP wrapper; again after each re-wrap."""
        if isinstance(self.model, DistributedDataParallel) and (run := self._ddp_run):
            run.hook.register(self.model)

    def rewrap_ddp(self, setting: BucketSetting) -> None:
        """Wrap the module in a new DDP with ``setting``'s buckets: a collective, at the same step on every rank."""
        _lightning.rewrap_ddp(self, setting.ddp_kwargs())
        self.register_communication_hook()

    # ------------------------------------------------------------------ evaluation

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if run := self._ddp_run:
            run.fusion.interrupt()  # the training step in progress is not timed
        if self._exact_across_ranks and isinstance(self.model, DistributedDataParallel):
            share_rank_zero_buffers(self.lightning_module, _lightning.ddp_kwargs(self))

    def _evaluate(self, through_ddp: Callable, step: Callable, context: Callable, args: tuple, kwargs: dict) -> Any:
        """Exact evaluation runs the module's ``step`` in its precision ``context``, without DDP's forward (no
        gradients; no buffer broadcast per batch); else the step goes ``through_ddp`` as under ``"ddp"``."""
        if not self._exact_across_ranks:
            return through_ddp(*args, **kwargs)
        with context():
            return step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        module, precision = self.lightning_module, self.precision_plugin
        return self._evaluate(super().validation_step, module.validation_step, precision.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        module, precision = self.lightning_module, self.precision_plugin
        return self._evaluate(super().test_step, module.test_step, precision.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        module, precision = self.lightning_module, self.precision_plugin
        return self._evaluate(super().predict_step, module.predict_step, precision.predict_step_context, args, kwargs)
