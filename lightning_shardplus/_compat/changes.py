"""Every change shardplus makes to an object it does not own (Lightning's, torch's, the user's, the process's) goes
through a :class:`RunChanges`, which undoes it in reverse order when its owner's run ends, also after an exception.
:class:`Change` names each kind; docs/architecture.md's table says why and when each is undone (a test keeps the two
equal), and :func:`active_changes` says which are in effect now, over all owners.

Example::

    changes = RunChanges()
    changes.set(Change.ACCUMULATION, trainer, "accumulate_grad_batches", 4)
    with changes.scoped(Change.FORWARD_WITHOUT_DATA, module, "forward", zero_forward):
        ddp()  # module.forward is the module's own again after the block
    changes.undo()  # trainer.accumulate_grad_batches is the user's again
"""

from __future__ import annotations

import enum
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class Change(enum.Enum):
    """A kind of change to an object shardplus does not own; the value names the object."""

    RANK_VARIABLES = "os.environ: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE"
    WARNING_FILTERS = "warnings.filters and litdata's logger filters"
    LAUNCH = "the strategy's launcher: launch"
    ZERO_LENGTH_LOADERS = "the LightningModule: allow_zero_length_dataloader_with_multiple_devices"
    METRIC_PROCESS_GROUP = "a torchmetrics Metric: process_group"
    METRIC_SYNC = "a torchmetrics Metric: sync_on_compute, dist_sync_on_step, distributed_available_fn"
    ACCUMULATION = "the Trainer: accumulate_grad_batches"
    TRAINING_LOGS = "Lightning's training _ResultCollection: log"
    FORWARD_WITHOUT_DATA = "the LightningModule: forward"
    LOGS_DROPPED = "the LightningModule: log"


_ABSENT = object()
_LIVE: weakref.WeakSet[RunChanges] = weakref.WeakSet()


class RunChanges:
    """The changes one owner (a strategy's run, a callback's) made, each with its undo."""

    def __init__(self) -> None:
        self._undos: list[tuple[Change, Callable[[], None]]] = []
        _LIVE.add(self)

    def __reduce__(self) -> tuple[type, tuple[()]]:
        """A copy sent to another process (the strategy of a spawn worker) starts empty: each process undoes its own
        changes."""
        return (RunChanges, ())

    @property
    def active(self) -> list[Change]:
        """The kinds of change in effect, oldest first."""
        return [change for change, _ in self._undos]

    def set(self, change: Change, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``; the undo puts the previous value back, or removes an attribute that
        shadowed the class's (a method patched on an instance)."""
        previous = vars(owner).get(name, _ABSENT)
        setattr(owner, name, value)
        self._undos.append((change, lambda: _put_back(owner, name, previous)))

    def set_environment(self, change: Change, values: dict[str, str]) -> None:
        """Set ``os.environ`` entries (none: no change); the undo puts back each one's previous value or absence."""
        if not values:
            return
        previous = {name: os.environ.get(name) for name in values}
        os.environ.update(values)

        def undo() -> None:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

        self._undos.append((change, undo))

    def apply(self, change: Change, undo: Callable[[], None]) -> None:
        """Record a change already made by a function that returned its ``undo``."""
        self._undos.append((change, undo))

    @contextmanager
    def scoped(self, change: Change, owner: Any, name: str, value: Any) -> Iterator[None]:
        """:meth:`set` for the block only."""
        self.set(change, owner, name, value)
        entry = self._undos[-1]
        try:
            yield
        finally:
            self._undos.remove(entry)
            entry[1]()

    def undo(self) -> None:
        """Undo every change, the newest first; all are undone even when one undo raises (the first error then)."""
        errors = []
        while self._undos:
            _, undo = self._undos.pop()
            try:
                undo()
            except Exception as error:  # noqa: BLE001  (the others are still undone)
                errors.append(error)
        if errors:
            raise errors[0]


def _put_back(owner: Any, name: str, previous: Any) -> None:
    if previous is _ABSENT:
        if name in vars(owner):
            delattr(owner, name)
    else:
        setattr(owner, name, previous)


def active_changes() -> list[Change]:
    """The changes in effect in this process, over every owner. Between Trainer runs, only ``LAUNCH`` of a strategy
    whose Trainer ran in the workers it launched (fork, spawn): that process runs no ``teardown``."""
    return [change for changes in list(_LIVE) for change in changes.active]
