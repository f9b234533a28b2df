"""Optimizers for large-batch training: ``LARS`` (layer-wise adaptive rate scaling)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

from lightning_shardplus.validation import check_bool, check_positive_number


def _check_number(name: str, value: Any, minimum: float, below: float | None = None) -> None:
    """``value`` is a real number with ``minimum <= value`` (and ``value < below`` when given)."""
    valid = f"{minimum} <= {name}" + (f" < {below}" if below is not None else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}`={value!r} is not valid: expected a number with {valid}.")
    if not value >= minimum or (below is not None and not value < below):  # `not >=` also rejects NaN
        raise ValueError(f"`{name}`={value!r} is not valid: expected a number with {valid}.")


def _check_group(options: dict[str, Any]) -> None:
    _check_number("lr", options["lr"], 0.0)
    _check_number("momentum", options["momentum"], 0.0, below=1.0)
    _check_number("weight_decay", options["weight_decay"], 0.0)
    check_positive_number("trust_coefficient", options["trust_coefficient"])
    _check_number("eps", options["eps"], 0.0)
    check_bool("exclude_bias_and_norm", options["exclude_bias_and_norm"])


class LARS(Optimizer):
    """Layer-wise Adaptive Rate Scaling (You, Gitman and Ginsburg 2017, Algorithm 1): SGD with momentum whose step
    for each parameter tensor ``w`` is scaled by the trust ratio
    ``trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)`` (1 where ``w`` or ``g`` is all zeros):
    ``v <- momentum * v + lr * ratio * (g + weight_decay * w); w <- w - v``, the learning rate inside the momentum
    buffer as in the paper; ``exclude_bias_and_norm``: plain SGD with momentum for ``ndim <= 1`` tensors. Every
    option can be set per parameter group; the arguments: docs/large-batch.md."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        exclude_bias_and_norm: bool = True,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, exclude_bias_and_norm=exclude_bias_and_norm)  # fmt: skip
        _check_group(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])  # options a group sets for itself

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("exclude_bias_and_norm", True)
            group.setdefault("eps", 1e-8)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Update every parameter that has a gradient; ``closure`` re-evaluates the loss and returns it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if grad.is_sparse:
                    raise RuntimeError("LARS does not support sparse gradients.")
                plain = group["exclude_bias_and_norm"] and param.ndim <= 1  # plain SGD with momentum
                update = grad if plain else self._adapted_update(param, grad, group)
                if momentum == 0:
                    param.sub_(update, alpha=lr)
                    continue
                state = self.state[param]
                buffer = state.get("momentum_buffer")
                if buffer is None:
                    buffer = state["momentum_buffer"] = torch.zeros_like(param)
                buffer.mul_(momentum).add_(update, alpha=lr)
                param.sub_(buffer)
        return loss

    @staticmethod
    def _adapted_update(param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """``ratio * (g + weight_decay * w)``, computed on the device (no host synchronization)."""
        weight_decay = group["weight_decay"]
        param_norm, grad_norm = torch.linalg.vector_norm(param), torch.linalg.vector_norm(grad)
        denominator = grad_norm + weight_decay * param_norm + group["eps"]
        ratio = group["trust_coefficient"] * param_norm / denominator
        trust_ratio = torch.where((param_norm > 0) & (grad_norm > 0), ratio, torch.ones_like(ratio))
        return grad.add(param, alpha=weight_decay).mul_(trust_ratio)
