"""DamchaAttention against the NumPy reference, conversion, stacks, decoding, training."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from _devices import TORCH_DEVICES
from torch import nn

import damcha_core as dc
from damcha_conformance import TOLERANCES, case_params
from damcha_torch import (
    DamchaAttention,
    DamchaKVCache,
    DamchaTransformerDecoderLayer,
    DamchaTransformerEncoderLayer,
    MetricGenerator,
    build_decoder,
    build_encoder,
    metric_penalty,
    replace_mha,
)

CONFIGS = {
    "heads-tied": dict(metric="heads", coupling="tied"),
    "heads-separate": dict(metric="heads", coupling="separate"),
    "lowrank-query-gqa": dict(metric="lowrank", metric_rank=3, coupling="query", num_kv_heads=2),
}


def _config(name: str, **kw) -> dc.DamchaConfig:
    return dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, **{**CONFIGS[name], **kw})


def _layer(cfg: dc.DamchaConfig, seed: int = 0) -> tuple[DamchaAttention, dict[str, np.ndarray]]:
    params = case_params(cfg, seed)  # open gates, non-zero biases
    return DamchaAttention.from_canonical(params, cfg, batch_first=True, dtype=torch.float64).eval(), params


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ------------------------------------------------------------ canonical I/O


@pytest.mark.parametrize("name", list(CONFIGS))
def test_canonical_round_trip_and_safetensors(name, tmp_path):
    cfg = _config(name)
    layer, params = _layer(cfg)
    back = layer.to_canonical()
    assert list(back) == list(cfg.param_shapes())
    for key, value in params.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)
    layer.save(tmp_path / "layer.safetensors")
    loaded = DamchaAttention.load(tmp_path / "layer.safetensors", batch_first=True, dtype=torch.float64).eval()
    assert loaded.config == cfg
    x = _x(2, 5, 16)
    torch.testing.assert_close(
        loaded(x, x, x, need_weights=False)[0], layer(x, x, x, need_weights=False)[0], rtol=0, atol=0
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_weights_path_equals_reference(name):
    """need_weights=True (explicit) gives the reference's output and probabilities."""
    cfg = _config(name)
    layer, params = _layer(cfg, seed=3)
    x = _x(2, 6, 16, seed=1)
    keep = np.ones((2, 1, 1, 6), dtype=bool)
    keep[1, ..., 4:] = False
    y, probs = dc.damcha_attention(params, cfg, x.numpy(), mask=keep, causal=True, return_weights=True)
    out, w = layer(
        x, x, x, key_padding_mask=torch.from_numpy(~keep[:, 0, 0]), is_causal=True, average_attn_weights=False
    )
    np.testing.assert_allclose(out.detach().numpy(), y, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(w.detach().numpy(), probs, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["heads-tied", "heads-separate"])
@pytest.mark.parametrize("shared_kv", [True, False], ids=["kv-one-tensor", "kv-two-tensors"])
@pytest.mark.parametrize("tokens", [(6, 4), (48, 40)], ids=["few", "many"])
def test_cross_attention_inference_equals_reference(name, shared_kv, tokens):
    """Without autograd a query projection of its own (and, with separate key
    and value tensors, the key projection too) is mapped by one bmm of
    I + diag(g) A, not the reference's residual y + g (A y): float64 agrees
    to 1e-12, and with its gates at 0 a layer made from nn.MultiheadAttention
    gives MHA's float32 output bit for bit. "many": enough tokens that the
    generator's product comes out of the projections' GEMMs (one joined
    weight per side; see _functional._linear_and_product)."""
    cfg = _config(name)
    layer, params = _layer(cfg, seed=4)
    n, m = tokens
    x, c = _x(2, n, 16, seed=1), _x(2, m, 16, seed=2)
    v = c if shared_kv else _x(2, m, 16, seed=3)
    expected = dc.damcha_attention(params, cfg, x.numpy(), c.numpy(), value=v.numpy(), causal=True)
    with torch.no_grad():
        out, _ = layer(x, c, v, need_weights=False, is_causal=True)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12, atol=1e-12)
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    fresh = DamchaAttention.from_mha(mha, coupling=cfg.coupling).eval()
    x32, c32, v32 = x.float(), c.float(), v.float()
    with torch.no_grad():
        ours, _ = fresh(x32, c32, v32, need_weights=False, is_causal=True)
        theirs, _ = mha(x32, c32, v32, need_weights=False, attn_mask=torch.ones(n, m, dtype=torch.bool).triu(1))
    assert torch.equal(ours, theirs)


def test_all_masked_rows_give_bias_and_finite_grads():
    cfg = _config("heads-tied")
    layer, params = _layer(cfg)
    x = _x(2, 4, 16).requires_grad_(True)
    am = torch.zeros(2 * 4, 4, 4, dtype=torch.bool)
    am[0:4, 1, :] = True  # batch 0, query 1: every key hidden in every head
    for need_weights in (False, True):
        out, _ = layer(x, x, x, attn_mask=am, need_weights=need_weights)
        torch.testing.assert_close(out[0, 1], layer.out_proj.bias, rtol=0, atol=1e-12)
        expected = dc.damcha_attention(params, cfg, x.detach().numpy(), mask=~am.view(2, 4, 4, 4).numpy())
        np.testing.assert_allclose(out.detach().numpy(), expected, rtol=1e-9, atol=1e-10)
        x.grad = None
        layer.zero_grad()
        out.sum().backward()
        assert torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_metric_penalty_matches_reference(name):
    cfg = _config(name)
    layer, params = _layer(cfg, seed=5)
    x = _x(2, 5, 16, seed=2)
    expected = dc.metric_penalty(params, cfg, x.numpy())
    torch.testing.assert_close(layer.metric_penalty(x).item(), expected, rtol=1e-10, atol=1e-12)
    layer.track_metric_penalty = True
    layer(x, x, x, need_weights=False)
    torch.testing.assert_close(metric_penalty(nn.Sequential(layer)).item(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["heads-tied", "lowrank-query-gqa"])
def test_metric_penalty_in_float16_with_large_tokens(name):
    """phi(t) makes the penalty scale-free, but sum(t^2) over the features
    overflows float16 (16 features of size 80 already pass 65504): like the
    map, the penalty must be computed in float32 for 16-bit layers."""
    cfg = _config(name)
    params = case_params(cfg, 5)
    layer = DamchaAttention.from_canonical(params, cfg, batch_first=True, dtype=torch.float16)
    x = (80 * _x(2, 5, 16, seed=2)).half()
    expected = dc.metric_penalty(params, cfg, x.double().numpy())
    tol = TOLERANCES["float16"]
    assert expected > 10 * tol.atol  # a zero (the overflow's result) would fail
    penalty = layer.metric_penalty(x)
    assert penalty.dtype == torch.float16
    np.testing.assert_allclose(penalty.item(), expected, rtol=tol.rtol, atol=tol.atol)
    layer.track_metric_penalty = True
    layer(x, x, x, need_weights=False)
    np.testing.assert_allclose(metric_penalty(layer).item(), expected, rtol=tol.rtol, atol=tol.atol)


def test_deepcopy_and_pickle_after_a_tracked_training_forward():
    """An EMA or best-model copy taken mid-training: the recorded penalty is a
    non-leaf tensor of the last graph, which deepcopy refuses; the copy must
    work, compute the same, and not carry the stale penalty."""
    import io
    import pickle

    enc = build_encoder(16, 4, 2, dim_feedforward=32, dropout=0.0, dtype=torch.float64)
    enc.apply(lambda m: setattr(m, "track_metric_penalty", True) if isinstance(m, DamchaAttention) else None)
    x = _x(2, 5, 16)
    enc(x).sum().backward()
    assert metric_penalty(enc).requires_grad
    buffer = io.BytesIO()
    torch.save(enc, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(enc), pickle.loads(pickle.dumps(enc)), torch.load(buffer, weights_only=False)):
        assert all(m.last_metric_penalty is None for m in twin.modules() if isinstance(m, DamchaAttention))
        torch.testing.assert_close(twin(x), enc(x), rtol=0, atol=0)
        gens = {id(layer.self_attn.metric_generators["qk"]) for layer in twin.layers}
        assert len(gens) == 1  # the shared generator stays shared in the copy


# --------------------------------------------------------------- causality


@pytest.mark.parametrize("name", list(CONFIGS))
def test_causal_future_tokens_do_not_leak(name):
    layer, _ = _layer(_config(name))
    x = _x(1, 8, 16)
    y = x.clone()
    y[:, 5:] += _x(1, 3, 16, seed=9)
    out_x, _ = layer(x, x, x, is_causal=True, need_weights=False)
    out_y, _ = layer(y, y, y, is_causal=True, need_weights=False)
    torch.testing.assert_close(out_y[:, :5], out_x[:, :5], rtol=0, atol=1e-13)
    assert (out_y[:, 5:] - out_x[:, 5:]).abs().max() > 1e-3


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("chunks", [(1,) * 6, (3, 1, 2)], ids=["token-by-token", "chunked"])
def test_kv_cache_decoding_equals_full_forward(name, chunks):
    cfg = _config(name)
    layer, params = _layer(cfg)
    x = _x(2, sum(chunks), 16)
    full, _ = layer(x, x, x, is_causal=True, need_weights=False)
    cache, outs, start = DamchaKVCache(), [], 0
    for size in chunks:
        t = x[:, start : start + size]
        outs.append(layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0])
        start += size
    assert len(cache) == x.shape[1]
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)
    # the cache holds transformed keys k~, as the reference's query_offset rule needs
    P = chunks[0]
    tail = x[:, P:]
    y = dc.damcha_attention(params, cfg, tail.numpy(), x.numpy(), causal=True, query_offset=P)
    torch.testing.assert_close(torch.cat(outs, dim=1)[:, P:], torch.from_numpy(y), rtol=1e-9, atol=1e-10)


# heads-tied (the same layer) is tests/test_torch_kv_cache.py's compiled decode, through more
# growths and with the same frame bound after 8 tokens: one compiled config here is enough.
@pytest.mark.parametrize("name", ["lowrank-query-gqa"])
def test_kv_cache_decoding_under_torch_compile(name):
    """A compiled decoding loop (fullgraph) equals the eager full forward, and the
    growing cache does not recompile per token: dynamo marks its length and
    its storage's size dynamic."""
    from torch._dynamo.testing import CompileCounterWithBackend

    cfg = _config(name)
    layer, _ = _layer(cfg)
    x = _x(2, 8, 16)
    full, _ = layer(x, x, x, is_causal=True, need_weights=False)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(layer, fullgraph=True, backend=counter)
    cache, outs = DamchaKVCache(), []
    with torch.no_grad():
        for i in range(x.shape[1]):
            t = x[:, i : i + 1]
            outs.append(step(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0])
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)
    # empty cache, a one-token cache (dynamo specialises sizes 0/1), a static then
    # dynamic storage size; tests/test_torch_kv_cache.py decodes through more growths
    assert counter.frame_count <= 4, counter.frame_count


# ---------------------------------------------------- conversion and stacks


def _vit_like() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.Linear(8, 16), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.LayerNorm(16)
    )


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_replace_mha_keeps_outputs_then_gates_learn(mode):
    torch.manual_seed(0)
    model = _vit_like().train(mode == "train")
    x = torch.randn(2, 6, 8)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, -2:] = True
    with torch.no_grad():
        expected = model[2](model[1](model[0](x), src_key_padding_mask=kpm))
    replace_mha(model)
    attns = [m for m in model.modules() if isinstance(m, DamchaAttention)]
    assert len(attns) == 2 and not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    with torch.no_grad():
        out = model[2](model[1](model[0](x), src_key_padding_mask=kpm))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().mean().backward()
    opt.step()
    for attn in attns:
        assert attn.metric_gates["qk"].abs().max() > 0


@pytest.mark.parametrize("how", ["from_mha", "replace_mha"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate-qkv"])
def test_conversion_keeps_frozen_parameters_frozen(packed, how):
    """A model frozen (or partly frozen) before conversion stays so: each
    parameter copied from the MHA keeps its requires_grad (before, from_mha made
    fresh trainable copies, so "freeze the backbone, train the gates" silently
    trained the attention projections too); the new gates and generators train."""
    torch.manual_seed(0)
    kw = {} if packed else {"kdim": 6, "vdim": 4}
    mha = nn.MultiheadAttention(8, 2, add_bias_kv=True, **kw)
    mha.requires_grad_(False)
    mha.in_proj_bias.requires_grad_(True)  # a partly frozen layer: one MHA parameter trains
    frozen = {n for n, p in mha.named_parameters() if not p.requires_grad}
    if how == "from_mha":
        layer = DamchaAttention.from_mha(mha)
    else:
        holder = nn.ModuleDict({"attn": mha})
        replace_mha(holder)
        layer = holder["attn"]
    flags = dict(layer.named_parameters())
    assert {n for n, p in flags.items() if not p.requires_grad} == frozen
    new = [n for n in flags if n.startswith("metric_")]
    assert new and all(flags[n].requires_grad for n in new)
    q = torch.randn(3, 2, 8)
    k, v = (q, q) if packed else (torch.randn(4, 2, 6), torch.randn(4, 2, 4))
    with torch.no_grad():
        for n in new:
            if "gates" in n:
                flags[n].fill_(0.5)
    layer(q, k, v)[0].square().sum().backward()
    assert {n for n, p in flags.items() if p.grad is None} == frozen


def test_replace_mha_moves_the_hooks_of_each_layer_to_its_replacement():
    """Hooks a user put on an MHA (feature capture, attention-map probes) run
    on its DAMCHA replacement with the same arguments and outputs, once per
    call for a layer shared by two parents; the handles returned at
    registration still remove them; gradient and state-dict hooks move too."""
    torch.manual_seed(0)
    shared = nn.MultiheadAttention(8, 2, batch_first=True)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    seen: dict[str, list] = {"pre": [], "pre-kwargs": [], "post": [], "backward": [], "state": []}

    def pre(module, args):
        seen["pre"].append((type(module).__name__, len(args)))

    def pre_kwargs(module, args, kwargs):
        seen["pre-kwargs"].append(sorted(kwargs))

    def post(module, args, out):
        seen["post"].append(out[0].detach().clone())
        return out[0] * 3.0, out[1]

    def backward(module, grad_in, grad_out):
        seen["backward"].append(grad_out[0].shape)

    def state(module, state_dict, prefix, local_metadata):
        seen["state"].append(prefix)

    handles = [
        shared.register_forward_pre_hook(pre),
        shared.register_forward_pre_hook(pre_kwargs, with_kwargs=True),
        shared.register_forward_hook(post),
        shared.register_full_backward_hook(backward),
        shared._register_state_dict_hook(state),
    ]
    x = torch.randn(2, 5, 8, requires_grad=True)
    before = shared(x, x, x, need_weights=False)[0]
    replace_mha(model)
    layer = model["a"]
    assert isinstance(layer, DamchaAttention) and model["b"][0] is layer
    for values in seen.values():
        values.clear()
    after = layer(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    assert seen["pre"] == [("DamchaAttention", 3)] and seen["pre-kwargs"] == [["need_weights"]]
    torch.testing.assert_close(after, 3.0 * seen["post"][0])
    after.sum().backward()
    assert seen["backward"] == [torch.Size([2, 5, 8])]
    layer.state_dict()
    assert seen["state"] == [""]
    for handle in handles:
        handle.remove()
    for values in seen.values():
        values.clear()
    plain = layer(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(plain, before / 3.0, rtol=1e-5, atol=1e-6)
    layer.state_dict()
    assert not any(seen.values()), seen


@pytest.mark.parametrize("tool", ["prune", "parametrize", "forward-hook"])
def test_replace_mha_keeps_the_out_proj_module_and_its_weight_tool(tool):
    """replace_mha moves the MHA's out_proj itself into the DAMCHA layer, so
    what a user put on it stays in force: pruned entries stay zero through a
    training step, a parametrization keeps shaping the weight, a hook runs."""
    from torch.nn.utils import parametrize, prune

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    out_proj = mha.out_proj
    calls = []
    if tool == "prune":
        prune.l1_unstructured(out_proj, "weight", amount=0.5)
    elif tool == "parametrize":
        parametrize.register_parametrization(out_proj, "weight", _Symmetric())
    else:
        out_proj.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    model = nn.Sequential(mha)
    x = torch.randn(2, 5, 8)
    before = mha(x, x, x, need_weights=False)[0]
    replace_mha(model)
    layer = model[0]
    assert isinstance(layer, DamchaAttention) and layer.out_proj is out_proj
    torch.testing.assert_close(layer(x, x, x, need_weights=False)[0], before, rtol=1e-5, atol=1e-6)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer(x, x, x, need_weights=False)[0].square().mean().backward()
    opt.step()
    if tool == "prune":
        mask = out_proj.weight_mask.bool()
        assert (~mask).sum() == 32 and (out_proj.weight[~mask] == 0).all()
    elif tool == "parametrize":
        torch.testing.assert_close(out_proj.weight, out_proj.weight.T)
    else:
        # The DAMCHA calls only: nn.MultiheadAttention reads out_proj.weight
        # and never calls the module, so its hooks never ran there.
        assert calls == [(2, 5, 8)] * 2


class _Symmetric(nn.Module):
    def forward(self, w):
        return (w + w.T) / 2


def test_replace_mha_on_default_encoder_with_padding_under_inference_mode():
    """torch's default encoder packs padded batches into nested tensors in
    inference; after replace_mha it must keep working and give the same output
    (the padded positions are garbage in both, so compare the real ones)."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 2).eval()
    x = torch.randn(3, 5, 16)
    kpm = torch.zeros(3, 5, dtype=torch.bool)
    kpm[0, -2:] = True
    with torch.inference_mode():
        expected = enc(x, src_key_padding_mask=kpm)
        replace_mha(enc)
        out = enc(x, src_key_padding_mask=kpm)
    keep = ~kpm
    torch.testing.assert_close(out[keep], expected[keep], rtol=1e-5, atol=1e-5)


# Each an encoder layer's activation and the aten op that must run it in place
# without gradients (None: not one of torch's ReLU/GELU, left as it is).
_ACTIVATIONS = {
    "relu": (lambda: "relu", "relu_"),
    "gelu": (lambda: "gelu", "gelu_"),
    "F.relu": (lambda: nn.functional.relu, "relu_"),
    "nn.ReLU": (lambda: nn.ReLU(), "relu_"),
    "nn.GELU-tanh": (lambda: nn.GELU(approximate="tanh"), "gelu_"),
    "silu": (lambda: nn.functional.silu, None),
}


def _activation_ops(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, set[str]]:
    """The layer's output and the names of the activation ops (relu, gelu, silu; in place or not) it ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name.rstrip("_") in ("relu", "gelu", "silu"):
                names.add(name)
            return func(*args, **(kwargs or {}))

    with Record():
        out = layer(x)
    return out, names


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("source", ["replace_mha", "DamchaTransformerEncoderLayer"])
@pytest.mark.parametrize("activation", list(_ACTIVATIONS))
def test_encoder_layer_activation_runs_in_place_only_without_grad(activation, source, norm_first):
    """In inference the encoder layer's ReLU/GELU overwrites linear1's output (torch's
    native MHA encoder kernel never keeps both either), giving torch's own output bit
    for bit; recording gradients it runs as torch's (GELU's backward reads its input)."""
    make, in_place = _ACTIVATIONS[activation]
    torch.manual_seed(3)
    kw = dict(dropout=0.0, activation=make(), batch_first=True, norm_first=norm_first)
    if source == "replace_mha":
        mha_layer = nn.TransformerEncoderLayer(16, 4, 32, **kw).eval()
        x = torch.randn(2, 5, 16)
        # torch's Python path (recording gradients): its native inference kernel takes
        # GELU exact even for nn.GELU(approximate="tanh")
        before = mha_layer(x).detach()
        layer = replace_mha(nn.Sequential(mha_layer))[0]
        assert type(layer) is DamchaTransformerEncoderLayer and isinstance(layer, nn.TransformerEncoderLayer)
    else:
        layer = DamchaTransformerEncoderLayer(16, 4, 32, **kw).eval()
        x = torch.randn(2, 5, 16)
    with torch.inference_mode():
        if source == "replace_mha":  # closed gates: the MHA layer's output
            torch.testing.assert_close(layer(x), before, rtol=1e-5, atol=1e-5)
        layer.self_attn.metric_gates["qk"].fill_(0.5)
        out, ops_inference = _activation_ops(layer, x)
    with torch.no_grad():
        out_no_grad, ops_no_grad = _activation_ops(layer, x)
    out_grad, ops_grad = _activation_ops(layer, x)
    plain = (in_place or "silu").rstrip("_")
    assert ops_grad == {plain}  # torch's own _ff_block
    assert ops_inference == ops_no_grad == {in_place or plain}
    assert torch.equal(out, out_grad.detach()) and torch.equal(out_no_grad, out)
    out_grad.square().sum().backward()  # GELU not overwritten under grad: backward runs
    assert layer.linear1.weight.grad.abs().max() > 0


@pytest.mark.parametrize("linear1", ["hooked", "subclass"])
def test_encoder_layer_activation_leaves_what_linear1_hands_out_alone(linear1):
    """The in-place activation overwrites linear1's output only where nothing
    else holds it: a forward hook on linear1 keeps what it saw (torch's layer
    does not overwrite it), and a linear1 whose output aliases its input (a
    subclass of nn.Linear returning a view) keeps the residual input intact. Each case equals torch's own
    layer, whose Python path runs the activation out of place (a reviewer's
    find: min(captured) 0.0 against -1.56, and an output off by 1.58)."""
    torch.manual_seed(5)
    mha_layer = nn.TransformerEncoderLayer(16, 4, 16, dropout=0.0, batch_first=True).eval()

    class Aliasing(nn.Linear):
        def forward(self, x):
            return x.view_as(x)

    seen = []
    if linear1 == "subclass":
        mha_layer.linear1 = Aliasing(16, 16)
    layer = replace_mha(nn.Sequential(copy.deepcopy(mha_layer)))[0]
    if linear1 == "hooked":
        layer.linear1.register_forward_hook(lambda module, args, out: seen.append(out))
    x = torch.randn(2, 5, 16)
    want = mha_layer(x).detach()  # torch's Python path (gradients recorded): out of place
    with torch.no_grad():
        got = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if linear1 == "hooked":
        kept = nn.functional.linear(
            layer.norm1(x + layer._sa_block(x, None, None)), layer.linear1.weight, layer.linear1.bias
        )
        assert seen[0].min() < 0 and torch.equal(seen[0], kept)


def test_encoder_layer_hooked_activation_module_stays_a_module_call():
    """A hooked activation module is called as a module (its hooks run), in inference too."""
    torch.manual_seed(4)
    layer = DamchaTransformerEncoderLayer(16, 4, 32, 0.0, activation=nn.GELU(), batch_first=True).eval()
    calls = []
    layer.activation.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    x = torch.randn(2, 5, 16)
    with torch.inference_mode():
        out, ops = _activation_ops(layer, x)
    assert calls == [torch.Size([2, 5, 32])] and ops == {"gelu"}
    assert torch.equal(out, layer(x).detach())
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        layer.activation._forward_hooks.clear()
        with torch.inference_mode():
            assert _activation_ops(layer, x)[1] == {"gelu"}  # a global module hook: still a module call
    finally:
        handle.remove()
    with torch.inference_mode():
        assert _activation_ops(layer, x)[1] == {"gelu_"}


def test_replace_mha_keeps_encoder_layer_subclasses_and_state_dict_keys():
    """Only torch's own encoder layer class becomes DamchaTransformerEncoderLayer; a user
    subclass (which may override the feed-forward) keeps its class; keys are unchanged."""

    class Mine(nn.TransformerEncoderLayer):
        pass

    model = nn.ModuleList(
        [nn.TransformerEncoderLayer(16, 4, 32, 0.0, batch_first=True), Mine(16, 4, 32, 0.0, batch_first=True)]
    )
    keys = set(model.state_dict())
    replace_mha(model)
    assert [type(m) for m in model] == [DamchaTransformerEncoderLayer, Mine]
    assert set(model.state_dict()) - keys == {k for k in model.state_dict() if "metric" in k}
    assert all(isinstance(m.self_attn, DamchaAttention) for m in model)
    clone = copy.deepcopy(model)
    assert type(clone[0]) is DamchaTransformerEncoderLayer


@pytest.mark.parametrize("share", [True, False], ids=["shared", "per-layer"])
def test_encoder_stack_sharing_and_parameter_count(share):
    E, H, L = 16, 4, 3
    enc = build_encoder(E, H, L, dim_feedforward=32, dropout=0.0, share_metric=share)
    gens = [layer.self_attn.metric_generators["qk"] for layer in enc.layers]
    assert (len({id(g) for g in gens}) == 1) == share
    gates = [layer.self_attn.metric_gates["qk"] for layer in enc.layers]
    assert len({id(g) for g in gates}) == L  # every layer keeps its own gate
    mha_stack = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(E, H, 32, 0.0, batch_first=True), L, enable_nested_tensor=False
    )
    base = sum(p.numel() for p in mha_stack.parameters())
    generator = E * H * H + H * H
    expected = base + L * H + (1 if share else L) * generator
    assert sum(p.numel() for p in enc.parameters()) == expected
    # a shared generator gets the gradient of every layer
    x = torch.randn(2, 5, E)
    with torch.no_grad():
        for g in gates:
            g.fill_(0.5)
    enc(x).sum().backward()
    assert gens[0].weight.grad is not None and gens[0].weight.grad.abs().max() > 0


def _randomised_metric(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "metric" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("target", ["replace_mha", "stack"])
def test_per_layer_generators_do_not_load_silently_into_a_shared_one(target):
    """A checkpoint of layers with generators of their own, loaded into a model
    whose layers share one generator, put every layer's values in turn into the
    one generator (the last layer's won, "All keys matched", a reviewer's find):
    refused naming the state dict and the two paths. A checkpoint of the shared
    model loads (twice in a row, other values the second time: one load is not
    mistaken for the next) and gives the saved model's outputs."""
    E, H, L = 16, 4, 3

    def build(shared: bool) -> nn.Module:
        torch.manual_seed(0)
        if target == "stack":
            return build_encoder(E, H, L, dim_feedforward=32, dropout=0.0, share_metric=shared).eval()
        host = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(E, H, 32, 0.0, batch_first=True), L, enable_nested_tensor=False
        ).eval()
        return replace_mha(host, metric_generator=MetricGenerator(E, H, E // H) if shared else None)

    per_layer, shared = _randomised_metric(build(False), 1), build(True)
    with pytest.raises(dc.DamchaValueError, match=r"`state_dict`.*layers\.0\..*layers\.1\..*one MetricGenerator"):
        shared.load_state_dict(per_layer.state_dict(), strict=target == "replace_mha")
    x = torch.randn(2, 5, E)
    for seed in (2, 3):
        saved = _randomised_metric(build(True), seed)
        assert shared.load_state_dict(saved.state_dict()) is not None
        torch.testing.assert_close(shared(x), saved(x), rtol=0, atol=0)


def test_a_shared_generators_own_state_dict_reloads_with_nan_and_on_meta():
    """The shared-generator check judges values, not bits it cannot compare: a
    stack's own state dict reloads when its generator holds a NaN (a diverged
    run reloaded to debug: torch.equal says NaN != NaN), cloned or not, and a
    meta stack's state dict loads with assign=True (meta tensors have no values
    to compare; torch.equal raised NotImplementedError). Reviewers' finds."""
    build = lambda: build_encoder(8, 2, 2, dim_feedforward=16, dropout=0.0, share_metric=True)  # noqa: E731
    enc = build()
    with torch.no_grad():
        enc.metric_generators["qk"].weight[0, 0] = float("nan")
    enc.load_state_dict(enc.state_dict())
    enc.load_state_dict({k: v.clone() for k, v in enc.state_dict().items()})
    assert torch.isnan(enc.layers[1].self_attn.metric_generators["qk"].weight[0, 0])
    with torch.device("meta"):
        meta = build()
    meta.load_state_dict(meta.state_dict(), assign=True)
    assert meta.layers[0].self_attn.metric_generators["qk"].weight.is_meta


def test_decoder_stack_runs_causal_with_memory():
    dec = build_decoder(16, 4, 2, dim_feedforward=32, dropout=0.0, cross_coupling="separate")
    tgt, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    out = dec(tgt, memory, tgt_mask=mask, tgt_is_causal=True)
    assert out.shape == (2, 5, 16) and torch.isfinite(out).all()
    cross = [layer.multihead_attn for layer in dec.layers]
    assert cross[0].metric_generators["q"] is cross[1].metric_generators["q"]
    assert dec.layers[0].self_attn.metric_generators["qk"] is not cross[0].metric_generators["q"]


def test_replace_mha_converts_every_name_of_one_mha_in_one_parent():
    # A module listed twice in one parent (ModuleList([mha] * k), two add_module names) appears once in
    # named_children(): its second and later names were left as nn.MultiheadAttention, silently.
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    model = nn.Module()
    model.blocks = nn.ModuleList([mha, mha, mha])
    model.add_module("a", mha)
    model.add_module("b", mha)
    x = torch.randn(2, 5, 8)
    before = mha(x, x, x, need_weights=False)[0]
    replace_mha(model)
    layer = model.a
    assert isinstance(layer, DamchaAttention)
    assert all(m is layer for m in [*model.blocks, model.b])  # still one shared module, under every name
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    torch.testing.assert_close(layer(x, x, x, need_weights=False)[0], before, rtol=1e-5, atol=1e-6)


def test_shared_generator_must_fit():
    gen = MetricGenerator(16, 4, 4)
    DamchaAttention(16, 4, metric_generator=gen)
    with pytest.raises(dc.DamchaValueError, match="metric_generator"):
        DamchaAttention(16, 2, metric_generator=gen)


def test_encoder_layer_never_takes_the_native_fast_path():
    """eval + batch_first + no grad is where nn.TransformerEncoderLayer would call
    its fused kernel; the open gates must still change the output."""
    torch.manual_seed(0)
    layer = DamchaTransformerEncoderLayer(16, 4, 32, 0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        closed = layer(x)
        layer.self_attn.metric_gates["qk"].fill_(1.0)
        opened = layer(x)
    assert (opened - closed).abs().max() > 1e-3


# ------------------------------------------------------ dtypes and compile


def test_autocast_bfloat16_close_to_float32():
    cfg = _config("heads-tied")
    params = case_params(cfg, 0)
    layer = DamchaAttention.from_canonical(params, cfg, batch_first=True).eval()
    x = _x(2, 6, 16).float()
    expected = dc.damcha_attention(params, cfg, x.numpy())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = layer(x, x, x, need_weights=False)
    assert out.dtype == torch.bfloat16
    np.testing.assert_allclose(out.detach().float().numpy(), expected, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_forward_backward(backend):
    cfg = _config("heads-tied")
    params = case_params(cfg, 0)
    layer = DamchaAttention.from_canonical(params, cfg, batch_first=True).train()  # recompute path
    x = _x(2, 5, 16).float().requires_grad_(True)
    # aot_eager: dynamo must capture one graph (fullgraph) and AOTAutograd its
    # backward; inductor (torch.compile's default) also generates the kernels.
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    out = compiled(x, x, x, need_weights=False, is_causal=True)[0]
    out.square().sum().backward()
    grad_compiled = x.grad.clone()
    x.grad = None
    eager = layer(x, x, x, need_weights=False, is_causal=True)[0]
    eager.square().sum().backward()
    # Inductor fuses and reorders float32 sums: compare at the float32 tolerance.
    tol = TOLERANCES["float32"]
    torch.testing.assert_close(out, eager, rtol=tol.rtol, atol=tol.atol)
    torch.testing.assert_close(grad_compiled, x.grad, rtol=tol.rtol, atol=tol.atol)


def test_torch_export_with_dynamic_batch_and_length():
    """torch.export.export (non-strict, its default) with dynamic B and N, as
    for nn.MultiheadAttention: the shape checks must not pin the example sizes,
    and the exported program must equal the layer at other sizes, empty ones
    included (the program failed in amax at N = M = 0 with this float mask:
    export traces N as >= 2 and dropped the layer's M = 0 branch)."""
    cfg = _config("heads-tied")
    layer = DamchaAttention.from_canonical(case_params(cfg, 4), cfg, batch_first=True).eval()
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")

    def inputs(b: int, n: int) -> tuple[tuple, dict]:
        x = _x(b, n, 16, seed=b).float()
        pad = torch.zeros(b, n, dtype=torch.bool)
        pad[-1:, -1:] = True  # none in an empty batch or sequence
        # (1, 1, N, N): a 2-D mask with is_causal=True would be the causal hint (not read).
        bias = _x(1, 1, n, n, seed=n).float()
        return (x, x, x), {"key_padding_mask": pad, "attn_mask": bias, "need_weights": False, "is_causal": True}

    args, kwargs = inputs(2, 5)
    tokens = {0: batch, 1: length}
    program = torch.export.export(
        layer,
        args,
        kwargs,
        dynamic_shapes={
            "query": tokens,
            "key": tokens,
            "value": tokens,
            "key_padding_mask": tokens,
            "attn_mask": {2: length, 3: length},
            "need_weights": None,
            "is_causal": None,
        },
    )
    for b, n in ((2, 5), (3, 7), (0, 5), (2, 0)):
        args, kwargs = inputs(b, n)
        got = program.module()(*args, **kwargs)[0]
        assert got.shape == (b, n, 16)
        torch.testing.assert_close(got, layer(*args, **kwargs)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("attention", ["self", "cross"])
def test_torch_export_of_a_gqa_layer_runs_empty_batches_and_sequences(attention):
    """A GQA layer (G < H: its NaN guard reduces over the keys) exported with dynamic B and N
    failed when its program was called with N = 0 ("amax(): Expected reduction dim 1 to have
    non-zero size"), though the eager layer returns the empty output: torch.export traces a
    dynamic dim as >= 2 and dropped the layer's size-0 branch. The program now gives the eager
    layer's output at every size, empty ones included, and keeps the guard (a NaN key makes its
    batch entry NaN, the others stay finite). torch's nn.MultiheadAttention, exported the same
    way, refuses B = 0 (a guard on 4 * B != M), so the eager layer is the reference."""
    cfg = _config("lowrank-query-gqa")
    layer = DamchaAttention.from_canonical(case_params(cfg, 4), cfg, batch_first=True).eval()

    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = layer

        def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return self.attn(x, c, c, need_weights=False, is_causal=attention == "self")[0]

    def inputs(b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = _x(b, n, 16, seed=b + n).float()
        return x, (x if attention == "self" else _x(b, n + 1 if n else 0, 16, seed=n).float())  # M = 0 for N = 0

    batch, length, keys = torch.export.Dim("batch"), torch.export.Dim("length"), torch.export.Dim("keys")
    program = torch.export.export(
        Attend(), inputs(2, 5), dynamic_shapes={"x": {0: batch, 1: length}, "c": {0: batch, 1: keys}}
    ).module()
    for b, n in ((3, 4), (0, 5), (2, 0), (0, 0)):
        x, c = inputs(b, n)
        with torch.no_grad():
            want = Attend()(x, c)
        got = program(x, c)
        assert got.shape == want.shape == (b, n, 16), (b, n)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    x, c = inputs(2, 5)
    c = c.clone()
    c[1, 2, 3] = float("nan")
    got = program(x if attention == "cross" else c, c)
    assert got[0].isfinite().all() and got[1].isnan().any()


def test_recompute_gives_the_same_gradients():
    cfg = _config("heads-separate")
    params = case_params(cfg, 0)
    grads = []
    for recompute in (True, False):
        layer = DamchaAttention.from_canonical(params, cfg, batch_first=True, dtype=torch.float64, recompute=recompute)
        x = _x(2, 5, 16).requires_grad_(True)
        layer(x, x, x, need_weights=False)[0].sum().backward()
        grads.append([x.grad] + [torch.from_numpy(g) for g in layer.canonical_grads().values()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# functorch has no batching rule for CPU SDPA and says so; the fallback is exact.
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_torch_func_per_sample_grads_in_training_mode():
    """vmap(grad(functional_call)) on a training-mode layer (recompute on by
    default): torch.func rejects checkpoint's saved-tensor hooks, so the layer
    must not use them there; per-sample grads equal a loop of backward calls."""
    from torch.func import functional_call, grad, vmap

    cfg = _config("heads-separate")
    layer = DamchaAttention.from_canonical(case_params(cfg, 2), cfg, batch_first=True, dtype=torch.float64).train()
    params = {n: p.detach() for n, p in layer.named_parameters()}
    x = _x(3, 4, 16)

    def loss(p, sample):
        t = sample[None]
        return functional_call(layer, p, (t, t, t), {"need_weights": False, "is_causal": True})[0].square().sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        layer.zero_grad()
        t = x[i : i + 1]
        layer(t, t, t, need_weights=False, is_causal=True)[0].square().sum().backward()
        for name, p in layer.named_parameters():
            torch.testing.assert_close(per_sample[name][i], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def _saved_activation_bytes(layer: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward, beyond the parameters and the input."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, x, x, need_weights=False)
    own = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    return sum(n for ptr, n in storages.items() if ptr not in own)


def test_recompute_keeps_saved_activations_within_mha():
    """The memory claim, measured exactly: with recompute (the default) training
    stores no more than nn.MultiheadAttention; without it, q/k and q~/k~ are both kept."""
    torch.manual_seed(0)
    x = torch.randn(2, 64, 32, requires_grad=True)
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    base = _saved_activation_bytes(mha, x)
    with_recompute = _saved_activation_bytes(DamchaAttention(32, 4, batch_first=True), x)
    without = _saved_activation_bytes(DamchaAttention(32, 4, batch_first=True, recompute=False), x)
    assert with_recompute <= base < without


@pytest.mark.parametrize("metric", ["heads", "lowrank"])
def test_module_dtype_and_device_moves_keep_outputs(metric):
    """nn.Module.to/.double/.float walk every submodule: the metric generator
    must not shadow Module._apply, and the moved layer must still match."""
    kw = {"metric_rank": 2} if metric == "lowrank" else {}
    layer = DamchaAttention(16, 4, batch_first=True, metric=metric, **kw)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "gate" in name:
                p.uniform_(0.3, 1.0)
    x = torch.randn(2, 5, 16)
    y32, _ = layer(x, x, x, need_weights=False)
    layer64 = copy.deepcopy(layer).double()
    assert all(p.dtype == torch.float64 for p in layer64.parameters())
    y64, _ = layer64(x.double(), x.double(), x.double(), need_weights=False)
    torch.testing.assert_close(y64.float(), y32, rtol=1e-4, atol=1e-5)
    back = layer64.to(torch.float32).to("cpu")
    torch.testing.assert_close(back(x, x, x, need_weights=False)[0], y32, rtol=1e-5, atol=1e-6)


def test_decoder_layer_equals_reference_composition():
    """Post-norm decoder layer, open gates: torch's norms and feed-forward around
    the reference's self- and cross-attention give the same output."""
    torch.manual_seed(0)
    layer = DamchaTransformerDecoderLayer(
        16, 4, dim_feedforward=32, dropout=0.0, batch_first=True, cross_coupling="separate", dtype=torch.float64
    ).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "gate" in name:
                p.uniform_(0.3, 1.0)
    tgt, memory = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, -3:] = True  # torch convention: True = padding
    out = layer(
        tgt,
        memory,
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64),
        tgt_is_causal=True,
        memory_key_padding_mask=pad,
    )

    def attend(attn, x, c, **kw):
        y = dc.damcha_attention(attn.to_canonical(), attn.config, x.numpy(), c.numpy(), **kw)
        return torch.from_numpy(y)

    with torch.no_grad():
        x = layer.norm1(tgt + attend(layer.self_attn, tgt, tgt, causal=True))
        x = layer.norm2(x + attend(layer.multihead_attn, x, memory, mask=(~pad).numpy()[:, None, None, :]))
        want = layer.norm3(x + layer.linear2(layer.activation(layer.linear1(x))))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    assert layer.multihead_attn.config.coupling == "separate"


def _meta_models() -> dict[str, tuple[nn.Module, bool]]:
    kw = dict(device="meta", dtype=torch.float32)
    return {
        "heads-tied": (DamchaAttention(16, 4, batch_first=True, **kw), True),
        "lowrank-separate-kdim": (
            DamchaAttention(
                16, 4, kdim=12, vdim=12, metric="lowrank", metric_rank=3, coupling="separate", batch_first=True, **kw
            ),
            True,
        ),
        "query-mqa-seq-first": (DamchaAttention(16, 4, num_kv_heads=1, coupling="query", **kw), True),
        "encoder-stack": (build_encoder(16, 4, 2, dim_feedforward=32, **kw), False),
        "decoder-stack": (build_decoder(16, 4, 2, dim_feedforward=32, **kw), False),
    }


@pytest.mark.parametrize("name", list(_meta_models()))
def test_every_tensor_follows_the_input_device(name):
    """Device-agnostic code, checked without a GPU: on the meta device any tensor
    the forward or backward built on the CPU instead (a mask, an arange, a zero
    penalty) raises a device-mismatch error, as it would on CUDA."""
    model, is_attention = _meta_models()[name]
    meta = dict(device="meta")
    x = torch.randn(2, 5, 16, **meta, requires_grad=True)
    pad = torch.zeros(2, 5, dtype=torch.bool, **meta)
    if is_attention:
        model.track_metric_penalty = True
        c = torch.randn(2, 7, model.kdim, **meta) if model.kdim != 16 else x
        if not model.batch_first:
            x, c = x.transpose(0, 1), c.transpose(0, 1)
        pad_c = torch.zeros(2, c.shape[0 if not model.batch_first else 1], dtype=torch.bool, **meta)
        for need_weights in (False, True):
            out, w = model(
                x,
                c,
                c,
                key_padding_mask=pad_c,
                need_weights=need_weights,
                is_causal=True,
                attn_mask=torch.zeros(5, pad_c.shape[1], **meta),
            )
            (out.sum() + metric_penalty(model)).backward()
            assert out.device.type == "meta" and (w is None) != need_weights
            assert w is None or w.device.type == "meta"
        if c is x:
            cache = DamchaKVCache()
            with torch.no_grad():
                for i in range(3):
                    t = x[:, i : i + 1] if model.batch_first else x[i : i + 1]
                    out, _ = model(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)
            assert len(cache) == 3 and out.device.type == "meta"
    elif name == "encoder-stack":
        out = model(
            x, is_causal=True, mask=torch.ones(5, 5, dtype=torch.bool, **meta).triu(1), src_key_padding_mask=pad
        )
        out.sum().backward()
    else:
        out = model(
            x,
            torch.randn(2, 7, 16, **meta),
            tgt_is_causal=True,
            tgt_mask=nn.Transformer.generate_square_subsequent_mask(5, **meta),
            memory_key_padding_mask=torch.zeros(2, 7, dtype=torch.bool, **meta),
        )
        out.sum().backward()
    assert out.device.type == "meta"
    assert all(p.grad is None or p.grad.device.type == "meta" for p in model.parameters())
    assert metric_penalty(model).device.type == "meta"  # recorded, or the zero of an untracked stack


@pytest.mark.parametrize("device", TORCH_DEVICES)
def test_layer_matches_reference_on_every_available_device(device):
    cfg = _config("lowrank-query-gqa")
    params = case_params(cfg, 1)
    layer = DamchaAttention.from_canonical(params, cfg, batch_first=True, device=device)
    x = _x(2, 6, 16).float()
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, -2:] = True  # torch convention: True = padding
    out, _ = layer(
        x.to(device), x.to(device), x.to(device), key_padding_mask=pad.to(device), need_weights=False, is_causal=True
    )
    want = dc.damcha_attention(params, cfg, x.double().numpy(), mask=(~pad).numpy()[:, None, None, :], causal=True)
    tol = TOLERANCES["float32"]
    np.testing.assert_allclose(out.detach().cpu().double().numpy(), want, rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize("device", TORCH_DEVICES)
def test_decode_autocast_and_compile_on_every_available_device(device):
    """What a GPU user runs besides the plain forward: the weights path and its
    gradients, KV-cache decoding, bfloat16 autocast and an inductor-compiled step,
    each against the reference or the same layer's eager float32 result."""
    cfg = _config("heads-separate")
    params = case_params(cfg, 2)
    layer = DamchaAttention.from_canonical(params, cfg, batch_first=True, device=device).eval()
    x = _x(2, 6, 16).float()
    xd = x.to(device, copy=True).requires_grad_(True)
    tol = TOLERANCES["float32"]
    want = dc.damcha_attention(params, cfg, x.double().numpy(), causal=True)
    out, weights = layer(xd, xd, xd, is_causal=True, average_attn_weights=False)
    np.testing.assert_allclose(out.detach().cpu().double().numpy(), want, rtol=tol.rtol, atol=tol.atol)
    assert weights.shape == (2, 4, 6, 6) and weights.device.type == device
    (grad,) = torch.autograd.grad(out.square().sum(), xd)
    x_cpu = x.clone().requires_grad_(True)
    cpu_layer = DamchaAttention.from_canonical(params, cfg, batch_first=True).eval()
    (grad_cpu,) = torch.autograd.grad(cpu_layer(x_cpu, x_cpu, x_cpu, is_causal=True)[0].square().sum(), x_cpu)
    torch.testing.assert_close(grad.cpu(), grad_cpu, rtol=tol.grad_rtol, atol=tol.grad_atol)

    cache, steps = DamchaKVCache(), []
    with torch.no_grad():
        for i in range(6):
            t = x[:, i : i + 1].to(device)
            steps.append(layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0])
    np.testing.assert_allclose(torch.cat(steps, 1).detach().cpu().double().numpy(), want, rtol=tol.rtol, atol=tol.atol)

    bf16 = TOLERANCES["bfloat16"]
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        low, _ = layer(x.to(device), x.to(device), x.to(device), is_causal=True, need_weights=False)
    assert low.dtype == torch.bfloat16
    np.testing.assert_allclose(low.detach().float().cpu().double().numpy(), want, rtol=bf16.rtol, atol=bf16.atol)

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)  # inductor: C++ kernels on CPU, Triton on CUDA
    with torch.no_grad():
        fast, _ = compiled(x.to(device), x.to(device), x.to(device), is_causal=True, need_weights=False)
    np.testing.assert_allclose(fast.detach().cpu().double().numpy(), want, rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize("share", [True, False], ids=["shared", "per-layer"])
@pytest.mark.parametrize("arch", ["post-norm-relu", "pre-norm-gelu-tanh-final"])
def test_encoder_stack_canonical_round_trip_and_core_reference(share, arch):
    """to_canonical() gives damcha_core's stack format: its NumPy reference
    reproduces the stack, and from_canonical rebuilds an equal stack."""
    kw = (
        dict(norm_first=True, activation=nn.GELU(approximate="tanh"), final_norm=True)
        if arch.startswith("pre")
        else dict(norm_first=False, activation="relu")
    )
    torch.manual_seed(0)
    enc = build_encoder(16, 4, 2, dim_feedforward=32, dropout=0.0, share_metric=share, dtype=torch.float64, **kw).eval()
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if "gate" in name:
                p.uniform_(0.3, 1.0)
    params, config = enc.to_canonical(causal=True)
    assert isinstance(config, dc.EncoderConfig) and config.share_metric == share and config.causal
    assert sorted(params) == sorted(config.param_shapes())
    x = _x(2, 5, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    with torch.no_grad():
        want = enc(x, mask=mask, is_causal=True)
    np.testing.assert_allclose(dc.encoder_forward(params, config, x.numpy()), want.numpy(), rtol=1e-10, atol=1e-10)
    twin = type(enc).from_canonical(params, config, dtype=torch.float64).eval()
    with torch.no_grad():
        torch.testing.assert_close(twin(x, mask=mask, is_causal=True), want, rtol=0, atol=1e-13)
    gens = {id(layer.self_attn.metric_generators["qk"]) for layer in twin.layers}
    assert len(gens) == (1 if share else 2)
    with pytest.raises(dc.DamchaValueError, match=r"layers.0.norm1.scale.*NaN"):
        twin.load_canonical({**params, "layers.0.norm1.scale": np.full(16, np.nan)})
