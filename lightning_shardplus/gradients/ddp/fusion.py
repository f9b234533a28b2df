"""Tensor fusion: DDP's bucket size, given or raced over ``ROUNDS`` rounds of measured steps, every rank deciding the
same from the MAX over ranks of each sample's median step (:func:`decide`, docs/fusion-autotuning.md)."""

from __future__ import annotations

import csv
import dataclasses
import inspect
import math
import numbers
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_shardplus._compat.torch import DDP_DEFAULT_FIRST_BUCKET_BYTES
from lightning_shardplus.data.aggregation import micro_batch_size
from lightning_shardplus.gradients.ddp.fusion_cache import (
    NotACacheError,
    cache_key,
    default_cache_path,
    device_model,
    read_cache,
    store_cached,
)
from lightning_shardplus.validation import check_int

_MB = 1024 * 1024  # DDP's megabyte
# DDP hands its reducer int(bucket_cap_mb * 2**20) as a 64-bit integer: 2**43 MB and more fail there (exclusive).
MAX_BUCKET_CAP_MB = float(2**63 // _MB)
DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's documented bucket size when none is given
DDP_FIRST_BUCKET_MB = DDP_DEFAULT_FIRST_BUCKET_BYTES / _MB  # and its first bucket then
DEFAULT_BUCKETS_PER_MODEL: tuple[int, ...] = (2, 4, 8, 16)  # the default candidates cut the gradients so
DEFAULT_FIRST_BUCKET_CANDIDATES_MB: tuple[float, ...] = (DDP_FIRST_BUCKET_MB,)
# Whether this torch's DDP takes per-bucket caps (torch >= 2.13): a first bucket of its own size can be raced.
SUPPORTS_FIRST_BUCKET = "bucket_cap_mb_list" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
ROUNDS = 4  # an even number: each candidate as often early as late in a round
FIRST_SAMPLE_EXTRA_WARMUP = 2  # the run's first steps are slower (loaders start, allocations)
CHECKPOINT_KEY = "shardplus_tensor_fusion"
CSV_COLUMNS = ("sample", "stage", "round", "bucket_cap_mb", "first_bucket_mb", "first_step", "timed_steps",
               "step_ms", "gradient_bytes_per_s", "note")  # fmt: skip
BUCKET_SIZE_RANGE = f"a finite number > 0 and < {MAX_BUCKET_CAP_MB:.0f} MB (DDP takes the size in bytes as int64)"


@dataclass(frozen=True, order=True)
class BucketSetting:
    """DDP's bucket size, and optionally another size for the first bucket (the gradients ready first)."""

    bucket_cap_mb: float
    first_bucket_mb: float | None = None

    def ddp_kwargs(self) -> dict[str, Any]:
        """DDP's arguments for this setting (None: left out, as for :data:`DDP_DEFAULT`: what ``"ddp"`` builds)."""
        if self == DDP_DEFAULT:
            return {"bucket_cap_mb": None, "bucket_cap_mb_list": None}
        caps = None if self.first_bucket_mb is None else [self.first_bucket_mb, self.bucket_cap_mb]
        return {"bucket_cap_mb": self.bucket_cap_mb, "bucket_cap_mb_list": caps}

    @property
    def label(self) -> str:
        size = f"{self.bucket_cap_mb:g} MB"
        return size if self.first_bucket_mb is None else f"{size} (first bucket {self.first_bucket_mb:g} MB)"


DDP_DEFAULT = BucketSetting(DEFAULT_BUCKET_CAP_MB, DDP_FIRST_BUCKET_MB)  # what DDP builds given no size
DDP_DEFAULT_LABEL = f"DDP's default ({DEFAULT_BUCKET_CAP_MB:g} MB, first bucket {DDP_FIRST_BUCKET_MB:g} MB)"


def is_bucket_size(value: Any) -> bool:
    """A size in MB that DDP takes: a real number > 0 and < :data:`MAX_BUCKET_CAP_MB`."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return real and math.isfinite(value) and 0 < value < MAX_BUCKET_CAP_MB


def check_bucket_size(name: str, value: Any) -> None:
    """TypeError for what is not a number, ValueError for a size DDP cannot take."""
    if not is_bucket_size(value):
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        raise (ValueError if number else TypeError)(f"`{name}`={value!r} is not valid: expected {BUCKET_SIZE_RANGE}.")


def _sizes(name: str, values: Any, minimum_count: int) -> tuple[float, ...]:
    items = list(values) if isinstance(values, Iterable) and not isinstance(values, (str, bytes)) else None
    if items is None or len(items) < minimum_count or not all(is_bucket_size(v) for v in items):
        expected = f"at least {minimum_count} bucket size(s) in MB" if minimum_count else "bucket sizes in MB (or none)"
        raise ValueError(f"`{name}`={values!r} is not valid: expected a list of {expected}, each {BUCKET_SIZE_RANGE}.")
    return tuple(sorted({float(v) for v in items}))


def default_candidates_mb(parameters: Sequence[torch.Tensor]) -> tuple[float, ...]:
    """The model's gradient bytes over 2, 4, 8 and 16 buckets (2 significant digits), and DDP's 25 MB."""
    total = sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)
    sizes = {float(f"{total / buckets / _MB:.2g}") for buckets in DEFAULT_BUCKETS_PER_MODEL} if total else set()
    return tuple(sorted(s for s in sizes | {DEFAULT_BUCKET_CAP_MB} if is_bucket_size(s)))


@dataclass(frozen=True)
class AutotuneSettings:
    """The search space and its budget; checked on construction (errors name the strategy argument)."""

    candidates_mb: tuple[float, ...] | None = None  # None: the model's (for_model)
    first_bucket_candidates_mb: tuple[float, ...] = DEFAULT_FIRST_BUCKET_CANDIDATES_MB
    steps_per_sample: int = 8
    warmup_steps: int = 1
    fixed_bucket_cap_mb: float | None = None  # the user's size: only first buckets are raced beside it
    tolerance: float = 0.02  # a candidate must be faster than the reference by more than this

    def __post_init__(self) -> None:
        if self.candidates_mb is not None:
            object.__setattr__(self, "candidates_mb", _sizes("autotune_candidates_mb", self.candidates_mb, 1))
        first = _sizes("autotune_first_bucket_candidates_mb", self.first_bucket_candidates_mb, 0)
        object.__setattr__(self, "first_bucket_candidates_mb", first)
        object.__setattr__(self, "steps_per_sample", check_int("autotune_steps_per_sample", self.steps_per_sample, 1))
        object.__setattr__(self, "warmup_steps", check_int("autotune_warmup_steps", self.warmup_steps, minimum=1))

    def for_model(self, parameters: Sequence[torch.Tensor]) -> AutotuneSettings:
        """These settings with the model's default candidates where none were given."""
        given = self.candidates_mb is not None
        return self if given else dataclasses.replace(self, candidates_mb=default_candidates_mb(parameters))

    @property
    def reference(self) -> BucketSetting:
        """What DDP uses without tuning: the user's size, else DDP's default."""
        return DDP_DEFAULT if self.fixed_bucket_cap_mb is None else BucketSetting(self.fixed_bucket_cap_mb)

    @property
    def candidates(self) -> list[BucketSetting]:
        """The settings raced, the reference last: uniform sizes, then the reference's with smaller first buckets."""
        if self.candidates_mb is None and self.fixed_bucket_cap_mb is None:
            raise ValueError("AutotuneSettings: the default candidates depend on the model: call for_model() first")
        reference, cap = self.reference, self.reference.bucket_cap_mb
        uniform = [BucketSetting(s) for s in self.candidates_mb or ()] if self.fixed_bucket_cap_mb is None else []
        firsts = [BucketSetting(cap, f) for f in self.first_bucket_candidates_mb if f < cap and SUPPORTS_FIRST_BUCKET]
        return [s for s in dict.fromkeys(uniform + firsts) if s != reference] + [reference]

    @property
    def max_tuning_steps(self) -> int:
        """Optimizer steps the race takes at most (not counting those spanning an epoch end or a validation)."""
        most = dataclasses.replace(self, candidates_mb=tuple(range(1, len(DEFAULT_BUCKETS_PER_MODEL) + 2)))
        count = len((self if self.candidates_mb is not None else most).candidates)
        return count * ROUNDS * (self.warmup_steps + self.steps_per_sample) + FIRST_SAMPLE_EXTRA_WARMUP


def decide(times: dict[BucketSetting, list[float]], reference: BucketSetting, tolerance: float
           ) -> tuple[BucketSetting, float | None]:  # fmt: skip
    """The setting to keep from ``times[c][r]`` (one score per candidate and round) and the paired gain over the
    reference (None: not measured): the lowest median wins only if faster by ``tolerance`` by medians and paired."""
    if not times.get(reference):
        return reference, None
    best = min((c for c in times if times[c]), key=lambda c: statistics.median(times[c]))
    gain = statistics.median(mine / theirs for mine, theirs in zip(times[reference], times[best], strict=False))
    faster = statistics.median(times[best]) < (1 - tolerance) * statistics.median(times[reference])
    return (best, gain) if faster and gain > 1 / (1 - tolerance) else (reference, 1.0)


def cached_setting(entry: dict[str, Any]) -> BucketSetting:
    """The setting of a cache or checkpoint entry; ValueError saying what is wrong (a hand-edited file)."""
    cap, first = entry.get("bucket_cap_mb"), entry.get("first_bucket_mb")
    if not is_bucket_size(cap) or not (first is None or is_bucket_size(first)):
        raise ValueError(f"`bucket_cap_mb` {cap!r}, `first_bucket_mb` {first!r}: expected {BUCKET_SIZE_RANGE} or null")
    return BucketSetting(float(cap), None if first is None else float(first))


@dataclass
class FusionResult:
    """What tuning decided (or found without a search), and what it measured."""

    setting: BucketSetting
    step_s: float | None = None  # the chosen setting's median step time
    default_step_s: float | None = None  # the reference's (None: not measured)
    tuning_steps: int = 0
    tuning_s: float = 0.0  # wall time of the tuning steps, re-wraps included
    from_cache: bool = False  # known without a search: cache, checkpoint, or nothing to race
    source: str = "the autotune cache"
    complete: bool = True
    gain: float | None = None  # reference / chosen step time, the median of their per-round ratios
    reference: str = DDP_DEFAULT_LABEL

    @property
    def chosen(self) -> str:
        return DDP_DEFAULT_LABEL if self.setting == DDP_DEFAULT else f"bucket {self.setting.label}"

    def summary(self) -> str:
        """One readable line: the setting, its step time, the reference's, the gain."""
        if self.from_cache:
            return f"shardplus: tensor fusion: {self.chosen} from {self.source} (no search)"
        chosen = f"{1000 * self.step_s:.2f} ms/step (median)" if self.step_s else "unmeasured"
        default = (f"{1000 * self.default_step_s:.2f} ms/step at {self.reference}" if self.default_step_s
                   else f"{self.reference} not measured")  # fmt: skip
        gain = f", {100 * (self.gain - 1):+.1f}% steps/s while tuning (paired round by round)" if self.gain else ""
        if self.chosen == self.reference and self.default_step_s and self.complete:  # nothing to compare it with
            return f"shardplus: tensor fusion tuned: kept {self.chosen}: {chosen}, no candidate more than 2% faster; " \
                   f"{self.tuning_steps} tuning steps"  # fmt: skip
        status = "" if self.complete else " (training ended before the search did: best so far, not cached)"
        return f"shardplus: tensor fusion tuned: {self.chosen}: {chosen} vs {default}{gain}; {self.tuning_steps} " \
               f"tuning steps{status}"  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """For the Lightning logger (what is known of them)."""
        values = {"bucket_cap_mb": self.setting.bucket_cap_mb, "first_bucket_mb": self.setting.first_bucket_mb,
                  "step_ms": self.step_s and 1000 * self.step_s, "gain": self.gain,
                  "default_step_ms": self.default_step_s and 1000 * self.default_step_s}  # fmt: skip
        return {f"fusion/{name}": value for name, value in values.items() if value}

    def cache_entry(self) -> dict[str, Any]:
        step_ms, default_ms = (None if s is None else 1000 * s for s in (self.step_s, self.default_step_s))
        return {"bucket_cap_mb": self.setting.bucket_cap_mb, "first_bucket_mb": self.setting.first_bucket_mb,
                "step_ms": step_ms, "default_step_ms": default_ms, "tuning_steps": self.tuning_steps,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip


def _all_ranks(values: list[float], device: torch.device | None, reduce_max: bool) -> list[float]:
    """``values`` MAX over the ranks, or rank 0's (a broadcast); as they are without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if reduce_max:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    else:
        dist.broadcast(tensor, src=0)
    return tensor.tolist()


class TensorFusion:
    """DDP's bucket setting for one fit: ``settings.reference``, or with ``tune`` the winner of the race (DDP is
    re-wrapped with what :meth:`at_batch_start` returns). ``cache_extra``: what else the best setting depends on."""

    def __init__(self, trainer: Any, settings: AutotuneSettings, *, tune: bool = False,
                 log_path: str | os.PathLike | None = None, cache: str | os.PathLike | bool = True,
                 cache_extra: dict[str, Any] | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.trainer, self.settings, self.tune, self.clock = trainer, settings, tune, clock
        self.log_path = None if log_path is None else Path(log_path).expanduser()
        self.cache_path = default_cache_path() if cache is True else Path(cache).expanduser() if cache else None
        self.cache_extra, self.cache_key, self.device = dict(cache_extra or {}), None, None
        self.result: FusionResult | None = None  # once decided (None without tuning)
        self.times: dict[BucketSetting, list[float]] = {}  # per candidate, in race order: one score per round
        self.schedule: list[BucketSetting] = []  # the samples to take, in order
        self.samples_taken = self.gradient_bytes = self._steps = 0
        self.measuring: BucketSetting | None = None  # the setting of the sample in progress
        self.sample_intervals: list[float] = []  # its timed steps so far
        self._warmup_left, self._first_step, self._last_boundary, self._started_at = 0, 0, None, 0.0
        self._checkpointed, self._reported = None, False  # the tuned setting of a checkpoint being resumed

    @property
    def tuning(self) -> bool:
        """Whether the race is still measuring (DDP may be re-wrapped at the next optimizer step)."""
        return self.result is None and bool(self.schedule)

    def initial_setting(self, module: torch.nn.Module, world_size: int, device: torch.device, backend: str):
        """The setting to train with from the first step: the reference, the checkpoint's or cached one, or the race's
        first. Asked when training starts: the key holds the per-device batch size, known once the loaders are."""
        if not self.tune:
            return self.settings.reference
        parameters = [p for p in module.parameters() if p.requires_grad]
        self.settings, self.device = self.settings.for_model(parameters), device  # the key holds the sizes raced
        layout = {"per_device_batch_size": micro_batch_size(self.trainer), "num_nodes": self.trainer.num_nodes,
                  "device_model": device_model(device)}  # fmt: skip
        extra = {"candidates": [s.label for s in self.settings.candidates], "rounds": ROUNDS, **layout,
                 **self.cache_extra}  # fmt: skip
        self.cache_key = cache_key(parameters, world_size, device.type, backend, extra)
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in parameters)
        self.times = {c: [] for c in self.settings.candidates}
        self.result = self._known_result(len(parameters))
        if self.result is not None:
            if self.log_path is not None and self.trainer.is_global_zero:  # the log says why nothing is raced
                setting, note = self.result.setting, f"no search: {self.result.chosen} from {self.result.source}"
                self._write_rows([CSV_COLUMNS, ["", "none", "", *_csv_sizes(setting), "", 0, "", "", note]], "w")
            return self.result.setting
        self.schedule = [c for r in range(ROUNDS) for c in list(self.times)[:: -1 if r % 2 else 1]]
        return self.schedule[0]

    def _known_result(self, gradient_tensors: int) -> FusionResult | None:
        """The result known without a race (checkpoint, cache, or nothing to race); rank 0 reads and broadcasts."""
        found = [0.0, 0.0, -1.0]  # where (1: cache, 2: checkpoint), bucket size, first bucket or -1
        for where, entry, source in self._stored() if self.trainer.is_global_zero else ():
            try:
                setting = cached_setting(entry)
            except ValueError as reason:  # a hand-edited file: checked on rank 0, before the broadcast
                rank_zero_warn(f"shardplus: the tuned bucket setting in {source} for this setup is not valid "
                               f"({reason}): it is ignored and the bucket size is searched again.")  # fmt: skip
                continue
            found = [where, setting.bucket_cap_mb, setting.first_bucket_mb or -1.0]
            break
        where, cap, first = _all_ranks(found, self.device, reduce_max=False)
        if where:
            source = "the checkpoint resumed" if where == 2 else "the autotune cache"
            return FusionResult(BucketSetting(cap, None if first < 0 else first), from_cache=True, source=source)
        if gradient_tensors == 1:
            source = "the candidates, which all give this model the same buckets (it has one parameter tensor)"
        elif len(self.times) == 1:
            source = "`tensor_fusion_threshold_mb` (no first bucket to race)"
        else:
            return None
        return FusionResult(self.settings.reference, from_cache=True, source=source)

    def _stored(self) -> list[tuple[int, dict[str, Any], str]]:
        """This key's entries: the resumed checkpoint's, then the cache's (a file that cannot be read has none)."""
        checkpointed = self._checkpointed if (self._checkpointed or {}).get("cache_key") == self.cache_key else None
        try:
            cached = None if self.cache_path is None else read_cache(self.cache_path).get(self.cache_key)
        except (OSError, NotACacheError):
            cached = None
        stored = [(2, checkpointed, "the checkpoint resumed"), (1, cached, f"the cache {self.cache_path}")]
        return [(where, entry, source) for where, entry, source in stored if entry is not None]

    def on_train_start(self) -> None:
        """Start the race, or report the setting found without one."""
        if not self.schedule:
            return self._report()
        self._begin_sample(self.schedule[0], self.settings.warmup_steps + FIRST_SAMPLE_EXTRA_WARMUP)
        self._started_at = self.clock()
        if self.log_path is not None and self.trainer.is_global_zero:
            self._write_rows([CSV_COLUMNS], "w")
        bound, total = self.settings.max_tuning_steps, self.trainer.estimated_stepping_batches
        labels = ", ".join(DDP_DEFAULT_LABEL if s == DDP_DEFAULT else s.label for s in self.times)
        rank_zero_info(f"shardplus: tuning the tensor-fusion bucket size among {labels}"
                       f": at most {bound} optimizer steps")  # fmt: skip
        if math.isfinite(total) and total < bound:
            rank_zero_warn(f"shardplus: this run has {int(total)} optimizer steps, tensor-fusion tuning up to {bound}: "
                           "it may end first (nothing cached then). Give fewer `autotune_candidates_mb` or a smaller "
                           "`autotune_steps_per_sample`.")  # fmt: skip

    def _begin_sample(self, setting: BucketSetting, warmup: int) -> None:
        self.measuring, self._warmup_left, self.sample_intervals = setting, warmup, []
        self._first_step = self.trainer.global_step  # where the sample starts, for the log

    def interrupt(self) -> None:
        """Something other than a training step runs now (validation): the step in progress is not timed."""
        self._last_boundary = None

    def at_batch_start(self, batch_idx: int) -> BucketSetting | None:
        """At a step boundary while tuning, time the step that ended; the setting to re-wrap with, or None."""
        if self.measuring is None or batch_idx % self.trainer.accumulate_grad_batches:
            return None  # inside an aggregation window DDP is never re-wrapped
        now = self.clock()
        previous, self._last_boundary = self._last_boundary, now
        if previous is None:
            return None  # the first boundary, or after an interruption: nothing that ended can be timed
        self._steps += 1
        if self._warmup_left > 0:
            self._warmup_left -= 1
        elif batch_idx > 0:
            self.sample_intervals.append(now - previous)
        if len(self.sample_intervals) < self.settings.steps_per_sample:
            return None
        setting: BucketSetting = self.measuring  # type: ignore[assignment]
        score = _all_ranks([statistics.median(self.sample_intervals)], self.device, reduce_max=True)[0]
        self.times[setting].append(score)
        if self.log_path is not None and self.trainer.is_global_zero:
            round_, rate = self.samples_taken // len(self.times), self.gradient_bytes / score if score else 0.0
            self._write_rows([[self.samples_taken, "bucket", round_, *_csv_sizes(setting), self._first_step,
                               len(self.sample_intervals), f"{1000 * score:.3f}", f"{rate:.0f}", ""]])  # fmt: skip
        self.samples_taken += 1
        if self.samples_taken < len(self.schedule):
            following = self.schedule[self.samples_taken]
            self._begin_sample(following, self.settings.warmup_steps if following != setting else 0)
        else:
            following = self._finish(complete=True)
        return following if following != setting else None

    def on_train_end(self) -> None:
        """Training ends while tuning: the best setting so far (every rank decides the same), not cached."""
        if self.tuning:
            self._finish(complete=False)

    def _finish(self, complete: bool) -> BucketSetting:
        """Decide, report, and cache a complete result (rank 0)."""
        reference = self.settings.reference
        winner, gain = decide(self.times, reference, self.settings.tolerance)
        medians = {s: statistics.median(t) for s, t in self.times.items() if t}
        label = DDP_DEFAULT_LABEL if reference == DDP_DEFAULT else f"the given {reference.label}"
        self.result = FusionResult(winner, medians.get(winner), medians.get(reference), self._steps,
                                   self.clock() - self._started_at, complete=complete, gain=gain, reference=label)
        self.measuring = None
        if complete and self.trainer.is_global_zero and self.cache_path is not None:
            try:
                store_cached(self.cache_path, self.cache_key, self.result.cache_entry())  # type: ignore[arg-type]
            except (NotACacheError, OSError) as error:  # checked at construction; the file may have changed since
                why = f"is not an autotune cache ({error}), and it is not overwritten" if isinstance(
                    error, NotACacheError) else f"could not be written ({error})"  # fmt: skip
                rank_zero_warn(f"shardplus: the autotune cache {self.cache_path} {why}: the tuned setting is used in "
                               "this run but not cached.")  # fmt: skip
        self._report()
        return winner

    def _report(self) -> None:
        """The summary line, and the result to the Lightning loggers (rank 0)."""
        result = self.result
        if result is None or self._reported:
            return
        self._reported = True
        where = [f"{'why' if result.from_cache else 'samples'} in {self.log_path}"] if self.log_path else []
        if result.complete and result.source == "the autotune cache" and self.cache_path is not None:
            where.append(f"cache {self.cache_path}")
        rank_zero_info(result.summary() + (f" ({'; '.join(where)})" if where else ""))
        if self.trainer.is_global_zero:
            for logger in self.trainer.loggers:
                logger.log_metrics(result.metrics(), step=self.trainer.global_step)

    def _write_rows(self, rows: list[Sequence[Any]], mode: str = "a") -> None:
        assert self.log_path is not None
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, mode, newline="") as f:
                csv.writer(f).writerows(rows)
        except OSError as error:  # checked at construction; a file system can change or fill up since
            rank_zero_warn(f"shardplus: could not write the autotune log {self.log_path} ({error}): logging stops.")
            self.log_path = None

    def state_dict(self) -> dict[str, Any] | None:
        """A finished tuning's setting and the key it holds for: a resumed run goes on with it (None otherwise)."""
        complete = self.result is not None and self.result.complete and self.cache_key is not None
        return {"cache_key": self.cache_key, **self.result.cache_entry()} if complete else None  # type: ignore

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._checkpointed = state


def _csv_sizes(setting: BucketSetting) -> list[str]:
    return [f"{setting.bucket_cap_mb:g}", "" if setting.first_bucket_mb is None else f"{setting.first_bucket_mb:g}"]
