"""The fork/spawn launch of the model-parallel strategy: after a fit, each worker gathers the module's weights whole
for the launching process, whose module is not sharded."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn


class LaunchGatheringWeights:
    """A fork/spawn launcher's ``launch`` whose workers, once a fit returned, gather the module's weights whole for the
    launching process: Lightning's launcher then computes ``state_dict()`` on every rank and sends rank 0's to the
    launching process, whose module is not sharded. Nothing of yours runs after that in a worker. (A class: the spawn
    launcher pickles it.)"""

    def __init__(self, launch: Any) -> None:
        self.launch = launch

    def __call__(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        return self.launch(_FitThenGather(function, trainer), *args, trainer=trainer, **kwargs)


class _FitThenGather:
    """The Trainer function a worker runs; after a fit, ``state_dict()`` gathers each DTensor whole (a collective on
    every rank), kept on CPU on local rank 0, whose copy Lightning sends."""

    def __init__(self, function: Any, trainer: Any) -> None:
        self.function, self.trainer = function, trainer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.function(*args, **kwargs)
        if self.trainer.state.fn == TrainerFn.FITTING:
            keep = self.trainer.local_rank == 0
            self.trainer.lightning_module.register_state_dict_post_hook(partial(_whole_tensors, keep))
        return result


def _whole_tensors(keep: bool, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, _: Any) -> None:
    """A ``state_dict`` post-hook: each DTensor (an FSDP2 or tensor-parallel shard) gathered whole on every rank, one
    at a time; on the rank that ``keep``s them, every tensor on CPU."""
    for key, value in state_dict.items():
        whole = value.full_tensor() if hasattr(value, "full_tensor") else value
        if keep and isinstance(whole, torch.Tensor):
            state_dict[key] = whole.cpu()
