"""Every port's fresh layer draws from the initialisers documented in
damcha_core._params (the spec says the distributions, not the values, are shared):
compare each canonical tensor's spread with the distribution's std."""

from __future__ import annotations

import math

import numpy as np
import pytest

import damcha_core as dc

E, H, d, r = 192, 6, 32, 16
STRUCTURES = {"heads": {}, "lowrank": {"metric": "lowrank", "metric_rank": r}}


def expected_std(name: str, shape: tuple[int, ...], metric: str) -> float:
    """The std of the documented initialiser of canonical tensor ``name`` (docs/spec.md
    section 4), written out here rather than read from damcha_core's table."""
    group, leaf = name.rsplit(".", 1)
    if leaf in ("bias", "gate"):
        return 0.0
    if group == "output":
        fan_in, fan_out = shape[0] * shape[1], shape[2]
    elif not group.startswith("metric."):
        fan_in, fan_out = shape[0], shape[1] * shape[2]
    elif metric == "heads":  # generator kernel (E, S, S)
        return 1.0 / math.sqrt(shape[0] * shape[1])
    elif leaf == "kernel":  # lowrank (E, r)
        return 1.0 / math.sqrt(shape[0])
    elif leaf == "u":  # (S, d, r)
        return 1.0 / math.sqrt(shape[2])
    else:  # lowrank v (S, d, r)
        return 1.0 / math.sqrt(shape[0] * shape[1])
    return math.sqrt(6.0 / (fan_in + fan_out)) / math.sqrt(3.0)  # uniform(-a, a) has std a/sqrt(3)


def check(params: dict[str, np.ndarray], metric: str) -> None:
    cfg = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=d, **STRUCTURES[metric])
    assert set(params) == set(cfg.param_shapes())
    for name, shape in cfg.param_shapes().items():
        value = np.asarray(params[name], dtype=np.float64)
        assert value.shape == shape, name
        std = expected_std(name, shape, metric)
        if std == 0.0:
            assert np.all(value == 0), name
        else:
            assert np.std(value) == pytest.approx(std, rel=0.06), name
            assert abs(np.mean(value)) < 4 * std / math.sqrt(value.size), name


@pytest.mark.parametrize("metric", list(STRUCTURES))
def test_reference_init_matches_documented_distributions(metric):
    cfg = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=d, **STRUCTURES[metric])
    check(dc.init_params(cfg, seed=0), metric)


@pytest.mark.parametrize("metric", list(STRUCTURES))
def test_torch_init_matches_documented_distributions(metric):
    import torch

    from damcha_torch import DamchaAttention

    torch.manual_seed(0)
    check(DamchaAttention(E, H, batch_first=True, **STRUCTURES[metric]).to_canonical(), metric)


@pytest.mark.parametrize("metric", list(STRUCTURES))
def test_jax_init_matches_documented_distributions(metric):
    from flax import nnx

    import damcha_jax as dj

    check(dj.DamchaAttention(num_heads=H, in_features=E, rngs=nnx.Rngs(0), **STRUCTURES[metric]).to_canonical(), metric)


@pytest.mark.parametrize("metric", list(STRUCTURES))
def test_keras_init_matches_documented_distributions(metric):
    import keras

    from damcha_keras import DamchaAttention

    # As in keras.layers.MultiHeadAttention, ``seed`` seeds dropout and this project's
    # own initialisers only; the projections' default initialisers draw from Keras'
    # global generator, so pin it: an unpinned draw made this 4-sigma check flaky
    # (it failed once in CI, mean 4.05 sigma from 0 on key.kernel).
    keras.utils.set_random_seed(0)
    layer = DamchaAttention(num_heads=H, key_dim=d, seed=0, **STRUCTURES[metric])
    x = np.zeros((1, 2, E), dtype="float32")
    layer(x, x)
    check(layer.to_canonical(), metric)
