"""The NumPy reference against an independent naive implementation, its own
explicit path, and every invariant of the design note."""

from __future__ import annotations

import numpy as np
import pytest
from _naive import naive_damcha, naive_metric_penalty
from hypothesis import given, settings
from hypothesis import strategies as st

import damcha_core as dc
from damcha_conformance import case_params

# (metric, coupling, num_kv_heads, context_dim) spanning every structure.
STRUCTURES = [
    ("none", "tied", 4, 12),
    ("heads", "tied", 4, 8),
    ("heads", "separate", 2, 12),
    ("heads", "query", 1, 6),
    ("lowrank", "tied", 4, 8),
    ("lowrank", "separate", 4, 6),
    ("lowrank", "query", 2, 8),
]
STRUCTURE_IDS = [f"{m}-{c}-G{g}-Ekv{e}" for m, c, g, e in STRUCTURES]
# Each test draws from its own seeded generator: a module-level one gave a test data that
# depended on which tests had run before it in the process (xdist's split, -k).


def make(metric="heads", coupling="tied", G=4, E_kv=8, seed=0, **kw):
    cfg = dc.DamchaConfig(
        query_dim=8,
        num_heads=4,
        key_dim=3,
        num_kv_heads=G,
        context_dim=E_kv,
        metric=metric,
        metric_rank=2 if metric == "lowrank" else None,
        coupling=coupling,
        **kw,
    )
    return cfg, case_params(cfg, seed)


def inputs(cfg, B=2, N=4, M=5, self_attn=False, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(B, N, cfg.query_dim))
    c = None if self_attn else r.normal(size=(B, M, cfg.context_dim))
    return x, c


@pytest.mark.parametrize("structure", STRUCTURES, ids=STRUCTURE_IDS)
@pytest.mark.parametrize("masking", ["nomask", "per-head-mask", "causal", "padding+causal"])
def test_matches_independent_naive_implementation(structure, masking):
    cfg, p = make(*structure, value_dim=2, output_dim=5)
    x, c = inputs(cfg)
    mask = None
    if masking in ("per-head-mask",):
        mask = np.random.default_rng(0).random((2, 4, 4, 5)) < 0.6
        mask[1, 2, 3] = False  # one all-masked row
    if masking == "padding+causal":
        mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)[:, None, None, :]
    causal = "causal" in masking
    got = dc.damcha_attention(p, cfg, x, c, mask=mask, causal=causal)
    want = naive_damcha(p, cfg, x, c, mask=mask, causal=causal)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("structure", STRUCTURES, ids=STRUCTURE_IDS)
def test_fast_path_equals_explicit_metric_path(structure):
    cfg, p = make(*structure)
    x, c = inputs(cfg, M=6)
    mask = np.random.default_rng(1).random((2, 1, 4, 6)) < 0.7
    fast, w_fast = dc.damcha_attention(p, cfg, x, c, mask=mask, causal=True, return_weights=True)
    explicit, w_explicit = dc.damcha_attention(
        p, cfg, x, c, mask=mask, causal=True, return_weights=True, path="explicit"
    )
    np.testing.assert_allclose(fast, explicit, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(w_fast, w_explicit, rtol=1e-10, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    metric=st.sampled_from(["heads", "lowrank"]),
    coupling=st.sampled_from(["tied", "separate", "query"]),
    heads_groups=st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (3, 3), (6, 3)]),
    d=st.integers(1, 3),
    n=st.integers(1, 4),
    m=st.integers(1, 4),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fast_equals_explicit_on_random_configs(metric, coupling, heads_groups, d, n, m, causal, seed):
    H, G = heads_groups
    if coupling == "tied":
        G = H
    cfg = dc.DamchaConfig(
        query_dim=5,
        num_heads=H,
        key_dim=d,
        num_kv_heads=G,
        metric=metric,
        coupling=coupling,
        metric_rank=2 if metric == "lowrank" else None,
        context_dim=5 if coupling == "tied" else 3,
    )
    p = case_params(cfg, seed)
    r = np.random.default_rng(seed)
    x, c = r.normal(size=(2, n, 5)), r.normal(size=(2, m, cfg.context_dim))
    fast = dc.damcha_attention(p, cfg, x, c, causal=causal)
    np.testing.assert_allclose(
        fast, dc.damcha_attention(p, cfg, x, c, causal=causal, path="explicit"), rtol=1e-9, atol=1e-11
    )
    np.testing.assert_allclose(fast, naive_damcha(p, cfg, x, c, causal=causal), rtol=1e-9, atol=1e-11)


def _mha(p, cfg, x, c, mask=None, causal=False):
    return naive_damcha(
        {k: v for k, v in p.items() if not k.startswith("metric.")},
        cfg.replace(metric="none", metric_rank=None),
        x,
        c,
        mask,
        causal,
    )


@pytest.mark.parametrize("structure", STRUCTURES[1:], ids=STRUCTURE_IDS[1:])
@pytest.mark.parametrize("neutraliser", ["zero-gates", "zero-generator"])
def test_identity_metric_is_mha(structure, neutraliser):
    cfg, p = make(*structure)
    x, c = inputs(cfg)
    for side in cfg.metric_sides:
        if neutraliser == "zero-gates":
            p[f"metric.{side}.gate"] = np.zeros_like(p[f"metric.{side}.gate"])
        else:  # W = b = 0 makes A(t) = 0 (heads) or u(t) = 0 (lowrank)
            p[f"metric.{side}.kernel"] = np.zeros_like(p[f"metric.{side}.kernel"])
            p[f"metric.{side}.bias"] = np.zeros_like(p[f"metric.{side}.bias"])
    np.testing.assert_allclose(
        dc.damcha_attention(p, cfg, x, c, causal=True), _mha(p, cfg, x, c, causal=True), rtol=1e-10, atol=1e-12
    )


def test_fresh_params_are_exactly_mha():
    cfg = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=3)
    p = dc.init_params(cfg, seed=3)
    x, _ = inputs(cfg)
    assert all(np.all(p[f"metric.{s}.gate"] == 0) for s in cfg.metric_sides)
    np.testing.assert_allclose(dc.damcha_attention(p, cfg, x), _mha(p, cfg, x, x), rtol=1e-10, atol=1e-12)


def test_metric_changes_the_output_when_gates_open():
    """Guards the other tests: the catalogue params really exercise the metric."""
    cfg, p = make("heads", "tied")
    x, _ = inputs(cfg)
    assert np.max(np.abs(dc.damcha_attention(p, cfg, x) - _mha(p, cfg, x, x))) > 1e-2


@pytest.mark.parametrize("structure", STRUCTURES[1:], ids=STRUCTURE_IDS[1:])
def test_static_metric_folds_into_mha_kernels(structure):
    cfg, p = make(*structure)
    for side in cfg.metric_sides:
        p[f"metric.{side}.kernel"] = np.zeros_like(p[f"metric.{side}.kernel"])
    x, c = inputs(cfg)
    folded, mha_cfg = dc.fold_static_metric(p, cfg)
    assert mha_cfg.metric == "none"
    np.testing.assert_allclose(
        dc.damcha_attention(folded, mha_cfg, x, c), dc.damcha_attention(p, cfg, x, c), rtol=1e-10, atol=1e-12
    )
    # the static map is not the identity here, so folding really changed kernels
    assert not np.allclose(folded["query.kernel"], p["query.kernel"])


def test_fold_rejects_data_dependent_metric():
    cfg, p = make("heads", "tied")
    with pytest.raises(dc.DamchaValueError, match=r"metric\.qk\.kernel.*all zeros"):
        dc.fold_static_metric(p, cfg)


def _permute(p, cfg, perm_kv):
    """Relabel key/value heads by perm_kv and query heads consistently (group-wise)."""
    per = cfg.group_size
    perm_q = np.concatenate([np.arange(g * per, (g + 1) * per) for g in perm_kv])
    out = dict(p)
    out["query.kernel"], out["query.bias"] = p["query.kernel"][:, perm_q], p["query.bias"][perm_q]
    for n in ("key", "value"):
        out[f"{n}.kernel"], out[f"{n}.bias"] = p[f"{n}.kernel"][:, perm_kv], p[f"{n}.bias"][perm_kv]
    out["output.kernel"] = p["output.kernel"][perm_q]
    for side in cfg.metric_sides:
        perm = perm_kv if side == "k" else perm_q
        pre = f"metric.{side}"
        out[f"{pre}.gate"] = p[f"{pre}.gate"][perm]
        if cfg.metric == "heads":
            out[f"{pre}.kernel"] = p[f"{pre}.kernel"][:, perm][:, :, perm]
            out[f"{pre}.bias"] = p[f"{pre}.bias"][perm][:, perm]
        else:
            out[f"{pre}.u"], out[f"{pre}.v"] = p[f"{pre}.u"][perm], p[f"{pre}.v"][perm]
    return out


@pytest.mark.parametrize("structure", STRUCTURES, ids=STRUCTURE_IDS)
def test_consistent_head_permutation_leaves_output_unchanged(structure):
    cfg, p = make(*structure)
    x, c = inputs(cfg)
    r = np.random.default_rng(5)
    perm_kv = r.permutation(cfg.num_kv_heads)
    if cfg.num_kv_heads > 1:
        while np.all(perm_kv == np.arange(cfg.num_kv_heads)):
            perm_kv = r.permutation(cfg.num_kv_heads)
    q = _permute(p, cfg, perm_kv)
    np.testing.assert_allclose(
        dc.damcha_attention(q, cfg, x, c), dc.damcha_attention(p, cfg, x, c), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("structure", STRUCTURES, ids=STRUCTURE_IDS)
def test_causal_outputs_ignore_future_tokens(structure):
    metric, coupling, G, _ = structure
    cfg, p = make(metric, coupling, G, 8)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 7, 8))
    y = dc.damcha_attention(p, cfg, x, causal=True)
    for i in range(6):
        x2 = x.copy()
        x2[:, i + 1 :] = rng.normal(size=x2[:, i + 1 :].shape) * 3
        y2 = dc.damcha_attention(p, cfg, x2, causal=True)
        np.testing.assert_allclose(y2[:, : i + 1], y[:, : i + 1], rtol=1e-12, atol=1e-12)
        assert np.max(np.abs(y2[:, i + 1 :] - y[:, i + 1 :])) > 1e-6


def test_query_offset_equals_decoding_the_last_tokens():
    cfg, p = make("heads", "tied")
    x = np.random.default_rng(3).normal(size=(2, 6, 8))
    full = dc.damcha_attention(p, cfg, x, causal=True)
    for P in range(6):
        step = dc.damcha_attention(p, cfg, x[:, P:], x, causal=True, query_offset=P)
        np.testing.assert_allclose(step, full[:, P:], rtol=1e-10, atol=1e-12)


def test_all_masked_row_gives_zero_attention_and_no_nan():
    cfg, p = make("heads", "separate", 2, 12)
    x, c = inputs(cfg)
    mask = np.ones((2, 4, 4, 5), bool)
    mask[0, :, 2] = False
    y, w = dc.damcha_attention(p, cfg, x, c, mask=mask, return_weights=True)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(w))
    assert np.all(w[0, :, 2] == 0)
    np.testing.assert_allclose(y[0, 2], p["output.bias"], rtol=0, atol=1e-15)
    np.testing.assert_allclose(w.sum(-1)[1], 1.0, rtol=1e-12)


def test_padding_mask_equals_truncated_context():
    cfg, p = make("lowrank", "separate", 4, 6)
    x, c = inputs(cfg, M=6)
    mask = np.zeros((1, 1, 1, 6), bool)
    mask[..., :4] = True
    np.testing.assert_allclose(
        dc.damcha_attention(p, cfg, x, c, mask=mask), dc.damcha_attention(p, cfg, x, c[:, :4]), rtol=1e-10, atol=1e-12
    )


def test_mask_shapes_broadcast_consistently():
    cfg, p = make()
    x, c = inputs(cfg)
    m2 = np.random.default_rng(4).random((4, 5)) < 0.7
    m2[:, 0] = True
    y2 = dc.damcha_attention(p, cfg, x, c, mask=m2)
    y4 = dc.damcha_attention(p, cfg, x, c, mask=np.broadcast_to(m2, (2, 4, 4, 5)).copy())
    y1 = dc.damcha_attention(p, cfg, x, c, mask=m2[None, None])
    np.testing.assert_array_equal(y2, y4)
    np.testing.assert_array_equal(y2, y1)


def test_gqa_equals_mha_with_repeated_key_value_heads():
    cfg, p = make("heads", "query", 2, 8)
    x, c = inputs(cfg)
    full_cfg = cfg.replace(num_kv_heads=4)
    q = dict(p)
    for n in ("key", "value"):
        q[f"{n}.kernel"] = np.repeat(p[f"{n}.kernel"], 2, axis=1)
        q[f"{n}.bias"] = np.repeat(p[f"{n}.bias"], 2, axis=0)
    np.testing.assert_allclose(
        dc.damcha_attention(q, full_cfg, x, c), dc.damcha_attention(p, cfg, x, c), rtol=1e-10, atol=1e-12
    )


def test_tied_metric_is_positive_semidefinite_on_the_diagonal():
    """With W_q = W_k and no biases, q_i = k_i, so sum_h logits_h(i, i) =
    scale * ||L(x_i) q_i||^2 >= 0 for tied coupling (the Mahalanobis form)."""
    cfg, p = make("heads", "tied", use_bias=False)
    p["key.kernel"] = p["query.kernel"].copy()
    x = np.random.default_rng(6).normal(size=(3, 6, 8))
    _, w, metric = dc.damcha_attention(p, cfg, x, return_weights=True, return_metric=True)
    q = np.einsum("bne,ehd->bnhd", x, p["query.kernel"])
    Lq = np.einsum("bnha,bnad->bnhd", metric["q"], q)
    diag = cfg.softmax_scale * np.einsum("bnhd,bnhd->bn", Lq, Lq)
    assert np.all(diag >= 0)
    # and the metric the reference reports is the same map for both roles on the same tokens
    np.testing.assert_array_equal(metric["q"], metric["k"])


def test_returned_metric_is_identity_plus_gated_generator():
    cfg, p = make("heads", "separate", 2, 12)
    x, c = inputs(cfg)
    _, metric = dc.damcha_attention(p, cfg, x, c, return_metric=True)
    phi = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6)
    A = np.einsum("bne,ehk->bnhk", phi, p["metric.q.kernel"]) + p["metric.q.bias"]
    np.testing.assert_allclose(metric["q"], np.eye(4) + p["metric.q.gate"][:, None] * A, rtol=1e-12)
    assert metric["k"].shape == (2, 5, 2, 2)


@pytest.mark.parametrize("structure", STRUCTURES, ids=STRUCTURE_IDS)
def test_return_tuple_order_and_weights_are_probabilities(structure):
    cfg, p = make(*structure)
    x, c = inputs(cfg)
    y = dc.damcha_attention(p, cfg, x, c)
    y1, w = dc.damcha_attention(p, cfg, x, c, return_weights=True)
    y2, w2, m = dc.damcha_attention(p, cfg, x, c, return_weights=True, return_metric=True)
    np.testing.assert_array_equal(y, y1)
    np.testing.assert_array_equal(w, w2)
    assert w.shape == (2, 4, 4, 5) and np.allclose(w.sum(-1), 1)
    expected_roles = {"none": set(), "tied": {"q", "k"}, "separate": {"q", "k"}, "query": {"q"}}
    assert set(m) == expected_roles["none" if cfg.metric == "none" else cfg.coupling]


@pytest.mark.parametrize("structure", STRUCTURES, ids=STRUCTURE_IDS)
def test_metric_penalty_equals_dense_frobenius_norm(structure):
    cfg, p = make(*structure)
    x, c = inputs(cfg)
    got = dc.metric_penalty(p, cfg, x, c)
    # brute force from the explicit dense map, the way the note defines it
    _, m = dc.damcha_attention(p, cfg, x, c, return_metric=True)
    per_role = []
    for dense in m.values():
        if cfg.metric == "heads":
            dense = np.einsum("bthk,ij->bthikj", dense, np.eye(cfg.key_dim))  # l (x) I_d
        S, d = dense.shape[2], dense.shape[3]
        L = dense.reshape(*dense.shape[:2], S * d, S * d)
        per_role.append(np.mean(np.sum((L - np.eye(S * d)) ** 2, axis=(-2, -1))) / (S * d))
    want = float(np.mean(per_role)) if per_role else 0.0
    assert got == pytest.approx(want, rel=1e-10, abs=1e-14)
    if cfg.metric != "none":
        assert got > 0
        fresh = dc.init_params(cfg)
        assert dc.metric_penalty(fresh, cfg, x, c) == 0.0


def test_init_params_distributions():
    cfg = dc.DamchaConfig(query_dim=256, num_heads=8, key_dim=32, output_dim=128)
    p = dc.init_params(cfg, seed=1)
    assert list(p) == list(cfg.param_shapes())
    limit = np.sqrt(6 / (256 + 8 * 32))
    assert np.max(np.abs(p["query.kernel"])) <= limit and np.std(p["query.kernel"]) == pytest.approx(
        limit / np.sqrt(3), rel=0.02
    )
    limit_o = np.sqrt(6 / (8 * 32 + 128))
    assert np.std(p["output.kernel"]) == pytest.approx(limit_o / np.sqrt(3), rel=0.02)
    assert np.std(p["metric.qk.kernel"]) == pytest.approx(1 / np.sqrt(256 * 8), rel=0.05)
    for n in ("query.bias", "output.bias", "metric.qk.bias", "metric.qk.gate"):
        assert np.all(p[n] == 0)
    again = dc.init_params(cfg, seed=1)
    assert all(np.array_equal(p[k], again[k]) for k in p)
    lr = dc.DamchaConfig(query_dim=256, num_heads=8, key_dim=32, metric="lowrank", metric_rank=16)
    q = dc.init_params(lr, seed=2)
    assert np.std(q["metric.qk.kernel"]) == pytest.approx(1 / 16, rel=0.05)
    assert np.std(q["metric.qk.u"]) == pytest.approx(1 / 4, rel=0.05)
    assert np.std(q["metric.qk.v"]) == pytest.approx(1 / 16, rel=0.05)


def test_params_from_mha_reproduces_the_mha():
    cfg = dc.DamchaConfig(query_dim=8, num_heads=4, key_dim=3, coupling="separate", num_kv_heads=2, context_dim=6)
    mha_cfg = cfg.replace(metric="none")
    r = np.random.default_rng(9)
    weights = {k: r.normal(size=s) for k, s in mha_cfg.param_shapes().items()}
    p = dc.params_from_mha(weights, cfg, seed=4)
    assert set(p) == set(cfg.param_shapes())
    x, c = inputs(cfg, M=3)
    np.testing.assert_allclose(
        dc.damcha_attention(p, cfg, x, c), naive_damcha(weights, mha_cfg, x, c), rtol=1e-10, atol=1e-12
    )
    with pytest.raises(dc.DamchaValueError, match="missing"):
        dc.params_from_mha({k: v for k, v in weights.items() if k != "key.bias"}, cfg)
    with pytest.raises(dc.DamchaValueError, match="metric tensors"):
        dc.params_from_mha({**weights, "metric.q.gate": np.zeros(4)}, cfg)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_any_float_input_dtype_is_computed_in_float64(dtype):
    cfg, p = make()
    x, c = inputs(cfg)
    x16, c16 = x.astype(dtype), c.astype(dtype)
    y = dc.damcha_attention({k: v.astype(dtype) for k, v in p.items()}, cfg, x16, c16)
    assert y.dtype == np.float64
    want = dc.damcha_attention(
        {k: v.astype(dtype).astype(np.float64) for k, v in p.items()},
        cfg,
        x16.astype(np.float64),
        c16.astype(np.float64),
    )
    np.testing.assert_array_equal(y, want)


def test_structure_grid_is_complete():
    seen = {(m, c) for m, c, *_ in STRUCTURES}
    assert {("heads", c) for c in dc.COUPLINGS} <= seen and {("lowrank", c) for c in dc.COUPLINGS} <= seen


# ------------------------------------------- broad random comparison with the naive loops


@st.composite
def _random_case(draw):
    """Any config (dims, bias, scale, rank 1), any lengths (N != M, M = 1, B = 1),
    broadcast masks, causal with a query offset, zero and extreme-magnitude tokens."""
    metric = draw(st.sampled_from(dc.METRICS))
    coupling = draw(st.sampled_from(dc.COUPLINGS))
    G = draw(st.integers(1, 3))
    H = G if (metric != "none" and coupling == "tied") else G * draw(st.integers(1, 3))
    E_q = draw(st.integers(1, 5))
    E_kv = E_q if (metric != "none" and coupling == "tied") else draw(st.integers(1, 5))
    cfg = dc.DamchaConfig(
        query_dim=E_q,
        num_heads=H,
        key_dim=draw(st.integers(1, 3)),
        value_dim=draw(st.integers(1, 3)),
        num_kv_heads=G,
        context_dim=E_kv,
        output_dim=draw(st.integers(1, 4)),
        use_bias=draw(st.booleans()),
        metric=metric,
        metric_rank=draw(st.integers(1, 3)) if metric == "lowrank" else None,
        coupling=coupling,
        scale=draw(st.one_of(st.none(), st.floats(0.1, 3.0))),
    )
    B, N = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    self_attn = E_kv == E_q and draw(st.booleans())
    M = N if self_attn else draw(st.integers(1, 5))
    r = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    p = {k: r.normal(size=s) for k, s in cfg.param_shapes().items()}
    magnitude = draw(st.sampled_from([1.0, 1e-3, 1e-30, 50.0]))
    x = r.normal(size=(B, N, E_q)) * magnitude
    c = None if self_attn else r.normal(size=(B, M, E_kv)) * magnitude
    x[0, 0] = 0.0  # phi(0) = 0
    if c is not None:
        c[-1, -1] = 0.0
    shape = draw(st.sampled_from([None, (N, M), (1, 1, N, M), (B, H, N, M), (B, 1, 1, M), (1, H, N, 1), (1, 1, 1, 1)]))
    mask = None if shape is None else r.random(shape) < 0.6
    causal = draw(st.booleans())
    offset = draw(st.integers(0, 5)) if causal else 0
    return cfg, p, x, c, mask, causal, offset


@settings(max_examples=150, deadline=None)
@given(_random_case())
def test_random_configs_match_the_naive_loops_and_the_explicit_path(case):
    cfg, p, x, c, mask, causal, offset = case
    kw = dict(mask=mask, causal=causal, query_offset=offset)
    y, w = dc.damcha_attention(p, cfg, x, c, return_weights=True, **kw)
    want = naive_damcha(p, cfg, x, c, **kw)
    tol = dict(rtol=1e-9, atol=1e-9 * max(1.0, float(np.max(np.abs(want)))))
    np.testing.assert_allclose(y, want, **tol)
    np.testing.assert_allclose(dc.damcha_attention(p, cfg, x, c, path="explicit", **kw), want, **tol)
    # rows with no visible key: probabilities 0 and y = output bias (0 without bias)
    empty = ~np.any(w > 0, axis=-1)  # (B, H, N)
    assert np.all(np.isfinite(w)) and np.allclose(w.sum(-1)[~empty], 1.0)
    rows = np.all(empty, axis=1)  # (B, N): every head empty
    bias = p["output.bias"] if cfg.use_bias else np.zeros(cfg.output_dim)
    np.testing.assert_allclose(y[rows], np.broadcast_to(bias, y[rows].shape), rtol=0, atol=1e-12)
    assert dc.metric_penalty(p, cfg, x, c) == pytest.approx(naive_metric_penalty(p, cfg, x, c), rel=1e-9, abs=1e-12)


def test_head_permutation_within_a_group_leaves_output_unchanged():
    """Query heads that share a key/value head may be relabelled among themselves
    (with G = 1 the group-wise permutation above is the identity)."""
    for metric, coupling, G in (("heads", "query", 1), ("lowrank", "separate", 2), ("heads", "separate", 1)):
        cfg, p = make(metric, coupling, G, 6)
        x, c = inputs(cfg)
        perm_q = np.array([1, 0, 3, 2]) if G == 2 else np.array([2, 0, 3, 1])
        q = dict(p)
        q["query.kernel"], q["query.bias"] = p["query.kernel"][:, perm_q], p["query.bias"][perm_q]
        q["output.kernel"] = p["output.kernel"][perm_q]
        pre = "metric.q"
        q[f"{pre}.gate"] = p[f"{pre}.gate"][perm_q]
        if metric == "heads":
            q[f"{pre}.kernel"] = p[f"{pre}.kernel"][:, perm_q][:, :, perm_q]
            q[f"{pre}.bias"] = p[f"{pre}.bias"][perm_q][:, perm_q]
        else:
            q[f"{pre}.u"], q[f"{pre}.v"] = p[f"{pre}.u"][perm_q], p[f"{pre}.v"][perm_q]
        got = naive_damcha(q, cfg, x, c)
        np.testing.assert_allclose(got, naive_damcha(p, cfg, x, c), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(dc.damcha_attention(q, cfg, x, c), got, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("structure", STRUCTURES[1:], ids=STRUCTURE_IDS[1:])
@pytest.mark.parametrize("use_bias", [True, False])
def test_folded_mha_equals_the_naive_static_metric(structure, use_bias):
    """Foldability against the independent loops: the naive DAMCHA with a static
    metric (zero generator kernels, non-zero generator biases) equals the naive
    MHA run on the folded kernels."""
    cfg, p = make(*structure, use_bias=use_bias)
    for side in cfg.metric_sides:
        p[f"metric.{side}.kernel"] = np.zeros_like(p[f"metric.{side}.kernel"])
    x, c = inputs(cfg)
    folded, mha_cfg = dc.fold_static_metric(p, cfg)
    assert set(folded) == set(mha_cfg.param_shapes())
    np.testing.assert_allclose(
        naive_damcha(folded, mha_cfg, x, c, causal=True),
        naive_damcha(p, cfg, x, c, causal=True),
        rtol=1e-10,
        atol=1e-12,
    )
