"""``ShardPlusModelParallelStrategy``: Lightning's ``ModelParallelStrategy`` (FSDP2 over the device mesh's
``data_parallel`` dimension, tensor parallel over ``tensor_parallel``) with shardplus's data side, over the
data-parallel ranks. FSDP's forward is itself a collective (the parameter all-gather), so a data-parallel rank without
data still runs one: on a stand-in batch whose loss, logged values, metric updates and predictions count nowhere.
docs/model-parallel.md."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torchmetrics import Metric
from typing_extensions import override

from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus._compat.changes import Change
from lightning_shardplus.data.config import DataSideConfig, fit_to_lightning
from lightning_shardplus.data.group import data_parallel
from lightning_shardplus.data.sharding import PaddingMode
from lightning_shardplus.data.uneven import NoBatch, UnevenInputs
from lightning_shardplus.gradients.fsdp2.launch import LaunchGatheringWeights
from lightning_shardplus.gradients.fsdp2.side import FSDP2Gradients
from lightning_shardplus.gradients.fsdp2.stand_in import counted_nowhere
from lightning_shardplus.launch import LaunchAfterCheck
from lightning_shardplus.strategies.data_side import ShardPlusDataSide
from lightning_shardplus.validation import (
    START_METHODS,
    check_bool,
    check_choice,
    check_int,
    check_process_group_backend,
    class_name,
    closest,
    process_group_timeout,
)

# DDP's arguments, with why each has no place here (FSDP2 reduces the gradients itself, by reduce-scatter).
DDP_ONLY = {
    "gradient_compression": "a DDP communication hook; FSDP2 has none",
    "tensor_fusion_threshold_mb": "DDP's bucket size; FSDP2 communicates per `fully_shard` unit",
    "auto_tune_tensor_fusion": "it measures DDP's bucket sizes; FSDP2 communicates per `fully_shard` unit",
    **dict.fromkeys(
        (
            "autotune_log",
            "autotune_candidates_mb",
            "autotune_first_bucket_candidates_mb",
            "autotune_steps_per_sample",
            "autotune_warmup_steps",
            "autotune_cache",
        ),
        "an option of DDP's bucket-size tuning",
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "ddp_comm_hook",
            "ddp_comm_state",
            "ddp_comm_wrapper",
            "model_averaging_period",
            "find_unused_parameters",
            "static_graph",
            "gradient_as_bucket_view",
            "broadcast_buffers",
        ),
        "an argument of DistributedDataParallel or DDPStrategy",
    ),  # fmt: skip
}
OPTIONS = (
    "data_parallel_size", "tensor_parallel_size", "save_distributed_checkpoint", "process_group_backend", "timeout",
    "aggregation_frequency", "average_aggregated_gradients", "shard_padding", "shuffle_seed", "exact_evaluation",
    "verify_sharding", "average_training_metrics", "uneven_inputs", "start_method",
)  # fmt: skip


class ShardPlusModelParallelStrategy(ShardPlusDataSide, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with shardplus's data side over the data-parallel ranks.

    Args:
        data_parallel_size: the device mesh's ``data_parallel`` dimension: FSDP2's ranks, which shardplus shards the
            data over; ``"auto"``: the number of nodes.
        tensor_parallel_size: the device mesh's ``tensor_parallel`` dimension: its ranks read the same samples;
            ``"auto"``: the devices per node.
        save_distributed_checkpoint: each rank saves its shards (a folder of files); False: one file, assembled on
            rank 0.
        process_group_backend: the process group's backend (``"gloo"``, ``"nccl"``, ...); None: the device's.
        timeout: the process group's timeout, a ``timedelta`` or seconds.
        aggregation_frequency: micro-batches per optimizer step; FSDP2 reduces the gradients once, at the last.
        average_aggregated_gradients: the mean of the aggregated gradients (True) or their sum (False).
        shard_padding: short training shards filled with the first element (``"first"``) or wrapped (``"wrap"``).
        shuffle_seed: seed of the training epoch permutation; None: the ``seed_everything`` seed, else 0.
        exact_evaluation: unpadded evaluation shards over the data-parallel ranks; epoch metrics equal a
            single-process run.
        verify_sharding: debug aid: check after each training epoch that the data-parallel shards were disjoint and
            complete.
        average_training_metrics: training values logged ``on_step`` are averaged over the data-parallel ranks.
        uneven_inputs: training streams of different lengths per data-parallel rank: ``"join"`` or ``"drop"``.
        start_method: ``"popen"`` (Lightning's subprocess launcher, as ``ModelParallelStrategy``), or ``"fork"``,
            ``"spawn"``, ``"forkserver"`` (Lightning's multiprocessing launcher, as ``DDPStrategy``'s; the launching
            process gets the trained weights whole).

    docs/model-parallel.md.

    Example::

        trainer = Trainer(devices=4, strategy=ShardPlusModelParallelStrategy(data_parallel_size=2,
                                                                              tensor_parallel_size=2))
    """

    strategy_name = "shardplus_model_parallel"
    components_after_checks = True  # Lightning's of the module first: `configure_model` overridden, FSDP2 only

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        *,
        aggregation_frequency: int = 1,
        average_aggregated_gradients: bool = True,
        shard_padding: PaddingMode = "first",
        shuffle_seed: int | None = None,
        exact_evaluation: bool = True,
        verify_sharding: bool = False,
        average_training_metrics: bool = True,
        uneven_inputs: UnevenInputs = "join",
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_only: Any,
    ) -> None:
        refuse_ddp_only(ddp_only)
        check_choice("start_method", start_method, START_METHODS)
        if start_method != "popen" and not hasattr(torch.nn.Module, "register_state_dict_post_hook"):
            raise RuntimeError(
                f"start_method={start_method!r} needs torch 2.5 or newer under model parallel (the weights are "
                "gathered for the launching process through `register_state_dict_post_hook`); this is "
                f"{torch.__version__}. "
                "Use start_method='popen'."
            )
        if start_method != "popen" and (gap := _lightning.lightning_gaps().get("start_method")):
            raise RuntimeError(
                f"start_method={start_method!r} cannot run here: Lightning {_lightning.pl.__version__} moved its "
                f"multiprocessing launcher ({gap}). Use start_method='popen'."
            )
        for name, size in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
            if size != "auto":
                check_int(name, size, minimum=1)
        check_process_group_backend(process_group_backend)
        config = fit_to_lightning(DataSideConfig(
            aggregation_frequency=aggregation_frequency, average_aggregated_gradients=average_aggregated_gradients,
            shard_padding=shard_padding, shuffle_seed=shuffle_seed, exact_evaluation=exact_evaluation,
            verify_sharding=verify_sharding, average_training_metrics=average_training_metrics,
            uneven_inputs=uneven_inputs,
        ))  # fmt: skip
        super().__init__(
            data_parallel_size, tensor_parallel_size,
            check_bool("save_distributed_checkpoint", save_distributed_checkpoint), process_group_backend,
            process_group_timeout(timeout),
        )  # fmt: skip
        self._data_parallel_given, self._tensor_parallel_given = data_parallel_size, tensor_parallel_size
        self._data_parallel_group: Any = None  # the mesh's data-parallel group, from `setup_environment` on
        self.start_method = start_method
        self._process_launcher: Any = None  # fork/spawn: Lightning's multiprocessing launcher, built once
        self._init_data_side(config)

    @property
    def num_replicas(self) -> int:
        """The data-parallel size (``"auto"``: the number of nodes, as ``ModelParallelStrategy``)."""
        given = self._data_parallel_given
        return self.num_nodes if given == "auto" else int(given)

    @override
    def _processes_launcher(self) -> Any:
        """Lightning's subprocess launcher for ``"popen"`` (or none, under torchrun), else its multiprocessing one."""
        environment = self.cluster_environment
        if self.start_method == "popen" or environment is None or environment.creates_processes_externally:
            return super()._processes_launcher()
        if self._process_launcher is None:
            self._process_launcher = _lightning.process_launcher(self, self.start_method)
        launch = self._process_launcher.launch
        if not isinstance(launch, (LaunchGatheringWeights, LaunchAfterCheck)):
            self._changes.set(Change.LAUNCH, self._process_launcher, "launch", LaunchGatheringWeights(launch))
        return self._process_launcher

    @override
    def check_trainer_call(self, *call_args: Any, trainer: Any = None) -> None:
        """Also: a mesh whose size is not the number of processes (Lightning would refuse it in every worker, once the
        process group is up)."""
        # "auto" as ModelParallelStrategy resolves it: data parallel over the nodes, tensor parallel within one
        dp = self.num_nodes if self._data_parallel_given == "auto" else self._data_parallel_given
        tp = self.num_processes if self._tensor_parallel_given == "auto" else self._tensor_parallel_given
        if dp * tp != (processes := self.started_processes):
            raise ValueError(
                f"`data_parallel_size`={dp} x `tensor_parallel_size`={tp} is a mesh of {dp * tp} processes, and the "
                f"Trainer starts {processes} ({self.processes_setting}): make the product equal the number of "
                "processes."
            )
        super().check_trainer_call(*call_args, trainer=trainer)

    @override
    def _gradient_side(self) -> FSDP2Gradients:
        return FSDP2Gradients()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._data_parallel_group = data_parallel(self).group

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Also: the module's torchmetrics Metrics without a process group of their own sync over the data-parallel
        group (over the world, each tensor-parallel copy would count again), until teardown; a fit whose module
        leaves the tensor-parallel dimension idle is warned about."""
        super().setup(trainer)
        self._build_components(trainer)  # (evaluation: no optimizers)
        if trainer.state.fn == TrainerFn.FITTING:
            warn_if_tensor_parallel_idle(self.lightning_module, self.world_size, self.num_replicas)
        group = self._data_parallel_group
        for metric in self.lightning_module.modules():
            if isinstance(metric, Metric) and metric.process_group is None and group is not None:
                self._changes.set(Change.METRIC_PROCESS_GROUP, metric, "process_group", group)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The data side's components first: ``setup`` calls this past Lightning's checks of the module, and
        ``configure_optimizers`` may load the training data through them (``trainer.estimated_stepping_batches``)."""
        self._build_components(trainer)
        super().setup_optimizers(trainer)

    @override
    def _build_components(self, trainer: pl.Trainer) -> None:
        """Once the processes run: a strategy set up without them (by hand, as Lightning's own unit tests do) has no
        device mesh, and nothing to shard over."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            super()._build_components(trainer)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """``self.log(sync_dist=True)`` and every reduction without a group: over the data-parallel ranks only
        (over the world, each tensor-parallel copy would count again)."""
        return super().reduce(tensor, group=self._data_parallel_group if group is None else group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Over every rank (checkpoint and early-stopping decisions must agree across the mesh)."""
        count = torch.tensor(int(decision), device=self.root_device)
        count = super().reduce(count, group=torch.distributed.group.WORLD, reduce_op="sum")
        return bool(count == self.world_size) if all else bool(count)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Inside an aggregation window (Lightning's accumulation) FSDP2 reduces no gradient: one reduce-scatter at
        the window's last micro-batch."""
        sharded = [m for m in self.model.modules() if hasattr(m, "set_requires_gradient_sync")]  # FSDP2 units
        for module in sharded:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for module in sharded:
                module.set_requires_gradient_sync(True, recurse=False)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not (args and isinstance(args[0], NoBatch)):
            return super().training_step(*args, **kwargs)
        # this rank's stream ran out ("join"): the step on a stand-in batch, for FSDP's collectives, with a zero loss;
        # its Metric updates and buffers are undone; its logs are abstained from by the averaged training metrics
        # (kept, so that every rank keeps every name), or dropped without them
        self._components.even.step_without_data()  # type: ignore[union-attr]
        averaged = self._components.metrics is not None  # type: ignore[union-attr]
        with counted_nowhere(self.lightning_module, self._changes, drop_logs=not averaged):
            output = super().training_step(self._prepared(args[0]), *args[1:], **kwargs)
        if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
            return {**output, "loss": output["loss"] * 0.0}
        return output * 0.0 if isinstance(output, torch.Tensor) else output

    def _evaluate(self, step: Callable, args: tuple, kwargs: dict) -> Any:
        """A stand-in batch (a data-parallel rank whose shard has fewer batches) runs Lightning's ``step`` for FSDP's
        collectives; what it logs, updates or predicts counts nowhere."""
        if not (args and isinstance(args[0], NoBatch)):
            return step(*args, **kwargs)
        stand_in = self._prepared(args[0], dataloader_idx=args[2] if len(args) > 2 else 0)
        with counted_nowhere(self.lightning_module, self._changes):
            step(stand_in, *args[1:], **kwargs)
        return args[0]  # (a prediction that `gather_predictions` leaves out)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate(super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate(super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate(super().predict_step, args, kwargs)

    def _prepared(self, batch: NoBatch, dataloader_idx: int = 0) -> Any:
        """The stand-in as Lightning's loops prepare a batch: precision conversion, the module's transfer hooks, the
        device (the loops ran them on the ``NoBatch``)."""
        prepared = self.precision_plugin.convert_input(batch.stand_in)
        prepared = self.lightning_module.on_before_batch_transfer(prepared, dataloader_idx)
        return self.batch_to_device(prepared, dataloader_idx=dataloader_idx)


def warn_if_tensor_parallel_idle(module: torch.nn.Module, world_size: int, data_parallel_size: int) -> None:
    """Warn (rank 0) where tensor-parallel peers exist but no parameter of ``module`` is sharded over the mesh's
    ``tensor_parallel`` dimension: the peers train identical copies on the same samples. Lightning's "auto" sizes
    give one node's devices to tensor parallel, which a module sharded by ``fully_shard`` alone leaves idle."""
    peers = world_size // data_parallel_size
    if peers == 1 or any(map(sharded_over_tensor_parallel, module.parameters())):
        return
    rank_zero_warn(
        f"shardplus: the device mesh has {peers} tensor-parallel peers per data-parallel rank (data_parallel_size="
        f"{data_parallel_size}, tensor_parallel_size={peers}), but no parameter of {class_name(module)} is sharded "
        'over its "tensor_parallel" dimension after `configure_model`: the peers train identical copies on the same '
        f"samples. For FSDP2 alone pass `data_parallel_size={world_size}, tensor_parallel_size=1` (every process a "
        'data-parallel rank); for tensor parallel, apply a plan over `self.device_mesh["tensor_parallel"]` '
        "(docs/model-parallel.md)."
    )


def sharded_over_tensor_parallel(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor with a shard placement on its mesh's ``tensor_parallel`` dimension."""
    names = getattr(getattr(tensor, "device_mesh", None), "mesh_dim_names", None) or ()
    return "tensor_parallel" in names and tensor.placements[names.index("tensor_parallel")].is_shard()  # type: ignore


def refuse_ddp_only(given: dict[str, Any]) -> None:
    """Refuse DDP's arguments, saying why, and unknown ones with the closest option."""
    for name, value in given.items():
        if name in DDP_ONLY:
            raise TypeError(
                f"`{name}`={value!r} is not a ShardPlusModelParallelStrategy option: {DDP_ONLY[name]}. Use "
                "ShardPlusStrategy (strategy='shardplus') for DDP; the data-side options are the same."
            )
        close = closest(name, OPTIONS)
        hint = f" (did you mean `{close}`?)" if close else ""
        raise TypeError(
            f"ShardPlusModelParallelStrategy got an unknown option `{name}`={value!r}{hint}: valid are "
            f"{', '.join(OPTIONS)}."
        )
