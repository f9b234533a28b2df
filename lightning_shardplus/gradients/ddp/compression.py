"""Gradient compression: ``gradient_compression`` -> a DDP communication hook (+ its state), on every device type.
``"fp16"``/``"bf16"``: torch's cast hooks; ``"powersgd"``: torch's ``powerSGD_hook``, its state kept per parameter
across bucket re-cuts and saved per rank beside checkpoints, its buckets serialized off NCCL (docs/compression.md)."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from os import PathLike
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

GradientCompression = Literal["none", "fp16", "bf16", "powersgd"]
GRADIENT_COMPRESSIONS: tuple[str, ...] = ("none", "fp16", "bf16", "powersgd")

# Steps of plain all-reduce before PowerSGD starts compressing (torch's default is 1000; it must be >= 2).
DEFAULT_POWERSGD_START_ITER = 10

_STATE_FORMAT = 1


def shardplus_bf16_compress_hook(process_group, bucket):  # no annotations: DDP checks them against its types
    """torch's ``bf16_compress_hook`` under another name (DDP refuses the original by name on builds without
    CUDA and NCCL, whatever the backend); registered only on backends that all-reduced bfloat16 at setup."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def build_compression(name: str, ddp_comm_state: object | None = None) -> CastCompression | PowerSGDCompression | None:
    """The compression object for ``name`` (None for ``"none"``), with fresh state for one fit."""
    if name not in GRADIENT_COMPRESSIONS:
        raise ValueError(f"`gradient_compression`={name!r} is not valid: expected one of {GRADIENT_COMPRESSIONS}.")
    if name == "powersgd":
        return PowerSGDCompression(ddp_comm_state if isinstance(ddp_comm_state, PowerSGDState) else None)
    return None if name == "none" else CastCompression(name, torch.float16 if name == "fp16" else torch.bfloat16)


class CastCompression:
    """``"fp16"`` / ``"bf16"``: all-reduce the gradient bucket in a 16-bit float type. Stateless."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype

    def check_backend(self, backend: str, device: torch.device) -> None:
        """Fail now, on every rank alike, if the backend cannot all-reduce this type (never at the first
        backward). NCCL is left to torch's own check when the hook is registered."""
        if backend == "nccl":
            return
        try:
            dist.all_reduce(torch.zeros(1, dtype=self.dtype, device=device))
        except Exception as err:  # the backend's own error is quoted in ours
            others = "'fp16', 'none' or 'powersgd'" if self.name == "bf16" else "'none' or 'powersgd'"
            raise ValueError(
                f"`gradient_compression`={self.name!r} cannot work on the {backend!r} process-group backend: "
                f"it cannot all-reduce {self.dtype} tensors ({type(err).__name__}: {err}). Use {others}, or "
                "a backend that supports it."
            ) from err

    def hook_for(self, model: DistributedDataParallel, backend: str) -> tuple[Callable, object]:
        bf16 = default_hooks.bf16_compress_hook if backend == "nccl" else shardplus_bf16_compress_hook
        return (default_hooks.fp16_compress_hook if self.dtype == torch.float16 else bf16), None

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_checkpoint_entry(self, entry: dict[str, Any], own: dict[str, Any] | None, unusable: str) -> None:
        pass


def _quiet_wait(future: torch.futures.Future) -> None:
    with contextlib.suppress(Exception):  # its error reaches DDP, which waits on the same future
        future.wait()


class PowerSGDCompression:
    """``"powersgd"``: torch's ``powerSGD_hook``, safe on gloo with several buckets, its state kept per parameter.
    ``template``: a ``PowerSGDState`` whose settings and generator are copied (None: the default)."""

    name = "powersgd"

    def __init__(self, template: PowerSGDState | None = None) -> None:
        self.state = _fresh_state(template)
        self._names: dict[int, str] = {}  # id(parameter) -> name, for the registered DDP wrapper
        self._shapes: dict[str, torch.Size] = {}
        self._layout: dict[int, tuple[str, ...]] = {}  # bucket index -> its parameter names, as last seen
        self._loose: dict[str, dict[str, torch.Tensor]] = {}  # name -> {"error"|"p"|"q": piece} not in a bucket
        self._serialize, self._previous, self._round = True, None, []  # (see `hook`)

    def check_backend(self, backend: str, device: torch.device) -> None:
        pass

    def hook_for(self, model: DistributedDataParallel, backend: str) -> tuple[Callable, object]:
        """Start following ``model``, a new DDP wrapper (its bucket layout is found at its first backward)."""
        named = [(name, p) for name, p in model.module.named_parameters() if p.requires_grad]
        self._names = {id(p): name for name, p in named}
        self._shapes = {name: p.shape for name, p in named}
        self._serialize, self._previous, self._round = backend != "nccl", None, []
        return self.hook, self.state

    def hook(self, state, bucket):  # no annotations: DDP checks them against its types
        """``powerSGD_hook`` after waiting for the previous bucket (not on NCCL) and re-cutting the state to DDP's
        bucket layout where it changed."""
        if self._serialize and self._previous is not None:
            previous, self._previous = self._previous, None
            _quiet_wait(previous)
        index = bucket.index()
        names = tuple(self._names.get(id(p), f"<unnamed {id(p)}>") for p in bucket.parameters())
        if self._layout.get(index) != names:
            if index in self._layout:  # DDP re-cut its buckets (or was re-wrapped): re-cut the state too
                for future in self._round:
                    _quiet_wait(future)
                self._dissolve()
            self._assemble(index, names, bucket.buffer())
            self._layout[index] = names
        future = powerSGD_hook(state, bucket)
        if bucket.is_last():
            self._previous, self._round = None, []
        else:
            self._previous = future
            self._round.append(future)
        return future

    def _numel(self, name: str) -> int:
        return int(torch.Size(self._shapes[name]).numel())

    def _compressed(self, names: tuple[str, ...]) -> tuple[list[str], dict[str, tuple[int, int]]]:
        """The order of the compressed matrices in a bucket's P/Q memory and their P and Q lengths, as
        ``powerSGD_hook`` lays them out: grouped by matrix shape in order of first appearance."""
        rank = self.state.matrix_approximation_rank
        groups: dict[tuple[int, int], list[str]] = {}
        lengths: dict[str, tuple[int, int]] = {}
        for name in names:
            shape = self._shapes.get(name)
            if shape is None or len(shape) == 0 or shape[0] == 0:
                continue
            n = int(shape[0])
            m = self._numel(name) // n
            r = min(n, m, rank)
            if (n + m) * r * self.state.min_compression_rate < n * m:
                groups.setdefault((n, m), []).append(name)
                lengths[name] = (n * r, m * r)
        return [name for group in groups.values() for name in group], lengths

    def _layouts(self, names: tuple[str, ...]) -> list[tuple[str, dict, list[tuple[str, int]]]]:
        """Per kind of state (error feedback, P, Q): its dict in PowerSGD's state and the (name, length) pieces a
        bucket of ``names`` holds in it, in order; no pieces where a name is unknown."""
        known = bool(names) and all(name in self._shapes for name in names)
        order, lengths = self._compressed(names) if known else ([], {})
        return [
            ("error", self.state.error_dict, [(name, self._numel(name)) for name in names] if known else []),
            ("p", self.state.p_memory_dict, [(name, lengths[name][0]) for name in order]),
            ("q", self.state.q_memory_dict, [(name, lengths[name][1]) for name in order]),
        ]

    def _split(self, index: int, names: tuple[str, ...], pop: bool) -> dict[str, dict[str, torch.Tensor]]:
        """Bucket ``index``'s error, P and Q memory cut into per-parameter pieces (copies)."""
        pieces: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
        for key, memory, layout in self._layouts(names):
            tensor = memory.pop(index, None) if pop else memory.get(index)
            sizes = [size for _, size in layout]
            if layout and tensor is not None and tensor.numel() == sum(sizes):
                for (name, _), piece in zip(layout, tensor.split(sizes), strict=True):
                    pieces[name][key] = piece.detach().clone()
        return pieces

    def _dissolve(self) -> None:
        for index, names in list(self._layout.items()):
            for name, parts in self._split(index, names, pop=True).items():
                self._loose.setdefault(name, {}).update(parts)
        self._layout.clear()

    def _assemble(self, index: int, names: tuple[str, ...], buffer: torch.Tensor) -> None:
        """Put the loose pieces of ``names`` together as bucket ``index``'s state, where all are there."""
        parts = dict(zip(names, [self._loose.pop(name, {}) for name in names], strict=True))
        if not any(parts.values()):
            return
        for key, memory, layout in self._layouts(names):
            pieces = [parts[name].get(key) for name, _ in layout]
            if layout and all(p is not None and p.numel() == n for p, (_, n) in zip(pieces, layout, strict=True)):
                memory[index] = torch.cat([p.reshape(-1) for p in pieces]).to(buffer.device, buffer.dtype)
        if (index in self.state.p_memory_dict) != (index in self.state.q_memory_dict):
            self.state.p_memory_dict.pop(index, None)  # warm start needs both, else PowerSGD starts afresh
            self.state.q_memory_dict.pop(index, None)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, independent of DDP's buckets: per-parameter error feedback and P/Q pieces (CPU), the
        step counter, the random generator (plain types and tensors: ``torch.load(weights_only=True)`` reads it)."""
        params = {name: {k: v.detach().cpu().clone() for k, v in parts.items()} for name, parts in self._loose.items()}
        for index, names in self._layout.items():
            for name, parts in self._split(index, names, pop=False).items():
                params.setdefault(name, {}).update({key: piece.cpu() for key, piece in parts.items()})
        _, keys, pos, has_gauss, cached_gaussian = self.state.rng.get_state()
        return {
            "format": _STATE_FORMAT,
            "iter": int(self.state.iter),
            "rng": {"keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},  # fmt: skip
            "stats": [int(getattr(self.state, name)) for name in _STATS],
            "matrix_approximation_rank": int(self.state.matrix_approximation_rank),
            "params": {name: parts for name, parts in params.items() if parts},
        }

    def load_state_dict(self, saved: dict[str, Any], keep_error_feedback: bool = True) -> None:
        """Continue from ``saved`` (:meth:`state_dict`); pieces put into DDP's buckets at the first backward, those
        that no longer fit (another approximation rank, another model) dropped: those buckets start afresh."""
        if saved.get("format") != _STATE_FORMAT:
            raise ValueError(f"unknown PowerSGD state format {saved.get('format')!r} (expected {_STATE_FORMAT})")
        self.state.iter = int(saved["iter"])
        rng = saved["rng"]
        keys = rng["keys"].numpy().astype(np.uint32)
        self.state.rng.set_state(("MT19937", keys, rng["pos"], rng["has_gauss"], rng["cached_gaussian"]))
        for name, value in zip(_STATS, saved["stats"], strict=True):
            setattr(self.state, name, value)
        for memory in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            memory.clear()
        self._layout.clear()
        self._loose = {
            name: {key: piece for key, piece in parts.items() if keep_error_feedback or key != "error"}
            for name, parts in saved["params"].items()
        }

    def load_checkpoint_entry(self, entry: dict[str, Any], own: dict[str, Any] | None, unusable: str) -> None:
        """Continue from a checkpoint entry and this rank's own state (None where unusable, ``unusable`` says why)."""
        if own is not None:
            self.load_state_dict(own)
            return
        rank_zero_warn(
            f"shardplus: the checkpoint's per-rank PowerSGD state {unusable}: the step counter and warm-start "
            "P/Q (the same on every rank) are restored, the per-rank error feedback starts again from zero."
        )
        self.load_state_dict(entry["state"], keep_error_feedback=False)


def _fresh_state(template: PowerSGDState | None) -> PowerSGDState:
    """A copy of ``template``'s settings and generator; by default rank 1, error feedback, warm start from step 10."""
    if template is None:
        return PowerSGDState(
            None, matrix_approximation_rank=1, start_powerSGD_iter=DEFAULT_POWERSGD_START_ITER, min_compression_rate=2,
            use_error_feedback=True, warm_start=True, random_seed=0,
        )  # fmt: skip
    state = PowerSGDState(**{name: getattr(template, name) for name in _SETTINGS})
    state.rng.set_state(template.rng.get_state())
    return state


# PowerSGDState's settings, copied from a template into each fit's fresh state; its statistics counters, saved.
_SETTINGS = (
    "process_group", "matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate", "use_error_feedback",
    "warm_start", "orthogonalization_epsilon", "compression_stats_logging_frequency", "batch_tensors_with_same_shape",
)  # fmt: skip
_STATS = ("total_numel_before_compression", "total_numel_after_compression", "next_stats_report")


CHECKPOINT_KEY = "shardplus_gradient_compression"
RANK_FILES_SUFFIX = ".powersgd"  # each rank writes its state to <checkpoint>.powersgd/rank-<r>-of-<W>.pt


def checkpoint_entry(name: str, world_size: int, state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's entry: the name, the world size and rank 0's state without its error feedback (the rest is the
    same on every rank), so that it does not grow with the world size."""
    params = {n: {k: v for k, v in parts.items() if k != "error"} for n, parts in state["params"].items()}
    return {"name": name, "world_size": world_size, "state": {**state, "params": params}}


def rank_file(checkpoint_path: str | PathLike, rank: int, world_size: int) -> str:
    """Where rank ``rank`` of ``world_size`` keeps its PowerSGD state for the checkpoint ``checkpoint_path``."""
    return f"{os.fspath(checkpoint_path)}{RANK_FILES_SUFFIX}/rank-{rank}-of-{world_size}.pt"


def save_rank_state(state: dict[str, Any], checkpoint_path: str | PathLike, rank: int, world_size: int) -> None:
    """Write this rank's state beside the checkpoint (any fsspec filesystem, as Lightning's checkpoints)."""
    path = rank_file(checkpoint_path, rank, world_size)
    fs = get_filesystem(path)
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with fs.open(path, "wb") as file:  # one write: a reader never sees half a file from this rank
        file.write(buffer.getvalue())


# Why a rank's file cannot be used, by code (0: it can): agreed by every rank with one all-reduce.
_FILE_PROBLEMS = {1: "is missing", 2: "cannot be read (truncated or corrupt)", 3: "is from another save"}


def load_rank_state(path: str | PathLike, rank: int, world: int, step: int | None) -> tuple[dict[str, Any] | None, int]:
    """This rank's state saved beside the checkpoint of step counter ``step``, and 0; or None and why not
    (:data:`_FILE_PROBLEMS`): no error here, so that every rank can agree."""
    path = rank_file(path, rank, world)
    fs = get_filesystem(path)
    try:
        if not fs.exists(path):
            return None, 1
        with fs.open(path, "rb") as file:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception:  # torch.load raises UnpicklingError, RuntimeError, EOFError, ... on a truncated file
        return None, 2
    if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
        return None, 2
    if state.get("iter") != step:
        return None, 3
    return state, 0


def remove_rank_states(checkpoint_path: str | PathLike, rank: int) -> None:
    """Remove this rank's files beside a removed checkpoint (any world size), then the folder if empty."""
    folder = f"{os.fspath(checkpoint_path)}{RANK_FILES_SUFFIX}"
    fs = get_filesystem(folder)
    for path in fs.glob(f"{folder}/rank-{rank}-of-*.pt"):
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path)
    with contextlib.suppress(OSError):  # not empty yet (another rank's file) or gone already
        if fs.exists(folder) and not fs.ls(folder):
            fs.rmdir(folder)


class CommunicationHook:
    """The gradient communication hook of one fit, registered on each DDP wrapper: ``gradient_compression``'s or the
    user's ``ddp_comm_hook``, wrapped by ``ddp_comm_wrapper``, then by ``wrappers``; its state in checkpoints."""

    def __init__(
        self, name: str, *, backend: str, device: torch.device, user_hook: Callable | None = None,
        user_state: object | None = None, user_wrapper: Callable | None = None,
        wrappers: list[Callable[[Callable], Callable]] | None = None,
    ) -> None:  # fmt: skip
        self.name, self.backend = name, backend
        self.user_hook, self.user_state, self.device = user_hook, user_state, device
        self.wrappers = ([] if user_wrapper is None else [user_wrapper]) + list(wrappers or [])  # innermost first
        self.compression = build_compression(name, user_state)
        if self.compression is not None:
            self.compression.check_backend(backend, device)

    def register(self, model: DistributedDataParallel) -> None:
        """Register the hook on ``model`` (once per wrapper; a wrapper that has it already is left alone)."""
        if getattr(model, _HOOK_REGISTERED, False):
            return
        hook, state = self.user_hook, self.user_state
        if self.compression is not None:
            hook, state = self.compression.hook_for(model, self.backend)
        if hook is None and self.wrappers:
            hook, state = default_hooks.allreduce_hook, None  # DDP's all-reduce, as a hook that can be wrapped
        if hook is None:
            return
        for wrap in self.wrappers:
            hook = wrap(hook)
        try:
            model.register_comm_hook(state, hook)
        except Exception as err:
            raise RuntimeError(
                f"DDP refused the communication hook {getattr(hook, '__qualname__', hook)!r} "
                f"(`gradient_compression`={self.name!r}) on the {self.backend!r} backend: {err}"
            ) from err
        setattr(model, _HOOK_REGISTERED, True)

    def state_dict(self, checkpoint_path: str | PathLike | None = None) -> dict[str, Any] | None:
        """The checkpoint entry (None when stateless); this rank's state (PowerSGD's error feedback is per rank) goes
        to its file beside the checkpoint."""
        state = None if self.compression is None else self.compression.state_dict()
        if state is None:
            return None
        rank, world = _rank_and_world()
        if checkpoint_path is not None:
            save_rank_state(state, checkpoint_path, rank, world)
        return checkpoint_entry(self.name, world, state)

    def load_state_dict(self, entry: dict[str, Any]) -> None:
        """Continue with a checkpoint's entry and this rank's file beside ``entry["checkpoint_path"]``; one all-reduce:
        if any rank's file cannot be used, every rank restarts its error feedback (one warning)."""
        if self.compression is None or entry.get("name") != self.name or "state" not in entry:
            rank_zero_warn(
                f"shardplus: the checkpoint holds {entry.get('name')!r} gradient-compression state, this run "
                f"uses `gradient_compression`={self.name!r}: it starts without it."
            )
            return
        rank, world = _rank_and_world()
        path, saved_world = entry.get("checkpoint_path"), entry.get("world_size")
        own, problem = None, 0
        if path is not None and saved_world == world:
            own, problem = load_rank_state(path, rank, world, entry["state"].get("iter"))
        problems = torch.zeros(world, device=self.device)  # every rank's, so that all know which files and why
        problems[rank] = problem
        if world > 1:
            dist.all_reduce(problems)
        if saved_world != world:
            unusable = f"is from {saved_world} processes, this run has {world}"
        elif path is None:
            unusable = "has no checkpoint path"
        else:
            codes = [int(code) for code in problems.tolist()]
            unusable = "; ".join(f"{rank_file(path, r, world)!r} {_FILE_PROBLEMS[c]}" for r, c in enumerate(codes) if c)
        self.compression.load_checkpoint_entry(entry, own if not unusable else None, unusable)


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# Set on a DistributedDataParallel wrapper once `CommunicationHook.register` has given it its hook.
_HOOK_REGISTERED = "_shardplus_hook_registered"
