"""One-layer stacks in damcha_core's stack format, in every port.

damcha_core (the spec) names a stack's generator ``shared.metric.*`` whenever
``share_metric=True``, one layer included (``EncoderConfig.param_shapes``); the
ports used to derive ``share_metric=False`` for a lone layer, so a one-layer
shared stack could not be loaded (``layers.0.attention.metric.*`` expected) and
did not export the core's names. Each port here builds/loads the core's params
for ``num_layers=1`` with and without sharing, is held to
``damcha_core.encoder_forward`` in float64, and gives the same names, values
and config back. Keras runs on TensorFlow in this process (test_cross_port's
convention); JAX inside ``jax.enable_x64``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import damcha_core as dc
import damcha_jax as dj
import damcha_keras as dk
import damcha_torch as dt

E, H, D, F = 8, 2, 4, 12  # small on purpose
KINDS = {
    "heads-tied": dict(metric="heads"),
    "lowrank-separate": dict(metric="lowrank", metric_rank=2, coupling="separate"),  # two generator sides
}
# The activation each port computes exactly in float64: JAX's blocks use nnx.gelu
# (the tanh form); Keras's float64 gelu is good to ~5e-9 only (float32 constants).
ACTIVATION = {"torch": "gelu", "jax": "gelu_tanh", "keras": "relu"}


@pytest.fixture
def x64() -> Iterator[None]:
    # Scoped: the rest of this process stays float32.
    with jax.enable_x64(True):
        yield


def _stack(port: str, kind: str, share: bool) -> tuple[dict[str, np.ndarray], dc.EncoderConfig]:
    attention = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D, **KINDS[kind])
    config = dc.EncoderConfig(attention, num_layers=1, ffn_dim=F, share_metric=share, activation=ACTIVATION[port])
    params = dc.init_encoder_params(config, seed=5)
    for name in params:  # open gates: a port that dropped the generator would fail
        if name.endswith(".gate"):
            params[name] = np.linspace(0.4, 0.9, params[name].size)
    assert ("shared.metric." + ("qk" if kind == "heads-tied" else "q") + ".kernel" in params) == share
    return params, config


def _assert_round_trip(got: dict[str, np.ndarray], got_config: dc.EncoderConfig, params: dict, config: Any) -> None:
    assert got_config == config
    assert list(got) == list(params)  # the core's names, in its order
    for name, value in params.items():
        assert got[name].dtype == np.float64, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def _x() -> np.ndarray:
    return np.random.default_rng(3).normal(size=(2, 3, E))


@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_torch_one_layer_stack(kind: str, share: bool) -> None:
    params, config = _stack("torch", kind, share)
    x = _x()
    enc = dt.DamchaTransformerEncoder.from_canonical(params, config, dtype=torch.float64).eval()
    with torch.no_grad():
        got = enc(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, dc.encoder_forward(params, config, x), rtol=1e-12, atol=1e-12)
    _assert_round_trip(*enc.to_canonical(), params, config)
    # build_encoder's one-layer stack is the same stack: it loads the core's params and gives them back.
    built = dt.build_encoder(
        E, H, 1, dim_feedforward=F, dropout=0.0, activation="gelu", norm_first=True, final_norm=True,
        share_metric=share, dtype=torch.float64, key_dim=D, **KINDS[kind],
    )  # fmt: skip
    assert built.load_canonical(params) is built
    _assert_round_trip(*built.to_canonical(), params, config)


@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_jax_one_layer_stack(kind: str, share: bool, x64: None) -> None:
    # 2-4 s each, the first ~10 s, on 2 loaded cores: x64 compiles every JAX op afresh (parameter init
    # included); the forward is one nnx.jit so that it compiles once, not per op.
    params, config = _stack("jax", kind, share)
    x = _x()
    enc = dj.DamchaEncoder.from_canonical(params, config, dtype=jnp.float64, param_dtype=jnp.float64)
    got = np.asarray(nnx.jit(lambda m, x: m(x))(enc, jnp.asarray(x)))
    np.testing.assert_allclose(got, dc.encoder_forward(params, config, x), rtol=1e-12, atol=1e-12)
    _assert_round_trip(*enc.to_canonical(), params, config)
    # load_canonical in place (from_canonical's own path) of a copy with other values.
    moved = {name: value + 0.25 for name, value in params.items()}
    assert enc.load_canonical(moved) is enc
    _assert_round_trip(*enc.to_canonical(), moved, config)


@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_keras_one_layer_stack(kind: str, share: bool) -> None:
    params, config = _stack("keras", kind, share)
    x = _x()
    layers = dk.stack_from_canonical(params, config, dtype="float64")
    h: Any = x
    for layer in layers:
        h = layer(h)
    np.testing.assert_allclose(np.asarray(h), dc.encoder_forward(params, config, x), rtol=1e-12, atol=1e-12)
    _assert_round_trip(*dk.stack_to_canonical(layers), params, config)
    assert dk.stack_load_canonical(layers, params) is layers
    # The block alone keeps the rule (its generator was handed to it when shared);
    # a block that made its own generator is a one-layer stack that does not share.
    one, one_config = layers[0].to_canonical()
    assert (
        one_config.share_metric == share
        and ("shared.metric." + next(iter(config.attention.metric_sides)) + ".kernel" in one) == share
    )
    own = type(layers[0])(F, H, key_dim=D, dtype="float64", **KINDS[kind])
    own(x)
    assert not own.to_canonical()[1].share_metric


def test_jax_from_canonical_names_what_the_encoder_cannot_compute() -> None:
    attention = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D)
    config = dc.EncoderConfig(attention, num_layers=1, ffn_dim=F, activation="relu")
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `config`.*config.activation='relu'"):
        dj.DamchaEncoder.from_canonical(dc.init_encoder_params(config), config)
