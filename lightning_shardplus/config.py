"""``ShardPlusConfig``: every ``ShardPlusStrategy`` argument, typed, validated once and frozen.

The strategy builds one from its keyword arguments and never changes it; what a fit learns (the tuned bucket
size, the sampler positions) belongs to the components built from it. Errors name the argument, the value and
what would be valid, and are raised at construction, before any process group starts.

Example::

    config = ShardPlusConfig(aggregation_frequency=4, gradient_compression="fp16")
    config.autotune_settings.max_tuning_steps  # the search space of `auto_tune_tensor_fusion`
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel

from lightning_shardplus import fusion
from lightning_shardplus._validation import (
    check_bool,
    check_choice,
    check_int,
    check_process_group_backend,
    check_writable_file,
    process_group_timeout,
)
from lightning_shardplus.aggregation import check_static_graph
from lightning_shardplus.compression import GRADIENT_COMPRESSIONS, GradientCompression
from lightning_shardplus.sharding import PADDING_MODES, PaddingMode
from lightning_shardplus.uneven import UNEVEN_INPUTS, UnevenInputs

# Keyword arguments DDPStrategy forwards to torch's DistributedDataParallel.
DDP_KWARGS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {
    "self",
    "module",
    "device_ids",
    "bucket_cap_mb",  # set through `tensor_fusion_threshold_mb`
}
START_METHODS = ("popen", "spawn", "fork", "forkserver")
# ShardPlusStrategy's own arguments: DDPStrategy's, the shardplus ones (ShardPlusConfig) and the DDP flags it names.
_DDP_STRATEGY_ARGUMENTS = tuple(
    name
    for name, parameter in inspect.signature(DDPStrategy.__init__).parameters.items()
    if name != "self" and parameter.kind is parameter.POSITIONAL_OR_KEYWORD
)
# DistributedDataParallel's defaults: what it gets when an argument is left out.
DDP_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(DistributedDataParallel.__init__).parameters.items()
    if parameter.default is not inspect.Parameter.empty
}


@dataclass(frozen=True)
class ShardPlusConfig:
    """The shardplus arguments of :class:`~lightning_shardplus.ShardPlusStrategy` (documented there, and one line
    each in the README's table). ``autotune_candidates_mb`` of None: sizes chosen from the model's gradient size
    (:func:`~lightning_shardplus.fusion.default_candidates_mb`); ``autotune_first_bucket_candidates_mb`` of None:
    :mod:`~lightning_shardplus.fusion`'s default."""

    aggregation_frequency: int = 1
    average_aggregated_gradients: bool = True
    gradient_compression: GradientCompression = "none"
    shard_padding: PaddingMode = "first"
    shuffle_seed: int | None = None
    exact_evaluation: bool = True
    verify_sharding: bool = False
    tensor_fusion_threshold_mb: float | None = None
    auto_tune_tensor_fusion: bool = False
    autotune_log: str | os.PathLike | None = None
    autotune_candidates_mb: tuple[float, ...] | None = None
    autotune_first_bucket_candidates_mb: tuple[float, ...] | None = None
    autotune_steps_per_sample: int = 8
    autotune_warmup_steps: int = 1
    autotune_cache: str | os.PathLike | bool = True
    average_training_metrics: bool = True
    uneven_inputs: UnevenInputs = "join"

    def __post_init__(self) -> None:
        frequency = check_int("aggregation_frequency", self.aggregation_frequency, minimum=1)
        object.__setattr__(self, "aggregation_frequency", frequency)  # numpy's integers as int
        check_choice("gradient_compression", self.gradient_compression, GRADIENT_COMPRESSIONS)
        check_choice("shard_padding", self.shard_padding, PADDING_MODES)
        if self.shuffle_seed is not None:
            object.__setattr__(self, "shuffle_seed", check_int("shuffle_seed", self.shuffle_seed, minimum=0))
        for name in ("average_aggregated_gradients", "exact_evaluation", "verify_sharding"):
            check_bool(name, getattr(self, name))
        if self.tensor_fusion_threshold_mb is not None:
            fusion.check_bucket_size("tensor_fusion_threshold_mb", self.tensor_fusion_threshold_mb)
            object.__setattr__(self, "tensor_fusion_threshold_mb", float(self.tensor_fusion_threshold_mb))
        check_bool("auto_tune_tensor_fusion", self.auto_tune_tensor_fusion)
        if self.autotune_log is not None and not isinstance(self.autotune_log, (str, os.PathLike)):
            raise TypeError(f"`autotune_log`={self.autotune_log!r} is not valid: expected a file path or None.")
        if self.autotune_log is not None:
            check_writable_file("autotune_log", self.autotune_log, expected="a writable file path or None")
        if not isinstance(self.autotune_cache, (bool, str, os.PathLike)):
            raise TypeError(
                f"`autotune_cache`={self.autotune_cache!r} is not valid: expected True, False or a file path."
            )
        if self.autotune_cache is not False and (self.autotune_cache is not True or self.auto_tune_tensor_fusion):
            fusion.check_cache_file("autotune_cache", self.autotune_cache)  # the default only where it is used
        _ = self.autotune_settings  # checked even when tuning is off: a YAML typo fails early
        check_bool("average_training_metrics", self.average_training_metrics)
        check_choice("uneven_inputs", self.uneven_inputs, UNEVEN_INPUTS)

    @classmethod
    def from_arguments(cls, arguments: dict[str, Any]) -> ShardPlusConfig:
        """The config of the strategy arguments among ``arguments`` (the strategy's ``locals()``)."""
        return cls(**{field.name: arguments[field.name] for field in dataclasses.fields(cls)})

    @cached_property
    def autotune_settings(self) -> fusion.AutotuneSettings:
        """The search space and budget of ``auto_tune_tensor_fusion``."""
        candidates, first = self.autotune_candidates_mb, self.autotune_first_bucket_candidates_mb
        return fusion.AutotuneSettings(
            candidates_mb=candidates,  # None: the model's (fusion.default_candidates_mb), chosen in setup
            first_bucket_candidates_mb=fusion.DEFAULT_FIRST_BUCKET_CANDIDATES_MB if first is None else first,
            steps_per_sample=self.autotune_steps_per_sample,
            warmup_steps=self.autotune_warmup_steps,
            fixed_bucket_cap_mb=self.tensor_fusion_threshold_mb,
        )

    @property
    def bucket_setting(self) -> fusion.BucketSetting:
        """The buckets DDP gets without tuning: the given size, else DDP's own default."""
        return self.autotune_settings.reference

    @property
    def epoch_seed(self) -> int:
        """Seed of the epoch permutation: ``shuffle_seed``, else the ``seed_everything`` seed, else 0."""
        if self.shuffle_seed is not None:
            return self.shuffle_seed
        return int(os.environ.get("PL_GLOBAL_SEED", 0))


STRATEGY_OPTIONS: tuple[str, ...] = (
    *_DDP_STRATEGY_ARGUMENTS,
    *(field.name for field in dataclasses.fields(ShardPlusConfig)),
    *("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "broadcast_buffers"),
)


def at_ddp_defaults(settings: dict[str, Any]) -> list[str]:
    """The names of ``settings`` (DistributedDataParallel arguments) whose value is DDP's default; None is taken as
    the default too (``bucket_cap_mb``'s default is None from torch 2.4, 25 before)."""
    return [name for name, value in settings.items() if name in DDP_DEFAULTS and value in (None, DDP_DEFAULTS[name])]


def check_ddp_arguments(
    config: ShardPlusConfig,
    start_method: str,
    timeout: Any,
    process_group_backend: str | None,
    ddp_comm_hook: Callable | None,
    ddp_comm_state: object | None,
    ddp_kwargs: dict[str, Any],
) -> timedelta | None:
    """Check the ``DDPStrategy`` arguments and how they combine with ``config``; returns the timeout as a
    timedelta (a number is seconds, as a YAML config gives it)."""
    check_choice("start_method", start_method, START_METHODS)
    check_process_group_backend(process_group_backend)  # its name when the processes start (`preflight`)
    for name in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "broadcast_buffers"):
        if name in ddp_kwargs and not (name == "broadcast_buffers" and ddp_kwargs[name] is None):
            check_bool(name, ddp_kwargs[name])
    _check_communication_hook(config, ddp_comm_hook, ddp_comm_state)
    _check_bucket_arguments(config, ddp_kwargs)
    check_static_graph(config.aggregation_frequency, ddp_kwargs.get("static_graph") is True, "`aggregation_frequency`")
    return process_group_timeout(timeout)


def _check_communication_hook(config: ShardPlusConfig, hook: Callable | None, state: object | None) -> None:
    compression = config.gradient_compression
    if compression != "none" and hook is not None:
        raise ValueError(
            f"`gradient_compression`={compression!r} and `ddp_comm_hook`={hook!r} both "
            "choose DDP's communication hook: give one of them (gradient_compression='none' for yours)."
        )
    if compression != "none" and state is not None and not (
        compression == "powersgd" and isinstance(state, PowerSGDState)
    ):
        raise ValueError(
            f"`ddp_comm_state`={state!r} does not go with `gradient_compression`="
            f"{compression!r}: only 'powersgd' takes a state (a PowerSGDState)."
        )
    if config.auto_tune_tensor_fusion and hook is not None and state is not None:
        raise ValueError(
            f"`ddp_comm_state`={state!r} with `auto_tune_tensor_fusion`=True: tuning re-wraps DDP with "
            "other buckets, and a hook state kept per bucket (PowerSGD's error feedback) would no longer fit. "
            "Use `gradient_compression='powersgd'` (its state is rebuilt on re-wrap) or turn tuning off."
        )


def _check_bucket_arguments(config: ShardPlusConfig, ddp_kwargs: dict[str, Any]) -> None:
    caps = ddp_kwargs.get("bucket_cap_mb_list")
    if caps is not None and (config.auto_tune_tensor_fusion or config.tensor_fusion_threshold_mb is not None):
        other = (
            "`auto_tune_tensor_fusion`=True"
            if config.auto_tune_tensor_fusion
            else f"`tensor_fusion_threshold_mb`={config.tensor_fusion_threshold_mb:g}"
        )
        raise ValueError(
            f"`bucket_cap_mb_list`={caps!r} and {other} both set DDP's bucket sizes (DDP would take the list and "
            "ignore the size): give one of them."
        )
    if "bucket_cap_mb" in ddp_kwargs:
        raise TypeError(
            f"`bucket_cap_mb`={ddp_kwargs['bucket_cap_mb']!r} is not a ShardPlusStrategy option: "
            "set the bucket size with `tensor_fusion_threshold_mb`."
        )
    unknown = sorted(set(ddp_kwargs) - DDP_KWARGS)
    if unknown:
        hints = {k: f" (did you mean `{close}`?)" if (close := closest_option(k)) else "" for k in unknown}
        given = ", ".join(f"`{k}`={ddp_kwargs[k]!r}{hints[k]}" for k in unknown)
        raise TypeError(
            f"ShardPlusStrategy got unknown option(s) {given}: valid are its own arguments "
            f"({', '.join(STRATEGY_OPTIONS)}) and DistributedDataParallel's ({', '.join(sorted(DDP_KWARGS))})."
        )


def closest_option(name: str) -> str | None:
    """The option of ``ShardPlusStrategy`` (its own, or DistributedDataParallel's it passes on) closest to a
    misspelled ``name`` (difflib), or None when none is close."""
    close = difflib.get_close_matches(name, [*STRATEGY_OPTIONS, *sorted(DDP_KWARGS)], n=1, cutoff=0.75)
    return close[0] if close else None


def registered_names() -> dict[str, tuple[str, dict[str, Any]]]:
    """Lightning's ``ddp*`` family of names as ``shardplus*`` (``shardplus_spawn``,
    ``shardplus_fork_find_unused_parameters_true``, ...): name -> (description, ``init_params``), the parameters
    Lightning registers for the ``ddp`` name of the same suffix (the strategy then leaves DDP's defaults out of
    DDP's arguments, as with ``strategy="ddp"``)."""
    methods = {"": "popen", "_spawn": "spawn", "_fork": "fork", "_notebook": "fork"}
    unused_flags = {"": None, "_find_unused_parameters_true": True, "_find_unused_parameters_false": False}
    names = {}
    for (suffix, method), (flag, unused) in itertools.product(methods.items(), unused_flags.items()):
        init_params: dict[str, Any] = {"start_method": method}
        if unused is not None:
            init_params["find_unused_parameters"] = unused
        description = f"ShardPlus data-parallel strategy with `start_method` '{method}'"
        if unused is not None:
            description += f" and `find_unused_parameters={unused}`"
        names[f"shardplus{suffix}{flag}"] = (description, init_params)
    return names
