"""``DDPGradients``: DDP's gradient side. The forward is local; a rank without data trains on nothing (DDP's
all-reduce of zeros); the gradients of an aggregation window are each rank's own (under ``no_sync``); a fit has a
communication hook (compression, or the user's) and a bucket size (tensor fusion, tuned or fixed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_shardplus.data.aggregation import micro_batches_per_step, window_entry
from lightning_shardplus.data.group import DataParallel
from lightning_shardplus.diagnostics.counting import CommunicationHookWrapper
from lightning_shardplus.gradients.ddp import compression, fusion
from lightning_shardplus.gradients.ddp.compression import CommunicationHook
from lightning_shardplus.gradients.ddp.config import ShardPlusConfig

DDP_FLAGS_IN_KEY = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")


@dataclass
class DDPRun:
    """DDP's state in one fit: the communication hook and the bucket setting, each with checkpoint state."""

    hook: CommunicationHook
    fusion: fusion.TensorFusion

    def checkpoint_states(self, checkpoint_path: Any) -> dict[str, Any]:
        states = {compression.CHECKPOINT_KEY: self.hook.state_dict(checkpoint_path),
                  fusion.CHECKPOINT_KEY: self.fusion.state_dict()}  # fmt: skip
        return {key: state for key, state in states.items() if state is not None}

    def load_states(self, states: dict[str, Any]) -> None:
        for key, part in ((compression.CHECKPOINT_KEY, self.hook), (fusion.CHECKPOINT_KEY, self.fusion)):
            if key in states:
                part.load_state_dict(states.pop(key))


@dataclass
class DDPGradients:
    """DDP's gradient side of a ``ShardPlusStrategy``: its config, the user's hook and DDP's keyword arguments."""

    config: ShardPlusConfig
    user_hook: tuple[Callable | None, object | None, Callable | None] = (None, None, None)  # hook, state, wrapper
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    forward_communicates = False
    ranks = "processes"

    def features(self) -> list[str]:
        return [f"gradient compression {self.config.gradient_compression!r}"]

    def window_gradients(
        self, module: torch.nn.Module, data_parallel: DataParallel, done: int, frequency: int
    ) -> dict[str, Any] | None:
        """Every rank's own accumulated gradients, gathered on rank 0 (None on the others)."""
        local = {name: p.grad.detach().cpu().clone() for name, p in module.named_parameters() if p.grad is not None}
        per_rank: list[Any] | None = [local]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            per_rank = [None] * world if rank == 0 else None
            torch.distributed.gather_object(local, per_rank, dst=0)
        return None if per_rank is None else window_entry(done, frequency, per_rank)

    @staticmethod
    @torch.no_grad()
    def set_window_gradients(module: torch.nn.Module, gradients: dict[str, torch.Tensor]) -> None:
        for name, parameter in module.named_parameters():
            if name in gradients:
                gradient = gradients[name].to(device=parameter.device, dtype=parameter.dtype)
                if parameter.grad is None:
                    parameter.grad = gradient
                else:
                    parameter.grad.copy_(gradient)

    def checkpointed(self, states: dict[str, Any], checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        """The compression entry learns the checkpoint's path (PowerSGD's per-rank files lie beside it)."""
        if isinstance(entry := checkpoint.get(compression.CHECKPOINT_KEY), dict):
            states[compression.CHECKPOINT_KEY] = {**entry, "checkpoint_path": str(checkpoint_path)}
        if fusion.CHECKPOINT_KEY in checkpoint:
            states[fusion.CHECKPOINT_KEY] = checkpoint[fusion.CHECKPOINT_KEY]

    def start_fit(self, trainer: pl.Trainer, backend: str, device: torch.device) -> DDPRun:
        hook, state, wrapper = self.user_hook
        return DDPRun(
            CommunicationHook(
                self.config.gradient_compression, backend=backend, device=device, user_hook=hook, user_state=state,
                user_wrapper=wrapper,
                wrappers=[cb.wrap for cb in trainer.callbacks if isinstance(cb, CommunicationHookWrapper)],
            ),
            self._tensor_fusion(trainer),
        )  # fmt: skip

    def _tensor_fusion(self, trainer: pl.Trainer) -> fusion.TensorFusion:
        config, ddp_kwargs = self.config, self.ddp_kwargs
        # what the best bucket size depends on, beside the parameters, world size, device, backend and torch
        extra = {
            "gradient_compression": config.gradient_compression,
            "ddp_comm_hook": getattr(self.user_hook[0], "__qualname__", None),
            "micro_batches_per_step": micro_batches_per_step(trainer),
            # (DDP's default, False, where left out: the key is the same whether the flag was passed or not)
            **{k: ddp_kwargs.get(k, False) for k in DDP_FLAGS_IN_KEY},
        }
        return fusion.TensorFusion(
            trainer, config.autotune_settings, tune=config.auto_tune_tensor_fusion, log_path=config.autotune_log,
            cache=config.autotune_cache, cache_extra=extra,
        )  # fmt: skip
