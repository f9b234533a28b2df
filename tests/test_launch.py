"""Launchers outside Lightning, on one machine: a 2-"node" torchrun job, a 2-process mpirun job, a launcher whose
world size disagrees with devices x num_nodes, and the example launch scripts.

The jobs run the ``shardplus`` CLI with ``tests/_launch_probe.py`` (on PYTHONPATH) recording, per rank, its ranks,
world size and training indices, and which rank wrote each checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _models import run_commands
from lightning.fabric.plugins.environments import (
    LightningEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

from lightning_shardplus.launch import check_launcher_world_size

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
CLI = ["-m", "lightning_shardplus.cli", "fit"]
NUM_SAMPLES, BATCH_SIZE = 13, 2  # 13 samples on 2 ranks: 7 each, one padded


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(extra_path: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    paths = [str(ROOT), str(ROOT / "tests"), *([extra_path] if extra_path else [])]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["OMP_NUM_THREADS"] = "1"
    return env


def write_config(tmp_path: Path, devices: int, num_nodes: int) -> Path:
    record = str(tmp_path / "record")
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": devices,
            "num_nodes": num_nodes,
            "strategy": "shardplus",
            "max_epochs": 1,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(tmp_path / "checkpoints"), "save_last": True},
                },
                {"class_path": "_launch_probe.RecordSaves", "init_args": {"record_dir": record}},
            ],
        },
        "model": {
            "class_path": "_launch_probe.ProbeModule",
            "init_args": {"record_dir": record, "num_samples": NUM_SAMPLES, "batch_size": BATCH_SIZE},
        },
    }
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def read_ranks(tmp_path: Path) -> dict[int, dict]:
    rows = [json.loads(p.read_text()) for p in sorted((tmp_path / "record").glob("rank*.json"))]
    return {row["global_rank"]: row for row in rows}


def check_training_shards(ranks: dict[int, dict]) -> None:
    shards = [ranks[r]["indices"] for r in sorted(ranks)]
    per_rank = -(-NUM_SAMPLES // len(shards))
    assert all(len(shard) == per_rank for shard in shards), "padded shards differ in length"
    assert set().union(*shards) == set(range(NUM_SAMPLES)), "the shards do not cover the dataset"
    padding = sum(map(len, shards)) - NUM_SAMPLES
    seen: set[int] = set()
    repeats = 0
    for shard in shards:
        repeats += len(set(shard) & seen) + len(shard) - len(set(shard))
        seen |= set(shard)
    assert repeats == padding, "the shards overlap beyond the padding"
    assert all(ranks[r]["sampler"] == "PaddedShardSampler" for r in ranks)


def check_checkpoints_written_once(tmp_path: Path) -> None:
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    steps = -(-NUM_SAMPLES // 2 // BATCH_SIZE)  # ceil(7 / 2) batches per rank in the one epoch
    assert files == [f"epoch=0-step={steps}.ckpt", "last.ckpt"], files
    saves = [json.loads(line) for line in (tmp_path / "record" / "saves.jsonl").read_text().splitlines()]
    assert {save["rank"] for save in saves} == {0}, saves
    assert len(saves) == len({save["path"] for save in saves}), f"a checkpoint was written twice: {saves}"


@pytest.mark.timeout(240)
def test_two_node_torchrun_job(tmp_path):
    config = write_config(tmp_path, devices=1, num_nodes=2)
    port = free_port()
    commands = [
        [
            *TORCHRUN,
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            *CLI,
            "--config",
            str(config),
        ]
        for node in (0, 1)
    ]
    results = run_commands(commands, tmp_path, job_env(), timeout=180)
    for code, output in results:
        assert code == 0, output[-5000:]
    ranks = read_ranks(tmp_path)
    assert sorted(ranks) == [0, 1]
    assert {r: (row["world_size"], row["node_rank"], row["local_rank"]) for r, row in ranks.items()} == {
        0: (2, 0, 0),
        1: (2, 1, 0),
    }
    assert {row["environment"] for row in ranks.values()} == {"TorchElasticEnvironment"}
    assert {row["strategy"] for row in ranks.values()} == {"ShardPlusStrategy"}
    check_training_shards(ranks)
    check_checkpoints_written_once(tmp_path)


@pytest.mark.timeout(180)
def test_torchrun_world_size_mismatch_fails_before_training(tmp_path):
    config = write_config(tmp_path, devices=1, num_nodes=1)
    command = [
        *TORCHRUN,
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        *CLI,
        "--config",
        str(config),
    ]
    [(code, output)] = run_commands([command], tmp_path, job_env(), timeout=120)
    assert code != 0
    assert "ValueError: torchrun started 2 processes in all (world size 2)" in output, output[-5000:]
    assert "devices=1 x num_nodes=1 = 1" in output and "set devices=2 and num_nodes=1" in output
    assert not (tmp_path / "record").exists(), "training started"


def _mpi4py_path() -> str | None:
    """Where mpi4py is, for the MPI job only: installed in this environment, or in the folder named by
    SHARDPLUS_MPI4PY_PATH (CI installs it there, so that the test process itself never initializes MPI)."""
    if importlib.util.find_spec("mpi4py") is not None:
        return ""
    path = os.environ.get("SHARDPLUS_MPI4PY_PATH")
    if path and (Path(path) / "mpi4py").is_dir():
        return path
    return None


@pytest.mark.timeout(240)
def test_two_process_mpirun_job(tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not found: install Open MPI (apt-get install openmpi-bin) to run the MPI launch test")
    mpi4py_path = _mpi4py_path()
    if mpi4py_path is None:
        pytest.skip("mpi4py not installed (pip install mpi4py, or SHARDPLUS_MPI4PY_PATH): MPIEnvironment needs it")
    config = write_config(tmp_path, devices=2, num_nodes=1)
    env = job_env(mpi4py_path or None)
    command = [
        mpirun,
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
        "2",
        "-x",
        "PYTHONPATH",
        "-x",
        "OMP_NUM_THREADS",
        sys.executable,
        *CLI,
        "--config",
        str(config),
    ]
    [(code, output)] = run_commands([command], tmp_path, env, timeout=180)
    assert code == 0, output[-5000:]
    ranks = read_ranks(tmp_path)
    assert sorted(ranks) == [0, 1]
    assert {row["world_size"] for row in ranks.values()} == {2}
    assert {row["environment"] for row in ranks.values()} == {"MPIEnvironment"}
    check_training_shards(ranks)
    check_checkpoints_written_once(tmp_path)


@pytest.mark.parametrize(
    ("environment", "variables", "expected"),
    [
        (TorchElasticEnvironment, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "set devices=2 and num_nodes=2"),
        (SLURMEnvironment, {"SLURM_NTASKS": "3", "SLURM_NTASKS_PER_NODE": "3"}, "set devices=3 and num_nodes=1"),
        (LightningEnvironment, {"LOCAL_RANK": "0", "WORLD_SIZE": "6"}, "set devices=6 and num_nodes=1"),
    ],
)
def test_world_size_check_names_both_numbers_and_the_fix(monkeypatch, environment, variables, expected):
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="devices=1 x num_nodes=1 = 1") as error:
        check_launcher_world_size(environment(), devices=1, num_nodes=1)
    assert expected in str(error.value)
    world_size = int(variables.get("WORLD_SIZE", variables.get("SLURM_NTASKS")))
    check_launcher_world_size(environment(), devices=world_size, num_nodes=1)  # agrees: no error


def test_world_size_check_skips_processes_lightning_starts(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    check_launcher_world_size(LightningEnvironment(), devices=2, num_nodes=1)
    check_launcher_world_size(None, devices=2, num_nodes=1)


@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_mpirun_without_lightning_seeing_mpi_is_refused(monkeypatch, variable):
    # without mpi4py Lightning falls back to its own environment and each mpirun process would train alone
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv(variable, "2")
    with pytest.raises(RuntimeError, match=rf"MPI/PMI launcher \(mpirun, srun --mpi=...: {variable}=2\).*mpi4py"):
        check_launcher_world_size(LightningEnvironment(), devices=2, num_nodes=1)
    monkeypatch.setenv("NODE_RANK", "0")  # one process per node, ranks given by hand: Lightning starts the rest
    check_launcher_world_size(LightningEnvironment(), devices=2, num_nodes=2)
    monkeypatch.delenv("NODE_RANK")
    monkeypatch.setenv(variable, "1")  # a single MPI process: nothing to coordinate
    check_launcher_world_size(LightningEnvironment(), devices=2, num_nodes=1)


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")
@pytest.mark.parametrize("script", ["torchrun_multinode.sh", "torchrun_restart.sh", "slurm.sbatch", "mpirun.sh"])
def test_launch_examples_are_valid_bash(script):
    path = ROOT / "examples" / "launch" / script
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "shardplus" in path.read_text()


@pytest.mark.timeout(120)
def test_slurm_overlay_config_parses(tmp_path):
    result = subprocess.run(
        [sys.executable, *CLI, "--config", str(ROOT / "configs" / "digits.yaml")]
        + ["--config", str(ROOT / "examples" / "launch" / "slurm.yaml"), "--ckpt_path", "last", "--print_config"],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = yaml.safe_load(result.stdout)
    assert config["trainer"]["plugins"][0]["init_args"]["auto_requeue"] is True
    assert config["trainer"]["callbacks"][0]["init_args"]["save_last"] is True
    assert config["ckpt_path"] == "last"


def test_resumable_overlay_checkpoints_at_optimizer_steps_with_a_last_checkpoint():
    config = yaml.safe_load((ROOT / "examples" / "launch" / "resumable.yaml").read_text())
    [checkpoint] = config["trainer"]["callbacks"]
    assert checkpoint["class_path"] == "lightning.pytorch.callbacks.ModelCheckpoint"
    assert checkpoint["init_args"]["save_last"] is True and checkpoint["init_args"]["every_n_train_steps"] > 0
    script = (ROOT / "examples" / "launch" / "torchrun_restart.sh").read_text()
    assert "--max-restarts" in script and "--ckpt_path last" in script and "resumable.yaml" in script


@pytest.mark.parametrize("strategy", ["shardplus_spawn", "forkserver"])
@pytest.mark.timeout(180)
@pytest.mark.compat
def test_the_spawn_and_forkserver_launchers_pickle_the_strategy_and_train(strategy):
    # these launchers pickle the Trainer, its strategy and the launcher; the fit's results come back by queue
    import lightning.pytorch as pl
    import torch

    from lightning_shardplus import ShardPlusDataModule, ShardPlusStrategy, SyntheticDataModule
    from lightning_shardplus.demo import ClassifierModule

    def trainer():
        chosen = strategy if strategy == "shardplus_spawn" else ShardPlusStrategy(start_method=strategy)
        return pl.Trainer(
            accelerator="cpu", devices=2, strategy=chosen, max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )

    model = ClassifierModule(input_dim=16, hidden_dims=[8])
    before = [p.detach().clone() for p in model.parameters()]
    fitted = trainer()
    fitted.fit(model, SyntheticDataModule(global_batch_size=16, num_samples=64, val_samples=10, input_shape=(16,)))
    assert fitted.state.finished and "train_loss" in fitted.callback_metrics  # rank 0's, sent back
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # weights came back
    with pytest.raises(ValueError, match=r"`global_batch_size`=1 is smaller than the data-parallel size \(2 processes"):
        trainer().fit(model, ShardPlusDataModule(1, train_dataset=torch.utils.data.TensorDataset(torch.zeros(4, 16))))
