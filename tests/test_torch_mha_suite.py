"""The public behaviours PyTorch's own MHA suites check (test/nn/test_multihead_attention.py
and the nn.MultiheadAttention tests of test/test_transformers.py), written for DamchaAttention.

Read upstream to learn what is checked; nothing is copied. A fresh DamchaAttention
(gates 0) and metric "none" must behave as nn.MultiheadAttention does: every mask
combination, fast (eval, no autograd) and slow (training) paths, the 3-D per-batch
mask, square inputs, hooks, is_causal with torch's layers, replace_mha under
torch.compile. Differences that remain are in docs/torch.md, "Differences from MHA".
"""

from __future__ import annotations

import zlib

import pytest
import torch
from torch import nn

import damcha_core as dc
from damcha_torch import DamchaAttention, DamchaTransformerEncoderLayer, replace_mha

B, N, E, H = 2, 4, 8, 4
VARIANTS = {"gates0": "heads", "none": "none"}


def _pair(variant: str, seed: int = 0, **kw) -> tuple[nn.MultiheadAttention, DamchaAttention]:
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64, **kw)
    with torch.no_grad():
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    return mha, DamchaAttention.from_mha(mha, metric=VARIANTS[variant])


def _mask(kind: str | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    if kind is None:
        return None
    # crc32, not hash(): str hashes change per process (PYTHONHASHSEED), and with them the masks.
    g = torch.Generator().manual_seed(zlib.crc32(repr((kind, shape)).encode()))
    hidden = torch.rand(shape, generator=g) < 0.3
    hidden[..., 0] = False  # every query keeps a key: MHA's kernels give NaN for empty rows
    if dtype == torch.bool:
        return hidden
    return torch.zeros(shape, dtype=dtype).masked_fill(hidden, float("-inf"))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64], ids=["bool", "float"])
@pytest.mark.parametrize("kpm_dim", [None, 2], ids=["no-kpm", "kpm"])
@pytest.mark.parametrize("attn_dim", [None, 2, 3], ids=["no-attn", "attn2d", "attn3d"])
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")
def test_fast_and_slow_paths_agree_with_mha_for_every_mask_combination(variant, attn_dim, kpm_dim, mask_dtype):
    """Training mode (MHA's slow path) and eval + no_grad (its fused kernel) give
    the same output, and both equal nn.MultiheadAttention's, for 2-D/3-D attn_mask,
    key_padding_mask, both merged, bool or float."""
    mha, layer = _pair(variant)
    x = torch.randn(B, N, E, dtype=torch.float64)
    kwargs = {
        "attn_mask": None
        if attn_dim is None
        else _mask("attn", (N, N) if attn_dim == 2 else (B * H, N, N), mask_dtype),
        "key_padding_mask": None if kpm_dim is None else _mask("kpm", (B, N), mask_dtype),
        "need_weights": False,
    }
    outs = []
    for train in (True, False):
        mha.train(train), layer.train(train)
        with torch.set_grad_enabled(train):
            want, _ = mha(x, x, x, **kwargs)
            got, _ = layer(x, x, x, **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        outs.append(got)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_3d_mask_equals_the_per_batch_2d_calls(variant):
    """A (B*H, N, M) mask repeating one (N, M) mask per batch element gives what
    each element gives alone with its (N, M) mask (seq-first layout, as upstream)."""
    _, layer = _pair(variant, seed=1)
    layer.batch_first = False
    M = 3
    q, k = torch.randn(N, B, E, dtype=torch.float64), torch.randn(M, B, E, dtype=torch.float64)
    per_batch = torch.stack([_mask(f"b{b}", (N, M), torch.float64) for b in range(B)])
    out3d, _ = layer(q, k, k, attn_mask=per_batch.repeat_interleave(H, dim=0))
    for b in range(B):
        out2d, _ = layer(q[:, b : b + 1], k[:, b : b + 1], k[:, b : b + 1], attn_mask=per_batch[b])
        torch.testing.assert_close(out3d[:, b : b + 1], out2d, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_square_input_batch_equal_to_length(variant, train):
    """Batch size == sequence length must not be confused with (N, M) by any
    layout or mask broadcasting (upstream's 'square input' edge case)."""
    torch.manual_seed(2)
    ref = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(E, H, 16, 0.0, batch_first=True, dtype=torch.float64), 2, enable_nested_tensor=False
    ).train(train)
    ours = replace_mha(type(ref)(ref.layers[0], 2, enable_nested_tensor=False), metric=VARIANTS[variant]).train(train)
    ours.load_state_dict(ref.state_dict(), strict=False)
    x = torch.randn(2, 2, E, dtype=torch.float64)
    mask = torch.tensor([[False, True], [False, False]])
    with torch.set_grad_enabled(train):
        torch.testing.assert_close(ours(x, mask=mask), ref(x, mask=mask), rtol=1e-10, atol=1e-12)


def test_encoder_layer_is_causal_hint_gives_the_masked_output():
    """nn.TransformerEncoderLayer(src_mask=causal, is_causal=True) equals the same
    call without the hint, after replace_mha and in the DAMCHA layer (gates open)."""
    torch.manual_seed(3)
    layer = DamchaTransformerEncoderLayer(E, H, 16, 0.0, batch_first=True, dtype=torch.float64).eval()
    with torch.no_grad():
        layer.self_attn.metric_gates["qk"].fill_(0.5)
    x = torch.randn(1, 5, E, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    torch.testing.assert_close(layer(x, src_mask=mask, is_causal=True), layer(x, src_mask=mask), rtol=1e-12, atol=1e-12)
    assert (layer(x, src_mask=mask) - layer(x)).abs().max() > 1e-3  # the mask matters


@pytest.mark.parametrize("nhead", [3, 4])
def test_forward_hooks_on_self_attn_fire_in_inference(nhead):
    """A hook on self_attn must see the attention output: the layer never skips
    the module for a fused kernel (which would skip the map too)."""
    torch.manual_seed(4)
    layer = replace_mha(nn.TransformerEncoderLayer(12, nhead, 12, batch_first=True)).eval()
    seen = []
    handle = layer.self_attn.register_forward_hook(lambda m, args, out: seen.append(out[0].shape))
    with torch.inference_mode():
        layer(torch.rand(2, 4, 12))
    handle.remove()
    assert seen == [torch.Size([2, 4, 12])]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_padding_with_a_bool_causal_mask_in_encoder_and_decoder_warns_nothing(variant, recwarn):
    """Bool padding masks with a bool src/tgt mask: no 'mismatched mask type'
    warning and the outputs of the padded stacks equal torch's (keys of real tokens)."""
    torch.manual_seed(5)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True), 2, nn.LayerNorm(16), enable_nested_tensor=False
    )
    dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, 0.0, batch_first=True), 2, nn.LayerNorm(16))
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    causal = torch.ones(3, 3, dtype=torch.bool).triu_(1)
    pad = torch.arange(3)[None, :] >= torch.tensor([3, 2])[:, None]
    want_enc = enc(x, mask=causal, src_key_padding_mask=pad)
    want_dec = dec(x, memory, tgt_mask=causal, tgt_key_padding_mask=pad, memory_key_padding_mask=pad)
    recwarn.clear()
    replace_mha(enc, metric=VARIANTS[variant]), replace_mha(dec, metric=VARIANTS[variant])
    torch.testing.assert_close(enc(x, mask=causal, src_key_padding_mask=pad), want_enc, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        dec(x, memory, tgt_mask=causal, tgt_key_padding_mask=pad, memory_key_padding_mask=pad),
        want_dec,
        rtol=1e-5,
        atol=1e-6,
    )
    assert not [w for w in recwarn if "damcha" in str(w.filename) or "mismatched" in str(w.message)]


def test_replace_mha_model_under_torch_compile_equals_eager_and_trains():
    """A converted model compiles (one graph, forward and backward) and matches
    eager; the gates get gradients through the compiled graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(6)
    model = nn.Sequential(
        nn.Linear(6, 16),
        nn.TransformerEncoder(
            nn.TransformerEncoderLayer(16, 4, 32, 0.0, batch_first=True, norm_first=True), 2, enable_nested_tensor=False
        ),
    )
    replace_mha(model)
    with torch.no_grad():
        for attn in (m for m in model.modules() if isinstance(m, DamchaAttention)):
            attn.metric_gates["qk"].fill_(0.3)
    x = torch.randn(2, 5, 6)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    eager = model[1](model[0](x), mask=mask, is_causal=True)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def run(inp: torch.Tensor) -> torch.Tensor:
        return model[1](model[0](inp), mask=mask, is_causal=True)

    compiled = torch.compile(run, backend=counter, fullgraph=True)
    out = compiled(x)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    gates = [m.metric_gates["qk"] for m in model.modules() if isinstance(m, DamchaAttention)]
    assert counter.frame_count == 1 and all(g.grad is not None and g.grad.abs().max() > 0 for g in gates)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_bias_stored_in_another_dtype_as_upstream_fast_path_test(variant, dtype):
    """upstream sets in_proj_bias to float16 on a float64 MHA and calls it in
    eval + no_grad: it must run; DamchaAttention computes in the weights' dtype."""
    mha, layer = _pair(variant, seed=7)
    layer = layer.to(dtype).eval()
    layer.in_proj_bias = nn.Parameter(layer.in_proj_bias.detach().half())
    x = torch.randn(B, N, E, dtype=dtype)
    with torch.no_grad():
        out, _ = layer(x, x, x)
        # MHA itself (gates at 0: the same function) with the float16-rounded bias in the layer's dtype.
        mha = mha.to(dtype).eval()
        mha.in_proj_bias.copy_(layer.in_proj_bias.to(dtype))
        want, _ = mha(x, x, x, need_weights=False)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out, want, rtol=1e-5 if dtype == torch.float32 else 1e-10, atol=1e-6 if dtype == torch.float32 else 1e-12
    )


def test_invalid_shapes_and_nested_tensors_are_damcha_errors():
    """Where MHA asserts (AssertionError), DamchaAttention raises a DamchaValueError
    or DamchaTypeError naming the argument; nested tensors are refused clearly."""
    layer = DamchaAttention(4, 4)
    q = torch.randn(4, 4, 4)
    cases = [
        (
            lambda: layer(q, torch.randn(4, 4), q),
            dc.DamchaValueError,
            r"Invalid argument `key`: expected `query`, `key` and `value` all batched",
        ),
        (
            lambda: layer(q, q, q, key_padding_mask=torch.tensor([False, True, True, True])),
            dc.DamchaValueError,
            r"Invalid argument `key_padding_mask`: expected shape \(B, M\)",
        ),
        (
            lambda: layer(q, q, q, attn_mask=torch.tensor([False, True, True, True])),
            dc.DamchaValueError,
            r"Invalid argument `attn_mask`: expected shape \(N, M\) or \(B, H, N, M\)",
        ),
        (
            lambda: layer(q[0], q[0], q[0], attn_mask=torch.zeros(5, 4, 4, dtype=torch.bool)),
            dc.DamchaValueError,
            r"Invalid argument `attn_mask`: expected shape \(B\*H, N, M\) = \(4, 4, 4\)",
        ),
    ]
    nested = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged)
    cases.append(
        (
            lambda: layer(nested, nested, nested),
            dc.DamchaTypeError,
            r"Invalid argument `query`: expected a dense \(padded\) tensor.*\(nested\)",
        )
    )
    for call, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            call()


@pytest.fixture
def swap_on_conversion():
    # torch's own module tests run .to()/to_empty()/load_state_dict with and without
    # swapping; swapping is forced for tensor-subclass parameters (DTensor).
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("action", ["to-float64", "float", "to_empty", "load_state_dict"])
def test_swapping_conversions_work_after_decoding_as_for_mha(action, swap_on_conversion):
    """After decoding steps (which keep views of the gates between steps),
    ``.to()``, ``.float()``, ``to_empty`` and ``load_state_dict`` in swap mode
    work, as they do for nn.MultiheadAttention after a forward (they raised
    "Couldn't swap" while a kept view used a gate), and decoding afterwards
    gives what a full pass gives."""
    from damcha_torch import DamchaKVCache

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    layer = DamchaAttention.from_mha(mha)
    with torch.no_grad():
        layer.metric_gates["qk"].fill_(0.5)
    saved = {k: v.clone() for k, v in layer.state_dict().items()}

    def decode(n: int) -> torch.Tensor:
        x = torch.randn(1, n, E, dtype=layer.out_proj.weight.dtype)
        cache, steps = DamchaKVCache(), []
        with torch.inference_mode():
            for i in range(n):
                t = x[:, i : i + 1]
                steps.append(layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)[0])
            full = layer(x, x, x, is_causal=True, need_weights=False)[0]
        torch.testing.assert_close(torch.cat(steps, 1), full)
        return full

    decode(3)
    assert "_gate_columns" in layer.__dict__  # the kept views this is about
    for module in (mha, layer):
        if action == "to-float64":
            module.to(torch.float64)
        elif action == "float":
            module.float()
        elif action == "to_empty":
            module.to_empty(device="cpu")
        else:
            module.load_state_dict(saved if module is layer else mha.state_dict())
    if action == "to_empty":
        layer.load_state_dict(saved)  # values were left uninitialised
    assert layer.out_proj.weight.dtype == (torch.float32 if action == "float" else torch.float64)
    if action != "float":
        for name, value in layer.state_dict().items():
            torch.testing.assert_close(value, saved[name], rtol=0, atol=0)
    decode(3)


def test_meta_device_model_loads_an_mha_checkpoint_after_reset_parameters():
    """torch's meta-device recipe (build on meta, ``to_empty``, ``reset_parameters``
    on every module that has one, then load) with a converted model and an MHA
    checkpoint gives the MHA model's outputs: the gates and generators, absent
    from the checkpoint, are fresh (gates 0), not uninitialised memory."""
    torch.manual_seed(0)
    kw = dict(dim_feedforward=16, dropout=0.0, batch_first=True)
    reference = nn.TransformerEncoderLayer(E, H, **kw).eval()
    with torch.device("meta"):
        model = nn.TransformerEncoderLayer(E, H, **kw)
    replace_mha(model)
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    missing = model.load_state_dict(reference.state_dict(), strict=False).missing_keys
    assert sorted(missing) == [
        "self_attn.metric_gates.qk",
        "self_attn.metric_generators.qk.bias",
        "self_attn.metric_generators.qk.weight",
    ]
    x = torch.randn(B, N, E)
    torch.testing.assert_close(model.eval()(x), reference(x))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
def test_a_strided_nested_tensor_is_refused_by_name_also_from_a_hand_built_encoder():
    """torch's default (strided) nested tensor raises RuntimeError for .shape: describe()
    crashed inside the error message ('NestedTensorImpl doesn't support sizes'). A user who
    replaces self_attn by hand in an eval nn.TransformerEncoder with a padding mask gets
    them from torch; the refusal names the argument and says what to do."""
    nested = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)])
    layer = DamchaAttention(8, 2, batch_first=True).eval()
    with pytest.raises(dc.DamchaTypeError, match=r"Invalid argument `query`.*enable_nested_tensor=False.*nested"):
        layer(nested, nested, nested)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2).eval()
    for block in enc.layers:
        block.self_attn = DamchaAttention.from_mha(block.self_attn)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0, 3:] = True
    with torch.no_grad(), pytest.raises(dc.DamchaTypeError, match=r"replace_mha"):
        enc(torch.randn(2, 5, 8), src_key_padding_mask=pad)
    assert "nested" in dc.describe(nested)
