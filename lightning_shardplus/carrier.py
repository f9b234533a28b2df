"""Numbers summed over ranks inside DDP's gradient all-reduce, with no collective of their own.

A :class:`GradientCarrier` is one extra parameter that DDP reduces with the model's gradients. It is registered
on the module only while DDP is built (DDP takes its parameters once, in its constructor), so the model, its
optimizers, its checkpoints and ``module.parameters()`` never see it. :meth:`join` makes the loss DDP's forward
returned ``loss + p.sum()`` (``p``, the carrier parameter, is all zeros: the same value and type, and ``p`` in the
graph), and a hook on ``p`` makes its gradient in that backward the buffer :meth:`load` put there; DDP then
averages it in the same bucket as the model's gradients, in C++ (its built-in all-reduce, or an averaging
communication hook), and :meth:`average` returns the average over ranks once the backward has run (a caller that
wants sums loads its numbers times the world size). The join is made in every step, so the carrier's gradient is
ready at the start of each backward: it does not hold back DDP's buckets.

Why: on a host whose cores are busy with the step's compute, one more small collective per step costs about
0.4 ms even when it overlaps backward (``docs/performance.md``); inside a gradient bucket it costs nothing
measurable. Only valid where DDP's communication is an average of the gradients as they are (no compression, no
user hook) and DDP does not search the forward's graph for unused parameters (``find_unused_parameters=False``:
the join comes after DDP's forward, where that search would already have marked ``p`` unused): the caller decides
that.

Example::

    carrier = GradientCarrier(numel=146)
    with carrier.registered_on(module):        # DDP sees one parameter more
        ddp = DistributedDataParallel(module)
    loss = carrier.join(ddp(batch))            # the loss is joined to the carrier parameter
    carrier.load(buffer * world_size)          # this rank's numbers: the carrier's gradient in this backward
    loss.backward()                            # DDP averages it with the gradients
    total = carrier.average()                  # the numbers summed over ranks (None if no backward carried them)
    carrier.close()
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

_PARAMETER_NAME = "_shardplus_gradient_carrier"


def carrier_dtype(module: nn.Module) -> torch.dtype:
    """float64 when every trainable parameter is float64, else float32: the carrier shares a bucket with the
    gradients of its dtype, and float32 holds the carried integers exactly (16-bit types would not)."""
    dtypes = {p.dtype for p in module.parameters() if p.requires_grad}
    return torch.float64 if dtypes == {torch.float64} else torch.float32


class GradientCarrier:
    """One parameter of ``numel`` elements that DDP reduces with the gradients, and whose gradient is the buffer
    loaded before the backward; see the module docstring. One per fit: :meth:`close` ends it."""

    def __init__(self, numel: int) -> None:
        if numel < 1:
            raise ValueError(f"`numel`={numel!r} is not valid: expected a positive number of carried elements.")
        self.numel = numel
        self.parameter: nn.Parameter | None = None  # made at the first registration, on the module's device
        self._zeros: Tensor | None = None  # the gradient of a backward with nothing loaded
        self._loaded: Tensor | None = None  # the next backward's gradient
        self._carried = False  # a backward took the loaded buffer

    @contextmanager
    def registered_on(self, module: nn.Module) -> Iterator[None]:
        """Register the carrier parameter on ``module`` for the duration (build DDP inside)."""
        if self.parameter is None:
            device = next((p.device for p in module.parameters()), torch.device("cpu"))
            self.parameter = nn.Parameter(torch.zeros(self.numel, dtype=carrier_dtype(module), device=device))
            self._zeros = torch.zeros_like(self.parameter)
            # in a backward through the parameter, its gradient is what was loaded (replacing the one the graph
            # gives it); runs before DDP's hook reads the gradient
            self.parameter.register_hook(lambda graphs: self._take())
        if hasattr(module, _PARAMETER_NAME):
            raise RuntimeError(f"shardplus: the module already has an attribute {_PARAMETER_NAME!r}.")
        module.register_parameter(_PARAMETER_NAME, self.parameter)
        try:
            yield
        finally:
            delattr(module, _PARAMETER_NAME)

    def join(self, output: Any) -> Any:
        """``output`` (a training step's: a loss tensor, a mapping with a ``"loss"`` tensor, or anything else, left
        as it is) with its loss joined to the carrier parameter, so that the next backward through it carries."""
        if isinstance(output, Tensor):
            return self._carry(output)
        if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
            return {**output, "loss": self._carry(output["loss"])}
        return output

    def _carry(self, loss: Tensor) -> Tensor:
        if not loss.requires_grad:  # no backward can run through it: leave it alone
            return loss
        # `loss + p.sum()`, p all zeros: the loss's value and type, and the parameter in the graph; the sum's
        # backward expands the gradient without a copy, and the hook on p then hands the loaded buffer instead.
        # Made anew in every step: the autograd engine runs the newest nodes first, so p's gradient is ready at the
        # start of backward (a node kept from an earlier step would run last, and hold back DDP's first bucket,
        # where p sits, and with it every all-reduce, until backward ends).
        assert self.parameter is not None, "join before the carrier was registered"
        link = self.parameter.sum()
        return torch.add(loss, link if link.dtype == loss.dtype else link.to(loss.dtype))

    @property
    def dtype(self) -> torch.dtype:
        """The carrier's type (its gradient's): known once it was registered (:func:`carrier_dtype`)."""
        assert self.parameter is not None, "the carrier is made when it is first registered"
        return self.parameter.dtype

    def load(self, buffer: Tensor) -> None:
        """``buffer`` (``numel`` elements, best of :attr:`dtype`) becomes the carrier's gradient in the next
        backward."""
        assert self.parameter is not None, "load before the carrier was registered"
        if buffer.numel() != self.numel:
            raise ValueError(f"shardplus: a carried buffer has {buffer.numel()} elements, expected {self.numel}.")
        self._loaded = buffer if buffer.dtype == self.parameter.dtype else buffer.to(self.parameter.dtype)
        self._carried = False

    def unload(self) -> None:
        """Forget a loaded buffer and a carried result."""
        self._loaded, self._carried = None, False
        if self.parameter is not None:
            self.parameter.grad = None

    def _take(self) -> Tensor:
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            assert self._zeros is not None
            return self._zeros
        self._carried = True
        return loaded

    def average(self) -> Tensor | None:
        """The loaded buffers averaged over ranks by DDP (of :attr:`dtype`, on the parameter's device), once the
        backward that took them has run; None if no backward took one since :meth:`load`. A tensor of its own:
        the gradient itself, or a copy where it is a view of DDP's bucket (``gradient_as_bucket_view``), which the
        next backward overwrites."""
        if not self._carried:
            return None
        assert self.parameter is not None and self.parameter.grad is not None
        grad = self.parameter.grad
        self.unload()
        return grad if grad._base is None else grad.clone()

    def close(self) -> None:
        """The fit ends: forget what was loaded; the parameter goes with the last DDP wrapper."""
        self.unload()
