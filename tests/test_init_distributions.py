"""Every port's fresh layer draws from the initialisers documented in
damcha_core._params (the spec says the distributions, not the values, are shared):
compare each canonical tensor's spread with the distribution's std."""

from __future__ import annotations

import math

import numpy as np
import pytest

import damcha_core as dc

E, H, d = 192, 6, 32
CFG = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=d)


def expected_std(name: str, shape: tuple[int, ...]) -> float:
    """The std of the documented initialiser of canonical tensor ``name``."""
    group, leaf = name.rsplit(".", 1)
    if leaf in ("bias", "gate"):
        return 0.0
    if group == "output":
        fan_in, fan_out = shape[0] * shape[1], shape[2]
    elif not group.startswith("metric."):
        fan_in, fan_out = shape[0], shape[1] * shape[2]
    else:  # heads generator kernel (E, S, S)
        return 1.0 / math.sqrt(shape[0] * shape[1])
    return math.sqrt(6.0 / (fan_in + fan_out)) / math.sqrt(3.0)  # uniform(-a, a) has std a/sqrt(3)


def check(params: dict[str, np.ndarray]) -> None:
    assert set(params) == set(CFG.param_shapes())
    for name, shape in CFG.param_shapes().items():
        value = np.asarray(params[name], dtype=np.float64)
        assert value.shape == shape, name
        std = expected_std(name, shape)
        if std == 0.0:
            assert np.all(value == 0), name
        else:
            assert np.std(value) == pytest.approx(std, rel=0.06), name
            assert abs(np.mean(value)) < 4 * std / math.sqrt(value.size), name


def test_reference_init_matches_documented_distributions():
    check(dc.init_params(CFG, seed=0))


def test_torch_init_matches_documented_distributions():
    import torch

    from damcha_torch import DamchaAttention

    torch.manual_seed(0)
    check(DamchaAttention(E, H, batch_first=True).to_canonical())


def test_jax_init_matches_documented_distributions():
    from flax import nnx

    import damcha_jax as dj

    check(dj.DamchaAttention(num_heads=H, in_features=E, rngs=nnx.Rngs(0)).to_params())


def test_keras_init_matches_documented_distributions():
    from damcha_keras import DamchaAttention

    layer = DamchaAttention(num_heads=H, key_dim=d, seed=0)
    x = np.zeros((1, 2, E), dtype="float32")
    layer(x, x)
    check(layer.to_canonical())
