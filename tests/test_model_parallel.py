"""``ShardPlusModelParallelStrategy``: shardplus's data side under Lightning's ``ModelParallelStrategy`` (FSDP2 over the
data-parallel ranks, tensor parallel over the others), on CPU processes (``tests/_model_parallel_probe.py`` on forks of
the test process that Lightning finds started, as torchrun's; scripts under Lightning's own launcher), each result
against a hand computation or a one-process run."""

import csv
import importlib.util
import json
import logging
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _models import cpu_trainer, in_external_ranks, in_forked_process
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, IterableDataset

import lightning_shardplus
from lightning_shardplus import ShardPlusDataModule, ShardPlusModelParallelStrategy, ShardPlusStrategy
from lightning_shardplus._compat.lightning import RESUMES_INSIDE_A_WINDOW, release
from lightning_shardplus.gradients.fsdp2.window import FSDP2_WINDOW_GRADIENTS_READABLE

PROBE = Path(__file__).parent / "_model_parallel_probe.py"
# a checkpoint inside an aggregation window resumes exactly: torch 2.6 (FSDP2's public unshard), Lightning 2.5
WINDOWS = FSDP2_WINDOW_GRADIENTS_READABLE and RESUMES_INSIDE_A_WINDOW
needs_torch_2_4 = pytest.mark.skipif(
    release(torch.__version__) < (2, 4), reason="ModelParallelStrategy needs torch 2.4"
)


def _launch(script: Path, tmp_path: Path, *args: object) -> subprocess.CompletedProcess:
    """``script`` run with ``args``; Lightning's launcher starts the other ranks."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROBE.parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCAL_RANK", None)
    done = subprocess.run(
        [sys.executable, str(script), *map(str, args)], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _run(tmp_path: Path, dp: int, tp: int) -> list[dict]:
    """The probe on ``dp x tp`` ranks, forks of this process that Lightning finds started (as torchrun's)."""
    import _model_parallel_probe as probe

    in_external_ranks(partial(probe.main, dp, tp, str(tmp_path / "found")), dp * tp, timeout=300, cwd=tmp_path)
    return [json.loads((tmp_path / f"found.{rank}.json").read_text()) for rank in range(dp * tp)]


def one_process(n: int) -> dict[str, float]:
    """What the probe's validation logs over samples 0..n-1 in one process."""
    total = n * (n - 1) / 2
    return {"index_sum": total, "index_mean": (n - 1) / 2, "index_max": n - 1.0, "metric_sum": total}


def _close(weights: list[list[float]], reference: list[list[float]]) -> bool:
    return all(
        torch.allclose(torch.tensor(w), torch.tensor(r), atol=1e-6) for w, r in zip(weights, reference, strict=True)
    )


@needs_torch_2_4
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("dp", "tp"), [(2, 2), (2, 1), (3, 1)], ids=["2x2-tensor-parallel", "2-data-parallel", "3-data-parallel"]
)
def test_the_data_side_holds_over_the_data_parallel_ranks(tmp_path, dp, tp):
    found = _run(tmp_path, dp, tp)
    by_dp = [found[r * tp] for r in range(dp)]
    for rank, result in enumerate(found):  # tensor-parallel peers read and see the same as their data-parallel rank
        assert result["fit"]["seen"] == by_dp[rank // tp]["fit"]["seen"]
    # padded equal training shards over the data-parallel ranks: every sample of 10 once (plus padding)
    seen = [i for result in by_dp for i in result["fit"]["seen"]]
    assert set(seen) == set(range(10)) and len(seen) == -(-10 // dp) * dp
    # a sync_dist sum is the global batch, never counted again per tensor-parallel copy
    shard = len(by_dp[0]["fit"]["seen"])  # 5 or 4, in batches of 2
    assert found[0]["fit"]["samples"] == [float(dp * min(2, shard - 2 * b)) for b in range(-(-shard // 2))]
    for rank, result in enumerate(found):
        # a torchmetrics Metric counts each data-parallel rank's samples once (not once per tensor-parallel copy),
        # and none of a stand-in step's
        assert result["fit"]["trained"] == len(seen)
        assert result["join"]["trained"] == 6 + 2 * (dp - 2)
        assert result["tiny"] == [0]  # one sample on every data-parallel rank: padded equal shards, no hang
        # one reduce-scatter per aggregation window gives one process's step on the whole batch
        assert _close(result["aggregation"]["weights"], result["aggregation"]["reference"])
        assert not _close(result["aggregation"]["reference"], result["initial"])
        # join: the empty rank runs stand-in steps (no hang), its zero gradient is corrected away; drop: stops at
        # the shortest stream (one step)
        assert result["join"]["samples"] == [2.0 * (dp - 1), 2.0, 2.0] if dp > 2 else [2.0, 2.0, 2.0]
        assert _close(result["join"]["weights"], result["join"]["reference"])
        # a stand-in step's BatchNorm statistics are undone (after its backward, which needs them): its batches of 2
        assert result["join"]["normalized"] == ([6] + [2 * r for r in range(dp - 1)])[rank // tp] // 2
        assert result["drop"]["samples"] == [2.0 * dp]
        assert _close(result["drop"]["weights"], result["drop"]["reference"])
        assert not _close(result["drop"]["reference"], result["initial"])
        # exact evaluation with shards of unequal batches, an empty shard, and none: one process's values
        # exact evaluation: shards of unequal batches, an empty shard, no data, an uneven stream (3 samples on rank
        # 0, none on rank 1, 1 on each other): one process's values
        assert result[f"validate{2 * dp - 1}"] == [one_process(2 * dp - 1)]
        assert result["validate1"] == [one_process(1)]
        assert result["validate0"] == []
        assert result["validate_stream"] == [one_process(dp + 1)]
        assert result["bf16"] == [one_process(dp + 1)]
        # checkpoint decisions over the whole mesh: all ranks True; rank 0 alone True; any; none
        assert result["decisions"] == [True, False, True, False]
    assert found[0]["predict"] == [[0, 1], [2], [3, 4]] if dp == 2 else found[0]["predict"][0] == [0, 1]
    # two evaluation streams: one process's values per loader, as data-parallel rank 0 returns them (a rank without a
    # batch of a loader returns none of its values from `validate`; its callback_metrics have them: docs/limitations.md)
    sizes = [dp + 2, dp]
    first, second = ({f"{k}/dataloader_idx_{i}": v for k, v in one_process(n).items()} for i, n in enumerate(sizes))
    second.pop("metric_sum/dataloader_idx_1")
    for result in found[:tp]:
        assert result["two_streams"] == [first, second]
    # prediction writers: each rank's real batches with their indices, its stand-ins with none and no prediction
    shards = [[0, 1, 2], [3, 4]] if dp == 2 else [[0, 1], [2, 3], [4]]
    most = max(-(-len(shard) // 2) for shard in shards)  # batches of 2 on the longest shard
    for rank, result in enumerate(found):
        own = [shards[rank // tp][i : i + 2] for i in range(0, len(shards[rank // tp]), 2)]
        assert result["writes"] == [[batch, batch] for batch in own] + [[[], None]] * (most - len(own))
    assert sorted(i for batch in found[0]["predict"] for i in batch) == list(range(5))


@needs_torch_2_4
@pytest.mark.timeout(600)
def test_a_mid_epoch_resume_reads_what_the_uninterrupted_run_read_next_on_any_data_parallel_size(tmp_path):
    """Saved at optimizer step 4 (one batch into epoch 1) on 2 x 2, in a distributed and a full checkpoint; and inside
    an aggregation window (FSDP2 holds its gradients unsharded until the window's reduce-scatter)."""
    import _model_parallel_resume as resume

    for dp, tp in ((2, 2), (3, 1)):
        in_external_ranks(partial(resume.main, dp, tp, tmp_path), dp * tp, timeout=280, cwd=tmp_path)
    same = [json.loads((tmp_path / f"found.2.{rank}.json").read_text()) for rank in range(4)]
    other = [json.loads((tmp_path / f"found.3.{rank}.json").read_text()) for rank in range(3)]
    for distributed in (True, False):
        whole = [same[rank][f"uninterrupted distributed={distributed}"] for rank in range(4)]
        for rank in range(4):  # the same mesh: exactly the samples that were next, to the same weights
            resumed = same[rank][f"resumed distributed={distributed}"]
            assert resumed["seen"] == whole[rank]["seen"][7:]  # 5 per epoch, 2 read in epoch 1 before the save
            assert _close(resumed["weights"], whole[rank]["weights"])
        for rank in range(4 if WINDOWS else 0):  # inside an aggregation window: its
            # gradients so far restored, to the same weights
            resumed = same[rank][f"window resumed distributed={distributed}"]
            assert resumed["seen"] == whole[rank]["seen"][7:]  # the same position as the step-4 save
            assert _close(resumed["weights"], same[rank][f"window uninterrupted distributed={distributed}"]["weights"])
        # 3 data-parallel ranks: every remaining sample of the epoch once
        remaining = [i for rank in (0, 2) for i in whole[rank]["seen"][7:]]
        read = [i for rank in range(3) for i in other[rank][f"resumed distributed={distributed}"]["seen"]]
        assert sorted(read) == sorted(remaining) and len(set(read)) == 6
    if WINDOWS:  # inside a window, on 3 x 1: the window's mean gradient, with a warning
        read = [i for rank in range(3) for i in other[rank]["window resumed elsewhere"]["seen"]]
        assert sorted(read) == sorted(remaining) and other[0]["window resumed elsewhere"]["warned"]
    # FSDP2 keeps one unit's float64 window gradients to itself: none restored (not the others' alone), and said
    assert same[0].get("reduce_dtype: warned", not WINDOWS)


@needs_torch_2_4
@pytest.mark.timeout(600)
def test_checkpoints_of_plain_model_parallel_resume_at_an_epoch_end_and_are_refused_inside_an_epoch(tmp_path):
    """Lightning's ``ModelParallelStrategy`` saves no sampler position, in a distributed or a full checkpoint: inside
    the epoch (2 of its 3 batches done) shardplus refuses it before the first step; at the epoch's end it resumes, and
    the next epoch reads every sample once."""
    import _cross_strategy_resume as script

    # saved by plain ModelParallelStrategy on 2 ranks; resumed under shardplus's fork launch from one process
    in_external_ranks(partial(script.main, "save", tmp_path), world_size=2, timeout=280, cwd=tmp_path)
    in_forked_process(partial(script.main, "resume", tmp_path), timeout=280)
    found = json.loads((tmp_path / "resumed.json").read_text())
    for distributed in (True, False):
        refused = found[f"distributed={distributed} step=2"]
        assert "the checkpoint has no position of shardplus's training sampler" in refused
        assert "the fit loop resumes epoch 0 after 2 of its batches" in refused
        assert sorted(i for seen in found[f"distributed={distributed} step=3"] for i in seen) == list(range(12))


def test_ddp_only_arguments_are_refused_saying_why():
    with pytest.raises(
        TypeError,
        match=r"`gradient_compression`='fp16' is not a ShardPlusModelParallelStrategy option: "
        r"a DDP communication hook; FSDP2 has none",
    ):
        ShardPlusModelParallelStrategy(gradient_compression="fp16")
    with pytest.raises(TypeError, match=r"`auto_tune_tensor_fusion`=True .* FSDP2 communicates per `fully_shard` unit"):
        ShardPlusModelParallelStrategy(auto_tune_tensor_fusion=True)
    with pytest.raises(TypeError, match=r"unknown option `unevn_inputs`='join' \(did you mean `uneven_inputs`\?\)"):
        ShardPlusModelParallelStrategy(unevn_inputs="join")
    with pytest.raises(TypeError, match=r"`save_distributed_checkpoint`='false' is not valid: expected True or False"):
        ShardPlusModelParallelStrategy(save_distributed_checkpoint="false")  # (a YAML string would flip it)
    with pytest.raises(ValueError, match=r"`data_parallel_size`=0 is not valid: expected an integer >= 1"):
        ShardPlusModelParallelStrategy(data_parallel_size=0)
    with pytest.raises(ValueError, match=r"`uneven_inputs`='wait' is not valid"):
        ShardPlusModelParallelStrategy(uneven_inputs="wait")
    with pytest.raises(ValueError, match=r"`start_method`='thread' is not valid"):
        ShardPlusModelParallelStrategy(start_method="thread")
    with pytest.MonkeyPatch.context() as patch:  # torch 2.4: no public state_dict post-hook to gather the weights with
        patch.delattr(torch.nn.Module, "register_state_dict_post_hook")
        with pytest.raises(RuntimeError, match=r"start_method='spawn' needs torch 2.5 or newer under model parallel"):
            ShardPlusModelParallelStrategy(start_method="spawn")
        ShardPlusModelParallelStrategy()
    assert not torch.distributed.is_initialized()


@needs_torch_2_4
def test_a_mesh_of_another_size_than_the_processes_is_refused_before_any_starts():
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = pl.Trainer(accelerator="cpu", devices=3, strategy=ShardPlusModelParallelStrategy(2, 1), logger=False)
    with pytest.raises(ValueError, match=r"`data_parallel_size`=2 x `tensor_parallel_size`=1 is a mesh of 2 processes, "
                       r"and the Trainer starts 3 \(devices x num_nodes\)"):  # fmt: skip
        trainer.fit(BoringModel())
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=ShardPlusModelParallelStrategy(tensor_parallel_size=3))
    with pytest.raises(ValueError, match=r"`data_parallel_size`=1 x `tensor_parallel_size`=3 is a mesh of 3"):
        trainer.fit(BoringModel())  # data parallel "auto": one per node, as Lightning resolves it
    assert not torch.distributed.is_initialized()


def test_the_strategy_is_registered_and_counts_data_parallel_ranks():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["shardplus_model_parallel"]["strategy"] is ShardPlusModelParallelStrategy
    for name, start_method in (("", "popen"), ("_fork", "fork"), ("_spawn", "spawn")):
        entry = StrategyRegistry[f"shardplus_model_parallel{name}"]
        assert entry["strategy"] is ShardPlusModelParallelStrategy
        assert entry["init_params"] == {"start_method": start_method}
    assert ShardPlusModelParallelStrategy(data_parallel_size=3, tensor_parallel_size=2).num_replicas == 3
    assert ShardPlusModelParallelStrategy().num_replicas == 1  # "auto": one per node, as ModelParallelStrategy
    assert "ShardPlusModelParallelStrategy" in lightning_shardplus.__all__


@pytest.mark.skipif(release(torch.__version__) < (2, 6), reason="the demo model's fully_shard is public from torch 2.6")
@pytest.mark.timeout(400)
def test_the_shipped_config_fits_two_by_two_through_the_shardplus_command(tmp_path):
    config = Path(__file__).parents[1] / "configs" / "model_parallel.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "lightning_shardplus.cli", "fit", "--config", str(config), "--trainer.max_epochs=2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "shardplus: 2 data-parallel ranks (model parallel)" in done.stderr + done.stdout
    # the demo's tensor-parallel plan returns no view from a `fully_shard` unit: FSDP2 (torch 2.13) would warn of
    # "wrong gradients" from in-place ops on it
    assert "returned a view tensor" not in done.stderr + done.stdout
    (metrics,) = tmp_path.glob("lightning_logs/model_parallel/version_0/metrics.csv")
    accuracy = [float(row["val_acc"]) for row in csv.DictReader(metrics.open()) if row["val_acc"]]
    assert len(accuracy) == 2 and accuracy[-1] > 0.85


@pytest.mark.skipif(release(torch.__version__) < (2, 6), reason="the demo model's fully_shard is public from torch 2.6")
@pytest.mark.timeout(300)
def test_the_example_script_trains_and_validates_every_sample_once(tmp_path):
    example = Path(__file__).parents[1] / "examples" / "model_parallel.py"
    done = _launch(example, tmp_path, "--data-parallel", 2, "--tensor-parallel", 1, "--max-epochs", 1)
    accuracy = float(done.stdout.split("validation accuracy ")[1].split()[0])
    assert 0.5 < accuracy <= 1.0


def test_the_global_batch_is_divided_over_the_data_parallel_ranks_only():
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=ShardPlusModelParallelStrategy(2, 2), logger=False,
        enable_progress_bar=False,
    )  # fmt: skip
    data = ShardPlusDataModule(global_batch_size=64, train_dataset=list(range(8)))
    data.trainer = trainer
    assert data.per_device_batch_size == 32 and data.effective_global_batch_size == 64
    # the messages name the data-parallel size (2), not the world's 4 processes
    with pytest.warns(UserWarning, match=r"global_batch_size=5 is not divisible by the data-parallel size \(2\)"):
        ShardPlusDataModule(global_batch_size=5, train_dataset=list(range(8))).trainer = trainer
    with pytest.raises(ValueError, match=r"`global_batch_size`=1 is smaller than the data-parallel size \(2 processes"):
        ShardPlusDataModule(global_batch_size=1, train_dataset=list(range(8))).trainer = trainer


MIRROR_FIT = """
import torch, torch.nn.functional as F, pytorch_lightning as ptl
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from lightning_shardplus.pytorch_lightning import ShardPlusModelParallelStrategy

class Model(ptl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def configure_model(self):
        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        self.log("samples", float(len(batch[0])), reduce_fx="sum", sync_dist=True)
        return F.cross_entropy(self.layer(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.layer(batch[0])
        self.log("evaluated", float(len(batch[0])), reduce_fx="sum", batch_size=len(batch[0]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def data(n):
    return DataLoader(TensorDataset(torch.randn(n, 4), torch.arange(n) % 2), batch_size=2)

trainer = ptl.Trainer(accelerator="cpu", devices=2, strategy=ShardPlusModelParallelStrategy(2, 1), max_epochs=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(Model(), data(8), data(3))
if trainer.is_global_zero:
    print("strategy:", type(trainer.strategy).__module__, {k: float(v) for k, v in trainer.callback_metrics.items()})
"""


@pytest.mark.skipif(release(torch.__version__) < (2, 6), reason="the script's fully_shard is public from torch 2.6")
@pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None, reason="needs pytorch_lightning")
@pytest.mark.timeout(300)
def test_the_pytorch_lightning_side_fits_with_the_mirrors_strategy(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(MIRROR_FIT)
    out = _launch(script, tmp_path).stdout
    # the mirror's class; the last step's 2 + 2 samples summed over the data-parallel ranks; 3 samples evaluated once
    mirror = "lightning_shardplus.pytorch_lightning.strategies.model_parallel"
    assert f"strategy: {mirror} {{'samples': 4.0, 'evaluated': 3.0}}" in out


@needs_torch_2_4
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("strategy", "start_method", "dp", "tp"),
    [
        pytest.param("model_parallel", "fork", 2, 2, marks=pytest.mark.compat),  # (each release's core check)
        ("model_parallel", "spawn", 2, 1),
        ("ddp", "spawn", 2, 1),
        ("ddp", "forkserver", 2, 1),
    ],
)
def test_a_fork_or_spawn_launch_trains_validates_and_gives_the_launching_process_the_whole_weights(
    tmp_path, strategy, start_method, dp, tp
):
    # Lightning's multiprocessing launcher sends rank 0's state_dict to the launching process, whose module is not
    # sharded (without the gathered tensors it could not load rank 0's shards), and only then: rank 0 alone reads the
    # state_dict in on_fit_end and teardown; spawned CPU workers get the Metric's state tensor in shared memory
    # (without their own copies the Metric's sum would count twice, as under ddp_spawn), forkserver ones the
    # parameters too (each step would be applied once per worker)
    script = PROBE.parent / "_process_launch_probe.py"
    _launch(script, tmp_path, strategy, start_method, dp, tp, tmp_path / "found.json")
    found = json.loads((tmp_path / "found.json").read_text())
    assert _close(found["weights"], found["reference"])  # the step of one process on the whole batch
    assert found["validate"] == [one_process(2 * dp - 1)]


CLASS_NAME_SCRIPT = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from lightning_shardplus.validation import class_name

class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

dist.init_process_group("gloo", init_method="file://" + __import__("sys").argv[1], rank=0, world_size=1)
module = fully_shard(Classifier(), mesh=init_device_mesh("cpu", (1,)))
print(type(module).__name__, class_name(module), class_name(Classifier()), class_name(torch.nn.Linear(1, 1)))
dist.destroy_process_group()
"""


@pytest.mark.skipif(release(torch.__version__) < (2, 6), reason="fully_shard is public from torch 2.6")
@pytest.mark.timeout(120)
def test_messages_name_the_class_the_user_wrote_not_the_one_fully_shard_makes(tmp_path):
    script = tmp_path / "name.py"
    script.write_text(CLASS_NAME_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["FSDPClassifier", "Classifier", "Classifier", "Linear"]


IDLE_TENSOR_PARALLEL = """
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

import lightning_shardplus  # (registers "shardplus_model_parallel")


class FullyShardedOnly(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def configure_model(self):
        for module in (self.l1, self.l2, self):
            fully_shard(module, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        if self.global_rank == 0:
            print(f"{type(self).__name__}: training step", file=sys.stderr, flush=True)
        return F.cross_entropy(self.l2(torch.relu(self.l1(batch[0]))), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Planned(FullyShardedOnly):
    def configure_model(self):
        plan = {"l1": ColwiseParallel(), "l2": RowwiseParallel()}
        parallelize_module(self, self.device_mesh["tensor_parallel"], plan)
        super().configure_model()


for model in (FullyShardedOnly(), Planned()):  # Lightning's "auto" mesh on one node: 1 x 2
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="shardplus_model_parallel", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(4, 4), torch.arange(4) % 2), batch_size=2))
"""


@pytest.mark.skipif(release(torch.__version__) < (2, 6), reason="the script's fully_shard is public from torch 2.6")
@pytest.mark.timeout(300)
def test_an_idle_tensor_parallel_dimension_is_named_once_before_the_first_step_and_a_plan_is_not(tmp_path):
    script = tmp_path / "idle.py"
    script.write_text(IDLE_TENSOR_PARALLEL)
    out = _launch(script, tmp_path).stderr
    warning = (
        "shardplus: the device mesh has 2 tensor-parallel peers per data-parallel rank (data_parallel_size=1, "
        'tensor_parallel_size=2), but no parameter of FullyShardedOnly is sharded over its "tensor_parallel" dimension '
        "after `configure_model`: the peers train identical copies on the same samples. For FSDP2 alone pass "
        "`data_parallel_size=2, tensor_parallel_size=1`"
    )
    # once (rank 0, the FSDP2-only fit), before that fit's first step; none for the module with a tensor-parallel plan
    assert out.count("tensor-parallel peers per data-parallel rank") == 1 and warning in out
    assert out.index(warning) < out.index("FullyShardedOnly: training step") < out.index("Planned: training step")


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.randn(4, 32))


class _Manual(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def _no_worker(*args, **kwargs):
    raise AssertionError("the launcher was called: the refusal came after workers started")


@needs_torch_2_4
def test_refusals_name_the_strategy_class_built_and_come_before_any_worker_starts():
    def trainer(strategy, **kwargs) -> pl.Trainer:
        trainer = cpu_trainer(strategy, 2, max_epochs=1, **kwargs)
        trainer.strategy.launcher.launch.launch = _no_worker  # Lightning's launch, after shardplus's checks
        return trainer

    refused = r"^ShardPlusModelParallelStrategy\(aggregation_frequency=3\) and Trainer\(accumulate_grad_batches=2\)"
    with pytest.raises(ValueError, match=refused):
        trainer(ShardPlusModelParallelStrategy(2, 1, aggregation_frequency=3), accumulate_grad_batches=2).fit(
            BoringModel()
        )
    refused = r"`uneven_inputs`='join' needs automatic optimization for a training stream: _Manual sets"
    for strategy, loaders in (
        (ShardPlusModelParallelStrategy(2, 1), DataLoader(_Stream())),
        (ShardPlusStrategy(start_method="spawn"), {"a": DataLoader(_Stream()), "b": DataLoader(range(4))}),
    ):
        with pytest.raises(ValueError, match=refused):
            trainer(strategy).fit(_Manual(), loaders)
    with pytest.raises(AssertionError, match="the launcher was called"):  # one data-parallel rank: nothing refused
        trainer(ShardPlusModelParallelStrategy(1, 2)).fit(_Manual(), DataLoader(_Stream()))
    assert not torch.distributed.is_initialized()


@needs_torch_2_4
@pytest.mark.timeout(120)
def test_lightnings_own_checks_of_the_module_come_before_the_data_side(caplog):
    # a module without `configure_model`: Lightning's refusal, with nothing of shardplus's started before it
    trainer = cpu_trainer(ShardPlusModelParallelStrategy(), 1, max_steps=1)
    refused = r"When using the ShardPlusModelParallelStrategy, you are required to override the `configure_model\(\)`"
    with caplog.at_level(logging.INFO), pytest.raises(TypeError, match=refused):
        trainer.fit(BoringModel())
    assert "All distributed processes registered" in caplog.text and "shardplus:" not in caplog.text
    # set up by hand, without processes (as Lightning's own unit tests do): Lightning's checks, then no data side
    strategy = ShardPlusModelParallelStrategy()
    strategy.accelerator, strategy.parallel_devices = CPUAccelerator(), [torch.device("cpu")]
    strategy.connect(BoringModel())
    with pytest.raises(TypeError, match=refused):
        strategy.setup(cpu_trainer("auto", 1))
