"""damcha_keras.convert on the jax and torch Keras backends.

Keras fixes its backend at import, so each backend runs this file as a script
in its own subprocess (``python tests/test_models_keras_backends.py BACKEND
TMPDIR``); the pytest side launches it and asserts on the JSON it prints.
tests/test_models_keras.py covers tensorflow (in process) in more depth.

Per backend: GPT-2, BERT, Llama, Gemma and ViT backbones exact at init (bit for bit); with
the gates open, every converted layer of GPT-2 and BERT equals the reference
damcha_attention and every mapped q/k of Llama the reference's maps (float64;
jax in x64 mode for that part), the whole Llama layer within float32 RoPE rounding;
greedy generate() with the cache equals greedy decoding without it (GPT-2,
Llama) and call_with_cache the full forward (Llama); fit moves the gates;
.weights.h5 and .keras files round-trip; the docs' Keras example runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BACKENDS = ("jax", "torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_models_keras_backend(backend, tmp_path):
    env = {**os.environ, "KERAS_BACKEND": backend}
    if backend == "jax":
        # Compile time, not run time, dominates tiny models: cheaper codegen (as test_keras_backends).
        env.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
    proc = subprocess.run(
        [sys.executable, __file__, backend, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
        cwd=os.path.dirname(__file__),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["backend"] == backend
    assert r["exact_at_init"] == {"gpt2": True, "bert": True, "llama": True, "gemma": True, "vit": True}, r
    assert max(r["reference_error_exact"].values()) <= 1e-12, r
    assert r["reference_error_llama_layer"] <= 1e-6, r
    assert r["maps_open"], r
    assert r["generate_equals_greedy"] == {"gpt2": True, "llama": True}, r
    assert r["call_with_cache_error"] <= 1e-5, r
    assert r["fit_gates_moved"], r
    assert r["weights_round_trip"] and r["keras_round_trip"], r
    assert r["docs_example"] == {"same": True, "moved": True}, r


# ------------------------------------------------------------ the subprocess


def _jax_x64(backend: str, enabled: bool) -> bool:
    """Set JAX's x64 mode (jax only); returns the previous setting."""
    if backend != "jax":
        return False
    import jax

    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", enabled)
    return previous


def main(backend: str, tmp: str) -> dict:
    import re

    import keras
    import numpy as np
    from _models_keras_zoo import (
        SUBLAYERS,
        backbone,
        cached_logits,
        call_layer,
        causal_lm,
        greedy_generate,
        greedy_without_cache,
        inputs,
        layer_params,
        numpy,
        open_gates,
        output,
        rotary,
    )

    import damcha_core as dc
    import damcha_keras as dk
    from damcha_core._reference import apply_map as reference_map

    assert keras.backend.backend() == backend
    r: dict = {"backend": backend}

    r["exact_at_init"] = {}
    for arch in ("gpt2", "bert", "llama", "gemma", "vit"):
        model = backbone(arch)
        x = inputs(arch)
        before = output(model, x)
        dk.convert(model)
        r["exact_at_init"][arch] = bool(np.array_equal(output(model, x), before))

    r["reference_error_exact"], r["maps_open"] = {}, True
    x64 = _jax_x64(backend, True)  # float64 layers on jax; KerasHub's generate() needs it off again
    rng = np.random.default_rng(3)
    for arch in ("gpt2", "bert", "llama"):
        model = backbone(arch, "float64")
        dk.convert(model, metric="lowrank" if arch == "bert" else "heads", metric_rank=2 if arch == "bert" else None)
        open_gates(model)
        errors = []
        for layer in dk.converted_layers(model).values():
            params, config = layer_params(arch, layer)
            x = rng.normal(size=(2, 5, config.query_dim))
            y0 = np.einsum("bte,ehd->bthd", x, params["query.kernel"]) + params["query.bias"]
            expected = reference_map(params, config, dc.side_of(config, "q"), x, y0)
            r["maps_open"] &= bool(np.abs(expected - y0).max() > 1e-2)
            errors.append(float(np.abs(numpy(getattr(layer, SUBLAYERS[arch][0])(x)) - expected).max()))
            mask = np.tril(np.ones((5, 5), bool))[None].repeat(2, 0)
            ref = dc.damcha_attention(params, config, x, mask=mask[:, None], rotary=rotary(arch, layer, config.key_dim))
            err = float(np.abs(call_layer(arch, layer, x, mask) - ref).max() / max(1.0, np.abs(ref).max()))
            if arch == "llama":  # KerasHub's RoPE angles are float32 even in float64 models
                r["reference_error_llama_layer"] = max(r.get("reference_error_llama_layer", 0.0), err)
            else:
                errors.append(err)
        r["reference_error_exact"][arch] = max(errors)
    _jax_x64(backend, x64)

    r["generate_equals_greedy"] = {}
    for arch in ("gpt2", "llama"):
        lm = causal_lm(arch)
        dk.convert(lm)
        open_gates(lm)
        r["generate_equals_greedy"][arch] = greedy_generate(lm, [5, 7, 9], 8) == greedy_without_cache(lm, [5, 7, 9], 8)
        if arch == "llama":
            ids = inputs(arch, batch=1, length=5, padded=False)["token_ids"]
            full = numpy(lm({"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}))
            r["call_with_cache_error"] = float(
                np.abs(cached_logits(lm, ids) - full).max() / max(1.0, np.abs(full).max())
            )

            lm.save(os.path.join(tmp, "lm.keras"))
            loaded = keras.saving.load_model(os.path.join(tmp, "lm.keras"))
            x = inputs(arch)
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
    return r


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
