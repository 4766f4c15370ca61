"""The fused kernel's fast paths of DamchaAttention for the masks Keras users pass
(issue 12), on every Keras backend.

``use_causal_mask=True`` reaches ``keras.ops.dot_product_attention`` with
``is_causal=True`` and no mask; padding (``query_mask``/``value_mask``/
``key_mask``, filled by Keras from ``Embedding(mask_zero=True)``, or an
``attention_mask`` whose query dim is 1) reaches it as a (B, 1, 1, M) key mask,
never as an N x M mask; an ``attention_mask`` whose values are known on the
host (NumPy, an eager CPU tensor) and are exactly causal and/or padding
(``ops.tril(ops.ones((N, N)))``, KerasHub's causal-and-padding masks) reaches
it the same way; a decoding step's causal rule over the cache is one
(1, 1, N, L) comparison. Any other mask (an almost-causal one, a random one, a
traced one) goes to the kernel as given.

This file runs on the current backend (tensorflow unless KERAS_BACKEND says
otherwise) and, from ``test_other_keras_backends``, on jax and torch in their
Keras processes (tests/_keras_processes.py). TensorFlow's kernel keeps float64, so there every case runs in
float64 against the NumPy reference and the explicit path
(``return_attention_scores=True``: einsum and softmax), outputs and gradients
(inputs and every weight); jax and torch run float32 with the conformance
tolerance (their fused kernels compute in float32), gradients on torch. The
kernel's arguments are recorded by wrapping ``keras.ops.dot_product_attention``;
on TensorFlow the traced graphs' N x M-sized ops are counted against Keras
MHA's for the same call (``tf_graph`` tests).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _aten import top_level_aten_ops
from _keras_processes import part_results
from _tf_ops import eager_op_types

import damcha_core as dc
from damcha_conformance import TOLERANCES, case_params
from damcha_keras import DamchaAttention

BACKEND = keras.backend.backend()
DTYPE = "float64" if BACKEND == "tensorflow" else "float32"
TOL = TOLERANCES[DTYPE]
B, N, M, E, H, D = 3, 6, 4, 8, 2, 4


def _opened_from_mha(x, heads: int, key_dim: int):
    """A built Keras MHA and the DamchaAttention converted from it, every gate opened to 0.5."""
    mha = keras.layers.MultiHeadAttention(heads, key_dim)
    mha(x, x)
    layer = DamchaAttention.from_mha(mha)
    layer.load_canonical(
        {k: np.full_like(v, 0.5) if k.endswith(".gate") else v for k, v in layer.to_canonical().items()}
    )
    return mha, layer


def np_(x):
    return np.asarray(keras.ops.convert_to_numpy(x), dtype=np.float64)


def rng(seed=0):
    return np.random.default_rng(seed)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records (is_causal, mask shape or None) of every keras.ops.dot_product_attention
    call, on torch of every direct SDPA call (``F._torch_attention``: every call
    without ``flash_attention=True`` skips Keras's wrapper there) and on TensorFlow of every call of
    its own composition (``F._tf_attention``, float32/float64)."""
    calls = []
    real = keras.ops.dot_product_attention

    def spy(*args, **kwargs):
        mask = kwargs.get("mask")
        calls.append((bool(kwargs.get("is_causal")), None if mask is None else tuple(mask.shape)))
        return real(*args, **kwargs)

    monkeypatch.setattr(keras.ops, "dot_product_attention", spy)
    if BACKEND == "torch":
        # Every call without flash_attention=True runs torch's SDPA directly (F._torch_attention).
        import damcha_keras._functional as F

        real_torch = F._torch_attention

        def torch_spy(q, k, v, *, scale, is_causal, mask=None):
            calls.append((bool(is_causal), None if mask is None else tuple(mask.shape)))
            return real_torch(q, k, v, scale=scale, is_causal=is_causal, mask=mask)

        monkeypatch.setattr(F, "_torch_attention", torch_spy)
    if BACKEND == "tensorflow":
        import damcha_keras._functional as F

        real_tf = F._tf_attention

        def tf_spy(q, k, v, *, scale, mask, is_causal):
            calls.append((bool(is_causal), None if mask is None else tuple(mask.shape)))
            return real_tf(q, k, v, scale=scale, mask=mask, is_causal=is_causal)

        monkeypatch.setattr(F, "_tf_attention", tf_spy)
    if BACKEND == "jax":
        # An eager call runs the kernel inside one compiled function (F._jax_fused_attention),
        # traced once per shape: record each call of it, with the kernel's own arguments;
        # the spy above sees the traced calls (jit, grad).
        import damcha_keras._functional as F

        real_factory = F._jax_fused_attention

        def factory(kernel):
            compiled = real_factory(real)

            def call(q, k, v, mask, keep, scale, is_causal, flash):
                calls.append((bool(is_causal), None if mask is None else tuple(mask.shape)))
                return compiled(q, k, v, mask, keep, scale, is_causal, flash)

            return call

        monkeypatch.setattr(F, "_jax_fused_attention", factory)
    return calls


def _padding(lengths, total, left=False):
    """(B, total) bool: True on the first (or, left=True, last) lengths[b] tokens."""
    pos = np.arange(total)[None, :]
    lengths = np.asarray(lengths)[:, None]
    return pos >= total - lengths if left else pos < lengths


def _tril(n, m):
    return np.tril(np.ones((n, m), bool))


# name -> (cross, call kwargs builder, reference mask builder, causal, expected kernel call)
# Kernel call: ("causal", mask rank) or ("mask", None); "key" means a (B|1, H|1, 1, M) mask.
def _case(name):
    r = rng(11)
    pad_q = _padding([N, N - 2, 3], N)
    pad_left = _padding([N, 2, 4], N, left=True)  # batch 1: rows 0..3 see no key under causality
    pad_k = _padding([M, M - 1, 2], M)
    am_full = r.random((B, N, N)) < 0.7
    am_full[:, :, 0] = True
    am_empty_row = am_full.copy()
    am_empty_row[1, 2] = False  # query 2 of batch 1 sees no key: its output is the bias
    cases = {
        "causal": (False, dict(use_causal_mask=True), None, True, ("causal", None)),
        "causal+padding": (
            False,
            dict(use_causal_mask=True, query_mask=pad_q, value_mask=pad_q),
            pad_q[:, None, None, :] & pad_q[:, None, :, None],
            True,
            ("causal", "key"),
        ),
        "causal+left-padding": (
            False,
            dict(use_causal_mask=True, query_mask=pad_left, value_mask=pad_left),
            pad_left[:, None, None, :] & pad_left[:, None, :, None],
            True,
            ("causal", "key"),
        ),
        "key-padding": (False, dict(value_mask=pad_q), pad_q[:, None, None, :], False, ("plain", "key")),
        "query+key-padding": (
            False,
            dict(query_mask=pad_q, value_mask=pad_q),
            pad_q[:, None, None, :] & pad_q[:, None, :, None],
            False,
            ("plain", "key"),
        ),
        "value+key-masks-differ": (
            False,
            dict(value_mask=pad_q, key_mask=pad_left),
            (pad_q & pad_left)[:, None, None, :],
            False,
            ("plain", "key"),
        ),
        "attention_mask-key-side": (
            False,
            dict(attention_mask=pad_q[:, None, :]),
            pad_q[:, None, None, :],
            False,
            ("plain", "key"),
        ),
        "causal+attention_mask-key-side": (
            False,
            dict(use_causal_mask=True, attention_mask=pad_left[:, None, :]),
            pad_left[:, None, None, :],
            True,
            ("causal", "key"),
        ),
        "causal+attention_mask-full": (
            False,
            dict(use_causal_mask=True, attention_mask=am_full),
            am_full[:, None],
            True,
            ("causal", "full"),
        ),
        "explicit-causal-bool": (False, dict(attention_mask=_tril(N, N)), None, True, ("causal", None)),
        "explicit-causal-float": (
            False,
            dict(attention_mask=_tril(N, N).astype("float64")),
            None,
            True,
            ("causal", None),
        ),
        # KerasHub's decoders pass causal & padding as one (B, N, N) attention mask.
        "explicit-causal-and-left-padding": (
            False,
            dict(attention_mask=_tril(N, N) & pad_left[:, None, :]),
            _tril(N, N) & pad_left[:, None, None, :],
            True,
            ("causal", "key"),
        ),
        "explicit-query-and-key-padding": (
            False,
            dict(attention_mask=pad_q[:, :, None] & pad_q[:, None, :]),
            pad_q[:, None, :, None] & pad_q[:, None, None, :],
            False,
            ("plain", "key"),
        ),
        "explicit-causal+use_causal_mask": (
            False,
            dict(attention_mask=_tril(N, N), use_causal_mask=True),
            None,
            True,
            ("causal", None),
        ),
        "almost-causal": (
            False,
            dict(attention_mask=_tril(N, N) & ~np.eye(N, k=-1, dtype=bool)),
            (_tril(N, N) & ~np.eye(N, k=-1, dtype=bool))[None, None],
            False,
            ("plain", "full"),
        ),
        "general-mask-with-an-empty-row": (
            False,
            dict(attention_mask=am_empty_row),
            am_empty_row[:, None],
            False,
            ("plain", "full"),
        ),
        "cross+key-padding": (True, dict(value_mask=pad_k), pad_k[:, None, None, :], False, ("plain", "key")),
        "cross+query+key-padding": (
            True,
            dict(query_mask=pad_q, value_mask=pad_k),
            pad_k[:, None, None, :] & pad_q[:, None, :, None],
            False,
            ("plain", "key"),
        ),
        "cross+rectangular-mask": (
            True,
            dict(attention_mask=am_full[:, :, :M]),
            am_full[:, None, :, :M],
            False,
            ("plain", "full"),
        ),
        "cross+rectangular-causal": (
            True,
            dict(use_causal_mask=True, value_mask=pad_k),
            pad_k[:, None, None, :],
            True,
            ("plain", "full"),
        ),
    }
    return cases[name]


CASES = [
    "causal",
    "causal+padding",
    "causal+left-padding",
    "key-padding",
    "query+key-padding",
    "value+key-masks-differ",
    "attention_mask-key-side",
    "causal+attention_mask-key-side",
    "causal+attention_mask-full",
    "explicit-causal-bool",
    "explicit-causal-float",
    "explicit-causal-and-left-padding",
    "explicit-query-and-key-padding",
    "explicit-causal+use_causal_mask",
    "almost-causal",
    "general-mask-with-an-empty-row",
    "cross+key-padding",
    "cross+query+key-padding",
    "cross+rectangular-mask",
    "cross+rectangular-causal",
]


def _layer(cross, seed=3):
    cfg = dc.DamchaConfig(
        query_dim=E,
        context_dim=E if not cross else E + 2,
        num_heads=H,
        key_dim=D,
        output_dim=5,
        coupling="separate" if cross else "tied",
    )
    params = case_params(cfg, seed)  # open gates, non-zero biases
    return DamchaAttention.from_canonical(params, cfg, dtype=DTYPE), params, cfg


def _close(actual, expected, what=""):
    """Equal within float64 rounding, or within the conformance tolerance in float32."""
    if DTYPE == "float64":
        np.testing.assert_allclose(actual, expected, rtol=1e-10, atol=1e-12, err_msg=what)
    else:
        err, ratio = TOL.output_ratio(actual, expected)
        assert ratio <= 1.0, (what, err, ratio)


def _grads_close(actual, expected, what=""):
    assert np.isfinite(actual).all(), what
    if DTYPE == "float64":
        np.testing.assert_allclose(actual, expected, rtol=1e-9, atol=1e-11, err_msg=what)
    else:
        rms = np.sqrt(np.mean(expected**2))
        np.testing.assert_array_less(
            np.abs(actual - expected), TOL.grad_atol + TOL.grad_rtol * rms + 1e-30, err_msg=what
        )


def _grads(layer, x, c, kwargs, weights):
    """Outputs, and the gradients of sum(out * weights) for the query, the
    value and every trainable weight (None on jax: outputs only)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        xs = tf.constant(x, dtype=DTYPE)
        cs = xs if c is x else tf.constant(c, dtype=DTYPE)  # self-attention: one tensor, as users call it
        with tf.GradientTape() as tape:
            tape.watch([xs, cs])
            out = layer(xs, cs, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            loss = tf.reduce_sum(out * tf.constant(weights, dtype=DTYPE))
        grads = tape.gradient(loss, [xs, cs] + layer.trainable_variables)
        return np_(out), [np_(g) for g in grads]
    if BACKEND == "torch":
        import torch

        xs = torch.tensor(x.astype(DTYPE), requires_grad=True)
        cs = xs if c is x else torch.tensor(c.astype(DTYPE), requires_grad=True)
        out = layer(xs, cs, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        loss = (out * torch.tensor(weights.astype(DTYPE))).sum()
        grads = torch.autograd.grad(loss, [xs, cs] + [v.value for v in layer.trainable_variables])
        return np_(out.detach()), [g.detach().numpy().astype(np.float64) for g in grads]
    out = layer(x.astype(DTYPE), c.astype(DTYPE), **kwargs)
    return np_(out[0] if isinstance(out, tuple) else out), None


@pytest.mark.parametrize("name", CASES)
def test_fast_path_equals_reference_and_explicit_path(name, kernel_calls):
    """Outputs equal the reference (rows that see no key give the output bias),
    and outputs and gradients equal the explicit path's, in float64; the
    kernel gets is_causal and at most a key mask wherever the masks allow."""
    cross, kwargs, ref_mask, causal, (mode, mask_kind) = _case(name)
    layer, params, cfg = _layer(cross)
    r = rng(5)
    x = r.normal(size=(B, N, E))
    c = r.normal(size=(B, M, E + 2)) if cross else x
    weights = r.normal(size=(B, N, 5))
    ref_mask = kwargs.get("attention_mask") if ref_mask is None else ref_mask
    ref_mask = None if ref_mask is None else np.asarray(ref_mask, bool)
    if ref_mask is not None and ref_mask.ndim == 3:
        ref_mask = ref_mask[:, None]
    y_ref = dc.damcha_attention(params, cfg, x, c if cross else None, mask=ref_mask, causal=causal)

    kernel_calls.clear()
    y_fast, g_fast = _grads(layer, x, c, kwargs, weights)
    assert len(kernel_calls) == 1, kernel_calls
    is_causal, shape = kernel_calls[0]
    assert is_causal == (mode == "causal"), kernel_calls
    if mask_kind is None:
        assert shape is None, kernel_calls
    elif mask_kind == "key":
        assert shape is not None and shape[-2] == 1, kernel_calls  # never N x M
    else:
        assert shape is not None and shape[-2:] == (N, c.shape[1]), kernel_calls
    _close(y_fast, y_ref, "fast path vs reference")

    y_explicit, g_explicit = _grads(layer, x, c, dict(kwargs, return_attention_scores=True), weights)
    _close(y_explicit, y_ref, "explicit path vs reference")
    if g_fast is not None:
        for a, b, var in zip(g_fast, g_explicit, ["query", "value"] + [v.path for v in layer.trainable_variables]):
            _grads_close(a, b, var)
    if name in ("causal+left-padding", "general-mask-with-an-empty-row"):  # the cases really have rows that see nothing
        seen = (ref_mask & (_tril(N, N) if causal else True)).any(-1)[:, 0]
        assert not seen.all()
        _close(y_fast[~seen], np.broadcast_to(params["output.bias"], y_fast[~seen].shape), "rows that see nothing")


def test_explicit_causal_mask_takes_the_causal_kernel(kernel_calls):
    """The ops.tril(ops.ones) idiom (float, as Keras users write it, or cast to
    bool) reaches the kernel as is_causal with no mask and gives
    use_causal_mask's answer, which is the reference's."""
    layer, params, cfg = _layer(cross=False)
    x = rng(6).normal(size=(B, N, E)).astype(DTYPE)
    want = dc.damcha_attention(params, cfg, x, causal=True)
    _close(np_(layer(x, x, use_causal_mask=True)), want, "use_causal_mask")
    tril = keras.ops.tril(keras.ops.ones((N, N), dtype=DTYPE))
    signed_zeros = np.where(_tril(N, N), 1.0, -0.0).astype(DTYPE)  # -0.0 is 0: still the causal mask
    for mask in (tril, keras.ops.cast(tril, "bool"), signed_zeros):
        kernel_calls.clear()
        _close(np_(layer(x, x, attention_mask=mask)), want, "attention_mask")
        assert kernel_calls == [(True, None)], kernel_calls


def test_embedding_padding_propagates_to_the_key_mask_path(kernel_calls):
    """Embedding(mask_zero=True) fills query/value/key masks (Keras masking): the
    kernel sees a (B, 1, 1, M) key mask and is_causal, and the output equals the
    reference with those masks."""
    keras.utils.set_random_seed(3)
    emb = keras.layers.Embedding(11, E, mask_zero=True, dtype=DTYPE)
    layer, params, cfg = _layer(cross=False)
    ids = np.array([[3, 4, 5, 6, 7, 8], [1, 2, 3, 0, 0, 0], [0, 0, 5, 6, 7, 1]], "int32")
    h = emb(ids)
    kernel_calls.clear()
    y = np_(layer(h, h, use_causal_mask=True))
    assert kernel_calls == [(True, (B, 1, 1, N))]
    pad = ids != 0
    want = dc.damcha_attention(params, cfg, np_(h), mask=pad[:, None, None, :] & pad[:, None, :, None], causal=True)
    _close(y, want, "embedding padding + causal")


@pytest.mark.parametrize("chunks", [(1,) * 5, (2, 3)], ids=["token-by-token", "chunked"])
def test_cache_decode_fast_path_equals_explicit_and_reference(chunks, kernel_calls):
    """A decoding step compares a cached (1, 1, N, L) offset table with the index:
    one small mask, equal to the explicit path and to one causal pass."""
    layer, params, cfg = _layer(cross=False)
    x = rng(7).normal(size=(B, sum(chunks), E))
    L = sum(chunks) + 2
    outs = {"fast": [], "explicit": []}
    for path in outs:
        cache, pos = layer.init_cache(B, L), 0
        for n in chunks:
            t = x[:, pos : pos + n].astype(DTYPE)
            kernel_calls.clear()
            result = layer(
                t,
                t,
                use_causal_mask=True,
                cache=cache,
                cache_update_index=pos,
                return_attention_scores=path == "explicit",
            )
            y, cache = result[0], result[-1]
            if path == "fast":
                assert kernel_calls == [(False, (1, 1, n, L))], kernel_calls
            outs[path].append(np_(y))
            pos += n
    full = dc.damcha_attention(params, cfg, x, causal=True)
    for path, ys in outs.items():
        _close(np.concatenate(ys, axis=1), full, path)


# The function that maps a tied self-attention's queries and keys, by backend (jax: with
# at least as many tokens as features).
MAPS_PAIR = {"tensorflow": "map_heads_pair", "jax": "packed_self_heads", "torch": "map_matrix"}


def test_eager_decode_maps_with_one_compiled_call_per_step(monkeypatch):
    """Counted, not timed: an eager decoding step maps its queries and keys with
    one call of a compiled function (tf.function / jax.jit; torch runs the ops),
    traced once for every step of one shape, and writes the cache with one
    slice update; the steps equal one causal pass."""
    import damcha_keras._functional as F

    runs = []
    # The compiled function (a new one: compiled once per function) or, on torch, the
    # matrix: one per step whether the pair is mapped by map_heads_pair or, recording
    # gradients, with q~ kept as a recipe (F.saved_as_recipes). A step's few tokens keep
    # the projections apart on jax too (F.packed_self_heads needs B*T >= E).
    name = "map_matrix" if BACKEND == "torch" else "map_heads_pair"
    real = getattr(F, name)

    def counted(*args):
        runs.append(1)
        return real(*args)

    monkeypatch.setattr(F, name, counted)
    updates = []
    real_update = keras.ops.slice_update
    monkeypatch.setattr(keras.ops, "slice_update", lambda *a: updates.append(a[0].shape) or real_update(*a))
    layer, params, cfg = _layer(cross=False)
    x = rng(10).normal(size=(B, 4, E)).astype(DTYPE)
    cache, ys = layer.init_cache(B, 4), []
    for i in range(4):
        t = keras.ops.convert_to_tensor(x[:, i : i + 1])  # one tensor for query and value, as users call it
        y, cache = layer(t, t, use_causal_mask=True, cache=cache, cache_update_index=i)
        ys.append(np_(y))
    # The Python body runs once per trace (compiled backends) or once per step (torch).
    assert len(runs) == (4 if BACKEND == "torch" else 1), runs
    assert updates == [(B, 2, 4, H, D)] * 4, updates
    _close(np.concatenate(ys, axis=1), dc.damcha_attention(params, cfg, x.astype(np.float64), causal=True))


def test_eager_calls_of_growing_length_do_not_trace_the_map_per_length(monkeypatch):
    """Eager self-attention calls of lengths 3..6 (generation without a cache):
    TensorFlow traces the compiled map at most twice (then any length), JAX
    once per length, torch runs it per call; every output equals the reference."""
    import damcha_keras._functional as F

    runs = []
    name = MAPS_PAIR[BACKEND]  # as in the decoding test above
    real = getattr(F, name)
    monkeypatch.setattr(F, name, lambda *a: runs.append(1) or real(*a))
    layer, params, cfg = _layer(cross=False)
    x = rng(12).normal(size=(B, 6, E)).astype(DTYPE)
    for n in range(3, 7):
        t = keras.ops.convert_to_tensor(x[:, :n])
        _close(np_(layer(t, t, use_causal_mask=True)), dc.damcha_attention(params, cfg, x[:, :n], causal=True), n)
    assert len(runs) <= 2 if BACKEND == "tensorflow" else len(runs) == 4, runs


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_other_keras_backends_take_the_same_fast_paths(backend, tmp_path_factory, request):
    """Every test of this file that is not TensorFlow-specific, run on the jax
    and torch backends (Keras fixes its backend per process: pytest runs this
    file in that backend's Keras process, tests/_keras_processes.py, part
    ``fastpath``); each must pass, none may be skipped."""
    if BACKEND != "tensorflow":
        pytest.skip("launched from the tensorflow run only")
    r = part_results(backend, "fastpath", tmp_path_factory, request)
    failed = {t: e["message"] for t, e in r["tests"].items() if e["outcome"] == "failed"}
    assert not failed, "\n\n".join(f"{backend}: {t} failed:\n{m}" for t, m in failed.items())
    assert r["exit_status"] == 0, r
    outcomes = sorted(e["outcome"] for e in r["tests"].values())
    # The cases + 6 other tests (+ the aten counts on torch, the compiled programs on jax).
    want = len(CASES) + 6 + {"torch": TORCH_ATEN_TESTS, "jax": JAX_HLO_TESTS}[backend]
    assert outcomes == ["passed"] * want, (want, r["tests"])
    assert r["deselected"] > 0, r  # the TensorFlow-only tests exist and were left out


# ------------------------------------------------------------- op counts


_BOOKKEEPING = ("Const", "Placeholder", "ReadVariableOp", "Identity", "NoOp")


def _graph_ops(fn):
    """The compute ops that ``fn``'s traced graph runs to make its outputs
    (those the outputs depend on, as TensorFlow prunes the rest; constants,
    variable reads and placeholders left out)."""
    import tensorflow as tf

    concrete = tf.function(fn).get_concrete_function()
    seen, todo = set(), [t.op for t in concrete.outputs]
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return [op for op in concrete.graph.get_operations() if op.name in seen and op.type not in _BOOKKEEPING]


def _nm_ops(ops, n, m):
    """Ops with an output holding at least n * m elements per (batch, head): the attention-sized work."""
    count = 0
    for op in ops:
        for t in op.outputs:
            shape = t.shape
            if shape.rank is not None and shape.rank >= 2 and shape[-1] == m and shape[-2] == n:
                count += 1
                break
    return count


def _logit_op_types(graph_ops, shape):
    """The sorted types of the ops with an output of exactly ``shape`` (the logits' (B, H, N, M))."""
    return sorted(op.type for op in graph_ops if any(tuple(t.shape) == shape for t in op.outputs if t.shape.rank))


TF_ONLY = pytest.mark.skipif(BACKEND != "tensorflow", reason="counts TensorFlow graph ops")


@TF_ONLY
def test_tf_graph_traced_explicit_mask_goes_to_the_kernel_as_given(kernel_calls):
    """Under tf.function a mask's values are unknown: a causal attention_mask
    reaches the kernel as the full mask it is (never guessed), with the
    reference's answer."""
    import tensorflow as tf

    layer, params, cfg = _layer(cross=False)
    x = rng(9).normal(size=(B, N, E))
    y = tf.function(lambda t, m: layer(t, t, attention_mask=m))(tf.constant(x), tf.constant(_tril(N, N)))
    assert kernel_calls == [(False, (1, 1, N, N))], kernel_calls
    _close(np_(y), dc.damcha_attention(params, cfg, x, causal=True))


@TF_ONLY
@pytest.mark.parametrize("case", ["use_causal_mask", "causal+padding", "padding", "explicit-causal"])
def test_tf_graph_has_no_more_n_by_m_work_than_mha(case):
    """Op counts, not timings: the TensorFlow graph of a DAMCHA call holds no
    more N x M-sized ops than Keras MHA's for the same call (the causal case:
    exactly the kernel's own), and its total op count stays within a fixed
    margin of MHA's (the cross-head map adds a fixed number of small ops)."""
    import tensorflow as tf

    n = 16
    x = tf.constant(rng(8).normal(size=(2, n, E)).astype("float32"))
    pad = tf.constant(_padding([n, n - 5], n))
    kwargs = {
        "use_causal_mask": dict(use_causal_mask=True),
        "causal+padding": dict(use_causal_mask=True, query_mask=pad, value_mask=pad),
        "padding": dict(query_mask=pad, value_mask=pad),
        # A NumPy mask is a constant of the graph: its values are known when tracing.
        "explicit-causal": dict(attention_mask=np.tril(np.ones((n, n), "float32"))),
    }[case]
    mha = keras.layers.MultiHeadAttention(H, D)
    mha(x, x)
    layer = DamchaAttention.from_mha(mha)
    ours = _graph_ops(lambda: layer(x, x, **kwargs))
    # An explicit causal mask runs MHA's causal path: compare with MHA's best for it.
    theirs = _graph_ops(lambda: mha(x, x, **(dict(use_causal_mask=True) if case == "explicit-causal" else kwargs)))
    ours_nm, theirs_nm = _nm_ops(ours, n, n), _nm_ops(theirs, n, n)
    assert ours_nm <= theirs_nm - 3, (ours_nm, theirs_nm)
    # Over the (B, H, N, M) logits: the product, the fill of hidden logits and the
    # softmax, nothing else (``F._tf_attention``). Keras's kernel, which MHA runs (and
    # DAMCHA did before), adds the scale product, a ones_like and an AND at that size.
    logits = (2, H, n, n)
    assert _logit_op_types(ours, logits) == ["Einsum", "SelectV2", "Softmax"], _logit_op_types(ours, logits)
    assert _logit_op_types(theirs, logits) == ["Einsum", "Fill", "LogicalAnd", "Mul", "SelectV2", "Softmax"]
    if case in ("use_causal_mask", "explicit-causal"):
        assert any(op.type == "MatrixBandPart" for op in ours)  # the kernel's is_causal rule, at (N, N)
    # Keras MHA's graph for these calls has 25-29 compute ops. DAMCHA adds 17 for the
    # map (on the weights: the gate, sqrt(E), the bias and the identity folded into
    # (E, S, S) weights and an (S, S) offset, 5 tiny ops; the tokens' statistic: 4;
    # the generator product: 3; its scale and offset: 3; two head mixes) and up to
    # 10 for the key mask and the zeroing of rows that see no key (before issue 12:
    # +30 to +40, the generator run twice, gates on the heads).
    assert len(ours) <= len(theirs) + 27, (len(ours), len(theirs))


@TF_ONLY
@pytest.mark.parametrize("case", ["use_causal_mask", "mask-float"])
def test_tf_graph_training_step_ops_within_margin_of_mha(case):
    """Op counts, not timings: the TensorFlow graph of a training step (forward,
    loss, gradients of every trainable weight) of a DAMCHA call has at most 41
    compute ops more than Keras MHA's for ``use_causal_mask=True`` (127 vs 86 at
    this commit: the map's 17 ops and their gradients; the weights' share of
    them folds the gate, sqrt(E), the bias and the identity; before the layer's
    own TensorFlow kernel 130). Of them, 4 fewer than MHA's are the size of the
    (B, H, N, M) logits (8 vs 12: no scale product and its gradient, no
    ones_like, no AND). A causal mask made in the traced call
    (``ops.tril(ops.ones)``, as in a compiled ``fit``) runs exactly the ops of
    ``use_causal_mask=True`` (before issue 12's mask reading: 12 more); every
    gradient is finite."""
    import tensorflow as tf

    x = tf.constant(rng(21).normal(size=(2, 16, E)).astype("float32"))
    mha = keras.layers.MultiHeadAttention(H, D)
    mha(x, x)
    layer = DamchaAttention.from_mha(mha)

    def call(attn, how):
        if how == "use_causal_mask":
            return attn(x, x, use_causal_mask=True)
        return attn(x, x, attention_mask=keras.ops.tril(keras.ops.ones((16, 16))))

    def step(attn, how):
        def run():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(call(attn, how)))
            return tape.gradient(loss, attn.trainable_variables)

        return run

    ours, theirs = _graph_ops(step(layer, case)), _graph_ops(step(mha, "use_causal_mask"))
    assert len(ours) <= len(theirs) + 41, (len(ours), len(theirs))
    logits = (2, H, 16, 16)
    assert len(_logit_op_types(ours, logits)) == len(_logit_op_types(theirs, logits)) - 4, (
        _logit_op_types(ours, logits),
        _logit_op_types(theirs, logits),
    )
    if case == "mask-float":
        causal = _graph_ops(step(layer, "use_causal_mask"))
        assert sorted(op.type for op in ours) == sorted(op.type for op in causal)
    grads = tf.function(step(layer, case))()
    assert len(grads) == len(layer.trainable_variables)
    assert all(g is not None and np.isfinite(np_(g)).all() for g in grads)


@TF_ONLY
def test_tf_graph_map_passes_over_the_tokens_once():
    """Op sizes, not timings: phi(t) is never formed. In the TensorFlow graph of a
    tied self-attention call, exactly one op more than in Keras MHA's has an output
    larger than the heads: the square of the tokens (B, N, E) under the RMS
    statistic (the generator's product reads the raw tokens); every other op it adds
    is no larger than the heads (B, N, H, d) (before: phi was a second pass). The
    attention's own ops at the logits' size are left out (the layer's TensorFlow
    kernel has fewer of them than MHA's; ``test_tf_graph_has_no_more_n_by_m_work_than_mha``)."""
    import tensorflow as tf

    b, n, e, h, d = 2, 16, 24, 2, 4  # tokens, heads and logits of distinct sizes
    x = tf.constant(rng(13).normal(size=(b, n, e)).astype("float32"))
    mha, layer = _opened_from_mha(x, h, d)
    ours = _graph_ops(lambda: layer(x, x, use_causal_mask=True))
    theirs = _graph_ops(lambda: mha(x, x, use_causal_mask=True))

    def larger_than_heads(graph_ops):
        return sorted(
            op.type
            for op in graph_ops
            if any(t.shape.num_elements() > b * n * h * d and tuple(t.shape) != (b, h, n, n) for t in op.outputs)
        )

    assert larger_than_heads(ours) == sorted(larger_than_heads(theirs) + ["Square"]), larger_than_heads(ours)
    np.testing.assert_allclose(
        np_(layer(x, x, use_causal_mask=True)),
        dc.damcha_attention(
            {k: v.astype(np.float64) for k, v in layer.to_canonical().items()},
            layer.config,
            np_(x),
            causal=True,
        ),
        rtol=1e-4,
        atol=1e-5,
    )


@TF_ONLY
@pytest.mark.parametrize("dtype", ["float", "bool"])
def test_tf_eager_causal_attention_mask_costs_no_op(dtype, kernel_calls):
    """Counted, not timed: an eager ``attention_mask=ops.tril(ops.ones((N, N)))``
    (float or cast to bool) is read on the host and never converted or expanded
    into a 4-D tensor, so the call runs exactly the eager ops of
    ``use_causal_mask=True`` (before: a conversion and two expand_dims more)."""
    import tensorflow as tf

    layer, params, cfg = _layer(cross=False)
    x = tf.constant(rng(14).normal(size=(B, N, E)))
    mask = keras.ops.tril(keras.ops.ones((N, N), dtype=DTYPE))
    mask = mask if dtype == "float" else keras.ops.cast(mask, "bool")
    for _ in range(2):  # traces and first-call work out of the way
        layer(x, x, attention_mask=mask), layer(x, x, use_causal_mask=True)
    kernel_calls.clear()
    masked = eager_op_types(lambda: layer(x, x, attention_mask=mask))
    causal = eager_op_types(lambda: layer(x, x, use_causal_mask=True))
    assert kernel_calls == [(True, None)] * 2, kernel_calls
    assert masked == causal, (masked, causal)
    _close(np_(layer(x, x, attention_mask=mask)), dc.damcha_attention(params, cfg, np_(x), causal=True))


@TF_ONLY
@pytest.mark.parametrize("dtype", ["float", "bool"])
def test_tf_eager_general_mask_costs_no_op_beyond_mha(dtype):
    """Counted, not timed: an eager ``attention_mask`` of no causal/padding form
    (values on the host, every row sees a key) reaches the kernel as it is. The
    eager ops a DAMCHA call with it runs beyond its ``use_causal_mask=True`` call
    are among those Keras MHA's runs beyond its own (the mask's expand_dims, the
    kernel's mask handling), no more: no zeroing of empty rows (before: an any,
    a transpose, a cast and a product per call), no second mask. The causal call
    itself runs at least 8 eager ops fewer than MHA's (the layer's TensorFlow
    kernel; before it: 2 more than MHA's)."""
    import collections

    import tensorflow as tf

    x = tf.constant(rng(16).normal(size=(B, N, E)).astype(DTYPE))
    mha = keras.layers.MultiHeadAttention(H, D, dtype=DTYPE)
    mha(x, x)
    layer = DamchaAttention.from_mha(mha)
    mask = rng(17).random((N, N)) < 0.6
    mask[:, 0] = True
    mask = tf.constant(mask if dtype == "bool" else mask.astype(DTYPE))
    deltas, totals = {}, {}
    for name, attn in (("damcha", layer), ("mha", mha)):
        for _ in range(2):
            attn(x, x, attention_mask=mask), attn(x, x, use_causal_mask=True)
        masked = collections.Counter(eager_op_types(lambda a=attn: a(x, x, attention_mask=mask)))
        causal = collections.Counter(eager_op_types(lambda a=attn: a(x, x, use_causal_mask=True)))
        deltas[name] = (masked - causal, causal - masked)
        totals[name] = causal.total()
    (ours_more, ours_fewer), (theirs_more, _) = deltas["damcha"], deltas["mha"]
    # The layer's TensorFlow kernel: an eager causal call runs 10 ops fewer than
    # before and than MHA's (no scale product, ones_like, ANDs or per-call triangle).
    assert totals["damcha"] <= totals["mha"] - 8, totals
    assert not ours_more - theirs_more, deltas
    # The causal call runs no op the masked one lacks: the triangle is made once per
    # length (MHA's kernel builds it per call: a fill, its band and slicing).
    assert not ours_fewer, deltas
    want = dc.damcha_attention(
        {k: v.astype(np.float64) for k, v in layer.to_canonical().items()},
        layer.config,
        np_(x),
        mask=np.asarray(mask, bool),
    )
    _close(np_(layer(x, x, attention_mask=mask)), want)


@TF_ONLY
@pytest.mark.parametrize("dtype", ["float", "bool"])
def test_tf_graph_causal_mask_made_in_the_traced_call_takes_the_causal_kernel(dtype, kernel_calls):
    """``ops.tril(ops.ones((N, N)))`` made inside a traced call (a layer's call in a
    compiled ``predict``/``fit``) is a constant of the graph: its values are read
    when tracing, so it reaches the kernel as ``is_causal`` with no mask, and the
    graph runs exactly the compute ops of ``use_causal_mask=True`` (before: the
    full mask, the 0/1 check of a float mask and the zeroing of empty rows)."""
    import tensorflow as tf

    layer, params, cfg = _layer(cross=False)
    x = tf.constant(rng(15).normal(size=(B, N, E)))

    def masked():
        mask = keras.ops.tril(keras.ops.ones((N, N), dtype=DTYPE))
        return layer(x, x, attention_mask=mask if dtype == "float" else keras.ops.cast(mask, "bool"))

    kernel_calls.clear()
    y = tf.function(masked)()
    assert kernel_calls == [(True, None)], kernel_calls
    _close(np_(y), dc.damcha_attention(params, cfg, np_(x), causal=True))
    ours = sorted(op.type for op in _graph_ops(masked))
    assert ours == sorted(op.type for op in _graph_ops(lambda: layer(x, x, use_causal_mask=True))), ours


@TF_ONLY
def test_tf_graph_band_masks_are_read_when_tracing():
    """``host_values`` reads the masks Keras users build in a traced call
    (``ops.tril``/``ops.triu`` of ``ops.ones``, cast, expanded, reshaped or
    broadcast) as NumPy, equal to NumPy's own; a mask that depends on an input
    is not known (None)."""
    import tensorflow as tf

    o = keras.ops
    one = lambda *shape: np.ones(shape, "float32")  # noqa: E731 - ops.ones makes float32
    built = {
        "tril": (lambda: o.tril(o.ones((4, 6))), np.tril(one(4, 6))),
        "tril 40x40 (a Fill, not a constant)": (lambda: o.tril(o.ones((40, 40))), np.tril(one(40, 40))),
        "tril k=2": (lambda: o.tril(o.ones((4, 6)), 2), np.tril(one(4, 6), 2)),
        "triu k=-1 bool": (lambda: o.cast(o.triu(o.ones((5, 3)), -1), "bool"), np.triu(one(5, 3), -1) > 0),
        "triu expanded": (lambda: o.expand_dims(o.triu(o.ones((3, 3))), 0), np.triu(one(3, 3))[None]),
        "tril broadcast": (
            lambda: o.broadcast_to(o.reshape(o.tril(o.ones((3, 4))), (1, 3, 4)), (2, 3, 4)),
            np.broadcast_to(np.tril(one(3, 4)), (2, 3, 4)),
        ),
    }
    for name, (make, want) in built.items():
        got = _traced_host_values(make)
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert got.dtype == want.dtype, name
    assert _traced_host_values(o.tril, tf.TensorSpec((3, 3), "float32")) is None


def _traced_host_values(make, *specs):
    """``host_values`` of ``make(*inputs)`` while tracing a tf.function of ``specs``."""
    import tensorflow as tf

    from damcha_keras._functional import host_values

    got = []

    def probe(*inputs):
        got.append(host_values(make(*inputs)))
        return tf.constant(0)

    tf.function(probe, autograph=False).get_concrete_function(*specs)
    return got[0]


# ------------------------------------------------------- torch aten op counts

# The aten counts exist only where Keras runs on torch: the torch Keras process's run
# of this file (test_other_keras_backends_*) collects and runs them (it counts TORCH_ATEN_TESTS passes); the
# other processes never define them (end of file), so no run reports them as skipped.
TORCH_ATEN_TESTS = 2


def _torch_pair():
    """A Keras MHA and the DamchaAttention converted from it (gates opened), float32."""
    x = rng(20).normal(size=(B, N, E)).astype("float32")
    mha, layer = _opened_from_mha(x, H, D)
    return mha, layer, keras.ops.convert_to_tensor(x)


def test_torch_aten_causal_forward_runs_sdpa_on_the_heads_without_copies(monkeypatch):
    """Counted, not timed (keras-torch): ``use_causal_mask=True`` reaches torch's SDPA
    once, with ``is_causal=True`` and no mask, on strided views of the mapped heads
    (no ``contiguous`` copy: Keras's wrapper copies q, k and v); the NaN probe is
    two sums and one add with alpha=0; the map is torch calls with no
    conversion or cast. The call's top-level aten ops stay within 13 of Keras
    MHA's (before: 75 vs 35), and the output equals the reference."""
    import torch

    mha, layer, x = _torch_pair()
    sdpa, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kwargs):
        sdpa.append((kwargs.get("is_causal"), attn_mask is None, q.is_contiguous()))
        return real(q, k, v, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    for attn in (layer, mha):
        attn(x, x, use_causal_mask=True)
    sdpa.clear()
    ours = top_level_aten_ops(lambda: layer(x, x, use_causal_mask=True))
    assert sdpa == [(True, True, False)], sdpa  # is_causal, no mask, the heads as strided views
    theirs = top_level_aten_ops(lambda: mha(x, x, use_causal_mask=True))
    assert "aten::contiguous" in theirs and "aten::contiguous" not in ours, (ours, theirs)
    assert ours.count("aten::sum") == 2 and ours.count("aten::scaled_dot_product_attention") == 1, ours
    assert len(ours) <= len(theirs) + 13, (len(ours), len(theirs), ours)
    params = {k: v.astype(np.float64) for k, v in layer.to_canonical().items()}
    want = dc.damcha_attention(params, layer.config, np_(x), causal=True)
    _close(np_(layer(x, x, use_causal_mask=True).detach()), want, "causal forward")


def test_torch_aten_causal_training_step_within_margin_of_mha():
    """Counted, not timed (keras-torch): a training step's top-level aten ops
    (forward, loss, backward) of ``use_causal_mask=True`` stay within a fixed
    margin of Keras MHA's: 55 more, the map's ops and their gradients (before: 198 vs
    110; then 170; then 163; now 165: q~ is kept as its recipe, made again in backward
    with one product and one view, ``F.saved_as_recipes``). The NaN probe has no backward: no sum's gradient is
    expanded back onto q~ and k~ and added to the kernel's (before: a product, two
    sums, two expands and two adds over the heads per step), so the step expands
    exactly what MHA's does. The gradients reach the map's weights and are finite."""
    mha, layer, x = _torch_pair()

    def step(attn):
        y = attn(x, x, use_causal_mask=True)
        (y**2).mean().backward()

    for attn in (layer, mha):
        step(attn)
    ours, theirs = top_level_aten_ops(lambda: step(layer)), top_level_aten_ops(lambda: step(mha))
    assert len(ours) <= len(theirs) + 55, (len(ours), len(theirs))
    assert ours.count("aten::expand") == theirs.count("aten::expand"), (ours, theirs)
    for name, var in layer.canonical_variables().items():
        grad = var.value.grad
        assert grad is not None and np.isfinite(grad.numpy()).all(), name


if BACKEND != "torch":
    del test_torch_aten_causal_forward_runs_sdpa_on_the_heads_without_copies
    del test_torch_aten_causal_training_step_within_margin_of_mha


# ------------------------------------------------------ jax compiled programs

# Defined only where Keras runs on jax (the jax Keras process's run of test_other_keras_backends_*
# counts JAX_HLO_TESTS passes), as the torch aten counts above.
JAX_HLO_TESTS = 5


def _jax_training_step(attn, x):
    """jit(grad) of mean(attn(x, x, use_causal_mask=True)^2) over the trainable weights."""
    import jax
    import jax.numpy as jnp

    trainable = [v.value for v in attn.trainable_variables]
    fixed = [v.value for v in attn.non_trainable_variables]

    def loss(weights, tokens):
        y, _ = attn.stateless_call(weights, fixed, tokens, tokens, use_causal_mask=True)
        return jnp.mean(jnp.square(y))

    return jax.jit(jax.grad(loss)), trainable


def test_jax_hlo_training_step_maps_heads_with_library_products_only(monkeypatch):
    """Counted, not timed (keras-jax): in the compiled training step, every
    product DAMCHA adds runs as XLA:CPU's library (YNNPACK) fusion, as all of
    MHA's do: the transpose of the head map (y's cotangent l^T g) is written
    as a product over l^T's minor axis (``F._jax_mix_heads``' derivative
    rule); plain autodiff left it as two native per-token ``dot`` loops
    (measured at B=4, N=256, E=512 under load: the step 1.15x MHA's -> 0.94-1.08x).
    The one native ``dot`` left is the weight gradient of the projections and
    the generator joined into one product (``F.packed_self_heads``): tokens^T
    times the joined output's cotangent, which XLA:CPU keeps native rather than
    copy a transpose for the library; routed to the library (a custom
    derivative with the tokens' transpose materialised) the step measured
    slower (0.97x the unjoined step's time at N=256 against 0.92x, measured with
    the product's plain derivative).
    The gradients equal plain autodiff's (the rule is exact) and the output
    the reference."""
    import re

    import jax
    import jax.numpy as jnp

    import damcha_keras._functional as F

    b, n, e, h, d = 2, 32, 64, 8, 8  # small, but large enough for XLA:CPU to call its library
    x = rng(22).normal(size=(b, n, e)).astype("float32")
    mha, layer = _opened_from_mha(x, h, d)

    def native_dots(attn):
        step, weights = _jax_training_step(attn, x)
        text = step.lower(weights, x).compile().as_text()
        return re.findall(r"= (\S+) dot\(", text[text.index("\nENTRY") :])  # products outside any fusion

    joined = f"f32[{e},{3 * h * d + h * h}]{{1,0}}"  # (E, q, k, v and the generator's S*S columns)
    ours, theirs = native_dots(layer), native_dots(mha)
    assert ours == [joined] and theirs == [], (ours, theirs)
    step, weights = _jax_training_step(layer, x)
    ours = step(weights, x)
    monkeypatch.setattr(F, "_jax_mix_heads", lambda: jnp.matmul)  # plain autodiff of the same product
    step, weights = _jax_training_step(layer, x)
    plain = step(weights, x)
    for g, want, var in zip(ours, plain, layer.trainable_variables):
        want = np.asarray(want, np.float64)
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=var.path)
    y = jax.jit(lambda t: layer(t, t, use_causal_mask=True))(x)
    params = {k: v.astype(np.float64) for k, v in layer.to_canonical().items()}
    _close(np_(y), dc.damcha_attention(params, layer.config, x.astype(np.float64), causal=True))


def _embedding_padding_models(b, n, e, h, d, vocab, seed, pad):
    """Token ids (the last ``pad`` of row 1 padding), an ``Embedding(mask_zero=True)`` model with
    Keras' MHA and the same with a DAMCHA layer of MHA's weights (gates opened), and that layer."""
    ids = rng(seed).integers(1, vocab, (b, n)).astype("int32")
    ids[1, n - pad :] = 0
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((n,), batch_size=b, dtype="int32")
    embedded = keras.layers.Embedding(vocab, e, mask_zero=True)(tokens)
    mha = keras.layers.MultiHeadAttention(h, d)
    models = {"mha": keras.Model(tokens, mha(embedded, embedded))}
    _, layer = _opened_from_mha(np.zeros((b, n, e), "float32"), h, d)
    layer.set_weights(mha.get_weights())
    models["damcha"] = keras.Model(tokens, layer(embedded, embedded))
    return ids, models, layer


def _compiled_entries(model, ids):
    """The ENTRY computation of the compiled (jax) forward loss and of its gradient."""
    import jax
    import jax.numpy as jnp

    trainable = [v.value for v in model.trainable_variables]
    fixed = [v.value for v in model.non_trainable_variables]

    def loss(weights, x):
        return jnp.mean(jnp.square(model.stateless_call(weights, fixed, x)[0]))

    texts = [jax.jit(fn).lower(trainable, ids).compile().as_text() for fn in (loss, jax.grad(loss))]
    return [t[t.index("\nENTRY") :] for t in texts]


def _padding_output_matches_reference(ids, models, layer):
    y = models["damcha"](ids)
    params = {k: v.astype(np.float64) for k, v in layer.to_canonical().items()}
    x = np_(models["damcha"].layers[1](ids))
    keep = ids != 0
    _close(np_(y), dc.damcha_attention(params, layer.config, x, mask=keep[:, None, :, None] & keep[:, None, None, :]))


def test_jax_hlo_embedding_tokens_are_written_once_as_in_mha():
    """Counted, not timed (keras-jax): with tokens from ``Embedding(mask_zero=True)``
    (Keras passes the padding as query and value masks), the compiled forward
    writes the looked-up (B, N, E) tokens once, as MHA's does, and the training
    step at most once more (the gather XLA keeps for the RMS statistic's
    gradient). Before ``F._flat_map_matrix`` the statistic read its own
    (B, N, E) copy: 3 writes in both (measured at B=4, N=256, E=512: 8.4 MB of
    the forward's 152.8). The output equals the reference with the padding mask."""
    import re

    b, n, e, h, d, vocab = 2, 32, 64, 8, 8, 50
    ids, models, layer = _embedding_padding_models(b, n, e, h, d, vocab, seed=24, pad=5)

    def token_writes(model):
        counts = []
        for text in _compiled_entries(model, ids):
            shapes = re.findall(r"= f32\[([\d,]+)\]\S* (?:fusion|copy|gather)\(.*embedding", text)
            counts.append(sum(np.prod([int(s) for s in shape.split(",")]) == b * n * e for shape in shapes))
        return counts

    # Every (B, N, E)-sized array the embedding's ops write, whatever its shape.
    theirs, ours = token_writes(models["mha"]), token_writes(models["damcha"])
    assert ours[0] <= theirs[0] and ours[1] <= theirs[1] + 1, (ours, theirs)
    _padding_output_matches_reference(ids, models, layer)


def test_jax_hlo_padding_mask_adds_no_n_by_m_array_to_mhas():
    """Counted, not timed (keras-jax): with ``Embedding(mask_zero=True)``
    padding (Keras passes it as query and value masks) the compiled forward and
    training step of DAMCHA write exactly the N x M-sized arrays MHA's do (the
    logits, their masked fill, the probabilities and, training, their
    cotangents) and no boolean N x M mask: the key mask reaches the kernel as
    (B, 1, 1, M) and XLA computes it inside the masked fill from the token ids,
    as it does MHA's (B, N, M) one. The full-mask path (``hook_mask``) writes a
    (B, 1, N, M) bool array in both. The output equals the reference."""
    import re

    b, n, e, h, d, vocab = 2, 48, 64, 8, 8, 50  # n appears in no other dim
    ids, models, layer = _embedding_padding_models(b, n, e, h, d, vocab, seed=25, pad=7)

    def n_by_m_arrays(model):
        found = []
        for text in _compiled_entries(model, ids):
            shapes = re.findall(r"= (\w+)\[([\d,]*)\]", text)
            found.append(sorted(f"{t}[{s}]" for t, s in shapes if s.split(",").count(str(n)) >= 2))
        return found

    theirs, ours = n_by_m_arrays(models["mha"]), n_by_m_arrays(models["damcha"])
    assert ours == theirs, (ours, theirs)
    assert not any(a.startswith("pred") for step in ours for a in step), ours
    _padding_output_matches_reference(ids, models, layer)


def test_jax_eager_attention_runs_as_one_compiled_call(monkeypatch):
    """Counted, not timed (keras-jax): an eager call runs the fused attention
    as one call of a compiled function (``F._jax_fused_attention``), traced
    once per shape, not op by op: Keras runs ``jax.nn.dot_product_attention``
    eagerly as ~15 dispatches, each a pass over the (B, H, N, M) logits in
    memory (its ``ones_like``, mask ANDs, fill and softmax steps). Measured at
    B=4, E=512, H=8 under load (CPU time, interleaved): the eager forward with
    ``use_causal_mask`` 1.06-1.11x MHA's -> 0.73x at N=256, 0.43x at N=1024.
    Before, the kernel ran with concrete arrays on every call. Outputs equal
    the reference (every mask case of ``test_fast_path_equals_reference_and_explicit_path``
    also runs this path on jax)."""
    import jax

    seen = []
    real = keras.ops.dot_product_attention

    def spy(q, *args, **kwargs):
        seen.append(isinstance(q, jax.core.Tracer))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(keras.ops, "dot_product_attention", spy)
    layer, params, cfg = _layer(cross=False)
    x = rng(23).normal(size=(B, N, E)).astype(DTYPE)
    t = keras.ops.convert_to_tensor(x)
    pad = _padding([N, N - 2, 3], N)
    calls = [
        (dict(use_causal_mask=True), None, True),
        (dict(use_causal_mask=True), None, True),  # same shapes: no new trace
        (dict(value_mask=pad), pad[:, None, None, :], False),
    ]
    for kwargs, mask, causal in calls:
        y = layer(t, t, **kwargs)
        _close(np_(y), dc.damcha_attention(params, cfg, x.astype(np.float64), mask=mask, causal=causal), str(kwargs))
    assert seen == [True, True], seen  # traced once per shape and masks, never run eagerly


def test_jax_packed_projections_equal_the_sublayers_path(monkeypatch):
    """keras-jax: a tied self-attention (query is value, no key) computes its
    query, key and value projections and its map's generator as one product
    (``F.packed_self_heads``); a cross-attention keeps one sublayer call per
    projection. The output and every trainable weight's gradient (jit(grad)
    of a causal call) equal the sublayers' path (``_packs_projections`` off)
    and the output the reference (float32; float64 runs in the conformance
    suite's x64 JAX process): biases on and off,
    value_dim != key_dim, and with LoRA enabled on the query and value
    sublayers (the joined product uses their ``kernel``, LoRA update
    included; the reference knows no LoRA, so there the sublayers' path is
    the check). Forward mode (``jax.jvp``) gives the same derivative as the
    sublayers' path. Fewer tokens than features (a decoding step, an empty
    batch) keep the sublayers."""
    import jax
    import jax.numpy as jnp

    import damcha_keras._functional as F

    packed = []
    real = F.packed_self_heads
    monkeypatch.setattr(F, "packed_self_heads", lambda *a: packed.append(1) or real(*a))

    def run(layer, x, c):
        """Output, every trainable weight's gradient, and the derivative along
        one direction in every weight and the tokens (forward mode)."""
        trainable = [v.value for v in layer.trainable_variables]
        fixed = [v.value for v in layer.non_trainable_variables]

        def loss(weights, tokens):
            context = tokens if c is x else c  # self-attention: one traced tensor for query and value
            y, _ = layer.stateless_call(weights, fixed, tokens, context, use_causal_mask=c is x)
            return jnp.sum(jnp.square(y)), y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(trainable, x)
        dw, dt = [np.full(w.shape, 0.01, w.dtype) for w in trainable], np.full(x.shape, 0.01, x.dtype)
        along = jax.jit(lambda w, t: jax.jvp(lambda w_, t_: loss(w_, t_)[0], (w, t), (dw, dt))[1])(trainable, x)
        return np_(y), [np_(g) for g in grads], float(along)

    cases = [  # (config, LoRA, cross-attention)
        (dict(), False, False),
        (dict(use_bias=False), False, False),
        (dict(value_dim=3, output_dim=5), False, False),
        (dict(), True, False),
        (dict(context_dim=E + 2, coupling="separate"), False, True),
    ]
    for extra, lora, cross in cases:
        what = f"{extra} lora={lora}"
        cfg = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D, **extra)
        params = case_params(cfg, 31)
        layer = DamchaAttention.from_canonical(params, cfg, dtype="float32")
        x = rng(32).normal(size=(B, N, E)).astype("float32")
        c = rng(33).normal(size=(B, M, E + 2)).astype("float32") if cross else x
        if lora:
            for dense in (layer.query_dense, layer.value_dense):
                dense.enable_lora(2)
                dense.lora_kernel_b.assign(rng(34).normal(size=dense.lora_kernel_b.shape).astype("float32"))
        before = len(packed)
        y, grads, along = run(layer, x, c)
        assert len(packed) == before + (0 if cross else 2), what  # traced for grad and for jvp
        with monkeypatch.context() as m:
            m.setattr(DamchaAttention, "_packs_projections", lambda self, tokens: False)
            y_sub, grads_sub, along_sub = run(layer, x, c)
        assert len(packed) == before + (0 if cross else 2), what
        rtol = 2e-5
        np.testing.assert_allclose(y, y_sub, rtol=rtol, atol=rtol * np.abs(y_sub).max(), err_msg=what)
        for g, want, var in zip(grads, grads_sub, layer.trainable_variables, strict=True):
            np.testing.assert_allclose(g, want, rtol=rtol, atol=rtol * np.abs(want).max(), err_msg=f"{what} {var.path}")
        np.testing.assert_allclose(along, along_sub, rtol=1e-4, err_msg=f"{what} jvp")
        if not lora:
            expected = dc.damcha_attention(params, cfg, x.astype(np.float64), c.astype(np.float64), causal=c is x)
            _close(y, expected, what)
    cfg = dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D)
    layer = DamchaAttention.from_canonical(case_params(cfg, 35), cfg)
    before = len(packed)
    for b in (0, 1):  # fewer tokens than features (E=8): the sublayers' path
        t = keras.ops.convert_to_tensor(x[:b, :4])
        y = layer(t, t, use_causal_mask=True)
        assert tuple(y.shape) == (b, 4, E), b
    assert len(packed) == before


if BACKEND != "jax":
    del test_jax_hlo_training_step_maps_heads_with_library_products_only
    del test_jax_packed_projections_equal_the_sublayers_path
    del test_jax_hlo_embedding_tokens_are_written_once_as_in_mha
    del test_jax_hlo_padding_mask_adds_no_n_by_m_array_to_mhas
    del test_jax_eager_attention_runs_as_one_compiled_call
