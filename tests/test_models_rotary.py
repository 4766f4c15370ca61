"""damcha_core.Rotary and the reference's rotary= option (spec section 10): the
maps go before RoPE, where RoPE's relative-position property survives both
metrics; after RoPE it survives "heads" only."""

from __future__ import annotations

import numpy as np
import pytest

import damcha_core as dc

B, N, E, H, d = 2, 6, 16, 4, 4


def _setup(metric, seed=0):
    cfg = dc.DamchaConfig(
        query_dim=E, num_heads=H, key_dim=d, metric=metric, metric_rank=3 if metric == "lowrank" else None
    )
    p = dc.init_params(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    for name in p:
        if name.endswith(".gate") or name.endswith(".bias"):
            p[name] = rng.normal(size=p[name].shape) * 0.5
    x = rng.normal(size=(B, N, E))
    return cfg, p, x


def _logits(cfg, p, x, shift, map_first=True):
    """Per-head logits with the map before (the spec) or after RoPE."""
    rot = dc.Rotary.from_base(d)
    pos = np.arange(N, dtype=np.float64)[None] + shift
    q = np.einsum("bte,ehd->bthd", x, p["query.kernel"]) + p["query.bias"]
    k = np.einsum("bte,ehd->bthd", x, p["key.kernel"]) + p["key.bias"]
    _, metric = dc.damcha_attention(p, cfg, x, return_metric=True)

    def lmap(L, y):
        if cfg.metric == "heads":
            return np.einsum("btha,btad->bthd", L, y)
        return np.einsum("bthiaj,btaj->bthi", L, y)

    if map_first:
        q, k = dc.apply_rotary(lmap(metric["q"], q), rot, pos), dc.apply_rotary(lmap(metric["k"], k), rot, pos)
    else:
        q, k = lmap(metric["q"], dc.apply_rotary(q, rot, pos)), lmap(metric["k"], dc.apply_rotary(k, rot, pos))
    return np.einsum("bnhd,bmhd->bhnm", q, k)


@pytest.mark.parametrize("metric", ["heads", "lowrank"])
def test_maps_before_rope_keep_relative_positions(metric):
    cfg, p, x = _setup(metric)
    np.testing.assert_allclose(_logits(cfg, p, x, 37), _logits(cfg, p, x, 0), rtol=0, atol=1e-10)


def test_maps_after_rope_break_relative_positions_for_lowrank_only():
    cfg, p, x = _setup("heads")
    np.testing.assert_allclose(_logits(cfg, p, x, 0, map_first=False), _logits(cfg, p, x, 0), rtol=0, atol=1e-12)
    cfg, p, x = _setup("lowrank")
    shifted = _logits(cfg, p, x, 37, map_first=False)
    assert np.abs(shifted - _logits(cfg, p, x, 0, map_first=False)).max() > 1e-2


@pytest.mark.parametrize("metric", ["heads", "lowrank"])
def test_reference_rotary_is_the_composition(metric):
    """damcha_attention(rotary=) equals softmax attention on the rotated mapped heads,
    and shifting every position leaves it unchanged."""
    cfg, p, x = _setup(metric)
    y = dc.damcha_attention(p, cfg, x, causal=True, rotary=dc.Rotary.from_base(d))
    logits = _logits(cfg, p, x, 0) * cfg.softmax_scale
    logits = np.where(np.tril(np.ones((N, N), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    v = np.einsum("bte,ehd->bthd", x, p["value.kernel"]) + p["value.bias"]
    want = np.einsum("bnhd,hde->bne", np.einsum("bhnm,bmhd->bnhd", probs, v), p["output.kernel"]) + p["output.bias"]
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-12)
    shifted = dc.Rotary.from_base(d, query_positions=np.arange(N) + 37.0, key_positions=np.arange(N) + 37.0)
    np.testing.assert_allclose(dc.damcha_attention(p, cfg, x, causal=True, rotary=shifted), y, rtol=0, atol=1e-12)
    assert np.abs(dc.damcha_attention(p, cfg, x, causal=True) - y).max() > 1e-3


def test_query_offset_places_cached_queries():
    """With P cached tokens the default query positions are P, P+1, ...: the last
    rows of one causal pass equal a pass over the last queries with query_offset."""
    cfg, p, x = _setup("lowrank")
    rot = dc.Rotary.from_base(d)
    full = dc.damcha_attention(p, cfg, x, causal=True, rotary=rot)
    tail = dc.damcha_attention(p, cfg, x[:, 4:], x, causal=True, query_offset=4, rotary=rot)
    np.testing.assert_allclose(tail, full[:, 4:], rtol=0, atol=1e-12)


def test_apply_rotary_layouts_and_partial():
    rng = np.random.default_rng(1)
    y = rng.normal(size=(1, 3, 2, 6))
    pos = np.array([[0.0, 1.0, 5.0]])
    half = dc.apply_rotary(y, dc.Rotary([1.0, 0.1]), pos)  # 4 of 6 channels rotate
    np.testing.assert_array_equal(half[..., 4:], y[..., 4:])
    c, s = np.cos(5.0 * 0.1), np.sin(5.0 * 0.1)  # pair (1, 3) at position 5
    np.testing.assert_allclose(half[0, 2, :, 1], y[0, 2, :, 1] * c - y[0, 2, :, 3] * s, rtol=0, atol=1e-15)
    inter = dc.apply_rotary(y, dc.Rotary([1.0, 0.1], interleaved=True), pos)  # pair (2, 3)
    np.testing.assert_allclose(inter[0, 2, :, 3], y[0, 2, :, 3] * c + y[0, 2, :, 2] * s, rtol=0, atol=1e-15)
    np.testing.assert_allclose(np.linalg.norm(half, axis=-1), np.linalg.norm(y, axis=-1), rtol=1e-14)


def test_rotary_errors():
    with pytest.raises(dc.DamchaValueError, match="inv_freq"):
        dc.Rotary([])
    with pytest.raises(dc.DamchaValueError, match="inv_freq"):
        dc.Rotary([np.nan])
    with pytest.raises(dc.DamchaTypeError, match="interleaved"):
        dc.Rotary([1.0], interleaved="yes")
    with pytest.raises(dc.DamchaValueError, match="dim"):
        dc.Rotary.from_base(3)
    with pytest.raises(dc.DamchaValueError, match="query_positions"):
        dc.Rotary([1.0], query_positions=np.zeros((1, 1, 1)))
    cfg, p, x = _setup("heads")
    with pytest.raises(dc.DamchaValueError, match="key_dim=4"):
        dc.damcha_attention(p, cfg, x, rotary=dc.Rotary.from_base(6))
    with pytest.raises(dc.DamchaValueError, match="query_positions"):
        dc.damcha_attention(p, cfg, x, rotary=dc.Rotary.from_base(4, query_positions=np.arange(N + 1)))
    with pytest.raises(dc.DamchaValueError, match="rotary"):
        dc.damcha_attention(p, cfg, x, rotary=dc.Rotary.from_base(4), path="explicit")
    with pytest.raises(dc.DamchaValueError, match="rotary"):
        dc.damcha_attention(p, cfg, x, rotary=(1.0, 2.0))
