"""damcha_keras's canonical-parameter I/O held to the rules of the other ports
(a review of its fidelity, defects 1-5):

1. a stack whose feed-forward Dense layers are quantized (``model.quantize``
   with ``filters``, attention kept float) is refused by name by
   ``stack_to_canonical``, ``damcha_onnx.encoder_from_keras`` and
   ``stack_load_canonical`` (they exported the int8 codes as float kernels);
   LoRA on a feed-forward Dense is merged by ``stack_to_canonical`` (as the
   attention's is) and refused by ``stack_load_canonical`` before anything is
   assigned (it failed with a raw AttributeError after loading block 0);
2. on JAX without ``jax_enable_x64`` a ``dtype="float64"`` layer holds float32:
   values past float32's range are refused, as damcha_jax refuses them (they
   were stored as inf), in a Keras process of its own (the JAX backend);
3. ``DamchaMaps.load_canonical`` (converted models) applies damcha_core's
   ``check_params`` rules: complex, bool and integer arrays are refused (a
   complex gate lost its imaginary part), torch tensors load as in
   ``DamchaAttention.load_canonical`` (detached, bfloat16 widened);
4. ``share_metric=True`` round-trips through Keras for ``metric="none"``
   stacks, as in torch and JAX;
5. a converted model's ``.weights.h5`` records its ``share_metric``: a file
   loaded into a model converted the other way is refused by name (one saved
   with share_metric=False loaded silently into a shared model);
6. so does each ``DamchaAttention`` (whether its generator was handed in as
   ``metric_generator``, as in shared stacks, or is its own): the same silent
   load, of layers or ``stack_from_canonical`` blocks, is refused by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import pytest
from _keras_processes import run_once_locked, shared_dir

import damcha_core as dc
import damcha_keras as dk

E, H, F = 8, 2, 16  # small on purpose


def np_(x: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(x), dtype=np.float64)


def snapshot(layers: Any) -> list[np.ndarray]:
    """Every variable of ``layers`` (a layer or a list), as NumPy copies."""
    layers = layers if isinstance(layers, list) else [layers]
    return [np.array(keras.ops.convert_to_numpy(v)) for layer in layers for v in layer.weights]


def assert_unchanged(layers: Any, before: list[np.ndarray]) -> None:
    after = snapshot(layers)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)


def trained_stack_params(config: dc.EncoderConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Stack params away from their initial values (open gates, non-zero biases)."""
    rng = np.random.default_rng(seed + 100)
    return {
        name: rng.uniform(-0.7, 0.7, size=v.shape) if name.endswith(".gate") else v + 0.2 * rng.normal(size=v.shape)
        for name, v in dc.init_encoder_params(config, seed=seed).items()
    }


def stack_config(**kwargs: Any) -> dc.EncoderConfig:
    attention = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=E // H, **kwargs.pop("attention", {}))
    options: dict[str, Any] = dict(num_layers=2, ffn_dim=F, activation="relu", final_norm=False)
    return dc.EncoderConfig(attention, **{**options, **kwargs})


# ------------------------------------------- 1. quantized / LoRA feed-forward


def _quantized_ffn_stack(mode: str) -> tuple[list[Any], dict[str, np.ndarray]]:
    """A two-block encoder whose feed-forward Dense layers alone are quantized
    (the recipe that keeps the attention float), and float stack params of it."""
    config = stack_config()
    params = trained_stack_params(config)
    blocks = dk.stack_from_canonical(params, config)
    inp = keras.Input((None, E))
    h = inp
    for block in blocks:
        h = block(h)
    model = keras.Model(inp, h)
    model.quantize(mode, filters=r"feedforward_\w+_dense")  # the two Dense layers of each block
    quantized = sorted(layer.path for layer in model._flatten_layers() if getattr(layer, "quantization_mode", None))
    assert len(quantized) == 4 and all("feedforward" in path for path in quantized), quantized
    return blocks, params


def _export_onnx(blocks: list[Any], params: dict[str, np.ndarray]) -> Any:
    import damcha_onnx as do

    return do.encoder_from_keras(blocks)


QUANTIZED_CALLS = {
    "stack_to_canonical": lambda blocks, params: dk.stack_to_canonical(blocks),
    "encoder_from_keras": _export_onnx,
    "stack_load_canonical": lambda blocks, params: dk.stack_load_canonical(blocks, params),
    "block_to_canonical": lambda blocks, params: blocks[1].to_canonical(),
}


@pytest.mark.parametrize("call", list(QUANTIZED_CALLS))
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_feedforward_is_refused_by_name(mode: str, call: str) -> None:
    """The canonical weights of a quantized Dense would be its integer codes (a
    silently wrong export); the attention's projections are refused the same way."""
    blocks, params = _quantized_ffn_stack(mode)
    before = snapshot(blocks)
    with pytest.raises(
        dc.DamchaValueError,
        match=rf"Invalid argument `blocks`: .*float feed-forward Dense layers.*'feedforward_\w+_dense' is quantized, {mode}",
    ):
        QUANTIZED_CALLS[call](blocks, params)
    assert_unchanged(blocks, before)


def _lora_stack(target: str) -> tuple[list[Any], dc.EncoderConfig]:
    config = stack_config()
    blocks = dk.stack_from_canonical(trained_stack_params(config), config, dtype="float64")
    index, attr = target.split("-")
    dense = getattr(blocks[int(index[-1])], f"_{attr}")
    dense.enable_lora(2)
    rng = np.random.default_rng(5)
    dense.lora_kernel_b.assign(rng.normal(size=dense.lora_kernel_b.shape))  # B starts at 0: no update to merge
    return blocks, config


LORA_TARGETS = ["block0-ffn_in", "block1-ffn_out"]


@pytest.mark.parametrize("target", LORA_TARGETS)
def test_lora_feedforward_is_merged_on_export_and_refused_on_load(target: str) -> None:
    """stack_to_canonical reads the merged kernel, as the attention's to_canonical
    merges its projections' (the reference on those params is the model's own
    forward); stack_load_canonical refuses the block by name, as the attention's
    load refuses LoRA (a sum: no one variable to assign), with every block as it
    was (block 0's attention had been loaded before a raw AttributeError)."""
    blocks, config = _lora_stack(target)
    params, got_config = dk.stack_to_canonical(blocks)
    assert got_config == config
    x = np.random.default_rng(1).normal(size=(2, 5, E))
    y = x
    for block in blocks:
        y = block(y)
    np.testing.assert_allclose(dc.encoder_forward(params, config, x), np_(y), rtol=0, atol=1e-10)
    before = snapshot(blocks)
    dense = "feedforward_intermediate_dense" if target.endswith("ffn_in") else "feedforward_output_dense"
    with pytest.raises(dc.DamchaValueError, match=rf"Invalid argument `blocks`: .*LoRA enabled on '{dense}'"):
        dk.stack_load_canonical(blocks, trained_stack_params(config, seed=7))
    assert_unchanged(blocks, before)


# --------------------------------- 2. JAX without x64: float64 holds float32

JAX_CASES = ["from_canonical", "load_canonical", "stack_load_canonical"]


def _jax_float64_results() -> dict[str, Any]:
    """Run in a Keras process on JAX with x64 off (``python THIS_FILE jax``)."""
    import warnings

    import jax

    warnings.simplefilter("ignore", UserWarning)  # JAX's own "float64 is not available"
    assert keras.backend.backend() == "jax" and not jax.config.jax_enable_x64
    config = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=E // H)
    rng = np.random.default_rng(0)
    params = {
        k: rng.uniform(-0.7, 0.7, v.shape) if k.endswith(".gate") else v + 0.2 * rng.normal(size=v.shape)
        for k, v in dc.init_params(config).items()
    }
    big = {**params, "metric.qk.bias": params["metric.qk.bias"].copy()}
    big["metric.qk.bias"][0, 0] = 1e39  # finite in float64, inf in float32
    out: dict[str, Any] = {}

    def attempt(case: str, call: Any, layers: Any = None) -> None:
        before = snapshot(layers) if layers is not None else None
        try:
            call()
            out[case] = {"refused": None}
        except dc.DamchaError as exc:
            out[case] = {"refused": f"{type(exc).__name__}: {exc}"}
        if before is not None:
            after = snapshot(layers)
            out[case]["unchanged"] = all(np.array_equal(a, b) for a, b in zip(after, before))

    attempt("from_canonical", lambda: dk.DamchaAttention.from_canonical(big, config, dtype="float64"))
    layer = dk.DamchaAttention.from_canonical(params, config, dtype="float64")
    attempt("load_canonical", lambda: layer.load_canonical(big), layer)
    x = rng.normal(size=(2, 5, E))
    out["load_canonical"]["stored"] = str(layer.metric_generators["qk"].bias.value.dtype)
    # The rule refuses only what float32 cannot hold: the layer computes the reference's output.
    out["load_canonical"]["max_error"] = float(np.abs(np_(layer(x, x)) - dc.damcha_attention(params, config, x)).max())
    stack = stack_config()
    stack_params = trained_stack_params(stack)
    blocks = dk.stack_from_canonical(stack_params, stack, dtype="float64")
    bad = {**stack_params, "layers.1.ffn.out.bias": np.full(E, 1e39)}
    attempt("stack_load_canonical", lambda: dk.stack_load_canonical(blocks, bad), blocks)
    return out


@pytest.fixture(scope="session")
def jax_results(tmp_path_factory: Any) -> dict[str, Any]:
    """The JAX process's results, computed once per test session (the first xdist
    worker to ask runs the process, the other reads its JSON)."""
    shared = shared_dir(tmp_path_factory)
    out = shared / "keras-canonical-hardening-jax.json"

    def run() -> None:
        env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
        env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "jax"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=Path(__file__).resolve().parent,
        )
        result = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None
        out.write_text(result or json.dumps({"crashed": done.stderr[-6000:]}))

    run_once_locked(out, shared / "keras-canonical-hardening-jax.lock", run)
    results: dict[str, Any] = json.loads(out.read_text())
    assert "crashed" not in results, results["crashed"]
    return results


@pytest.mark.parametrize("case", JAX_CASES)
def test_jax_float64_without_x64_is_checked_against_float32(case: str, jax_results: dict[str, Any]) -> None:
    """dtype="float64" on JAX without jax_enable_x64 holds float32: a 1e39 weight
    passed float64's range check and was stored as inf (every output NaN).
    Refused with damcha_jax's wording (commit d9c01cc), the layer unchanged."""
    result = jax_results[case]
    if case == "load_canonical":  # float32 held; params that fit load and compute the reference's output
        assert result["stored"] == "float32" and result["max_error"] < 1e-5, result
    assert result["refused"] is not None, result
    assert result["refused"].startswith("DamchaValueError: Invalid argument `params["), result
    assert "expected values that round to a finite float32 (float64 without jax_enable_x64)" in result["refused"]
    assert result.get("unchanged", True), result


# ------------------------------------------- 3. DamchaMaps.load_canonical


def _converted_maps() -> Any:
    inp = keras.Input((None, E))
    model = keras.Model(inp, keras.layers.MultiHeadAttention(H, E // H, name="att")(inp, inp))
    dk.convert(model)
    return next(iter(dk.converted_layers(model).values())).damcha


REFUSED_VALUES = {
    "complex-gate": ("metric.qk.gate", lambda v: v + 3j),
    "bool-gate": ("metric.qk.gate", lambda v: v > 0),
    "int-kernel": ("metric.qk.kernel", lambda v: np.ones(v.shape, dtype=np.int64)),
    "complex-list-bias": ("metric.qk.bias", lambda v: (v + 1j).tolist()),
}


@pytest.mark.parametrize("kind", list(REFUSED_VALUES))
def test_maps_load_canonical_refuses_non_real_float_values(kind: str) -> None:
    """As every other load_canonical (damcha_core's check_params): a complex gate
    lost its imaginary part, bool and integer arrays loaded as numbers."""
    maps = _converted_maps()
    params = maps.to_canonical()
    params = {k: v + 0.25 for k, v in params.items()}
    maps.load_canonical(params)
    before = snapshot(maps)
    name, change = REFUSED_VALUES[kind]
    bad = {**params, name: change(params[name])}
    with pytest.raises(dc.DamchaTypeError, match=rf"Invalid argument `params\['{name}'\]`: expected a real floating"):
        maps.load_canonical(bad)
    assert_unchanged(maps, before)


def _tf_value(v: np.ndarray, dtype: str, variable: bool) -> Any:
    import tensorflow as tf

    value = tf.constant(v, getattr(tf, dtype))
    return tf.Variable(value) if variable else value


FRAMEWORK_VALUES = {
    "torch-requires-grad": lambda v: __import__("torch").tensor(v, requires_grad=True),
    "torch-bfloat16": lambda v: __import__("torch").tensor(v).to(__import__("torch").bfloat16),
    # A tf.DType is not a NumPy dtype (np.dtype(tf.float32) raises): these were refused as not floats.
    "tf-float32": lambda v: _tf_value(v, "float32", False),
    "tf-variable": lambda v: _tf_value(v, "float32", True),
    "tf-bfloat16": lambda v: _tf_value(v, "bfloat16", False),
}


@pytest.mark.parametrize("kind", list(FRAMEWORK_VALUES))
def test_maps_load_canonical_reads_framework_tensors_as_the_layer_does(kind: str) -> None:
    """A torch gate that requires grad (RuntimeError) or is bfloat16 (TypeError), and
    TensorFlow tensors and variables (refused as not real floats), load as
    DamchaAttention.load_canonical loads them: detached, 16-bit widened."""
    maps = _converted_maps()
    params = maps.to_canonical()
    gate = np.array([0.5, -0.25])
    maps.load_canonical({**params, "metric.qk.gate": FRAMEWORK_VALUES[kind](gate)})
    layer = dk.DamchaAttention.from_canonical(
        dc.init_params(dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=E // H)),
        dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=E // H),
    )
    layer.load_canonical({**layer.to_canonical(), "metric.qk.gate": FRAMEWORK_VALUES[kind](gate)})
    np.testing.assert_array_equal(maps.to_canonical()["metric.qk.gate"], gate)
    np.testing.assert_array_equal(layer.to_canonical()["metric.qk.gate"], gate)


# ------------------------------------- 4. share_metric of metric="none" stacks


@pytest.mark.parametrize("layers", [1, 2], ids=["one-layer", "two-layers"])
def test_metric_none_stack_keeps_share_metric(layers: int) -> None:
    """torch and JAX keep the flag of a stack with no generator (it round-trips);
    Keras returned share_metric=False for every metric="none" stack."""
    for share in (True, False):
        config = stack_config(attention=dict(metric="none"), num_layers=layers, share_metric=share, final_norm=True)
        params = trained_stack_params(config)
        got, got_config = dk.stack_to_canonical(dk.stack_from_canonical(params, config))
        assert got_config == config
        assert list(got) == list(params)
        for name, value in params.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7)
        if layers == 1:  # the block's own methods too
            one = dc.EncoderConfig(**{**config.__dict__, "final_norm": False})
            single = {k: v for k, v in params.items() if not k.startswith("final_norm.")}
            assert dk.TransformerEncoder.from_canonical(single, one).to_canonical()[1] == one


# --------------------------------------- 5. .weights.h5 and share_metric


def _converted_model(share: bool, seed: int, layers: int = 2) -> Any:
    """``layers`` converted MultiHeadAttention layers, their DAMCHA weights random."""
    inp = keras.Input((None, E))
    h = inp
    for i in range(layers):
        h = keras.layers.MultiHeadAttention(H, E // H, name=f"att{i}", seed=i)(h, h)
    model = dk.convert(keras.Model(inp, h), share_metric=share)
    rng = np.random.default_rng(seed)
    for v in dk.damcha_variables(model):
        v.assign(np_(v) + 0.5 * rng.normal(size=v.shape))
    return model


SHARING = {"unshared-into-shared": (False, True), "shared-into-unshared": (True, False)}


def _strip_sharing_records(path: Path) -> None:
    """The file as saved before the layout was recorded."""
    import h5py

    with h5py.File(path, "a") as f:
        found: list[str] = []
        f.visit(lambda name: found.append(name) if name.endswith("/damcha_share_metric") else None)
        assert len(found) == 2, found  # one per converted layer
        for name in found:
            del f[name]


@pytest.mark.parametrize("case", list(SHARING))
def test_weights_file_records_share_metric(case: str, tmp_path: Path) -> None:
    """A file saved with share_metric=False loaded silently into a model converted
    with share_metric=True (Keras loads a shared generator once and ignores the
    other layers' entries; the other way Keras refused without naming why): now
    refused by name both ways (Keras wraps the error in its own ValueError). A
    model converted as the file was loads it bit for bit, and so does a file
    saved before the layout was recorded."""
    saved, loaded = SHARING[case]
    model = _converted_model(saved, seed=0)
    x = np.random.default_rng(1).normal(size=(2, 5, E)).astype("float32")
    path = tmp_path / "m.weights.h5"
    model.save_weights(path)
    word = "generators shared by the converted layers" if saved else "generators of each layer's own"
    with pytest.raises(
        ValueError, match=rf"Invalid argument `share_metric`: expected the sharing the weights were saved with: {word}"
    ):
        _converted_model(loaded, seed=3).load_weights(path)
    for record in (True, False):
        if not record:
            _strip_sharing_records(path)
        fresh = _converted_model(saved, seed=3)
        fresh.load_weights(path)
        np.testing.assert_array_equal(np_(fresh(x)), np_(model(x)))


# ------------------------- 6. .weights.h5 and a DamchaAttention's shared generator


def _attention_model(share: bool, seed: int, builder: str) -> Any:
    """Two DamchaAttention layers (``builder="layers"``) or two stack blocks
    (``"stack"``, ``stack_from_canonical``), one generator handed to both when
    ``share``; every weight random."""
    inp = keras.Input((None, E))
    h = inp
    if builder == "stack":
        config = stack_config(share_metric=share)
        for block in dk.stack_from_canonical(dc.init_encoder_params(config, seed=seed), config):
            h = block(h)
    else:
        shared = dk.MetricGenerator(H, name="shared_metric_qk") if share else None
        for i in range(2):
            h = dk.DamchaAttention(H, E // H, metric_generator=shared, name=f"att{i}", seed=i)(h, h)
    model = keras.Model(inp, h)
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(np_(v) + 0.5 * rng.normal(size=v.shape))
    return model


def _generator_records(path: Path, strip: bool = False) -> list[int]:
    """The recorded layout of each attention layer in the file (1: shared), in
    file order; ``strip`` deletes them (the file as saved before they were)."""
    import h5py

    with h5py.File(path, "a" if strip else "r") as f:
        found: list[str] = []
        f.visit(lambda name: found.append(name) if name.endswith("/damcha_shared_generator") else None)
        records = [int(np.asarray(f[name])) for name in found]
        if strip:
            for name in found:
                del f[name]
    return records


ATTENTION_SHARING = ["unshared-into-shared", "shared-into-unshared", "matching", "old-format"]


# Keras's own note when a refused layer leaves the model's container of operations unvisited.
@pytest.mark.filterwarnings("ignore:Skipping nested container:UserWarning")
@pytest.mark.parametrize("builder", ["layers", "stack"])
@pytest.mark.parametrize("case", ATTENTION_SHARING)
def test_attention_weights_file_records_shared_generator(case: str, builder: str, tmp_path: Path) -> None:
    """A file saved from layers with their own generators loaded silently into
    layers sharing one (Keras loads the shared generator once, from the first
    layer's entry, and ignores the others': other outputs); the other way Keras
    refused without naming why. Each layer records its layout and a mismatch is
    refused by name (Keras wraps the error in its own ValueError); layers built
    as saved load bit for bit, and so does a file saved before the record."""
    x = np.random.default_rng(1).normal(size=(2, 5, E)).astype("float32")
    path = tmp_path / "m.weights.h5"
    if case in ("unshared-into-shared", "shared-into-unshared"):
        saved = case == "shared-into-unshared"
        _attention_model(saved, seed=0, builder=builder).save_weights(path)
        word = "a generator shared with other layers" if saved else "a generator of its own"
        with pytest.raises(
            ValueError,
            match=rf"Invalid argument `metric_generator`: expected the generator layout the weights were saved with: "
            rf"{word}",
        ):
            _attention_model(not saved, seed=3, builder=builder).load_weights(path)
        return
    for share in (False, True):
        model = _attention_model(share, seed=0, builder=builder)
        model.save_weights(path)
        records = _generator_records(path, strip=case == "old-format")
        assert records == [int(share)] * 2, records  # one per attention layer
        fresh = _attention_model(share, seed=3, builder=builder)
        fresh.load_weights(path)
        np.testing.assert_array_equal(np_(fresh(x)), np_(model(x)))


def _single_attention(handed: bool, seed: int) -> Any:
    """One DamchaAttention, handed a generator of its own (``handed``) or making one."""
    inp = keras.Input((None, E))
    generator = dk.MetricGenerator(H, name="given_metric_qk") if handed else None
    model = keras.Model(inp, dk.DamchaAttention(H, E // H, metric_generator=generator, name="att0", seed=0)(inp, inp))
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(np_(v) + 0.5 * rng.normal(size=v.shape))
    return model


@pytest.mark.filterwarnings("ignore:Skipping nested container:UserWarning")
def test_the_record_is_whether_another_layer_maps_with_the_generator(tmp_path: Path) -> None:
    """The record says whether another layer maps with the generator (what decides
    where Keras saves it), not whether one was handed in: a single layer handed a
    generator loads a file of one that made its own and back, and a one-layer model
    converted with share_metric=True one converted without it, bit for bit (both
    were refused); a clone of a shared pair, whose layers each hold a copy, no
    longer loads silently into the shared original."""
    x = np.random.default_rng(1).normal(size=(2, 5, E)).astype("float32")
    path = tmp_path / "m.weights.h5"
    builders = {
        "single-layer": lambda flag, seed: _single_attention(flag, seed),
        "one-converted-layer": lambda flag, seed: _converted_model(flag, seed, layers=1),
    }
    for build in builders.values():
        for saved in (True, False):
            model = build(saved, 0)
            model.save_weights(path)
            fresh = build(not saved, 3)
            fresh.load_weights(path)
            np.testing.assert_array_equal(np_(fresh(x)), np_(model(x)))
    shared = _attention_model(True, seed=0, builder="layers")
    clone = keras.models.clone_model(shared)
    gens = {id(layer._generators["qk"]) for layer in clone.layers if isinstance(layer, dk.DamchaAttention)}
    assert len(gens) == 2  # the clone's layers each hold a copy
    rng = np.random.default_rng(5)
    for v in clone.weights:
        v.assign(np_(v) + 0.5 * rng.normal(size=v.shape))
    clone.save_weights(path)
    with pytest.raises(ValueError, match=r"`metric_generator`.*saved with: a generator of its own"):
        shared.load_weights(path)


if __name__ == "__main__":  # the JAX process of test_jax_float64_without_x64_is_checked_against_float32
    assert sys.argv[1:] == ["jax"], sys.argv
    print(json.dumps(_jax_float64_results()))
