"""Hostile inputs that used to change results silently, in every port (session 10 audit).

Each test here failed on a63638c: a converted subclass with its own forward
computed something else, a float16 layer held inf, a file lost options.
"""

from __future__ import annotations

import functools
import os
import re

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import jax
import keras
import numpy as np
import pytest
import torch
from flax import nnx
from torch import nn

import damcha_core as dc
import damcha_jax as dj
import damcha_keras as dk
import damcha_torch as dt

# ------------------------------------------------------- 1. MHA subclasses


class _ScaledTorchMHA(nn.MultiheadAttention):
    def forward(self, query, key, value, **kwargs):  # type: ignore[override]
        out, weights = super().forward(query, key, value, **kwargs)
        return 2 * out, weights


class _TaggedTorchMHA(nn.MultiheadAttention):
    """Adds an attribute only: MHA's forward, so it converts exactly."""

    tag = "mine"


class _Holder(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Identity(), attention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block[1](x, x, x)[0]


def _torch_subclasses() -> list[type[nn.MultiheadAttention]]:
    from torch.ao.nn.quantizable import MultiheadAttention as QuantizableMHA

    return [_ScaledTorchMHA, QuantizableMHA]


@pytest.mark.parametrize("cls", _torch_subclasses(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("how", ["from_mha", "replace_mha", "convert"])
def test_torch_refuses_mha_subclass_with_own_forward(cls: type, how: str) -> None:
    torch.manual_seed(0)
    model = _Holder(cls(8, 2)).eval()
    x = torch.randn(3, 2, 8)
    before = model(x)
    with pytest.raises(dc.DamchaValueError) as info:
        if how == "from_mha":
            dt.DamchaAttention.from_mha(model.block[1])
        elif how == "replace_mha":
            dt.replace_mha(model)
        else:
            dt.convert(model)
    text = str(info.value)
    assert cls.__qualname__ in text and "overrides forward" in text
    if how != "from_mha":
        assert "model.block.1" in text
    # Nothing replaced: the model still computes what it computed.
    assert type(model.block[1]) is cls
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)


def _take_over(mha: nn.MultiheadAttention, tool: str) -> None:
    from torch.nn.utils import parametrize, prune

    if tool == "parametrize":
        parametrize.register_parametrization(mha, "in_proj_weight", nn.Tanh())
    elif tool == "prune":
        prune.l1_unstructured(mha, "in_proj_bias", amount=0.5)
    else:
        torch.nn.utils.spectral_norm(mha, "in_proj_weight")


@pytest.mark.parametrize("tool", ["parametrize", "prune", "spectral_norm"])
@pytest.mark.parametrize("how", ["replace_mha", "convert"])
def test_torch_refuses_to_swap_an_mha_whose_weights_a_tool_holds(how: str, tool: str) -> None:
    """A swap in place would copy the tool's current value into a plain
    parameter and then train without it: refused before anything changes,
    naming the layer and the parameter; from_mha (a new layer from the
    values) still copies exactly."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2)
    _take_over(mha, tool)
    model = _Holder(mha).eval()
    x = torch.randn(3, 2, 8)
    before = model(x)
    with pytest.raises(dc.DamchaValueError) as info:
        dt.replace_mha(model) if how == "replace_mha" else dt.convert(model)
    text = str(info.value)
    taken = "in_proj_bias" if tool == "prune" else "in_proj_weight"
    assert "model.block.1" in text and f"whose {taken} a weight tool has taken over" in text
    assert model.block[1] is mha
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    copy = dt.DamchaAttention.from_mha(mha).eval()
    torch.testing.assert_close(copy(x, x, x)[0], before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["from_mha", "replace_mha", "convert"])
def test_torch_refuses_mha_with_a_forward_set_on_the_instance(how: str) -> None:
    """A wrapper that replaces forward on the instance (accelerate's dispatch
    hooks, a monkeypatch) is neither on the class nor in a hook registry: a
    converted layer would drop it, so conversion refuses and names it."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2)
    plain = nn.MultiheadAttention.forward

    def halved(*args, **kwargs):
        out, weights = plain(mha, *args, **kwargs)
        return out * 0.5, weights

    mha.forward = halved
    model = _Holder(mha).eval()
    x = torch.randn(3, 2, 8)
    before = model(x)
    with pytest.raises(dc.DamchaValueError) as info:
        if how == "from_mha":
            dt.DamchaAttention.from_mha(mha)
        elif how == "replace_mha":
            dt.replace_mha(model)
        else:
            dt.convert(model)
    text = str(info.value)
    assert "forward set on the instance" in text and "halved" in text
    assert ("model.block.1" in text) == (how != "from_mha")
    assert model.block[1] is mha
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["replace_mha", "convert"])
def test_torch_converts_mha_subclass_keeping_forward(how: str) -> None:
    torch.manual_seed(0)
    model = _Holder(_TaggedTorchMHA(8, 2)).eval()
    x = torch.randn(3, 2, 8)
    before = model(x)
    (dt.replace_mha if how == "replace_mha" else dt.convert)(model)
    assert isinstance(model.block[1], dt.DamchaAttention)
    torch.testing.assert_close(model(x), before, rtol=1e-6, atol=1e-6)


def test_jax_from_mha_refuses_subclass_with_own_call() -> None:
    class Scaled(nnx.MultiHeadAttention):
        def __call__(self, *args, **kwargs):  # type: ignore[override]
            return 2 * super().__call__(*args, **kwargs)

    class Tagged(nnx.MultiHeadAttention):
        tag = "mine"

    mha = Scaled(num_heads=2, in_features=8, decode=False, rngs=nnx.Rngs(0))
    with pytest.raises(dc.DamchaValueError, match=r"Scaled, which overrides __call__"):
        dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))
    plain = Tagged(num_heads=2, in_features=8, decode=False, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (1, 3, 8))
    converted = dj.DamchaAttention.from_mha(plain, rngs=nnx.Rngs(1))
    np.testing.assert_allclose(np.asarray(converted(x)), np.asarray(plain(x)), rtol=1e-5, atol=1e-6)


def test_keras_from_mha_refuses_subclass_with_own_call() -> None:
    class Scaled(keras.layers.MultiHeadAttention):
        def call(self, query, value, key=None, **kwargs):  # type: ignore[override]
            return 2 * super().call(query, value, key, **kwargs)

    class Tagged(keras.layers.MultiHeadAttention):
        pass

    x = np.random.default_rng(0).normal(size=(1, 4, 8)).astype("float32")
    layer = Scaled(2, 4)
    layer(x, x)
    with pytest.raises(dc.DamchaValueError, match=r"Scaled\), which overrides call"):
        dk.DamchaAttention.from_mha(layer)
    plain = Tagged(2, 4)
    want = keras.ops.convert_to_numpy(plain(x, x))
    got = keras.ops.convert_to_numpy(dk.DamchaAttention.from_mha(plain)(x, x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------- 3. Keras options the file lacks


@pytest.mark.parametrize(
    "option", [{"sliding_window": 2}, {"attention_axes": (2,)}, {"output_shape": (2, 4)}], ids=lambda o: next(iter(o))
)
def test_keras_save_refuses_options_the_canonical_file_lacks(tmp_path, option):
    """The file used to load as a layer without the option (outputs differed by 1.68; an
    output_shape of (2, 4) loaded as (8,))."""
    x = np.random.default_rng(0).normal(size=(2, 3, 4, 8)).astype("float32")
    x = x if "attention_axes" in option else x[:, 0]
    layer = dk.DamchaAttention(num_heads=2, key_dim=4, **option)
    layer(x, x)
    ((name, value),) = option.items()
    with pytest.raises(
        dc.DamchaValueError, match=re.escape(f"Invalid argument `{name}`: expected its default for `save`")
    ):
        layer.save(tmp_path / "l.safetensors")
    assert not (tmp_path / "l.safetensors").exists()
    # The weights stay available, and the option travels when the caller passes it.
    path = tmp_path / "w.safetensors"
    dc.save_params(path, layer.to_canonical(), layer.config)
    loaded = dk.DamchaAttention(num_heads=2, key_dim=4, **option)
    loaded(x, x)
    loaded.load_canonical(dc.load_params(path)[0])
    got, want = (keras.ops.convert_to_numpy(m(x, x)) for m in (loaded, layer))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------- 4. finite float64 params that overflow


def _big_params() -> tuple[dict[str, np.ndarray], dc.DamchaConfig]:
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    params = dc.init_params(config, seed=0)
    params["query.kernel"] = params["query.kernel"] * 1e6  # finite, far past float16's 65504
    return params, config


def _load_float16(port: str, params: dict, config: dc.DamchaConfig) -> object:
    if port == "torch":
        return dt.DamchaAttention.from_canonical(params, config, dtype=torch.float16)
    if port == "jax":
        return dj.DamchaAttention.from_canonical(params, config, param_dtype=np.float16)
    if port == "keras":
        return dk.DamchaAttention.from_canonical(params, config, dtype="float16")
    import damcha_onnx as do

    return do.export(params, config, None, dtype="float16")


@pytest.mark.parametrize("port", ["torch", "jax", "keras", "onnx"])
def test_float16_refuses_params_that_overflow(port):
    """Each used to hold inf (the ONNX export returned a 'validated' model computing NaN)."""
    params, config = _big_params()
    largest = float(np.abs(params["query.kernel"]).max())
    with pytest.raises(dc.DamchaValueError) as info:
        _load_float16(port, params, config)
    text = str(info.value)
    assert "'query.kernel'" in text and "float16" in text and "65504" in text and repr(largest) in text
    # In range, float16 loads and holds the params (to float16's precision).
    fine = dc.init_params(config, seed=0)
    layer = _load_float16(port, fine, config)
    if port != "onnx":
        got = layer.to_canonical()  # type: ignore[attr-defined]
        for name in fine:
            np.testing.assert_allclose(got[name], fine[name], rtol=1e-3, atol=1e-3)


_BF16_MAX = float(2.0**127 * (2 - 2.0**-7))
_BF16_INF_FROM = float(2.0**127 * (2 - 2.0**-8))  # bfloat16's max plus half an ulp


def _load(port: str, params: dict, config: dc.DamchaConfig, dtype: str) -> object:
    if port == "torch":
        return dt.DamchaAttention.from_canonical(params, config, dtype=getattr(torch, dtype))
    if port == "jax":
        return dj.DamchaAttention.from_canonical(params, config, param_dtype=getattr(jax.numpy, dtype))
    if port == "keras":
        return dk.DamchaAttention.from_canonical(params, config, dtype=dtype)
    import damcha_onnx as do

    return do.export(params, config, None, dtype=dtype)


# float16 rounds to nearest even: up to 65520 (max 65504 plus half its ulp of 32) a value
# rounds to 65504 and fits. 65519.999 is refused: torch's float64 -> float16 cast rounds
# through float32, where it is 65520, and becomes inf.
_FLOAT16_EDGES = [(65504.0, True), (65519.99, True), (65519.999, False), (65520.0, False)]
_BFLOAT16_EDGES = [(_BF16_MAX, True), (_BF16_INF_FROM - 2.0**104, True), (_BF16_INF_FROM, False)]
_EDGES = [("float16", v, fits) for v, fits in _FLOAT16_EDGES] + [("bfloat16", v, fits) for v, fits in _BFLOAT16_EDGES]


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize(
    ("port", "dtype", "value", "fits"),
    # The ONNX export has no bfloat16 graphs (refused up front): no such cases, rather than skips.
    [
        (port, *edge)
        for port in ("torch", "jax", "keras", "onnx")
        for edge in _EDGES
        if (port, edge[0]) != ("onnx", "bfloat16")
    ],
)
def test_params_fit_iff_they_round_to_a_finite_value(port, sign, dtype, value, fits):
    """The check refused 65504 < |value| < 65520 (and bfloat16's like band), which float16
    rounds to 65504: it compared with the max, not with where rounding reaches inf."""
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    params = dc.init_params(config, seed=0)
    params["query.kernel"][0, 0, 0] = sign * value
    if not fits:
        with pytest.raises(
            dc.DamchaValueError, match=rf"round to a finite {dtype}.*max \|value\| = {re.escape(repr(value))}"
        ):
            _load(port, params, config, dtype)
        return
    layer = _load(port, params, config, dtype)
    if port != "onnx":
        held = layer.to_canonical()["query.kernel"][0, 0, 0]  # type: ignore[attr-defined]
        assert held == sign * float(np.finfo(np.float16).max if dtype == "float16" else _BF16_MAX)


def test_params_fit_edges_are_where_each_framework_casts_to_inf():
    """The refused values are the ones torch's own cast makes inf (NumPy's direct float16
    cast keeps 65519.999, a value in the half float32 ulp below 65520)."""
    for dtype, value, fits in _EDGES:
        cast = torch.tensor([value], dtype=torch.float64).to(getattr(torch, dtype))
        assert bool(torch.isfinite(cast)) == fits, (dtype, value)


# --------------------------------------- 7. value_input_dim != context_dim


def test_jax_loads_a_file_whose_values_have_their_own_feature_size(tmp_path):
    """torch and Keras loaded it; JAX built (E_kv, ...) value kernels and blamed the params."""
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, context_dim=6, value_input_dim=5, coupling="separate")
    params = dc.init_params(config, seed=1)
    for name in params:
        if name.endswith("gate"):
            params[name] = np.full(params[name].shape, 0.3)
    path = tmp_path / "v.safetensors"
    dc.save_params(path, params, config)
    rng = np.random.default_rng(0)
    q, ctx, val = rng.normal(size=(2, 3, 8)), rng.normal(size=(2, 4, 6)), rng.normal(size=(2, 4, 5))
    want = dc.damcha_attention(params, config, q, ctx, value=val)
    # float32 (x64 would compile every op again, ~10 s here): the load is what is tested.
    layer = dj.DamchaAttention.load(path)
    assert layer.config == config
    got = np.asarray(layer(q.astype(np.float32), ctx.astype(np.float32), val.astype(np.float32)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_keras_from_mha_converts_keras_hub_cached_mha():
    """Its own call is MHA's plus the cache arguments DamchaAttention takes: exact."""
    keras_hub = pytest.importorskip("keras_hub")
    x = np.random.default_rng(0).normal(size=(1, 4, 8)).astype("float32")
    layer = keras_hub.layers.CachedMultiHeadAttention(2, 4)
    want = keras.ops.convert_to_numpy(layer(x, x))
    got = keras.ops.convert_to_numpy(dk.DamchaAttention.from_mha(layer)(x, x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------- review of the fixes above (session 10)


def test_keras_save_takes_a_converted_keras_mha_and_default_axes(tmp_path):
    """Keras's MHA writes attention_axes=(1,) into its config when it builds: the default for
    3-D inputs, which the file reproduces, so from_mha then save must work."""
    x = np.random.default_rng(1).normal(size=(2, 4, 8)).astype("float32")
    mha = keras.layers.MultiHeadAttention(2, 4)
    want = keras.ops.convert_to_numpy(mha(x, x))
    layer = dk.DamchaAttention.from_mha(mha)
    layer.save(tmp_path / "c.safetensors")
    got = keras.ops.convert_to_numpy(dk.DamchaAttention.load(tmp_path / "c.safetensors")(x, x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    explicit = dk.DamchaAttention(num_heads=2, key_dim=4, attention_axes=1)
    explicit(x, x)
    explicit.save(tmp_path / "e.safetensors")
    # Not the default for 4-D inputs: refused (the test above).
    x4 = np.random.default_rng(2).normal(size=(2, 3, 4, 8)).astype("float32")
    axis1 = dk.DamchaAttention(num_heads=2, key_dim=4, attention_axes=1)
    axis1(x4, x4)
    with pytest.raises(
        dc.DamchaValueError, match=r"`attention_axes`: expected its default for `save`.*attention_axes=\(1,\)"
    ):
        axis1.save(tmp_path / "a.safetensors")


def _keras_attention(base: type) -> keras.layers.Layer:
    if issubclass(base, keras.layers.GroupQueryAttention):
        return base(head_dim=4, num_query_heads=2, num_key_value_heads=1)
    return base(2, 4)


# What MHA's and GQA's call reaches that a subclass can change (read from Keras, so a hook a
# later Keras adds shows up here): call, the _compute_* steps and mask builders, the softmax,
# and the builders of the softmax/equations and of the output projection.
_KERAS_HOOKS = sorted(
    {
        name
        for cls in (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)
        for name in vars(cls)
        if name == "call" or name.startswith(("_compute_", "_masked_softmax", "_build_attention", "_make_output"))
    }
)


@pytest.mark.parametrize(
    ("base", "hook"),
    # Each class's own hooks (GroupQueryAttention has no _build_attention or _make_output_dense).
    [
        (base, hook)
        for base in ("MultiHeadAttention", "GroupQueryAttention")
        for hook in _KERAS_HOOKS
        if hasattr(getattr(keras.layers, base), hook)
    ],
)
def test_keras_from_mha_refuses_a_subclass_that_changes_an_attention_hook(base, hook) -> None:
    """from_mha rebuilds the base class's computation: a subclass's own hook would be lost.
    _build_attention (MHA's softmax and equations), _compute_sliding_window_mask and
    _make_output_dense were not looked at."""
    cls = getattr(keras.layers, base)

    @functools.wraps(getattr(cls, hook))  # its signature: Keras reads call's
    def same(self, *args, **kwargs):  # an override that changes nothing is refused too: it could
        return getattr(cls, hook)(self, *args, **kwargs)

    hooked = type("Hooked", (cls,), {hook: same})
    x = np.random.default_rng(0).normal(size=(1, 4, 8)).astype("float32")
    layer = _keras_attention(hooked)
    layer(x, x)
    with pytest.raises(
        dc.DamchaValueError,
        match=rf"expected a keras.layers.{cls.__name__} computing what.*Hooked\), which overrides {hook}$",
    ):
        dk.DamchaAttention.from_mha(layer)
    dk.DamchaAttention.from_mha(_built(_keras_attention(cls), x))  # the base class itself converts


def _built(layer: keras.layers.Layer, x: np.ndarray) -> keras.layers.Layer:
    layer(x, x)
    return layer


class _DoubledKerasMHA(keras.layers.MultiHeadAttention):
    def _compute_attention(self, *args, **kwargs):  # type: ignore[override]
        out, scores = super()._compute_attention(*args, **kwargs)
        return 2 * out, scores


def test_keras_convert_keeps_a_subclass_s_attention_hook() -> None:
    """convert() maps the projections and keeps the layer's own call and hooks (what from_mha's
    refusal points to): a doubling _compute_attention still doubles, maps included."""
    keras_hub = pytest.importorskip("keras_hub")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 8)).astype("float32")

    def model(cls: type) -> keras.Model:
        inp = keras.Input((5, 8))
        return keras.Model(inp, cls(2, 4, name="attention")(inp, inp))

    plain, doubled, cached = (
        model(keras.layers.MultiHeadAttention),
        model(_DoubledKerasMHA),
        model(keras_hub.layers.CachedMultiHeadAttention),
    )
    doubled.set_weights(plain.get_weights())
    cached.set_weights(plain.get_weights())
    before = {
        name: keras.ops.convert_to_numpy(m(x))
        for name, m in (("plain", plain), ("doubled", doubled), ("cached", cached))
    }
    np.testing.assert_allclose(before["doubled"], 2 * before["plain"], rtol=1e-6, atol=1e-6)
    for m in (plain, doubled, cached):
        dk.convert(m)
    # Gates at 0: each converted model is its original, bit for bit.
    for name, m in (("plain", plain), ("doubled", doubled), ("cached", cached)):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(m(x)), before[name])
    # Open gates, the same maps in all three: the subclass still doubles what MHA computes.
    maps = {
        name: next(iter(dk.converted_layers(m).values())).damcha
        for name, m in (("plain", plain), ("doubled", doubled), ("cached", cached))
    }
    params = maps["plain"].to_canonical()
    params["metric.qk.gate"] = np.full_like(params["metric.qk.gate"], 0.7)
    for m in maps.values():
        m.load_canonical(params)
    got = {
        name: keras.ops.convert_to_numpy(m(x))
        for name, m in (("plain", plain), ("doubled", doubled), ("cached", cached))
    }
    assert np.abs(got["plain"] - before["plain"]).max() > 1e-3  # the maps act
    np.testing.assert_allclose(got["doubled"], 2 * got["plain"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got["cached"], got["plain"])


def _stack() -> tuple[dict[str, np.ndarray], dc.EncoderConfig]:
    attention = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    config = dc.EncoderConfig(attention, num_layers=2, ffn_dim=12, final_norm=True)
    return dc.init_encoder_params(config, seed=0), config


@pytest.mark.parametrize("port", ["torch", "keras"])
@pytest.mark.parametrize(
    "name", ["layers.1.ffn.in.kernel", "layers.1.attention.query.kernel", "shared.metric.qk.kernel", "final_norm.scale"]
)
def test_float16_stacks_refuse_overflow_before_loading_anything(port, name):
    """A stack's FFN and norm weights were copied without a fit check (inf in float16), and a
    refused layer 1 left layer 0 already overwritten."""
    params, config = _stack()
    if port == "torch":
        stack = dt.DamchaTransformerEncoder.from_canonical(params, config, dtype=torch.float16)
        before = {k: v.clone() for k, v in stack.state_dict().items()}
    else:
        stack = dk.stack_from_canonical(params, config, dtype="float16")
        before = [keras.ops.convert_to_numpy(w).copy() for layer in stack for w in layer.weights]
    bad = {k: v * 3 for k, v in params.items()}  # in range: would change every tensor if loaded
    bad[name] = params[name] * 1e6
    with pytest.raises(dc.DamchaValueError, match=re.escape(f"'{name}'") + r".*float16"):
        stack.load_canonical(bad) if port == "torch" else dk.stack_load_canonical(stack, bad)
    if port == "torch":
        for k, v in stack.state_dict().items():
            assert torch.equal(v, before[k]), k
    else:
        after = [keras.ops.convert_to_numpy(w) for layer in stack for w in layer.weights]
        for a, b in zip(after, before):
            np.testing.assert_array_equal(a, b)


# --------------------------------------- flags and float masks (cli review B1, B2)


def _port_call(port: str, **kw):
    """A (2, 5, 8) self-attention call of each port's layer, with ``kw`` as that port names it."""
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    if port == "torch":
        torch.manual_seed(0)
        layer = dt.DamchaAttention(8, 2, batch_first=True).eval()
        t = torch.as_tensor(x)
        kw = {k: torch.as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
        return layer(t, t, t, **kw)
    if port == "jax":
        layer = dj.DamchaAttention(2, 8, rngs=nnx.Rngs(0), deterministic=True)
        return layer(
            jax.numpy.asarray(x), **{k: jax.numpy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
        )
    return dk.DamchaAttention(2, 4)(x, x, **kw)


@pytest.mark.parametrize("name", ["need_weights", "average_attn_weights", "is_causal"])
def test_torch_flag_none_reads_as_multihead_attention_reads_it(name):
    """nn.MultiheadAttention reads a None flag as False (a truth test); code that
    passes an optional flag on keeps working with DamchaAttention."""
    import torch

    from damcha_torch import DamchaAttention

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64).eval()
    layer = DamchaAttention.from_mha(mha).eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64) if name == "is_causal" else None
    for module in (mha, layer):
        got = module(x, x, x, attn_mask=mask, **{name: None})
        want = module(x, x, x, attn_mask=mask, **{name: False})
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is not None:
                torch.testing.assert_close(g, w, rtol=0, atol=0)
    got, want = layer(x, x, x, attn_mask=mask, **{name: None}), mha(x, x, x, attn_mask=mask, **{name: None})
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("port", "name", "value"),
    [
        ("torch", "need_weights", "False"),  # truthy: it computed the weights
        ("torch", "need_weights", 0),
        ("torch", "is_causal", 1),
        ("torch", "average_attn_weights", 0.5),
        ("jax", "is_causal", 1),
        ("jax", "sow_weights", None),
        ("jax", "deterministic", "no"),  # truthy, and the layer has no dropout: was accepted
        ("jax", "decode", 1),
    ],
)
def test_call_flags_must_be_bools_with_one_message(port, name, value):
    with pytest.raises(
        dc.DamchaTypeError, match=re.escape(f"Invalid argument `{name}`: expected a bool. Received: {name}={value!r}")
    ):
        _port_call(port, **{name: value})


@pytest.mark.parametrize("port", ["torch", "jax"])
def test_call_flags_take_numpy_bools(port):
    """np.bool_ is a bool in every port (dc.check_bool); the result equals the Python bool's."""
    name = "is_causal"
    extra = {"need_weights": False} if port == "torch" else {}
    a = _port_call(port, **{name: np.bool_(True)}, **extra)
    b = _port_call(port, **{name: True}, **extra)
    a, b = (r[0] if isinstance(r, tuple) else r for r in (a, b))
    np.testing.assert_array_equal(
        np.asarray(a.detach() if port == "torch" else a), np.asarray(b.detach() if port == "torch" else b)
    )


# Each port's mask argument; torch reads a float mask as additive (nn.MultiheadAttention), jax and
# keras as 0/1, but NaN (and torch's +inf) is refused by all three as a mask error, DamchaValueError.
_MASKS = {"torch": "attn_mask", "jax": "mask", "keras": "attention_mask"}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("port", ["torch", "jax", "keras"])
def test_float_mask_with_nan_or_inf_is_refused_in_every_port(port, bad):
    mask = np.zeros((5, 5), np.float32) if port == "torch" else np.ones((5, 5), np.float32)
    mask[2, 3] = bad
    kw = {_MASKS[port]: mask}
    if port == "torch":
        kw["need_weights"] = False
    with pytest.raises(dc.DamchaValueError, match=f"Invalid argument `{_MASKS[port]}`"):
        _port_call(port, **kw)


@pytest.mark.parametrize("dtype", ["int32", "bool", "complex64"])
def test_keras_layer_refuses_a_dtype_that_is_not_floating(dtype: str) -> None:
    """dtype='int32' failed in the first call with TensorFlow's InvalidArgumentError ('bool': a bare
    ValueError), where torch and Flax refuse non-float dtypes by name when the layer is built."""
    with pytest.raises(
        dc.DamchaTypeError,
        match=rf"Invalid argument `dtype`: expected a real floating dtype .*Received: dtype='{dtype}'",
    ):
        dk.DamchaAttention(num_heads=2, key_dim=4, dtype=dtype)
    assert dk.DamchaAttention(num_heads=2, key_dim=4, dtype="mixed_bfloat16").compute_dtype == "bfloat16"


# ------------------------------------------------------- params from a torch model in training


@pytest.mark.parametrize("port", ["torch", "jax", "keras"])
def test_every_port_loads_torch_tensors_that_require_grad(port: str) -> None:
    """torch's load_canonical (under no_grad) and save_params took a model's parameters as they
    are; JAX's and Keras' refused them ("needs .detach().cpu()"): the same params, one port each."""
    cfg = dc.DamchaConfig(8, 2, 4)
    params = dc.init_params(cfg, seed=1)
    live = {k: torch.from_numpy(v).requires_grad_() for k, v in params.items()}
    if port == "torch":
        layer = dt.DamchaAttention.from_canonical(live, cfg, dtype=torch.float64)
    elif port == "jax":
        with jax.enable_x64(True):
            layer = dj.DamchaAttention.from_canonical(live, cfg, param_dtype=jax.numpy.float64)
            got = layer.to_canonical()
    else:
        layer = dk.DamchaAttention.from_canonical(live, cfg, dtype="float64")
    got = got if port == "jax" else layer.to_canonical()
    for name, value in params.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize(
    "port, keyword",
    [
        ("jax", "key_dim"),
        ("jax", "in_features"),
        ("keras", "num_heads"),
        ("keras", "output_shape"),
        ("torch", "num_heads"),
        ("torch", "kdim"),
    ],
)
def test_from_canonical_refuses_a_keyword_the_config_sets(port: str, keyword: str) -> None:
    """A keyword the config already fixes was Python's bare "got multiple values for keyword
    argument" (JAX, Keras) or "unexpected keyword argument" (torch) TypeError; every port
    now names it with the same wording."""
    cfg = dc.DamchaConfig(8, 2, 4)
    params = dc.init_params(cfg, seed=1)
    build = {"jax": dj.DamchaAttention, "keras": dk.DamchaAttention, "torch": dt.DamchaAttention}[port]
    with pytest.raises(dc.DamchaTypeError, match=rf"Invalid argument `{keyword}`: expected no keyword the config sets"):
        build.from_canonical(params, cfg, **{keyword: 2})


@pytest.mark.parametrize("port", ["torch", "keras"])
def test_damcha_parameter_lists_refuse_a_string_for_a_flag(port: str) -> None:
    """gates='no' was read as true (the gates were included)."""
    if port == "torch":
        model = nn.Sequential(nn.Identity())
        call = functools.partial(dt.damcha_parameters, model)
    else:
        call = functools.partial(dk.damcha_variables, keras.Sequential([keras.layers.Dense(2)]))
    for flag in ("gates", "generators"):
        with pytest.raises(
            dc.DamchaTypeError, match=rf"Invalid argument `{flag}`: expected a bool. Received: {flag}='no'"
        ):
            call(**{flag: "no"})
