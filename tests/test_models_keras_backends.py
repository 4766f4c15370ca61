"""damcha_keras.convert on the jax and torch Keras backends.

Keras fixes its backend at import, so each backend runs ``run`` below in a
Keras process of its own, shared with tests/test_keras_backends.py
(tests/_keras_processes.py: one process per backend per test session); each
check here is one pytest item, ``test_models_keras_backend[BACKEND-CHECK]``,
asserting on that process's results. ``python tests/test_models_keras_backends.py
BACKEND TMPDIR`` (with ``KERAS_BACKEND=BACKEND``) prints them.
tests/test_models_keras.py covers tensorflow (in process) in more depth.

Per backend: every converted architecture (GPT-2, BERT, Llama, Mistral, Qwen,
Qwen3, Gemma, ViT, ESM, DINOv3, Bloom, Falcon, SmolLM3, Gemma 4) exact at init
(bit for bit; the causal LMs with Mistral's sliding window and Gemma 2's
soft-capping, query scaling and sliding window active); with the gates open,
every converted layer of GPT-2 and BERT equals the reference damcha_attention
and every mapped q/k of Llama and ESM (Dense projections) the reference's maps
(float64; jax in x64 mode for that part), the whole Llama and ESM layers within
float32 RoPE rounding; for the causal LMs of CAUSAL greedy generate() with the
cache equals greedy decoding without it, and for those and CACHED's
call_with_cache step by step equals the full forward;
one mixed-precision model (jax: Gemma in mixed_bfloat16, torch: Qwen3 in
mixed_float16) exact at init and close to its float32 twin with the gates open;
fit moves the gates; convert() refuses a model whose optimizer is built; .weights.h5 and .keras files round-trip; the docs' Keras
example runs.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from _keras_processes import part_results

BACKENDS = ("jax", "torch")
# KerasHub causal LMs convert() knows, but Gemma 3, whose generate() fails without a
# preprocessor in KerasHub 0.32 (tested on TensorFlow: tests/test_models_keras.py).
CAUSAL = ("gpt2", "opt", "llama", "mistral", "qwen", "qwen3", "gemma", "mixtral", "phi3")
# Causal LMs of the other layouts: exact at init and call_with_cache step by step against
# the full forward, without generate() (its compilation, per model, costs more than the
# cache check): ALiBi in the layer (Bloom) and from the decoder block (Falcon), Dense
# projections and a NoPE layer (SmolLM3), Gemma 4's norms. GPT-OSS (~15 s per backend) and
# Qwen3-MoE (Qwen3's attention) run on TensorFlow only (tests/test_models_keras.py).
CACHED = ("bloom", "falcon", "smollm3", "gemma4")
ALL = ("bert", "vit", "esm", "dinov3", *CAUSAL, *CACHED)
# Bound on the mixed model's logits error, relative to the logits' scale: 8
# machine epsilons of the compute dtype (bfloat16 2**-7, float16 2**-10). Any
# path to the logits rounds about 8 times per layer to the compute dtype
# (normalised input, q/k/v projection, map, scores, soft-cap/softmax, attention
# output, MLP, residual sum), each within half an epsilon of the (normalised)
# activations' scale, and 2 layers give 16 half-epsilons. Measured (seeded
# weights): 2.4 eps (jax, Gemma, bfloat16), 0.11 eps (torch, Qwen3, float16). A
# defect on the mixed path (a map skipped or computed from the wrong tensor, a
# float16 overflow) moves the logits by the maps' own effect, which the test
# requires to be over 2 bounds (measured: 39 and 62 eps).
MIXED_BOUND = {"mixed_bfloat16": 8 * 2.0**-7, "mixed_float16": 8 * 2.0**-10}
# backend -> (arch, dtype policy) of its mixed-precision case
MIXED = {"jax": ("gemma", "mixed_bfloat16"), "torch": ("qwen3", "mixed_float16")}


def check_exact_at_init(r: dict, backend: str) -> None:
    assert r["exact_at_init"] == dict.fromkeys(ALL, True), r["exact_at_init"]


def check_layers_equal_reference(r: dict, backend: str) -> None:
    assert r["maps_open"], r
    assert max(r["reference_error_exact"].values()) <= 1e-12, r["reference_error_exact"]
    errors = r["reference_error_rotary_layers"]
    assert sorted(errors) == ["esm", "llama"] and max(errors.values()) <= 1e-6, errors


def check_generate_equals_greedy(r: dict, backend: str) -> None:
    assert r["generate_mismatches"] == dict.fromkeys(CAUSAL, 0), r["generate_mismatches"]


def check_call_with_cache(r: dict, backend: str) -> None:
    errors = r["call_with_cache_error"]
    assert max(errors.values()) <= 1e-5 and sorted(errors) == sorted(CAUSAL + CACHED), errors


def check_mixed_precision(r: dict, backend: str) -> None:
    assert r["mixed_exact_at_init"], r
    bound = MIXED_BOUND[MIXED[backend][1]]
    assert r["mixed_error"] <= bound < r["mixed_map_effect"] / 2, r


def check_fit_moves_gates(r: dict, backend: str) -> None:
    assert r["fit_gates_moved"], r


def check_convert_after_fit(r: dict, backend: str) -> None:
    # What is checked is shared with the tensorflow test (tests/test_models_keras.py).
    assert "convert_after_fit" in r, sorted(r)
    refused = r["convert_after_fit"]["refused"]
    assert refused.startswith("Invalid argument `model`: expected a model whose optimizer is not built"), r
    assert "compiled with optimizer Adam, already built for 8 variables" in refused, r
    assert all(r["convert_after_fit"][k] for k in ("unchanged", "recompiled_moved", "compiled_only_moved")), r
    inner = r["convert_after_fit"]["inner_refused"]
    assert inner.startswith("Invalid argument `model`: expected a model whose optimizer is not built"), r
    assert "inside Functional" in inner and r["convert_after_fit"]["inner_unchanged"], r


def check_file_round_trips(r: dict, backend: str) -> None:
    assert r["weights_round_trip"] and r["keras_round_trip"], r


def check_docs_example(r: dict, backend: str) -> None:
    assert r["docs_example"] == {"same": True, "moved": True}, r["docs_example"]


# A converted GPT-2's training step (XLA's estimate, jax): the maps' backward needs
# the unmapped query and key heads y (2 units of B*N*E floats per layer, beside the
# host attention's saved q~ and k~) and the small per-token matrices. Measured: 2.6
# units; the coefficient form (also keeping the gated term g * A y per side) 5.5.
MAP_TRAIN_UNITS = 3.5


def check_training_memory(r: dict, backend: str) -> None:
    m = r["training_memory"]
    extra = (m["damcha"] - m["original"]) / (m["unit"] * m["layers"])
    assert 2.0 <= extra <= MAP_TRAIN_UNITS, m


CHECKS = {
    "exact-at-init": check_exact_at_init,
    "layers-equal-reference": check_layers_equal_reference,
    "generate-equals-greedy": check_generate_equals_greedy,
    "call-with-cache": check_call_with_cache,
    "mixed-precision": check_mixed_precision,
    "fit-moves-gates": check_fit_moves_gates,
    "convert-after-fit": check_convert_after_fit,
    "file-round-trips": check_file_round_trips,
    "docs-example": check_docs_example,
    "training-memory": check_training_memory,
}
# XLA's memory estimate: jax only (torch's Keras backend has no compiled step to read).
ONLY = {"training-memory": ("jax",)}


@pytest.mark.parametrize(
    "backend, check", [pytest.param(b, c, id=f"{b}-{c}") for c in CHECKS for b in ONLY.get(c, BACKENDS)]
)
def test_models_keras_backend(backend, check, tmp_path_factory, request):
    CHECKS[check](part_results(backend, "models", tmp_path_factory, request), backend)


# ------------------------------------------------------------ the subprocess


def _jax_x64(backend: str, enabled: bool) -> bool:
    """Set JAX's x64 mode (jax only); returns the previous setting."""
    if backend != "jax":
        return False
    import jax

    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", enabled)
    return previous


def run(backend: str, tmp: str) -> dict:
    """Every check's measurements on this process's Keras backend (a JSON-able dict)."""
    import re

    import keras
    import numpy as np
    from _models_keras_zoo import (
        ACTIVE,
        SUBLAYERS,
        backbone,
        cached_logits,
        call_layer,
        causal_lm,
        convert_after_fit,
        generate_batch,
        greedy_mismatches,
        inputs,
        layer_params,
        lm_inputs,
        numpy,
        open_gates,
        output,
        rotary,
    )

    import damcha_core as dc
    import damcha_keras as dk
    from damcha_core._reference import apply_map as reference_map

    assert keras.backend.backend() == backend
    keras.utils.set_random_seed(0)  # one set of random weights, run after run
    r: dict = {"backend": backend}

    r["exact_at_init"] = {}
    for arch in ("bert", "vit", "esm", "dinov3"):
        model = backbone(arch)
        x = inputs(arch)
        before = output(model, x)
        dk.convert(model)
        r["exact_at_init"][arch] = bool(np.array_equal(output(model, x), before))

    # Every causal LM, one model each, the layouts' own features active (ACTIVE):
    # exact at init, then with the gates open generate() equals greedy decoding
    # without a cache and call_with_cache step by step equals the full forward.
    # Every full forward has the shape (2, 6) and every cached step (2, 1), as
    # the sections below, so JAX's op-by-op compilation cache stays warm.
    r["call_with_cache_error"], r["generate_mismatches"], lms = {}, {}, {}
    prompts = [[5, 7, 9], [11, 3]]
    for arch in CAUSAL:
        lm = lms[arch] = causal_lm(arch, **ACTIVE.get(arch, {}))
        x = inputs(arch)  # the last row right-padded
        before = numpy(lm(x))
        dk.convert(lm)
        r["exact_at_init"][arch] = bool(np.array_equal(numpy(lm(x)), before))
        open_gates(lm)
        generated = generate_batch(lm, prompts, 6)
        full = numpy(lm({"token_ids": generated, "padding_mask": np.ones_like(generated, bool)}))
        r["generate_mismatches"][arch] = greedy_mismatches(prompts, generated, full)
        r["call_with_cache_error"][arch] = float(
            np.abs(cached_logits(lm, generated) - full).max() / max(1.0, np.abs(full).max())
        )
    for arch in CACHED:
        lm = causal_lm(arch, **ACTIVE.get(arch, {}))
        x = inputs(arch)
        before = numpy(lm(x))
        dk.convert(lm)
        r["exact_at_init"][arch] = bool(np.array_equal(numpy(lm(x)), before))
        open_gates(lm)
        ids = inputs(arch, padded=False)["token_ids"]
        full = numpy(lm(lm_inputs(lm, ids, np.ones_like(ids, bool))))
        r["call_with_cache_error"][arch] = float(
            np.abs(cached_logits(lm, ids) - full).max() / max(1.0, np.abs(full).max())
        )

    # Mixed precision, one case per backend: the converted model under a mixed
    # policy, exact at init, then given the gates-open float32 model's weights,
    # against that model (error relative to the logits' scale); and how far the
    # open maps move the float32 logits, so the bound is known to be tighter
    # than the maps' effect.
    arch, policy = MIXED[backend]
    lm = causal_lm(arch, policy, **ACTIVE.get(arch, {}))
    x = inputs(arch)
    before = numpy(lm(x))
    dk.convert(lm)
    r["mixed_exact_at_init"] = bool(np.array_equal(numpy(lm(x)), before))
    lm.set_weights(lms[arch].get_weights())
    reference = numpy(lms[arch](x))
    scale = max(1.0, float(np.abs(reference).max()))
    r["mixed_error"] = float(np.abs(numpy(lm(x)).astype(np.float32) - reference).max() / scale)
    for gate in dk.damcha_variables(lms[arch], generators=False):
        gate.assign(np.zeros(gate.shape, "float32"))
    r["mixed_map_effect"] = float(np.abs(numpy(lms[arch](x)) - reference).max() / scale)

    r["reference_error_exact"], r["reference_error_rotary_layers"], r["maps_open"] = {}, {}, True
    x64 = _jax_x64(backend, True)  # float64 layers on jax; KerasHub's generate() needs it off again
    rng = np.random.default_rng(3)
    for arch in ("gpt2", "bert", "llama", "esm"):  # ESM: Dense projections (flat features)
        model = backbone(arch, "float64")
        dk.convert(model, metric="lowrank" if arch == "bert" else "heads", metric_rank=2 if arch == "bert" else None)
        open_gates(model)
        errors = []
        for layer in dk.converted_layers(model).values():
            params, config = layer_params(arch, layer)
            x = rng.normal(size=(2, 5, config.query_dim))
            projection = getattr(layer, SUBLAYERS[arch][0])
            y0 = np.einsum("bte,ehd->bthd", x, params["query.kernel"]) + params["query.bias"]
            if arch == "esm":
                # The map of the host's own projection: Keras's float64 Dense rounds to about
                # 1e-7 on torch (its EinsumDense does not), which is the host's, not the map's.
                y0 = numpy(type(projection).call(projection, x)).reshape(y0.shape)
            expected = reference_map(params, config, dc.side_of(config, "q"), x, y0)
            r["maps_open"] &= bool(np.abs(expected - y0).max() > 1e-2)
            got = numpy(projection(x)).reshape(expected.shape)
            errors.append(float(np.abs(got - expected).max()))
            # ESM's layers are bidirectional (its mask hides padded queries, none here).
            mask = np.ones((2, 5, 5), bool) if arch == "esm" else np.tril(np.ones((5, 5), bool))[None].repeat(2, 0)
            ref = dc.damcha_attention(params, config, x, mask=mask[:, None], rotary=rotary(arch, layer, config.key_dim))
            err = float(np.abs(call_layer(arch, layer, x, mask) - ref).max() / max(1.0, np.abs(ref).max()))
            # KerasHub's RoPE angles are float32 in float64 models (and so is Keras's Dense on torch).
            if arch in ("llama", "esm"):
                rotary_errors = r["reference_error_rotary_layers"]
                rotary_errors[arch] = max(rotary_errors.get(arch, 0.0), err)
            else:
                errors.append(err)
        r["reference_error_exact"][arch] = max(errors)
    _jax_x64(backend, x64)

    lm = lms["llama"]
    lm.save(os.path.join(tmp, "lm.keras"))
    loaded = keras.saving.load_model(os.path.join(tmp, "lm.keras"))
    x = inputs("llama")
    r["keras_round_trip"] = bool(
        type(loaded) is type(lm)
        and len(dk.converted_layers(loaded)) == 2
        and np.array_equal(numpy(loaded(x)), numpy(lm(x)))
    )

    model = backbone("gpt2")
    dk.convert(model, share_metric=True)
    open_gates(model)
    model.save_weights(os.path.join(tmp, "gpt2.weights.h5"))
    fresh = dk.convert(backbone("gpt2"), share_metric=True)
    fresh.load_weights(os.path.join(tmp, "gpt2.weights.h5"))
    x = inputs("gpt2")
    r["weights_round_trip"] = bool(np.array_equal(output(fresh, x), output(model, x)))

    bert = backbone("bert")
    dk.convert(bert)
    head = keras.Model(bert.input, keras.layers.Dense(2)(bert(bert.input)["pooled_output"]))
    head.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    head.fit(inputs("bert"), np.array([0, 1]), epochs=2, verbose=0)
    r["fit_gates_moved"] = all(bool(np.abs(numpy(g)).max() > 0) for g in dk.damcha_variables(head, generators=False))
    r["convert_after_fit"] = convert_after_fit()

    with open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "models.md"), encoding="utf-8") as f:
        example = re.search(
            r"<!-- tested: tests/test_models_keras_backends.py -->\s*```python\n(.*?)```", f.read(), re.S
        )
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        exec(compile(example.group(1), "docs/models.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    r["docs_example"] = {"same": bool(namespace["same"]), "moved": bool(namespace["moved"])}
    if backend == "jax":
        r["training_memory"] = _training_memory()
    return r


def _training_memory() -> dict:
    """Temp bytes of a 2-layer GPT-2's compiled training step, host and converted
    (Keras's train_step lowered on its state, as Keras jits it)."""
    import jax
    import keras
    import keras_hub
    import numpy as np

    import damcha_keras as dk

    layers, hidden, n, batch, vocab = 2, 64, 128, 2, 128
    ids = np.random.default_rng(0).integers(1, vocab, (batch, n)).astype("int32")
    x, y = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}, np.roll(ids, -1, 1)

    def temp(convert: bool) -> int:
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocab,
            num_layers=layers,
            num_heads=4,
            hidden_dim=hidden,
            intermediate_dim=4 * hidden,
            dropout=0.0,
            max_sequence_length=n,
        )
        lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        if convert:
            dk.convert(lm)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        lm.compile(optimizer=keras.optimizers.SGD(1e-4), loss=loss, weighted_metrics=[])
        lm.train_on_batch(x, y)  # builds the optimizer's variables, which the state holds
        state = lm._get_jax_state(
            trainable_variables=True, non_trainable_variables=True, optimizer_variables=True, metrics_variables=True
        )
        return int(jax.jit(lm.train_step).lower(state, (x, y)).compile().memory_analysis().temp_size_in_bytes)

    return {"original": temp(False), "damcha": temp(True), "unit": batch * n * hidden * 4, "layers": layers}


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps(run(sys.argv[1], sys.argv[2])))
