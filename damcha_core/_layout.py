"""How the model converters of the ports describe a host's attention layer.

``damcha_torch.convert`` and ``damcha_keras.convert`` find attention layers by
asking registered ``ModelAdapter``s, which describe each layer as an
``AttentionLayout`` of ``ProjectionSite``s. These descriptions hold no
framework object, so one definition serves both ports; each port re-exports
the three classes under its own name (``damcha_torch.ProjectionSite``,
``damcha_keras.ProjectionSite``, ...). The rules both converters apply to a
layout are here too: the values ``coupling`` takes (``check_coupling``), the
``DamchaConfig`` of a layer's maps (``layout_config``) and the sizes
``share_metric=True`` needs (``check_shareable``). The module or
layer an adapter inspects is typed ``Any`` here, so importing this module
imports NumPy at most.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from ._config import DamchaConfig
from ._errors import DamchaTypeError, DamchaValueError, describe, invalid_argument
from ._policy import resolve_coupling

__all__ = [
    "COUPLINGS",
    "FUSED_QK_NAMES",
    "QUERY_KEY_NAMES",
    "AttentionLayout",
    "ModelAdapter",
    "ProjectionSite",
    "check_coupling",
    "check_layout",
    "check_shareable",
    "check_site_sizes",
    "layout_config",
    "register",
]

# The converters' ``coupling`` values; "auto" is resolved per layer by ``layout_config``.
COUPLINGS = ("auto", "tied", "separate", "query")

# Names under which attention layers keep their query and key projections: one fused
# projection, or a query projection beside a key (or fused key/value) one. Both
# converters count a module or layer holding such projections (with weights) as
# attention whatever its class is named (timm's GPSA, MHSA and XCA; a user's
# "SelfAttn"), so that convert() names it instead of leaving it without maps while
# converting the rest. Not "in_proj": state-space mixers (Mamba, Jamba, Zamba in
# transformers) name their input projection so, and nn.MultiheadAttention keeps its
# in_proj_weight as a parameter. A query projection alone is not attention.
FUSED_QK_NAMES = ("qkv", "qk", "qkv_proj", "Wqkv", "query_key_value")
QUERY_KEY_NAMES = (
    ("q", "k"),
    ("q", "kv"),
    ("q_proj", "k_proj"),
    ("q_proj", "kv_proj"),
    ("query", "key"),
    ("query_proj", "key_proj"),
    ("query_dense", "key_dense"),
    ("_query_dense", "_key_dense"),
    ("to_q", "to_k"),
    ("to_q", "to_kv"),
    ("wq", "wk"),
    ("q_lin", "k_lin"),
)


@dataclasses.dataclass(frozen=True)
class ProjectionSite:
    """One projection of an attention layer whose output holds queries and/or
    keys, as consecutive heads of ``head_dim`` features.

    The projection maps tokens (B, T, E) to flat features (B, T, F) (a torch
    ``nn.Linear``, a Keras ``Dense``) or to stacked heads (B, T, heads, d) (as
    ``EinsumDense`` does in Keras and KerasHub); offsets count features of the
    flattened heads either way.

    Some fused projections interleave the roles: GPT-NeoX's and BLOOM's
    ``query_key_value`` holds, for each head in turn, its query, key and value
    (F = H * 3d), and Falcon's (new decoder architecture) holds, for each of
    its G key/value groups, the group's H/G queries, then its key and its
    value. ``groups`` describes them: the output is ``groups`` equal runs of
    F / groups features, each holding ``1/groups`` of the query heads at
    offset ``q`` and of the key heads at offset ``k`` (offsets within a run),
    in head order (run g holds query heads g*H/groups, ...). GPT-NeoX is
    ``ProjectionSite("query_key_value", q=0, k=d, groups=H)``. A site of one
    role needs ``groups`` to divide that role's head count only: Qwen3-Next's
    ``q_proj`` holds, for each query head in turn, its query and then its
    output gate (F = H * 2d): ``ProjectionSite("q_proj", q=0, groups=H)``,
    where H need not divide the G key heads of the ``k_proj`` beside it.

    Args:
        attr: attribute name of the projection on the attention module or
            layer (``"q_proj"``, ``"c_attn"``, ``"qkv"``, ``"_query_dense"``).
        q: feature offset of the H query heads in the projection's output (in
            each run, with ``groups``), or ``None`` when it projects no queries.
        k: feature offset of the G key heads, or ``None``.
        groups: how many runs the output is cut into (default 1: the whole
            output, the heads of each role consecutive).
    """

    attr: str
    q: int | None = None
    k: int | None = None
    groups: int = 1

    def __post_init__(self) -> None:
        # Checked here, where a custom adapter builds it: convert() would
        # otherwise fail far from the cause (getattr with a non-str name, a
        # site mapping neither role).
        where = "ProjectionSite"
        if not isinstance(self.attr, str) or not self.attr:
            raise DamchaTypeError(
                invalid_argument(
                    "attr", "the projection's attribute name, a non-empty str", f"attr={describe(self.attr)}"
                )
            )
        for field in ("q", "k"):
            _set_int(self, where, field, minimum=0, optional=True)
        if self.q is None and self.k is None:
            raise DamchaValueError(
                invalid_argument(
                    "q",
                    "the feature offset of the queries (q) or of the keys (k) the site projects, or both",
                    f"{where}({self.attr!r}, q=None, k=None)",
                )
            )
        _set_int(self, where, "groups", minimum=1)

    def roles(self) -> list[tuple[str, int]]:
        """(role, offset) pairs, in output order (within a run with ``groups``)."""
        return sorted(((r, o) for r, o in (("q", self.q), ("k", self.k)) if o is not None), key=lambda t: t[1])

    def blocks(self, num_heads: int, num_kv_heads: int, head_dim: int, features: int) -> list[tuple[str | None, int]]:
        """One run of the output as consecutive blocks: (role or None, width
        in features), widths summing to ``features / groups``; ``features`` is
        the projection's output size F.

        Raises:
            DamchaValueError: ``groups`` is not a positive int dividing F and
                the head count of each role the site holds (H for ``q``, G for
                ``k``: a query-only site, as Qwen3-Next's q_proj of H runs of a
                query head and its gate, need not divide G), or the roles'
                blocks overlap or leave the run.
        """
        groups = self.groups
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
            raise DamchaValueError(
                invalid_argument("groups", "a positive int", f"groups={describe(groups)} for `{self.attr}`")
            )
        roles = self.roles()
        heads = {"q": num_heads, "k": num_kv_heads}
        if features % groups or any(heads[role] % groups for role, _ in roles):
            raise DamchaValueError(
                invalid_argument(
                    "groups",
                    "a divisor of the projection's output features and of the head count of each role the site "
                    "holds (the query heads for q, the key heads for k)",
                    f"groups={groups} for `{self.attr}` with {features} features, {num_heads} query heads and "
                    f"{num_kv_heads} key heads",
                )
            )
        run = features // groups
        blocks: list[tuple[str | None, int]] = []
        pos = 0
        for role, offset in roles:
            width = (num_heads if role == "q" else num_kv_heads) // groups * head_dim
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < pos or offset + width > run:
                where = "the run of features each group holds" if groups > 1 else "the projection's output"
                raise DamchaValueError(
                    invalid_argument(
                        role,
                        f"an offset whose {width} features lie in {where} ({run} features) after the other role's",
                        f"{role}={describe(offset)} for `{self.attr}`",
                    )
                )
            if offset > pos:
                blocks.append((None, offset - pos))
            blocks.append((role, width))
            pos = offset + width
        if pos < run:
            blocks.append((None, run - pos))
        return blocks


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """What ``convert`` needs to know about one attention module or layer.

    Args:
        num_heads: H, query heads.
        num_kv_heads: G, key/value heads (G divides H).
        head_dim: d, features per query/key head.
        query_features: E_q, feature size of the tokens projected to queries.
        key_features: E_kv, feature size of the tokens projected to keys.
        sites: the projections carrying queries and keys.
        self_attention: queries and keys are projected from the same tokens
            (True), from different ones (False: ``coupling="auto"`` never ties
            then), or unknown (None: a layer that can be called either way,
            such as a plain Keras ``MultiHeadAttention``; "auto" ties when the
            sizes allow, as for True).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    query_features: int
    key_features: int
    sites: tuple[ProjectionSite, ...]
    self_attention: bool | None = True

    def __post_init__(self) -> None:
        where = "AttentionLayout"
        for field in ("num_heads", "num_kv_heads", "head_dim", "query_features", "key_features"):
            _set_int(self, where, field, minimum=1)
        sites = self.sites
        if not isinstance(sites, (tuple, list)) or not all(isinstance(s, ProjectionSite) for s in sites):
            raise DamchaTypeError(
                invalid_argument("sites", "a tuple of ProjectionSite", f"{where}(sites={describe(sites)})")
            )
        object.__setattr__(self, "sites", tuple(sites))
        if self.self_attention not in (True, False, None):
            raise DamchaTypeError(
                invalid_argument(
                    "self_attention", "True, False or None", f"{where}(self_attention={describe(self.self_attention)})"
                )
            )


@dataclasses.dataclass(frozen=True)
class ModelAdapter:
    """Recognises one attention layout and describes it.

    Args:
        name: short unique name (shown in errors and reprs).
        description: what it supports, one line (listed in errors).
        matches: ``module -> bool``, whether a module (a torch ``nn.Module``,
            a Keras layer) has this layout.
        layout: ``module -> AttentionLayout`` for a matched (in Keras: built)
            module; raise ``DamchaValueError`` for a variant the adapter
            cannot convert.
    """

    name: str
    description: str
    matches: Callable[[Any], bool]
    layout: Callable[[Any], AttentionLayout]

    def __post_init__(self) -> None:
        # An adapter joins a process-wide registry that every convert() asks:
        # a bad one refused here, not in every later conversion.
        for field, expected in (("name", "a non-empty str"), ("description", "a str")):
            value = getattr(self, field)
            if not isinstance(value, str) or (field == "name" and not value):
                raise DamchaTypeError(invalid_argument(field, expected, f"ModelAdapter({field}={describe(value)})"))
        for field, expected in (
            ("matches", "a callable module -> bool"),
            ("layout", "a callable module -> AttentionLayout"),
        ):
            value = getattr(self, field)
            if not callable(value):
                raise DamchaTypeError(
                    invalid_argument(field, expected, f"ModelAdapter({self.name!r}, {field}={describe(value)})")
                )


def _set_int(obj: Any, where: str, field: str, *, minimum: int, optional: bool = False) -> None:
    """Check the int field ``field`` of the frozen dataclass ``obj`` (>= ``minimum``,
    or None where ``optional``) and store it as a plain int (a NumPy integer
    read off a config is one)."""
    value = getattr(obj, field)
    if value is None and optional:
        return
    expected = f"an int >= {minimum}" + (" or None" if optional else "")
    received = f"{where}({field}={describe(value)})"
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise DamchaTypeError(invalid_argument(field, expected, received))
    if value < minimum:
        raise DamchaValueError(invalid_argument(field, expected, received))
    object.__setattr__(obj, field, int(value))


def check_layout(adapter: ModelAdapter, layout: Any) -> AttentionLayout:
    """What ``adapter.layout(...)`` returned, checked before ``convert`` reads it
    (both ports): an ``AttentionLayout`` whose sites project the queries and
    the keys once each, at whole-head offsets.

    Raises:
        DamchaTypeError: ``layout`` is not an ``AttentionLayout``.
        DamchaValueError: a role is projected by no site or by two, or an
            offset is not a multiple of ``head_dim``.
    """
    if not isinstance(layout, AttentionLayout):
        raise DamchaTypeError(
            invalid_argument(
                "layout", "an AttentionLayout", f"adapter {adapter.name!r}'s layout() returned {describe(layout)}"
            )
        )
    roles = sorted(r for site in layout.sites for r, _ in site.roles())
    if roles != ["k", "q"]:
        raise DamchaValueError(
            invalid_argument(
                "sites",
                "sites that project the queries (q) and the keys (k) once each",
                f"roles {roles} in {[site.attr for site in layout.sites]}",
            )
        )
    for site in layout.sites:
        for role, offset in site.roles():
            if offset % layout.head_dim:
                raise DamchaValueError(
                    invalid_argument(
                        role,
                        f"a multiple of head_dim={layout.head_dim} (whole heads)",
                        f"{role}={offset} for `{site.attr}`",
                    )
                )
    return layout


def check_site_sizes(
    layout: AttentionLayout, site: ProjectionSite, *, in_features: int | None, out_features: int | None
) -> None:
    """The sizes a site's projection reports, checked against ``layout`` before
    ``convert`` changes anything (both ports; either size may be unknown: None).
    Its output must hold the blocks the site describes (``ProjectionSite.blocks``);
    its input is the tokens the generators read, so it must be the layout's
    ``query_features``/``key_features`` for each role it projects (a mismatch
    converted, then failed in the first call with a raw shape error).

    Raises:
        DamchaValueError: naming the layout field and the projection's size.
    """
    if out_features is not None:
        site.blocks(layout.num_heads, layout.num_kv_heads, layout.head_dim, out_features)
    if in_features is None:
        return
    for role, _ in site.roles():
        field = "query_features" if role == "q" else "key_features"
        if getattr(layout, field) != in_features:
            raise DamchaValueError(
                invalid_argument(
                    field,
                    f"the input features of `{site.attr}`, which projects the {role} heads",
                    f"{field}={getattr(layout, field)} with `{site.attr}` taking {in_features} input features",
                )
            )


def register(registry: list[ModelAdapter], adapter: ModelAdapter, *, port: str) -> ModelAdapter:
    """Append ``adapter`` to a port's ``registry`` and return it: the body of
    ``damcha_torch.register_adapter`` and ``damcha_keras.register_adapter``.

    Args:
        registry: the port's adapters, in registration order.
        adapter: the ``ModelAdapter`` to add.
        port: the port's import name, for messages (``"damcha_torch"``).

    Raises:
        DamchaTypeError: ``adapter`` is not a ``ModelAdapter``.
        DamchaValueError: an adapter of that name is already registered.
    """
    if not isinstance(adapter, ModelAdapter):
        raise DamchaTypeError(invalid_argument("adapter", f"a {port}.ModelAdapter", f"adapter={describe(adapter)}"))
    if any(a.name == adapter.name for a in registry):
        raise DamchaValueError(
            invalid_argument("adapter", "an adapter whose name is not registered yet", f"adapter.name={adapter.name!r}")
        )
    registry.append(adapter)
    return adapter


def check_coupling(coupling: Any) -> str:
    """The ``coupling`` argument of ``convert``, normalised: ``None`` means "auto".

    Args:
        coupling: "auto", ``None``, "tied", "separate" or "query".

    Returns:
        One of ``COUPLINGS``.

    Raises:
        DamchaTypeError: neither a string nor ``None``.
        DamchaValueError: any other string.
    """
    coupling = "auto" if coupling is None else coupling
    if not isinstance(coupling, str) or coupling not in COUPLINGS:
        error = DamchaValueError if isinstance(coupling, str) else DamchaTypeError
        raise error(invalid_argument("coupling", f"one of {COUPLINGS} or None", f"coupling={describe(coupling)}"))
    return coupling


def layout_config(layout: AttentionLayout, *, metric: str, metric_rank: int | None, coupling: str) -> DamchaConfig:
    """The ``DamchaConfig`` of the maps ``convert`` gives a layer of ``layout``.

    Args:
        layout: the layer's ``AttentionLayout``.
        metric: "heads" or "lowrank".
        metric_rank: r for "lowrank".
        coupling: "auto" (resolved by ``damcha_core.resolve_coupling`` from the
            layout's sizes and ``self_attention``), "tied", "separate" or "query".

    Raises:
        DamchaValueError: the layout's sizes do not make a valid config (the
            converters name the layer).
    """
    return DamchaConfig(
        query_dim=layout.query_features,
        context_dim=layout.key_features,
        num_heads=layout.num_heads,
        num_kv_heads=layout.num_kv_heads,
        key_dim=layout.head_dim,
        metric=metric,
        metric_rank=metric_rank,
        coupling=resolve_coupling(
            coupling,
            metric=metric,
            query_dim=layout.query_features,
            context_dim=layout.key_features,
            num_heads=layout.num_heads,
            num_kv_heads=layout.num_kv_heads,
            same_inputs=layout.self_attention,
        ),
    )


def check_shareable(plans: Sequence[tuple[str, DamchaConfig]]) -> None:
    """``share_metric=True``: one generator per side serves every layer, so
    each side needs the same (features, heads, head_dim) in every layer.

    Args:
        plans: (layer name, config) of each layer to convert.

    Raises:
        DamchaValueError: naming the first layer whose sizes differ.
    """
    seen: dict[str, tuple[str, tuple[int, int, int]]] = {}
    for name, config in plans:
        for side in config.metric_sides:
            sizes = (config.side_features(side), config.side_heads(side), config.key_dim)
            first = seen.setdefault(side, (name, sizes))
            if first[1] != sizes:
                raise DamchaValueError(
                    invalid_argument(
                        "share_metric",
                        f"False unless every layer has the same (features, heads, head_dim) for side {side!r}",
                        f"share_metric=True, {first[1]} in `{first[0]}`, {sizes} in `{name}`",
                    )
                )
