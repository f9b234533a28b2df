"""A seeded permutation of ``range(N)``, position -> index in O(1) memory for N < 2**63: a cycle-walking Feistel
network keyed by ``(seed, epoch, N)`` (docs/sharding.md, "O(1)-memory epoch permutation")."""

from __future__ import annotations

import numpy as np

ROUNDS = 6
SMALL_DOMAIN_ROUNDS = 12
"""Rounds on a domain under ``2**16`` (``k < 8``), where few rounds of a small-word function leave a bias."""
MAX_LENGTH = 2**63 - 1
_MASK64 = (1 << 64) - 1


def _splitmix64(state: int) -> tuple[int, int]:
    """One step of splitmix64 on Python ints: ``(new state, output)``."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
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
    """The 64-bit round keys of the ``(length, seed, epoch)`` permutation: ``(a_i, b_i)`` for each round, flat."""
    state = _splitmix64(_fold64(seed))[1]  # chained, not xor-ed together: (seed, epoch) is ordered
    state = _splitmix64(state ^ _fold64(epoch))[1]
    state = _splitmix64(state ^ _fold64(length))[1]
    keys = []
    for _ in range(2 * (ROUNDS if half_bits(length) >= 8 else SMALL_DOMAIN_ROUNDS)):
        state, key = _splitmix64(state)
        keys.append(key)
    return keys


def half_bits(length: int) -> int:
    """``k``: the Feistel domain is ``2**(2k)``, the smallest even power of two >= ``length`` (k >= 1)."""
    return max(1, ((length - 1).bit_length() + 1) // 2)


class KeyedPermutation:
    """The ``(seed, epoch)`` order of ``range(length)`` as a function of numpy position arrays: the keys and the word
    size are set up once, then :meth:`at` maps each chunk of positions with a few in-place array operations."""

    def __init__(self, length: int, seed: int, epoch: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= MAX_LENGTH:
            raise ValueError(f"`length`={length!r} is not valid: expected an integer in [0, 2**63 - 1].")
        self.length = length
        k = half_bits(length)
        dtype = self._dtype = np.uint32 if k <= 16 else np.uint64  # 32-bit words: SIMD multiplies
        width = 32 if k <= 16 else 64
        keys = round_keys(length, seed, epoch)
        word = (1 << width) - 1
        self._keys = [(dtype((keys[i] | 1) & word), dtype(keys[i + 1] & word)) for i in range(0, len(keys), 2)]
        self._half, self._mask = dtype(k), dtype((1 << k) - 1)
        self._mix, self._top = dtype(width // 2), dtype(width - k)
        self._walks = length < 4**k  # values can land outside [0, length) (the domain is larger)
        self._bound = dtype(length) if self._walks else None

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        """The Feistel permutation of ``[0, 2**(2k))`` applied to ``values`` (of the word dtype), in place: each
        round maps ``(L, R) -> (R, L xor F(R))``, ``F(R)`` the top ``k`` bits of a multiply-xorshift of ``R``."""
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
            while outside.size:  # cycle-walking: fewer than 4 encryptions per value on average (domain < 4N)
                walked = self._encrypt(values[outside])
                values[outside] = walked
                outside = outside[walked >= self._bound]
        return values.astype(np.int64)
