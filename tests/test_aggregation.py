"""Gradient aggregation: equivalence with one process and a larger batch, communication only on the last
micro-batch of a window, the short last window of an epoch, argument checks."""

import json
import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import IndexedDataset, RecordingModule, cpu_trainer
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

import lightning_shardplus  # noqa: F401
from lightning_shardplus import PaddedShardSampler, ShardPlusStrategy
from lightning_shardplus.data.aggregation import gradient_correction, window_length
from lightning_shardplus.diagnostics import CommunicationCounter


class AggregationModule(pl.LightningModule):
    """An MLP (no dropout, no BatchNorm) trained with plain SGD and a per-step LR schedule; on the last train
    batch each rank saves its weights, and it records the LR and the gradient it stepped with.

    ``loss_divisor``: None for the mean loss over the batch; else the summed per-sample loss divided by it
    (the single-process reference of ``average_aggregated_gradients=False``)."""

    def __init__(self, out_dir, dim=4, hidden=6, classes=3, lr=0.2, loss_divisor=None, clip=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, classes))
        self.out_dir = Path(out_dir)
        self.lr = lr
        self.loss_divisor = loss_divisor
        self.steps: list[dict] = []

    def training_step(self, batch, batch_idx):
        inputs, labels, _ = batch
        logits = self.net(inputs)
        if self.loss_divisor is None:
            return F.cross_entropy(logits, labels)
        return F.cross_entropy(logits, labels, reduction="sum") / self.loss_divisor

    def on_before_optimizer_step(self, optimizer):
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in self.parameters()))
        self.steps.append({"lr": optimizer.param_groups[0]["lr"], "grad_norm": float(norm)})

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_end(self):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        weights = {k: v.tolist() for k, v in self.state_dict().items()}
        record = {"weights": weights, "steps": self.steps, "global_step": self.trainer.global_step}
        (self.out_dir / f"rank{self.global_rank}.json").write_text(json.dumps(record))


def fit(
    out_dir,
    world_size,
    batch_size,
    dataset_size,
    epochs,
    module_kwargs=None,
    callbacks=(),
    plugins=None,
    **strategy_kwargs,
):
    module = AggregationModule(out_dir, **(module_kwargs or {}))
    trainer = cpu_trainer(
        ShardPlusStrategy(start_method="fork", **strategy_kwargs),
        world_size,
        max_epochs=epochs,
        callbacks=list(callbacks),
        gradient_clip_val=(module_kwargs or {}).get("clip"),
        plugins=plugins,
    )
    dim, classes = module.net[0].in_features, module.net[-1].out_features
    dataset = IndexedDataset(dataset_size, dim=dim, num_classes=classes)
    trainer.fit(module, DataLoader(dataset, batch_size=batch_size, shuffle=True))
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world_size)]


def flat(weights):
    return torch.cat([torch.as_tensor(v).flatten() for v in weights.values()])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("average", [True, False])
@pytest.mark.compat
def test_aggregated_training_equals_one_process_with_the_large_batch(tmp_path, world_size, average):
    # per-device batch b=2, A=3, 5 micro-batches per rank and epoch: windows of 3 then 2 (a short last window)
    b, frequency, per_rank_batches, epochs = 2, 3, 5, 2
    size = world_size * b * per_rank_batches
    # average: the optimizer gets the mean over the window's samples = one process, mean loss, batch W*b*A.
    # sum: it gets the sum over micro-batches of each micro-batch's gradient averaged over ranks, i.e.
    #      sum over the window's samples / (W*b) = one process, summed loss / (W*b), batch W*b*A.
    reference_kwargs = None if average else {"loss_divisor": world_size * b}
    runs = fit(
        tmp_path / "agg",
        world_size,
        b,
        size,
        epochs,
        aggregation_frequency=frequency,
        average_aggregated_gradients=average,
    )
    [reference] = fit(
        tmp_path / "ref", 1, world_size * b * frequency, size, epochs, module_kwargs=reference_kwargs
    )

    assert reference["global_step"] == runs[0]["global_step"] == 4  # 2 optimizer steps per epoch
    for run in runs:
        assert torch.allclose(flat(run["weights"]), flat(reference["weights"]), atol=1e-5, rtol=0)
        # LR (interval="step") stepped once per optimizer step: the same schedule as the reference
        assert [s["lr"] for s in run["steps"]] == pytest.approx([s["lr"] for s in reference["steps"]])
        assert [s["grad_norm"] for s in run["steps"]] == pytest.approx(
            [s["grad_norm"] for s in reference["steps"]], rel=1e-5
        )
    before = flat(AggregationModule(tmp_path).state_dict())
    assert not torch.allclose(before, flat(reference["weights"]), atol=1e-3)  # training did move the weights


@pytest.mark.timeout(120)
def test_gradient_clipping_clips_the_corrected_gradient(tmp_path):
    # 4 micro-batches per rank, A=3: the second window holds 1 micro-batch, which Lightning alone would step
    # with a third of its gradient. A clip threshold between that third and the full norm tells them apart.
    [unclipped] = fit(tmp_path / "norms", 1, 12, 16, 1)
    clip = 0.6 * unclipped["steps"][1]["grad_norm"]
    kwargs = {"clip": clip}
    runs = fit(tmp_path / "agg", 2, 2, 16, 1, module_kwargs=kwargs, aggregation_frequency=3)
    [reference] = fit(tmp_path / "ref", 1, 12, 16, 1, module_kwargs=kwargs)
    assert reference["global_step"] == runs[0]["global_step"] == 2
    assert reference["steps"][1]["grad_norm"] > clip > reference["steps"][1]["grad_norm"] / 3
    assert torch.allclose(flat(runs[0]["weights"]), flat(reference["weights"]), atol=1e-5, rtol=0)


@pytest.mark.timeout(120)
def test_aggregation_with_amp_and_a_grad_scaler(tmp_path):
    # 16-bit AMP with a GradScaler (on CPU here): the correction runs on the scaled gradient, before the
    # precision plugin unscales it; the optimizer sees the same gradients as the one-process reference.
    def amp():
        return [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=1024.0))]

    runs = fit(tmp_path / "agg", 2, 2, 20, 2, plugins=amp(), aggregation_frequency=3)
    [reference] = fit(tmp_path / "ref", 1, 12, 20, 2, plugins=amp())
    assert [s["grad_norm"] for s in runs[0]["steps"]] == pytest.approx(
        [s["grad_norm"] for s in reference["steps"]], rel=1e-3
    )
    assert torch.allclose(flat(runs[0]["weights"]), flat(reference["weights"]), atol=1e-3, rtol=0)


@pytest.mark.timeout(120)
def test_stock_accumulation_misnormalizes_the_short_window_and_shardplus_does_not(tmp_path):
    # The same 2-rank run with Lightning's accumulate_grad_batches=3 under the stock DDPStrategy, fed the same
    # shards (our sampler, put in by hand with use_distributed_sampler=False): only the short window differs.
    [reference] = fit(tmp_path / "ref", 1, 12, 20, 1)

    class StockModule(AggregationModule):
        def train_dataloader(self):
            dim, classes = self.net[0].in_features, self.net[-1].out_features
            dataset = IndexedDataset(20, dim=dim, num_classes=classes)
            return DataLoader(dataset, batch_size=2, sampler=PaddedShardSampler(dataset, 2, self.global_rank))

    trainer = cpu_trainer(
        DDPStrategy(start_method="fork"), 2, max_epochs=1, accumulate_grad_batches=3, use_distributed_sampler=False
    )
    trainer.fit(StockModule(tmp_path / "ddp"))
    stock = json.loads((tmp_path / "ddp" / "rank0.json").read_text())
    ours = fit(tmp_path / "agg", 2, 2, 20, 1, aggregation_frequency=3)[0]
    first, short = (s["grad_norm"] for s in reference["steps"])
    assert stock["steps"][0]["grad_norm"] == pytest.approx(first, rel=1e-5)
    assert stock["steps"][1]["grad_norm"] == pytest.approx(short * 2 / 3, rel=1e-5)  # 2 micro-batches / 3
    assert ours["steps"][1]["grad_norm"] == pytest.approx(short, rel=1e-5)
    assert torch.allclose(flat(ours["weights"]), flat(reference["weights"]), atol=1e-5, rtol=0)


@pytest.mark.timeout(120)
def test_one_all_reduce_round_per_optimizer_step(tmp_path):
    # 5 micro-batches per rank and epoch, A=3: windows of 3 and 2; a small bucket cap makes several buckets
    counter = CommunicationCounter(tmp_path / "counts")
    fit(
        tmp_path / "agg",
        2,
        2,
        20,
        2,
        module_kwargs={"dim": 64, "hidden": 256, "classes": 64},
        callbacks=[counter],
        aggregation_frequency=3,
        tensor_fusion_threshold_mb=0.05,
    )
    for rank in range(2):
        report = json.loads((tmp_path / "counts" / f"rank{rank}.json").read_text())
        records = report["records"]
        assert [r["stepped"] for r in records] == [False, False, True, False, True] * 2
        assert [r["rounds"] for r in records] == [0, 0, 1, 0, 1] * 2  # exactly one round, on the last
        assert all(r["collectives"] == r["bytes"] == 0 for r in records if not r["stepped"])
        steps = report["steps"]
        assert [s["micro_batches"] for s in steps] == [3, 2, 3, 2]
        assert all(s["rounds"] == 1 for s in steps)
        assert all(s["buckets"] == s["collectives"] > 1 for s in steps[1:])  # several buckets, one round
        parameters = 64 * 256 + 256 + 256 * 64 + 64
        assert all(s["bytes"] == 4 * parameters for s in steps)  # float32: the whole gradient once per step
        assert report["summary"]["rounds_on_non_stepping_micro_batches"] == 0


def test_window_arithmetic():
    assert [window_length(done, 3) for done in range(1, 9)] == [1, 2, 3, 1, 2, 3, 1, 2]
    assert gradient_correction(3, 3, average=True) == 1.0
    assert gradient_correction(3, 2, average=True) == 1.5
    assert gradient_correction(3, 2, average=False) == 3.0
    with pytest.raises(ValueError):
        gradient_correction(3, 4, average=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"aggregation_frequency": 0}, ValueError, r"`aggregation_frequency`=0.*integer >= 1"),
        ({"aggregation_frequency": -2}, ValueError, r"`aggregation_frequency`=-2.*integer >= 1"),
        ({"aggregation_frequency": 2.0}, TypeError, r"`aggregation_frequency`=2.0.*integer >= 1"),
        ({"aggregation_frequency": "4"}, TypeError, r"`aggregation_frequency`='4'.*integer >= 1"),
        ({"aggregation_frequency": True}, TypeError, r"`aggregation_frequency`=True"),
        ({"average_aggregated_gradients": 1}, TypeError, r"`average_aggregated_gradients`=1.*True or False"),
    ],
)
def test_bad_aggregation_arguments_raise_before_any_process_group(kwargs, error, message):
    with pytest.raises(error, match=message):
        ShardPlusStrategy(**kwargs)
    assert not dist.is_initialized()


def test_different_accumulate_grad_batches_is_refused_before_launch(tmp_path):
    trainer = cpu_trainer(
        ShardPlusStrategy(start_method="fork", aggregation_frequency=4),
        2,
        accumulate_grad_batches=2,
        max_epochs=1,
    )
    with pytest.raises(
        ValueError,
        match=r"aggregation_frequency=4\).*accumulate_grad_batches=2\).*Use "
        r"`aggregation_frequency` only.*remove `accumulate_grad_batches`",
    ):
        trainer.fit(RecordingModule(tmp_path), DataLoader(IndexedDataset(8), batch_size=2))
    assert not dist.is_initialized()


def test_aggregation_with_manual_optimization_or_an_accumulation_scheduler_is_refused(tmp_path):
    class Manual(RecordingModule):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.automatic_optimization = False

    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork", aggregation_frequency=2), 2, max_epochs=1)
    with pytest.raises(ValueError, match=r"`aggregation_frequency`=2 needs automatic optimization"):
        trainer.fit(Manual(tmp_path), DataLoader(IndexedDataset(8), batch_size=2))
    trainer = cpu_trainer(
        ShardPlusStrategy(start_method="fork", aggregation_frequency=2),
        2,
        max_epochs=1,
        callbacks=[GradientAccumulationScheduler({0: 2})],
    )
    with pytest.raises(ValueError, match=r"GradientAccumulationScheduler"):
        trainer.fit(RecordingModule(tmp_path), DataLoader(IndexedDataset(8), batch_size=2))
    assert not dist.is_initialized()


def test_a_static_graph_with_more_than_one_micro_batch_per_step_is_refused_before_any_process_starts(tmp_path):
    # torch's DDP fails on the first backward of an accumulation window with static_graph=True (pytorch#143580)
    with pytest.raises(ValueError, match=r"`static_graph`=True and `aggregation_frequency`=2 do not work together"):
        ShardPlusStrategy(static_graph=True, aggregation_frequency=2)
    trainer = cpu_trainer(ShardPlusStrategy(start_method="fork", static_graph=True), 2, accumulate_grad_batches=3)
    refused = r"`static_graph`=True and `Trainer\(accumulate_grad_batches\)`=3 do not work together"
    with pytest.raises(ValueError, match=refused):
        trainer.fit(RecordingModule(tmp_path), DataLoader(IndexedDataset(8), batch_size=2))
    assert not dist.is_initialized()
    ShardPlusStrategy(static_graph=True)  # one micro-batch per step: DDP's static graph as it is


class _ReportBatch(Callback):
    """Writes what the strategy tells callbacks, and the messages logged from the setup on (the strategy logs the
    effective batch when the training loaders are built)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.messages: list[str] = []

    def setup(self, trainer, pl_module, stage):
        handler = logging.Handler()
        handler.emit = lambda record: self.messages.append(record.getMessage())
        for name in ("lightning.pytorch", "pytorch_lightning"):  # rank_zero_info logs under the last one imported
            logging.getLogger(name).addHandler(handler)

    def on_train_start(self, trainer, pl_module):
        self.report = {
            "effective": trainer.strategy.effective_batch_size,
            "micro_batches": trainer.strategy.micro_batches_per_step,
            "accumulate": trainer.accumulate_grad_batches,
        }

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            self.out.write_text(json.dumps(self.report | {"messages": self.messages}))


@pytest.mark.timeout(120)
def test_effective_batch_is_reported_and_available_to_callbacks(tmp_path):
    out = tmp_path / "batch.json"
    trainer = cpu_trainer(
        ShardPlusStrategy(start_method="fork", aggregation_frequency=4),
        2,
        max_steps=1,
        callbacks=[_ReportBatch(out)],
    )
    trainer.fit(RecordingModule(tmp_path / "r"), DataLoader(IndexedDataset(40), batch_size=3))
    report = json.loads(out.read_text())
    assert (report["effective"], report["micro_batches"], report["accumulate"]) == (24, 4, 4)
    assert any(
        m.startswith(
            "shardplus: effective batch 24 = 3 per device x 2 processes x 4 micro-batches per optimizer"
        )
        for m in report["messages"]
    )
    assert trainer.accumulate_grad_batches == 1  # the user's Trainer is left as it was


def test_the_new_arguments_parse_from_the_cli(monkeypatch, capsys):
    from lightning_shardplus.cli import ShardPlusCLI

    monkeypatch.setattr("sys.argv", ["shardplus"])
    config = Path(__file__).resolve().parents[1] / "configs" / "digits.yaml"
    cli = ShardPlusCLI(
        args=[
            "--config",
            str(config),
            "--trainer.strategy.init_args.aggregation_frequency=4",
            "--trainer.strategy.init_args.average_aggregated_gradients=false",
            "--trainer.strategy.init_args.gradient_compression=fp16",
            "--trainer.logger=false",
        ],
        run=False,
    )
    strategy = cli.trainer.strategy
    assert (strategy.config.aggregation_frequency, strategy.config.average_aggregated_gradients) == (4, False)
    assert strategy.config.gradient_compression == "fp16"
    with pytest.raises(SystemExit) as exit_info:  # a usage error carrying our message (cli.ShardPlusCLI)
        ShardPlusCLI(
            args=["--config", str(config), "--trainer.strategy.init_args.aggregation_frequency=0"], run=False
        )
    assert exit_info.value.code == 2
    assert "`aggregation_frequency`=0 is not valid: expected an integer >= 1" in capsys.readouterr().err


def test_window_gradients_are_restored_per_rank_or_as_the_mean_on_another_world_size():
    from lightning_shardplus.data.aggregation import restore_window_gradients, window_entry
    from lightning_shardplus.gradients.ddp.side import DDPGradients

    put = DDPGradients.set_window_gradients

    module = nn.Linear(2, 1)
    # rank 1 had no gradient for the bias (unused there): it contributed zero
    per_rank = [{"weight": torch.full((1, 2), 1.0), "bias": torch.tensor([2.0])}, {"weight": torch.full((1, 2), 3.0)}]
    entry = window_entry(3, 4, per_rank)
    assert restore_window_gradients(module, entry, 3, 4, rank=1, world_size=2, set_gradients=put) is None
    assert torch.equal(module.weight.grad, per_rank[1]["weight"]) and module.bias.grad is None
    message = restore_window_gradients(module, entry, 3, 4, rank=0, world_size=3, set_gradients=put)
    assert "saved on 2 processes, on 3" in message and "mean" in message
    assert torch.equal(module.weight.grad, torch.full((1, 2), 2.0))
    assert torch.equal(module.bias.grad, torch.tensor([1.0]))
    module.zero_grad(set_to_none=True)
    message = restore_window_gradients(module, entry, 2, 4, rank=0, world_size=2, set_gradients=put)
    assert "window of 4 after micro-batch 3" in message and "not restored" in message and module.weight.grad is None
    other = window_entry(3, 4, [{"weight": torch.zeros(3, 2)}])
    message = restore_window_gradients(module, other, 3, 4, rank=0, world_size=1, set_gradients=put)
    assert "does not fit this model" in message
    assert module.weight.grad is None
