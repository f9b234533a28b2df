"""``--sampler``: rank 0's PaddedShardSampler beside torch's DistributedSampler, in this process, without training:
time to the first index, indices/s while iterating, peak resident memory."""

from __future__ import annotations

import argparse
import gc
import itertools
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from torch.utils.data import DistributedSampler

from lightning_shardplus.bench.runner import report_settings
from lightning_shardplus.data.sharding import PaddedShardSampler

SAMPLER_SIZES = (10**6, 10**8, 10**9, 10**12)


class _Length:
    """A dataset of a given length that holds nothing (all the samplers ask for)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length


def _proc_status_kib(field: str) -> int | None:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM); None where there is none."""
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", open("/proc/self/status").read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _reset_peak_rss() -> bool:
    """Reset this process's peak resident set size (VmHWM) to the current one (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        return True
    except OSError:
        return False


def measure_sampler(make: Callable[[], Iterable[int]], indices: int) -> dict[str, Any]:
    """Time to the first index (construction and ``iter`` included), indices/s over the next ``indices - 1`` and
    over the whole pass (first index included), and the peak resident memory above the level before (None where
    /proc cannot tell)."""
    gc.collect()
    resettable = _reset_peak_rss()
    before = _proc_status_kib("VmRSS")
    start = time.perf_counter()
    iterator = iter(make())
    next(iterator)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    rest = sum(1 for _ in itertools.islice(iterator, indices - 1))
    seconds = time.perf_counter() - start
    peak = _proc_status_kib("VmHWM")
    del iterator
    gc.collect()
    return {
        "first_index_ms": first_s * 1e3,
        "indices_per_s": rest / seconds if rest else None,
        # the rank's indices over the whole pass, construction and first index included (torch builds its list then)
        "indices_per_s_with_setup": (rest + 1) / (first_s + seconds),
        "indices_timed": rest,
        "peak_memory_mb": (peak - before) / 1024 if resettable and peak is not None and before is not None else None,
    }


def run_sampler(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--sampler`` rows: shardplus's sampler for every length, torch's DistributedSampler where it fits."""
    rows = []
    world = args.devices
    for length in args.sampler_sizes:
        indices = max(1, min(args.sampler_indices, length // world))
        makers: list[tuple[str, Callable[[], Iterable[int]]]] = [
            ("shardplus PaddedShardSampler", lambda n=length: PaddedShardSampler(n, world, 0, seed=0)),
        ]
        if length <= args.torch_max_length:
            makers.append(
                ("torch DistributedSampler", lambda n=length: DistributedSampler(_Length(n), world, 0, seed=0))
            )
        for name, make in makers:
            rows.append({"sampler": name, "length": length, "num_replicas": world, **measure_sampler(make, indices)})
    return {"settings": report_settings(args), "sampler_rows": rows}
