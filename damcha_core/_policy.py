"""The argument policy every port follows, in one place.

Ports call these functions instead of writing their own checks, probe configs
or renaming core messages: each takes ``names``, a mapping from the canonical
names (DamchaConfig's fields, the reference's arguments ``query``, ``context``,
``value``, ``mask``, and ``metric_generator``) to the port's own argument
names, and every message speaks of the port's names. For example PyTorch
passes ``{"query_dim": "embed_dim", "context_dim": "kdim", "use_bias": "bias"}``
to ``make_config`` and ``{"context": "key", "mask": "attn_mask", "query_dim":
"embed_dim", "context_dim": "kdim"}`` to ``check_shapes``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

from ._config import _SIDES, DamchaConfig
from ._errors import DamchaTypeError, DamchaValueError, describe, invalid_argument
from ._metrics import GeneratorSpec
from ._validators import (
    CONFIG_NAMES,
    COUPLING_CHOICES,
    auto_coupling,
    check_bool,
    check_choice,
    check_config_fields,
    check_finite_nonneg,
    check_int,
    check_names,
    check_offset,
    check_rate,
    check_real,
    check_seed,
    check_tied,
    display,
    unknown_fields,
)

__all__ = [
    "GeneratorSpec",
    "check_bool",
    "check_choice",
    "check_config",
    "check_finite_nonneg",
    "check_generator_arg",
    "check_int",
    "check_keys",
    "check_layer_args",
    "check_offset",
    "check_rate",
    "check_real",
    "check_seed",
    "check_shapes",
    "invalid_argument",
    "make_config",
    "resolve_coupling",
    "resolve_generators",
]


def check_config(value: Any, name: str = "config") -> DamchaConfig:
    """A ``DamchaConfig``.

    Raises:
        DamchaTypeError: anything else, naming ``name``.
    """
    if not isinstance(value, DamchaConfig):
        raise DamchaTypeError(invalid_argument(name, "a DamchaConfig", f"{name}={describe(value)}"))
    return value


def make_config(*, names: Mapping[str, str] | None = None, **fields: Any) -> DamchaConfig:
    """A ``DamchaConfig`` whose errors name the port's arguments.

    Args:
        names: canonical field name -> the port's argument name, e.g. torch's
            ``{"query_dim": "embed_dim", "context_dim": "kdim", "use_bias": "bias"}``.
        **fields: DamchaConfig fields (``coupling=None`` means "auto").

    Raises:
        DamchaTypeError, DamchaValueError: as DamchaConfig, naming the port's
            arguments; DamchaTypeError for a field DamchaConfig does not have.
    """
    names = check_names(names)
    unknown = sorted(set(fields) - set(DamchaConfig.__dataclass_fields__))
    if unknown:
        raise DamchaTypeError(unknown_fields(unknown, DamchaConfig.__dataclass_fields__))
    token = CONFIG_NAMES.set(names)
    try:
        # Missing required fields reach __post_init__ as None and are reported there.
        return DamchaConfig(**{"query_dim": None, "num_heads": None, "key_dim": None, **fields})
    finally:
        CONFIG_NAMES.reset(token)


def check_layer_args(*, names: Mapping[str, str] | None = None, **fields: Any) -> dict[str, Any]:
    """Validate the layer arguments that do not depend on the input feature sizes.

    For layers built lazily (Keras) that know ``num_heads``, ``key_dim``,
    ``metric`` ... at construction but ``query_dim``/``context_dim`` only at
    their first call. Rules between fields apply where all of their fields are
    given (e.g. ``num_heads % num_kv_heads``, the rank rule, tied coupling
    with ``num_kv_heads``).

    Args:
        names: canonical field name -> the port's argument name.
        **fields: any subset of DamchaConfig's fields.

    Returns:
        The given fields, normalised: ints as ``int``; ``value_dim=None``
        becomes ``key_dim`` and ``num_kv_heads=None`` becomes ``num_heads``
        when those are given (other sizes default to input sizes and stay
        None); ``coupling`` None/"auto" stays "auto" unless ``query_dim`` and
        ``context_dim`` are given too.
    """
    return check_config_fields(fields, check_names(names), partial=True)


def resolve_coupling(
    coupling: str | None,
    *,
    metric: str,
    query_dim: int,
    context_dim: int | None,
    num_heads: int,
    num_kv_heads: int | None,
    same_inputs: bool | None = None,
    names: Mapping[str, str] | None = None,
) -> str:
    """The coupling a layer uses: ``coupling`` itself, or for None/"auto"
    "tied" when ``num_kv_heads == num_heads``, ``context_dim == query_dim`` and
    ``same_inputs`` is not False, else "separate" (the rule of
    ``DamchaConfig(coupling="auto")``). An explicit "tied" is checked against
    the sizes when the metric is on.

    Args:
        coupling: "tied", "separate", "query", "auto" or None.
        metric: the layer's metric.
        query_dim, num_heads: E_q and H.
        context_dim, num_kv_heads: E_kv and G; None means E_q and H.
        same_inputs: False when the caller knows queries and keys come from
            different inputs (then "auto" never ties).
        names: canonical name -> the port's argument name, for messages.

    Raises:
        DamchaTypeError, DamchaValueError: a bad coupling, or "tied" with
            sizes it cannot serve.
    """
    names = check_names(names)
    if coupling is None:
        coupling = "auto"
    coupling = check_choice(display(names, "coupling"), coupling, COUPLING_CHOICES)
    metric = check_choice(display(names, "metric"), metric, ("heads", "lowrank", "none"))
    E_q = check_int(display(names, "query_dim"), query_dim)
    H = check_int(display(names, "num_heads"), num_heads)
    E_kv = check_int(display(names, "context_dim"), context_dim, optional=True)
    G = check_int(display(names, "num_kv_heads"), num_kv_heads, optional=True)
    E_kv = E_q if E_kv is None else E_kv
    G = H if G is None else G
    if same_inputs is not None:
        same_inputs = check_bool("same_inputs", same_inputs)
    if coupling == "auto":
        return auto_coupling(H, G, E_q, E_kv, same_inputs)
    if coupling == "tied" and metric != "none":
        check_tied(names, H, G, E_q, E_kv)
    return coupling


def resolve_generators(
    given: Any,
    config: DamchaConfig,
    *,
    generator_type: type | tuple[type, ...],
    spec_of: Callable[[Any], GeneratorSpec],
    names: Mapping[str, str] | None = None,
    coupling_was_auto: bool = False,
) -> dict[str, Any]:
    """The shared generators a user passed, one per metric side of ``config``.

    One rule in every port:

    * ``None`` -> ``{}``: the layer makes fresh generators.
    * with metric "none", any generator -> DamchaValueError.
    * a single generator where the config has one side (tied: "qk", query:
      "q") -> that side; with coupling "separate" -> DamchaValueError (pass a
      dict ``{"q": ..., "k": ...}``).
    * a mapping must have exactly the config's sides (missing or extra keys ->
      DamchaValueError naming them; a missing side never gets a silent fresh
      generator).
    * a value that is not a ``generator_type`` -> DamchaTypeError naming
      ``metric_generator['q']``.
    * a generator whose ``spec_of(generator)`` does not fit the side's
      ``config.generator_spec(side)`` -> DamchaValueError naming the fields
      that differ.

    Args:
        given: the user's ``metric_generator`` argument.
        config: the layer's config.
        generator_type: the port's generator class (or a tuple of classes).
        spec_of: returns the ``GeneratorSpec`` of one of the port's generators.
        names: ``{"metric_generator": ...}`` if the port calls it otherwise;
            also the port's names of the sizes a message may cite.
        coupling_was_auto: True when the port built ``config`` from a
            ``coupling`` of None or "auto" (the user chose none): messages
            then say that the coupling was chosen automatically, and why,
            instead of naming a ``coupling=`` the user never passed.

    Returns:
        side -> generator, for every metric side, or ``{}``.
    """
    check_config(config)
    names = check_names(names)
    arg = display(names, "metric_generator")
    sides = config.metric_sides
    if given is None:
        return {}
    coupling = _coupling_said(config, names, auto=check_bool("coupling_was_auto", coupling_was_auto))
    chosen, labels = _generator_sides(given, sides, coupling, arg, generator_type)
    for side, generator in chosen.items():
        spec = spec_of(generator)
        if not isinstance(spec, GeneratorSpec):
            raise DamchaTypeError(
                invalid_argument(
                    "spec_of", "a callable that returns a damcha_core.GeneratorSpec", f"spec_of(...)={describe(spec)}"
                )
            )
        differs = config.generator_spec(side).mismatches(spec)
        if differs:
            raise DamchaValueError(
                invalid_argument(
                    labels[side],
                    f"a generator that fits side {side!r} of this layer; it differs in {', '.join(differs)}",
                    f"{labels[side]} with {spec}",
                )
            )
    return chosen


def check_generator_arg(
    given: Any,
    *,
    metric: str,
    coupling: str | None,
    generator_type: type | tuple[type, ...],
    names: Mapping[str, str] | None = None,
) -> None:
    """The rules of ``resolve_generators`` that do not need the feature sizes.

    For layers built lazily (Keras): the types, the "metric none" rule and,
    when ``coupling`` is explicit, the sides (a single generator with
    coupling "separate", a mapping's missing or extra keys), so such a layer
    refuses them at construction as the other ports do. With ``coupling``
    None/"auto" the sides depend on the feature sizes and are checked by
    ``resolve_generators`` at build; so is the fit of each generator.

    Args:
        given: the user's ``metric_generator`` argument.
        metric: the layer's (validated) metric.
        coupling: the layer's (validated) coupling; None or "auto" if automatic.
        generator_type: the port's generator class (or a tuple of classes).
        names: ``{"metric_generator": ...}`` if the port calls it otherwise.

    Raises:
        DamchaTypeError, DamchaValueError: as ``resolve_generators``.
    """
    if given is None:
        return
    arg = display(check_names(names), "metric_generator")
    if metric == "none" or coupling not in (None, "auto"):
        sides = () if metric == "none" else _SIDES[cast(str, coupling)]
        said = "" if metric == "none" else f"with {display(check_names(names), 'coupling')}={coupling!r}"
        _generator_sides(given, sides, said, arg, generator_type)
        return
    if isinstance(given, generator_type):
        return
    # The sides are unknown: a mapping is held to its own keys, so only its values' types are checked.
    _generator_sides(given, tuple(given) if isinstance(given, Mapping) else ("q", "k"), "", arg, generator_type)


def _coupling_said(config: DamchaConfig, names: Mapping[str, str], *, auto: bool) -> str:
    """How a message states the coupling that decided the sides: what the user
    passed, or that it was chosen automatically and why (the user passed none,
    so ``coupling='separate'`` alone would name an argument they never gave)."""
    arg = display(names, "coupling")
    if not auto:
        return f"with {arg}={config.coupling!r}"
    H, G = config.num_heads, config.num_kv_heads
    heads = f"{display(names, 'num_kv_heads')}={G} {'==' if G == H else '!='} {display(names, 'num_heads')}={H}"
    E_q, E_kv = config.query_dim, config.context_dim
    dims = (
        f"{_feature_arg(names, 'context_dim')}={E_kv} {'==' if E_kv == E_q else '!='} "
        f"{_feature_arg(names, 'query_dim')}={E_q}"
    )
    if config.coupling == "tied":
        why = f"{heads} and {dims}"
    else:
        why = " and ".join(([heads] if G != H else []) + ([dims] if E_kv != E_q else []))
        why = why or "the queries and keys come from different inputs"
    return (
        f"with {arg}={config.coupling!r}, which was chosen automatically because {why} "
        f"(no {arg} was passed; pass {arg}=... to choose one)"
    )


def _generator_sides(
    given: Any, sides: tuple[str, ...], coupling: str, arg: str, generator_type: type | tuple[type, ...]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The side rules of ``resolve_generators``: side -> generator and side ->
    how a message names it, for a ``given`` that is not None. ``coupling`` is
    how the message states the coupling (see ``_coupling_said``), or ""."""
    kind = (
        generator_type.__name__ if isinstance(generator_type, type) else " or ".join(t.__name__ for t in generator_type)
    )
    if isinstance(given, generator_type):
        if not sides:
            raise DamchaValueError(
                invalid_argument(
                    arg, "None with metric='none' (there is no cross-head map)", f"{arg}={describe(given)}"
                )
            )
        if len(sides) != 1:
            raise DamchaValueError(
                invalid_argument(
                    arg,
                    f"a dict {{'q': ..., 'k': ...}} {coupling} (one generator per side)",
                    f"{arg}={describe(given)}",
                )
            )
        chosen = {sides[0]: given}
        labels = {sides[0]: arg}
    elif isinstance(given, Mapping):
        missing = [s for s in sides if s not in given]
        extra = sorted(repr(k) for k in given if k not in sides)
        if not sides and given:
            raise DamchaValueError(
                invalid_argument(
                    arg,
                    "None with metric='none' (there is no cross-head map)",
                    f"{arg} with keys {sorted(map(repr, given))}",
                )
            )
        if missing or extra:
            parts = ([f"missing sides {missing}"] if missing else []) + (
                [f"unexpected keys [{', '.join(extra)}]"] if extra else []
            )
            raise DamchaValueError(
                invalid_argument(
                    arg,
                    f"exactly this layer's metric sides {list(sides)} as keys{' ' if coupling else ''}{coupling}: "
                    + "; ".join(parts),
                    f"{arg} with keys {sorted(map(repr, given))}",
                )
            )
        for side in sides:
            if not isinstance(given[side], generator_type):
                raise DamchaTypeError(
                    invalid_argument(f"{arg}[{side!r}]", f"a {kind}", f"{arg}[{side!r}]={describe(given[side])}")
                )
        chosen = {side: given[side] for side in sides}
        labels = {side: f"{arg}[{side!r}]" for side in sides}
    else:
        raise DamchaTypeError(
            invalid_argument(
                arg, f"a {kind}, a dict of side -> {kind} for sides {list(sides)}, or None", f"{arg}={describe(given)}"
            )
        )
    return chosen, labels


def _feature_arg(names: Mapping[str, str], canonical: str) -> str:
    """How a message refers to a configured feature size."""
    return names.get(canonical, f"config.{canonical}")


def check_token_shape(name: str, shape: tuple[int, ...], features: int, feature_arg: str) -> None:
    """Rank-3 (batch, length, features) with the configured feature size.

    The batch and the length may be 0 (an empty batch, an empty sequence), as
    in the frameworks' own attention layers; whether a length of 0 has an
    output is ``check_shapes``'s rule (keys, see ``check_keys``).
    ``feature_arg`` is how the message names the configured size (e.g.
    ``"config.query_dim"`` or a port's ``"embed_dim"``).
    """
    shape = tuple(shape)
    received = f"{name}.shape={shape}"
    if len(shape) != 3:
        raise DamchaValueError(invalid_argument(name, "rank 3, (batch, length, features)", received))
    if shape[-1] != features:
        raise DamchaValueError(invalid_argument(name, f"{features} features ({feature_arg})", received))


# Where a port words the rule itself (a cache's length, Keras's attention axes),
# it reuses this text, so the refusal reads the same in every port.
NO_KEYS_RULE = "at least one key (M >= 1) when there are queries: a query row with no key has no defined output"


def check_keys(name: str, shape: tuple[int, ...], queries: Any, keys: Any) -> None:
    """Refuse M = 0 keys for N >= 1 queries (whatever the batch size).

    Every other empty shape has an output, the empty one: a batch of 0, or
    no queries (N = 0, also self-attention's N = M = 0). N queries over no
    key would each attend to nothing; v1 gives a row with no *visible* key
    the output 0, but a row with no key at all is refused rather than given
    a meaning (the frameworks' MHA return their output bias there).
    ``name``/``shape``: the argument that holds the keys, as passed.
    """
    # "!= 0"/"== 0", never "0 in": a symbolic size (torch.export's SymInt,
    # assumed >= 2) then answers without pinning the dim to its example.
    if keys == 0 and queries != 0:
        raise DamchaValueError(invalid_argument(name, NO_KEYS_RULE, f"{name}.shape={tuple(shape)}"))


def check_shapes(
    config: DamchaConfig,
    query_shape: tuple[int, ...],
    context_shape: tuple[int, ...] | None = None,
    mask_shape: tuple[int, ...] | None = None,
    *,
    value_shape: tuple[int, ...] | None = None,
    names: Mapping[str, str] | None = None,
    mask_name: str | None = None,
) -> tuple[Any, Any, Any]:
    """Shape rules shared by every backend; returns (B, N, M).

    ``context_shape=None`` is self-attention and needs context_dim == query_dim;
    ``value_shape=None`` means the values are the context tokens and needs
    value_input_dim == context_dim. The mask may be (N, M) or (B, H, N, M),
    any dim may be 1. A 3-D mask is rejected rather than guessed: NumPy-style
    broadcasting would read (B, N, M) as (H, N, M), a silent and common bug.

    Args:
        config: the layer's config.
        query_shape, context_shape, value_shape, mask_shape: the shapes.
        names: canonical name -> the port's argument name, for ``query``,
            ``context``, ``value``, ``mask`` and the sizes ``query_dim``,
            ``context_dim``, ``value_input_dim`` (these default to
            ``config.query_dim`` etc. in messages).
        mask_name: deprecated, use ``names={"mask": ...}``.
    """
    names = check_names(names)
    if mask_name is not None:
        warnings.warn(
            "check_shapes(mask_name=...) is deprecated; pass names={'mask': ...}", DeprecationWarning, stacklevel=2
        )
        names.setdefault("mask", mask_name)
    n = functools.partial(display, names)
    query, context, value, mask = n("query"), n("context"), n("value"), n("mask")
    check_token_shape(query, query_shape, config.query_dim, _feature_arg(names, "query_dim"))
    if context_shape is None:
        if config.context_dim != config.query_dim:
            raise DamchaValueError(
                invalid_argument(
                    context,
                    f"a tensor when {_feature_arg(names, 'context_dim')} != {_feature_arg(names, 'query_dim')} "
                    "(self-attention reuses the query, so it is required)",
                    f"{context}=None, {n('query_dim')}={config.query_dim}, {n('context_dim')}={config.context_dim}",
                )
            )
        context_shape = query_shape
    else:
        check_token_shape(context, context_shape, cast(int, config.context_dim), _feature_arg(names, "context_dim"))
        if context_shape[0] != query_shape[0]:
            raise DamchaValueError(
                invalid_argument(
                    context,
                    f"the batch size of `{query}`",
                    f"{query}.shape={tuple(query_shape)}, {context}.shape={tuple(context_shape)}",
                )
            )
    if value_shape is None:
        if config.value_input_dim != config.context_dim:
            raise DamchaValueError(
                invalid_argument(
                    value,
                    f"a tensor when {_feature_arg(names, 'value_input_dim')} != {_feature_arg(names, 'context_dim')} "
                    f"(the values default to the {context} tokens, so it is required)",
                    f"{value}=None, {n('context_dim')}={config.context_dim}, "
                    f"{n('value_input_dim')}={config.value_input_dim}",
                )
            )
    else:
        check_token_shape(value, value_shape, cast(int, config.value_input_dim), _feature_arg(names, "value_input_dim"))
        if tuple(value_shape[:2]) != tuple(context_shape[:2]):
            raise DamchaValueError(
                invalid_argument(
                    value,
                    f"the batch size and length of `{context}` (one value per key)",
                    f"{context}.shape={tuple(context_shape)}, {value}.shape={tuple(value_shape)}",
                )
            )
    # Returned as given, not int(): a port tracing symbolic sizes (torch.export's
    # SymInts) would otherwise pin a dynamic batch or length to its example value.
    B, N, M = query_shape[0], query_shape[1], context_shape[1]
    check_keys(context, context_shape, N, M)
    if mask_shape is not None:
        mask_shape = tuple(mask_shape)
        target = (B, config.num_heads, N, M)
        if len(mask_shape) not in (2, 4):
            hint = f" (for a (B, N, M) mask pass {mask}[:, None])" if len(mask_shape) == 3 else ""
            raise DamchaValueError(
                invalid_argument(
                    mask,
                    f"shape (N, M) or (B, H, N, M) with size-1 dims allowed, broadcastable to {target}{hint}",
                    f"{mask}.shape={mask_shape}",
                )
            )
        if any(s not in (1, t) for s, t in zip(mask_shape[::-1], target[::-1])):
            raise DamchaValueError(
                invalid_argument(
                    mask,
                    f"a shape broadcastable to (B, H, N, M) = {target} (each dim equal or 1)",
                    f"{mask}.shape={mask_shape}",
                )
            )
    return B, N, M
