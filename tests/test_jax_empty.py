"""Empty shapes in the JAX/Flax port, as nnx.MultiHeadAttention takes them: an
empty batch (B = 0) or no query (N = 0, also self-attention's N = M = 0)
gives the empty output, empty input gradients and zero parameter gradients
(Flax's MHA, run side by side); queries over no key (M = 0, N >= 1) are
refused naming `inputs_k`. Decoding: ``init_cache`` makes an empty cache for a
batch of 0 (as Flax's does) and an empty step appends nothing."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import damcha_core as dc
import damcha_jax as dj
from damcha_conformance import case_params


@pytest.fixture(autouse=True)
def _x64():
    """float64 as in the reference, within each test: x64 is process-wide, and other
    modules' tests run in this process without it."""
    with jax.enable_x64(True):
        yield


E, H, E_KV = 8, 2, 6

# (B, N, M) with M None for self-attention.
SHAPES = {"B0-self": (0, 4, None), "B0-cross": (0, 3, 5), "N0-cross": (2, 0, 5), "N0-self": (2, 0, None)}


def _config(cross: bool) -> dc.DamchaConfig:
    return dc.DamchaConfig(
        query_dim=E, num_heads=H, key_dim=4, context_dim=E_KV if cross else E, coupling="separate" if cross else "tied"
    )


def _inputs(B, N, M) -> tuple[jax.Array, jax.Array | None]:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, N, E)))
    return x, None if M is None else jnp.asarray(rng.normal(size=(B, M, E_KV)))


def _grads(module, x, c):
    """(output, d/d inputs_q, d/d params) of sum(module(x, c))."""

    def loss(m, x):
        return m(x, c).sum()

    y = module(x, c)
    g_module, g_x = nnx.grad(loss, argnums=(0, 1))(module, x)
    return y, g_x, jax.tree_util.tree_leaves(nnx.state(g_module, nnx.Param))


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_module_matches_flax_mha_on_empty_shapes(shape) -> None:
    B, N, M = shape
    config = _config(M is not None)
    ours = dj.DamchaAttention.from_canonical(case_params(config, 0), config, param_dtype=jnp.float64)
    kv = {} if M is None else {"in_kv_features": E_KV}
    flax = nnx.MultiHeadAttention(H, E, decode=False, rngs=nnx.Rngs(0), param_dtype=jnp.float64, **kv)
    x, c = _inputs(B, N, M)
    y, g_x, g_params = _grads(ours, x, c)
    y_ref, g_x_ref, g_params_ref = _grads(flax, x, c)
    assert (y.shape, y.dtype) == (y_ref.shape, y_ref.dtype) == ((B, N, E), jnp.float64)
    assert g_x.shape == g_x_ref.shape == x.shape
    # Every parameter's gradient is zeros, as every Flax MHA parameter's.
    assert g_params_ref and all(not np.asarray(g).any() for g in g_params_ref)
    assert g_params and all(not np.asarray(g).any() for g in g_params)
    want = dc.damcha_attention(case_params(config, 0), config, np.asarray(x), None if c is None else np.asarray(c))
    assert y.shape == want.shape


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_module_masks_causal_weights_and_jit_on_empty_shapes(shape) -> None:
    B, N, M = shape
    config = _config(M is not None)
    ours = dj.DamchaAttention.from_canonical(case_params(config, 0), config, param_dtype=jnp.float64)
    x, c = _inputs(B, N, M)
    K = N if M is None else M
    outs = [
        ours(x, c, mask=jnp.ones((B, 1, N, K), bool)),
        ours(x, c, is_causal=True),
        ours(x, c, sow_weights=True),
        nnx.jit(lambda m, x, c: m(x, c))(ours, x, c),
        ours(x[None], None if c is None else c[None]),  # two batch axes
    ]
    for y in outs[:4]:
        assert y.shape == (B, N, E)
    assert outs[4].shape == (1, B, N, E)
    assert float(ours.metric_penalty(x, c)) == dc.metric_penalty(
        case_params(config, 0), config, np.asarray(x), None if c is None else np.asarray(c)
    )


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_functional_matches_the_reference_on_empty_shapes(shape) -> None:
    B, N, M = shape
    config = _config(M is not None)
    params = case_params(config, 1)
    x, c = _inputs(B, N, M)
    y, w, maps = dj.damcha_attention(params, config, x, c, return_weights=True, return_metric=True)
    y_ref, w_ref, maps_ref = dc.damcha_attention(
        params, config, np.asarray(x), None if c is None else np.asarray(c), return_weights=True, return_metric=True
    )
    assert (y.shape, w.shape, y.dtype) == (y_ref.shape, w_ref.shape, jnp.float64)
    for role in maps_ref:
        np.testing.assert_allclose(np.asarray(maps[role]), maps_ref[role], rtol=1e-12, atol=1e-12)
    g = jax.grad(lambda p: dj.damcha_attention(p, config, x, c).sum())({k: jnp.asarray(v) for k, v in params.items()})
    assert all(not np.asarray(v).any() for v in g.values())
    assert float(dj.metric_penalty(params, config, x, c)) == pytest.approx(
        dc.metric_penalty(params, config, np.asarray(x), None if c is None else np.asarray(c)), rel=1e-12, abs=1e-15
    )


@pytest.mark.parametrize("B", [0, 2], ids=["B0", "B2"])
def test_decode_with_an_empty_batch_or_step(B) -> None:
    """``init_cache`` with batch_size=0 is an empty cache (Flax's init_cache((0, L, E))
    makes one too); an empty step appends nothing: the steps equal one causal
    pass of the reference."""
    config = _config(False)
    params = case_params(config, 0)
    x = np.random.default_rng(4).normal(size=(B, 5, E))
    want = dc.damcha_attention(params, config, x, causal=True)
    cache = dj.init_cache(config, B, 5, jnp.float64)
    for a, b in [(0, 2), (2, 2), (2, 3), (3, 5)]:
        y, cache = dj.decode_step(params, config, cache, jnp.asarray(x[:, a:b]))
        assert y.shape == (B, b - a, E)
        np.testing.assert_allclose(np.asarray(y), want[:, a:b], rtol=1e-10, atol=1e-12)
    assert int(cache["index"]) == 5
    module = dj.DamchaAttention.from_canonical(params, config, param_dtype=jnp.float64, decode=True)
    module.init_cache((B, 5, E), jnp.float64)
    ys = [module(jnp.asarray(x[:, a:b])) for a, b in [(0, 1), (1, 1), (1, 2)]]
    np.testing.assert_allclose(np.asarray(jnp.concatenate(ys, axis=1)), want[:, :2], rtol=1e-10, atol=1e-12)


def test_queries_over_no_key_are_refused_naming_inputs_k() -> None:
    config = _config(True)
    ours = dj.DamchaAttention.from_canonical(case_params(config, 0), config)
    for shape in [(2, 0, E_KV), (0, 0, E_KV), (1, 2, 0, E_KV)]:
        x = jnp.ones((*shape[:-2], 3, E))
        pattern = rf"^Invalid argument `inputs_k`: expected at least one key \(M >= 1\).*Received: inputs_k.shape={re.escape(str(shape))}$"
        with pytest.raises(dc.DamchaValueError, match=pattern):
            ours(x, jnp.ones(shape))
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `inputs_q`: expected 8 features.*\(0, 3, 7\)"):
        ours(jnp.ones((0, 3, 7)), jnp.ones((0, 5, E_KV)))
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `max_length`: expected an int >= 1"):
        dj.init_cache(config, 0, 0)
