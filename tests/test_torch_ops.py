"""Operation counts that pin the fast paths of DamchaAttention (no timings).

Each test counts the aten operations a call dispatches (a TorchDispatchMode
sees every kernel-level op, after autograd and composite decompositions) and
compares with nn.MultiheadAttention or a hand-written MHA step doing the same
work, so a refactor that adds a copy, a second projection GEMM or an N x M
mask on a hot path fails here rather than only in a benchmark.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from damcha_torch import DamchaAttention, DamchaKVCache

E, H = 32, 4


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.shapes: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        self.shapes.append((name, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def _count(fn) -> _Ops:
    mode = _Ops()
    with mode:
        fn()
    return mode


def _layers() -> tuple[nn.MultiheadAttention, DamchaAttention]:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    layer = DamchaAttention.from_mha(mha).eval()
    with torch.no_grad():
        layer.metric_gates["qk"].fill_(0.5)  # an open map: the honest cost
    return mha, layer


def _mha_step(mha: nn.MultiheadAttention, x: torch.Tensor, cache: list) -> torch.Tensor:
    """The usual hand-written decode step around nn.MultiheadAttention's weights."""
    B, n, _ = x.shape
    qkv = F.linear(x, mha.in_proj_weight, mha.in_proj_bias)
    q, k, v = qkv.view(B, n, 3, H, E // H).permute(2, 0, 3, 1, 4)
    if cache:
        k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
    cache[:] = [k, v]
    P = k.shape[2] - n
    mask = torch.ones(n, P + n, dtype=torch.bool).tril(P)  # bottom-right causal
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return mha.out_proj(o.transpose(1, 2).reshape(B, n, E))


# A steady-state DAMCHA step (every token step after the first, which records
# the step's shapes and takes the general path) does the MHA step's work plus
# the per-token map (RMS scale, one generator GEMM, the gate, one small bmm per
# side) and the NaN guard: 32 vs 21 dispatched ops when written (33 before the
# layer kept its gates' views, 44 before the flat step and the in-place cache,
# 56 before the port was split). This bound only stops it from growing.
DECODE_EXTRA_OPS = 11


def test_decode_step_ops_stay_within_a_margin_of_a_hand_written_mha_step():
    mha, layer = _layers()
    prompt, token = torch.randn(1, 8, E), torch.randn(1, 1, E)
    with torch.no_grad():
        mha_cache: list = []
        _mha_step(mha, prompt, mha_cache)
        _mha_step(mha, token, mha_cache)
        cache = DamchaKVCache()
        layer(prompt, prompt, prompt, is_causal=True, need_weights=False, kv_cache=cache)
        layer(token, token, token, is_causal=True, need_weights=False, kv_cache=cache)
        base = _count(lambda: _mha_step(mha, token, mha_cache))
        ours = _count(lambda: layer(token, token, token, is_causal=True, need_weights=False, kv_cache=cache))
    total, reference = sum(ours.ops.values()), sum(base.ops.values())
    assert total <= reference + DECODE_EXTRA_OPS, (total, reference, sorted(ours.ops.items()))
    # One attention kernel, no mask built for a one-token step (it sees every key).
    assert ours.ops["_scaled_dot_product_flash_attention_for_cpu"] == 1
    assert ours.ops["tril"] == ours.ops["arange"] == ours.ops["ones"] == 0
    # The cache writes the new token in place (one copy per tensor) instead of
    # concatenating the whole cache, as the hand-written step does.
    assert ours.ops["cat"] == 0 and ours.ops["copy_"] == 2
    assert base.ops["cat"] == 2


def _gemms(mode: _Ops) -> list[list[tuple[int, ...]]]:
    return [shapes for name, shapes in mode.shapes if name in ("addmm", "mm", "bmm")]


def test_self_attention_projects_q_k_v_with_one_packed_gemm():
    """query is key is value: one GEMM with in_proj_weight (3E outputs), as MHA;
    the only other GEMMs of the tokens are the generator's and the output's."""
    _, layer = _layers()
    x = torch.randn(2, 6, E)
    with torch.no_grad():
        ours = _count(lambda: layer(x, x, x, need_weights=False))
    gemms = _gemms(ours)
    assert len([s for s in gemms if (E, 3 * E) in s]) == 1, gemms
    tokens = [s for s in gemms if (2 * 6, E) in s]  # GEMMs that read the (B*N, E) tokens
    assert len(tokens) == 3, gemms
    assert ours.ops["_scaled_dot_product_flash_attention_for_cpu"] == 1
    # 54 ops when this test was written (MHA's eval path is one fused native op, not comparable)
    assert sum(ours.ops.values()) <= 54, sorted(ours.ops.items())


def test_fused_path_runs_one_sdpa_kernel_and_no_softmax():
    _, layer = _layers()
    x = torch.randn(2, 6, E)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, -2:] = True
    for kwargs in ({}, {"is_causal": True}, {"key_padding_mask": kpm}):
        with torch.no_grad():
            ours = _count(lambda kwargs=kwargs: layer(x, x, x, need_weights=False, **kwargs))
        assert ours.ops["_scaled_dot_product_flash_attention_for_cpu"] == 1, kwargs
        assert ours.ops["_softmax"] == 0 and ours.ops["bmm"] <= 2, (kwargs, sorted(ours.ops.items()))
    # causal alone: the kernel's own causal mode, no (N, M) mask built
    with torch.no_grad():
        causal = _count(lambda: layer(x, x, x, need_weights=False, is_causal=True))
    assert causal.ops["arange"] == causal.ops["tril"] == causal.ops["triu"] == 0, sorted(causal.ops.items())


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "store"])
def test_recompute_projects_queries_and_keys_again_in_backward(recompute):
    """Training with recompute=True: the q/k projection and the maps run in
    forward and again in backward (torch.utils.checkpoint); value and output
    projections run once. Without recompute, every projection runs once."""
    torch.manual_seed(0)
    layer = DamchaAttention(E, H, batch_first=True, recompute=recompute).train()
    with torch.no_grad():
        layer.metric_gates["qk"].fill_(0.5)
    x = torch.randn(2, 6, E, requires_grad=True)
    forward = _count(lambda: layer(x, x, x, need_weights=False))
    out, _ = layer(x, x, x, need_weights=False)
    backward = _count(lambda: out.sum().backward())
    qk = 2 * E  # q and k rows of in_proj_weight

    def qk_gemms(mode: _Ops) -> int:
        return len([s for s in _gemms(mode) if any(qk in dims for dims in s)])

    assert qk_gemms(forward) == (1 if recompute else 0)
    # backward: the recomputed forward GEMM, then its two gradient GEMMs (input and weight)
    assert qk_gemms(backward) == (3 if recompute else 0), _gemms(backward)


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
def test_metric_none_in_inference_takes_mhas_native_kernel(need_weights):
    """metric 'none' in MHA's layout, eval, no autograd, no mask: the call is
    nn.MultiheadAttention's own fast path (torch._native_multi_head_attention),
    bit for bit; with a mask, grads or the map on, it is not."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    plain = DamchaAttention.from_mha(mha, metric="none").eval()
    x = torch.randn(2, 6, E)
    with torch.no_grad():
        ours = _count(lambda: plain(x, x, x, need_weights=need_weights))
        out, w = plain(x, x, x, need_weights=need_weights)
        want, w_want = mha(x, x, x, need_weights=need_weights)
    assert ours.ops["_native_multi_head_attention"] == 1, sorted(ours.ops.items())
    assert torch.equal(out, want) and (w is None) == (w_want is None) and (w is None or torch.equal(w, w_want))
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1] = True  # batch 1 sees no key: MHA's kernel gives NaN there, DAMCHA's rule 0
    _, layer = _layers()
    for call in (
        lambda: plain(x, x, x, key_padding_mask=pad, need_weights=need_weights),
        lambda: plain(x, x, x, need_weights=need_weights, is_causal=True),
        lambda: layer(x, x, x, need_weights=need_weights),
    ):
        with torch.no_grad():
            assert _count(call).ops["_native_multi_head_attention"] == 0
    with torch.no_grad():
        masked, _ = plain(x, x, x, key_padding_mask=pad, need_weights=need_weights)
    torch.testing.assert_close(masked[1], plain.out_proj.bias.expand(6, E), rtol=0, atol=0)
    assert _count(lambda: plain(x, x, x, need_weights=need_weights)).ops["_native_multi_head_attention"] == 0  # grad on
