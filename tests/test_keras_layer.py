"""DamchaAttention on the current Keras backend (tensorflow unless KERAS_BACKEND says
otherwise): equality with keras.layers.MultiHeadAttention and with the NumPy
reference, a Keras-style layer test, serialisation, sharing and bad input.
The other Keras backends run test_keras_backends.py's checks in subprocesses."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import damcha_core as dc
from damcha_conformance import case_params
from damcha_keras import DamchaAttention, MetricGenerator, TransformerDecoder, TransformerEncoder
from damcha_keras import stack_from_canonical as dk_stack_from_canonical
from damcha_keras import stack_to_canonical as dk_stack_to_canonical

B, N, M, E, H, D = 2, 5, 7, 12, 3, 4


def np_(x):
    return np.asarray(keras.ops.convert_to_numpy(x), dtype=np.float64)


def rng(seed=0):
    return np.random.default_rng(seed)


def built_mha(cross: bool, seed: int = 0) -> keras.layers.MultiHeadAttention:
    mha = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D, value_dim=D + 1, output_shape=E + 1, seed=seed)
    x = rng(seed).normal(size=(B, N, E)).astype("float32")
    c = rng(seed + 1).normal(size=(B, M if cross else N, E + 2 if cross else E)).astype("float32")
    mha(x, c)
    # Non-zero biases so that a dropped bias cannot pass.
    for var in mha.weights:
        if "bias" in var.path:
            var.assign(rng(seed + 2).normal(size=var.shape).astype("float32"))
    return mha


# --------------------------------------------------------- MHA equivalence

MASK_KINDS = ["none", "attention_mask", "causal", "query_value_masks", "causal_and_padding", "all_masked_row"]


@pytest.mark.parametrize("metric", ["heads", "lowrank", "none"])
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_from_mha_equals_mha(mask_kind, metric):
    """A converted MHA (gates 0) computes what keras MHA computes, through both
    the fused and the explicit (scores) path; rows with no visible key give the
    output bias where MHA gives a uniform average."""
    cross = mask_kind in ("attention_mask", "all_masked_row")
    mha = built_mha(cross)
    kwargs = dict(metric=metric, coupling="separate" if cross else "tied")
    if metric == "lowrank":
        kwargs["metric_rank"] = 2
    layer = DamchaAttention.from_mha(mha, **kwargs)
    r = rng(3)
    x = r.normal(size=(B, N, E)).astype("float32")
    c = r.normal(size=(B, M, E + 2)).astype("float32") if cross else x
    call = {}
    visible = np.ones((B, N, c.shape[1]), bool)
    if mask_kind in ("attention_mask", "all_masked_row"):
        am = r.random((B, N, M)) < 0.6
        am[..., 0] = True
        if mask_kind == "all_masked_row":
            am[1, 2] = False
        call["attention_mask"] = am
        visible &= am
    if mask_kind in ("causal", "causal_and_padding"):
        call["use_causal_mask"] = True
        visible &= np.tril(np.ones((N, N), bool))
    if mask_kind in ("query_value_masks", "causal_and_padding"):
        pad = np.ones((B, N), bool)
        pad[1, -2:] = False
        call["value_mask"] = pad
        visible &= pad[:, None, :]
        if mask_kind == "query_value_masks":
            call["query_mask"] = pad
            visible &= pad[:, :, None]
    seen = visible.any(-1)
    expected = np_(mha(x, c, **call))
    bias = np_(mha.output_dense.bias)
    expected[~seen] = bias
    got = np_(layer(x, c, **call))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    got2, scores = layer(x, c, return_attention_scores=True, **call)
    _, mha_scores = mha(x, c, return_attention_scores=True, **call)
    np.testing.assert_allclose(np_(got2), expected, rtol=1e-5, atol=1e-5)
    mha_scores = np_(mha_scores) * np.broadcast_to(seen[:, None, :, None], mha_scores.shape)
    np.testing.assert_allclose(np_(scores), mha_scores, rtol=1e-5, atol=1e-6)
    if mask_kind == "all_masked_row":
        assert not seen.all()  # the case really has a row that sees nothing


@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_from_mha_keeps_the_activity_regularizer(kind):
    # It was dropped: a converted model silently lost the user's loss term.
    x = np.random.default_rng(0).random((2, 4, 8)).astype("float32")
    if kind == "mha":
        mha = keras.layers.MultiHeadAttention(2, 4, activity_regularizer="l2")
    else:
        mha = keras.layers.GroupQueryAttention(
            head_dim=4, num_query_heads=2, num_key_value_heads=1, activity_regularizer="l2"
        )
    mha(x, x)
    layer = DamchaAttention.from_mha(mha)
    y = layer(x, x)
    assert isinstance(layer.activity_regularizer, keras.regularizers.L2)
    # Keras applies it to the layer's output (MHA applies it to its projections' outputs instead).
    [loss] = layer.losses
    np.testing.assert_allclose(float(loss), float(keras.regularizers.L2(0.01)(y)) / 2, rtol=1e-5)


def test_from_mha_keeps_weights_and_names():
    mha = built_mha(cross=False)
    layer = DamchaAttention.from_mha(mha)
    for name in ("query", "key", "value", "output"):
        ours, theirs = getattr(layer, f"{name}_dense"), getattr(mha, f"{name}_dense")
        np.testing.assert_array_equal(np_(ours.kernel), np_(theirs.kernel))
        assert ours.kernel.path.split("/")[-2:] == theirs.kernel.path.split("/")[-2:]
    canonical = layer.to_canonical()
    assert list(canonical) == list(layer.config.param_shapes())
    assert np.all(canonical["metric.qk.gate"] == 0)


@pytest.mark.parametrize("frozen", ["layer", "query-dense", "key-kernel"])
def test_from_mha_keeps_frozen_weights_frozen(frozen):
    """What was frozen before conversion stays frozen (the layer, one projection
    or one variable); before, from_mha's copies were all trainable, so "freeze
    the backbone, train the gates" trained the projections too. The new gates
    and generators are trainable, and a training step leaves the frozen ones."""
    mha = built_mha(cross=False)
    if frozen == "layer":
        mha.trainable = False
    elif frozen == "query-dense":
        mha._query_dense.trainable = False
    else:
        mha._key_dense.kernel.trainable = False
    expected = sorted(w.path.split("/", 1)[1] for w in mha.non_trainable_weights)
    assert expected
    layer = DamchaAttention.from_mha(mha)
    assert sorted(w.path.split("/", 1)[1] for w in layer.non_trainable_weights) == expected
    trainable = {w.path.split("/", 1)[1] for w in layer.trainable_weights}
    assert {"metric_qk_gate", "metric_qk/kernel", "metric_qk/bias"} <= trainable
    x = rng(3).normal(size=(B, N, E)).astype("float32")
    inputs = keras.Input((N, E))
    model = keras.Model(inputs, layer(inputs, inputs))
    before = {w.path: np_(w) for w in layer.weights}
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.train_on_batch(x, np.ones((B, N, E + 1), "float32"))
    moved = {w.path.split("/", 1)[1] for w in layer.weights if not np.array_equal(np_(w), before[w.path])}
    assert "metric_qk_gate" in moved  # the step trained (the generator moves once the gate is open)
    assert not moved & set(expected)


@pytest.mark.parametrize("metric", ["heads", "none"])
def test_weights_order_is_the_documented_one(metric):
    """docs/keras.md: layer.weights = the gates (the layer's own variables, which
    Keras lists first), MHA's weights in MHA's order (names and shapes), then the
    generators; exactly MHA's list without the metric."""
    x, c = np.zeros((1, 3, 8), "float32"), np.zeros((1, 4, 6), "float32")
    mha = keras.layers.MultiHeadAttention(2, 4, use_gate=True)
    mha(x, c)
    layer = DamchaAttention(2, 4, use_gate=True, metric=metric, coupling="separate" if metric != "none" else None)
    layer(x, c)
    names = [w.path.split("/", 1)[1] for w in layer.weights]
    theirs = [(w.path.split("/", 1)[1], tuple(w.shape)) for w in mha.weights]
    gates = ["metric_q_gate", "metric_k_gate"] if metric != "none" else []
    generators = ["metric_q/kernel", "metric_q/bias", "metric_k/kernel", "metric_k/bias"] if metric != "none" else []
    assert names == gates + [n for n, _ in theirs] + generators
    mine = [(w.path.split("/", 1)[1], tuple(w.shape)) for w in layer.weights[len(gates) : len(gates) + len(theirs)]]
    assert mine == theirs


# ------------------------------------------------------ reference equality

CONFIGS = {
    "heads-tied": dict(metric="heads", coupling="tied"),
    "heads-separate-gqa": dict(metric="heads", coupling="separate", num_kv_heads=1),
    "lowrank-query-scale": dict(metric="lowrank", metric_rank=2, coupling="query", scale=0.7),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_reference_with_keras_masks(name, causal):
    """Open gates, Keras (B, N, M) and (B, M) masks, causal: equals damcha_core,
    outputs and attention scores."""
    cfg = dc.DamchaConfig(query_dim=E, num_heads=H + 1, key_dim=D, output_dim=6, **CONFIGS[name])
    params = case_params(cfg, seed=7)
    layer = DamchaAttention.from_canonical(params, cfg)
    r = rng(5)
    x = r.normal(size=(B, N, E))
    am = r.random((B, N, N)) < 0.7
    am[0, 1] = False  # a row that sees nothing
    vm = np.array([[True] * N, [True] * (N - 2) + [False] * 2])
    ref_mask = (am & vm[:, None, :])[:, None]
    y_ref, w_ref = dc.damcha_attention(params, cfg, x, mask=ref_mask, causal=causal, return_weights=True)
    xs = x.astype("float32")
    y = layer(xs, xs, attention_mask=am, value_mask=vm, use_causal_mask=causal)
    np.testing.assert_allclose(np_(y), y_ref, rtol=2e-4, atol=2e-5)
    y2, w = layer(xs, xs, attention_mask=am, value_mask=vm, use_causal_mask=causal, return_attention_scores=True)
    np.testing.assert_allclose(np_(y2), y_ref, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(np_(w), w_ref, rtol=2e-4, atol=2e-5)


def test_distinct_key_feeds_key_side():
    """`key` (same shape as value) feeds the key projection and key-side metric:
    equals the reference with context=key for logits, value from `value`, which
    with key == value is the reference itself; a different key changes the output."""
    cfg = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D, context_dim=8, coupling="separate")
    params = case_params(cfg, seed=2)
    layer = DamchaAttention.from_canonical(params, cfg)
    r = rng(9)
    x, c = r.normal(size=(B, N, E)).astype("float32"), r.normal(size=(B, M, 8)).astype("float32")
    np.testing.assert_allclose(np_(layer(x, c, key=c)), dc.damcha_attention(params, cfg, x, c), rtol=2e-4, atol=2e-5)
    other = np_(layer(x, c, key=c[:, ::-1]))
    assert np.abs(other - np_(layer(x, c))).max() > 1e-3


# ---------------------------------------------------------- layer test


def test_layer_config_roundtrip_and_symbolic_call():
    layer = DamchaAttention(
        2,
        4,
        value_dim=3,
        output_shape=7,
        metric="lowrank",
        metric_rank=2,
        coupling="separate",
        num_kv_heads=1,
        scale=0.5,
        metric_l2=0.01,
        dropout=0.1,
        seed=1,
        kernel_regularizer="l2",
        name="att",
    )
    clone = DamchaAttention.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    q, c = keras.Input((None, 6)), keras.Input((9, 5))
    out, scores = layer(q, c, return_attention_scores=True)
    assert tuple(out.shape) == (None, None, 7) and tuple(scores.shape) == (None, 2, None, 9)
    assert layer.config == dc.DamchaConfig(
        query_dim=6,
        context_dim=5,
        num_heads=2,
        key_dim=4,
        value_dim=3,
        output_dim=7,
        metric="lowrank",
        metric_rank=2,
        coupling="separate",
        num_kv_heads=1,
        scale=0.5,
        dropout=0.1,
    )
    eager = layer(np.ones((2, 3, 6), "float32"), np.ones((2, 9, 5), "float32"))
    assert tuple(eager.shape) == (2, 3, 7)
    assert len(layer.trainable_weights) == len(layer.config.param_shapes())


def test_compiled_training_step_updates_metric_weights():
    """model.fit runs the compiled graph; the gates open (they get gradients)
    and the loss decreases."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 8))
    att = DamchaAttention(2, 4, seed=0)
    model = keras.Model(inp, keras.layers.GlobalAveragePooling1D()(att(inp, inp)))
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", jit_compile=False)
    r = rng(1)
    x, y = r.normal(size=(32, 6, 8)).astype("float32"), r.normal(size=(32, 8)).astype("float32")
    history = model.fit(x, y, epochs=4, batch_size=16, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert np.abs(np_(att.canonical_variables()["metric.qk.gate"])).max() > 0


def test_mixed_precision_matches_float32():
    layer32 = DamchaAttention(2, 4, seed=3)
    x = rng(2).normal(size=(2, 5, 8)).astype("float32")
    ref = np_(layer32(x, x))
    for name, var in layer32.canonical_variables().items():
        if name.endswith("gate"):
            var.assign(np.full(var.shape, 0.5, "float32"))
    ref = np_(layer32(x, x))
    mixed = DamchaAttention.from_canonical(layer32.to_canonical(), layer32.config, dtype="mixed_float16")
    out = mixed(x, x)
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    assert keras.backend.standardize_dtype(mixed.query_dense.kernel.dtype) == "float32"
    np.testing.assert_allclose(np_(out), ref, rtol=2e-2, atol=2e-2)


def test_metric_l2_adds_reference_penalty():
    cfg = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, metric="lowrank", metric_rank=3, coupling="separate")
    params = case_params(cfg, seed=4)
    layer = DamchaAttention.from_canonical(params, cfg, metric_l2=0.3)
    r = rng(4)
    x, c = r.normal(size=(2, 5, 8)), r.normal(size=(2, 6, 8))
    layer(x.astype("float32"), c.astype("float32"))
    assert len(layer.losses) == 1
    np.testing.assert_allclose(np_(layer.losses[0]), 0.3 * dc.metric_penalty(params, cfg, x, c), rtol=1e-4)


# ------------------------------------------------ serialisation, sharing


def test_shared_generator_stack_saves_and_loads_bit_exactly(tmp_path):
    keras.utils.set_random_seed(1)
    gen = MetricGenerator(2, name="shared_metric")
    inp = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8, mask_zero=True)(inp)
    enc = [TransformerEncoder(16, 2, metric_generator=gen, name=f"enc{i}") for i in range(2)]
    dec = TransformerDecoder(16, 2, metric_generator=gen, name="dec")
    for block in enc:
        h = block(h)
    out = keras.layers.Dense(3)(dec(h))
    model = keras.Model(inp, out)
    for block in enc + [dec]:
        assert block._attention.metric_generators["qk"] is gen
    for block in enc + [dec]:  # open every gate so the generator matters
        gate = block._attention.canonical_variables()["metric.qk.gate"]
        gate.assign(rng(5).uniform(0.3, 1.0, gate.shape).astype("float32"))
    tokens = np.array([[3, 4, 5, 0, 0, 0], [1, 2, 3, 4, 5, 6]], "int32")
    before = np_(model(tokens))
    path = tmp_path / "stack.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(np_(loaded(tokens)), before)
    gens = {id(loaded.get_layer(n)._attention.metric_generators["qk"]) for n in ("enc0", "enc1", "dec")}
    assert len(gens) == 1  # still one shared generator after loading


def test_automatic_keras_mask_equals_explicit_masks():
    """Embedding(mask_zero=True) masks flow into query_mask/value_mask."""
    keras.utils.set_random_seed(2)
    emb = keras.layers.Embedding(10, 8, mask_zero=True)
    att = DamchaAttention(2, 4, seed=2)
    tokens = np.array([[1, 2, 3, 0], [4, 5, 0, 0]], "int32")
    h = emb(tokens)
    auto = np_(att(h, h))
    pad = tokens != 0
    explicit = np_(att(h, h, query_mask=pad, value_mask=pad))
    unmasked = np_(att(emb.call(tokens), emb.call(tokens)))
    np.testing.assert_array_equal(auto, explicit)
    assert np.abs(auto - unmasked).max() > 1e-4


def test_canonical_safetensors_roundtrip(tmp_path):
    """save/load (the canonical vocabulary of every port); save_canonical is a
    deprecated alias; load_canonical returns the layer."""
    cfg = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    params = case_params(cfg, seed=1)
    layer = DamchaAttention.from_canonical(params, cfg)
    layer.save(tmp_path / "a.safetensors")
    again = DamchaAttention.load(tmp_path / "a.safetensors")
    assert again.config == cfg
    for name, value in again.to_canonical().items():
        np.testing.assert_array_equal(value, params[name].astype("float32"))
    with pytest.warns(DeprecationWarning, match="save_canonical"):
        layer.save_canonical(tmp_path / "b.safetensors")
    assert DamchaAttention.load(tmp_path / "b.safetensors").config == cfg
    fresh = DamchaAttention.from_canonical(dc.init_params(cfg, seed=3), cfg)
    assert fresh.load_canonical(params) is fresh
    np.testing.assert_array_equal(fresh.to_canonical()["query.kernel"], params["query.kernel"].astype("float32"))


def test_functional_damcha_attention_matches_reference():
    """_functional.damcha_attention, the forward as free keras.ops functions on
    canonical tensors, equals damcha_core in float64 (open gates, lowrank,
    GQA, mask and causal)."""
    from damcha_keras import _functional as F

    cfg = dc.DamchaConfig(
        query_dim=E,
        num_heads=4,
        key_dim=D,
        num_kv_heads=2,
        context_dim=6,
        metric="lowrank",
        metric_rank=2,
        coupling="separate",
        output_dim=5,
    )
    params = case_params(cfg, seed=4)
    r = rng(11)
    x, c = r.normal(size=(B, N, E)), r.normal(size=(B, M, 6))
    mask = r.random((B, 1, N, M)) < 0.7
    mask[1, 0, 2] = False
    y_ref, w_ref = dc.damcha_attention(params, cfg, x, c, mask=mask, causal=True, return_weights=True)
    tensors = {k: keras.ops.convert_to_tensor(v) for k, v in params.items()}
    y, w = F.damcha_attention(
        tensors,
        cfg,
        keras.ops.convert_to_tensor(x),
        keras.ops.convert_to_tensor(c),
        mask=keras.ops.convert_to_tensor(mask),
        causal=True,
        return_weights=True,
    )
    np.testing.assert_allclose(np_(y), y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np_(w), w_ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------ bad input

BAD_CONSTRUCTOR = {
    "num_heads-zero": (dict(num_heads=0, key_dim=4), dc.DamchaValueError, "num_heads"),
    "key_dim-float": (dict(num_heads=2, key_dim=4.0), dc.DamchaTypeError, "key_dim"),
    "coupling-unknown": (dict(num_heads=2, key_dim=4, coupling="both"), dc.DamchaValueError, "coupling"),
    "lowrank-without-rank": (dict(num_heads=2, key_dim=4, metric="lowrank"), dc.DamchaValueError, "metric_rank"),
    "tied-gqa": (dict(num_heads=4, key_dim=4, num_kv_heads=2, coupling="tied"), dc.DamchaValueError, "num_kv_heads"),
    # Keras's wording for the whole argument (its own tests match "Invalid `output_shape`"), the core's class.
    "output_shape-float": (
        dict(num_heads=2, key_dim=4, output_shape=8.0),
        dc.DamchaNotIntegerError,
        r"^Invalid `output_shape`: expected an int >= 1, a tuple of ints >= 1 or None\. Received: output_shape=8\.0$",
    ),
    "output_shape-zero-dim": (
        dict(num_heads=2, key_dim=4, output_shape=(2, 0)),
        dc.DamchaValueError,
        r"^Invalid `output_shape`: .*Received: output_shape=\(2, 0\)$",
    ),
    "output_shape-str": (dict(num_heads=2, key_dim=4, output_shape="8"), dc.DamchaTypeError, "Invalid `output_shape`"),
    "metric_l2-negative": (dict(num_heads=2, key_dim=4, metric_l2=-1.0), dc.DamchaValueError, "metric_l2"),
    "generator-wrong-type": (
        dict(num_heads=2, key_dim=4, metric_generator="gen"),
        dc.DamchaTypeError,
        "metric_generator",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONSTRUCTOR))
def test_bad_constructor_arguments(case):
    kwargs, error, name = BAD_CONSTRUCTOR[case]
    with pytest.raises(error, match=name):
        DamchaAttention(**kwargs)


X = np.zeros((2, 5, 8), "float32")
BAD_CALL = {
    "int-query": (dict(query=np.zeros((2, 5, 8), "int32")), dc.DamchaTypeError, "query"),
    "float-attention_mask-additive": (
        dict(attention_mask=np.zeros((2, 5, 5), "float32") - np.inf),
        dc.DamchaValueError,
        "attention_mask",
    ),
    "float16-value_mask-0.5": (dict(value_mask=np.full((2, 5), 0.5, "float16")), dc.DamchaValueError, "value_mask"),
    "complex-attention_mask": (
        dict(attention_mask=np.ones((2, 5, 5), "complex64")),
        dc.DamchaTypeError,
        "attention_mask",
    ),
    "attention_mask-shape": (dict(attention_mask=np.ones((2, 5, 4), bool)), dc.DamchaValueError, "attention_mask"),
    "attention_mask-rank5": (
        dict(attention_mask=np.ones((1, 2, 2, 5, 5), bool)),
        dc.DamchaValueError,
        "attention_mask",
    ),
    "query_mask-shape": (dict(query_mask=np.ones((2, 4), bool)), dc.DamchaValueError, "query_mask"),
    "features-changed": (dict(query=np.zeros((2, 5, 6), "float32")), dc.DamchaValueError, "query"),
    "rank-2-query": (dict(query=np.zeros((5, 8), "float32")), dc.DamchaValueError, "query"),
    "batch-mismatch": (dict(value=np.zeros((3, 5, 8), "float32")), dc.DamchaValueError, "batch"),
    "causal-not-bool": (dict(use_causal_mask="yes"), dc.DamchaTypeError, "use_causal_mask"),
    "scores-not-bool": (
        dict(return_attention_scores="no"),
        dc.DamchaTypeError,
        r"Invalid argument `return_attention_scores`: expected a bool.*Received: return_attention_scores='no'",
    ),
    "training-not-bool": (
        dict(training="yes"),
        dc.DamchaTypeError,
        r"Invalid argument `training`: expected None or a bool.*Received: training='yes'",
    ),
    "list-query": (
        dict(query=np.zeros((2, 5, 8)).tolist()),
        dc.DamchaTypeError,
        r"Invalid argument `query`: expected a tensor",
    ),
    "tuple-value": (
        dict(value=tuple(np.zeros((2, 5, 8)))),
        dc.DamchaTypeError,
        r"Invalid argument `value`: expected a tensor",
    ),
    # A built layer read None's shape (a raw AttributeError); key=None is value's default.
    "none-query": (dict(query=None), dc.DamchaTypeError, r"Invalid argument `query`: expected a tensor.*query=None"),
    "none-value": (dict(value=None), dc.DamchaTypeError, r"Invalid argument `value`: expected a tensor.*value=None"),
    # The layer's argument names, not damcha_core's (`context`), and the received shape.
    "value-features-changed": (
        dict(value=np.zeros((2, 5, 6), "float32")),
        dc.DamchaValueError,
        r"Invalid argument `value`: expected 8 features.*Received: value\.shape=\(2, 5, 6\)",
    ),
    "value-batch": (
        dict(value=np.zeros((3, 5, 8), "float32")),
        dc.DamchaValueError,
        r"Invalid argument `value`: expected the batch size of `query`.*value\.shape=\(3, 5, 8\)",
    ),
    # A built layer used to pass this key to the projection (a backend reshape error).
    "key-features-changed": (
        dict(key=np.zeros((2, 5, 6), "float32")),
        dc.DamchaValueError,
        r"Invalid argument `key`: expected 8 features.*Received: key\.shape=\(2, 5, 6\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CALL))
def test_bad_call_arguments(case):
    layer = DamchaAttention(2, 4)
    layer(X, X)
    overrides, error, name = BAD_CALL[case]
    args = {"query": X, "value": X, **overrides}
    with pytest.raises(error, match=name):
        layer(args.pop("query"), args.pop("value"), **args)


@pytest.mark.parametrize("block", [TransformerEncoder, TransformerDecoder])
@pytest.mark.parametrize(
    "num_heads, error, message",
    [
        (0, dc.DamchaValueError, r"^Invalid argument `num_heads`: expected an int >= 1\. Received: num_heads=0$"),
        (True, dc.DamchaTypeError, r"^Invalid argument `num_heads`: expected an int >= 1\. Received: num_heads=True$"),
    ],
)
def test_block_rejects_bad_num_heads_at_construction(block, num_heads, error, message):
    """Was accepted, then a ZeroDivisionError (0) in build; the core's rule and class."""
    with pytest.raises(error, match=message):
        block(16, num_heads)


@pytest.mark.parametrize(
    ("block", "name", "shape"),
    [
        (TransformerEncoder, "padding_mask", (2, 4)),
        (TransformerEncoder, "padding_mask", (2, 5, 5)),
        (TransformerDecoder, "decoder_padding_mask", (3, 5)),
    ],
    ids=["encoder-length", "encoder-rank", "decoder-batch"],
)
def test_block_padding_mask_errors_name_the_blocks_argument(block, name, shape):
    """A padding mask that does not fit is named as the block's caller passed it
    (the attention inside named it `query_mask`)."""
    x = np.zeros((2, 5, 8), "float32")
    with pytest.raises(dc.DamchaValueError, match=rf"Invalid argument `{name}`: expected shape \(B, N\) = \(2, 5\)"):
        block(16, 2)(x, **{name: np.ones(shape, bool)})


def test_incompatible_shared_generator_is_rejected():
    gen = MetricGenerator(3)
    with pytest.raises(dc.DamchaValueError, match="metric_generator"):
        DamchaAttention(2, 4, metric_generator=gen)(X, X)


def test_dropout_only_in_training():
    x = rng(6).normal(size=(2, 5, 8)).astype("float32")
    plain = DamchaAttention(2, 4, seed=0)
    plain(x, x)
    dropped = DamchaAttention.from_canonical(plain.to_canonical(), plain.config.replace(dropout=0.5), seed=0)
    np.testing.assert_allclose(np_(dropped(x, x)), np_(plain(x, x)), rtol=1e-6, atol=1e-6)
    train = np_(dropped(x, x, training=True))
    assert np.abs(train - np_(plain(x, x))).max() > 1e-3


def test_export_saved_model_and_reload(tmp_path):
    """model.export to a TensorFlow SavedModel (symbolic batch and length),
    reloaded with TFSMLayer, gives the same predictions."""
    inp = keras.Input((None, 8))
    att = DamchaAttention(2, 4, seed=0)
    model = keras.Model(inp, att(inp, inp, use_causal_mask=True))
    for name, var in att.canonical_variables().items():
        if name.endswith("gate"):
            var.assign(np.full(var.shape, 0.7, "float32"))
    model.export(str(tmp_path / "sm"), format="tf_saved_model", verbose=False)
    served = keras.layers.TFSMLayer(str(tmp_path / "sm"), call_endpoint="serve")
    x = rng(8).normal(size=(3, 6, 8)).astype("float32")
    np.testing.assert_allclose(np_(served(x)), np_(model(x)), rtol=1e-5, atol=1e-6)


def test_symbolic_bad_input_fails_when_building_the_model():
    q = keras.Input((5, 8))
    with pytest.raises(dc.DamchaValueError, match="attention_mask"):
        DamchaAttention(2, 4)(q, q, attention_mask=keras.Input((5, 4), dtype="bool"))
    with pytest.raises(dc.DamchaTypeError, match="query"):
        DamchaAttention(2, 4)(keras.Input((5, 8), dtype="int32"), q)


# ------------------------------------------------------------ decoding cache

from damcha_core import _reference as ref  # noqa: E402  (the spec's own projection and map)

CACHE_CONFIGS = {
    "heads-tied": dict(metric="heads", coupling="tied"),
    "lowrank-separate": dict(metric="lowrank", metric_rank=2, coupling="separate"),
    "heads-query-mqa": dict(metric="heads", coupling="query", num_kv_heads=1),
}


def _cache_layer(name: str, seed: int = 0):
    cfg = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D, **CACHE_CONFIGS[name])
    params = case_params(cfg, seed)
    return DamchaAttention.from_canonical(params, cfg, dtype="float64"), params, cfg


@pytest.mark.parametrize("chunks", [(1,) * 6, (3, 1, 2)], ids=["token-by-token", "chunked"])
@pytest.mark.parametrize("name", list(CACHE_CONFIGS))
def test_cache_decoding_equals_full_causal_forward(name, chunks):
    """Writing each step's tokens at cache_update_index with the bottom-right
    causal rule reproduces one causal pass; the cache holds k~ = L_k(x) k."""
    layer, params, cfg = _cache_layer(name)
    x = rng(4).normal(size=(B, sum(chunks), E))
    cache = layer.init_cache(B, sum(chunks) + 2)  # two slots never written
    outs, pos = [], 0
    for n in chunks:
        t = x[:, pos : pos + n]
        y, cache = layer(t, t, use_causal_mask=True, cache=cache, cache_update_index=pos)
        outs.append(np_(y))
        pos += n
    full = dc.damcha_attention(params, cfg, x, causal=True)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-10, atol=1e-12)
    _, k, v = ref.project(params, cfg, x, x)
    side = dc.side_of(cfg, "k")
    k_mapped = k if side is None else ref.apply_map(params, cfg, side, x, k)
    cached = np_(cache)
    np.testing.assert_allclose(cached[:, 0, :pos], k_mapped, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(cached[:, 1, :pos], v, rtol=1e-10, atol=1e-12)
    assert not cached[:, :, pos:].any()


def test_cache_step_under_tf_function_with_tensor_index():
    """A traced cache_update_index (tf.function, as in a generation loop) writes and masks correctly."""
    import tensorflow as tf

    layer, params, cfg = _cache_layer("heads-tied", seed=1)
    x = rng(5).normal(size=(B, 5, E))
    step = tf.function(lambda t, cache, i: layer(t, t, use_causal_mask=True, cache=cache, cache_update_index=i))
    cache, outs = layer.init_cache(B, 5), []
    for i in range(5):
        y, cache = step(tf.constant(x[:, i : i + 1]), cache, tf.constant(i))
        outs.append(np_(y))
    assert step.experimental_get_tracing_count() == 1  # one trace for every position
    np.testing.assert_allclose(
        np.concatenate(outs, axis=1), dc.damcha_attention(params, cfg, x, causal=True), rtol=1e-10, atol=1e-12
    )
    # Past the cache's end (or before its start) a traced index cannot be refused on
    # the host: NaN, where slice_update would clamp it and overwrite the last slot.
    for bad in (5, -1):
        y, _ = step(tf.constant(x[:, :1]), cache, tf.constant(bad))
        assert np.isnan(np_(y)).all(), bad


def test_read_only_cache_serves_cross_attention():
    """Memory written once (index 0) is then read as is by later queries; its
    keys were mapped by the memory's own tokens (separate coupling)."""
    layer, params, cfg = _cache_layer("lowrank-separate", seed=2)
    x, memory = rng(6).normal(size=(B, N, E)), rng(7).normal(size=(B, M, E))
    y0, cache = layer(x[:, :1], memory, cache=layer.init_cache(B, M), cache_update_index=0)
    y1, same = layer(x[:, 1:], x[:, 1:], cache=cache)  # value is ignored without an index
    assert same is cache
    want = dc.damcha_attention(params, cfg, x, memory)
    np.testing.assert_allclose(np.concatenate([np_(y0), np_(y1)], axis=1), want, rtol=1e-10, atol=1e-12)


def test_cache_masks_scores_and_all_hidden_row():
    """attention_mask spans the cache; unwritten slots get probability 0; a row
    that sees nothing outputs the output bias."""
    layer, params, cfg = _cache_layer("heads-tied", seed=3)
    x = rng(8).normal(size=(B, 4, E))
    L = 6
    _, cache = layer(x[:, :2], x[:, :2], use_causal_mask=True, cache=layer.init_cache(B, L), cache_update_index=0)
    mask = np.ones((B, 2, L), bool)
    mask[1, 0, :] = False  # batch 1, query 0 sees nothing
    mask[0, 1, 0] = False
    y, scores, _ = layer(
        x[:, 2:],
        x[:, 2:],
        attention_mask=mask,
        use_causal_mask=True,
        cache=cache,
        cache_update_index=2,
        return_attention_scores=True,
    )
    scores = np_(scores)
    assert scores.shape == (B, H, 2, L)
    np.testing.assert_array_equal(scores[..., 4:], 0.0)  # never written
    want = dc.damcha_attention(params, cfg, x[:, 2:], x, mask=mask[:, None, :, :4], causal=True, query_offset=2)
    np.testing.assert_allclose(np_(y), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np_(y)[1, 0], params["output.bias"], rtol=0, atol=1e-12)


def test_cache_in_a_functional_model():
    layer, params, cfg = _cache_layer("heads-tied")
    tokens = keras.Input((1, E), batch_size=B, dtype="float64")
    cache_in = keras.Input((2, 4, cfg.num_kv_heads, D), batch_size=B, dtype="float64")
    y, cache_out = layer(tokens, tokens, use_causal_mask=True, cache=cache_in, cache_update_index=0)
    model = keras.Model([tokens, cache_in], [y, cache_out])
    assert tuple(cache_out.shape) == (B, 2, 4, cfg.num_kv_heads, D)
    t = rng(9).normal(size=(B, 1, E))
    out, cache = model([t, np.zeros((B, 2, 4, cfg.num_kv_heads, D))])
    np.testing.assert_allclose(np_(out), np_(layer(t, t)), rtol=1e-10, atol=1e-12)  # one token sees itself only
    # The model's cache output is the cache: the next token, decoded from it, sees both tokens as
    # one causal pass does (a model that dropped or mis-wrote cache_out passed the check above).
    np.testing.assert_array_equal(np_(cache)[:, :, 1:], 0.0)  # only position 0 written
    t2 = rng(10).normal(size=(B, 1, E))
    y2, _ = layer(t2, t2, use_causal_mask=True, cache=cache, cache_update_index=1)
    both = np.concatenate([t, t2], axis=1)
    want = dc.damcha_attention(params, cfg, t2, both, causal=True, query_offset=1)
    np.testing.assert_allclose(np_(y2), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (
            dict(cache_update_index=0),
            dc.DamchaValueError,
            r"Invalid argument `cache_update_index`: expected None without a `cache`",
        ),
        (
            dict(cache=np.zeros((B, 2, 6, H, D + 1)), cache_update_index=0),
            dc.DamchaValueError,
            r"Invalid argument `cache`: expected shape \(B, 2, L, G, d\) = \(2, 2, L, 3, 4\)\. Received: cache.shape=\(2, 2, 6, 3, 5\)",
        ),
        (dict(cache=np.zeros((B, 2, 6, H, D), "int32"), cache_update_index=0), dc.DamchaTypeError, r"`cache`"),
        (
            dict(cache_update_index=5),
            dc.DamchaValueError,
            r"Invalid argument `cache_update_index`: expected an index in \[0, L - M\] = \[0, 4\].*Received: cache_update_index=5",
        ),
        (dict(cache_update_index=1.0), dc.DamchaTypeError, r"Invalid argument `cache_update_index`: expected an int"),
        (
            dict(value_mask=np.ones((B, 2), bool), cache_update_index=0),
            dc.DamchaValueError,
            r"Invalid argument `value_mask`: expected None with a cache",
        ),
        (
            dict(use_causal_mask=True),
            dc.DamchaValueError,
            r"expected the position of the first new token with use_causal_mask=True and a cache",
        ),
        (
            dict(attention_mask=np.ones((B, 2, 2), bool), cache_update_index=0),
            dc.DamchaValueError,
            r"Invalid argument `attention_mask`: expected shape.*\(2, 6\)",
        ),
    ],
    ids=[
        "index-without-cache",
        "cache-shape",
        "cache-dtype",
        "index-out-of-range",
        "index-type",
        "value-mask",
        "causal-read-only",
        "mask-not-spanning-cache",
    ],
)
def test_bad_cache_arguments(kwargs, error, pattern):
    layer, _, _ = _cache_layer("heads-tied")
    x = rng(0).normal(size=(B, 2, E))
    if "cache" not in kwargs and kwargs != dict(cache_update_index=0):  # every case but the first has a cache
        kwargs = dict(kwargs, cache=layer.init_cache(B, 6))
    with pytest.raises(error, match=pattern):
        layer(x, x, **kwargs)


def test_cache_needs_equal_key_and_value_dims():
    layer = DamchaAttention(H, D, value_dim=D + 1)
    x = rng(0).normal(size=(B, 2, E)).astype("float32")
    layer(x, x)
    with pytest.raises(dc.DamchaValueError, match=r"expected value_dim == key_dim for a cache.*key_dim=4, value_dim=5"):
        layer.init_cache(B, 4)


@pytest.mark.parametrize("normalize_first", [False, True], ids=["post-norm", "pre-norm"])
def test_decoder_block_cache_decoding_equals_full_forward(normalize_first):
    """A stack of two decoder blocks sharing a generator, decoded token by token
    through per-block caches, equals the full causal forward of the same blocks."""
    gen = MetricGenerator(2, name="dec_shared", dtype="float64")
    blocks = [
        TransformerDecoder(
            16, 2, normalize_first=normalize_first, metric_generator=gen, seed=i, dtype="float64", name=f"dec{i}"
        )
        for i in range(2)
    ]
    x = rng(10).normal(size=(B, 5, 8))
    h = x
    for block in blocks:
        h = block(h)
    for block in blocks:  # open the gates so the maps act (fresh blocks are exactly MHA)
        block._attention._gates["qk"].assign(rng(11).normal(size=2))
    full = x
    for block in blocks:
        full = block(full)
    caches, outs = [block.init_cache(B, 5) for block in blocks], []
    for i in range(5):
        h = x[:, i : i + 1]
        for j, block in enumerate(blocks):
            h, caches[j] = block(h, self_attention_cache=caches[j], self_attention_cache_update_index=i)
        outs.append(np_(h))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), np_(full), rtol=1e-10, atol=1e-12)
    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `decoder_padding_mask`: expected None with `self_attention_cache`"
    ):
        blocks[0](
            x[:, :1],
            decoder_padding_mask=np.ones((B, 1), bool),
            self_attention_cache=caches[0],
            self_attention_cache_update_index=0,
        )
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `self_attention_cache_update_index`: expected the position of the first new token",
    ):
        blocks[0](x[:, :1], self_attention_cache=caches[0])


def test_mixed_precision_cache_in_a_compiled_generation_loop():
    """A mixed_float16 layer makes a float16 cache that keeps its dtype through a
    tf.function fori_loop (a loop carry must not change dtype) and decodes like the
    layer's own causal pass; a float32 cache would come back float16 (Keras casts
    floating call inputs), so init_cache refuses that dtype."""
    import tensorflow as tf

    _, params, cfg = _cache_layer("heads-tied", seed=4)
    layer = DamchaAttention.from_canonical(params, cfg, dtype="mixed_float16")
    x = keras.ops.convert_to_tensor(rng(12).normal(size=(B, 5, E)).astype("float32"))
    cache = layer.init_cache(B, 5)
    assert keras.backend.standardize_dtype(cache.dtype) == "float16"

    @tf.function
    def generate(cache):
        def body(i, state):
            cache, outs = state
            t = x[:, i : i + 1]
            y, cache = layer(t, t, use_causal_mask=True, cache=cache, cache_update_index=i)
            return cache, keras.ops.slice_update(outs, [0, i, 0], y)

        return keras.ops.fori_loop(0, 5, body, (cache, keras.ops.zeros((B, 5, E), "float16")))

    cache, outs = generate(cache)
    assert keras.backend.standardize_dtype(cache.dtype) == "float16"
    np.testing.assert_allclose(np_(outs), np_(layer(x, x, use_causal_mask=True)), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np_(outs), dc.damcha_attention(params, cfg, np_(x), causal=True), rtol=2e-2, atol=2e-2)
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `dtype`: expected the layer's compute dtype 'float16' for a cache.*"
        r"Received: dtype='float32'",
    ):
        layer.init_cache(B, 5, dtype="float32")
    with pytest.raises(
        dc.DamchaTypeError, match=r"Invalid argument `dtype`: expected a float dtype for a cache. Received: dtype="
    ):
        layer.init_cache(B, 5, dtype="int32")


def test_cache_refuses_keras_mask_filled_value_mask_with_a_hint():
    """Tokens from Embedding(mask_zero=True) carry a Keras mask that Keras passes as
    value_mask; the refusal says where it came from."""
    layer, _, _ = _cache_layer("heads-tied")
    tokens = keras.layers.Embedding(10, E, mask_zero=True, dtype="float64")(np.array([[1], [2]]))
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `value_mask`: expected None with a cache.*Embedding\(mask_zero=True\)",
    ):
        layer(tokens, tokens, use_causal_mask=True, cache=layer.init_cache(B, 4), cache_update_index=0)


def test_blocks_share_separate_generators_and_keep_them_through_save(tmp_path):
    """coupling='separate' stacks share a {'q', 'k'} pair of generators across blocks,
    and a .keras round trip keeps one pair for every block, bit-exactly."""
    pair = {"q": MetricGenerator(2, name="gq"), "k": MetricGenerator(2, name="gk")}
    inp = keras.Input((5, 8))
    h = TransformerEncoder(16, 2, coupling="separate", metric_generator=pair, name="b0")(inp)
    h = TransformerEncoder(16, 2, coupling="separate", metric_generator=pair, name="b1")(h)
    model = keras.Model(inp, h)
    blocks = [model.get_layer("b0"), model.get_layer("b1")]
    assert all(
        b._attention.metric_generators["q"] is pair["q"] and b._attention.metric_generators["k"] is pair["k"]
        for b in blocks
    )
    for b in blocks:  # open the gates: the generators shape the output
        for gate in b._attention._gates.values():
            gate.assign(rng(12).uniform(0.3, 1.0, size=2))
    path = tmp_path / "separate.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    x = rng(13).normal(size=(2, 5, 8)).astype("float32")
    np.testing.assert_array_equal(np_(loaded(x)), np_(model(x)))
    again = [loaded.get_layer("b0")._attention.metric_generators, loaded.get_layer("b1")._attention.metric_generators]
    assert again[0]["q"] is again[1]["q"] and again[0]["k"] is again[1]["k"] and again[0]["q"] is not again[0]["k"]
    # The shared policy's rules, at construction (the generator's fit waits for the sizes, at build).
    with pytest.raises(
        dc.DamchaTypeError, match=r"^Invalid argument `metric_generator\['q'\]`: expected a MetricGenerator"
    ):
        TransformerEncoder(16, 2, coupling="separate", metric_generator={"q": 3, "k": pair["k"]})
    with pytest.raises(dc.DamchaValueError, match=r"missing sides \['k'\]"):
        TransformerEncoder(16, 2, coupling="separate", metric_generator={"q": pair["q"]})
    with pytest.raises(
        dc.DamchaValueError,
        match=r"^Invalid argument `metric_generator`: expected a dict \{'q': \.\.\., 'k': \.\.\.\} with coupling='separate'",
    ):
        TransformerEncoder(16, 2, coupling="separate", metric_generator=pair["q"])


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "float32", "float16"])
def test_numeric_0_1_masks_read_as_keras_mha_reads_them(dtype):
    """Tokenizers hand out 0/1 integer masks and ``ops.tril(ops.ones((N, N)))`` is a
    float 0/1 causal mask; Keras MHA reads non-zero as attend, and so does this
    layer (same output as the boolean masks, gates open, against the reference)."""
    cfg = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D, coupling="separate", context_dim=E + 2)
    params = case_params(cfg, 5)
    layer = DamchaAttention.from_canonical(params, cfg, dtype="float64")
    r = rng(14)
    x, c = r.normal(size=(B, N, E)), r.normal(size=(B, M, E + 2))
    attention = r.random((B, N, M)) < 0.7
    attention[..., 0] = True
    value = np.ones((B, M), bool)
    value[1, -2:] = False
    want = np_(layer(x, c, attention_mask=attention, value_mask=value))
    got = np_(layer(x, c, attention_mask=attention.astype(dtype), value_mask=value.astype(dtype)))
    np.testing.assert_array_equal(got, want)
    ref = dc.damcha_attention(params, cfg, x, c, mask=(attention & value[:, None, :])[:, None])
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
    tril = keras.ops.cast(keras.ops.tril(keras.ops.ones((N, M))), dtype)
    np.testing.assert_array_equal(np_(layer(x, c, attention_mask=tril)), np_(layer(x, c, use_causal_mask=True)))


@pytest.mark.parametrize("bad", ["additive-0-inf", "nan", "two", "tril-with-a-two"])
def test_masks_with_values_other_than_0_1_are_refused_or_nan_under_tracing(bad):
    """DECISIONS 5: an additive 0/-inf float mask (or NaN, or an int 2) is never read
    as a boolean. Concrete values: DamchaValueError naming the argument; traced
    (tf.function, values unknown): the output is NaN, never a finite number."""
    layer = DamchaAttention(2, 4, seed=0)
    x = rng(15).normal(size=(2, 5, 8)).astype("float32")
    layer(x, x)
    allowed = np.tril(np.ones((5, 5), "float32"))
    mask = {
        "additive-0-inf": np.where(allowed > 0, 0.0, -np.inf).astype("float32"),
        "nan": np.where(allowed > 0, 1.0, np.nan).astype("float32"),
        "two": (allowed * 2).astype("int32"),
        # The causal pattern with one value 2: not read as causal (the exact lower triangle is compared first).
        "tril-with-a-two": np.where(np.eye(5, k=-2) > 0, 2.0, allowed).astype("float32"),
    }[bad]
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `attention_mask`: expected only 0 and 1 .*Received: "
        r"attention_mask\.shape=\(5, 5\)",
    ):
        layer(x, x, attention_mask=mask)
    import tensorflow as tf

    traced = tf.function(lambda q, m: layer(q, q, attention_mask=m))
    assert np.isnan(np_(traced(x, mask))).all()
    fine = np_(traced(x, allowed.astype(mask.dtype)))
    np.testing.assert_allclose(fine, np_(layer(x, x, use_causal_mask=True)), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------- stack canonical I/O


@pytest.mark.parametrize("kind", ["encoder-shared-final-norm", "decoder-separate", "encoder-gelu-tanh-unshared"])
def test_stack_canonical_round_trip_against_the_core_reference(kind):
    """Blocks expose the core's stack format: stack_from_canonical builds blocks
    (and the final norm) from damcha_core params, they compute
    damcha_core.encoder_forward, and stack_to_canonical / a block's to_canonical
    give the params back (shared generator once)."""
    attention = dc.DamchaConfig(
        query_dim=8,
        num_heads=2,
        key_dim=4,
        metric="lowrank" if "separate" in kind else "heads",
        metric_rank=2 if "separate" in kind else None,
        coupling="separate" if "separate" in kind else "auto",
    )
    config = dc.EncoderConfig(
        attention,
        num_layers=2,
        ffn_dim=12,
        share_metric="unshared" not in kind,
        causal=kind.startswith("decoder"),
        norm_first=kind != "decoder-separate",
        activation="gelu_tanh" if "tanh" in kind else "relu",
        final_norm="final" in kind,
    )
    params = dc.init_encoder_params(config, seed=3)
    for name in params:
        if name.endswith("gate"):
            params[name] = np.full(params[name].shape, 0.7)
    layers = dk_stack_from_canonical(params, config, dtype="float64")
    assert type(layers[0]).__name__ == ("TransformerDecoder" if config.causal else "TransformerEncoder")
    x = rng(16).normal(size=(2, 5, 8))
    h = x
    for layer in layers:
        h = layer(h)
    # Keras's float64 gelu is good to ~5e-9 (its constants are float32); relu is exact.
    tol = 1e-12 if config.activation == "relu" else 1e-7
    np.testing.assert_allclose(np_(h), dc.encoder_forward(params, config, x), rtol=tol, atol=tol)
    again, again_config = dk_stack_to_canonical(layers)
    assert again_config == config and set(again) == set(params)
    for name, value in params.items():
        np.testing.assert_array_equal(again[name], value)
    one, one_config = layers[0].to_canonical()
    assert one_config.num_layers == 1 and not one_config.final_norm
    block = type(layers[0]).from_canonical(one, one_config, dtype="float64")
    np.testing.assert_array_equal(np_(block(x)), np_(layers[0](x)))
    assert block.load_canonical(one) is block


def test_stack_to_canonical_names_what_does_not_fit():
    blocks = [TransformerEncoder(16, 2, activation="silu"), TransformerEncoder(16, 2)]
    for b in blocks:
        b(np.zeros((1, 3, 8), "float32"))
    with pytest.raises(dc.DamchaValueError, match=r"activation relu, gelu or gelu_tanh \(block 0 has silu\)"):
        dk_stack_to_canonical(blocks)
    with pytest.raises(dc.DamchaTypeError, match="one kind"):
        dk_stack_to_canonical([blocks[1], TransformerDecoder(16, 2)])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_one_array_as_query_and_value_is_a_self_attention(monkeypatch, dtype):
    """``layer(x, x)`` with one NumPy array maps its queries and keys with one map
    matrix per token, as with one tensor: Keras converts (and casts: float64 into a
    float32 layer) each argument on its own, so ``call`` got two tensors and took
    the untied path (two map matrices). The output equals the reference."""
    import damcha_keras._functional as F

    calls = {"map_heads_pair": 0, "map_heads": 0}

    def counted(name):
        real = getattr(F, name)

        def run(*args):
            calls[name] += 1
            return real(*args)

        return run

    for name in calls:
        monkeypatch.setattr(F, name, counted(name))
    cfg = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D)
    params = case_params(cfg, 41)
    layer = DamchaAttention.from_canonical(params, cfg)
    x = np.random.default_rng(42).normal(size=(B, 3, E)).astype(dtype)  # 6 tokens < E: the sublayers' path
    y = layer(x, x, use_causal_mask=True)
    assert calls["map_heads_pair"] >= 1 and calls["map_heads"] == 0, calls
    expected = dc.damcha_attention(params, cfg, x.astype(np.float64), causal=True)
    np.testing.assert_allclose(np_(y), expected, rtol=1e-5, atol=1e-6)
