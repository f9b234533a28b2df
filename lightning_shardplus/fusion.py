"""Tensor-fusion autotuning: DDP's gradient bucket size (``bucket_cap_mb``) chosen by measuring real training
steps.

``ShardPlusStrategy(auto_tune_tensor_fusion=True)`` measures the first optimizer steps of training under each
candidate bucket size and keeps the fastest. Nothing is thrown away: every measured step is a real training
step; between samples DDP is re-wrapped with the next candidate on every rank at the same optimizer-step
boundary (never inside an aggregation window), and the communication hook is registered again.

How a decision is reached (Horovod's autotuner, made robust on a noisy machine and bounded in steps):

- A *sample* is ``warmup_steps`` discarded optimizer steps after a re-wrap (DDP cuts its buckets after the first
  step of a new wrapper; the run's first sample discards 2 more) followed by ``steps_per_sample`` timed steps.
  A step's time is the wall time between the starts of consecutive optimizer steps (a window of
  ``aggregation_frequency`` micro-batches); steps that span an epoch end or a validation are not counted. The
  sample's score is the median step time on each rank, reduced with MAX across ranks (the slowest rank sets the
  pace): one all_reduce per sample, not per step.
- The reference is what DDP builds without tuning (:data:`DDP_DEFAULT`: 25 MB buckets, the first one 1 MB, what
  ``strategy="ddp"`` uses; or the user's ``tensor_fusion_threshold_mb``): it is always raced, and kept unless
  something is measurably faster.
- Candidates that give the model the same buckets (e.g. 16, 25 and 64 MB for 6 MB of gradients: one bucket)
  are one candidate: it is measured once, as the reference where that is among them (:func:`bucket_layout`).
- Candidates are raced in interleaved rounds (each round visits every remaining candidate, in reverse order every
  other round, so the machine's drift spreads over all of them); a candidate's time is the median of its samples.
  After the first round, candidates more than 50% slower than the best are dropped; from ``min_rounds`` on, those
  slower than the best by more than two standard errors (from the noise measured across samples) and by the medians,
  and the finalists are measured again. The race stops as soon as one is left, when the finalists are within
  ``tolerance`` (2%) of each other (a difference not worth more steps), or after ``max_rounds``. The reference (or,
  for the first bucket, the first stage's winner) is kept unless another is faster by more than the tolerance *and*
  the noise (two standard errors) *and* by the medians: a change has to be measurably better.
- Where torch's DDP takes ``bucket_cap_mb_list`` (torch >= 2.13: per-bucket caps, in gradient-ready order) the
  first bucket is raced next, with the chosen size for the others (settings raced in the first stage already are
  not raced again): a small first bucket lets the all-reduce start before the backward pass ends.
- Rank 0 decides and broadcasts the next setting (one broadcast per sample); it also writes one CSV row per
  sample (``autotune_log``) and caches the result in a JSON file keyed by what determines it (parameter layout,
  world size, device type, backend, torch version, communication hook, search space), so that the next run
  with the same key starts with the tuned setting and does not search.

:class:`FusionAutotuner` knows nothing of the Trainer: collectives and the clock are passed in, so the search runs
in one process in tests. :class:`TensorFusion` is the strategy's component for one fit: it builds the autotuner
(cache key, log), drives it at optimizer-step boundaries and reports the result; the strategy re-wraps DDP when
it returns a setting.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import inspect
import json
import math
import numbers
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_shardplus._validation import check_int, check_writable_file

_MB = 1024 * 1024  # DDP's megabyte
# DDP hands its C++ reducer the bucket size in bytes, int(bucket_cap_mb * 1024 * 1024), as a 64-bit integer: sizes
# of 2**43 MB and more fail there (a TypeError when DDP is built, inside the worker processes). Exclusive bound.
MAX_BUCKET_CAP_MB = float(2**63 // _MB)
# torch's DDP bucket size when none is given
DEFAULT_BUCKET_CAP_MB = 25.0
# and its first bucket then (the gradients ready first); torch.distributed private, guarded by
# tests/test_lightning_private.py
DDP_FIRST_BUCKET_MB = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", _MB) / _MB  # (absent without distributed)
# The default candidates (``autotune_candidates_mb=None``) cut the model's gradients into this many buckets: the
# size that overlaps communication with the backward pass best depends on the model's gradient size.
DEFAULT_BUCKETS_PER_MODEL: tuple[int, ...] = (1, 2, 4, 8, 16)
# and DDP's uniform 25 MB, and, where those all cut the gradients one way, the smallest gradient tensor's size
MAX_DEFAULT_CANDIDATES = len(DEFAULT_BUCKETS_PER_MODEL) + 2
DEFAULT_FIRST_BUCKET_CANDIDATES_MB: tuple[float, ...] = (DDP_FIRST_BUCKET_MB,)
DEFAULT_CACHE_PATH = Path("~/.cache/lightning_shardplus/fusion.json")
# Untimed steps added to the first sample of a run: its first steps (data loading starts, allocations) are slower.
FIRST_SAMPLE_EXTRA_WARMUP = 2
# Whether this torch's DDP takes per-bucket caps (the first bucket can then be tuned on its own).
SUPPORTS_FIRST_BUCKET = "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters

CSV_COLUMNS = (
    "sample",
    "stage",
    "round",
    "bucket_cap_mb",
    "first_bucket_mb",
    "first_step",
    "timed_steps",
    "step_ms",
    "gradient_bytes_per_s",
    "note",  # why nothing was raced (one row then: the setting used), else empty
)


@dataclass(frozen=True, order=True)
class BucketSetting:
    """What the autotuner sets on DDP: the bucket size, and optionally a different size for the first bucket
    (the first to be all-reduced: the gradients ready first)."""

    bucket_cap_mb: float
    first_bucket_mb: float | None = None

    def ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``DistributedDataParallel`` that give it this setting (None: leave it out).
        :data:`DDP_DEFAULT` leaves both out: DDP's own default, exactly what ``strategy="ddp"`` builds, on any torch."""
        if self == DDP_DEFAULT:
            return {"bucket_cap_mb": None, "bucket_cap_mb_list": None}
        caps = None if self.first_bucket_mb is None else [self.first_bucket_mb, self.bucket_cap_mb]
        return {"bucket_cap_mb": self.bucket_cap_mb, "bucket_cap_mb_list": caps}

    @property
    def label(self) -> str:
        size = f"{self.bucket_cap_mb:g} MB"
        return size if self.first_bucket_mb is None else f"{size} (first bucket {self.first_bucket_mb:g} MB)"


def _merged_label(setting: BucketSetting, kept: BucketSetting) -> str:
    """``setting``'s label beside the one it was merged into: "25 MB (every bucket)" beside "25 MB (first bucket
    1 MB)", not "25 MB" twice."""
    same_cap = setting.bucket_cap_mb == kept.bucket_cap_mb and setting.first_bucket_mb is None
    return f"{setting.label} (every bucket)" if same_cap else setting.label


# What DDP builds when no bucket size is given (``strategy="ddp"``, and shardplus without
# ``tensor_fusion_threshold_mb``): the reference tuning has to beat measurably.
DDP_DEFAULT = BucketSetting(DEFAULT_BUCKET_CAP_MB, DDP_FIRST_BUCKET_MB)
DDP_DEFAULT_LABEL = f"DDP's default ({DEFAULT_BUCKET_CAP_MB:g} MB, first bucket {DDP_FIRST_BUCKET_MB:g} MB)"


@dataclass(frozen=True)
class AutotuneSettings:
    """The search space and its budget; checked on construction (errors name the strategy argument)."""

    candidates_mb: tuple[float, ...] | None = None  # None: chosen from the model's gradient size (for_model)
    first_bucket_candidates_mb: tuple[float, ...] = DEFAULT_FIRST_BUCKET_CANDIDATES_MB
    steps_per_sample: int = 8
    warmup_steps: int = 1
    min_rounds: int = 3  # paired ratios before a candidate can be dropped as slower (2 are too few here)
    max_rounds: int = 4
    noise_floor: float = 0.01
    tolerance: float = 0.02  # finalists this close are as good as each other: stop
    # after the first round, candidates this much slower than the best are dropped (one sample each: a wide margin)
    first_round_margin: float = 0.5
    # set by the user: only the first bucket is searched, with this size for the others
    fixed_bucket_cap_mb: float | None = None

    def __post_init__(self) -> None:
        if self.candidates_mb is not None:
            object.__setattr__(self, "candidates_mb", _sizes("autotune_candidates_mb", self.candidates_mb, 1))
        first = _sizes("autotune_first_bucket_candidates_mb", self.first_bucket_candidates_mb, 0)
        object.__setattr__(self, "first_bucket_candidates_mb", first)
        object.__setattr__(self, "steps_per_sample", check_int("autotune_steps_per_sample", self.steps_per_sample, 1))
        object.__setattr__(self, "warmup_steps", check_int("autotune_warmup_steps", self.warmup_steps, minimum=1))
        object.__setattr__(self, "min_rounds", check_int("min_rounds", self.min_rounds, minimum=1))
        object.__setattr__(self, "max_rounds", check_int("max_rounds", self.max_rounds, minimum=self.min_rounds))

    def for_model(self, parameters: Sequence[torch.Tensor]) -> AutotuneSettings:
        """These settings with the default candidates of a model whose parameters are ``parameters``
        (:func:`default_candidates_mb`) where none were given; given ones stay as given."""
        if self.candidates_mb is not None:
            return self
        return dataclasses.replace(self, candidates_mb=default_candidates_mb(parameters))

    @property
    def first_stage(self) -> list[BucketSetting]:
        """The uniform bucket sizes raced first, and DDP's default: the reference (none when the user fixed the
        size). The default candidates depend on the model: :meth:`for_model` first."""
        if self.fixed_bucket_cap_mb is not None:
            return []
        if self.candidates_mb is None:
            raise ValueError("AutotuneSettings: the default candidates depend on the model: call for_model() first")
        return [BucketSetting(size) for size in self.candidates_mb] + [DDP_DEFAULT]

    @property
    def reference(self) -> BucketSetting:
        """What DDP would use without tuning: the user's size, else DDP's default."""
        if self.fixed_bucket_cap_mb is not None:
            return BucketSetting(self.fixed_bucket_cap_mb)
        return DDP_DEFAULT

    def second_stage(self, chosen: BucketSetting) -> list[BucketSetting]:
        """``chosen``, its bucket size uniform and with each smaller first bucket (empty where torch cannot set a
        first bucket or none is smaller)."""
        cap = chosen.bucket_cap_mb
        smaller = [f for f in self.first_bucket_candidates_mb if f < cap]
        if not SUPPORTS_FIRST_BUCKET or not smaller:
            return []
        stage = [BucketSetting(cap)] + [BucketSetting(cap, f) for f in smaller]
        return stage if chosen in stage else [chosen, *stage]

    @property
    def max_tuning_steps(self) -> int:
        """Optimizer steps the search takes at most (it usually stops earlier), not counting steps that span an
        epoch end or a validation (they are not timed)."""
        sample = self.warmup_steps + self.steps_per_sample
        if self.candidates_mb is None and self.fixed_bucket_cap_mb is None:  # the model's: at most this many
            # any default candidate, as far as the second stage goes, is at most a size above every first bucket
            stage = [BucketSetting(math.inf)] * MAX_DEFAULT_CANDIDATES + [DDP_DEFAULT]
        else:
            stage = self.first_stage
        first = len(stage) * self.max_rounds * sample
        # the first stage's winner decides the second stage: the largest one it can be
        second = max(len(self.second_stage(chosen)) for chosen in stage or [self.reference])
        return first + second * self.max_rounds * sample + FIRST_SAMPLE_EXTRA_WARMUP

    def describe(self) -> dict[str, Any]:
        """The search space, as it enters the cache key."""
        return {
            "candidates_mb": None if self.candidates_mb is None else list(self.candidates_mb),
            "first_bucket_candidates_mb": list(self.first_bucket_candidates_mb) if SUPPORTS_FIRST_BUCKET else [],
            "fixed_bucket_cap_mb": self.fixed_bucket_cap_mb,
            "reference": self.reference.label,
        }


def is_bucket_size(value: Any) -> bool:
    """Whether ``value`` is a bucket size in MB that DDP takes: a number > 0 and < :data:`MAX_BUCKET_CAP_MB`."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value < MAX_BUCKET_CAP_MB
    )


BUCKET_SIZE_RANGE = (
    f"a finite number > 0 and < {MAX_BUCKET_CAP_MB:.0f} MB (2**43: DDP's bucket size in bytes is a 64-bit integer)"
)


def check_bucket_size(name: str, value: Any) -> None:
    """Refuse a bucket size in MB that DDP cannot take (:func:`is_bucket_size`): TypeError for what is not a
    number, ValueError for a number out of range (as the other arguments' checks)."""
    if not is_bucket_size(value):
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        raise (ValueError if number else TypeError)(f"`{name}`={value!r} is not valid: expected {BUCKET_SIZE_RANGE}.")


def _sizes(name: str, values: Any, minimum_count: int) -> tuple[float, ...]:
    items = None
    if not isinstance(values, (str, bytes)):
        try:
            items = list(values)
        except TypeError:  # not a collection
            items = None
    valid = items is not None and len(items) >= minimum_count and all(is_bucket_size(v) for v in items)
    if not valid:
        expected = f"at least {minimum_count} bucket size(s) in MB" if minimum_count else "bucket sizes in MB (or none)"
        raise ValueError(f"`{name}`={values!r} is not valid: expected a list of {expected}, each {BUCKET_SIZE_RANGE}.")
    return tuple(sorted({float(v) for v in items}))


def default_candidates_mb(parameters: Sequence[torch.Tensor]) -> tuple[float, ...]:
    """The default bucket sizes of a model: its gradient bytes divided by each of :data:`DEFAULT_BUCKETS_PER_MODEL`
    (2 significant digits), DDP's uniform 25 MB, and, where these and DDP's default all cut the gradients the same
    way, the smallest gradient tensor's size (one bucket per tensor): more than one tensor then has >= 2 layouts.
    Sizes with the same layout are raced once (:func:`merge_equivalent`)."""
    grads = [p for p in parameters if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in grads if p.numel()]
    if not sizes:
        return (DEFAULT_BUCKET_CAP_MB,)
    total = sum(sizes)
    candidates = {float(f"{total / buckets / _MB:.2g}") for buckets in DEFAULT_BUCKETS_PER_MODEL}
    candidates.add(DEFAULT_BUCKET_CAP_MB)
    layouts = {bucket_layout(grads, BucketSetting(size)) for size in candidates}
    if len(layouts | {bucket_layout(grads, DDP_DEFAULT)}) < 2:
        candidates.add(min(sizes) / _MB)  # exact: _MB is a power of 2, DDP gets back min(sizes) bytes
    return tuple(sorted(size for size in candidates if is_bucket_size(size)))


# ---------------------------------------------------------------------------------------------------- search


def bucket_layout(parameters: Sequence[torch.Tensor], setting: BucketSetting) -> tuple[Any, ...]:
    """The buckets (parameter indices) DDP builds under ``setting``, with DDP's own bucketing, for the gradients
    taken in reverse registration order (the usual backward order, in which DDP rebuilds its buckets after the
    first step) and in registration order (the other extreme). Settings with the same layout in both orders
    are the same setting for this model, whatever order the gradients really come in."""
    limits = [int(mb * _MB) for mb in (setting.first_bucket_mb, setting.bucket_cap_mb) if mb is not None]
    grads = [p for p in parameters if p.requires_grad]
    if not grads:
        return (), ()
    shapes = [torch.empty(p.numel(), dtype=p.dtype, device="meta") for p in grads]  # sizes and dtypes only

    def buckets(order: list[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
        # torch.distributed private (guarded by tests/test_lightning_private.py)
        assignment, _ = dist._compute_bucket_assignment_by_size(order, limits, [False] * len(order))
        return tuple(tuple(bucket) for bucket in assignment)

    return buckets(shapes[::-1]), buckets(shapes)


def merge_equivalent(
    candidates: Sequence[BucketSetting],
    layout: Callable[[BucketSetting], Any] | None,
    preferred: Sequence[BucketSetting] = (),
) -> tuple[list[BucketSetting], dict[BucketSetting, list[BucketSetting]]]:
    """One candidate per distinct ``layout`` (all of them without one): the first of ``preferred`` in a group,
    else the group's first; and, per kept candidate, the others it stands for."""
    if layout is None:
        return list(candidates), {}
    groups: dict[Any, list[BucketSetting]] = {}
    for candidate in candidates:
        groups.setdefault(layout(candidate), []).append(candidate)
    kept, merged = [], {}
    for group in groups.values():
        representative = next((p for p in preferred if p in group), group[0])
        kept.append(representative)
        if len(group) > 1:
            merged[representative] = [c for c in group if c != representative]
    return kept, merged



class CandidateRace:
    """Successive elimination over bucket settings, from one score (seconds per step) per sample.

    :meth:`next_setting` says what to measure next (None: decided), :meth:`record` takes its score. Rounds visit the
    remaining candidates in alternating order. Candidates are compared *paired*: by the median over the rounds that
    measured both of the ratio of their scores (:meth:`ratio`), so that a change of the machine's load between
    rounds cancels. After each round from ``min_rounds`` on, candidates slower than the leader by more than two
    standard errors (:meth:`margin`, from ``noise``: the median relative deviation of the paired ratios, at least
    ``noise_floor``), and slower by the medians of their scores, are dropped (a round or two of outliers can make
    the two measures disagree: then nothing is concluded); the race ends with one candidate left, with all finalists
    within ``tolerance`` of the leader (a difference not worth more steps), or after ``max_rounds``. After the first
    round, with one sample each, only candidates slower than the leader by more than ``first_round_margin`` are
    dropped."""

    def __init__(
        self,
        candidates: Sequence[BucketSetting],
        min_rounds: int,
        max_rounds: int,
        noise_floor: float,
        preferred: BucketSetting | None = None,
        first_round_margin: float = math.inf,
        tolerance: float = 0.02,
    ) -> None:
        if not candidates:
            raise ValueError("CandidateRace needs at least one candidate")
        self.live = list(candidates)
        self.samples: dict[BucketSetting, list[float]] = {c: [] for c in candidates}
        self.by_round: dict[BucketSetting, dict[int, float]] = {c: {} for c in candidates}
        self.min_rounds, self.max_rounds, self.noise_floor = min_rounds, max_rounds, noise_floor
        self.preferred = preferred
        self.first_round_margin, self.tolerance = first_round_margin, tolerance
        self.round = 0
        self.winner: BucketSetting | None = candidates[0] if len(candidates) == 1 else None
        self._queue = list(self.live)

    def next_setting(self) -> BucketSetting | None:
        if self.winner is not None:
            return None
        if not self._queue:
            self._end_round()
            if self.winner is not None:
                return None
        return self._queue[0]

    def record(self, setting: BucketSetting, seconds_per_step: float) -> None:
        if not self._queue or self._queue[0] != setting:
            raise RuntimeError(f"CandidateRace: expected a sample of {self._queue[:1]}, got {setting}")
        self._queue.pop(0)
        self.samples[setting].append(seconds_per_step)
        self.by_round[setting][self.round] = seconds_per_step

    def median(self, setting: BucketSetting) -> float:
        """The median of ``setting``'s scores (seconds per step), for reports."""
        samples = [s for s in self.samples.get(setting, ()) if math.isfinite(s)]
        return statistics.median(samples) if samples else math.inf

    def _ratios(self, setting: BucketSetting, reference: BucketSetting) -> list[float]:
        mine, theirs = self.by_round.get(setting, {}), self.by_round.get(reference, {})
        return [mine[r] / theirs[r] for r in mine if r in theirs and theirs[r] > 0]

    def ratio(self, setting: BucketSetting, reference: BucketSetting) -> float:
        """Median over the rounds that measured both of ``setting``'s score / ``reference``'s (1.05: 5% slower);
        inf when they share no round."""
        if setting == reference:
            return 1.0
        ratios = self._ratios(setting, reference)
        return statistics.median(ratios) if ratios else math.inf

    def leader(self) -> BucketSetting:
        """The fastest remaining candidate: the lowest median, unless another is faster paired with it."""
        leader = min(self.live, key=self.median)
        challenger = min(self.live, key=lambda c: self.ratio(c, leader))
        return challenger if self.ratio(challenger, leader) < 1 else leader

    @property
    def noise(self) -> float:
        """The median relative deviation of paired ratios (against the leader) from their median."""
        leader, deviations = self.leader(), []
        for setting in self.samples:
            ratios = self._ratios(setting, leader) if setting != leader else []
            if len(ratios) > 1:
                middle = statistics.median(ratios)
                deviations += [abs(r - middle) / middle for r in ratios]
        return max(self.noise_floor, statistics.median(deviations) if deviations else 0.0)

    def margin(self, setting: BucketSetting, leader: BucketSetting) -> float:
        """How much slower than ``leader`` (relative) ``setting`` may measure and still be as fast: two standard
        errors of their paired ratio."""
        return 2 * self.noise / math.sqrt(max(len(self._ratios(setting, leader)), 1))

    def best(self) -> BucketSetting:
        """The leader; the preferred candidate where it is not measurably slower: within ``tolerance`` of the
        leader, within the noise (:meth:`margin`), or no slower by the medians (the two measures disagree). A
        preferred candidate dropped earlier (slower than the leader then) is still chosen over a final leader that
        is no faster than it in the rounds both ran."""
        leader, preferred = self.leader(), self.preferred
        if preferred is None or preferred == leader:
            return leader
        if preferred in self.live:
            if self.ratio(preferred, leader) <= 1 + self.tolerance or not self._slower(preferred, leader):
                return preferred
        elif self._ratios(preferred, leader) and self.ratio(preferred, leader) <= 1:
            return preferred
        return leader

    def _slower(self, setting: BucketSetting, leader: BucketSetting) -> bool:
        """Measurably slower than ``leader``: paired by more than the noise, and by the medians (never when they
        share no round: not measured is not slower)."""
        if setting != leader and not self._ratios(setting, leader):
            return False
        paired = self.ratio(setting, leader) > 1 + self.margin(setting, leader)
        return paired and self.median(setting) > self.median(leader)

    def _end_round(self) -> None:
        self.round += 1
        if self.round == 1 and self.round < self.min_rounds:
            leader = self.leader()  # one sample each: the default is not dropped on it
            margin = 1 + self.first_round_margin
            self.live = [c for c in self.live if c == self.preferred or self.ratio(c, leader) <= margin]
        if self.round >= self.min_rounds or len(self.live) == 1:
            leader = self.leader()
            self.live = [c for c in self.live if not self._slower(c, leader)]
            close = all(self.ratio(c, leader) <= 1 + self.tolerance for c in self.live)
            if len(self.live) == 1 or close or self.round >= self.max_rounds:
                self.winner = self.best()
                return
        order = self.live if self.round % 2 == 0 else list(reversed(self.live))
        self._queue = list(order)


# ---------------------------------------------------------------------------------------------------- cache


def cache_key(
    parameters: Iterable[torch.Tensor],
    world_size: int,
    device_type: str,
    backend: str,
    extra: dict[str, Any] | None = None,
) -> str:
    """A hash of what determines the best bucket size: the shapes and dtypes of the parameters that get
    gradients, in registration order (DDP's bucket order follows it), world size, device type, backend, torch
    version, and ``extra`` (the communication hook, the search space)."""
    layout = [[list(p.shape), str(p.dtype)] for p in parameters if p.requires_grad]
    described = {
        "parameters": layout,
        "world_size": world_size,
        "device_type": device_type,
        "backend": backend,
        "torch": torch.__version__,
        "extra": extra or {},
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


class NotACacheError(ValueError):
    """A file that is not an autotune cache: it is neither read nor overwritten."""


def read_cache(path: Path) -> dict[str, Any]:
    """The entries of the autotune cache at ``path``: {} where there is no file or an empty one. Raises
    :class:`NotACacheError` for a file that is not a cache (not JSON, or not an object whose values are entries
    with a ``bucket_cap_mb``): such a file is someone else's, and is not overwritten."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    except UnicodeDecodeError:
        raise NotACacheError("not text") from None
    if not text.strip():
        return {}
    try:
        entries = json.loads(text)
    except ValueError:
        raise NotACacheError("not JSON") from None
    if not isinstance(entries, dict) or not all(
        isinstance(entry, dict) and "bucket_cap_mb" in entry for entry in entries.values()
    ):
        raise NotACacheError("JSON, but not an object of tuned settings each with a `bucket_cap_mb`")
    return entries


def check_cache_file(name: str, cache: str | os.PathLike | bool) -> Path:
    """Refuse an ``autotune_cache`` that cannot be written, or an existing file that is not a cache (it would be
    overwritten); True stands for :data:`DEFAULT_CACHE_PATH`. Returns the path."""
    path = DEFAULT_CACHE_PATH if cache is True else None
    expected = "a writable file path, or False (no cache)"
    path = check_writable_file(name, cache, path, replaced=True, expected=expected)
    given = f"`{name}`={cache!r}" + (f" ({path})" if cache is True else "")
    try:
        read_cache(path)
    except NotACacheError as reason:
        raise ValueError(
            f"{given} is not an autotune cache ({reason}), and it is not overwritten: expected the path of a new "
            "file, of an empty one or of a cache lightning_shardplus wrote, or False (no cache)."
        ) from None
    except OSError as error:
        raise ValueError(f"{given} cannot be read ({error}): expected {expected}.") from None
    return path


def load_cached(path: Path, key: str) -> dict[str, Any] | None:
    """The cached entry of ``key`` as stored (see :func:`cached_setting`), or None (no file, no entry, or a file
    that cannot be read or is not a cache)."""
    try:
        return read_cache(Path(path).expanduser()).get(key)
    except (OSError, NotACacheError):
        return None


def cached_setting(entry: dict[str, Any]) -> BucketSetting:
    """The setting of a cache or checkpoint entry; ValueError, saying what is wrong, when it is not one DDP takes
    (the file may have been edited by hand)."""
    cap, first = entry.get("bucket_cap_mb"), entry.get("first_bucket_mb")
    for name, value in (("bucket_cap_mb", cap), ("first_bucket_mb", first)):
        if (value is not None or name == "bucket_cap_mb") and not is_bucket_size(value):
            optional = " or null" if name == "first_bucket_mb" else ""
            raise ValueError(f"`{name}`: {value!r}, expected {BUCKET_SIZE_RANGE}{optional}")
    return BucketSetting(float(cap), None if first is None else float(first))


CHECKPOINT_KEY = "shardplus_tensor_fusion"


def checkpoint_entry(result: FusionResult | None, key: str | None) -> dict[str, Any] | None:
    """What the strategy stores under ``checkpoint[CHECKPOINT_KEY]``: a finished tuning's setting and the key it
    holds for, so that a resumed run goes on with it instead of searching again (None while tuning)."""
    if result is None or not result.complete or key is None:
        return None
    return {"cache_key": key, **result.cache_entry()}


def store_cached(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add ``entry`` under ``key`` to the JSON cache file (written whole to a temporary file, then renamed).
    Raises :class:`NotACacheError` (and leaves the file alone) when the file is not a cache."""
    path = Path(path).expanduser()
    entries = read_cache(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    entries[key] = entry
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------- autotuner


@dataclass
class FusionResult:
    """What tuning decided (or found in the cache), and what it measured."""

    setting: BucketSetting
    step_s: float | None = None  # the chosen setting's median step time
    default_step_s: float | None = None  # the reference's: DDP's default or the user's size (None: not measured)
    tuning_steps: int = 0
    tuning_s: float = 0.0  # wall time of the tuning steps, re-wraps included
    from_cache: bool = False  # known without a search: from the cache, or from the checkpoint resumed
    source: str = "the autotune cache"
    complete: bool = True
    paired_gain: float | None = None  # the default's step time / the chosen one's, paired round by round
    reference: str = DDP_DEFAULT_LABEL  # what the default is: DDP's own, or the user's bucket size

    @property
    def gain(self) -> float | None:
        """Default step time / chosen step time (1.10: 10% more steps per second): paired within rounds where
        measured so, else the ratio of the medians."""
        if self.paired_gain is not None and math.isfinite(self.paired_gain):
            return self.paired_gain
        if not self.step_s or not self.default_step_s:
            return None
        return self.default_step_s / self.step_s

    @property
    def chosen(self) -> str:
        """The setting, in words."""
        return DDP_DEFAULT_LABEL if self.setting == DDP_DEFAULT else f"bucket {self.setting.label}"

    def summary(self) -> str:
        """One readable line: chosen size, its step time, the default's, the gain."""
        if self.from_cache:
            return f"shardplus: tensor fusion: {self.chosen} from {self.source} (no search)"
        chosen = f"{1000 * self.step_s:.2f} ms/step (median)" if self.step_s else "unmeasured"
        default = (
            f"{1000 * self.default_step_s:.2f} ms/step at {self.reference}"
            if self.default_step_s
            else f"{self.reference} not measured"
        )
        paired = " (paired round by round)" if self.paired_gain is not None else ""
        gain = f", {100 * (self.gain - 1):+.1f}% steps/s while tuning{paired}" if self.gain else ""
        status = "" if self.complete else " (training ended before the search did: best so far, not cached)"
        return (
            f"shardplus: tensor fusion tuned: {self.chosen}: {chosen} vs {default}{gain}; "
            f"{self.tuning_steps} tuning steps{status}"
        )

    def metrics(self) -> dict[str, float]:
        """For the Lightning logger."""
        values = {"fusion/bucket_cap_mb": self.setting.bucket_cap_mb}
        if self.setting.first_bucket_mb is not None:
            values["fusion/first_bucket_mb"] = self.setting.first_bucket_mb
        if self.step_s:
            values["fusion/step_ms"] = 1000 * self.step_s
        if self.default_step_s:
            values["fusion/default_step_ms"] = 1000 * self.default_step_s
        if self.gain:
            values["fusion/gain"] = self.gain
        return values

    def cache_entry(self) -> dict[str, Any]:
        return {
            "bucket_cap_mb": self.setting.bucket_cap_mb,
            "first_bucket_mb": self.setting.first_bucket_mb,
            "step_ms": None if self.step_s is None else 1000 * self.step_s,
            "default_step_ms": None if self.default_step_s is None else 1000 * self.default_step_s,
            "tuning_steps": self.tuning_steps,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }


@dataclass
class Collectives:
    """The two collectives the autotuner needs, so that tests can run it in one process."""

    is_decider: bool = True  # rank 0
    reduce_max: Callable[[float], float] = lambda value: value
    broadcast: Callable[[list[float]], list[float]] = lambda values: values

    @classmethod
    def torch_distributed(cls, device: torch.device) -> Collectives:
        """MAX all_reduce and broadcast from rank 0 over the default process group, on ``device``."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls()

        def reduce_max(value: float) -> float:
            tensor = torch.tensor([value], dtype=torch.float64, device=device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            return float(tensor.item())

        def broadcast(values: list[float]) -> list[float]:
            tensor = torch.tensor(values, dtype=torch.float64, device=device)
            dist.broadcast(tensor, src=0)
            return tensor.tolist()

        return cls(dist.get_rank() == 0, reduce_max, broadcast)


@dataclass
class _Sample:
    setting: BucketSetting
    first_step: int
    warmup_left: int
    intervals: list[float] = field(default_factory=list)


class FusionAutotuner:
    """Runs the search at optimizer-step boundaries; the strategy applies the settings it returns.

    Call :meth:`start` once DDP is wrapped with :attr:`initial_setting`, then :meth:`on_step_boundary` at the
    start of every optimizer step on every rank (``counted=False`` when the step that just ended spans an epoch
    end or a validation), and :meth:`interrupt` before anything that is not a training step. When it returns a
    setting, re-wrap DDP with it before the step runs. :attr:`result` is set once tuning is over."""

    def __init__(
        self,
        settings: AutotuneSettings,
        collectives: Collectives | None = None,
        log_path: str | os.PathLike | None = None,
        cache_path: str | os.PathLike | None = None,
        cache_key: str | None = None,
        gradient_bytes: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        checkpointed: dict[str, Any] | None = None,
        layout: Callable[[BucketSetting], Any] | None = None,
        gradient_tensors: int | None = None,
    ) -> None:
        if settings.candidates_mb is None and settings.fixed_bucket_cap_mb is None:
            raise ValueError("FusionAutotuner: the default candidates depend on the model: settings.for_model() first")
        self.settings = settings
        self.gradient_tensors = gradient_tensors  # parameter tensors with gradients, for the reason of no search
        self.collectives = collectives or Collectives()
        self.log_path = None if log_path is None else Path(log_path).expanduser()
        self.cache_path = None if cache_path is None else Path(cache_path).expanduser()
        self.cache_key = cache_key
        self.gradient_bytes = gradient_bytes
        self.clock = clock
        self.checkpointed = checkpointed
        self.layout = layout  # a setting's buckets for this model (bucket_layout): equal layouts are raced once
        self.merged: dict[BucketSetting, list[BucketSetting]] = {}  # a raced candidate: those it stands for
        self.result: FusionResult | None = None
        self.samples_taken = 0
        self._race: CandidateRace | None = None
        self._first_stage: CandidateRace | None = None
        self._sample: _Sample | None = None
        self._last_boundary: float | None = None
        self._steps = 0
        self._started_at = 0.0
        self.initial_setting = self._lookup_cache()
        if self.result is not None:  # nothing to race: the log says why
            self._log_no_search(self.result)

    # -- cache

    def _lookup_cache(self) -> BucketSetting:
        """The setting to wrap DDP with first: the one of the checkpoint being resumed, or the cached one (tuning
        is then over), else the first candidate. Rank 0 looks and broadcasts what it found."""
        found = [0.0, 0.0, -1.0]  # (0: nothing, 1: cache, 2: checkpoint), bucket size, first bucket or -1
        if self.collectives.is_decider and self.cache_key is not None:
            candidates = []
            if (self.checkpointed or {}).get("cache_key") == self.cache_key:
                candidates.append((self.checkpointed, 2.0, "the checkpoint resumed"))
            if self.cache_path is not None:
                candidates.append((load_cached(self.cache_path, self.cache_key), 1.0, f"the cache {self.cache_path}"))
            for entry, where, source in candidates:
                if entry is None:
                    continue
                try:
                    setting = cached_setting(entry)
                except ValueError as reason:  # a hand-edited file; checked here, on rank 0, before the broadcast
                    rank_zero_warn(
                        f"shardplus: the tuned bucket setting in {source} for this setup is not valid ({reason}): it "
                        "is ignored and the bucket size is searched again."
                    )
                    continue
                found = [where, setting.bucket_cap_mb, _encode_first(setting)]
                break
        where, cap, first = self.collectives.broadcast(found)
        if where:
            setting = BucketSetting(cap, None if first < 0 else first)
            source = "the checkpoint resumed" if where == 2.0 else "the autotune cache"
            self.result = FusionResult(setting, from_cache=True, source=source)
            return setting
        reference = self.settings.reference
        # equal layouts: raced as DDP's default where it is among them, else as the uniform 25 MB
        preferred = (reference, BucketSetting(DEFAULT_BUCKET_CAP_MB))
        stage, self.merged = merge_equivalent(self.settings.first_stage, self.layout, preferred)
        if len(stage) > 1:
            self._first_stage = self._race = self._new_race(stage, preferred=reference)
        else:  # the user's size, or one layout for every candidate: only the first bucket is left to race
            chosen = stage[0] if stage else reference
            self._race = self.second_stage(chosen)
            if self._race is None:  # nothing to search
                source = (
                    "`tensor_fusion_threshold_mb` (no first bucket to race)"
                    if not stage
                    else "the candidates, which all give this model the same buckets"
                    + (" (it has one parameter tensor)" if self.gradient_tensors == 1 else "")
                )
                self.result = FusionResult(chosen, from_cache=True, source=source)
                return self.result.setting
        return self._race.live[0]

    def _new_race(self, candidates: list[BucketSetting], preferred: BucketSetting) -> CandidateRace:
        settings = self.settings
        return CandidateRace(
            candidates,
            settings.min_rounds,
            settings.max_rounds,
            settings.noise_floor,
            preferred=preferred,
            first_round_margin=settings.first_round_margin,
            tolerance=settings.tolerance,
        )

    def second_stage(self, chosen: BucketSetting, raced: Iterable[BucketSetting] = ()) -> CandidateRace | None:
        """``chosen`` against the first buckets of its size that the first stage did not race (``raced``; nor one
        with the same buckets): it stays unless one is measurably faster. None when there is nothing to race."""
        layout = self.layout or (lambda setting: setting)
        already = {layout(c) for c in raced if c != chosen}
        candidates = [c for c in self.settings.second_stage(chosen) if c == chosen or layout(c) not in already]
        stage, merged = merge_equivalent(candidates, self.layout, (chosen,))
        for kept, others in merged.items():
            listed = self.merged.setdefault(kept, [])
            listed.extend(other for other in others if other not in listed)
        return self._new_race(stage, preferred=chosen) if len(stage) > 1 else None

    # -- driving

    @property
    def tuning(self) -> bool:
        return self.result is None

    @property
    def stage(self) -> str:
        """``"bucket"`` while the bucket size is raced, ``"first_bucket"`` while the first bucket is."""
        return "bucket" if self._race is self._first_stage else "first_bucket"

    @property
    def measuring(self) -> BucketSetting | None:
        """The setting the sample in progress measures (None when not tuning)."""
        return self._sample.setting if self.tuning and self._sample is not None else None

    @property
    def sample_intervals(self) -> list[float]:
        """The step times counted so far in the sample in progress (warm-up steps are not counted)."""
        return list(self._sample.intervals) if self._sample is not None else []

    @property
    def candidates(self) -> list[BucketSetting]:
        """The settings raced now (the first stage's while it runs)."""
        return list(self._race.live) if self._race is not None else []

    def start(self, global_step: int = 0) -> None:
        """DDP is wrapped with :attr:`initial_setting`; the first sample starts at the next step boundary."""
        if self.tuning:
            warmup = self.settings.warmup_steps + FIRST_SAMPLE_EXTRA_WARMUP
            self._sample = _Sample(self.initial_setting, global_step, warmup)
            self._started_at = self.clock()
            if self.log_path is not None and self.collectives.is_decider:
                self._write_log_row(CSV_COLUMNS, "w")

    def interrupt(self) -> None:
        """Something other than training steps runs now (validation): the step in progress is not timed."""
        self._last_boundary = None

    def on_step_boundary(self, global_step: int, counted: bool = True) -> BucketSetting | None:
        """An optimizer step starts (the previous one, if any, has ended). Returns the setting to re-wrap DDP
        with before this step, or None to keep the current one."""
        if not self.tuning or self._sample is None:
            return None
        now = self.clock()
        previous, self._last_boundary = self._last_boundary, now
        if previous is None:
            return None  # the first boundary, or after an interruption: nothing ended that can be timed
        self._steps += 1
        sample = self._sample
        if sample.warmup_left > 0:
            sample.warmup_left -= 1
            return None
        if counted:
            sample.intervals.append(now - previous)
        if len(sample.intervals) < self.settings.steps_per_sample:
            return None
        return self._end_sample(global_step)

    def _end_sample(self, global_step: int) -> BucketSetting | None:
        sample = self._sample
        assert sample is not None and self._race is not None
        score = self.collectives.reduce_max(statistics.median(sample.intervals))
        payload = [0.0, 0.0, -1.0]
        if self.collectives.is_decider:
            self._log_row(sample, score)
            self._race.record(sample.setting, score)
            next_setting = self._race.next_setting()
            if next_setting is None and self._race is self._first_stage:
                assert self._race.winner is not None
                self._race = self.second_stage(self._race.winner, self._race.samples) or self._race
                next_setting = self._race.next_setting()
            more = next_setting is not None
            setting = next_setting if next_setting is not None else self._race.winner
            assert setting is not None
            payload = [float(more), setting.bucket_cap_mb, _encode_first(setting)]
        self.samples_taken += 1
        more, cap, first = self.collectives.broadcast(payload)
        setting = BucketSetting(cap, None if first < 0 else first)
        if not more:
            self._finish(setting, complete=True)
        changed = setting != sample.setting
        if more:
            self._sample = _Sample(setting, global_step, self.settings.warmup_steps if changed else 0)
        return setting if changed else None

    def finish_early(self) -> FusionResult | None:
        """Training ends while tuning: the best setting measured so far, rank 0's choice on every rank (a
        broadcast: call it on every rank; not cached)."""
        if self.tuning and self._race is not None:
            best = self._race.best()
            _, cap, first = self.collectives.broadcast([0.0, best.bucket_cap_mb, _encode_first(best)])
            self._finish(BucketSetting(cap, None if first < 0 else first), complete=False)
        return self.result

    def _finish(self, winner: BucketSetting, complete: bool) -> None:
        """Record the result; rank 0 (which holds the timings) caches it."""
        reference = self.settings.reference
        stages = [stage for stage in (self._first_stage, self._race) if stage is not None]
        step_s, default_s, paired_gain = measured_against(stages, winner, reference)
        decider = self.collectives.is_decider
        self.result = FusionResult(
            winner,
            step_s=step_s if decider else None,
            default_step_s=default_s if decider else None,
            tuning_steps=self._steps,
            tuning_s=self.clock() - self._started_at,
            complete=complete,
            paired_gain=paired_gain if decider else None,
            reference=DDP_DEFAULT_LABEL if reference == DDP_DEFAULT else f"the given {reference.label}",
        )
        self._race = self._first_stage = None
        if complete and self.collectives.is_decider and self.cache_path is not None and self.cache_key is not None:
            try:
                store_cached(self.cache_path, self.cache_key, self.result.cache_entry())
            except NotACacheError as reason:  # checked at construction; someone wrote another file there since
                rank_zero_warn(
                    f"shardplus: {self.cache_path} is not an autotune cache ({reason}), and it is not overwritten: "
                    "the tuned setting is used in this run but not cached."
                )
            except OSError as error:  # checked at construction; a file system can change or fill up since
                rank_zero_warn(
                    f"shardplus: could not write the autotune cache {self.cache_path} ({error}): the tuned setting "
                    "is used in this run but not cached."
                )

    def _log_row(self, sample: _Sample, score: float) -> None:
        if self.log_path is None:
            return
        stage = self.stage
        bytes_per_s = self.gradient_bytes / score if score > 0 else 0.0
        row = [
            self.samples_taken,
            stage,
            self._race.round if self._race is not None else "",
            f"{sample.setting.bucket_cap_mb:g}",
            "" if sample.setting.first_bucket_mb is None else f"{sample.setting.first_bucket_mb:g}",
            sample.first_step,
            len(sample.intervals),
            f"{1000 * score:.3f}",
            f"{bytes_per_s:.0f}",
            "",
        ]
        self._write_log_row(row, "a")

    def _log_no_search(self, result: FusionResult) -> None:
        """The log of a run that races nothing: the header and one row, the setting used and why (rank 0)."""
        if self.log_path is None or not self.collectives.is_decider:
            return
        setting = result.setting
        first = "" if setting.first_bucket_mb is None else f"{setting.first_bucket_mb:g}"
        note = f"no search: {result.chosen} from {result.source}"
        self._write_log_row(CSV_COLUMNS, "w")
        if self.log_path is not None:  # still: the header could be written
            self._write_log_row(["", "none", "", f"{setting.bucket_cap_mb:g}", first, "", 0, "", "", note], "a")

    def _write_log_row(self, row: Sequence[Any], mode: str) -> None:
        assert self.log_path is not None
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, mode, newline="") as f:
                csv.writer(f).writerow(row)
        except OSError as error:  # checked at construction; a file system can change or fill up since
            rank_zero_warn(f"shardplus: could not write the autotune log {self.log_path} ({error}): logging stops.")
            self.log_path = None


def measured_against(
    stages: Sequence[CandidateRace], winner: BucketSetting, reference: BucketSetting
) -> tuple[float | None, float | None, float | None]:
    """The winner's and the reference's median step times on one time base (the machine's speed drifts between
    stages and rounds) and reference / winner paired round by round: from the rounds both ran in the last stage
    that raced both; else through the first stage's winner (raced against the reference in the first stage,
    against the winner in the second), the winner's time being its time divided by their paired ratio; else
    what was measured, unpaired (None: not measured)."""
    for stage in reversed(stages):
        mine, theirs = stage.by_round.get(winner, {}), stage.by_round.get(reference, {})
        shared = [r for r in mine if r in theirs]
        if shared:
            times = statistics.median(mine[r] for r in shared), statistics.median(theirs[r] for r in shared)
            return *times, stage.ratio(reference, winner)
    first, second = stages[0], stages[-1]
    chosen = first.winner
    if second is not first and chosen is not None and first.samples.get(reference):
        factor = second.ratio(chosen, winner)  # inf when they share no round
        step, gain = first.median(chosen) / factor, first.ratio(reference, chosen) * factor
        if math.isfinite(gain) and step > 0:
            return step, first.median(reference), gain
    measured = {s: stage.median(s) for stage in stages for s in (winner, reference) if stage.samples.get(s)}
    return measured.get(winner), measured.get(reference), None


def _encode_first(setting: BucketSetting) -> float:
    return -1.0 if setting.first_bucket_mb is None else setting.first_bucket_mb


# ---------------------------------------------------------------------------------------------------- component


class TensorFusion:
    """DDP's bucket setting for one fit: the configured one, or, with ``tune``, the one a :class:`FusionAutotuner`
    chooses by measurement. Owns the search, its cache key, CSV log, summary line and logged result.

    The strategy wraps DDP with :meth:`initial_setting`, calls :meth:`on_train_start` once, :meth:`at_batch_start`
    before every training micro-batch (re-wrapping DDP when it returns a setting), :meth:`interrupt` before
    validation and :meth:`on_train_end`. ``state_dict`` holds a finished tuning's setting, so that a resumed run
    goes on with it instead of searching again.

    Args:
        trainer: the Trainer of the fit (its step counters, and its loggers for the result).
        settings: the search space; ``settings.reference`` is the setting without tuning.
        tune: search (``auto_tune_tensor_fusion``); False: DDP keeps ``settings.reference``.
        log_path / cache: ``autotune_log`` and ``autotune_cache`` (True: :data:`DEFAULT_CACHE_PATH`).
        cache_extra: what else the best setting depends on (communication hook, DDP flags, micro-batches per
            step), beside the parameters, world size, device, backend and torch version.
    """

    def __init__(
        self,
        trainer: Any,
        settings: AutotuneSettings,
        *,
        tune: bool = False,
        log_path: str | os.PathLike | None = None,
        cache: str | os.PathLike | bool = True,
        cache_extra: dict[str, Any] | None = None,
    ) -> None:
        self.trainer, self.settings, self.tune, self.log_path = trainer, settings, tune, log_path
        self.cache_path = DEFAULT_CACHE_PATH if cache is True else (cache or None)
        self.cache_extra = dict(cache_extra or {})
        self.tuner: FusionAutotuner | None = None
        self._checkpointed: dict[str, Any] | None = None  # the tuned setting of a checkpoint being resumed
        self._reported = False

    @property
    def result(self) -> FusionResult | None:
        """What tuning decided (None without tuning, or while it measures)."""
        return None if self.tuner is None else self.tuner.result

    @property
    def tuning(self) -> bool:
        """Whether the search is still measuring (DDP may be re-wrapped at the next optimizer step)."""
        return self.tuner is not None and self.tuner.tuning

    def initial_setting(
        self, module: torch.nn.Module, world_size: int, device: torch.device, backend: str
    ) -> BucketSetting:
        """The setting to wrap DDP with first: the checkpoint's or the cached tuned one, else the first to measure
        (a broadcast from rank 0 when tuning: call it on every rank)."""
        if not self.tune:
            return self.settings.reference
        parameters = [p for p in module.parameters() if p.requires_grad]
        # the default candidates are the model's; the key holds the sizes raced, so that a result found among
        # other candidates (another default) is not taken for this search's
        self.settings = self.settings.for_model(parameters)
        extra = {"search": self.settings.describe(), **self.cache_extra}
        key = cache_key(parameters, world_size, device.type, backend, extra)
        self.tuner = FusionAutotuner(
            self.settings,
            Collectives.torch_distributed(device),
            log_path=self.log_path,
            cache_path=self.cache_path,
            cache_key=key,
            gradient_bytes=sum(p.numel() * p.element_size() for p in parameters),
            checkpointed=self._checkpointed,
            # with find_unused_parameters DDP keeps its first-iteration buckets (other cuts): no merging then
            layout=None if self.cache_extra.get("find_unused_parameters") else _partial_layout(parameters),
            gradient_tensors=len(parameters),
        )
        return self.tuner.initial_setting

    def on_train_start(self) -> None:
        """Start measuring, or report the setting found without a search."""
        tuner = self.tuner
        if tuner is None:
            return
        if not tuner.tuning:
            self._report()
            return
        tuner.start(self.trainer.global_step)
        raced = tuner.candidates or [self.settings.reference]
        same = "".join(
            f"; {', '.join(_merged_label(o, kept) for o in others)}: the same buckets as {kept.label} for this model"
            for kept, others in tuner.merged.items()
        )
        rank_zero_info(
            f"shardplus: tuning the tensor-fusion bucket size among {', '.join(s.label for s in raced)}{same}: at "
            f"most {self.settings.max_tuning_steps} optimizer steps"
        )
        total = self.trainer.estimated_stepping_batches
        if math.isfinite(total) and total < self.settings.max_tuning_steps:
            rank_zero_warn(
                f"shardplus: this run has {int(total)} optimizer steps, tensor-fusion tuning may take up to "
                f"{self.settings.max_tuning_steps}: it may end before tuning does (then nothing is cached). Give fewer "
                "`autotune_candidates_mb` or a smaller `autotune_steps_per_sample`."
            )

    def at_batch_start(self, batch_idx: int) -> BucketSetting | None:
        """A training micro-batch starts: at an optimizer-step boundary while tuning, time the step that ended;
        returns the setting to re-wrap DDP with before this step (a collective then: every rank gets it)."""
        tuner = self.tuner
        if tuner is None or not tuner.tuning or batch_idx % self.trainer.accumulate_grad_batches:
            return None  # inside an aggregation window: DDP is re-wrapped only between optimizer steps
        # the step that ended at an epoch's first batch spans the epoch end: not timed
        setting = tuner.on_step_boundary(self.trainer.global_step, counted=batch_idx > 0)
        if not tuner.tuning:
            self._report()
        return setting

    def interrupt(self) -> None:
        """Something other than a training step runs now (validation): the step in progress is not timed."""
        if self.tuner is not None:
            self.tuner.interrupt()

    def on_train_end(self) -> None:
        """Training ends while tuning: the best setting so far (a broadcast: every rank), not cached."""
        if self.tuner is not None and self.tuner.tuning:
            self.tuner.finish_early()
            self._report()

    def _report(self) -> None:
        """The summary line, and the result to the Lightning loggers (rank 0, which holds the timings)."""
        result = self.result
        if result is None or self._reported:
            return
        self._reported = True
        where = []
        if self.log_path:
            where.append(f"{'why' if result.from_cache else 'samples'} in {self.log_path}")
        if self.tuner is not None and self.tuner.cache_path is not None and result.complete:
            if result.source == "the autotune cache":
                where.append(f"cache {self.tuner.cache_path}")
        rank_zero_info(result.summary() + (f" ({'; '.join(where)})" if where else ""))
        if self.trainer.is_global_zero:
            for logger in self.trainer.loggers:
                logger.log_metrics(result.metrics(), step=self.trainer.global_step)

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.tuner is None else checkpoint_entry(self.result, self.tuner.cache_key)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._checkpointed = state


def _partial_layout(parameters: list[torch.Tensor]) -> Callable[[BucketSetting], Any]:
    return lambda setting: bucket_layout(parameters, setting)
