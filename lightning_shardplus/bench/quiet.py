"""The benchmark's own runs without Lightning's banners, infos and warnings: log levels and warning filters set for
the duration of one run and restored after it (inherited by the forked workers), not patches of Lightning."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

# the loggers of Lightning's banners ("GPU available", "Initializing distributed", "`Trainer.fit` stopped") and of
# the strategy's one-line summaries
QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_shardplus")


@contextmanager
def quiet_run() -> Iterator[None]:
    """Within it, the loggers of :data:`QUIET_LOGGERS` pass only errors and warnings are not shown."""
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
