"""``ShardPlusStrategy``: DDP with padded equal training shards, exact evaluation shards, gradient
aggregation, gradient compression and tuned fusion.

The strategy validates its arguments and wires the algorithm modules into Lightning's hooks; the algorithms
themselves live in :mod:`lightning_shardplus.sharding`, :mod:`lightning_shardplus.aggregation`,
:mod:`lightning_shardplus.compression`, :mod:`lightning_shardplus.metrics` and :mod:`lightning_shardplus.fusion`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler, Sampler
from typing_extensions import override

from lightning_shardplus import _lightning, aggregation, compression, fusion, sharding
from lightning_shardplus._validation import (
    check_bool,
    check_choice,
    check_int,
    check_positive_number,
    check_process_group_backend,
    process_group_timeout,
)
from lightning_shardplus.callbacks import VerifySharding
from lightning_shardplus.compression import GRADIENT_COMPRESSIONS, CommunicationHookWrapper, GradientCompression
from lightning_shardplus.datamodule import ShardPlusDataModule, per_device_batch_size
from lightning_shardplus.launch import check_launcher_world_size
from lightning_shardplus.metrics import AverageTrainingMetrics, ExactEvaluation
from lightning_shardplus.sharding import (
    PADDING_MODES,
    ExactShardSampler,
    PaddedShardSampler,
    PaddingMode,
    PlaceholderShardSampler,
)

log = logging.getLogger(__name__)

# Keyword arguments DDPStrategy forwards to torch's DistributedDataParallel.
_DDP_KWARGS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {
    "self",
    "module",
    "device_ids",
    "bucket_cap_mb",  # set through `tensor_fusion_threshold_mb`
}

# Set on a DistributedDataParallel wrapper once `register_communication_hook` has given it its hook.
_HOOK_REGISTERED = "_shardplus_hook_registered"

_EVALUATION_STAGES = (
    RunningStage.VALIDATING,
    RunningStage.SANITY_CHECKING,
    RunningStage.TESTING,
    RunningStage.PREDICTING,
)



class _LaunchAfterPreflight:
    """A launcher's ``launch``, run after the strategy's :meth:`ShardPlusStrategy.preflight`. A class, not a
    closure: the spawn and forkserver launchers pickle the Trainer, its strategy and this launcher with it."""

    def __init__(self, strategy: ShardPlusStrategy, launch: Callable) -> None:
        self.strategy, self.launch = strategy, launch

    def __call__(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self.strategy.preflight(*args, *kwargs.values(), trainer=trainer)
        return self.launch(function, *args, trainer=trainer, **kwargs)


class ShardPlusStrategy(DDPStrategy):
    """DDP for synchronous data-parallel training, with the training optimizations of Horovod, Determined and
    NVIDIA Clara Train.

    Args:
        aggregation_frequency: micro-batches per optimizer step (Determined's name; Horovod's
            ``backward_passes_per_step``). The gradients of all but the last micro-batch of a window stay
            local (DDP ``no_sync`` over forward and backward); the last one all-reduces the window's gradient
            once. The effective batch is ``per-device batch x world size x aggregation_frequency``
            (:attr:`effective_batch_size`, reported when training starts). Built on Lightning's accumulation
            loop (``trainer.accumulate_grad_batches`` is set to it, so do not also give the Trainer a
            different ``accumulate_grad_batches``), with the normalization of a short last window corrected:
            see :mod:`lightning_shardplus.aggregation`. LR schedulers with ``interval="step"`` step once per
            optimizer step. Needs automatic optimization.
        average_aggregated_gradients: True: the optimizer sees the mean gradient over the micro-batches
            actually aggregated (also in a short last window); False: their sum (Horovod's semantics; it is
            still averaged over processes). The correction is applied after the all-reduce and before AMP
            unscaling, ``on_before_optimizer_step`` and gradient clipping. With ShardPlusStrategy a plain
            ``Trainer(accumulate_grad_batches=N)`` gets the same treatment.
        gradient_compression: the DDP communication hook, registered on every device type (CPU/gloo included)
            and again whenever DDP is re-wrapped: ``"none"`` (DDP's all-reduce), ``"fp16"`` or ``"bf16"`` (the
            bucket all-reduced in 16 bits: half the bytes; bf16 works on gloo too), ``"powersgd"`` (low-rank
            PowerSGD with error feedback and warm start, by default rank 1 from the 10th communicating step;
            pass a ``PowerSGDState`` as ``ddp_comm_state`` to configure it; on backends other than NCCL its
            buckets are reduced one after the other, which avoids the hang of torch's hook with several
            buckets on gloo; its per-rank state is saved in checkpoints). It runs only on the micro-batches
            that communicate. A backend that cannot run it fails at setup. See
            :mod:`lightning_shardplus.compression`. Give either this or ``ddp_comm_hook``, not both.
        shard_padding: how short training shards are filled: ``"first"`` (the dataset's first element, as
            Clara Train) or ``"wrap"`` (the epoch order's first indices, as torch's ``DistributedSampler``).
        shuffle_seed: seed of the training epoch permutation; None takes the seed given to
            ``seed_everything`` (``PL_GLOBAL_SEED``), else 0.
        exact_evaluation: validation, test and predict loaders get unpadded shards, so every sample is
            evaluated exactly once; False keeps Lightning's padded ``DistributedSampler``.
        verify_sharding: debug aid: at the end of each training epoch the ranks check together that their
            shards were disjoint and covered the dataset.
        tensor_fusion_threshold_mb: DDP's gradient bucket size (``bucket_cap_mb``); None: DDP's default (25 MB,
            the first bucket 1 MB, as ``strategy="ddp"``), or the tuned size with ``auto_tune_tensor_fusion``. A
            size given here is kept as it is (every bucket that size, as DDP does), also when tuning.
        auto_tune_tensor_fusion: choose the bucket size by measuring the first optimizer steps of training under
            each of ``autotune_candidates_mb`` and DDP's default, DDP re-wrapped between samples; training goes
            on with the fastest, and the result is cached (``autotune_cache``) so that the next run with the same
            model, world size, device, backend and torch starts tuned. With a ``tensor_fusion_threshold_mb`` of
            your own only the first bucket is tuned. See :mod:`lightning_shardplus.fusion`.
        autotune_log: CSV file with one row per measured sample (written by rank 0).
        autotune_candidates_mb: bucket sizes raced (default 1, 4, 16, 25, 64 MB).
        autotune_first_bucket_candidates_mb: sizes of the first bucket raced against the chosen setting once
            the bucket size is chosen (default 1 MB, DDP's own first bucket; torch >= 2.13, ``bucket_cap_mb_list``).
            An empty list races none (DDP's default, with its 1 MB first bucket, is still raced first).
        autotune_steps_per_sample: timed optimizer steps per sample (default 8).
        autotune_warmup_steps: optimizer steps not timed after each re-wrap (default 1: DDP cuts its buckets
            after the first step of a new wrapper).
        autotune_cache: JSON cache of tuned results: True for ``~/.cache/lightning_shardplus/fusion.json``, a
            path, or False to search in every new run (a fit resumed from a checkpoint of a finished tuning goes
            on with the checkpoint's bucket size either way).
        average_training_metrics: values logged with ``on_step=True`` from ``training_step`` and the
            training-batch hooks are replaced by their batch-weighted mean over all ranks (``sync_dist=True``
            sum/max/min values by that reduction) before loggers, the progress bar or ``callback_metrics`` see
            them, with one fused all_reduce per optimizer step; False keeps Lightning's behaviour (rank 0's
            own values, a barrier and an all_reduce per ``sync_dist=True`` value). See
            :mod:`lightning_shardplus.metrics`.
        find_unused_parameters, static_graph, gradient_as_bucket_view, broadcast_buffers: passed to
            ``DistributedDataParallel``, as are other keyword arguments it accepts.

    The remaining arguments are ``DDPStrategy``'s; unlike ``DDPStrategy``, a ``ddp_comm_hook`` (and
    ``ddp_comm_wrapper``, which also wraps the hook of ``gradient_compression``) is registered on every device
    type, not only on CUDA.
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
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        check_choice("start_method", start_method, ("popen", "spawn", "fork", "forkserver"))
        timeout = process_group_timeout(timeout)
        if process_group_backend is not None:
            check_process_group_backend(process_group_backend)
        for name, flag in (
            ("find_unused_parameters", find_unused_parameters),
            ("static_graph", static_graph),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
        ):
            check_bool(name, flag)
        if broadcast_buffers is not None:
            check_bool("broadcast_buffers", broadcast_buffers)
            ddp_kwargs["broadcast_buffers"] = broadcast_buffers  # only when given: torch 2.13 deprecates it
        check_int("aggregation_frequency", aggregation_frequency, minimum=1)
        check_bool("average_aggregated_gradients", average_aggregated_gradients)
        check_choice("gradient_compression", gradient_compression, GRADIENT_COMPRESSIONS)
        if gradient_compression != "none" and ddp_comm_hook is not None:
            raise ValueError(
                f"`gradient_compression`={gradient_compression!r} and `ddp_comm_hook`={ddp_comm_hook!r} both "
                "choose DDP's communication hook: give one of them (gradient_compression='none' for yours)."
            )
        if gradient_compression != "none" and ddp_comm_state is not None and not (
            gradient_compression == "powersgd" and isinstance(ddp_comm_state, PowerSGDState)
        ):
            raise ValueError(
                f"`ddp_comm_state`={ddp_comm_state!r} does not go with `gradient_compression`="
                f"{gradient_compression!r}: only 'powersgd' takes a state (a PowerSGDState)."
            )
        check_choice("shard_padding", shard_padding, PADDING_MODES)
        if shuffle_seed is not None:
            check_int("shuffle_seed", shuffle_seed, minimum=0)
        check_bool("exact_evaluation", exact_evaluation)
        check_bool("verify_sharding", verify_sharding)
        if tensor_fusion_threshold_mb is not None:
            check_positive_number("tensor_fusion_threshold_mb", tensor_fusion_threshold_mb)
        check_bool("auto_tune_tensor_fusion", auto_tune_tensor_fusion)
        if autotune_log is not None and not isinstance(autotune_log, (str, os.PathLike)):
            raise TypeError(f"`autotune_log`={autotune_log!r} is not valid: expected a file path or None.")
        if not isinstance(autotune_cache, (bool, str, os.PathLike)):
            raise TypeError(f"`autotune_cache`={autotune_cache!r} is not valid: expected True, False or a file path.")
        # checks the search settings (candidates, steps) even when tuning is off: a YAML typo fails early
        autotune_settings = fusion.AutotuneSettings(
            candidates_mb=fusion.DEFAULT_CANDIDATES_MB if autotune_candidates_mb is None else autotune_candidates_mb,
            first_bucket_candidates_mb=fusion.DEFAULT_FIRST_BUCKET_CANDIDATES_MB
            if autotune_first_bucket_candidates_mb is None
            else autotune_first_bucket_candidates_mb,
            steps_per_sample=autotune_steps_per_sample,
            warmup_steps=autotune_warmup_steps,
            fixed_bucket_cap_mb=None if tensor_fusion_threshold_mb is None else float(tensor_fusion_threshold_mb),
        )
        caps = ddp_kwargs.get("bucket_cap_mb_list")
        if caps is not None and (auto_tune_tensor_fusion or tensor_fusion_threshold_mb is not None):
            other = (
                "`auto_tune_tensor_fusion`=True"
                if auto_tune_tensor_fusion
                else f"`tensor_fusion_threshold_mb`={tensor_fusion_threshold_mb!r}"
            )
            raise ValueError(
                f"`bucket_cap_mb_list`={caps!r} and {other} both set DDP's bucket sizes (DDP would take the list and "
                "ignore the size): give one of them."
            )
        if auto_tune_tensor_fusion and ddp_comm_hook is not None and ddp_comm_state is not None:
            raise ValueError(
                f"`ddp_comm_state`={ddp_comm_state!r} with `auto_tune_tensor_fusion`=True: tuning re-wraps DDP with "
                "other buckets, and a hook state kept per bucket (PowerSGD's error feedback) would no longer fit. "
                "Use `gradient_compression='powersgd'` (its state is rebuilt on re-wrap) or turn tuning off."
            )
        check_bool("average_training_metrics", average_training_metrics)
        if "bucket_cap_mb" in ddp_kwargs:
            raise TypeError(
                f"`bucket_cap_mb`={ddp_kwargs['bucket_cap_mb']!r} is not a ShardPlusStrategy option: "
                "set the bucket size with `tensor_fusion_threshold_mb`."
            )
        unknown = sorted(set(ddp_kwargs) - _DDP_KWARGS)
        if unknown:
            given = ", ".join(f"`{k}`={ddp_kwargs[k]!r}" for k in unknown)
            raise TypeError(
                f"ShardPlusStrategy got unknown option(s) {given}: valid are its own arguments and "
                f"DistributedDataParallel's ({', '.join(sorted(_DDP_KWARGS))})."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            # None: DDP's own default (25 MB buckets, the first 1 MB), as with strategy="ddp". Passed by name even
            # then: LightningCLI (jsonargparse) would otherwise offer DDP's `bucket_cap_mb` among `**ddp_kwargs`.
            bucket_cap_mb=None if tensor_fusion_threshold_mb is None else float(tensor_fusion_threshold_mb),
            **ddp_kwargs,
        )
        self.aggregation_frequency = aggregation_frequency
        self.average_aggregated_gradients = average_aggregated_gradients
        self.gradient_compression: GradientCompression = gradient_compression
        self.shard_padding: PaddingMode = shard_padding
        self.shuffle_seed = shuffle_seed
        self.exact_evaluation = exact_evaluation
        self.verify_sharding = verify_sharding
        # the bucket size in use: DDP's default 25 MB unless given, or the tuned one once tuning has decided
        self.tensor_fusion_threshold_mb = _lightning.ddp_kwargs(self)["bucket_cap_mb"] or fusion.DEFAULT_BUCKET_CAP_MB
        self.auto_tune_tensor_fusion = auto_tune_tensor_fusion
        self.autotune_log = autotune_log
        self.autotune_cache: str | bool = autotune_cache
        self.autotune_settings = autotune_settings
        self.fusion_result: fusion.FusionResult | None = None  # what tuning decided, on rank 0 with timings
        self._fusion_tuner: fusion.FusionAutotuner | None = None
        self._fusion_checkpoint: dict[str, Any] | None = None  # the tuned setting of a checkpoint being resumed
        self._fusion_cache_key: str | None = None  # what `fusion_result` holds for
        self._restore_warnings: Callable[[], None] | None = None  # undoes a warning filter set in `setup`
        # Set by ExactEvaluation while an evaluation epoch runs: logged values are reduced at its end instead.
        self.defer_logging_sync = False
        self._compression: compression.CastCompression | compression.PowerSGDCompression | None = None
        self._compression_checkpoint: dict[str, Any] | None = None  # from a checkpoint, until registered
        # The training samplers' progress from a checkpoint, until the training loaders are built; and how many
        # of its sampler states were given to samplers so far.
        self._sampler_checkpoint: dict[str, Any] | None = None
        self._sampler_states_used = 0
        self._user_accumulate_grad_batches: int | None = None
        self.average_training_metrics = average_training_metrics

    # ------------------------------------------------------------------ registration

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (
            ("shardplus", "popen"),
            ("shardplus_spawn", "spawn"),
            ("shardplus_fork", "fork"),
            ("shardplus_notebook", "fork"),
        ):
            strategy_registry.register(
                name,
                cls,
                description=f"ShardPlus data-parallel strategy with `start_method` '{start_method}'",
                start_method=start_method,
                override=True,
            )

    # ------------------------------------------------------------------ wiring

    @property
    def epoch_seed(self) -> int:
        """Seed of the epoch permutation: ``shuffle_seed``, else the ``seed_everything`` seed, else 0."""
        if self.shuffle_seed is not None:
            return self.shuffle_seed
        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        kwargs = super().distributed_sampler_kwargs
        kwargs["seed"] = _lightning.InjectedSeed(self.epoch_seed)
        return kwargs

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        # Check what the user handed to fit/validate/test/predict in the launching process, before any worker
        # or process group starts (the launcher keeps its type: Lightning checks it with isinstance).
        self._launcher.launch = _LaunchAfterPreflight(self, self._launcher.launch)

    def preflight(self, *call_args: Any, trainer: pl.Trainer | None = None) -> None:
        """Refuse, before any process starts, the arguments of a Trainer call that cannot work at this world
        size or with this strategy's options."""
        check_launcher_world_size(self.cluster_environment, self.num_processes, self.num_nodes)
        for arg in call_args:
            if isinstance(arg, ShardPlusDataModule):
                per_device_batch_size(arg.global_batch_size, self.num_replicas)
        if trainer is not None:
            model = next((arg for arg in call_args if isinstance(arg, pl.LightningModule)), None)
            self._check_aggregation(trainer, model)

    def _check_aggregation(self, trainer: pl.Trainer, model: pl.LightningModule | None) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            return
        frequency = self.aggregation_frequency
        accumulate = self._user_accumulate_grad_batches or trainer.accumulate_grad_batches
        aggregation.check_accumulation(frequency, accumulate)
        if frequency == 1:
            return
        if model is not None and not model.automatic_optimization:
            raise ValueError(
                f"`aggregation_frequency`={frequency} needs automatic optimization, but "
                f"{type(model).__name__} sets `automatic_optimization = False`: use aggregation_frequency=1 "
                "and aggregate yourself (manual_backward inside `self.trainer.strategy.model.no_sync()` on "
                "all but the last micro-batch)."
            )
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise ValueError(
                f"`aggregation_frequency`={frequency} and a GradientAccumulationScheduler callback both set "
                "the micro-batches per optimizer step: use one of them (aggregation_frequency=1 to keep the "
                "scheduler)."
            )

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        if self.exact_evaluation:
            # Exact evaluation shards are empty on some ranks when the dataset is smaller than the world size.
            model.allow_zero_length_dataloader_with_multiple_devices = True
        trainer = _lightning.attached_trainer(model)
        if trainer is not None:
            self._check_aggregation(trainer, model)
            fitting = trainer.state.fn == TrainerFn.FITTING
            if fitting and self.aggregation_frequency > 1 and self._user_accumulate_grad_batches is None:
                # Lightning's accumulation loop does the windows (no_sync, zero_grad, step, schedulers); the
                # user's value is put back in teardown.
                self._user_accumulate_grad_batches = trainer.accumulate_grad_batches
                trainer.accumulate_grad_batches = self.aggregation_frequency

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            _lightning.destroy_process_group_at_exit()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.verify_sharding and not any(isinstance(cb, VerifySharding) for cb in trainer.callbacks):
            trainer.callbacks.append(VerifySharding())
        if self._exact_across_ranks and not any(isinstance(cb, ExactEvaluation) for cb in trainer.callbacks):
            # first, so that the epoch values are exact before any other callback reads them
            trainer.callbacks.insert(0, ExactEvaluation())
        if self._exact_across_ranks and self._restore_warnings is None:
            self._restore_warnings = _lightning.silence_evaluation_sampler_warning()
        if trainer.state.fn == TrainerFn.FITTING:
            self._compression = compression.build_compression(self.gradient_compression, self._ddp_comm_state)
            if self._compression is not None:
                self._compression.check_backend(self._backend(), self.root_device)
            if self._compression_checkpoint is not None:
                self._restore_compression(self._compression_checkpoint)
        averaging = any(isinstance(cb, AverageTrainingMetrics) for cb in trainer.callbacks)
        if self.average_training_metrics and not averaging:
            # first: the metrics are averaged before any other callback's `on_train_batch_end` reads them
            trainer.callbacks.insert(0, AverageTrainingMetrics())
        super().setup(trainer)

    @property
    def _exact_across_ranks(self) -> bool:
        return self.exact_evaluation and self.num_replicas > 1

    # ------------------------------------------------------------------ evaluation

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if self.defer_logging_sync:
            # Exact evaluation: no per-batch collective (ranks hold different numbers of batches); the logged
            # values are reduced once at the epoch end by `metrics.ExactEvaluation`.
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def _share_rank_zero_buffers(self) -> None:
        """Before evaluating mid-fit, give every rank rank 0's buffers (BatchNorm running statistics), as DDP's
        next forward would: each rank's last training step updated its own copy, and evaluation skips DDP."""
        kwargs = _lightning.ddp_kwargs(self)
        sync = kwargs.get("forward_sync_buffers")  # DDP: None is its default, True
        sync = kwargs.get("broadcast_buffers", True) if sync is None else sync
        if not (self._exact_across_ranks and sync):
            return
        if not isinstance(self.model, DistributedDataParallel):
            return  # validate/test/predict outside fit: DDPStrategy.setup synchronized the module already
        for buffer in self.lightning_module.buffers():
            torch.distributed.broadcast(buffer, src=0)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self._fusion_tuner is not None:
            self._fusion_tuner.interrupt()  # the training step in progress is not timed
        self._share_rank_zero_buffers()

    # Evaluation runs the LightningModule directly, not through the DDP forward: there are no gradients to
    # reduce, and DDP's forward may broadcast buffers (BatchNorm statistics), a per-batch collective.
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._exact_across_ranks:
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._exact_across_ranks:
            return super().test_step(*args, **kwargs)
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._exact_across_ranks:
            return super().predict_step(*args, **kwargs)
        with self.precision_plugin.predict_step_context():
            return self.lightning_module.predict_step(*args, **kwargs)

    @override
    def on_predict_end(self) -> None:
        """Where Lightning returns predictions, return every rank's: the exact shards are contiguous blocks in
        rank order, so concatenating the ranks' batch lists gives every sample once, in dataset order."""
        super().on_predict_end()
        loop = self.lightning_module.trainer.predict_loop
        if not (self._exact_across_ranks and loop.return_predictions):
            return
        per_loader = [loop.predictions] if loop.num_dataloaders == 1 else loop.predictions
        for predictions in per_loader:
            gathered: list[Any] = [None] * self.num_replicas
            torch.distributed.all_gather_object(gathered, predictions)
            predictions[:] = [batch for rank_batches in gathered for batch in rank_batches]

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        trainer = _lightning.attached_trainer(module)
        if trainer is not None and self._user_accumulate_grad_batches is not None:
            trainer.accumulate_grad_batches = self._user_accumulate_grad_batches
        self._user_accumulate_grad_batches = None
        self._compression_checkpoint = None
        self._sampler_checkpoint, self._sampler_states_used = None, 0
        self._fusion_tuner, self._fusion_checkpoint = None, None
        if self._restore_warnings is not None:
            self._restore_warnings()
            self._restore_warnings = None
        super().teardown()

    # ------------------------------------------------------------------ aggregation

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches per optimizer step: ``aggregation_frequency`` (or, with it left at 1, the Trainer's
        ``accumulate_grad_batches``)."""
        module = self.lightning_module
        trainer = _lightning.attached_trainer(module)
        if trainer is None:
            return self.aggregation_frequency
        return aggregation.micro_batches_per_step(trainer)

    @property
    def effective_batch_size(self) -> int | None:
        """Samples per optimizer step over all processes: ``per-device batch x world size x micro-batches per
        step``, once the training data is known (None before, or when the batch size cannot be found).
        ``ScaleLearningRate`` scales with the same figure."""
        module = self.lightning_module
        trainer = _lightning.attached_trainer(module)
        return None if trainer is None else aggregation.effective_batch_size(trainer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # the training loaders are built: a later reload (reload_dataloaders_every_n_epochs) starts its epoch whole
        self._sampler_checkpoint, self._sampler_states_used = None, 0
        trainer = self.lightning_module.trainer
        per_device = aggregation.micro_batch_size(trainer)
        micro_batches = self.micro_batches_per_step
        if trainer.ckpt_path is not None and micro_batches > 1:
            # resumed at an optimizer step: checkpointing "every n steps" must not save again mid-window
            _lightning.mark_resumed_step_saved(trainer)
        batch = "unknown" if per_device is None else str(self.effective_batch_size)
        rank_zero_info(
            f"shardplus: effective batch {batch} = {per_device or '?'} per device x {trainer.world_size} "
            f"processes x {micro_batches} micro-batches per optimizer step "
            f"({'mean' if self.average_aggregated_gradients else 'sum'} of aggregated gradients); "
            f"gradient compression {self.gradient_compression!r}"
        )
        self._start_fusion_tuning()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if batch_idx == 0:
            # Lightning reads the training loaders' lengths once per fit; after a mid-epoch resume on another
            # world size or batch size, the resumed epoch and the next have different lengths.
            _lightning.refresh_training_batch_count(self.lightning_module.trainer)
        self._tune_fusion_at_step_boundary(batch_idx)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        closure = self._normalizing_closure(optimizer, closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _normalizing_closure(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (forward + backward of the window's last micro-batch, whose backward all-reduced the
        window's gradient), then the gradient corrected from Lightning's ``sum(loss / N)`` to the mean over
        the micro-batches actually aggregated (or their sum). Runs before unscaling, hooks and clipping."""
        module = self.lightning_module
        trainer = _lightning.attached_trainer(module)
        if trainer is None or not module.automatic_optimization or not trainer.training:
            return closure
        frequency = trainer.accumulate_grad_batches
        if frequency == 1:
            return closure

        def closure_then_normalize() -> Any:
            result = closure()
            aggregated = aggregation.window_length(_lightning.micro_batches_done_in_epoch(trainer), frequency)
            factor = aggregation.gradient_correction(frequency, aggregated, self.average_aggregated_gradients)
            parameters = (p for group in optimizer.param_groups for p in group["params"])
            aggregation.scale_gradients(parameters, factor)
            return result

        return closure_then_normalize

    # ------------------------------------------------------------------ tensor fusion

    @override
    def configure_ddp(self) -> None:
        """Wrap in DDP; with ``auto_tune_tensor_fusion``, with the cached tuned setting or the first candidate."""
        self._fusion_tuner = None
        trainer = self.lightning_module.trainer
        if self.auto_tune_tensor_fusion and trainer.state.fn == TrainerFn.FITTING:
            tuner = self._fusion_tuner = self._build_fusion_tuner()
            self._fusion_cache_key = tuner.cache_key
            self._set_bucket_setting(tuner.initial_setting)
            self.fusion_result = tuner.result  # set when the cache had it (or there was nothing to search)
        super().configure_ddp()

    def _build_fusion_tuner(self) -> fusion.FusionAutotuner:
        module = self.lightning_module
        parameters = [p for p in module.parameters() if p.requires_grad]
        # what the best bucket size depends on, beside the parameters, world size, device, backend and torch
        extra = {
            "search": self.autotune_settings.describe(),
            "gradient_compression": self.gradient_compression,
            "ddp_comm_hook": getattr(self._ddp_comm_hook, "__qualname__", None),
            "micro_batches_per_step": self.micro_batches_per_step,
            **{
                k: _lightning.ddp_kwargs(self).get(k)
                for k in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")
            },
        }
        key = fusion.cache_key(parameters, self.world_size, self.root_device.type, self._backend(), extra)
        cache = fusion.DEFAULT_CACHE_PATH if self.autotune_cache is True else (self.autotune_cache or None)
        return fusion.FusionAutotuner(
            self.autotune_settings,
            fusion.Collectives.torch_distributed(self.root_device),
            log_path=self.autotune_log,
            cache_path=cache,
            cache_key=key,
            gradient_bytes=sum(p.numel() * p.element_size() for p in parameters),
            checkpointed=self._fusion_checkpoint,
            # with find_unused_parameters DDP keeps its first-iteration buckets (other cuts): no merging then
            layout=None
            if extra["find_unused_parameters"]
            else functools.partial(fusion.bucket_layout, parameters),
        )

    def _set_bucket_setting(self, setting: fusion.BucketSetting) -> None:
        _lightning.set_ddp_kwargs(self, setting.ddp_kwargs())
        self.tensor_fusion_threshold_mb = setting.bucket_cap_mb

    @property
    def fusion_tuning(self) -> bool:
        """Whether tensor-fusion autotuning is still measuring (DDP may be re-wrapped at the next step)."""
        return self._fusion_tuner is not None and self._fusion_tuner.tuning

    def rewrap_ddp(self, setting: fusion.BucketSetting) -> None:
        """Wrap the module in a new DDP with ``setting``'s bucket sizes and register the communication hook on it
        again (``gradient_compression``'s state is rebuilt for the new buckets; a user ``ddp_comm_state`` is refused
        with tuning in ``__init__``). A collective: call it on every rank at the same optimizer-step boundary
        (outside ``no_sync``)."""
        self._set_bucket_setting(setting)
        _lightning.rewrap_ddp(self, {})
        self.register_communication_hook()

    def _tune_fusion_at_step_boundary(self, batch_idx: int) -> None:
        """While tuning: time the step that just ended and re-wrap DDP when the tuner moves to another setting."""
        tuner = self._fusion_tuner
        if tuner is None or not tuner.tuning:
            return
        trainer = self.lightning_module.trainer
        if batch_idx % trainer.accumulate_grad_batches:
            return  # inside an aggregation window: DDP is re-wrapped only between optimizer steps
        # the step that ended at an epoch's first batch spans the epoch end: not timed
        setting = tuner.on_step_boundary(trainer.global_step, counted=batch_idx > 0)
        if setting is not None:
            self.rewrap_ddp(setting)
        if not tuner.tuning:
            self._report_fusion(trainer)

    def _start_fusion_tuning(self) -> None:
        tuner = self._fusion_tuner
        if tuner is None:
            return
        if not tuner.tuning:
            self._report_fusion(self.lightning_module.trainer)
            return
        trainer = self.lightning_module.trainer
        settings = self.autotune_settings
        tuner.start(trainer.global_step)
        raced = tuner.candidates or [fusion.BucketSetting(self.tensor_fusion_threshold_mb)]
        same = "".join(
            f"; {', '.join(o.label for o in others)}: the same buckets as {kept.label} for this model"
            for kept, others in tuner.merged.items()
        )
        rank_zero_info(
            f"shardplus: tuning the tensor-fusion bucket size among {', '.join(s.label for s in raced)}{same}: at "
            f"most {settings.max_tuning_steps} optimizer steps"
        )
        total = trainer.estimated_stepping_batches
        if math.isfinite(total) and total < settings.max_tuning_steps:
            rank_zero_warn(
                f"shardplus: this run has {int(total)} optimizer steps, tensor-fusion tuning may take up to "
                f"{settings.max_tuning_steps}: it may end before tuning does (then nothing is cached). Give fewer "
                "`autotune_candidates_mb` or a smaller `autotune_steps_per_sample`."
            )

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        tuner = self._fusion_tuner
        if tuner is not None and tuner.tuning:
            tuner.finish_early()
            self._report_fusion(self.lightning_module.trainer)

    def _report_fusion(self, trainer: pl.Trainer) -> None:
        """The summary line, and the result to the Lightning loggers (rank 0, which holds the timings)."""
        assert self._fusion_tuner is not None
        result = self.fusion_result = self._fusion_tuner.result
        if result is None:
            return
        where = []
        if self.autotune_log and not result.from_cache:
            where.append(f"samples in {self.autotune_log}")
        if self._fusion_tuner.cache_path is not None and result.complete and result.source == "the autotune cache":
            where.append(f"cache {self._fusion_tuner.cache_path}")
        rank_zero_info(result.summary() + (f" ({'; '.join(where)})" if where else ""))
        if self.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(result.metrics(), step=trainer.global_step)

    # ------------------------------------------------------------------ compression

    def _backend(self) -> str:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return str(torch.distributed.get_backend())
        return self._get_process_group_backend()

    @override
    def _register_ddp_hooks(self) -> None:
        # The stock implementation registers hooks on CUDA only; ours on every device type.
        self.register_communication_hook()

    def register_communication_hook(self) -> None:
        """Register the gradient communication hook on the current DDP wrapper (``self.model``): the hook of
        ``gradient_compression`` or the user's ``ddp_comm_hook``, wrapped by ``ddp_comm_wrapper`` and by any
        :class:`~lightning_shardplus.compression.CommunicationHookWrapper` among the Trainer's callbacks
        (``CommunicationCounter``, ``ScalingReport``).

        Call it again after re-wrapping DDP (``self.model = self._setup_model(self.lightning_module)``): the
        compression state (PowerSGD's error feedback and warm start) carries over to the new wrapper. A
        wrapper that already has the hook is left alone."""
        model = self.model
        if not isinstance(model, DistributedDataParallel) or getattr(model, _HOOK_REGISTERED, False):
            return
        backend = self._backend()
        hook: Callable | None = self._ddp_comm_hook
        state = self._ddp_comm_state
        if self._compression is not None:
            hook, state = self._compression.hook_for(model, backend)
        trainer = _lightning.attached_trainer(self.lightning_module)
        wrappers = [cb for cb in trainer.callbacks if isinstance(cb, CommunicationHookWrapper)] if trainer else []
        if hook is None and (self._ddp_comm_wrapper is not None or wrappers):
            # DDP's all-reduce, as a hook that can be wrapped
            hook, state = default_hooks.allreduce_hook, None
        if hook is None:
            return
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        for wrapper in wrappers:
            hook = wrapper.wrap(hook)
        try:
            model.register_comm_hook(state, hook)
        except Exception as err:
            raise RuntimeError(
                f"DDP refused the communication hook {getattr(hook, '__qualname__', hook)!r} "
                f"(`gradient_compression`={self.gradient_compression!r}) on the {backend!r} backend: {err}"
            ) from err
        setattr(model, _HOOK_REGISTERED, True)

    def compression_state_dict(self) -> dict[str, Any] | None:
        """This rank's gradient-compression state (PowerSGD: per-parameter error feedback and warm-start P/Q,
        step counter, random generator); None for stateless compression or outside fit."""
        return None if self._compression is None else self._compression.state_dict()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Add every rank's compression state (PowerSGD's error feedback is per rank) to the checkpoint that
        rank 0 writes: a gather on all ranks, which Lightning's ``Trainer.save_checkpoint`` calls together."""
        state = self.compression_state_dict()
        if state is not None and "loops" in checkpoint:  # not for weights-only checkpoints
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                gathered: list[Any] | None = [None] * self.world_size if self.is_global_zero else None
                torch.distributed.gather_object(state, gathered, dst=0)
            else:
                gathered = [state]
            if self.is_global_zero:
                assert gathered is not None
                checkpoint[compression.CHECKPOINT_KEY] = compression.checkpoint_entry(
                    self.gradient_compression, gathered
                )
        tuned = fusion.checkpoint_entry(self.fusion_result, self._fusion_cache_key)
        if tuned is not None and "loops" in checkpoint:  # a training checkpoint (not weights only)
            checkpoint[fusion.CHECKPOINT_KEY] = tuned
        samplers = self._training_sampler_progress() if "loops" in checkpoint else None
        if samplers is not None:
            checkpoint[sharding.CHECKPOINT_KEY] = samplers
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _training_sampler_progress(self) -> dict[str, Any] | None:
        """The training samplers' progress at the last trained batch (see ``sharding.checkpoint_entry``), so
        that a resume reads exactly the samples that were next; None outside fit or without our samplers."""
        module = self.lightning_module
        trainer = _lightning.attached_trainer(module)
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return None
        samplers = []
        for loader in aggregation.dataloaders(trainer.train_dataloader):
            if isinstance(loader.sampler, PaddedShardSampler):
                samplers.append((loader.sampler, _loader_batch_size(loader)))
        if not samplers:
            return None
        batches_done = _lightning.micro_batches_trained_in_epoch(trainer)
        micro_batches = trainer.accumulate_grad_batches
        if batches_done % micro_batches and batches_done < trainer.num_training_batches:
            rank_zero_warn(
                f"shardplus: a checkpoint is saved after micro-batch {batches_done} of the epoch, inside an "
                f"aggregation window of {micro_batches}: the gradients accumulated so far are not in it, so a "
                "run resumed from it does not equal an uninterrupted one. Save at optimizer steps (ModelCheckpoint "
                "every_n_train_steps counts them)."
            )
        return sharding.checkpoint_entry(batches_done, samplers)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # DDP restores checkpoints before `setup`, which builds this fit's compression state and restores this
        self._compression_checkpoint = checkpoint.get(compression.CHECKPOINT_KEY)
        # and before the training loaders are built, whose samplers continue the checkpoint's epoch
        self._sampler_checkpoint, self._sampler_states_used = checkpoint.get(sharding.CHECKPOINT_KEY), 0
        # and before DDP is wrapped: a tuned bucket size goes on without a new search
        self._fusion_checkpoint = checkpoint.get(fusion.CHECKPOINT_KEY)
        return checkpoint

    def _restore_compression(self, entry: dict[str, Any]) -> None:
        if self._compression is None or entry.get("name") != self.gradient_compression:
            rank_zero_warn(
                f"shardplus: the checkpoint holds {entry.get('name')!r} gradient-compression state, this run "
                f"uses `gradient_compression`={self.gradient_compression!r}: it starts without it."
            )
        else:
            self._compression.load_checkpoint_entry(entry, self.global_rank, self.world_size)
        self._compression_checkpoint = None

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Put shardplus samplers into the loaders Lightning prepared: padded shards for training, exact
        shards for evaluation. Loaders the user sharded, or that Lightning left alone, pass through
        unchanged."""
        dataloader = super().process_dataloader(dataloader)
        if not isinstance(dataloader, DataLoader):
            return dataloader
        sampler = _lightning.effective_sampler(dataloader)
        if not _lightning.is_injected(sampler):
            if isinstance(sampler, DistributedSampler):
                rank_zero_warn(
                    "shardplus: a DataLoader already has a DistributedSampler; it is left alone, so padded "
                    "equal shards and exact evaluation do not apply to it. Pass a plain DataLoader to get "
                    "them."
                )
            return dataloader
        if not _lightning.injected_over_dataset_order(sampler):
            rank_zero_warn(
                "shardplus: a DataLoader has a custom sampler; Lightning's DistributedSamplerWrapper shards "
                "it, and padded equal shards and exact evaluation do not apply to it."
            )
            return dataloader
        stage = self.lightning_module.trainer.state.stage
        if stage == RunningStage.TRAINING:
            return _lightning.replace_sampler(dataloader, self._training_sampler(dataloader, sampler), stage)
        if stage in _EVALUATION_STAGES and self.exact_evaluation:
            exact: Sampler = ExactShardSampler(dataloader.dataset, self.num_replicas, self.global_rank)
            if len(exact) == 0 and len(dataloader.dataset) > 0:
                exact = PlaceholderShardSampler()
            return _lightning.replace_sampler(dataloader, exact, stage)
        return dataloader

    @property
    def num_replicas(self) -> int:
        return self.num_nodes * self.num_processes

    def _training_sampler(self, dataloader: DataLoader, injected: Any) -> PaddedShardSampler:
        if len(dataloader.dataset) == 0:
            raise ValueError(
                "The training dataset is empty (len(train dataset) == 0): give it at least one sample."
            )
        sampler = PaddedShardSampler(
            dataloader.dataset,
            self.num_replicas,
            self.global_rank,
            shuffle=bool(injected.shuffle) and self._datamodule_shuffles(),
            seed=self.epoch_seed,
            padding=self.shard_padding,
            record_indices=self.verify_sharding,
        )
        self._resume_sampler(sampler, _loader_batch_size(dataloader))
        return sampler

    def _datamodule_shuffles(self) -> bool:
        """False when the training data comes from a ``ShardPlusDataModule(shuffle=False)``: Lightning marks every
        training loader as shuffled when it injects its sampler, so the datamodule's choice is read here."""
        datamodule = getattr(self.lightning_module.trainer, "datamodule", None)
        return not isinstance(datamodule, ShardPlusDataModule) or datamodule.shuffle

    def _resume_sampler(self, sampler: PaddedShardSampler, batch_size: int | None) -> None:
        """Give ``sampler`` its state from the checkpoint being resumed, if any: the training loaders take the
        checkpoint's sampler states in order. The epoch continues where the checkpoint stopped, resharded over
        this run's ranks (see ``PaddedShardSampler.load_state_dict``)."""
        entry = self._sampler_checkpoint
        if entry is None or self._sampler_states_used >= len(entry["samplers"]):
            return
        state = entry["samplers"][self._sampler_states_used]
        self._sampler_states_used += 1
        if batch_size is None or state is None:
            rank_zero_warn("shardplus: a training loader has no batch size; its epoch restarts from the beginning.")
            return
        if state["seed"] != sampler.seed:
            rank_zero_warn(
                f"shardplus: the checkpoint's training order has seed {state['seed']}, this run's seed is "
                f"{sampler.seed}: the checkpoint's seed is kept for the rest of training, so that the run goes on "
                "in the order it started with (as if it had not stopped)."
            )
        sampler.load_state_dict(state, samples_counted=int(entry["batches_done"]) * batch_size)


def _loader_batch_size(loader: DataLoader) -> int | None:
    """Samples per batch of ``loader`` (its ``batch_size``, or its batch sampler's); None when unknown."""
    size = loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
    return size if isinstance(size, int) and size >= 1 else None
