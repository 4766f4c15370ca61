"""The pure functional API: jit, grad, vmap, recompilation, masks, decoding, errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import damcha_core as dc
import damcha_jax as dj
from damcha_conformance import case_params

# See test_jax_module.py: one cheaply compiled program per check.
FAST = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}
fast_jit = functools.partial(jax.jit, compiler_options=FAST)

CFG = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4)
CROSS = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, num_kv_heads=2, context_dim=12, coupling="separate")


def _params(config: dc.DamchaConfig, seed: int = 0) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v, jnp.float32) for k, v in case_params(config, seed).items()}


def _x(shape, seed: int = 0) -> jax.Array:
    # NumPy draws: an eager jax.random call compiles a kernel per shape.
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def test_jit_retraces_only_for_new_shapes() -> None:
    traces = []

    def fn(params, x, mask):
        traces.append(x.shape)
        return dj.damcha_attention(params, CFG, x, mask=mask, is_causal=True)

    jitted = fast_jit(fn)
    params = _params(CFG)
    mask = jnp.ones((2, 1, 1, 6), bool)
    y1 = jitted(params, _x((2, 6, 16)), mask)
    jitted(_params(CFG, seed=1), _x((2, 6, 16), seed=1), mask.at[1, ..., 4:].set(False))  # new values
    assert traces == [(2, 6, 16)]
    jitted(params, _x((3, 6, 16)), jnp.ones((3, 1, 1, 6), bool))  # a new batch size: one trace
    jitted(params, _x((2, 6, 16)), mask)  # back to the first: cached
    assert traces == [(2, 6, 16), (3, 6, 16)] and jitted._cache_size() == 2
    expected = dc.damcha_attention(
        {k: np.asarray(v) for k, v in params.items()}, CFG, np.asarray(_x((2, 6, 16))), causal=True
    )
    np.testing.assert_allclose(y1, expected, rtol=2e-4, atol=2e-5)


def test_grad_matches_reference_directional_derivative() -> None:
    params, x = _params(CROSS), _x((2, 5, 16))
    c = _x((2, 7, 12), seed=1)
    mask = np.random.default_rng(2).random((2, 4, 5, 7)) < 0.7
    mask[..., 0] = True
    mask = jnp.asarray(mask)

    def loss(params, x, c):
        return jnp.sum(jnp.sin(dj.damcha_attention(params, CROSS, x, c, mask=mask)))

    grads = fast_jit(jax.grad(loss, argnums=(0, 1, 2)))(params, x, c)
    # Central difference of the float64 reference along one random direction per tensor.
    np_params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    ref = lambda p, x, c: np.sum(np.sin(dc.damcha_attention(p, CROSS, x, c, mask=np.asarray(mask))))  # noqa: E731
    rng = np.random.default_rng(0)
    targets = {"query": (1, None), "context": (2, None), **{k: (0, k) for k in params}}
    for name, (arg, key) in targets.items():
        g = np.asarray(grads[arg] if key is None else grads[0][key], np.float64)
        direction = rng.normal(size=g.shape)
        args = [np_params, np.asarray(x, np.float64), np.asarray(c, np.float64)]

        def moved(sign: float, args=args, arg=arg, key=key, direction=direction):
            a = list(args)
            if key is None:
                a[arg] = a[arg] + sign * 1e-5 * direction
            else:
                a[0] = {**np_params, key: np_params[key] + sign * 1e-5 * direction}
            return ref(*a)

        fd = (moved(1.0) - moved(-1.0)) / 2e-5
        assert abs(np.sum(g * direction) - fd) <= 1e-3 * (1 + abs(fd)), name


def test_vmap_over_params_and_leading_axis() -> None:
    stacked = jax.tree.map(lambda *a: jnp.stack(a), _params(CFG, 0), _params(CFG, 1), _params(CFG, 2))
    x = _x((3, 2, 5, 16))

    def ensemble(stacked, x):
        per_member = jax.vmap(lambda p, xi: dj.damcha_attention(p, CFG, xi, is_causal=True))(stacked, x)
        shared_params = jax.vmap(lambda xi: dj.damcha_attention(_params(CFG, 0), CFG, xi))(x)
        return per_member, shared_params

    per_member, shared_params = fast_jit(ensemble)(stacked, x)
    for i in range(3):
        p = {k: np.asarray(v[i]) for k, v in stacked.items()}
        np.testing.assert_allclose(
            per_member[i], dc.damcha_attention(p, CFG, np.asarray(x[i]), causal=True), rtol=2e-4, atol=2e-5
        )
        p0 = {k: np.asarray(v) for k, v in _params(CFG, 0).items()}
        np.testing.assert_allclose(
            shared_params[i], dc.damcha_attention(p0, CFG, np.asarray(x[i])), rtol=2e-4, atol=2e-5
        )


def test_all_masked_rows_give_bias_and_finite_zero_gradients() -> None:
    params, x, c = _params(CROSS), _x((2, 5, 16)), _x((2, 7, 12), seed=1)
    mask = np.ones((2, 4, 5, 7), bool)
    mask[0, :, 1, :] = False  # query 1 of batch 0 sees nothing in any head
    mask[1, :, :, :3] = False  # with causal, queries 0-2 of batch 1 see nothing
    mask = jnp.asarray(mask)

    def fn(params, x, c):
        y = dj.damcha_attention(params, CROSS, x, c, mask=mask, is_causal=True)
        grads = jax.grad(
            lambda p, x, c: jnp.sum(dj.damcha_attention(p, CROSS, x, c, mask=mask, is_causal=True) ** 2),
            argnums=(0, 1, 2),
        )(params, x, c)
        return y, grads

    y, (g_params, g_x, g_c) = fast_jit(fn)(params, x, c)
    bias = np.asarray(params["output.bias"])
    np.testing.assert_array_equal(y[0, 1], bias)
    np.testing.assert_array_equal(y[1, :3], np.broadcast_to(bias, (3, bias.size)))
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves((g_params, g_x, g_c)))
    # Those rows' output is a constant: their queries get exactly zero gradient.
    np.testing.assert_array_equal(g_x[0, 1], 0.0)
    np.testing.assert_array_equal(g_x[1, :3], 0.0)
    assert np.abs(np.asarray(g_x[0, 2:])).max() > 0  # rows that see several keys do get one
    expected = dc.damcha_attention(
        {k: np.asarray(v) for k, v in params.items()},
        CROSS,
        np.asarray(x),
        np.asarray(c),
        mask=np.asarray(mask),
        causal=True,
    )
    np.testing.assert_allclose(y, expected, rtol=2e-4, atol=2e-5)


def test_weights_path_equals_fused_path_and_reference() -> None:
    params, x = _params(CFG), _x((2, 6, 16))
    mask = jnp.asarray(np.arange(6)[None, None, None, :] < np.array([6, 3])[:, None, None, None])

    def fn(params, x):
        fused = dj.damcha_attention(params, CFG, x, mask=mask, is_causal=True)
        y, w, metric = dj.damcha_attention(
            params, CFG, x, mask=mask, is_causal=True, return_weights=True, return_metric=True
        )
        return fused, y, w, metric

    fused, y, w, metric = fast_jit(fn)(params, x)
    np_params = {k: np.asarray(v) for k, v in params.items()}
    ref_y, ref_w, ref_metric = dc.damcha_attention(
        np_params, CFG, np.asarray(x), mask=np.asarray(mask), causal=True, return_weights=True, return_metric=True
    )
    np.testing.assert_allclose(fused, y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w, ref_w, rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(y, ref_y, rtol=2e-4, atol=2e-5)
    assert set(metric) == set(ref_metric) == {"q", "k"}
    np.testing.assert_allclose(metric["q"], ref_metric["q"], rtol=2e-4, atol=2e-5)


def test_functional_decode_under_jit_equals_causal_forward() -> None:
    params, x = _params(CROSS.replace(context_dim=16, coupling="query")), _x((2, 6, 16))
    config = CROSS.replace(context_dim=16, coupling="query")

    def fn(params, x):
        cache = dj.init_cache(config, 2, 6)
        ys = []
        for t in range(6):  # the cache index is traced inside jit
            y, cache = dj.decode_step(params, config, cache, x[:, t : t + 1])
            ys.append(y)
        return jnp.concatenate(ys, axis=1), dj.damcha_attention(params, config, x, is_causal=True)

    steps, full = fast_jit(fn)(params, x)
    np.testing.assert_allclose(steps, full, rtol=1e-5, atol=1e-5)


def test_functional_decode_overflow_under_jit_is_nan() -> None:
    """A traced cache index cannot be checked on the host: a step past
    max_length gives NaN (dynamic_update_slice would clamp the index and
    overwrite the last slot silently); the steps before it are unchanged."""
    config = CROSS.replace(context_dim=16, coupling="query")
    params, x = _params(config), _x((2, 4, 16))

    def fn(params, x):
        cache = dj.init_cache(config, 2, 3)
        ys = []
        for t in range(4):
            y, cache = dj.decode_step(params, config, cache, x[:, t : t + 1])
            ys.append(y)
        return jnp.concatenate(ys, axis=1), dj.damcha_attention(params, config, x[:, :3], is_causal=True)

    steps, full = fast_jit(fn)(params, x)
    np.testing.assert_allclose(steps[:, :3], full, rtol=1e-5, atol=1e-5)
    assert np.isnan(np.asarray(steps[:, 3])).all()


@pytest.mark.parametrize("used", [0, 2, 3], ids=["empty", "part-used", "full"])
def test_decode_chunk_longer_than_the_room_left_says_how_much_is_left(used: int) -> None:
    """The message said "the cache is full" for an empty cache too."""
    config = CROSS.replace(context_dim=16, coupling="query")
    params, x = _params(config), _x((2, 4, 16))
    cache = dj.init_cache(config, 2, 3)
    if used:
        _, cache = dj.decode_step(params, config, cache, x[:, :used])
    state = "the cache is full" if used == 3 else f"the cache has room for {3 - used} more"
    with pytest.raises(
        dc.DamchaValueError,
        match=rf"at most {3 - used} new tokens: {state} \({used} of max_length=3 positions are used\)",
    ):
        dj.decode_step(params, config, cache, x[:, : 4 - used + 1 if used < 3 else 1])


def test_functional_decode_respects_padding_mask() -> None:
    """The mask spans the cache (B, H|1, T, L); decoding with it equals the full
    masked causal forward; a float 0/1 mask is read as the bool one, an additive
    0/-inf mask is refused as in the full call."""
    config = CROSS.replace(context_dim=16, coupling="query")
    params, x = _params(config), _x((2, 6, 16))
    pad = np.ones((2, 1, 1, 6), bool)
    pad[1, ..., 2:4] = False  # batch row 1 hides keys 2 and 3
    cache = dj.init_cache(config, 2, 6)
    ys = []
    for t in range(6):
        y, cache = dj.decode_step(params, config, cache, x[:, t : t + 1], mask=jnp.asarray(pad))
        ys.append(y)
    full = dj.damcha_attention(params, config, x, mask=jnp.asarray(pad), is_causal=True)
    np.testing.assert_allclose(jnp.concatenate(ys, axis=1), full, rtol=1e-5, atol=1e-5)
    unmasked = dj.damcha_attention(params, config, x, is_causal=True)
    assert np.max(np.abs(np.asarray(full) - np.asarray(unmasked))) > 1e-3  # the mask matters here
    y_float, _ = dj.decode_step(
        params, config, dj.init_cache(config, 2, 6), x[:, :1], mask=jnp.asarray(pad, jnp.float32)
    )
    np.testing.assert_array_equal(y_float, ys[0])
    additive = jnp.where(jnp.asarray(pad), 0.0, -jnp.inf)
    with pytest.raises(
        dc.DamchaValueError,
        match="Invalid argument `mask`: expected a mask that is boolean .*Received: mask=.* holds other values",
    ):
        dj.decode_step(params, config, dj.init_cache(config, 2, 6), x[:, :1], mask=additive)


def test_metric_penalty_matches_reference() -> None:
    lowrank = CROSS.replace(metric="lowrank", metric_rank=3)
    for config in (CFG, lowrank):
        params = _params(config)
        x = _x((2, 5, 16))
        c = None if config is CFG else _x((2, 7, 12), seed=1)
        actual = dj.metric_penalty(params, config, x, c)
        expected = dc.metric_penalty(
            {k: np.asarray(v) for k, v in params.items()}, config, np.asarray(x), None if c is None else np.asarray(c)
        )
        np.testing.assert_allclose(actual, expected, rtol=1e-4)


# ---------------------------------------------------------------- bad input

_P = {k: np.asarray(v, np.float32) for k, v in case_params(CFG, 0).items()}
_X = np.ones((2, 5, 16), np.float32)

BAD = {
    "config-not-config": (dict(config={"query_dim": 16}), {}),
    "query-int": (dict(query=np.ones((2, 5, 16), np.int32)), {}),
    "query-rank-2": (dict(query=np.ones((5, 16), np.float32)), {}),
    "query-features": (dict(query=np.ones((2, 5, 8), np.float32)), {}),
    "context-batch": (dict(context=np.ones((3, 5, 16), np.float32)), {}),
    "mask-3d": (dict(mask=np.ones((2, 5, 5), bool)), {}),
    "mask-wrong-len": (dict(mask=np.ones((5, 4), bool)), {}),
    "param-missing": (dict(params={k: v for k, v in _P.items() if k != "key.bias"}), {}),
    "param-shape": (dict(params={**_P, "query.kernel": np.ones((16, 4, 5), np.float32)}), {}),
    "param-int": (dict(params={**_P, "metric.qk.gate": np.zeros(4, np.int32)}), {}),
    "causal-not-bool": ({}, dict(causal="yes")),
    "offset-negative": ({}, dict(query_offset=-1)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_the_reference_error(case: str) -> None:
    args, flags = BAD[case]
    call = {**dict(params=_P, config=CFG, query=_X, context=None, mask=None), **args}
    with pytest.raises(dc.DamchaError) as ref:
        dc.damcha_attention(call["params"], call["config"], call["query"], call["context"], mask=call["mask"], **flags)
    jax_flags = {("is_causal" if k == "causal" else k): v for k, v in flags.items()}
    with pytest.raises(dc.DamchaError) as got:
        dj.damcha_attention(
            call["params"], call["config"], call["query"], call["context"], mask=call["mask"], **jax_flags
        )
    assert type(got.value) is type(ref.value)
    assert str(got.value) == str(ref.value).replace("`causal`", "`is_causal`").replace("causal=", "is_causal=")


_CACHE = {k: np.asarray(v) for k, v in dj.init_cache(CFG, 2, 6).items()}
_OTHER = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, value_dim=3, num_kv_heads=2, coupling="query")
BAD_DECODING = {
    # A concrete negative offset is as wrong as -1 (a traced one cannot be checked).
    "offset-negative-array": (
        dc.DamchaValueError,
        r"query_offset=-1 ",
        lambda: dj.damcha_attention(_P, CFG, _X, is_causal=True, query_offset=jnp.int32(-1)),
    ),
    "offset-negative-numpy": (
        dc.DamchaValueError,
        r"query_offset=-2 ",
        lambda: dj.damcha_attention(_P, CFG, _X, is_causal=True, query_offset=np.int64(-2)),
    ),
    "cache-of-other-kv-heads": (
        dc.DamchaValueError,
        r"Invalid argument `cache\['key'\]`: expected shape .*\(B, max_length, 4, 4\).*shape=\(2, 6, 2, 4\)",
        lambda: dj.decode_step(_P, CFG, dj.init_cache(_OTHER, 2, 6), _X[:, :1]),
    ),
    "cache-of-other-value-dim": (
        dc.DamchaValueError,
        r"Invalid argument `cache\['value'\]`: expected shape .*shape=\(2, 6, 4, 3\)",
        lambda: dj.decode_step(_P, CFG, {**_CACHE, "value": np.zeros((2, 6, 4, 3), np.float32)}, _X[:, :1]),
    ),
    "cache-index-vector": (
        dc.DamchaValueError,
        r"Invalid argument `cache\['index'\]`: expected an integer scalar",
        lambda: dj.decode_step(_P, CFG, {**_CACHE, "index": np.zeros(2, np.int32)}, _X[:, :1]),
    ),
    "cache-int-dtype": (
        dc.DamchaTypeError,
        r"Invalid argument `dtype`: expected a floating dtype. Received: dtype=",
        lambda: dj.init_cache(CFG, 2, 6, jnp.int32),
    ),
    # A bad precision named the argument only as JAX's internals did, at the first product.
    "precision-attention": (
        dc.DamchaValueError,
        r"Invalid argument `precision`: expected None, a jax\.lax\.Precision .*Received: precision='bogus'",
        lambda: dj.damcha_attention(_P, CFG, _X, precision="bogus"),
    ),
    "precision-decode": (
        dc.DamchaTypeError,
        r"Invalid argument `precision`.*Received: precision=3",
        lambda: dj.decode_step(_P, CFG, dj.init_cache(CFG, 2, 6), _X[:, :1], precision=3),
    ),
    "precision-transformed": (
        dc.DamchaValueError,
        r"Invalid argument `precision`.*Received: precision=\('highest', 'fast'\)",
        lambda: dj.transformed_qkv(_P, CFG, _X, precision=("highest", "fast")),
    ),
    "coefficients-metric": (
        dc.DamchaValueError,
        r"Invalid argument `metric`: expected one of .*Received: metric='none'",
        lambda: dj.coefficients("none", _P["metric.qk.kernel"], _P["metric.qk.bias"], _X),
    ),
    # The generator's leaves were not checked: a bias of one row broadcast, a kernel
    # of one head gave coefficients of another shape, a wrong E an einsum error.
    "coefficients-bias": (
        dc.DamchaValueError,
        r"Invalid argument `bias`: expected shape \(S, S\) for metric 'heads' with S=4\. Received: bias\.shape=\(1, 4\)",
        lambda: dj.coefficients("heads", _P["metric.qk.kernel"], _P["metric.qk.bias"][:1], _X),
    ),
    "coefficients-kernel": (
        dc.DamchaValueError,
        r"Invalid argument `kernel`: expected shape \(E, S, S\) for metric 'heads' with E=16\. "
        r"Received: kernel\.shape=\(16, 1, 4\)",
        lambda: dj.coefficients("heads", _P["metric.qk.kernel"][:, :1], _P["metric.qk.bias"], _X),
    ),
    "coefficients-tokens": (
        dc.DamchaValueError,
        r"Invalid argument `kernel`: expected shape \(E, S, S\) for metric 'heads' with E=8\.",
        lambda: dj.coefficients("heads", _P["metric.qk.kernel"], _P["metric.qk.bias"], _X[..., :8]),
    ),
    "coefficients-int-tokens": (
        dc.DamchaTypeError,
        r"Invalid argument `tokens`: expected a real floating array \(\.\.\., E\)",
        lambda: dj.coefficients("heads", _P["metric.qk.kernel"], _P["metric.qk.bias"], _X.astype(np.int32)),
    ),
}


@pytest.mark.parametrize("case", list(BAD_DECODING))
def test_bad_offsets_caches_and_metrics_name_the_argument(case: str) -> None:
    error, match, call = BAD_DECODING[case]
    with pytest.raises(error, match=match):
        call()


def test_decode_step_takes_a_python_int_cache_index() -> None:
    """A hand-built cache may hold a plain int index, like the Python int query_offset."""
    params, x = _params(CFG), _x((2, 6, 16))

    def fn(params, x):
        cache = dj.init_cache(CFG, 2, 6)
        _, cache = dj.decode_step(params, CFG, cache, x[:, :2])
        y_int, c_int = dj.decode_step(params, CFG, {**cache, "index": 2}, x[:, 2:3])
        y_arr, c_arr = dj.decode_step(params, CFG, cache, x[:, 2:3])
        return y_int, y_arr, c_int["index"], c_arr["index"]

    y_int, y_arr, i_int, i_arr = fast_jit(fn)(params, x)
    np.testing.assert_array_equal(y_int, y_arr)
    assert int(i_int) == int(i_arr) == 3


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (jit, custom_jvp, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for v in value if isinstance(value, (list, tuple)) else [value]:
                inner = v if hasattr(v, "eqns") else getattr(v, "jaxpr", None)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_maps_under_jit_match_the_reference_in_float64() -> None:
    """Under jit the maps are one batched product per side, their gradient a
    rearranged product (``_mix_heads``, a custom_jvp): forward, reverse and
    forward-mode derivatives equal the float64 reference."""
    config = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=3)  # d=3: l (.., 4, 4) and y (.., 4, 3) differ
    with jax.enable_x64(True):
        params = {k: jnp.asarray(v) for k, v in case_params(config, 0).items()}
        params = {k: v + 0.3 if k.endswith("gate") else v for k, v in params.items()}  # open gates
        x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 40, 16)))  # 80 tokens
        fn = lambda p, x: dj.damcha_attention(p, config, x, is_causal=True)  # noqa: E731
        map_products = [
            e
            for e in _eqns(jax.make_jaxpr(fn)(params, x).jaxpr)
            if e.primitive.name == "dot_general" and e.invars[0].aval.shape == (2, 40, 4, 4)
        ]
        # k's map: one batched product; q's (with its bias) is _mix_query's S multiply-adds.
        assert len(map_products) == 1
        mix_query = [e for e in _eqns(jax.make_jaxpr(fn)(params, x).jaxpr) if e.primitive.name.startswith("custom_jvp")]
        assert mix_query
        np_params = {k: np.asarray(v) for k, v in params.items()}
        ref = lambda p, x: dc.damcha_attention(p, config, x, causal=True)  # noqa: E731
        np.testing.assert_allclose(jax.jit(fn)(params, x), ref(np_params, np.asarray(x)), rtol=1e-10, atol=1e-12)

        loss = lambda p, x: jnp.sum(jnp.sin(fn(p, x)))  # noqa: E731
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
        rng = np.random.default_rng(1)
        dp = {k: rng.normal(size=v.shape) for k, v in np_params.items()}
        dx = rng.normal(size=x.shape)
        _, jvp = jax.jit(lambda p, x, dp, dx: jax.jvp(loss, (p, x), (dp, dx)))(params, x, dp, dx)

        def ref_loss(t: float) -> float:
            moved = {k: v + t * dp[k] for k, v in np_params.items()}
            return float(np.sum(np.sin(ref(moved, np.asarray(x) + t * dx))))

        fd = (ref_loss(1e-6) - ref_loss(-1e-6)) / 2e-6
        along = sum(float(np.sum(np.asarray(grads[0][k]) * dp[k])) for k in dp) + float(
            np.sum(np.asarray(grads[1]) * dx)
        )
        assert abs(along - fd) <= 1e-6 * (1 + abs(fd)) and abs(float(jvp) - fd) <= 1e-6 * (1 + abs(fd))
