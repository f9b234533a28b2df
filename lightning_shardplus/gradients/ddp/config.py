"""``ShardPlusConfig``: the options of ``ShardPlusStrategy``, the data side's (``DataSideConfig``) and DDP's, typed,
validated once at construction and frozen; the checks of DDPStrategy's and DistributedDataParallel's arguments.

Errors name the argument, the value and what would be valid, before any process group starts; what a fit learns
belongs to the components built from the config.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Any

import lightning.fabric.plugins  # noqa: F401  (the modules `_lightning_classes` reads in sys.modules)
import lightning.pytorch.plugins.precision  # noqa: F401
import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn import Parameter
from torch.nn.parallel import DistributedDataParallel

from lightning_shardplus.data.aggregation import check_static_graph
from lightning_shardplus.data.config import DataSideConfig, fit_to_lightning
from lightning_shardplus.gradients.ddp import fusion, fusion_cache
from lightning_shardplus.gradients.ddp.compression import GRADIENT_COMPRESSIONS, GradientCompression
from lightning_shardplus.validation import (
    START_METHODS,
    check_bool,
    check_choice,
    check_int,
    check_process_group_backend,
    check_writable_file,
    closest,
    process_group_timeout,
)

_DDP_PARAMETERS = inspect.signature(DistributedDataParallel.__init__).parameters
# Keyword arguments DDPStrategy forwards to DDP (`bucket_cap_mb` is set through `tensor_fusion_threshold_mb`).
DDP_KWARGS = frozenset(_DDP_PARAMETERS) - {"self", "module", "device_ids", "bucket_cap_mb"}
DDP_DEFAULTS = {name: p.default for name, p in _DDP_PARAMETERS.items() if p.default is not inspect.Parameter.empty}
_DDP_STRATEGY_ARGUMENTS = tuple(
    name for name, p in inspect.signature(DDPStrategy.__init__).parameters.items()
    if name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD
)  # fmt: skip


@dataclass(frozen=True)
class ShardPlusConfig(DataSideConfig):
    """The options of :class:`~lightning_shardplus.ShardPlusStrategy` (documented there): the data side's and DDP's
    gradient side's (compression, tensor fusion and its tuning)."""

    gradient_compression: GradientCompression = "none"
    tensor_fusion_threshold_mb: float | None = None
    auto_tune_tensor_fusion: bool = False
    autotune_log: str | os.PathLike | None = None
    autotune_candidates_mb: tuple[float, ...] | None = None
    autotune_first_bucket_candidates_mb: tuple[float, ...] | None = None
    autotune_steps_per_sample: int = 8
    autotune_warmup_steps: int = 1
    autotune_cache: str | os.PathLike | bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("gradient_compression", self.gradient_compression, GRADIENT_COMPRESSIONS)
        tune = check_bool("auto_tune_tensor_fusion", self.auto_tune_tensor_fusion)
        object.__setattr__(self, "auto_tune_tensor_fusion", tune)  # numpy's bools as bool
        if self.tensor_fusion_threshold_mb is not None:
            fusion.check_bucket_size("tensor_fusion_threshold_mb", self.tensor_fusion_threshold_mb)
            object.__setattr__(self, "tensor_fusion_threshold_mb", float(self.tensor_fusion_threshold_mb))
        if self.autotune_log is not None and not isinstance(self.autotune_log, (str, os.PathLike)):
            raise TypeError(f"`autotune_log`={self.autotune_log!r} is not valid: expected a file path or None.")
        if self.autotune_log is not None:
            check_writable_file("autotune_log", self.autotune_log, expected="a writable file path or None")
        if not isinstance(self.autotune_cache, (bool, str, os.PathLike)):
            raise TypeError(
                f"`autotune_cache`={self.autotune_cache!r} is not valid: expected True, False or a file path."
            )
        if self.autotune_cache is not False and (self.autotune_cache is not True or self.auto_tune_tensor_fusion):
            fusion_cache.check_cache_file("autotune_cache", self.autotune_cache)  # the default only where it is used
        _ = self.autotune_settings  # checked even when tuning is off: a YAML typo fails early

    @classmethod
    def from_arguments(cls, arguments: dict[str, Any]) -> ShardPlusConfig:
        """The config of the strategy arguments among ``arguments`` (the strategy's ``locals()``)."""
        return cls(**{field.name: arguments[field.name] for field in dataclasses.fields(cls)})

    @cached_property
    def autotune_settings(self) -> fusion.AutotuneSettings:
        """The search space and budget of ``auto_tune_tensor_fusion``."""
        first = self.autotune_first_bucket_candidates_mb
        return fusion.AutotuneSettings(  # candidates None: the model's, chosen in setup
            candidates_mb=self.autotune_candidates_mb,
            first_bucket_candidates_mb=fusion.DEFAULT_FIRST_BUCKET_CANDIDATES_MB if first is None else first,
            steps_per_sample=self.autotune_steps_per_sample, warmup_steps=self.autotune_warmup_steps,
            fixed_bucket_cap_mb=self.tensor_fusion_threshold_mb,
        )  # fmt: skip



STRATEGY_OPTIONS: tuple[str, ...] = (
    *_DDP_STRATEGY_ARGUMENTS,
    *(field.name for field in dataclasses.fields(ShardPlusConfig)),
    *("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "broadcast_buffers"),
)


def check_arguments(arguments: dict[str, Any]) -> tuple[ShardPlusConfig, timedelta | None, dict[str, Any], list[str]]:
    """``ShardPlusStrategy``'s arguments (its ``locals()``) checked: its config, DDP's timeout (a number is
    seconds, as YAML gives it), the keyword arguments for ``DDPStrategy`` as DDP takes them, and the names of
    those at DDP's own default (left out then, as with ``strategy="ddp"``)."""
    config, a = fit_to_lightning(ShardPlusConfig.from_arguments(arguments)), arguments
    flags = {"static_graph": a["static_graph"], "gradient_as_bucket_view": a["gradient_as_bucket_view"]}
    ddp_kwargs = dict(a["ddp_kwargs"])
    for name in ("find_unused_parameters", "broadcast_buffers"):  # only when given (torch 2.13 deprecates the latter)
        if a[name] is not None:
            ddp_kwargs[name] = a[name]
    check_strategy_plugins(a["accelerator"], a["model_averaging_period"], **{name: a[name] for name in _PLUGIN_TYPES})
    check_choice("start_method", a["start_method"], START_METHODS)
    check_process_group_backend(a["process_group_backend"])  # its name when the processes start (`preflight`)
    _check_communication_hook(config, a["ddp_comm_hook"], a["ddp_comm_state"])
    _check_bucket_arguments(config, {**flags, **ddp_kwargs})
    ddp_kwargs = check_ddp_kwargs({**flags, **ddp_kwargs})  # numpy's bools as bool
    check_static_graph(config.aggregation_frequency, ddp_kwargs.get("static_graph") is True, "`aggregation_frequency`")
    given = {"bucket_cap_mb": config.tensor_fusion_threshold_mb, **{name: ddp_kwargs[name] for name in flags}}
    defaults = [name for name, value in given.items() if value in (None, DDP_DEFAULTS[name])]  # None: torch < 2.4 too
    return config, process_group_timeout(a["timeout"]), ddp_kwargs, defaults


# DistributedDataParallel's flags (each checked where this torch has it); the optional ones take None (its default).
_DDP_FLAGS = (
    "init_sync", "find_unused_parameters", "check_reduction", "gradient_as_bucket_view", "static_graph",
    "skip_all_reduce_unused_params", "batched_grad_copy",
)  # fmt: skip
_DDP_OPTIONAL_FLAGS = ("broadcast_buffers", "forward_sync_buffers")


def check_ddp_kwargs(ddp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """DDP's keyword arguments checked as DDP would take them in every worker; numpy's bools and numbers as Python's."""
    checked = dict(ddp_kwargs)
    for name in (*_DDP_FLAGS, *_DDP_OPTIONAL_FLAGS):
        if name in checked and not (name in _DDP_OPTIONAL_FLAGS and checked[name] is None):
            checked[name] = check_bool(name, checked[name])
    if "dim" in checked:
        checked["dim"] = check_int("dim", checked["dim"])
    if checked.get("bucket_cap_mb_list") is not None:
        checked["bucket_cap_mb_list"] = _bucket_caps(checked["bucket_cap_mb_list"])
    if checked.get("output_device") is not None:
        checked["output_device"] = _device("output_device", checked["output_device"])
    _check_types(checked)
    return checked


def _bucket_caps(caps: Any) -> list[float]:
    if not isinstance(caps, (list, tuple)) or not all(fusion.is_bucket_size(cap) for cap in caps):
        raise ValueError(
            f"`bucket_cap_mb_list`={caps!r} is not valid: expected a list of bucket sizes in MB, one per bucket in "
            f"order, each {fusion.BUCKET_SIZE_RANGE}."
        )
    return [float(cap) for cap in caps]


def _device(name: str, value: Any) -> int | str | torch.device:
    expected = "expected None, a device index or a device such as 'cuda:0' or torch.device('cuda', 0)"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"`{name}`={value!r} is not valid: {expected}.")
    try:
        torch.device(value)
    except RuntimeError:
        raise ValueError(f"`{name}`={value!r} is not valid: {expected}.") from None
    return value


def _check_types(ddp_kwargs: dict[str, Any]) -> None:
    """DDP's arguments that are objects: process group or device mesh, mixed precision, delayed all-reduce."""
    from torch.distributed.device_mesh import DeviceMesh

    kinds = {"process_group": dist.ProcessGroup, "device_mesh": DeviceMesh, "param_to_hook_all_reduce": Parameter}
    for name, kind in kinds.items():
        if ddp_kwargs.get(name) is not None and not isinstance(ddp_kwargs[name], kind):
            raise TypeError(f"`{name}`={ddp_kwargs[name]!r} is not valid: expected None or a {_qualname(kind)}.")
    precision = ddp_kwargs.get("mixed_precision")
    dtypes = ("param_dtype", "reduce_dtype", "buffer_dtype")
    if precision is not None and not all(hasattr(precision, dtype) for dtype in dtypes):
        raise TypeError(
            f"`mixed_precision`={precision!r} is not valid: expected None or a mixed-precision setting with "
            "`param_dtype`, `reduce_dtype` and `buffer_dtype` (torch.nn.parallel.distributed._MixedPrecision)."
        )
    delayed = ddp_kwargs.get("delay_all_reduce_named_params")
    if delayed is not None and not (
        isinstance(delayed, (list, tuple))
        and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], Parameter) for p in delayed)
    ):
        raise TypeError(
            f"`delay_all_reduce_named_params`={delayed!r} is not valid: expected None or a list of (name, "
            "torch.nn.Parameter) pairs."
        )
    if (delayed is None) != (ddp_kwargs.get("param_to_hook_all_reduce") is None):
        raise ValueError(
            "`delay_all_reduce_named_params` and `param_to_hook_all_reduce` go together: give both or neither "
            f"(got {delayed!r} and {ddp_kwargs.get('param_to_hook_all_reduce')!r})."
        )
    if ddp_kwargs.get("process_group") is not None and ddp_kwargs.get("device_mesh") is not None:
        raise ValueError("`process_group` and `device_mesh` both choose DDP's process group: give one of them.")


def _qualname(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def check_strategy_plugins(accelerator: Any, model_averaging_period: Any, **plugins: Any) -> None:
    """``DDPStrategy``'s own arguments, which Lightning checks only later: ``accelerator`` and ``plugins`` by name."""
    names = ("auto", "gpu", *sorted(AcceleratorRegistry.available_accelerators()))
    if accelerator is not None and not isinstance(accelerator, (*_lightning_classes("Accelerator"), str)):
        raise TypeError(f"`accelerator`={accelerator!r} is not valid: expected None, an Accelerator or one of {names}.")
    if isinstance(accelerator, str) and accelerator not in names:
        raise ValueError(
            f"`accelerator`={accelerator!r} is not valid: expected None, an Accelerator or one of {names}. It is "
            "DDPStrategy's first positional argument: give ShardPlusStrategy's own options by keyword "
            "(ShardPlusStrategy(uneven_inputs='join'), for example)."
        )
    for name, value in plugins.items():
        kind = _PLUGIN_TYPES[name]
        if value is not None and not (callable(value) if kind is None else isinstance(value, _lightning_classes(kind))):
            raise TypeError(f"`{name}`={value!r} is not valid: expected None or a {kind or 'callable'}.")
    if model_averaging_period is not None:
        check_int("model_averaging_period", model_averaging_period, minimum=1)


# The plugin arguments: the Lightning class each must be an instance of (None: a callable).
_PLUGIN_TYPES = {"cluster_environment": "ClusterEnvironment", "checkpoint_io": "CheckpointIO",
                 "precision_plugin": "Precision", "ddp_comm_hook": None, "ddp_comm_wrapper": None}  # fmt: skip
_LIGHTNING_MODULES = {
    "Accelerator": ("lightning.pytorch.accelerators", "pytorch_lightning.accelerators"),
    "ClusterEnvironment": ("lightning.fabric.plugins", "lightning_fabric.plugins"),
    "CheckpointIO": ("lightning.fabric.plugins", "lightning_fabric.plugins"),
    "Precision": ("lightning.pytorch.plugins.precision", "pytorch_lightning.plugins.precision"),
}


def _lightning_classes(name: str) -> tuple[type, ...]:
    """Lightning's class ``name`` in each of its namespaces already imported (``lightning``, ``pytorch_lightning``)."""
    return tuple(getattr(sys.modules[module], name) for module in _LIGHTNING_MODULES[name] if module in sys.modules)


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
    if "device_ids" in ddp_kwargs:
        raise TypeError(
            f"`device_ids`={ddp_kwargs['device_ids']!r} is not a ShardPlusStrategy option: the strategy gives DDP "
            "the one device of each process (choose the devices with the Trainer's `devices`)."
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
    """The strategy's option (or DDP's) closest to a misspelled ``name``, or None when none is close."""
    return closest(name, [*STRATEGY_OPTIONS, *sorted(DDP_KWARGS)])
