"""ScaleLearningRate: the rate of every optimizer step against the closed form, over world sizes, gradient
accumulation, rules, warmup and a user scheduler; resume from a mid-warmup checkpoint; argument checks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_shardplus import ShardPlusDataModule, ShardPlusStrategy
from lightning_shardplus.large_batch.scaling import ScaleLearningRate, scaling_factor, warmup_factor

BASE_LRS = (0.1, 0.02)  # two parameter groups: weight, bias
PER_DEVICE_BATCH = 2
NUM_SAMPLES = 40  # 20 batches on 1 rank, 10 on 2, 7 on 3 (padded): partial accumulation windows included
STEP_SIZE, GAMMA = 2, 0.5  # the user's StepLR, stepped every optimizer step


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(NUM_SAMPLES, 4, generator=generator), torch.randn(NUM_SAMPLES, 1, generator=generator)
    )


class RecordingSGD(torch.optim.Optimizer):
    """Plain SGD that records the rate of each parameter group at the moment it updates the parameters."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self.records: list[list[float]] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.records.append([float(group["lr"]) for group in self.param_groups])
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.sub_(param.grad * group["lr"])  # the rate may be a tensor
        return loss


class TinyModule(pl.LightningModule):
    def __init__(
        self, scheduler: str | None = None, batch_size: int | None = PER_DEVICE_BATCH, tensor_lr: bool = False
    ) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.scheduler = scheduler
        self.batch_size = batch_size
        self.tensor_lr = tensor_lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return F.mse_loss(self.layer(inputs), targets)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_dataset(), batch_size=self.batch_size)

    def configure_optimizers(self) -> Any:
        rates: list[Any] = [
            torch.tensor(lr, dtype=torch.float64) if self.tensor_lr else lr for lr in BASE_LRS
        ]
        optimizer = RecordingSGD(
            [{"params": [self.layer.weight]}, {"params": [self.layer.bias], "lr": rates[1]}], lr=rates[0]
        )
        if self.scheduler is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=STEP_SIZE, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class WriteRecords(Callback):
    """Each rank writes the rates its optimizer recorded (fork workers return nothing else to the test)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        record = {
            "records": optimizer.records,
            "final_lrs": [float(group["lr"]) for group in optimizer.param_groups],
            "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("lr-scaled")},
        }
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _fit(
    directory: Path,
    world_size: int,
    accumulation: int,
    scale: ScaleLearningRate,
    max_steps: int,
    module: pl.LightningModule | None = None,
    ckpt_path: str | None = None,
    extra_callbacks: list[Callback] | None = None,
    datamodule: pl.LightningDataModule | None = None,
) -> list[dict[str, Any]]:
    directory.mkdir(parents=True, exist_ok=True)
    strategy: Any = ShardPlusStrategy(start_method="fork") if world_size > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=max_steps,
        accumulate_grad_batches=accumulation,
        callbacks=[scale, WriteRecords(directory), *(extra_callbacks or [])],
        logger=False,
        enable_checkpointing=bool(extra_callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=directory,
    )
    trainer.fit(module or TinyModule(), datamodule=datamodule, ckpt_path=ckpt_path)
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _expected(
    steps: range,
    rule: str,
    batch_ratio: float,
    warmup_steps: int,
    scheduler: str | None,
) -> list[list[float]]:
    """The closed form, written out independently of the callback's helpers."""
    full = {"linear": batch_ratio, "sqrt": math.sqrt(batch_ratio), "none": 1.0}[rule]
    rates = []
    for step in steps:
        factor = 1.0 + (full - 1.0) * step / warmup_steps if step < warmup_steps else full
        schedule = GAMMA ** (step // STEP_SIZE) if scheduler else 1.0
        rates.append([base * schedule * factor for base in BASE_LRS])
    return rates


def _assert_rates(got: list[list[float]], want: list[list[float]]) -> None:
    assert len(got) == len(want)
    for step, (got_rates, want_rates) in enumerate(zip(got, want, strict=True)):
        assert got_rates == pytest.approx(want_rates, rel=1e-12), f"optimizer step {step}"


def _check(results: list[dict[str, Any]], expected: list[list[float]], scheduler: str | None) -> None:
    for result in results:
        _assert_rates(result["records"], expected)
        # The optimizer is left with the user's (scheduler's) rates, unscaled.
        schedule = GAMMA ** (len(expected) // STEP_SIZE) if scheduler else 1.0
        assert result["final_lrs"] == pytest.approx([base * schedule for base in BASE_LRS], rel=1e-12)
        # The applied rate of the last step is what was logged.
        assert result["logged"] == pytest.approx(
            {"lr-scaled/group0": expected[-1][0], "lr-scaled/group1": expected[-1][1]}, rel=1e-6
        )


MAX_STEPS = 6


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("rule", ["linear", "sqrt"])
@pytest.mark.parametrize("warmup_steps", [None, 3])
@pytest.mark.parametrize("scheduler", [None, "steplr"])
def test_rate_of_every_step_matches_closed_form(
    tmp_path: Path,
    world_size: int,
    accumulation: int,
    rule: str,
    warmup_steps: int | None,
    scheduler: str | None,
) -> None:
    """Default reference (the per-device batch): the ratio is world_size * accumulation."""
    scale = ScaleLearningRate(rule=rule, warmup_steps=warmup_steps)
    results = _fit(tmp_path, world_size, accumulation, scale, MAX_STEPS, module=TinyModule(scheduler))
    ratio = world_size * accumulation
    _check(results, _expected(range(MAX_STEPS), rule, ratio, warmup_steps or 0, scheduler), scheduler)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize(("rule", "reference"), [("linear", 4), ("sqrt", 1)])
def test_explicit_reference_batch_size(
    tmp_path: Path, world_size: int, accumulation: int, rule: str, reference: int
) -> None:
    scale = ScaleLearningRate(rule=rule, reference_batch_size=reference, warmup_steps=3)
    results = _fit(tmp_path, world_size, accumulation, scale, MAX_STEPS, module=TinyModule("steplr"))
    ratio = PER_DEVICE_BATCH * world_size * accumulation / reference
    _check(results, _expected(range(MAX_STEPS), rule, ratio, 3, "steplr"), "steplr")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("world_size", "accumulation", "warmup_epochs"), [(1, 4, 0.5), (2, 4, 1.5), (3, 1, 1)]
)
def test_warmup_epochs_are_converted_to_optimizer_steps(
    tmp_path: Path, world_size: int, accumulation: int, warmup_epochs: float
) -> None:
    batches_per_rank = math.ceil(math.ceil(NUM_SAMPLES / world_size) / PER_DEVICE_BATCH)
    steps_per_epoch = math.ceil(batches_per_rank / accumulation)  # Lightning also steps on a partial window
    warmup_steps = math.floor(warmup_epochs * steps_per_epoch + 0.5)
    assert 0 < warmup_steps < 8
    scale = ScaleLearningRate(warmup_epochs=warmup_epochs)
    results = _fit(tmp_path, world_size, accumulation, scale, 8, module=TinyModule("steplr"))
    ratio = world_size * accumulation
    _check(results, _expected(range(8), "linear", ratio, warmup_steps, "steplr"), "steplr")


@pytest.mark.timeout(60)
@pytest.mark.compat
def test_per_device_batch_comes_from_the_datamodule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    warnings = tmp_path / "warnings.txt"

    def record_warning(message: str, *args: Any, **kwargs: Any) -> None:  # in the forked ranks: to a file
        with open(warnings, "a") as f:
            f.write(message + "\n")

    monkeypatch.setattr("lightning_shardplus.data.training_metrics.callback.rank_zero_warn", record_warning)
    # global batch 8 on 2 processes: 4 per device (the datamodule's loader replaces the module's)
    datamodule = ShardPlusDataModule(global_batch_size=8, train_dataset=_dataset(), shuffle=False)
    scale = ScaleLearningRate(rule="sqrt", reference_batch_size=2, warmup_steps=2)
    results = _fit(tmp_path, 2, 1, scale, 4, datamodule=datamodule)
    _check(results, _expected(range(4), "sqrt", 4 * 2 / 2, 2, None), None)
    # the rate is logged in on_train_batch_end, the same on every rank: averaged metrics leave it alone, silently
    assert "lr-scaled" not in (warnings.read_text() if warnings.exists() else "")


@pytest.mark.timeout(60)
def test_rule_none_leaves_the_rates_alone(tmp_path: Path) -> None:
    results = _fit(
        tmp_path, 1, 2, ScaleLearningRate(rule="none", warmup_steps=2), 4, module=TinyModule("steplr")
    )
    _check(results, _expected(range(4), "none", 2.0, 2, "steplr"), "steplr")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_mid_warmup_continues_the_curve(tmp_path: Path, world_size: int) -> None:
    total, saved_at, warmup = 10, 3, 6

    def scale() -> ScaleLearningRate:
        return ScaleLearningRate(rule="linear", reference_batch_size=1, warmup_steps=warmup)

    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=saved_at, save_top_k=-1
    )
    full = _fit(
        tmp_path / "full", world_size, 2, scale(), total, TinyModule("steplr"), extra_callbacks=[checkpoints]
    )
    ratio = PER_DEVICE_BATCH * world_size * 2 / 1
    expected = _expected(range(total), "linear", ratio, warmup, "steplr")
    _check(full, expected, "steplr")

    path = tmp_path / "ckpt" / f"step={saved_at}.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    # Only the callback's step count is stored; the optimizer holds the scheduler's rate, never a scaled one.
    state = next(v for k, v in checkpoint["callbacks"].items() if k.startswith("ScaleLearningRate"))
    assert state["steps"] == [saved_at]
    schedule = GAMMA ** (saved_at // STEP_SIZE)
    rates = [group["lr"] for group in checkpoint["optimizer_states"][0]["param_groups"]]
    assert rates == pytest.approx([base * schedule for base in BASE_LRS], rel=1e-12)

    resumed = _fit(
        tmp_path / "resumed", world_size, 2, scale(), total, TinyModule("steplr"), ckpt_path=str(path)
    )
    for result in resumed:
        _assert_rates(result["records"], expected[saved_at:])
    assert [r["records"] for r in resumed] == [r["records"][saved_at:] for r in full]


@pytest.mark.timeout(60)
def test_tensor_learning_rates_are_scaled_in_place_and_restored(tmp_path: Path) -> None:
    module = TinyModule("steplr", tensor_lr=True)
    results = _fit(tmp_path, 1, 2, ScaleLearningRate(warmup_steps=3), 5, module=module)
    _check(results, _expected(range(5), "linear", 2.0, 3, "steplr"), "steplr")


@pytest.mark.timeout(60)
def test_optimizer_subclass_calling_super_step_is_scaled_once(tmp_path: Path) -> None:
    class SubSGD(torch.optim.SGD):
        def __init__(self, params: Any, lr: float) -> None:
            super().__init__(params, lr=lr)
            self.records: list[list[float]] = []

        def step(self, closure: Any = None) -> Any:
            self.records.append([group["lr"] for group in self.param_groups])
            return super().step(closure)

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # makes SGD.step run the hooks too

    class Module(TinyModule):
        def configure_optimizers(self) -> Any:
            return SubSGD(
                [{"params": [self.layer.weight]}, {"params": [self.layer.bias], "lr": BASE_LRS[1]}],
                lr=BASE_LRS[0],
            )

    _fit(tmp_path, 1, 2, ScaleLearningRate(warmup_steps=2), 4, module=Module())
    # WriteRecords reads `records` from the optimizer, which SubSGD also has.
    result = json.loads((tmp_path / "rank0.json").read_text())
    _check([result], _expected(range(4), "linear", 2.0, 2, None), None)


def test_pure_helpers() -> None:
    assert scaling_factor("linear", 8) == 8.0
    assert scaling_factor("sqrt", 16) == 4.0
    assert scaling_factor("none", 16) == 1.0
    assert [warmup_factor(5.0, step, 4) for step in range(6)] == [1.0, 2.0, 3.0, 4.0, 5.0, 5.0]
    assert warmup_factor(5.0, 0, 0) == 5.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"rule": "cubic"},
            ValueError,
            r"`rule`='cubic' is not valid: expected one of 'linear', 'sqrt', 'none'",
        ),
        ({"warmup_steps": -1}, ValueError, r"`warmup_steps`=-1 is not valid: expected an integer >= 0"),
        ({"warmup_steps": 2.5}, TypeError, r"`warmup_steps`=2.5 is not valid: expected an integer >= 0"),
        (
            {"warmup_epochs": -0.5},
            ValueError,
            r"`warmup_epochs`=-0.5 is not valid: expected a finite number >= 0",
        ),
        ({"warmup_epochs": float("nan")}, ValueError, r"`warmup_epochs`=nan is not valid"),
        ({"warmup_epochs": "1"}, TypeError, r"`warmup_epochs`='1' is not valid"),
        (
            {"warmup_steps": 10, "warmup_epochs": 1.0},
            ValueError,
            r"`warmup_steps`=10 and `warmup_epochs`=1.0 were",
        ),
        (
            {"reference_batch_size": 0},
            ValueError,
            r"`reference_batch_size`=0 is not valid: expected an integer >= 1",
        ),
        ({"reference_batch_size": 32.0}, TypeError, r"`reference_batch_size`=32.0 is not valid"),
        ({"log_lr": "yes"}, TypeError, r"`log_lr`='yes' is not valid: expected True or False"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ScaleLearningRate(**kwargs)


class _Stream(IterableDataset):
    def __iter__(self) -> Any:
        yield from _dataset()


class _StreamModule(TinyModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Stream(), batch_size=PER_DEVICE_BATCH)


class _UnbatchedModule(TinyModule):
    """A loader without a batch size (it yields single samples)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_dataset(), batch_size=None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("module_class", "kwargs", "match"),
    [
        (_UnbatchedModule, {"reference_batch_size": 4}, r"cannot find the per-device batch size"),
        (_StreamModule, {"warmup_epochs": 1.0}, r"`warmup_epochs`=1.0 needs the number of training batches"),
    ],
)
def test_errors_found_when_training_starts(
    tmp_path: Path, module_class: type[TinyModule], kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _fit(tmp_path, 1, 1, ScaleLearningRate(**kwargs), 2, module=module_class())


def test_aggregation_counts_the_strategy_frequency_or_accumulation_once() -> None:
    from types import SimpleNamespace

    from lightning_shardplus.data.aggregation import micro_batches_per_step

    # ShardPlusStrategy sets accumulate_grad_batches to its aggregation_frequency: one count, not a product (the
    # strategy sets it in its setup, before any callback's on_fit_start: test_effective_batch_is_the_strategy_figure...)
    trainer: Any = SimpleNamespace(
        strategy=SimpleNamespace(aggregation_frequency=3), accumulate_grad_batches=3
    )
    assert micro_batches_per_step(trainer) == 3
    trainer.strategy = SimpleNamespace()  # a strategy without the attribute
    trainer.accumulate_grad_batches = 2
    assert micro_batches_per_step(trainer) == 2


@pytest.mark.timeout(120)
def test_effective_batch_is_the_strategy_figure_with_aggregation(tmp_path: Path) -> None:
    scale = ScaleLearningRate(rule="linear")
    records = _fit_aggregated(tmp_path, scale)
    assert records["callback"] == records["strategy"] == 4 * 2 * 3
    assert records["at_fit_start"] == 3  # the strategy's count, already when the first callback hook of a fit runs


def _fit_aggregated(directory: Path, scale: ScaleLearningRate) -> dict[str, Any]:
    from lightning_shardplus.data.aggregation import micro_batches_per_step

    class Report(Callback):
        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.at_fit_start = micro_batches_per_step(trainer)

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.is_global_zero:
                strategy_figure = trainer.strategy.effective_batch_size
                figures = {"callback": scale.effective_batch_size, "strategy": strategy_figure}
                figures["at_fit_start"] = self.at_fit_start
                (directory / "figures.json").write_text(json.dumps(figures))

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardPlusStrategy(start_method="fork", aggregation_frequency=3),
        max_steps=2,
        callbacks=[scale, Report()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyModule(), datamodule=ShardPlusDataModule(8, train_dataset=_dataset()))
    return json.loads((directory / "figures.json").read_text())


def test_large_batch_config_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from lightning_shardplus.cli import ShardPlusCLI
    from lightning_shardplus.large_batch.lars import LARS

    pytest.importorskip("sklearn")
    config = Path(__file__).resolve().parents[1] / "configs" / "large_batch.yaml"
    monkeypatch.setattr(sys, "argv", ["shardplus"])
    cli = ShardPlusCLI(args=["--config", str(config), "--trainer.logger=false"], run=False)
    scale = [cb for cb in cli.trainer.callbacks if isinstance(cb, ScaleLearningRate)]
    assert len(scale) == 1
    assert (scale[0].rule, scale[0].reference_batch_size, scale[0].warmup_epochs) == ("linear", 64, 5)
    assert cli.datamodule.global_batch_size == 512 and cli.trainer.num_devices == 2
    optimizers, schedulers = cli.model.configure_optimizers()
    assert isinstance(optimizers[0], LARS) and optimizers[0].defaults["trust_coefficient"] == 0.02
    assert isinstance(schedulers[0], torch.optim.lr_scheduler.CosineAnnealingLR)
