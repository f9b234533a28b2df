"""Tensor-fusion autotuning: the decision rule and the race in one process (fake clock and timings), then
tuning on 2 ranks: it finishes within its step bound, logs and caches, keeps the ranks' weights in sync through
every re-wrap, keeps the communication hook, trains the same weights as without tuning, and a second run starts
from the cache (one DDP wrapper for every step)."""

import csv
import json
import logging
import math
import os
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _models import cpu_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_compression import MLP, PARAMETERS, counts, flat, loader
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from lightning_shardplus import ShardPlusStrategy
from lightning_shardplus._compat import lightning as _lightning
from lightning_shardplus.diagnostics import CommunicationCounter
from lightning_shardplus.gradients.ddp import fusion, fusion_cache
from lightning_shardplus.gradients.ddp.fusion import ROUNDS, AutotuneSettings, BucketSetting, TensorFusion, decide

# ---------------------------------------------------------------------------------------------- one process

A, B, C, UNIFORM_25 = (BucketSetting(size) for size in (1.0, 4.0, 16.0, 25.0))
DDP_DEFAULT = fusion.DDP_DEFAULT  # 25 MB buckets, the first one 1 MB
REFERENCE = DDP_DEFAULT
MODEL = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))  # 4 tensors with gradients, 136 bytes
GRADIENT_BYTES = 4 * (16 + 4 + 8 + 2)


def rounds_of(times, loads=None, jitter=None):
    """``times[s]`` per round, times the round's load (``loads[r]``) and the setting's own ``jitter[s][r]``."""
    loads = loads or [1.0] * ROUNDS
    return {s: [t * load * (jitter or {}).get(s, [1.0] * len(loads))[r] for r, load in enumerate(loads)]
            for s, t in times.items()}  # fmt: skip


def test_the_decision_rule_keeps_the_reference_unless_a_candidate_is_faster_by_the_medians_and_paired():
    # the rule, over synthetic timings of fixed rounds: the lowest median replaces the reference only if faster than
    # it by more than the tolerance (2%) both by the medians and by the median of the per-round ratios
    assert decide(rounds_of({B: 1.0, C: 1.03, REFERENCE: 1.2}), REFERENCE, 0.02) == (B, pytest.approx(1.2))
    assert decide(rounds_of({B: 1.0, REFERENCE: 1.019}), REFERENCE, 0.02) == (REFERENCE, 1.0)  # within tolerance
    assert decide(rounds_of({B: 1.0, REFERENCE: 1.021}), REFERENCE, 0.02)[0] == B
    assert decide(rounds_of({B: 1.0, REFERENCE: 1.005}), REFERENCE, 0.02)[0] == REFERENCE  # within noise
    assert decide(rounds_of({B: 1.0, REFERENCE: 1.1}), REFERENCE, 0.02)[0] == B
    # a load change between rounds (another job took the CPU) cancels in the paired comparison
    winner, gain = decide(rounds_of({B: 1.0, C: 1.03, REFERENCE: 1.2}, loads=[1.0, 1.5, 1.0, 1.5]), REFERENCE, 0.02)
    assert winner == B and gain == pytest.approx(1.2)
    # one burst of contention in one of B's samples does not decide the race: B is 10% faster
    burst = {B: [1.0, 1.8, 1.0, 1.01], REFERENCE: [1.1, 1.1, 1.11, 1.1]}
    assert decide(burst, REFERENCE, 0.02)[0] == B


def test_a_candidate_faster_paired_but_slower_by_the_medians_does_not_replace_the_default():
    # A is 10% faster in 3 of 5 rounds but far slower in two rounds where the default was fast: by the medians it
    # is the slower one. Nothing is concluded: the default stays.
    jitter = {A: [0.9, 4.5, 4.5, 10.0, 10.0], REFERENCE: [1.0, 5.0, 5.0, 0.1, 0.1]}
    times = rounds_of({A: 1.0, REFERENCE: 1.0}, loads=[1.0] * 5, jitter=jitter)
    assert decide(times, REFERENCE, 0.02)[0] == REFERENCE
    # the same paired gain with medians that agree: A replaces the default
    agreeing = {A: [0.9, 4.5, 4.5, 0.2, 0.2], REFERENCE: [1.0, 5.0, 5.0, 0.1, 0.1]}
    assert decide(rounds_of({A: 1.0, REFERENCE: 1.0}, loads=[1.0] * 5, jitter=agreeing), REFERENCE, 0.02)[0] == A
    # faster by the medians but not paired (its fast samples fell in rounds where the default was fast too): kept
    unpaired = {A: [0.5, 0.5, 2.0, 2.0], REFERENCE: [0.4, 0.4, 2.1, 2.1]}
    assert decide(unpaired, REFERENCE, 0.02)[0] == REFERENCE


class FakeClock:
    """Advances by the step time of the setting the strategy would have applied."""

    def __init__(self, times):
        self.times, self.now, self.setting = times, 0.0, None

    def __call__(self):
        return self.now

    def step(self):
        self.now += self.times[self.setting]


def trainer(**kwargs):
    """What TensorFusion reads of the Trainer: its step counter, accumulation, length, rank and loggers."""
    defaults = dict(global_step=0, accumulate_grad_batches=1, estimated_stepping_batches=math.inf, is_global_zero=True,
                    num_nodes=1, datamodule=SimpleNamespace(per_device_batch_size=8))  # fmt: skip
    return SimpleNamespace(**(defaults | {"loggers": []} | kwargs))


def tuner(settings, clock=None, log=None, cache=False, checkpointed=None, model=MODEL, world_size=1, **trainer_kwargs):
    """A tuning TensorFusion set up for ``model`` (DDP wrapped with its initial setting)."""
    clock = clock or FakeClock({})
    tensor_fusion = TensorFusion(trainer(**trainer_kwargs), settings, tune=True, log_path=log, cache=cache, clock=clock)
    if checkpointed is not None:
        tensor_fusion.load_state_dict(checkpointed)
    tensor_fusion.first = tensor_fusion.initial_setting(model, world_size, torch.device("cpu"), "gloo")
    return tensor_fusion


def drive(tensor_fusion, clock, max_steps=500):
    """What the strategy does: a batch start per optimizer step, the returned setting applied. Returns the step at
    which tuning finished and the settings applied (re-wraps)."""
    clock.setting = tensor_fusion.first
    tensor_fusion.on_train_start()
    rewraps = []
    for step in range(max_steps):
        if not tensor_fusion.tuning:
            return step, rewraps
        tensor_fusion.trainer.global_step = step
        if (setting := tensor_fusion.at_batch_start(step + 1)) is not None:  # not an epoch's first batch
            rewraps.append(setting)
            clock.setting = setting
        clock.step()
    raise AssertionError("tuning did not finish")


def test_every_round_measures_every_candidate_once_in_alternating_order(tmp_path):
    times = {A: 0.9, B: 0.5, UNIFORM_25: 0.7, DDP_DEFAULT: 0.68}
    settings = AutotuneSettings(candidates_mb=(25, 1, 4), steps_per_sample=2, warmup_steps=1)
    clock = FakeClock(times)
    tensor_fusion = tuner(settings, clock, log=tmp_path / "log.csv")
    assert tensor_fusion.first == A  # candidates are sorted, the reference last
    step, rewraps = drive(tensor_fusion, clock)
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    order = [BucketSetting(float(r["bucket_cap_mb"]), float(r["first_bucket_mb"]) if r["first_bucket_mb"] else None)
             for r in rows]  # fmt: skip
    forward = [A, B, UNIFORM_25, DDP_DEFAULT]
    assert order == (forward + forward[::-1]) * (ROUNDS // 2)  # no candidate dropped, no round skipped
    assert [int(r["round"]) for r in rows] == [r for r in range(ROUNDS) for _ in forward]
    # a re-wrap at every change of setting, none between a round's last sample and the next round's first
    assert len(rewraps) == len(order) - ROUNDS + 1 and tensor_fusion.result.setting == B == rewraps[-1]
    assert step <= settings.max_tuning_steps and tensor_fusion.result.tuning_steps == step - 1


@pytest.mark.compat
@pytest.mark.skipif(not fusion.SUPPORTS_FIRST_BUCKET, reason="DDP without bucket_cap_mb_list (torch < 2.13)")
def test_a_search_that_keeps_ddps_default_says_so_without_comparing_it_with_itself(caplog):
    clock = FakeClock({A: 0.9, B: 0.8, UNIFORM_25: 0.7, DDP_DEFAULT: 0.7})
    tensor_fusion = tuner(AutotuneSettings(candidates_mb=(25, 1, 4), steps_per_sample=2, warmup_steps=1), clock)
    with caplog.at_level(logging.INFO):
        drive(tensor_fusion, clock)
    result = tensor_fusion.result
    assert result.setting == DDP_DEFAULT and result.complete
    assert result.summary().startswith(
        "shardplus: tensor fusion tuned: kept DDP's default (25 MB, first bucket 1 MB): 700.00 ms/step (median), no "
        "candidate more than 2% faster;"
    ) and "+0.0%" not in result.summary()
    among = next(m for m in caplog.messages if "tuning the tensor-fusion bucket size among" in m)
    assert among.count("25 MB") == 2 and "DDP's default (25 MB, first bucket 1 MB)" in among  # each labelled once


def test_the_autotuner_finds_the_fastest_logs_each_sample_and_caches(tmp_path):
    times = {A: 0.9, B: 0.5, UNIFORM_25: 0.7, DDP_DEFAULT: 0.68}
    settings = AutotuneSettings(candidates_mb=(25, 1, 4), steps_per_sample=3, warmup_steps=1)
    clock = FakeClock(times)
    cache = tmp_path / "cache.json"
    tensor_fusion = tuner(settings, clock, log=tmp_path / "log.csv", cache=cache)
    step, rewraps = drive(tensor_fusion, clock)
    result = tensor_fusion.result
    assert result.setting == B == rewraps[-1]
    assert result.step_s == pytest.approx(0.5) and result.default_step_s == pytest.approx(0.68)
    assert result.gain == pytest.approx(0.68 / 0.5) and result.complete  # against DDP's default, paired
    assert step <= settings.max_tuning_steps and result.tuning_steps == step - 1  # steps that ended
    assert (
        "bucket 4 MB: 500.00 ms/step (median) vs 680.00 ms/step at DDP's default (25 MB, first bucket 1 MB), +36.0% "
        "steps/s while tuning (paired round by round)"
    ) in result.summary()
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert len(rows) == tensor_fusion.samples_taken == 4 * ROUNDS and rows[0]["bucket_cap_mb"] == "1"
    assert {row["stage"] for row in rows} == {"bucket"} and rows[0]["timed_steps"] == "3"
    assert float(rows[0]["step_ms"]) == pytest.approx(900)
    assert float(rows[0]["gradient_bytes_per_s"]) == round(GRADIENT_BYTES / 0.9)
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["bucket_cap_mb"] == 4.0 and entry["first_bucket_mb"] is None

    again = tuner(settings, clock, log=tmp_path / "log2.csv", cache=cache)
    assert not again.tuning and again.result.from_cache and again.first == B
    assert drive(again, clock) == (0, [])
    assert "from the autotune cache" in again.result.summary()
    (row,) = csv.DictReader(open(tmp_path / "log2.csv"))  # the log says why nothing was raced
    assert row["stage"] == "none" and row["note"] == "no search: bucket 4 MB from the autotune cache"
    other = tuner(settings, clock, cache=cache, world_size=2)  # another key
    assert other.tuning


def test_a_result_cached_for_another_batch_size_node_count_or_device_model_is_not_reused(tmp_path, monkeypatch):
    # the cache (under the home directory by default) may be shared by runs of other layouts on a cluster
    settings = AutotuneSettings(candidates_mb=(1,), steps_per_sample=2)
    clock, cache = FakeClock({A: 0.5, DDP_DEFAULT: 0.7}), tmp_path / "cache.json"
    drive(tuner(settings, clock, cache=cache), clock)  # 8 samples per device, 1 node: tuned and cached
    assert not tuner(settings, cache=cache).tuning  # the same layout: from the cache
    assert tuner(settings, cache=cache, datamodule=SimpleNamespace(per_device_batch_size=16)).tuning
    assert tuner(settings, cache=cache, num_nodes=2).tuning
    monkeypatch.setattr(fusion, "device_model", lambda device: "another CPU")
    assert tuner(settings, cache=cache).tuning


def test_a_fixed_bucket_size_is_not_searched():
    settings = AutotuneSettings(fixed_bucket_cap_mb=8.0, first_bucket_candidates_mb=(1.0, 16.0))
    assert settings.reference == BucketSetting(8.0)
    assert settings.candidates == [BucketSetting(8.0, 1.0), BucketSetting(8.0)]  # first buckets below 8 MB only
    clock = FakeClock({BucketSetting(8.0): 1.0, BucketSetting(8.0, 1.0): 2.0})
    tensor_fusion = tuner(settings, clock)
    _, rewraps = drive(tensor_fusion, clock)
    assert tensor_fusion.result.setting == BucketSetting(8.0) and all(s.bucket_cap_mb == 8.0 for s in rewraps)
    nothing = tuner(AutotuneSettings(fixed_bucket_cap_mb=8.0, first_bucket_candidates_mb=()))
    assert not nothing.tuning and nothing.first == BucketSetting(8.0)
    assert nothing.result.summary() == (
        "shardplus: tensor fusion: bucket 8 MB from `tensor_fusion_threshold_mb` (no first bucket to race) (no search)"
    )


def test_a_model_with_one_gradient_tensor_races_nothing():
    one = tuner(AutotuneSettings(candidates_mb=(1, 4)), model=torch.nn.Linear(4, 4, bias=False))
    assert not one.tuning and one.first == DDP_DEFAULT and one.result.tuning_steps == 0
    assert one.result.summary() == (
        "shardplus: tensor fusion: DDP's default (25 MB, first bucket 1 MB) from the candidates, which all give this "
        "model the same buckets (it has one parameter tensor) (no search)"
    )


def test_steps_that_span_an_interruption_are_not_timed():
    clock = FakeClock({A: 1.0, BucketSetting(2.0): 1.0, DDP_DEFAULT: 1.0})
    tensor_fusion = tuner(AutotuneSettings(candidates_mb=(1, 2), steps_per_sample=2, warmup_steps=1), clock)
    clock.setting = tensor_fusion.first
    tensor_fusion.on_train_start()
    tensor_fusion.at_batch_start(1)
    clock.now += 100  # a validation
    tensor_fusion.interrupt()
    # 1: nothing ended that can be timed; 2-4: the warm-up (1, and 2 more in the run's first sample); 5: timed
    for step in range(1, 6):
        tensor_fusion.at_batch_start(step + 1)
        clock.step()
    tensor_fusion.at_batch_start(0)  # an epoch's first batch: the step that ended spans the epoch end
    clock.step()
    assert tensor_fusion.sample_intervals == [1.0]  # the warm-up, then one counted step
    # inside an aggregation window nothing is timed and DDP is never re-wrapped
    tensor_fusion.trainer.accumulate_grad_batches = 3
    assert [tensor_fusion.at_batch_start(i) for i in (1, 2, 4, 5)] == [None] * 4
    assert tensor_fusion.sample_intervals == [1.0]


def test_cache_key_follows_the_parameter_layout_and_the_setup():
    params = [torch.zeros(3, 4, requires_grad=True), torch.zeros(4, requires_grad=True)]
    key = fusion_cache.cache_key(params, 2, "cpu", "gloo", {"hook": None})
    same = [torch.ones(3, 4, requires_grad=True), torch.ones(4, requires_grad=True)]
    assert key == fusion_cache.cache_key(same, 2, "cpu", "gloo", {"hook": None})
    assert key == fusion_cache.cache_key([*params, torch.zeros(5)], 2, "cpu", "gloo", {"hook": None})  # no gradient
    assert key != fusion_cache.cache_key(params[::-1], 2, "cpu", "gloo", {"hook": None})
    assert key != fusion_cache.cache_key(params, 4, "cpu", "gloo", {"hook": None})
    assert key != fusion_cache.cache_key(params, 2, "cuda", "nccl", {"hook": None})
    assert key != fusion_cache.cache_key([p.double() for p in params], 2, "cpu", "gloo", {"hook": None})
    assert key != fusion_cache.cache_key(params, 2, "cpu", "gloo", {"hook": "fp16"})


def test_first_bucket_tuning_follows_what_ddp_takes():
    assert fusion.SUPPORTS_FIRST_BUCKET  # torch 2.13's DDP takes bucket_cap_mb_list
    assert BucketSetting(4.0, 1.0).ddp_kwargs() == {"bucket_cap_mb": 4.0, "bucket_cap_mb_list": [1.0, 4.0]}
    assert BucketSetting(4.0).ddp_kwargs() == {"bucket_cap_mb": 4.0, "bucket_cap_mb_list": None}
    # DDP's default is given as no size at all: what DDP builds then, on any torch
    assert DDP_DEFAULT == BucketSetting(25.0, 1.0) and DDP_DEFAULT.ddp_kwargs() == dict.fromkeys(
        ("bucket_cap_mb", "bucket_cap_mb_list")
    )


def test_first_buckets_are_raced_with_the_references_size_in_the_same_race():
    # DDP's default is 25 MB with a 1 MB first bucket: the default first-bucket candidate is DDP's default itself
    assert AutotuneSettings(candidates_mb=(1, 4, 25)).candidates == [A, B, UNIFORM_25, DDP_DEFAULT]
    other = AutotuneSettings(candidates_mb=(1, 4, 25), first_bucket_candidates_mb=(0.5, 1.0))
    assert other.candidates == [A, B, UNIFORM_25, BucketSetting(25.0, 0.5), DDP_DEFAULT]
    assert AutotuneSettings(candidates_mb=(1,), first_bucket_candidates_mb=()).candidates == [A, DDP_DEFAULT]


def test_the_step_bound_counts_every_candidate_in_every_round():
    sample = 1 + 8
    assert AutotuneSettings(candidates_mb=(0.0002, 0.001)).max_tuning_steps == 3 * ROUNDS * sample + 2
    other = AutotuneSettings(candidates_mb=(1, 4), first_bucket_candidates_mb=(0.5, 2))
    assert other.max_tuning_steps == 5 * ROUNDS * sample + 2
    assert AutotuneSettings(fixed_bucket_cap_mb=8.0).max_tuning_steps == 2 * ROUNDS * sample + 2
    # the default candidates are the model's: the bound before the model is known holds for any model
    bound = AutotuneSettings().max_tuning_steps
    for sizes in ([10], [10, 10], [2_621_440, 2_621_440, 262_144], [256 * 256, 256] * 24, [1 << 26, 1 << 24]):
        parameters = [torch.empty(n, device="meta", requires_grad=True) for n in sizes]
        assert AutotuneSettings().for_model(parameters).max_tuning_steps <= bound


def test_the_default_candidates_cut_the_gradients_into_2_to_16_buckets_and_25_mb():
    parameters = list(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(24)]).parameters())  # 6 MB
    assert fusion.default_candidates_mb(parameters) == (0.38, 0.75, 1.5, 3.0, 25.0)
    assert fusion.default_candidates_mb([torch.zeros(3)]) == (25.0,)  # no gradients


def test_a_cached_or_checkpointed_ddp_default_gives_ddp_no_bucket_size(tmp_path):
    cache = tmp_path / "cache.json"
    clock = FakeClock({A: 0.9, B: 0.9, DDP_DEFAULT: 0.5})
    drive(tuner(AutotuneSettings(candidates_mb=(1, 4)), clock, cache=cache), clock)  # DDP's default wins, cached
    cached = tuner(AutotuneSettings(candidates_mb=(1, 4)), cache=cache)
    assert not cached.tuning and cached.first == DDP_DEFAULT
    strategy = ShardPlusStrategy(auto_tune_tensor_fusion=True)
    _lightning.set_ddp_kwargs(strategy, BucketSetting(4.0, 1.0).ddp_kwargs())  # as the strategy's re-wrap does
    assert _lightning.ddp_kwargs(strategy)["bucket_cap_mb_list"] == [1.0, 4.0]
    _lightning.set_ddp_kwargs(strategy, cached.first.ddp_kwargs())
    assert "bucket_cap_mb" not in _lightning.ddp_kwargs(strategy)
    assert "bucket_cap_mb_list" not in _lightning.ddp_kwargs(strategy)
    assert cached.first.bucket_cap_mb == 25.0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"auto_tune_tensor_fusion": 1}, TypeError, r"`auto_tune_tensor_fusion`=1 is not valid: expected True"),
        ({"autotune_candidates_mb": []}, ValueError, r"`autotune_candidates_mb`=\[\].*at least 1 bucket size"),
        ({"autotune_candidates_mb": [4, -1]}, ValueError, r"`autotune_candidates_mb`=\[4, -1\].*> 0"),
        ({"autotune_candidates_mb": "25"}, ValueError, r"`autotune_candidates_mb`='25'"),
        ({"autotune_first_bucket_candidates_mb": [0]}, ValueError, r"`autotune_first_bucket_candidates_mb`=\[0\]"),
        ({"autotune_candidates_mb": [1, 1e30]}, ValueError, r"`autotune_candidates_mb`=\[1, 1e\+30\].*< 8796093022208"),
        ({"autotune_first_bucket_candidates_mb": [2.0**43]}, ValueError, r"`autotune_first_bucket_candidates_mb`="),
        ({"autotune_steps_per_sample": 0}, ValueError, r"`autotune_steps_per_sample`=0.*>= 1"),
        ({"autotune_warmup_steps": 0}, ValueError, r"`autotune_warmup_steps`=0.*>= 1"),
        ({"autotune_cache": 3}, TypeError, r"`autotune_cache`=3.*True, False or a file path"),
        ({"autotune_log": 3}, TypeError, r"`autotune_log`=3.*a file path or None"),
        (
            {"auto_tune_tensor_fusion": True, "bucket_cap_mb_list": [1, 4]},
            ValueError,
            r"`bucket_cap_mb_list`=\[1, 4\] and `auto_tune_tensor_fusion`=True both set",
        ),
        (
            {"tensor_fusion_threshold_mb": 8, "bucket_cap_mb_list": [1, 25]},
            ValueError,
            r"`bucket_cap_mb_list`=\[1, 25\] and `tensor_fusion_threshold_mb`=8 both set DDP's bucket sizes",
        ),
        (
            {"autotune_candidates_mb": ["4"]},
            ValueError,
            r"`autotune_candidates_mb`=\['4'\] is not valid: expected a list of at least 1 bucket size",
        ),
        (
            {"autotune_first_bucket_candidates_mb": "1"},
            ValueError,
            r"`autotune_first_bucket_candidates_mb`='1' is not valid: expected a list of bucket sizes in MB \(or none",
        ),
        (
            {
                "auto_tune_tensor_fusion": True,
                "ddp_comm_hook": powerSGD_hook.powerSGD_hook,
                "ddp_comm_state": powerSGD_hook.PowerSGDState(process_group=None),
            },
            ValueError,
            r"`ddp_comm_state`=.*with `auto_tune_tensor_fusion`=True.*gradient_compression='powersgd'",
        ),
    ],
)
def test_bad_autotune_arguments_raise_before_any_process_group(kwargs, error, message):
    with pytest.raises(error, match=message):
        ShardPlusStrategy(**kwargs)
    assert not dist.is_initialized()


@pytest.mark.parametrize("argument", ["autotune_cache", "autotune_log"])
@pytest.mark.parametrize("where", ["a-directory", "a-directory-name", "under-a-file"])
def test_an_autotune_file_that_cannot_be_written_is_refused_at_construction(tmp_path, argument, where):
    (tmp_path / "notes.txt").write_text("not a directory")
    path = {
        "a-directory": str(tmp_path),
        "a-directory-name": str(tmp_path / "new") + os.sep,
        "under-a-file": str(tmp_path / "notes.txt" / "fusion.json"),
    }[where]
    with pytest.raises(ValueError, match=rf"`{argument}`={re.escape(repr(path))} .*file"):
        ShardPlusStrategy(auto_tune_tensor_fusion=True, **{argument: path})
    assert not dist.is_initialized()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
@pytest.mark.parametrize("argument", ["autotune_cache", "autotune_log"])
def test_an_autotune_file_in_a_read_only_directory_is_refused_at_construction(tmp_path, argument):
    (tmp_path / "ro").mkdir(mode=0o500)
    path = str(tmp_path / "ro" / "sub" / "fusion.json")
    with pytest.raises(ValueError, match=rf"`{argument}`={re.escape(repr(path))} .*write"):
        ShardPlusStrategy(auto_tune_tensor_fusion=True, **{argument: path})


def test_the_default_cache_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fusion_cache.default_cache_path() == tmp_path / "xdg" / "lightning_shardplus" / "fusion.json"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in ("", "relative/cache"):  # the XDG spec ignores an empty or relative value
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert fusion_cache.default_cache_path() == tmp_path / "home" / ".cache" / "lightning_shardplus" / "fusion.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert fusion_cache.default_cache_path() == tmp_path / "home" / ".cache" / "lightning_shardplus" / "fusion.json"


def test_the_default_cache_is_checked_only_when_tuning(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "lightning_shardplus" / "fusion.json").mkdir(parents=True)  # a directory
    ShardPlusStrategy()  # not tuning: the default cache is not used
    default = str(tmp_path / "lightning_shardplus" / "fusion.json")
    with pytest.raises(ValueError, match=r"`autotune_cache`=True \(" + re.escape(default) + r"\) .*False"):
        ShardPlusStrategy(auto_tune_tensor_fusion=True)


def test_missing_directories_of_the_autotune_files_are_created(tmp_path):
    cache, log = tmp_path / "a" / "cache.json", tmp_path / "b" / "c" / "log.csv"
    ShardPlusStrategy(auto_tune_tensor_fusion=True, autotune_cache=str(cache), autotune_log=str(log))
    clock = FakeClock({A: 0.5, DDP_DEFAULT: 0.7})
    drive(tuner(AutotuneSettings(candidates_mb=(1,), steps_per_sample=2), clock, log=log, cache=cache), clock)
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["bucket_cap_mb"] == 1.0 and log.read_text().startswith("sample,")


def test_autotune_files_that_cannot_be_written_while_tuning_are_a_warning_not_a_crash(tmp_path):
    cache, log = tmp_path / "cache.json", tmp_path / "log.csv"
    clock = FakeClock({A: 0.5, DDP_DEFAULT: 0.7})
    tensor_fusion = tuner(AutotuneSettings(candidates_mb=(1,), steps_per_sample=2), clock, log=log, cache=cache)
    cache.mkdir()  # became directories after the strategy checked them
    log.mkdir()
    with pytest.warns(UserWarning) as warned:
        drive(tensor_fusion, clock)
    messages = [str(w.message) for w in warned]
    assert any(re.search(r"could not write the autotune log .*log.csv.*logging stops", m) for m in messages)
    assert any(re.search(r"the autotune cache .*cache.json could not be written", m) for m in messages)
    assert tensor_fusion.result.complete and tensor_fusion.result.setting == A
    assert sorted(tmp_path.iterdir()) == sorted([cache, log])  # no temporary file left behind


@pytest.mark.parametrize(
    "entry",
    [
        {"bucket_cap_mb": "abc"},
        {"bucket_cap_mb": None},
        {"bucket_cap_mb": float("nan")},
        {"bucket_cap_mb": -5},
        {"bucket_cap_mb": 1e30},
        {"bucket_cap_mb": True},
        {"bucket_cap_mb": 4.0, "first_bucket_mb": "1"},
        {"bucket_cap_mb": 4.0, "first_bucket_mb": 0},
    ],
    ids=["text", "null", "nan", "negative", "too-large", "bool", "first-text", "first-zero"],
)
@pytest.mark.parametrize("source", ["cache", "checkpoint"])
def test_a_cached_setting_that_does_not_validate_is_ignored_with_one_warning_and_searched_again(
    tmp_path, entry, source
):
    cache = tmp_path / "cache.json"
    clock = FakeClock({A: 0.5, DDP_DEFAULT: 0.7})
    settings = AutotuneSettings(candidates_mb=(1,), steps_per_sample=2)
    first = tuner(settings, clock, cache=cache)
    drive(first, clock)  # a search, cached (and checkpointed) under this setup's key
    (key,) = json.loads(cache.read_text())
    edited = {"cache_key": key, **entry}  # edited by hand
    checkpointed = edited if source == "checkpoint" else None
    cache.write_text(json.dumps({"other": {"bucket_cap_mb": 8.0}} | ({key: entry} if source == "cache" else {})))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        again = tuner(settings, clock, cache=cache, checkpointed=checkpointed)
    messages = [str(w.message) for w in warned if "not valid" in str(w.message)]
    assert len(messages) == 1 and "searched again" in messages[0], messages
    assert ("checkpoint" in messages[0]) == (source == "checkpoint")
    assert again.tuning and again.first == A
    drive(again, clock)
    entries = json.loads(cache.read_text())
    assert entries[key]["bucket_cap_mb"] == 1.0 and entries["other"] == {"bucket_cap_mb": 8.0}


@pytest.mark.parametrize(
    "content",
    [
        "name: my settings\n",
        '["a", "list"]',
        '{"name": "my config"}',
        '{"key": {"bucket_cap_mb": 4}, "x": 1}',
        "\x00\xff",
    ],
    ids=["yaml", "json-list", "json-object", "json-mixed", "binary"],
)
def test_an_existing_file_that_is_not_an_autotune_cache_is_refused_and_never_overwritten(tmp_path, content):
    path = tmp_path / "settings.json"
    path.write_bytes(content.encode("latin-1"))
    message = rf"`autotune_cache`={re.escape(repr(str(path)))} is not an autotune cache .*not overwritten"
    with pytest.raises(ValueError, match=message):
        ShardPlusStrategy(autotune_cache=str(path))
    # a file that becomes something else after the check is not overwritten either
    clock = FakeClock({A: 0.5, DDP_DEFAULT: 0.7})
    tensor_fusion = tuner(AutotuneSettings(candidates_mb=(1,), steps_per_sample=2), clock, cache=path)
    with pytest.warns(UserWarning, match=r"is not an autotune cache .*not overwritten"):
        drive(tensor_fusion, clock)
    assert path.read_bytes() == content.encode("latin-1") and tensor_fusion.result.complete


def test_an_empty_file_or_a_cache_is_taken_as_the_autotune_cache(tmp_path):
    empty, cache = tmp_path / "empty.json", tmp_path / "cache.json"
    empty.touch()
    fusion_cache.store_cached(cache, "key", {"bucket_cap_mb": 4.0, "first_bucket_mb": None})
    for path in (empty, cache):
        ShardPlusStrategy(auto_tune_tensor_fusion=True, autotune_cache=str(path))
    fusion_cache.store_cached(empty, "key", {"bucket_cap_mb": 4.0, "first_bucket_mb": None})
    assert json.loads(empty.read_text()) == json.loads(cache.read_text())


def test_the_largest_bucket_size_accepted_is_the_largest_ddp_takes(tmp_path):
    from torch.nn.parallel import DistributedDataParallel

    largest = math.nextafter(fusion.MAX_BUCKET_CAP_MB, 0)
    assert ShardPlusStrategy(tensor_fusion_threshold_mb=largest).config.tensor_fusion_threshold_mb == largest
    assert ShardPlusStrategy(autotune_candidates_mb=[largest]).config.autotune_settings.candidates_mb == (largest,)
    with pytest.raises(ValueError, match=r"`tensor_fusion_threshold_mb`=8796093022208.0"):
        ShardPlusStrategy(tensor_fusion_threshold_mb=fusion.MAX_BUCKET_CAP_MB)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        for kwargs in ({"bucket_cap_mb": largest}, {"bucket_cap_mb": largest, "bucket_cap_mb_list": [1.0, largest]}):
            ddp = DistributedDataParallel(model, **kwargs)
            for _ in range(2):  # DDP rebuilds its buckets at the second step
                ddp(torch.ones(2, 4)).sum().backward()
        with pytest.raises(TypeError):  # DDP's reducer takes the size in bytes as a 64-bit integer
            DistributedDataParallel(model, bucket_cap_mb=fusion.MAX_BUCKET_CAP_MB)
    finally:
        dist.destroy_process_group()


def test_the_default_buckets_are_ddps_own_unless_a_size_is_given(tmp_path):
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    default = ShardPlusStrategy()
    assert "bucket_cap_mb" not in _lightning.ddp_kwargs(default)
    assert default.config.autotune_settings.reference == DDP_DEFAULT
    assert DDP_DEFAULT.bucket_cap_mb == 25.0
    assert _lightning.ddp_kwargs(DDPStrategy()).get("bucket_cap_mb") is None
    strategy = ShardPlusStrategy(auto_tune_tensor_fusion=True, tensor_fusion_threshold_mb=8)
    settings = strategy.config.autotune_settings
    assert settings.fixed_bucket_cap_mb == 8.0 and strategy.config.tensor_fusion_threshold_mb == 8.0
    assert settings.reference == BucketSetting(8.0)

    # the buckets DDP builds (after its rebuild in backward order) under each setting's ddp_kwargs
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(24)])  # 24 layers of 0.25 MB + 1 kB

    def rebuilt_buckets(ddp_kwargs):
        ddp = DistributedDataParallel(model, **ddp_kwargs)
        for _ in range(3):  # DDP rebuilds its buckets at the second step
            ddp(torch.ones(2, 256)).sum().backward()
        return ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"].split(", ")

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plain_ddp = rebuilt_buckets({})
        assert len(plain_ddp) == 2  # a 1 MB first bucket, then the rest
        assert rebuilt_buckets(_lightning.ddp_kwargs(default) | DDP_DEFAULT.ddp_kwargs()) == plain_ddp
        # one bucket; 4 layers (>= 1 MB) per bucket; a first bucket of 4 layers, then 16 (>= 4 MB), then the rest
        for setting, buckets in ((UNIFORM_25, 1), (A, 6), (BucketSetting(4.0, 1.0), 3)):
            kwargs = {k: v for k, v in setting.ddp_kwargs().items() if v is not None}
            assert len(rebuilt_buckets(kwargs)) == buckets, setting
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- 2 ranks

# the MLP's gradients are 3.2 kB: sizes in MB that cut them into 4, 2 and 1 bucket(s); and a first bucket of
# 0.0002 MB with 25 MB for the others, raced in the same rounds as these and DDP's default
CANDIDATES = [0.00002, 0.001, 25.0]
TUNING = dict(
    auto_tune_tensor_fusion=True,
    autotune_candidates_mb=CANDIDATES,
    autotune_first_bucket_candidates_mb=[0.0002],
    autotune_steps_per_sample=2,
    autotune_warmup_steps=1,
)


class RecordSteps(Callback):
    """Per rank and optimizer step: a checksum of the weights, the DDP wrapper and its bucket size, written to
    ``rank{r}.json`` at the end; rank 0 adds the tuning result."""

    def __init__(self, out_dir):
        self.out_dir = Path(out_dir)
        self.steps = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # called before the strategy's hook: the weights as they are going into the re-wrap, if any
        weights = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        self.steps.append({"step": trainer.global_step, "weights": weights.tolist()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ddp = trainer.strategy.model
        self.steps[-1] |= {"wrapper": id(ddp), "caps": wrapper_caps(ddp)}

    def on_train_end(self, trainer, pl_module):
        result = trainer.strategy.fusion_result
        summary = None if result is None else result.__dict__ | {"setting": result.setting.__dict__}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        data = {
            "steps": self.steps,
            "result": summary,
            "max_tuning_steps": trainer.strategy.config.autotune_settings.max_tuning_steps,
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(data))


def wrapper_caps(ddp):
    """What a DDP wrapper was built with: its bucket cap, per-bucket caps, and whether it took DDP's own default
    (a smaller first bucket) because no size was given."""
    return [ddp.bucket_bytes_cap, list(ddp.bucket_bytes_cap_list), ddp.bucket_bytes_cap_default]


def caps_of(setting):
    """:func:`wrapper_caps` of a wrapper built with ``setting`` (a FusionResult's setting, as a dict)."""
    setting = BucketSetting(setting["bucket_cap_mb"], setting["first_bucket_mb"])
    cap = int(setting.bucket_cap_mb * 2**20)
    if setting == DDP_DEFAULT:
        return [cap, [], True]
    return [cap, [] if setting.first_bucket_mb is None else [int(setting.first_bucket_mb * 2**20), cap], False]


def tuned_fit(
    tmp_path, name, callbacks=(), epochs=8, size=96, trainer_kwargs=None, ckpt_path=None, model=None, **kwargs
):
    recorder = RecordSteps(tmp_path / f"steps-{name}")
    trainer = cpu_trainer(
        ShardPlusStrategy(start_method="fork", **kwargs),
        2,
        max_epochs=epochs,
        callbacks=[recorder, *callbacks],
        **(trainer_kwargs or {}),
    )
    trainer.fit((model or MLP)(tmp_path / name), loader(size=size), ckpt_path=ckpt_path)
    runs = [json.loads((tmp_path / f"steps-{name}" / f"rank{r}.json").read_text()) for r in range(2)]
    weights = [torch.load(tmp_path / name / f"rank{r}.pt", weights_only=False)["weights"] for r in range(2)]
    return runs, weights


def logged_setting(row):
    """The setting of one row of the autotune CSV log."""
    return BucketSetting(float(row["bucket_cap_mb"]), float(row["first_bucket_mb"]) if row["first_bucket_mb"] else None)


def wrappers(run):
    return len({step["wrapper"] for step in run["steps"]})


@pytest.mark.timeout(120)
def test_tuning_on_two_ranks_finishes_logs_caches_and_a_second_run_starts_from_the_cache(tmp_path):
    cache, log = tmp_path / "fusion.json", tmp_path / "samples.csv"
    plain_runs, plain = tuned_fit(tmp_path, "plain")  # 8 epochs of 12 steps: more than tuning's bound
    runs, tuned = tuned_fit(tmp_path, "tuned", autotune_cache=str(cache), autotune_log=str(log), **TUNING)
    result = runs[0]["result"]
    # finished within its bound, on a candidate, and went on training with it
    assert result["complete"] and not result["from_cache"]
    assert 0 < result["tuning_steps"] <= runs[0]["max_tuning_steps"] < len(runs[0]["steps"])
    winner = result["setting"]["bucket_cap_mb"]
    assert winner in CANDIDATES
    assert wrappers(runs[0]) > 2  # re-wrapped while tuning
    for run in runs:
        after = [step for step in run["steps"] if step["step"] > result["tuning_steps"]]
        assert after and all(step["caps"] == caps_of(result["setting"]) for step in after)
        assert len({step["wrapper"] for step in after}) == 1
    # the ranks' weights agree at every step, before and after each re-wrap; as without tuning
    for first, second in zip(runs[0]["steps"], runs[1]["steps"], strict=True):
        assert first["step"] == second["step"] and first["weights"] == second["weights"]
    assert len(runs[0]["steps"]) == len(plain_runs[0]["steps"])
    assert torch.allclose(flat(tuned[0]), flat(plain[0]), atol=1e-6, rtol=0)
    assert torch.equal(flat(tuned[0]), flat(tuned[1]))
    rows = list(csv.DictReader(open(log)))
    assert len(rows) >= len(CANDIDATES) and {float(row["bucket_cap_mb"]) for row in rows} == set(CANDIDATES)
    assert all(row["timed_steps"] == "2" for row in rows)
    # each row's rate is the model's gradient bytes over its step time; the result's times are the logged ones
    gradient_bytes = 4 * PARAMETERS
    for row in rows:
        assert float(row["gradient_bytes_per_s"]) == pytest.approx(gradient_bytes / float(row["step_ms"]) * 1000, 1e-3)

    def logged_ms(setting):
        return [float(r["step_ms"]) for r in rows if logged_setting(r) == setting]

    chosen, rounding = logged_ms(BucketSetting(**result["setting"])), 0.0005  # the log rounds to 3 decimals
    assert min(chosen) - rounding <= 1000 * result["step_s"] <= max(chosen) + rounding
    default = logged_ms(DDP_DEFAULT)
    assert min(default) - rounding <= 1000 * result["default_step_s"] <= max(default) + rounding
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["bucket_cap_mb"] == winner

    again, _ = tuned_fit(tmp_path, "again", autotune_cache=str(cache), autotune_log=str(tmp_path / "2.csv"), **TUNING)
    assert again[0]["result"]["from_cache"] and again[0]["result"]["tuning_steps"] == 0
    for run in again:
        assert wrappers(run) == 1 and all(step["caps"] == caps_of(result["setting"]) for step in run["steps"])
    (row,) = csv.DictReader(open(tmp_path / "2.csv"))  # the log says why nothing was raced
    assert row["stage"] == "none" and logged_setting(row) == BucketSetting(**result["setting"])
    assert row["note"].startswith("no search: ") and row["note"].endswith("from the autotune cache")


# the default candidates race: no given sizes, no first bucket to race
DEFAULT_TUNING = dict(
    auto_tune_tensor_fusion=True,
    autotune_first_bucket_candidates_mb=[],
    autotune_steps_per_sample=2,
    autotune_warmup_steps=1,
)


@pytest.mark.timeout(180)
def test_the_default_candidates_follow_the_gradient_size_and_other_candidates_cached_results_are_not_reused(
    tmp_path,
):
    cache, log = tmp_path / "fusion.json", tmp_path / "default.csv"
    given, _ = tuned_fit(tmp_path, "given", autotune_cache=str(cache), **TUNING)  # raced among given sizes, cached
    assert given[0]["result"]["complete"] and not given[0]["result"]["from_cache"]
    runs, _ = tuned_fit(tmp_path, "default", autotune_cache=str(cache), autotune_log=str(log), **DEFAULT_TUNING)
    result = runs[0]["result"]  # strategy.fusion_result
    # searched (the cached result of other candidates is not this search's), and went on with the winner
    assert result["complete"] and not result["from_cache"] and result["tuning_steps"] > 0
    assert wrappers(runs[0]) > 2
    rows = list(csv.DictReader(open(log)))
    assert rows and {row["stage"] for row in rows} == {"bucket"} and not any(row["note"] for row in rows)
    # 3.2 kB of gradients: the sizes raced beside DDP's default cut them into 2 to 16 buckets of about equal
    # bytes, or are DDP's uniform 25 MB
    gradient_mb = 4 * PARAMETERS / 2**20
    uniform = {logged_setting(row) for row in rows} - {DDP_DEFAULT}
    assert len(uniform) == 5 and DDP_DEFAULT in {logged_setting(row) for row in rows} and UNIFORM_25 in uniform
    for setting in uniform - {UNIFORM_25}:
        buckets = gradient_mb / setting.bucket_cap_mb
        assert setting.first_bucket_mb is None and any(abs(buckets / k - 1) < 0.05 for k in (2, 4, 8, 16))
    assert len(json.loads(cache.read_text())) == 2  # each search under its own key


class OneTensorMLP(MLP):
    """The MLP with one parameter tensor that gets gradients (the others frozen)."""

    def __init__(self, out_dir, lr=0.1) -> None:
        super().__init__(out_dir, lr)
        for name, parameter in self.named_parameters():
            parameter.requires_grad_(name == "net.0.weight")


@pytest.mark.timeout(120)
def test_a_model_with_one_parameter_tensor_races_nothing_and_the_log_says_why(tmp_path):
    log = tmp_path / "one.csv"
    runs, _ = tuned_fit(
        tmp_path, "one", model=OneTensorMLP, epochs=2, autotune_cache=False, autotune_log=str(log), **DEFAULT_TUNING
    )
    result = runs[0]["result"]
    assert result["from_cache"] and result["tuning_steps"] == 0 and wrappers(runs[0]) == 1
    (row,) = csv.DictReader(open(log))
    assert row["stage"] == "none" and logged_setting(row) == DDP_DEFAULT
    assert row["note"] == (
        "no search: DDP's default (25 MB, first bucket 1 MB) from the candidates, which all give this model the same "
        "buckets (it has one parameter tensor)"
    )


@pytest.mark.timeout(120)
def test_a_run_resumed_from_a_checkpoint_goes_on_with_its_tuned_bucket_size(tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True, save_top_k=0)
    enable = {"enable_checkpointing": True}
    first, _ = tuned_fit(
        tmp_path, "first", callbacks=[checkpoints], trainer_kwargs=enable, autotune_cache=False, **TUNING
    )
    winner = first[0]["result"]["setting"]
    assert first[0]["result"]["complete"] and not first[0]["result"]["from_cache"]
    # no cache: only the checkpoint knows the tuned size
    resumed, _ = tuned_fit(
        tmp_path, "resumed", epochs=10, ckpt_path=tmp_path / "checkpoints" / "last.ckpt", autotune_cache=False, **TUNING
    )
    result = resumed[0]["result"]
    assert result["from_cache"] and result["source"] == "the checkpoint resumed" and result["tuning_steps"] == 0
    for run in resumed:
        assert run["steps"] and wrappers(run) == 1  # no search, no re-wrap
        assert all(step["caps"] == caps_of(winner) for step in run["steps"])


@pytest.mark.timeout(120)
def test_the_communication_hook_runs_through_tuning_and_after_it(tmp_path):
    counter = CommunicationCounter(tmp_path / "counts")
    logger = CSVLogger(tmp_path / "logs", name="", version="")
    runs, weights = tuned_fit(
        tmp_path,
        "fp16",
        callbacks=[counter],
        trainer_kwargs={"logger": logger, "log_every_n_steps": 1},
        gradient_compression="fp16",
        autotune_cache=False,
        **TUNING,
    )
    logged = list(csv.DictReader(open(tmp_path / "logs" / "metrics.csv")))
    (row,) = [row for row in logged if row.get("fusion/bucket_cap_mb")]  # the result, once, to the logger
    assert float(row["fusion/bucket_cap_mb"]) == runs[0]["result"]["setting"]["bucket_cap_mb"]
    assert float(row["fusion/step_ms"]) == pytest.approx(1000 * runs[0]["result"]["step_s"])
    assert float(row["fusion/default_step_ms"]) == pytest.approx(1000 * runs[0]["result"]["default_step_s"])
    steps = counts(tmp_path / "counts")["steps"]
    assert len(steps) == len(runs[0]["steps"]) and runs[0]["result"]["tuning_steps"] < len(steps)
    assert wrappers(runs[0]) > 2
    assert all(step["bytes"] == 2 * PARAMETERS for step in steps)  # fp16 on every wrapper, the last included
    assert torch.equal(flat(weights[0]), flat(weights[1]))


@pytest.mark.timeout(120)
def test_a_fixed_bucket_size_is_kept_while_the_first_bucket_is_tuned_and_cached_under_xdg_cache_home(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default cache (autotune_cache=True)
    runs, _ = tuned_fit(tmp_path, "fixed", epochs=3, tensor_fusion_threshold_mb=25.0, **TUNING)
    assert all(step["caps"][0] == 25 * 2**20 for run in runs for step in run["steps"])  # the size is kept
    assert runs[0]["result"]["complete"] and runs[0]["result"]["setting"]["bucket_cap_mb"] == 25.0
    raced = {json.dumps(step["caps"]) for step in runs[0]["steps"]}
    assert raced == {json.dumps(caps_of({"bucket_cap_mb": 25.0, "first_bucket_mb": f})) for f in (None, 0.0002)}
    (entry,) = json.loads((tmp_path / "xdg" / "lightning_shardplus" / "fusion.json").read_text()).values()
    assert entry["bucket_cap_mb"] == 25.0
    assert entry["first_bucket_mb"] == runs[0]["result"]["setting"]["first_bucket_mb"]


@pytest.mark.timeout(120)
def test_tuning_with_aggregation_rewraps_only_between_optimizer_steps(tmp_path):
    rewraps = tmp_path / "rewraps"

    class RewrapAt(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            rewraps.mkdir(exist_ok=True)
            with open(rewraps / f"rank{trainer.global_rank}", "a") as f:
                f.write(f"{batch_idx} {id(trainer.strategy.model)}\n")

    runs, weights = tuned_fit(
        tmp_path, "agg", callbacks=[RewrapAt()], size=3 * 96, aggregation_frequency=3, autotune_cache=False, **TUNING
    )
    lines = [line.split() for line in (rewraps / "rank0").read_text().splitlines()]
    changed = [int(lines[i][0]) for i in range(1, len(lines)) if lines[i][1] != lines[i - 1][1]]
    assert changed and all(batch_idx % 3 == 0 for batch_idx in changed)  # a new wrapper only at a window start
    assert runs[0]["result"]["complete"]
    assert torch.equal(flat(weights[0]), flat(weights[1]))
    assert math.isfinite(flat(weights[0]).sum())


def test_a_run_that_ends_while_tuning_reports_the_best_so_far_and_caches_nothing(tmp_path):
    clock = FakeClock({A: 0.9, B: 0.5, UNIFORM_25: 0.7, DDP_DEFAULT: 0.7})
    settings = AutotuneSettings(candidates_mb=(1, 4, 25), steps_per_sample=2, warmup_steps=1)
    tensor_fusion = tuner(settings, clock, cache=tmp_path / "cache.json")
    clock.setting = tensor_fusion.first
    tensor_fusion.on_train_start()
    for step in range(16):  # the first round only
        if (setting := tensor_fusion.at_batch_start(step + 1)) is not None:
            clock.setting = setting
        clock.step()
    assert tensor_fusion.tuning and tensor_fusion.samples_taken == 4
    tensor_fusion.on_train_end()
    result = tensor_fusion.result
    assert result.setting == B and not result.complete and not tensor_fusion.tuning
    assert "best so far, not cached" in result.summary() and not (tmp_path / "cache.json").exists()
    assert tensor_fusion.state_dict() is None  # nor checkpointed: a resumed run searches again


def test_a_run_that_ends_before_the_default_was_measured_keeps_the_default():
    clock = FakeClock({A: 0.5, B: 0.6, UNIFORM_25: 0.7, DDP_DEFAULT: 0.7})
    tensor_fusion = tuner(AutotuneSettings(candidates_mb=(1, 4, 25), steps_per_sample=2), clock)
    clock.setting = tensor_fusion.first
    tensor_fusion.on_train_start()
    for step in range(9):  # 1 MB and 4 MB measured, DDP's default not yet
        if (setting := tensor_fusion.at_batch_start(step + 1)) is not None:
            clock.setting = setting
        clock.step()
    assert tensor_fusion.samples_taken == 2
    tensor_fusion.on_train_end()
    result = tensor_fusion.result
    assert result.setting == DDP_DEFAULT and not result.complete  # not measured is not slower
    assert result.default_step_s is None and "not measured" in result.summary()


class MarkRank(Callback):
    """Gives the module a frozen parameter holding the rank after DDP wrapped it; records it when training ends."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        pl_module.rank_mark = torch.nn.Parameter(torch.tensor([float(trainer.global_rank)]), requires_grad=False)

    def on_train_end(self, trainer, pl_module):
        (self.out / f"mark{trainer.global_rank}").write_text(str(float(pl_module.rank_mark)))


@pytest.mark.timeout(120)
def test_re_wraps_while_tuning_broadcast_nothing_from_rank_zero(tmp_path):
    # the parameters are identical at every step boundary: a re-wrap need not broadcast the model again; a
    # frozen parameter that differs per rank shows whether anything was broadcast
    runs, _ = tuned_fit(tmp_path, "marked", callbacks=[MarkRank(tmp_path)], autotune_cache=False, **TUNING)
    assert wrappers(runs[0]) > 2  # re-wrapped while tuning
    assert [float((tmp_path / f"mark{r}").read_text()) for r in range(2)] == [0.0, 1.0]
