"""What shardplus adds, as a function of the world size: ``python -m lightning_shardplus.bench.scale``.

A tiny fit (fork processes on gloo, CPU) at each world size, once with ``strategy="ddp"`` and once with shardplus
(its defaults, plus ``verify_sharding=True``): the Python-level ``torch.distributed`` collectives of each run are
counted per phase (setup, per optimizer step, per epoch end) and the difference is what shardplus adds. A third
fit with ``gradient_compression="powersgd"`` saves a checkpoint: rank 0's file size and one rank's PowerSGD file.

How calls are counted: each run happens in a child process of this command (``--child``); there, before Lightning
is imported, the collective functions of the ``torch.distributed`` package are replaced by counting wrappers
(a patch scoped to that child and the workers it forks, never to the calling process). Calls made inside torch
(``all_gather_object``'s own ``all_gather``) and DDP's C++ gradient all-reduce are not counted: the latter is the
same in both runs. Bytes are what the calling rank contributes: the tensor, or the pickled object (for
``broadcast_object_list``, on the source rank only).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
)  # fmt: skip
_PHASE = ["setup"]
_COUNTS: dict[str, dict[str, list[int]]] = {}
PHASES = ("setup", "step", "epoch_end", "end")
RUN_KINDS = ("ddp", "shardplus", "powersgd")


def _payload_bytes(name: str, args: tuple, kwargs: dict) -> int:
    """What the calling rank contributes to one call, in bytes."""
    import torch

    def tensor_bytes(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)):
            return sum(tensor_bytes(v) for v in value)
        return 0

    if name in ("barrier", "monitored_barrier"):
        return 0
    if name in ("all_gather_object", "gather_object"):
        obj = args[1] if name == "all_gather_object" and len(args) > 1 else (args[0] if args else kwargs.get("obj"))
        return len(pickle.dumps(obj))
    if name in ("broadcast_object_list", "scatter_object_list"):
        import torch.distributed as dist

        src = kwargs.get("src", args[1] if len(args) > 1 else 0)
        objects = args[0] if args else kwargs.get("object_list")
        return len(pickle.dumps(objects)) if dist.get_rank() == src else 0
    if name in ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"):
        return tensor_bytes(args[1] if len(args) > 1 else None)
    return tensor_bytes(args[0] if args else None)


def install_counters() -> None:
    """Replace the ``torch.distributed`` package's collectives by counting wrappers (in this benchmark child only)."""
    import torch.distributed as dist

    for name in _COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args: Any, __name: str = name, __original: Any = original, **kwargs: Any) -> Any:
            entry = _COUNTS.setdefault(_PHASE[0], {}).setdefault(__name, [0, 0])
            entry[0] += 1
            entry[1] += _payload_bytes(__name, args, kwargs)
            return __original(*args, **kwargs)

        setattr(dist, name, counted)


def _phase_callback(out: Path) -> Any:
    from lightning.pytorch.callbacks import Callback

    class Phases(Callback):
        """Labels the counts by phase; each rank writes its own at the end of the fit. It reads no logged value
        (as a callback of Lightning's or shardplus's would not)."""

        reads_step_values = False

        def __init__(self) -> None:
            self.steps = 0

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            _PHASE[0] = f"step@{trainer.current_epoch}"
            self.steps = 0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx + 1 == trainer.num_training_batches:  # the last step: the epoch's end reads its values
                _PHASE[0] = f"epoch_end@{trainer.current_epoch}"

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self.steps += _PHASE[0].startswith("step@")  # the steps before the last

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            _PHASE[0] = f"epoch_end@{trainer.current_epoch}"  # the validation at a training epoch's end

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            _PHASE[0] = f"epoch_end@{trainer.current_epoch}"

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            _PHASE[0] = "end"

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            record = {"counts": _COUNTS, "steps_per_epoch": self.steps, "epochs": trainer.current_epoch}
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))

    return Phases()


def _child(kind: str, world: int, out: Path, steps: int, epochs: int) -> None:
    """One fit of ``kind`` at ``world`` fork processes; the counts (or checkpoint sizes) go to ``out``."""
    install_counters()
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shardplus import ShardPlusStrategy
    from lightning_shardplus.bench.quiet import quiet_run

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.log("loss", loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    batch = 4
    size = world * batch * steps
    data = TensorDataset(torch.randn(size, 16), torch.randint(0, 8, (size,)))
    callbacks: list[Any] = [_phase_callback(out)]
    if kind == "ddp":
        strategy: Any = DDPStrategy(start_method="fork", process_group_backend="gloo")
    elif kind == "shardplus":
        strategy = ShardPlusStrategy(start_method="fork", verify_sharding=True)
    else:
        strategy = ShardPlusStrategy(start_method="fork", gradient_compression="powersgd")
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", filename="last", save_top_k=1))
    with quiet_run():  # the Trainer's banners too
        trainer = pl.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, logger=False,
            enable_checkpointing=kind == "powersgd", enable_progress_bar=False, enable_model_summary=False,
            callbacks=callbacks, num_sanity_val_steps=0,
        )  # fmt: skip
        trainer.fit(Tiny(), DataLoader(data, batch_size=batch), DataLoader(data, batch_size=batch))


def _summarize(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Calls and bytes per phase: setup, per optimizer step and per epoch end (the last epoch), and the rest
    (first-epoch extras and the end of fit) as once per fit."""
    counts, steps, last = record["counts"], max(record["steps_per_epoch"], 1), record["epochs"] - 1

    def total(phase: str) -> tuple[int, int]:
        entries = counts.get(phase, {}).values()
        return sum(e[0] for e in entries), sum(e[1] for e in entries)

    everything = [sum(e[i] for phase in counts.values() for e in phase.values()) for i in (0, 1)]
    step, epoch_end = total(f"step@{last}"), total(f"epoch_end@{last}")
    epochs = record["epochs"]
    once = [everything[i] - epochs * (step[i] + epoch_end[i]) for i in (0, 1)]
    return {
        "per_step": {"calls": step[0] / steps, "bytes": step[1] / steps},
        "per_epoch": {"calls": epoch_end[0], "bytes": epoch_end[1]},
        "once": {"calls": once[0], "bytes": once[1]},
        "by_phase": counts,
    }


def _run_child(kind: str, world: int, out: Path, steps: int, epochs: int, timeout: float) -> None:
    command = [sys.executable, "-m", "lightning_shardplus.bench.scale", "--child", kind, f"--world-sizes={world}"]
    command += [f"--out={out}", f"--steps={steps}", f"--epochs={epochs}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, timeout=timeout, env=env, stdout=subprocess.DEVNULL)


def measure(world_sizes: list[int], steps: int = 4, epochs: int = 2, timeout: float = 300) -> dict[str, Any]:
    """Per world size: what shardplus adds over ddp (rank 0's calls and bytes per step, per epoch, once per fit)
    and, with PowerSGD, rank 0's checkpoint size and one rank's PowerSGD file size."""
    results: dict[str, Any] = {"steps_per_epoch": steps, "epochs": epochs, "world_sizes": {}}
    with tempfile.TemporaryDirectory(prefix="shardplus-scale-") as tmp:
        for world in world_sizes:
            row: dict[str, Any] = {}
            for kind in RUN_KINDS:
                out = Path(tmp) / f"{kind}-{world}"
                out.mkdir()
                _run_child(kind, world, out, steps, epochs, timeout)
                if kind == "powersgd":
                    row["checkpoint_bytes"] = (out / "ckpt" / "last.ckpt").stat().st_size
                    rank_file = out / "ckpt" / "last.ckpt.powersgd" / f"rank-0-of-{world}.pt"
                    row["powersgd_rank_file_bytes"] = rank_file.stat().st_size
                    continue
                row[kind] = _summarize(json.loads((out / "rank0.json").read_text()))
            row["added"] = {
                key: {m: row["shardplus"][key][m] - row["ddp"][key][m] for m in ("calls", "bytes")}
                for key in ("per_step", "per_epoch", "once")
            }
            results["world_sizes"][str(world)] = row
    return results


def table(results: dict[str, Any]) -> str:
    """A Markdown table of what shardplus adds over ddp, per world size (rank 0)."""
    lines = [
        "| W | calls / step | bytes / step | calls / epoch end | bytes / epoch end | calls once | bytes once "
        "| rank 0 checkpoint (PowerSGD) | PowerSGD file per rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for world, row in results["world_sizes"].items():
        a = row["added"]
        lines.append(
            f"| {world} | {a['per_step']['calls']:g} | {a['per_step']['bytes']:g} | {a['per_epoch']['calls']:g} "
            f"| {a['per_epoch']['bytes']:g} | {a['once']['calls']:g} | {a['once']['bytes']:g} "
            f"| {row['checkpoint_bytes']} | {row['powersgd_rank_file_bytes']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    prog = "python -m lightning_shardplus.bench.scale"
    parser = argparse.ArgumentParser(prog=prog, description="What shardplus adds, as a function of the world size.")
    parser.add_argument("--world-sizes", default="2,4,8", help="comma-separated process counts (default 2,4,8)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per epoch (default 4)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (default 2)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--child", choices=RUN_KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.world_sizes.split(",")]
    if args.child:
        _child(args.child, worlds[0], Path(args.out), args.steps, args.epochs)
        return None
    results = measure(worlds, args.steps, args.epochs)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
