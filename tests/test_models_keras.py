"""damcha_keras.convert on KerasHub backbones and Keras models, on the current
Keras backend (tensorflow unless KERAS_BACKEND says otherwise): exact at init,
every converted layer equals the NumPy reference with the gates open,
generation with the cache, training, weights and .keras files, helpers and
errors. tests/test_models_keras_backends.py runs the core of it on the jax and
torch backends, each in a subprocess."""

from __future__ import annotations

import functools
import os
import re
import warnings

import keras
import keras_hub  # (a missing keras-hub fails collection: CI installs it)
import numpy as np
import pytest
from _models_keras_zoo import (
    ARCHS,
    CAUSAL,
    COUPLINGS,
    GATED,
    HOSTED,
    NORMED,
    POSITIONAL,
    ROTARY,
    SUBLAYERS,
    attention_layers,
    backbone,
    cached_logits,
    call_layer,
    causal_lm,
    convert_after_fit,
    greedy_generate,
    greedy_without_cache,
    inputs,
    layer_params,
    lm_inputs,
    numpy,
    open_gates,
    output,
    positional_reference,
    projection,
    reference_config,
    reference_maps,
    rotary,
)

import damcha_core as dc
import damcha_core._layout
import damcha_keras as dk
from damcha_core._reference import apply_map as reference_map
from damcha_core._reference import generator as reference_generator
from damcha_core._reference import role_penalty
from damcha_core._rotary import apply_rotary

DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "models.md")


def causal_mask(batch: int, n: int) -> np.ndarray:
    """Causal (B, N, N) with the last row's last two keys hidden (padding)."""
    mask = np.tril(np.ones((n, n), bool))[None].repeat(batch, 0)
    mask[-1, :, n - 2 :] = False
    mask[-1, np.arange(n), np.arange(n)] = True  # every query still sees itself
    return mask


# --------------------------------------------------------------- at init


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_exact_at_init(arch, dtype):
    model = backbone(arch, dtype)
    x = inputs(arch)  # the last row is right-padded
    before = output(model, x)
    n_weights = len(model.weights)
    host_paths = {v.path for v in model.weights}
    assert dk.convert(model) is model
    after = output(model, x)
    np.testing.assert_array_equal(after, before)  # residual form y + 0 * (Delta y): bit for bit
    layers = dk.converted_layers(model)
    assert len(layers) == attention_layers(arch)
    if arch in COUPLINGS:
        assert [layer.damcha.config.coupling for layer in layers.values()] == COUPLINGS[arch]
    # Only DAMCHA variables were added, each under its attention layer's path,
    # and none repeats a path (the old variables are the host's, untouched; SmolLM3's
    # host repeats two paths of its own: sublayers made outside its layers' name scopes).
    added = [v for v in model.weights if "/damcha/" in v.path]
    assert len(model.weights) == n_weights + len(added) and added
    assert len({v.path for v in model.weights}) == len(host_paths) + len(added)
    for path, layer in layers.items():
        assert all(v.path.startswith(f"{path}/damcha/") for v in layer.damcha.weights)
    assert all(float(np.abs(numpy(g)).max()) == 0.0 for g in dk.damcha_variables(model, generators=False))


def test_exact_at_init_mixed_precision():
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = causal_lm("llama")
    finally:
        keras.config.set_dtype_policy(policy)
    x = inputs("llama")
    before = numpy(model(x))
    dk.convert(model)
    np.testing.assert_array_equal(numpy(model(x)), before)
    maps = next(iter(dk.converted_layers(model).values())).damcha
    assert maps.dtype_policy.name == "mixed_float16" and maps.metric_gates["q"].dtype == "float32"


# --------------------------------------------------- against the reference


# "lowrank" on one architecture of each kind of layout (the maps' code is the same for
# every host; make test's time budget): MHA and Keras MHA (gpt2, bert), GQA with RoPE
# (llama), per-head norms (qwen3, gemma3), images (vit), ALiBi (bloom), Dense
# projections (esm), a host attention of its own (gpt_oss), queries interleaved with gates (qwen3_5).
LOWRANK = ("gpt2", "bert", "llama", "qwen3", "gemma3", "vit", "bloom", "esm", "gpt_oss", "qwen3_5")


@pytest.mark.parametrize(
    ("arch", "metric"),
    [(a, "heads") for a in ARCHS] + [(a, "lowrank") for a in ARCHS if a in LOWRANK],
    ids=lambda v: v,
)
def test_layers_equal_reference(arch, metric):
    """float64, gates open: the mapped q/k of every converted layer equal the
    reference's maps to 1e-12, and the whole layer equals the reference's
    damcha_attention (with rotary= for RoPE layers; Qwen3 and Gemma 3: the
    host's per-head norms applied between the maps and RoPE, spec section 10)."""
    model = backbone(arch, "float64")
    dk.convert(model, metric=metric, metric_rank=3 if metric == "lowrank" else None)
    closed = output(model, inputs(arch))
    open_gates(model)
    rng = np.random.default_rng(3)
    for layer in dk.converted_layers(model).values():
        params, config = layer_params(arch, layer)
        n = 6 if arch == "dinov3" else 5  # DINOv3: class, register and 4 patch tokens
        x = rng.normal(size=(2, n, config.query_dim))
        check_maps(arch, layer, params, config, x, opened=1e-2)
        if arch in HOSTED:
            continue  # the whole model against its host with the reference's maps, below
        mask = np.ones((2, n, n), bool) if arch in ("esm", "dinov3") else causal_mask(2, n)
        got = call_layer(arch, layer, x, mask)
        if arch in NORMED:
            expected = normed_reference(arch, layer, params, config, x, mask)
        elif arch in POSITIONAL:
            expected = positional_reference(arch, layer, params, config, x, mask)
        else:
            expected = dc.damcha_attention(
                params, config, x, mask=mask[:, None], rotary=rotary(arch, layer, config.key_dim)
            )
        # KerasHub computes RoPE's angles (and Llama-style softmaxes) in float32
        # even in a float64 model: those layers agree to float32 rounding.
        tol = 1e-6 if arch in ROTARY or arch in ("bloom", "falcon") else 1e-12
        np.testing.assert_allclose(got, expected, rtol=0, atol=tol * max(1.0, np.abs(expected).max()))
    if arch in HOSTED:
        # GPT-OSS, Gemma 4: attention of their own (sinks and YaRN RoPE; q/k and value norms,
        # scale 1). The converted model equals its host with each query/key projection followed
        # by the reference's map (the definition), and the maps move its output.
        x = inputs(arch)
        got = output(model, x)
        with reference_maps(arch, model):
            expected = output(model, x)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12 * max(1.0, np.abs(expected).max()))
        assert np.abs(got - closed).max() > 1e-6


def all_outputs(model, x):
    """Every output of ``model(x)`` (an encoder-decoder's several), as NumPy arrays."""
    return [numpy(y) for y in keras.tree.flatten(model(x))]


def convert_exactly(model, x):
    """convert() ``model``, asserting each of its outputs on ``x`` bit for bit
    unchanged; (the outputs before, the converted layers)."""
    before = all_outputs(model, x)
    dk.convert(model)
    for got, want in zip(all_outputs(model, x), before, strict=True):
        np.testing.assert_array_equal(got, want)
    return before, dk.converted_layers(model)


def check_maps(arch, layer, params, config, x, opened, atol=1e-12):
    """The query and key projection sublayers of a converted layer (gates
    open) on tokens x equal the reference's maps of their heads to ``atol``
    (1e-12: float64 models), and each map moves its heads by more than ``opened``."""
    for role, attr, name in (("q", SUBLAYERS[arch][0], "query"), ("k", SUBLAYERS[arch][1], "key")):
        y0 = np.einsum("bte,ehd->bthd", x, params[f"{name}.kernel"]) + params[f"{name}.bias"]
        expected = reference_map(params, config, dc.side_of(config, role), x, y0)
        assert np.abs(expected - y0).max() > opened  # the maps are open
        got = numpy(getattr(layer, attr)(x))  # Dense projections: flat features, split head by head
        if role == "q" and arch in GATED:  # each head's query, then its output gate, untouched
            dense = getattr(layer, attr)
            plain = numpy(type(dense).call(dense, x))
            np.testing.assert_array_equal(got[..., config.key_dim :], plain[..., config.key_dim :])
            got = got[..., : config.key_dim]
        np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=0, atol=atol)


def normed_reference(arch, layer, params, config, x, mask):
    """Qwen3 (and Qwen3-MoE) or Gemma 3 attention from the reference's maps, the host's
    per-head RMS norms (its own sublayers, its weights and eps), the
    reference's rotary and a NumPy softmax attention (Gemma 3: its query
    scale, 1/sqrt(head_dim) or 1/sqrt(hidden_dim / heads))."""
    q0 = np.einsum("bte,ehd->bthd", x, params["query.kernel"])
    k0 = np.einsum("bte,ehd->bthd", x, params["key.kernel"])
    v = np.einsum("bte,ehd->bthd", x, params["value.kernel"])
    if arch in ("qwen3", "qwen3_moe"):
        norms, scale = (layer._query_dense_layer_norm, layer._key_dense_layer_norm), 1 / np.sqrt(config.key_dim)
    else:
        norms = (layer.query_norm, layer.key_norm)
        per_head = config.key_dim if layer.query_head_dim_normalize else layer.hidden_dim // layer.num_query_heads
        scale = 1 / np.sqrt(per_head)
        assert layer.logit_soft_cap is None and not layer.use_sliding_window_attention
    q = numpy(norms[0](reference_map(params, config, "q", x, q0))).astype(np.float64)
    k = numpy(norms[1](reference_map(params, config, "k", x, k0))).astype(np.float64)
    rot = rotary(arch, layer, config.key_dim)
    pos = np.arange(x.shape[1], dtype=np.float64)[None]
    q, k = apply_rotary(q, rot, pos), apply_rotary(k, rot, pos)
    group = config.num_heads // config.num_kv_heads
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("bnhd,bmhd->bhnm", q, k) * scale
    logits = np.where(mask[:, None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("bhnm,bmhd->bnhd", probs, v)
    return np.einsum("bnhd,hde->bne", o, params["output.kernel"])


@pytest.mark.parametrize("metric", ["heads", "lowrank"])
def test_rope_shift_invariance(metric):
    """Maps before RoPE keep its relative-position property for both metrics:
    the same tokens placed 37 positions later (behind 37 hidden cache slots)
    give the same outputs (a map after RoPE would change them by O(gate))."""
    model = backbone("llama")
    dk.convert(model, metric=metric, metric_rank=3 if metric == "lowrank" else None)
    open_gates(model, gate=1.0, scale=1.0)
    layer = next(iter(dk.converted_layers(model).values()))
    cfg = layer.damcha.config
    n, shift = 5, 37
    x = np.random.default_rng(4).normal(size=(1, n, cfg.query_dim)).astype("float32")
    plain = numpy(layer(x, attention_mask=np.tril(np.ones((1, n, n), bool))))
    cache = np.zeros((1, 2, shift + n, cfg.num_kv_heads, cfg.key_dim), "float32")
    mask = np.zeros((1, n, shift + n), bool)
    mask[0, :, shift:] = np.tril(np.ones((n, n), bool))
    shifted, _ = layer(x, attention_mask=mask, cache=cache, cache_update_index=shift)
    np.testing.assert_allclose(numpy(shifted), plain, rtol=0, atol=2e-5)


# ---------------------------------------------------- generation and cache


# CachedMHA, RoPE + GQA, per-head norms, (H, E, d) kernels, public sublayer names. (Gemma 3's generate() fails without a
# preprocessor in KerasHub 0.32, converted or not; its cache is tested by call_with_cache above.)
# ALiBi from Falcon's decoder block, SmolLM3's Dense projections and NoPE layer. (Bloom and
# Gemma 4 repeat one token from this prompt, a weak check, and GPT-OSS's generate() takes
# ~9 s: the caches of the three are tested by call_with_cache.)
GENERATE = ("gpt2", "opt", "llama", "qwen3", "gemma", "mixtral", "phi3", "falcon", "smollm3")


@pytest.mark.parametrize("arch", CAUSAL)
def test_call_with_cache_equals_full_forward(arch):
    lm = causal_lm(arch)
    dk.convert(lm)
    open_gates(lm)
    ids = inputs(arch, batch=2, length=6, padded=False)["token_ids"]
    full = numpy(lm(lm_inputs(lm, ids, np.ones_like(ids, bool))))
    np.testing.assert_allclose(cached_logits(lm, ids), full, rtol=0, atol=1e-5 * max(1.0, np.abs(full).max()))


@pytest.mark.parametrize("arch", GENERATE)
def test_generate_equals_greedy_without_cache(arch):
    lm = causal_lm(arch)
    dk.convert(lm)
    open_gates(lm)
    prompt = [5, 7, 9]
    assert greedy_generate(lm, prompt, 9) == greedy_without_cache(lm, prompt, 9)


def test_convert_after_generate_and_predict_retraces_them():
    """On TensorFlow generate() and predict() keep the tf.functions they traced:
    converted after them, the model went on generating and predicting without
    its maps (a user's report, reproduced). Now both follow the converted model."""
    lm = causal_lm("falcon")  # a zoo LM whose greedy tokens the open maps change
    x = lm_inputs(lm, np.array([[5, 7, 9, 0, 0, 0, 0, 0, 0]]), np.array([[True] * 3 + [False] * 6]))
    prompt = [5, 7, 9]
    before, predicted = greedy_generate(lm, prompt, 9), numpy(lm.predict(x, verbose=0))
    dk.convert(lm)
    open_gates(lm, scale=2.0)
    called = numpy(lm(x))
    assert np.abs(called - predicted).max() > 1e-2  # the maps move the logits
    np.testing.assert_allclose(numpy(lm.predict(x, verbose=0)), called, rtol=0, atol=1e-5)
    after = greedy_generate(lm, prompt, 9)
    assert after == greedy_without_cache(lm, prompt, 9) and after != before


# ---------------------------------------------------------------- training


def test_fit_moves_gates_llama_with_penalty():
    lm = causal_lm("llama")
    dk.convert(lm)
    dk.track_metric_penalty(lm, 50.0)
    x = inputs("llama", padded=False)
    y = np.roll(x["token_ids"], -1, axis=1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # Eager steps: tracing this train step takes ~25 s on TensorFlow; the BERT
    # test below trains in graph mode.
    lm.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss, sampler="greedy", run_eagerly=True)
    gates = dk.damcha_variables(lm, generators=False)
    before = [numpy(g).copy() for g in gates]
    lm.fit(x, y, epochs=2, verbose=0)
    assert all(np.abs(numpy(g) - b).max() > 0 for g, b in zip(gates, before))
    # The trainer's loss is the task loss plus 50 * the metric penalty of this forward.
    y_pred = lm(x)
    penalty = float(numpy(dk.metric_penalty(lm)))
    total = float(numpy(lm.compute_loss(x=x, y=y, y_pred=y_pred)))
    assert penalty > 0
    np.testing.assert_allclose(total - float(numpy(loss(y, y_pred))), 50.0 * penalty, rtol=1e-2)


def test_a_saved_model_keeps_its_metric_penalty(tmp_path):
    """track_metric_penalty was not saved: a reloaded model tracked no penalty
    (resumed training dropped the regulariser) and mapped in the other form
    (outputs 1e-8 apart). Turned off (weight 0), the file records none."""
    model = backbone("llama")
    dk.convert(model)
    dk.track_metric_penalty(model, 2.0)
    open_gates(model)
    x = inputs("llama", padded=False)
    out, penalty, losses = numpy(model(x)), float(numpy(dk.metric_penalty(model))), len(model.losses)
    model.save(tmp_path / "m.keras")
    again = keras.saving.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(numpy(again(x)), out)
    assert len(again.losses) == losses > 0
    assert float(numpy(dk.metric_penalty(again))) == penalty > 0
    dk.track_metric_penalty(again, 0.0)
    again.save(tmp_path / "off.keras")
    off = keras.saving.load_model(tmp_path / "off.keras")
    off(x)
    assert not off.losses


def test_fit_moves_gates_bert_classifier():
    bert = backbone("bert")
    dk.convert(bert)
    x = inputs("bert")
    pooled = bert(bert.input)["pooled_output"]
    model = keras.Model(bert.input, keras.layers.Dense(2)(pooled))
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    gates = dk.damcha_variables(model, generators=False)
    assert len(gates) == 2  # tied: one gate variable per layer
    model.fit(x, np.array([0, 1]), epochs=2, verbose=0)
    assert all(np.abs(numpy(g)).max() > 0 for g in gates)


def test_metric_penalty_equals_reference():
    model = backbone("gpt2", "float64")
    dk.convert(model)
    open_gates(model)
    dk.track_metric_penalty(model)
    x = inputs("gpt2")
    model(x)
    # The tokens each layer's projections saw: capture them with the reference.
    tokens = {}
    for path, layer in dk.converted_layers(model).items():
        site = layer._query_dense.call

        def spy(t, *a, _site=site, _path=path, **k):
            tokens[_path] = numpy(t)
            return _site(t, *a, **k)

        layer._query_dense.call = spy
    model(x)
    got = float(numpy(dk.metric_penalty(model)))
    expected = np.mean(
        [
            dc.metric_penalty(*layer_params("gpt2", layer), tokens[path])
            for path, layer in dk.converted_layers(model).items()
        ]
    )
    np.testing.assert_allclose(got, expected, rtol=1e-6)  # the port takes penalties in float32
    assert expected > 1e-4


# ---------------------------------------------------------------- saving


def test_weights_file_round_trip(tmp_path):
    model = backbone("llama")
    dk.convert(model, metric="lowrank", metric_rank=2)
    open_gates(model)
    model.save_weights(tmp_path / "m.weights.h5")
    fresh = dk.convert(backbone("llama"), metric="lowrank", metric_rank=2)
    x = inputs("llama")
    assert not np.array_equal(output(fresh, x), output(model, x))
    fresh.load_weights(tmp_path / "m.weights.h5")
    np.testing.assert_array_equal(output(fresh, x), output(model, x))
    # A plain (unconverted) weights file does not fit a converted model: Keras
    # names the DAMCHA sublayers it found no weights for.
    backbone("llama").save_weights(tmp_path / "plain.weights.h5")
    with pytest.raises(ValueError, match="damcha"):
        dk.convert(backbone("llama")).load_weights(tmp_path / "plain.weights.h5")


@pytest.mark.parametrize("what", ["gpt2-causal-lm", "bert-backbone-shared", "llama-causal-lm-query", "vit-backbone"])
def test_keras_file_round_trip(what, tmp_path):
    arch, kind = what.split("-")[0], what.split("-", 1)[1]
    options = {"shared": {"share_metric": True}, "query": {"coupling": "query"}}.get(kind.rsplit("-", 1)[-1], {})
    model = backbone(arch) if "backbone" in kind else causal_lm(arch)
    host = type(model)
    dk.convert(model, **options)
    open_gates(model)
    x = inputs(arch)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert isinstance(loaded, host) and type(loaded).__name__ == host.__name__
    assert list(dk.converted_layers(loaded)) == list(dk.converted_layers(model))
    np.testing.assert_array_equal(output(loaded, x), output(model, x))
    assert len(loaded.weights) == len(model.weights)
    if options.get("share_metric"):
        gens = {id(layer.damcha.metric_generators["qk"]) for layer in dk.converted_layers(loaded).values()}
        assert len(gens) == 1
    with pytest.raises(dc.DamchaValueError, match="already converted"):
        dk.convert(loaded)


@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
def test_keras_file_of_a_converted_then_quantized_model(mode, tmp_path):
    """convert, then model.quantize (the documented order), then save: the load refused the
    quantized projections ("convert the float model, then quantize it", which the user did).
    Keras rebuilds a quantized layer quantized from the config and loads its integer weights;
    the loaded model is converted over those projections and equals the quantized model.
    Quantizing before convert stays refused, and converts nothing."""
    model = dk.convert(backbone("llama"))
    open_gates(model)
    x = inputs("llama")
    float_output = output(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Keras: "MetricGenerator does not have a `quantize` method"
        model.quantize(mode)
    quantized = output(model, x)
    assert not np.array_equal(quantized, float_output)
    model.save(tmp_path / "q.keras")
    loaded = keras.saving.load_model(tmp_path / "q.keras")
    layers = dk.converted_layers(loaded)
    assert list(layers) == list(dk.converted_layers(model))
    assert {layer._query_dense.quantization_mode for layer in layers.values()} == {mode}
    np.testing.assert_array_equal(output(loaded, x), quantized)
    # The loaded maps act (their weights were loaded): closing the gates changes the output.
    for layer in layers.values():
        for gate in layer.damcha.metric_gates.values():
            gate.assign(np.zeros(gate.shape, gate.dtype))
    assert not np.array_equal(output(loaded, x), quantized)

    plain = backbone("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        plain.quantize(mode)
    with pytest.raises(
        dc.DamchaValueError,
        match=rf"Cannot convert layer `transformer_layer_0/self_attention` \(keras-hub-llama\): `_query_dense` is "
        rf"quantized \({mode}\); convert the float model, then quantize it",
    ):
        dk.convert(plain)
    assert not dk.converted_layers(plain) and not any(isinstance(a, dk.DamchaMaps) for a in plain._flatten_layers())


@pytest.mark.parametrize("what", ["llama-causal-lm", "llama-backbone"])
def test_save_to_preset_of_a_converted_model_is_refused(what, tmp_path):
    """KerasHub's from_preset loaded a converted task's preset as the plain task (the DAMCHA
    weights dropped without a word) and refused a converted backbone's: save_to_preset is
    refused up front and writes nothing; an unconverted model's preset is unchanged."""
    model = backbone("llama") if "backbone" in what else causal_lm("llama")
    plain = tmp_path / "plain"
    model.save_to_preset(str(plain))  # before conversion: KerasHub's own
    assert (plain / "config.json").exists()
    dk.convert(model)
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `model`: expected a model KerasHub's from_preset"):
        model.save_to_preset(str(tmp_path / "converted"))
    assert not (tmp_path / "converted").exists()
    if "causal" in what:
        # The task's backbone, which holds the converted layers: its preset loaded back as a plain
        # backbone, without a word.
        with pytest.raises(dc.DamchaValueError, match=r"holds converted layers of a converted LlamaCausalLM"):
            model.backbone.save_to_preset(str(tmp_path / "inner"))
        assert not (tmp_path / "inner").exists()


def test_from_mha_refuses_lora_projections():
    """With LoRA on, a projection's kernel is a merged tensor: from_mha failed with a raw
    AttributeError ('EagerTensor' object has no attribute 'value')."""
    mha = keras.layers.MultiHeadAttention(2, 4)
    q = np.ones((1, 3, 8), "float32")
    mha(q, q)
    mha._query_dense.enable_lora(2)
    with pytest.raises(dc.DamchaValueError, match=r"without LoRA on its projections .*LoRA enabled on its query"):
        dk.DamchaAttention.from_mha(mha)


def test_convert_checks_every_layer_for_a_damcha_attribute_before_converting_any():
    """A layer already holding a `damcha` attribute was refused after the layers before it had
    been converted: the model was left half converted, and a retry said 'already converted'."""

    class Flagged(keras.layers.MultiHeadAttention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.damcha = "mine"

    inp = keras.Input((3, 8))
    h = keras.layers.MultiHeadAttention(2, 4, name="a_first")(inp, inp)
    out = Flagged(2, 4, name="z_second")(h, h)
    model = keras.Model(inp, out)
    with pytest.raises(
        dc.DamchaValueError, match=r"Cannot convert layer `z_second`.*already has an attribute `damcha`"
    ):
        dk.convert(model)
    assert not dk.converted_layers(model) and not dk.damcha_variables(model)


def test_keras_file_of_a_converted_subclassed_model(tmp_path):
    """A subclassed model is built by Keras after from_config: the converted model's .keras file
    did not load ("expected a built model"); the conversion now waits for that build."""

    @keras.saving.register_keras_serializable(package="damcha_tests")
    class Sub(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.mha = keras.layers.MultiHeadAttention(2, 4)
            self.dense = keras.layers.Dense(8)

        def call(self, x):
            return self.dense(self.mha(x, x))

    x = np.random.default_rng(0).normal(size=(2, 3, 8)).astype("float32")
    model = Sub()
    model(x)
    dk.convert(model, coupling="query")
    open_gates(model)
    model.save(tmp_path / "s.keras")
    loaded = keras.saving.load_model(tmp_path / "s.keras")
    assert isinstance(loaded, Sub) and len(dk.converted_layers(loaded)) == 1
    np.testing.assert_array_equal(numpy(loaded(x)), numpy(model(x)))
    assert dk._models.recorded_options(loaded) == dk._models.recorded_options(model)
    assert dk._models.recorded_options(loaded)["coupling"] == "query"


def test_keras_file_of_functional_mha_model(tmp_path):
    """A plain Keras functional model with MultiHeadAttention (self and cross)."""
    q_in, c_in = keras.Input((5, 8)), keras.Input((7, 6))
    h = keras.layers.MultiHeadAttention(2, 4, name="self_attention")(q_in, q_in, use_causal_mask=True)
    out = keras.layers.MultiHeadAttention(2, 4, name="cross_attention")(h, c_in)
    model = keras.Model([q_in, c_in], out)
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(2, 5, 8)).astype("float32"), rng.normal(size=(2, 7, 6)).astype("float32")]
    before = numpy(model(x))
    dk.convert(model)
    np.testing.assert_array_equal(numpy(model(x)), before)
    couplings = {p: layer.damcha.config.coupling for p, layer in dk.converted_layers(model).items()}
    assert couplings == {"self_attention": "tied", "cross_attention": "separate"}
    open_gates(model)
    model.save(tmp_path / "f.keras")
    loaded = keras.saving.load_model(tmp_path / "f.keras")
    np.testing.assert_array_equal(numpy(loaded(x)), numpy(model(x)))
    # clone_model rebuilds the host layer by layer (fresh weights) and drops the
    # maps; the clone converts again.
    clone = keras.models.clone_model(model)
    assert not dk.converted_layers(clone)
    plain = numpy(clone(x))
    np.testing.assert_array_equal(numpy(dk.convert(clone)(x)), plain)
    assert len(dk.converted_layers(clone)) == 2


def test_keras_file_keeps_a_converted_backbone_of_a_task(tmp_path):
    """Converting the backbone of a task and saving the task keeps the
    conversion (the task's config serialises its backbone); converting one
    transformer layer of a KerasHub backbone warns, because the backbone's
    config rebuilds that layer from constructor arguments (docs/models.md)."""
    lm = causal_lm("gpt2")
    dk.convert(lm.backbone)
    open_gates(lm)
    x = inputs("gpt2")
    lm.save(tmp_path / "lm.keras")
    loaded = keras.saving.load_model(tmp_path / "lm.keras")
    assert len(dk.converted_layers(loaded)) == 2
    np.testing.assert_array_equal(numpy(loaded(x)), numpy(lm(x)))
    model = backbone("gpt2")
    with pytest.warns(UserWarning, match="not a keras.Model"):
        dk.convert(model.get_layer("transformer_layer_0"))
    assert len(dk.converted_layers(model)) == 1


def test_keras_file_without_damcha_keras_fails_loudly(tmp_path):
    """A process that has not imported damcha_keras lacks the registered loader
    ("damcha>ConvertedModel"): loading raises instead of returning a plain model."""
    model = dk.convert(backbone("gpt2"))
    model.save(tmp_path / "m.keras")
    registry = keras.saving.get_custom_objects()
    loader = registry.pop("damcha>ConvertedModel")
    try:
        with pytest.raises(TypeError, match="damcha>ConvertedModel"):
            keras.saving.load_model(tmp_path / "m.keras")
    finally:
        registry["damcha>ConvertedModel"] = loader
    assert dk.converted_layers(keras.saving.load_model(tmp_path / "m.keras"))


# ---------------------------------------------------------------- options


def test_couplings_and_sharing():
    gpt2 = dk.convert(backbone("gpt2"))
    assert {layer.damcha.config.coupling for layer in dk.converted_layers(gpt2).values()} == {"tied"}
    llama = dk.convert(backbone("llama"), share_metric=True)
    layers = list(dk.converted_layers(llama).values())
    assert {layer.damcha.config.coupling for layer in layers} == {"separate"}  # GQA
    for side in ("q", "k"):
        assert layers[0].damcha.metric_generators[side] is layers[1].damcha.metric_generators[side]
    assert layers[0].damcha.metric_gates["q"] is not layers[1].damcha.metric_gates["q"]
    # gates of 2 layers x 2 sides, one generator (kernel, bias) per side
    assert len(dk.damcha_variables(llama)) == 4 + 4
    with pytest.raises(dc.DamchaValueError, match=r"transformer_layer_0/self_attention.*tied"):
        dk.convert(backbone("llama"), coupling="tied")
    query = dk.convert(backbone("llama"), coupling="query")
    assert set(next(iter(dk.converted_layers(query).values())).damcha.metric_gates) == {"q"}


def test_sublayer_conversion_and_register_adapter():
    """A layout of one's own: a layer projecting q and k with Dense (flat
    features, fused q|k in one projection) is converted once registered."""

    class MyAttention(keras.layers.Layer):
        def __init__(self, heads=2, head_dim=4, **kw):
            super().__init__(**kw)
            self.heads, self.head_dim = heads, head_dim

        def build(self, shape):
            self.qk = keras.layers.Dense(2 * self.heads * self.head_dim, name="qk")
            self.qk.build(shape)
            self.built = True

        def call(self, x):
            qk = self.qk(x)
            B, T = keras.ops.shape(x)[0], keras.ops.shape(x)[1]
            q, k = keras.ops.split(keras.ops.reshape(qk, (B, T, 2 * self.heads, self.head_dim)), 2, axis=2)
            logits = keras.ops.einsum("bnhd,bmhd->bhnm", q, k)
            return keras.ops.einsum("bhnm,bmhd->bnhd", keras.ops.softmax(logits), q)

    # One definition serves both ports' converters (damcha_core._layout).
    assert dk.ProjectionSite is damcha_core._layout.ProjectionSite
    assert dk.AttentionLayout is damcha_core._layout.AttentionLayout
    assert dk.ModelAdapter is damcha_core._layout.ModelAdapter
    inp = keras.Input((5, 8))
    model = keras.Model(inp, MyAttention(name="mine")(inp))
    with pytest.raises(
        dc.DamchaValueError,
        match=r"knows \(one of the \d+ that damcha_keras\.supported_layouts\(\) lists;.*Received: model with layers of "
        r"unknown layouts: mine \(.*MyAttention\)",
    ):
        dk.convert(model)
    adapter = dk.register_adapter(
        dk.ModelAdapter(
            "test-my-attention",
            "MyAttention (fused qk Dense)",
            matches=lambda layer: isinstance(layer, MyAttention),
            layout=lambda layer: dk.AttentionLayout(2, 2, 4, 8, 8, (dk.ProjectionSite("qk", q=0, k=8),)),
        )
    )
    try:
        x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
        before = numpy(model(x))
        dk.convert(model)
        np.testing.assert_array_equal(numpy(model(x)), before)
        layer = model.get_layer("mine")
        open_gates(model)
        params = {**layer.damcha.to_canonical()}
        cfg = layer.damcha.config
        y = x @ numpy(layer.qk.kernel) + numpy(layer.qk.bias)
        heads = y.reshape(2, 5, 4, 4).astype(np.float64)
        full = {
            **params,
            **{
                f"{n}.{p}": np.zeros(s)
                for n in ("query", "key", "value", "output")
                for p, s in (("kernel", (1,)), ("bias", (1,)))
            },
        }
        expected_q = reference_map(full, cfg, "qk", x.astype(np.float64), heads[:, :, :2])
        expected_k = reference_map(full, cfg, "qk", x.astype(np.float64), heads[:, :, 2:])
        got = numpy(layer.qk(x)).reshape(2, 5, 4, 4)
        np.testing.assert_allclose(got, np.concatenate([expected_q, expected_k], axis=2), rtol=0, atol=1e-5)
    finally:
        dk._models._ADAPTERS.remove(adapter)
    assert any(line.startswith("keras-hub-llama") for line in dk.supported_layouts())
    # One whose sizes do not fit the Dense it names: converted, then failed in the first call.
    wrong = dk.register_adapter(
        dk.ModelAdapter(
            "test-wrong-features",
            "query_features 16 for an 8-feature qk",
            matches=lambda layer: isinstance(layer, MyAttention) and layer.name == "wrong",
            layout=lambda layer: dk.AttentionLayout(2, 2, 4, 16, 16, (dk.ProjectionSite("qk", q=0, k=8),)),
        )
    )
    try:
        wrong_model = keras.Model(inp, MyAttention(name="wrong")(inp))
        with pytest.raises(
            dc.DamchaValueError,
            match=r"Cannot convert layer `wrong` \(test-wrong-features\): Invalid argument `query_features`: expected "
            r"the input features of `qk`.*query_features=16 with `qk` taking 8 input features",
        ):
            dk.convert(wrong_model)
        assert not dk.converted_layers(wrong_model)
    finally:
        dk._models._ADAPTERS.remove(wrong)
    # An adapter whose layout() returns something else: a raw AttributeError ('int' has no 'sites').
    fresh = keras.Model(inp, MyAttention(name="other")(inp))
    bad = dk.register_adapter(
        dk.ModelAdapter(
            "test-bad-layout",
            "returns an int",
            matches=lambda layer: isinstance(layer, MyAttention),
            layout=lambda layer: 3,
        )
    )
    try:
        with pytest.raises(
            dc.DamchaTypeError,
            match=r"Invalid argument `layout`: expected an AttentionLayout\. Received: adapter 'test-bad-layout''s "
            r"layout\(\) returned 3",
        ):
            dk.convert(fresh)
    finally:
        dk._models._ADAPTERS.remove(bad)


class _NamedProjections(keras.layers.Layer):
    """A user's attention under a class name without "Attention", its projections
    (Dense sublayers) under ``names``."""

    def __init__(self, names, **kw):
        super().__init__(**kw)
        self.names = tuple(names)
        for name in self.names:
            setattr(self, name, keras.layers.Dense(8))

    def call(self, x):
        out = x
        for name in self.names:
            out = out + getattr(self, name)(x)
        return out


_PROJECTION_NAMES = [(n,) for n in dc._layout.FUSED_QK_NAMES] + list(dc._layout.QUERY_KEY_NAMES)


@pytest.mark.parametrize("names", _PROJECTION_NAMES, ids=["+".join(n) for n in _PROJECTION_NAMES])
def test_attention_under_another_name_is_refused_by_name(names):
    """A user's layer with query and key projections of its own, not named "...Attention"
    (as damcha_torch finds them, from one table in damcha_core._layout): it was left
    unconverted beside the converted MHA, without a word. A layer holding a query
    projection alone is not attention."""
    inp = keras.Input((5, 8))
    h = keras.layers.MultiHeadAttention(2, 4, name="mha")(inp, inp)
    model = keras.Model(inp, _NamedProjections(names, name="my_self_attn")(h))
    with pytest.raises(dc.DamchaValueError, match=r"Received: model with layers of unknown layouts: my_self_attn \("):
        dk.convert(model)
    assert not dk.converted_layers(model)
    if len(names) == 2:
        one = _NamedProjections(names[:1], name="query_only")
        fine = keras.Model(inp, one(keras.layers.MultiHeadAttention(2, 4, name="mha")(inp, inp)))
        dk.convert(fine)
        assert list(dk.converted_layers(fine)) == ["mha"]


def test_a_layout_whose_features_do_not_fit_its_einsum_dense_projections_is_refused():
    """The same input-size check for EinsumDense sites (KerasHub's kind): the
    kernel axis named by the input's last letter; a fitting layout converts."""

    class EinsumAttention(keras.layers.Layer):
        def build(self, shape):
            self.q = keras.layers.EinsumDense("btc,chd->bthd", output_shape=(None, 2, 4), name="q")
            self.k = keras.layers.EinsumDense("btc,chd->bthd", output_shape=(None, 2, 4), name="k")
            self.q.build(shape)
            self.k.build(shape)
            self.built = True

        def call(self, x):
            return keras.ops.einsum("bnhd,bmhd->bhnm", self.q(x), self.k(x))

    def layout(features):
        return lambda layer: dk.AttentionLayout(
            2, 2, 4, features, features, (dk.ProjectionSite("q", q=0), dk.ProjectionSite("k", k=0))
        )

    inp = keras.Input((5, 8))
    for features, refused in ((12, True), (8, False)):
        name = f"test-einsum-features-{features}"
        adapter = dk.register_adapter(
            dk.ModelAdapter(name, "EinsumAttention", lambda layer: isinstance(layer, EinsumAttention), layout(features))
        )
        try:
            model = keras.Model(inp, EinsumAttention(name="mine")(inp))
            if refused:
                with pytest.raises(
                    dc.DamchaValueError,
                    match=r"Invalid argument `query_features`: expected the input features of `q`.*"
                    r"query_features=12 with `q` taking 8 input features",
                ):
                    dk.convert(model)
                assert not dk.converted_layers(model)
            else:
                dk.convert(model)
                assert list(dk.converted_layers(model)) == ["mine"]
        finally:
            dk._models._ADAPTERS.remove(adapter)


class _WrappedAttention(keras.layers.Layer):
    """A user's attention layer that only wraps a MultiHeadAttention (and a dropout), as
    KerasHub's DINOV2Attention does; ``extra`` gives it a weight of its own."""

    def __init__(self, inner, extra=False, **kwargs):
        super().__init__(**kwargs)
        self.inner, self.extra = inner, extra
        self.dropout = keras.layers.Dropout(0.5, dtype=self.dtype_policy)

    def build(self, shape):
        if self.extra:
            self.scale = self.add_weight(name="scale", shape=(), initializer="ones")
        self.built = True

    def call(self, x, training=None):
        y = self.inner([x, x]) if isinstance(self.inner, keras.layers.Attention) else self.inner(x, x)
        y = self.dropout(y, training=training)
        return y * self.scale if self.extra else y


def test_a_layer_wrapping_a_supported_attention_is_converted_through_it(tmp_path):
    """An attention-named layer that only holds a supported attention layer (a user's
    wrapper; KerasHub's DINOV2Attention) made convert() refuse the whole model as an
    unknown layout. The inner layer is converted and the wrapper keeps calling it: exact
    at identity gates, the reference with the gates open. A wrapper with weights of its
    own, or around a layer no adapter supports, is still refused, naming the layer."""
    inp = keras.Input((5, 8), dtype="float64")
    mha = keras.layers.MultiHeadAttention(2, 4, name="inner", dtype="float64")
    model = keras.Model(inp, _WrappedAttention(mha, name="wrapped", dtype="float64")(inp))
    x = np.random.default_rng(0).normal(size=(2, 5, 8))
    before = numpy(model(x))
    dk.convert(model)
    np.testing.assert_array_equal(numpy(model(x)), before)
    assert list(dk.converted_layers(model)) == ["wrapped/inner"]
    open_gates(model)
    inner = model.get_layer("wrapped").inner
    params, config = layer_params("vit", inner)  # the zoo reads any MHA's canonical parameters
    got = numpy(model(x))
    assert np.abs(got - before).max() > 1e-2  # the maps act through the wrapper
    np.testing.assert_array_equal(got, numpy(inner(x, x)))
    # Keras's unmasked "float64" MHA agrees with the reference to about 1e-7 on torch and on JAX
    # (float32 there without x64), converted or not (test_layers_equal_reference's ViT too).
    tol = 1e-12 if keras.backend.backend() == "tensorflow" else 1e-6
    np.testing.assert_allclose(got, dc.damcha_attention(params, config, x), rtol=0, atol=tol)

    # KerasHub's DINOv2 (test_exact_at_init and test_layers_equal_reference run it too).
    dino = backbone("dinov2")
    images = inputs("dinov2")
    plain = output(dino, images)
    dk.convert(dino)
    np.testing.assert_array_equal(output(dino, images), plain)
    assert sorted(dk.converted_layers(dino)) == [f"encoder/layers_{i}/attention/attention" for i in range(2)]
    open_gates(dino)
    assert np.abs(output(dino, images) - plain).max() > 1e-3
    dino.save(tmp_path / "dino.keras")
    loaded = keras.saving.load_model(tmp_path / "dino.keras")
    # (KerasHub's DINOv2 loads under other layer paths, "dinov2_backbone_encoder/...", converted or not.)
    assert sorted(p.rpartition("encoder/")[2] for p in dk.converted_layers(loaded)) == [
        f"layers_{i}/attention/attention" for i in range(2)
    ]
    np.testing.assert_array_equal(output(loaded, images), output(dino, images))

    own = keras.Model(
        inp, _WrappedAttention(keras.layers.MultiHeadAttention(2, 4, name="inner"), True, name="scaled")(inp)
    )
    with pytest.raises(
        dc.DamchaValueError,
        match=r"or layers that only wrap such a layer .*Received: model with layers of unknown layouts: scaled "
        r"\(.*_WrappedAttention, which wraps the supported scaled/inner but also holds weights that are not that layer's: "
        r"scaled/scale\)$",
    ):
        dk.convert(own)
    assert not dk.converted_layers(own)
    # Around an MHA over attention_axes (matched, unsupported): refused naming the inner layer.
    x4 = keras.Input((3, 5, 8))
    axes = keras.Model(x4, _WrappedAttention(keras.layers.MultiHeadAttention(2, 4, attention_axes=(2,)), name="w")(x4))
    with pytest.raises(dc.DamchaValueError, match=r"Cannot convert layer `w/multi_head_attention.*` \(keras-mha\)"):
        dk.convert(axes)
    # Around an attention layer no adapter knows: both are unknown.
    dot = keras.Model(inp, _WrappedAttention(keras.layers.Attention(name="dot"), name="w_dot")(inp))
    with pytest.raises(
        dc.DamchaValueError, match=r"unknown layouts: w_dot \(.*_WrappedAttention\), w_dot/dot \(.*Attention\)"
    ):
        dk.convert(dot)


class _NormedAttention(keras.layers.Layer):
    """A post-norm block around an MHA (BLIP-2's QFormerAttention's shape): the residual's
    LayerNorm, or, with ``dense``, a projection of its own besides."""

    def __init__(self, inner, dense=False, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner
        self.norm = keras.layers.LayerNormalization(dtype=self.dtype_policy)
        self.dense = keras.layers.Dense(8, dtype=self.dtype_policy) if dense else None

    def call(self, x):
        y = self.norm(x + self.inner(x, x))
        return self.dense(y) if self.dense is not None else y


def test_a_wrapper_whose_own_weights_are_norms_converts_through_its_attention():
    """A LayerNorm projects nothing: BLIP-2's QFormerAttention (an MHA, a dropout and the
    residual's LayerNorm) was refused as a wrapper holding weights of its own, and so was
    the whole BLIP-2 model. A projection of its own is still refused."""
    from keras_hub.src.models.blip2.blip2_qformer import BLIP2QFormer

    qformer = BLIP2QFormer(
        num_query_tokens=4,
        num_layers=2,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        vision_dim=8,  # as the Q-Former's: the sizes alone would let its cross-attention be tied
        cross_attention_frequency=2,
        dropout=0.0,
        layer_norm_epsilon=1e-6,
        dtype="float64",
    )
    rng = np.random.default_rng(0)
    [tokens] = qformer.get_layer("query_tokens_layer").weights  # zeros at init: every query alike
    tokens.assign(rng.normal(size=tokens.shape))
    vision = rng.normal(size=(2, 5, 8))
    before = numpy(qformer(vision))
    dk.convert(qformer)
    couplings = {path: layer.damcha.config.coupling for path, layer in dk.converted_layers(qformer).items()}
    # 2 self, 1 cross: the MHA named "attention" inside "cross_attention" gets separate maps (was tied).
    assert couplings == {
        "transformer_layer_0/self_attention/attention": "tied",
        "transformer_layer_0/cross_attention/attention": "separate",
        "transformer_layer_1/self_attention/attention": "tied",
    }, couplings
    np.testing.assert_array_equal(numpy(qformer(vision)), before)
    open_gates(qformer)
    assert np.abs(numpy(qformer(vision)) - before).max() > 1e-3

    inp = keras.Input((5, 8), dtype="float64")
    x = np.random.default_rng(1).normal(size=(2, 5, 8))
    block = _NormedAttention(keras.layers.MultiHeadAttention(2, 4, dtype="float64"), name="block", dtype="float64")
    model = keras.Model(inp, block(inp))
    plain = numpy(model(x))
    dk.convert(model)
    np.testing.assert_array_equal(numpy(model(x)), plain)
    open_gates(model)
    got = numpy(model(x))
    np.testing.assert_array_equal(got, numpy(block.norm(x + block.inner(x, x))))  # the maps act through it
    assert np.abs(got - plain).max() > 1e-3
    projected = keras.Model(inp, _NormedAttention(keras.layers.MultiHeadAttention(2, 4), dense=True, name="p")(inp))
    with pytest.raises(
        dc.DamchaValueError,
        match=r"which wraps the supported p/multi_head_attention.* but also holds weights that are not that layer's: p/dense\w*/kernel, p/dense\w*/bias\)$",
    ):
        dk.convert(projected)


# ----------------------------------------------------------------- errors


def test_errors():
    with pytest.raises(dc.DamchaTypeError, match="Invalid argument `model`: expected a Keras layer"):
        dk.convert(object())
    with pytest.raises(dc.DamchaValueError, match="`metric`"):
        dk.convert(backbone("gpt2"), metric="none")
    with pytest.raises(dc.DamchaValueError, match="`coupling`"):
        dk.convert(backbone("gpt2"), coupling="both")
    with pytest.raises(dc.DamchaTypeError, match="`share_metric`"):
        dk.convert(backbone("gpt2"), share_metric=1)
    with pytest.raises(dc.DamchaValueError, match="expected a built model"):
        dk.convert(keras.layers.MultiHeadAttention(2, 4))
    model = dk.convert(backbone("gpt2"))
    n = len(model.weights)
    with pytest.raises(dc.DamchaValueError, match="already converted"):
        dk.convert(model)
    with pytest.raises(dc.DamchaValueError, match="already converted"):
        dk.convert(model.get_layer("transformer_layer_0"))
    assert len(model.weights) == n
    with pytest.raises(dc.DamchaValueError, match="no attention layer"):
        dk.convert(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    inp = keras.Input((5, 8))
    damcha_only = keras.Model(inp, dk.DamchaAttention(2, 4)(inp, inp))
    with pytest.raises(dc.DamchaValueError, match="already converted \\(DamchaAttention at"):
        dk.convert(damcha_only)
    # An MHA on rank-4 inputs (attention_axes) is refused with its equation, and nothing is converted.
    x4 = keras.Input((3, 5, 8))
    mixed = keras.Model(
        [inp, x4],
        [
            keras.layers.MultiHeadAttention(2, 4)(inp, inp),
            keras.layers.MultiHeadAttention(2, 4, attention_axes=(2,))(x4, x4),
        ],
    )
    with pytest.raises(dc.DamchaValueError, match=r"Cannot convert layer .*keras-mha.*rank 3"):
        dk.convert(mixed)
    assert not dk.converted_layers(mixed)
    with pytest.raises(dc.DamchaValueError, match="track_metric_penalty"):
        dk.metric_penalty(model)
    with pytest.raises(dc.DamchaValueError, match="exactly the metric weights"):
        next(iter(dk.converted_layers(model).values())).damcha.load_canonical({})
    q2 = keras.Input((5, 6))
    two_sizes = keras.Model(
        [inp, q2], [keras.layers.MultiHeadAttention(2, 4)(inp, inp), keras.layers.MultiHeadAttention(2, 4)(q2, q2)]
    )
    with pytest.raises(dc.DamchaValueError, match="share_metric"):
        dk.convert(two_sizes, share_metric=True)


def test_converted_layers_keeps_layers_whose_paths_repeat_in_nested_models():
    """Keras paths restart in each nested functional model (CLIP's text and vision
    encoders both hold `encoder_block_0/attention`): every converted layer is listed
    (a repeated path qualified by its models' names), so damcha_variables and
    open gates reach all of them; before, one encoder's layers were dropped."""

    def encoder(name):
        inp = keras.Input((None, 8))
        block = keras.layers.MultiHeadAttention(2, 4, name="attention")
        return keras.Model(inp, block(inp, inp), name=name)

    inp = keras.Input((None, 8))
    model = keras.Model(inp, [encoder("text")(inp), encoder("vision")(inp)])
    dk.convert(model)
    layers = dk.converted_layers(model)
    assert sorted(layers) == ["text/attention", "vision/attention"]
    assert len({id(layer) for layer in layers.values()}) == 2
    assert len(dk.damcha_variables(model, generators=False)) == 2


def test_relative_or_cross_variants_of_supported_layers():
    """XLNet's TwoStreamRelativeAttention (a MultiHeadAttention subclass with a
    relative-position projection `_encoding_dense` the maps would not reach) is
    refused by name, not half mapped; T5Gemma's cross-attention (a
    CachedGemmaAttention subclass) gets separate maps under coupling="auto",
    as every other cross-attention does."""
    from keras_hub.src.models.t5gemma.t5gemma_attention import T5GemmaAttention
    from keras_hub.src.models.xlnet.relative_attention import TwoStreamRelativeAttention

    xlnet = TwoStreamRelativeAttention(num_heads=2, key_dim=4, name="relative_attention")
    xlnet.build((2, 5, 8))
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Cannot convert layer `relative_attention` \(keras-mha\).*relative_attention/encoding/kernel",
    ):
        dk.convert(xlnet)
    assert not dk.converted_layers(xlnet)
    common = dict(
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=2,
        query_pre_attn_scalar=1.0,
        attention_bias=False,
        head_dim=4,
    )
    for kind, coupling in (("self", "tied"), ("cross", "separate")):
        layer = T5GemmaAttention(**common, attention_type=kind, name=f"{kind}_attention")
        layer.build((2, 5, 8) if kind == "self" else [(2, 5, 8), (2, 7, 8)])
        with pytest.warns(UserWarning):
            dk.convert(layer)
        assert layer.damcha.config.coupling == coupling, kind


def test_moonshine_converts():
    """KerasHub's Moonshine (an audio encoder-decoder whose attention,
    MoonshineMultiHeadAttention, is a CachedMultiHeadAttention subclass that
    applies RoPE to the projected heads, after the maps) was refused over its
    ComputeAttentionMask, a layer without weights that builds masks. Every
    attention layer converts: the encoder's and the decoder's self-attention
    tied, the decoder's cross-attention (the one built without rotary
    embeddings; KerasHub gives it a default name) separate. Exact at init bit
    for bit; with the gates open each query/key projection's output equals the
    reference's map of its heads, the model's outputs move, and the task's
    cached decoding steps equal the full forward."""
    from keras_hub.src.models.moonshine.moonshine_backbone import MoonshineBackbone

    model = MoonshineBackbone(
        vocabulary_size=50,
        filter_dim=16,
        encoder_num_layers=1,
        decoder_num_layers=1,
        hidden_dim=16,
        intermediate_dim=16,
        encoder_num_heads=2,
        decoder_num_heads=2,
        dtype="float64",
    )
    rng = np.random.default_rng(4)
    x = {
        "encoder_input_values": rng.normal(size=(2, 2000, 1)),
        "encoder_padding_mask": np.ones((2, 2000), bool),
        "decoder_token_ids": rng.integers(1, 50, (2, 5)).astype("int32"),
        "decoder_padding_mask": np.ones((2, 5), bool),
    }

    outputs = functools.partial(all_outputs, model, x)
    before, layers = convert_exactly(model, x)
    assert {type(layer).__name__ for layer in layers.values()} == {"MoonshineMultiHeadAttention"}
    ties = {path: (layer.apply_rotary_embedding, layer.damcha.config.metric_sides) for path, layer in layers.items()}
    assert sorted(ties.values()) == [(False, ("q", "k")), (True, ("qk",)), (True, ("qk",))], ties
    open_gates(model)
    for layer in layers.values():
        params, config = layer_params("gpt2", layer)  # the four MultiHeadAttention sublayers
        check_maps("gpt2", layer, params, config, rng.normal(size=(2, 5, config.query_dim)), opened=1e-3)
    assert all(np.abs(got - want).max() > 1e-6 for got, want in zip(outputs()[:1], before[:1]))
    # Decoding with the task's caches (the cross-attention's keys mapped once, where the
    # task projects the encoder states) equals the full forward, token by token.
    from keras_hub.src.models.moonshine.moonshine_audio_to_text import MoonshineAudioToText

    task = MoonshineAudioToText(backbone=model)
    out = model(x)
    want = numpy(model.token_embedding(out["decoder_sequence_output"], reverse=True))
    ids, inputs_ = x["decoder_token_ids"], (x["encoder_input_values"], x["encoder_padding_mask"])
    _, self_cache, cross_cache, states, mask = task._build_cache(*inputs_, ids, x["decoder_padding_mask"])
    for i in range(ids.shape[1]):
        step = task.call_decoder_with_cache(states, mask, ids[:, i : i + 1], self_cache, i, cross_cache)
        logits, self_cache = numpy(step[0])[:, 0], step[2]
        np.testing.assert_allclose(logits, want[:, i], rtol=0, atol=1e-12 * np.abs(want).max())


@pytest.mark.parametrize("arch", ["bart", "whisper"])
def test_encoder_decoder_backbones_convert(arch):
    """KerasHub's BART and Whisper backbones (CachedMultiHeadAttention and
    Whisper's subclass of it; the decoders' cross-attention layers are named
    "cross_attention"): exact at init bit for bit, the encoder's and the
    decoder's self-attention tied and the cross-attention separate, each
    query/key projection equal to the reference's map with the gates open,
    and the outputs move."""
    rng = np.random.default_rng(5)
    sizes = dict(vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16, dtype="float64")
    ids = rng.integers(1, 50, (2, 5)).astype("int32")
    x = {"decoder_token_ids": ids, "decoder_padding_mask": np.ones((2, 5), bool)}
    if arch == "bart":
        model = keras_hub.models.BartBackbone(max_sequence_length=32, dropout=0.0, **sizes)
        x.update(encoder_token_ids=ids[:, ::-1].copy(), encoder_padding_mask=np.ones((2, 5), bool))
    else:
        model = keras_hub.models.WhisperBackbone(
            num_mels=8, max_encoder_sequence_length=16, max_decoder_sequence_length=16, **sizes
        )
        x.update(encoder_features=rng.normal(size=(2, 16, 8)))

    outputs = functools.partial(all_outputs, model, x)
    before, layers = convert_exactly(model, x)
    sides = sorted(
        (path.endswith("cross_attention"), layer.damcha.config.metric_sides) for path, layer in layers.items()
    )
    assert sides == [(False, ("qk",)), (False, ("qk",)), (True, ("q", "k"))], sides
    open_gates(model)
    for layer in layers.values():
        params, config = layer_params("gpt2", layer)  # the four MultiHeadAttention sublayers
        check_maps("gpt2", layer, params, config, rng.normal(size=(2, 5, config.query_dim)), opened=1e-3)
    assert max(np.abs(got - want).max() for got, want in zip(outputs(), before)) > 1e-6


def _t5_backbone(arch):
    if arch == "t5":
        return keras_hub.models.T5Backbone(
            vocabulary_size=50,
            num_layers=2,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            dropout=0.0,
            dtype="float64",
        )
    sizes = dict(hidden_dim=8, intermediate_dim=16, num_layers=1, num_attention_heads=2, num_key_value_heads=2)
    sizes.update(head_dim=4, layer_types=["full_attention"])
    return keras_hub.models.T5GemmaBackbone(
        vocabulary_size=50,
        dtype="float64",
        **{f"{side}_{k}": v for side in ("encoder", "decoder") for k, v in sizes.items()},
    )


@pytest.mark.filterwarnings("ignore:Layer .* does not support masking:UserWarning")  # T5's layers, KerasHub's
@pytest.mark.parametrize("arch", ["t5", "t5gemma"])
def test_t5_backbones_convert(arch):
    """KerasHub's T5 (T5MultiHeadAttention: Dense projections, a relative position bias
    added to the logits, one class for self- and cross-attention, told apart by the names
    its transformer layers give them) and T5Gemma (T5GemmaAttention, by its attention_type)
    encoder-decoder backbones: exact at init bit for bit, the encoder's and the decoder's
    self-attention tied and the cross-attention separate, each query/key projection equal
    to the reference's map with the gates open, T5's layers equal the NumPy attention with
    its own bias table (positional_reference), the outputs move, and T5's cached decoding
    steps (the cross-attention's keys mapped once, where the task projects the encoder
    states) equal the full forward."""
    model = _t5_backbone(arch)
    rng = np.random.default_rng(6)
    ids = rng.integers(1, 50, (2, 5)).astype("int32")
    x = {
        "encoder_token_ids": ids[:, ::-1].copy(),
        "encoder_padding_mask": np.ones((2, 5), bool),
        "decoder_token_ids": ids,
        "decoder_padding_mask": np.ones((2, 5), bool),
    }

    outputs = functools.partial(all_outputs, model, x)
    before, layers = convert_exactly(model, x)
    sides = sorted(
        (
            getattr(layer, "attention_type", None) == "cross" or path.endswith("cross_attention"),
            layer.damcha.config.metric_sides,
        )
        for path, layer in layers.items()
    )
    self_layers = 4 if arch == "t5" else 2
    assert sides == [(False, ("qk",))] * self_layers + [(True, ("q", "k"))] * (self_layers // 2), sides
    open_gates(model)
    sublayers = "t5" if arch == "t5" else "gemma"
    for layer in layers.values():
        params, config = layer_params(sublayers, layer)
        x_layer = rng.normal(size=(2, 5, config.query_dim))
        check_maps(sublayers, layer, params, config, x_layer, opened=1e-3)
        if arch == "t5":
            mask = causal_mask(2, 5)
            expected = positional_reference("t5", layer, params, config, x_layer, mask)
            got = call_layer("t5", layer, x_layer, mask)
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12 * max(1.0, np.abs(expected).max()))
    assert max(np.abs(got - want).max() for got, want in zip(outputs(), before)) > 1e-6
    if arch != "t5":
        return
    task = keras_hub.models.T5Seq2SeqLM(backbone=model, preprocessor=None)
    want = numpy(task._logits(model(x)["decoder_sequence_output"]))
    encoded = task.call_encoder(x["encoder_token_ids"], x["encoder_padding_mask"])
    self_cache, cross_cache = task._initialize_cache(x["encoder_token_ids"], ids)
    for i in range(ids.shape[1]):
        logits, _, self_cache, cross_cache = task.call_decoder_with_cache(
            encoded, x["encoder_padding_mask"], ids[:, i : i + 1], self_cache, i, cross_cache, 0 if i == 0 else None
        )
        np.testing.assert_allclose(numpy(logits)[:, 0], want[:, i], rtol=0, atol=1e-12 * np.abs(want).max())


def test_gemma4_vision_encoder_converts():
    """Gemma 4's vision encoder (Gemma4VisionAttention: projections by
    Gemma4ClippableEinsumDense, which clips around an einsum with its inner
    EinsumDense's kernel; per-head q/k norms, value norm, 2-D RoPE), standalone,
    in float32 (it computes in float32 whatever dtype it is given): exact at init
    bit for bit, each query/key projection (its output clip included) equal to the
    reference's map with the gates open, and the encoder equal to its host with
    the reference's maps after those projections, to float32 rounding."""
    from keras_hub.src.models.gemma4.gemma4_vision_encoder import Gemma4VisionEncoder

    # float32: the encoder computes in float32 whatever dtype it is given (KerasHub 0.32).
    encoder = Gemma4VisionEncoder(
        image_size=16,
        patch_size=4,
        hidden_dim=8,
        num_layers=2,
        num_heads=2,
        num_key_value_heads=2,
        head_dim=4,
        intermediate_dim=16,
        output_dim=8,
        position_embedding_size=16,
        pool_size=2,
    )
    rng = np.random.default_rng(7)
    grid = np.stack(np.meshgrid(np.arange(4), np.arange(4), indexing="ij"), -1).reshape(1, 1, 16, 2)
    x = {
        "pixel_values": rng.normal(size=(2, 1, 16, 48)).astype("float32"),
        "pixel_position_ids": grid.repeat(2, 0).astype("int32"),
    }
    before = numpy(encoder(x))
    dk.convert(encoder)
    np.testing.assert_array_equal(numpy(encoder(x)), before)
    layers = dk.converted_layers(encoder)
    assert [type(layer).__name__ for layer in layers.values()] == ["Gemma4VisionAttention"] * 2
    open_gates(encoder)
    for layer in layers.values():
        params, config = layer_params("gemma4", layer)
        tokens = rng.normal(size=(2, 5, config.query_dim)).astype("float32")
        check_maps("gemma4", layer, params, config, tokens, opened=1e-2, atol=1e-5)
    got = numpy(encoder(x))
    with reference_maps("gemma4", encoder):
        expected = numpy(encoder(x))
    # float32 rounding of the maps (the reference's in float64), against maps that move the output by O(1e-1).
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * max(1.0, np.abs(expected).max()))
    assert np.abs(got - before).max() > 1e-2


def test_more_kerashub_backbones_convert():
    """Backbones whose attention classes the zoo covers under other models: RoFormer V2
    (RoformerAttention, ESM's base class; interleaved RoPE), Qwen-MoE (QwenMoeAttention:
    Qwen's source under public sublayer names), Llama 3 (LlamaAttention), CLIP's text and
    vision encoders and SigLIP's text encoder (Keras MultiHeadAttention): every attention
    layer converts, exact at init bit for bit."""
    rng = np.random.default_rng(8)
    tokens = rng.integers(1, 50, (2, 5)).astype("int32")
    mask = np.ones((2, 5), bool)
    images = rng.normal(size=(2, 8, 8, 3)).astype("float32")
    lm = dict(vocabulary_size=50, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16)
    text = dict(vocabulary_size=50, embedding_dim=8, hidden_dim=8, num_layers=2, num_heads=2, intermediate_dim=16)
    vision = dict(patch_size=4, hidden_dim=8, num_layers=2, num_heads=2, intermediate_dim=16, image_shape=(8, 8, 3))
    cases = {
        "RoformerAttention": (
            keras_hub.models.RoformerV2Backbone(
                vocabulary_size=50,
                num_layers=2,
                num_heads=2,
                hidden_dim=8,
                intermediate_dim=16,
                head_size=4,
                dropout=0.0,
            ),
            {"token_ids": tokens, "segment_ids": np.zeros_like(tokens)},
        ),
        "QwenMoeAttention": (
            keras_hub.models.QwenMoeBackbone(
                **lm,
                intermediate_dim=32,
                moe_intermediate_dim=8,
                shared_expert_intermediate_dim=8,
                num_experts=2,
                top_k=1,
            ),
            {"token_ids": tokens, "padding_mask": mask},
        ),
        "LlamaAttention": (
            keras_hub.models.Llama3Backbone(**lm, intermediate_dim=32),
            {"token_ids": tokens, "padding_mask": mask},
        ),
        "MultiHeadAttention": (keras_hub.models.CLIPTextEncoder(**text, max_sequence_length=8), {"token_ids": tokens}),
        "MultiHeadAttention ": (keras_hub.models.CLIPVisionEncoder(**vision), {"images": images}),
        # SigLIP's text encoder takes exactly max_sequence_length tokens.
        "MultiHeadAttention  ": (
            keras_hub.models.SigLIPTextEncoder(**text, max_sequence_length=5),
            {"token_ids": tokens},
        ),
    }
    for name, (model, x) in cases.items():
        _, layers = convert_exactly(model, x)
        assert [type(layer).__name__ for layer in layers.values()] == [name.strip()] * 2, name


def _gpt_neox():
    """A tiny float64 KerasHub GPT-NeoX (its fused, interleaved _qkv_dense), seeded."""
    keras.utils.set_random_seed(0)
    return keras_hub.models.GPTNeoXBackbone(
        vocabulary_size=50,
        num_layers=2,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=32,
        rotary_percentage=0.5,  # d = 4: a rotary size of 2
        dtype="float64",
    )


def test_gpt_neox_converts():
    """KerasHub GPT-NeoX's fused _qkv_dense, (B, T, H, 3d) with each head's query,
    key and value side by side (ProjectionSite groups=H): exact at init bit for bit
    on a padded batch; with the gates open each layer's query and key heads, read
    as the host slices them, are the reference's maps of the unmapped heads (to
    1e-12), its values untouched, and the output moves. (KerasHub's own cached
    GPT-NeoX differs from its full forward, converted or not: no cache check.)"""
    model = _gpt_neox()
    ids = np.array([[1, 5, 7, 9, 3, 2], [4, 4, 8, 1, 0, 0]])
    x = {"token_ids": ids, "padding_mask": ids != 0}
    before = output(model, x)
    dk.convert(model)
    np.testing.assert_array_equal(output(model, x), before)
    layers = dk.converted_layers(model)
    assert len(layers) == 2 and all(layer.damcha.config.metric_sides == ("qk",) for layer in layers.values())
    open_gates(model)
    rng = np.random.default_rng(3)
    for layer in layers.values():
        cfg, d = layer.damcha.config, layer.attn_head_size
        dense = layer._qkv_dense
        tokens = rng.normal(size=(2, 5, cfg.query_dim))
        y0 = np.einsum("bte,ehf->bthf", tokens, numpy(dense.kernel)) + numpy(dense.bias)
        y = numpy(dense(tokens))
        params = layer.damcha.to_canonical()
        for role, cut in (("q", slice(0, d)), ("k", slice(d, 2 * d))):
            want = reference_map(params, cfg, dc.side_of(cfg, role), tokens, y0[..., cut])
            assert np.abs(want - y0[..., cut]).max() > 1e-2  # the maps are open
            np.testing.assert_allclose(y[..., cut], want, rtol=0, atol=1e-12, err_msg=role)
        np.testing.assert_allclose(y[..., 2 * d :], y0[..., 2 * d :], rtol=0, atol=1e-12)
    assert np.abs(output(model, x) - before).max() > 1e-3


def test_a_tied_fused_projection_makes_its_map_once(monkeypatch):
    """GPT-NeoX's fused _qkv_dense holds a tied query and key as two blocks of one
    side: one forward calls each layer's generator once (it called it for each
    block), and the metric penalty, added per block with its share, still
    equals the reference's, once per layer."""
    model = _gpt_neox()
    ids = np.array([[1, 5, 7, 9, 3, 2]])
    x = {"token_ids": ids, "padding_mask": ids != 0}
    dk.convert(model)
    open_gates(model)
    dk.track_metric_penalty(model)
    layers = dk.converted_layers(model)
    tokens = {}
    for path, layer in layers.items():
        site = layer._qkv_dense.call

        def spy(t, *a, _site=site, _path=path, **k):
            tokens[_path] = numpy(t)
            return _site(t, *a, **k)

        layer._qkv_dense.call = spy
    calls = []
    original = dk.MetricGenerator.call

    def counted(self, *args, **kwargs):
        calls.append(id(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(dk.MetricGenerator, "call", counted)
    model(x)
    assert sorted(calls) == sorted(id(layer.damcha.metric_generators["qk"]) for layer in layers.values())
    # Self-attention with a tied map: each layer's penalty is its one side's.
    expected = np.mean(
        [
            role_penalty(np, params, cfg, "qk", reference_generator(params, cfg, "qk", tokens[path]))
            for path, layer in layers.items()
            for params, cfg in [(layer.damcha.to_canonical(), layer.damcha.config)]
        ]
    )
    np.testing.assert_allclose(float(numpy(dk.metric_penalty(model))), expected, rtol=1e-6)
    assert expected > 1e-4


def test_paligemma_and_gemma3_vision_attention_converts():
    """PaliGemma's vision tower (PaliGemmaVitAttention) and Gemma 3's vision encoder
    (Gemma3VisionAttention), CLIP's layout (Dense query_proj/key_proj, softmax attention at
    1/sqrt(d)), were refused as unknown layouts. float64: exact at init bit for bit (PaliGemma's
    Gemma decoder converted with it: separate maps for its MQA), each vision layer equal to the
    reference's damcha_attention with the gates open (its projections to its maps), the outputs move."""
    rng = np.random.default_rng(9)
    ids = rng.integers(1, 50, (2, 5)).astype("int32")
    cases = [
        (
            keras_hub.models.PaliGemmaBackbone(
                vocabulary_size=50,
                image_size=8,
                num_layers=1,
                num_query_heads=2,
                num_key_value_heads=1,
                hidden_dim=8,
                intermediate_dim=16,
                head_dim=4,
                vit_patch_size=4,
                vit_num_layers=1,
                vit_num_heads=2,
                vit_hidden_dim=8,
                vit_intermediate_dim=16,
                dtype="float64",
            ),
            {
                "images": rng.normal(size=(2, 8, 8, 3)),
                "token_ids": ids,
                "padding_mask": np.ones((2, 5), "int32"),
                "response_mask": np.zeros((2, 5), "int32"),
            },
            {"PaliGemmaVitAttention": "tied", "CachedGemmaAttention": "separate"},
        ),
        (
            keras_hub.models.Gemma3VisionEncoder(
                image_size=8,
                patch_size=4,
                num_heads=2,
                hidden_dim=8,
                num_layers=2,
                intermediate_dim=16,
                output_dim=8,
                pool_size=1,
                dtype="float64",
            ),
            rng.normal(size=(2, 1, 8, 8, 3)),
            {"Gemma3VisionAttention": "tied"},
        ),
    ]
    for model, x, couplings in cases:
        before, layers = convert_exactly(model, x)
        assert {type(layer).__name__: layer.damcha.config.coupling for layer in layers.values()} == couplings
        open_gates(model)
        for layer in layers.values():
            if type(layer).__name__ not in ("PaliGemmaVitAttention", "Gemma3VisionAttention"):
                continue
            params, config = layer_params("clip_vit", layer)
            tokens = rng.normal(size=(2, 5, config.query_dim))
            check_maps("clip_vit", layer, params, config, tokens, opened=1e-3)
            expected = dc.damcha_attention(params, config, tokens)
            np.testing.assert_allclose(numpy(layer(tokens)[0]), expected, rtol=0, atol=1e-12)
        assert max(np.abs(got - want).max() for got, want in zip(all_outputs(model, x), before)) > 1e-3


@pytest.mark.filterwarnings("ignore:Layer 'attn' .* does not support masking:UserWarning")  # Swin's, KerasHub's
def test_swin_window_attention_converts():
    """Swin's WindowAttention (one qkv Dense the host views (B, N, 3, H, d): the query heads,
    the key heads, the value heads; a learned relative position bias per head on the logits;
    shifted windows, masked, in every second block) was refused as an unknown layout. float64:
    exact at init bit for bit; with the gates open each layer's query and key heads are the
    reference's maps of the unmapped heads (to 1e-12), its values untouched, the layer equals
    softmax attention of those heads plus its bias table, and the output moves."""
    rng = np.random.default_rng(10)
    model = keras_hub.models.SwinTransformerBackbone(
        image_shape=(8, 8, 3), embed_dim=8, depths=(2,), num_heads=(2,), window_size=2, patch_size=2, dtype="float64"
    )
    images = rng.normal(size=(2, 8, 8, 3))
    (before,), layers = convert_exactly(model, images)
    assert len(layers) == 2 and {layer.damcha.config.coupling for layer in layers.values()} == {"tied"}
    open_gates(model)
    for layer in layers.values():
        cfg, H, d = layer.damcha.config, layer.num_heads, layer.head_dim
        config = reference_config(cfg)
        kernel = numpy(layer.qkv.kernel).reshape(cfg.query_dim, 3, H, d)
        bias = numpy(layer.qkv.bias).reshape(3, H, d)
        params = {
            **{f"{r}.kernel": kernel[:, i] for i, r in enumerate(("query", "key", "value"))},
            **{f"{r}.bias": bias[i] for i, r in enumerate(("query", "key", "value"))},
            "output.kernel": numpy(layer.proj.kernel).reshape(H, d, -1),
            "output.bias": numpy(layer.proj.bias),
            **layer.damcha.to_canonical(),
        }
        tokens = rng.normal(size=(3, 4, cfg.query_dim))  # 3 windows of 2x2 tokens
        q0, k0, v = (np.einsum("bte,ehd->bthd", tokens, kernel[:, i]) + bias[i] for i in range(3))
        q, k = (reference_map(params, config, "qk", tokens, y0) for y0 in (q0, k0))
        assert min(np.abs(q - q0).max(), np.abs(k - k0).max()) > 1e-2  # the maps are open
        y = numpy(layer.qkv(tokens)).reshape(3, 4, 3, H, d)
        for got, want in ((y[:, :, 0], q), (y[:, :, 1], k), (y[:, :, 2], v)):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        logits = np.einsum("bnhd,bmhd->bhnm", q * layer.scale, k) + numpy(layer._get_rel_pos_bias())[None]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        o = np.einsum("bhnm,bmhd->bnhd", probs, v)
        expected = np.einsum("bnhd,hde->bne", o, params["output.kernel"]) + params["output.bias"]
        np.testing.assert_allclose(numpy(layer(tokens)), expected, rtol=0, atol=1e-12)
    assert np.abs(output(model, images) - before).max() > 1e-3


def test_qwen3_5_vision_attention_converts():
    """Qwen3.5's vision attention (one qkv Dense over the patches of all the images as one
    sequence (N, E), no batch axis; 2-D RoPE and attention inside each frame after the maps)
    was refused: the maps took tokens (B, T, E) only, and now read any leading axes. Exact at
    init bit for bit; with the gates open each layer's query and key heads are the reference's
    maps of the unmapped heads (float64 reference; the encoder's blocks compute in float32
    whatever its dtype), its values untouched; the output moves."""
    from keras_hub.src.models.qwen3_5.qwen3_5_vision_encoder import Qwen3_5VisionEncoder

    rng = np.random.default_rng(11)
    encoder = Qwen3_5VisionEncoder(
        depth=2, hidden_size=8, num_heads=2, intermediate_size=16, patch_size=4, out_hidden_size=8, dtype="float64"
    )
    grid = np.array([[1, 4, 4], [1, 2, 4]], "int32")  # two images: two frames of attention
    patches = rng.normal(size=(24, encoder.temporal_patch_size, 4, 4, encoder.in_channels))
    before = numpy(encoder(patches, grid))
    dk.convert(encoder)
    layers = dk.converted_layers(encoder)
    assert len(layers) == 2 and {layer.damcha.config.coupling for layer in layers.values()} == {"tied"}
    np.testing.assert_array_equal(numpy(encoder(patches, grid)), before)
    open_gates(encoder)
    for layer in layers.values():
        cfg, H, d = layer.damcha.config, layer.num_heads, layer.head_dim
        kernel = numpy(layer.qkv.kernel).reshape(cfg.query_dim, 3, H, d)
        bias = numpy(layer.qkv.bias).reshape(3, H, d)
        params = {
            **{f"{r}.kernel": kernel[:, i] for i, r in enumerate(("query", "key", "value"))},
            **{f"{r}.bias": bias[i] for i, r in enumerate(("query", "key", "value"))},
            "output.kernel": numpy(layer.proj.kernel).reshape(H, d, -1),
            "output.bias": numpy(layer.proj.bias),
            **layer.damcha.to_canonical(),
        }
        tokens = rng.normal(size=(5, cfg.query_dim))  # (N, E), as the encoder calls it
        q0, k0, v = (np.einsum("te,ehd->thd", tokens, kernel[:, i]) + bias[i] for i in range(3))
        q, k = (reference_map(params, reference_config(cfg), "qk", tokens[None], y0[None])[0] for y0 in (q0, k0))
        assert min(np.abs(q - q0).max(), np.abs(k - k0).max()) > 1e-2  # the maps are open
        y = numpy(layer.qkv(tokens)).reshape(5, 3, H, d)
        for got, want in ((y[:, 0], q), (y[:, 1], k), (y[:, 2], v)):
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    assert np.abs(numpy(encoder(patches, grid)) - before).max() > 1e-3


def test_videoprism_converts():
    """VideoPrism (VideoPrismAttention: EinsumDense query_dense/key_dense; its spatial, temporal,
    auxiliary and text encoders' self-attention, its pooler's attention of a learned query probe
    with a per-dimension query scale) was refused as an unknown layout. float64: exact at init bit
    for bit, the pooler's maps separate and the others tied, each projection equal to the
    reference's map with the gates open, the self-attention layers equal to the reference's
    damcha_attention, and both outputs move."""
    rng = np.random.default_rng(11)
    model = keras_hub.models.VideoPrismBackbone(
        image_shape=(8, 8, 3),
        num_frames=2,
        patch_size=4,
        hidden_dim=8,
        intermediate_dim=16,
        num_heads=2,
        num_spatial_layers=1,
        num_temporal_layers=1,
        num_auxiliary_layers=1,
        vocabulary_size=50,
        num_text_layers=1,
        dtype="float64",
    )
    x = {
        "pixel_values": rng.normal(size=(2, 2, 8, 8, 3)),
        "token_ids": rng.integers(1, 50, (2, 5)).astype("int32"),
        "padding_mask": np.ones((2, 5), "int32"),
    }
    before, layers = convert_exactly(model, x)
    sides = sorted((layer.name, layer.damcha.config.coupling) for layer in layers.values())
    assert sides == [("mha", "tied")] * 4 + [("pooling_attention", "separate")], sides
    open_gates(model)
    for layer in layers.values():
        params, config = layer_params("videoprism", layer)
        tokens = rng.normal(size=(2, 5, config.query_dim))
        check_maps("videoprism", layer, params, config, tokens, opened=1e-3)
        if not layer.use_per_dim_scale:  # (its softmax in float32, whatever its dtype)
            expected = dc.damcha_attention(params, config, tokens)
            np.testing.assert_allclose(numpy(layer(tokens, tokens)), expected, rtol=0, atol=1e-6)
    assert all(np.abs(got - want).max() > 1e-3 for got, want in zip(all_outputs(model, x), before))


def test_t5gemma2_merged_attention_gets_separate_maps():
    """T5Gemma 2's decoder attention (T5Gemma2MergedAttention, a CachedGemma3Attention subclass)
    attends over its own keys and the encoder's, both projected by its key_dense: keys of other
    tokens than its queries, so coupling="auto" gives it separate maps, as every cross-attention
    (it tied them, as self-attention, where its query and key heads matched); the encoder's
    self-attention stays tied. Exact at init bit for bit, and the maps move both outputs."""
    sizes = dict(hidden_dim=8, intermediate_dim=16, num_layers=1, num_attention_heads=2, num_key_value_heads=2)
    sizes.update(head_dim=4, layer_types=["full_attention"])
    model = keras_hub.models.T5Gemma2Backbone(
        vocabulary_size=50,
        dtype="float64",
        **{f"{side}_{k}": v for side in ("encoder", "decoder") for k, v in sizes.items()},
    )
    rng = np.random.default_rng(12)
    x = {
        "encoder_token_ids": rng.integers(1, 50, (2, 5)).astype("int32"),
        "encoder_padding_mask": np.ones((2, 5), "int32"),
        "decoder_token_ids": rng.integers(1, 50, (2, 4)).astype("int32"),
        "decoder_padding_mask": np.ones((2, 4), "int32"),
    }
    before, layers = convert_exactly(model, x)
    couplings = {type(layer).__name__: layer.damcha.config.coupling for layer in layers.values()}
    assert couplings == {"T5Gemma2Attention": "tied", "T5Gemma2MergedAttention": "separate"}, couplings
    open_gates(model)
    assert all(np.abs(got - want).max() > 1e-3 for got, want in zip(all_outputs(model, x), before))


def test_attention_layers_of_refused_models_convert_alone():
    """SAM 3's SAM3Attention (Dense q_proj/k_proj; self- or cross-attention as its name says) and
    D-FINE's DFineMultiheadAttention (EinsumDense q_proj/k_proj), the attention of models refused
    as a whole (SAM 3's vision encoder, D-FINE's deformable attention), convert on their own: each
    projection equals the reference's map of its heads with the gates open."""
    from keras_hub.src.models.d_fine.d_fine_attention import DFineMultiheadAttention
    from keras_hub.src.models.sam3.sam3_layers import SAM3Attention

    rng = np.random.default_rng(13)
    q, c = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 3, 8))
    cases = []
    for name, coupling in (("self_attn", "tied"), ("text_cross_attn", "separate")):
        layer = SAM3Attention(8, 2, name=name, dtype="float64")
        layer(q, c, c)
        cases.append((layer, coupling))
    layer = DFineMultiheadAttention(8, 2, name="self_attn", dtype="float64")
    layer(q)
    cases.append((layer, "tied"))
    for layer, coupling in cases:
        with pytest.warns(UserWarning, match="not a keras.Model"):
            dk.convert(layer)
        cfg = layer.damcha.config
        assert cfg.coupling == coupling, layer.name
        open_gates(layer)
        params = layer.damcha.to_canonical()
        for role, heads in (("query", cfg.num_heads), ("key", cfg.num_kv_heads)):
            params[f"{role}.kernel"], params[f"{role}.bias"] = projection(getattr(layer, f"{role[0]}_proj"), heads)
        SUBLAYERS["_alone"] = ("q_proj", "k_proj")
        try:
            check_maps("_alone", layer, params, reference_config(cfg), q, opened=1e-3)
        finally:
            del SUBLAYERS["_alone"]


def test_sam3_vision_attention_converts():
    """SAM 3's vision encoder attention (SAM3RoPEAttention: Dense q_proj/k_proj on image tokens
    (B, H, W, E), 2-D RoPE, windowed or global self-attention) was refused for its token rank;
    the maps now read tokens with any leading axes. Exact at init bit for bit; with the gates open
    its q_proj/k_proj outputs are the reference's maps of each token's heads, and the layer's
    output moves."""
    from keras_hub.src.models.sam3.sam3_layers import SAM3RoPEAttention

    rng = np.random.default_rng(14)
    tokens = rng.normal(size=(2, 3, 4, 8))  # (B, H, W, E)
    angles = rng.normal(size=(12, 4))
    rope = (np.cos(angles), np.sin(angles))
    layer = SAM3RoPEAttention(8, 2, name="attention", dtype="float64")
    before = numpy(layer(tokens, rope))
    with pytest.warns(UserWarning, match="not a keras.Model"):
        dk.convert(layer)
    np.testing.assert_array_equal(numpy(layer(tokens, rope)), before)
    cfg = layer.damcha.config
    assert cfg.coupling == "tied"
    open_gates(layer)
    params = layer.damcha.to_canonical()
    flat = tokens.reshape(1, -1, 8)
    for attr in ("q_proj", "k_proj"):
        kernel, bias = numpy(getattr(layer, attr).kernel), numpy(getattr(layer, attr).bias)
        unmapped = (flat @ kernel + bias).reshape(1, -1, 2, 4)
        want = reference_map(params, reference_config(cfg), "qk", flat, unmapped)
        assert np.abs(want - unmapped).max() > 1e-2  # the maps are open
        got = numpy(getattr(layer, attr)(tokens)).reshape(1, -1, 2, 4)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert np.abs(numpy(layer(tokens, rope)) - before).max() > 1e-3


def test_kerashub_layouts_that_are_refused():
    """Refused naming the layer and why, nothing converted: DeBERTa V3 (its query and key
    projections also project the relative position embeddings), Gemma 4's KV-shared layers (no key
    projection) and layers whose key projection gives their values too (attention_k_eq_v),
    SigLIP's vision encoder (its attention pooling head holds a probe, a norm and an MLP
    beside its MultiHeadAttention); by the keras-hub-refused adapter: Stable Diffusion 3's MMDiT
    (its MMDiTBlock attends jointly over two streams and is not attention-named: a model with it
    and other attention layers converted those and skipped it without a word), ViTDet (relative
    positions from the queries), MobileNetV5's attention block (convolutions of
    feature maps), Gemma 3n's audio conformer
    (relative positions projected apart from the keys); Gemma 3n's KV-shared layers."""
    from keras_hub.src.models.gemma3n.gemma3n_audio_encoder import Gemma3nAudioEncoder
    from keras_hub.src.models.stable_diffusion_3.mmdit import MMDiT

    small = dict(vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=8, intermediate_dim=16)
    gemma3n = dict(
        text_vocab_size=10,
        text_hidden_size=8,
        pad_token_id=0,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        hidden_activation="gelu_approximate",
        sliding_window=4,
        rope_theta=10000.0,
        max_position_embeddings=8,
        vocab_size_per_layer_input=10,
        hidden_size_per_layer_input=2,
        altup_num_inputs=2,
        laurel_rank=1,
    )
    audio = Gemma3nAudioEncoder(
        hidden_size=4,
        input_feat_size=16,
        sscp_conv_channel_size=[2, 4],
        sscp_conv_kernel_size=[(1, 1), (1, 1)],
        sscp_conv_stride_size=[(2, 2), (2, 2)],
        sscp_conv_group_norm_eps=1e-5,
        num_hidden_layers=1,
        rms_norm_eps=1e-6,
        gradient_clipping=1.0,
        residual_weight=0.5,
        num_attention_heads=1,
        attention_chunk_size=2,
        num_attention_context_right=1,
        num_attention_context_left=1,
        attention_logit_cap=50.0,
        conv_kernel_size=3,
        reduction_factor=1,
    )
    mobilenetv5 = {
        f"stackwise_{k}": v
        for k, v in dict(
            block_types=[["er"], ["mqa"]],
            num_blocks=[1, 1],
            num_filters=[[8], [8]],
            strides=[[2], [1]],
            act_layers=[["relu"], ["relu"]],
            exp_ratios=[[2.0], [2.0]],
            se_ratios=[[0.0], [0.0]],
            dw_kernel_sizes=[[0], [0]],
            dw_start_kernel_sizes=[[0], [0]],
            dw_end_kernel_sizes=[[0], [0]],
            exp_kernel_sizes=[[3], [0]],
            pw_kernel_sizes=[[1], [0]],
            num_heads=[[0], [2]],
            key_dims=[[0], [4]],
            value_dims=[[0], [4]],
            kv_strides=[[0], [1]],
            use_cpe=[[False], [False]],
        ).items()
    }
    gemma4 = dict(
        vocabulary_size=50,
        image_size=16,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        head_dim=4,
    )
    cases = [
        (
            keras_hub.models.DebertaV3Backbone(**small, max_sequence_length=32, bucket_size=8),
            r"Cannot convert layer `disentangled_attention_encoder_layer_0` \(keras-hub-deberta-v3\): Invalid argument "
            r"`layer`: expected an attention layer whose query and key projections project tokens only; .*relative "
            r"position embeddings",
        ),
        (
            keras_hub.models.Gemma4Backbone(**gemma4, num_kv_shared_layers=1),
            r"Cannot convert layer `decoder_block_1/attention` \(keras-hub-gemma4\): .*this KV-shared layer "
            r"\(is_kv_shared_layer=True",
        ),
        (
            keras_hub.models.Gemma4Backbone(**gemma4, sliding_window_pattern=2, num_global_key_value_heads=1),
            r"Cannot convert layer `decoder_block_1/attention` \(keras-hub-gemma4\): .*key projection also gives "
            r"its values \(attention_k_eq_v=True",
        ),
        (
            keras_hub.models.SigLIPVisionEncoder(
                patch_size=4, hidden_dim=8, num_layers=1, num_heads=2, intermediate_dim=16, image_shape=(8, 8, 3)
            ),
            r"unknown layouts: head \(keras_hub\.\S+\.SigLIPMultiHeadAttentionPooling, which wraps the supported "
            r"head/attention but also holds weights",
        ),
        (
            MMDiT(2, 8, 1, 2, 4, latent_shape=(4, 4, 4), context_shape=(3, 8), pooled_projection_shape=(8,)),
            r"Cannot convert layer `joint_block_0` \(keras-hub-refused\): Invalid argument `layer`: expected an "
            r"attention layer that projects its queries and keys once each; Stable Diffusion 3's MMDiTBlock attends "
            r"jointly over its text and image streams",
        ),
        (
            keras_hub.models.ViTDetBackbone(
                image_shape=(8, 8, 3),
                patch_size=4,
                hidden_size=8,
                num_layers=1,
                global_attention_layer_indices=[0],
                intermediate_dim=16,
                num_heads=2,
                num_output_channels=4,
                window_size=2,
            ),
            r"\(keras-hub-refused\): Invalid argument `layer`: expected an attention layer whose logits compare its "
            r"queries with its keys .*; ViTDet's attention .* relative-position tables",
        ),
        (
            keras_hub.models.MobileNetV5Backbone(**mobilenetv5, image_shape=(16, 16, 3), stem_size=8, use_msfa=False),
            r"Cannot convert layer `mobile_attention` \(keras-hub-refused\): .*MobileNetV5's multi-query attention "
            r"projects feature maps \(B, H, W, C\)",
        ),
        (
            keras_hub.models.Gemma3nBackbone(
                **gemma3n,
                num_hidden_layers=1,
                intermediate_size=[16],
                layer_types=["full_attention"],
                audio_encoder_config=audio.get_config(),
                audio_hidden_size=4,
            ),
            r"Cannot convert layer `\S+/conformer_block_0/attention` \(keras-hub-refused\): Invalid argument `layer`: "
            r"expected an attention layer whose logits compare its queries with its keys \(plus terms of positions "
            r"only\); Gemma 3n's audio attention",
        ),
        (
            keras_hub.models.Gemma3nBackbone(
                **gemma3n,
                num_hidden_layers=2,
                intermediate_size=[16, 16],
                layer_types=["full_attention"] * 2,
                num_kv_shared_layers=1,
            ),
            r"Cannot convert layer `text_model/decoder_block_1/attention` \(keras-hub-dense-qk\): .*this KV-shared "
            r"layer \(is_kv_shared_layer=True, Gemma 3n's num_kv_shared_layers\)",
        ),
    ]
    for model, message in cases:
        n = len(model.weights)
        with pytest.raises(dc.DamchaValueError, match=message):
            dk.convert(model)
        assert len(model.weights) == n and not dk.converted_layers(model)


def test_a_refusal_names_the_known_layers_that_cannot_be_converted_too():
    """A model with a layer of no known layout and a layer of a known layout
    that cannot be converted is refused naming both: XLNet's backbone, whose
    attention-named mask layer (it holds a mask embedding) has no layout and
    whose relative attention (a MultiHeadAttention subclass with a relative
    position projection) the keras-mha adapter refuses; named before was only
    the mask layer, which hid the attention layer that stops the conversion."""
    from keras_hub.src.models.xlnet.xlnet_backbone import XLNetBackbone

    model = XLNetBackbone(vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16)
    with pytest.raises(
        dc.DamchaValueError,
        match=r"unknown layouts: encoder_block_attn_mask_layer \(keras_hub\.\S+\.XLNetAttentionMaskLayer\); and "
        r"layers of known layouts that cannot be converted: Cannot convert layer `xlnet_encoder_0/rel_attn` "
        r"\(keras-mha\): .*Received: weights xlnet_encoder_0/rel_attn/encoding/kernel$",
    ):
        dk.convert(model)
    assert not dk.converted_layers(model)


def test_convert_refuses_a_model_whose_optimizer_is_built():
    """An optimizer built before convert() never trains the new variables (TensorFlow
    silently: the gates stayed 0 after fit). Refused, model untouched; compiled again,
    or compiled but not yet run (as KerasHub tasks are at construction), it converts
    and fit() moves the gates. The jax and torch processes run the same check."""
    r = convert_after_fit()
    assert r["refused"].startswith("Invalid argument `model`: expected a model whose optimizer is not built"), r
    assert "compiled with optimizer Adam, already built for 8 variables" in r["refused"], r
    assert r["unchanged"] and r["recompiled_moved"] and r["compiled_only_moved"], r
    # A model inside a fitted one (a task's backbone): refused, naming both.
    assert r["inner_refused"].startswith("Invalid argument `model`: expected a model whose optimizer is not built"), r
    assert "inside Functional" in r["inner_refused"] and r["inner_unchanged"], r


@pytest.mark.parametrize("policy", ["float16", "mixed_float16"])
def test_converted_maps_refuse_metric_weights_that_overflow_the_compute_dtype(policy):
    """DamchaMaps.load_canonical checked finiteness only: 1e5 loaded into a float16 (or
    mixed_float16: float32 variables, float16 compute) model, whose every output was then NaN."""
    inp = keras.Input((5, 8))
    model = keras.Model(inp, keras.layers.MultiHeadAttention(2, 4, dtype=policy)(inp, inp))
    dk.convert(model)
    maps = next(iter(dk.converted_layers(model).values())).damcha
    params = maps.to_canonical()
    before = {k: v.copy() for k, v in params.items()}
    params["metric.qk.kernel"].flat[0] = 65520.0  # float16's first value that is inf
    with pytest.raises(
        dc.DamchaValueError, match=r"`params\['metric.qk.kernel'\]`: expected values that round to a finite float16"
    ):
        maps.load_canonical(params)
    for name, value in maps.to_canonical().items():  # nothing was assigned
        np.testing.assert_array_equal(value, before[name])
    params["metric.qk.kernel"].flat[0] = 65504.0
    maps.load_canonical(params)
    assert maps.to_canonical()["metric.qk.kernel"].flat[0] == 65504.0


# ------------------------------------------------------------------- docs


def test_docs_example_runs(tmp_path, monkeypatch):
    """The Keras example of docs/models.md, as written (in a temporary folder)."""
    with open(DOCS, encoding="utf-8") as f:
        text = f.read()
    match = re.search(r"<!-- tested: tests/test_models_keras_backends.py -->\s*```python\n(.*?)```", text, re.S)
    assert match, "docs/models.md lost its tested Keras example"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(match.group(1), "docs/models.md", "exec"), namespace)
    assert os.path.isfile(tmp_path / "llama.keras")
    assert namespace["same"] and namespace["moved"]
