"""Key and value inputs of different feature sizes (config.value_input_dim, E_v),
against the independent naive loops."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _naive import naive_damcha, naive_metric_penalty

import damcha_core as dc

CASES = {
    "heads-separate": dict(metric="heads", coupling="separate", context_dim=6, num_kv_heads=2),
    "lowrank-query": dict(metric="lowrank", metric_rank=3, coupling="query", context_dim=5),
    "heads-tied": dict(metric="heads", coupling="tied"),
    "none": dict(metric="none", num_kv_heads=1),
}


def _setup(name, E_v=7, seed=0):
    cfg = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=2, value_dim=3, value_input_dim=E_v, **CASES[name])
    rng = np.random.default_rng(seed)
    params = dc.init_params(cfg, seed=seed)
    for k in params:
        if k.startswith("metric.") or k.endswith(".bias"):
            params[k] = rng.normal(size=params[k].shape)
    x = rng.normal(size=(2, 3, 8))
    c = rng.normal(size=(2, 5, cfg.context_dim))
    v = rng.normal(size=(2, 5, E_v))
    return cfg, params, x, c, v


@pytest.mark.parametrize("name", list(CASES))
def test_value_of_another_size_matches_the_naive_loops(name):
    cfg, p, x, c, v = _setup(name)
    assert cfg.param_shapes()["value.kernel"] == (7, cfg.num_kv_heads, 3)
    mask = np.random.default_rng(1).random((2, 1, 3, 5)) > 0.3
    want = naive_damcha(p, cfg, x, c, mask=mask, causal=True, v=v)
    got = dc.damcha_attention(p, cfg, x, c, mask=mask, causal=True, value=v)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    explicit = dc.damcha_attention(p, cfg, x, c, mask=mask, causal=True, value=v, path="explicit")
    np.testing.assert_allclose(explicit, want, rtol=1e-10, atol=1e-12)
    # the values change the output, the penalty does not read them
    assert not np.allclose(got, dc.damcha_attention(p, cfg, x, c, mask=mask, causal=True, value=v + 1.0))
    penalty = dc.metric_penalty(p, cfg, x, c, value=v)
    assert penalty == pytest.approx(naive_metric_penalty(p, cfg, x, c), rel=1e-9, abs=1e-12)


def test_value_defaults_to_the_context():
    cfg, p, x, c, _ = _setup("heads-separate", E_v=6)
    assert cfg == cfg.replace(value_input_dim=None)  # None resolves to context_dim
    np.testing.assert_array_equal(dc.damcha_attention(p, cfg, x, c), dc.damcha_attention(p, cfg, x, c, value=c))
    np.testing.assert_allclose(dc.damcha_attention(p, cfg, x, c), naive_damcha(p, cfg, x, c), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "kw, error, pattern",
    [
        (
            {},
            dc.DamchaValueError,
            r"^Invalid argument `value`: expected a tensor when config\.value_input_dim != config\.context_dim.*value_input_dim=7$",
        ),
        (
            {"value": np.zeros((2, 5, 6))},
            dc.DamchaValueError,
            r"Invalid argument `value`: expected 7 features \(config\.value_input_dim\)\. Received: value\.shape=\(2, 5, 6\)",
        ),
        (
            {"value": np.zeros((2, 4, 7))},
            dc.DamchaValueError,
            r"Invalid argument `value`: expected the batch size and length of `context`.*value\.shape=\(2, 4, 7\)",
        ),
        (
            {"value": np.zeros((2, 5, 7), int)},
            dc.DamchaTypeError,
            r"Invalid argument `value`: expected a real floating tensor.*dtype=int64",
        ),
    ],
    ids=["missing", "features", "length", "dtype"],
)
def test_value_errors_name_value(kw, error, pattern):
    cfg, p, x, c, _ = _setup("heads-separate")
    with pytest.raises(error, match=pattern):
        dc.damcha_attention(p, cfg, x, c, **kw)
    with pytest.raises(error, match=pattern):
        dc.metric_penalty(p, cfg, x, c, **kw)


def test_value_input_dim_round_trips_and_old_configs_load(tmp_path):
    cfg, p, *_ = _setup("lowrank-query")
    dc.save_params(tmp_path / "v.safetensors", p, cfg)
    params, again = dc.load_params(tmp_path / "v.safetensors")
    assert again == cfg and again.value_input_dim == 7
    np.testing.assert_array_equal(params["value.kernel"], p["value.kernel"])
    old = {k: v for k, v in cfg.replace(value_input_dim=None).to_dict().items() if k != "value_input_dim"}
    assert "value_input_dim" in cfg.to_dict()
    loaded = dc.DamchaConfig.from_dict(json.loads(json.dumps(old)))
    assert loaded.value_input_dim == loaded.context_dim == 5
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `value_input_dim`: expected an int >= 1"):
        cfg.replace(value_input_dim=0)


def test_params_from_mha_and_folding_keep_the_value_size():
    cfg, p, x, c, v = _setup("heads-separate")
    weights = {k: p[k] for k in dc.projection_names(cfg)}
    mha_cfg = cfg.replace(metric="none")
    converted = dc.params_from_mha(weights, cfg, seed=3)
    np.testing.assert_allclose(
        dc.damcha_attention(converted, cfg, x, c, value=v),
        naive_damcha(weights, mha_cfg, x, c, v=v),
        rtol=1e-10,
        atol=1e-12,
    )
    static = {k: (np.zeros_like(a) if k.endswith(".kernel") and k.startswith("metric.") else a) for k, a in p.items()}
    folded, folded_cfg = dc.fold_static_metric(static, cfg)
    assert folded_cfg.value_input_dim == 7
    np.testing.assert_allclose(
        dc.damcha_attention(folded, folded_cfg, x, c, value=v),
        dc.damcha_attention(static, cfg, x, c, value=v),
        rtol=1e-10,
        atol=1e-12,
    )


def test_replace_keeps_values_on_the_context_unless_set_apart():
    plain = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=2, coupling="separate")
    assert plain.replace(context_dim=12).value_input_dim == 12
    apart = plain.replace(value_input_dim=5)
    assert apart.replace(context_dim=12).value_input_dim == 5
    assert apart.replace(context_dim=12, value_input_dim=None).value_input_dim == 12
