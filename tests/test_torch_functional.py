"""The torch functional core (damcha_torch.damcha_attention and its steps)
against the NumPy reference, and the layer's delegation to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import damcha_core as dc
from damcha_conformance import case_params
from damcha_core import _reference as ref
from damcha_torch import (
    DamchaAttention,
    DamchaKVCache,
    apply_map,
    causal_visibility,
    damcha_attention,
    generator,
    metric_penalty,
    rms_normalise,
    safe_attention,
    softmax_attend,
    visibility,
)

CONFIGS = {
    "heads-tied": dict(metric="heads", coupling="tied"),
    "heads-separate-kdim": dict(metric="heads", coupling="separate", context_dim=12),
    "lowrank-query-gqa": dict(metric="lowrank", metric_rank=3, coupling="query", num_kv_heads=2),
    "lowrank-separate-dv": dict(metric="lowrank", metric_rank=2, coupling="separate", value_dim=3, output_dim=10),
    "none-mqa-nobias": dict(metric="none", num_kv_heads=1, use_bias=False),
}


def _config(name: str) -> dc.DamchaConfig:
    return dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, **CONFIGS[name])


def _torch(params: dict[str, np.ndarray], requires_grad: bool = False) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(v).requires_grad_(requires_grad) for n, v in params.items()}


def _tokens(cfg: dc.DamchaConfig, seed: int = 0, n: int = 5, m: int = 7):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, n, cfg.query_dim))
    c = None if cfg.context_dim == cfg.query_dim else rng.normal(size=(2, m, cfg.context_dim))
    return x, c


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("return_weights", [False, True], ids=["fused", "weights"])
def test_damcha_attention_equals_reference(name, return_weights):
    cfg = _config(name)
    params = case_params(cfg, 3)
    x, c = _tokens(cfg)
    M = x.shape[1] if c is None else c.shape[1]
    keep = np.random.default_rng(1).random((2, 1, x.shape[1], M)) < 0.7
    keep[..., 0] = True
    keep[1, 0, 2] = False  # one query of batch 1 sees nothing: output = output.bias
    want, want_w, want_metric = dc.damcha_attention(
        params, cfg, x, c, mask=keep, return_weights=True, return_metric=True
    )
    out = damcha_attention(
        _torch(params),
        cfg,
        torch.from_numpy(x),
        None if c is None else torch.from_numpy(c),
        mask=torch.from_numpy(keep),
        return_weights=return_weights,
        return_metric=True,
    )
    y, *extras = out
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-10, atol=1e-12)
    if return_weights:
        np.testing.assert_allclose(extras.pop(0).numpy(), want_w, rtol=1e-10, atol=1e-12)
    (metric,) = extras
    assert sorted(metric) == sorted(want_metric)
    for role, value in want_metric.items():
        np.testing.assert_allclose(metric[role].numpy(), value, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["heads-tied", "lowrank-query-gqa"])
def test_damcha_attention_causal_offset_and_cache(name):
    """causal + query_offset as the reference, and a cache that continues a prefix."""
    cfg = _config(name)
    params = case_params(cfg, 4)
    x = np.random.default_rng(2).normal(size=(2, 7, 16))
    P = 3
    want = dc.damcha_attention(params, cfg, x[:, P:], x, causal=True, query_offset=P)
    p = _torch(params)
    got = damcha_attention(p, cfg, torch.from_numpy(x[:, P:]), torch.from_numpy(x), causal=True, query_offset=P)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)
    cache = DamchaKVCache()
    damcha_attention(p, cfg, torch.from_numpy(x[:, :P]), causal=True, kv_cache=cache)
    outs = [
        damcha_attention(p, cfg, torch.from_numpy(x[:, i : i + 1]), causal=True, kv_cache=cache) for i in range(P, 7)
    ]
    np.testing.assert_allclose(torch.cat(outs, 1).numpy(), want, rtol=1e-10, atol=1e-12)
    assert len(cache) == 7


@pytest.mark.parametrize("name", ["heads-separate-kdim", "lowrank-query-gqa"])
def test_steps_equal_the_reference_steps(name):
    cfg = _config(name)
    params = case_params(cfg, 5)
    p = _torch(params)
    x, c = _tokens(cfg, 6)
    side = cfg.metric_sides[0]
    y = np.random.default_rng(3).normal(size=(2, x.shape[1], cfg.side_heads(side), cfg.key_dim))
    np.testing.assert_allclose(rms_normalise(torch.from_numpy(x)).numpy(), ref.rms_normalise(x), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(
        generator(p, cfg, side, torch.from_numpy(x)).numpy(),
        ref.generator(params, cfg, side, x),
        rtol=1e-10,
        atol=1e-12,
    )
    mapped = apply_map(p, cfg, side, torch.from_numpy(x), torch.from_numpy(y))
    np.testing.assert_allclose(mapped.numpy(), ref.apply_map(params, cfg, side, x, y), rtol=1e-10, atol=1e-12)
    ct = None if c is None else torch.from_numpy(c)
    np.testing.assert_allclose(
        metric_penalty(p, cfg, torch.from_numpy(x), ct).item(),
        dc.metric_penalty(params, cfg, x, c),
        rtol=1e-10,
        atol=1e-12,
    )


def test_visibility_and_softmax_attend_follow_the_reference():
    rng = np.random.default_rng(7)
    B, H, N, M, d = 2, 4, 3, 5, 4
    q, k, v = (rng.normal(size=s) for s in ((B, H, N, d), (B, H, M, d), (B, H, M, d)))
    keep = rng.random((B, 1, N, M)) < 0.6
    keep[0, 0, 1] = False
    vis = visibility(N, M, mask=torch.from_numpy(keep), causal=True, query_offset=1)
    want_vis = ref.visibility(B, H, N, M, keep, True, 1)
    np.testing.assert_array_equal(np.broadcast_to(vis.numpy(), want_vis.shape), want_vis)
    assert visibility(N, M) is None and visibility(1, 4, causal=True, query_offset=3) is None
    np.testing.assert_array_equal(causal_visibility(N, M, 1).numpy(), ref.visibility(1, 1, N, M, None, True, 1)[0, 0])
    probs = ref.softmax_attend(np.einsum("bhnd,bhmd->bhnm", q, k) / 2.0, want_vis)
    for need_weights in (False, True):
        o, w = softmax_attend(
            *(torch.from_numpy(t) for t in (q, k, v)),
            mask=torch.from_numpy(keep),
            causal=True,
            query_offset=1,
            need_weights=need_weights,
        )
        np.testing.assert_allclose(o.numpy(), probs @ v, rtol=1e-10, atol=1e-12)
        if need_weights:
            np.testing.assert_allclose(w.numpy(), probs, rtol=1e-10, atol=1e-12)
    with pytest.warns(DeprecationWarning, match="softmax_attend"):
        o_old, _ = safe_attention(
            *(torch.from_numpy(t) for t in (q, k, v)), mask=torch.from_numpy(keep), is_causal=True, query_offset=1
        )
    np.testing.assert_allclose(o_old.numpy(), probs @ v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["heads-tied", "heads-separate-kdim", "lowrank-query-gqa"])
def test_layer_forward_is_the_functional_on_views_of_its_parameters(name):
    """The layer delegates: damcha_attention on canonical views of the layer's
    own parameters gives its output exactly, and gradients reach the layer."""
    cfg = _config(name)
    layer = DamchaAttention.from_canonical(case_params(cfg, 8), cfg, batch_first=True, dtype=torch.float64).eval()
    x, c = _tokens(cfg, 9)
    xt = torch.from_numpy(x)
    ct = xt if c is None else torch.from_numpy(c)
    out, _ = layer(xt, ct, ct, need_weights=False, is_causal=True)
    views = layer._canonical_views(dict(layer.named_parameters(remove_duplicate=False)))
    got = damcha_attention(views, cfg, xt, None if c is None else ct, causal=True)
    torch.testing.assert_close(got, out, rtol=0, atol=1e-14)
    got.sum().backward()
    assert all(p.grad is not None for p in layer.parameters())


def test_old_heads_signature_still_works_with_a_deprecation_warning():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 5, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 7, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 7, 2, 6, generator=g, dtype=torch.float64)
    with pytest.warns(DeprecationWarning, match=r"damcha_attention\(params, config, query"):
        out, w = damcha_attention(q, k, v, is_causal=True, need_weights=True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(2, 2).transpose(1, 2),
        v.repeat_interleave(2, 2).transpose(1, 2),
        is_causal=True,
    ).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    assert w.shape == (2, 4, 5, 7)
    # Its masks follow softmax_attend's convention; a mask of another dtype is refused saying so
    # (the message said "boolean" alone, though a float mask is accepted).
    with pytest.warns(DeprecationWarning), pytest.raises(dc.DamchaTypeError) as info:
        damcha_attention(q, k, v, mask=torch.ones(5, 7, dtype=torch.int64))
    assert "Invalid argument `mask`: expected a mask that is boolean (True = may attend) or floating" in str(info.value)
    with pytest.warns(DeprecationWarning):
        additive = torch.zeros(5, 7, dtype=torch.float64).masked_fill(torch.ones(5, 7).triu(1).bool(), -torch.inf)
        torch.testing.assert_close(damcha_attention(q, k, v, mask=additive)[0], out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (
            lambda p, c, x: damcha_attention(p, "cfg", x),
            dc.DamchaTypeError,
            r"Invalid argument `config`: expected a DamchaConfig",
        ),
        (
            lambda p, c, x: damcha_attention({}, c, x),
            dc.DamchaValueError,
            r"Invalid argument `params`: expected exactly the config's parameter names",
        ),
        (
            lambda p, c, x: damcha_attention({**p, "query.kernel": p["query.kernel"].numpy()}, c, x),
            dc.DamchaTypeError,
            r"Invalid argument `params\['query.kernel'\]`: expected a torch tensor",
        ),
        (
            lambda p, c, x: damcha_attention(p, c, x.long()),
            dc.DamchaTypeError,
            r"Invalid argument `query`: expected a real floating",
        ),
        (
            lambda p, c, x: damcha_attention(p, c, x, mask=torch.zeros(5, 5, dtype=torch.int32)),
            dc.DamchaTypeError,
            r"Invalid argument `mask`: expected a mask that is boolean \(True = may attend\) or floating",
        ),
        (
            lambda p, c, x: damcha_attention(p, c, x, mask=torch.zeros(2, 5, 5, dtype=torch.bool)),
            dc.DamchaValueError,
            r"Invalid argument `mask`: expected shape \(N, M\) or \(B, H, N, M\)",
        ),
        (
            lambda p, c, x: damcha_attention(p, c, x, query_offset=-1),
            dc.DamchaValueError,
            r"Invalid argument `query_offset`: expected an int >= 0",
        ),
        (
            lambda p, c, x: damcha_attention(p, c, x, causal=1),
            dc.DamchaTypeError,
            r"Invalid argument `causal`: expected a bool",
        ),
        (
            lambda p, c, x: damcha_attention(p, c, x, kv_cache=[]),
            dc.DamchaTypeError,
            r"Invalid argument `kv_cache`: expected a Damcha",
        ),
        (
            lambda p, c, x: damcha_attention(p, c, x, x, x[:, :3]),
            dc.DamchaValueError,
            r"Invalid argument `value`: expected the batch size and length of `context`",
        ),
        (lambda p, c, x: apply_map(p, c, "q", x, x), dc.DamchaValueError, r"Invalid argument `side`: expected one of"),
        (
            lambda p, c, x: generator(p, c, "qk", x.int()),
            dc.DamchaTypeError,
            r"Invalid argument `tokens`: expected a real floating",
        ),
    ],
    ids=[
        "config-type",
        "params-names",
        "params-numpy",
        "query-int",
        "mask-dtype",
        "mask-3d",
        "offset",
        "causal-type",
        "cache-type",
        "value-shape",
        "side",
        "tokens-int",
    ],
)
def test_functional_errors_name_the_argument(call, error, pattern):
    cfg = _config("heads-tied")
    p = _torch(case_params(cfg, 0))
    with pytest.raises(error, match=pattern):
        call(p, cfg, torch.randn(2, 5, 16, dtype=torch.float64))


@pytest.mark.parametrize("flag", ["causal", "return_weights", "return_metric", "recompute"])
def test_functional_flags_follow_the_layers_rule(flag):
    """One rule with DamchaAttention.forward (dc.check_bool): a NumPy bool is a
    bool, computing what the Python bool computes; a 0-d bool tensor and an int
    are refused with the same message."""
    cfg = _config("heads-tied")
    p = _torch(case_params(cfg, 0))
    x = torch.from_numpy(_tokens(cfg, 4)[0])
    for value in (True, False):
        got = damcha_attention(p, cfg, x, **{flag: np.bool_(value)})
        want = damcha_attention(p, cfg, x, **{flag: value})
        got, want = (r if isinstance(r, tuple) else (r,) for r in (got, want))
        assert len(got) == len(want)
        for a, b in zip(got, want):
            a, b = (list(r.values()) if isinstance(r, dict) else [r] for r in (a, b))  # return_metric: a dict
            assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))
    for bad in (torch.tensor(True), 1):
        with pytest.raises(
            dc.DamchaTypeError, match=rf"^Invalid argument `{flag}`: expected a bool\. Received: {flag}="
        ):
            damcha_attention(p, cfg, x, **{flag: bad})
        layer = DamchaAttention(16, 4, batch_first=True)
        with pytest.raises(dc.DamchaTypeError, match=r"^Invalid argument `is_causal`: expected a bool\. Received"):
            layer(x.float(), x.float(), x.float(), is_causal=bad, need_weights=False)


def test_mixed_dtypes_compute_in_the_promoted_dtype():
    """float64 params (damcha_core.init_params) with a float32 query, or the
    other way round: computed in float64, as the JAX functional promotes."""
    cfg = _config("heads-separate-kdim")
    params = case_params(cfg, 7)
    x, c = _tokens(cfg, 8)
    want = dc.damcha_attention(params, cfg, x, c)
    for p_dtype, x_dtype in ((torch.float64, torch.float32), (torch.float32, torch.float64)):
        p = {n: t.to(p_dtype) for n, t in _torch(params).items()}
        xq, xc = torch.from_numpy(x).to(x_dtype), torch.from_numpy(c).to(torch.float32)
        y = damcha_attention(p, cfg, xq, xc)
        assert y.dtype == torch.float64
        np.testing.assert_allclose(
            y.numpy(),
            dc.damcha_attention(
                {n: t.double().numpy() for n, t in p.items()}, cfg, xq.double().numpy(), xc.double().numpy()
            ),
            rtol=1e-10,
            atol=1e-12,
        )
        assert metric_penalty(p, cfg, xq, xc).dtype == torch.float64
    np.testing.assert_allclose(
        damcha_attention(_torch(params), cfg, torch.from_numpy(x), torch.from_numpy(c)).numpy(),
        want,
        rtol=1e-10,
        atol=1e-12,
    )


def test_value_without_context_equals_the_reference():
    """context=None with value= (keys from the query, values of their own
    size) computes what the reference computes for the same call, as
    damcha_jax.damcha_attention does; refused here before."""
    cfg = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, value_input_dim=5, metric="heads")
    params = case_params(cfg, 0)
    for k in params:
        if k.endswith(".gate"):
            params[k] = np.full_like(params[k], 0.6)  # the maps open
    rng = np.random.default_rng(0)
    x, v = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 5))
    want = ref.damcha_attention(params, cfg, x, value=v, causal=True)
    got = damcha_attention(_torch(params), cfg, torch.from_numpy(x), value=torch.from_numpy(v), causal=True)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)
    # The values matter: the same call with other values differs.
    assert np.abs(ref.damcha_attention(params, cfg, x, value=v[::-1].copy(), causal=True) - want).max() > 1e-3


@pytest.mark.parametrize(
    ("dropout_p", "error"),
    [("0.1", dc.DamchaTypeError), (True, dc.DamchaTypeError), (1.0, dc.DamchaValueError)],
    ids=["string", "bool", "one"],
)
def test_dropout_p_errors_follow_the_core_rule(dropout_p, error):
    """dc.check_rate's classes: not a number is a type error, outside [0, 1) a value error."""
    cfg = _config("heads-tied")
    with pytest.raises(error, match=r"Invalid argument `dropout_p`"):
        damcha_attention(
            _torch(case_params(cfg, 0)), cfg, torch.randn(2, 5, 16, dtype=torch.float64), dropout_p=dropout_p
        )


@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 4, 3)),  # values of another length: SDPA on CPU read them silently
        ((2, 4, 5, 8), (2, 2, 6, 8), (1, 2, 6, 3)),
        ((2, 4, 5, 8), (2, 3, 6, 8), (2, 3, 6, 3)),
        ((2, 4, 5, 8), (2, 2, 6, 7), (2, 2, 6, 3)),
        ((4, 5, 8), (2, 6, 8), (2, 6, 3)),
    ],
    ids=["value-length", "value-batch", "heads-not-dividing", "key-dim", "rank-3"],
)
def test_softmax_attend_refuses_shapes_that_do_not_fit(shapes):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `q, k, v`: expected shapes \(B, H, N, d\)"):
        softmax_attend(q, k, v)
