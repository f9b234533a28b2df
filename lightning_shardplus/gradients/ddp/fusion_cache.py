"""The autotune cache of tensor fusion: one JSON file of tuned bucket settings, each under a hash of what the best
setting depends on (parameter shapes, world size, device, backend, torch); docs/fusion-autotuning.md."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_shardplus.validation import check_writable_file


def default_cache_path() -> Path:
    """``$XDG_CACHE_HOME/lightning_shardplus/fusion.json``; ``~/.cache/...`` where it is unset, empty or relative."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path("~/.cache").expanduser()
    return root / "lightning_shardplus" / "fusion.json"


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo or the platform module tells it."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else platform.machine()


def device_model(device: torch.device) -> str:
    """The model of ``device`` for the cache key: the GPU's name, the CPU's, else the device type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model() if device.type == "cpu" else device.type


def cache_key(
    parameters: Iterable[torch.Tensor], world_size: int, device_type: str, backend: str, extra: dict | None = None
) -> str:
    """A hash of what the best setting depends on: parameter shapes, dtypes, world, device, backend, torch."""
    layout = [[list(p.shape), str(p.dtype)] for p in parameters if p.requires_grad]
    described = {"parameters": layout, "world_size": world_size, "device_type": device_type, "backend": backend,
                 "torch": torch.__version__, "extra": extra or {}}  # fmt: skip
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


class NotACacheError(ValueError):
    """A file that is not an autotune cache: it is neither read nor overwritten."""


def read_cache(path: Path) -> dict[str, Any]:
    """The entries of the cache at ``path`` ({} for none); :class:`NotACacheError` for a file that is not a cache."""
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        return {}
    try:
        entries = json.loads(text) if text.strip() else {}
    except ValueError:  # a UnicodeDecodeError too
        raise NotACacheError("not JSON") from None
    if not isinstance(entries, dict) or not all(isinstance(e, dict) and "bucket_cap_mb" in e for e in entries.values()):
        raise NotACacheError("JSON, but not an object of tuned settings each with a `bucket_cap_mb`")
    return entries


def check_cache_file(name: str, cache: str | os.PathLike | bool) -> Path:
    """The path of ``autotune_cache`` (True: the default), refused if not writable or an existing non-cache file."""
    expected = "a writable file path, or False (no cache)"
    path = check_writable_file(name, cache, default_cache_path() if cache is True else None, replaced=True,
                               expected=expected)  # fmt: skip
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


def store_cached(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add ``entry`` under ``key`` (written beside, then renamed); :class:`NotACacheError` when it is not a cache."""
    entries = read_cache(path) | {key: entry}
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
