"""DamchaAttention as a drop-in for keras.layers.MultiHeadAttention (issue 14), on
the current Keras backend (tensorflow unless KERAS_BACKEND says otherwise).

Each MHA feature is checked two ways: converted from a built MHA with the gates at
0 it computes what that MHA computes (Keras's own layer as the independent
implementation), and with the gates open it equals the NumPy reference. Keras's
own MHA test suite runs against the layer in test_keras_upstream.py."""

from __future__ import annotations

import re
import warnings

import keras
import numpy as np
import pytest

import damcha_core as dc
from damcha_conformance import case_params
from damcha_keras import DamchaAttention

B, N, M, E = 2, 5, 4, 8


def np_(x):
    return np.asarray(keras.ops.convert_to_numpy(x), dtype=np.float64)


def rng(seed=0):
    return np.random.default_rng(seed)


def open_gates(layer: DamchaAttention, seed: int = 0) -> None:
    for gate in layer.metric_gates.values():
        gate.assign(rng(seed).uniform(0.3, 1.0, size=gate.shape).astype(gate.dtype))


def randomize_biases(layer: keras.layers.Layer, seed: int = 1) -> None:
    for var in layer.weights:
        if "bias" in var.path:
            var.assign(rng(seed).normal(size=var.shape).astype(var.dtype))


# ----------------------------------------------------------- quantization


@pytest.mark.parametrize("mode", ["int8", "float8"])
def test_quantize_matches_mha_quantized_the_same_way(mode):
    """model.quantize used to hit the raw int8 kernel (sublayers were called
    through .call, skipping Keras's quantized_call): output MSE 1e10. Now a
    quantized DAMCHA model equals Keras MHA quantized the same way (gates 0) and
    stays close to its float model with open gates."""
    # `seed` seeds dropout only: the projections' default initialisers draw from Keras's
    # global generator, pinned here: over 160 unpinned draws float8's relative MSE below had
    # a median of 5e-3 and one draw at 4.5e-2, over its bound.
    keras.utils.set_random_seed(0)
    mha = keras.layers.MultiHeadAttention(2, 4, seed=0)
    x = rng(0).normal(size=(B, N, E)).astype("float32")
    mha(x, x)
    randomize_biases(mha)
    layer = DamchaAttention.from_mha(mha)
    inp = keras.Input((N, E))
    models = {name: keras.Model(inp, attn(inp, inp)) for name, attn in (("mha", mha), ("damcha", layer))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dropout/MetricGenerator have no quantized form
        for model in models.values():
            model.quantize(mode)
    assert layer.query_dense.quantization_mode == mode
    np.testing.assert_allclose(np_(models["damcha"](x)), np_(models["mha"](x)), rtol=1e-5, atol=1e-5)

    opened = DamchaAttention(2, 4, seed=1)
    opened(x, x)
    open_gates(opened)
    float_out = np_(opened(x, x))
    quantized = keras.Model(inp, opened(inp, inp))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized.quantize(mode)
    error = np.mean((np_(quantized(x)) - float_out) ** 2) / np.mean(float_out**2)
    # Relative MSE of honest quantization: int8 stays well under 1e-2 (at most 4e-4 over 60
    # initialisations); float8 (e4m3, 3 mantissa bits, on weights and activations) measured
    # 0.5-1.1e-2 on this layer across test orders (Keras's float8 scaling state), and under
    # 2e-2 for 159 of 160 initialisations. A lost scale or a raw int8 kernel gives >= 1.
    assert error < {"int8": 1e-2, "float8": 3e-2}[mode], error
    with pytest.raises(dc.DamchaValueError, match=r"`to_canonical` needs float projections.*quantized"):
        opened.to_canonical()


def test_lora_trains_only_adapters_and_merges_into_to_canonical():
    """enable_lora on the projections: the LoRA factors are used in the forward
    (sublayers are called as layers), only they (and the metric) train, and
    to_canonical returns the merged kernels, which reproduce the output in the
    reference."""
    layer = DamchaAttention(2, 4, seed=0)
    x = rng(1).normal(size=(B, N, E)).astype("float32")
    layer(x, x)
    open_gates(layer)
    for dense in (layer.query_dense, layer.key_dense, layer.value_dense):
        dense.enable_lora(2)
        dense.lora_kernel_b.assign(rng(2).normal(size=dense.lora_kernel_b.shape).astype("float32"))
    params = layer.to_canonical()
    assert not layer.query_dense._kernel.trainable
    np.testing.assert_allclose(np_(layer(x, x)), dc.damcha_attention(params, layer.config, x), rtol=1e-4, atol=1e-5)
    with pytest.raises(dc.DamchaValueError, match="LoRA is enabled"):
        layer.canonical_variables()


def test_dtype_policy_map_reaches_the_projections():
    """A DTypePolicyMap keyed by sublayer path quantizes the projections at build
    (Keras MHA's own test), and the call runs their quantized kernels."""
    policy = keras.dtype_policies.DTypePolicyMap()
    for name in ("query", "key", "value"):
        policy[f"att/{name}"] = keras.dtype_policies.QuantizedDTypePolicy("int8", "float32")
    layer = DamchaAttention(2, 4, use_bias=False, dtype=policy, name="att")
    x = rng(3).normal(size=(B, N, E)).astype("float32")
    y = layer(x, x)
    assert keras.backend.standardize_dtype(layer.query_dense._kernel.dtype) == "int8"
    assert np.isfinite(np_(y)).all() and np.abs(np_(y)).max() < 1e3


# ---------------------------------------------------------- MHA features


def _equal_to_mha(mha: keras.layers.Layer, q, v, **call) -> DamchaAttention:
    randomize_biases(mha)
    layer = DamchaAttention.from_mha(mha)
    want, want_scores = mha(q, v, return_attention_scores=True, **call)
    got, scores = layer(q, v, return_attention_scores=True, **call)
    np.testing.assert_allclose(np_(got), np_(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np_(scores), np_(want_scores), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np_(layer(q, v, **call)), np_(want), rtol=1e-5, atol=1e-5)
    return layer


def test_use_gate_equals_mha_and_has_no_canonical_form():
    mha = keras.layers.MultiHeadAttention(2, 4, use_gate=True, seed=0)
    x = rng(4).normal(size=(B, N, E)).astype("float32")
    mha(x, x)
    layer = _equal_to_mha(mha, x, x, use_causal_mask=True)
    assert [w.path.split("/")[-2] for w in layer.weights if "gate" in w.path and "metric" not in w.path] == ["gate"] * 2
    with pytest.raises(dc.DamchaValueError, match="use_gate=True"):
        layer.to_canonical()


@pytest.mark.parametrize(
    "axes, q_shape, v_shape",
    [
        ((2,), (B, 3, 4, E), (B, 3, 2, E)),  # attend over axis 2; axis 1 is a batch-like axis
        ((1, 2), (B, 3, 4, E), (B, 2, 2, E)),  # 2-D attention (images)
        ((-2,), (B, 3, 4, E), (B, 3, 2, E)),  # MHA's negative axes
    ],
    ids=["axis2", "axes12", "negative"],
)
def test_attention_axes_equal_mha_and_the_reference_per_token(axes, q_shape, v_shape):
    """High-rank inputs: gates 0 equal MHA (outputs and scores in MHA's layout);
    open gates equal the reference run on the folded tokens, where the map acts
    on each position's heads."""
    r = rng(5)
    q, v = r.normal(size=q_shape).astype("float32"), r.normal(size=v_shape).astype("float32")
    mha = keras.layers.MultiHeadAttention(2, 4, attention_axes=axes, seed=0)
    mha(q, v)
    layer = _equal_to_mha(mha, q, v)
    open_gates(layer)
    pos = tuple(a % len(q_shape) for a in axes)
    batch = tuple(a for a in range(1, len(q_shape) - 1) if a not in pos)

    def fold(x):
        x = np.transpose(x, (0, *batch, *pos, x.ndim - 1))
        return x.reshape(-1, int(np.prod(x.shape[1 + len(batch) : -1])), x.shape[-1])

    ref = dc.damcha_attention(
        layer.to_canonical(), layer.config, fold(q).astype(np.float64), fold(v).astype(np.float64)
    )
    got = np_(layer(q, v))
    np.testing.assert_allclose(fold(got), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(B, N, E), (B, 3, 4, E)], ids=["rank3", "rank4"])
def test_default_attention_axes_and_the_name_read_as_mhas_after_build(shape, tmp_path):
    """Keras MHA sets its default attention_axes at build ((1,) for rank 3): DAMCHA's stayed
    None; and from_mha(mha) dropped the name ('foo' became 'damcha_attention_1')."""
    x = rng(3).normal(size=shape).astype("float32")
    mha, layer = keras.layers.MultiHeadAttention(2, 4, name="foo"), DamchaAttention(num_heads=2, key_dim=4)
    assert layer.attention_axes is None  # unbuilt: as MHA's
    mha(x, x), layer(x, x)
    assert layer.attention_axes == mha.attention_axes == tuple(range(1, len(shape) - 1))
    assert layer.get_config()["attention_axes"] == mha.get_config()["attention_axes"]
    converted = DamchaAttention.from_mha(mha)
    assert converted.name == "foo" and converted.attention_axes == mha.attention_axes
    assert DamchaAttention.from_mha(mha, name="bar").name == "bar"
    # The config with the axes set reloads (.keras) to the same outputs, and the canonical file
    # still takes the default axes of rank 3.
    inp = keras.Input(shape[1:])
    model = keras.Model(inp, converted(inp, inp))
    model.save(tmp_path / "m.keras")
    again = keras.saving.load_model(tmp_path / "m.keras")
    assert again.get_layer("foo").attention_axes == mha.attention_axes
    np.testing.assert_allclose(np_(again(x)), np_(mha(x, x)), rtol=1e-5, atol=1e-6)
    if len(shape) == 3:
        layer.save(tmp_path / "l.safetensors")
        np.testing.assert_allclose(np_(DamchaAttention.load(tmp_path / "l.safetensors")(x, x)), np_(layer(x, x)))


def test_attention_axes_masks_and_causal():
    """Masks of high-rank inputs: an attention mask in MHA's layout (B, *batch
    axes, *query axes, *key axes) and a (B, *dims) Keras value mask hide what MHA
    hides. Causal runs over the flattened attended positions (MHA's own causal
    mask reads axis 1 and fails for attention_axes=2), checked with open gates
    against the reference on the folded tokens."""
    r = rng(6)
    q = r.normal(size=(B, 3, 5, E)).astype("float32")
    mha = keras.layers.MultiHeadAttention(2, 4, attention_axes=2, seed=0)
    mha(q, q)
    mask = r.random((B, 3, 5, 5)) < 0.7
    mask[..., 0] = True
    layer = _equal_to_mha(mha, q, q, attention_mask=mask)
    value_mask = np.ones((B, 3, 5), bool)
    value_mask[1, :, -2:] = False
    np.testing.assert_allclose(
        np_(layer(q, q, value_mask=value_mask)),
        np_(mha(q, q, attention_mask=np.broadcast_to(value_mask[:, :, None, :], (B, 3, 5, 5)))),
        rtol=1e-5,
        atol=1e-5,
    )
    open_gates(layer)
    folded = q.reshape(B * 3, 5, E).astype(np.float64)
    ref = dc.damcha_attention(
        layer.to_canonical(), layer.config, folded, mask=mask.reshape(B * 3, 1, 5, 5), causal=True
    )
    got = np_(layer(q, q, attention_mask=mask, use_causal_mask=True)).reshape(B * 3, 5, E)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("output_shape", [(3, 2), (6,), 5], ids=["2d", "1-tuple", "int"])
def test_output_shape_equals_mha_and_round_trips_canonically(output_shape):
    r = rng(7)
    q, v = r.normal(size=(B, N, E)).astype("float32"), r.normal(size=(B, M, 6)).astype("float32")
    mha = keras.layers.MultiHeadAttention(2, 4, output_shape=output_shape, seed=0)
    mha(q, v)
    layer = _equal_to_mha(mha, q, v)
    dims = output_shape if isinstance(output_shape, tuple) else (output_shape,)
    assert tuple(layer.compute_output_shape(q.shape, v.shape)) == (B, N, *dims)
    open_gates(layer)
    params = layer.to_canonical()
    assert params["output.kernel"].shape == (2, 4, int(np.prod(dims)))
    ref = dc.damcha_attention(params, layer.config, q, v).reshape(B, N, *dims)
    np.testing.assert_allclose(np_(layer(q, v)), ref, rtol=1e-4, atol=1e-5)
    again = DamchaAttention(2, 4, output_shape=output_shape)
    again(q, v)
    again.load_canonical(params)
    np.testing.assert_array_equal(np_(again(q, v)), np_(layer(q, v)))


@pytest.mark.parametrize("causal", [False, True], ids=["band", "causal-band"])
def test_sliding_window_equals_mha_and_the_reference(causal):
    r = rng(8)
    x = r.normal(size=(B, 6, E)).astype("float32")
    mha = keras.layers.MultiHeadAttention(2, 4, sliding_window=3, seed=0)
    mha(x, x)
    layer = _equal_to_mha(mha, x, x, use_causal_mask=causal)
    open_gates(layer)
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    band = np.abs(i - j) < 3
    ref = dc.damcha_attention(layer.to_canonical(), layer.config, x, mask=band, causal=causal)
    np.testing.assert_allclose(np_(layer(x, x, use_causal_mask=causal)), ref, rtol=1e-4, atol=1e-5)


def test_sliding_window_decodes_with_a_cache():
    """A windowed causal layer decoding token by token equals its full pass."""
    cfg = dc.DamchaConfig(query_dim=E, num_heads=2, key_dim=4)
    params = case_params(cfg, 3)
    layer = DamchaAttention.from_canonical(params, cfg)
    windowed = DamchaAttention(2, 4, sliding_window=2)
    windowed(np.zeros((1, 1, E), "float32"), np.zeros((1, 1, E), "float32"))
    windowed.load_canonical(params)
    x = rng(9).normal(size=(1, 5, E)).astype("float32")
    full = np_(windowed(x, x, use_causal_mask=True))
    cache, outs = windowed.init_cache(1, 5), []
    for t in range(5):
        y, cache = windowed(x[:, t : t + 1], x[:, t : t + 1], use_causal_mask=True, cache=cache, cache_update_index=t)
        outs.append(np_(y))
    np.testing.assert_allclose(np.concatenate(outs, 1), full, rtol=1e-5, atol=1e-6)
    assert np.abs(full - np_(layer(x, x, use_causal_mask=True))).max() > 1e-3  # the window matters


def test_grouped_query_attention_and_cross_sizes_convert_without_coupling():
    """from_mha of Keras's GroupedQueryAttention (G < H) and of a cross-size MHA
    work without `coupling=` (automatic: separate) and equal the source layer."""
    r = rng(10)
    q, c = r.normal(size=(B, N, E)).astype("float32"), r.normal(size=(B, M, 6)).astype("float32")
    gqa = keras.layers.GroupQueryAttention(head_dim=4, num_query_heads=4, num_key_value_heads=2, seed=0)
    gqa(q, q)
    randomize_biases(gqa)
    layer = DamchaAttention.from_mha(gqa)
    assert layer.config.num_kv_heads == 2 and layer.coupling == "separate"
    np.testing.assert_allclose(
        np_(layer(q, q, use_causal_mask=True)), np_(gqa(q, q, use_causal_mask=True)), rtol=1e-5, atol=1e-5
    )
    mha = keras.layers.MultiHeadAttention(2, 4, seed=0)
    mha(q, c)
    assert _equal_to_mha(mha, q, c).coupling == "separate"
    assert DamchaAttention(2, 4).coupling is None  # automatic until built
    tied = DamchaAttention(2, 4)
    tied(q, q)
    assert tied.coupling == "tied"


def test_set_weights_takes_an_mha_weight_list():
    """mha.get_weights() fits DamchaAttention.set_weights: projections set, metric
    kept (gates 0), so the output is MHA's; a wrong shape names the weight."""
    x = rng(11).normal(size=(B, N, E)).astype("float32")
    mha = keras.layers.MultiHeadAttention(2, 4, use_gate=True, seed=0)
    mha(x, x)
    randomize_biases(mha)
    layer = DamchaAttention(2, 4, use_gate=True, seed=3)
    layer(x, x)
    layer.set_weights(mha.get_weights())
    np.testing.assert_allclose(np_(layer(x, x)), np_(mha(x, x)), rtol=1e-5, atol=1e-5)
    bad = mha.get_weights()
    bad[0] = bad[0][:, :1]
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `weights\[0\]`: expected the shape"):
        layer.set_weights(bad)


# ------------------------------------------------------- call arguments


@pytest.mark.parametrize(
    "flag", [0, 1, np.True_, np.False_, np.int64(1)], ids=["0", "1", "np.True_", "np.False_", "np.int64"]
)
def test_use_causal_mask_takes_truthy_values_as_keras_does(flag):
    x = rng(12).normal(size=(B, N, E)).astype("float32")
    layer = DamchaAttention(2, 4, seed=0)
    want = layer(x, x, use_causal_mask=bool(flag))
    np.testing.assert_array_equal(np_(layer(x, x, use_causal_mask=flag)), np_(want))
    out, scores = layer(x, x, return_attention_scores=np.True_, use_causal_mask=flag)
    assert np.all(np_(scores)[..., np.triu_indices(N, 1)[0], np.triu_indices(N, 1)[1]] == 0) == bool(flag)


@pytest.mark.parametrize(
    "flag",
    [None, False, True, 0, 1, np.True_, np.False_, np.array(True), np.array(0), "tensor-True", "tensor-False"],
    ids=[
        "None",
        "False",
        "True",
        "0",
        "1",
        "np.True_",
        "np.False_",
        "array-True",
        "array-0",
        "tensor-True",
        "tensor-False",
    ],
)
def test_training_takes_what_keras_takes(flag):
    """None or a truthy flag known at call time, as Keras Dropout reads it: dropout
    happens exactly when it is truthy (None: inference, as Keras resolves it)."""
    flag = keras.ops.convert_to_tensor(flag == "tensor-True") if isinstance(flag, str) else flag
    x = rng(16).normal(size=(B, N, E)).astype("float32")
    layer = DamchaAttention(2, 4, dropout=0.5, seed=0)
    off = np_(layer(x, x, training=False))
    out = np_(layer(x, x, training=flag))
    truthy = flag is not None and bool(np.asarray(keras.ops.convert_to_numpy(flag)))
    assert np.array_equal(out, off) is not truthy


# What is not a flag, as each is described in the message. NumPy float scalars and
# 0-d float/str arrays have a shape () and a dtype, and used to be read as truthy
# concrete scalars (np.float64(0.5), np.array(0.5): dropout on) where 0.5 is refused.
NOT_FLAGS = {
    "yes": ("yes", "'yes'"),
    "str-False": ("False", "'False'"),
    "float": (1.0, "1.0"),
    "list": ([True], r"\[True\]"),
    "np.float64": (np.float64(0.5), "0.5"),
    "np.float32-0": (np.float32(0.0), "0.0"),
    "array-float": (np.array(0.5), r"ndarray\(shape=\(\), dtype=float64\)"),
    "array-str": (np.array("yes"), r"ndarray\(shape=\(\), dtype=<U3\)"),
    "array-object": (np.array(True, dtype=object), r"ndarray\(shape=\(\), dtype=object\)"),
    "array-1d-bool": (np.array([True]), r"ndarray\(shape=\(1,\), dtype=bool\)"),
    "tensor-float": ("tensor-float", r"\w+\(shape=\(\), dtype=[^)]*float32'?>?\)"),
}


def _not_flag(key):
    value, shown = NOT_FLAGS[key]
    return (keras.ops.convert_to_tensor(0.5), shown) if key == "tensor-float" else (value, shown)


@pytest.mark.parametrize("key", list(NOT_FLAGS))
@pytest.mark.parametrize("where", ["layer", "encoder"])
def test_training_refuses_what_is_not_a_flag(key, where):
    """A string is truthy: training="False" used to switch dropout on, and so did a
    NumPy float scalar or 0-d float array (a Python float was refused); the message
    names `training`, the value and what is expected, in the layer and in the blocks."""
    from damcha_keras import TransformerEncoder

    value, shown = _not_flag(key)
    x = rng(17).normal(size=(B, N, E)).astype("float32")
    match = (
        r"Invalid argument `training`: expected None or a bool \(or an int / a concrete scalar tensor or array "
        r"of a bool or integer dtype, read as truthy\), known when the layer is called\. "
        rf"Received: training={shown}(\x1b|\n|$)"  # Keras appends its own context
    )
    with pytest.raises(dc.DamchaTypeError, match=match):
        if where == "layer":
            DamchaAttention(2, 4, dropout=0.5)(x, x, training=value)
        else:
            TransformerEncoder(16, 2, dropout=0.5)(x, training=value)


@pytest.mark.parametrize("key", list(NOT_FLAGS))
@pytest.mark.parametrize("name", ["use_causal_mask", "return_attention_scores"])
def test_call_flags_refuse_what_is_not_a_flag(key, name):
    """The other call flags follow the same rule (np.float64(0.5) switched the causal mask on)."""
    value, shown = _not_flag(key)
    x = rng(17).normal(size=(B, N, E)).astype("float32")
    match = (
        rf"Invalid argument `{name}`: expected a bool \(or an int / a concrete scalar tensor or array "
        r"of a bool or integer dtype, read as truthy\), known when the layer is called\. "
        rf"Received: {name}={shown}(\x1b|\n|$)"
    )
    with pytest.raises(dc.DamchaTypeError, match=match):
        DamchaAttention(2, 4)(x, x, **{name: value})


def test_training_traced_is_taken_where_keras_mha_takes_it():
    """Under tf.function Keras MHA without dropout takes a symbolic `training`
    (autograph reads Dropout's test); so does the layer (it passes it on
    unread), where the other backends' tracers fail in MHA too."""
    x = rng(18).normal(size=(B, N, E)).astype("float32")

    def traced(layer):
        layer(x, x)
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            fn = tf.function(lambda t: layer(x, x, training=t), input_signature=[tf.TensorSpec((), tf.bool)])
            return fn(tf.constant(True))
        if keras.backend.backend() == "jax":
            import jax

            return jax.jit(lambda t: layer(x, x, training=t))(True)
        return layer(x, x, training=keras.ops.convert_to_tensor(True))

    mha = keras.layers.MultiHeadAttention(2, 4, seed=0)
    try:
        want = np_(traced(mha))
    except Exception:  # noqa: BLE001 - this backend's MHA refuses it: nothing to match
        want = None
    if want is not None:
        # The same weights (gates at 0: MHA's function): the traced call computes MHA's output,
        # not only its shape (a layer returning zeros under a symbolic `training` passed).
        layer = DamchaAttention.from_mha(mha)
        got = np_(traced(layer))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, np_(layer(x, x)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["bool", "int"])
def test_a_list_mask_is_taken_as_keras_mha_takes_it(kind):
    """Keras MHA casts any mask it is given; a nested list raised AttributeError ('list' has no dtype)."""
    x, c = rng(13).normal(size=(B, N, E)).astype("float32"), rng(14).normal(size=(B, M, E)).astype("float32")
    mha = keras.layers.MultiHeadAttention(2, 4)
    mha(x, c)
    randomize_biases(mha)
    layer = DamchaAttention.from_mha(mha)  # gates 0: it computes what the MHA computes
    visible = rng(15).uniform(size=(B, N, M)) < 0.6
    visible[..., 0] = True
    mask = visible.tolist() if kind == "bool" else visible.astype(int).tolist()
    want = np_(mha(x, c, attention_mask=mask))
    np.testing.assert_allclose(np_(layer(x, c, attention_mask=mask)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np_(layer(x, c, attention_mask=visible)), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(dc.DamchaValueError, match="attention_mask"):
        layer(x, c, attention_mask=(2 * visible.astype(int)).tolist())  # values other than 0/1, as for arrays


@pytest.mark.parametrize("mask", ["all", 1, {1, 2}, [[True], [True, False]]], ids=["str", "int", "set", "ragged"])
def test_a_mask_that_is_no_array_is_a_mask_dtype_error(mask):
    x = rng(16).normal(size=(B, N, E)).astype("float32")
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `attention_mask`: expected a mask that is boolean"):
        DamchaAttention(2, 4, seed=0)(x, x, attention_mask=mask)


@pytest.mark.parametrize(
    "query, value, key",
    [
        ((B, N, E), (B, M, 7), (B, 3, 7)),  # key/value lengths differ
        ((B, N, E), (B, M, E), (B,)),  # key of another rank
        ((B, 3, N, E), (B, 3, M, E), (B, 2, M, E)),  # key/value non-feature dims differ
        ((B, N, E), (B, M, E), (1, M, E)),  # a key of batch 1 (Keras's MHA broadcasts it on JAX and torch)
        ((B, N, E), (B, M, E), (B + 1, M, E)),  # another batch size
    ],
    ids=["length", "rank", "high-rank", "key-batch-1", "key-batch"],
)
def test_compute_output_shape_validates_like_mha(query, value, key):
    """MHA raises for key/value shapes that differ outside the feature axis; so do
    compute_output_shape and the call, naming both arguments."""
    layer = DamchaAttention(2, 4)
    named = (
        r"Invalid argument `key`: expected the shape of `value`.*must be equal.*Received: key\.shape=.*value\.shape="
    )
    with pytest.raises(dc.DamchaValueError, match=named):
        layer.compute_output_shape(query, value, key)
    with pytest.raises(dc.DamchaValueError, match=named):
        layer(np.ones(query, "float32"), np.ones(value, "float32"), np.ones(key, "float32"))


def test_flash_attention_is_honoured_or_refused_never_ignored():
    """As MHA: flash with dropout is refused at construction, flash with scores at
    the call; flash=True otherwise reaches keras.ops.dot_product_attention, so a
    backend without a flash kernel raises just as it does for MHA."""
    with pytest.raises(dc.DamchaValueError, match="Dropout is not supported when flash attention is enabled"):
        DamchaAttention(2, 4, dropout=0.1, flash_attention=True)
    x = rng(13).normal(size=(B, N, E)).astype("float32")
    layer = DamchaAttention(2, 4, flash_attention=True)
    with pytest.raises(dc.DamchaValueError, match="Returning attention scores is not supported when flash attention"):
        layer(x, x, return_attention_scores=True)
    mha = keras.layers.MultiHeadAttention(2, 4, flash_attention=True)
    mha.build(x.shape, x.shape)
    # A converted MHA keeps its flash choice (MHA's get_config does not carry it).
    converted = DamchaAttention.from_mha(mha)
    assert converted.get_config()["flash_attention"] is True
    plain = keras.layers.MultiHeadAttention(2, 4)
    plain.build(x.shape, x.shape)
    assert DamchaAttention.from_mha(plain).get_config()["flash_attention"] is None
    try:
        want = mha(x, x)
    except Exception as error:  # noqa: BLE001 - no flash kernel here (the backend's own error type): DAMCHA must fail alike
        # The backend's own refusal, word for word (any error of that type passed); Keras wraps it
        # in a frame naming the layer, so the line that is neither the frame nor blank.
        lines = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()
        reason = next(line for line in lines if line.strip() and not line.startswith("Exception encountered"))
        for ours in (layer, converted):
            with pytest.raises(type(error), match=re.escape(reason)):
                ours(x, x)
    else:
        # Flash honoured: MHA's output on the same weights (gates at 0), not only its shape.
        np.testing.assert_allclose(np_(converted(x, x)), np_(want), rtol=1e-5, atol=1e-6)


def test_compute_attention_is_the_override_point():
    """A subclass overriding _compute_attention (MHA's documented hook) receives
    the mapped heads and the full boolean mask (the causal-only shortcut is off for
    it, as in MHA), and its result is used."""
    seen = {}

    class Probe(DamchaAttention):
        def _compute_attention(
            self, query, key, value, attention_mask=None, training=None, return_attention_scores=False
        ):
            seen["mask"] = None if attention_mask is None else np_(attention_mask)
            seen["query"] = tuple(query.shape)
            return super()._compute_attention(query, key, value, attention_mask, training, return_attention_scores)

    x = rng(14).normal(size=(B, N, E)).astype("float32")
    probe = Probe(2, 4, seed=0)
    y = probe(x, x, use_causal_mask=True)
    assert seen["query"] == (B, N, 2, 4)
    np.testing.assert_array_equal(seen["mask"][0, 0], np.tril(np.ones((N, N))))
    plain = DamchaAttention.from_canonical(probe.to_canonical(), probe.config)
    np.testing.assert_allclose(np_(y), np_(plain(x, x, use_causal_mask=True)), rtol=1e-5, atol=1e-6)


def test_key_and_value_of_different_feature_sizes():
    """DECISIONS 8: `key` and `value` of their own feature sizes (E_k != E_v), as
    Keras MHA takes them: equal to MHA with gates 0, to the reference (value=) with
    open gates, and round-tripped through the canonical form (value_input_dim)."""
    r = rng(15)
    q, v, k = (r.normal(size=shape).astype("float32") for shape in ((B, N, E), (B, M, 6), (B, M, 3)))
    mha = keras.layers.MultiHeadAttention(2, 4, value_dim=5, seed=0)
    mha(q, v, k)
    randomize_biases(mha)
    layer = DamchaAttention.from_mha(mha)
    assert (layer.config.context_dim, layer.config.value_input_dim) == (3, 6)
    np.testing.assert_allclose(np_(layer(q, v, k)), np_(mha(q, v, k)), rtol=1e-5, atol=1e-5)
    open_gates(layer)
    params = layer.to_canonical()
    assert params["key.kernel"].shape == (3, 2, 4) and params["value.kernel"].shape == (6, 2, 5)
    ref = dc.damcha_attention(params, layer.config, q, k, value=v, causal=True)
    np.testing.assert_allclose(np_(layer(q, v, k, use_causal_mask=True)), ref, rtol=1e-4, atol=1e-5)
    again = DamchaAttention.from_canonical(params, layer.config)
    np.testing.assert_array_equal(np_(again(q, v, k)), np_(layer(q, v, k)))
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `key`: expected a tensor.*Received: key=None"):
        layer(q, v)
