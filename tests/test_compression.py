"""Gradient compression: hooks registered on CPU/gloo and counted, composed with aggregation, PowerSGD on
several buckets, across DDP re-wraps and across a stop-and-resume, bf16's backend check, argument checks."""

import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import IndexedDataset, RecordingModule, cpu_trainer, in_forked_process, read_records
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.multiprocessing import ProcessRaisedException  # what a forked rank raised, in this process
from torch.utils.data import DataLoader

import lightning_shardplus  # noqa: F401
from lightning_shardplus import ShardPlusStrategy
from lightning_shardplus.diagnostics import CommunicationCounter
from lightning_shardplus.gradients.ddp import fusion
from lightning_shardplus.gradients.ddp.compression import CHECKPOINT_KEY, rank_file
from lightning_shardplus.gradients.ddp.fusion import BucketSetting

DIM, HIDDEN, CLASSES = 16, 32, 8
PARAMETERS = DIM * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES


class MLP(pl.LightningModule):
    """Two linear layers, SGD with momentum; at the end of training each rank writes its weights and its
    compression state (what a checkpoint saves beside itself for this rank; None when stateless)."""

    def __init__(self, out_dir, lr=0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))
        self.out_dir = Path(out_dir)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        inputs, labels, _ = batch
        return F.cross_entropy(self.net(inputs), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def on_train_end(self):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = self.out_dir / "end.ckpt"
        self.trainer.save_checkpoint(checkpoint)
        own = Path(rank_file(checkpoint, self.global_rank, self.trainer.world_size))
        state = torch.load(own, weights_only=True) if own.exists() else None
        torch.save(
            {"weights": self.state_dict(), "compression": state, "step": self.trainer.global_step},
            self.out_dir / f"rank{self.global_rank}.pt",
        )


def loader(size=48, batch_size=4):
    return DataLoader(IndexedDataset(size, dim=DIM, num_classes=CLASSES), batch_size=batch_size, shuffle=True)


def fit(
    out_dir, world_size=2, epochs=2, callbacks=(), ckpt_path=None, trainer_kwargs=None, **strategy_kwargs
):
    trainer = cpu_trainer(
        ShardPlusStrategy(start_method="fork", **strategy_kwargs),
        world_size,
        max_epochs=epochs,
        callbacks=list(callbacks),
        **(trainer_kwargs or {}),
    )
    trainer.fit(MLP(out_dir), loader(), ckpt_path=ckpt_path)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def counts(directory, rank=0):
    return json.loads((Path(directory) / f"rank{rank}.json").read_text())


def flat(state_dict):
    return torch.cat([v.flatten() for v in state_dict.values()])


def powersgd_state(start=2):
    return PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=start)


@pytest.mark.timeout(180)
@pytest.mark.compat
def test_fp16_and_bf16_send_half_the_bytes_of_none_on_gloo(tmp_path):
    results = {}
    for name in ("none", "fp16", "bf16"):
        counter = CommunicationCounter(tmp_path / f"counts-{name}")
        runs = fit(tmp_path / name, callbacks=[counter], gradient_compression=name)
        results[name] = (counts(tmp_path / f"counts-{name}")["summary"], flat(runs[0]["weights"]))
        assert torch.equal(flat(runs[0]["weights"]), flat(runs[1]["weights"]))  # ranks stay in sync
    none, fp16, bf16 = (results[name][0] for name in ("none", "fp16", "bf16"))
    assert none["optimizer_steps"] == 12 and none["rounds_per_step"] == 1
    assert none["bytes_per_step"] == 4 * PARAMETERS
    assert fp16["bytes_per_step"] == bf16["bytes_per_step"] == 2 * PARAMETERS
    assert fp16["rounds_per_step"] == bf16["rounds_per_step"] == 1
    # the 16-bit all-reduce changes the weights a little, not much
    for name, tolerance in (("fp16", 1e-3), ("bf16", 1e-2)):
        difference = (results[name][1] - results["none"][1]).abs().max()
        assert 0 < difference < tolerance


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["fp16", "powersgd"])
def test_compression_runs_only_on_the_communicating_micro_batch(tmp_path, name):
    counter = CommunicationCounter(tmp_path / "counts")
    state = powersgd_state() if name == "powersgd" else None
    fit(
        tmp_path / "run",
        callbacks=[counter],
        gradient_compression=name,
        ddp_comm_state=state,
        aggregation_frequency=4,
    )  # 6 micro-batches per epoch: windows of 4 and 2
    records = counts(tmp_path / "counts")["records"]
    assert [r["rounds"] for r in records] == [0, 0, 0, 1, 0, 1] * 2
    assert all(r["collectives"] == 0 for r in records if not r["stepped"])


@pytest.mark.timeout(120)
def test_a_user_comm_hook_is_registered_on_cpu_too(tmp_path):
    counter = CommunicationCounter(tmp_path / "counts")
    fit(tmp_path / "run", callbacks=[counter], ddp_comm_hook=default_hooks.fp16_compress_hook)
    assert counts(tmp_path / "counts")["summary"]["bytes_per_step"] == 2 * PARAMETERS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.compat
@pytest.mark.skipif(not fusion.SUPPORTS_FIRST_BUCKET, reason="DDP without bucket_cap_mb_list (torch < 2.13)")
def test_powersgd_with_several_buckets_on_gloo_does_not_hang_and_compresses(tmp_path, world_size):
    # torch's powerSGD_hook alone hangs here (from the first compressed step on): see compression.py
    counter = CommunicationCounter(tmp_path / "counts")
    runs = fit(
        tmp_path / "run",
        world_size=world_size,
        callbacks=[counter],
        gradient_compression="powersgd",
        ddp_comm_state=powersgd_state(),
        tensor_fusion_threshold_mb=0.0001,  # several buckets
    )
    steps = counts(tmp_path / "counts")["steps"]
    assert steps[0]["buckets"] == 1  # DDP starts with one bucket and re-cuts them after the first step
    assert all(step["buckets"] == steps[1]["buckets"] > 1 for step in steps[1:])
    # a plain all-reduce before start_powerSGD_iter
    assert steps[0]["bytes"] == steps[1]["bytes"] == 4 * PARAMETERS
    # rank 1: P and Q of both matrices, the biases uncompressed
    compressed = 4 * (DIM + HIDDEN + HIDDEN + CLASSES + HIDDEN + CLASSES)
    assert all(step["bytes"] == compressed for step in steps[2:])
    for run in runs[1:]:
        assert torch.equal(flat(runs[0]["weights"]), flat(run["weights"]))
    assert torch.isfinite(flat(runs[0]["weights"])).all()
    errors = [run["compression"]["params"]["net.0.weight"]["error"] for run in runs]
    assert not torch.equal(errors[0], errors[1])  # error feedback is per rank


class Rewrap(Callback):
    """Re-wraps DDP after ``at`` optimizer steps (as the fusion autotuner does): a new wrapper, a new hook."""

    def __init__(self, at: int, bucket_cap_mb: float) -> None:
        self.at, self.bucket_cap_mb = at, bucket_cap_mb

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            trainer.strategy.rewrap_ddp(BucketSetting(self.bucket_cap_mb))  # a new wrapper, the hook registered again


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["fp16", "powersgd"])
def test_hook_and_state_carry_over_when_ddp_is_rewrapped(tmp_path, name):
    state = powersgd_state() if name == "powersgd" else None
    counter = CommunicationCounter(tmp_path / "counts")
    plain = fit(
        tmp_path / "plain", gradient_compression=name, ddp_comm_state=state, tensor_fusion_threshold_mb=0.0001
    )
    rewrapped = fit(
        tmp_path / "rewrapped",
        callbacks=[Rewrap(at=5, bucket_cap_mb=0.003), counter],
        gradient_compression=name,
        ddp_comm_state=state,
        tensor_fusion_threshold_mb=0.0001,
    )
    steps = counts(tmp_path / "counts")["steps"]
    assert all(step["rounds"] == 1 for step in steps)  # the new wrapper has the (counted) hook as well
    if name == "fp16":
        assert all(step["bytes"] == 2 * PARAMETERS for step in steps)
    # PowerSGD's error feedback and warm start are re-cut for the new wrapper's buckets: nothing changes
    for a, b in zip(plain, rewrapped, strict=True):
        assert torch.allclose(flat(a["weights"]), flat(b["weights"]), atol=1e-6, rtol=0)


def _error_feedback(run):
    return torch.cat(
        [run["compression"]["params"][name]["error"] for name in sorted(run["compression"]["params"])]
    )


@pytest.mark.timeout(180)
def test_powersgd_resumed_from_a_checkpoint_continues_like_an_uninterrupted_run(tmp_path):
    kwargs = dict(
        gradient_compression="powersgd", ddp_comm_state=powersgd_state(), tensor_fusion_threshold_mb=0.0001
    )
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}", save_top_k=-1)
    uninterrupted = fit(
        tmp_path / "full",
        epochs=4,
        callbacks=[checkpoints],
        trainer_kwargs={"enable_checkpointing": True},
        **kwargs,
    )
    checkpoint = torch.load(tmp_path / "ckpt" / "epoch=1.ckpt", weights_only=True)  # plain types and tensors
    entry = checkpoint[CHECKPOINT_KEY]
    assert entry["name"] == "powersgd" and entry["world_size"] == 2
    assert "error" not in entry["state"]["params"]["net.0.weight"]  # rank 0's file holds no per-rank state
    per_rank = [torch.load(rank_file(tmp_path / "ckpt" / "epoch=1.ckpt", r, 2), weights_only=True) for r in range(2)]
    first, second = (state["params"]["net.0.weight"]["error"] for state in per_rank)
    assert not torch.equal(first, second)  # each rank's own error feedback, in its own file

    resumed = fit(tmp_path / "resumed", epochs=4, ckpt_path=str(tmp_path / "ckpt" / "epoch=1.ckpt"), **kwargs)
    for full, again in zip(uninterrupted, resumed, strict=True):
        assert again["step"] == full["step"] == 24
        assert again["compression"]["iter"] == full["compression"]["iter"]
        assert torch.allclose(_error_feedback(again), _error_feedback(full), atol=1e-6, rtol=0)
        assert torch.allclose(flat(again["weights"]), flat(full["weights"]), atol=1e-6, rtol=0)

    # without the compression state, the same resume goes elsewhere: the state is what makes it continue
    del checkpoint[CHECKPOINT_KEY]
    torch.save(checkpoint, tmp_path / "stripped.ckpt")
    stripped = fit(tmp_path / "stripped", epochs=4, ckpt_path=str(tmp_path / "stripped.ckpt"), **kwargs)
    assert (flat(stripped[0]["weights"]) - flat(uninterrupted[0]["weights"])).abs().max() > 1e-4


@pytest.mark.timeout(300)
def test_rank_zeros_powersgd_checkpoint_does_not_grow_with_the_world_size(tmp_path):
    sizes = {}
    for world in (2, 4):
        directory = tmp_path / f"ckpt{world}"
        checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=1)  # keeps the newest only
        fit(
            tmp_path / f"run{world}",
            world_size=world,
            callbacks=[checkpoints],
            trainer_kwargs={"enable_checkpointing": True},
            gradient_compression="powersgd",
            ddp_comm_state=powersgd_state(),
        )
        sizes[world] = (directory / "epoch=1.ckpt").stat().st_size
        # every rank wrote its own file beside the checkpoint; the removed checkpoint's files went with it
        assert sorted(p.name for p in (directory / "epoch=1.ckpt.powersgd").iterdir()) == [
            f"rank-{r}-of-{world}.pt" for r in range(world)
        ]
        assert sorted(p.name for p in directory.iterdir()) == ["epoch=1.ckpt", "epoch=1.ckpt.powersgd"]
    assert abs(sizes[4] - sizes[2]) <= 0.02 * sizes[2], sizes


@pytest.mark.timeout(240)
def test_powersgd_resume_without_the_per_rank_files_warns_and_restarts_error_feedback(tmp_path):
    kwargs = dict(gradient_compression="powersgd", ddp_comm_state=powersgd_state())
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}", save_top_k=-1)
    fit(tmp_path / "full", callbacks=[checkpoints], trainer_kwargs={"enable_checkpointing": True}, **kwargs)
    checkpoint = tmp_path / "ckpt" / "epoch=0.ckpt"
    for path in (tmp_path / "ckpt" / "epoch=0.ckpt.powersgd").iterdir():
        path.unlink()
    message = r"PowerSGD state '.*rank-0-of-2\.pt' is missing; '.*rank-1-of-2\.pt' is missing: .*error feedback"
    with warnings.catch_warnings():  # the ranks (forked) inherit the filter: the warning stops the fit, named
        warnings.filterwarnings("error", message=".*per-rank PowerSGD state")
        with pytest.raises(ProcessRaisedException, match=message):
            fit(tmp_path / "resumed", epochs=3, ckpt_path=str(checkpoint), **kwargs)
    with warnings.catch_warnings():  # with its files, the other checkpoint resumes without a word
        warnings.filterwarnings("error", message=".*per-rank PowerSGD state")
        fit(tmp_path / "resumed2", epochs=3, ckpt_path=str(tmp_path / "ckpt" / "epoch=1.ckpt"), **kwargs)


class RecordWarnings(Callback):
    """Each rank writes the warnings raised from the Trainer's setup on (where checkpoints are loaded) to
    ``<out_dir>/warnings-rank<r>.txt`` when the fit ends."""

    def __init__(self, out_dir) -> None:
        self.out_dir = Path(out_dir)

    def setup(self, trainer, pl_module, stage):
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def teardown(self, trainer, pl_module, stage):
        self._catcher.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        text = "\n".join(str(w.message) for w in self._caught)
        (self.out_dir / f"warnings-rank{trainer.global_rank}.txt").write_text(text)


@pytest.mark.timeout(240)
def test_a_corrupt_per_rank_powersgd_file_warns_naming_it_and_the_fit_goes_on(tmp_path):
    # a crash during a save on a non-atomic filesystem leaves a truncated file: that rank's torch.load failed
    # (UnpicklingError) while the other rank waited in the agreement collective ("Connection closed by peer")
    kwargs = dict(gradient_compression="powersgd", ddp_comm_state=powersgd_state())
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}", save_top_k=-1)
    fit(tmp_path / "full", callbacks=[checkpoints], trainer_kwargs={"enable_checkpointing": True}, **kwargs)
    checkpoint = tmp_path / "ckpt" / "epoch=0.ckpt"
    corrupt = Path(rank_file(checkpoint, 1, 2))
    corrupt.write_bytes(corrupt.read_bytes()[: corrupt.stat().st_size // 2])
    record = RecordWarnings(tmp_path)
    runs = fit(tmp_path / "resumed", epochs=3, ckpt_path=str(checkpoint), callbacks=[record], **kwargs)
    assert [run["step"] for run in runs] == [18, 18]  # the fit ended on both ranks
    assert torch.equal(flat(runs[0]["weights"]), flat(runs[1]["weights"]))
    text = (tmp_path / "warnings-rank0.txt").read_text()  # one warning, as for a missing file, from rank 0
    assert f"{str(corrupt)!r} cannot be read" in text, text
    assert "error feedback starts again from zero" in text
    assert rank_file(checkpoint, 0, 2) not in text  # rank 0's file was fine


def test_canary_powersgd_state_layout_is_torchs():
    # compression.py cuts torch's per-bucket PowerSGD memory into per-parameter pieces as powerSGD_hook lays it
    # out (error: the bucket's flat gradients; P and Q: the compressed matrices grouped by shape, in order of first
    # appearance, n*r and m*r each) and reads these PowerSGDState fields: a torch that changes either fails here
    from torch.nn.parallel import DistributedDataParallel

    from lightning_shardplus.gradients.ddp.compression import PowerSGDCompression

    fields = {"error_dict", "p_memory_dict", "q_memory_dict", "iter", "rng", "matrix_approximation_rank",
              "min_compression_rate", "total_numel_before_compression", "total_numel_after_compression",
              "next_stats_report", "start_powerSGD_iter", "use_error_feedback", "warm_start"}  # fmt: skip
    assert fields <= set(PowerSGDState.__slots__)

    def layout() -> None:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        torch.manual_seed(0)  # weights (48, 32) first and last, other shapes between them; biases not compressed
        module = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 20), nn.Linear(20, 32, bias=False), nn.Linear(32, 48))
        compression = PowerSGDCompression(PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2))
        model = DistributedDataParallel(module)
        model.register_comm_hook(*reversed(compression.hook_for(model, "gloo")))
        for _ in range(3):  # two plain all-reduces, then one compressed step
            model.zero_grad()
            model(torch.randn(4, 32)).square().sum().backward()
        state = compression.state_dict()
        compressed = {name for name, parts in state["params"].items() if "p" in parts}
        assert compressed == {"0.weight", "1.weight", "2.weight", "3.weight"}
        for name, parameter in module.named_parameters():
            parts = state["params"][name]
            assert parts["error"].shape == (parameter.numel(),)
            if name in compressed:  # the gradient DDP hands back is P Q^T of this parameter's own pieces
                n, m = parameter.shape
                p, q = parts["p"].view(n, 2), parts["q"].view(m, 2)
                assert torch.allclose(parameter.grad, p @ q.T, atol=1e-5), name

    in_forked_process(layout)  # the process group and DDP die with the child (see `in_forked_process`)


@pytest.mark.timeout(120)
def test_bf16_on_a_backend_that_cannot_all_reduce_it_fails_at_setup(tmp_path, monkeypatch):
    # gloo all-reduces bfloat16 in torch 2.13; a backend that cannot is simulated (fork workers inherit it)
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        if tensor.dtype == torch.bfloat16:
            raise RuntimeError("Invalid scalar type")
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    trainer = cpu_trainer(
        ShardPlusStrategy(start_method="fork", gradient_compression="bf16"), 2, max_epochs=1
    )
    with pytest.raises(
        Exception,
        match=r"`gradient_compression`='bf16' cannot work on the 'gloo' process-group "
        r"backend: it cannot all-reduce torch.bfloat16 tensors.*Use 'fp16'",
    ):
        trainer.fit(RecordingModule(tmp_path), DataLoader(IndexedDataset(8), batch_size=2))
    assert not [row for row in read_records(tmp_path) if row["stage"] == "train"]  # before any training step


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"gradient_compression": "int8"},
            ValueError,
            r"`gradient_compression`='int8' is not valid: expected one of 'none', 'fp16', 'bf16', 'powersgd'",
        ),
        ({"gradient_compression": None}, ValueError, r"`gradient_compression`=None"),
        (
            {"gradient_compression": "fp16", "ddp_comm_hook": default_hooks.fp16_compress_hook},
            ValueError,
            r"`gradient_compression`='fp16' and `ddp_comm_hook`=.*both choose DDP's communication hook",
        ),
        (
            {"gradient_compression": "fp16", "ddp_comm_state": powersgd_state()},
            ValueError,
            r"`ddp_comm_state`=.*does not go with `gradient_compression`='fp16'",
        ),
    ],
)
def test_bad_compression_arguments_raise_before_any_process_group(kwargs, error, message):
    with pytest.raises(error, match=message):
        ShardPlusStrategy(**kwargs)
    assert not dist.is_initialized()


def _digits_accuracy(tmp_path, compression):
    from lightning_shardplus.cli import ShardPlusCLI

    config = Path(__file__).resolve().parents[1] / "configs" / "digits.yaml"
    cli = ShardPlusCLI(
        args=[
            "--config",
            str(config),
            "--trainer.strategy.init_args.start_method=fork",
            f"--trainer.strategy.init_args.gradient_compression={compression}",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            f"--trainer.default_root_dir={tmp_path / compression}",
        ],
        run=False,
    )
    assert cli.trainer.strategy.config.gradient_compression == compression  # parsed from the command line
    cli.trainer.fit(cli.model, cli.datamodule)
    return float(cli.trainer.callback_metrics["val_acc"])


@pytest.mark.timeout(300)
def test_digits_config_reaches_the_same_accuracy_with_compression(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["shardplus"])  # the CLI reads its arguments from `args`, not pytest's
    baseline = _digits_accuracy(tmp_path, "none")
    assert baseline >= 0.9
    for compression in ("fp16", "bf16", "powersgd"):
        assert abs(_digits_accuracy(tmp_path, compression) - baseline) <= 0.01, compression


def test_the_counter_survives_pickling_for_the_spawn_launcher():
    import pickle

    counter = pickle.loads(pickle.dumps(CommunicationCounter("somewhere")))
    assert counter.output_dir == Path("somewhere") and counter.summary()["optimizer_steps"] == 0
    with counter._lock:
        pass


def test_compression_state_from_another_setting_or_world_size_warns_and_keeps_what_fits():
    from lightning_shardplus.gradients.ddp.compression import CommunicationHook, PowerSGDCompression, checkpoint_entry

    saved = PowerSGDCompression()
    saved.state.iter = 7
    saved._loose = {"w": {"error": torch.ones(6), "p": torch.ones(2), "q": torch.ones(3)}}
    entry = checkpoint_entry("powersgd", 2, saved.state_dict())

    # the strategy's component of a fit with fp16 (on NCCL the backend check is torch's: nothing communicates here)
    hook = CommunicationHook("fp16", backend="nccl", device=torch.device("cpu"))
    with pytest.warns(
        UserWarning,
        match=r"holds 'powersgd' gradient-compression state, this run uses "
        r"`gradient_compression`='fp16': it starts without it",
    ):
        hook.load_state_dict(entry)

    restored = CommunicationHook("powersgd", backend="gloo", device=torch.device("cpu"))  # one process
    with pytest.warns(UserWarning, match=r"from 2 processes, this run has 1.*error feedback starts again"):
        restored.load_state_dict({**entry, "checkpoint_path": "x.ckpt"})
    assert restored.compression.state.iter == 7 and set(restored.compression._loose["w"]) == {"p", "q"}
    again = PowerSGDCompression()
    again.load_checkpoint_entry(entry, saved.state_dict(), unusable="")
    assert set(again._loose["w"]) == {"error", "p", "q"}
