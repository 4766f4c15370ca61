"""Bad input to the PyTorch backend raises DamchaError subclasses that name the argument."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
import torch
from torch import nn

import damcha_core as dc
from damcha_core import DamchaNotIntegerError, DamchaTypeError, DamchaValueError
from damcha_torch import (
    DamchaAttention,
    DamchaTransformerDecoderLayer,
    DamchaTransformerEncoder,
    DamchaTransformerEncoderLayer,
    MetricGenerator,
    build_decoder,
    build_encoder,
)

x = torch.randn(2, 5, 16)


def _layer(**kw) -> DamchaAttention:
    return DamchaAttention(16, 4, batch_first=True, **kw)


@pytest.mark.parametrize(
    "build, error, pattern",
    [
        (
            lambda: DamchaAttention(16, 4, num_kv_heads=3, coupling="query"),
            DamchaValueError,
            r"^Invalid argument `num_heads`: expected a multiple of `num_kv_heads`.*Received: num_heads=4, num_kv_heads=3$",
        ),
        (
            lambda: DamchaAttention(16, 4, kdim=12, vdim=12, coupling="tied"),
            DamchaValueError,
            r"coupling='tied'.*kdim == embed_dim.*embed_dim=16, kdim=12",
        ),
        (
            lambda: DamchaAttention(16, 4, num_kv_heads=2, coupling="tied"),
            DamchaValueError,
            r"coupling='tied'.*num_kv_heads == num_heads.*num_heads=4, num_kv_heads=2",
        ),
        (
            lambda: DamchaAttention(16, 4, coupling="separate", metric_generator={"q": MetricGenerator(16, 4, 4)}),
            DamchaValueError,
            r"Invalid argument `metric_generator`: expected exactly this layer's metric sides \['q', 'k'\].*missing",
        ),
        (
            lambda: DamchaAttention(16, 4, coupling="separate", metric_generator=MetricGenerator(16, 4, 4)),
            DamchaValueError,
            r"Invalid argument `metric_generator`: expected a dict \{'q': ..., 'k': ...\} with coupling='separate'",
        ),
        (
            lambda: DamchaAttention(16, 4, metric="none", metric_generator=MetricGenerator(16, 4, 4)),
            DamchaValueError,
            r"Invalid argument `metric_generator`: expected None with metric='none'",
        ),
        (
            lambda: DamchaAttention(16, 4, metric_generator={"qk": nn.Linear(2, 2)}),
            DamchaTypeError,
            r"Invalid argument `metric_generator\['qk'\]`: expected a MetricGenerator",
        ),
        (
            lambda: DamchaAttention(16, 2, metric_generator=MetricGenerator(16, 4, 4)),
            DamchaValueError,
            r"Invalid argument `metric_generator`: expected a generator that fits side 'qk' of this layer; it differs in heads=4 \(expected 2\)",
        ),
        (
            lambda: DamchaAttention(18, 4),
            DamchaValueError,
            r"Invalid argument `embed_dim`: expected a multiple of `num_heads`.*embed_dim=18",
        ),
        (
            lambda: DamchaAttention(16, 4, metric="lowrank"),
            DamchaValueError,
            r"^Invalid argument `metric_rank`: expected an int >= 1 with metric='lowrank' \(it is required\)",
        ),
        (
            lambda: DamchaAttention(16, 4, metric="full"),
            DamchaValueError,
            r"Invalid argument `metric`: expected one of",
        ),
        (
            lambda: DamchaAttention(16, 4, add_bias_kv=1),
            DamchaTypeError,
            r"^Invalid argument `add_bias_kv`: expected a bool",
        ),
        (
            lambda: DamchaAttention(16, 4, metric_generator=nn.Linear(2, 2)),
            DamchaTypeError,
            r"^Invalid argument `metric_generator`: expected a MetricGenerator, a dict",
        ),
        (
            lambda: DamchaAttention.from_mha(nn.Linear(2, 2)),
            DamchaTypeError,
            r"Invalid argument `mha`: expected an nn.MultiheadAttention",
        ),
        # nn.MultiheadAttention's argument names, not DamchaConfig's (query_dim, context_dim, use_bias)
        (
            lambda: DamchaAttention(16.0, 4),
            DamchaTypeError,
            r"^Invalid argument `embed_dim`: expected an int >= 1\. Received: embed_dim=16\.0",
        ),
        (
            lambda: DamchaAttention(16, 4, bias="no"),
            DamchaTypeError,
            r"^Invalid argument `bias`: expected a bool\. Received: bias='no'",
        ),
        (
            lambda: DamchaAttention(16, 4, kdim=0, vdim=0, coupling="separate"),
            DamchaValueError,
            r"^Invalid argument `kdim`: expected an int >= 1 or None\. Received: kdim=0",
        ),
    ],
    ids=[
        "heads-not-divisible",
        "kdim-with-tied",
        "gqa-with-tied",
        "separate-one-side",
        "separate-one-generator",
        "none-with-generator",
        "generator-value-type",
        "generator-misfit",
        "embed-not-divisible",
        "lowrank-no-rank",
        "unknown-metric",
        "bias-kv-type",
        "generator-type",
        "from-mha-type",
        "embed-type",
        "bias-type",
        "kdim-zero",
    ],
)
def test_constructor_errors(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (
            lambda m: m(torch.randn(2, 5, 12), torch.randn(2, 5, 12), torch.randn(2, 5, 12)),
            DamchaValueError,
            r"Invalid argument `query`: expected 16 features \(embed_dim\).*Received: query.shape=\(2, 5, 12\)",
        ),
        (
            lambda m: m(x, x[:1], x[:1]),
            DamchaValueError,
            r"Invalid argument `key`: expected the batch size of `query`.*key.shape=\(1, 5, 16\)",
        ),
        (
            lambda m: m(x, x[:, :0], x[:, :0]),
            DamchaValueError,
            r"^Invalid argument `key`: expected at least one key \(M >= 1\) when there are queries.*Received: key.shape=\(2, 0, 16\)$",
        ),
        (
            lambda m: m(x.long(), x.long(), x.long()),
            DamchaTypeError,
            r"Invalid argument `query`: expected a real floating tensor.*int64",
        ),
        (
            lambda m: m(x, x, torch.randn(2, 4, 16)),
            DamchaValueError,
            r"Invalid argument `value`: expected the batch size and length of `key`.*value.shape=\(2, 4, 16\)",
        ),
        (
            lambda m: m(torch.randn(5, 16), x, x),
            DamchaValueError,
            r"Invalid argument `key`: expected a 2-D \(unbatched\) tensor with an unbatched \(2-D\) `query`.*key.shape=\(2, 5, 16\)",
        ),
        (
            lambda m: m(x, torch.randn(5, 16), torch.randn(5, 16)),
            DamchaValueError,
            r"Invalid argument `key`: expected `query`, `key` and `value` all batched \(B, N, E\) or all unbatched \(N, E\).*key.shape=\(5, 16\)",
        ),
        (
            lambda m: m(x[None], x[None], x[None]),
            DamchaValueError,
            r"Invalid argument `query`: expected `query`, `key` and `value` all batched.*query.shape=\(1, 2, 5, 16\)",
        ),
        (
            lambda m: m(x[0], x[0], x[0], key_padding_mask=torch.zeros(1, 5, dtype=torch.bool)),
            DamchaValueError,
            r"Invalid argument `key_padding_mask`: expected shape \(M,\) = \(5,\).*\(1, 5\)",
        ),
        (
            lambda m: m(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)),
            DamchaValueError,
            r"Invalid argument `key_padding_mask`: expected shape \(B, M\) = \(2, 5\).*\(2, 4\)",
        ),
        (
            lambda m: m(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.int64)),
            DamchaTypeError,
            r"Invalid argument `key_padding_mask`: expected a bool tensor \(True = masked out.*int64",
        ),
        (
            lambda m: m(x, x, x, attn_mask=torch.zeros(5, 4, dtype=torch.bool)),
            DamchaValueError,
            r"Invalid argument `attn_mask`: expected a shape broadcastable.*attn_mask.shape=\(5, 4\)",
        ),
        (
            lambda m: m(x, x, x, attn_mask=torch.zeros(2, 5, 5, dtype=torch.bool)),
            DamchaValueError,
            r"Invalid argument `attn_mask`: expected shape \(B\*H, N, M\) = \(8, 5, 5\)",
        ),
        (
            lambda m: m(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.uint8)),
            DamchaTypeError,
            r"Invalid argument `attn_mask`: expected a bool tensor.*uint8",
        ),
        (
            lambda m: m(x, x, x, is_causal=True, need_weights=False, kv_cache=object()),
            DamchaTypeError,
            r"Invalid argument `kv_cache`: expected a DamchaKVCache or None\. Received: kv_cache=<object",
        ),
    ],
    ids=[
        "wrong-embed",
        "key-batch",
        "empty-key",
        "int-query",
        "value-shape",
        "unbatched-query-batched-key",
        "batched-query-unbatched-key",
        "rank-4",
        "unbatched-padding-shape",
        "padding-shape",
        "padding-dtype",
        "mask-shape",
        "mask-3d-shape",
        "mask-dtype",
        "kv-cache-type",
    ],
)
def test_forward_errors(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call(_layer())


@pytest.mark.parametrize("name", ["attn_mask", "key_padding_mask"])
def test_a_mask_on_another_device_names_the_mask(name):
    """A mask on another device than the inputs (the meta device here; a CPU
    mask beside CUDA inputs alike) names the mask and both devices, where
    torch's own error named neither; the causal hint's mask, never read, is
    not checked (nn.MultiheadAttention drops it too)."""
    mask = torch.zeros((2, 5) if name == "key_padding_mask" else (5, 5), device="meta")
    if name == "key_padding_mask":
        mask = mask.bool()
    layer = _layer()
    with pytest.raises(
        DamchaValueError, match=rf"`{name}`: expected a tensor on the inputs' device \(cpu\).*{name}.device=meta"
    ):
        layer(x, x, x, **{name: mask})
    if name == "attn_mask":
        hinted = layer(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
        torch.testing.assert_close(hinted, layer(x, x, x, is_causal=True, need_weights=False)[0])


def test_separate_coupling_rejects_wrong_context_size():
    layer = DamchaAttention(16, 4, kdim=12, vdim=12, coupling="separate", batch_first=True)
    with pytest.raises(
        DamchaValueError, match=r"Invalid argument `key`: expected 12 features \(kdim\).*key.shape=\(2, 5, 16\)"
    ):
        layer(x, x, x)


def test_from_canonical_rejects_mismatched_params():
    layer = _layer()
    params = layer.to_canonical()
    params["query.kernel"] = params["query.kernel"][:, :2]
    with pytest.raises(DamchaValueError, match=r"query.kernel'\]`: expected shape \(16, 4, 4\)"):
        DamchaAttention.from_canonical(params, layer.config)


def test_kv_cache_mismatch_names_the_cache_and_leaves_it_intact():
    """A call that does not fit the cache (other batch, head size, dtype) raises
    before appending, so the cache still continues its sequence afterwards."""
    from damcha_torch import DamchaKVCache

    layer = _layer().double().eval()
    t = x.double()[:, :1]
    cache = DamchaKVCache()
    layer(t, t, t, is_causal=True, need_weights=False, kv_cache=cache)
    wider = DamchaAttention(16, 4, batch_first=True, key_dim=8, dtype=torch.float64)
    bad = [
        (
            lambda: layer(t[:1], t[:1], t[:1], is_causal=True, need_weights=False, kv_cache=cache),
            r"Invalid argument `key`: expected the batch, head count and head size the `kv_cache` holds.*cached key shape \(2, 4, 1, 4\), new key shape \(1, 4, 1, 4\)",
        ),
        (
            lambda: wider(t, t, t, is_causal=True, need_weights=False, kv_cache=cache),
            r"Invalid argument `key`: expected the batch, head count and head size the `kv_cache` holds.*new key shape \(2, 4, 1, 8\)",
        ),
        (
            lambda: _layer()(t.float(), t.float(), t.float(), is_causal=True, need_weights=False, kv_cache=cache),
            r"Invalid argument `key`: expected the dtype and device of the keys the `kv_cache` holds.*cached torch.float64 on cpu, new torch.float32 on cpu",
        ),
        # Causal decoding appends one key per query (query i sits at P + i):
        # other counts would put the cache's positions out of step.
        (
            lambda: layer(t, x.double()[:, 1:3], x.double()[:, 1:3], is_causal=True, kv_cache=cache),
            r"Invalid argument `key`: expected one new key per query token with is_causal=True and a kv_cache "
            r"\(self-attention decoding\)\. Received: query\.shape=\(2, 1, 16\), key\.shape=\(2, 2, 16\)",
        ),
        (
            lambda: layer(x.double()[:, 1:3], t, t, is_causal=True, need_weights=False, kv_cache=cache),
            r"one new key per query token.*Received: query\.shape=\(2, 2, 16\), key\.shape=\(2, 1, 16\)",
        ),
    ]
    for call, pattern in bad:
        with pytest.raises(DamchaValueError, match=pattern):
            call()
        assert len(cache) == 1
    s = x.double()[:, 1:2]
    out, _ = layer(s, s, s, is_causal=True, need_weights=False, kv_cache=cache)
    full, _ = layer(x.double()[:, :2], x.double()[:, :2], x.double()[:, :2], is_causal=True, need_weights=False)
    torch.testing.assert_close(out, full[:, 1:], rtol=1e-12, atol=1e-12)


def test_kv_cache_without_is_causal_appends_any_number_of_keys():
    """Only causal decoding ties the key count to the query count: without
    ``is_causal`` the cache takes, e.g., a prefix or cross-attention keys."""
    from damcha_torch import DamchaKVCache

    layer = _layer().double().eval()
    with torch.no_grad():
        layer.metric_gates["qk"].normal_()
    xd = x.double()
    cache = DamchaKVCache()
    layer(xd[:, :1], xd[:, :3], xd[:, :3], kv_cache=cache)
    out, _ = layer(xd[:, 3:5], xd[:, 3:4], xd[:, 3:4], kv_cache=cache)
    assert len(cache) == 4
    full, _ = layer(xd[:, 3:5], xd[:, :4], xd[:, :4])
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("num_layers", "error"),
    [(0, DamchaValueError), (2.0, DamchaNotIntegerError), ("2", DamchaTypeError)],
    ids=["zero", "float", "string"],
)
def test_stack_builders_reject_bad_num_layers(num_layers, error):
    """The core's classes for the same values (EncoderConfig, damcha_jax's stacks)."""
    for build in (build_encoder, build_decoder):
        with pytest.raises(
            error,
            match=rf"Invalid argument `num_layers`: expected an int >= 1\. Received: num_layers={num_layers!r}",
        ):
            build(16, 4, num_layers, dim_feedforward=8)
    with pytest.raises(error, match=r"`num_layers`"):
        dc.EncoderConfig(
            attention=dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4), num_layers=num_layers, ffn_dim=8
        )


# ---------------------------------------------------------- blocks and builders (issue 11)


@pytest.mark.parametrize(
    "build, error, pattern",
    [
        (
            lambda: build_encoder(30, 4, 2),
            DamchaValueError,
            r"^Invalid argument `d_model`: expected a multiple of `nhead` when `key_dim` is not given\. Received: d_model=30, nhead=4",
        ),
        (
            lambda: build_decoder(30, 4, 2),
            DamchaValueError,
            r"^Invalid argument `d_model`: expected a multiple of `nhead`",
        ),
        (
            lambda: build_encoder(16.0, 4, 2),
            DamchaTypeError,
            r"^Invalid argument `d_model`: expected an int >= 1\. Received: d_model=16\.0",
        ),
        (
            lambda: build_encoder(16, 0, 2),
            DamchaValueError,
            r"^Invalid argument `nhead`: expected an int >= 1\. Received: nhead=0",
        ),
        (
            lambda: build_encoder(16, 4, 2, dim_feedforward=0),
            DamchaValueError,
            r"^Invalid argument `dim_feedforward`: expected an int >= 1",
        ),
        (
            lambda: build_encoder(16, 4, 2, dropout=1.5),
            DamchaValueError,
            r"^Invalid argument `dropout`: expected a number in \[0, 1\)",
        ),
        (
            lambda: build_encoder(16, 4, 2, activation="swish"),
            DamchaValueError,
            r"^Invalid argument `activation`: expected 'relu', 'gelu' or a callable\. Received: activation='swish'",
        ),
        (
            lambda: build_encoder(16, 4, 2, norm_first="yes"),
            DamchaTypeError,
            r"^Invalid argument `norm_first`: expected a bool",
        ),
        (
            lambda: build_encoder(16, 4, 2, final_norm=1),
            DamchaTypeError,
            r"^Invalid argument `final_norm`: expected a bool",
        ),
        (
            lambda: build_encoder(16, 4, 2, share_metric="no"),
            DamchaTypeError,
            r"^Invalid argument `share_metric`: expected a bool",
        ),
        (
            lambda: build_encoder(16, 4, 2, dtype=torch.int32),
            DamchaTypeError,
            r"^Invalid argument `dtype`: expected None or a real floating",
        ),
        (
            lambda: build_encoder(16, 4, 2, metric="full"),
            DamchaValueError,
            r"^Invalid argument `metric`: expected one of",
        ),
        (
            lambda: build_encoder(16, 4, 2, kdim=8),
            DamchaTypeError,
            r"^Invalid argument `kdim`: expected DAMCHA attention arguments, a subset of \[.*Received: unknown keyword argument \['kdim'\]$",
        ),
        (
            lambda: DamchaTransformerEncoderLayer(16, 4, layer_norm_eps=-1.0),
            DamchaValueError,
            r"^Invalid argument `layer_norm_eps`: expected a finite number >= 0",
        ),
        (
            lambda: DamchaTransformerEncoderLayer(16, 4, metric_generator=MetricGenerator(16, 2, 8)),
            DamchaValueError,
            r"^Invalid argument `metric_generator`: expected a generator that fits side 'qk'",
        ),
        (
            lambda: DamchaTransformerEncoder(DamchaTransformerEncoderLayer(16, 4), 2, norm=5),
            DamchaTypeError,
            r"^Invalid argument `norm`: expected a torch.nn.Module",
        ),
        (
            lambda: build_decoder(16, 4, 2, cross_coupling="crossed"),
            DamchaValueError,
            r"^Invalid argument `cross_coupling`: expected one of",
        ),
        (
            lambda: DamchaTransformerDecoderLayer(
                16, 4, cross_coupling="separate", cross_metric_generator=MetricGenerator(16, 4, 4)
            ),
            DamchaValueError,
            r"^Invalid argument `cross_metric_generator`: expected a dict \{'q': ..., 'k': ...\} with cross_coupling='separate'",
        ),
        (
            lambda: build_decoder(16, 4, 2, coupling="tied", num_kv_heads=2),
            DamchaValueError,
            r"coupling='tied'.*num_kv_heads == nhead",
        ),
    ],
    ids=[
        "encoder-d-model-heads",
        "decoder-d-model-heads",
        "d-model-type",
        "nhead-zero",
        "ffn-zero",
        "dropout",
        "activation",
        "norm-first",
        "final-norm",
        "share-metric",
        "dtype",
        "metric",
        "unknown-kwarg",
        "layer-norm-eps",
        "generator-misfit",
        "stack-norm",
        "cross-coupling",
        "cross-generator",
        "tied-gqa",
    ],
)
def test_block_and_builder_errors_name_their_arguments(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


def test_key_dim_frees_d_model_from_dividing_by_nhead():
    """As for DamchaAttention itself: with key_dim the heads need not tile d_model."""
    enc = build_encoder(30, 4, 2, dim_feedforward=8, key_dim=8, dropout=0.0)
    assert enc.layers[0].self_attn.config.key_dim == 8 and enc.layers[0].self_attn.num_heads == 4
    assert enc(torch.randn(2, 3, 30)).shape == (2, 3, 30)


# ---------------------------------------------------------------- dtypes (issue 11)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int32, "float32"], ids=["complex64", "int32", "string"])
def test_parameter_dtype_must_be_real_floating(dtype):
    for build in (lambda: DamchaAttention(16, 4, dtype=dtype), lambda: MetricGenerator(16, 4, 4, dtype=dtype)):
        with pytest.raises(
            DamchaTypeError, match=r"^Invalid argument `dtype`: expected None or a real floating torch dtype"
        ):
            build()


@pytest.mark.parametrize(
    "dtypes",
    [("float64",) * 3, ("float16",) * 3, ("float32", "float64", "float64")],
    ids=["float64-input", "float16-input", "mixed-query-key"],
)
def test_inputs_of_another_dtype_name_the_arguments(dtypes):
    layer = _layer()
    q, k, v = (x.to(getattr(torch, d)) for d in dtypes)
    with pytest.raises(
        DamchaTypeError,
        match=rf"^Invalid argument `{'query' if dtypes[0] != 'float32' else 'key'}`: expected the dtype of this layer's "
        rf"parameters \(torch.float32\).*query.dtype=torch.{dtypes[0]}, "
        rf"key.dtype=torch.{dtypes[1]}",
    ):
        layer(q, k, v)


def test_autocast_casts_inputs_of_another_dtype_as_for_mha():
    """Under autocast MHA and DamchaAttention take float32 and bfloat16 inputs
    together; float64 autocast does not cast: a clear error (MHA: a raw one)."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    layer = DamchaAttention.from_mha(mha).eval()
    q, kv = x, x.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = mha(q, kv, kv, need_weights=False)
        out, _ = layer(q, kv, kv, need_weights=False)
        assert out.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
        with pytest.raises(DamchaTypeError, match=r"casts float32 and 16-bit inputs \(not float64\).*float64"):
            layer(x.double(), x.double(), x.double())


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
def test_in_proj_bias_of_another_dtype_computes_in_the_weight_dtype(need_weights):
    """issue 14: a float64 in_proj_bias (loaded with assign=True) next to float32
    weights: MHA still returns float32; so does DamchaAttention (it raised)."""
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    layer = DamchaAttention.from_mha(mha).eval()
    state = {"in_proj_bias": mha.in_proj_bias.detach().double().clone()}
    mha.load_state_dict(state, strict=False, assign=True)
    layer.load_state_dict(state, strict=False, assign=True)
    assert layer.in_proj_bias.dtype == torch.float64
    want, _ = mha(x, x, x, need_weights=need_weights)
    out, _ = layer(x, x, x, need_weights=need_weights)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    copy = DamchaAttention.from_mha(mha).eval()  # from_mha promotes on copy
    assert copy.in_proj_bias.dtype == torch.float32
    torch.testing.assert_close(copy(x, x, x, need_weights=need_weights)[0], want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------- files (issue 11)


def test_save_after_training_and_of_views_that_require_grad(tmp_path):
    import damcha_core as dc

    layer = _layer()
    layer(x, x, x, need_weights=False)[0].sum().backward()
    assert all(p.requires_grad and p.grad is not None for p in layer.parameters())
    layer.save(tmp_path / "a.safetensors")
    views = layer._canonical_views(dict(layer.named_parameters()))
    dc.save_params(tmp_path / "b.safetensors", views, layer.config)
    for name in ("a", "b"):
        params, config = dc.load_params(tmp_path / f"{name}.safetensors")
        assert config == layer.config
        for key, value in layer.to_canonical().items():
            np.testing.assert_array_equal(params[key], value)


def test_save_of_a_meta_layer_is_a_clear_error(tmp_path):
    layer = DamchaAttention(16, 4, device="meta")
    with pytest.raises(DamchaValueError, match=r"meta device and hold no values"):
        layer.save(tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


# ------------------------------------------------------ cache, conversion, penalty


@pytest.mark.parametrize(
    "args, error, pattern",
    [
        (
            (np.zeros((1, 2, 3, 4)), torch.zeros(1, 2, 3, 4)),
            DamchaTypeError,
            r"^Invalid argument `key`: expected a real floating tensor",
        ),
        (
            (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4, dtype=torch.int64)),
            DamchaTypeError,
            r"^Invalid argument `value`: expected",
        ),
        ((torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)), DamchaValueError, r"^Invalid argument `key`: expected rank 4"),
        (
            (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 2, 4)),
            DamchaValueError,
            r"^Invalid argument `value`: expected the batch, head count and length \(B, G, M\) of `key`",
        ),
        (
            (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4, dtype=torch.float64)),
            DamchaValueError,
            r"^Invalid argument `value`: expected the dtype and device of `key`",
        ),
    ],
    ids=["key-numpy", "value-int", "rank-3", "length-mismatch", "dtype-mismatch"],
)
def test_kv_cache_update_checks_its_arguments(args, error, pattern):
    from damcha_torch import DamchaKVCache

    cache = DamchaKVCache()
    with pytest.raises(error, match=pattern):
        cache.update(*args)
    assert len(cache) == 0


def test_replace_mha_and_metric_penalty_name_bad_arguments():
    from damcha_torch import metric_penalty, replace_mha

    model = nn.Sequential(nn.MultiheadAttention(16, 4))
    with pytest.raises(
        DamchaTypeError,
        match=r"^Invalid argument `coupled`: expected the arguments replace_mha passes to from_mha, .*Received: unknown keyword argument \['coupled'\]$",
    ):
        replace_mha(model, coupled="tied")
    assert isinstance(model[0], nn.MultiheadAttention)  # nothing replaced
    with pytest.raises(DamchaValueError, match=r"^Invalid argument `metric`: expected one of"):
        replace_mha(model, metric="full")
    with pytest.raises(DamchaTypeError, match=r"^Invalid argument `model`: expected a torch.nn.Module"):
        replace_mha([model])
    with pytest.raises(
        DamchaTypeError, match=r"^Invalid argument `model`: expected a torch.nn.Module \(or canonical params"
    ):
        metric_penalty("model")
    with pytest.raises(DamchaValueError, match=r"`config`, `query` and `context` are for canonical params"):
        metric_penalty(model, query=x)


def test_replace_mha_warns_when_nothing_is_replaced():
    """A model without nn.MultiheadAttention (the wrong model, or converted
    already) would otherwise train plain attention believing it DAMCHA."""
    from damcha_torch import replace_mha

    with pytest.warns(
        UserWarning, match=r"^replace_mha found no nn.MultiheadAttention in Linear: nothing was replaced\.$"
    ):
        replace_mha(nn.Linear(4, 4))
    model = replace_mha(nn.Sequential(nn.MultiheadAttention(16, 4)))
    with pytest.warns(
        UserWarning, match=r"in Sequential: nothing was replaced \(it holds 1 DamchaAttention layers already\)"
    ):
        assert replace_mha(model) is model


# ------------------------------------------------------------ malformed inputs (issue 11)


def _random_tensor(rng: np.random.Generator, batch: int) -> torch.Tensor:
    """A tensor of a random rank (0-4), sizes (some 0) and dtype, often near-valid."""
    rank = int(rng.integers(0, 5))
    shape = [int(rng.choice([0, 1, 2, 3, 5, 7, 12, 16])) for _ in range(rank)]
    if rank >= 1 and rng.random() < 0.5:
        shape[0] = batch
    dtype = rng.choice(["float32", "float64", "float16", "int64", "bool", "complex64"])
    if dtype == "bool":
        return torch.from_numpy(np.asarray(rng.random(shape) < 0.5))
    values = np.asarray(rng.normal(size=shape) * 3)
    if rng.random() < 0.1 and values.size:
        values.flat[0] = rng.choice([np.nan, np.inf])
    return torch.from_numpy(values).to(getattr(torch, str(dtype)))


@pytest.mark.parametrize("seed", range(4))
def test_malformed_inputs_raise_damcha_errors_or_equal_the_reference(seed):
    """Random malformed calls of damcha_attention (shapes, dtypes, NaN/inf,
    empty dims, masks of wrong shapes and dtypes, bad flags): either a
    DamchaError, or the call was valid and equals the reference, which then
    accepts the same inputs."""
    import damcha_core as dc
    from damcha_conformance import case_params
    from damcha_torch import damcha_attention

    rng = np.random.default_rng(seed)
    configs = [
        dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4),
        dc.DamchaConfig(
            query_dim=16,
            num_heads=4,
            key_dim=4,
            context_dim=12,
            value_input_dim=7,
            metric="lowrank",
            metric_rank=2,
            num_kv_heads=2,
        ),
    ]
    for _ in range(60):
        cfg = configs[int(rng.integers(2))]
        numpy_params = case_params(cfg, 0)
        params = {n: torch.from_numpy(v) for n, v in numpy_params.items()}
        valid = {
            "query": torch.from_numpy(rng.normal(size=(2, 5, 16))),
            "context": torch.from_numpy(rng.normal(size=(2, 7, cfg.context_dim))),
            "value": torch.from_numpy(rng.normal(size=(2, 7, cfg.value_input_dim))),
        }
        args = {k: (_random_tensor(rng, 2) if rng.random() < 0.3 else t) for k, t in valid.items()}
        if cfg.context_dim == 16 and rng.random() < 0.3:
            args["context"] = args["value"] = None
        kwargs = {}
        if rng.random() < 0.5:
            kwargs["mask"] = (
                _random_tensor(rng, 2) if rng.random() < 0.5 else torch.from_numpy(rng.random((5, 7)) < 0.7)
            )
        if rng.random() < 0.3:
            kwargs["causal"] = [True, False, 1, None][int(rng.integers(4))]
        if rng.random() < 0.2:
            kwargs["query_offset"] = [0, 2, -1, 1.5][int(rng.integers(4))]
        try:
            got = damcha_attention(params, cfg, args["query"], args["context"], args["value"], **kwargs)
        except dc.DamchaError:
            continue
        to_np = {k: None if t is None else t.numpy() for k, t in args.items()}
        mask = kwargs.pop("mask", None)
        want = dc.damcha_attention(
            numpy_params,
            cfg,
            to_np["query"],
            to_np["context"],
            value=to_np["value"],
            mask=None if mask is None else mask.numpy(),
            **kwargs,
        )
        np.testing.assert_allclose(got.double().numpy(), want, rtol=2e-3, atol=2e-3, equal_nan=True)


@pytest.mark.parametrize("seed", range(4))
def test_malformed_layer_calls_raise_damcha_errors(seed):
    """The same for DamchaAttention.forward with torch's mask conventions:
    nothing but a DamchaError escapes, and a call that passes gives an output
    of the expected shape."""
    import damcha_core as dc
    from damcha_torch import DamchaKVCache

    rng = np.random.default_rng(100 + seed)
    layers = [
        DamchaAttention(16, 4, batch_first=True).eval(),
        DamchaAttention(16, 4, kdim=12, vdim=7, batch_first=True).eval(),
    ]
    for _ in range(80):
        layer = layers[int(rng.integers(2))]
        q = _random_tensor(rng, 2) if rng.random() < 0.4 else torch.randn(2, 5, 16)
        k = _random_tensor(rng, 2) if rng.random() < 0.3 else torch.randn(2, 7, layer.kdim)
        v = _random_tensor(rng, 2) if rng.random() < 0.3 else torch.randn(2, 7, layer.vdim)
        if layer.kdim == 16 and rng.random() < 0.4:
            k = v = q
        kwargs = {"need_weights": bool(rng.random() < 0.5)}
        for name in ("key_padding_mask", "attn_mask"):
            if rng.random() < 0.4:
                kwargs[name] = _random_tensor(rng, 2)
        if rng.random() < 0.2:
            kwargs["is_causal"] = True
        if rng.random() < 0.1:
            kwargs["kv_cache"] = DamchaKVCache()
        try:
            out, _ = layer(q, k, v, **kwargs)
        except dc.DamchaError:
            continue
        assert out.shape == (*q.shape[:-1], 16)


def test_shape_errors_print_the_shapes_as_passed():
    """Sequence-first and unbatched inputs are checked on batch-first views;
    the messages show what the caller passed (as the JAX and Keras layers do)."""
    seq_first = DamchaAttention(16, 4)  # batch_first=False
    q, k = torch.randn(5, 2, 16), torch.randn(4, 2, 16)
    cases = [
        (
            lambda: seq_first(torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)),
            r"query\.shape=\(5, 2, 8\)$",
        ),
        (
            lambda: seq_first(q, torch.randn(4, 3, 16), torch.randn(4, 3, 16)),
            r"query\.shape=\(5, 2, 16\), key\.shape=\(4, 3, 16\)$",
        ),
        (lambda: seq_first(q, k, torch.randn(3, 2, 16)), r"key\.shape=\(4, 2, 16\), value\.shape=\(3, 2, 16\)$"),
        (
            lambda: seq_first(q, torch.randn(4, 2, 8), k),
            r"expected 16 features \(kdim\)\. Received: key\.shape=\(4, 2, 8\)$",
        ),
        (lambda: seq_first(torch.randn(5, 8), torch.randn(5, 8), torch.randn(5, 8)), r"query\.shape=\(5, 8\)$"),
        (lambda: seq_first(q[:, 0], k[:, 0], k[:3, 0]), r"key\.shape=\(4, 16\), value\.shape=\(3, 16\)$"),
        (
            lambda: seq_first(q[:, 0], q[:, 0], q[:, 0], key_padding_mask=torch.zeros(4, dtype=torch.bool)),
            r"expected shape \(M,\) = \(5,\) with unbatched inputs\. Received: key_padding_mask\.shape=\(4,\)",
        ),
        (lambda: seq_first.metric_penalty(torch.randn(5, 2, 8)), r"query\.shape=\(5, 2, 8\)$"),
    ]
    for call, pattern in cases:
        with pytest.raises(DamchaValueError, match=pattern):
            call()


def _blocks():
    torch.manual_seed(0)
    enc_layer = DamchaTransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    dec_layer = DamchaTransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    for layer in (enc_layer, dec_layer):
        for gate in layer.self_attn.metric_gates.values():
            nn.init.constant_(gate, 0.5)
    return {
        "encoder-layer": (enc_layer, 1, "is_causal", ("src_mask", "src_key_padding_mask")),
        "encoder": (
            build_encoder(8, 2, 2, dim_feedforward=16, dropout=0.0, batch_first=True).eval(),
            1,
            "is_causal",
            ("mask", "src_key_padding_mask"),
        ),
        "decoder-layer": (
            dec_layer,
            2,
            "tgt_is_causal",
            ("tgt_mask", "memory_mask", "tgt_key_padding_mask", "memory_key_padding_mask"),
        ),
        "decoder": (
            build_decoder(8, 2, 2, dim_feedforward=16, dropout=0.0, batch_first=True).eval(),
            2,
            "tgt_is_causal",
            ("tgt_mask", "memory_mask", "tgt_key_padding_mask", "memory_key_padding_mask"),
        ),
    }


@pytest.mark.parametrize("block", ["encoder-layer", "encoder", "decoder-layer", "decoder"])
def test_block_causal_flags_and_masks_follow_the_layers_rules(block):
    """The blocks' causal flags take the layer's rule (a NumPy bool is the bool;
    torch's own forward tests `is True`, so np.True_ was silently not causal),
    other values are refused naming the block's argument, keyword or
    positional; a mask neither boolean nor floating is a DamchaTypeError
    naming it (torch's forward asserted, a bare AssertionError)."""
    module, n_inputs, flag, masks = _blocks()[block]
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    inputs = (x,) * n_inputs
    with torch.no_grad():
        causal, plain = module(*inputs, **{flag: True}), module(*inputs, **{flag: False})
        assert (causal - plain).abs().max() > 1e-3  # the flag changes the output
        assert torch.equal(module(*inputs, **{flag: np.True_}), causal)
        assert torch.equal(module(*inputs, **{flag: np.False_}), plain)
    names = list(inspect.signature(type(module).forward).parameters)[1:]
    for bad in (1, "yes", torch.tensor(True)):
        with pytest.raises(DamchaTypeError, match=rf"Invalid argument `{flag}`: expected a bool"):
            module(*inputs, **{flag: bad})
        positional = [None] * names.index(flag)
        positional[:n_inputs] = inputs
        with pytest.raises(DamchaTypeError, match=rf"Invalid argument `{flag}`"):
            module(*positional, bad)
    for name in masks:
        shape = (2, 5) if "padding" in name else (5, 5)
        with pytest.raises(DamchaTypeError, match=rf"Invalid argument `{name}`: expected a mask that is boolean"):
            module(*inputs, **{name: torch.zeros(shape, dtype=torch.int64)})


@pytest.mark.parametrize("block", ["encoder-layer", "encoder", "decoder-layer", "decoder"])
def test_block_shape_errors_name_the_blocks_arguments(block):
    """Tokens and masks of the wrong shape are refused naming the block's
    argument (`src`, `memory`, `tgt_mask`, ...), with the tokens it was held
    to; the attention layers inside name their own (`query`, `attn_mask`), and
    with norm_first torch's LayerNorm failed first. Every layout the attention
    takes still runs: (N, M), (B*H, N, M) and broadcastable 4-D masks, unbatched
    tokens with (M,) padding."""
    module, n_inputs, _, masks = _blocks()[block]
    tokens = ("src",) if n_inputs == 1 else ("tgt", "memory")
    g = torch.Generator().manual_seed(2)
    x, memory = torch.randn(2, 5, 8, generator=g), torch.randn(2, 7, 8, generator=g)
    inputs = (x,) if n_inputs == 1 else (x, memory)
    lengths = {"src": 5, "tgt": 5, "memory": 7}
    with torch.no_grad():
        for name in masks:
            if "padding" in name:
                of = tokens[0] if name.startswith(tokens[0]) else "memory"
                good, bad = torch.zeros(2, lengths[of], dtype=torch.bool), torch.zeros(2, 4, dtype=torch.bool)
                module(*inputs, **{name: good})
                with pytest.raises(
                    DamchaValueError,
                    match=rf"^Invalid argument `{name}`: expected shape \(B, M\) = \(2, {lengths[of]}\)\. Received: {name}\.shape=\(2, 4\), {of}\.shape=",
                ):
                    module(*inputs, **{name: bad})
                continue
            N, M = 5, 7 if name == "memory_mask" else 5
            for good in (torch.zeros(N, M), torch.zeros(4, N, M), torch.zeros(2, 1, N, M), torch.zeros(1, 2, 1, M)):
                module(*inputs, **{name: good})
            for bad in (torch.zeros(N, 4), torch.zeros(3, N, M), torch.zeros(2, 3, N, M), torch.zeros(N, M, 1)):
                with pytest.raises(
                    DamchaValueError,
                    match=rf"^Invalid argument `{name}`: expected shape .* Received: {name}\.shape={re.escape(str(tuple(bad.shape)))}, ",
                ):
                    module(*inputs, **{name: bad})
        for i, name in enumerate(tokens):
            wrong = list(inputs)
            wrong[i] = torch.randn(2, lengths[name], 9)
            with pytest.raises(
                DamchaValueError,
                match=rf"^Invalid argument `{name}`: expected 8 features \(d_model\)\. Received: {name}\.shape=\(2, {lengths[name]}, 9\)$",
            ):
                module(*wrong)
            wrong[i] = torch.randn(2, lengths[name], 8, 1)
            with pytest.raises(DamchaValueError, match=rf"^Invalid argument `{name}`: expected a batched"):
                module(*wrong)
            wrong[i] = torch.ones(2, lengths[name], 8, dtype=torch.int64)
            with pytest.raises(DamchaTypeError, match=rf"Invalid argument `{name}`"):
                module(*wrong)
        if n_inputs == 2:
            with pytest.raises(DamchaValueError, match=r"^Invalid argument `memory`: expected the batch size of `tgt`"):
                module(x, torch.randn(3, 7, 8))
            with pytest.raises(DamchaValueError, match=r"^Invalid argument `memory`: expected the batch size of `tgt`"):
                module(x, memory[0])
        unbatched = tuple(t[0] for t in inputs)
        padding = masks[-1]
        M = 7 if padding.startswith("memory") else 5
        expected = module(*inputs, **{padding: torch.zeros(2, M, dtype=torch.bool)})[0]
        torch.testing.assert_close(module(*unbatched, **{padding: torch.zeros(M, dtype=torch.bool)}), expected)
        with pytest.raises(
            DamchaValueError,
            match=rf"^Invalid argument `{padding}`: expected shape \(M,\) = \({M},\) with an unbatched",
        ):
            module(*unbatched, **{padding: torch.zeros(2, M, dtype=torch.bool)})


@pytest.mark.parametrize("enabled", ["False", 0, None], ids=["string", "int", "none"])
def test_track_metric_penalty_takes_a_bool(enabled):
    """bool("False") is True: a string turned the tracking on; now refused, and nothing changes."""
    from damcha_torch import track_metric_penalty

    layer = _layer()
    with pytest.raises(DamchaTypeError, match=r"Invalid argument `enabled`: expected a bool"):
        track_metric_penalty(layer, enabled)
    assert layer.track_metric_penalty is False
    assert track_metric_penalty(layer, np.True_).track_metric_penalty is True
