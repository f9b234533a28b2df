"""The ``shardplus`` console script: Lightning's CLI whose default strategy is ``ShardPlusStrategy`` (the class, so that
``--trainer.strategy.<option>`` applies; a config's `strategy: shardplus` is read as the class too)."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import lightning.pytorch as pl
from jsonargparse import ActionConfigFile, Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

import lightning_shardplus  # noqa: F401  (registers the strategy names)
import lightning_shardplus.large_batch.scaling  # noqa: F401  (ScaleLearningRate and LARS among the callbacks and optimizers)
from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus.gradients.ddp.config import closest_option
from lightning_shardplus.strategies import registry


class ShardPlusArgumentParser(LightningArgumentParser):
    """Lightning's parser; a strategy option misspelled gets the closest valid name added to jsonargparse's error."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if "ShardPlusStrategy" in message:
            for name in dict.fromkeys(re.findall(r"Option '(\w+)' is not accepted", message)):
                if close := closest_option(name):
                    message += f"\nShardPlusStrategy: did you mean '{close}'?"
        if f"{STRATEGY_HELP}:" in message:
            message += f"\n{STRATEGY_HELP} takes {strategy_help_values()}."
        elif named := re.search(r"Expected a dot import path string: (\w+)", message):
            message += (
                f"\n`trainer.strategy` is the name {named.group(1)!r}: options under it need its class, given first, "
                f"as in --trainer.strategy={STRATEGY_CLASS} (or `class_path: {STRATEGY_CLASS}` in a config)."
            )
        super().error(message, ex)

    def parse_args(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Namespace:
        """Parse as jsonargparse does, where ``--trainer.strategy.help`` also takes a registered strategy name."""
        return super().parse_args(strategy_help_by_name(sys.argv[1:] if args is None else list(args)), *rest, **kwargs)

    def parse_string(self, *args: Any, **kwargs: Any) -> Namespace:
        """Parse a config; a shardplus name as the strategy becomes the class with that name's arguments, so that
        later ``--trainer.strategy.<option>`` arguments apply to it (jsonargparse takes them only on a class)."""
        cfg = super().parse_string(*args, **kwargs)
        names = registry.entries("shardplus")
        for key in [key for key in cfg.keys() if key == "trainer.strategy" or key.endswith(".trainer.strategy")]:
            if isinstance(name := cfg[key], str) and name in names:
                cfg[key] = Namespace(class_path=STRATEGY_CLASS, init_args=Namespace(**names[name][1]))
        return cfg


STRATEGY_CLASS = "lightning_shardplus.ShardPlusStrategy"
STRATEGY_DEFAULT = {"class_path": STRATEGY_CLASS}
STRATEGY_HELP = "--trainer.strategy.help"
DESCRIPTION = (
    "shardplus: Lightning's command line (LightningCLI) with the `shardplus` strategy by default. "
    "`shardplus fit --config configs/digits.yaml` trains; the strategy's options: "
    f"`shardplus fit {STRATEGY_HELP} shardplus` (or `shardplus_model_parallel`, or any registered name or class "
    "path), set as `--trainer.strategy.<option>=...`."
)


def shardplus_names() -> list[str]:
    """The strategy names registered for lightning_shardplus's strategies."""
    return [name for name, entry in StrategyRegistry.items() if entry["strategy"].__module__.startswith(__package__)]


def strategy_help_values() -> str:
    """What ``--trainer.strategy.help`` takes, in words."""
    names = [name for name in shardplus_names() if "_find_unused_parameters_" not in name]
    return (
        f"a registered strategy name ({', '.join(names)}; the shardplus* data-parallel ones also with "
        "_find_unused_parameters_true or _false; Lightning's own, such as ddp), a class name or a class path"
    )


def strategy_help_by_name(args: list[str]) -> list[str]:
    """``args`` where the name after ``--trainer.strategy.help`` is replaced by its class path, saying what else the
    name sets; where no value follows, by the default strategy's, saying what it takes (jsonargparse knows class
    names and paths only, and shows Lightning's base ``Strategy`` without one)."""
    args = list(args)
    for index, arg in enumerate(args):
        option, equals, value = arg.partition("=")
        if option != STRATEGY_HELP:
            continue
        given = index + 1 < len(args) and not args[index + 1].startswith("-")
        value = value if equals else args[index + 1] if given else None
        if value is None:
            print(f"{STRATEGY_HELP} takes {strategy_help_values()}. The default strategy's options:\n")
            value = STRATEGY_CLASS
        elif value in StrategyRegistry:
            strategy, settings = StrategyRegistry[value]["strategy"], StrategyRegistry[value]["init_params"]
            if settings:
                set_here = ", ".join(f"{key}={setting!r}" for key, setting in settings.items())
                print(f"{value!r} is {strategy.__qualname__} with {set_here}.\n")
            value = f"{strategy.__module__}.{strategy.__qualname__}"
        else:
            continue
        args[index : index + 1 + (given and not equals)] = [f"{STRATEGY_HELP}={value}"]
        break
    return args


class ShardPlusCLI(LightningCLI):
    """``LightningCLI`` in subclass mode, the ``shardplus`` strategy by default, a summary of the metrics after fit."""

    def __init__(self, *args: Any, trainer_defaults: dict[str, Any] | None = None, **kwargs: Any) -> None:
        defaults = {"strategy": STRATEGY_DEFAULT, **(trainer_defaults or {})}
        # without a logger the config is saved in the working directory: a second run there overwrites it
        kwargs = {"subclass_mode_model": True, "subclass_mode_data": True, "save_config_kwargs": {"overwrite": True},
                  "parser_kwargs": {"description": DESCRIPTION}, **kwargs}  # fmt: skip
        super().__init__(*args, trainer_defaults=defaults, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """Lightning's parser, as :class:`ShardPlusArgumentParser` (Lightning 2.4 has no ``parser_class`` argument)."""
        kwargs.setdefault("dump_header", [f"lightning.pytorch=={pl.__version__}"])
        parser = ShardPlusArgumentParser(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile, help="Path to a configuration file (YAML).")
        return parser

    def instantiate_classes(self) -> None:
        """Instantiate as Lightning does; a value that a class refuses with one of our named errors (the strategy's,
        the datamodules') ends as a usage error carrying that message, not as a traceback through jsonargparse."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            refused = named_argument_errors(error)
            if not refused:
                raise
            self.parser.error("\n".join(refused))

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``--help`` states one default for ``trainer.strategy`` (Lightning's docstring names ``"auto"``), and how to
        list the options of a strategy."""
        for action in _lightning.parser_actions(parser):
            if action.dest == "trainer.strategy" and action.help:
                action.help = action.help.replace('Default: ``"auto"``.', "").strip() + (
                    f" The default strategy's options: {STRATEGY_HELP} shardplus."
                )
            elif action.dest == "trainer.strategy.help":
                action.help = f"Show the options of a strategy and exit: it takes {strategy_help_values()}."

    def after_fit(self) -> None:
        """Print the final metrics (rank 0): with the progress bar off nothing else says how the fit ended."""
        if self.trainer.is_global_zero:
            print(summary_table(self.trainer.callback_metrics, self.trainer.global_step, self.trainer.current_epoch))


_NAMED_ERROR = re.compile(r"`[A-Za-z_][\w.]*`=.*")


def named_argument_errors(error: BaseException) -> list[str]:
    """The lines of ``error`` (and of the errors it was raised from) that are our named argument errors
    ("`name`=value is not valid: ..."): jsonargparse lists them among the errors of each type it tried."""
    found: list[str] = []
    while error is not None:
        for line in str(error).splitlines():
            match = _NAMED_ERROR.search(line)
            if match and match.group(0) not in found:
                found.append(match.group(0))
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return found


def summary_table(metrics: dict[str, Any], global_step: int, epochs: int) -> str:
    """A short table of the final metrics of a fit, one per line, sorted by name."""
    rows = [(name, f"{float(value):.4f}") for name, value in sorted(metrics.items())]
    width = max([len(name) for name, _ in rows] + [len("metric")])
    lines = [f"fit ended after {epochs} epochs, {global_step} optimizer steps", f"{'metric':<{width}}  value"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``shardplus fit|validate|test|predict --config ...``."""
    ShardPlusCLI(args=args)


if __name__ == "__main__":
    main()
