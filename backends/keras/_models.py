"""Converting Keras and KerasHub models to DAMCHA in place.

Where the maps go: on each token's projected queries and keys, *inside* the
host's projection call, as in ``damcha_torch.convert``. ``convert`` replaces
the ``call`` of the sublayers that project queries and keys (``_query_dense``
and ``_key_dense`` of ``keras.layers.MultiHeadAttention`` and KerasHub's
``CachedMultiHeadAttention``, ``LlamaAttention``, ...) by the projection
followed by the cross-head map of the token that was projected. Everything the
host does after its projections runs unchanged: per-head q/k norms, RoPE, the
key/value cache (which therefore stores mapped keys) and the host's attention
kernel. The host's weights keep their names and paths; each converted
attention layer gains a sublayer ``damcha`` (``DamchaMaps``) holding the gates
and generators, created under the attention layer's name scope.

The map is computed in residual form, y + g * (Delta(t) y), so a converted
model with its gates at 0 is the original bit for bit.

The converted model (the object given to ``convert``) records the conversion
in its config: its class becomes a subclass of its own class registered as
``"damcha>ConvertedModel"``, whose config holds the host's config and the
options. ``keras.saving.load_model`` then rebuilds the host, converts it and
loads every weight; without ``import damcha_keras`` the load fails loudly
instead of returning a plain model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

import damcha_core as dc
import keras
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, _layout, describe
from damcha_core._layout import AttentionLayout, ModelAdapter, ProjectionSite
from damcha_core._params import check_params_finite, detached
from keras import ops

from ._canonical import _check_fit
from ._functional import apply_map, apply_map_matrix, dtype_name, map_matrix, map_weights
from ._functional import metric_penalty as _side_penalty
from ._generator import MetricGenerator, hold, read_sharing, record_sharing
from ._layer import DamchaAttention

__all__ = [
    "AttentionLayout",
    "DamchaMaps",
    "ModelAdapter",
    "ProjectionSite",
    "convert",
    "converted_layers",
    "damcha_variables",
    "metric_penalty",
    "register_adapter",
    "supported_layouts",
    "track_metric_penalty",
]

# The attribute under which a converted attention layer holds its DamchaMaps.
CONFIG_KEY = "damcha"
CONFIG_FORMAT = "damcha-v1-convert"
REGISTERED_NAME = "ConvertedModel"  # registered as "damcha>ConvertedModel"
# The entry of each DamchaMaps in a weights file that records share_metric (1 or 0).
SHARE_KEY = "damcha_share_metric"


# ------------------------------------------------------------------ layouts

# ProjectionSite, AttentionLayout, ModelAdapter and the registration rule hold no
# framework object: one definition in damcha_core serves the torch and Keras converters.

_ADAPTERS: list[ModelAdapter] = []


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Teach ``convert`` another attention layout; returns the adapter.

    Adapters are tried in registration order, the built-in ones first; the
    first whose ``matches`` accepts a layer converts it.
    """
    return _layout.register(_ADAPTERS, adapter, port="damcha_keras")


def supported_layouts() -> list[str]:
    """One line per layout ``convert`` knows (built-in and registered adapters)."""
    _load_builtin_adapters()
    return [f"{a.name}: {a.description}" for a in _ADAPTERS]


def _load_builtin_adapters() -> None:
    from . import _models_layouts  # noqa: F401  (registers on first import)


# ---------------------------------------------------------------- the maps


class _Shapes:
    """A config for ``damcha_core.check_params``: the canonical shapes of a
    converted layer's metric weights (its projections stay the host's)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._shapes = dict(shapes)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)


class _SiteCall:
    """Installed as a projection sublayer's ``call`` (and ``quantized_call``):
    the projection, then the maps of the heads it projected.

    A plain object rather than a closure or a Layer: Keras neither tracks nor
    saves it, so the host's weight paths and files keep their structure.
    """

    def __init__(self, maps: DamchaMaps, projection: Any, site: ProjectionSite, method: str, previous: Any) -> None:
        self.maps = maps
        self.projection = projection
        self.site = site
        self.method = method
        self.previous = previous  # an instance-level method that was there before, or None

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            y = self.previous(inputs, *args, **kwargs)
        else:
            y = getattr(type(self.projection), self.method)(self.projection, inputs, *args, **kwargs)
        return self.maps.map_site(self.site, inputs, y)


class DamchaMaps(keras.layers.Layer):
    """The DAMCHA weights of one converted attention layer, and its maps.

    Set as the sublayer ``damcha`` of the attention layer. Per metric side
    ("qk" tied, "q"/"k" separate, "q" query): a gate variable
    ``metric_<side>_gate`` (S,) starting at 0, and a ``MetricGenerator``
    ``metric_<side>`` (with ``share_metric``, one object shared by every
    converted layer). The names follow ``DamchaAttention``'s.

    Args:
        config: the layer's ``DamchaConfig`` (sizes, metric, coupling).
        layout: the attention layer's ``AttentionLayout``.
        adapter: name of the adapter that matched the layer.
        shared: generators to use, by side (``share_metric``).
        **kwargs: base Layer arguments (``name``, ``dtype``).
    """

    def __init__(
        self,
        config: DamchaConfig,
        layout: AttentionLayout,
        adapter: str,
        *,
        shared: Mapping[str, MetricGenerator] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.config = config
        self.layout = layout
        self.adapter = adapter
        self._gates: dict[str, Any] = {}
        self._generators: dict[str, MetricGenerator] = {}
        for side in config.metric_sides:
            given = None if shared is None else shared.get(side)
            self._generators[side] = (
                given
                if given is not None
                else MetricGenerator(
                    config.side_heads(side),
                    metric=config.metric,
                    key_dim=config.key_dim,
                    metric_rank=config.metric_rank,
                    name=f"metric_{side}",
                    dtype=self.dtype_policy,
                )
            )
        # track_metric_penalty: add weight * this layer's penalty / layers to the losses.
        self._penalty_weight = 0.0
        self._penalty_layers = 1
        for generator in self._generators.values():
            hold(generator, self)  # convert(share_metric=True) hands every layer the first's

    def build(self, input_shape: Any = None) -> None:
        cfg = self.config
        for side in cfg.metric_sides:
            generator = self._generators[side]
            if not generator.built:
                generator.build((None, None, cfg.side_features(side)))
            # The gate is per layer even when the generator is shared; 0 = exactly the host.
            self._gates[side] = self.add_weight(
                name=f"metric_{side}_gate", shape=(cfg.side_heads(side),), initializer="zeros"
            )
        self.built = True

    def save_own_variables(self, store: Any) -> None:
        """The gates, as Keras saves them, and whether other converted layers map
        with these generators (``record_sharing``: ``share_metric=True`` over two
        or more layers).

        Keras saves a shared generator once, under the first layer that holds it,
        and loads each object once: a file saved with ``share_metric=False`` would
        load into a model converted with ``share_metric=True`` without a word (the
        other layers' generators ignored, other outputs). The layout recorded here
        lets ``load_own_variables`` refuse that file.
        """
        super().save_own_variables(store)
        record_sharing(store, SHARE_KEY, self._generators, self)

    def load_own_variables(self, store: Any) -> None:
        """The gates; a file recording another sharing than this model's
        conversion is refused (before this layer's gates are assigned). A file
        saved before the layout was recorded loads as before."""
        store, mismatch = read_sharing(store, SHARE_KEY, self._generators, self)
        if mismatch is not None:
            saved, mine = mismatch
            layout = {
                True: "generators shared by the converted layers (share_metric=True)",
                False: "generators of each layer's own (share_metric=False, or a single converted layer)",
            }
            raise DamchaValueError(
                dc.invalid_argument(
                    "share_metric",
                    f"the sharing the weights were saved with: {layout[saved]}. Convert the model with "
                    f"dk.convert(model, share_metric={saved}) before loading them",
                    f"layer {self.path!r} with {layout[mine]}",
                )
            )
        super().load_own_variables(store)

    @property
    def metric_gates(self) -> dict[str, Any]:
        """Side -> gate variable (S,)."""
        return dict(self._gates)

    @property
    def metric_generators(self) -> dict[str, MetricGenerator]:
        """Side -> ``MetricGenerator`` (shared ones are the same object in every layer)."""
        return dict(self._generators)

    # ---------------------------------------------------------------- math

    def map_site(self, site: ProjectionSite, tokens: Any, y: Any) -> Any:
        """Map the query/key heads of a projection output ``y`` (B, T, heads, d),
        (B, T, F) or any (B, T, ...) holding F features (GPT-NeoX's (B, T, H, 3d))
        computed from ``tokens`` (B, T, E)."""
        cfg = self.config
        d = cfg.key_dim
        rank = len(tokens.shape)
        if rank != 3:
            # Tokens without a batch axis (Qwen3.5's vision patches, (N, E)) or with more leading
            # axes: one sequence of them, as each token's map reads that token alone.
            flat = ops.reshape(tokens, (1, -1, tokens.shape[-1]))
            mapped = self.map_site(site, flat, ops.reshape(y, (1, -1, *y.shape[rank - 1 :])))
            return ops.reshape(mapped, ops.shape(y))
        # (B, T, heads, d) as EinsumDense gives it, else the output's features as heads
        # (a flat (B, T, F), or GPT-NeoX's (B, T, H, 3d)).
        stacked = len(y.shape) == rank + 1 and y.shape[-1] == d
        features = math.prod(y.shape[rank - 1 :])
        groups = site.groups
        # One run of the output per group (see ProjectionSite) as consecutive blocks of heads.
        blocks = [(role, width // d) for role, width in site.blocks(cfg.num_heads, cfg.side_heads("k"), d, features)]
        lead = ops.shape(y)[: rank - 1]
        if groups > 1:
            heads = ops.reshape(y, (*lead, groups, features // d // groups, d))
        else:
            heads = y if stacked else ops.reshape(y, (*lead, features // d, d))
        # Blocks by slicing, not ops.split, and as few reshapes as the layout allows: in
        # eager Keras on torch each op call costs 25-60 us (a decoding step maps every
        # layer's site), a slice a few. Runs of one head per block (GPT-NeoX's q, k, v
        # of each head): each block is heads[..., i, :], (..., groups, d), no reshape.
        single = groups > 1 and all(n == 1 for _, n in blocks)
        starts = np.cumsum([0] + [n for _, n in blocks])[:-1].tolist()
        out = []
        # Each side's A(tokens), made once per call: a tied query and key of one
        # projection (GPT-2's, GPT-NeoX's fused qkv) are two blocks of one side.
        coeffs: dict[str, Any] = {}
        whole_run = len(blocks) == 1
        for (owner, count), start in zip(blocks, starts):
            part = heads[..., start, :] if single else (heads if whole_run else heads[..., start : start + count, :])
            side = None if owner is None else dc.side_of(cfg, owner)
            if side is None:
                out.append(part)
            elif groups == 1 or single:
                out.append(self._map(side, tokens, part, coeffs))
            else:
                # The role's heads of all runs, (..., groups, S/groups, d) -> (..., S, d) in head order.
                whole = self._map(side, tokens, ops.reshape(part, (*lead, groups * count, d)), coeffs)
                out.append(ops.reshape(whole, (*lead, groups, count, d)))
        if single:
            out = [ops.stack(out, axis=-2)]  # (..., groups, blocks, d)
        mapped = out[0] if len(out) == 1 else ops.concatenate(out, axis=-2)
        return mapped if stacked and groups == 1 else ops.reshape(mapped, ops.shape(y))

    def _map(self, side: str, tokens: Any, y: Any, coeffs: dict[str, Any]) -> Any:
        cfg = self.config
        generator, gate = self._generators[side], self._gates[side]
        if cfg.metric == "heads" and not self._penalty_weight and generator.compute_dtype == self.compute_dtype:
            # DamchaAttention's fast form: the gate and identity folded into one (B, T, S, S)
            # matrix per token. Training keeps that matrix and y for the product's backward,
            # where the coefficient form also kept the gated term g * A y, the size of y (a
            # converted GPT-2's training step on JAX: 1.06x the host's memory, XLA's estimate).
            matrix = coeffs.get(side)
            if matrix is None:
                matrix = coeffs[side] = map_matrix(tokens, *map_weights((generator.kernel, generator.bias, gate)))
            if dtype_name(matrix) != dtype_name(y):
                matrix = ops.cast(matrix, dtype_name(y))
            return apply_map_matrix(matrix, y)
        coeff = coeffs.get(side)
        if coeff is None:
            coeff = coeffs[side] = generator(tokens)
        u, v = getattr(generator, "u", None), getattr(generator, "v", None)
        if self._penalty_weight:
            roles = sum(dc.side_of(cfg, r) is not None for r in ("q", "k"))
            scale = self._penalty_weight / (roles * self._penalty_layers)
            self.add_loss(scale * _side_penalty(cfg, side, coeff, gate, u, v))
        return apply_map(y, coeff, gate, metric=cfg.metric, u=u, v=v)

    # ---------------------------------------------------- canonical weights

    def canonical_variables(self) -> dict[str, Any]:
        """The metric's canonical names (``metric.qk.kernel``, ``metric.qk.gate``,
        ...) -> ``keras.Variable``; the projections stay the host's."""
        out: dict[str, Any] = {}
        for side in self.config.metric_sides:
            generator = self._generators[side]
            for leaf in generator.leaf_names():
                out[f"metric.{side}.{leaf}"] = getattr(generator, leaf)
            out[f"metric.{side}.gate"] = self._gates[side]
        return out

    def to_canonical(self) -> dict[str, np.ndarray]:
        """The metric weights as canonical float64 NumPy arrays."""
        return {
            k: np.asarray(keras.ops.convert_to_numpy(v), dtype=np.float64)
            for k, v in self.canonical_variables().items()
        }

    def load_canonical(self, params: Mapping[str, Any]) -> DamchaMaps:
        """Assign canonical metric weights (exactly this layer's metric names,
        real floating, finite, in the canonical shapes); returns the maps."""
        variables = self.canonical_variables()
        if not isinstance(params, Mapping):
            raise DamchaTypeError(
                dc.invalid_argument("params", "a mapping of canonical names", f"params={describe(params)}")
            )
        params = detached(params)  # read once: a dict of the values, torch's detached
        missing, extra = sorted(set(variables) - set(params)), sorted(set(params) - set(variables))
        if missing or extra:
            raise DamchaValueError(
                dc.invalid_argument(
                    "params",
                    f"exactly the metric weights of layer {self.path!r}: missing {missing}, unexpected {extra}",
                    f"{len(params)} names",
                )
            )
        # The rules of every other load_canonical (damcha_core's): real floating arrays (a
        # complex, bool or integer one refused, not cast), the shapes, finite values; torch
        # tensors that require grad are read detached, bfloat16 ones widened.
        shapes = {name: tuple(variable.shape) for name, variable in variables.items()}
        values = check_params_finite(params, _Shapes(shapes))  # type: ignore[arg-type]  # duck-typed on param_shapes()
        for name, variable in variables.items():  # all checked before any is assigned
            _check_fit(name, values[name], variable, self)
        for name, variable in variables.items():
            variable.assign(values[name].astype(keras.backend.standardize_dtype(variable.dtype)))
        return self


# ------------------------------------------------------------------ convert


def _is_attention_like(layer: Any) -> bool:
    """A layer whose class name says attention, except one without weights that
    builds masks (Moonshine's ``ComputeAttentionMask``): it attends nothing, and
    refusing a model over it hid that its attention layers convert."""
    name = type(layer).__name__.lower()
    return "attention" in name and not ("mask" in name and not layer.weights)


def _projects_queries_and_keys(layer: Any) -> bool:
    """``layer`` holds query/key projections (sublayers with weights) under the names
    ``_layout.FUSED_QK_NAMES``/``QUERY_KEY_NAMES`` list, as damcha_torch's convert reads
    child modules: a user's `SelfAttn` computes attention whatever its class is named."""

    def weighted(attr: str) -> bool:
        sub = layer.__dict__.get(attr)
        return isinstance(sub, keras.layers.Layer) and bool(sub.weights)

    return any(weighted(a) for a in _layout.FUSED_QK_NAMES) or any(
        weighted(q) and weighted(k) for q, k in _layout.QUERY_KEY_NAMES
    )


def _walk(model: keras.layers.Layer) -> list[keras.layers.Layer]:
    # Keras has no public recursive sublayer iterator; _flatten_layers is the
    # one Keras's own quantize() and weights use.
    return model._flatten_layers(include_self=True, recursive=True)


def _name(layer: Any) -> str:
    return layer.path or layer.name


def _find(model: keras.layers.Layer) -> tuple[list[tuple[Any, ModelAdapter]], list[str], list[Any]]:
    """(matched layers, unknown attention-like layers, DamchaAttention layers)."""
    _load_builtin_adapters()
    matched: list[tuple[Any, ModelAdapter]] = []
    claimed: set[int] = set()
    damcha = []
    for layer in _walk(model):
        if id(layer) in claimed:
            continue
        if isinstance(layer, (DamchaAttention, DamchaMaps)):
            inside = layer._flatten_layers(include_self=True, recursive=True)
            claimed.update(id(sub) for sub in inside)
            if isinstance(layer, DamchaAttention):
                damcha.append(layer)
            continue
        adapter = next((a for a in _ADAPTERS if a.matches(layer)), None)
        if adapter is not None:
            matched.append((layer, adapter))
            claimed.update(id(sub) for sub in layer._flatten_layers(include_self=True, recursive=True))
    supported = [layer for layer, _ in matched] + damcha
    unknown = []
    for layer in _walk(model):
        if id(layer) in claimed or not (_is_attention_like(layer) or _projects_queries_and_keys(layer)):
            continue
        problem = _wrapper_problem(layer, supported)
        if problem is not None:
            unknown.append(f"{_name(layer)} ({type(layer).__module__}.{type(layer).__qualname__}{problem})")
    return matched, unknown, damcha


def _plans(
    matched: list[tuple[Any, ModelAdapter]], metric: str, metric_rank: int | None, coupling: str, loading: bool
) -> tuple[list[tuple[Any, ModelAdapter, AttentionLayout, Any]], list[DamchaValueError | DamchaTypeError]]:
    """(layer, adapter, layout, config) of each matched layer, and the errors of
    those that cannot be converted ("Cannot convert layer `path` (adapter): why"),
    without changing any layer."""
    plans: list = []
    failures: list[DamchaValueError | DamchaTypeError] = []
    for layer, adapter in matched:
        try:
            if not layer.built:
                raise DamchaValueError("the layer is not built (call the model once)")
            if CONFIG_KEY in layer.__dict__ or getattr(layer, CONFIG_KEY, None) is not None:
                # Checked here, not when attaching: the layers before it had been converted already.
                raise DamchaValueError(f"the layer already has an attribute `{CONFIG_KEY}`")
            layout = _layout.check_layout(adapter, adapter.layout(layer))
            _check_sites(layer, layout, quantized=loading)
            if layout.self_attention is None and "cross" in _name(layer).rpartition("/")[0].rpartition("/")[2].lower():
                # A layer that can serve either (an MHA) inside a wrapper named as a cross-attention
                # (BLIP-2's Q-Former: "cross_attention" holding an MHA named "attention"): the wrapper
                # passes it other tokens' keys, so coupling "auto" maps them apart.
                layout = dataclasses.replace(layout, self_attention=False)
            config = _layout.layout_config(layout, metric=metric, metric_rank=metric_rank, coupling=coupling)
        except (DamchaValueError, DamchaTypeError) as exc:
            failures.append(type(exc)(f"Cannot convert layer `{_name(layer)}` ({adapter.name}): {exc}"))
            continue
        plans.append((layer, adapter, layout, config))
    return plans, failures


# Layers whose weights scale and shift features one by one: a wrapper holding them beside a
# supported attention layer computes no projection of its own.
_NORMS = (
    keras.layers.LayerNormalization,
    keras.layers.RMSNormalization,
    keras.layers.BatchNormalization,
    keras.layers.GroupNormalization,
)


def _wrapper_problem(layer: Any, supported: list[Any]) -> str | None:
    """None when ``layer`` only wraps supported attention layers (KerasHub's
    DINOV2Attention: an MHA and a dropout): converting the inner layers converts
    what it computes, as it calls them. Otherwise why it is an unknown layout,
    as a suffix for its entry ("" when it holds no supported layer).

    A wrapper's own weights could be projections of attention it computes
    itself, which convert() would leave unmapped: such a wrapper is refused,
    unless they are all normalisation layers' (BLIP-2's QFormerAttention: an
    MHA, a dropout and the residual's LayerNorm), which project nothing: the
    queries and keys are still the inner layer's projections of what it is
    given.
    """
    sublayers = layer._flatten_layers(include_self=False, recursive=True)
    inside = {id(sub) for sub in sublayers}
    inner = [sub for sub in supported if id(sub) in inside]
    if not inner:
        return ""
    covered = {id(v) for sub in inner for v in sub.weights}
    covered |= {id(v) for sub in sublayers if isinstance(sub, _NORMS) for v in sub.weights}
    own = [v.path for v in layer.weights if id(v) not in covered]
    if not own:
        return None
    shown = ", ".join(own[:3]) + (f" and {len(own) - 3} more" if len(own) > 3 else "")
    return (
        f", which wraps the supported {', '.join(_name(sub) for sub in inner)} but also holds weights "
        f"that are not that layer's: {shown}"
    )


def _supported_text() -> str:
    # A pointer, not the list: inlined, the layouts' descriptions (~6,000
    # characters) came before the part that names the user's layer.
    return f"one of the {len(supported_layouts())} that damcha_keras.supported_layouts() lists"


def _is_converted(model: Any) -> bool:
    return isinstance(model, _ConvertedModel) and model._damcha_convert is not None


def convert(
    model: keras.layers.Layer,
    *,
    metric: str = "heads",
    metric_rank: int | None = None,
    coupling: str | None = "auto",
    share_metric: bool = False,
) -> keras.layers.Layer:
    """Convert every supported attention layer of ``model`` to DAMCHA, in place.

    The converted model computes exactly what it computed before (gates start
    at 0). The host's weights keep their names and paths; each converted
    attention layer gains a sublayer ``damcha`` (``DamchaMaps``). The maps act
    on the projected queries and keys, before per-head q/k norms, RoPE and the
    key/value cache. ``model`` records the conversion in its config, so
    ``model.save("m.keras")`` / ``keras.saving.load_model`` round-trip it.

    Convert a built model (KerasHub backbones and tasks are built at
    construction), before its first ``fit``/``evaluate``: an optimizer built
    earlier does not see the new variables, so a ``model`` whose optimizer is
    built (after a ``fit``/``evaluate``, or loaded compiled) is refused; a
    model compiled but not yet run (KerasHub tasks compile at construction)
    is fine. The functions Keras and KerasHub traced on ``model`` and on the
    models inside it (``predict``, ``evaluate``, ``generate``) are dropped, to
    be traced again with the maps at their next call (on TensorFlow they kept
    running the unconverted projections); a task around a converted backbone
    keeps its own: convert the model you call.

    Args:
        model: a built Keras layer or model, e.g. a KerasHub ``GPT2Backbone``,
            ``BertBackbone``, ``LlamaCausalLM``, or a functional model using
            ``keras.layers.MultiHeadAttention``.
        metric: "heads" (default) or "lowrank".
        metric_rank: r for "lowrank".
        coupling: "auto" (default; ``None`` means the same): "tied" where
            queries and keys have as many heads and tokens of one size (self-
            attention without GQA), "separate" otherwise (GQA/MQA, cross-
            attention); or force "tied", "separate" or "query".
        share_metric: one generator per side for all converted layers (the
            stack-wise sharing of the spec); each layer keeps its own gates.

    Returns:
        ``model``, converted.

    Raises:
        DamchaTypeError: ``model`` is not a Keras layer, or a bad option type.
        DamchaValueError: an unbuilt model or one whose optimizer is built, no supported attention layer, an
            attention layer of a layout no adapter knows (a layer that only wraps a supported one, holding no
            weights but its, is converted through it; nothing is converted then), quantized query/key
            projections (convert, then ``model.quantize``), or a model already converted.

    Warns:
        UserWarning: ``model`` is a layer but not a ``keras.Model``: a parent
            whose config does not serialise its layers (KerasHub backbones and
            tasks) saves ``.keras`` files without the conversion.
    """
    return _convert(
        model, metric=metric, metric_rank=metric_rank, coupling=coupling, share_metric=share_metric, loading=False
    )


def _convert(
    model: keras.layers.Layer,
    *,
    metric: str,
    metric_rank: int | None,
    coupling: str | None,
    share_metric: bool,
    loading: bool,
) -> keras.layers.Layer:
    """``convert``; ``loading``: the model is rebuilt from a ``.keras`` file of a
    converted model, whose projections may have been quantized after conversion
    (Keras rebuilds a quantized layer quantized, then loads its integer weights)."""
    if not isinstance(model, keras.layers.Layer):
        raise DamchaTypeError(dc.invalid_argument("model", "a Keras layer or model", f"model={describe(model)}"))
    metric = dc.check_choice("metric", metric, ("heads", "lowrank"))
    coupling = _layout.check_coupling(coupling)
    share_metric = dc.check_bool("share_metric", share_metric)
    if _is_converted(model) or any(isinstance(layer, DamchaMaps) for layer in _walk(model)):
        raise DamchaValueError(
            dc.invalid_argument(
                "model",
                "a model not yet converted; it is already converted (it has DAMCHA maps: "
                f"{', '.join(converted_layers(model)) or type(model).__name__})",
                f"model={type(model).__name__}",
            )
        )
    optimizer = getattr(model, "optimizer", None) if isinstance(model, keras.Model) else None
    if optimizer is None or not getattr(optimizer, "built", False):
        # A model inside a fitted one (`lm.backbone` after `lm.fit()`): the outer model's
        # optimizer never trains the new variables either.
        outer = _fitted_model_around(model)
        if outer is not None:
            optimizer = outer.optimizer
    else:
        outer = None
    if optimizer is not None and getattr(optimizer, "built", False):
        holder = model if outer is None else outer
        inside = "" if outer is None else f"{type(model).__name__} {model.name!r} inside "
        # Refused, not handled: an optimizer builds its slots for the trainable variables it
        # sees at the first fit()/evaluate() (or when a compiled model is loaded) and never
        # learns of variables added later (TensorFlow then silently never trains the gates,
        # torch and JAX fail inside Keras). Recompiling for the caller would drop the
        # optimizer's state. A model compiled but not yet run (KerasHub tasks compile at
        # construction) is fine: its optimizer is built at the first fit().
        raise DamchaValueError(
            dc.invalid_argument(
                "model",
                "a model whose optimizer is not built yet: an optimizer built before convert() never trains "
                "the new DAMCHA variables. Convert before the first fit()/evaluate(), then compile and fit; or "
                "compile this model again (a new optimizer) and then convert it; load a saved model with "
                "keras.saving.load_model(..., compile=False)",
                f"{inside}{type(holder).__name__} {holder.name!r} compiled with optimizer {type(optimizer).__name__}, "
                f"already built for {len(getattr(optimizer, '_trainable_variables', []) or [])} variables",
            )
        )
    if not model.built:
        raise DamchaValueError(
            dc.invalid_argument(
                "model",
                "a built model (call it once, or build it, before convert())",
                f"an unbuilt {type(model).__name__} {model.name!r}",
            )
        )
    matched, unknown, damcha = _find(model)
    # Validate every layer before touching any: a failure leaves the model as it was.
    plans, failures = _plans(matched, metric, metric_rank, coupling, loading)
    if unknown:
        # The known layers that cannot be converted too: a refusal naming only an
        # attention-named helper (XLNet's mask layer) would hide them.
        also = (
            f"; and layers of known layouts that cannot be converted: {'; '.join(str(e) for e in failures[:3])}"
            if failures
            else ""
        )
        raise DamchaValueError(
            dc.invalid_argument(
                "model",
                f"attention layers of a layout convert() knows ({_supported_text()}; teach it another with "
                "damcha_keras.register_adapter), or layers that only wrap such a layer (holding no weights but "
                "that layer's). Nothing was converted",
                f"model with layers of unknown layouts: {', '.join(unknown[:5])}"
                + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
                + also,
            )
        )
    if failures:
        raise failures[0]
    if not matched:
        if damcha:
            raise DamchaValueError(
                dc.invalid_argument(
                    "model",
                    "a model not yet converted; it is already converted (DamchaAttention at "
                    f"{', '.join(_name(a) for a in damcha[:5])})",
                    f"model={type(model).__name__}",
                )
            )
        raise DamchaValueError(
            dc.invalid_argument(
                "model",
                f"a model with an attention layer convert() supports ({_supported_text()}); it has no attention layer "
                "convert() supports",
                f"model={type(model).__name__}",
            )
        )

    if share_metric:
        _layout.check_shareable([(_name(layer), c) for layer, _, _, c in plans])

    shared: dict[str, MetricGenerator] = {}
    for layer, adapter, layout, config in plans:
        maps = DamchaMaps(
            config,
            layout,
            adapter.name,
            shared=shared if share_metric else None,
            name=CONFIG_KEY,
            dtype=layer.dtype_policy,
        )
        _build_in_scope(layer, maps)
        if share_metric:
            for side in config.metric_sides:
                shared.setdefault(side, maps.metric_generators[side])
        _attach(layer, maps)
        for site in layout.sites:
            _install(maps, site, getattr(layer, site.attr))
    if keras.backend.backend() == "torch":
        _refresh_torch_params(model)
    _forget_traced_functions(model)
    _record(model, metric=metric, metric_rank=metric_rank, coupling=coupling, share_metric=share_metric)
    _refuse_inner_presets(model)
    if not isinstance(model, keras.Model):
        # The conversion is recorded in this layer's config, which a parent saves only if its
        # own config serialises its layers (functional models do; KerasHub backbones and
        # tasks rebuild them from constructor arguments, and their .keras files would then
        # load as plain models, Keras ignoring the extra weights).
        warnings.warn(
            f"convert() was given a layer that is not a keras.Model ({type(model).__name__} {model.name!r}): "
            "a .keras file of a model holding it keeps the conversion only if that model's config serialises "
            "this layer (functional models do; KerasHub backbones and tasks do not). Convert the model you "
            "save (e.g. the backbone or the task) instead.",
            UserWarning,
            stacklevel=3,  # the caller of convert()
        )
    return model


# The functions Keras (predict, evaluate, fit) and KerasHub (generate) trace once and keep
# on a model: on TensorFlow a tf.function traced before convert() keeps running the
# projections without their maps. Reset, they are traced again at the next call, as
# compile() resets them.
_TRACED_FUNCTIONS = ("train_function", "test_function", "predict_function", "generate_function")


def _forget_traced_functions(model: Any) -> None:
    """Drop the traced functions of ``model`` and of every model nested in it."""
    models = [model] if isinstance(model, keras.Model) else []
    models += [m for m in model._flatten_layers(include_self=False) if isinstance(m, keras.Model)]
    for m in models:
        for attr in _TRACED_FUNCTIONS:
            if getattr(m, attr, None) is not None:
                setattr(m, attr, None)


def _check_sites(layer: Any, layout: AttentionLayout, *, quantized: bool) -> None:
    """Refuse sites convert() cannot map (their roles and offsets are checked
    already: ``_layout.check_layout``); ``quantized``: accept quantized projections."""
    for site in layout.sites:
        projection = getattr(layer, site.attr, None)
        if not isinstance(projection, keras.layers.Layer):
            raise DamchaValueError(
                f"the layer has no projection sublayer `{site.attr}`. Received: {describe(projection)}"
            )
        for method in ("call", "quantized_call"):
            if isinstance(projection.__dict__.get(method), _SiteCall):
                raise DamchaValueError(f"`{site.attr}` already carries a DAMCHA map (converted twice?)")
        mode = getattr(projection, "quantization_mode", None)
        if mode is not None and not quantized:
            # The supported (documented, tested) order is convert, then quantize. A .keras file
            # of a converted model with quantized projections was made in that order: Keras
            # rebuilds those projections quantized, so its load passes quantized=True.
            raise DamchaValueError(
                f"`{site.attr}` is quantized ({mode}); convert the float model, then quantize it "
                "(model.quantize after dk.convert; its .keras file loads back converted and quantized)."
            )
        _layout.check_site_sizes(
            layout, site, in_features=_in_features(projection), out_features=_out_features(projection)
        )


def _in_features(projection: Any) -> int | None:
    """The input size of a built projection: a ``Dense``'s input spec's last axis,
    an unquantized ``EinsumDense``'s kernel axis named by its input's last letter
    (``abc,cde->abde``: c, the kernel's first axis); None for others."""
    if isinstance(projection, keras.layers.Dense):
        axes = getattr(getattr(projection, "input_spec", None), "axes", None)
        value = axes.get(-1) if isinstance(axes, dict) else None
        return value if isinstance(value, int) else None
    if isinstance(projection, keras.layers.EinsumDense) and getattr(projection, "quantization_mode", None) is None:
        inputs, _, rest = str(getattr(projection, "equation", "")).partition(",")
        kernel_axes = rest.partition("->")[0]
        letter = inputs[-1:] if inputs[-1:].isalpha() else ""
        kernel = getattr(projection, "_kernel", None)
        shape = getattr(kernel, "shape", None)
        if letter and kernel_axes.count(letter) == 1 and shape is not None and len(shape) == len(kernel_axes):
            value = shape[kernel_axes.index(letter)]
            return value if isinstance(value, int) else None
    return None


def _out_features(projection: Any) -> int | None:
    """The output size F of a ``Dense`` projection (its ``units``); None for
    others (an ``EinsumDense``'s output axes depend on its equation: the maps
    check its output on the first call)."""
    units = getattr(projection, "units", None) if isinstance(projection, keras.layers.Dense) else None
    return units if isinstance(units, int) else None


def _build_in_scope(layer: Any, maps: DamchaMaps) -> None:
    """Build ``maps`` so its variables' paths sit under ``layer``'s path
    (``.../self_attention/damcha/metric_qk/kernel``), as if the attention
    layer had built it: unique paths keep torch's parameter dict, dtype
    policy maps and path-keyed tools working."""
    path = layer.path or layer.name
    parent, _, last = path.rpartition("/")
    with keras.name_scope(last, override_parent=parent):
        maps.build()


def _attach(layer: Any, maps: DamchaMaps) -> None:
    """Set ``maps`` as the tracked sublayer ``damcha`` of a built layer.

    Keras locks a built layer's state; its own ``enable_lora`` unlocks the
    tracker the same way to add variables after build.
    """
    if CONFIG_KEY in layer.__dict__ or getattr(layer, CONFIG_KEY, None) is not None:
        raise DamchaValueError(f"layer `{_name(layer)}` already has an attribute `{CONFIG_KEY}`")
    tracker = getattr(layer, "_tracker", None)
    if tracker is None or not tracker.locked:
        setattr(layer, CONFIG_KEY, maps)
        return
    tracker.unlock()
    try:
        setattr(layer, CONFIG_KEY, maps)
    finally:
        tracker.lock()


def _install(maps: DamchaMaps, site: ProjectionSite, projection: Any) -> None:
    for method in ("call", "quantized_call"):
        previous = projection.__dict__.get(method)
        setattr(projection, method, _SiteCall(maps, projection, site, method, previous))


def _refresh_torch_params(model: keras.layers.Layer) -> None:
    """On the torch backend every built layer mirrors its variables (its
    sublayers' included) in a torch ParameterDict; refresh them so
    ``model.parameters()`` includes the new DAMCHA variables."""
    for layer in _walk(model):
        if hasattr(layer, "_torch_params"):
            layer._track_variables()


# ------------------------------------------------------- recorded conversion


class _ConvertedModel:
    """Mixed into the class of a converted model: its config is the host's
    config plus the ``convert`` options, and ``from_config`` rebuilds the host
    and converts it, so ``.keras`` files keep the conversion. KerasHub presets
    cannot (``save_to_preset`` is refused, below). An instance of the class
    without recorded options (what ``keras.models.clone_model`` builds layer by
    layer: it drops the maps) is a plain model."""

    # The host Keras class (Keras ships no types: type[Any]); the loader ConvertedModel has none.
    _damcha_host: type[Any] = object
    _damcha_convert: str | None = None

    def get_config(self) -> dict[str, Any]:
        host = type(self)._damcha_host
        record = {
            "module": host.__module__,
            "class_name": host.__name__,
            "config": host.get_config(self),
            "registered_name": keras.saving.get_registered_name(host),
        }
        options = None if self._damcha_convert is None else json.loads(self._damcha_convert)
        return {"host": record, CONFIG_KEY: options}

    def save_to_preset(self, preset_dir: Any, *args: Any, **kwargs: Any) -> None:
        """Refused: KerasHub's ``from_preset`` loads a task's preset as the unconverted
        model (it dropped the DAMCHA weights without a word) and refuses a backbone's."""
        host = type(self)._damcha_host
        if not hasattr(host, "save_to_preset"):
            raise AttributeError(f"{host.__name__!r} object has no attribute 'save_to_preset'")
        if self._damcha_convert is None:  # a plain model (clone_model's): the host's own preset
            host.save_to_preset(self, preset_dir, *args, **kwargs)
            return
        raise _preset_refusal(f"save_to_preset of a converted {host.__name__}")

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        if "host" not in config or CONFIG_KEY not in config:
            raise DamchaValueError(f"This config records no DAMCHA conversion. Received: keys {sorted(config)}")
        host = keras.saving.deserialize_keras_object(config["host"], custom_objects=custom_objects)
        options = config[CONFIG_KEY]
        if options is None:
            return host
        options = dict(options)
        if options.pop("format", None) != CONFIG_FORMAT:
            raise DamchaValueError(
                f"The recorded DAMCHA conversion is not of format {CONFIG_FORMAT!r}. Received: {config[CONFIG_KEY]!r}"
            )
        penalty = options.get("metric_penalty")
        options = {k: options[k] for k in ("metric", "metric_rank", "coupling", "share_metric")}
        if not host.built:
            # A subclassed model is built by Keras after from_config (build_from_config), and
            # convert needs it built: the conversion waits for that build (the file did not load).
            host.__class__ = _converted_class(type(host))
            host._damcha_pending = (options, penalty)
            return host
        return _restore_penalty(_convert(host, **options, loading=True), penalty)

    def build_from_config(self, config: dict[str, Any]) -> None:
        type(self)._damcha_host.build_from_config(self, config)
        pending = self.__dict__.pop("_damcha_pending", None)
        if pending is not None:
            self.built = True  # as Keras marks it right after this call; convert needs it
            options, penalty = pending
            _restore_penalty(_convert(self, **options, loading=True), penalty)


def _fitted_model_around(layer: Any) -> Any:
    """A Keras model holding ``layer`` (as an attribute or in a layer list) whose
    optimizer is built, or None. Layers keep no link to what holds them: the
    objects that refer to ``layer`` are asked of the garbage collector, and the
    owners of those (a task's ``__dict__`` holding its backbone; a functional
    model's layer list, in its ``__dict__``), up to three steps out: three scans
    of the collector's objects (0.13 s among 450,000 objects in a TensorFlow
    process), at most 256 containers followed a step."""
    import gc

    seen: set[int] = {id(layer)}
    frontier = [layer]
    for _ in range(3):
        found = []
        for ref in gc.get_referrers(*frontier):
            if id(ref) in seen or isinstance(ref, type(sys._getframe())):
                continue
            seen.add(id(ref))
            if isinstance(ref, keras.Model) and ref is not layer:
                optimizer = getattr(ref, "optimizer", None)
                if (
                    optimizer is not None
                    and getattr(optimizer, "built", False)
                    and any(inner is layer for inner in ref._flatten_layers(include_self=False, recursive=True))
                ):
                    return ref
            elif isinstance(ref, (dict, list, tuple)):
                found.append(ref)
        frontier = found[:256]
        if not frontier:
            break
    return None


class _InnerPresetRefusal:
    """Installed as the ``save_to_preset`` of a KerasHub model inside a converted one
    (``lm.backbone`` of a converted task): its preset held the host's weights only
    and ``from_preset`` loaded a plain model, without a word. Not saved (an
    instance attribute, as ``_SiteCall``)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise _preset_refusal(
            f"save_to_preset of a {self.owner}'s inner model, which holds converted layers of a converted {self.owner}"
        )


def _preset_refusal(received: str) -> DamchaValueError:
    """save_to_preset's refusal, for a converted model and for a KerasHub model inside one."""
    return DamchaValueError(
        dc.invalid_argument(
            "model",
            "a model KerasHub's from_preset can load back as it is: a converted model, or one holding its "
            "converted layers, cannot be (from_preset loads a task's preset as the unconverted model, dropping "
            "the DAMCHA weights, and refuses a converted backbone's). Save the converted model with "
            "model.save('model.keras') (keras.saving.load_model restores the conversion), or save the host's "
            "preset before dk.convert and convert again after from_preset",
            received,
        )
    )


def _refuse_inner_presets(model: Any) -> None:
    """Give each KerasHub model inside ``model`` that holds converted layers the
    refusal the converted model's own ``save_to_preset`` gives."""
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if hasattr(type(layer), "save_to_preset") and any(True for _ in _maps_of(layer)):
            object.__setattr__(layer, "save_to_preset", _InnerPresetRefusal(type(model).__name__))


def _restore_penalty(model: Any, penalty: Any) -> Any:
    """``track_metric_penalty``'s setting, as recorded in a saved model's options
    (a file saved before it was recorded tracks no penalty, as before)."""
    if isinstance(penalty, dict):
        for _, maps in _maps_of(model):
            maps._penalty_weight = float(penalty["weight"])
            maps._penalty_layers = int(penalty["layers"])
        model._damcha_convert = json.dumps({**json.loads(model._damcha_convert), "metric_penalty": penalty})
    return model


# The loader: a fresh process finds "damcha>ConvertedModel" once damcha_keras is imported.
ConvertedModel = keras.saving.register_keras_serializable(package="damcha", name=REGISTERED_NAME)(
    type("ConvertedModel", (_ConvertedModel,), {"__module__": __name__})
)

_CONVERTED_CLASSES: dict[type, type] = {}


def _converted_class(host: type) -> type:
    if issubclass(host, _ConvertedModel):
        return host
    cls = _CONVERTED_CLASSES.get(host)
    if cls is None:
        # Same name as the host (reprs, summaries); registered under the loader's
        # name, so serialisation writes "damcha>ConvertedModel".
        cls = type(
            host.__name__,
            (_ConvertedModel, host),
            {"__module__": __name__, "__qualname__": host.__qualname__, "_damcha_host": host},
        )
        keras.saving.register_keras_serializable(package="damcha", name=REGISTERED_NAME)(cls)
        # ...and the name keeps resolving to the loader (any of them would do).
        keras.saving.register_keras_serializable(package="damcha", name=REGISTERED_NAME)(ConvertedModel)
        _CONVERTED_CLASSES[host] = cls
    return cls


def _record(model: Any, **options: Any) -> None:
    model.__class__ = _converted_class(type(model))
    model._damcha_convert = json.dumps({"format": CONFIG_FORMAT, **options})


def recorded_options(model: Any) -> dict[str, Any] | None:
    """The options ``convert`` recorded on ``model``, or None."""
    if not _is_converted(model):
        return None
    options = json.loads(model._damcha_convert)
    options.pop("format", None)
    return options


# ------------------------------------------------------------------ helpers


def _check_model(model: Any) -> None:
    if not isinstance(model, keras.layers.Layer):
        raise DamchaTypeError(dc.invalid_argument("model", "a Keras layer or model", f"model={describe(model)}"))


def _maps_of(model: keras.layers.Layer) -> Iterator[tuple[Any, DamchaMaps]]:
    for layer in _walk(model):
        maps = getattr(layer, CONFIG_KEY, None)
        if isinstance(maps, DamchaMaps):
            yield layer, maps


def converted_layers(model: keras.layers.Layer) -> dict[str, Any]:
    """Path -> attention layer, for every layer of ``model`` carrying DAMCHA
    (converted by ``convert``, or a ``DamchaAttention``). Keras paths restart in
    each nested functional model: a path found twice (CLIP's text and vision
    encoders) is prefixed by the names of the models around each layer
    (``clip_text_encoder/encoder_block_0/attention``)."""
    _check_model(model)
    found = [
        (layer, models)
        for layer, models in _walk_with_models(model)
        if isinstance(layer, DamchaAttention) or isinstance(getattr(layer, CONFIG_KEY, None), DamchaMaps)
    ]
    # Keras paths restart in each nested functional model (CLIP's and SigLIP's text and
    # vision encoders both hold `encoder_block_0/attention`): a path that repeats is
    # qualified by the names of the models around the layer, so no layer is dropped.
    counts: dict[str, int] = {}
    for layer, _ in found:
        counts[_name(layer)] = counts.get(_name(layer), 0) + 1
    out: dict[str, Any] = {}
    for layer, models in found:
        key = _name(layer)
        if counts[key] > 1:
            key = "/".join([*models, key])
        while key in out:  # the same names all the way up: number them
            key += "'"
        out[key] = layer
    return out


def _walk_with_models(model: keras.layers.Layer) -> Iterator[tuple[Any, list[str]]]:
    """Each layer of ``model`` once (as ``_walk``), with the names of the nested
    ``keras.Model`` objects around it (the root excluded)."""
    seen: set[int] = set()

    def visit(layer: Any, models: list[str]) -> Iterator[tuple[Any, list[str]]]:
        if id(layer) in seen:
            return
        seen.add(id(layer))
        yield layer, models
        inner = [*models, layer.name] if isinstance(layer, keras.Model) and layer is not model else models
        for sub in layer._flatten_layers(include_self=False, recursive=False):
            yield from visit(sub, inner)

    yield from visit(model, [])


def damcha_variables(model: keras.layers.Layer, *, gates: bool = True, generators: bool = True) -> list[Any]:
    """The DAMCHA variables of ``model`` (gates and metric generators of
    converted layers and ``DamchaAttention`` layers), each once: e.g. to train
    them alone (``trainable`` on the others) or with their own learning rate
    in a custom loop.

    Args:
        model: a converted model.
        gates: include the gates.
        generators: include the metric generators' variables.
    """
    _check_model(model)
    # gates='no' read as true: include the gates.
    gates, generators = dc.check_bool("gates", gates), dc.check_bool("generators", generators)
    out, seen = [], set()

    def add(variable: Any) -> None:
        if id(variable) not in seen:
            seen.add(id(variable))
            out.append(variable)

    for layer in converted_layers(model).values():
        owner = layer if isinstance(layer, DamchaAttention) else getattr(layer, CONFIG_KEY)
        for side, gate in owner.metric_gates.items():
            if gates:
                add(gate)
            if generators:
                for variable in owner.metric_generators[side].weights:
                    add(variable)
    return out


def track_metric_penalty(model: keras.layers.Layer, weight: float = 1.0) -> keras.layers.Layer:
    """Add ``weight * metric_penalty`` to ``model``'s losses on every forward
    (``fit`` minimises it with the task loss); ``weight=0`` turns it off.
    Returns ``model``.

    The penalty is the reference's ``metric_penalty`` of each converted layer
    (mean over its mapped roles of mean_t ||L(t) - I||_F^2 / (S*d)), averaged
    over the converted layers: each layer adds its share with ``add_loss``.
    """
    _check_model(model)
    weight = dc.check_finite_nonneg("weight", weight)
    maps = [m for _, m in _maps_of(model)]
    if not maps:
        raise DamchaValueError(
            dc.invalid_argument(
                "model", "a model with converted layers (call convert first)", f"model={type(model).__name__}"
            )
        )
    for m in maps:
        m._penalty_weight = float(weight)
        m._penalty_layers = len(maps)
    # Recorded with each converted model's options, so a .keras file restores it: a reloaded
    # model resumed training without the regulariser before.
    penalty = {"weight": float(weight), "layers": len(maps)} if weight else None
    for layer in model._flatten_layers(include_self=True, recursive=True):
        recorded = getattr(layer, "_damcha_convert", None)
        if isinstance(recorded, str):
            layer._damcha_convert = json.dumps({**json.loads(recorded), "metric_penalty": penalty})
    return model


def metric_penalty(model: keras.layers.Layer) -> Any:
    """The metric penalty of the last forward (eager): the mean over converted
    layers of each layer's ``metric_penalty``, as a scalar tensor. Needs
    ``track_metric_penalty(model, weight)`` with ``weight > 0`` first."""
    _check_model(model)
    maps = [m for _, m in _maps_of(model)]
    if not maps or not all(m._penalty_weight for m in maps):
        raise DamchaValueError("`metric_penalty` needs track_metric_penalty(model, weight) with weight > 0 first.")
    losses = [loss for m in maps for loss in m.losses]
    if not losses:
        raise DamchaValueError("`metric_penalty` needs a forward pass of the model after track_metric_penalty.")
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total / maps[0]._penalty_weight
