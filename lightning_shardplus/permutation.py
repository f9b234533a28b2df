"""A seeded permutation of ``range(N)`` computed on the fly: position -> index in O(1) memory, for N < 2**63.

The epoch order is a keyed bijection rather than a materialized ``randperm``: ``permuted(positions, N, seed,
epoch)`` maps any chunk of positions to their indices, so a sampler needs memory for one chunk whatever N is,
can yield its first index at once, and ranks reading different positions read different indices by construction.

Construction (format-preserving encryption, as in Black & Rogaway's "Ciphers with arbitrary finite domains"):

- a balanced Feistel network on ``2**(2k)`` values, the smallest even-bit domain holding ``[0, N)``
  (``2**(2k) < 4N``), with halves of ``k <= 32`` bits. Each round maps ``(L, R) -> (R, L xor F_i(R))`` with a
  multiply-xorshift round function ``F_i(R)``: ``x = (R xor b_i) * a_i; x ^= x >> w/2; x *= a_i``, the top ``k``
  bits of ``x``, in ``w = 32``-bit words for ``k <= 16`` (SIMD multiplies) and 64-bit words above, ``a_i`` odd.
  Any round function gives a bijection; the rounds and the mixer give the statistical quality:
  :func:`rounds` is 6 (Luby-Rackoff: 4 rounds of random functions already give a pseudorandom permutation) and
  12 on domains under ``2**16`` (``N`` up to about 16,000), where few rounds of a small-word function leave a
  measurable bias and extra rounds cost nothing.
- cycle-walking: a value that lands in ``[N, 2**(2k))`` is encrypted again until it lands in ``[0, N)``. The
  walk follows the value's cycle in the big permutation, which contains the start, so it terminates; since
  the domain is under ``4N``, a walk takes fewer than 4 encryptions on average.
- round keys from ``(seed, epoch, N)`` by splitmix64, so neighbouring seeds or epochs give unrelated orders.

All arithmetic is numpy unsigned words, which wrap (no overflow), on whole chunks of positions at a time, in place.
This order is neither ``torch.randperm``'s nor that of this module's first version (8 rounds of MurmurHash3's
finalizer): a given seed gives a different, equally reproducible order.
"""

from __future__ import annotations

import numpy as np
import torch

ROUNDS = 6
SMALL_DOMAIN_ROUNDS = 12
"""Rounds on a domain under ``2**16`` (``k < 8``)."""
MAX_LENGTH = 2**63 - 1
_MASK64 = (1 << 64) - 1


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


def rounds(length: int) -> int:
    """The Feistel rounds of the permutation of ``range(length)``."""
    return ROUNDS if half_bits(length) >= 8 else SMALL_DOMAIN_ROUNDS


def round_keys(length: int, seed: int, epoch: int) -> list[int]:
    """The 64-bit round keys of the ``(length, seed, epoch)`` permutation: ``(a_i, b_i)`` for each round, flat."""
    state = _splitmix64(_fold64(seed))[1]  # chained, not xor-ed together: (seed, epoch) is ordered
    state = _splitmix64(state ^ _fold64(epoch))[1]
    state = _splitmix64(state ^ _fold64(length))[1]
    keys = []
    for _ in range(2 * rounds(length)):
        state, key = _splitmix64(state)
        keys.append(key)
    return keys


def half_bits(length: int) -> int:
    """``k``: the Feistel domain is ``2**(2k)``, the smallest even power of two >= ``length`` (k >= 1)."""
    return max(1, ((length - 1).bit_length() + 1) // 2)


def _check(length: int) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= MAX_LENGTH:
        raise ValueError(f"`length`={length!r} is not valid: expected an integer in [0, 2**63 - 1].")


class KeyedPermutation:
    """The ``(seed, epoch)`` order of ``range(length)`` as a function of numpy position arrays: the keys and the
    word size are set up once, then :meth:`at` maps each chunk of positions with a few in-place array operations.
    """

    def __init__(self, length: int, seed: int, epoch: int) -> None:
        _check(length)
        self.length = length
        k = self._k = half_bits(length)
        dtype = self._dtype = np.uint32 if k <= 16 else np.uint64
        width = 32 if k <= 16 else 64
        keys = round_keys(length, seed, epoch)
        word = (1 << width) - 1
        self._keys = [(dtype((keys[i] | 1) & word), dtype(keys[i + 1] & word)) for i in range(0, len(keys), 2)]
        self._half, self._mask = dtype(k), dtype((1 << k) - 1)
        self._mix, self._top = dtype(width // 2), dtype(width - k)
        self._walks = length < 4**k  # values can land outside [0, length) (the domain is larger)
        self._bound = dtype(length) if self._walks else None

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        """The Feistel permutation of ``[0, 2**(2k))`` applied to ``values`` (of the word dtype), in place."""
        left, right = values >> self._half, values & self._mask
        x, shifted = np.empty_like(values), np.empty_like(values)
        for a, b in self._keys:
            np.bitwise_xor(right, b, out=x)
            x *= a
            np.right_shift(x, self._mix, out=shifted)
            x ^= shifted
            x *= a
            x >>= self._top
            left ^= x
            left, right = right, left
        left <<= self._half
        return np.bitwise_or(left, right, out=values)

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The indices (int64) at ``positions`` (an integer array, each in ``[0, length)``, not checked)."""
        if self.length <= 1:
            return np.array(positions, dtype=np.int64)
        values = self._encrypt(positions.astype(self._dtype))
        if self._walks:
            outside = np.flatnonzero(values >= self._bound)
            while outside.size:  # cycle-walking: fewer than 4 encryptions per value on average
                walked = self._encrypt(values[outside])
                values[outside] = walked
                outside = outside[walked >= self._bound]
        return values.astype(np.int64)


def permuted(positions: torch.Tensor, length: int, seed: int, epoch: int) -> torch.Tensor:
    """The indices at ``positions`` (int64, each in ``[0, length)``) of the ``(seed, epoch)`` order of
    ``range(length)``; a bijection of ``[0, length)``, computed in memory proportional to ``positions``."""
    _check(length)
    array = torch.as_tensor(positions, dtype=torch.int64).numpy()  # numpy's min/max: faster than torch's here
    if array.size and (int(array.min()) < 0 or int(array.max()) >= length):
        raise ValueError(f"positions must lie in [0, {length}); got [{int(array.min())}, {int(array.max())}].")
    return torch.from_numpy(KeyedPermutation(length, seed, epoch).at(array))


def permutation(length: int, seed: int, epoch: int) -> torch.Tensor:
    """The whole order as one tensor (``length`` int64 values): for small ``length`` and for tests."""
    _check(length)
    return permuted(torch.arange(length, dtype=torch.int64), length, seed, epoch)
