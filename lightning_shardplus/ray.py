"""shardplus on Ray Train's workers (the ``[ray]`` extra): ``RayShardPlusStrategy``, a ``RayDDPStrategy`` that Ray's
``prepare_trainer`` accepts, and ``RayShardPlusModelParallelStrategy`` (FSDP2 and tensor parallel; Ray has no class
for it). Ray starts one process per worker, gives ranks and world size (``RayLightningEnvironment``), the device and
the process group; shardplus's data side shards, evaluates and averages over them. docs/ray.md."""

from __future__ import annotations

from typing import Any, Literal

try:
    import ray.train
    import ray.train.torch
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment
except ModuleNotFoundError as error:
    raise ImportError(
        f"lightning_shardplus.ray needs Ray Train ({error}): pip install 'lightning-shardplus[ray]'"
    ) from error

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_shardplus import ShardPlusModelParallelStrategy, ShardPlusStrategy
from lightning_shardplus.validation import check_int

if not issubclass(RayDDPStrategy, DDPStrategy):  # Ray builds on `lightning` where it is installed, else on the other
    _ray_namespace = RayDDPStrategy.__mro__[1].__module__.rsplit(".strategies")[0]
    raise ImportError(
        f"Ray Train's Lightning integration is built on {_ray_namespace} here, this module on {pl.__name__}: "
        "shardplus's Ray strategies run with Trainers of the namespace Ray uses (docs/ray.md)"
    )

LAUNCHER = "Ray Train"
WORKERS = "ScalingConfig(num_workers=...)"  # Ray's setting of the number of processes


def ray_world_size() -> int:
    """The number of Ray Train workers, each one process; an error naming where it works outside a worker."""
    try:
        return ray.train.get_context().get_world_size()
    except RuntimeError as error:
        raise RuntimeError(
            "shardplus's Ray strategies run inside Ray Train's workers: build the Trainer in the training function "
            f"given to TorchTrainer ({error})"
        ) from error


class _RayWorkers:
    """What both Ray strategies say of their processes: Ray started them, one per worker."""

    launcher_name = LAUNCHER
    processes_setting = WORKERS
    # Ray's workers save checkpoints to report them (RayTrainReportCallback, ray.train.report), with checkpointing off
    saves_outside_callbacks = True
    cluster_environment: Any

    @property
    def started_processes(self) -> int:
        return ray_world_size()

    def check_launcher(self) -> None:
        """Ray started the processes: their number is Ray's, whatever ``devices`` says. Ranks and world size must
        come from Ray: without ``RayLightningEnvironment`` Lightning would count the world from ``devices x
        num_nodes`` (1 per worker)."""
        if not isinstance(self.cluster_environment, RayLightningEnvironment):
            raise ValueError(
                f"{type(self).__name__} takes ranks and world size from Ray: build the Trainer with "
                f"plugins=[RayLightningEnvironment()] (found {type(self.cluster_environment).__name__})"
            )


class RayShardPlusStrategy(_RayWorkers, ShardPlusStrategy, RayDDPStrategy):
    """``ShardPlusStrategy`` over Ray Train's workers, used as Ray documents ``RayDDPStrategy``::

        trainer = Trainer(devices="auto", strategy=RayShardPlusStrategy(), plugins=[RayLightningEnvironment()],
                          callbacks=[RayTrainReportCallback()])
        trainer = prepare_trainer(trainer)

    The data-parallel size is Ray's worker count (``ScalingConfig(num_workers=...)``), not ``devices x num_nodes``.
    ``process_group_backend``, ``timeout`` and ``start_method`` are Ray's (``TorchConfig``), as for ``RayDDPStrategy``.
    """


class RayShardPlusModelParallelStrategy(_RayWorkers, ShardPlusModelParallelStrategy):
    """``ShardPlusModelParallelStrategy`` (FSDP2 and tensor parallel) over Ray Train's workers. ``"auto"`` sizes:
    tensor parallel 1, data parallel the worker count over it. Ray's ``prepare_trainer`` accepts only its own
    classes: build the Trainer with ``plugins=[RayLightningEnvironment()]`` and do not call it (docs/ray.md)."""

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        *args: Any,
        **kwargs: Any,
    ) -> None:
        tp = 1 if tensor_parallel_size == "auto" else check_int("tensor_parallel_size", tensor_parallel_size, minimum=1)
        dp = max(ray_world_size() // tp, 1) if data_parallel_size == "auto" else data_parallel_size
        super().__init__(dp, tp, *args, **kwargs)

    @property
    @override
    def root_device(self) -> torch.device:
        return ray.train.torch.get_device()

    @override
    def setup_environment(self) -> None:
        """The Trainer call's checks (the mesh against Ray's workers first): no launcher runs them under Ray."""
        self.check_trainer_call(trainer=self.lightning_module.trainer)
        super().setup_environment()


__all__ = ["RayShardPlusModelParallelStrategy", "RayShardPlusStrategy"]
