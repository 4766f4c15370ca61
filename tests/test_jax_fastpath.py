"""Masks as Flax users write them reach the fused kernel's fast path.

A mask from ``nnx.make_causal_mask`` (alone or ``nnx.combine_masks``-ed with a
padding mask from ``nnx.make_attention_mask``) or a padding-only mask is given
to ``jax.nn.dot_product_attention`` as ``is_causal`` and a key mask (b, h, 1, M),
the query rows it hides zeroed, instead of the (N, M) mask. These tests hold
that path, in float64, to the explicit-mask path (outputs and gradients) and
to ``damcha_core``'s reference, and pin which path runs from the jaxpr and the
kernel's arguments (never from timings).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import damcha_core as dc
import damcha_jax as dj
from damcha_conformance import case_params
from damcha_jax import _functional as F

FAST = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}
fast_jit = functools.partial(jax.jit, compiler_options=FAST)

SELF = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4)
CROSS = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, num_kv_heads=2, context_dim=12, coupling="separate")
B, N = 2, 5
# The fused kernel's float32 softmax (see ``fused_float64``); the explicit path is held to 1e-10.
TOL = dict(rtol=1e-5, atol=1e-6)


def _close_grads(actual, expected) -> None:
    """Gradients of the fused path: float32-softmax rounding, relative to each tensor's scale."""
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.max(np.abs(b)))))


def _params(config: dc.DamchaConfig, dtype=jnp.float64) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v, dtype) for k, v in case_params(config, 0).items()}


def _normal(shape, seed: int, dtype=jnp.float64) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _ids(valid: list[list[int]]) -> jax.Array:
    return jnp.asarray(np.array(valid))


def _case(name: str):
    """(config, x, context, Flax-made mask, hint, is_causal, query_offset)."""
    # Row 0 pads token 0 (so query 0 sees no key under the causal rule), row 1 pads the end.
    ids = _ids([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    x = _normal((B, N, 16), 0)
    if name == "causal":
        return SELF, x, None, nnx.make_causal_mask(ids), "causal", False, 0
    if name == "causal+padding":
        mask = nnx.combine_masks(nnx.make_causal_mask(ids), nnx.make_attention_mask(ids > 0, ids > 0))
        return SELF, x, None, mask, "causal", False, 0
    if name == "padding":
        return SELF, x, None, nnx.make_attention_mask(ids > 0, ids > 0), "padding", False, 0
    if name == "padding+is_causal":
        return SELF, x, None, nnx.make_attention_mask(ids > 0, ids > 0), "padding", True, 0
    # Cross-attention: 3 queries at positions 4, 5, 6 over 7 keys (a rectangular causal mask).
    kv = _ids([[1, 1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    c = _normal((B, 7, 12), 1)
    xq = x[:, :3]
    if name == "cross-padding":
        return CROSS, xq, c, nnx.make_attention_mask(jnp.ones((B, 3)), kv > 0), "padding", False, 0
    positions = jnp.broadcast_to(jnp.arange(3) + 4, (B, 3))
    keys = jnp.broadcast_to(jnp.arange(7), (B, 7))
    causal = nnx.make_attention_mask(positions, keys, jnp.greater_equal)
    mask = nnx.combine_masks(causal, nnx.make_attention_mask(jnp.ones((B, 3)), kv > 0))
    return CROSS, xq, c, mask, "causal", False, 4


CASES = ["causal", "causal+padding", "padding", "padding+is_causal", "cross-padding", "cross-causal"]


def _reference(config, params, x, c, mask, is_causal, offset) -> np.ndarray:
    np_params = {k: np.asarray(v) for k, v in params.items()}
    return dc.damcha_attention(
        np_params,
        config,
        np.asarray(x),
        None if c is None else np.asarray(c),
        mask=np.asarray(mask) != 0,
        causal=is_causal,
        query_offset=offset,
    )


@pytest.fixture
def fused_float64(monkeypatch):
    """float64 through jax.nn.dot_product_attention instead of the einsum path
    float64 takes by default, so that the fast path itself is what runs. The
    kernel takes its softmax in float32 (it says so), so it agrees with the
    float64 reference to ~1e-7, not 1e-12: a wrong mask, row or key would be
    off by O(1) (``TOL``)."""
    monkeypatch.setattr(F, "EINSUM_FOR_FLOAT64", False)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The arguments every traced call of the fused kernel gets."""
    calls: list[dict] = []
    kernel = jax.nn.dot_product_attention

    def spy(q, k, v, *args, mask=None, is_causal=False, **kwargs):
        calls.append({"mask": None if mask is None else tuple(mask.shape), "is_causal": is_causal})
        return kernel(q, k, v, *args, mask=mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("name", CASES)
def test_fast_path_equals_explicit_path_and_reference_in_float64(name, fused_float64, kernel_calls) -> None:
    with jax.enable_x64(True):
        config, x, c, mask, hint, is_causal, offset = _case(name)
        params = _params(config)
        args = (params, x) if c is None else (params, x, c)

        def loss(path: str, mask, *args):
            kwargs = dict(mask=mask, is_causal=is_causal, query_offset=offset)
            if path == "hinted":
                kwargs["mask_hint"] = hint
            elif path == "explicit":
                kwargs["return_weights"] = True  # the einsum path with the whole mask
            y = dj.damcha_attention(*args[:1], config, *args[1:], **kwargs)
            y = y[0] if path == "explicit" else y
            return jnp.sum(jnp.sin(y)), y

        def grad(path: str, concrete: bool = False):
            if concrete:  # the mask is a constant of the traced function: its values are known
                return jax.value_and_grad(
                    functools.partial(loss, path, mask), argnums=tuple(range(len(args))), has_aux=True
                )
            return jax.value_and_grad(
                functools.partial(loss, path), argnums=tuple(range(1, len(args) + 1)), has_aux=True
            )

        (_, y_hint), g_hint = fast_jit(grad("hinted"))(mask, *args)  # a traced mask: the hint's path
        (_, y_host), g_host = fast_jit(grad("unhinted", concrete=True))(*args)  # a concrete 0/1 mask: read
        (_, y_exp), g_exp = fast_jit(grad("explicit"))(mask, *args)
        causal = is_causal or hint == "causal"
        expected = _reference(config, params, x, c, mask, causal, offset)
        np.testing.assert_allclose(y_exp, expected, rtol=1e-10, atol=1e-12)
        for y, g in ((y_hint, g_hint), (y_host, g_host)):
            np.testing.assert_allclose(y, expected, **TOL)
            _close_grads(g, g_exp)
        # Query rows that see no key give the output bias.
        n, m = x.shape[1], mask.shape[-1]
        visible = np.asarray(mask)[:, 0] != 0
        if causal:
            visible = visible & (np.arange(m)[None, :] <= np.arange(n)[:, None] + offset)
        empty = ~visible.any(-1)
        assert empty.any() == (name in ("causal+padding", "padding", "padding+is_causal"))
        np.testing.assert_allclose(np.asarray(y_hint)[empty], np.broadcast_to(params["output.bias"], (empty.sum(), 16)))
    if offset == 0:
        # Both fast calls gave the kernel a key mask (b, 1, 1, M) (none where the host sees every key visible)
        # and the causal rule, never an (N, M) mask.
        assert len(kernel_calls) == 2 and kernel_calls[0]["mask"] == (B, 1, 1, mask.shape[-1]), kernel_calls
        assert kernel_calls[1]["mask"] in ((B, 1, 1, mask.shape[-1]), None), kernel_calls
        assert [c["is_causal"] for c in kernel_calls] == [causal] * 2
    else:
        # The kernel's causal rule is top-left: an offset causal rule goes to it as the (N, M) mask.
        assert kernel_calls == [{"mask": (B, 1, 3, 7), "is_causal": False}] * 2


def test_decode_with_cache_fast_path_equals_explicit_and_reference(fused_float64, kernel_calls) -> None:
    """decode_step with a key-padding mask over the cache (B, 1, 1, L), hinted,
    equals the unhinted call and the reference's masked causal forward,
    under jit, in outputs and gradients."""
    config = SELF
    with jax.enable_x64(True):
        params, x = _params(config), _normal((B, 6, 16), 3)
        ids = _ids([[1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
        pad = nnx.make_attention_mask(jnp.ones((B, 1)), ids > 0)  # (B, 1, 1, L) float32

        def run(params, x, hint):
            cache, ys = dj.init_cache(config, B, 6, jnp.float64), []
            for t in range(6):
                y, cache = dj.decode_step(params, config, cache, x[:, t : t + 1], mask=pad, mask_hint=hint)
                ys.append(y)
            y = jnp.concatenate(ys, axis=1)
            return jnp.sum(jnp.sin(y)), y

        grads = {}
        for hint in ("padding", None):
            grads[hint] = fast_jit(jax.value_and_grad(functools.partial(run, hint=hint), argnums=(0, 1), has_aux=True))(
                params, x
            )
        expected = _reference(config, params, x, None, pad, True, 0)
        (_, y_hint), g_hint = grads["padding"]
        (_, y_plain), g_plain = grads[None]
        np.testing.assert_allclose(y_hint, expected, **TOL)
        np.testing.assert_allclose(y_plain, expected, **TOL)
        _close_grads(g_hint, g_plain)
        # Row 1's token 0 is padding: its first step sees no key, so its output is the output bias.
        np.testing.assert_allclose(y_hint[1, 0], params["output.bias"], rtol=1e-12)
    # A step's kernel mask is the (1, L) causal row of the cache (the offset is traced), not (B, 1, 1, L) & it.
    assert kernel_calls and all(call["mask"] == (B, 1, 1, 6) for call in kernel_calls[:6])


def _count(jaxpr, name: str) -> int:
    """How many equations call the sub-jaxpr ``name`` (e.g. jnp.tril's), at any depth."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.params.get("name") == name:
            total += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    total += _count(inner if hasattr(inner, "eqns") else inner.jaxpr, name)
    return total


def _shapes(jaxpr, dtype=np.bool_) -> list[tuple[int, ...]]:
    """The shapes of every ``dtype`` value an equation makes, at any depth."""
    out = []
    for eqn in jaxpr.eqns:
        out += [tuple(v.aval.shape) for v in eqn.outvars if v.aval.dtype == dtype]
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    out += _shapes(inner if hasattr(inner, "eqns") else inner.jaxpr, dtype)
    return out


@pytest.mark.parametrize("hint", ["causal", None])
def test_jaxpr_pins_the_fused_causal_path(hint, kernel_calls) -> None:
    """Under jit (float32, the default path) a hinted make_causal_mask &
    padding mask reaches the kernel as is_causal (its jnp.tril) and a key mask;
    without the hint the (B, 1, N, N) mask goes to it as it is."""
    params, x = _params(SELF, jnp.float32), _normal((B, N, 16), 0, jnp.float32)
    ids = _ids([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    mask = nnx.combine_masks(nnx.make_causal_mask(ids), nnx.make_attention_mask(ids > 0, ids > 0))
    fn = lambda p, x, m: dj.damcha_attention(p, SELF, x, mask=m, mask_hint=hint)  # noqa: E731
    jaxpr = jax.make_jaxpr(fn)(params, x, mask).jaxpr
    assert _count(jaxpr, "tril") == (1 if hint else 0)
    assert kernel_calls == [{"mask": (B, 1, 1, N) if hint else (B, 1, N, N), "is_causal": hint == "causal"}]
    # The hint's check is two reductions over the (B, 1, N, N) mask: no (B, H, N, N) bool is made outside the kernel.
    assert (B, 1, N, N) in _shapes(jaxpr)
    y, expected = fast_jit(fn)(params, x, mask), dj.damcha_attention(params, SELF, x, mask=mask != 0)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_module_fast_path_eager_and_under_nnx_jit(kernel_calls) -> None:
    """DamchaAttention: a concrete Flax mask needs no hint; under nnx.jit the hint gives the same path and numbers."""
    layer = dj.DamchaAttention(4, 16, rngs=nnx.Rngs(0))
    x = _normal((B, N, 16), 0, jnp.float32)
    ids = _ids([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    mask = nnx.combine_masks(nnx.make_causal_mask(ids), nnx.make_attention_mask(ids > 0, ids > 0))
    eager = layer(x, mask=mask)
    hinted = nnx.jit(lambda layer, x, m: layer(x, mask=m, mask_hint="causal"))(layer, x, mask)
    plain = nnx.jit(lambda layer, x, m: layer(x, mask=m))(layer, x, mask)
    assert [c["mask"] for c in kernel_calls] == [(B, 1, 1, N), (B, 1, 1, N), (B, 1, N, N)]
    assert [c["is_causal"] for c in kernel_calls] == [True, True, False]
    np.testing.assert_allclose(eager, plain, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hinted, plain, rtol=1e-5, atol=1e-6)


def test_wrong_hint_raises_when_concrete_and_gives_nan_under_jit() -> None:
    params, x = _params(SELF, jnp.float32), _normal((B, N, 16), 0, jnp.float32)
    ids = _ids([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    padding = nnx.make_attention_mask(ids > 0, ids > 0)
    rng = np.random.default_rng(0)
    scattered = jnp.asarray(rng.random((B, 1, N, N)) < 0.5).at[..., 0].set(True)  # neither causal nor padding
    for mask, hint in ((padding, "causal"), (scattered, "padding"), (scattered, "causal")):
        with pytest.raises(
            dc.DamchaValueError, match=f"Invalid argument `mask`: expected what mask_hint='{hint}' says"
        ):
            dj.damcha_attention(params, SELF, x, mask=np.asarray(mask), mask_hint=hint)
        y = fast_jit(lambda p, x, m, hint=hint: dj.damcha_attention(p, SELF, x, mask=m, mask_hint=hint))(
            params, x, mask
        )
        assert np.all(np.isnan(np.asarray(y))), hint
    # An additive 0/-inf mask is still refused / NaN with a hint (DECISIONS 5), not read as an inverted causal mask.
    additive = jnp.where(nnx.make_causal_mask(ids) > 0, 0.0, -jnp.inf)
    with pytest.raises(dc.DamchaValueError, match="holds other values"):
        dj.damcha_attention(params, SELF, x, mask=additive, mask_hint="causal")
    y = fast_jit(lambda p, x, m: dj.damcha_attention(p, SELF, x, mask=m, mask_hint="causal"))(params, x, additive)
    assert np.all(np.isnan(np.asarray(y)))
    with pytest.raises(dc.DamchaValueError, match="mask_hint"):
        dj.damcha_attention(params, SELF, x, mask_hint="causal")  # a hint needs a mask
    with pytest.raises(dc.DamchaValueError, match="mask_hint"):
        dj.damcha_attention(params, SELF, x, mask=padding, mask_hint="sliding")


def test_nan_input_stays_nan_on_the_fast_path() -> None:
    """DECISIONS 5: NaN in gives NaN out on the hinted path too. The kernel
    multiplies the hidden value of the NaN token by 0 for the rows before it,
    so every row of that batch row is NaN (as with is_causal=True alone); the
    other batch row stays finite."""
    params, x = _params(SELF, jnp.float32), _normal((B, N, 16), 0, jnp.float32)
    ids = _ids([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    mask = nnx.make_causal_mask(ids)
    x = x.at[0, 2, 3].set(jnp.nan)
    y = fast_jit(lambda p, x, m: dj.damcha_attention(p, SELF, x, mask=m, mask_hint="causal"))(params, x, mask)
    y = np.asarray(y)
    assert np.all(np.isnan(y[0, 2:])) and np.all(np.isfinite(y[1]))


def test_encoder_forwards_the_hint_to_every_layer(kernel_calls) -> None:
    """DamchaEncoder(mask=..., mask_hint=...) under nnx.jit: each layer's kernel gets the causal rule and a key mask."""
    encoder = dj.DamchaEncoder(2, 16, 4, 32, rngs=nnx.Rngs(0))
    x = _normal((B, N, 16), 0, jnp.float32)
    ids = _ids([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    mask = nnx.combine_masks(nnx.make_causal_mask(ids), nnx.make_attention_mask(ids > 0, ids > 0))
    hinted = nnx.jit(lambda enc, x, m: enc(x, mask=m, mask_hint="causal"))(encoder, x, mask)
    assert kernel_calls == [{"mask": (B, 1, 1, N), "is_causal": True}] * 2
    plain = nnx.jit(lambda enc, x, m: enc(x, mask=m))(encoder, x, mask)
    np.testing.assert_allclose(hinted, plain, rtol=1e-5, atol=1e-5)


def test_module_decode_with_a_hinted_padding_mask(kernel_calls) -> None:
    """DamchaAttention(decode=True) under nnx.jit, a key-padding mask over the
    cache with mask_hint="padding": equals the unhinted steps and the layer's
    own masked causal forward."""
    layer = dj.DamchaAttention(4, 16, decode=False, rngs=nnx.Rngs(0))
    x = _normal((B, 6, 16), 4, jnp.float32)
    ids = _ids([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    pad = nnx.make_attention_mask(jnp.ones((B, 1)), ids > 0)  # (B, 1, 1, L)
    full = layer(x, mask=pad, is_causal=True)
    outputs = {}
    for hint in ("padding", None):
        layer.init_cache((B, 6, 16))
        step = nnx.jit(lambda layer, x, m, hint=hint: layer(x, mask=m, decode=True, mask_hint=hint))
        outputs[hint] = jnp.concatenate([step(layer, x[:, t : t + 1], pad) for t in range(6)], axis=1)
    np.testing.assert_allclose(outputs["padding"], outputs[None], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outputs["padding"], full, rtol=1e-5, atol=1e-5)
    assert all(call["mask"] == (B, 1, 1, 6) for call in kernel_calls[1:])


# Values a wrong mask may hold in one cell; 0.5 and 1.5 together keep a row's sum.
ODD_VALUES = [0.5, 1.5, 2.0, -1.0, 1e-30, -1e-30, 1 + 2**-23, 1 - 2**-24, np.nan, np.inf, -np.inf, 3e38]


def _hint_masks(n: int, m: int, offset: int, hint: str) -> list[np.ndarray]:
    """(B, 1, n, m) float masks: valid ones for ``hint`` and wrong ones (an odd value, a one outside
    the causal grid, a missing one, two cells that keep the row's sum), each in every row."""
    grid = np.arange(m)[None, :] <= np.arange(n)[:, None] + offset if hint == "causal" else np.ones((n, m), bool)
    q_ok = np.array([[True] * n, [False] + [True] * (n - 2) + [False]])
    k_ok = np.array([[True] * m, [True] * (m - 2) + [False, False]])
    valid = (q_ok[:, :, None] & k_ok[:, None, :] & grid)[:, None].astype(np.float64)
    masks = [valid, np.zeros_like(valid)]
    for i in range(n):
        ones = np.flatnonzero(valid[1, 0, i])
        for v in ODD_VALUES:
            bad = valid.copy()
            bad[1, 0, i, ones[0] if len(ones) else 0] = v
            masks.append(bad)
        outside = np.flatnonzero(~grid[i])
        if len(outside):
            bad = valid.copy()
            bad[0, 0, i, outside[0]] = 1.0
            masks.append(bad)
        if len(ones) >= 2:
            bad = valid.copy()
            bad[1, 0, i, ones[0]] = 0.0  # a missing one: the row no longer equals rows x key_ok
            masks.append(bad)
            bad = bad.copy()
            bad[1, 0, i, ones[0]], bad[1, 0, i, ones[1]] = 0.5, 1.5
            masks.append(bad)
    return masks


def _host_check(mask: np.ndarray, n: int, m: int, offset: int, hint: str) -> tuple[bool, np.ndarray, np.ndarray]:
    """(ok, key_ok, rows) by definition: only 0 and 1, and the mask equals [causal &] rows x key_ok."""
    grid = np.arange(m)[None, :] <= np.arange(n)[:, None] + offset if hint == "causal" else np.ones((n, m), bool)
    binary = bool(np.all((mask == 0) | (mask == 1)))
    v = mask != 0
    keys, rows = v.any(-2), v.any(-1)
    return binary and np.array_equal(v, rows[..., None] & keys[..., None, :] & grid), keys, rows


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32"])
@pytest.mark.parametrize(("n", "m", "offset", "hint"), [(6, 6, 0, "causal"), (3, 7, 4, "causal"), (5, 6, 0, "padding")])
def test_hint_check_is_exact_for_wrong_values(dtype, n, m, offset, hint) -> None:
    """``_masks.traced_split`` on a traced numeric mask (float32 counts fused into
    XLA:CPU's reductions, compiled as users compile): ok exactly when the mask
    holds only 0 and 1 and is [causal &] rows x key_ok, then key_ok and rows as
    defined; a value the counts could round away (1e-30, 1 + 2**-23) or two
    that keep a row's sum (0.5, 1.5) still fails it."""
    from damcha_jax._masks import traced_split

    with jax.enable_x64(dtype == "float64"):
        check = jax.jit(lambda a: traced_split(a != 0, n, m, hint=hint, offset=offset, raw=a))
        tried = 0
        for mask in _hint_masks(n, m, offset, hint):
            with np.errstate(invalid="ignore", over="ignore"):
                typed = mask.astype(dtype)
            if dtype == "int32" and not np.array_equal(typed, mask):
                continue  # an odd value an int mask cannot hold (its cast is checked as it is)
            ok, keys, rows = _host_check(typed.astype(np.float64), n, m, offset, hint)
            got = check(jnp.asarray(typed))
            assert bool(got[2]) == ok, (typed, ok)
            if ok:
                np.testing.assert_array_equal(got[0], keys)
                np.testing.assert_array_equal(got[1], rows)
            tried += 1
        assert tried > 2 * n


def test_an_eager_call_skips_the_maps_checkpoint_and_a_traced_one_keeps_it(monkeypatch):
    """``mapped_attention`` wraps the maps in ``jax.checkpoint`` so that training
    recomputes q~ and k~ (tests/test_jax_compiled_cost.py). An eager module call
    (concrete arrays: nothing differentiates it) calls the maps directly, where
    the checkpoint traced its body again on every call (a reviewer measured an
    eager call at 3-4x MHA's, most of it that trace); under jax.grad or jit the
    checkpoint is there. The eager output equals the jitted one, and the
    gradients through the checkpoint equal the reference's."""
    calls = []
    original = jax.checkpoint

    def counted(fun, *args, **kwargs):
        calls.append(fun)
        return original(fun, *args, **kwargs)

    monkeypatch.setattr(F.jax, "checkpoint", counted)
    with jax.enable_x64(True):
        layer = dj.DamchaAttention(4, 16, rngs=nnx.Rngs(0), dtype=jnp.float64, param_dtype=jnp.float64)
        layer.metric["qk"].gate[...] = jnp.full((4,), 0.5)
        x = jax.random.normal(jax.random.key(3), (2, 5, 16), jnp.float64)
        eager = layer(x, is_causal=True)
        assert calls == []
        graphdef, state = nnx.split(layer)
        jitted = fast_jit(lambda s, x: nnx.merge(graphdef, s)(x, is_causal=True))(state, x)
        assert len(calls) == 1
        np.testing.assert_allclose(eager, jitted, rtol=1e-12, atol=1e-12)
        params, cfg = layer.to_canonical(), layer.config
        grad = jax.grad(lambda x: layer(x, is_causal=True).sum())(x)
        assert len(calls) == 2
        want = _reference_grad(params, cfg, np.array(x))
        np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-8)
        assert np.abs(np.asarray(eager) - dc.damcha_attention(params, cfg, np.asarray(x), causal=True)).max() < 1e-12


def _reference_grad(params, cfg, x, eps=1e-6):
    """d sum(damcha_attention(x, causal)) / dx by central differences, float64."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        keep = flat[i]
        flat[i] = keep + eps
        up = dc.damcha_attention(params, cfg, x, causal=True).sum()
        flat[i] = keep - eps
        down = dc.damcha_attention(params, cfg, x, causal=True).sum()
        flat[i] = keep
        gflat[i] = (up - down) / (2 * eps)
    return g
