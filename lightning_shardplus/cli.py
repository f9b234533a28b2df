"""The ``shardplus`` console script: Lightning's CLI with ``strategy="shardplus"`` as the default."""

from __future__ import annotations

import re
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_shardplus  # noqa: F401  (registers the strategy names)
from lightning_shardplus.config import closest_option


class ShardPlusArgumentParser(LightningArgumentParser):
    """Lightning's parser; an option that ``ShardPlusStrategy`` does not take (a typo in a config file or on the
    command line) gets the closest valid name added to jsonargparse's error."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if "ShardPlusStrategy" in message:
            for name in dict.fromkeys(re.findall(r"Option '(\w+)' is not accepted", message)):
                if close := closest_option(name):
                    message += f"\nShardPlusStrategy: did you mean '{close}'?"
        super().error(message, ex)


class ShardPlusCLI(LightningCLI):
    """``LightningCLI`` in subclass mode (any LightningModule / DataModule by ``class_path``) whose trainer
    defaults to the ``shardplus`` strategy."""

    def __init__(self, *args: Any, trainer_defaults: dict[str, Any] | None = None, **kwargs: Any) -> None:
        defaults = {"strategy": "shardplus"}
        defaults.update(trainer_defaults or {})
        kwargs.setdefault("parser_class", ShardPlusArgumentParser)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        super().__init__(*args, trainer_defaults=defaults, **kwargs)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``shardplus fit|validate|test|predict --config ...``."""
    ShardPlusCLI(args=args)


if __name__ == "__main__":
    main()
