"""Argument checks shared by every public class: each error names the argument, the value and what is valid."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"`{name}`={value!r} is not valid: expected a finite number > 0.")


def _bound(minimum: int | None) -> str:
    return "" if minimum is None else f" >= {minimum}"
