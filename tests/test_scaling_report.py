"""ScalingReport: where a training step's time goes (data, forward, backward, exposed communication,
optimizer), aggregated over ranks, and its verdict."""

import json
import logging
import time
import warnings

import pytest
import torch
from _models import cpu_trainer
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.profilers import SimpleProfiler
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

from lightning_shardplus import ShardPlusDataModule, ShardPlusStrategy
from lightning_shardplus._compat.lightning import TRAIN_DATALOADER_NEXT
from lightning_shardplus.demo import ClassifierModule
from lightning_shardplus.diagnostics import (
    STEP_PHASES,
    ScalingReport,
    format_scaling_report,
    scaling_report,
    scaling_verdict,
    summarize_scaling,
)
from lightning_shardplus.diagnostics.step_clock import HostClock, step_clock, supports_device_events


class SlowDataset(Dataset):
    """In-memory samples, each taking ``delay`` seconds to read: the slow-storage workload."""

    def __init__(self, length: int, dim: int, delay: float) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(length, dim, generator=generator)
        self.labels = torch.randint(0, 10, (length,), generator=generator)
        self.delay = delay

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        if self.delay:
            time.sleep(self.delay)  # the workload: reading from slow storage, not a synchronization
        return self.inputs[index], self.labels[index]


def fit_with_report(tmp_path, devices: int, delay: float, strategy_kwargs=None, batches=12, **report_kwargs) -> dict:
    """A short fit (``batches`` steps) of a small MLP on ``devices`` CPU processes; rank 0's report."""
    output = tmp_path / f"report-{devices}-{delay}.json"
    dim, batch = 256, 64 * devices
    datamodule = ShardPlusDataModule(global_batch_size=batch, train_dataset=SlowDataset(batch * batches, dim, delay))
    trainer = cpu_trainer(
        ShardPlusStrategy(start_method="fork", average_training_metrics=False, **(strategy_kwargs or {})),
        devices,
        max_epochs=1,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path / "logs", name=f"run{devices}-{delay}"),
        callbacks=[ScalingReport(output_file=output, **report_kwargs)],
    )
    trainer.fit(ClassifierModule(input_dim=dim, hidden_dims=[1024, 1024]), datamodule)
    return json.loads(output.read_text())


@pytest.mark.timeout(120)
def test_a_slow_dataset_is_reported_as_the_bottleneck(tmp_path):
    report = fit_with_report(tmp_path, devices=2, delay=0.002)  # 128 ms of reading per 64-sample batch
    assert report["world_size"] == 2 and report["micro_batches"] == 10  # 12 batches, the first 2 not counted
    assert report["fractions"]["data"] > 0.5
    assert report["verdict"].startswith("data loading takes") and "num_workers" in report["verdict"]
    assert report["ms_per_micro_batch"]["data"] > 100
    assert report["samples_per_second"] > 0
    logged = (next((tmp_path / "logs").rglob("metrics.csv"))).read_text()
    assert "scaling/data_fraction" in logged and "scaling/samples_per_second" in logged


@pytest.mark.timeout(120)
@pytest.mark.compat
def test_in_memory_data_is_not_the_bottleneck_and_communication_is_measured_on_two_ranks(tmp_path):
    with warnings.catch_warnings():  # the ranks (forked) inherit the filter: a deprecated collective fails the fit
        warnings.filterwarnings("error", message=r".*all_gather is deprecated")
        report = fit_with_report(tmp_path, devices=2, delay=0.0, single_device_samples_per_second=1000.0)
    assert report["fractions"]["data"] < 0.2
    assert "data loading" not in report["verdict"]
    assert report["ms_per_micro_batch"]["communication"] > 0
    assert all(rank["communication"] > 0 for rank in report["per_rank"])
    assert report["scaling_efficiency"] == pytest.approx(report["samples_per_second"] / 2000.0)
    assert report["verdict"].endswith(f"scaling efficiency {report['scaling_efficiency']:.0%}")
    assert sum(report["fractions"].values()) == pytest.approx(1.0)


@pytest.mark.timeout(120)
def test_under_stock_ddp_exposed_communication_is_measured_too(tmp_path):
    """The end of the backward computation is the autograd engine's, not a communication hook's: plain DDP (its
    built-in all-reduce) gets the phase as well."""
    output = tmp_path / "report.json"
    datamodule = ShardPlusDataModule(global_batch_size=16, train_dataset=SlowDataset(16 * 6, 8, 0.0))
    report = ScalingReport(output_file=output)
    trainer = cpu_trainer(DDPStrategy(start_method="fork"), 2, max_epochs=1, callbacks=[report])
    trainer.fit(ClassifierModule(input_dim=8, hidden_dims=[16]), datamodule)
    written = json.loads(output.read_text())
    assert written["world_size"] == 2 and written["micro_batches"] == 4
    assert written["ms_per_micro_batch"]["communication"] > 0
    assert all(rank["communication"] > 0 for rank in written["per_rank"])


@pytest.mark.timeout(120)
def test_communication_is_zero_with_one_rank(tmp_path):
    report = fit_with_report(tmp_path, devices=1, delay=0.0)
    assert report["world_size"] == 1 and report["micro_batches"] == 10
    assert report["ms_per_micro_batch"]["communication"] == 0
    assert report["ms_per_micro_batch"]["backward"] > 0 and report["ms_per_micro_batch"]["forward"] > 0


def test_verdict_names_the_larger_bottleneck_first_and_otherwise_the_computation():
    def totals(**seconds):
        return {**dict.fromkeys(STEP_PHASES, 0.0), **seconds, "samples": 100.0, "micro_batches": 10.0}

    both = summarize_scaling([totals(data=3.0, communication=4.0, forward=3.0)] * 2)
    assert both["verdict"].startswith("gradient communication not hidden behind backward takes 40%")
    assert "; data loading takes 30%" in both["verdict"]
    assert "gradient_compression ('fp16', 'powersgd'), aggregation_frequency > 1, or another" in both["verdict"]
    # the advice leaves out what the run already does
    busy = summarize_scaling(
        [totals(communication=4.0, forward=3.0)], micro_batches_per_step=4, gradient_compression="powersgd"
    )
    assert "try aggregation_frequency > 4, or another tensor_fusion_threshold_mb" in busy["verdict"]
    assert "'fp16'" not in busy["verdict"]
    fp16 = summarize_scaling([totals(communication=4.0, forward=3.0)], gradient_compression="fp16")
    assert "try gradient_compression='powersgd', aggregation_frequency > 1" in fp16["verdict"]
    assert both["samples_per_second"] == pytest.approx(200 / 10.0)
    compute = summarize_scaling([totals(data=0.1, forward=0.5, backward=0.3, optimizer=0.1)])
    assert scaling_verdict(compute) == "compute-bound: forward/backward/optimizer take 90% of each step"
    assert summarize_scaling([totals()] * 0 + [{**totals(), "micro_batches": 0.0}])["micro_batches"] == 0
    with pytest.raises(ValueError, match="threshold"):
        ScalingReport(threshold=1.5)
    with pytest.raises(ValueError, match="single_device_samples_per_second"):
        ScalingReport(single_device_samples_per_second=0)


@pytest.mark.timeout(60)
def test_in_one_process_the_verdict_is_printed_and_the_users_profiler_still_sees_everything(caplog):
    profiler = SimpleProfiler()
    report = ScalingReport()
    trainer = cpu_trainer("auto", 1, max_steps=8, profiler=profiler, callbacks=[report])
    loader = DataLoader(SlowDataset(128, 8, delay=0.002), batch_size=8)
    with caplog.at_level(logging.INFO):
        trainer.fit(ClassifierModule(input_dim=8, hidden_dims=[16]), loader)
    assert report.report["micro_batches"] == 6 and report.report["samples_per_second"] > 0
    assert report.report["fractions"]["data"] > 0.5 and report.report["ms_per_micro_batch"]["communication"] == 0
    assert "ScalingReport: data loading takes" in caplog.text and "samples/s" in caplog.text
    assert trainer.profiler is profiler  # handed back when training ended
    assert len(profiler.recorded_durations[TRAIN_DATALOADER_NEXT]) == 8
    assert len(profiler.recorded_durations["run_training_batch"]) == 8


@pytest.mark.timeout(120)
def test_the_steps_of_fusion_autotuning_are_not_counted(tmp_path):
    # three layouts (a bucket per parameter; one bucket; DDP's default: a 1 MB first bucket, then the rest), samples
    # of 1 untimed + 1 timed step (2 more untimed for the run's first): tuning takes at least one round (8 steps)
    # and at most its bound; it and the step after it are left out
    tuning = {
        "auto_tune_tensor_fusion": True,
        "autotune_candidates_mb": [0.001, 25.0],
        "autotune_first_bucket_candidates_mb": [],
        "autotune_steps_per_sample": 1,
        "autotune_warmup_steps": 1,
        "autotune_cache": False,
    }
    bound = ShardPlusStrategy(**tuning).config.autotune_settings.max_tuning_steps
    assert bound == 3 * 4 * 2 + 2
    report = fit_with_report(tmp_path, devices=2, delay=0.0, strategy_kwargs=tuning, batches=40)
    plain = fit_with_report(tmp_path / "plain", devices=2, delay=0.0, batches=40)
    assert plain["micro_batches"] == 38
    assert 40 - (bound + 1) - 1 <= report["micro_batches"] <= 40 - 8 - 1  # + 1: the batch tuning starts at


class CountingClock:
    """A stand-in for device timing events: each mark is one second after the one before on its own timeline
    (not the host's), and the "device" passes a mark only once ten more have been made (about two steps)."""

    name = "counting events"
    lag = 10

    def __init__(self) -> None:
        self.count = 0
        self.waited = 0
        self.read_during_training = 0
        self.training = True  # while True, reading a mark the device has not passed fails the test

    def mark(self) -> int:
        self.count += 1
        return self.count

    def ready(self, mark: int) -> bool:
        return self.count - mark >= self.lag

    def wait(self, mark: int) -> None:
        self.waited += 1
        self.training = False  # the report waits for the device when training has ended, to read the last marks

    def seconds(self, start: int, end: int) -> float:
        assert self.ready(start) and self.ready(end) or not self.training, "read a mark the device had not passed"
        self.read_during_training += self.training
        return float(end - start)


@pytest.mark.timeout(60)
def test_with_device_timing_the_phases_are_the_devices_and_are_read_once_it_has_passed_them(monkeypatch):
    clock = CountingClock()
    monkeypatch.setattr(scaling_report, "step_clock", lambda device, device_timing: clock)

    class EndOfTraining(ScalingReport):
        def on_train_end(self, trainer, pl_module):
            assert clock.waited == 0, "the report made the host wait for the device during training"
            super().on_train_end(trainer, pl_module)

    report = EndOfTraining(verbose=False)
    trainer = cpu_trainer("auto", 1, max_steps=10, callbacks=[report])
    trainer.fit(ClassifierModule(input_dim=8, hidden_dims=[16]), DataLoader(SlowDataset(128, 8, 0.0), batch_size=8))
    result = report.report
    assert result["timing"] == "counting events" and result["micro_batches"] == 8
    # marks per step, one "second" apart on the stand-in's clock: the previous end, next() start and stop, start,
    # before_backward, after_backward, end
    ms = result["ms_per_micro_batch"]
    assert ms["forward"] == ms["backward"] == ms["optimizer"] == 1000.0 and ms["communication"] == 0
    assert ms["data"] == 1000.0 and ms["between_steps"] == 2000.0  # the device's time across next(), of a 3 s gap
    assert clock.read_during_training > 0  # most steps were read during training, without waiting
    assert 1 <= clock.waited <= 2  # the last steps' marks, which the device had not passed when training ended
    assert "timed with" in format_scaling_report(result)


def test_the_clock_is_the_hosts_on_the_cpu_and_device_timing_true_needs_a_device_with_events():
    assert isinstance(step_clock(torch.device("cpu")), HostClock)
    assert isinstance(step_clock(torch.device("cpu"), device_timing=False), HostClock)
    with pytest.raises(ValueError, match=r"`device_timing`=True is not valid on device 'cpu'"):
        step_clock(torch.device("cpu"), device_timing=True)
    with pytest.raises(TypeError, match=r"`device_timing`='yes' is not valid: expected None, True or False"):
        ScalingReport(device_timing="yes")
    if not torch.cuda.is_available():
        assert not supports_device_events(torch.device("cuda"))
    assert not supports_device_events(torch.device("meta"))  # creates an event, fails to record it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(120)
def test_on_a_gpu_the_report_uses_cuda_events():
    report = ScalingReport(verbose=False)
    trainer = Trainer(
        accelerator="gpu", devices=1, max_steps=12, callbacks=[report], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    loader = DataLoader(SlowDataset(256, 256, 0.0), batch_size=32)
    trainer.fit(ClassifierModule(input_dim=256, hidden_dims=[2048, 2048]), loader)
    result = report.report
    assert result["timing"] == "cuda events" and result["micro_batches"] == 10
    assert result["ms_per_micro_batch"]["forward"] > 0 and result["ms_per_micro_batch"]["backward"] > 0
    assert result["ms_per_micro_batch"]["communication"] == 0
    assert sum(result["fractions"].values()) == pytest.approx(1.0)


@pytest.mark.timeout(120)
def test_with_device_timing_on_two_ranks_exposed_communication_is_read_from_the_devices_marks(tmp_path, monkeypatch):
    clock = CountingClock()  # forked into each rank
    monkeypatch.setattr(scaling_report, "step_clock", lambda device, device_timing: clock)
    report = fit_with_report(tmp_path, devices=2, delay=0.0)
    assert report["timing"] == "counting events" and report["micro_batches"] == 10
    for rank in report["per_rank"]:  # start, before_backward, last bucket, after_backward, end: 1 "second" apart
        assert rank["forward"] == rank["backward"] == rank["communication"] == rank["optimizer"] == 10.0
        assert rank["data"] == 10.0 and rank["between_steps"] == 20.0
