"""``damcha_jax.replace_mha``: every ``nnx.MultiHeadAttention`` of a Flax NNX
model swapped for ``DamchaAttention.from_mha`` in one call, wherever NNX holds
modules, shared layers kept shared, atomic on refusal."""

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


def test_stacked_layers_and_missing_dropout_streams_are_refused_by_name():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(2, E, qkv_features=E, decode=False, dropout_rate=0.1, rngs=rngs)

    class Stacked(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(r):
                return Block(r)

            self.blocks = make(rngs)

    stacked = Stacked(nnx.Rngs(0))
    # Was a raw ValueError from the kernel copy ("Cannot broadcast to shape with fewer dimensions").
    with pytest.raises(
        dc.DamchaValueError,
        match=r"`mha`: expected an nnx.MultiHeadAttention of one layer.*nnx.vmap or nnx.scan.*"
        r"Received: mha.query.kernel.shape=\(3, 8, 2, 4\) \(at model.blocks.attn\)$",
    ):
        dj.replace_mha(stacked, rngs=nnx.Rngs(1))
    assert isinstance(stacked.blocks.attn, nnx.MultiHeadAttention)
    # Was a raw AttributeError ("No RngStream named 'dropout'"), naming no layer.
    with pytest.raises(dc.DamchaValueError, match=r"`rngs`: expected an nnx.Rngs with a 'dropout'.*\(at model.attn\)$"):
        dj.replace_mha(Block(nnx.Rngs(0)), rngs=nnx.Rngs(params=1))
    assert isinstance(dj.replace_mha(Block(nnx.Rngs(0)), rngs=nnx.Rngs(params=1, dropout=2)).attn, dj.DamchaAttention)
