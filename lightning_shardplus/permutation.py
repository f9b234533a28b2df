"""A seeded permutation of ``range(N)`` computed on the fly: position -> index in O(1) memory, for N < 2**63.

The epoch order is a keyed bijection rather than a materialized ``randperm``: ``permuted(positions, N, seed,
epoch)`` maps any chunk of positions to their indices, so a sampler needs memory for one chunk whatever N is,
yields its first index at once, and ranks reading different positions read different indices by construction.

Construction (format-preserving encryption, as in Black & Rogaway's "Ciphers with arbitrary finite domains"):

- a balanced Feistel network on ``2**(2k)`` values, the smallest even-bit domain holding ``[0, N)``
  (``2**(2k) < 4N``), with halves of ``k <= 32`` bits. Each of :data:`ROUNDS` rounds maps
  ``(L, R) -> (R, L xor F_i(R))`` with ``F_i(R) = fmix64(R xor key_i) >> (64 - k)`` (MurmurHash3's 64-bit
  finalizer, a bijection with full avalanche, taking the top ``k`` bits). Any round function gives a
  bijection; the rounds and the mixer give the statistical quality (Luby-Rackoff: 4 rounds of random functions
  already give a pseudorandom permutation; 8 leave a wide margin for a fast, non-cryptographic mixer).
- cycle-walking: a value that lands in ``[N, 2**(2k))`` is encrypted again until it lands in ``[0, N)``. The
  walk follows the value's cycle in the big permutation, which contains the start, so it terminates; since
  the domain is under ``4N``, a walk takes fewer than 4 encryptions on average.
- round keys from ``(seed, epoch, N)`` by splitmix64, so neighbouring seeds or epochs give unrelated orders.

All arithmetic is numpy ``uint64``, which wraps modulo ``2**64`` (no int64 overflow); positions and indices
travel as torch ``int64`` tensors. This order is not ``torch.randperm``'s: a given seed gives a different (but
equally reproducible) order than before.
"""

from __future__ import annotations

import numpy as np
import torch

ROUNDS = 8
MAX_LENGTH = 2**63 - 1
_MASK64 = (1 << 64) - 1
_FMIX_C1 = np.uint64(0xFF51AFD7ED558CCD)
_FMIX_C2 = np.uint64(0xC4CEB9FE1A85EC53)
_SHIFT33 = np.uint64(33)


def _splitmix64(state: int) -> tuple[int, int]:
    """One step of splitmix64 on Python ints: ``(new state, output)``."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def _fold64(value: int) -> int:
    """Any Python int (negative or wider than 64 bits) to 64 bits, every bit of it counting."""
    if value < 0:
        return _splitmix64(_fold64(-value) ^ _MASK64)[1]
    folded = 0
    while True:
        folded = _splitmix64(folded ^ (value & _MASK64))[1]
        value >>= 64
        if not value:
            return folded


def round_keys(length: int, seed: int, epoch: int) -> list[int]:
    """The :data:`ROUNDS` 64-bit round keys of the ``(length, seed, epoch)`` permutation."""
    state = _splitmix64(_fold64(seed))[1]  # chained, not xor-ed together: (seed, epoch) is ordered
    state = _splitmix64(state ^ _fold64(epoch))[1]
    state = _splitmix64(state ^ _fold64(length))[1]
    keys = []
    for _ in range(ROUNDS):
        state, key = _splitmix64(state)
        keys.append(key)
    return keys


def half_bits(length: int) -> int:
    """``k``: the Feistel domain is ``2**(2k)``, the smallest even power of two >= ``length`` (k >= 1)."""
    return max(1, ((length - 1).bit_length() + 1) // 2)


def _encrypt(values: np.ndarray, keys: list[int], k: int) -> np.ndarray:
    """The Feistel permutation of ``[0, 2**(2k))`` applied to ``values`` (uint64)."""
    shift_k, mask, top = np.uint64(k), np.uint64((1 << k) - 1), np.uint64(64 - k)
    left, right = values >> shift_k, values & mask
    for key in keys:
        x = right ^ np.uint64(key)
        x ^= x >> _SHIFT33
        x *= _FMIX_C1
        x ^= x >> _SHIFT33
        x *= _FMIX_C2
        x ^= x >> _SHIFT33
        x >>= top
        left, right = right, left ^ x
    return (left << shift_k) | right


def _check(length: int) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= MAX_LENGTH:
        raise ValueError(f"`length`={length!r} is not valid: expected an integer in [0, 2**63 - 1].")


def permuted(positions: torch.Tensor, length: int, seed: int, epoch: int) -> torch.Tensor:
    """The indices at ``positions`` (int64, each in ``[0, length)``) of the ``(seed, epoch)`` order of
    ``range(length)``; a bijection of ``[0, length)``, computed in memory proportional to ``positions``."""
    _check(length)
    array = torch.as_tensor(positions, dtype=torch.int64).numpy()  # numpy's min/max: faster than torch's here
    if array.size and (int(array.min()) < 0 or int(array.max()) >= length):
        raise ValueError(f"positions must lie in [0, {length}); got [{int(array.min())}, {int(array.max())}].")
    if length <= 1:
        return torch.from_numpy(array.copy())
    keys, k = round_keys(length, seed, epoch), half_bits(length)
    bound = np.uint64(length)
    values = _encrypt(array.astype(np.uint64), keys, k)
    outside = np.flatnonzero(values >= bound)
    while outside.size:  # cycle-walking: fewer than 4 encryptions per value on average
        walked = _encrypt(values[outside], keys, k)
        values[outside] = walked
        outside = outside[walked >= bound]
    return torch.from_numpy(values.astype(np.int64))


def permutation(length: int, seed: int, epoch: int) -> torch.Tensor:
    """The whole order as one tensor (``length`` int64 values): for small ``length`` and for tests."""
    _check(length)
    return permuted(torch.arange(length, dtype=torch.int64), length, seed, epoch)
