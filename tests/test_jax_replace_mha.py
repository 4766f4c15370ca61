"""``damcha_jax.replace_mha``: every ``nnx.MultiHeadAttention`` of a Flax NNX
model swapped for ``DamchaAttention.from_mha`` in one call, wherever NNX holds
modules, shared layers kept shared, atomic on refusal; layers stacked by
``nnx.vmap``/``nnx.scan`` converted stacked, checked against the same layers
sliced out and run one after another."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import damcha_core as dc
import damcha_jax as dj

E = 8


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, mha: type = nnx.MultiHeadAttention) -> None:
        self.attn = mha(num_heads=2, in_features=E, qkv_features=E, decode=False, rngs=rngs)
        self.mlp = nnx.Linear(E, E, rngs=rngs)

    def __call__(self, x, mask=None):
        return x + self.mlp(self.attn(x, mask=mask))


class Model(nnx.Module):
    """Attention in an nnx.List, a list and a tuple kept with nnx.data, an nnx.Dict, and an alias."""

    def __init__(self, rngs: nnx.Rngs, mha: type = nnx.MultiHeadAttention) -> None:
        self.blocks = nnx.List([Block(rngs), Block(rngs, mha)])
        self.kept = nnx.data([Block(rngs)])
        self.pair = nnx.data((Block(rngs),))
        self.named = nnx.Dict({"last": Block(rngs)})
        self.alias = self.blocks[0].attn

    def __call__(self, x, mask=None):
        for block in [*self.blocks, *self.kept, *self.pair, self.named["last"]]:
            x = block(x, mask)
        return self.alias(x, mask=mask)


def _where(model: Model) -> list:
    return [
        model.blocks[0].attn,
        model.blocks[1].attn,
        model.kept[0].attn,
        model.pair[0].attn,
        model.named["last"].attn,
    ]


def _inputs():
    x = jax.random.normal(jax.random.key(1), (2, 5, E))
    mask = nnx.combine_masks(nnx.make_causal_mask(jnp.ones((2, 5))), jnp.ones((2, 1, 1, 5), bool))
    return x, mask


def test_every_layer_is_replaced_with_its_outputs_and_the_alias_stays_one_layer():
    model = Model(nnx.Rngs(0))
    before = _where(model)
    x, mask = _inputs()
    expected = model(x, mask)
    assert dj.replace_mha(model, rngs=nnx.Rngs(3)) is model
    after = _where(model)
    assert all(isinstance(layer, dj.DamchaAttention) for layer in after)
    assert model.alias is model.blocks[0].attn
    for old, new in zip(before, after):
        np.testing.assert_array_equal(np.asarray(new.query.kernel[...]), np.asarray(old.query.kernel[...]))
    np.testing.assert_allclose(np.asarray(model(x, mask)), np.asarray(expected), atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(nnx.jit(lambda m, x, mask: m(x, mask))(model, x, mask)), np.asarray(expected), atol=1e-6
    )


def test_the_replaced_layers_train_and_their_maps_act():
    model = Model(nnx.Rngs(0))
    dj.replace_mha(model, rngs=nnx.Rngs(3), coupling="separate")
    x, mask = _inputs()
    plain = model(x, mask)
    for layer in _where(model):
        for side in ("q", "k"):
            gate = layer.metric[side].gate
            gate[...] = jnp.full(gate.shape, 0.5)
    assert float(jnp.abs(model(x, mask) - plain).max()) > 1e-3  # every map open: the model moved

    def loss(m):
        return jnp.mean(m(x, mask) ** 2)

    grads = dict(nnx.to_flat_state(nnx.grad(loss)(model)))
    for prefix in (("blocks", 1, "attn"), ("named", "last", "attn"), ("pair", 0, "attn"), ("kept", 0, "attn")):
        metric = {path: g for path, g in grads.items() if path[: len(prefix) + 1] == (*prefix, "metric")}
        assert len(metric) == 6, (prefix, list(metric))  # gate, generator kernel and bias of q and k
        for path, g in metric.items():
            assert float(jnp.abs(g[...]).max()) > 0, path


def test_an_optimizer_built_after_replace_mha_trains_the_maps_and_one_built_before_fails():
    """docs/jax.md: build nnx.Optimizer after replace_mha. After: Adam moves the gates
    and generators with the projections; before: its state lacks the new parameters
    and its first update fails (optax's pytree ValueError: Flax's optimizer keeps no
    link to the model that replace_mha could follow)."""
    import optax

    x, mask = _inputs()

    def loss(m):
        return jnp.mean(m(x, mask) ** 2)

    model = Model(nnx.Rngs(0))
    dj.replace_mha(model, rngs=nnx.Rngs(3))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    gate = model.blocks[1].attn.metric["qk"].gate
    before = np.asarray(gate[...]).copy()
    opt.update(model, nnx.grad(loss)(model))
    assert float(np.abs(np.asarray(gate[...]) - before).max()) > 1e-4

    stale = Model(nnx.Rngs(0))
    early = nnx.Optimizer(stale, optax.adam(1e-2), wrt=nnx.Param)
    dj.replace_mha(stale, rngs=nnx.Rngs(3))
    with pytest.raises(ValueError, match="pytree structure"):
        early.update(stale, nnx.grad(loss)(stale))


class OwnCall(nnx.MultiHeadAttention):
    def __call__(self, inputs_q, *args, **kwargs):
        return 2.0 * super().__call__(inputs_q, *args, **kwargs)


def test_a_layer_that_cannot_be_converted_is_named_and_nothing_is_replaced():
    model = Model(nnx.Rngs(0), mha=OwnCall)
    with pytest.raises(dc.DamchaValueError, match=r"overrides __call__ \(at model\.blocks\[1\]\.attn\)$"):
        dj.replace_mha(model, rngs=nnx.Rngs(3))
    assert not any(isinstance(layer, dj.DamchaAttention) for layer in _where(model))


def test_bad_calls_are_refused():
    with pytest.raises(dc.DamchaValueError, match=r"Invalid argument `model`: .*it is itself one"):
        dj.replace_mha(nnx.MultiHeadAttention(2, E, decode=False, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `model`: expected a flax.nnx.Module"):
        dj.replace_mha({"attn": None}, rngs=nnx.Rngs(1))
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `rngs`: expected an nnx.Rngs"):
        dj.replace_mha(Model(nnx.Rngs(0)), rngs=0)
    model = Model(nnx.Rngs(0))
    dj.replace_mha(model, rngs=nnx.Rngs(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dj.replace_mha(model, rngs=nnx.Rngs(3))
    assert [str(w.message) for w in caught] == [
        "replace_mha found no nnx.MultiHeadAttention in Model: nothing was replaced (it holds 5 DamchaAttention "
        "layers already)."
    ]


def test_a_tuple_held_twice_gets_the_one_converted_layer_in_both_places():
    # The second holder kept the old tuple (and so the unconverted MHA): after training, two layers.
    class Twice(nnx.Module):
        def __init__(self, rngs):
            self.attns = nnx.data((nnx.MultiHeadAttention(2, E, qkv_features=E, decode=False, rngs=rngs),))
            self.same = nnx.data(self.attns)

    model = Twice(nnx.Rngs(0))
    dj.replace_mha(model, rngs=nnx.Rngs(1))
    assert isinstance(model.attns[0], dj.DamchaAttention) and model.same[0] is model.attns[0]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_a_model_cast_after_construction_keeps_its_dtype(dtype):
    """An MHA whose arrays were cast after construction (param_dtype still
    float32: a model cast for inference) converts with its arrays in their
    dtype, and gives MHA's output dtype and values with closed gates, alone
    and through replace_mha (the arrays were written into new float32
    variables: float32 outputs, twice the memory, a reviewer's find)."""
    model = Block(nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda a: a.astype(dtype), nnx.state(model, nnx.Param)))
    x = jax.random.normal(jax.random.key(1), (2, 5, E), dtype)
    want, want_attn = model(x), model.attn(x)
    layer = dj.DamchaAttention.from_mha(model.attn, rngs=nnx.Rngs(1))
    got = layer(x)
    assert layer.query.kernel[...].dtype == layer.out.kernel[...].dtype == dtype
    assert got.dtype == want_attn.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want_attn, np.float32))
    dj.replace_mha(model, rngs=nnx.Rngs(1))
    assert isinstance(model.attn, dj.DamchaAttention) and model.attn.query.kernel[...].dtype == dtype
    out = model(x)
    assert out.dtype == want.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_missing_dropout_streams_are_refused_by_name():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(2, E, qkv_features=E, decode=False, dropout_rate=0.1, rngs=rngs)

    # Was a raw AttributeError ("No RngStream named 'dropout'"), naming no layer.
    with pytest.raises(dc.DamchaValueError, match=r"`rngs`: expected an nnx.Rngs with a 'dropout'.*\(at model.attn\)$"):
        dj.replace_mha(Block(nnx.Rngs(0)), rngs=nnx.Rngs(params=1))
    assert isinstance(dj.replace_mha(Block(nnx.Rngs(0)), rngs=nnx.Rngs(params=1, dropout=2)).attn, dj.DamchaAttention)
    stacked = _stack(lambda r: Block(r), 2, nnx.Rngs(0))
    with pytest.raises(dc.DamchaValueError, match=r"`rngs`: expected an nnx.Rngs with a 'dropout'.*\(at model.attn\)$"):
        dj.replace_mha(stacked, rngs=nnx.Rngs(params=1))
    assert isinstance(stacked.attn, nnx.MultiHeadAttention)


# ------------------------------------------------- layers stacked by nnx.vmap / nnx.scan

SE, SL = 16, 3  # the stacked models' feature size and layer count


def _stack(factory, splits, rngs, out_axes=0, **vmap_kwargs):
    """``factory(rngs)`` built once per layer, stacked on leading axes ``splits``
    (an int, or a tuple for nested vmaps), the Flax NNX LM recipe."""
    splits_tuple = (splits,) if isinstance(splits, int) else tuple(splits)
    build = factory
    for _ in splits_tuple:
        build = nnx.vmap(build, in_axes=0, out_axes=out_axes, **vmap_kwargs)
    with nnx.split_rngs(rngs, splits=splits_tuple):
        return build(rngs)


class SBlock(nnx.Module):
    """A pre-LN-free residual block: attention, then a dense layer."""

    def __init__(self, rngs: nnx.Rngs, **mha_kwargs) -> None:
        self.attn = nnx.MultiHeadAttention(2, SE, decode=False, rngs=rngs, **mha_kwargs)
        self.mlp = nnx.Linear(SE, SE, rngs=rngs)

    def __call__(self, x, mask, deterministic):
        return x + self.mlp(self.attn(x, mask=mask, deterministic=deterministic))


class StackedLM(nnx.Module):
    """``SL`` blocks stacked by ``nnx.vmap``, run by ``nnx.scan`` (the user's forward, untouched by conversion)."""

    def __init__(self, rngs: nnx.Rngs, **mha_kwargs) -> None:
        self.blocks = _stack(lambda r: SBlock(r, **mha_kwargs), SL, rngs)

    def __call__(self, x, mask=None, deterministic=True):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, block):
            return block(h, mask, deterministic)

        return run(x, self.blocks)


def _layer_by_layer(stacked, indices, x, apply):
    """The independent computation a stacked forward must equal: for each index
    in turn (a tuple for nested axes), the stacked module's state sliced there,
    merged into an unstacked module and applied, ``x = apply(module, x)``: a
    Python loop of one-layer modules (compiled as one program, for speed)."""
    graphdef, state = nnx.split(stacked)

    @jax.jit
    def run(state, x):
        for index in indices:
            one = nnx.merge(graphdef, jax.tree.map(lambda a, i=index: a[i], state))
            x = apply(one, x)
        return x

    return run(state, x)


def _open_gates(model, value=0.5):
    for _, node in nnx.iter_graph(model):
        if isinstance(node, dj.DamchaAttention):
            for side in node.metric:
                gate = node.metric[side].gate
                gate[...] = jnp.full(gate.shape, value, gate.dtype)


def _stacked_inputs():
    x = jax.random.normal(jax.random.key(1), (2, 5, SE))
    # A padded key in the second row: the mask reaches every layer of the scan.
    mask = jnp.asarray(np.arange(5)[None, None, None, :] < np.array([5, 3])[:, None, None, None])
    return x, mask


STACKED_CASES = {
    "self-attention": ({}, {}),
    # Separate maps, the lowrank generator, the norms' scales and a stacked dropout stream.
    "gqa-normalize_qk-dropout-lowrank": (
        dict(num_kv_heads=1, normalize_qk=True, dropout_rate=0.3),
        dict(metric="lowrank", metric_rank=2),
    ),
}


@pytest.mark.parametrize("mha_kwargs, convert_kwargs", list(STACKED_CASES.values()), ids=list(STACKED_CASES))
def test_stacked_layers_convert_in_one_call_and_the_scanned_forward_runs_them(mha_kwargs, convert_kwargs):
    model = StackedLM(nnx.Rngs(0), **mha_kwargs)
    mha = model.blocks.attn
    x, mask = _stacked_inputs()
    before = model(x, mask)
    dj.replace_mha(model, rngs=nnx.Rngs(params=3, dropout=4), **convert_kwargs)
    layer = model.blocks.attn
    assert isinstance(layer, dj.DamchaAttention) and layer.decode is False
    for path, param in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        assert param.shape[0] == SL, path  # projections, norms, gates and generators alike
    if mha_kwargs.get("dropout_rate"):
        assert layer.rngs is not None and layer.rngs.count.shape == mha.rngs.count.shape == (SL,)
    for name in ("query", "key", "value", "out"):
        np.testing.assert_array_equal(np.asarray(getattr(layer, name).kernel[...]), getattr(mha, name).kernel[...])
    if mha_kwargs.get("normalize_qk"):
        np.testing.assert_array_equal(np.asarray(layer.key_ln.scale[...]), mha.key_ln.scale[...])
    # Gates closed, as converted: the scanned model is the original one (float32 rounding aside:
    # a layer with dropout runs the einsum attention).
    np.testing.assert_allclose(np.asarray(model(x, mask)), np.asarray(before), rtol=1e-5, atol=1e-5)

    _open_gates(model)
    # Copies taken before the forward advances the dropout streams: each runs the same draws.
    reference, again = nnx.clone(model.blocks), nnx.clone(model)
    deterministic = not mha_kwargs.get("dropout_rate")
    eager = model(x, mask, deterministic)

    def block(one, h):
        assert isinstance(one.attn, dj.DamchaAttention) and one.attn.query.kernel.shape == (SE, 2, 8)
        return one(h, mask, deterministic)

    expected = _layer_by_layer(reference, range(SL), x, block)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(eager - before).max()) > 1e-3  # the maps act
    jitted = nnx.jit(lambda m, x, mask: m(x, mask, deterministic))(again, x, mask)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_stacked_generators_draw_per_layer_and_per_stack():
    class TwoStacks(nnx.Module):
        def __init__(self, rngs):
            self.encoder = _stack(lambda r: SBlock(r), SL, rngs)
            self.decoder = _stack(lambda r: SBlock(r), SL, rngs)

    model = TwoStacks(nnx.Rngs(0))
    dj.replace_mha(model, rngs=nnx.Rngs(5))
    kernels = [np.asarray(s.attn.metric["qk"].generator.kernel[...]) for s in (model.encoder, model.decoder)]
    draws = [k[index] for k in kernels for index in range(SL)]
    assert all(float(np.abs(draws[i] - draws[j]).max()) > 1e-3 for i in range(len(draws)) for j in range(i))
    # Each layer's draw is an initialisation, not a zero or a copy: the stack's spread is the generator's.
    fresh = dj.DamchaAttention(2, SE, rngs=nnx.Rngs(9)).metric["qk"].generator.kernel[...]
    np.testing.assert_allclose(np.std(kernels[0]), float(jnp.std(fresh)), rtol=0.5)


def test_nested_layer_axes_convert_and_a_vmapped_scan_runs_them():
    K = 2  # an ensemble of K stacks of SL layers: nested nnx.vmap, axes (K, SL) on every parameter
    blocks = _stack(lambda r: SBlock(r), (K, SL), nnx.Rngs(0))
    assert blocks.attn.query.kernel.shape == (K, SL, SE, 2, 8)
    x, mask = _stacked_inputs()

    @nnx.vmap(in_axes=(0, None))
    def forward(stack, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, block):
            return block(h, mask, True)

        return run(x, stack)

    before = forward(blocks, x)
    layer = dj.DamchaAttention.from_mha(blocks.attn, rngs=nnx.Rngs(3))
    blocks.attn = layer
    for path, param in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        assert param.shape[:2] == (K, SL), path
    np.testing.assert_allclose(np.asarray(forward(blocks, x)), np.asarray(before), atol=1e-6)
    _open_gates(blocks)
    opened = forward(blocks, x)
    for member in range(K):
        indices = [(member, index) for index in range(SL)]
        expected = _layer_by_layer(blocks, indices, x, lambda one, h: one(h, mask, True))
        np.testing.assert_allclose(np.asarray(opened[member]), np.asarray(expected), rtol=1e-5, atol=1e-5)
    kernel = np.asarray(layer.metric["qk"].generator.kernel[...]).reshape(K * SL, -1)
    assert min(float(np.abs(kernel[i] - kernel[j]).max()) for i in range(K * SL) for j in range(i)) > 1e-3


def test_stacked_gradients_reach_every_layer_as_an_unrolled_loop_computes_them():
    model = StackedLM(nnx.Rngs(0))
    dj.replace_mha(model, rngs=nnx.Rngs(3))
    _open_gates(model)
    x, mask = _stacked_inputs()
    graphdef, params, rest = nnx.split(model.blocks, nnx.Param, ...)

    def unrolled(params):
        h = x
        for index in range(SL):
            sliced = jax.tree.map(lambda a, i=index: a[i], (params, rest))
            h = nnx.merge(graphdef, *sliced)(h, mask, True)
        return jnp.mean(h**2)

    expected = dict(nnx.to_flat_state(jax.jit(jax.grad(unrolled))(params)))
    got = nnx.jit(nnx.grad(lambda m: jnp.mean(m(x, mask) ** 2)))(model)
    metric = {path[1:]: g for path, g in nnx.to_flat_state(got) if "metric" in path}
    assert len(metric) == 3  # gate, generator kernel and bias of the tied map
    for path, g in metric.items():
        g = np.asarray(g[...])
        assert np.isfinite(g).all() and all(np.abs(g[i]).max() > 0 for i in range(SL)), path
        np.testing.assert_allclose(g, np.asarray(expected[path][...]), rtol=1e-4, atol=1e-6)


def test_stacked_decode_layers_decode_under_scan_as_mha_and_as_a_causal_forward_per_layer():
    # Converted as one layer is (a cache is not copied): the converted layer's cache is initialised
    # as the MHA's, under nnx.vmap, and the user's scan decodes the stacked layers token by token.
    B, T = 2, 4
    x = jax.random.normal(jax.random.key(2), (B, T, SE))

    @nnx.jit
    def step(stack, token):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, one):
            return h + one(h)

        return run(token, stack)

    def decode(stack):
        nnx.vmap(lambda m: m.init_cache((B, T, SE)), in_axes=0)(stack)
        return jnp.concatenate([step(stack, x[:, t : t + 1]) for t in range(T)], axis=1)

    mha = _stack(lambda r: nnx.MultiHeadAttention(2, SE, decode=True, rngs=r), SL, nnx.Rngs(0))
    layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))
    assert layer.decode is True and layer.query.kernel.shape == (SL, SE, 2, 8)
    opened = nnx.clone(layer)
    _open_gates(opened)
    reference = nnx.clone(opened)  # without a cache: the reference runs the plain causal forward
    np.testing.assert_allclose(np.asarray(decode(layer)), np.asarray(decode(mha)), rtol=1e-5, atol=1e-5)
    decoded = decode(opened)
    assert opened.cached_key.shape == (SL, B, T, 2, 8)
    np.testing.assert_array_equal(np.asarray(opened.cache_index[...]), [T] * SL)
    expected = _layer_by_layer(reference, range(SL), x, lambda one, h: h + one(h, decode=False, is_causal=True))
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_stacked_layers_keep_their_partition_names():
    # nnx.vmap's transform_metadata puts the layer axis's name in front of each sharded
    # parameter's names; the converted layer keeps them, and a scan that removes it runs.
    mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    layers = {nnx.PARTITION_NAME: "layers"}
    sharded = dict(
        kernel_metadata={"out_sharding": (None, "model", None)},
        out_kernel_metadata={"out_sharding": ("model", None, None)},
    )
    x, _ = _stacked_inputs()
    with jax.set_mesh(mesh):
        mha = _stack(
            lambda r: nnx.MultiHeadAttention(2, SE, decode=False, rngs=r, **sharded),
            SL,
            nnx.Rngs(0),
            transform_metadata=layers,
        )

        def forward(stack):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=layers)
            def run(h, one):
                return h + one(h)

            return run(x, stack)

        before = forward(mha)
        layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))
        theirs, ours = nnx.get_partition_spec(nnx.state(mha)), nnx.get_partition_spec(nnx.state(layer))
        assert ours["query"]["kernel"].get_metadata()["out_sharding"] == ("layers", None, "model", None)
        for name in ("query", "key", "value", "out"):
            for leaf in ("kernel", "bias"):
                assert ours[name][leaf] == theirs[name][leaf], (name, leaf)
        np.testing.assert_allclose(np.asarray(forward(layer)), np.asarray(before), atol=1e-6)


def _layer_axis_second(rngs):
    return _stack(lambda r: SBlock(r), SL, rngs, out_axes=1)


def _leading_axes_disagree(rngs):
    model = _stack(lambda r: SBlock(r), SL, rngs)
    model.attn.out.bias = nnx.Param(jnp.zeros((2, SE)))  # two layers' biases under three layers' kernels
    return model


@pytest.mark.parametrize(
    "make, shown",
    [
        (
            _layer_axis_second,
            r"\(query.kernel \(16, 2, 8\), key.kernel \(16, 2, 8\), .*out.bias \(16,\)\), all behind the same "
            r".*Received: mha.query.kernel.shape=\(16, 3, 2, 8\), .*mha.out.bias.shape=\(16, 3\)",
        ),
        (
            _leading_axes_disagree,
            r"\(query.kernel \(16, 2, 8\), out.bias \(16,\)\), all behind the same .*"
            r"Received: mha.query.kernel.shape=\(3, 16, 2, 8\), mha.out.bias.shape=\(2, 16\)",
        ),
    ],
    ids=["layer-axis-not-first", "leading-axes-disagree"],
)
def test_stacked_layouts_that_are_not_layer_axes_in_front_are_refused_by_name(make, shown):
    model = make(nnx.Rngs(0))
    with pytest.raises(
        dc.DamchaValueError,
        match=r"^Invalid argument `mha`: expected an nnx.MultiHeadAttention whose parameters have the one-layer "
        r"shapes its sizes give " + shown + r" \(at model.attn\)$",
    ):
        dj.replace_mha(model, rngs=nnx.Rngs(1))
    assert isinstance(model.attn, nnx.MultiHeadAttention)


def test_a_stacked_layer_its_options_refuse_is_refused_before_any_draw():
    model = _stack(lambda r: SBlock(r, num_kv_heads=1), SL, nnx.Rngs(0))
    rngs = nnx.Rngs(1)
    with pytest.raises(dc.DamchaValueError, match=r"^Invalid argument `coupling`: .*\(at model.attn\)$"):
        dj.replace_mha(model, rngs=rngs, coupling="tied")
    assert isinstance(model.attn, nnx.MultiHeadAttention)
    assert int(rngs.params.count[...]) == 0 and rngs.params.key.shape == ()  # not split, nothing drawn


@pytest.mark.parametrize("call", ["to_canonical", "arrays", "load_canonical", "save"])
def test_a_stacked_layer_refuses_canonical_io_and_one_sliced_out_takes_it(call, tmp_path):
    """Canonical params are one layer's. A stacked layer's to_canonical/arrays
    returned (L, ...) arrays under canonical names, and load_canonical of one
    layer's params wrote them into every layer, silently: each call is now
    refused naming the layer axes (nothing written), and the recipe the error
    gives (layer i's state sliced out and merged) reads that layer's params,
    whose reference forward is the stacked layer's own at index i."""
    mha = _stack(lambda r: nnx.MultiHeadAttention(2, SE, decode=False, rngs=r), SL, nnx.Rngs(0))
    layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))
    _open_gates(layer)
    before = jax.tree.map(np.asarray, nnx.state(layer))
    one = dc.init_params(layer.config, seed=5)
    run = {
        "to_canonical": lambda: layer.to_canonical(),
        "arrays": lambda: layer.arrays(),
        "load_canonical": lambda: layer.load_canonical(one),
        "save": lambda: layer.save(tmp_path / "stacked.safetensors"),
    }[call]
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `self`: expected one layer.*query\.kernel has shape \(3, 16, 2, 8\)",
    ):
        run()
    after = jax.tree.map(np.asarray, nnx.state(layer))
    assert jax.tree.all(jax.tree.map(np.array_equal, before, after))
    graphdef, state = nnx.split(layer)
    second = nnx.merge(graphdef, jax.tree.map(lambda a: a[1], state))
    x = np.asarray(jax.random.normal(jax.random.key(2), (2, 5, SE)), dtype=np.float64)
    want = dc.damcha_attention(second.to_canonical(), second.config, x)
    np.testing.assert_allclose(np.asarray(second(jnp.asarray(x, jnp.float32))), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stacked", [False, True], ids=["one-layer", "stacked"])
def test_a_converted_layer_owns_its_arrays_so_donating_its_state_keeps_the_originals(stacked):
    """from_mha copied each Variable with ``Variable.copy``, which shares the array: a jitted
    step that donates the converted layer's state (as training loops do) deleted the
    original MHA's weights too ("Array has been deleted") where a user kept both."""
    if stacked:
        model = StackedLM(nnx.Rngs(0))
        mha = model.blocks.attn
        dj.replace_mha(model, rngs=nnx.Rngs(3))
        layer = model.blocks.attn
    else:
        mha = nnx.MultiHeadAttention(num_heads=2, in_features=E, qkv_features=E, decode=False, rngs=nnx.Rngs(0))
        layer = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))
    names = ("query", "key", "value", "out")
    before = {n: np.asarray(getattr(mha, n).kernel[...]).copy() for n in names}
    step = jax.jit(lambda state: jax.tree.map(lambda a: a + 1, state), donate_argnums=0)
    stepped = jax.block_until_ready(step(nnx.state(layer, nnx.Param)))
    for n in names:  # the original's arrays are alive and unchanged
        np.testing.assert_array_equal(np.asarray(getattr(mha, n).kernel[...]), before[n])
    np.testing.assert_array_equal(np.asarray(stepped[names[0]]["kernel"][...]), before[names[0]] + 1)
