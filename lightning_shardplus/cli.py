"""The ``shardplus`` console script: Lightning's CLI with ``strategy="shardplus"`` as the default."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.cli import LightningCLI

import lightning_shardplus  # noqa: F401  (registers the strategy names)


class ShardPlusCLI(LightningCLI):
    """``LightningCLI`` in subclass mode (any LightningModule / DataModule by ``class_path``) whose trainer
    defaults to the ``shardplus`` strategy."""

    def __init__(self, *args: Any, trainer_defaults: dict[str, Any] | None = None, **kwargs: Any) -> None:
        defaults = {"strategy": "shardplus"}
        defaults.update(trainer_defaults or {})
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        super().__init__(*args, trainer_defaults=defaults, **kwargs)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``shardplus fit|validate|test|predict --config ...``."""
    ShardPlusCLI(args=args)


if __name__ == "__main__":
    main()
