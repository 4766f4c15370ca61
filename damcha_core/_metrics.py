"""The metric structures of DAMCHA v1, written once.

A *structure* (config ``metric``) fixes what the generator of one side holds
and how its per-token coefficients act on that token's stacked heads. Each
entry of ``METRIC_STRUCTURES`` gives

* its leaves: canonical names under ``metric.SIDE.``, shapes in the symbols
  E (features of the side's tokens), S (heads of the side), d (head size),
  r (rank), initialiser std (``None`` = zeros) and whether the leaf belongs to
  the generator (shared stack-wise) or to the layer (the gate);
* the coefficient shape per token: A(t) (S, S) or u(t) (r,);
* the math over an array namespace ``xp`` (``numpy``, ``jax.numpy``,
  ``keras.ops``, ``torch``): ``coefficients``, ``delta``, ``apply``,
  ``dense_delta`` and ``penalty_sq``. They use only ``einsum``, ``sum``,
  ``reshape``, ``@`` and broadcasting, so every port can evaluate the same
  formula with its own arrays.

``DamchaConfig.param_shapes``, ``init_params``, the reference's ``generator``,
``apply_map`` and ``dense_map``, and ``role_penalty`` read this table; adding a
structure means adding an entry here (and its map in each port's generator).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ._errors import DamchaValueError, invalid_argument

SYMBOLS = ("E", "S", "d", "r")


@dataclasses.dataclass(frozen=True)
class MetricLeaf:
    """One tensor of a metric side.

    Args:
        name: the leaf's canonical name (``metric.SIDE.<name>``).
        dims: its shape in the symbols E, S, d, r.
        std_of: the initialiser: normal with std 1/sqrt(product of these
            symbols); ``None`` means zeros.
        generator: True for the generator's tensors (shared by the layers of
            a stack), False for the layer's own (the gate).
    """

    name: str
    dims: tuple[str, ...]
    std_of: tuple[str, ...] | None
    generator: bool = True

    def shape(self, sizes: Mapping[str, int | None]) -> tuple[int, ...]:
        return tuple(_size(sizes, s) for s in self.dims)

    def std(self, sizes: Mapping[str, int | None]) -> float:
        """0.0 for zero-initialised leaves."""
        if self.std_of is None:
            return 0.0
        return 1.0 / math.sqrt(math.prod(_size(sizes, s) for s in self.std_of))


def _size(sizes: Mapping[str, int | None], symbol: str) -> int:
    """The size of ``symbol``; r is None unless the metric is "lowrank", where it is required."""
    value = sizes[symbol]
    if value is None:
        raise DamchaValueError(f"this metric structure needs the size {symbol!r} (metric_rank for 'r'); it was None")
    return value


_GATE = MetricLeaf("gate", ("S",), None, generator=False)


@dataclasses.dataclass(frozen=True)
class GeneratorSpec:
    """What a metric generator is: the sizes it was built for.

    Ports describe their generator objects with it (a ``spec_of`` callable) and
    ``DamchaConfig.generator_spec(side)`` says what a side needs, so one rule
    decides whether a generator fits a layer.

    Args:
        features: E, feature size of the tokens it reads.
        heads: S, number of heads its map acts on.
        metric: its structure, "heads" or "lowrank".
        head_dim: d, head size. Only "lowrank" generators depend on it.
        rank: r for "lowrank", None for "heads".
    """

    features: int
    heads: int
    metric: str
    head_dim: int | None = None
    rank: int | None = None

    def mismatches(self, other: GeneratorSpec) -> list[str]:
        """``"field=mine (other)"`` for each field that matters to this
        structure and differs; ``[]`` when ``other`` can stand in for self."""
        fields = ["features", "heads", "metric", "rank"]
        if self.metric not in METRIC_STRUCTURES or METRIC_STRUCTURES[self.metric].uses_head_dim:
            fields.insert(3, "head_dim")
        return [
            f"{f}={getattr(other, f)!r} (expected {getattr(self, f)!r})"
            for f in fields
            if getattr(self, f) != getattr(other, f)
        ]


class MetricStructure:
    """Base of a table entry; see the module docstring."""

    name: str
    leaves: tuple[MetricLeaf, ...]
    coefficient_dims: tuple[str, ...]

    @property
    def uses_head_dim(self) -> bool:
        """Whether the generator's tensors depend on d (so a generator fits only one head size)."""
        return any("d" in leaf.dims for leaf in self.leaves if leaf.generator)

    @property
    def leaf_names(self) -> tuple[str, ...]:
        """Every leaf of a side, in canonical order."""
        return tuple(leaf.name for leaf in self.leaves)

    @property
    def generator_leaves(self) -> tuple[str, ...]:
        """The leaves a shared generator holds (all but the gate)."""
        return tuple(leaf.name for leaf in self.leaves if leaf.generator)

    # Whether ``head_map`` gives a compact (B, T, S, S) factor l(t) with
    # L(t) = l(t) (x) I_d; otherwise it gives the dense L(t).
    compact_head_map = False

    @staticmethod
    def sizes(E: int, S: int, d: int, r: int | None) -> dict[str, int | None]:
        return {"E": E, "S": S, "d": d, "r": r}

    def shapes(self, E: int, S: int, d: int, r: int | None = None) -> dict[str, tuple[int, ...]]:
        """Leaf name -> shape, in canonical order."""
        sizes = self.sizes(E, S, d, r)
        return {leaf.name: leaf.shape(sizes) for leaf in self.leaves}

    def stds(self, E: int, S: int, d: int, r: int | None = None) -> dict[str, float]:
        """Leaf name -> initialiser std (0.0: zeros), in canonical order."""
        sizes = self.sizes(E, S, d, r)
        return {leaf.name: leaf.std(sizes) for leaf in self.leaves}

    def coefficient_shape(self, S: int, r: int | None = None) -> tuple[int, ...]:
        """Per-token shape of the generator's output."""
        sizes = self.sizes(0, S, 0, r)
        return tuple(_size(sizes, s) for s in self.coefficient_dims)

    # The math. ``leaves`` maps leaf name -> array; ``phi`` is rms_normalise(t)
    # (B, T, E); ``y`` the side's stacked heads (B, T, S, d).

    def coefficients(self, xp: Any, phi: Any, leaves: Mapping[str, Any]) -> Any:
        """The generator: A(t) (B, T, S, S) or u(t) (B, T, r)."""
        raise NotImplementedError

    def delta(self, xp: Any, coeff: Any, y: Any, leaves: Mapping[str, Any]) -> Any:
        """Delta(t) y (B, T, S, d), before the gate."""
        raise NotImplementedError

    def apply(self, xp: Any, coeff: Any, y: Any, leaves: Mapping[str, Any]) -> Any:
        """L(t) y = y + diag(g) Delta(t) y, (B, T, S, d)."""
        return y + leaves["gate"][:, None] * self.delta(xp, coeff, y, leaves)

    def dense_delta(self, xp: Any, coeff: Any, leaves: Mapping[str, Any], d: int) -> Any:
        """Delta(t) as a dense (B, T, S, d, S, d) array; small sizes only."""
        raise NotImplementedError

    def penalty_sq(self, xp: Any, coeff: Any, leaves: Mapping[str, Any], d: int) -> Any:
        """||L(t) - I||_F^2 per token, (B, T)."""
        raise NotImplementedError

    def head_map(self, xp: Any, coeff: Any, leaves: Mapping[str, Any]) -> Any:
        """The compact per-token factor, when ``compact_head_map``."""
        raise NotImplementedError


class HeadsStructure(MetricStructure):
    """metric "heads": A(t) = phi(t) W_A + b_A (S, S); Delta = A(t) (x) I_d."""

    name = "heads"
    leaves = (
        _GATE,
        MetricLeaf("kernel", ("E", "S", "S"), ("E", "S")),
        MetricLeaf("bias", ("S", "S"), None),
    )
    coefficient_dims = ("S", "S")
    compact_head_map = True

    def coefficients(self, xp: Any, phi: Any, leaves: Mapping[str, Any]) -> Any:
        return xp.einsum("bte,ehk->bthk", phi, leaves["kernel"]) + leaves["bias"]

    def delta(self, xp: Any, coeff: Any, y: Any, leaves: Mapping[str, Any]) -> Any:
        return xp.einsum("btha,btad->bthd", coeff, y)

    def dense_delta(self, xp: Any, coeff: Any, leaves: Mapping[str, Any], d: int) -> Any:
        return xp.einsum("btha,ij->bthiaj", coeff, xp.eye(d))

    def penalty_sq(self, xp: Any, coeff: Any, leaves: Mapping[str, Any], d: int) -> Any:
        # L - I = (diag(g) A) (x) I_d, whose squared norm is d * ||diag(g) A||^2.
        return xp.sum((leaves["gate"][:, None] * coeff) ** 2, axis=(-2, -1)) * d

    def head_map(self, xp: Any, coeff: Any, leaves: Mapping[str, Any]) -> Any:
        """l(t) = I + diag(g) A(t), (B, T, S, S)."""
        S = coeff.shape[-1]
        return xp.eye(S) + leaves["gate"][:, None] * coeff


class LowRankStructure(MetricStructure):
    """metric "lowrank": u(t) = phi(t) W_u + b_u (r,); Delta y = U diag(u(t)) V^T y."""

    name = "lowrank"
    leaves = (
        _GATE,
        MetricLeaf("kernel", ("E", "r"), ("E",)),
        MetricLeaf("bias", ("r",), None),
        MetricLeaf("u", ("S", "d", "r"), ("r",)),
        MetricLeaf("v", ("S", "d", "r"), ("S", "d")),
    )
    coefficient_dims = ("r",)

    def coefficients(self, xp: Any, phi: Any, leaves: Mapping[str, Any]) -> Any:
        return phi @ leaves["kernel"] + leaves["bias"]

    def delta(self, xp: Any, coeff: Any, y: Any, leaves: Mapping[str, Any]) -> Any:
        z = xp.einsum("btad,adr->btr", y, leaves["v"])
        return xp.einsum("hdr,btr->bthd", leaves["u"], coeff * z)

    def dense_delta(self, xp: Any, coeff: Any, leaves: Mapping[str, Any], d: int) -> Any:
        return xp.einsum("hir,btr,ajr->bthiaj", leaves["u"], coeff, leaves["v"])

    def penalty_sq(self, xp: Any, coeff: Any, leaves: Mapping[str, Any], d: int) -> Any:
        # L - I = P diag(u) Q^T with P = g*U, Q = V, both (S*d, r): O(r^2) per token.
        g = leaves["gate"]
        S = g.shape[0]
        P = xp.reshape(g[:, None, None] * leaves["u"], (S * d, -1))
        Q = xp.reshape(leaves["v"], (S * d, -1))
        gram = xp.einsum("ir,is->rs", P, P) * xp.einsum("ir,is->rs", Q, Q)
        return xp.einsum("btr,bts,rs->bt", coeff, coeff, gram)


METRIC_STRUCTURES: dict[str, MetricStructure] = {"heads": HeadsStructure(), "lowrank": LowRankStructure()}


def structure(metric: str) -> MetricStructure:
    """The table entry of ``metric`` ("heads" or "lowrank")."""
    try:
        return METRIC_STRUCTURES[metric]
    except KeyError:
        raise DamchaValueError(
            invalid_argument(
                "metric",
                f"a metric with a generator structure, one of {tuple(METRIC_STRUCTURES)}",
                f"metric={metric!r}",
            )
        ) from None
