"""Every strategy name shardplus registers, in one literal table, mirroring Lightning's ``ddp*`` family. Lightning
has no entry point for third-party strategies: ``import lightning_shardplus`` registers these in each installed
namespace (``_compat/namespace.py``)."""

from __future__ import annotations

from typing import Any

# name: (strategy family, start_method, find_unused_parameters; None: DDP's default, left out as Lightning's names do)
NAMES: dict[str, tuple[str, str, bool | None]] = {
    "shardplus": ("shardplus", "popen", None),
    "shardplus_find_unused_parameters_true": ("shardplus", "popen", True),
    "shardplus_find_unused_parameters_false": ("shardplus", "popen", False),
    "shardplus_spawn": ("shardplus", "spawn", None),
    "shardplus_spawn_find_unused_parameters_true": ("shardplus", "spawn", True),
    "shardplus_spawn_find_unused_parameters_false": ("shardplus", "spawn", False),
    "shardplus_fork": ("shardplus", "fork", None),
    "shardplus_fork_find_unused_parameters_true": ("shardplus", "fork", True),
    "shardplus_fork_find_unused_parameters_false": ("shardplus", "fork", False),
    "shardplus_notebook": ("shardplus", "fork", None),
    "shardplus_notebook_find_unused_parameters_true": ("shardplus", "fork", True),
    "shardplus_notebook_find_unused_parameters_false": ("shardplus", "fork", False),
    "shardplus_model_parallel": ("shardplus_model_parallel", "popen", None),
    "shardplus_model_parallel_spawn": ("shardplus_model_parallel", "spawn", None),
    "shardplus_model_parallel_fork": ("shardplus_model_parallel", "fork", None),
}
DESCRIPTIONS = {
    "shardplus": "ShardPlus data-parallel strategy",
    "shardplus_model_parallel": "ShardPlus data side on ModelParallelStrategy (FSDP2, TP)",
}


def entries(family: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """The names of one strategy family (a class's ``strategy_name``): name -> (description, ``init_params``)."""
    found = {}
    for name, (of, start_method, unused) in NAMES.items():
        if of != family:
            continue
        init_params: dict[str, Any] = {"start_method": start_method}
        description = f"{DESCRIPTIONS[family]} with `start_method` '{start_method}'"
        if unused is not None:
            init_params["find_unused_parameters"] = unused
            description += f" and `find_unused_parameters={unused}`"
        found[name] = (description, init_params)
    return found


def register(strategy_class: Any, strategy_registry: Any) -> None:
    """Register ``strategy_class``'s names in one Lightning ``StrategyRegistry`` (its ``register_strategies``)."""
    for name, (description, init_params) in entries(strategy_class.strategy_name).items():
        strategy_registry.register(name, strategy_class, description=description, override=True, **init_params)
