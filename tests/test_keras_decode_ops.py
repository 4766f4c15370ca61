"""The per-step work of DamchaAttention's cache path on TensorFlow (issue 12,
decoding at B=1): counted in the traced graph of a step, never timed.

An eager step (B=1, an int index, as a Python decoding loop calls it) runs no
more eager TensorFlow ops than Keras MHA's step on a KerasHub-style cache, and
reads no variable but the projections' (the map's compiled function reads its
weights itself), counted with TensorFlow's op callbacks.

A step writes the new tokens' mapped keys and values with one slice update of
the whole (B, 2, L, G, d) cache and reads both halves back with one unstack (no
per-half slices, no casts when the dtypes agree); its causal rule over the cache
is one comparison of a cached offset table with a tensor index (int32: no cast),
and no op at all for an index known on the host (an eager loop's int), whose mask
NumPy builds. Every count is checked together with the steps' outputs against
the NumPy reference. The other Keras backends run the cache path in
test_keras_backends.py and test_keras_fastpath.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _tf_ops import eager_op_types

import damcha_core as dc
from damcha_conformance import case_params
from damcha_keras import DamchaAttention

pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="counts TensorFlow graph ops")

B, E, H, D, L = 1, 8, 2, 4, 6


def _layer() -> tuple[DamchaAttention, dict, dc.DamchaConfig]:
    cfg = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D, coupling="tied")
    params = case_params(cfg, 5)  # open gates, non-zero biases
    return DamchaAttention.from_canonical(params, cfg, dtype="float64"), params, cfg


def _step_graph(layer: DamchaAttention, index: object) -> tf.Graph:
    """The graph of one cached step of one token at ``index`` (an int, or a
    tf.TensorSpec for a tensor index)."""
    specs = [tf.TensorSpec((B, 1, E), "float64"), tf.TensorSpec((B, 2, L, H, D), "float64")]
    if isinstance(index, tf.TensorSpec):
        specs.append(index)
        fn = tf.function(lambda t, c, i: layer(t, t, use_causal_mask=True, cache=c, cache_update_index=i))
    else:
        fn = tf.function(lambda t, c: layer(t, t, use_causal_mask=True, cache=c, cache_update_index=index))
    return fn.get_concrete_function(*specs).graph


def _consumers(graph: tf.Graph, op_type: str) -> list[str]:
    """The types of the ops that read the output of the one op of ``op_type``."""
    (op,) = [o for o in graph.get_operations() if o.type == op_type]
    return sorted(c.type for t in op.outputs for c in t.consumers())


def _cache_placeholder(graph: tf.Graph) -> tf.Operation:
    (op,) = [o for o in graph.get_operations() if o.type == "Placeholder" and o.outputs[0].shape.rank == 5]
    return op


@pytest.mark.parametrize("index", ["int", "int32 tensor", "int64 tensor"])
def test_cache_step_writes_with_one_update_and_reads_with_one_unstack(index):
    """One XlaDynamicUpdateSlice reads the cache; its result feeds only one
    Unpack (both halves) and the returned cache: no slice per half, no cast."""
    layer, _, _ = _layer()
    spec = 3 if index == "int" else tf.TensorSpec((), index.split()[0])
    graph = _step_graph(layer, spec)
    assert [c.type for c in _cache_placeholder(graph).outputs[0].consumers()] == ["XlaDynamicUpdateSlice"]
    assert _consumers(graph, "XlaDynamicUpdateSlice") == ["Identity", "Unpack"]
    types = [o.type for o in graph.get_operations()]
    assert types.count("Unpack") == 1 and types.count("XlaDynamicUpdateSlice") == 1, types


@pytest.mark.parametrize(
    ("index", "less_equal", "casts"),
    [("int", 0, 0), ("int32 tensor", 1, 0), ("int64 tensor", 1, 1)],
    ids=["int", "int32-tensor", "int64-tensor"],
)
def test_cache_step_causal_rule_costs_at_most_one_comparison(index, less_equal, casts):
    """The (1, 1, N, L) causal mask of a step: built on the host for an int
    index (no op), one LessEqual against a tensor index (plus one cast when it
    is not int32)."""
    layer, _, _ = _layer()
    spec = 3 if index == "int" else tf.TensorSpec((), index.split()[0])
    graph = _step_graph(layer, spec)
    types = [o.type for o in graph.get_operations()]
    assert types.count("LessEqual") == less_equal, types
    index_casts = [
        o
        for o in graph.get_operations()
        if o.type == "Cast" and o.inputs[0].op.type == "Placeholder" and o.inputs[0].shape.rank == 0
    ]
    assert len(index_casts) == casts, index_casts


@pytest.mark.parametrize("mode", ["eager-int", "eager-tensor", "tf.function-int64"])
def test_counted_cache_steps_equal_the_reference(mode):
    """The steps whose ops are counted above decode token by token to one
    causal pass of the NumPy reference."""
    layer, params, cfg = _layer()
    x = np.random.default_rng(6).normal(size=(B, L, E))
    step = (
        tf.function(lambda t, c, i: layer(t, t, use_causal_mask=True, cache=c, cache_update_index=i))
        if mode.startswith("tf.function")
        else (lambda t, c, i: layer(t, t, use_causal_mask=True, cache=c, cache_update_index=i))
    )
    cache, ys = layer.init_cache(B, L), []
    for i in range(L):
        index = i if mode == "eager-int" else tf.constant(i, "int64" if mode.endswith("int64") else "int32")
        y, cache = step(tf.constant(x[:, i : i + 1]), cache, index)
        ys.append(np.asarray(y))
    np.testing.assert_allclose(
        np.concatenate(ys, axis=1), dc.damcha_attention(params, cfg, x, causal=True), rtol=1e-10, atol=1e-12
    )


def _mha_step(mha: keras.layers.MultiHeadAttention, x, cache, index: int, mask):
    """Keras MHA's decoding step on a KerasHub-style cache (B, 2, L, H, d) (as
    ``keras_hub.layers.CachedMultiHeadAttention`` writes it): the new keys and
    values written with ``slice_update``, MHA's own attention over the whole
    cache with an explicit mask."""
    ops = keras.ops
    q = mha.query_dense(x)
    k = ops.slice_update(cache[:, 0], (0, index, 0, 0), mha.key_dense(x))
    v = ops.slice_update(cache[:, 1], (0, index, 0, 0), mha.value_dense(x))
    out, _ = mha._compute_attention(q, k, v, attention_mask=mask, training=False)
    return mha.output_dense(out), ops.stack([k, v], axis=1)


def test_eager_step_runs_no_more_ops_than_keras_mha_and_reads_only_the_projections():
    """Counted, not timed: an eager decoding step of a converted MHA (gates open)
    runs at most as many eager TensorFlow ops as the MHA's own step on the same
    cache layout, its variable reads are exactly the four projections' kernels
    and biases (the map's three weights are read inside its compiled function;
    before: three eager ReadVariableOps more per step), and the steps equal the
    NumPy reference."""
    mha = keras.layers.MultiHeadAttention(H, D, dtype="float64")
    x = np.random.default_rng(7).normal(size=(B, L, E))
    mha(x[:, :1], x[:, :1])
    layer = DamchaAttention.from_mha(mha)
    params = {k: np.full_like(v, 0.5) if k.endswith(".gate") else v for k, v in layer.to_canonical().items()}
    layer.load_canonical(params)
    cache, mha_cache = layer.init_cache(B, L), tf.zeros((B, 2, L, H, D), "float64")
    ys, counts = [], {}
    for i in range(L):
        t = tf.constant(x[:, i : i + 1])
        mask = tf.constant(np.arange(L)[None, None, :] <= i)
        if i == 3:  # a steady-state step (the map traced at step 0)
            counts["damcha"] = eager_op_types(
                lambda t=t, c=cache, i=i: layer(t, t, use_causal_mask=True, cache=c, cache_update_index=i)
            )
            counts["mha"] = eager_op_types(lambda t=t, c=mha_cache, i=i, m=mask: _mha_step(mha, t, c, i, m))
        y, cache = layer(t, t, use_causal_mask=True, cache=cache, cache_update_index=i)
        _, mha_cache = _mha_step(mha, t, mha_cache, i, mask)
        ys.append(np.asarray(y))
    ours, theirs = counts["damcha"], counts["mha"]
    assert ours.count("ReadVariableOp") == theirs.count("ReadVariableOp") == 8, (ours, theirs)
    assert len(ours) <= len(theirs), (ours, theirs)
    np.testing.assert_allclose(
        np.concatenate(ys, axis=1),
        dc.damcha_attention(params, layer.config, x, causal=True),
        rtol=1e-10,
        atol=1e-12,
    )
