"""The torch port's fast paths (issue 12): the ``is_causal`` hint, decoding, gates at 0.

Every fast path is checked against the path it replaces (outputs and gradients,
float64) and against damcha_core's reference; which kernels run is pinned by
counting dispatched aten calls (``benchmarks/_counts.py``), never by timing.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import damcha_core as dc
from damcha_conformance import case_params
from damcha_torch import DamchaAttention, DamchaKVCache, replace_mha
from damcha_torch import _functional as fn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _counts

E, H, D = 16, 4, 4


def _config(**kw) -> dc.DamchaConfig:
    return dc.DamchaConfig(query_dim=E, num_heads=H, key_dim=D, **{"metric": "heads", "coupling": "tied", **kw})


def _layer(cfg: dc.DamchaConfig, seed: int = 0) -> tuple[DamchaAttention, dict[str, np.ndarray]]:
    params = case_params(cfg, seed)  # open gates, non-zero biases
    return DamchaAttention.from_canonical(params, cfg, batch_first=True, dtype=torch.float64).eval(), params


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _causal(n: int, m: int, offset: int = 0, *, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """torch's convention: True (or -inf) = hidden; query i sees keys j <= offset + i."""
    hidden = torch.ones(n, m, dtype=torch.bool).triu(1 + offset)
    if dtype == torch.bool:
        return hidden
    return torch.zeros(n, m, dtype=dtype).masked_fill(hidden, float("-inf"))


def _run(layer: DamchaAttention, inputs: list[torch.Tensor], call) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(output, [grads of inputs..., canonical grads...]) of ``call(layer, *inputs)``."""
    layer = copy.deepcopy(layer)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = call(layer, *leaves)
    cot = _x(*out.shape, seed=99)
    (out * cot).sum().backward()
    grads = [t.grad for t in leaves] + [torch.from_numpy(g) for g in layer.canonical_grads().values()]
    return out.detach(), grads


def _assert_same(a, b) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    torch.testing.assert_close(out_a, out_b, rtol=1e-12, atol=1e-13)
    assert len(grads_a) == len(grads_b)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, rtol=1e-11, atol=1e-12)


MASK_DTYPES = {"bool": torch.bool, "float": torch.float64}


# ------------------------------------------------------------ the is_causal hint


@pytest.mark.parametrize("mask_dtype", list(MASK_DTYPES))
def test_hint_with_padding_equals_explicit_mask_and_reference(mask_dtype):
    cfg = _config()
    layer, params = _layer(cfg)
    B, N = 2, 6
    x = _x(B, N, E)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, 4:] = True
    causal = _causal(N, N, dtype=MASK_DTYPES[mask_dtype])

    def call(is_causal):
        return lambda m, t: m(t, t, t, key_padding_mask=pad, attn_mask=causal, is_causal=is_causal, need_weights=False)[
            0
        ]

    hint, explicit = _run(layer, [x], call(True)), _run(layer, [x], call(False))
    _assert_same(hint, explicit)
    keep = ~pad.numpy()[:, None, None, :]
    want = dc.damcha_attention(params, cfg, x.numpy(), mask=keep, causal=True)
    np.testing.assert_allclose(hint[0].numpy(), want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(("n", "m"), [(4, 7), (6, 4)], ids=["wide", "tall"])
def test_hint_cross_attention_rectangular_mask(n, m):
    """A rectangular causal mask is top-left (j <= i), as SDPA's is_causal."""
    cfg = _config(coupling="separate")
    layer, params = _layer(cfg, seed=1)
    x, c = _x(2, n, E, seed=1), _x(2, m, E, seed=2)
    causal = _causal(n, m)

    def call(is_causal):
        return lambda m, q, k: m(q, k, k, attn_mask=causal, is_causal=is_causal, need_weights=False)[0]

    hint, explicit = _run(layer, [x, c], call(True)), _run(layer, [x, c], call(False))
    _assert_same(hint, explicit)
    want = dc.damcha_attention(params, cfg, x.numpy(), c.numpy(), causal=True)
    np.testing.assert_allclose(hint[0].numpy(), want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 3], ids=["one-token", "chunk"])
def test_hint_with_kv_cache(chunk):
    """Prompt of P tokens, then a chunk whose (T, P+T) mask is bottom-right causal."""
    cfg = _config()
    layer, params = _layer(cfg, seed=2)
    P, T = 4, chunk
    x = _x(2, P + T, E, seed=3)
    mask = _causal(T, P + T, offset=P)

    def call(is_causal):
        def run(m, t):
            cache = DamchaKVCache()
            head = m(t[:, :P], t[:, :P], t[:, :P], is_causal=True, need_weights=False, kv_cache=cache)[0]
            step = t[:, P:]
            tail = m(step, step, step, attn_mask=mask, is_causal=is_causal, need_weights=False, kv_cache=cache)[0]
            return torch.cat([head, tail], dim=1)

        return run

    hint, explicit = _run(layer, [x], call(True)), _run(layer, [x], call(False))
    _assert_same(hint, explicit)
    want = dc.damcha_attention(params, cfg, x.numpy(), causal=True)
    np.testing.assert_allclose(hint[0].numpy(), want, rtol=1e-9, atol=1e-10)


def test_hint_unbatched():
    cfg = _config()
    layer, params = _layer(cfg, seed=3)
    N = 5
    x = _x(N, E, seed=4)
    pad = torch.tensor([False, False, False, False, True])
    causal = _causal(N, N, dtype=torch.float64)

    def call(is_causal):
        return lambda m, t: m(t, t, t, key_padding_mask=pad, attn_mask=causal, is_causal=is_causal, need_weights=False)[
            0
        ]

    hint, explicit = _run(layer, [x], call(True)), _run(layer, [x], call(False))
    _assert_same(hint, explicit)
    want = dc.damcha_attention(params, cfg, x.numpy()[None], mask=~pad.numpy()[None, None, None], causal=True)[0]
    np.testing.assert_allclose(hint[0].numpy(), want, rtol=1e-9, atol=1e-10)


def test_causal_mask_without_the_hint_is_applied():
    cfg = _config()
    layer, params = _layer(cfg, seed=4)
    x = _x(2, 6, E, seed=5)
    for mask_dtype in MASK_DTYPES.values():
        for need_weights in (False, True):
            out, _ = layer(x, x, x, attn_mask=_causal(6, 6, dtype=mask_dtype), need_weights=need_weights)
            want = dc.damcha_attention(params, cfg, x.numpy(), causal=True)
            np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-9, atol=1e-10)


def test_wrong_hint_is_the_causal_rule_alone_and_other_shapes_still_apply():
    """docs/torch.md: with is_causal=True a 2-D (N, M) attn_mask is not read
    (nn.MultiheadAttention leaves a wrong hint undefined; DAMCHA gives the
    causal rule alone, on every path); a (B, 1, 1, M) or (B*H, N, M) mask is
    applied together with the causal rule."""
    cfg = _config()
    layer, params = _layer(cfg, seed=5)
    B, N = 2, 6
    x = _x(B, N, E, seed=6)
    causal_only = dc.damcha_attention(params, cfg, x.numpy(), causal=True)
    not_causal = torch.zeros(N, N, dtype=torch.bool)
    not_causal[:, 0] = True  # hides key 0: not the causal mask
    for need_weights in (False, True):
        out, _ = layer(x, x, x, attn_mask=not_causal, is_causal=True, need_weights=need_weights)
        np.testing.assert_allclose(out.detach().numpy(), causal_only, rtol=1e-9, atol=1e-10)
    keep = np.ones((B, 1, 1, N), dtype=bool)
    keep[0, ..., 3:] = False
    both = dc.damcha_attention(params, cfg, x.numpy(), mask=keep, causal=True)
    per_batch = torch.from_numpy(~keep)
    per_head = per_batch.expand(B, H, N, N).reshape(B * H, N, N)
    for mask in (per_batch, per_head):
        for need_weights in (False, True):
            out, _ = layer(x, x, x, attn_mask=mask, is_causal=True, need_weights=need_weights)
            np.testing.assert_allclose(out.detach().numpy(), both, rtol=1e-9, atol=1e-10)


# ------------------------------------------------------------ which kernel runs


def _sdpa(fn) -> list[tuple[bool, bool]]:
    return [(c["is_causal"], c["has_mask"]) for c in _counts.torch_sdpa_calls(fn)]


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("mask_dtype", list(MASK_DTYPES))
def test_hint_reaches_sdpa_as_is_causal_without_a_mask(grad, mask_dtype):
    cfg = _config()
    layer, _ = _layer(cfg)
    layer.float()
    x = _x(2, 8, E).float().requires_grad_(grad)
    causal = _causal(8, 8, dtype=torch.float32 if mask_dtype == "float" else torch.bool)

    def call():
        with torch.set_grad_enabled(grad):
            out = layer(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
            if grad:
                out.sum().backward()

    assert _sdpa(call) == [(True, False)]

    def explicit():
        with torch.set_grad_enabled(grad):
            layer(x, x, x, attn_mask=causal, need_weights=False)

    assert _sdpa(explicit) == [(False, True)]  # without the hint the mask goes to SDPA


def _encoder(decoder: bool = False) -> nn.Module:
    torch.manual_seed(0)
    kw = dict(dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=True)
    if decoder:
        stack = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, **kw), 2)
    else:
        stack = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, **kw), 2, enable_nested_tensor=False)
    model = replace_mha(stack.double())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "metric_gates" in name:
                p.fill_(0.5)
    return model


@pytest.mark.parametrize("is_causal", [True, None], ids=["hint", "detected"])
def test_transformer_encoder_after_replace_mha_uses_the_causal_kernel(is_causal):
    """nn.TransformerEncoder passes its mask with is_causal (given, or found by
    _detect_is_causal_mask): every layer's SDPA call is the causal kernel, and
    the result (outputs, gradients) equals the explicit-mask run."""
    model = _encoder()
    N = 6
    x = _x(2, N, E, seed=7)
    mask = nn.Transformer.generate_square_subsequent_mask(N, dtype=torch.float64)
    pad = torch.zeros(2, N, dtype=torch.float64)  # float like the mask (torch warns on mixed types)
    pad[1, -2:] = float("-inf")

    def run(m, t, causal=is_causal, **kw):
        return m(t, mask=mask, is_causal=causal, **kw)

    calls = _sdpa(lambda: run(model, x))
    assert calls == [(True, False)] * 2
    with_pad = _sdpa(lambda: run(model, x, src_key_padding_mask=pad))
    assert with_pad == [(False, True)] * 2  # padding needs an explicit mask, as in nn.MultiheadAttention

    def plain(m):
        return [p for n, p in m.named_parameters()]

    for kw in ({}, {"src_key_padding_mask": pad}):
        results = []
        for causal in (is_causal, False):
            m = copy.deepcopy(model)
            t = x.clone().requires_grad_(True)
            out = run(m, t, causal=causal, **kw)
            out.square().sum().backward()
            results.append((out.detach(), [t.grad] + [p.grad for p in plain(m)]))
        _assert_same(*results)


@pytest.mark.parametrize("is_causal", [True, None], ids=["hint", "detected"])
def test_transformer_decoder_after_replace_mha_uses_the_causal_kernel(is_causal):
    model = _encoder(decoder=True)
    N, M = 5, 7
    tgt, memory = _x(2, N, E, seed=8), _x(2, M, E, seed=9)
    mask = nn.Transformer.generate_square_subsequent_mask(N, dtype=torch.float64)
    calls = _sdpa(lambda: model(tgt, memory, tgt_mask=mask, tgt_is_causal=is_causal))
    # Per layer: self-attention with the causal kernel, cross-attention with no mask.
    assert calls == [(True, False), (False, False)] * 2
    hint = model(tgt, memory, tgt_mask=mask, tgt_is_causal=is_causal)
    explicit = model(tgt, memory, tgt_mask=mask, tgt_is_causal=False)
    torch.testing.assert_close(hint, explicit, rtol=1e-12, atol=1e-13)


# ------------------------------------------------------------ decoding at B = 1

# A decode step's aten calls (views included) may exceed the hand-written MHA
# step's by at most this many, both appending to a DamchaKVCache (14: packed
# linear, SDPA, output linear and their views; per cache tensor a narrow and a
# copy_ for the in-place write and a narrow for the view of the cached
# positions). The usual MHA step with two cats makes 10: the margin over it is
# 4 more (the in-place writes' views). Metric "none" makes MHA's 14 (q, k, v cut out of the packed
# projection by one as_strided each, the NaN guard in place of MHA's transpose).
# Per generator: its GEMM, the bias and phi scaling (addcdiv), the gate product
# (the gate's (S, 1) view is kept by the layer) and one view; phi's norm
# (vector_norm, hypot) once; one baddbmm per side with a view of its input and
# of its output, or one for both when tied with one token (A read twice by an
# as_strided, q and k split by a view and an unbind). Separate coupling scales
# and gates both sides with one foreach call each.
# Measured when written: none 14, heads-tied 22, heads-separate 26, heads-query
# 22 (24, 30 and 23 before the gate views were kept and the tied product lost
# its expand; separate 28 before the foreach calls). Without caching values
# derived from the parameters (see the .data tests below) this is the floor
# of the map: norm, hypot, GEMM, scaling, gate product, batched product.
DECODE_MARGIN = {"none": 0, "heads-tied": 8, "heads-separate": 12, "heads-query": 8}
# With the C kernel (damcha_torch._headmix, the default on CPU where it was
# built) every map of a step is one call outside the dispatcher: no aten op
# for the map at all, only the kernel's output buffer (empty) and its two
# views (q~ and k~, or one per mapped side).
# Measured when written: heads-tied 16, heads-separate 16, heads-query 15.
KERNEL_MARGIN = {"none": 0, "heads-tied": 2, "heads-separate": 2, "heads-query": 1}
DECODE_CONFIGS = {
    "none": dict(metric="none"),
    "heads-tied": dict(metric="heads", coupling="tied"),
    "heads-separate": dict(metric="heads", coupling="separate"),
    "heads-query": dict(metric="heads", coupling="query"),
}


def _decode_pair(name: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True, dtype=dtype).eval()
    layer = DamchaAttention.from_mha(mha, **DECODE_CONFIGS[name]).eval()
    with torch.no_grad():
        for gate in layer.metric_gates.values():
            gate.fill_(0.5)
    g = torch.Generator().manual_seed(1)
    return (
        mha,
        layer,
        torch.randn(1, 6, 32, generator=g, dtype=dtype),
        torch.randn(1, 4, 1, 32, generator=g, dtype=dtype),
    )


@pytest.mark.parametrize("name", list(DECODE_CONFIGS))
def test_decode_step_aten_calls_stay_near_the_mha_step(name, decode_kernel):
    mha, layer, prompt, tokens = _decode_pair(name)
    mha_caches, cache = ([], DamchaKVCache()), DamchaKVCache()
    with torch.inference_mode():
        for c in mha_caches:
            _counts.mha_decode_step(mha, prompt, c)
        layer(prompt, prompt, prompt, is_causal=True, need_weights=False, kv_cache=cache)
        for t in tokens.unbind(1)[:2]:  # the first step records the shapes, the second the fused generator weight
            layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)
            for c in mha_caches:
                _counts.mha_decode_step(mha, t, c)
    t = tokens[:, 2]

    def damcha_step():
        with torch.inference_mode():
            return layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0]

    def mha_step(c):
        with torch.inference_mode():
            return _counts.mha_decode_step(mha, t, c)

    ours = _counts.torch_op_counts(damcha_step)
    cat, theirs = (_counts.torch_op_counts(lambda c=c: mha_step(c)) for c in mha_caches)
    assert sum(cat.values()) == 10 and cat["aten.cat"] == 2, cat
    assert sum(theirs.values()) == 14 and theirs["aten.copy_"] == 2 and "aten.cat" not in theirs, theirs
    table = _counts.side_by_side({"mha, cat": cat, "mha, preallocated": theirs, "damcha": ours})
    margin = KERNEL_MARGIN[name] if decode_kernel == "c-kernel" else DECODE_MARGIN[name]
    assert sum(ours.values()) <= sum(theirs.values()) + margin, table
    assert sum(ours.values()) <= sum(cat.values()) + 4 + margin, table
    # Only the new token is copied: no cat, two copies of one position each.
    assert "aten.cat" not in ours and ours["aten.copy_"] == 2, table
    assert ours["aten.scaled_dot_product_attention"] == 1
    if decode_kernel == "c-kernel":
        # The map is the kernel's: no generator GEMM, norm, scaling or product in aten.
        assert ours["aten.linear"] == theirs["aten.linear"], table
        assert not {"aten.baddbmm", "aten.mul", "aten.addcdiv", "aten.linalg_vector_norm"} & set(ours), table
        assert ours["aten.empty"] == (name != "none"), table
        return
    generators = {"none": 0, "heads-tied": 1, "heads-separate": 2, "heads-query": 1}[name]
    assert ours["aten.linear"] == theirs["aten.linear"] + generators  # tied q and k: one generator GEMM
    # The head mix: one batched product (q and k together when tied), one gate product per generator.
    assert ours["aten.baddbmm"] == generators
    if name == "heads-separate":  # both sides' scaling and gate products: one foreach call each
        assert ours["aten._foreach_addcdiv"] == ours["aten._foreach_mul"] == 1, table
        assert "aten.mul" not in ours and "aten.addcdiv" not in ours, table
    else:
        assert ours["aten.mul"] == generators


@pytest.mark.parametrize("name", list(DECODE_CONFIGS))
def test_decode_fast_step_equals_general_path_and_reference(name, decode_kernel):
    """The flat decoding path (inference, shapes seen) computes what the
    general path computes (autograd on, the hint mask given), and the
    reference's causal forward (float64)."""
    _, layer, prompt, tokens = _decode_pair(name, torch.float64)
    x = torch.cat([prompt, tokens.flatten(1, 2)], dim=1)
    outs = {}
    for grad in (False, True):
        cache, steps = DamchaKVCache(), []
        with torch.set_grad_enabled(grad):
            for t in [prompt] + list(tokens.unbind(1)):
                hint = {"attn_mask": _causal(t.shape[1], len(cache) + t.shape[1])} if grad else {}
                steps.append(layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache, **hint)[0])
        outs[grad] = torch.cat(steps, dim=1).detach()
    torch.testing.assert_close(outs[False], outs[True], rtol=1e-13, atol=1e-14)
    want = dc.damcha_attention(layer.to_canonical(), layer.config, x.numpy(), causal=True)
    np.testing.assert_allclose(outs[False].numpy(), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
@pytest.mark.parametrize("name", list(DECODE_CONFIGS))
def test_decode_fast_step_batched_and_chunks_equal_general_path(name, batch_first, decode_kernel):
    """The flat path's strided reads of q, k, v out of the packed projection
    hold for B > 1 and for chunks of N > 1 tokens (causal on an empty cache,
    then non-causal chunks appended), in both layouts: it is taken (counted)
    and equals the general path (autograd on), float64."""
    kw = DECODE_CONFIGS[name]
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=batch_first, dtype=torch.float64).eval()
    layer = DamchaAttention.from_mha(mha, **kw).eval()
    with torch.no_grad():
        for gate in layer.metric_gates.values():
            gate.uniform_(-1.0, 1.0)
    calls = []
    for B, N in ((3, 1), (2, 3)):
        steps = [_x(B, N, 32, seed=20 + i) for i in range(4)]
        if not batch_first:
            steps = [t.transpose(0, 1) for t in steps]
        outs = {}
        for grad in (False, True):
            cache, got = DamchaKVCache(), []
            for i, t in enumerate(steps):
                causal = i == 0 or N == 1  # later chunks attend to every cached key

                def step(t=t, causal=causal, cache=cache, grad=grad):
                    with torch.set_grad_enabled(grad):
                        return layer(t, t, t, is_causal=causal, need_weights=False, kv_cache=cache)[0]

                if grad:
                    got.append(step().detach())
                else:
                    counts = _counts.torch_op_counts(lambda got=got, step=step: got.append(step()))
                    calls.append(counts["aten.as_strided"])
            outs[grad] = torch.cat(got)
        torch.testing.assert_close(outs[False], outs[True], rtol=1e-12, atol=1e-13)
    # Every step after the first of each shape takes the flat path (as_strided is its own).
    assert calls[0] == 0 and calls[4] == 0 and all(c > 0 for c in calls[1:4] + calls[5:]), calls


@pytest.mark.parametrize("name", [n for n in DECODE_CONFIGS if n != "none"])
def test_decode_step_of_several_tokens_gives_every_gemm_its_bias(name, monkeypatch):
    """On the torch-ops path (CUDA, or a build without the C kernel), with
    B * N > 1 tokens each generator GEMM of the flat step gets a bias
    (a constant zero; b is added with the phi scaling after), as the
    projections' linears have theirs: on CPU MKL runs a bias-free GEMM of a
    few rows (beta = 0) in two OpenMP parallel regions and one with a bias in
    one, and at 2 threads each region of such a tiny op costs more than the
    op. No op more. Structure only: the values are the batched test's above."""
    monkeypatch.setattr(fn, "_HEADMIX", None)
    _, layer, prompt, _ = _decode_pair(name, torch.float64)
    cache = DamchaKVCache()
    steps = [_x(3, 1, 32, seed=30 + i) for i in range(3)]  # float64
    gemms: list[tuple[str, bool]] = []

    def record(func, args, kwargs):
        op = func._schema.name
        if op in ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul"):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            gemms.append((op, bias is not None))

    with torch.inference_mode():
        p = prompt.expand(3, -1, -1)
        layer(p, p, p, is_causal=True, need_weights=False, kv_cache=cache)
        for t in steps[:2]:  # the first records the shape
            layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)
        with _counts._recorder(record):
            layer(steps[2], steps[2], steps[2], is_causal=True, need_weights=False, kv_cache=cache)
    generators = 2 if name == "heads-separate" else 1
    # The packed projection, the generators and the output, each with a bias.
    assert gemms == [("aten::linear", True)] * (2 + generators), gemms


def _two_primed_decoders():
    """A float64 separate-coupling layer and its deep copy, each with its own cache
    after a prompt and two one-token steps (the flat step's state recorded)."""
    _, layer, prompt, tokens = _decode_pair("heads-separate", torch.float64)
    ref = copy.deepcopy(layer)
    caches = [DamchaKVCache(), DamchaKVCache()]
    with torch.inference_mode():
        for model, cache in zip((layer, ref), caches):
            model(prompt, prompt, prompt, is_causal=True, need_weights=False, kv_cache=cache)
            for t in tokens.unbind(1)[:2]:
                model(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)
    return layer, ref, caches, tokens


def _fast_step_equals_general(layer, ref, caches, t):
    """One more token: ``layer``'s flat step (inference mode) equals ``ref``'s general path."""
    with torch.inference_mode():
        fast = layer(t, t, t, is_causal=True, need_weights=False, kv_cache=caches[0])[0]
    with torch.enable_grad():  # the general path
        general = ref(t, t, t, is_causal=True, need_weights=False, kv_cache=caches[1])[0]
    torch.testing.assert_close(fast, general.detach(), rtol=1e-13, atol=1e-14)


def test_decode_fast_path_sees_parameters_written_through_data():
    """Nothing derived from the parameters is kept between steps: a gate or a
    generator weight changed through ``.data`` (which bumps no version
    counter: an EMA update, a gate set by hand) is used by the next step."""
    layer, ref, caches, tokens = _two_primed_decoders()
    for model in (layer, ref):
        model.metric_gates["k"].data.mul_(-3.0)
        model.metric_generators["q"].weight.data.add_(0.25)
    _fast_step_equals_general(layer, ref, caches, tokens[:, 3])


@pytest.mark.parametrize("how", ["copy_", "data-assign", "load-state-dict", "assign", "to-and-back"])
def test_decode_fast_path_gate_views_follow_every_kind_of_write(how):
    """The flat step keeps views of the gates between steps (one aten call less
    per generator): each way of changing a gate reaches the next step, whether
    it writes in place (copy_, load_state_dict) or gives the gate other
    storage or another object (``.data = ...``, ``assign=True``, ``.to()``)."""
    layer, ref, caches, tokens = _two_primed_decoders()
    new = {"metric_gates.q": torch.tensor([0.3, -0.7, 1.1, 0.2], dtype=torch.float64)}
    for model in (layer, ref):
        gate = model.metric_gates["q"]
        if how == "copy_":
            with torch.no_grad():
                gate.copy_(new["metric_gates.q"])
        elif how == "data-assign":
            gate.data = new["metric_gates.q"].clone()
        elif how in ("load-state-dict", "assign"):
            model.load_state_dict(new, strict=False, assign=how == "assign")
        else:  # new storage for every parameter, then a write into it
            model.float().double()
            with torch.no_grad():
                model.metric_gates["q"].copy_(new["metric_gates.q"])
    assert torch.equal(layer.metric_gates["q"].detach(), new["metric_gates.q"])
    _fast_step_equals_general(layer, ref, caches, tokens[:, 3])
    assert len(layer.__dict__["_gate_columns"]) == 2  # the flat path ran


def test_decode_fast_path_is_taken_with_the_hint_mask():
    """A one-token step with attn_mask (1, P + 1) and is_causal=True takes the
    flat path too (same aten calls as without the mask)."""
    _, layer, prompt, tokens = _decode_pair("heads-tied")
    cache = DamchaKVCache()
    with torch.inference_mode():
        layer(prompt, prompt, prompt, is_causal=True, need_weights=False, kv_cache=cache)
        for t in tokens.unbind(1)[:2]:
            layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)
    t = tokens[:, 2]
    counts = []
    for kw in ({}, {"attn_mask": _causal(1, 9)}):
        c = copy.deepcopy(cache)

        def step(c=c, kw=kw):
            with torch.inference_mode():
                return layer(t, t, t, is_causal=True, need_weights=False, kv_cache=c, **kw)[0]

        counts.append(_counts.torch_op_counts(step))
    assert counts[0] == counts[1]


# ------------------------------------------------------------ gates at 0: MHA to the bit

ZERO_GATE_CONFIGS = {
    "heads-tied": dict(metric="heads", coupling="tied"),
    "heads-separate": dict(metric="heads", coupling="separate"),
    "lowrank": dict(metric="lowrank", metric_rank=2),
}


@pytest.fixture
def matmul_precision(request):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(request.param)
    yield request.param
    torch.set_float32_matmul_precision(before)


# "medium" lets float32 GEMMs run in bfloat16 (on CPUs with AVX512-BF16/AMX as
# on GPUs with TF32): there (I + 0) y != y, while y + 0 y == y.
PRECISIONS = ["highest", "medium"]


@pytest.mark.parametrize("matmul_precision", PRECISIONS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(ZERO_GATE_CONFIGS))
def test_fresh_layer_is_mha_bit_for_bit(name, dtype, matmul_precision):
    """The map is computed in residual form, y + (diag(g) A) y, so gates at 0
    give q and k unchanged to the bit (a folded I + diag(g) A would round y in
    a reduced-precision GEMM): a converted layer equals nn.MultiheadAttention
    exactly, on its explicit and fused paths, in training and eval mode."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True, dtype=dtype)
    layer = DamchaAttention.from_mha(mha, **ZERO_GATE_CONFIGS[name])
    x = torch.randn(2, 7, 32, dtype=dtype)
    causal = _causal(7, 7)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    calls = {
        "hint": dict(attn_mask=causal, is_causal=True),
        "mask": dict(attn_mask=causal),
        "padding": dict(key_padding_mask=pad),
        "none": {},
    }
    for train in (True, False):
        mha.train(train), layer.train(train)
        for what, kw in calls.items():
            want = mha(x, x, x, need_weights=False, **kw)[0]
            got = layer(x, x, x, need_weights=False, **kw)[0]
            assert torch.equal(got, want), (train, what, (got - want).abs().max())


@pytest.mark.parametrize("name", list(ZERO_GATE_CONFIGS)[:2])
def test_fresh_layer_decode_step_is_the_mha_step_bit_for_bit(name):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    layer = DamchaAttention.from_mha(mha, **ZERO_GATE_CONFIGS[name]).eval()
    x = torch.randn(1, 9, 32)
    mha_cache, cache = [], DamchaKVCache()
    with torch.inference_mode():
        want = [_counts.mha_decode_step(mha, x[:, :5], mha_cache)]
        got = [layer(x[:, :5], x[:, :5], x[:, :5], is_causal=True, need_weights=False, kv_cache=cache)[0]]
        for i in range(5, 9):  # the later steps take the flat path
            t = x[:, i : i + 1]
            want.append(_counts.mha_decode_step(mha, t, mha_cache))
            got.append(layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0])
    assert torch.equal(torch.cat(got, 1), torch.cat(want, 1))


@pytest.mark.parametrize("matmul_precision", PRECISIONS, indirect=True)
@pytest.mark.parametrize("name", list(ZERO_GATE_CONFIGS))
def test_zero_gate_map_returns_its_input_bit_for_bit(name, matmul_precision):
    """apply_map itself: with gates 0 q~ is q and k~ is k, to the bit."""
    from damcha_torch import _functional as fn

    torch.manual_seed(1)
    layer = DamchaAttention(32, 4, batch_first=True, **ZERO_GATE_CONFIGS[name])
    for gen in layer.metric_generators.values():
        gen.reset_parameters()  # non-zero generator weights: only the gate is 0
    w = layer._weights()
    tokens = torch.randn(2, 40, 32) * 3
    q, k = torch.randn(2, 40, 4, 8) * 5, torch.randn(2, 40, 4, 8) * 5
    for side in w.sides.values():
        for y, y_mapped in zip((q, k), fn.apply_map_weights(side, tokens, (q, k))):
            assert torch.equal(y_mapped, y)


def test_compiled_decode_with_the_hint_mask_equals_eager():
    """torch.compile (fullgraph) of a decoding loop that passes the hint's
    (1, P + 1) mask with is_causal=True: the shape check traces (no value is
    read), and the steps equal the eager full causal forward."""
    cfg = _config()
    layer, params = _layer(cfg, seed=6)
    x = _x(2, 4, E, seed=10)
    torch._dynamo.reset()
    step = torch.compile(layer, fullgraph=True, backend="aot_eager")
    cache, outs = DamchaKVCache(), []
    with torch.no_grad():
        for i in range(x.shape[1]):
            t = x[:, i : i + 1]
            outs.append(
                step(
                    t, t, t, attn_mask=_causal(1, i + 1, offset=i), is_causal=True, need_weights=False, kv_cache=cache
                )[0]
            )
    want = dc.damcha_attention(params, cfg, x.numpy(), causal=True)
    np.testing.assert_allclose(torch.cat(outs, dim=1).numpy(), want, rtol=1e-9, atol=1e-10)


# ------------------------------------------------ training: fused projections and maps

# Training with recompute (the default) projects and maps with one autograd node
# per projection GEMM (damcha_torch._models_fused: SplitLinearMaps, FusedProjectionMaps); with
# recompute=False the composite path stores its intermediates. Both must give
# the reference's outputs and the same gradients. "call": self-attention, cross
# with one tensor for key and value (one k/v GEMM), or cross with key and value
# inputs of other sizes (three projection weights).
TRAIN_CASES = {
    "tied": ({}, "self"),
    "separate": ({"coupling": "separate"}, "self"),
    "query": ({"coupling": "query"}, "self"),
    "gqa-separate": ({"coupling": "separate", "num_kv_heads": 2}, "self"),
    "no-bias": ({"use_bias": False}, "self"),
    "cross-tied": ({}, "cross"),
    "cross-separate": ({"coupling": "separate"}, "cross"),
    "cross-kdim-vdim": ({"coupling": "separate", "context_dim": 12, "value_input_dim": 10}, "cross-kv"),
}


def _train_inputs(cfg: dc.DamchaConfig, call: str, n: int = 6, m: int = 4) -> list[torch.Tensor]:
    x = _x(2, n, E, seed=20)
    if call == "self":
        return [x]
    if call == "cross":
        return [x, _x(2, m, E, seed=21)]
    return [x, _x(2, m, cfg.context_dim, seed=21), _x(2, m, cfg.value_input_dim, seed=22)]


def _train_call(call: str, *, is_causal: bool = True, **kw):
    def run(layer, x, *rest):
        if call == "self":
            key = value = x
        elif call == "cross":
            key = value = rest[0]  # one tensor: nn.MultiheadAttention users' cross-attention
        else:
            key, value = rest
        return layer(x, key, value, need_weights=False, is_causal=is_causal, **kw)[0]

    return run


def _train_layer(cfg: dc.DamchaConfig, recompute: bool, **kw) -> tuple[DamchaAttention, dict[str, np.ndarray]]:
    params = case_params(cfg, 3)  # open gates, non-zero biases
    layer = DamchaAttention.from_canonical(params, cfg, dtype=torch.float64, recompute=recompute, **kw)
    return layer.train(), params  # dropout 0: training differs from eval only by the recompute path


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_training_fused_path_equals_stored_path_and_reference(case):
    overrides, call = TRAIN_CASES[case]
    cfg = _config(**overrides)
    inputs = _train_inputs(cfg, call)
    fused, params = _train_layer(cfg, True, batch_first=True)
    stored, _ = _train_layer(cfg, False, batch_first=True)
    got = _run(fused, inputs, _train_call(call))
    _assert_same(got, _run(stored, inputs, _train_call(call)))
    x, *rest = (t.numpy() for t in inputs)
    context = rest[0] if rest else None
    value = rest[1] if len(rest) > 1 else None
    want = dc.damcha_attention(params, cfg, x, context, causal=True, value=value)
    np.testing.assert_allclose(got[0].numpy(), want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("layout", ["batch-first", "sequence-first"])
@pytest.mark.parametrize("case", ["tied", "cross-tied", "cross-separate"])
def test_training_store_mode_takes_the_product_from_the_projection_gemm(case, layout):
    """With at least as many tokens as the joined weight has rows, a store-mode
    node with one metric side makes the generator's product t W^T as the
    last S*S columns of its projection GEMM (one GEMM, where the product
    alone, 64 columns at E = 512, ran well below the GEMM rate): each
    projection GEMM S*S wider and no other GEMM in forward but the output
    projection's. Outputs and gradients equal the stored path's and the
    output the reference's. (Fails on the old code: its forward ran the
    products' own GEMMs.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    overrides, call = TRAIN_CASES[case]
    cfg = _config(**overrides)
    # 64 query tokens >= 3E + H*H = 64 rows (the packed node); 48 context tokens >= 2E + H*H = 48
    inputs = _train_inputs(cfg, call, n=32, m=24)
    run = _train_call(call)
    if layout == "sequence-first":

        def wrapped(layer, *ts):
            return run(layer, *(t.transpose(0, 1) for t in ts)).transpose(0, 1)

    else:
        wrapped = run

    class Widths(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.widths: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm, torch.ops.aten.bmm):
                self.widths.append(out.shape[-1])
            return out

    fused, params = _train_layer(cfg, True, batch_first=layout == "batch-first")
    stored, _ = _train_layer(cfg, False, batch_first=layout == "batch-first")
    layer = copy.deepcopy(fused)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    with Widths() as mode:
        wrapped(layer, *leaves)
    S2 = H * H
    # The projections' GEMMs with the product's columns, and the output projection (E).
    joined = [3 * E + S2] if call == "self" else [E + S2, 2 * E + S2]
    assert sorted(mode.widths) == sorted([*joined, E]), mode.widths
    got = _run(fused, inputs, wrapped)
    _assert_same(got, _run(stored, inputs, wrapped))
    x, *rest = (t.numpy() for t in inputs)
    want = dc.damcha_attention(params, cfg, x, rest[0] if rest else None, causal=True)
    np.testing.assert_allclose(got[0].numpy(), want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("case", ["tied", "cross-tied"])
def test_training_fused_path_with_padding_and_sequence_first_inputs(case):
    """key_padding_mask + the causal hint, (N, B, E) inputs (the layer's views
    of one key/value tensor must still share one k/v GEMM) and a batch whose
    first key is padded (a query row with no visible key: output bias, finite
    gradients)."""
    overrides, call = TRAIN_CASES[case]
    cfg = _config(**overrides)
    inputs = _train_inputs(cfg, call)
    m = inputs[-1].shape[1]
    pad = torch.zeros(2, m, dtype=torch.bool)
    pad[1, :2] = True
    causal = _causal(inputs[0].shape[1], m)
    run = _train_call(call, key_padding_mask=pad, attn_mask=causal)

    def seq_first(layer, *ts):
        return run(layer, *(t.transpose(0, 1) for t in ts)).transpose(0, 1)

    fused, params = _train_layer(cfg, True)
    stored, _ = _train_layer(cfg, False)
    got = _run(fused, inputs, seq_first)
    _assert_same(got, _run(stored, inputs, seq_first))
    assert all(torch.isfinite(g).all() for g in got[1])
    x, *rest = (t.numpy() for t in inputs)
    keep = ~pad.numpy()[:, None, None, :]
    want = dc.damcha_attention(params, cfg, x, rest[0] if rest else None, mask=keep, causal=True)
    np.testing.assert_allclose(got[0].numpy(), want, rtol=1e-9, atol=1e-10)


def _tiny_train_layer(overrides: dict) -> DamchaAttention:
    cfg = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, metric="heads", **{"coupling": "tied", **overrides})
    return DamchaAttention.from_canonical(case_params(cfg, 4), cfg, batch_first=True, dtype=torch.float64).train()


def _functional_layer(layer: DamchaAttention, call: str, need_weights: bool):
    """(leaves, f): f(*leaves) is the layer's output as a function of its
    inputs and every parameter (torch.func.functional_call)."""
    from torch.func import functional_call

    names = [n for n, _ in layer.named_parameters()]
    x, c = _x(1, 3, 8, seed=30), _x(1, 2, 8, seed=31)
    inputs = [x] if call == "self" else [x, c]
    leaves = [t.requires_grad_(True) for t in inputs] + [
        p.detach().clone().requires_grad_(True) for p in layer.parameters()
    ]

    def f(*args):
        tensors, params = args[: len(inputs)], dict(zip(names, args[len(inputs) :]))
        key = tensors[-1]
        out = functional_call(layer, params, (tensors[0], key, key), {"need_weights": need_weights, "is_causal": True})
        return out[0]

    return leaves, f


@pytest.mark.parametrize("case", ["tied", "separate", "cross-tied"])
def test_training_fused_path_gradcheck_and_double_backward(case):
    """The fused node's derivatives (inputs and every parameter) by finite
    differences (fast mode: random directions, which any wrong entry of the
    Jacobian fails): first order through the fused SDPA call; second order
    (a gradient penalty) with need_weights=True, whose explicit softmax is
    twice differentiable (the CPU SDPA kernel has no double backward)."""
    overrides, call = TRAIN_CASES[case]
    layer = _tiny_train_layer(overrides)
    leaves, f = _functional_layer(layer, call, need_weights=False)
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, fast_mode=True)
    leaves, f = _functional_layer(layer, call, need_weights=True)
    assert torch.autograd.gradgradcheck(f, leaves, eps=1e-6, atol=1e-6, fast_mode=True)


# Store mode (the default on CPU): the fused nodes keep each projection's output
# unmapped and SDPA saves q~ and k~ as their recipes (made again in backward from
# it), so backward projects nothing again. Under saved-tensor hooks of the
# caller's (checkpoint, save_on_cpu) the nodes map in place and backward
# projects the mapped rows again. Both equal the stored path.
@pytest.mark.parametrize("case", ["tied", "gqa-separate", "cross-tied", "cross-kdim-vdim"])
@pytest.mark.parametrize("hooks", ["none", "save_on_cpu", "checkpoint"])
def test_training_store_mode_and_in_place_nodes_equal_stored_path(case, hooks):
    overrides, call = TRAIN_CASES[case]
    cfg = _config(**overrides)
    inputs = _train_inputs(cfg, call)
    run = _train_call(call)

    def wrapped(layer, *ts):
        if hooks == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                return run(layer, *ts)
        if hooks == "checkpoint":
            return torch.utils.checkpoint.checkpoint(run, layer, *ts, use_reentrant=False)
        return run(layer, *ts)

    fused, _ = _train_layer(cfg, True, batch_first=True)
    stored, _ = _train_layer(cfg, False, batch_first=True)
    _assert_same(_run(fused, inputs, wrapped), _run(stored, inputs, run))


@pytest.mark.parametrize("case", ["tied", "cross-tied"])
def test_training_store_mode_backward_twice_with_retain_graph(case):
    """The coefficients made for the recomputed q~/k~ are let go after the node's
    backward; a second backward over the same graph makes them again and
    gives the same gradients."""
    overrides, call = TRAIN_CASES[case]
    cfg = _config(**overrides)
    layer, _ = _train_layer(cfg, True, batch_first=True)
    leaves = [t.requires_grad_(True) for t in _train_inputs(cfg, call)]
    out = _train_call(call)(layer, *leaves).sum()
    first = torch.autograd.grad(out, [*leaves, *layer.parameters()], retain_graph=True)
    second = torch.autograd.grad(out, [*leaves, *layer.parameters()])
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["tied", "separate", "cross-tied", "cross-kdim-vdim"])
def test_training_sequence_first_equals_batch_first(case):
    """batch_first=False projects the (N, B, E) tokens in their own order (no
    copy into batch-first order) and gives SDPA permuted views: outputs and
    gradients equal batch_first=True's, with a padding mask and the hint."""
    overrides, call = TRAIN_CASES[case]
    cfg = _config(**overrides)
    inputs = _train_inputs(cfg, call)
    m = inputs[-1].shape[1]
    pad = torch.zeros(2, m, dtype=torch.bool)
    pad[1, -1] = True
    run = _train_call(call, key_padding_mask=pad, attn_mask=_causal(inputs[0].shape[1], m))

    def seq_first(layer, *ts):
        return run(layer, *(t.transpose(0, 1) for t in ts)).transpose(0, 1)

    batch, _ = _train_layer(cfg, True, batch_first=True)
    seq, _ = _train_layer(cfg, True, batch_first=False)
    _assert_same(_run(seq, inputs, seq_first), _run(batch, inputs, run))


@pytest.mark.parametrize("first_key", ["kept", "padded"])
@pytest.mark.parametrize("case", ["tied", "cross-tied"])
def test_padding_with_the_hint_with_and_without_empty_rows(case, first_key):
    """With the causal rule every query sees key 0, so a padding mask that keeps
    each sequence's first key leaves no row empty (the forward then skips
    unhiding and zeroing rows); one that pads it empties the first rows of
    that sequence (attention output 0 there: y = out_proj.bias, finite
    gradients). Fused and explicit (need_weights=True) paths agree in outputs
    and gradients, and outputs equal the reference."""
    overrides, call = TRAIN_CASES[case]
    cfg = _config(**overrides)
    inputs = _train_inputs(cfg, call)
    n, m = inputs[0].shape[1], inputs[-1].shape[1]
    pad = torch.zeros(2, m, dtype=torch.bool)
    pad[1, -1] = True
    if first_key == "padded":
        pad[1, :2] = True
    layer, params = _train_layer(cfg, True, batch_first=True)
    fused = _run(layer, inputs, _train_call(call, key_padding_mask=pad, attn_mask=_causal(n, m)))

    def explicit(layer, *ts):
        x, key = ts[0], ts[-1]
        return layer(x, key, key, key_padding_mask=pad, is_causal=True, need_weights=True)[0]

    _assert_same(fused, _run(layer, inputs, explicit))
    assert all(torch.isfinite(g).all() for g in fused[1])
    if first_key == "padded":
        torch.testing.assert_close(fused[0][1, :2], layer.out_proj.bias.detach().expand(2, E), rtol=0, atol=1e-15)
    x, *rest = (t.numpy() for t in inputs)
    keep = ~pad.numpy()[:, None, None, :]
    want = dc.damcha_attention(params, cfg, x, rest[0] if rest else None, mask=keep, causal=True)
    np.testing.assert_allclose(fused[0].numpy(), want, rtol=1e-9, atol=1e-10)


def _masks_without_hint(kind: str, n: int, m: int) -> dict:
    """Masks that can leave a query row empty, without the causal hint (torch's
    convention: True / -inf = hidden). Batch entry 1 of "padding-empty" pads
    every key; the (N, M) masks hide every key from query 1."""
    pad = torch.zeros(2, m, dtype=torch.bool)
    pad[0, -1] = True
    if kind == "padding":
        return {"key_padding_mask": pad}
    if kind == "padding-empty":
        pad[1] = True
        return {"key_padding_mask": pad}
    hidden = torch.zeros(n, m, dtype=torch.bool)
    hidden[1] = True
    hidden[3, ::2] = True
    if kind == "bool-mask":
        return {"attn_mask": hidden}
    if kind == "float-mask":
        return {"attn_mask": torch.zeros(n, m, dtype=torch.float64).masked_fill(hidden, float("-inf"))}
    if kind == "padding+bool-mask":
        return {"key_padding_mask": pad, "attn_mask": hidden}
    assert kind == "per-head-bool", kind
    per_head = torch.zeros(2 * H, n, m, dtype=torch.bool)
    per_head[1, 2] = True  # batch 0, head 1, query 2 sees nothing; its other heads do
    per_head[5, 0] = True
    return {"attn_mask": per_head}


@pytest.mark.parametrize("case", ["tied", "cross-tied"])
@pytest.mark.parametrize(
    "kind", ["padding", "padding-empty", "bool-mask", "float-mask", "padding+bool-mask", "per-head-bool"]
)
@pytest.mark.parametrize("layout", ["batch-first", "seq-first"])
def test_masks_without_the_hint_fused_training_equals_explicit_and_reference(kind, case, layout):
    """A key_padding_mask alone or a bool/float attn_mask, no causal hint, with
    rows that see no key: the fused training path sets those rows and the NaN
    guard on y (not on o, whose guarded copy the output projection would
    keep) and equals the explicit path (need_weights=True) in outputs and
    gradients, and the reference in outputs; an empty row gives
    out_proj.bias exactly, with finite gradients."""
    overrides, call = TRAIN_CASES[case]
    cfg = _config(**overrides)
    inputs = _train_inputs(cfg, call)
    n, m = inputs[0].shape[1], inputs[-1].shape[1]
    masks = _masks_without_hint(kind, n, m)
    layer, params = _train_layer(cfg, True, batch_first=layout == "batch-first")

    def call_with(need_weights: bool):
        def run(layer, *ts):
            if layout == "seq-first":
                ts = tuple(t.transpose(0, 1) for t in ts)
            x, key = ts[0], ts[-1]
            out = layer(x, key, key, need_weights=need_weights, **masks)[0]
            return out.transpose(0, 1) if layout == "seq-first" else out

        return run

    fused = _run(layer, inputs, call_with(False))
    _assert_same(fused, _run(layer, inputs, call_with(True)))
    assert all(torch.isfinite(g).all() for g in fused[1])
    bias = layer.out_proj.bias.detach()
    if kind == "padding-empty":
        torch.testing.assert_close(fused[0][1], bias.expand(n, E), rtol=0, atol=0)
    elif kind in ("bool-mask", "float-mask", "padding+bool-mask"):
        torch.testing.assert_close(fused[0][:, 1], bias.expand(2, E), rtol=0, atol=0)
    keep = np.ones((2, 1, n, m), dtype=bool)
    if "key_padding_mask" in masks:
        keep &= ~masks["key_padding_mask"].numpy()[:, None, None, :]
    if "attn_mask" in masks:
        hidden = masks["attn_mask"]
        hidden = hidden.view(2, H, n, m) if hidden.dim() == 3 else hidden
        keep = keep & ~(hidden.isinf() if hidden.is_floating_point() else hidden).numpy()
    x, *rest = (t.numpy() for t in inputs)
    want = dc.damcha_attention(params, cfg, x, rest[0] if rest else None, mask=keep)
    np.testing.assert_allclose(fused[0].numpy(), want, rtol=1e-9, atol=1e-10)
