"""DamchaConfig: the hyper-parameters of one DAMCHA layer, validated once."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping

from ._errors import DamchaTypeError, DamchaValueError, describe

METRICS = ("heads", "lowrank", "none")
COUPLINGS = ("tied", "separate", "query")

# Which side(s) carry a metric generator, and which input feeds each side.
_SIDES = {"tied": ("qk",), "separate": ("q", "k"), "query": ("q",)}


def _check_int(name: str, value: Any, *, minimum: int = 1, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        expected = "an int or None" if optional else "an int"
        raise DamchaTypeError(f"`{name}` must be {expected} >= {minimum}. Received: {name}={describe(value)}")
    if value < minimum:
        raise DamchaValueError(f"`{name}` must be >= {minimum}. Received: {name}={value}")
    return int(value)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise DamchaTypeError(f"`{name}` must be one of {choices}. Received: {name}={describe(value)}")
    if value not in choices:
        raise DamchaValueError(f"`{name}` must be one of {choices}. Received: {name}={value!r}")
    return value


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DamchaTypeError(f"`{name}` must be a real number. Received: {name}={describe(value)}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class DamchaConfig:
    """Hyper-parameters of one DAMCHA layer.

    Args:
        query_dim: E_q, feature size of the query input x (B, N, E_q).
        num_heads: H, number of query heads.
        key_dim: d, size of each query/key head.
        value_dim: d_v, size of each value head. Defaults to ``key_dim``.
        num_kv_heads: G, number of key/value heads; must divide ``num_heads``.
            Defaults to ``num_heads`` (MHA); 1 is multi-query attention.
        context_dim: E_kv, feature size of the context c (B, M, E_kv).
            Defaults to ``query_dim``.
        output_dim: E_o, feature size of the output. Defaults to ``query_dim``.
        use_bias: whether the four projections have biases.
        metric: structure of the cross-head map: ``"heads"`` (an S x S head
            mixing per token), ``"lowrank"`` (rank-``metric_rank`` update over
            all S*d coordinates) or ``"none"`` (exactly MHA).
        metric_rank: r, only for ``metric="lowrank"``, where it is required.
        coupling: ``"tied"`` (one generator for queries and keys; needs
            ``num_kv_heads == num_heads`` and ``context_dim == query_dim``),
            ``"separate"`` (one per side) or ``"query"`` (queries only).
            Ignored, and unconstrained, when ``metric="none"``.
        scale: softmax temperature; ``None`` means ``1/sqrt(key_dim)``.
        dropout: attention-probability dropout rate in [0, 1), training only.

    All defaults are resolved at construction (``value_dim`` etc. are ints
    afterwards, ``scale`` stays ``None`` when defaulted) so two configs that
    describe the same layer compare equal.
    """

    query_dim: int
    num_heads: int
    key_dim: int
    value_dim: int | None = None
    num_kv_heads: int | None = None
    context_dim: int | None = None
    output_dim: int | None = None
    use_bias: bool = True
    metric: str = "heads"
    metric_rank: int | None = None
    coupling: str = "tied"
    scale: float | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        query_dim = _check_int("query_dim", self.query_dim)
        num_heads = _check_int("num_heads", self.num_heads)
        key_dim = _check_int("key_dim", self.key_dim)
        set_("query_dim", query_dim)
        set_("num_heads", num_heads)
        set_("key_dim", key_dim)
        for name, default in (
            ("value_dim", key_dim),
            ("num_kv_heads", num_heads),
            ("context_dim", query_dim),
            ("output_dim", query_dim),
        ):
            value = _check_int(name, getattr(self, name), optional=True)
            set_(name, default if value is None else value)
        if num_heads % self.num_kv_heads:
            raise DamchaValueError(
                "`num_heads` must be divisible by `num_kv_heads` (each key/value head serves a "
                f"whole group of query heads). Received: num_heads={num_heads}, "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if not isinstance(self.use_bias, bool):
            raise DamchaTypeError(f"`use_bias` must be a bool. Received: use_bias={describe(self.use_bias)}")
        metric = _check_choice("metric", self.metric, METRICS)
        coupling = _check_choice("coupling", self.coupling, COUPLINGS)
        if metric == "lowrank":
            if self.metric_rank is None:
                raise DamchaValueError(
                    "`metric_rank` is required with metric='lowrank' and must be an int >= 1. "
                    "Received: metric_rank=None"
                )
            set_("metric_rank", _check_int("metric_rank", self.metric_rank))
        elif self.metric_rank is not None:
            raise DamchaValueError(
                f"`metric_rank` is only used with metric='lowrank'; leave it None. "
                f"Received: metric={metric!r}, metric_rank={describe(self.metric_rank)}"
            )
        if metric != "none" and coupling == "tied":
            if self.num_kv_heads != num_heads:
                raise DamchaValueError(
                    "coupling='tied' shares one cross-head map between queries and keys, so it needs "
                    "num_kv_heads == num_heads; use coupling='query' or 'separate' for GQA/MQA. "
                    f"Received: num_heads={num_heads}, num_kv_heads={self.num_kv_heads}"
                )
            if self.context_dim != query_dim:
                raise DamchaValueError(
                    "coupling='tied' feeds queries and keys to one generator, so it needs "
                    "context_dim == query_dim; use coupling='separate' or 'query' for other "
                    f"context sizes. Received: query_dim={query_dim}, context_dim={self.context_dim}"
                )
        if self.scale is not None:
            scale = _check_real("scale", self.scale)
            if not (math.isfinite(scale) and scale > 0):
                raise DamchaValueError(f"`scale` must be a finite number > 0 or None. Received: scale={scale}")
            set_("scale", scale)
        dropout = _check_real("dropout", self.dropout)
        if not 0.0 <= dropout < 1.0:
            raise DamchaValueError(f"`dropout` must be in [0, 1). Received: dropout={dropout}")
        set_("dropout", dropout)

    # ------------------------------------------------------------------ derived

    @property
    def softmax_scale(self) -> float:
        """The logit scale actually used: ``scale`` or ``1/sqrt(key_dim)``."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.key_dim)

    @property
    def group_size(self) -> int:
        """Query heads per key/value head, H / G."""
        return self.num_heads // self.num_kv_heads  # type: ignore[operator]

    @property
    def metric_sides(self) -> tuple[str, ...]:
        """Canonical side names that own a metric generator (``()`` for metric "none")."""
        return () if self.metric == "none" else _SIDES[self.coupling]

    def side_heads(self, side: str) -> int:
        """S, the number of heads the map of ``side`` acts on."""
        return self.num_kv_heads if side == "k" else self.num_heads  # type: ignore[return-value]

    def side_features(self, side: str) -> int:
        """E, the feature size of the tokens that feed the generator of ``side``."""
        return self.context_dim if side == "k" else self.query_dim  # type: ignore[return-value]

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical parameter names and shapes, in canonical order."""
        E_q, E_kv, E_o = self.query_dim, self.context_dim, self.output_dim
        H, G, d, d_v = self.num_heads, self.num_kv_heads, self.key_dim, self.value_dim
        shapes: dict[str, tuple[int, ...]] = {}
        for name, kernel, bias in (
            ("query", (E_q, H, d), (H, d)),
            ("key", (E_kv, G, d), (G, d)),
            ("value", (E_kv, G, d_v), (G, d_v)),
            ("output", (H, d_v, E_o), (E_o,)),
        ):
            shapes[f"{name}.kernel"] = kernel  # type: ignore[assignment]
            if self.use_bias:
                shapes[f"{name}.bias"] = bias  # type: ignore[assignment]
        for side in self.metric_sides:
            S, E = self.side_heads(side), self.side_features(side)
            prefix = f"metric.{side}"
            shapes[f"{prefix}.gate"] = (S,)
            if self.metric == "heads":
                shapes[f"{prefix}.kernel"] = (E, S, S)
                shapes[f"{prefix}.bias"] = (S, S)
            else:
                r = self.metric_rank
                shapes[f"{prefix}.kernel"] = (E, r)  # type: ignore[assignment]
                shapes[f"{prefix}.bias"] = (r,)  # type: ignore[assignment]
                shapes[f"{prefix}.u"] = (S, d, r)  # type: ignore[assignment]
                shapes[f"{prefix}.v"] = (S, d, r)  # type: ignore[assignment]
        return shapes

    # ----------------------------------------------------------- serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON dict of every field; ``from_dict`` rebuilds an equal config."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DamchaConfig":
        """Rebuild a config from ``to_dict()`` output; unknown keys are an error."""
        if not isinstance(data, Mapping):
            raise DamchaTypeError(f"`data` must be a mapping. Received: data={describe(data)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DamchaValueError(
                f"`data` has keys that are not DamchaConfig fields: {unknown}. Expected a subset of {sorted(known)}"
            )
        required = sorted(f.name for f in dataclasses.fields(cls)
                          if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        missing = [name for name in required if name not in data]
        if missing:
            raise DamchaValueError(
                f"`data` lacks the required DamchaConfig fields {missing}. Received keys: {sorted(data)}"
            )
        return cls(**dict(data))

    def replace(self, **changes: Any) -> "DamchaConfig":
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)
