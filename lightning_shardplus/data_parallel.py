"""The data-parallel group: the ranks that read different samples. Under DDP that is every rank; under model parallel
(FSDP2 and tensor parallel) it is the device mesh's ``data_parallel`` dimension, whose tensor-parallel peers read the
same samples and hold copies of the same values. Shards, averaged metrics, exact evaluation and uneven streams are
counted and reduced over it, never over the world (which would count each tensor-parallel copy)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy


class DataParallel(NamedTuple):
    """This rank's data-parallel group: its ``size``, this rank's place in it and the process group (None: the default
    group, every rank); ``groups``: every data-parallel group's global ranks, where there are several."""

    size: int
    rank: int
    group: Any = None
    groups: tuple[tuple[int, ...], ...] | None = None

    def global_rank(self, rank: int = 0) -> int:
        """The global rank of data-parallel rank ``rank`` (the ``src``/``dst`` collectives take)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def gloo_group(self, backend: str) -> Any:
        """The group again on gloo (host tensors) where ``backend`` is another; a collective on every rank."""
        if backend == "gloo":
            return self.group
        if self.groups is None:
            return dist.new_group(backend="gloo")
        own, _ = dist.new_subgroups_by_enumeration([list(ranks) for ranks in self.groups], backend="gloo")
        return own


def data_parallel(strategy: Any) -> DataParallel:
    """``strategy``'s data-parallel group once its processes run; one rank, alone, without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return DataParallel(1, 0)
    if isinstance(strategy, ModelParallelStrategy):
        mesh = strategy.device_mesh
        ranks = mesh.mesh.reshape(mesh["data_parallel"].size(), -1).T.tolist()  # one column per tensor-parallel rank
        sub = mesh["data_parallel"]
        return DataParallel(sub.size(), sub.get_local_rank(), sub.get_group(), tuple(map(tuple, ranks)))
    return DataParallel(dist.get_world_size(), dist.get_rank())


def data_parallel_size(trainer: Any) -> int:
    """The data-parallel size a Trainer will run with, known before its processes start (the global batch is divided
    by it): the strategy's ``num_replicas`` (shardplus's strategies), else every device."""
    return getattr(trainer.strategy, "num_replicas", None) or trainer.num_devices * trainer.num_nodes
