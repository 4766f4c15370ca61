"""A fit/save/load smoke test under each Keras backend (the conformance
catalogue, one test per check, is tests/test_keras_conformance.py).

Keras fixes its backend at import, so each backend runs ``run`` below in a
Keras process of its own, shared with tests/test_models_keras_backends.py
(tests/_keras_processes.py: one process per backend per test session; the test
process's own backend, tensorflow unless KERAS_BACKEND says otherwise, runs in
the test process); each
check here is one pytest item, ``test_keras_backend[BACKEND-CHECK]``, asserting
on that process's results. ``python tests/test_keras_backends.py BACKEND TMPDIR``
(with ``KERAS_BACKEND=BACKEND``) prints them.

Every backend decodes token by token with a cache (jitted on jax), checks
that NaN in a parameter or an input gives NaN out on every path of the layer
(fused, masked, causal-only, explicit, float64), and that an int8-quantized
model equals Keras MHA quantized the same way; the
torch backend also exports a model with Keras's ``model.export(format="onnx")``
and runs it in onnxruntime; the jax backend exports one with
``model.export(format="tf_saved_model")`` (jax2tf, symbolic batch and length)
and runs it with ``tf.saved_model.load``, and checks that
``DamchaAttention.from_mha`` copies the MHA's weights rather than sharing them
(a jitted ``model.fit`` donates its variables' buffers: shared weights would be
deleted under the layer that was not trained, "Array has been deleted").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from _aten import top_level_aten_ops
from _keras_processes import part_results

BACKENDS = ("tensorflow", "torch", "jax")


def check_fit_save_load(r: dict, backend: str) -> None:
    assert r["fit_loss_decreased"] and r["reload_bit_exact"], r


def check_decode_with_cache(r: dict, backend: str) -> None:
    assert r["decode_within_float32_tolerance"], r


def check_onnx_export(r: dict, backend: str) -> None:
    assert r["onnx_export_matches"] is (True if backend == "torch" else None), r


def check_saved_model_export(r: dict, backend: str) -> None:
    assert r["saved_model_export_matches"] is (True if backend == "jax" else None), r


def check_nan_gives_nan(r: dict, backend: str) -> None:
    assert r["nan_not_nan"] == [], r["nan_not_nan"]


def check_int8_equals_mha(r: dict, backend: str) -> None:
    assert r["quantized_vs_mha_mse"] is not None and r["quantized_vs_mha_mse"] < 1e-8, r


def check_from_mha_copies(r: dict, backend: str) -> None:
    if backend == "jax":  # from_mha copies, never shares, the weights: each layer trains alone
        assert r["from_mha_copies"] == {
            "damcha_trained": True,
            "mha_unchanged_after_damcha_fit": True,
            "mha_trained": True,
            "damcha_unchanged_after_mha_fit": True,
        }, r["from_mha_copies"]
    else:
        assert r["from_mha_copies"] is None, r


def check_torch_padding_path(r: dict, backend: str) -> None:
    if backend != "torch":
        assert r["torch_padding_path"] is None, r
        return
    got = r["torch_padding_path"]
    # Counted, not timed: the padding call's heads reach SDPA as strided views (Keras's
    # wrapper, which the call went through before, copies all three with
    # ``contiguous``, as MHA's call does) and its top-level aten ops stay within 13 of
    # MHA's (58 vs 45 here; before: 69, 4 clones); the tokens' sum of squares has its
    # own backward, one product (before: vector_norm's: a division, a comparison and a
    # fill over the tokens).
    assert got["sdpa_calls"] == [[False, True]], got  # one call, no is_causal, an additive mask
    assert got["clones"]["forward"] == 0 and got["clones"]["mha_forward"] >= 3, got
    assert got["forward_ops"] <= got["mha_forward_ops"] + 13, got
    assert got["norm_backward_ops"] == [], got
    assert got["decode_step_contiguous"] == 0, got
    assert got["causal_padding_clones"] == 0, got  # padding with use_causal_mask: the triangle folded in
    assert got["sum_squares_grad_fn"] == "SumSquaresBackward", got
    assert got["gradcheck"] and got["gradgradcheck"] and got["grad_vs_2t"] == 0.0, got
    # torch.func and forward-mode AD work through the autograd function (its vmap rule, its jvp).
    assert got["forward_ad_gradcheck"] and got["func_grad_vs_autograd"] < 1e-6 and got["vmap_vs_loop"] == 0.0, got
    assert got["ratio_vs_reference"] <= 1.0 and got["mha_max_diff"] < 1e-5, got


def check_torch_causal_probe(r: dict, backend: str) -> None:
    if backend != "torch":
        assert r["torch_causal_probe"] is None, r
        return
    got = r["torch_causal_probe"]
    # Counted, not timed: with finite q~ and k~ (one sum of each, read eagerly on CPU)
    # the NaN probe is skipped, nothing runs between SDPA and the output projection
    # but views (before: the probe's row sums of q~, sum of k~ and two adds, one a
    # pass over the output); two full sums read q~ and k~ before SDPA instead.
    assert got["after_sdpa"] == ["aten::transpose", "aten::to", "aten::to"], got
    assert got["sums"] == 2 and got["items"] == 2, got
    # The check itself: a NaN or inf in either, or a sum that overflows (float16),
    # says "not certainly finite"; so does every call it must not branch in.
    assert got["finite"] is True and got["not_finite"] == [False] * 5, got
    assert got["in_transforms"] == {"vmap": False, "grad": False, "jit_trace": False}, got
    # The same outputs and the same NaN rows as with the probe always run: a NaN query
    # token (self-attention) or key token (cross-attention) makes every row of its
    # batch entry NaN and leaves the other entry finite; finite inputs, equal bits.
    assert got["same_as_probe"] == {"finite": True, "query-token": True, "key-token": True}, got
    assert got["nan_rows"] == {"query-token": [[True] * 6, [False] * 6], "key-token": [[False] * 6, [True] * 6]}, got


def check_mixed_precision_fit(r: dict, backend: str) -> None:
    got = r["mixed_precision_fit"]
    # float32 variables that fit, but not in the float16/bfloat16 the policy computes in:
    # refused, naming the compute dtype (they were accepted and every call gave inf/NaN).
    for policy, compute in (("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16")):
        for what in ("layer", "stack_attention", "stack_ffn"):
            assert f"round to a finite {compute}, the compute dtype of dtype policy '{policy}'" in got[policy][what], (
                policy,
                what,
                got[policy][what],
            )
        # Just inside: loads, and the call is finite.
        assert got[policy]["fits_finite"] is True, got
        # LayerNormalization reads its float32 weights in float32 (autocast=False): not refused.
        assert got[policy]["norm_scale"] == "accepted", got


def check_torch_saved_recipes(r: dict, backend: str) -> None:
    if backend != "torch":
        assert r["torch_saved_recipes"] is None, r
        return
    got = r["torch_saved_recipes"]
    # Training: the same outputs and gradients (inputs and every weight, bit for bit) with the
    # recipe as without, for each coupling, masks, the explicit path and a cache-writing
    # step; backward made q~ again where the kernel kept it (not for "lowrank": no fast map).
    for case, diff in got["vs_off"].items():
        assert diff["made"] == diff["expected"] and diff["made_without"] == 0, (case, diff)
        assert diff["output"] == 0.0 and diff["grads"] == 0.0 and diff["names"] > 0, (case, diff)
    # Off without gradient, under the caller's saved-tensor hooks (which the layer's would
    # displace) and under torch.func; on in plain eager training.
    assert got["off"] == {"no_grad": False, "callers_hooks": False, "eager_training": True}, got
    assert got["func_grad"] is False, got
    assert "modified in place" in got["in_place"], got
    # What one training call keeps for backward (a tied layer, gates open, against the
    # Keras MHA it came from): within 5% of MHA's activations (the map matrix); without
    # the recipe, q~ besides (a (B, N, E) tensor).
    saved = got["saved_bytes"]
    assert saved["recipes"] <= 1.05 * saved["mha"], saved
    assert saved["off"] >= saved["recipes"] + saved["tokens"], saved


# Each check on every backend: the export and from_mha checks run on one backend
# and assert that the others' runs left them out (None, never a silent pass).
CHECKS = {
    "fit-save-load": check_fit_save_load,
    "decode-with-cache": check_decode_with_cache,
    "onnx-export": check_onnx_export,
    "saved-model-export": check_saved_model_export,
    "nan-gives-nan": check_nan_gives_nan,
    "int8-equals-mha": check_int8_equals_mha,
    "from-mha-copies": check_from_mha_copies,
    "torch-padding-path": check_torch_padding_path,
    "torch-causal-probe": check_torch_causal_probe,
    "mixed-precision-fit": check_mixed_precision_fit,
    "torch-saved-recipes": check_torch_saved_recipes,
}


@pytest.mark.parametrize("backend, check", [pytest.param(b, c, id=f"{b}-{c}") for b in BACKENDS for c in CHECKS])
def test_keras_backend(backend, check, tmp_path_factory, request):
    CHECKS[check](part_results(backend, "layer", tmp_path_factory, request), backend)


NAN_PLACES = ("query.kernel", "metric.qk.kernel", "metric.qk.gate", "query-token", "key-token")
NAN_PATHS = {
    "fused": {},
    "fused-mask": {"attention_mask": "mask"},
    "causal-only": {"use_causal_mask": True},
    "explicit": {"return_attention_scores": True},
    "float64": {"dtype": "float64"},
}


def nan_cases(DamchaAttention, keras, np) -> list[str]:
    """NaN in a parameter or an input gives NaN out on every path (fused kernel,
    fused with a mask, causal-only, explicit, float64 einsum): the names of the
    (place, path) pairs where a row that reads the NaN came out finite."""
    import damcha_core as dc

    cfg = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 8))
    mask = np.ones((2, 5, 5), bool)
    mask[:, :, 3] = False
    finite = []
    for place in NAN_PLACES:
        params = dc.init_params(cfg, seed=1)
        params["metric.qk.gate"] = np.full(2, 0.5)
        tokens = x.copy()
        rows = np.ones((2, 5), bool)  # the query rows that read the NaN
        if place == "query-token":
            tokens[0, 2, 1] = np.nan
            rows[:] = False
            rows[0, 2] = True
        elif place == "key-token":
            tokens[1, 0, 3] = np.nan  # key 0 of batch 1: every query of batch 1 sees it
            rows[0] = False
        for path, options in NAN_PATHS.items():
            options = dict(options)
            dtype = options.pop("dtype", "float32")
            layer = DamchaAttention.from_canonical(params, cfg, dtype=dtype)
            for name, variable in layer.canonical_variables().items():
                if name == place:  # loading validates params: put the NaN in afterwards
                    value = np.asarray(keras.ops.convert_to_numpy(variable)).copy()
                    value.flat[0] = np.nan
                    variable.assign(value)
            if options.get("attention_mask") == "mask":
                options["attention_mask"] = mask
            q = tokens.astype(dtype)
            out = layer(q, q, **options)
            out = np.asarray(keras.ops.convert_to_numpy(out[0] if isinstance(out, tuple) else out))
            if not np.isnan(out[rows]).all():
                finite.append(f"{place}/{path}")
    return finite


def quantized_vs_mha(DamchaAttention, keras, np) -> float:
    """model.quantize("int8") of a converted layer equals Keras MHA quantized the
    same way (it used to read the raw int8 kernel: MSE 1e10, a dtype error on torch)."""
    import warnings

    mha = keras.layers.MultiHeadAttention(2, 4, seed=0)
    x = np.random.default_rng(1).normal(size=(2, 5, 8)).astype("float32")
    mha(x, x)
    layer = DamchaAttention.from_mha(mha)
    inp = keras.Input((5, 8))
    outs = []
    for attention in (mha, layer):
        model = keras.Model(inp, attention(inp, inp))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.quantize("int8")
        outs.append(np.asarray(keras.ops.convert_to_numpy(model(x))))
    return float(np.mean((outs[0] - outs[1]) ** 2))


def _fit_one_step(keras, np, layer, x) -> bool:
    """Train ``layer`` (self-attention on ``x``) one step with ``model.fit``;
    return whether its weights moved."""
    inputs = keras.Input(x.shape[1:])
    model = keras.Model(inputs, layer(inputs, inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = [np.array(keras.ops.convert_to_numpy(v.value)) for v in layer.trainable_variables]
    model.fit(x, np.zeros_like(x), epochs=1, batch_size=len(x), verbose=0)
    after = [keras.ops.convert_to_numpy(v.value) for v in layer.trainable_variables]
    return any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def from_mha_copies(DamchaAttention, keras, np) -> dict[str, bool]:
    """Fit a converted layer, then its MHA, one step each: each must train and
    leave the other's outputs unchanged (JAX donates a jitted fit's buffers)."""
    x = np.random.default_rng(0).normal(size=(4, 5, 8)).astype("float32")
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, seed=0)
    y_mha = keras.ops.convert_to_numpy(mha(x, x))
    damcha = DamchaAttention.from_mha(mha)
    result = {"damcha_trained": _fit_one_step(keras, np, damcha, x)}
    result["mha_unchanged_after_damcha_fit"] = bool(np.array_equal(keras.ops.convert_to_numpy(mha(x, x)), y_mha))
    y_damcha = keras.ops.convert_to_numpy(damcha(x, x))
    result["mha_trained"] = _fit_one_step(keras, np, mha, x)
    result["damcha_unchanged_after_mha_fit"] = bool(np.array_equal(keras.ops.convert_to_numpy(damcha(x, x)), y_damcha))
    return result


def torch_padding_path(DamchaAttention, keras, np) -> dict:
    """keras-torch: a padded self-attention (the query and value masks that
    ``Embedding(mask_zero=True)`` makes Keras fill, here passed as such: a
    (B, 1, 1, M) key mask reaches the kernel) against the
    MHA it was converted from, gates opened: the SDPA call, the aten ops of a
    forward, the backward of the tokens' sum of squares (``F._sum_squares``:
    gradcheck in float64, its own rule 2 t g), and the output against the
    reference."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import damcha_core as dc
    import damcha_keras._functional as F
    from damcha_conformance import TOLERANCES

    keras.utils.set_random_seed(4)
    ids = np.array([[3, 4, 5, 6, 7, 8], [1, 2, 3, 0, 0, 0]], "int32")
    emb = keras.layers.Embedding(11, 16)
    mha = keras.layers.MultiHeadAttention(2, 8)
    h = emb(ids).detach()
    pad = keras.ops.convert_to_tensor(ids != 0)
    masks = dict(query_mask=pad, value_mask=pad)
    y_mha = keras.ops.convert_to_numpy(mha(h, h, **masks))
    layer = DamchaAttention.from_mha(mha)
    closed = np.abs(keras.ops.convert_to_numpy(layer(h, h, **masks)) - y_mha)[ids != 0].max()
    params = layer.to_canonical()
    layer.load_canonical({k: (np.full_like(v, 0.5) if k.endswith(".gate") else v) for k, v in params.items()})

    sdpa, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kwargs):
        sdpa.append([bool(kwargs.get("is_causal")), attn_mask is not None and attn_mask.is_floating_point()])
        return real(q, k, v, attn_mask, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        y = layer(h, h, **masks)
    finally:
        torch.nn.functional.scaled_dot_product_attention = real
    ours, theirs = top_level_aten_ops(lambda: layer(h, h, **masks)), top_level_aten_ops(lambda: mha(h, h, **masks))

    def clones(fn) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        return sum(e.name == "aten::clone" for e in prof.events())

    # The tokens' sum of squares: the training step's norm backward, and the rule itself.
    tokens = emb(ids)  # requires grad (the embedding's table)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (layer(tokens, tokens, **masks) ** 2).mean().backward()
    norm_backward = sorted(
        {e.name for e in prof.events() if "VectorNormBackward" in e.name or e.name == "aten::masked_fill_"}
    )
    t64 = torch.tensor(np.random.default_rng(1).normal(size=(2, 3, 5)), dtype=torch.float64, requires_grad=True)
    out = F._sum_squares(t64)
    (grad,) = torch.autograd.grad(out, t64, torch.ones_like(out))
    # torch.func through the layer (its tokens need a gradient there, so the call
    # takes the autograd function) against autograd; forward mode and vmap on the rule.
    x = tokens.detach()

    def loss(t):
        return (layer(t, t, **masks) ** 2).mean()

    x_leaf = x.clone().requires_grad_(True)
    (want_grad,) = torch.autograd.grad(loss(x_leaf), x_leaf)
    func_grad = torch.func.grad(loss)(x)
    vmapped = torch.func.vmap(F._sum_squares)(t64.detach())
    ref = dc.damcha_attention(
        {k: v.astype(np.float64) for k, v in layer.to_canonical().items()},
        layer.config,
        keras.ops.convert_to_numpy(h).astype(np.float64),
        mask=(ids != 0)[:, None, None, :] & (ids != 0)[:, None, :, None],
    )
    rows = ids != 0
    causal_clones = clones(lambda: layer(h, h, use_causal_mask=True, **masks))
    # A decoding step: its cache-slot mask takes the same direct call (before: the
    # wrapper's three contiguous copies of the step's heads).
    cache = layer.init_cache(2, 8)
    with torch.no_grad():
        _, cache = layer(h, h, use_causal_mask=True, cache=cache, cache_update_index=0)
        step = h[:, :1]
        decode_ops = top_level_aten_ops(
            lambda: layer(step, step, use_causal_mask=True, cache=cache, cache_update_index=6)
        )
    return {
        "decode_step_contiguous": decode_ops.count("aten::contiguous"),
        "causal_padding_clones": causal_clones,
        "sdpa_calls": sdpa,
        "clones": {"forward": clones(lambda: layer(h, h, **masks)), "mha_forward": clones(lambda: mha(h, h, **masks))},
        "forward_ops": len(ours),
        "mha_forward_ops": len(theirs),
        "norm_backward_ops": norm_backward,
        "sum_squares_grad_fn": type(out.grad_fn).__name__,
        "gradcheck": bool(torch.autograd.gradcheck(F._sum_squares, (t64,))),
        "gradgradcheck": bool(torch.autograd.gradgradcheck(F._sum_squares, (t64,))),
        "forward_ad_gradcheck": bool(
            torch.autograd.gradcheck(F._sum_squares, (t64,), check_forward_ad=True, check_backward_ad=False)
        ),
        "func_grad_vs_autograd": float((func_grad - want_grad).abs().max()),
        "vmap_vs_loop": float((vmapped - torch.stack([F._sum_squares(t) for t in t64.detach()])).abs().max()),
        "grad_vs_2t": float((grad - 2 * t64.detach()).abs().max()),
        "ratio_vs_reference": float(
            TOLERANCES["float32"].output_ratio(keras.ops.convert_to_numpy(y)[rows], ref[rows])[1]
        ),
        "mha_max_diff": float(closed),
    }


def torch_causal_probe(DamchaAttention, keras, np) -> dict:
    """keras-torch: ``use_causal_mask`` without a mask, gates opened: the aten ops
    of a finite call around SDPA, ``F._torch_certainly_finite`` on finite and
    non-finite heads and under torch.func and tracing, and the outputs and NaN
    rows against the same calls with the NaN probe forced (the code before)."""
    import torch

    import damcha_keras._functional as F

    keras.utils.set_random_seed(5)
    mha = keras.layers.MultiHeadAttention(2, 8)
    h = torch.tensor(np.random.default_rng(5).normal(size=(2, 6, 16)).astype("float32"))
    mha(h, h)
    layer = DamchaAttention.from_mha(mha)
    params = layer.to_canonical()
    layer.load_canonical({k: (np.full_like(v, 0.5) if k.endswith(".gate") else v) for k, v in params.items()})
    ops = top_level_aten_ops(lambda: layer(h, h, use_causal_mask=True))
    start = ops.index("aten::scaled_dot_product_attention") + 1
    after_sdpa = ops[start : ops.index("aten::einsum", start)]

    q, k = torch.ones(2, 3, 2, 4), torch.ones(2, 3, 2, 4)
    bad = []
    for name in ("nan-q", "nan-k", "inf-q", "inf-k"):
        qq, kk = q.clone(), k.clone()
        (qq if name.endswith("q") else kk)[1, 2, 0, 3] = float("nan") if name.startswith("nan") else float("inf")
        bad.append(F._torch_certainly_finite(qq, kk))
    big = torch.full((2, 3, 2, 4), 60000.0, dtype=torch.float16)  # every element finite, the sum is not
    bad.append(F._torch_certainly_finite(big, big))
    seen: dict[str, bool] = {}

    def probe(name: str):
        def fn(a):
            seen[name] = F._torch_certainly_finite(a, a)
            return a * 2

        return fn

    torch.func.vmap(probe("vmap"))(q)
    torch.func.grad(lambda a: probe("grad")(a).sum())(q)
    torch.jit.trace(probe("jit_trace"), (q,), check_trace=False)

    real = F._torch_certainly_finite

    def both(x, c):
        y = layer(x, c, use_causal_mask=True).detach()
        F._torch_certainly_finite = lambda q, k: False
        try:
            y_probe = layer(x, c, use_causal_mask=True).detach()
        finally:
            F._torch_certainly_finite = real
        return y, y_probe

    same, nan_rows = {}, {}
    y, y_probe = both(h, h)
    same["finite"] = bool(torch.equal(y, y_probe))
    x_nan = h.clone()
    x_nan[0, 2, 1] = float("nan")
    y, y_probe = both(x_nan, x_nan)
    same["query-token"] = bool(
        torch.equal(y.isnan(), y_probe.isnan()) and torch.equal(y.nan_to_num(), y_probe.nan_to_num())
    )
    nan_rows["query-token"] = y.isnan().all(-1).tolist()
    c_nan = torch.tensor(np.random.default_rng(6).normal(size=(2, 6, 16)).astype("float32"))
    c_nan[1, 0, 3] = float("nan")
    y, y_probe = both(h, c_nan)
    same["key-token"] = bool(
        torch.equal(y.isnan(), y_probe.isnan()) and torch.equal(y.nan_to_num(), y_probe.nan_to_num())
    )
    nan_rows["key-token"] = y.isnan().all(-1).tolist()
    return {
        "after_sdpa": after_sdpa,
        "sums": ops.count("aten::sum"),
        "items": ops.count("aten::item"),
        "finite": F._torch_certainly_finite(q, k),
        "not_finite": bad,
        "in_transforms": seen,
        "same_as_probe": same,
        "nan_rows": nan_rows,
    }


def torch_saved_recipes(DamchaAttention, keras, np) -> dict:
    """keras-torch training: attention saves the mapped heads as recipes
    (``F.saved_as_recipes``): outputs and gradients against the same calls with
    the recipes off, how many recipes backward made, when they are off, an
    in-place change caught, and the activations a call saves against MHA's."""
    import torch

    import damcha_keras._functional as F

    real_keeps, real_make = F.torch_keeps_recipes, F._Recipe.make
    made = []

    def counting_make(self):
        made.append(1)
        return real_make(self)

    def run_layer(layer, inputs, kwargs, recipes: bool):
        """Output and the gradients of sum(y * w) for the inputs and every trainable weight."""
        copies: dict[int, Any] = {}  # one leaf per distinct input: self-attention stays `key is query`
        leaves = [copies.setdefault(id(t), t.detach().clone().requires_grad_(True)) for t in inputs]
        if not recipes:
            F.torch_keeps_recipes = lambda: False
        F._Recipe.make = counting_make
        try:
            del made[:]
            out = layer(*leaves, **kwargs)
            y = out[0] if isinstance(out, tuple) else out
            weights = [v.value for v in layer.trainable_variables]
            w = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
            grads = torch.autograd.grad((y * w).sum(), list(copies.values()) + weights, allow_unused=True)
            n = len(made)
        finally:
            F.torch_keeps_recipes, F._Recipe.make = real_keeps, real_make
        return y.detach(), [None if t is None else t.detach() for t in grads], n

    rng = np.random.default_rng(8)
    vs_off = {}
    cases = {  # layer, inputs, call, recipes backward makes (one: q~'s)
        "tied": (dict(num_heads=2, key_dim=4), "self", {}, 1),
        "tied-causal": (dict(num_heads=2, key_dim=4), "self", {"use_causal_mask": True}, 1),
        "separate": (dict(num_heads=2, key_dim=4, coupling="separate"), "cross", {}, 1),
        "query": (dict(num_heads=2, key_dim=4, coupling="query"), "cross", {}, 1),
        "gqa-separate": (dict(num_heads=4, key_dim=4, num_kv_heads=2, coupling="separate"), "self", {}, 1),
        "no-bias-padding": (dict(num_heads=2, key_dim=4, use_bias=False), "self", {"mask": True}, 1),
        # The explicit path's einsums save permuted copies of q~: no recipe, same numbers.
        "explicit-scores": (dict(num_heads=2, key_dim=4), "self", {"return_attention_scores": True}, 0),
        "decode-step": (dict(num_heads=2, key_dim=4), "cache", {"use_causal_mask": True}, 1),
        "lowrank": (dict(num_heads=2, key_dim=4, metric="lowrank", metric_rank=2), "self", {}, 0),
    }
    for name, (kw, kind, call_kwargs, expected) in cases.items():
        # float32: the kernel path (float64 takes the explicit one, whose einsums save copies)
        layer = DamchaAttention(**kw, seed=1)
        q = torch.tensor(rng.normal(size=(2, 5, 8)).astype("float32"))
        c = torch.tensor(rng.normal(size=(2, 7, 8)).astype("float32"))
        layer(q, q if kind != "cross" else c)
        params = layer.to_canonical()
        layer.load_canonical({k: (np.full_like(v, 0.5) if k.endswith(".gate") else v) for k, v in params.items()})
        if call_kwargs.pop("mask", False):
            pad = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
            call_kwargs = dict(call_kwargs, query_mask=pad, value_mask=pad)
        if kind == "cache":
            token = q[:, :1]
            inputs = [token, token]
            call_kwargs = dict(call_kwargs, cache=layer.init_cache(2, 6), cache_update_index=0)
        else:
            inputs = [q, q] if kind == "self" else [q, c]
        a = run_layer(layer, inputs, call_kwargs, recipes=True)
        b = run_layer(layer, inputs, call_kwargs, recipes=False)
        pairs = [(u, v) for u, v in zip(a[1], b[1]) if u is not None or v is not None]
        vs_off[name] = {
            "output": float((a[0] - b[0]).abs().max()),
            "grads": max(float((u - v).abs().max()) for u, v in pairs),
            "names": len(pairs),
            "made": a[2],
            "expected": expected,
            "made_without": b[2],
        }

    # Off where the layer's hooks would displace a caller's or cannot run.
    off = {}
    with torch.no_grad():
        off["no_grad"] = F.torch_keeps_recipes()
    with torch.autograd.graph.save_on_cpu():
        off["callers_hooks"] = F.torch_keeps_recipes()
    seen = {}
    torch.func.grad(lambda a: (seen.setdefault("func_grad", F.torch_keeps_recipes()), a.sum())[1])(torch.ones(2))
    off["eager_training"] = F.torch_keeps_recipes()

    # An in-place change of what a recipe reads, after the forward, fails loudly.
    m = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    base = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True) * 1.0  # a non-leaf y
    block = torch.matmul(m, base)
    with F.saved_as_recipes([(block, m, base)]):
        loss = (block * block).sum()
    with torch.no_grad():
        base.add_(1.0)
    try:
        loss.backward()
        in_place = "no error"
    except RuntimeError as e:
        in_place = str(e)

    # Saved for backward: distinct activations' bytes, one training call (B=2, N=32, E=128, H=4).
    mha = keras.layers.MultiHeadAttention(4, 32)
    h = torch.tensor(rng.normal(size=(2, 32, 128)).astype("float32"))
    mha(h, h)
    layer = DamchaAttention.from_mha(mha)
    params = layer.to_canonical()
    layer.load_canonical({k: (np.full_like(v, 0.5) if k.endswith(".gate") else v) for k, v in params.items()})
    # Parameters are kept anyway: only the activations count.
    weights = {v.value.untyped_storage().data_ptr() for v in layer.weights + mha.weights}

    def saved_bytes(fn) -> int:
        storages = {}

        def record(t) -> None:
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

        def pack(t):
            record(t)
            return t

        def counted(blocks):  # the layer's hooks, recording what they keep (a recipe: its matrix and y)
            hooks = real_saved_as_recipes(blocks)

            def pack_recipes(t):
                kept = hooks.pack_hook(t)
                for x in (kept.matrix, kept.y) if isinstance(kept, F._Recipe) else (kept,):
                    record(x)
                return kept

            return torch.autograd.graph.saved_tensors_hooks(pack_recipes, hooks.unpack_hook)

        # The counting hooks would turn the layer's off (a caller's hooks): it is told there are none.
        real_top = torch._C._autograd._top_saved_tensors_default_hooks
        torch._C._autograd._top_saved_tensors_default_hooks = lambda *a: None
        F.saved_as_recipes = counted
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                fn()
        finally:
            torch._C._autograd._top_saved_tensors_default_hooks = real_top
            F.saved_as_recipes = real_saved_as_recipes
        return sum(storages.values())

    real_saved_as_recipes = F.saved_as_recipes
    with_recipes = saved_bytes(lambda: layer(h, h))
    F.torch_keeps_recipes = lambda: False
    try:
        without = saved_bytes(lambda: layer(h, h))
    finally:
        F.torch_keeps_recipes = real_keeps
    return {
        "vs_off": vs_off,
        "off": off,
        "func_grad": seen["func_grad"],
        "in_place": in_place,
        "saved_bytes": {
            "recipes": with_recipes,
            "off": without,
            "mha": saved_bytes(lambda: mha(h, h)),
            "tokens": h.nbytes,
        },
    }


def mixed_precision_fit(DamchaAttention, keras, np) -> dict:
    """What loading params that fit float32 but not the compute dtype does under each
    mixed policy: the error's text, or "accepted"."""
    import damcha_core as dc
    from damcha_keras import stack_from_canonical, stack_load_canonical

    def outcome(load, *args, **kwargs) -> str:
        try:
            load(*args, **kwargs)
        except dc.DamchaValueError as exc:
            return str(exc)
        return "accepted"

    cfg = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    stack_cfg = dc.EncoderConfig(cfg, num_layers=2, ffn_dim=12, final_norm=True)
    # Small inputs: the products of a kernel entry at the dtype's max stay finite.
    x = 1e-6 * np.random.default_rng(0).normal(size=(1, 3, 8)).astype("float32")
    out: dict = {}
    # The smallest magnitude that is inf in the compute dtype, and its largest finite value.
    for policy, big, largest in (
        ("mixed_float16", 65520.0, 65504.0),
        ("mixed_bfloat16", 2.0**127 * (2 - 2.0**-8), 2.0**127 * (2 - 2.0**-7)),
    ):
        params = dc.init_params(cfg, seed=0)
        params["query.kernel"][0, 0, 0] = big
        got = {"layer": outcome(DamchaAttention.from_canonical, params, cfg, dtype=policy)}
        params["query.kernel"][0, 0, 0] = largest
        layer = DamchaAttention.from_canonical(params, cfg, dtype=policy)
        got["fits_finite"] = bool(np.all(np.isfinite(keras.ops.convert_to_numpy(layer(x, x)))))
        stack_params = dc.init_encoder_params(stack_cfg, seed=0)
        stack = stack_from_canonical(stack_params, stack_cfg, dtype=policy)
        for what, name in (
            ("stack_attention", "layers.0.attention.key.kernel"),
            ("stack_ffn", "layers.0.ffn.in.kernel"),
            ("norm_scale", "final_norm.scale"),
        ):
            bad = dict(stack_params)
            bad[name] = stack_params[name].copy()
            bad[name].flat[0] = big
            got[what] = outcome(stack_load_canonical, stack, bad)
        out[policy] = got
    return out


def run(backend: str, workdir: str) -> dict:
    """Every check's measurements on this process's Keras backend (a JSON-able dict)."""
    import keras
    import numpy as np

    from damcha_keras import DamchaAttention, MetricGenerator, TransformerDecoder, TransformerEncoder

    assert keras.backend.backend() == backend

    # A small functional model whose layers share one generator: fit, save, reload.
    keras.utils.set_random_seed(0)
    gen = MetricGenerator(2, name="shared")
    inp = keras.Input((6, 8))
    h = DamchaAttention(2, 4, metric_generator=gen, seed=0, name="a0")(inp, inp)
    h = TransformerEncoder(16, 2, metric_generator=gen, name="enc")(h)
    h = TransformerDecoder(16, 2, metric_generator=gen, name="dec")(h)
    h = DamchaAttention(2, 4, metric_generator=gen, seed=1, name="a1")(h, h, use_causal_mask=True)
    model = keras.Model(inp, keras.layers.GlobalAveragePooling1D()(h))
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6, 8)).astype("float32"), rng.normal(size=(32, 8)).astype("float32")
    history = model.fit(x, y, epochs=3, batch_size=16, verbose=0)
    path = Path(workdir) / f"model-{backend}.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    before, after = (keras.ops.convert_to_numpy(m(x[:4])) for m in (model, loaded))
    users = [loaded.get_layer(n) for n in ("a0", "a1")] + [loaded.get_layer(n)._attention for n in ("enc", "dec")]
    shared_again = len({id(layer.metric_generators["qk"]) for layer in users}) == 1
    # Incremental decoding with a cache (token by token, bottom-right causal) equals one causal pass.
    import damcha_core as dc
    from damcha_conformance import case_params

    cfg = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, metric="lowrank", metric_rank=2, coupling="separate")
    params = case_params(cfg, 0)
    dec = DamchaAttention.from_canonical(params, cfg, dtype="float32")
    seq = rng.normal(size=(2, 5, 8)).astype("float32")
    step = lambda t, c, i: dec(t, t, use_causal_mask=True, cache=c, cache_update_index=i)  # noqa: E731
    if backend == "jax":
        import jax

        step = jax.jit(step)  # the index is traced: one compilation for every position
    cache, outs = dec.init_cache(2, 5), []
    for i in range(5):
        y, cache = step(seq[:, i : i + 1], cache, np.int32(i))
        outs.append(keras.ops.convert_to_numpy(y))
    from damcha_conformance import TOLERANCES

    _, decode_ratio = TOLERANCES["float32"].output_ratio(
        np.concatenate(outs, axis=1), dc.damcha_attention(params, cfg, seq, causal=True)
    )

    onnx_ok = None
    if backend == "torch":
        # Keras's own ONNX export (torch.onnx under the hood) of a model with open gates,
        # run in onnxruntime with a batch size the export never saw.
        import onnxruntime as ort

        inp = keras.Input((5, 8))
        out = DamchaAttention.from_canonical(params, cfg, dtype="float32")(inp, inp, use_causal_mask=True)
        exported = keras.Model(inp, out)
        exported(seq[:1])
        exported.export(str(Path(workdir) / "model.onnx"), format="onnx")
        session = ort.InferenceSession(str(Path(workdir) / "model.onnx"), providers=["CPUExecutionProvider"])
        got = session.run(None, {session.get_inputs()[0].name: seq})[0]
        onnx_ok = TOLERANCES["float32"].output_ratio(got, dc.damcha_attention(params, cfg, seq, causal=True))[1] <= 1.0

    saved_model_ok = None
    if backend == "jax":
        # model.export(format="tf_saved_model") goes through jax2tf with symbolic batch and
        # length: the layer's shape checks must not call int() on those dims.
        import tensorflow as tf

        inp = keras.Input((None, 8))
        out = DamchaAttention.from_canonical(params, cfg, dtype="float32")(inp, inp, use_causal_mask=True)
        keras.Model(inp, out).export(str(Path(workdir) / "sm"), format="tf_saved_model", verbose=False)
        served = tf.saved_model.load(str(Path(workdir) / "sm"))
        seq7 = rng.normal(size=(3, 7, 8)).astype("float32")
        got = served.serve(seq7).numpy()
        saved_model_ok = (
            TOLERANCES["float32"].output_ratio(got, dc.damcha_attention(params, cfg, seq7, causal=True))[1] <= 1.0
        )

    return {
        "nan_not_nan": nan_cases(DamchaAttention, keras, np),
        "mixed_precision_fit": mixed_precision_fit(DamchaAttention, keras, np),
        "quantized_vs_mha_mse": quantized_vs_mha(DamchaAttention, keras, np),
        "from_mha_copies": from_mha_copies(DamchaAttention, keras, np) if backend == "jax" else None,
        "torch_padding_path": torch_padding_path(DamchaAttention, keras, np) if backend == "torch" else None,
        "torch_causal_probe": torch_causal_probe(DamchaAttention, keras, np) if backend == "torch" else None,
        "torch_saved_recipes": torch_saved_recipes(DamchaAttention, keras, np) if backend == "torch" else None,
        "saved_model_export_matches": saved_model_ok,
        "onnx_export_matches": onnx_ok,
        "decode_within_float32_tolerance": decode_ratio <= 1.0,
        "backend": backend,
        "fit_loss_decreased": history.history["loss"][-1] < history.history["loss"][0],
        "reload_bit_exact": bool(np.array_equal(before, after)) and shared_again,
    }


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2])))
