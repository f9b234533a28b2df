"""Gradient compression: a name -> a DDP communication hook (+ its state, checkpointable), on every device.

``ShardPlusStrategy(gradient_compression=...)`` picks one of:

- ``"none"``: DDP's own all-reduce (no hook; float32 gradients on the wire).
- ``"fp16"``: torch's ``fp16_compress_hook``: the bucket is cast to float16 (divided by the world size
  first), all-reduced, and cast back. Half the bytes; float16's range and 11-bit mantissa apply to the summed
  gradient.
- ``"bf16"``: the same in bfloat16 (float32's range, 8-bit mantissa). torch's DDP refuses its
  ``bf16_compress_hook`` *by name* unless torch was built with CUDA and NCCL >= 2.10, although gloo
  all-reduces bfloat16 (checked with a one-element all-reduce at setup): on other backends
  than NCCL the strategy registers the same hook under another name. On NCCL torch's hook and its check are
  used as they are.
- ``"powersgd"``: torch's ``powerSGD_hook`` (Vogels et al., 2019): each gradient matrix is all-reduced as a
  rank-r approximation ``P Q^T``, with error feedback (what compression dropped is added to the next step's
  gradient, kept per rank) and warm start (``Q`` of the previous step starts the next power iteration). The
  default state is :func:`default_powersgd_state`; pass a ``PowerSGDState`` as the strategy's
  ``ddp_comm_state`` to choose the rank, the first compressed step, and so on.

The hook runs only on the steps that communicate: with aggregation, on the last micro-batch of each window.

PowerSGD on gloo with several buckets hung in torch's hook: its continuations block a gloo worker thread each
(``all_reduce(...).wait()`` inside ``Future.then`` callbacks), and with several buckets in flight they block
all worker threads while the collectives they wait for queue behind them; the callbacks also issue collectives
from different threads in an order that may differ between ranks. :class:`PowerSGDCompression` therefore runs
the buckets one after the other on every backend but NCCL (each bucket waits for the previous bucket's future
before it starts), which removes both problems at the cost of overlap between buckets.

PowerSGD's state is keyed by DDP bucket index, but DDP re-cuts its buckets after the first iteration and a
fresh DDP wrapper (a resumed run, or a re-wrap during fit) starts with one bucket again.
:class:`PowerSGDCompression` keeps the state per *parameter* across such changes, which is also the form saved
in checkpoints (see :meth:`PowerSGDCompression.state_dict`), so a resumed run continues with the same error
feedback and warm start. Each rank writes its own state to ``<checkpoint>.powersgd/rank-<r>-of-<W>.pt``
(:func:`rank_file`); rank 0's checkpoint holds only what is the same on every rank, so it does not grow with W.
A rank's file that is missing, unreadable or from another save restarts every rank's error feedback, with a warning.
"""

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


def default_powersgd_state() -> PowerSGDState:
    """The PowerSGD configuration of ``gradient_compression="powersgd"``: rank 1, error feedback and warm
    start on, compression from the 10th communicating step on (the first ones use a plain all-reduce, as torch
    recommends), seed 0."""
    return PowerSGDState(
        process_group=None,
        matrix_approximation_rank=1,
        start_powerSGD_iter=DEFAULT_POWERSGD_START_ITER,
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )


def shardplus_bf16_compress_hook(process_group, bucket):  # no annotations: DDP checks them against its types
    """torch's ``bf16_compress_hook`` under another name (DDP refuses the original by name on builds without
    CUDA and NCCL, whatever the backend); registered only on backends that all-reduced bfloat16 at setup."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def build_compression(
    name: str, ddp_comm_state: object | None = None
) -> CastCompression | PowerSGDCompression | None:
    """The compression object for ``name`` (None for ``"none"``), with fresh state for one fit."""
    if name == "none":
        return None
    if name == "fp16":
        return CastCompression("fp16", torch.float16)
    if name == "bf16":
        return CastCompression("bf16", torch.bfloat16)
    if name == "powersgd":
        return PowerSGDCompression(ddp_comm_state if isinstance(ddp_comm_state, PowerSGDState) else None)
    raise ValueError(
        f"`gradient_compression`={name!r} is not valid: expected one of {GRADIENT_COMPRESSIONS}."
    )


class CastCompression:
    """``"fp16"`` / ``"bf16"``: all-reduce the gradient bucket in a 16-bit float type. Stateless."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype

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
        if self.dtype == torch.float16:
            return default_hooks.fp16_compress_hook, None
        if backend == "nccl":
            return default_hooks.bf16_compress_hook, None
        return shardplus_bf16_compress_hook, None

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_checkpoint_entry(self, entry: dict[str, Any], own: dict[str, Any] | None, unusable: str) -> None:
        pass


def _quiet_wait(future: torch.futures.Future | None) -> None:
    """Wait for ``future``; its error, if any, reaches DDP through the future itself."""
    if future is None:
        return
    try:
        future.wait()
    except Exception:  # DDP reports it when it waits on the same future
        pass


class PowerSGDCompression:
    """``"powersgd"``: torch's ``powerSGD_hook`` with its ``PowerSGDState``, made safe on gloo with several
    buckets, kept across DDP bucket re-cuts and re-wraps, and saved per rank in checkpoints.

    Args:
        template: a ``PowerSGDState`` whose settings (rank, start iteration, ...) and random generator state
            to copy; None: :func:`default_powersgd_state`. The state of one fit is always fresh.
    """

    name = "powersgd"

    def __init__(self, template: PowerSGDState | None = None) -> None:
        self.state = _fresh_state(template)
        self._names: dict[int, str] = {}  # id(parameter) -> name, for the registered DDP wrapper
        self._shapes: dict[str, torch.Size] = {}
        self._layout: dict[int, tuple[str, ...]] = {}  # bucket index -> its parameter names, as last seen
        self._loose: dict[
            str, dict[str, torch.Tensor]
        ] = {}  # name -> {"error"|"p"|"q": piece} not in a bucket
        self._serialize = True
        self._previous: torch.futures.Future | None = None
        self._round: list[torch.futures.Future] = []

    def check_backend(self, backend: str, device: torch.device) -> None:
        pass

    def hook_for(self, model: DistributedDataParallel, backend: str) -> tuple[Callable, object]:
        """Start following ``model``, a new DDP wrapper (its bucket layout is found at its first backward)."""
        named = [(name, p) for name, p in model.module.named_parameters() if p.requires_grad]
        self._names = {id(p): name for name, p in named}
        self._shapes = {name: p.shape for name, p in named}
        self._serialize = backend != "nccl"
        self._previous = None
        self._round = []
        return self.hook, self.state

    # ------------------------------------------------------------------ the hook

    def hook(self, state, bucket):  # no annotations: DDP checks them against its types
        """``powerSGD_hook`` after (1) waiting for the previous bucket (not on NCCL) and (2) re-cutting the
        state when DDP's bucket layout changed."""
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

    # ------------------------------------------------------------------ per-parameter state

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

    def _split(self, index: int, names: tuple[str, ...], pop: bool) -> dict[str, dict[str, torch.Tensor]]:
        """Bucket ``index``'s error, P and Q memory cut into per-parameter pieces (copies)."""
        take = dict.pop if pop else dict.get
        error = take(self.state.error_dict, index, None)
        p_memory = take(self.state.p_memory_dict, index, None)
        q_memory = take(self.state.q_memory_dict, index, None)
        pieces: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
        if names and all(name in self._shapes for name in names):
            sizes = [self._numel(name) for name in names]
            if error is not None and error.numel() == sum(sizes):
                for name, piece in zip(names, error.split(sizes), strict=True):
                    pieces[name]["error"] = piece.detach().clone()
            order, lengths = self._compressed(names)
            for key, memory, column in (("p", p_memory, 0), ("q", q_memory, 1)):
                sizes = [lengths[name][column] for name in order]
                if order and memory is not None and memory.numel() == sum(sizes):
                    for name, piece in zip(order, memory.split(sizes), strict=True):
                        pieces[name][key] = piece.detach().clone()
        return pieces

    def _dissolve(self) -> None:
        for index, names in list(self._layout.items()):
            for name, parts in self._split(index, names, pop=True).items():
                self._loose.setdefault(name, {}).update(parts)
        self._layout.clear()

    def _assemble(self, index: int, names: tuple[str, ...], buffer: torch.Tensor) -> None:
        """Put the loose pieces of ``names`` together as bucket ``index``'s state, where all are there."""
        parts = [self._loose.pop(name, {}) for name in names]
        if not any(parts) or not all(name in self._shapes for name in names):
            return
        device, dtype = buffer.device, buffer.dtype
        errors = [part.get("error") for part in parts]
        if all(e is not None and e.numel() == self._numel(n) for e, n in zip(errors, names, strict=True)):
            self.state.error_dict[index] = torch.cat([e.reshape(-1) for e in errors]).to(device, dtype)
        order, lengths = self._compressed(names)
        by_name = dict(zip(names, parts, strict=True))
        for key, memory, column in (("p", self.state.p_memory_dict, 0), ("q", self.state.q_memory_dict, 1)):
            pieces = [by_name[name].get(key) for name in order]
            if order and all(
                piece is not None and piece.numel() == lengths[name][column]
                for piece, name in zip(pieces, order, strict=True)
            ):
                memory[index] = torch.cat([piece.reshape(-1) for piece in pieces]).to(device, dtype)
        if (index in self.state.p_memory_dict) != (index in self.state.q_memory_dict):
            self.state.p_memory_dict.pop(index, None)  # warm start needs both, else PowerSGD starts afresh
            self.state.q_memory_dict.pop(index, None)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's PowerSGD state, independent of DDP's bucket layout: per-parameter error feedback and
        warm-start P/Q pieces (CPU tensors), the step counter and the random generator (plain types and
        tensors only, so ``torch.load(weights_only=True)`` reads it)."""
        params: dict[str, dict[str, torch.Tensor]] = {
            name: {key: piece.detach().cpu().clone() for key, piece in parts.items()}
            for name, parts in self._loose.items()
        }
        for index, names in self._layout.items():
            for name, parts in self._split(index, names, pop=False).items():
                params.setdefault(name, {}).update({key: piece.cpu() for key, piece in parts.items()})
        _, keys, pos, has_gauss, cached_gaussian = self.state.rng.get_state()
        return {
            "format": _STATE_FORMAT,
            "iter": int(self.state.iter),
            "rng": {
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            },
            "stats": [
                int(self.state.total_numel_before_compression),
                int(self.state.total_numel_after_compression),
                int(self.state.next_stats_report),
            ],
            "matrix_approximation_rank": int(self.state.matrix_approximation_rank),
            "params": {name: parts for name, parts in params.items() if parts},
        }

    def load_state_dict(self, saved: dict[str, Any], keep_error_feedback: bool = True) -> None:
        """Continue from ``saved`` (from :meth:`state_dict`). The pieces are put into DDP's buckets at the
        first backward; pieces whose size no longer fits (another rank of approximation, another model) are
        dropped and PowerSGD starts those buckets afresh."""
        if saved.get("format") != _STATE_FORMAT:
            raise ValueError(
                f"unknown PowerSGD state format {saved.get('format')!r} (expected {_STATE_FORMAT})"
            )
        self.state.iter = int(saved["iter"])
        rng = saved["rng"]
        self.state.rng.set_state(
            (
                "MT19937",
                rng["keys"].numpy().astype(np.uint32),
                rng["pos"],
                rng["has_gauss"],
                rng["cached_gaussian"],
            )
        )
        before, after, next_report = saved["stats"]
        self.state.total_numel_before_compression = before
        self.state.total_numel_after_compression = after
        self.state.next_stats_report = next_report
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()
        self._layout.clear()
        self._loose = {
            name: {key: piece for key, piece in parts.items() if keep_error_feedback or key != "error"}
            for name, parts in saved["params"].items()
        }

    def load_checkpoint_entry(self, entry: dict[str, Any], own: dict[str, Any] | None, unusable: str) -> None:
        """Continue from a checkpoint entry of :func:`checkpoint_entry` and this rank's own state (``own``, from
        its file beside the checkpoint; None where any rank's cannot be used, ``unusable`` saying why)."""
        if own is not None:
            self.load_state_dict(own)
            return
        rank_zero_warn(
            f"shardplus: the checkpoint's per-rank PowerSGD state {unusable}: the step counter and warm-start "
            "P/Q (the same on every rank) are restored, the per-rank error feedback starts again from zero."
        )
        self.load_state_dict(entry["state"], keep_error_feedback=False)


def _fresh_state(template: PowerSGDState | None) -> PowerSGDState:
    if template is None:
        return default_powersgd_state()
    state = PowerSGDState(
        process_group=template.process_group,
        matrix_approximation_rank=template.matrix_approximation_rank,
        start_powerSGD_iter=template.start_powerSGD_iter,
        min_compression_rate=template.min_compression_rate,
        use_error_feedback=template.use_error_feedback,
        warm_start=template.warm_start,
        orthogonalization_epsilon=template.orthogonalization_epsilon,
        compression_stats_logging_frequency=template.compression_stats_logging_frequency,
        batch_tensors_with_same_shape=template.batch_tensors_with_same_shape,
    )
    state.rng.set_state(template.rng.get_state())
    return state


CHECKPOINT_KEY = "shardplus_gradient_compression"
RANK_FILES_SUFFIX = ".powersgd"
"""Each rank's PowerSGD state goes to ``<checkpoint>.powersgd/rank-<r>-of-<W>.pt``, written by that rank."""


def checkpoint_entry(name: str, world_size: int, state: dict[str, Any]) -> dict[str, Any]:
    """What rank 0 stores under ``checkpoint[CHECKPOINT_KEY]``: the name, the world size and rank 0's state without
    its error feedback (step counter, random generator and warm-start P/Q are the same on every rank). The same
    size whatever the world size: each rank's full state is in its own file (:func:`rank_file`)."""
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


def load_rank_state(
    checkpoint_path: str | PathLike, rank: int, world_size: int, step: int | None
) -> tuple[dict[str, Any] | None, int]:
    """This rank's state saved beside the checkpoint of step counter ``step``, and 0; or None and why not
    (:data:`_FILE_PROBLEMS`): a file that cannot be read is not an error here, so that every rank can agree."""
    path = rank_file(checkpoint_path, rank, world_size)
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
    """Remove this rank's files beside a removed checkpoint (of any world size), then the folder if empty: every
    rank calls it, so per-rank files on node-local disks go too."""
    folder = f"{os.fspath(checkpoint_path)}{RANK_FILES_SUFFIX}"
    fs = get_filesystem(folder)
    for path in fs.glob(f"{folder}/rank-{rank}-of-*.pt"):
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path)
    with contextlib.suppress(OSError):  # not empty yet (another rank's file) or gone already
        if fs.exists(folder) and not fs.ls(folder):
            fs.rmdir(folder)


class CommunicationHook:
    """The gradient communication hook of one fit, registered on each DDP wrapper the strategy builds: the hook
    of ``gradient_compression`` (with its state) or the user's ``ddp_comm_hook``, wrapped by ``ddp_comm_wrapper``
    and then by ``wrappers`` (the instrumentation callbacks' ``wrap``); and the compression state in checkpoints.

    Example::

        hook = CommunicationHook("fp16", backend="gloo", device=torch.device("cpu"))
        hook.register(ddp_model)  # again after each re-wrap: PowerSGD's state carries over
    """

    def __init__(
        self,
        name: str,
        *,
        backend: str,
        device: torch.device,
        user_hook: Callable | None = None,
        user_state: object | None = None,
        user_wrapper: Callable | None = None,
        wrappers: list[Callable[[Callable], Callable]] | None = None,
    ) -> None:
        self.name, self.backend = name, backend
        self.user_hook, self.user_state, self.user_wrapper = user_hook, user_state, user_wrapper
        self.wrappers = wrappers or []
        self.device = device
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
        if hook is None and (self.user_wrapper is not None or self.wrappers):
            hook, state = default_hooks.allreduce_hook, None  # DDP's all-reduce, as a hook that can be wrapped
        if hook is None:
            return
        if self.user_wrapper is not None:
            hook = self.user_wrapper(hook)
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

    def local_state_dict(self) -> dict[str, Any] | None:
        """This rank's compression state (PowerSGD's error feedback is per rank); None when stateless."""
        return None if self.compression is None else self.compression.state_dict()

    def state_dict(self, checkpoint_path: str | PathLike | None = None) -> dict[str, Any] | None:
        """The checkpoint entry (:func:`checkpoint_entry`, the same size at any world size); this rank's full state
        is written to its own file beside ``checkpoint_path`` (:func:`rank_file`). Call it on every rank; it does
        not communicate. None when stateless."""
        state = self.local_state_dict()
        if state is None:
            return None
        rank, world = _rank_and_world()
        if checkpoint_path is not None:
            save_rank_state(state, checkpoint_path, rank, world)
        return checkpoint_entry(self.name, world, state)

    def load_state_dict(self, entry: dict[str, Any]) -> None:
        """Continue with a checkpoint's compression state: the entry, and this rank's file beside the checkpoint
        (``entry["checkpoint_path"]``, added at load time). One all-reduce of a count: if any rank's file is
        missing or stale, every rank restarts its error feedback (with one warning)."""
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
