"""``python -m lightning_shardplus.bench``: see the package's documentation (``--help``)."""

from lightning_shardplus.bench.cli import main

main()
