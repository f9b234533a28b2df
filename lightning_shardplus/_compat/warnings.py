"""Lightning's console warnings that are false under shardplus, silenced where and while they are false; each
``silence_*`` returns what undoes it."""

from __future__ import annotations

import re
import warnings
from typing import Any

from lightning.pytorch.utilities.warnings import PossibleUserWarning

from lightning_shardplus._compat import lightning as _lightning

# matched by their text (canaries: tests/test_lightning_private.py)
EVALUATION_SAMPLER_WARNING = r"Using `DistributedSampler` with the dataloaders\. During `trainer\."


def silence_evaluation_sampler_warning() -> Any:
    """Ignore Lightning's advice of one device for validate/test (exact evaluation replicates no sample)."""
    return _ignore_warning(EVALUATION_SAMPLER_WARNING)


# on a mid-epoch resume with a loader that is not `_Stateful`: false where shardplus's samplers continue the epoch
NOT_RESUMABLE_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is"


def silence_not_resumable_warning() -> Any:
    """Ignore Lightning's warning that the training loaders cannot resume mid-epoch (each continued exactly)."""
    return _ignore_warning(NOT_RESUMABLE_WARNING)


# Lightning's advice to sync epoch-level values, once per value name: the evaluation loop reads the epoch values
# before the epoch-end hooks, where exact evaluation reduces them; for those values the advice is wrong.
EPOCH_SYNC_ADVICE = (
    r"It is recommended to use `self\.log\({names}, \.\.\., sync_dist=True\)` when logging on epoch level in "
    r"distributed setting"
)


def silence_epoch_sync_advice(names: Any) -> Any:
    """Ignore Lightning's sync_dist advice for the values logged under ``names``; the undo also forgets it was given
    for them (once per name and process), so that a later run where it is true still sees it."""
    pattern = EPOCH_SYNC_ADVICE.format(names="(" + "|".join(re.escape(repr(name)) for name in sorted(names)) + ")")
    restore_filter = _ignore_warning(pattern)

    def restore() -> None:
        restore_filter()
        _lightning.forget_given_warnings(pattern)

    return restore


def _ignore_warning(pattern: str) -> Any:
    """A process-wide "ignore" filter for Lightning's ``PossibleUserWarning`` matching ``pattern``; returns its undo.
    Put into ``warnings.filters`` directly: ``warnings.filterwarnings`` would make Python show each "default" warning
    again (Lightning's LeafSpec deprecation, twice per process); an "ignore" filter needs no such reset."""
    added = ("ignore", re.compile(pattern, re.I), PossibleUserWarning, None, 0)
    warnings.filters.insert(0, added)

    def restore() -> None:
        if added in warnings.filters:  # an "ignore" filter leaves nothing in the warning registries to reset
            warnings.filters.remove(added)

    return restore
