"""Argument checks shared by every public class: each error names the argument, the value and what is valid."""

from __future__ import annotations

import contextlib
import difflib
import math
import numbers
import os
import tempfile
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

START_METHODS = ("popen", "spawn", "fork", "forkserver")  # how a strategy's processes start


def closest(name: str, options: Iterable[str]) -> str | None:
    """The option closest to a misspelled ``name``, or None when none is close."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.75)
    return close[0] if close else None


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    if value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}`={value!r} is not valid: expected one of {valid}.")


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a ``bool``: True or False (numpy's too, as numbers are taken elsewhere), not a number."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}`={value!r} is not valid: expected True or False.")
    return bool(value)


def check_int(name: str, value: Any, minimum: int | None = None) -> int:
    """``value`` as an ``int``: any integer (numpy's too, as for numbers elsewhere), not a bool."""
    message = f"`{name}`={value!r} is not valid: expected an integer{'' if minimum is None else f' >= {minimum}'}."
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(message)
    if minimum is not None and value < minimum:
        raise ValueError(message)
    return int(value)


def check_positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"`{name}`={value!r} is not valid: expected a finite number > 0.")


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
    """At construction: None or a non-empty string. The name is checked when the processes start
    (:func:`check_process_group_backend_known`): a third-party backend registers itself when its package is imported."""
    if backend is not None and (not isinstance(backend, str) or not backend.strip()):
        raise (ValueError if isinstance(backend, str) else TypeError)(
            f"`process_group_backend`={backend!r} is not valid: expected None (Lightning chooses) or a backend "
            "name: 'gloo', 'nccl', a third-party one such as 'ccl', or per device like 'cpu:gloo,cuda:nccl'."
        )


def check_process_group_backend_known(backend: str) -> None:
    """``backend`` names process-group backends torch knows now and has in this build (or per device, as
    ``"cpu:gloo,cuda:nccl"``)."""
    known = [name for name in dist.Backend.backend_list if name not in ("undefined", "fake")]
    for part in backend.split(","):
        name = part.split(":")[-1].lower()
        available = getattr(dist, f"is_{name}_available", None)
        if part != part.strip() or not name:
            problem = f"{part!r} has spaces around it or names no backend"
        elif name not in known:
            problem = f"{name!r} is not a process-group backend torch knows"
        elif available is not None and not available():
            problem = f"this torch build has no {name!r} (torch.distributed.is_{name}_available() is False)"
        else:
            continue
        raise ValueError(
            f"`process_group_backend`={backend!r} is not valid: {problem}: expected one of "
            f"{', '.join(repr(k) for k in known)}, a third-party backend registered with torch "
            "(torch.distributed.Backend.register_backend; importing its package registers it, as "
            "oneccl_bindings_for_pytorch does for 'ccl'), or per device like 'cpu:gloo,cuda:nccl'."
        )

def check_writable_file(
    name: str, value: Any, path: Path | None = None, *, replaced: bool = False, expected: str = "a writable file path"
) -> Path:
    """``value`` as the path of a file this process can create or overwrite (missing directories it can create
    allowed), ``~`` expanded. ``path``: the file ``value`` stands for, when not a path itself; ``replaced``: written
    beside, then renamed over (its directory must be writable too)."""
    given = f"`{name}`={value!r}"
    if path is None:
        text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else ""
        if not text:
            raise ValueError(f"{given} is not valid: expected {expected}.")
        path, names_a_directory = Path(text), isinstance(text, str) and text.endswith(("/", os.sep))
    else:
        given, names_a_directory = f"{given} ({path})", False
    path = path.expanduser()
    if names_a_directory or path.is_dir():
        raise ValueError(f"{given} is a directory: expected {expected} (of a file in it, for example).")
    directory = path.parent
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    if not directory.is_dir():
        raise ValueError(f"{given} cannot be written: `{directory}` is a file, not a directory: expected {expected}.")
    try:
        _try_writing(path, replaced)
    except PermissionError as error:
        denied = Path(error.filename or path)
        where = "this file" if denied == path else f"in `{denied.parent}`"
        raise ValueError(f"{given} cannot be written: no permission to write {where}: expected {expected}.") from None
    except OSError as error:
        raise ValueError(f"{given} cannot be written ({error}): expected {expected}.") from None
    return path


def _try_writing(path: Path, replaced: bool) -> None:
    """Create the missing directories of ``path`` and a temporary file beside it (or open ``path`` for appending
    where it exists), then remove what was created: ``os.access`` says yes to root even where nothing can be created
    (under ``/proc``)."""
    created: list[Path] = []
    try:
        for directory in reversed(path.parents):
            if not directory.exists():
                directory.mkdir()
                created.append(directory)
        if path.exists():
            open(path, "ab").close()
        if replaced or not path.exists():
            tempfile.NamedTemporaryFile(dir=path.parent).close()
    finally:
        for directory in reversed(created):
            with contextlib.suppress(OSError):
                directory.rmdir()


def class_name(instance: Any) -> str:
    """The name of ``instance``'s class as its author wrote it, for messages: FSDP2's ``fully_shard`` swaps a module's
    class for a subclass named ``FSDP<Name>`` (made in ``torch.distributed``), which no user wrote.

    Example: ``class_name(fully_shard(Classifier()))`` is ``"Classifier"``, where ``type(...).__name__`` is
    ``"FSDPClassifier"``."""
    written = (klass for klass in type(instance).__mro__ if not klass.__module__.startswith("torch.distributed."))
    return next(written).__name__
