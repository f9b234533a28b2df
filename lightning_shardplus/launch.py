"""Checks of a Trainer call before any process group starts: the launcher's world size (processes started by
torchrun, SLURM, mpirun or by hand must number ``devices x num_nodes``), the backend, the batch, the aggregation."""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import (
    LightningEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from lightning.pytorch.trainer.states import TrainerFn
from torchmetrics import Metric

from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus.data.aggregation import check_aggregation
from lightning_shardplus.data.datamodule import ShardPlusDataModule, per_device_batch_size
from lightning_shardplus.data.uneven import check_automatic_optimization, training_streams
from lightning_shardplus.validation import check_process_group_backend_known, class_name


def _launcher_world_size(environment: ClusterEnvironment | None) -> tuple[int, int | None, str] | None:
    """(world size, processes per node if known, launcher name) of processes started outside Lightning; None when
    Lightning starts them (the sizes then agree)."""
    if environment is None or not environment.creates_processes_externally:
        return None
    if isinstance(environment, LightningEnvironment):
        # processes started by hand (or by Lightning's own launcher) with LOCAL_RANK/NODE_RANK/WORLD_SIZE set
        if "WORLD_SIZE" not in os.environ:
            return None
        world_size, local_key, name = int(os.environ["WORLD_SIZE"]), "LOCAL_WORLD_SIZE", "the WORLD_SIZE variable"
    else:
        try:
            world_size = int(environment.world_size())
        except (KeyError, TypeError, ValueError):  # an environment variable the launcher did not set
            return None
        local_key, name = {
            TorchElasticEnvironment: ("LOCAL_WORLD_SIZE", "torchrun"),
            SLURMEnvironment: ("SLURM_NTASKS_PER_NODE", "SLURM"),
            MPIEnvironment: ("OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun"),
        }.get(type(environment), ("LOCAL_WORLD_SIZE", type(environment).__name__))
    local = os.environ.get(local_key, "")
    return world_size, int(local) if local.isdigit() and int(local) > 0 else None, name


_MPI_WORLD_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")  # Open MPI; MPICH and Intel MPI


def _check_mpi_is_seen(environment: ClusterEnvironment | None) -> None:
    """Under mpirun, Lightning detects MPI only with mpi4py installed; without it every mpirun process would start
    its own Lightning job and train alone, silently."""
    if not isinstance(environment, LightningEnvironment):
        return
    if any(v in os.environ for v in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE")):
        return  # ranks given by hand or by a wrapper (one process per node, Lightning starts the local ones)
    for variable in _MPI_WORLD_SIZE_VARIABLES:
        size = os.environ.get(variable, "")
        if size.isdigit() and int(size) > 1:
            why = "mpi4py is installed but MPI reports one process" if find_spec("mpi4py") else "no mpi4py"
            raise RuntimeError(
                f"This process was started by an MPI/PMI launcher (mpirun, srun --mpi=...: {variable}={size}), "
                f"but Lightning does not see MPI ({why}; its MPIEnvironment needs mpi4py): each of the {size} "
                "processes would start its own training job. Install mpi4py (pip install mpi4py) in this "
                "environment, launch with torchrun, or set NODE_RANK/WORLD_SIZE for one process per node."
            )


def check_launcher_world_size(environment: ClusterEnvironment | None, devices: int, num_nodes: int) -> None:
    """Refuse a launcher whose world size is not ``devices x num_nodes`` (processes would wait for peers that never
    come, or two take the same rank), and mpirun without mpi4py (each process would train alone)."""
    _check_mpi_is_seen(environment)
    found = _launcher_world_size(environment)
    if found is None or found[0] == devices * num_nodes:
        return
    world_size, local, name = found
    if local is not None and world_size % local == 0:
        settings = f"devices={local} and num_nodes={world_size // local}"
    elif world_size % num_nodes == 0:
        settings = f"devices={world_size // num_nodes} and num_nodes={num_nodes}"
    else:
        settings = f"devices x num_nodes = {world_size}"
    raise ValueError(
        f"{name} started {world_size} processes in all (world size {world_size}), but the Trainer expects "
        f"devices={devices} x num_nodes={num_nodes} = {devices * num_nodes}. Fix: set {settings} (`--trainer.devices` "
        f"/ `--trainer.num_nodes` on the shardplus command line) to match the launcher, or start {devices} process(es) "
        f"per node on {num_nodes} node(s) (torchrun --nproc-per-node={devices} --nnodes={num_nodes}; SLURM "
        f"--ntasks-per-node={devices} --nodes={num_nodes}; mpirun -np {devices * num_nodes})."
    )


class LaunchAfterCheck:
    """A launcher's ``launch`` that first runs ``check`` on the Trainer call's arguments, in the launching process. A
    class, not a closure: the spawn and forkserver launchers pickle it with the Trainer."""

    def __init__(self, check: Callable[..., None], launch: Callable) -> None:
        self.check, self.launch = check, launch

    def __call__(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.check(*args, *kwargs.values(), trainer=trainer)
        return self.launch(function, *args, trainer=trainer, **kwargs)


def check_accelerator(accelerator: Any, strategy_name: str, start_method: str) -> None:
    """Refuse Apple's MPS accelerator as Lightning refuses the DDP family there (it recognizes the family by a name
    containing "ddp", which "shardplus" does not), in Lightning's words."""
    from lightning.pytorch.accelerators import MPSAccelerator

    if isinstance(accelerator, MPSAccelerator):
        name = strategy_name if start_method == "popen" else f"{strategy_name}_{start_method}"
        raise ValueError(
            f"You set `strategy={name}` but strategies from the DDP family are not supported on the MPS "
            "accelerator. Either explicitly set `accelerator='cpu'` or change the strategy."
        )


def check_trainer_call(strategy: Any, *call_args: Any, trainer: Any = None) -> None:
    """Refuse the arguments of a Trainer call that cannot work at this world size or with ``strategy``'s options:
    the launcher's world size, the backend's name, the global batch size, the aggregation frequency."""
    strategy.check_launcher()
    if strategy.process_group_backend is not None:
        check_process_group_backend_known(strategy.process_group_backend)
    for arg in call_args:
        if isinstance(arg, ShardPlusDataModule):
            per_device_batch_size(arg.global_batch_size, strategy.num_replicas)
    model = next((arg for arg in call_args if isinstance(arg, pl.LightningModule)), None)
    check_fit(strategy, trainer, model)
    fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
    if fitting and model is not None and strategy.num_replicas > 1 and training_streams(call_args[1]):
        check_automatic_optimization(strategy.config.uneven_inputs, model)  # (`fit(model, train_dataloaders, ...)`)


def check_fit(strategy: Any, trainer: Any, model: Any) -> None:
    """The aggregation frequency against ``trainer`` (None: none yet) when it fits ``model`` (None: not known)."""
    if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
        static_graph = bool(_lightning.ddp_kwargs(strategy).get("static_graph"))
        check_aggregation(class_name(strategy), strategy.config.aggregation_frequency, trainer, model, static_graph)


RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def rank_variables(environment: ClusterEnvironment, local_world_size: int) -> dict[str, str]:
    """The :data:`RANK_VARIABLES` absent from ``os.environ``, with more than one process, to set (Lightning's
    launchers set neither ``RANK`` nor ``LOCAL_WORLD_SIZE``; Mosaic Streaming reads them, and takes their absence for
    one process)."""
    values = (environment.global_rank(), environment.world_size(), environment.local_rank(), local_world_size)
    if environment.world_size() < 2:
        return {}
    return {name: str(v) for name, v in zip(RANK_VARIABLES, values, strict=True) if name not in os.environ}


def unshare_memory(module: torch.nn.Module) -> None:
    """Give ``module`` tensors of its own in a worker started by spawn or forkserver on CPU: torch passes the launching
    process's tensors to such workers in shared memory, so every worker would update one tensor. Lightning copies the
    parameters and buffers under spawn only (``_disable_module_memory_sharing``): under forkserver each optimizer step
    was applied once per worker. A torchmetrics ``Metric``'s states are plain attributes, copied by neither: its sum
    counted once per worker (as under ``strategy="ddp_spawn"``). DTensors (model parallel) are new storage already."""
    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            if not hasattr(tensor, "full_tensor"):
                tensor.data = tensor.data.clone()
    for metric in module.modules():
        if isinstance(metric, Metric):
            for name, value in metric.metric_state.items():
                setattr(metric, name, value.clone() if isinstance(value, torch.Tensor) else [v.clone() for v in value])
