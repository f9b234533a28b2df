"""The one door to torch's private names; each is guarded by a canary in tests/test_lightning_private.py."""

from __future__ import annotations

from collections.abc import Callable

import torch

# The first bucket DDP builds when it is given no bucket size: 1 MiB on torch 2.3 to 2.14, where DDP's documentation
# names only the 25 MiB of the others. A copy, not a read: the canary in tests/test_lightning_private.py compares it
# with torch's own `dist._DEFAULT_FIRST_BUCKET_BYTES`.
DDP_DEFAULT_FIRST_BUCKET_BYTES: int = 2**20


def call_when_backward_ends(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass has computed every gradient: called from a hook on the loss,
    it runs before DDP's end-of-pass callback (which waits for the all-reduces). Private: the autograd engine's
    ``queue_callback``, as DDP's Python side and FSDP use it."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]
