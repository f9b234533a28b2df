"""Counts how model-parallel launches end (docs/limitations.md, "at exit"): ``python tests/_exit_status_loop.py
STRATEGY CALL LAUNCHER N`` launches N runs one after another and prints each exit status, whether its output has
"terminate called without an active exception", and the totals. STRATEGY: ``shardplus`` or ``plain``
(``ModelParallelStrategy``); CALL: ``validate`` (1 sample on 2 data-parallel ranks: rank 1's shard is empty) or
``fit`` (a checkpoint at the end); LAUNCHER: ``lightning`` (its subprocess launcher) or ``torchrun``
(``--nproc_per_node 2``). Each run's output and any core dump (``ulimit -c unlimited`` first) stay in a directory of
its own under ``$TMPDIR``. ``python tests/_exit_status_loop.py STRATEGY CALL`` is one run."""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys
import tempfile

EXIT_ABORT = "terminate called without an active exception"


def run(strategy_name: str, call: str) -> None:
    """One 2-process run, data parallel 2 x tensor parallel 1, FSDP2 over the data-parallel dimension."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard  # torch 2.6 or newer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shardplus import ShardPlusModelParallelStrategy

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))

        def configure_model(self) -> None:
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.log("loss", loss)
            return loss

        def validation_step(self, batch, batch_idx) -> None:
            self.log("val", torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1]), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def data(n: int) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(n, 4, generator=generator), torch.randint(0, 2, (n,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=2)

    strategy = (ShardPlusModelParallelStrategy if strategy_name == "shardplus" else ModelParallelStrategy)(2, 1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=call == "fit", default_root_dir=os.getcwd(),
    )  # fmt: skip
    if call == "validate":
        trainer.validate(Model(), data(1))
    else:
        trainer.fit(Model(), data(16), data(4))
    print(f"rank {trainer.global_rank}: the run finished", flush=True)


def loop(strategy_name: str, call: str, launcher: str, n: int) -> None:
    """N launches; each one's exit status and whether it aborted at exit, then the totals."""
    script, totals = os.path.abspath(__file__), collections.Counter()
    for i in range(n):
        directory = tempfile.mkdtemp(prefix=f"exit-{strategy_name}-{call}-{launcher}-")
        command = [sys.executable, script, strategy_name, call]
        if launcher == "torchrun":
            port = str(random.randrange(20000, 40000))
            command[1:2] = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port, script]
        result = subprocess.run(command, cwd=directory, capture_output=True, text=True, timeout=900)
        output = result.stdout + result.stderr
        with open(os.path.join(directory, "output.txt"), "w") as file:
            file.write(output)
        key = (result.returncode, EXIT_ABORT in output)
        totals[key] += 1
        print(f"{i + 1}/{n}: exit status {result.returncode}, aborted at exit: {key[1]} ({directory})", flush=True)
    print(f"{strategy_name} {call} {launcher}: " + ", ".join(f"{count} x {key}" for key, count in totals.items()))


if __name__ == "__main__":
    if len(sys.argv) == 5:
        loop(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        run(sys.argv[1], sys.argv[2])
