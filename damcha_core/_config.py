"""DamchaConfig: the hyper-parameters of one DAMCHA layer, validated once."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, cast

from ._errors import DamchaError, DamchaTypeError, DamchaValueError, describe, invalid_argument
from ._metrics import METRIC_STRUCTURES, GeneratorSpec, MetricStructure, structure
from ._validators import CONFIG_NAMES, check_config_fields, unknown_fields

# Which side(s) carry a metric generator, and which input feeds each side.
_SIDES = {"tied": ("qk",), "separate": ("q", "k"), "query": ("q",)}


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
            Any r >= 1 is accepted, also r > S*d: each token's Delta(t) =
            U diag(u(t)) V^T has rank <= S*d, but the r rank-one terms it
            mixes span up to (S*d)^2 maps, so up to r = S*d * min(S*d, E + 1)
            a larger rank reaches maps a smaller one cannot. Past that bound
            every affine map from phi(t) to Delta is reachable and a larger r
            only over-parameterises (more weights, another initial scale), as
            ``key_dim * num_heads > query_dim`` does; it is not refused.
        coupling: ``"tied"`` (one generator for queries and keys; needs
            ``num_kv_heads == num_heads`` and ``context_dim == query_dim``),
            ``"separate"`` (one per side), ``"query"`` (queries only) or
            ``"auto"`` (default; also ``None``): "tied" when
            ``num_kv_heads == num_heads`` and ``context_dim == query_dim``,
            else "separate". Ignored, and unconstrained, when ``metric="none"``.
        scale: softmax temperature; ``None`` means ``1/sqrt(key_dim)``.
        dropout: attention-probability dropout rate in [0, 1), training only.
        value_input_dim: E_v, feature size of the value tokens (B, M, E_v)
            when they differ from the context's. Defaults to ``context_dim``.

    All defaults are resolved at construction (``value_dim`` etc. are ints
    afterwards, ``coupling`` is one of tied/separate/query, ``scale`` stays
    ``None`` when defaulted) so two configs that describe the same layer
    compare equal. Errors name the fields; ``damcha_core.make_config`` builds
    a config whose errors name a port's own arguments instead.
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
    coupling: str = "auto"
    scale: float | None = None
    dropout: float = 0.0
    value_input_dim: int | None = None
    # The optional sizes above are ints once __post_init__ has resolved their defaults;
    # the methods below cast them to say so.

    def __post_init__(self) -> None:
        # One implementation of the rules (damcha_core._validators), with the
        # caller's argument names when built through make_config(names=...).
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in check_config_fields(fields, CONFIG_NAMES.get()).items():
            object.__setattr__(self, name, value)  # frozen: normalised once, here

    # ------------------------------------------------------------------ derived

    @property
    def softmax_scale(self) -> float:
        """The logit scale actually used: ``scale`` or ``1/sqrt(key_dim)``."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.key_dim)

    @property
    def group_size(self) -> int:
        """Query heads per key/value head, H / G."""
        return self.num_heads // cast(int, self.num_kv_heads)

    @property
    def metric_sides(self) -> tuple[str, ...]:
        """Canonical side names that own a metric generator (``()`` for metric "none")."""
        return () if self.metric == "none" else _SIDES[self.coupling]

    def side_heads(self, side: str) -> int:
        """S, the number of heads the map of ``side`` acts on."""
        return cast(int, self.num_kv_heads if side == "k" else self.num_heads)

    def side_features(self, side: str) -> int:
        """E, the feature size of the tokens that feed the generator of ``side``."""
        return cast(int, self.context_dim if side == "k" else self.query_dim)

    @property
    def metric_structure(self) -> MetricStructure | None:
        """The table entry of ``metric`` (damcha_core._metrics), None for "none"."""
        return METRIC_STRUCTURES.get(self.metric)

    def _check_side(self, side: str) -> None:
        if side not in self.metric_sides:
            raise DamchaValueError(
                invalid_argument(
                    "side", f"one of this config's metric sides {self.metric_sides}", f"side={describe(side)}"
                )
            )

    def generator_spec(self, side: str) -> GeneratorSpec:
        """What the generator of ``side`` must be: its features, heads, metric,
        head size and rank (see ``damcha_core.resolve_generators``)."""
        self._check_side(side)
        return GeneratorSpec(
            features=self.side_features(side),
            heads=self.side_heads(side),
            metric=self.metric,
            head_dim=self.key_dim,
            rank=self.metric_rank,
        )

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical parameter names and shapes, in canonical order."""
        E_q, H, d = self.query_dim, self.num_heads, self.key_dim
        E_kv, E_v, E_o, G, d_v = config_sizes(self)
        shapes: dict[str, tuple[int, ...]] = {}
        for name, kernel, bias in (
            ("query", (E_q, H, d), (H, d)),
            ("key", (E_kv, G, d), (G, d)),
            ("value", (E_v, G, d_v), (G, d_v)),
            ("output", (H, d_v, E_o), (E_o,)),
        ):
            shapes[f"{name}.kernel"] = kernel
            if self.use_bias:
                shapes[f"{name}.bias"] = bias
        for side in self.metric_sides:
            leaves = structure(self.metric).shapes(self.side_features(side), self.side_heads(side), d, self.metric_rank)
            shapes.update({f"metric.{side}.{leaf}": shape for leaf, shape in leaves.items()})
        return shapes

    # ----------------------------------------------------------- serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON dict of every field; ``from_dict`` rebuilds an equal config."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DamchaConfig:
        """Rebuild a config from ``to_dict()`` output; unknown keys are an error."""
        if not isinstance(data, Mapping):
            raise DamchaTypeError(invalid_argument("data", "a mapping", f"data={describe(data)}"))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DamchaValueError(
                invalid_argument(
                    "data",
                    f"DamchaConfig fields as keys, a subset of {sorted(known)}",
                    f"data with unknown keys {unknown}",
                )
            )
        required = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        missing = [name for name in required if name not in data]
        if missing:
            raise DamchaValueError(
                invalid_argument(
                    "data",
                    f"the required DamchaConfig fields {missing} among its keys",
                    f"data with keys {sorted(data)}",
                )
            )
        return cls(**dict(data))

    def replace(self, **changes: Any) -> DamchaConfig:
        """A copy with some fields changed, validated again.

        A field that holds its default keeps following it: unless it is among
        the changes, each of ``value_dim``, ``num_kv_heads``, ``context_dim``,
        ``output_dim``, ``value_input_dim`` and ``coupling`` that equals what
        its default (None/"auto") resolves to in this config is reset to that
        default, so ``DamchaConfig(8, 2, 4).replace(num_heads=4)`` has 4 key/
        value heads, ``.replace(key_dim=8)`` value heads of 8 and
        ``.replace(query_dim=16)`` stays self-attention with context_dim 16.
        Defaults are resolved at construction, so which fields were given
        explicitly is not known: a value equal to its default is read as the
        default (two equal configs always replace alike). Set a field in the
        changes to keep it.
        """
        following = {}
        for name, default in _FOLLOWING:
            if name in changes:
                continue
            try:
                probe = dataclasses.replace(self, **{name: default})
            except DamchaError:
                continue
            if getattr(probe, name) == getattr(self, name):
                following[name] = default
        return dataclasses.replace(self, **{**following, **changes})


def _checked_init(generated: Any) -> Any:
    """Wrap the dataclass ``__init__`` so that a call it cannot bind (an unknown keyword, too
    many positional arguments, a required field missing) raises a DamchaTypeError naming the
    arguments, as ``make_config`` does, instead of Python's bare TypeError. ``replace`` and
    ``dataclasses.replace`` build through it too."""
    names = [f.name for f in dataclasses.fields(DamchaConfig)]
    required = [f.name for f in dataclasses.fields(DamchaConfig) if f.default is dataclasses.MISSING]

    @functools.wraps(generated)
    def __init__(self: DamchaConfig, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise DamchaTypeError(unknown_fields(unknown, names))
        if len(args) > len(names):
            raise DamchaTypeError(
                invalid_argument(
                    "DamchaConfig",
                    f"at most {len(names)} positional arguments, the fields {names} in order",
                    f"{len(args)} positional arguments",
                )
            )
        given = set(names[: len(args)]) | set(kwargs)
        twice = sorted(set(names[: len(args)]) & set(kwargs))
        missing = [name for name in required if name not in given]
        if twice or missing:
            name = (twice or missing)[0]
            rule = "one value (it was passed by position and by keyword)" if twice else "an int >= 1 (it is required)"
            raise DamchaTypeError(invalid_argument(name, rule, f"{name} {'given twice' if twice else 'not given'}"))
        generated(self, *args, **kwargs)

    return __init__


DamchaConfig.__init__ = _checked_init(DamchaConfig.__init__)  # type: ignore[method-assign]


#: The fields whose default is derived from other fields, and that default.
_FOLLOWING: tuple[tuple[str, Any], ...] = (
    ("value_dim", None),
    ("num_kv_heads", None),
    ("context_dim", None),
    ("output_dim", None),
    ("value_input_dim", None),
    ("coupling", "auto"),
)


def config_sizes(config: DamchaConfig) -> tuple[int, int, int, int, int]:
    """(E_kv, E_v, E_o, G, d_v) as ints. DamchaConfig types these fields
    ``int | None`` for its constructor's defaults and resolves every one to
    an int when it is built, so None here would be a broken config."""
    Ekv, Ev, Eo = config.context_dim, config.value_input_dim, config.output_dim
    G, dv = config.num_kv_heads, config.value_dim
    assert Ekv is not None and Ev is not None and Eo is not None and G is not None and dv is not None, config
    return Ekv, Ev, Eo, G, dv
