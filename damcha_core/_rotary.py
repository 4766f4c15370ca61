"""Rotary position embedding (RoPE) as DAMCHA composes with it (spec section 10).

A converted RoPE model rotates the *mapped* queries and keys: the cross-head
map L(t) acts on each token's projected heads, then the host rotates q~ and k~
by their positions, then the key cache stores the rotated k~. ``Rotary``
describes the rotation in a framework-free way (inverse frequencies, layout,
positions) so the NumPy reference, conformance vectors and every port agree on
it; ``apply_rotary`` is its float64 executable form.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import numpy as np

from ._errors import DamchaTypeError, DamchaValueError, describe, invalid_argument

__all__ = ["Rotary", "apply_rotary", "rotary_angles"]


def _positions(name: str, value: Any) -> np.ndarray | None:
    if value is None:
        return None
    array = np.asarray(value)
    if array.dtype.kind not in "iuf" or array.ndim not in (1, 2) or array.size == 0:
        raise DamchaValueError(
            invalid_argument(name, "a non-empty (T,) or (B, T) array of positions", f"{name}={describe(value)}")
        )
    if not np.all(np.isfinite(array)):
        raise DamchaValueError(
            invalid_argument(name, "finite values", f"{name}={describe(value)} with non-finite values")
        )
    return array.astype(np.float64)


@dataclasses.dataclass(frozen=True, eq=False)
class Rotary:
    """A rotary position embedding, applied after the cross-head maps.

    Channel pairs of each head are rotated by ``position * inv_freq[i]``. The
    first ``2 * len(inv_freq)`` channels of a head rotate (partial rotary when
    that is less than the head size); the rest pass through.

    Args:
        inv_freq: (R,) inverse frequencies, one per channel pair, as the host's
            rotary module computes them (any rope scaling already applied).
        interleaved: channel pairing. ``False`` (Llama, GPT-NeoX, Qwen,
            Mistral): channel i pairs with channel i + R ("rotate half").
            ``True`` (GPT-J, RoFormer): channel 2i pairs with 2i + 1.
        scaling: factor on cos and sin (transformers' ``attention_scaling``,
            1 except for YaRN-like rope types).
        query_positions: (N,) or (B, N) position of each query; default
            ``query_offset + arange(N)`` (so a decoder with P cached tokens
            places its queries at P, P + 1, ...).
        key_positions: (M,) or (B, M) position of each key; default arange(M).
    """

    inv_freq: Any
    interleaved: bool = False
    scaling: float = 1.0
    query_positions: Any = None
    key_positions: Any = None

    def __post_init__(self) -> None:
        inv = np.asarray(self.inv_freq)
        if inv.dtype.kind not in "iuf" or inv.ndim != 1 or inv.size == 0 or not np.all(np.isfinite(inv)):
            raise DamchaValueError(
                invalid_argument(
                    "inv_freq",
                    "a non-empty finite 1-D array (one frequency per channel pair)",
                    f"inv_freq={describe(self.inv_freq)}",
                )
            )
        if not isinstance(self.interleaved, (bool, np.bool_)):
            raise DamchaTypeError(
                invalid_argument("interleaved", "a bool", f"interleaved={describe(self.interleaved)}")
            )
        if (
            isinstance(self.scaling, bool)
            or not isinstance(self.scaling, numbers.Real)
            or not np.isfinite(self.scaling)
        ):
            raise DamchaValueError(
                invalid_argument("scaling", "a finite real number", f"scaling={describe(self.scaling)}")
            )
        object.__setattr__(self, "inv_freq", inv.astype(np.float64))
        object.__setattr__(self, "interleaved", bool(self.interleaved))
        object.__setattr__(self, "scaling", float(self.scaling))
        object.__setattr__(self, "query_positions", _positions("query_positions", self.query_positions))
        object.__setattr__(self, "key_positions", _positions("key_positions", self.key_positions))

    @classmethod
    def from_base(cls, dim: int, base: float = 10000.0, **kwargs: Any) -> Rotary:
        """The classic RoPE frequencies base^(-2i/dim) for ``dim`` rotated channels."""
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 2 or dim % 2:
            raise DamchaValueError(invalid_argument("dim", "an even int >= 2", f"dim={describe(dim)}"))
        return cls(inv_freq=base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim), **kwargs)

    @property
    def rotary_dim(self) -> int:
        """Number of rotated channels per head, 2 * len(inv_freq)."""
        return 2 * int(self.inv_freq.shape[0])

    def positions(self, role: str, batch: int, length: int, query_offset: int = 0) -> np.ndarray:
        """(B|1, T) positions of the queries (``role="q"``) or keys (``"k"``)."""
        given = self.query_positions if role == "q" else self.key_positions
        name = "query_positions" if role == "q" else "key_positions"
        if given is None:
            start = query_offset if role == "q" else 0
            return (start + np.arange(length, dtype=np.float64))[None]
        pos = given if given.ndim == 2 else given[None]
        if pos.shape[-1] != length or pos.shape[0] not in (1, batch):
            raise DamchaValueError(
                invalid_argument(
                    name,
                    f"shape ({length},) or (B, {length}) with B = {batch} or 1",
                    f"{name}.shape={tuple(given.shape)}",
                )
            )
        return pos


def rotary_angles(rotary: Rotary, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (B, T, R) of the angles position * inv_freq, times ``scaling``."""
    angles = positions[..., None] * rotary.inv_freq
    return np.cos(angles) * rotary.scaling, np.sin(angles) * rotary.scaling


def apply_rotary(y: np.ndarray, rotary: Rotary, positions: np.ndarray) -> np.ndarray:
    """Rotate stacked heads y (B, T, S, d) by their tokens' positions (B|1, T).

    Raises DamchaValueError when the rotary needs more channels than a head has.
    """
    d = y.shape[-1]
    R = rotary.inv_freq.shape[0]
    if d < 2 * R:
        raise DamchaValueError(
            invalid_argument(
                "rotary",
                f"a Rotary that rotates at most key_dim={d} channels per head; it rotates {2 * R}",
                f"inv_freq.shape={rotary.inv_freq.shape}",
            )
        )
    cos, sin = rotary_angles(rotary, positions)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # one angle per token, shared by every head
    head, rest = y[..., : 2 * R], y[..., 2 * R :]
    if rotary.interleaved:
        a, b = head[..., 0::2], head[..., 1::2]
        out = np.empty_like(head)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
    else:
        a, b = head[..., :R], head[..., R:]
        out = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return np.concatenate([out, rest], axis=-1) if rest.shape[-1] else out
