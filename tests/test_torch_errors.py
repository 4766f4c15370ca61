"""Bad input to the PyTorch backend raises DamchaError subclasses that name the argument."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from damcha_core import DamchaTypeError, DamchaValueError
from damcha_torch import DamchaAttention, MetricGenerator

x = torch.randn(2, 5, 16)


def _layer(**kw) -> DamchaAttention:
    return DamchaAttention(16, 4, batch_first=True, **kw)


@pytest.mark.parametrize(
    "build, error, pattern",
    [
        (lambda: DamchaAttention(16, 4, num_kv_heads=3, coupling="query"), DamchaValueError,
         r"num_heads.*divisible by `num_kv_heads`.*num_heads=4, num_kv_heads=3"),
        (lambda: DamchaAttention(16, 4, kdim=12, vdim=12, coupling="tied"), DamchaValueError,
         r"coupling='tied'.*kdim == embed_dim.*embed_dim=16, kdim=12"),
        (lambda: DamchaAttention(16, 4, num_kv_heads=2, coupling="tied"), DamchaValueError,
         r"coupling='tied'.*num_kv_heads == num_heads.*num_heads=4, num_kv_heads=2"),
        (lambda: DamchaAttention(16, 4, coupling="separate", metric_generator={"q": MetricGenerator(16, 4, 4)}),
         DamchaValueError, r"`metric_generator` must have exactly this layer's metric sides \['q', 'k'\].*missing"),
        (lambda: DamchaAttention(16, 4, coupling="separate", metric_generator=MetricGenerator(16, 4, 4)),
         DamchaValueError, r"`metric_generator` must be a dict \{'q': ..., 'k': ...\} with coupling='separate'"),
        (lambda: DamchaAttention(16, 4, metric="none", metric_generator=MetricGenerator(16, 4, 4)),
         DamchaValueError, r"`metric_generator` must be None with metric='none'"),
        (lambda: DamchaAttention(16, 4, metric_generator={"qk": nn.Linear(2, 2)}), DamchaTypeError,
         r"`metric_generator\['qk'\]` must be a MetricGenerator"),
        (lambda: DamchaAttention(16, 2, metric_generator=MetricGenerator(16, 4, 4)), DamchaValueError,
         r"`metric_generator` does not fit side 'qk' of this layer: heads=4 \(expected 2\)"),
        (lambda: DamchaAttention(18, 4), DamchaValueError, r"`embed_dim` must be divisible by `num_heads`.*embed_dim=18"),
        (lambda: DamchaAttention(16, 4, metric="lowrank"), DamchaValueError, r"`metric_rank` is required"),
        (lambda: DamchaAttention(16, 4, metric="full"), DamchaValueError, r"`metric` must be one of"),
        (lambda: DamchaAttention(16, 4, add_bias_kv=True), DamchaValueError, r"add_bias_kv"),
        (lambda: DamchaAttention(16, 4, metric_generator=nn.Linear(2, 2)), DamchaTypeError, r"`metric_generator` must be"),
        (lambda: DamchaAttention.from_mha(nn.Linear(2, 2)), DamchaTypeError, r"`mha` must be an nn.MultiheadAttention"),
        # nn.MultiheadAttention's argument names, not DamchaConfig's (query_dim, context_dim, use_bias)
        (lambda: DamchaAttention(16.0, 4), DamchaTypeError, r"^`embed_dim` must be an int >= 1\. Received: embed_dim=16\.0"),
        (lambda: DamchaAttention(16, 4, bias="no"), DamchaTypeError, r"^`bias` must be a bool\. Received: bias='no'"),
        (lambda: DamchaAttention(16, 4, kdim=0, vdim=0, coupling="separate"), DamchaValueError,
         r"^`kdim` must be >= 1\. Received: kdim=0"),
    ],
    ids=["heads-not-divisible", "kdim-with-tied", "gqa-with-tied", "separate-one-side", "separate-one-generator",
         "none-with-generator", "generator-value-type", "generator-misfit", "embed-not-divisible", "lowrank-no-rank",
         "unknown-metric", "bias-kv", "generator-type", "from-mha-type", "embed-type", "bias-type", "kdim-zero"],
)
def test_constructor_errors(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda l: l(torch.randn(2, 5, 12), torch.randn(2, 5, 12), torch.randn(2, 5, 12)), DamchaValueError,
         r"`query` must have 16 features \(embed_dim\).*Received: query.shape=\(2, 5, 12\)"),
        (lambda l: l(x, x[:1], x[:1]), DamchaValueError,
         r"`query` and `key` must have the same batch size.*key.shape=\(1, 5, 16\)"),
        (lambda l: l(x, x[:, :0], x[:, :0]), DamchaValueError, r"`key` must be non-empty.*key.shape=\(2, 0, 16\)"),
        (lambda l: l(x.long(), x.long(), x.long()), DamchaTypeError, r"`query` must be a real floating tensor.*int64"),
        (lambda l: l(x, x, torch.randn(2, 4, 16)), DamchaValueError,
         r"`value` must have the batch size and length of `key`.*value.shape=\(2, 4, 16\)"),
        (lambda l: l(torch.randn(5, 16), x, x), DamchaValueError,
         r"With an unbatched \(2-D\) `query`, `key` and `value` must be 2-D too.*key.shape=\(2, 5, 16\)"),
        (lambda l: l(x, torch.randn(5, 16), torch.randn(5, 16)), DamchaValueError,
         r"must all be batched \(B, N, E\) or all unbatched \(N, E\).*key.shape=\(5, 16\)"),
        (lambda l: l(x[None], x[None], x[None]), DamchaValueError, r"must all be batched.*query.shape=\(1, 2, 5, 16\)"),
        (lambda l: l(x[0], x[0], x[0], key_padding_mask=torch.zeros(1, 5, dtype=torch.bool)), DamchaValueError,
         r"unbatched inputs `key_padding_mask` must have shape \(M,\) = \(5,\).*\(1, 5\)"),
        (lambda l: l(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), DamchaValueError,
         r"`key_padding_mask` must have shape \(B, M\) = \(2, 5\).*\(2, 4\)"),
        (lambda l: l(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.int64)), DamchaTypeError,
         r"`key_padding_mask` must be a bool tensor \(True = masked out.*int64"),
        (lambda l: l(x, x, x, attn_mask=torch.zeros(5, 4, dtype=torch.bool)), DamchaValueError,
         r"`attn_mask` must be broadcastable.*attn_mask.shape=\(5, 4\)"),
        (lambda l: l(x, x, x, attn_mask=torch.zeros(2, 5, 5, dtype=torch.bool)), DamchaValueError,
         r"3-D `attn_mask` must have shape \(B\*H, N, M\) = \(8, 5, 5\)"),
        (lambda l: l(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.uint8)), DamchaTypeError,
         r"`attn_mask` must be a bool tensor.*uint8"),
        (lambda l: l(x, x, x, is_causal=True, need_weights=False, kv_cache=object()), DamchaTypeError,
         r"`kv_cache` must be a DamchaKVCache or None\. Received: kv_cache=<object"),
    ],
    ids=["wrong-embed", "key-batch", "empty-key", "int-query", "value-shape", "unbatched-query-batched-key", "batched-query-unbatched-key",
         "rank-4", "unbatched-padding-shape", "padding-shape", "padding-dtype",
         "mask-shape", "mask-3d-shape", "mask-dtype", "kv-cache-type"],
)
def test_forward_errors(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call(_layer())


def test_separate_coupling_rejects_wrong_context_size():
    layer = DamchaAttention(16, 4, kdim=12, vdim=12, coupling="separate", batch_first=True)
    with pytest.raises(DamchaValueError, match=r"`key` must have 12 features \(kdim\).*key.shape=\(2, 5, 16\)"):
        layer(x, x, x)


def test_from_canonical_rejects_mismatched_params():
    layer = _layer()
    params = layer.to_canonical()
    params["query.kernel"] = params["query.kernel"][:, :2]
    with pytest.raises(DamchaValueError, match=r"query.kernel.*must have shape \(16, 4, 4\)"):
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
        (lambda: layer(t[:1], t[:1], t[:1], is_causal=True, need_weights=False, kv_cache=cache),
         r"`kv_cache` holds a different batch.*cached key shape \(2, 4, 1, 4\), new key shape \(1, 4, 1, 4\)"),
        (lambda: wider(t, t, t, is_causal=True, need_weights=False, kv_cache=cache),
         r"`kv_cache` holds a different batch, head count or head size.*new key shape \(2, 4, 1, 8\)"),
        (lambda: _layer()(t.float(), t.float(), t.float(), is_causal=True, need_weights=False, kv_cache=cache),
         r"`kv_cache` holds keys of another dtype.*cached torch.float64 on cpu, new torch.float32 on cpu"),
    ]
    for call, pattern in bad:
        with pytest.raises(DamchaValueError, match=pattern):
            call()
        assert len(cache) == 1
    s = x.double()[:, 1:2]
    out, _ = layer(s, s, s, is_causal=True, need_weights=False, kv_cache=cache)
    full, _ = layer(x.double()[:, :2], x.double()[:, :2], x.double()[:, :2], is_causal=True, need_weights=False)
    torch.testing.assert_close(out, full[:, 1:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_layers", [0, 2.0])
def test_stack_builders_reject_bad_num_layers(num_layers):
    from damcha_torch import build_decoder, build_encoder

    for build in (build_encoder, build_decoder):
        with pytest.raises(DamchaValueError, match=rf"`num_layers` must be an int >= 1\. Received: num_layers={num_layers}"):
            build(16, 4, num_layers, dim_feedforward=8)
