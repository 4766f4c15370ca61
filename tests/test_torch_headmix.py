"""damcha_torch._headmix, the C kernel of a decoding step's cross-head map.

The kernel itself against the spec's formula computed in NumPy float64 (every
layout it takes: tokens with a row stride, one or two blocks per token), NaN
and inf carried as the reference carries them, gates at 0 returning y bit for
bit; then the layer: which decoding steps it takes, which it leaves to the
torch ops (each refusal gives the same outputs as the torch path), and its
outputs against damcha_core's reference. The layer tests that run with the
kernel on and off are in test_torch_fastpath.py and test_torch_kv_cache.py
(the ``decode_kernel`` fixture).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _kernel import KERNEL, KernelCalls
from torch import nn

import damcha_core as dc
import damcha_torch
from damcha_torch import DamchaAttention, DamchaKVCache
from damcha_torch import _functional as fn

# A mark, not a module-level skip: each test's skip is a report that
# DAMCHA_REQUIRE_ALL_BACKENDS=1 (CI) turns into a failure (tests/_require_all.py).
pytestmark = pytest.mark.skipif(
    fn._HEADMIX is None, reason="damcha_torch._headmix not installed (built without a C compiler)"
)

DTYPES = {"float32": torch.float32, "float64": torch.float64}
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-6), torch.float64: dict(rtol=1e-12, atol=1e-13)}


def _spec_map(x, W, b, g, y, blocks):
    """z = y + diag(g) (phi(x) W^T + b) y per token, float64 (spec.md: generator and map); y (T, blocks, S, d)."""
    x, W, b, g, y = (np.asarray(t, dtype=np.float64) for t in (x, W, b, g, y))
    T, E = x.shape
    S = g.shape[0]
    phi = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + dc.RMS_EPS)
    A = (phi @ W.T + b).reshape(T, S, S) * g[None, :, None]
    return y + np.einsum("tha,tkad->tkhd", A, y)


def _run(x, W, b, g, y, d, blocks, row_stride, y_stride):
    T, E, S = x.shape[0], W.shape[1], g.shape[0]
    out = torch.empty((T, blocks, S, d), dtype=x.dtype)
    KERNEL.map(
        x.dtype is torch.float64,
        T,
        E,
        S,
        d,
        x.data_ptr(),
        row_stride,
        W.data_ptr(),
        b.data_ptr(),
        g.data_ptr(),
        y.data_ptr(),
        y_stride,
        blocks,
        out.data_ptr(),
        0,
        dc.RMS_EPS,
        d,
        S * d,
    )
    return out


def _inputs(T, E, S, d, blocks, dtype, seed, x_pad=0, y_pad=0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(T, E + x_pad, generator=g, dtype=dtype) * 3
    ys = torch.randn(T, blocks * S * d + y_pad, generator=g, dtype=dtype)
    W = torch.randn(S * S, E, generator=g, dtype=dtype) / math.sqrt(E)
    b = torch.randn(S * S, generator=g, dtype=dtype) * 0.1
    gate = torch.rand(S, generator=g, dtype=dtype) * 2 - 1
    return xs, ys, W, b, gate


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(
    "T,E,S,d,blocks,x_pad,y_pad",
    [
        (1, 32, 4, 8, 2, 0, 0),  # one token, tied: q and k blocks
        (1, 512, 8, 64, 2, 0, 0),  # the benchmarks' layer
        (8, 512, 8, 64, 2, 0, 0),  # its B = 8 step: token pairs by row quads only
        (3, 17, 3, 5, 1, 7, 9),  # odd sizes, rows with a stride wider than the row
        (16, 40, 5, 3, 2, 0, 11),  # the most tokens the flat step takes
        (2, 1, 1, 1, 1, 0, 0),  # one feature, one head
    ],
    ids=["tied-1", "E512", "E512-8-tokens", "odd-strided", "16-tokens", "tiny"],
)
def test_kernel_computes_the_spec_map(T, E, S, d, blocks, x_pad, y_pad, dtype):
    xs, ys, W, b, gate = _inputs(T, E, S, d, blocks, dtype, seed=T * 100 + E, x_pad=x_pad, y_pad=y_pad)
    out = _run(xs, W, b, gate, ys, d, blocks, E + x_pad, blocks * S * d + y_pad)
    want = _spec_map(xs[:, :E], W, b, gate, ys[:, : blocks * S * d].reshape(T, blocks, S, d), blocks)
    np.testing.assert_allclose(out.numpy(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_kernel_maps_in_place(dtype):
    """out = y (out_stride = y's row stride): each row's blocks replaced by
    their map, every other element of the row untouched; three adjacent
    blocks after an offset, as a converted model's fused projection holds
    them."""
    T, E, S, d, blocks, lead, tail = 5, 20, 3, 4, 3, 7, 5
    xs, _, W, b, gate = _inputs(T, E, S, d, blocks, dtype, seed=21)
    rows = torch.randn(T, lead + blocks * S * d + tail, dtype=dtype, generator=torch.Generator().manual_seed(22))
    before = rows.clone()
    at = rows.data_ptr() + lead * rows.element_size()
    width = rows.shape[1]
    KERNEL.map(dtype is torch.float64, T, E, S, d, xs.data_ptr(), E, W.data_ptr(), b.data_ptr(), gate.data_ptr(),
               at, width, blocks, at, width, dc.RMS_EPS, d, S * d)  # fmt: skip
    want = _spec_map(xs, W, b, gate, before[:, lead : lead + blocks * S * d].reshape(T, blocks, S, d), blocks)
    np.testing.assert_allclose(
        rows[:, lead : lead + blocks * S * d].reshape(T, blocks, S, d).numpy(), want, **TOL[dtype]
    )
    assert torch.equal(rows[:, :lead], before[:, :lead]) and torch.equal(rows[:, -tail:], before[:, -tail:])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(
    "S,d,roles,blocks,lead",
    [(4, 8, 3, 2, 0), (3, 5, 3, 1, 5), (2, 4, 2, 1, 0), (5, 3, 4, 3, 1)],
    ids=["neox-tied", "one-block-offset", "gated-query", "three-blocks"],
)
def test_kernel_maps_interleaved_heads_in_place(S, d, roles, blocks, lead, dtype):
    """Heads a run apart (an interleaved projection: each head's ``roles``
    blocks of d in turn, GPT-NeoX's q, k, v; Qwen3.5's query, gate): head
    stride roles * d, block stride d, the mapped blocks from ``lead`` within
    each run, in place in rows of the output. Each mapped block equals the
    spec's map, every other element is untouched."""
    T, E = 3, 24
    run = roles * d
    xs, _, W, b, gate = _inputs(T, E, S, d, blocks, dtype, seed=31 + S)
    rows = torch.randn(T, S * run, dtype=dtype, generator=torch.Generator().manual_seed(32))
    before = rows.clone()
    at = rows.data_ptr() + lead * rows.element_size()
    width = rows.shape[1]
    KERNEL.map(dtype is torch.float64, T, E, S, d, xs.data_ptr(), E, W.data_ptr(), b.data_ptr(), gate.data_ptr(),
               at, width, blocks, at, width, dc.RMS_EPS, run, d)  # fmt: skip
    flat = before.reshape(T, S, run)
    y = np.stack([flat[:, :, lead + k * d : lead + (k + 1) * d].numpy() for k in range(blocks)], axis=1)
    want = _spec_map(xs, W, b, gate, y, blocks)  # (T, blocks, S, d)
    got = rows.reshape(T, S, run)
    mapped = np.zeros((S, run), dtype=bool)
    for k in range(blocks):
        cut = slice(lead + k * d, lead + (k + 1) * d)
        np.testing.assert_allclose(got[:, :, cut].numpy(), want[:, k], **TOL[dtype])
        mapped[:, cut] = True
    assert torch.equal(got[:, torch.from_numpy(~mapped)], flat[:, torch.from_numpy(~mapped)])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_kernel_with_gates_at_zero_returns_y_bit_for_bit(dtype):
    xs, ys, W, b, gate = _inputs(4, 24, 4, 6, 2, dtype, seed=3)
    out = _run(xs, W, b, torch.zeros_like(gate), ys, 6, 2, 24, 48)
    assert torch.equal(out.reshape(4, 48), ys)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("where", ["x-nan", "x-inf", "y-nan", "weight-nan", "gate-inf"])
def test_kernel_carries_non_finite_values_as_the_spec_does(where, dtype):
    """NaN and inf reach exactly the outputs the formula sends them to (the
    kernel tests no value): a token's own x or y touches only its own rows;
    a weight, every token."""
    xs, ys, W, b, gate = _inputs(3, 16, 4, 5, 1, dtype, seed=11)
    if where == "x-nan":
        xs[1, 3] = float("nan")
    elif where == "x-inf":
        xs[1, 3] = float("inf")
    elif where == "y-nan":
        ys[1, 7] = float("nan")
    elif where == "weight-nan":
        W[2, 5] = float("nan")
    else:
        gate[0] = float("inf")
    out = _run(xs, W, b, gate, ys, 5, 1, 16, 20).numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        want = _spec_map(xs, W, b, gate, ys.reshape(3, 1, 4, 5), 1)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(want))
    finite = np.isfinite(want)
    assert not finite.all()
    np.testing.assert_allclose(out[finite], want[finite], **TOL[dtype])


def test_kernel_keeps_the_spec_statistic_for_huge_float32_tokens():
    """|x|^2 in double, as the spec's float64 statistic: float32 tokens of
    norm 1e20-1e30 (whose float32 square overflows) are mapped as the spec
    maps them, phi(x) finite."""
    xs, ys, W, b, gate = _inputs(3, 16, 4, 5, 1, torch.float32, seed=13)
    xs = xs * torch.tensor([[1e20], [1e25], [1e30]])
    out = _run(xs, W, b, gate, ys, 5, 1, 16, 20)
    want = _spec_map(xs, W, b, gate, ys.reshape(3, 1, 4, 5), 1)
    np.testing.assert_allclose(out.numpy(), want, rtol=2e-5, atol=2e-5)


def test_kernel_refuses_a_stale_build(monkeypatch):
    """A build whose calling convention (ABI) is not the code's is not used."""
    import importlib

    monkeypatch.setattr(fn._HEADMIX, "ABI", fn._HEADMIX_ABI + 1)
    try:
        importlib.reload(fn)
        assert fn._HEADMIX is None and not damcha_torch.has_decode_kernel()
    finally:
        monkeypatch.undo()
        importlib.reload(fn)
    assert fn._HEADMIX is not None


def test_kernel_refuses_malformed_calls():
    # Pointers 8 (never read: each call below is refused before the kernel runs).
    args = [False, 1, 4, 2, 2, 8, 4, 8, 8, 8, 8, 8, 1, 8, 0, 1e-6, 2, 4]
    with pytest.raises(TypeError, match="18 arguments"):
        KERNEL.map(*args[:-1])
    with pytest.raises(ValueError, match="non-negative"):
        KERNEL.map(*args[:16], -2, 4)
    with pytest.raises(ValueError, match="non-negative"):
        KERNEL.map(*args[:17], -4)
    with pytest.raises(ValueError, match="blocks must be positive"):
        KERNEL.map(*args[:12], 0, *args[13:])
    with pytest.raises(ValueError, match="positive"):
        KERNEL.map(args[0], 0, *args[2:])
    with pytest.raises(ValueError, match="non-negative"):
        KERNEL.map(*args[:6], -4, *args[7:])
    with pytest.raises(TypeError):
        KERNEL.map(*args[:5], "0", *args[6:])
    with pytest.raises(ValueError, match="null pointer"):
        KERNEL.map(*args[:7], 0, *args[8:])


# ------------------------------------------------------------------ the layer

CONFIGS = {
    "heads-tied": dict(metric="heads", coupling="tied"),
    "heads-separate": dict(metric="heads", coupling="separate"),
    "heads-query": dict(metric="heads", coupling="query"),
    "heads-query-gqa": dict(metric="heads", coupling="query", num_kv_heads=2),
}


def _layer(name, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    kw = dict(CONFIGS[name])
    if "num_kv_heads" in kw:
        layer = DamchaAttention(32, 4, batch_first=True, dtype=dtype, **kw).eval()
    else:
        layer = DamchaAttention.from_mha(nn.MultiheadAttention(32, 4, batch_first=True, dtype=dtype), **kw).eval()
    with torch.no_grad():
        for gate in layer.metric_gates.values():
            gate.uniform_(-1.0, 1.0)
    return layer


def _decode(layer, x, steps, monkeypatch=None, kernel=True, mode=torch.inference_mode):
    """A causal prompt of 3 tokens, then one-token steps (inference): outputs and kernel calls."""
    recorder = KernelCalls()
    if monkeypatch is not None:
        monkeypatch.setattr(fn, "_HEADMIX", recorder if kernel else None)
    cache, outs = DamchaKVCache(), []
    with mode():
        outs.append(layer(x[:, :3], x[:, :3], x[:, :3], is_causal=True, need_weights=False, kv_cache=cache)[0])
        for i in range(3, 3 + steps):
            t = x[:, i : i + 1]
            outs.append(layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0])
    return torch.cat(outs, dim=1), recorder.calls


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_decoding_takes_the_kernel_and_matches_the_reference(name, dtype, monkeypatch):
    """Every one-token step after the first (which records the shapes) maps
    through the kernel: one call per step when tied (q and k together) or
    with one mapped side, two when separate. The outputs equal the torch-ops
    path and damcha_core's causal forward."""
    layer = _layer(name, dtype)
    x = torch.randn(2, 9, 32, dtype=dtype, generator=torch.Generator().manual_seed(4))
    got, calls = _decode(layer, x, 6, monkeypatch)
    per_step = 2 if name == "heads-separate" else 1
    assert calls == per_step * 5, calls
    torch_ops, none = _decode(layer, x, 6, monkeypatch, kernel=False)
    assert none == 0
    torch.testing.assert_close(got, torch_ops, **TOL[dtype])
    want = dc.damcha_attention(layer.to_canonical(), layer.config, x.to(torch.float64).numpy(), causal=True)
    np.testing.assert_allclose(
        got.to(torch.float64).numpy(), want, **(TOL[dtype] if dtype is torch.float64 else dict(rtol=1e-4, atol=1e-5))
    )


@pytest.mark.parametrize(
    "change",
    ["generator-not-contiguous", "gate-not-contiguous", "tokens-not-rows"],
)
def test_layer_leaves_what_the_kernel_cannot_read_to_the_torch_ops(change, monkeypatch):
    """Parameters the kernel cannot read as contiguous arrays (a generator
    weight stored transposed, a gate that is a strided view) and tokens that
    are not rows of one stride (seq-first, B > 1, N > 1: x is (B, N, E) with
    the batch stride E) take the torch ops, with the same outputs."""
    layer = _layer("heads-tied", torch.float64)
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    want, _ = _decode(layer, x, 6, monkeypatch, kernel=False)
    if change == "generator-not-contiguous":
        gen = layer.metric_generators["qk"]
        gen.weight.data = gen.weight.data.t().contiguous().t()
        assert not gen.weight.is_contiguous()
    elif change == "gate-not-contiguous":
        gate = layer.metric_gates["qk"]
        gate.data = torch.stack([gate.data, gate.data], dim=1)[:, 0]
        assert not gate.is_contiguous()
    if change != "tokens-not-rows":
        got, calls = _decode(layer, x, 6, monkeypatch)
        assert calls == 0
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)
        return
    seq_first = DamchaAttention.from_mha(
        nn.MultiheadAttention(32, 4, dtype=torch.float64), metric="heads", coupling="tied"
    ).eval()
    seq_first.load_state_dict(layer.state_dict())
    recorder = KernelCalls()
    monkeypatch.setattr(fn, "_HEADMIX", recorder)
    # (N, B, E) in: the layer's x is (B, N, E) with strides (E, B * E, 1); two-token chunks, B = 2, N = 2.
    got = _chunked(seq_first, x, (3, 5, 7), 2, torch.inference_mode, seq_first=True)
    assert recorder.calls == 0
    want = _chunked(layer, x, (3, 5, 7), 2, torch.enable_grad)  # the general path
    torch.testing.assert_close(got, want.detach(), rtol=1e-13, atol=1e-14)


def _chunked(layer, x, starts, width, mode, seq_first=False):
    """A causal prompt of 3 tokens, then non-causal chunks of ``width`` tokens
    at ``starts``, under ``mode``: the outputs (B, ., E) of x (B, N, E),
    passed as (N, B, E) when ``seq_first``."""
    src = x.transpose(0, 1) if seq_first else x
    cut = (lambda a, b: src[a:b]) if seq_first else (lambda a, b: src[:, a:b])
    cache, outs = DamchaKVCache(), []
    with mode():
        for i, (a, b) in enumerate([(0, 3)] + [(start, start + width) for start in starts]):
            t = cut(a, b)
            outs.append(layer(t, t, t, is_causal=i == 0, need_weights=False, kv_cache=cache)[0])
    return torch.cat(outs, 0).transpose(0, 1) if seq_first else torch.cat(outs, 1)


class _Wrapped(torch.Tensor):
    """A wrapper subclass (as DTensor is): its data_ptr() is 0, no storage of its own."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, _Wrapped) else t  # noqa: E731
        out = func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        # Every tensor result wrapped again, as DTensor's are (views of it, products with it).
        wrap = lambda t: _Wrapped(t) if isinstance(t, torch.Tensor) and not isinstance(t, _Wrapped) else t  # noqa: E731
        return torch.utils._pytree.tree_map(wrap, out)


@pytest.mark.parametrize("which", ["generator", "gate", "in_proj"])
def test_layer_never_hands_a_tensor_subclass_to_the_kernel(which, monkeypatch):
    """A parameter that is a tensor subclass (DTensor under tensor
    parallelism; here a wrapper with no storage, data_ptr() 0) is left to
    the torch ops, which compute the step: before, the kernel read address 0."""
    layer = _layer("heads-tied", torch.float64)
    x = torch.randn(1, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    want, _ = _decode(layer, x, 6, monkeypatch, kernel=False)
    owner, name = {
        "generator": (layer.metric_generators["qk"], "weight"),
        "gate": (layer.metric_gates, "qk"),
        "in_proj": (layer, "in_proj_weight"),
    }[which]
    setattr(owner, name, nn.Parameter(_Wrapped(getattr(owner, name).detach().clone()), requires_grad=False))
    got, calls = _decode(layer, x, 6, monkeypatch, mode=torch.no_grad)  # (a wrapper cannot be an inference tensor)
    assert calls == 0
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)


def test_layer_chunks_and_strided_tokens(monkeypatch):
    """B = 1 with chunks of N = 4 tokens (one row stride: the sequence's)
    takes the kernel; tokens whose features are not adjacent (a stride-2
    view) take the torch ops. Both equal the general path."""
    layer = _layer("heads-tied", torch.float64)
    x = torch.randn(1, 11, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    for strided in (False, True):
        recorder = KernelCalls()
        monkeypatch.setattr(fn, "_HEADMIX", recorder)
        src = torch.stack([x, x], dim=-1)[..., 0] if strided else x  # stride 2 between features
        assert (src.stride(-1) == 2) == strided
        # The first chunk records the shape, the second takes the flat step.
        got = _chunked(layer, src, (3, 7), 4, torch.inference_mode)
        assert recorder.calls == (0 if strided else 1), (strided, recorder.calls)
        want = _chunked(layer, x, (3, 7), 4, torch.enable_grad)
        torch.testing.assert_close(got, want.detach(), rtol=1e-13, atol=1e-14)


def test_layer_sees_a_generator_replaced_between_steps(monkeypatch):
    """The kernel reads the parameters' storage afresh every step: a generator
    weight replaced by ``.data =`` with another tensor between steps is used,
    and one of another shape is never read (the torch ops raise their own
    shape error, as without the kernel)."""
    layer = _layer("heads-tied", torch.float64)
    ref = _layer("heads-tied", torch.float64)
    x = torch.randn(1, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    recorder = KernelCalls()
    monkeypatch.setattr(fn, "_HEADMIX", recorder)
    caches = DamchaKVCache(), DamchaKVCache()
    with torch.inference_mode():
        for model, cache in zip((layer, ref), caches):
            model(x[:, :3], x[:, :3], x[:, :3], is_causal=True, need_weights=False, kv_cache=cache)
            for i in (3, 4):
                model(
                    x[:, i : i + 1],
                    x[:, i : i + 1],
                    x[:, i : i + 1],
                    is_causal=True,
                    need_weights=False,
                    kv_cache=cache,
                )
    new = torch.randn_like(layer.metric_generators["qk"].weight)
    for model in (layer, ref):
        model.metric_generators["qk"].weight.data = new.clone()
    t = x[:, 5:6]
    before = recorder.calls
    with torch.inference_mode():
        fast = layer(t, t, t, is_causal=True, need_weights=False, kv_cache=caches[0])[0]
    assert recorder.calls == before + 1
    with torch.enable_grad():
        general = ref(t, t, t, is_causal=True, need_weights=False, kv_cache=caches[1])[0]
    torch.testing.assert_close(fast, general.detach(), rtol=1e-13, atol=1e-14)
    layer.metric_generators["qk"].weight.data = torch.zeros(3, 32, dtype=torch.float64)
    t = x[:, 6:7]
    with torch.inference_mode(), pytest.raises(RuntimeError):
        layer(t, t, t, is_causal=True, need_weights=False, kv_cache=caches[0])
    assert recorder.calls == before + 1


def test_has_decode_kernel_reports_the_build(monkeypatch):
    assert damcha_torch.has_decode_kernel() is True
    monkeypatch.setattr(fn, "_HEADMIX", None)
    assert damcha_torch.has_decode_kernel() is False


# ------------------------------------------------------- converted models


@pytest.mark.parametrize("arch", ["llama", "gpt2", "vit"])
def test_converted_model_in_eval_maps_few_tokens_with_the_kernel(arch, monkeypatch):
    """A converted model in eval mode without a graph (``generate``, inference)
    maps each projection site's output in place with the kernel when it holds
    at most 16 tokens: Llama's separate q_proj and k_proj (one call each),
    GPT-2's fused c_attn and timm's fused qkv (tied q and k: one call for the
    run of two blocks). The outputs equal the torch ops' and the reference
    model's layers (tests/test_models_torch.py compares every architecture's
    layers with the reference on this path)."""
    import _models_zoo as zoo

    model = zoo.open_gates(damcha_torch.convert(zoo.build(arch, torch.float64)))
    kw = zoo.inputs(arch, torch.float64, batch=2, length=7)  # 14 tokens; ViT: 2 x 5
    recorder = KernelCalls()
    monkeypatch.setattr(fn, "_HEADMIX", recorder)
    with torch.no_grad():
        got = zoo.run(model, arch, kw)
    sites = {"llama": 2, "gpt2": 1, "vit": 1}[arch] * 2  # per layer, two layers
    assert recorder.calls == sites, recorder.calls
    monkeypatch.setattr(fn, "_HEADMIX", None)
    with torch.no_grad():
        want = zoo.run(model, arch, kw)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.equal(got, zoo.run(zoo.build(arch, torch.float64), arch, kw).detach())  # the maps are on


def test_converted_model_keeps_the_torch_ops_in_training_and_for_many_tokens(monkeypatch):
    """In training mode a no-grad forward may be a reentrant checkpoint's,
    whose recomputation (the fused node, torch ops) must give the same bits:
    the kernel is not used there; nor for more than 16 tokens (a prompt),
    where the torch ops' multi-threaded GEMM is the faster."""
    import _models_zoo as zoo

    model = zoo.open_gates(damcha_torch.convert(zoo.build("llama", torch.float64)))
    recorder = KernelCalls()
    monkeypatch.setattr(fn, "_HEADMIX", recorder)
    with torch.no_grad():
        model.train()
        zoo.run(model, "llama", zoo.inputs("llama", torch.float64, batch=2, length=7))
        model.eval()
        zoo.run(model, "llama", zoo.inputs("llama", torch.float64, batch=3, length=6))  # 18 tokens
    assert recorder.calls == 0


def test_converted_llama_generates_the_same_with_and_without_the_kernel(monkeypatch):
    """Greedy generation of a converted Llama (float32, gates open): the
    prompt through the torch ops (more than 16 tokens), every later token
    through the kernel; tokens equal and logits close to the torch ops' run."""
    import _models_zoo as zoo

    model = zoo.open_gates(damcha_torch.convert(zoo.build("llama", torch.float32)), scale=0.8)
    ids = torch.randint(3, zoo.VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    opts = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    runs = {}
    for kernel in (True, False):
        recorder = KernelCalls()
        monkeypatch.setattr(fn, "_HEADMIX", recorder if kernel else None)
        with torch.no_grad():
            runs[kernel] = model.generate(ids, **opts)
        assert (recorder.calls > 0) == kernel
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    for a, b in zip(runs[True].logits, runs[False].logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_maps_refuses_what_the_kernel_would_read_out_of_bounds():
    """_fused_maps' own checks, which the layer's make redundant today: a
    packed projection narrower than q's and k's blocks, a dtype other than
    x's, a tied pair of sides with other head counts, a 16-bit x. Each gives
    None (the torch ops), never a kernel call."""
    E, H, d = 8, 2, 4
    x = torch.randn(1, 1, E)
    side = (torch.randn(H * H, E), torch.randn(H * H), torch.rand(H, 1))
    good = torch.randn(1, 1, 3 * H * d)
    assert fn._fused_maps(x, good, 0, (side, side), H, H, d) is not None
    assert fn._fused_maps(x, good[..., : 2 * H * d - 1], 0, (side, side), H, H, d) is None
    assert fn._fused_maps(x, good.double(), 0, (side, side), H, H, d) is None
    assert fn._fused_maps(x, good, 0, (side, side), H, 1, d) is None
    half = (side[0].half(), side[1].half(), side[2].half())
    assert fn._fused_maps(x.half(), good.half(), 0, (half, half), H, H, d) is None
