"""DamchaAttention (Flax NNX) against nnx.MultiHeadAttention and the NumPy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import damcha_core as dc
import damcha_jax as dj
from damcha_conformance import case_params

B, N, M, E = 2, 5, 6, 16

# One compiled program per check: eager JAX compiles every op separately, and
# on this CPU the fusion emitters and LLVM -O2 cost ~5x the legacy ones at -O0
# for programs this small. The arithmetic is the same.
FAST = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}


def run(fn, *args):
    return jax.jit(fn, compiler_options=FAST)(*args)


def build(factory):
    """``factory()`` with its initialisers compiled as one program (eager
    init compiles a random-number kernel per parameter shape)."""
    graphdef, _ = nnx.split(nnx.eval_shape(factory))
    return nnx.merge(graphdef, run(lambda: nnx.split(factory())[1]))


# name -> (MultiHeadAttention kwargs, DAMCHA options, cross-attention?)
ARCHS = {
    "self": (dict(num_heads=4, in_features=E, qkv_features=16), dict(coupling="tied"), False),
    "cross": (
        dict(num_heads=4, in_features=E, qkv_features=8, in_kv_features=12, out_features=10),
        dict(coupling="separate"),
        True,
    ),
    "gqa": (dict(num_heads=4, in_features=E, qkv_features=16, num_kv_heads=2), dict(coupling="query"), False),
    "mqa-lowrank": (
        dict(num_heads=4, in_features=E, qkv_features=16, num_kv_heads=1),
        dict(coupling="separate", metric="lowrank", metric_rank=2),
        True,
    ),
}
MASKS = ["none", "padding", "per_head", "causal", "causal+padding"]


def _inputs(cross: bool, kv_features: int, seed: int = 0):
    # NumPy draws: an eager jax.random call compiles a kernel per shape.
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(B, N, E)), jnp.float32)
    c = jnp.asarray(rng.normal(size=(B, M, kv_features)), jnp.float32) if cross else None
    return x, c


def _normal(shape, seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _mask(kind: str, heads: int, m: int):
    rng = np.random.default_rng(0)
    if kind in ("padding", "causal+padding"):
        # Key 0 stays visible so no row is empty: there nnx MHA averages the values and
        # DAMCHA gives the output bias (test_flax_mask_helpers_work_as_in_flax_mha checks both).
        return jnp.asarray(np.arange(m)[None, None, None, :] < np.array([m, m - 2])[:, None, None, None])
    if kind == "per_head":
        mask = rng.random((B, heads, N, m)) < 0.6
        mask[..., 0] = True
        return jnp.asarray(mask)
    return None


@pytest.mark.parametrize("arch", list(ARCHS))
def test_zero_gates_equal_flax_mha(arch: str) -> None:
    mha_kwargs, options, cross = ARCHS[arch]
    mha = build(lambda: nnx.MultiHeadAttention(**mha_kwargs, decode=False, rngs=nnx.Rngs(1)))
    layer = build(lambda: dj.DamchaAttention.from_mha(mha, **options, rngs=nnx.Rngs(2)))
    x, c = _inputs(cross, mha.in_kv_features)
    masks = {kind: _mask(kind, mha.num_heads, M if cross else N) for kind in MASKS}

    def both(x, c, masks):
        out = {}
        for kind, mask in masks.items():
            causal = kind.startswith("causal")
            out[kind] = (mha(x, c, mask=mask, is_causal=causal), layer(x, c, mask=mask, is_causal=causal))
        return out

    for kind, (expected, actual) in run(both, x, c, masks).items():
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5, err_msg=f"mask: {kind}")
    # The generator is live: opening the gates must change the output.
    for cross_map in layer.metric.values():
        cross_map.gate[...] = jnp.full(cross_map.gate.shape, 0.5)
    opened = run(lambda x, c: layer(x, c), x, c)
    assert np.abs(np.asarray(opened - mha(x, c))).max() > 1e-3


def _open_layer(arch: str, seed: int = 3):
    """A layer from ARCHS with the conformance suite's open gates and biases."""
    mha_kwargs, options, _ = ARCHS[arch]
    config = dj.attention_config(**mha_kwargs, **options)
    params = case_params(config, seed)
    return build(lambda: dj.DamchaAttention.from_canonical(params, config)), params, config


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_module_equals_reference(arch: str, causal: bool) -> None:
    layer, params, config = _open_layer(arch)
    x, c = _inputs(ARCHS[arch][2], config.context_dim, seed=1)
    expected = dc.damcha_attention(params, config, np.asarray(x), None if c is None else np.asarray(c), causal=causal)
    np.testing.assert_allclose(run(lambda x, c: layer(x, c, is_causal=causal), x, c), expected, rtol=2e-4, atol=2e-5)


def test_separate_value_input_matches_mha() -> None:
    mha = build(lambda: nnx.MultiHeadAttention(4, E, 16, in_kv_features=12, decode=False, rngs=nnx.Rngs(1)))
    layer = build(lambda: dj.DamchaAttention.from_mha(mha, coupling="separate", rngs=nnx.Rngs(2)))
    x, k, v = _normal((B, N, E), 4), _normal((B, M, 12), 5), _normal((B, M, 12), 6)
    actual, expected = run(lambda x, k, v: (layer(x, k, v), mha(x, k, v)), x, k, v)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_canonical_params_round_trip_through_safetensors(tmp_path) -> None:
    layer, params, config = _open_layer("mqa-lowrank")
    assert layer.config == config
    for name, value in layer.to_canonical().items():
        np.testing.assert_allclose(value, params[name].astype(np.float32))
    path = tmp_path / "layer.safetensors"
    layer.save(path)
    loaded = build(lambda: dj.DamchaAttention.load(path))
    assert loaded.config == config
    # A file written by the reference loads into the same numbers.
    dc.save_params(tmp_path / "ref.safetensors", params, config)
    from_ref = build(lambda: dj.DamchaAttention.load(tmp_path / "ref.safetensors"))
    for other in (loaded, from_ref):
        for name, value in other.to_canonical().items():
            np.testing.assert_array_equal(value, layer.to_canonical()[name], err_msg=name)


@pytest.mark.parametrize("chunks", [(1,) * 7, (3, 1, 1, 2)], ids=["token-by-token", "prefill-then-steps"])
def test_decode_loop_equals_causal_forward(chunks: tuple[int, ...]) -> None:
    layer, _, config = _open_layer("gqa")
    x = _normal((B, sum(chunks), E), 5)
    full = run(lambda x: layer(x, is_causal=True), x)
    layer.init_cache(x.shape)
    graphdef, state = nnx.split(layer)

    def step(state, tokens):
        module = nnx.merge(graphdef, state)
        return module(tokens, decode=True), nnx.state(module)

    step = jax.jit(step, compiler_options=FAST)
    outs, start = [], 0
    for size in chunks:
        y, state = step(state, x[:, start : start + size])
        outs.append(y)
        start += size
    # Under jit the full cache cannot be checked on the host: the next step is NaN
    # (dynamic_update_slice would clamp its index and overwrite the last slot).
    over, _ = step(state, x[:, :1])
    assert np.isnan(np.asarray(over)).all()
    nnx.update(layer, state)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, rtol=1e-5, atol=1e-5)
    # The cache holds the transformed keys k~ = L(x) k, not the raw k.
    _, k_tilde, _ = dj.transformed_qkv(layer.arrays(), config, x)
    np.testing.assert_allclose(layer.cached_key[...], k_tilde, rtol=1e-5, atol=1e-6)
    with pytest.raises(dc.DamchaValueError, match=rf"the cache is full .*Received: inputs_q\.shape=\({B}, 1, {E}\)$"):
        layer(x[:, :1], decode=True)


@pytest.mark.parametrize("q_len, k_len", [(1, 2), (2, 1)], ids=["more-keys", "fewer-keys"])
def test_decode_refuses_keys_of_another_length(q_len: int, k_len: int) -> None:
    """As Flax's MHA does: a step appends one key per query token. Keys of another
    length would fill the cache out of step with cache_index (a slot overwritten
    at the next step, or a slot left zero that later queries attend to)."""
    layer = build(lambda: dj.DamchaAttention(4, E, rngs=nnx.Rngs(0)))
    layer.init_cache((B, 4, E))
    x = _normal((B, 2, E), 6)
    with pytest.raises(
        dc.DamchaValueError,
        match=rf"Invalid argument `inputs_k`: expected one key token per query token when decoding: {q_len}, .*"
        rf"Received: inputs_k\.shape=\({B}, {k_len}, {E}\), inputs_q\.shape=\({B}, {q_len}, {E}\)",
    ):
        layer(x[:, :q_len], x[:, :k_len], decode=True)
    assert int(layer.cache_index[...]) == 0  # nothing was written


def test_decode_needs_init_cache() -> None:
    layer = build(lambda: dj.DamchaAttention(4, E, rngs=nnx.Rngs(0)))
    with pytest.raises(dc.DamchaValueError, match="init_cache"):
        layer(jnp.ones((1, 1, E)), decode=True)


def test_stack_shares_one_generator_and_sums_its_gradient() -> None:
    kwargs = dict(num_layers=2, in_features=E, num_heads=4, mlp_features=32)
    shared = build(lambda: dj.DamchaEncoder(**kwargs, share_metric=True, rngs=nnx.Rngs(0)))
    gens = {id(layer.attention.metric["qk"].generator) for layer in shared.layers}
    assert len(gens) == 1 and shared.metric_generators["qk"] is shared.layers[0].attention.metric["qk"].generator
    for i, layer in enumerate(shared.layers):  # open the per-layer gates, differently
        layer.attention.metric["qk"].gate[...] = jnp.full((4,), 0.2 * (i + 1))
    unshared = build(lambda: dj.DamchaEncoder(**kwargs, share_metric=False, rngs=nnx.Rngs(1)))
    for source, target in zip(shared.layers, unshared.layers):
        nnx.update(target, nnx.state(source))  # a block's state includes the generator
    nnx.update(unshared.final_norm, nnx.state(shared.final_norm))
    n_shared = sum(v.size for v in jax.tree.leaves(nnx.state(shared, nnx.Param)))
    n_unshared = sum(v.size for v in jax.tree.leaves(nnx.state(unshared, nnx.Param)))
    assert n_unshared - n_shared == E * 16 + 16  # the generator is stored once

    x = _normal((B, N, E), 6)

    (gd_shared, st_shared), (gd_unshared, st_unshared) = nnx.split(shared), nnx.split(unshared)

    def outputs_and_grads(st_shared, st_unshared):
        # split/merge keeps the graph: a plain pytree flatten would copy the shared node.
        shared, unshared = nnx.merge(gd_shared, st_shared), nnx.merge(gd_unshared, st_unshared)
        loss = lambda model: jnp.sum(model(x, is_causal=True) ** 2)  # noqa: E731
        return shared(x, is_causal=True), unshared(x, is_causal=True), nnx.grad(loss)(shared), nnx.grad(loss)(unshared)

    y_shared, y_unshared, g_shared, g_unshared = run(outputs_and_grads, st_shared, st_unshared)
    np.testing.assert_allclose(y_shared, y_unshared, rtol=1e-5, atol=1e-5)
    summed = sum(g_unshared["layers"][i]["attention"]["metric"]["qk"]["generator"]["kernel"][...] for i in range(2))
    # NNX reports a shared variable once, at its first path: one gradient, the sum over layers.
    kernels = [v for path, v in nnx.to_flat_state(g_shared) if path[-2:] == ("generator", "kernel")]
    assert len(kernels) == 1
    np.testing.assert_allclose(kernels[0][...], summed, rtol=1e-4, atol=1e-6)


def _call(model, x, **kwargs) -> np.ndarray:
    """``model(x, **kwargs)`` as one compiled program, its RNG counts written back."""
    graphdef, state = nnx.split(model)

    def inner(state, x):
        merged = nnx.merge(graphdef, state)
        return merged(x, **kwargs), nnx.state(merged)

    y, state = run(inner, state, x)
    nnx.update(model, state)
    return np.asarray(y)


def test_encoder_dropouts_follow_deterministic_as_in_flax() -> None:
    """Every dropout of the blocks (residual and attention) takes the
    constructor's ``deterministic`` as its default, a call's as an override,
    and eval()/train()/nnx.view as Flax's modules do (the residual dropout
    once ignored the constructor's and dropped at every call)."""
    kwargs = dict(num_layers=2, in_features=8, num_heads=2, mlp_features=16)
    enc = build(
        lambda: dj.DamchaEncoder(
            **kwargs, dropout_rate=0.5, attention_dropout_rate=0.5, deterministic=True, rngs=nnx.Rngs(0, dropout=1)
        )
    )
    plain = build(lambda: dj.DamchaEncoder(**kwargs, rngs=nnx.Rngs(2)))  # no dropout at all, same weights below
    plain.load_canonical(enc.to_canonical()[0])
    x = _normal((B, N, 8), 11)
    expected = _call(plain, x)
    for _ in range(2):  # repeated calls: nothing dropped, the dropout-free output
        np.testing.assert_allclose(_call(enc, x), expected, rtol=1e-6, atol=1e-6)
    first, second = _call(enc, x, deterministic=False), _call(enc, x, deterministic=False)
    assert np.abs(first - expected).max() > 1e-2 and np.abs(first - second).max() > 1e-2  # fresh masks per call

    dropouts = [m for layer in enc.layers for m in (layer.dropout, layer.attention)]
    enc.train()
    assert all(m.deterministic is False for m in dropouts)
    assert np.abs(_call(enc, x) - expected).max() > 1e-2
    np.testing.assert_allclose(_call(enc, x, deterministic=True), expected, rtol=1e-6, atol=1e-6)
    enc.eval()
    assert all(m.deterministic is True for m in dropouts)
    np.testing.assert_allclose(_call(enc, x), expected, rtol=1e-6, atol=1e-6)
    training = nnx.view(enc, deterministic=False)
    assert np.abs(_call(training, x) - expected).max() > 1e-2
    np.testing.assert_allclose(_call(enc, x), expected, rtol=1e-6, atol=1e-6)  # the view left enc in eval mode
    # Each dropout alone is switched too: only the residual, then only the attention, drops.
    for rates in (dict(dropout_rate=0.5), dict(attention_dropout_rate=0.5)):
        one = build(lambda rates=rates: dj.DamchaEncoder(**kwargs, **rates, rngs=nnx.Rngs(0, dropout=1)))
        one.eval()
        np.testing.assert_allclose(_call(one, x), expected, rtol=1e-6, atol=1e-6)
        one.train()
        assert np.abs(_call(one, x) - expected).max() > 1e-2, rates


@pytest.mark.parametrize("rate", ["dropout_rate", "attention_dropout_rate"])
def test_block_without_deterministic_refuses_either_dropout_alike(rate: str) -> None:
    """deterministic=None (the default) decides nothing, for the residual
    dropout as for the attention's (as nnx.MultiHeadAttention): a call needs
    one, else the same DamchaValueError; with no dropout nothing is needed."""
    block = build(lambda: dj.DamchaEncoderBlock(8, 2, 16, **{rate: 0.5}, rngs=nnx.Rngs(0, dropout=1)))
    x = _normal((B, N, 8), 12)
    with pytest.raises(
        dc.DamchaValueError,
        match=rf"Invalid argument `deterministic`: expected a bool when {rate}=0.5 > 0: given to __call__ or the "
        r"constructor, or set by eval\(\)/train\(\).*Received: deterministic=None",
    ):
        block(x)
    kept = _call(block, x, deterministic=True)
    assert np.abs(_call(block, x, deterministic=False) - kept).max() > 1e-2
    assert np.all(np.isfinite(_call(build(lambda: dj.DamchaEncoderBlock(8, 2, 16, rngs=nnx.Rngs(0))), x)))


def test_attention_dropout_only_in_training() -> None:
    layer, params, config = _open_layer("self")
    dropping = build(
        lambda: dj.DamchaAttention.from_canonical(params, config.replace(dropout=0.5), rngs=nnx.Rngs(0, dropout=1))
    )
    x, _ = _inputs(False, E)
    key = jax.random.key(7)
    inference, train, plain = run(
        lambda x, key: (
            dropping(x, deterministic=True),
            dropping(x, deterministic=False, rngs=nnx.Rngs(dropout=key)),
            layer(x),
        ),
        x,
        key,
    )
    np.testing.assert_allclose(inference, plain, rtol=1e-6, atol=1e-6)
    assert np.all(np.isfinite(train)) and np.abs(np.asarray(train - plain)).max() > 1e-3
    with pytest.raises(dc.DamchaValueError, match="deterministic"):
        dropping(x)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_heads=3, in_features=16), "Invalid argument `qkv_features`: expected a multiple of `num_heads`"),
        (dict(num_heads=4, in_features=16, num_kv_heads=2, coupling="tied"), "coupling='tied'"),
        (dict(num_heads=4, in_features=16, qkv_features=16, key_dim=8), "expected num_heads \\* key_dim when both"),
        (dict(num_heads=4, in_features=16, metric="lowrank"), "metric_rank"),
    ],
    ids=["indivisible", "tied-gqa", "qkv-vs-key-dim", "lowrank-no-rank"],
)
def test_constructor_errors(kwargs, match) -> None:
    with pytest.raises(dc.DamchaValueError, match=match):
        dj.DamchaAttention(**kwargs, rngs=nnx.Rngs(0))


def test_mismatched_shared_generator_is_rejected() -> None:
    gen = build(lambda: dj.MetricGenerator(16, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(dc.DamchaValueError, match="expected a generator that fits"):
        dj.DamchaAttention(4, 16, metric_generator=gen, rngs=nnx.Rngs(0))


def test_flax_mask_helpers_work_as_in_flax_mha() -> None:
    """nnx.make_attention_mask / make_causal_mask return float 0/1 masks, which
    Flax MHA reads as non-zero = attend; the module takes them the same way."""
    mha_kwargs, options, _ = ARCHS["self"]
    mha = build(lambda: nnx.MultiHeadAttention(**mha_kwargs, decode=False, rngs=nnx.Rngs(1)))
    layer = build(lambda: dj.DamchaAttention.from_mha(mha, **options, rngs=nnx.Rngs(2)))
    x, _ = _inputs(False, E)
    tokens = jnp.asarray(np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))
    padding = nnx.make_attention_mask(tokens > 0, tokens > 0)  # (B, 1, N, N) float32
    mask = nnx.combine_masks(padding, nnx.make_causal_mask(tokens))
    assert mask.dtype == jnp.float32
    expected, actual, boolean, mean = run(
        lambda x, m: (
            mha(x, mask=m),
            layer(x, mask=m),
            layer(x, mask=m > 0),
            mha.out(jnp.mean(mha.value(x), axis=1)),  # (B, E): the output of the mean of every key's value
        ),
        x,
        mask,
    )
    # Padded queries see no key: Flax averages the values of all keys there,
    # DAMCHA gives attention output 0 (the spec's rule), so y = the output bias.
    # from_mha's layer equals Flax everywhere else.
    real = np.asarray(tokens > 0)
    np.testing.assert_allclose(np.asarray(actual)[real], np.asarray(expected)[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(actual)[~real], np.broadcast_to(np.asarray(layer.out.bias[...]), (2, 16)), atol=1e-6
    )
    np.testing.assert_allclose(np.asarray(expected)[1, 3:], np.asarray(mean)[1][None].repeat(2, 0), atol=1e-5)
    np.testing.assert_array_equal(actual, boolean)


@pytest.mark.parametrize("x64", [False, True], ids=["bfloat16-params", "float32-params-under-x64"])
def test_every_parameter_and_the_output_follow_param_dtype(x64: bool) -> None:
    """param_dtype holds for the metric generator too (its init scale once
    promoted bfloat16 to float32, and float32 to float64 under x64), so the
    output dtype follows Flax's MHA with the same dtypes."""
    param_dtype = jnp.float32 if x64 else jnp.bfloat16
    with jax.enable_x64(x64):
        for options in (dict(), dict(metric="lowrank", metric_rank=2, coupling="separate")):

            def build_and_call(options=options):  # abstractly: shapes and dtypes only, nothing compiled
                x = jnp.zeros((B, N, E), param_dtype)
                layer = dj.DamchaAttention(4, E, param_dtype=param_dtype, rngs=nnx.Rngs(0), **options)
                mha = nnx.MultiHeadAttention(4, E, param_dtype=param_dtype, decode=False, rngs=nnx.Rngs(0))
                return nnx.state(layer, nnx.Param), layer(x), mha(x)

            state, out, expected = jax.eval_shape(build_and_call)
            dtypes = {path: v.dtype for path, v in nnx.to_flat_state(state)}
            assert all(dt == param_dtype for dt in dtypes.values()), dtypes
            assert out.dtype == expected.dtype == param_dtype


def test_initialiser_arguments_follow_flax_mha() -> None:
    """Flax's constructor options are accepted: out_bias_init (default bias_init) sets the output bias only."""
    inits = dict(bias_init=nnx.initializers.constant(0.5), out_bias_init=nnx.initializers.ones)
    mha = build(lambda: nnx.MultiHeadAttention(4, E, 16, decode=False, **inits, rngs=nnx.Rngs(0)))
    layer = build(lambda: dj.DamchaAttention(4, E, 16, **inits, rngs=nnx.Rngs(0)))
    for name in ("query", "key", "value", "out"):
        np.testing.assert_array_equal(getattr(layer, name).bias[...], getattr(mha, name).bias[...], err_msg=name)


def test_batch_axes_as_flax_takes_them():
    """[batch..., N, E] and unbatched (N, E) inputs with [batch..., H|1, N|1, M] masks:
    equal to Flax MHA with zero gates, and with open gates to the reference on the
    folded batch."""
    mha = build(
        lambda: nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=nnx.Rngs(0))
    )
    layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(2, 3, 5, 8)), jnp.float32)
    pad = jnp.asarray(rng.random((2, 3, 5)) < 0.8).at[..., 0].set(True)
    # Padded keys only: a query row that sees nothing is the documented v1 difference from Flax.
    mask = nnx.combine_masks(
        nnx.make_causal_mask(pad), nnx.make_attention_mask(jnp.ones_like(pad), pad)
    )  # (2, 3, 1, 5, 5)
    want, got = run(lambda x, m: (mha(x, mask=m), layer(x, mask=m)), x, mask)
    assert got.shape == (2, 3, 5, 8)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    want, got = run(lambda x: (mha(x), layer(x)), x[0, 0])
    assert got.shape == (5, 8)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)

    params = layer.to_canonical()
    params["metric.qk.gate"] = np.array([0.7, -0.5])
    layer.load_canonical(params)
    got = np.asarray(run(lambda x, m: layer(x, mask=m), x, mask), dtype=np.float64)
    flat_mask = np.broadcast_to(np.asarray(mask, bool), (2, 3, 1, 5, 5)).reshape(6, 1, 5, 5)
    ref = dc.damcha_attention(
        layer.to_canonical(), layer.config, np.asarray(x, np.float64).reshape(6, 5, 8), mask=flat_mask
    )
    np.testing.assert_allclose(got.reshape(6, 5, 8), ref, rtol=2e-4, atol=2e-5)

    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `inputs_k`: expected the batch axes of `inputs_q`, \(2, 3\)"
    ):
        layer(x, x[:, :2])
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `mask`: expected a shape broadcastable to \[batch\.\.\., H, N, M\] = \(2, 3, 2, 5, 5\).*Received: mask.shape=\(2, 2, 1, 5, 5\)",
    ):
        layer(x, mask=jnp.ones((2, 2, 1, 5, 5), bool))


def test_canonical_vocabulary_and_deprecated_aliases() -> None:
    """to_canonical (float64) / load_canonical (returns self) / from_canonical,
    and the old to_params / set_params / from_params still work with a DeprecationWarning."""
    layer, params, config = _open_layer("self")
    canonical = layer.to_canonical()
    assert all(v.dtype == np.float64 for v in canonical.values())
    assert list(canonical) == list(config.param_shapes())
    other = build(lambda: dj.DamchaAttention(4, E, 16, rngs=nnx.Rngs(9)))
    assert other.load_canonical(params) is other
    for name, value in other.to_canonical().items():
        np.testing.assert_array_equal(value, canonical[name], err_msg=name)
    with pytest.warns(DeprecationWarning, match="to_canonical"):
        old = layer.to_params()
    assert old.keys() == canonical.keys()
    with pytest.warns(DeprecationWarning, match="load_canonical"):
        assert other.set_params(params) is other
    with pytest.warns(DeprecationWarning, match="from_canonical"):
        again = dj.DamchaAttention.from_params(params, config)
    np.testing.assert_array_equal(again.to_canonical()["metric.qk.kernel"], canonical["metric.qk.kernel"])


@pytest.mark.parametrize("share", [True, False], ids=["shared", "per-block"])
def test_encoder_to_canonical_is_the_core_stack_format(share: bool) -> None:
    """DamchaEncoder.to_canonical() -> (params, EncoderConfig): the stack
    reference (damcha_core.encoder_forward) on it equals the JAX encoder; a
    shared generator is stored once. A block gives a one-layer stack."""
    enc = build(lambda: dj.DamchaEncoder(2, 8, 2, 16, share_metric=share, rngs=nnx.Rngs(0)))
    for i, block in enumerate(enc.layers):
        block.attention.metric["qk"].gate[...] = jnp.asarray([0.4 + 0.2 * i, -0.6])
    x = _normal((2, 5, 8), 7)
    params, config = enc.to_canonical(causal=True)
    assert isinstance(config, dc.EncoderConfig) and config.share_metric == share and config.causal
    assert (config.activation, config.norm_eps, config.final_norm, config.norm_first) == ("gelu_tanh", 1e-6, True, True)
    assert list(params) == list(config.param_shapes()) and all(v.dtype == np.float64 for v in params.values())
    assert ("shared.metric.qk.kernel" in params) == share
    np.testing.assert_allclose(
        run(lambda x: enc(x, is_causal=True), x),
        dc.encoder_forward(params, config, np.asarray(x)),
        rtol=2e-4,
        atol=2e-5,
    )
    block_params, block_config = enc.layers[1].to_canonical()
    assert block_config.num_layers == 1 and not block_config.final_norm and not block_config.causal
    np.testing.assert_array_equal(
        block_params["layers.0.attention.metric.qk.gate"], np.asarray([0.6, -0.6], np.float32)
    )


def test_module_metric_penalty_and_nnx_view() -> None:
    """The module's metric_penalty equals the reference's (batch axes folded);
    nnx.view(decode=True, batch_size, max_length) allocates the cache (Flax 0.12.8's set_view
    means to, but its check finds the attribute `cached_key = None` and allocates nothing)."""
    layer, params, config = _open_layer("mqa-lowrank")
    x, c = _normal((2, 3, N, E), 8), _normal((2, 3, M, E), 9)
    expected = dc.metric_penalty(params, config, np.asarray(x).reshape(6, N, E), np.asarray(c).reshape(6, M, E))
    np.testing.assert_allclose(layer.metric_penalty(x, c), expected, rtol=1e-4)
    view = nnx.view(layer, decode=True, batch_size=B, max_length=4)
    assert view.decode and view.cached_key.shape == (B, 4, 1, 4) and layer.cached_key is None
    with pytest.raises(
        dc.DamchaValueError,
        match="Invalid argument `batch_size`: expected a value with decode=True.*both batch_size and max_length",
    ):
        nnx.view(layer, decode=True)


@pytest.mark.parametrize(
    "call",
    ["plain", "is_causal", "mask-2d", "mask-batched", "lead-axes"],
)
def test_exports_with_a_symbolic_batch_size(call):
    """jax.export with a symbolic batch size, as nnx.MultiHeadAttention exports:
    the layer folded its batch axes with int(), which a symbolic size refuses
    (InconclusiveDimensionOperation, a reviewer's find). The exported program,
    called at two batch sizes, equals the jitted layer."""
    from jax import export

    (b,) = export.symbolic_shape("b")
    layer = build(lambda: dj.DamchaAttention(4, E, rngs=nnx.Rngs(0)))
    layer.metric["qk"].gate[...] = jnp.full((4,), 0.5)  # open: the maps run
    graphdef, state = nnx.split(layer)
    causal = jnp.tril(jnp.ones((N, N), bool))
    lead = (b, 3) if call == "lead-axes" else (b,)
    masks = {"mask-2d": lambda B: causal, "mask-batched": lambda B: jnp.broadcast_to(causal, (B, 1, N, N))}

    def f(state, x, *mask):
        return nnx.merge(graphdef, state)(x, mask=mask[0] if mask else None, is_causal=call == "is_causal")

    specs = [jax.ShapeDtypeStruct((*lead, N, E), jnp.float32)]
    if call == "mask-batched":
        specs.append(jax.ShapeDtypeStruct((b, 1, N, N), jnp.bool_))
    elif call == "mask-2d":
        specs.append(jax.ShapeDtypeStruct((N, N), jnp.bool_))
    exported = export.export(jax.jit(f))(state, *specs)
    for B in (2, 5):
        x = jax.random.normal(jax.random.key(B), (B, 3, N, E) if call == "lead-axes" else (B, N, E))
        args = (masks[call](B),) if call in masks else ()
        np.testing.assert_allclose(exported.call(state, x, *args), run(f, state, x, *args), rtol=1e-6, atol=1e-6)
