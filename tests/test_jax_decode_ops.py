"""decode_step at B=1: how many ops a step costs next to Flax's MHA decode
step (jaxpr equation counts, never timings), and the compiled step equals
the op-by-op one."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import damcha_core as dc
import damcha_jax as dj
from damcha_conformance import case_params

FAST = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}
fast_jit = functools.partial(jax.jit, compiler_options=FAST)
E, H, D, L = 32, 4, 8, 16


def _count(jaxpr, counts: collections.Counter | None = None) -> collections.Counter:
    """Primitive equations by name, nested calls (jit, custom_jvp) opened up."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        subs = [
            v
            for value in eqn.params.values()
            for v in (value if isinstance(value, (list, tuple)) else [value])
            if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns")
        ]
        for sub in subs:
            _count(sub if hasattr(sub, "eqns") else sub.jaxpr, counts)
        if not subs:
            counts[eqn.primitive.name] += 1
    return counts


def _flax_step_counts() -> collections.Counter:
    mha = nnx.MultiHeadAttention(H, E, qkv_features=H * D, decode=True, rngs=nnx.Rngs(0))
    mha.init_cache((1, L, E))
    graphdef, state = nnx.split(mha)

    def step(state, x):
        module = nnx.merge(graphdef, state)
        return module(x), nnx.state(module)

    return _count(jax.make_jaxpr(step)(state, jnp.ones((1, 1, E))).jaxpr)


def _damcha_step_counts(config: dc.DamchaConfig, api: str) -> collections.Counter:
    x = jnp.ones((1, 1, E))
    if api == "decode_step":
        params = {k: jnp.asarray(v, jnp.float32) for k, v in case_params(config, 0).items()}
        step = lambda p, cache, x: dj.decode_step(p, config, cache, x)  # noqa: E731
        return _count(jax.make_jaxpr(step)(params, dj.init_cache(config, 1, L), x).jaxpr)
    layer = dj.DamchaAttention(H, E, qkv_features=H * D, decode=True, coupling=config.coupling, rngs=nnx.Rngs(0))
    layer.init_cache((1, L, E))
    graphdef, state = nnx.split(layer)

    def module_step(state, x):
        module = nnx.merge(graphdef, state)
        return module(x), nnx.state(module)

    return _count(jax.make_jaxpr(module_step)(state, x).jaxpr)


# DAMCHA's own work in a step, over Flax's: the generator (1 GEMM, its RMS
# scale, the gate and identity folded into l(t)) and the two head maps (q
# and k). A step is traced (decode_step compiles it, the module runs under
# jit), where each map is S multiply-adds (cross_head_maps' terms: XLA fuses
# them into the cache update and q's copy, test_jax_compiled_cost counts the
# compiled thunks), about 8 S equations per side here. Measured 90 (tied) /
# 59 (query) / 106 (separate) on JAX 0.10.2 (26 / 26 / 42 as one batched
# product per side); the margin leaves room for a JAX upgrade, not for a
# second pass.
MARGIN = {"tied": 96, "query": 64, "separate": 112}


@pytest.mark.parametrize("api", ["decode_step", "module"])
@pytest.mark.parametrize("coupling", ["tied", "query", "separate"])
def test_decode_step_ops_stay_within_a_margin_of_flax_mha(coupling: str, api: str) -> None:
    """One B=1 decode step of the pure decode_step and of DamchaAttention(decode=True)."""
    config = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D, coupling=coupling)
    flax_counts, damcha_counts = _flax_step_counts(), _damcha_step_counts(config, api)
    extra = sum(damcha_counts.values()) - sum(flax_counts.values())
    assert 0 < extra <= MARGIN[coupling], (extra, damcha_counts, flax_counts)
    # GEMMs: Flax's 6 (q, k, v, logits, probs x v, out) and one per generator (a tied
    # generator is evaluated once for q and k); the head maps are multiply-adds.
    generators = 2 if coupling == "separate" else 1
    assert damcha_counts["dot_general"] == flax_counts["dot_general"] + generators
    # One RMS scale per step, shared by every generator reading the same tokens.
    assert damcha_counts["rsqrt"] == 1


@pytest.mark.parametrize("coupling", ["tied", "separate"])
def test_compiled_decode_equals_op_by_op_and_jit(coupling: str) -> None:
    """decode_step runs its checked math as one compiled program; it equals the
    same steps op by op (jax.disable_jit), a jitted loop, and the reference's
    causal forward."""
    config = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D, coupling=coupling)
    params = {k: jnp.asarray(v, jnp.float32) for k, v in case_params(config, 0).items()}
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, E)), jnp.float32)

    def loop(params, x):
        cache, ys = dj.init_cache(config, 1, 8), []
        for t in range(x.shape[1]):
            y, cache = dj.decode_step(params, config, cache, x[:, t : t + 1])
            ys.append(y)
        return jnp.concatenate(ys, axis=1), cache["index"]

    eager, index = loop(params, x)
    with jax.disable_jit():
        op_by_op, _ = loop(params, x)
    jitted, _ = fast_jit(loop)(params, x)
    assert int(index) == 5
    np.testing.assert_allclose(eager, op_by_op, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-6)
    expected = dc.damcha_attention({k: np.asarray(v) for k, v in params.items()}, config, np.asarray(x), causal=True)
    np.testing.assert_allclose(eager, expected, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize(
    "kind, hint",
    [("bool", "causal"), ("bool", "padding"), ("float", "causal")],
    ids=["numpy-bool-causal", "numpy-bool-padding", "numpy-float-causal"],
)
def test_a_numpy_mask_with_a_hint_takes_the_compiled_step(kind: str, hint: str, monkeypatch) -> None:
    """A NumPy mask with ``mask_hint`` (checked on the host against its hint) runs the
    one compiled program, as a JAX mask does: it took the op-by-op step once (about
    5x slower at E=512). The steps equal the reference's causal forward (the causal
    masks) or its causal forward with one key hidden (the padding mask)."""
    from damcha_jax import _cache

    config = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D)
    params = {k: jnp.asarray(v, jnp.float32) for k, v in case_params(config, 0).items()}
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 6, E)), jnp.float32)
    hidden = 1 if hint == "padding" else None  # a padded key: position 1

    def op_by_op(*args, **kwargs):
        raise AssertionError("decode_step took the op-by-op step")

    monkeypatch.setattr(_cache, "_step", op_by_op)  # the compiled step wraps the original
    cache, ys = dj.init_cache(config, 1, L), []
    for t in range(x.shape[1]):
        if hint == "padding":  # a key-padding mask over the whole cache; the cache hides what is unfilled
            m = np.ones((1, L), bool)
            m[0, hidden] = False
        else:  # the cache's causal rule written out: keys up to this token's position
            m = np.zeros((1, L), bool)
            m[0, : t + 1] = True
        mask = m.astype(np.float32) if kind == "float" else m
        y, cache = dj.decode_step(params, config, cache, x[:, t : t + 1], mask=mask, mask_hint=hint)
        ys.append(y)
    got = np.asarray(jnp.concatenate(ys, axis=1))
    causal = np.tril(np.ones((6, 6), bool))
    if hidden is not None:
        causal[:, hidden] = False
    expected = dc.damcha_attention(
        {k: np.asarray(v) for k, v in params.items()}, config, np.asarray(x), mask=causal[None, None]
    )
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-5)


def _compiled_cost(fn, *args) -> tuple[float, int]:
    """XLA:CPU's bytes accessed by the compiled ``fn`` and its copy instructions (layout changes)."""
    with jax.default_device(jax.devices("cpu")[0]):
        compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["bytes accessed"], compiled.as_text().count(" copy(")


def test_jitted_decode_step_compiles_to_the_modules_step() -> None:
    """The pure decode_step under jit reads what DamchaAttention(decode=True)'s step reads
    (one coupling: the output projection does not depend on it).

    Its output projection was jnp.einsum("bnhd,hde->bne"), which contracts
    (d, h) (einsum's sorted names): XLA copied the whole output kernel (and
    o) to that layout every step, 54036 bytes here against the module's
    45844 (at the benchmark's E=512: 13.4 MB against 11.2 MB per B=1 step).
    """
    layer = dj.DamchaAttention(H, E, qkv_features=H * D, decode=True, rngs=nnx.Rngs(0))
    layer.init_cache((1, L, E))
    config = layer.config
    graphdef, cache, params = nnx.split(layer, nnx.Cache, ...)
    x = jnp.ones((1, 1, E))

    def module_step(cache, x, params):
        module = nnx.merge(graphdef, cache, params)
        return module(x), nnx.state(module, nnx.Cache)

    module = _compiled_cost(module_step, cache, x, params)
    functional = _compiled_cost(
        lambda cache, x, p: dj.decode_step(p, config, cache, x), dj.init_cache(config, 1, L), x, layer.arrays()
    )
    assert functional == module, (functional, module)
