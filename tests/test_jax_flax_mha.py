"""DamchaAttention as a drop-in for Flax's MHA (issue 14): the public behaviours
Flax's own attention tests check, written for this project.

Each check compares DamchaAttention with ``nnx.MultiHeadAttention`` or
``linen.MultiHeadDotProductAttention`` holding the same weights (gates at 0,
or ``metric="none"``), and with the NumPy reference with the gates open.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from jax.lax import Precision

import damcha_core as dc
import damcha_jax as dj

FAST = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}
B, N, M, E = 2, 5, 6, 16


def run(fn, *args):
    return jax.jit(fn, compiler_options=FAST)(*args)


def in_one_program(fn, modules, *args):
    """``fn(*modules, *args)`` compiled as one program (eager JAX compiles
    every op on its own, which dominates these small tests); the modules'
    state changes (caches, RNG counts) are written back."""
    split = [nnx.split(m) for m in modules]

    def inner(states, *args):
        merged = [nnx.merge(g, s) for (g, _), s in zip(split, states)]
        out = fn(*merged, *args)
        return out, [nnx.state(m) for m in merged]

    out, states = jax.jit(inner, compiler_options=FAST)([s for _, s in split], *args)
    for module, state in zip(modules, states):
        nnx.update(module, state)
    return out


def _normal(shape, seed: int, dtype=jnp.float32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _open_gates(layer: dj.DamchaAttention, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for side in layer.config.metric_sides:
        gate = layer.metric[side].gate
        gate[...] = jnp.asarray(rng.uniform(0.3, 0.9, gate.shape), gate.dtype)


def _np(params):
    return {k: np.asarray(v, np.float64) for k, v in params.items()}


# ------------------------------------------------- linen / nnx equivalence


@pytest.mark.parametrize(
    "precision, decode, normalize_qk",
    [
        (Precision.DEFAULT, False, False),
        (Precision.HIGHEST, False, True),
        (Precision.HIGH, True, False),
        (Precision.HIGHEST, True, True),
    ],
    ids=["default-forward", "highest-forward-normalize_qk", "high-decode", "highest-decode-normalize_qk"],
)
def test_equals_linen_mha_with_the_same_weights(precision, decode: bool, normalize_qk: bool) -> None:
    """Flax's linen/nnx consistency check, DAMCHA substituted: the same weights
    in linen.MultiHeadDotProductAttention and DamchaAttention (fresh gates, and
    metric "none") give the same outputs, token by token when decoding."""
    kwargs = dict(
        num_heads=2, qkv_features=6, out_features=6, precision=precision, decode=decode, normalize_qk=normalize_qk
    )
    model = linen.MultiHeadDotProductAttention(**kwargs)
    x = _normal((B, 4, 3), 1)
    variables = model.init(jax.random.key(0), x)
    layers = [
        dj.DamchaAttention(in_features=3, rngs=nnx.Rngs(0), metric=metric, **kwargs) for metric in ("heads", "none")
    ]
    for layer in layers:
        assert layer.query.precision == layer.out.precision == precision
        for name in ("query", "key", "value", "out"):
            getattr(layer, name).kernel[...] = variables["params"][name]["kernel"]
            getattr(layer, name).bias[...] = variables["params"][name]["bias"]
        if normalize_qk:
            layer.query_ln.scale[...] = 1.0 + _normal((3,), 2)
            layer.key_ln.scale[...] = 1.0 + _normal((3,), 3)
    if normalize_qk:
        variables = {
            "params": {
                **variables["params"],
                "query_ln": {"scale": layers[0].query_ln.scale[...]},
                "key_ln": {"scale": layers[0].key_ln.scale[...]},
            },
            **({"cache": variables["cache"]} if decode else {}),
        }
    if not decode:
        expected, *ours = in_one_program(lambda a, b, x: (model.apply(variables, x), a(x), b(x)), layers, x)
        for out in ours:
            np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
        return
    for layer in layers:
        layer.init_cache(x.shape)

    def steps(a, b, x):
        state, out = variables, []
        for t in range(x.shape[1]):
            expected, mutated = model.apply(state, x[:, t : t + 1], mutable=["cache"])
            state = {**state, **mutated}
            out.append((expected, a(x[:, t : t + 1]), b(x[:, t : t + 1])))
        return out

    for t, (expected, *ours) in enumerate(in_one_program(steps, layers, x)):
        for out in ours:
            np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")


# ---------------------------------------------------- keep_rngs and dropout


@pytest.mark.parametrize(
    "keep_rngs, broadcast_dropout, streams",
    [(True, True, "two"), (False, False, "two"), (True, False, "one")],
    ids=["keep_rngs-broadcast", "no_rngs-elementwise", "keep_rngs-one-stream"],
)
def test_dropout_and_keep_rngs_follow_flax_mha(keep_rngs: bool, broadcast_dropout: bool, streams: str) -> None:
    """keep_rngs stores (or not) the dropout stream as Flax does, and with the
    same keys DAMCHA (gates 0) drops the same probabilities as nnx.MultiHeadAttention,
    in a forward pass and while decoding; with one stream for everything
    (``nnx.Rngs(0)``) too, where the layer keeps its dropout stream at the same
    point of the draws as Flax (it used to keep it after the generators drew)."""

    def make(cls, **extra):
        return cls(
            4,
            E,
            dropout_rate=0.5,
            broadcast_dropout=broadcast_dropout,
            keep_rngs=keep_rngs,
            rngs=nnx.Rngs(params=0, dropout=1) if streams == "two" else nnx.Rngs(0),
            **extra,
        )

    mha, layer = make(nnx.MultiHeadAttention, decode=False), make(dj.DamchaAttention)
    nnx.update(layer, nnx.state(mha, nnx.Param))  # the four projections
    assert (layer.rngs is None) == (mha.rngs is None) == (not keep_rngs)
    if keep_rngs:
        _, _, rest = nnx.split(layer, nnx.Param, ...)
        assert isinstance(rest["rngs"]["count"], nnx.RngCount) and isinstance(rest["rngs"]["key"], nnx.RngKey)
    x = _normal((B, N, E), 4)
    rngs = lambda: None if keep_rngs else nnx.Rngs(dropout=7)  # noqa: E731
    if not keep_rngs:
        with pytest.raises(
            dc.DamchaValueError, match="Invalid argument `rngs`: expected an nnx.Rngs passed to __call__"
        ):
            layer(x, deterministic=False)
    for module in (mha, layer):
        module.init_cache((B, 3, E))

    def body(layer, mha, x):
        pairs = [
            (layer(x, deterministic=False, rngs=rngs()), mha(x, deterministic=False, rngs=rngs())) for _ in range(2)
        ]  # the streams advance identically
        plain = layer(x, deterministic=True)
        steps = [
            (
                layer(x[:, t : t + 1], decode=True, deterministic=False, rngs=rngs()),
                mha(x[:, t : t + 1], decode=True, deterministic=False, rngs=rngs()),
            )
            for t in range(3)
        ]
        return pairs, plain, steps

    pairs, plain, steps = in_one_program(body, (layer, mha), x)
    for ours, flax in pairs + steps:
        np.testing.assert_allclose(ours, flax, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(pairs[0][0] - plain)).max() > 1e-3


# ------------------------------------------------- GQA and other sizes


@pytest.mark.parametrize(
    "mha_kwargs",
    [dict(num_kv_heads=2), dict(in_kv_features=12, num_kv_heads=1)],
    ids=["gqa", "cross-size-mqa"],
)
def test_gqa_and_cross_sizes_need_no_coupling(mha_kwargs) -> None:
    """The constructor and from_mha pick the coupling themselves ("separate"
    when one generator cannot serve both sides): equal to nnx MHA at gates 0,
    to the reference with the gates open; GQA decoding as Flax's test does it."""
    kv = mha_kwargs.get("in_kv_features", E)
    mha = nnx.MultiHeadAttention(4, E, 16, decode=False, rngs=nnx.Rngs(1), **mha_kwargs)
    layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(2))
    direct = dj.DamchaAttention(4, E, 16, rngs=nnx.Rngs(3), **mha_kwargs)
    assert layer.config.coupling == direct.config.coupling == "separate"
    assert direct.key.kernel.shape == (kv, mha.num_kv_heads, 4)
    x, c = _normal((B, N, E), 5), _normal((B, M, kv), 6)
    ours, flax = in_one_program(lambda layer, mha, x, c: (layer(x, c), mha(x, c)), (layer, mha), x, c)
    np.testing.assert_allclose(ours, flax, rtol=1e-5, atol=1e-5)
    _open_gates(layer)
    expected = dc.damcha_attention(_np(layer.to_canonical()), layer.config, np.asarray(x), np.asarray(c))
    np.testing.assert_allclose(in_one_program(lambda m, x, c: m(x, c), (layer,), x, c), expected, rtol=2e-4, atol=2e-5)
    if kv == E:  # decoding (self-attention), one token at a time as Flax's GQA test
        layer.init_cache((1, 4, E))
        assert layer.cached_key.shape == (1, 4, mha.num_kv_heads, 4)
        ys = in_one_program(lambda m, x: [m(x[:1, t : t + 1], decode=True) for t in range(4)], (layer,), x)
        assert layer.cache_index[...] == 4
        full = dc.damcha_attention(_np(layer.to_canonical()), layer.config, np.asarray(x[:1, :4]), causal=True)
        np.testing.assert_allclose(jnp.concatenate(ys, axis=1), full, rtol=2e-4, atol=2e-5)


def test_key_and_value_inputs_of_different_sizes() -> None:
    """in_v_features (E_v) != in_kv_features: inputs_k and inputs_v of their own
    sizes, against the reference's value= (DECISIONS 8), gates open and metric none."""
    for metric in ("heads", "none"):
        layer = dj.DamchaAttention(4, E, 16, in_kv_features=12, in_v_features=6, metric=metric, rngs=nnx.Rngs(0))
        assert layer.value.kernel.shape == (6, 4, 4) and layer.config.value_input_dim == 6
        _open_gates(layer)
        x, k, v = _normal((B, N, E), 1), _normal((B, M, 12), 2), _normal((B, M, 6), 3)
        expected = dc.damcha_attention(
            _np(layer.to_canonical()), layer.config, np.asarray(x), np.asarray(k), value=np.asarray(v)
        )
        np.testing.assert_allclose(layer(x, k, v), expected, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(
            dj.damcha_attention(layer.arrays(), layer.config, x, k, value=v), expected, rtol=2e-4, atol=2e-5
        )
        with pytest.raises(
            dc.DamchaValueError,
            match=r"Invalid argument `inputs_v`: expected a tensor when in_v_features != in_kv_features",
        ):
            layer(x, k)


# ------------------------------------------------------- mask broadcasting

# (batch axes of the inputs, mask shape) with H = 4 heads, N = M = 5.
# Flax broadcasts the mask with jnp's rules; DAMCHA takes every such mask whose
# meaning no alignment of its axes can change.
LIKE_FLAX = [
    ((), (5, 5)),
    ((), (1, 5, 5)),
    ((), (4, 5, 5)),  # unbatched: [H, N, M], the full rank
    ((), (1, 1, 5, 5)),
    ((), (1, 4, 5, 5)),
    ((), (1, 5)),
    ((2,), (1, 5, 5)),
    ((2,), (1, 1, 5, 5)),
    ((2,), (2, 1, 5, 5)),
    ((2,), (2, 4, 1, 5)),
    ((2, 3), (5, 5)),
    ((2, 3), (1, 5, 5)),
    ((2, 3), (1, 1, 5, 5)),
    ((2, 3), (1, 1, 1, 5, 5)),
    ((2, 3), (2, 3, 1, 5, 5)),
    ((2, 3), (1, 1, 1, 1, 5, 5)),
]
# Accepted here, refused by Flax 0.12.8: more than 4 axes on its fused path, or
# its fold of several batch axes (mask.shape[:-3] flattened apart from the inputs').
BEYOND_FLAX = [((), (1, 1, 1, 5, 5)), ((2,), (1, 1, 1, 5, 5)), ((2, 3), (1, 3, 1, 5, 5)), ((2, 3), (2, 1, 4, 5, 5))]
# Accepted by Flax, refused here: a non-1 axis whose place depends on the
# alignment (Flax reads a (B, N, M) mask's B as the heads), or a mask without
# its query axis (a (N,) padding vector would be read as the keys').
REFUSED = [((2,), (4, 5, 5)), ((2, 3), (1, 4, 5, 5)), ((), (5,)), ((2,), (5,))]


def _full_mask(mask: np.ndarray, lead: tuple[int, ...]) -> np.ndarray:
    """``mask`` as [batch..., H, N, M], which Flax takes for every batch shape."""
    rank = len(lead) + 3
    if mask.ndim > rank:
        mask = mask.reshape(mask.shape[mask.ndim - rank :])
    elif mask.ndim < rank:
        mask = mask.reshape(mask.shape[-2:])
    return np.broadcast_to(mask, (*lead, 4, 5, 5))


@pytest.mark.parametrize("case", LIKE_FLAX + BEYOND_FLAX, ids=str)
def test_masks_broadcast_as_in_flax(case) -> None:
    """Unbatched inputs and several batch axes take the masks Flax broadcasts
    (size-1 axes, extra leading ones): gates at 0 give Flax's output for the
    same call, and for the same mask broadcast to [batch..., H, N, M]."""
    lead, shape = case
    mha = nnx.MultiHeadAttention(4, E, 16, decode=False, rngs=nnx.Rngs(1))
    layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(2))
    rng = np.random.default_rng(len(lead) + len(shape))
    x = _normal((*lead, 5, E), 7)
    mask = rng.random(shape) < 0.6
    mask[..., 0] = True  # every query sees a key (Flax averages the values in a row that sees none)
    full = _full_mask(mask, lead)
    both = lambda m, mha, x, mask, full: (m(x, mask=mask), mha(x, mask=full))  # noqa: E731
    ours, flax = in_one_program(both, (layer, mha), x, jnp.asarray(mask), jnp.asarray(full))
    assert ours.shape == (*lead, 5, E)
    np.testing.assert_allclose(ours, flax, rtol=1e-5, atol=1e-5)
    if case in LIKE_FLAX:
        np.testing.assert_allclose(ours, run(lambda x, m: mha(x, mask=m), x, jnp.asarray(mask)), rtol=1e-5, atol=1e-5)
    # A float 0/1 mask traced under jit, with a hint, takes the same route (its row flags are reshaped too).
    padding = np.broadcast_to(np.arange(5) < 4, shape).astype(np.float32)
    full = _full_mask(padding, lead)
    hinted = lambda m, mha, x, p, f: (m(x, mask=p, mask_hint="padding"), mha(x, mask=f))  # noqa: E731
    ours, flax = in_one_program(hinted, (layer, mha), x, jnp.asarray(padding), jnp.asarray(full))
    np.testing.assert_allclose(ours, flax, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lead", [(), (2,), (2, 3)], ids=str)
def test_a_scalar_mask_is_broadcast_as_in_flax(lead) -> None:
    """A 0-d mask means every key or none whatever the alignment (it was refused):
    True gives Flax's output; False leaves every row without a key, so the
    output projection's bias (docs/spec.md, where Flax averages the values)."""
    mha = nnx.MultiHeadAttention(4, E, 16, decode=False, rngs=nnx.Rngs(1))
    layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(2))
    x = _normal((*lead, 5, E), 7)
    np.testing.assert_allclose(layer(x, mask=jnp.array(True)), mha(x), rtol=1e-5, atol=1e-5)
    hidden = np.asarray(layer(x, mask=jnp.array(False)))
    np.testing.assert_array_equal(hidden, np.broadcast_to(np.asarray(mha.out.bias[...]), hidden.shape))


@pytest.mark.parametrize("case", REFUSED, ids=str)
def test_ambiguous_masks_are_refused_where_flax_guesses(case) -> None:
    lead, shape = case
    mha = nnx.MultiHeadAttention(4, E, 16, decode=False, rngs=nnx.Rngs(1))
    layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(2))
    x, mask = _normal((*lead, 5, E), 7), jnp.ones(shape, bool)
    assert jax.eval_shape(lambda x, m: mha(x, mask=m), x, mask).shape == (*lead, 5, E)  # Flax takes it
    with pytest.raises(
        dc.DamchaValueError, match=rf"Invalid argument `mask`.*Received: mask\.shape={re.escape(str(shape))}"
    ):
        layer(x, mask=mask)


# ------------------------------------------------------------ sow_weights


def test_sow_weights_match_flax_and_reference() -> None:
    """sow_weights=True stores the probabilities in nnx.Intermediate as
    'attention_weights' [batch..., H, N, M] (Flax's name and shape), only when
    asked: equal to Flax MHA's at gates 0 and to the reference's with the gates open."""
    mha = nnx.MultiHeadAttention(4, E, 16, decode=False, rngs=nnx.Rngs(1))
    layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(2))
    x = _normal((2, 3, N, E), 4)  # two batch axes
    mask = nnx.make_causal_mask(jnp.ones((2, 3, N)))

    def sown(module, sow):
        _, inter = nnx.capture(lambda m: m(x, mask=mask, sow_weights=sow), nnx.Intermediate)(module)
        return inter

    ours, flax = sown(layer, True), sown(mha, True)
    assert ours["attention_weights"][0].shape == (2, 3, 4, N, N)
    np.testing.assert_allclose(ours["attention_weights"][0], flax["attention_weights"][0], rtol=1e-5, atol=1e-6)
    assert not sown(layer, False)
    _open_gates(layer)
    _, weights = dc.damcha_attention(
        _np(layer.to_canonical()), layer.config, np.asarray(x).reshape(6, N, E), causal=True, return_weights=True
    )
    np.testing.assert_allclose(
        np.asarray(sown(layer, True)["attention_weights"][0]).reshape(6, 4, N, N), weights, rtol=2e-4, atol=2e-6
    )


def test_sow_weights_while_decoding_match_flax_and_reference() -> None:
    """A decoding step with sow_weights=True records its probabilities over the
    whole cache [batch..., H, T, L], as Flax's MHA does (it recorded nothing):
    equal to Flax's at gates 0, and with the gates open to the reference's rows
    of a causal pass over the tokens so far (zeros beyond them)."""
    L = 4
    mha = nnx.MultiHeadAttention(4, E, 16, decode=True, rngs=nnx.Rngs(1))
    layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(2))
    x = _normal((2, L, E), 4)

    def steps(module):
        module.init_cache(x.shape)
        out = []
        for t in range(L):
            step = x[:, t : t + 1]
            _, inter = nnx.capture(lambda m, step=step: m(step, decode=True, sow_weights=True), nnx.Intermediate)(
                module
            )
            out.append(inter["attention_weights"][0])
        return out

    ours, flax = steps(layer), steps(mha)
    for t in range(L):
        assert ours[t].shape == flax[t].shape == (2, 4, 1, L)
        np.testing.assert_allclose(ours[t], flax[t], rtol=1e-5, atol=1e-6)
    _open_gates(layer)
    _, weights = dc.damcha_attention(
        _np(layer.to_canonical()), layer.config, np.asarray(x), causal=True, return_weights=True
    )
    for t, step in enumerate(steps(layer)):
        np.testing.assert_allclose(np.asarray(step)[:, :, 0], weights[:, :, t], rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("decode", [False, True], ids=["forward", "decode"])
def test_sown_weights_take_the_computation_dtype_as_in_flax(decode: bool) -> None:
    """Under dtype=bfloat16 Flax records bfloat16 probabilities (its softmax may
    run in float32); DAMCHA's were float32."""
    mha = nnx.MultiHeadAttention(4, E, 16, decode=decode, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(2))
    x = _normal((2, N, E), 4)

    def sown(module):
        if decode:
            module.init_cache(x.shape, dtype=jnp.bfloat16)  # Flax's own bfloat16 steps need a bfloat16 cache
        call = (lambda m: m(x[:, :1], decode=True, sow_weights=True)) if decode else (lambda m: m(x, sow_weights=True))
        return nnx.capture(call, nnx.Intermediate)(module)[1]["attention_weights"][0]

    ours, flax = sown(layer), sown(mha)
    assert ours.dtype == flax.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(flax, np.float32), atol=1e-2)


# ------------------------------------------------------------ attention_fn


def test_custom_attention_fn_gets_the_transformed_heads() -> None:
    """attention_fn is called as Flax calls it, with q~ = L_q(x) q and
    k~ = L_k(c) k (after the maps) and v; a standard kernel on them is DAMCHA,
    also with a non-default scale, in a forward pass and while decoding."""
    calls = []

    def recording(q, k, v, **kwargs):
        calls.append((q, k, v, kwargs))
        return nnx.dot_product_attention(q, k, v, **kwargs)

    for scale in (None, 0.3):
        default = dj.DamchaAttention(4, E, 16, num_kv_heads=2, scale=scale, rngs=nnx.Rngs(0))
        _open_gates(default)
        custom = dj.DamchaAttention(4, E, 16, num_kv_heads=2, scale=scale, attention_fn=recording, rngs=nnx.Rngs(9))
        nnx.update(custom, nnx.state(default, nnx.Param))
        x = _normal((B, N, E), 1)
        mask = nnx.make_attention_mask(jnp.ones((B, N)), jnp.asarray(np.arange(N) < 4)[None].repeat(B, 0))
        calls.clear()
        np.testing.assert_allclose(custom(x, mask=mask), default(x, mask=mask), rtol=1e-5, atol=1e-5)
        ((q, k, v, kwargs),) = calls
        q_t, k_t, v_t = dj.transformed_qkv(default.arrays(), default.config, x)
        factor = 1.0 if scale is None else scale * np.sqrt(4)
        np.testing.assert_allclose(q, q_t * factor, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(k, k_t, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(v, v_t, rtol=1e-5, atol=1e-6)
        assert set(kwargs) == {
            "mask",
            "dropout_rng",
            "dropout_rate",
            "broadcast_dropout",
            "deterministic",
            "dtype",
            "precision",
            "module",
            "is_causal",
        }
        for module in (default, custom):
            module.init_cache((B, 3, E))
        for t in range(3):
            np.testing.assert_allclose(
                custom(x[:, t : t + 1], decode=True),
                default(x[:, t : t + 1], decode=True),
                rtol=1e-5,
                atol=1e-5,
                err_msg=f"decode step {t}",
            )


# --------------------------------------------------------- normalize_qk


def test_normalize_qk_converts_from_flax() -> None:
    """normalize_qk: LayerNorm on the projected q and k (before the maps);
    from_mha copies the norm scales, so the outputs equal Flax's at gates 0.
    The canonical v1 format has no such norm: to_canonical refuses."""
    mha = nnx.MultiHeadAttention(4, E, 16, normalize_qk=True, decode=False, rngs=nnx.Rngs(1))
    mha.query_ln.scale[...] = 1.0 + _normal((4,), 2)
    mha.key_ln.scale[...] = 1.0 + _normal((4,), 3)
    layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(2))
    x = _normal((B, N, E), 4)
    np.testing.assert_allclose(layer(x, is_causal=True), mha(x, is_causal=True), rtol=1e-5, atol=1e-5)
    _open_gates(layer)
    assert np.abs(np.asarray(layer(x) - mha(x))).max() > 1e-3
    with pytest.raises(dc.DamchaValueError, match="normalize_qk"):
        layer.to_canonical()


# ------------------------------------------------------------------ dtypes


@pytest.mark.parametrize(
    "dtype, param_dtype",
    [(None, jnp.bfloat16), (jnp.float16, jnp.float32)],
    ids=["bf16-params", "f16-compute"],
)
def test_dtypes_follow_flax_mha(dtype, param_dtype) -> None:
    """dtype and param_dtype act as in nnx.MultiHeadAttention: the output dtype
    is the same, metric "none" gives Flax's numbers exactly, fresh gates to 16-bit rounding."""
    kwargs = dict(dtype=dtype, param_dtype=param_dtype, decode=False)
    mha = nnx.MultiHeadAttention(4, E, 16, rngs=nnx.Rngs(1), **kwargs)
    x = _normal((B, N, E), 5, jnp.float32 if dtype == jnp.float32 else (param_dtype if dtype is None else dtype))
    none = dj.DamchaAttention.from_mha(mha, metric="none", rngs=nnx.Rngs(2))
    fresh = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(2))
    expected = mha(x, is_causal=True)
    assert none(x, is_causal=True).dtype == fresh(x, is_causal=True).dtype == expected.dtype
    np.testing.assert_array_equal(none(x, is_causal=True), expected)
    np.testing.assert_allclose(
        np.asarray(fresh(x, is_causal=True), np.float32), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-2
    )


def test_sown_weights_while_decoding_from_a_float32_cache_take_the_computation_dtype() -> None:
    """DAMCHA (unlike Flax) decodes from a float32 cache under dtype=bfloat16; the recorded
    probabilities then followed the cache (float32) while the step's output was bfloat16."""
    layer = dj.DamchaAttention(4, E, 16, dtype=jnp.bfloat16, rngs=nnx.Rngs(2))
    x = _normal((2, N, E), 4)
    layer.init_cache(x.shape)  # float32, the default
    y, state = nnx.capture(lambda m: m(x[:, :1], decode=True, sow_weights=True), nnx.Intermediate)(layer)
    weights = state["attention_weights"][0]
    assert y.dtype == weights.dtype == jnp.bfloat16
