"""Argument checks shared by every public class: each error names the argument, the value and what is valid."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    if value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}`={value!r} is not valid: expected one of {valid}.")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}`={value!r} is not valid: expected True or False.")


def check_int(name: str, value: Any, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}`={value!r} is not valid: expected an integer{_bound(minimum)}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}`={value!r} is not valid: expected an integer{_bound(minimum)}.")


def check_positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"`{name}`={value!r} is not valid: expected a finite number > 0.")


def _bound(minimum: int | None) -> str:
    return "" if minimum is None else f" >= {minimum}"


def process_group_timeout(timeout: Any) -> timedelta | None:
    """``timeout`` as DDPStrategy takes it: a timedelta; a number is seconds (as a YAML config gives it)."""
    message = f"`timeout`={timeout!r} is not valid: expected a timedelta > 0, a number of seconds > 0, or None."
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        if timeout <= timedelta(0):
            raise ValueError(message)
        return timeout
    if not isinstance(timeout, numbers.Real) or isinstance(timeout, bool):
        raise TypeError(message)
    try:
        if not 0 < timeout < math.inf:
            raise ValueError(message)
        return timedelta(seconds=float(timeout))
    except OverflowError:
        raise ValueError(message) from None


def check_process_group_backend(backend: Any) -> None:
    """A process-group backend torch knows (its own and registered third-party ones), or per-device ones as
    ``"cpu:gloo,cuda:nccl"``."""
    known = [name for name in dist.Backend.backend_list if name not in ("undefined", "fake")]
    parts = backend.split(",") if isinstance(backend, str) else [None]
    if not all(part is not None and part.split(":")[-1].lower() in known and part == part.strip() for part in parts):
        raise ValueError(
            f"`process_group_backend`={backend!r} is not valid: expected None (Lightning chooses), one of "
            f"{', '.join(repr(k) for k in known)}, or per device like 'cpu:gloo,cuda:nccl'."
        )
