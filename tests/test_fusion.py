"""Tensor-fusion autotuning: the candidate race and the autotuner in one process (fake clock and timings), then
tuning on 2 ranks: it finishes within its step bound, logs and caches, keeps the ranks' weights in sync through
every re-wrap, keeps the communication hook, trains the same weights as without tuning, and a second run starts
from the cache without re-wrapping."""

import csv
import functools
import json
import math
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _models import cpu_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_compression import MLP, PARAMETERS, counts, flat, loader
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from lightning_shardplus import ShardPlusStrategy, _lightning, fusion
from lightning_shardplus.fusion import (
    AutotuneSettings,
    BucketSetting,
    CandidateRace,
    FusionAutotuner,
)
from lightning_shardplus.instrumentation import CommunicationCounter

# ---------------------------------------------------------------------------------------------- one process

A, B, C, PREFERRED = (BucketSetting(size) for size in (1.0, 4.0, 16.0, 25.0))
UNIFORM_25, DDP_DEFAULT = PREFERRED, fusion.DDP_DEFAULT  # 25 MB buckets; DDP's default: the first one 1 MB


def race_with(times, rounds=(2, 4), noise_floor=0.01, preferred=PREFERRED, jitter=None):
    """Run a race where setting ``s`` measures ``times[s]`` times ``jitter[k]`` on its k-th sample (``jitter``: a
    list for all settings, the same load in a round; or a list per setting)."""
    race = CandidateRace(list(times), *rounds, noise_floor, preferred=preferred)
    seen = {s: 0 for s in times}
    order = []
    while (setting := race.next_setting()) is not None:
        factors = (jitter.get(setting, [1.0]) if isinstance(jitter, dict) else jitter) or [1.0]
        factor = factors[seen[setting] % len(factors)]
        race.record(setting, times[setting] * factor)
        seen[setting] += 1
        order.append(setting)
    return race, order


def test_the_race_interleaves_drops_the_slow_and_stops_once_one_is_left():
    race, order = race_with({A: 1.3, B: 1.0, C: 1.005, PREFERRED: 1.2}, jitter=[1.0, 1.004])
    assert order[:8] == [A, B, C, PREFERRED, PREFERRED, C, B, A]  # every round visits all, alternating order
    assert race.winner == B
    assert set(race.live) == {B, C} and race.round == 2  # the slow two dropped; B and C within noise: stop
    assert len(order) == 8


def test_a_candidate_faster_paired_but_slower_by_the_medians_does_not_replace_the_default():
    # A is 10% faster in 3 of 5 rounds (no spread there: the noise estimate is ~0) but far slower in two rounds
    # where the default was fast: by the medians it is the slower one. Nothing is concluded: the default stays.
    jitter = {A: [0.9, 4.5, 4.5, 10.0, 10.0], PREFERRED: [1.0, 5.0, 5.0, 0.1, 0.1]}
    race, _ = race_with({A: 1.0, PREFERRED: 1.0}, rounds=(5, 5), noise_floor=0.0, jitter=jitter)
    assert race.ratio(A, PREFERRED) == pytest.approx(0.9) and race.median(A) > race.median(PREFERRED)
    assert set(race.live) == {A, PREFERRED} and race.winner == PREFERRED
    # the same paired gain with medians that agree: A replaces the default
    agreeing = {A: [0.9, 4.5, 4.5, 0.2, 0.2], PREFERRED: [1.0, 5.0, 5.0, 0.1, 0.1]}
    race, _ = race_with({A: 1.0, PREFERRED: 1.0}, rounds=(5, 5), noise_floor=0.0, jitter=agreeing)
    assert race.winner == A


def test_the_race_remeasures_finalists_and_is_bounded_by_max_rounds():
    # B and C 3% apart with 4% noise of their own: neither dropped nor within tolerance after round 2
    jitter = {B: [1.0, 1.04, 1.0], C: [1.04, 1.0, 1.0]}
    race, order = race_with({A: 2.0, B: 1.0, C: 1.03}, rounds=(2, 5), jitter=jitter)
    assert race.winner == B and race.round <= 5
    assert order.count(A) == 2 and order.count(B) > 2
    # 10% apart, paired ratios 1.1 x (1 +- 0.12): kept, not close; the third round is the last
    jitter = {A: [1.0, 1.12, 1.0], B: [1.12, 1.0, 1.0]}
    race, order = race_with({A: 1.0, B: 1.1}, rounds=(2, 3), noise_floor=0.0, jitter=jitter)
    assert race.round == 3 and len(order) == 6 and race.winner == A


def test_after_one_round_only_the_clearly_slower_are_dropped():
    race = CandidateRace([A, B, C], 2, 4, 0.01, first_round_margin=0.3)
    for setting, seconds in ((A, 1.4), (B, 1.0), (C, 1.25)):
        assert race.next_setting() == setting
        race.record(setting, seconds)
    assert race.next_setting() == C and race.live == [B, C]  # A is 40% slower; C, 25%, gets a second sample


def test_one_burst_of_contention_does_not_decide_the_race():
    # B is 10% faster, but its second sample ran while another process took the CPU
    race = CandidateRace([B, PREFERRED], 2, 4, 0.01, preferred=PREFERRED)
    samples = {B: iter([1.0, 1.8, 1.0, 1.01, 1.0]), PREFERRED: iter([1.1, 1.1, 1.11, 1.1, 1.1])}
    while (setting := race.next_setting()) is not None:
        race.record(setting, next(samples[setting]))
    assert race.winner == B and race.round >= 3  # measured again rather than decided on the burst


def test_a_load_change_between_rounds_cancels_in_the_paired_comparison():
    # the second round runs 50% slower for everyone (another job took the CPU): B is still 3% faster than C
    race, order = race_with({B: 1.0, C: 1.03, PREFERRED: 1.2}, rounds=(2, 4), jitter=[1.0, 1.5])
    assert race.winner == B and race.round == 2 and len(order) == 6
    assert race.ratio(C, B) == pytest.approx(1.03) and race.noise == 0.01  # the floor: no noise left


def test_within_noise_the_default_is_kept():
    race, _ = race_with({B: 1.0, PREFERRED: 1.005})
    assert race.winner == PREFERRED
    race, _ = race_with({B: 1.0, PREFERRED: 1.1})
    assert race.winner == B


class FakeClock:
    """Advances by the step time of the setting the strategy would have applied."""

    def __init__(self, times):
        self.times, self.now, self.setting = times, 0.0, None

    def __call__(self):
        return self.now

    def step(self):
        self.now += self.times[self.setting]


def drive(tuner, clock, max_steps=500):
    """What the strategy does: a boundary per optimizer step, the returned setting applied. Returns the step at
    which tuning finished and the settings applied (re-wraps)."""
    clock.setting = tuner.initial_setting
    tuner.start()
    rewraps = []
    for step in range(max_steps):
        if not tuner.tuning:
            return step, rewraps
        setting = tuner.on_step_boundary(step)
        if setting is not None:
            rewraps.append(setting)
            clock.setting = setting
        clock.step()
    raise AssertionError("tuning did not finish")


def test_bucket_layout_is_ddps_bucketing_in_backward_and_registration_order():
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 10))
    parameters = list(model.parameters())  # 256 kB, 1 kB, 256 kB, 1 kB, 10 kB, 40 B
    backward, forward = fusion.bucket_layout(parameters, BucketSetting(25.0))
    assert backward == forward == (tuple(range(6)),)  # one bucket, whatever the order
    backward, forward = fusion.bucket_layout(parameters, BucketSetting(0.25))
    assert backward == ((0, 1, 2, 3), (4, 5))  # indices into the reversed list; a bucket closes at >= 0.25 MB
    assert forward == ((0,), (1, 2), (3, 4, 5))
    assert fusion.bucket_layout(parameters, BucketSetting(25.0, 0.001))[0] == ((0, 1), (2, 3, 4, 5))
    # the same cuts as a DDP wrapper builds (its initial assignment, before the rebuild in backward order)
    buckets, _ = dist._compute_bucket_assignment_by_size(parameters[::-1], [int(0.25 * 2**20)], [False] * 6)
    assert tuple(tuple(b) for b in buckets) == backward
    # sizes that cut the gradients the same way in one order but not the other are not merged: 10, 10, 1 MB
    big = [torch.empty(n, device="meta", requires_grad=True) for n in (2_621_440, 2_621_440, 262_144)]
    sixteen, twenty_five = (fusion.bucket_layout(big, BucketSetting(s)) for s in (16.0, 25.0))
    assert sixteen[0] == twenty_five[0] and sixteen != twenty_five


def test_candidates_with_the_same_buckets_are_raced_once_as_the_default(tmp_path):
    layouts = {1.0: "many", 4.0: "two", 16.0: "one", 25.0: "one", 64.0: "one"}

    def layout(setting):
        return (layouts[setting.bucket_cap_mb], setting.first_bucket_mb)

    kept, merged = fusion.merge_equivalent([BucketSetting(s) for s in layouts], layout, (PREFERRED,))
    assert kept == [A, B, PREFERRED] and merged == {PREFERRED: [C, BucketSetting(64.0)]}
    assert fusion.merge_equivalent([A, B], None) == ([A, B], {})

    times = {BucketSetting(s): t for s, t in ((1.0, 0.9), (4.0, 0.5), (16.0, 0.6), (25.0, 0.6), (64.0, 0.6))}
    times[DDP_DEFAULT] = 0.6
    settings = AutotuneSettings(candidates_mb=tuple(layouts), first_bucket_candidates_mb=(), steps_per_sample=2)
    clock = FakeClock(times)
    tuner = FusionAutotuner(settings, None, tmp_path / "log.csv", None, None, clock=clock, layout=layout)
    # DDP's default is always raced: the reference
    assert tuner.candidates == [A, B, UNIFORM_25, DDP_DEFAULT]
    assert tuner.merged == {UNIFORM_25: [C, BucketSetting(64.0)]}
    clock.setting = tuner.initial_setting
    drive(tuner, clock)
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    measured = {(float(row["bucket_cap_mb"]), row["first_bucket_mb"]) for row in rows}
    assert measured == {(1.0, ""), (4.0, ""), (25.0, ""), (25.0, "1")} and tuner.result.setting == B

    # every candidate the same buckets, DDP's default too, and no first bucket to race: nothing to measure
    same = FusionAutotuner(settings, None, None, None, None, clock=clock, layout=lambda setting: "one")
    assert not same.tuning and same.initial_setting == DDP_DEFAULT and same.result.tuning_steps == 0
    assert same.result.summary() == (
        "shardplus: tensor fusion: DDP's default (25 MB, first bucket 1 MB) from the candidates, which all give this "
        "model the same buckets (no search)"
    )


def test_the_default_is_not_dropped_on_the_first_rounds_single_sample():
    race = CandidateRace([A, B, PREFERRED], 2, 4, 0.01, preferred=PREFERRED, first_round_margin=0.5)
    for setting, seconds in ((A, 1.0), (B, 1.6), (PREFERRED, 2.0)):
        assert race.next_setting() == setting
        race.record(setting, seconds)
    assert race.next_setting() is not None and race.live == [A, PREFERRED]  # B dropped, the preferred kept


@pytest.mark.compat
@pytest.mark.skipif(not fusion.SUPPORTS_FIRST_BUCKET, reason="DDP without bucket_cap_mb_list (torch < 2.13)")
def test_the_autotuner_finds_the_fastest_logs_each_sample_and_caches(tmp_path):
    times = {BucketSetting(s): t for s, t in ((1.0, 0.9), (4.0, 0.5), (25.0, 0.7))}
    times[BucketSetting(4.0, 1.0)], times[DDP_DEFAULT] = 0.45, 0.68
    settings = AutotuneSettings(candidates_mb=(25, 1, 4), steps_per_sample=3, warmup_steps=1)
    clock = FakeClock(times)
    cache = tmp_path / "cache.json"
    tuner = FusionAutotuner(settings, None, tmp_path / "log.csv", cache, "key", gradient_bytes=1000, clock=clock)
    assert tuner.initial_setting == BucketSetting(1.0)  # candidates are sorted
    step, rewraps = drive(tuner, clock)
    result = tuner.result
    assert result.setting == BucketSetting(4.0, 1.0) == rewraps[-1]
    assert result.step_s == pytest.approx(0.45) and result.default_step_s == pytest.approx(0.68)
    assert result.gain == pytest.approx(0.68 / 0.45) and result.complete  # against DDP's default, paired
    assert step <= settings.max_tuning_steps and result.tuning_steps == step - 1  # steps that ended
    line = result.summary()
    assert (
        "bucket 4 MB (first bucket 1 MB): 450.00 ms/step (median) vs 680.00 ms/step at DDP's default (25 MB, first "
        "bucket 1 MB), +51.1% steps/s while tuning (paired round by round)"
    ) in line
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert len(rows) == tuner.samples_taken and rows[0]["bucket_cap_mb"] == "1" and rows[0]["timed_steps"] == "3"
    assert {row["stage"] for row in rows} == {"bucket", "first_bucket"}
    assert float(rows[0]["step_ms"]) == pytest.approx(900) and float(rows[0]["gradient_bytes_per_s"]) == 1111
    assert json.loads(cache.read_text())["key"]["bucket_cap_mb"] == 4.0

    again = FusionAutotuner(settings, None, tmp_path / "log2.csv", cache, "key", clock=clock)
    assert not again.tuning and again.result.from_cache and again.initial_setting == BucketSetting(4.0, 1.0)
    assert drive(again, clock) == (0, [])
    assert "from the autotune cache" in again.result.summary()
    other = FusionAutotuner(settings, None, None, cache, "another key", clock=clock)
    assert other.tuning


def test_a_fixed_bucket_size_is_not_searched():
    settings = AutotuneSettings(fixed_bucket_cap_mb=8.0, first_bucket_candidates_mb=(1.0, 16.0))
    assert settings.first_stage == [] and settings.reference == BucketSetting(8.0)
    assert settings.second_stage(BucketSetting(8.0)) == [BucketSetting(8.0), BucketSetting(8.0, 1.0)]
    times = {BucketSetting(8.0): 1.0, BucketSetting(8.0, 1.0): 2.0}
    clock = FakeClock(times)
    tuner = FusionAutotuner(settings, clock=clock)
    _, rewraps = drive(tuner, clock)
    assert tuner.result.setting == BucketSetting(8.0) and all(s.bucket_cap_mb == 8.0 for s in rewraps)
    nothing = FusionAutotuner(AutotuneSettings(fixed_bucket_cap_mb=8.0, first_bucket_candidates_mb=()))
    assert not nothing.tuning and nothing.initial_setting == BucketSetting(8.0)


def test_steps_that_span_an_interruption_are_not_timed():
    clock = FakeClock({BucketSetting(1.0): 1.0, BucketSetting(2.0): 1.0})
    tuner = FusionAutotuner(AutotuneSettings(candidates_mb=(1, 2), steps_per_sample=2, warmup_steps=1), clock=clock)
    clock.setting = tuner.initial_setting
    tuner.start()
    tuner.on_step_boundary(0)
    clock.now += 100  # a validation
    tuner.interrupt()
    # 1: nothing ended that can be timed; 2-4: the warm-up (1, and 2 more in the run's first sample); 5: timed
    for step in range(1, 6):
        tuner.on_step_boundary(step)
        clock.step()
    tuner.on_step_boundary(6, counted=False)  # an epoch end
    clock.step()
    assert tuner.sample_intervals == [1.0]  # the warm-up, then one counted step


def test_cache_key_follows_the_parameter_layout_and_the_setup():
    params = [torch.zeros(3, 4, requires_grad=True), torch.zeros(4, requires_grad=True)]
    key = fusion.cache_key(params, 2, "cpu", "gloo", {"hook": None})
    same = [torch.ones(3, 4, requires_grad=True), torch.ones(4, requires_grad=True)]
    assert key == fusion.cache_key(same, 2, "cpu", "gloo", {"hook": None})
    assert key == fusion.cache_key([*params, torch.zeros(5)], 2, "cpu", "gloo", {"hook": None})  # no gradient
    assert key != fusion.cache_key(params[::-1], 2, "cpu", "gloo", {"hook": None})
    assert key != fusion.cache_key(params, 4, "cpu", "gloo", {"hook": None})
    assert key != fusion.cache_key(params, 2, "cuda", "nccl", {"hook": None})
    assert key != fusion.cache_key([p.double() for p in params], 2, "cpu", "gloo", {"hook": None})
    assert key != fusion.cache_key(params, 2, "cpu", "gloo", {"hook": "fp16"})


def test_first_bucket_tuning_follows_what_ddp_takes():
    assert fusion.SUPPORTS_FIRST_BUCKET  # torch 2.13's DDP takes bucket_cap_mb_list
    assert BucketSetting(4.0, 1.0).ddp_kwargs() == {"bucket_cap_mb": 4.0, "bucket_cap_mb_list": [1.0, 4.0]}
    assert BucketSetting(4.0).ddp_kwargs() == {"bucket_cap_mb": 4.0, "bucket_cap_mb_list": None}
    # DDP's default is given as no size at all: what DDP builds then, on any torch
    assert DDP_DEFAULT == BucketSetting(25.0, 1.0) and DDP_DEFAULT.ddp_kwargs() == dict.fromkeys(
        ("bucket_cap_mb", "bucket_cap_mb_list")
    )


def test_the_first_bucket_is_raced_for_the_chosen_size_unless_the_first_stage_raced_it():
    settings = AutotuneSettings(candidates_mb=(1, 4, 25))
    # 4 MB won: 4 MB against 4 MB with a 1 MB first bucket
    tuner = FusionAutotuner(settings)
    race = tuner.second_stage(B, [A, B, UNIFORM_25, DDP_DEFAULT])
    assert race.live == [B, BucketSetting(4.0, 1.0)] and race.preferred == B
    # DDP's default won: its first bucket was raced against the uniform 25 MB already
    assert tuner.second_stage(DDP_DEFAULT, [A, B, UNIFORM_25, DDP_DEFAULT]) is None
    # ... unless other first buckets are asked for: those against DDP's default
    other = FusionAutotuner(AutotuneSettings(candidates_mb=(1, 4, 25), first_bucket_candidates_mb=(0.5, 1.0)))
    race = other.second_stage(DDP_DEFAULT, [A, B, UNIFORM_25, DDP_DEFAULT])
    assert set(race.live) == {DDP_DEFAULT, BucketSetting(25.0, 0.5)} and race.preferred == DDP_DEFAULT
    # 16 MB won, and 16 MB with a 1 MB first bucket cuts the gradients as DDP's default does (raced already)
    layouts = {16.0: "one", 25.0: "one"}

    def layout(setting):
        return (layouts.get(setting.bucket_cap_mb, setting.bucket_cap_mb), setting.first_bucket_mb)

    tuner = FusionAutotuner(AutotuneSettings(candidates_mb=(1, 16)), layout=layout)
    assert tuner.candidates == [A, C, DDP_DEFAULT]
    assert tuner.second_stage(C, [A, C, DDP_DEFAULT]) is None


def test_the_step_bound_counts_the_largest_second_stage_the_first_can_lead_to():
    sample = 1 + 8
    # tiny sizes have no smaller first bucket; DDP's default can win, and leads to 25 MB against 25 MB (first 1 MB)
    tiny = AutotuneSettings(candidates_mb=(0.0002, 0.001))
    assert len(tiny.first_stage) == 3 and tiny.second_stage(DDP_DEFAULT) == [UNIFORM_25, DDP_DEFAULT]
    assert tiny.max_tuning_steps == (3 + 2) * 4 * sample + 2
    # first buckets of 0.5 and 2 MB: DDP's default against 25 MB uniform, first 0.5 and first 2 MB
    other = AutotuneSettings(candidates_mb=(1, 4), first_bucket_candidates_mb=(0.5, 2))
    assert len(other.second_stage(DDP_DEFAULT)) == 4
    assert other.max_tuning_steps == (3 + 4) * 4 * sample + 2
    assert AutotuneSettings(fixed_bucket_cap_mb=8.0).max_tuning_steps == 2 * 4 * sample + 2
    # the default candidates are the model's: the bound before the model is known holds for any model
    bound = AutotuneSettings().max_tuning_steps
    for sizes in ([10], [10, 10], [2_621_440, 2_621_440, 262_144], [256 * 256, 256] * 24, [1 << 26, 1 << 24]):
        parameters = [torch.empty(n, device="meta", requires_grad=True) for n in sizes]
        assert AutotuneSettings().for_model(parameters).max_tuning_steps <= bound


def test_a_cached_or_checkpointed_ddp_default_gives_ddp_no_bucket_size(tmp_path):
    cache = tmp_path / "cache.json"
    fusion.store_cached(cache, "key", {"bucket_cap_mb": 25.0, "first_bucket_mb": 1.0})
    tuner = FusionAutotuner(AutotuneSettings(candidates_mb=(1, 4)), cache_path=cache, cache_key="key")
    assert not tuner.tuning and tuner.initial_setting == DDP_DEFAULT
    strategy = ShardPlusStrategy(auto_tune_tensor_fusion=True)
    _lightning.set_ddp_kwargs(strategy, BucketSetting(4.0, 1.0).ddp_kwargs())  # as the strategy's re-wrap does
    assert strategy._ddp_kwargs["bucket_cap_mb_list"] == [1.0, 4.0]
    _lightning.set_ddp_kwargs(strategy, tuner.initial_setting.ddp_kwargs())
    assert "bucket_cap_mb" not in strategy._ddp_kwargs and "bucket_cap_mb_list" not in strategy._ddp_kwargs
    assert tuner.initial_setting.bucket_cap_mb == 25.0


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


def test_the_default_cache_is_checked_only_when_tuning(tmp_path, monkeypatch):
    monkeypatch.setattr(fusion, "DEFAULT_CACHE_PATH", tmp_path)  # a directory
    ShardPlusStrategy()  # not tuning: the default cache is not used
    with pytest.raises(ValueError, match=r"`autotune_cache`=True \(" + re.escape(str(tmp_path)) + r"\) .*False"):
        ShardPlusStrategy(auto_tune_tensor_fusion=True)


def test_missing_directories_of_the_autotune_files_are_created(tmp_path):
    cache, log = tmp_path / "a" / "cache.json", tmp_path / "b" / "c" / "log.csv"
    ShardPlusStrategy(auto_tune_tensor_fusion=True, autotune_cache=str(cache), autotune_log=str(log))
    times = {BucketSetting(1.0): 0.5, DDP_DEFAULT: 0.7}
    clock = FakeClock(times)
    settings = AutotuneSettings(candidates_mb=(1,), steps_per_sample=2)
    tuner = FusionAutotuner(settings, None, log, cache, "k", clock=clock)
    drive(tuner, clock)
    assert json.loads(cache.read_text())["k"]["bucket_cap_mb"] == 1.0 and log.read_text().startswith("sample,")


def test_autotune_files_that_cannot_be_written_while_tuning_are_a_warning_not_a_crash(tmp_path):
    cache, log = tmp_path / "cache.json", tmp_path / "log.csv"
    cache.mkdir()  # became directories after the strategy checked them
    log.mkdir()
    clock = FakeClock({BucketSetting(1.0): 0.5, DDP_DEFAULT: 0.7})
    settings = AutotuneSettings(candidates_mb=(1,), steps_per_sample=2)
    tuner = FusionAutotuner(settings, None, log, cache, "k", clock=clock)
    with pytest.warns(UserWarning) as warned:
        drive(tuner, clock)
    messages = [str(w.message) for w in warned]
    assert any(re.search(r"could not write the autotune log .*log.csv.*logging stops", m) for m in messages)
    assert any(re.search(r"could not write the autotune cache .*cache.json", m) for m in messages)
    assert tuner.result.complete and tuner.result.setting == BucketSetting(1.0)
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
    checkpointed = {"cache_key": "key", **entry} if source == "checkpoint" else None
    cached = {"other": {"bucket_cap_mb": 8.0}} | ({"key": entry} if source == "cache" else {})
    cache.write_text(json.dumps(cached))  # NaN written as JSON's NaN
    clock = FakeClock({BucketSetting(1.0): 0.5, DDP_DEFAULT: 0.7})
    settings = AutotuneSettings(candidates_mb=(1,), steps_per_sample=2)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        tuner = FusionAutotuner(settings, None, None, cache, "key", clock=clock, checkpointed=checkpointed)
    messages = [str(w.message) for w in warned if "not valid" in str(w.message)]
    assert len(messages) == 1 and "searched again" in messages[0], messages
    assert ("checkpoint" in messages[0]) == (source == "checkpoint")
    assert tuner.tuning and tuner.initial_setting == BucketSetting(1.0)
    drive(tuner, clock)
    entries = json.loads(cache.read_text())
    assert entries["key"]["bucket_cap_mb"] == 1.0 and entries["other"] == {"bucket_cap_mb": 8.0}


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
    clock = FakeClock({BucketSetting(1.0): 0.5, DDP_DEFAULT: 0.7})
    settings = AutotuneSettings(candidates_mb=(1,), steps_per_sample=2)
    tuner = FusionAutotuner(settings, None, None, path, "k", clock=clock)
    with pytest.warns(UserWarning, match=r"is not an autotune cache .*not overwritten"):
        drive(tuner, clock)
    assert path.read_bytes() == content.encode("latin-1") and tuner.result.complete


def test_an_empty_file_or_a_cache_is_taken_as_the_autotune_cache(tmp_path):
    empty, cache = tmp_path / "empty.json", tmp_path / "cache.json"
    empty.touch()
    fusion.store_cached(cache, "key", {"bucket_cap_mb": 4.0, "first_bucket_mb": None})
    for path in (empty, cache):
        ShardPlusStrategy(auto_tune_tensor_fusion=True, autotune_cache=str(path))
    fusion.store_cached(empty, "key", {"bucket_cap_mb": 4.0, "first_bucket_mb": None})
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
    assert "bucket_cap_mb" not in default._ddp_kwargs and default.config.bucket_setting == DDP_DEFAULT
    assert DDP_DEFAULT.bucket_cap_mb == 25.0
    assert DDPStrategy()._ddp_kwargs.get("bucket_cap_mb") is None
    strategy = ShardPlusStrategy(auto_tune_tensor_fusion=True, tensor_fusion_threshold_mb=8)
    settings = strategy.config.autotune_settings
    assert settings.fixed_bucket_cap_mb == 8.0 and strategy.config.tensor_fusion_threshold_mb == 8.0
    assert settings.reference == BucketSetting(8.0) == strategy.config.bucket_setting

    # the buckets DDP builds (after its rebuild in backward order) under each setting, and as bucket_layout says
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(24)])  # 6 MB of gradients
    parameters = list(model.parameters())

    def rebuilt_buckets(ddp_kwargs):
        ddp = DistributedDataParallel(model, **ddp_kwargs)
        for _ in range(3):  # DDP rebuilds its buckets at the second step
            ddp(torch.ones(2, 256)).sum().backward()
        indices = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]  # "47 46, 45 ...": last first
        return tuple(tuple(len(parameters) - 1 - int(i) for i in bucket.split()) for bucket in indices.split(", "))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plain_ddp = rebuilt_buckets({})
        assert len(plain_ddp) == 2  # a 1 MB first bucket, then the rest
        assert rebuilt_buckets(default._ddp_kwargs | DDP_DEFAULT.ddp_kwargs()) == plain_ddp
        assert fusion.bucket_layout(parameters, DDP_DEFAULT)[0] == plain_ddp
        for setting in (UNIFORM_25, BucketSetting(1.0), BucketSetting(4.0, 1.0)):
            kwargs = {k: v for k, v in setting.ddp_kwargs().items() if v is not None}
            assert rebuilt_buckets(kwargs) == fusion.bucket_layout(parameters, setting)[0]
        assert len(fusion.bucket_layout(parameters, UNIFORM_25)[0]) == 1  # what shardplus built before
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- 2 ranks

# the MLP's gradients are 3.2 kB: sizes in MB that cut them into 4, 2 and 1 bucket(s) (distinct layouts)
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
    # 3.2 kB of gradients: the sizes raced beside DDP's default cut them into 2 to 16 buckets of about equal bytes
    gradient_mb = 4 * PARAMETERS / 2**20
    uniform = {logged_setting(row) for row in rows} - {DDP_DEFAULT}
    assert len(uniform) >= 2 and DDP_DEFAULT in {logged_setting(row) for row in rows}
    for setting in uniform:
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
def test_a_fixed_bucket_size_is_kept_while_the_first_bucket_is_tuned(tmp_path):
    runs, _ = tuned_fit(tmp_path, "fixed", epochs=3, tensor_fusion_threshold_mb=25.0, autotune_cache=False, **TUNING)
    assert all(step["caps"][0] == 25 * 2**20 for run in runs for step in run["steps"])  # the size is kept
    assert runs[0]["result"]["complete"] and runs[0]["result"]["setting"]["bucket_cap_mb"] == 25.0
    raced = {json.dumps(step["caps"]) for step in runs[0]["steps"]}
    assert raced == {json.dumps(caps_of({"bucket_cap_mb": 25.0, "first_bucket_mb": f})) for f in (None, 0.0002)}


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
    times = {BucketSetting(s): t for s, t in ((1.0, 0.9), (4.0, 0.5), (25.0, 0.7))} | {DDP_DEFAULT: 0.7}
    clock = FakeClock(times)
    settings = AutotuneSettings(candidates_mb=(1, 4, 25), steps_per_sample=2, warmup_steps=1)
    tuner = FusionAutotuner(settings, None, None, tmp_path / "cache.json", "key", clock=clock)
    clock.setting = tuner.initial_setting
    tuner.start()
    for step in range(16):  # the first round only
        if (setting := tuner.on_step_boundary(step)) is not None:
            clock.setting = setting
        clock.step()
    assert tuner.tuning
    result = tuner.finish_early()
    assert result.setting == BucketSetting(4.0) and not result.complete
    assert "best so far, not cached" in result.summary() and not (tmp_path / "cache.json").exists()


def test_a_run_that_ends_before_the_default_was_measured_keeps_the_default():
    times = {BucketSetting(s): t for s, t in ((1.0, 0.5), (4.0, 0.6), (25.0, 0.7))} | {DDP_DEFAULT: 0.7}
    clock = FakeClock(times)
    tuner = FusionAutotuner(AutotuneSettings(candidates_mb=(1, 4, 25), steps_per_sample=2), clock=clock)
    clock.setting = tuner.initial_setting
    tuner.start()
    for step in range(9):  # 1 MB and 4 MB measured, DDP's default not yet
        if (setting := tuner.on_step_boundary(step)) is not None:
            clock.setting = setting
        clock.step()
    assert tuner.samples_taken == 2
    result = tuner.finish_early()
    assert result.setting == DDP_DEFAULT and not result.complete  # not measured is not slower
    assert result.default_step_s is None and "not measured" in result.summary()


def test_the_summary_compares_times_measured_in_the_same_stage():
    # the machine runs 30% slower once the first-bucket stage starts: 4 MB's time in the summary is the one
    # measured beside DDP's default, not the later one
    times = {BucketSetting(s): t for s, t in ((1.0, 0.9), (4.0, 0.5), (25.0, 0.7))}
    times |= {DDP_DEFAULT: 0.7, BucketSetting(4.0, 1.0): 0.6}
    clock = FakeClock(times)
    tuner = FusionAutotuner(AutotuneSettings(candidates_mb=(1, 4, 25), steps_per_sample=3), clock=clock)
    clock.setting = tuner.initial_setting
    tuner.start()
    step, second_stage_steps = 0, 0
    while tuner.tuning:
        if (setting := tuner.on_step_boundary(step)) is not None:
            clock.setting = setting
        slower = tuner.tuning and tuner.stage == "first_bucket"
        second_stage_steps += slower
        clock.now += times[clock.setting] * (1.3 if slower else 1.0)
        step += 1
    result = tuner.result
    assert second_stage_steps > 0 and result.setting == B
    assert result.step_s == pytest.approx(0.5) and result.default_step_s == pytest.approx(0.7)
    assert result.gain == pytest.approx(0.7 / 0.5)
    # a winner raced only in the second stage: its time on the first stage's base, through the paired ratio
    times[BucketSetting(4.0, 1.0)] = 0.45
    clock, step = FakeClock(times), 0
    tuner = FusionAutotuner(AutotuneSettings(candidates_mb=(1, 4, 25), steps_per_sample=3), clock=clock)
    clock.setting = tuner.initial_setting
    tuner.start()
    while tuner.tuning:
        if (setting := tuner.on_step_boundary(step)) is not None:
            clock.setting = setting
        slower = tuner.tuning and tuner.stage == "first_bucket"
        clock.now += times[clock.setting] * (1.3 if slower else 1.0)
        step += 1
    assert tuner.result.setting == BucketSetting(4.0, 1.0)
    assert tuner.result.step_s == pytest.approx(0.45) and tuner.result.default_step_s == pytest.approx(0.7)
    assert tuner.result.gain == pytest.approx(0.7 / 0.45)  # the same factor as the times


def test_a_dropped_default_is_kept_over_a_final_leader_no_faster_than_it():
    race = CandidateRace([A, B, PREFERRED], 3, 4, 0.01, preferred=PREFERRED)

    def measured(setting, scores):
        race.samples[setting], race.by_round[setting] = list(scores), dict(enumerate(scores))

    measured(A, [1.0, 1.0, 1.0, 1.5])
    measured(B, [1.2] * 4)
    measured(PREFERRED, [1.1] * 3)  # dropped after the third round
    race.live = [A, B]
    assert race.leader() == A and race.best() == A  # faster than the default in the rounds both ran
    measured(A, [1.2, 1.4, 1.4, 0.2])  # median 1.3
    assert race.leader() == B and race.best() == PREFERRED  # the final leader is slower than the default was
    # the times in a summary come from the rounds both ran (A's median there is 1.4, not 1.3)
    assert fusion.measured_against([race], A, PREFERRED)[:2] == (pytest.approx(1.4), pytest.approx(1.1))


RECORDED_CANDIDATES = (1, 4, 16, 25, 64)  # the default candidates when these runs were recorded


@pytest.mark.parametrize("run", [1, 2, 3, 4])
def test_the_recorded_benchmark_runs_replay_to_the_same_choices(run):
    # docs/bench/fusion-2cpu-run*.json hold each tuning sample (the autotune CSV) and the setting the run chose: fed
    # to the race as it is now, in the order it asks for them, they lead to that setting. A change of the race that
    # would decide otherwise fails here: run the benchmark again (and update the figures in docs/).
    from lightning_shardplus.demo import ClassifierModule

    path = Path(__file__).parents[1] / "docs" / "bench" / f"fusion-2cpu-run{run}.json"
    shapes = {"many-small": (256, 256, 24), "few-large": (1024, 2048, 3)}
    for row in json.loads(path.read_text())["fusion_rows"]:
        input_dim, hidden, layers = shapes[row["shape"]]
        parameters = list(ClassifierModule(input_dim=input_dim, hidden_dims=[hidden] * layers).parameters())
        recorded = [
            (BucketSetting(float(r["bucket_cap_mb"]), float(r["first_bucket_mb"]) if r["first_bucket_mb"] else None),
             float(r["step_ms"]) / 1000)
            for r in csv.DictReader(row["csv"])
        ]
        clock = FakeClock(times=None)  # advanced by hand below
        layout = functools.partial(fusion.bucket_layout, parameters)
        tuner = FusionAutotuner(AutotuneSettings(candidates_mb=RECORDED_CANDIDATES), clock=clock, layout=layout)
        tuner.start()
        step = 0
        while tuner.tuning:  # every step of a sample takes the time that sample measured
            tuner.on_step_boundary(step)
            if tuner.tuning:
                setting, seconds = recorded[tuner.samples_taken]
                assert tuner.measuring == setting  # the race asks for the sample that was measured
                clock.now += seconds
                step += 1
        assert tuner.samples_taken == len(recorded)  # decided on these samples, no more
        assert tuner.result.setting.label == row["tuned"].split(" = ")[0]


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
