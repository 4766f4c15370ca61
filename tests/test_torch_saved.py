"""Training memory of DamchaAttention against nn.MultiheadAttention in one
training forward (no timing): with recompute=True a layer keeps what MHA keeps,
plus its small generator weights, and no extra (B, N, E) activation. Counted
two ways: the bytes of the distinct storages autograd saves (through
saved-tensor hooks, under which the fused nodes take their store path), and
the bytes allocated and still held when the forward returns (the profiler's
allocation records; the default path, where SDPA saves q~, k~ as recipes)."""

from __future__ import annotations

import contextlib
import gc
import statistics
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from damcha_torch import DamchaAttention

B, N, M, E, H = 2, 32, 24, 64, 4
ACTIVATION = B * N * E * 4  # one float32 (B, N, E) tensor


def _saved_bytes(module: nn.Module, *args, **kwargs) -> int:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*args, **kwargs)
    return sum(storages.values())


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """No cyclic garbage collection inside a profiling window, so that the
    window's records are the call's own allocations and frees, whatever
    earlier tests left in reference cycles (a cheap guard: forcing a
    collection inside a window did not reproduce the odd windows described
    in the test below)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _held_bytes(module: nn.Module, *args, **kwargs) -> tuple[int, torch.Tensor]:
    # Every allocation and free of the window, from the profiler's raw records.
    # (The "[memory]" entries of prof.events() are only those outside any op,
    # in practice the frees of temporaries: a call that made fewer of them
    # looked as if it held more.)
    with _no_collection(), torch.profiler.profile(profile_memory=True) as prof:
        y = module(*args, **kwargs)[0]
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), y


def _padding(m: int, empty: bool) -> torch.Tensor:
    """A key_padding_mask (B, m): batch entry 1 pads its last 5 keys, or every
    key with ``empty`` (then each of its queries sees nothing)."""
    pad = torch.zeros(B, m, dtype=torch.bool)
    pad[1, -5:] = True
    if empty:
        pad[1] = True
    return pad


def _hidden_row(m: int) -> torch.Tensor:
    """A bool attn_mask (N, m) that hides every key from query 3 and a few from others."""
    hidden = torch.zeros(N, m, dtype=torch.bool)
    hidden[3] = True
    hidden[::2, ::3] = True
    return hidden


CALLS = {
    "no-mask": lambda x, c: ((x, x, x), {}),
    "causal-hint": lambda x, c: (
        (x, x, x),
        {"attn_mask": nn.Transformer.generate_square_subsequent_mask(N), "is_causal": True},
    ),
    "cross": lambda x, c: ((x, c, c), {}),
    # Masks without the causal hint (the fused path then guards y and sets the
    # rows the mask empties on y, not on o):
    "padding": lambda x, c: ((x, x, x), {"key_padding_mask": _padding(N, empty=False)}),
    "padding-empty-rows": lambda x, c: ((x, x, x), {"key_padding_mask": _padding(N, empty=True)}),
    "bool-mask-empty-row": lambda x, c: ((x, x, x), {"attn_mask": _hidden_row(N)}),
    "padding+bool-mask": lambda x, c: (
        (x, x, x),
        {"key_padding_mask": _padding(N, empty=False), "attn_mask": _hidden_row(N)},
    ),
    "cross-padding-empty-rows": lambda x, c: ((x, c, c), {"key_padding_mask": _padding(M, empty=True)}),
}


@pytest.mark.parametrize("count", ["saved-storages", "held-allocations"])
@pytest.mark.parametrize("call", list(CALLS))
def test_a_training_forward_keeps_no_more_activations_than_mha(call, count):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    layer = DamchaAttention.from_mha(mha)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "gate" in name:
                p.fill_(0.5)  # the maps do their full work
    layer.train()
    x = torch.randn(B, N, E, requires_grad=True)
    c = torch.randn(B, M, E, requires_grad=True)
    args, kwargs = CALLS[call](x, c)
    samples: dict[str, list[int]] = {"ours": [], "theirs": []}
    if count == "saved-storages":
        ours = _saved_bytes(layer, *args, need_weights=False, **kwargs)
        theirs = _saved_bytes(mha, *args, need_weights=False, **kwargs)
    else:
        # Each output stays alive until both are counted, so neither window
        # frees the other's. Three alternating windows each, compared by
        # their medians: in two CI runs under xdist one MHA window (of
        # hundreds) counted 24-27 KB less than every other (72,704 or
        # 74,752 against 99,328; never reproduced alone), so one odd window
        # must not decide; a real extra activation of ours shows in all three.
        kept = []
        for _ in range(3):
            for side, module in (("ours", layer), ("theirs", mha)):
                held, out = _held_bytes(module, *args, need_weights=False, **kwargs)
                samples[side].append(held)
                kept.append(out)
        ours, theirs = (statistics.median(samples[side]) for side in ("ours", "theirs"))
    # The NaN guard once made a guarded copy of the attention output, which the
    # output projection saved beside SDPA's own output: one activation more
    # (without a mask until cf0048d; with a mask, and the zeroing of the rows it
    # empties, until the guard and those rows moved to y). What may remain is
    # the generator's weights and, in store mode, its product P = t W^T kept for
    # backward (S*S floats per token and side: a quarter of an activation per
    # side here, E = 64, H = 4; an eighth at E = 512, H = 8), below a half.
    assert ours - theirs < ACTIVATION / 2, (ours, theirs, ACTIVATION, samples)


def _peak_bytes(module: nn.Module, *args, **kwargs) -> int:
    """The most bytes one call holds at once beyond what existed before it,
    from the profiler's allocation records in the order they happened."""
    with _no_collection(), torch.profiler.profile(profile_memory=True) as prof:
        module(*args, **kwargs)
    records = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    held = peak = 0
    for _, nbytes in records:
        held += nbytes
        peak = max(peak, held)
    return peak


def _median_peaks(ours: nn.Module, theirs: nn.Module, *args, **kwargs) -> tuple[float, float]:
    """Each module's median peak over three alternating windows. In cross-attention the two
    peaks are equal (no margin), so one odd window (the test above saw MHA windows count
    24-27 KB less in CI) would decide alone; a real extra activation shows in all three."""
    peaks: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(3):
        for side, module in enumerate((ours, theirs)):
            peaks[side].append(_peak_bytes(module, *args, **kwargs))
    return statistics.median(peaks[0]), statistics.median(peaks[1])


def _mha_and_open_layer() -> tuple[nn.MultiheadAttention, DamchaAttention]:
    """An eval nn.MultiheadAttention (seed 0) and its DamchaAttention with every gate at 0.5."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    layer = DamchaAttention.from_mha(mha).eval()
    with torch.no_grad():
        for gate in layer.metric_gates.values():
            gate.fill_(0.5)
    return mha, layer


@pytest.mark.parametrize("call", ["no-mask", "causal-hint", "cross"])
def test_an_inference_call_peaks_no_higher_than_mha(call):
    """Inference (eval, inference_mode, gates open): the maps are added into
    the projections' own output and the guard into SDPA's, and q~, k~ and v
    are let go before the output projection, so a call holds no more at its
    peak than nn.MultiheadAttention's (its native kernel without a mask).
    Before, q~, k~, a guarded copy of o and the packed projection's output
    (which v views) were all alive beside y: 1.25 activations over MHA's peak
    in cross-attention and 1 without a mask (7 vs 6 activations)."""
    mha, layer = _mha_and_open_layer()
    x, c = torch.randn(B, N, E), torch.randn(B, M, E)
    args, kwargs = CALLS[call](x, c)
    with torch.inference_mode():
        for module in (mha, layer):  # first calls make constants that stay (phi's sqrt(E * eps))
            module(*args, need_weights=False, **kwargs)
        ours, theirs = _median_peaks(layer, mha, *args, need_weights=False, **kwargs)
    assert ours <= theirs, (ours / ACTIVATION, theirs / ACTIVATION)


def test_cross_inference_with_joined_generator_gemms_peaks_no_higher_than_mha():
    """Cross-attention with enough queries that their generator product comes
    out of the query GEMM (a joined weight, made per call;
    _functional._linear_and_product): the joined weight and the wider output
    still leave the call's peak at or below nn.MultiheadAttention's. (The
    query side's output and product are let go before the keys are mapped:
    held one step longer, the peak was 4.6 activations to MHA's 4.0 at N=32;
    the key side's product from the k/v GEMM, whose output v keeps alive
    through SDPA, was 4.19 to 4.01 here.)"""
    mha, layer = _mha_and_open_layer()
    n, m = 4 * N, 4 * M  # B*n = 256 query tokens >= E + H*H = 80 joined rows
    x, c = torch.randn(B, n, E), torch.randn(B, m, E)
    with torch.inference_mode():
        for module in (mha, layer):
            module(x, c, c, need_weights=False)
        ours, theirs = _median_peaks(layer, mha, x, c, c, need_weights=False)
    assert ours <= theirs, (ours / (4 * ACTIVATION), theirs / (4 * ACTIVATION))
