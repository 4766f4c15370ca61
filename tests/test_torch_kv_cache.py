"""DamchaKVCache's preallocated storage: appends written in place, growth,
autograd, inference_mode, pickling and torch.compile (float64, against the
NumPy reference and the layer's own full forward)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from _devices import TORCH_DEVICES
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import damcha_core as dc
from damcha_conformance import case_params
from damcha_torch import DamchaAttention, DamchaKVCache

CONFIGS = {
    "heads-tied": dict(metric="heads", coupling="tied"),
    "heads-separate": dict(metric="heads", coupling="separate"),
    "lowrank-query-gqa": dict(metric="lowrank", metric_rank=3, coupling="query", num_kv_heads=2),
}


def _layer(name: str) -> tuple[DamchaAttention, dict[str, np.ndarray], dc.DamchaConfig]:
    cfg = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, **CONFIGS[name])
    params = case_params(cfg, 0)  # open gates, non-zero biases
    layer = DamchaAttention.from_canonical(params, cfg, batch_first=True, dtype=torch.float64).eval()
    return layer, params, cfg


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _step(layer: DamchaAttention, t: torch.Tensor, cache: DamchaKVCache) -> torch.Tensor:
    return layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0]


class _Copies(TorchDispatchMode):
    """Counts aten calls and the elements written by copy_/cat (what an append moves)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.cats, self.copied = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls += 1
        name = func.overloadpacket.__name__
        if name == "cat":
            self.cats += 1
            self.copied += out.numel()
        elif name == "copy_":
            self.copied += args[1].numel()
        return out


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_long_decode_across_growths_equals_full_forward_and_reference(name, mode):
    """B = 2: a 3-token prompt, 30 single tokens and a 4-token chunk, written
    in place into storage that grows several times; every output equals the
    layer's full causal forward and the reference, and the cache holds what
    the full sequence's projection gives."""
    layer, params, cfg = _layer(name)
    chunks = [3] + [1] * 30 + [4]
    x = _x(2, sum(chunks), 16, seed=1)
    with torch.no_grad():
        full = layer(x, x, x, is_causal=True, need_weights=False)[0]
    ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    cache, outs, start, capacities = DamchaKVCache(), [], 0, []
    with ctx:
        for size in chunks:
            t = x[:, start : start + size]
            outs.append(_step(layer, t, cache))
            start += size
            capacities.append(cache.capacity)
            assert len(cache) == start and cache.capacity > start
            assert cache.key.shape == (2, cfg.num_kv_heads, start, 4)
    growths = sum(b != a for a, b in zip(capacities, capacities[1:]))
    assert growths >= 3, capacities
    got = torch.cat(outs, dim=1)
    torch.testing.assert_close(got, full, rtol=1e-12, atol=1e-13)
    want = dc.damcha_attention(params, cfg, x.numpy(), causal=True)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)
    # The cache equals one made by a single call on the whole sequence.
    whole = DamchaKVCache()
    with torch.no_grad():
        _step(layer, x, whole)
    torch.testing.assert_close(cache.key, whole.key, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(cache.value, whole.value, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("name", ["heads-tied", "lowrank-query-gqa"])
def test_a_step_copies_only_its_new_token(name):
    """Op and element counts (not timing): a token step that does not grow the
    storage runs the same aten calls and copies the same number of elements
    (one position of keys and of values) at P = 8 as at P = 40; it makes no
    cat. Over a whole decode the copies stay linear in its length (growth is
    geometric), where concatenation copied the whole cache every step."""
    layer, _, cfg = _layer(name)
    x = _x(1, 64, 16, seed=2)
    G, d = cfg.num_kv_heads, 4
    cache, seen = DamchaKVCache(), {}
    total = 0
    with torch.inference_mode():
        _step(layer, x[:, :2], cache)
        for i in range(2, 64):
            grows = len(cache) + 1 >= cache.capacity
            mode = _Copies()
            with mode:
                _step(layer, x[:, i : i + 1], cache)
            total += mode.copied
            assert mode.cats == 0
            if not grows:
                seen[len(cache) - 1] = (mode.calls, mode.copied)
    assert {8, 40} <= set(seen), sorted(seen)
    assert seen[8] == seen[40], seen
    assert seen[8][1] == 2 * G * d  # the new token's key and value, nothing else
    # Concatenation would copy sum(P + 1) positions: 2 * G * d * ~2000 here.
    assert total <= 2 * G * d * 3 * 64, total


@pytest.mark.parametrize("name", ["heads-tied", "heads-separate"])
def test_autograd_through_a_cache_and_no_grad_steps_after_it(name):
    """With autograd on, appends concatenate: a loss over the decoded outputs
    backpropagates to the same gradients as the full causal forward, and steps
    without autograd after the graph was built leave what it saved alone (an
    in-place write into that storage would make backward fail)."""
    layer, _, _ = _layer(name)
    x = _x(2, 9, 16, seed=3)
    layer.zero_grad()
    layer(x, x, x, is_causal=True, need_weights=False)[0][:, 2:7].sum().backward()
    want = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    cache, outs = DamchaKVCache(capacity=32), []
    for i in [slice(0, 3)] + [slice(i, i + 1) for i in range(3, 7)]:
        outs.append(_step(layer, x[:, i], cache))
    with torch.no_grad():
        for i in range(7, 9):
            _step(layer, x[:, i : i + 1], cache)
    torch.cat(outs, dim=1)[:, 2:].sum().backward()
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-12, msg=n)


def test_autograd_steps_after_in_place_steps():
    """Steps without autograd write their storage in place; autograd steps after
    them build a graph over the cache (no grad to the earlier tokens) whose
    backward runs even when more steps without autograd follow."""
    layer, _, _ = _layer("heads-tied")
    x = _x(1, 8, 16, seed=9)
    cache = DamchaKVCache(capacity=32)
    with torch.no_grad():
        _step(layer, x[:, :3], cache)
    y = sum(_step(layer, x[:, i : i + 1], cache).sum() for i in range(3, 6))
    with torch.no_grad():
        for i in range(6, 8):
            _step(layer, x[:, i : i + 1], cache)
    y.backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    assert got["in_proj_weight"].abs().sum() > 0
    # The same steps with backward before the trailing in-place steps: those steps must not have
    # changed what the graph saved (finite but wrong gradients would pass a finiteness check).
    layer.zero_grad()
    cache = DamchaKVCache(capacity=32)
    with torch.no_grad():
        _step(layer, x[:, :3], cache)
    sum(_step(layer, x[:, i : i + 1], cache).sum() for i in range(3, 6)).backward()
    for n, p in layer.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-10, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")


def test_inference_storage_then_no_grad_and_grad_steps():
    """Storage allocated under inference_mode cannot be written outside it: the
    next step outside moves the cache to new storage rather than fail."""
    layer, _, _ = _layer("heads-tied")
    x = _x(1, 6, 16, seed=4)
    with torch.no_grad():
        full = layer(x, x, x, is_causal=True, need_weights=False)[0]
    cache, outs = DamchaKVCache(capacity=16), []
    with torch.inference_mode():
        outs.append(_step(layer, x[:, :3], cache))
    with torch.no_grad():
        outs.append(_step(layer, x[:, 3:4], cache))
    assert not cache.key.is_inference()
    outs.append(_step(layer, x[:, 4:5], cache).detach())
    with torch.inference_mode():
        outs.append(_step(layer, x[:, 5:6], cache))
    torch.testing.assert_close(torch.cat([o.clone() for o in outs], dim=1), full, rtol=1e-12, atol=1e-13)


def test_capacity_reserves_storage_and_is_validated():
    layer, _, _ = _layer("heads-tied")
    x = _x(1, 5, 16, seed=5)
    cache = DamchaKVCache(capacity=32)
    with torch.inference_mode():
        _step(layer, x[:, :2], cache)
        assert cache.capacity == 32
        key = cache.key.clone()
        held = cache.key
        for i in range(2, 5):
            _step(layer, x[:, i : i + 1], cache)
        assert cache.capacity == 32 and len(cache) == 5
        torch.testing.assert_close(held, key, rtol=0, atol=0)  # earlier views keep their positions
        cache.reset()
        assert len(cache) == 0 and cache.key is None and cache.capacity == 0
    with pytest.raises(dc.DamchaValueError, match=r"`capacity`.*Received: capacity=0"):
        DamchaKVCache(capacity=0)
    with pytest.raises(dc.DamchaTypeError, match=r"`capacity`.*Received: capacity="):
        DamchaKVCache(capacity="8")


def test_pickle_and_deepcopy_keep_only_the_cached_positions():
    layer, _, _ = _layer("heads-separate")
    x = _x(2, 8, 16, seed=6)
    cache = DamchaKVCache(capacity=64)
    with torch.inference_mode():
        _step(layer, x[:, :5], cache)
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert len(twin) == 5 and twin.capacity == 5  # no spare storage copied
        torch.testing.assert_close(twin.key, cache.key, rtol=0, atol=0)
        torch.testing.assert_close(twin.value, cache.value, rtol=0, atol=0)
        with torch.inference_mode():
            a = [_step(layer, x[:, i : i + 1], twin) for i in range(5, 8)]
            twin_cap = twin.capacity
        assert twin_cap == 64  # the reserve survives
        with torch.no_grad():
            full = layer(x, x, x, is_causal=True, need_weights=False)[0]
        torch.testing.assert_close(torch.cat(a, dim=1), full[:, 5:], rtol=1e-12, atol=1e-13)
    assert len(cache) == 5  # the original is untouched by its copies' steps


def test_assigned_tensors_are_not_written_into():
    """``cache.key``/``cache.value`` stay assignable; an append after an
    assignment copies into new storage, never into the caller's tensors."""
    layer, _, _ = _layer("heads-tied")
    x = _x(1, 4, 16, seed=7)
    src = DamchaKVCache()
    with torch.no_grad():
        _step(layer, x[:, :3], src)
    key, value = src.key.clone(), src.value.clone()
    mine = torch.zeros(1, 4, 8, 4, dtype=torch.float64)
    mine[:, :, :3] = key
    cache = DamchaKVCache()
    cache.key, cache.value = mine[:, :, :3], value
    with torch.no_grad():
        out = _step(layer, x[:, 3:4], cache)
        full = layer(x, x, x, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(out, full[:, 3:], rtol=1e-12, atol=1e-13)
    assert torch.count_nonzero(mine[:, :, 3:]) == 0


def test_compiled_decode_does_not_recompile_per_token_or_per_growth():
    """torch.compile (fullgraph): a 40-token decode through five growths of
    the storage equals the eager full forward; dynamo makes a bounded number
    of graphs (empty cache, sizes 0/1, then a step that grows and one that does
    not, with the length and the capacity dynamic) and none after the first growths."""
    from torch._dynamo.testing import CompileCounterWithBackend

    layer, _, _ = _layer("heads-tied")
    x = _x(2, 40, 16, seed=8)
    with torch.no_grad():
        full = layer(x, x, x, is_causal=True, need_weights=False)[0]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(layer, fullgraph=True, backend=counter)
    cache, outs, frames, capacities = DamchaKVCache(), [], [], set()
    with torch.no_grad():
        for i in range(x.shape[1]):
            t = x[:, i : i + 1]
            outs.append(step(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0])
            frames.append(counter.frame_count)
            capacities.add(cache.capacity)
    assert len(capacities) >= 5, capacities
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)
    # After 8 tokens (empty cache, sizes 0/1, a static then a dynamic storage size) at most 4
    # graphs, as tests/test_torch_layers.py's compiled decode of lowrank-query-gqa asserts.
    assert frames[7] <= 4 and frames[-1] <= 6 and frames[16] == frames[-1], frames


class _Ops(TorchDispatchMode):
    """Counts the aten calls of each name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _flat_steps(layer: DamchaAttention, x: torch.Tensor, cache: DamchaKVCache, start: int) -> list[torch.Tensor]:
    """One-token steps from ``start`` on, under inference_mode, each checked to
    take the flat path (fn.few_tokens_step: its NaN guard is an addcmul_)."""
    outs = []
    with torch.inference_mode():
        for i in range(start, x.shape[1]):
            mode = _Ops()
            with mode:
                outs.append(_step(layer, x[:, i : i + 1], cache))
            assert mode.ops.get("addcmul_") == 1 and "addcmul" not in mode.ops, mode.ops
    return outs


@pytest.mark.parametrize("name", ["heads-tied", "heads-separate"])
@pytest.mark.parametrize("where", ["token", "generator", "query-weight", "gate"])
def test_flat_decode_step_gives_nan_where_the_reference_does(name, where, decode_kernel):
    """NaN in gives NaN out on the flat decoding path (inference, shapes seen),
    whose NaN guard is added into SDPA's output in place (SDPA's CPU kernel
    gives 0, not NaN, for some rows whose logits are all NaN): a NaN token
    makes its own row and every later row NaN, as the reference; a weight
    made non-finite between steps (the flat path reads them every step)
    makes every later row NaN. The rows before stay finite and equal."""
    layer, params, cfg = _layer(name)
    x = _x(1, 9, 16, seed=15)
    with torch.inference_mode():
        cache = DamchaKVCache()
        first = [_step(layer, x[:, :3], cache)] + [_step(layer, x[:, i : i + 1], cache) for i in (3, 4)]
    if where == "token":
        x[0, 6, 5] = float("nan")
        want = dc.damcha_attention(params, cfg, x.numpy(), causal=True)
        got = torch.cat(first + _flat_steps(layer, x, cache, 5), dim=1).numpy()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert np.isnan(want[0, 6:]).all() and not np.isnan(want[0, :6]).any()
        np.testing.assert_allclose(got[0, :6], want[0, :6], rtol=1e-10, atol=1e-12)
        return
    with torch.no_grad():
        if where == "generator":
            next(iter(layer.metric_generators.values())).weight[0, 0] = float("nan")
        elif where == "query-weight":
            layer.in_proj_weight[0, 0] = float("nan")
        else:
            next(iter(layer.metric_gates.values()))[0] = float("inf")
    later = torch.cat(_flat_steps(layer, x, cache, 5), dim=1)
    assert torch.isnan(later).all(), later
    assert torch.isfinite(torch.cat(first, dim=1)).all()


def _out_proj_hook(layer, calls):
    def hook(module, args, out):
        calls.append(out.shape)
        return out * 2.0 - 1.0

    return layer.out_proj.register_forward_hook(hook).remove


def _out_proj_instance_forward(layer, calls):
    # An override set on the instance (a wrapper, a monkeypatch): nothing on
    # the class changes and no hook dict holds it.
    linear = layer.out_proj

    def forward(t):
        out = nn.Linear.forward(linear, t)
        calls.append(out.shape)
        return out * 2.0 - 1.0

    linear.forward = forward
    return lambda: delattr(linear, "forward")


@pytest.mark.parametrize("wrap", [_out_proj_hook, _out_proj_instance_forward], ids=["forward-hook", "instance-forward"])
def test_flat_decode_step_calls_a_wrapped_out_proj(wrap):
    """The flat step calls F.linear on out_proj's parameters only when the
    module's call is exactly that: with a forward hook on out_proj, or a
    forward set on the instance, the wrapper runs on every step, and the
    outputs equal the general path's (autograd on) with the same wrapper."""
    layer, _, _ = _layer("heads-tied")
    x = _x(2, 7, 16, seed=16)
    calls: list = []
    undo = wrap(layer, calls)
    try:
        outs = {}
        for grad in (False, True):
            cache = DamchaKVCache()
            with torch.set_grad_enabled(grad):
                steps = [_step(layer, x[:, :3], cache)] + [_step(layer, x[:, i : i + 1], cache) for i in range(3, 7)]
            outs[grad] = torch.cat(steps, dim=1).detach()
        assert len(calls) == 10, calls
        torch.testing.assert_close(outs[False], outs[True], rtol=1e-12, atol=1e-13)
    finally:
        undo()
    with torch.no_grad():
        plain = layer(x, x, x, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(outs[False], plain * 2.0 - 1.0, rtol=1e-12, atol=1e-13)


def test_compiled_decode_step_is_the_flat_step_in_one_graph():
    """torch.compile (fullgraph: no graph break) of a decoding loop without
    autograd traces the flat step: each token graph holds one generator
    GEMM, one batched product for tied q and k and the NaN guard on SDPA's
    output, with no reduction (the general path's graph had a product per
    side and per-row maxima of |q~| and |k~|: 2 baddbmm, 2 amax); no
    graph is made after the first token steps; the outputs equal the eager
    decode and the reference (float64).

    Every call of a compiled step first evaluates its graph's guards, so
    what the traced flat step reads is a per-token cost: it checks the shape
    rules' one condition inline (a non-empty (B, N, E), E the packed
    weight's input size) and reads the config's sizes as one tuple, so no
    guard falls on damcha_core's functions and dicts or on a config field.
    Measured when written (the steady-state token graph): 120 guards, where
    the shape rules and the config fields made it 163 (E = 64: 4.9 against
    8.7 us per evaluation, RootGuardManager.check); the hand-written MHA
    step (_counts.mha_decode_step) compiled the same way has 48."""
    layer, params, cfg = _layer("heads-tied")
    x = _x(1, 30, 16, seed=17)
    graphs: list[dict[str, int]] = []
    guards: list[list[str]] = []

    def keep_all(entries):
        guards.append([e.name for e in entries])
        return [True] * len(entries)

    def backend(gm, example_inputs):
        ops: dict[str, int] = {}
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_method"):
                name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "?")
                ops[name] = ops.get(name, 0) + 1
        graphs.append(ops)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(layer, fullgraph=True, backend=backend, options={"guard_filter_fn": keep_all})
    outs, made = [], []
    with torch.no_grad():
        cache = DamchaKVCache()
        outs.append(step(x[:, :3], x[:, :3], x[:, :3], is_causal=True, need_weights=False, kv_cache=cache)[0])
        for i in range(3, 30):
            t = x[:, i : i + 1]
            outs.append(step(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0])
            made.append((len(graphs), cache.capacity))
        eager = DamchaKVCache()
        want = [_step(layer, x[:, :3], eager)] + [_step(layer, x[:, i : i + 1], eager) for i in range(3, 30)]
    # The storage holds 6, then 12, 24 and 48 positions (tokens 5, 11 and 23 grow it):
    # graphs for the prompt, the first token's sizes, a dynamic length, its first
    # growth, then a dynamic storage size and its growth (Dynamo makes a size dynamic
    # once it has changed); none after, through the third growth.
    assert [c for _, c in made] == [6] * 2 + [12] * 6 + [24] * 12 + [48] * 7, made
    assert made[8][0] == made[-1][0] <= 6, made
    for ops in graphs[1:]:  # the one-token graphs
        assert ops.get("baddbmm") == 1 and ops.get("linear") == 3, ops
        assert not ops.get("amax") and not ops.get("abs") and not ops.get("bmm"), ops
    token = guards[-1]  # the steady-state one-token graph's
    assert not [g for g in token if "damcha_core" in g or ".config" in g], token
    assert len(token) <= 125, (len(token), token)
    got = torch.cat(outs, dim=1)
    torch.testing.assert_close(got, torch.cat(want, dim=1), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(
        got.numpy(), dc.damcha_attention(params, cfg, x.numpy(), causal=True), rtol=1e-10, atol=1e-12
    )


def test_flat_decode_step_takes_the_hint_mask_and_no_other(monkeypatch):
    """With is_causal, the hint's 2-D (1, P + 1) mask, bool or float, takes
    the flat step, its values unread (all "masked" here, as the hint's
    contract says); a mask of another shape or dtype takes the general path.
    The eager step and the one torch.compile traces (called here as it is
    traced, without the compilation's seconds; compiled hint decodes are in
    tests/test_torch_fastpath.py) share the predicate. Every output equals
    the reference's causal decode."""
    import damcha_torch._functional as fn

    layer, params, cfg = _layer("heads-tied")
    x = _x(2, 10, 16, seed=21)
    flat = []
    real = fn.few_tokens_step

    def counted(*args, **kwargs):
        flat.append(kwargs.get("traced", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(fn, "few_tokens_step", counted)
    masks = {
        "bool": lambda P: torch.ones(1, P + 1, dtype=torch.bool),
        "float": lambda P: torch.full((1, P + 1), -1e9, dtype=torch.float64),
        "3-d": lambda P: torch.zeros(2 * 4, 1, P + 1, dtype=torch.bool),
    }
    taken = {}
    with torch.no_grad():
        cache = DamchaKVCache()
        outs = [_step(layer, x[:, :3], cache), _step(layer, x[:, 3:4], cache)]  # the second records the shapes
        for i, (kind, traced) in zip(range(4, 10), [(k, t) for t in (False, True) for k in masks]):
            t, before = x[:, i : i + 1], len(flat)
            mask = masks[kind](i)
            if traced:
                out = layer._traced_few_tokens_step(t, True, cache, mask)
                if out is None:  # forward goes on to the general path
                    out = layer(t, t, t, attn_mask=mask, is_causal=True, need_weights=False, kv_cache=cache)[0]
            else:
                out = layer(t, t, t, attn_mask=mask, is_causal=True, need_weights=False, kv_cache=cache)[0]
            outs.append(out)
            taken[kind, traced] = flat[before:]
        # Not the hint's (1, P + 1): the general path, which names the mask in its error.
        t, before, P = x[:, 9:10], len(flat), len(cache)
        for bad in (torch.zeros(1, P + 3, dtype=torch.bool), torch.zeros(1, P + 1, dtype=torch.int64)):
            assert layer._traced_few_tokens_step(t, True, cache, bad) is None
            with pytest.raises((ValueError, TypeError), match="attn_mask"):
                layer(t, t, t, attn_mask=bad, is_causal=True, need_weights=False, kv_cache=cache)
        assert len(flat) == before and len(cache) == P
    assert taken == {
        ("bool", False): [False],
        ("float", False): [False],
        ("3-d", False): [],
        ("bool", True): [True],
        ("float", True): [True],
        ("3-d", True): [],
    }, taken
    want = dc.damcha_attention(params, cfg, x.numpy(), causal=True)
    np.testing.assert_allclose(torch.cat(outs, dim=1).numpy(), want, rtol=1e-10, atol=1e-12)


def test_every_sequence_after_the_first_takes_the_flat_step_from_its_first_token(monkeypatch):
    """The token shape a step validated stays remembered across prompts of
    other shapes: after the first sequence (whose first token step records
    it), every token step of the next sequences, each after its own prompt,
    is the flat step. Before, the prompt replaced the memo and each
    sequence's first token step took the general path again (its one-token
    call dispatches about twice the flat step's aten ops). Outputs equal the
    reference."""
    import damcha_torch._functional as fn

    layer, params, cfg = _layer("heads-tied")
    flat = []
    real = fn.few_tokens_step

    def counted(*args, **kwargs):
        flat.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fn, "few_tokens_step", counted)
    for seq, prompt in enumerate((3, 5, 4)):
        x = _x(2, prompt + 4, 16, seed=30 + seq)
        before = len(flat)
        with torch.inference_mode():
            cache = DamchaKVCache()
            outs = [_step(layer, x[:, :prompt], cache)]
            outs += [_step(layer, x[:, i : i + 1], cache) for i in range(prompt, prompt + 4)]
        assert len(flat) - before == (3 if seq == 0 else 4), (seq, len(flat) - before)
        want = dc.damcha_attention(params, cfg, x.numpy(), causal=True)
        np.testing.assert_allclose(torch.cat(outs, dim=1).numpy(), want, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ static storage


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("fixed_shape", [False, True], ids=["static", "fixed-shape"])
def test_static_cache_never_reallocates_and_equals_full_forward(name, fixed_shape):
    """DamchaKVCache(capacity, static=True): the first call allocates the
    storage and every later call, a reset and a second sequence write into
    that same storage (its address never changes); the outputs equal the full
    causal forward and the reference (float64). A call that would pass the
    capacity raises before appending anything."""
    layer, params, cfg = _layer(name)
    x = _x(2, 12, 16, seed=11)
    with torch.no_grad():
        full = layer(x, x, x, is_causal=True, need_weights=False)[0]
    cache = DamchaKVCache(capacity=12, static=True, fixed_shape=fixed_shape)
    assert cache.static and cache.capacity == 12 and len(cache) == 0 and cache.key is None
    for sequence in range(2):
        outs, addresses = [], set()
        with torch.no_grad():
            outs.append(_step(layer, x[:, :3], cache))
            for i in range(3, 10):
                outs.append(_step(layer, x[:, i : i + 1], cache))
                addresses.add((cache._kbuf.data_ptr(), cache._vbuf.data_ptr()))
            outs.append(_step(layer, x[:, 10:12], cache))
            assert len(cache) == 12 and cache.capacity == 12
            with pytest.raises(dc.DamchaValueError, match=r"static `kv_cache`.*12 of `capacity`=12.*appends 1"):
                _step(layer, x[:, :1], cache)
            assert len(cache) == 12
        assert len(addresses) == 1, addresses
        if sequence == 0:
            first = addresses
        else:
            assert addresses == first  # reset kept the storage
        got = torch.cat(outs, dim=1)
        torch.testing.assert_close(got, full, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(
            got.numpy(), dc.damcha_attention(params, cfg, x.numpy(), causal=True), rtol=1e-10, atol=1e-12
        )
        cache.reset()
        assert len(cache) == 0 and cache.key is None and cache.capacity == 12


def test_static_cache_arguments_autograd_inference_and_copies():
    layer, _, _ = _layer("heads-tied")
    x = _x(1, 8, 16, seed=12)
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `capacity`: expected an int >= 1 with static=True.*Received: capacity=None",
    ):
        DamchaKVCache(static=True)
    with pytest.raises(dc.DamchaTypeError, match=r"`static`.*Received: static="):
        DamchaKVCache(capacity=4, static="yes")
    # Autograd recording: the in-place write would break earlier steps' backward.
    cache = DamchaKVCache(capacity=8, static=True)
    with pytest.raises(dc.DamchaValueError, match=r"no_grad\(\) or torch.inference_mode\(\).*requires_grad=True"):
        _step(layer, x[:, :3], cache)
    assert len(cache) == 0
    # Storage made under inference_mode: a step outside it mid-sequence is refused
    # (the storage cannot be written there), a new sequence reallocates.
    with torch.inference_mode():
        _step(layer, x[:, :3], cache)
    with torch.no_grad(), pytest.raises(dc.DamchaValueError, match=r"inference_mode"):
        _step(layer, x[:, 3:4], cache)
    assert len(cache) == 3
    cache.reset()
    with torch.no_grad():
        full = layer(x, x, x, is_causal=True, need_weights=False)[0]
        outs = [_step(layer, x[:, :5], cache)]
    assert not cache._kbuf.is_inference()
    # Copies stay static: the cached positions and the capacity travel, and
    # the twin decodes on into its own fixed storage.
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert twin.static and twin.capacity == 8 and len(twin) == 5
        with torch.no_grad():
            rest = [_step(layer, x[:, i : i + 1], twin) for i in range(5, 8)]
        torch.testing.assert_close(torch.cat(outs + rest, dim=1), full, rtol=1e-12, atol=1e-13)
        assert twin._kbuf.shape[2] == 9  # capacity + the free position
    assert len(cache) == 5


def test_compiled_decode_with_a_static_cache():
    """torch.compile (fullgraph) of a decode into a static cache: the storage is
    never replaced, the outputs equal the eager full forward, and after the
    first steps no step compiles again. Past the capacity a compiled step
    (without fullgraph, which turns every exception into its own error) raises
    the same DamchaValueError as eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    layer, _, _ = _layer("heads-tied")
    x = _x(2, 12, 16, seed=13)
    with torch.no_grad():
        full = layer(x, x, x, is_causal=True, need_weights=False)[0]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(layer, fullgraph=True, backend=counter)
    cache, outs, frames, addresses = DamchaKVCache(capacity=12, static=True), [], [], set()
    with torch.no_grad():
        outs.append(step(x[:, :2], x[:, :2], x[:, :2], is_causal=True, need_weights=False, kv_cache=cache)[0])
        for i in range(2, 12):
            t = x[:, i : i + 1]
            outs.append(step(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0])
            addresses.add(cache._kbuf.data_ptr())
            frames.append(counter.frame_count)
        loose = torch.compile(layer, backend="aot_eager")
        with pytest.raises(dc.DamchaValueError, match=r"12 of `capacity`=12"):
            loose(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)
    assert len(addresses) == 1 and len(cache) == 12
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)
    assert frames[-1] <= 4 and frames[3] == frames[-1], frames


def test_reduce_overhead_decode_with_a_static_cache_on_cpu():
    """mode="reduce-overhead" (CUDA graphs) runs Inductor without graphs on CPU:
    the numbers must still be right. The prompt runs eagerly (it allocates the
    storage, as docs/torch.md advises), the token steps compiled (dynamic
    sizes from the start: one Inductor compilation)."""
    layer, _, _ = _layer("heads-tied")
    x = _x(1, 6, 16, seed=14)
    with torch.no_grad():
        full = layer(x, x, x, is_causal=True, need_weights=False)[0]
    torch._dynamo.reset()
    step = torch.compile(layer, fullgraph=True, mode="reduce-overhead", dynamic=True)
    cache = DamchaKVCache(capacity=6, static=True)
    with torch.no_grad():
        outs = [layer(x[:, :2], x[:, :2], x[:, :2], is_causal=True, need_weights=False, kv_cache=cache)[0]]
        address = cache._kbuf.data_ptr()
        for i in range(2, 6):
            t = x[:, i : i + 1]
            outs.append(step(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0].clone())
    assert cache._kbuf.data_ptr() == address and len(cache) == 6
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------- fixed-shape reads


def _symbolic_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """Placeholders of a dynamo graph that are symbolic ints or tensors of
    symbolic size: what makes cudagraph trees record one graph per value."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        v = node.meta.get("example_value")
        if isinstance(v, torch.SymInt) or (
            isinstance(v, torch.Tensor) and not all(isinstance(s, int) for s in (*v.shape, *v.stride()))
        ):
            found.append(node.name)
    return found


def _decode_compiled(layer, step, x, cache, prompt: int = 2, mark_steps: bool = False) -> torch.Tensor:
    """The prompt uncompiled (it allocates the storage, as docs/torch.md advises),
    then one compiled call per token; outputs cloned (CUDA graphs reuse theirs)."""
    outs = [_step(layer, x[:, :prompt], cache)]
    for i in range(prompt, x.shape[1]):
        t = x[:, i : i + 1]
        if mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        outs.append(step(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0].clone())
    return torch.cat(outs, dim=1)


def test_fixed_shape_cache_compiles_one_static_graph_for_every_length():
    """DamchaKVCache(capacity, static=True, fixed_shape=True): a compiled token
    step reads the whole capacity with a mask of the cached positions and
    writes at a position held in a tensor, so one graph without any symbolic
    size serves every length (what lets CUDA graphs record once), also for a
    second sequence after reset(). The same loop on a static cache without it
    makes a graph whose key length is symbolic (one CUDA graph per length).
    Both equal the eager growing cache token for token and the reference
    (float64)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    layer, params, cfg = _layer("heads-tied")
    x = _x(2, 10, 16, seed=15)
    with torch.no_grad():
        eager = DamchaKVCache()
        want = torch.cat(
            [_step(layer, x[:, :2], eager)] + [_step(layer, x[:, i : i + 1], eager) for i in range(2, 10)], dim=1
        )
    np.testing.assert_allclose(
        want.numpy(), dc.damcha_attention(params, cfg, x.numpy(), causal=True), rtol=1e-10, atol=1e-12
    )
    graphs = {}
    for fixed in (True, False):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        step = torch.compile(layer, fullgraph=True, backend=counter)
        cache = DamchaKVCache(capacity=12, static=True, fixed_shape=fixed)
        with torch.no_grad():
            got = _decode_compiled(layer, step, x, cache)
            address = cache._kbuf.data_ptr()
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
            assert len(cache) == 10 and cache._kbuf.data_ptr() == address
            torch.testing.assert_close(cache.key, eager.key, rtol=1e-13, atol=1e-14)
            cache.reset()
            again = _decode_compiled(layer, step, x[:, :6], cache, prompt=3)
        torch.testing.assert_close(again, want[:, :6], rtol=1e-12, atol=1e-13)
        assert len(cache) == 6 and cache._kbuf.data_ptr() == address
        graphs[fixed] = (counter.frame_count, [_symbolic_inputs(g) for g in counter.graphs])
    assert graphs[True] == (1, [[]]), graphs
    assert any(graphs[False][1]), graphs  # the contrast: the plain static cache's length is a graph size


def test_fixed_shape_cache_eager_steps_arguments_and_finite_masked_positions():
    """Eager steps of a fixed_shape cache read the cached positions as a static
    cache does (same outputs); the position tensor follows every write, reset,
    copy and assignment; `fixed_shape` needs `static`; a NaN sequence leaves
    nothing behind that a masked read of the next one would turn into NaN."""
    from torch._dynamo.testing import CompileCounterWithBackend

    with pytest.raises(
        dc.DamchaValueError, match=r"`fixed_shape`.*static=True.*Received: fixed_shape=True, static=False"
    ):
        DamchaKVCache(capacity=4, fixed_shape=True)
    with pytest.raises(dc.DamchaTypeError, match=r"`fixed_shape`.*Received: fixed_shape="):
        DamchaKVCache(capacity=4, static=True, fixed_shape="yes")
    layer, _, _ = _layer("heads-separate")
    x = _x(1, 8, 16, seed=16)
    with torch.no_grad():
        full = layer(x, x, x, is_causal=True, need_weights=False)[0]
        cache = DamchaKVCache(capacity=8, static=True, fixed_shape=True)
        outs = [_step(layer, x[:, :3], cache)] + [_step(layer, x[:, i : i + 1], cache) for i in range(3, 5)]
        assert cache.fixed_shape and int(cache._pos) == len(cache) == 5
        for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
            assert twin.fixed_shape and int(twin._pos) == len(twin) == 5 and twin._kbuf.shape[2] == 9
            rest = [_step(layer, x[:, i : i + 1], twin) for i in range(5, 8)]
            torch.testing.assert_close(torch.cat(outs + rest, dim=1), full, rtol=1e-12, atol=1e-13)
        # A NaN sequence over the whole capacity, then reset and a finite one read at
        # the fixed shape: its masked positions must not be the old NaN.
        torch._dynamo.reset()
        step = torch.compile(layer, fullgraph=True, backend=CompileCounterWithBackend("aot_eager"))
        cache.reset()
        assert int(cache._pos) == 0
        bad = x.clone()
        bad[:, 0] = float("nan")  # every later query reads its key: all outputs NaN
        assert torch.isnan(_step(layer, bad, cache)).all()  # fills every position
        cache.reset()
        # Compiled steps (fixed-shape reads) alternate with eager ones, which read
        # the length the compiled ones left in the position tensor.
        got = [_step(layer, x[:, :3], cache)]
        for i in range(3, 8):
            t = x[:, i : i + 1]
            got.append((step if i % 2 else layer)(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0])
        assert len(cache) == 8
        got = torch.cat(got, dim=1)
    torch.testing.assert_close(got, full, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("device", TORCH_DEVICES)
def test_reduce_overhead_fixed_shape_decode_compiles_and_records_once(device, monkeypatch):
    """mode="reduce-overhead" with a fixed_shape cache: Inductor compiles the
    token step once for every length, and on CUDA the cudagraph trees record
    one graph for the whole decode (on CPU there are no CUDA graphs: Inductor
    alone). Outputs equal the eager decode (float64)."""
    from torch._inductor import cudagraph_trees

    recordings = []
    original = cudagraph_trees.CUDAGraphTreeManager.record_function

    def record_function(self, *args, **kwargs):
        recordings.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", record_function)
    layer, _, _ = _layer("heads-tied")
    layer = layer.to(device)
    x = _x(1, 9, 16, seed=17).to(device)
    with torch.no_grad():
        full = layer(x, x, x, is_causal=True, need_weights=False)[0]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    cache = DamchaKVCache(capacity=9, static=True, fixed_shape=True)
    with torch.no_grad():
        got = _decode_compiled(layer, step, x, cache, mark_steps=True)
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-12)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert len(recordings) == (1 if device == "cuda" else 0), recordings
    if device == "cuda":  # on CPU Inductor reports CUDA graphs skipped for the device
        assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
