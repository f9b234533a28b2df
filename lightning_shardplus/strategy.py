"""``ShardPlusStrategy``: DDP with padded equal training shards, exact evaluation shards and tuned fusion.

The strategy validates its arguments and wires the algorithm modules into Lightning's hooks; the algorithms
themselves live in :mod:`lightning_shardplus.sharding` (and, later, aggregation, compression, fusion,
metrics).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_shardplus import _lightning
from lightning_shardplus._validation import check_bool, check_choice, check_int, check_positive_number
from lightning_shardplus.callbacks import VerifySharding
from lightning_shardplus.datamodule import ShardPlusDataModule, per_device_batch_size
from lightning_shardplus.metrics import AverageTrainingMetrics
from lightning_shardplus.sharding import PADDING_MODES, ExactShardSampler, PaddedShardSampler, PaddingMode

log = logging.getLogger(__name__)

# Keyword arguments DDPStrategy forwards to torch's DistributedDataParallel.
_DDP_KWARGS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {
    "self",
    "module",
    "device_ids",
    "bucket_cap_mb",  # set through `tensor_fusion_threshold_mb`
}

_EVALUATION_STAGES = (
    RunningStage.VALIDATING,
    RunningStage.SANITY_CHECKING,
    RunningStage.TESTING,
    RunningStage.PREDICTING,
)


class ShardPlusStrategy(DDPStrategy):
    """DDP for synchronous data-parallel training, with the training optimizations of Horovod, Determined and
    NVIDIA Clara Train.

    Args:
        shard_padding: how short training shards are filled: ``"first"`` (the dataset's first element, as
            Clara Train) or ``"wrap"`` (the epoch order's first indices, as torch's ``DistributedSampler``).
        shuffle_seed: seed of the training epoch permutation; None takes the seed given to
            ``seed_everything`` (``PL_GLOBAL_SEED``), else 0.
        exact_evaluation: validation, test and predict loaders get unpadded shards, so every sample is
            evaluated exactly once; False keeps Lightning's padded ``DistributedSampler``.
        verify_sharding: debug aid: at the end of each training epoch the ranks check together that their
            shards were disjoint and covered the dataset.
        tensor_fusion_threshold_mb: DDP's gradient bucket size (``bucket_cap_mb``).
        average_training_metrics: values logged with ``on_step=True`` from ``training_step`` and the
            training-batch hooks are replaced by their batch-weighted mean over all ranks (``sync_dist=True``
            sum/max/min values by that reduction) before loggers, the progress bar or ``callback_metrics`` see
            them, with one fused all_reduce per optimizer step; False keeps Lightning's behaviour (rank 0's
            own values, a barrier and an all_reduce per ``sync_dist=True`` value). See
            :mod:`lightning_shardplus.metrics`.
        find_unused_parameters, static_graph, gradient_as_bucket_view, broadcast_buffers: passed to
            ``DistributedDataParallel``, as are other keyword arguments it accepts.

    The remaining arguments are ``DDPStrategy``'s.
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
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        shard_padding: PaddingMode = "first",
        shuffle_seed: int | None = None,
        exact_evaluation: bool = True,
        verify_sharding: bool = False,
        tensor_fusion_threshold_mb: float = 25.0,
        average_training_metrics: bool = True,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
        **ddp_kwargs: Any,
    ) -> None:
        check_choice("start_method", start_method, ("popen", "spawn", "fork", "forkserver"))
        check_choice("shard_padding", shard_padding, PADDING_MODES)
        if shuffle_seed is not None:
            check_int("shuffle_seed", shuffle_seed, minimum=0)
        check_bool("exact_evaluation", exact_evaluation)
        check_bool("verify_sharding", verify_sharding)
        check_positive_number("tensor_fusion_threshold_mb", tensor_fusion_threshold_mb)
        check_bool("average_training_metrics", average_training_metrics)
        if "bucket_cap_mb" in ddp_kwargs:
            raise TypeError(
                f"`bucket_cap_mb`={ddp_kwargs['bucket_cap_mb']!r} is not a ShardPlusStrategy option: "
                "set the bucket size with `tensor_fusion_threshold_mb`."
            )
        unknown = sorted(set(ddp_kwargs) - _DDP_KWARGS)
        if unknown:
            given = ", ".join(f"`{k}`={ddp_kwargs[k]!r}" for k in unknown)
            valid = ", ".join(sorted(_DDP_KWARGS))
            raise TypeError(
                f"ShardPlusStrategy got unknown option(s) {given}: "
                f"valid are its own arguments and DistributedDataParallel's ({valid})."
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
            broadcast_buffers=broadcast_buffers,
            bucket_cap_mb=float(tensor_fusion_threshold_mb),
            **ddp_kwargs,
        )
        self.shard_padding: PaddingMode = shard_padding
        self.shuffle_seed = shuffle_seed
        self.exact_evaluation = exact_evaluation
        self.verify_sharding = verify_sharding
        self.tensor_fusion_threshold_mb = float(tensor_fusion_threshold_mb)
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
        launch = self._launcher.launch

        def launch_after_preflight(
            function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any
        ) -> Any:
            self.preflight(*args, *kwargs.values())
            return launch(function, *args, trainer=trainer, **kwargs)

        self._launcher.launch = launch_after_preflight

    def preflight(self, *call_args: Any) -> None:
        """Refuse, before any process starts, the arguments of a Trainer call that cannot work at this world
        size."""
        for arg in call_args:
            if isinstance(arg, ShardPlusDataModule):
                per_device_batch_size(arg.global_batch_size, self.num_replicas)

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        if self.exact_evaluation:
            # Exact evaluation shards are empty on some ranks when the dataset is smaller than the world size.
            model.allow_zero_length_dataloader_with_multiple_devices = True

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.verify_sharding and not any(isinstance(cb, VerifySharding) for cb in trainer.callbacks):
            trainer.callbacks.append(VerifySharding())
        averaging = any(isinstance(cb, AverageTrainingMetrics) for cb in trainer.callbacks)
        if self.average_training_metrics and not averaging:
            # first: the metrics are averaged before any other callback's `on_train_batch_end` reads them
            trainer.callbacks.insert(0, AverageTrainingMetrics())
        super().setup(trainer)

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
            exact = ExactShardSampler(dataloader.dataset, self.num_replicas, self.global_rank)
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
        return PaddedShardSampler(
            dataloader.dataset,
            self.num_replicas,
            self.global_rank,
            shuffle=bool(injected.shuffle),
            seed=self.epoch_seed,
            padding=self.shard_padding,
            record_indices=self.verify_sharding,
        )

