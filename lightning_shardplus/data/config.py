"""``DataSideConfig``: the data side's options, shared by both strategies, typed, validated once at construction and
frozen; ``fit_to_lightning`` turns off (or refuses) a feature this Lightning cannot run. Errors name the argument,
the value and what would be valid, before any process group starts."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import cache

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus.data.sharding import PADDING_MODES, PaddingMode
from lightning_shardplus.data.uneven import UNEVEN_INPUTS, UnevenInputs
from lightning_shardplus.validation import check_bool, check_choice, check_int


@dataclass(frozen=True)
class DataSideConfig:
    """The data-side options of both strategies (documented on :class:`~lightning_shardplus.ShardPlusStrategy`)."""

    aggregation_frequency: int = 1
    average_aggregated_gradients: bool = True
    shard_padding: PaddingMode = "first"
    shuffle_seed: int | None = None
    exact_evaluation: bool = True
    verify_sharding: bool = False
    average_training_metrics: bool = True
    uneven_inputs: UnevenInputs = "join"

    def __post_init__(self) -> None:
        frequency = check_int("aggregation_frequency", self.aggregation_frequency, minimum=1)
        object.__setattr__(self, "aggregation_frequency", frequency)  # numpy's integers as int
        check_choice("shard_padding", self.shard_padding, PADDING_MODES)
        if self.shuffle_seed is not None:
            object.__setattr__(self, "shuffle_seed", check_int("shuffle_seed", self.shuffle_seed, minimum=0))
        for name in ("average_aggregated_gradients", "exact_evaluation", "verify_sharding", "average_training_metrics"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))  # numpy's bools as bool
        check_choice("uneven_inputs", self.uneven_inputs, UNEVEN_INPUTS)

    @property
    def epoch_seed(self) -> int:
        """``shuffle_seed``, else the ``seed_everything`` seed, else 0."""
        if self.shuffle_seed is not None:
            return self.shuffle_seed
        return int(os.environ.get("PL_GLOBAL_SEED", 0))


# What takes the place of a default feature this Lightning cannot run (`_lightning.lightning_gaps`).
_FALLBACKS = {
    "exact_evaluation": "evaluation runs on Lightning's DistributedSampler, as under strategy='ddp'",
    "average_training_metrics": "training values are synced as `self.log(sync_dist=...)` asks, as under 'ddp'",
}


def fit_to_lightning(config: DataSideConfig) -> DataSideConfig:
    """``config`` on this Lightning: a feature whose private Lightning names moved is refused, or, where it is on by
    default, turned off with one warning; never a failure in the middle of a fit."""
    for feature, gap in _lightning.lightning_gaps().items():
        if feature != "sharding" and not getattr(config, feature, False):
            continue  # off, or not a data-side option (the model-parallel strategy checks `start_method`)
        moved = f"Lightning {_lightning.pl.__version__} moved a private name it needs ({gap})"
        supported = f"Lightning {_lightning.SUPPORTED} run it (docs/compatibility.md)"
        if feature not in _FALLBACKS:
            what = "ShardPlusStrategy" if feature == "sharding" else f"`{feature}`=True"
            raise RuntimeError(f"{what} cannot run here: {moved}. {supported}.")
        _warn_once(f"shardplus: `{feature}` is off: {moved}; {_FALLBACKS[feature]}. {supported}.")
        config = dataclasses.replace(config, **{feature: False})
    return config


_warn_once = cache(rank_zero_warn)  # one warning per message and process
