"""The data-parallel group: the ranks that read different samples. Under DDP that is every rank; under model parallel
(FSDP2 and tensor parallel) it is the device mesh's ``data_parallel`` dimension, whose tensor-parallel peers read the
same samples and hold copies of the same values. Shards, averaged metrics, exact evaluation and uneven streams are
counted and reduced over it, never over the world (which would count each tensor-parallel copy)."""

from __future__ import annotations

import copy
import sys
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


def read_by_data_parallel_rank(dataloader: Any, data_parallel: DataParallel, world_size: int) -> None:
    """Stream readers that shard by ``torch.distributed``'s world read by the data-parallel rank instead, so that
    tensor-parallel peers read the same samples: litdata's ``StreamingDataset`` (and subclasses) is given the
    data-parallel rank and size (its public ``distributed_env``); Mosaic's ``StreamingDataset`` must be built with
    ``replication`` = the tensor-parallel size, and litdata's combined and parallel datasets are refused (a
    ``ValueError`` says so). A no-op where every rank is a data-parallel rank.

    Example: on a 2 x 2 mesh, global ranks 2 and 3 read litdata's shard 1 of 2."""
    dataset, peers = getattr(dataloader, "dataset", None), world_size // data_parallel.size
    if peers == 1 or dataset is None:
        return
    litdata, mosaic = sys.modules.get("litdata"), sys.modules.get("streaming")  # (imported where a dataset is one)
    if litdata is not None and isinstance(dataset, litdata.StreamingDataset):
        env = copy.copy(dataset.distributed_env)
        nodes = min(env.num_nodes, data_parallel.size)
        env.world_size, env.global_rank = data_parallel.size, data_parallel.rank
        env.num_nodes = nodes if data_parallel.size % nodes == 0 else 1
        dataset.distributed_env = env
    elif litdata is not None and isinstance(dataset, _litdata_wrappers(litdata)):
        raise ValueError(
            f"a litdata {type(dataset).__name__} under model parallel ({peers} tensor-parallel peers per data-parallel "
            "rank): its datasets would shard by torch.distributed's world, so the peers would read different "
            "samples. Use one litdata StreamingDataset per loader (it is given the data-parallel rank)."
        )
    elif mosaic is not None and isinstance(dataset, mosaic.StreamingDataset) and (dataset.replication or 1) != peers:
        raise ValueError(
            f"Mosaic StreamingDataset(replication={dataset.replication!r}) under model parallel with {peers} "
            "tensor-parallel peers per data-parallel rank: the peers would read different samples. Build it with "
            f"replication={peers} (Mosaic then gives consecutive ranks, the tensor-parallel peers, the same samples)."
        )


def _litdata_wrappers(litdata: Any) -> tuple[type, ...]:
    """litdata's datasets over several ``StreamingDataset``s (public where this litdata has them)."""
    names = ("CombinedStreamingDataset", "ParallelStreamingDataset")
    return tuple(getattr(litdata, name) for name in names if hasattr(litdata, name))
