"""Built-in adapters of ``convert`` for attention layers with one fused qkv projection.

GPT-NeoX (Pythia), Persimmon, BLOOM, Falcon, GPTBigCode (StarCoder 1,
SantaCoder), MPT, DBRX and ModernBERT project queries, keys and values with
one Linear. Some lay its output out role by role (q heads, then k, then v:
one ``ProjectionSite`` with two offsets, as Phi-3's); the others interleave
the roles per head or per key/value group, which ``ProjectionSite.groups``
describes. Each layout is read off the host's own split of the output
(``_split_heads``, ``view(..., H, 3 * d)``) and checked against its config,
so a variant with another split is refused rather than mis-mapped.

Everything these hosts do after the projection (RoPE, partial or not; ALiBi;
per-head LayerNorms; MPT's and DBRX's clamp of the whole output) acts on the
mapped heads: the converted layer is the host with its projection's query and
key heads replaced by L(t) q and L(t) k, as for every other adapter.
"""

from __future__ import annotations

from typing import Any

from damcha_core import DamchaValueError

from ._models import AttentionLayout, ModelAdapter, ProjectionSite, register_adapter
from ._models_layouts import _by_role, _features, _heads, _is


def _per_head(attr: str, projection: Any, H: int, d: int) -> AttentionLayout:
    """A self-attention whose ``attr`` output is, per head in turn, its query,
    key and value (F = H * 3d: GPT-NeoX, Persimmon, BLOOM, Falcon's and
    GPTBigCode's multi-head variants)."""
    e, out = _features(projection)
    _heads(attr, out, d, 3 * H)
    return AttentionLayout(H, H, d, e, e, (ProjectionSite(attr, q=0, k=d, groups=H),))


def _gpt_neox_layout(m: Any) -> AttentionLayout:
    """GPT-NeoX's ``query_key_value``, viewed (..., H, 3d) and chunked into q, k, v."""
    return _per_head("query_key_value", m.query_key_value, int(m.config.num_attention_heads), int(m.head_size))


def _persimmon_layout(m: Any) -> AttentionLayout:
    """Persimmon's (and Fuyu's) ``query_key_value``, viewed (..., H, 3, d)."""
    return _per_head("query_key_value", m.query_key_value, int(m.num_heads), int(m.head_dim))


def _bloom_layout(m: Any) -> AttentionLayout:
    """BLOOM's ``query_key_value``, viewed (..., H, 3, d) (``_reshape``)."""
    return _per_head("query_key_value", m.query_key_value, int(m.num_heads), int(m.head_dim))


def _falcon_layout(m: Any) -> AttentionLayout:
    """Falcon's ``query_key_value`` in its three splits (``_split_heads``):
    the new decoder architecture (Falcon-40B/180B) holds, per key/value group,
    the group's H/G queries, its key and its value; multi-query (Falcon-7B)
    the H queries, then one key and one value; otherwise per head q, k, v."""
    H, d = int(m.num_heads), int(m.head_dim)
    if m.new_decoder_architecture:
        G = int(m.num_kv_heads)
        if G < 1 or H % G:
            raise DamchaValueError(f"num_kv_heads={G} does not divide num_heads={H}")
        e, out = _features(m.query_key_value)
        _heads("query_key_value", out, d, H + 2 * G)
        site = ProjectionSite("query_key_value", q=0, k=H // G * d, groups=G)
        return AttentionLayout(H, G, d, e, e, (site,))
    if m.multi_query:
        return _by_role("query_key_value", m.query_key_value, H, 1, d)
    return _per_head("query_key_value", m.query_key_value, H, d)


def _gpt_bigcode_layout(m: Any) -> AttentionLayout:
    """GPTBigCode's self-attention ``c_attn``: multi-query, the H queries then
    one key and one value; otherwise viewed (..., H, 3d) per head. Its
    cross-attention is refused: its ``c_attn`` split gives one head of keys
    and values whatever the head count (``split((head_dim, head_dim))``)."""
    if m.is_cross_attention:
        raise DamchaValueError(
            "GPTBigCode's cross-attention splits its c_attn output into one key and one value head "
            "(split((head_dim, head_dim))), a layout the maps cannot read; only its self-attention converts"
        )
    H, d = int(m.num_heads), int(m.head_dim)
    if m.multi_query:
        return _by_role("c_attn", m.c_attn, H, 1, d)
    return _per_head("c_attn", m.c_attn, H, d)


def _mpt_layout(m: Any) -> AttentionLayout:
    """MPT's ``Wqkv``, chunked into q, k, v of H heads each."""
    return _by_role("Wqkv", m.Wqkv, int(m.n_heads), int(m.n_heads), int(m.head_dim))


def _dbrx_layout(m: Any) -> AttentionLayout:
    """DBRX's ``Wqkv``: the H queries, then G keys, then G values."""
    return _by_role("Wqkv", m.Wqkv, int(m.num_heads), int(m.num_key_value_heads), int(m.head_dim))


def _modernbert_layout(m: Any) -> AttentionLayout:
    """ModernBERT's ``Wqkv``, viewed (..., 3, H, d): q, k, v of H heads each."""
    H = int(m.config.num_attention_heads)
    return _by_role("Wqkv", m.Wqkv, H, H, int(m.head_dim))


for _name, _classes, _layout, _description in (
    (
        "transformers-gpt-neox",
        {"GPTNeoXAttention"},
        _gpt_neox_layout,
        "transformers GPT-NeoX (Pythia): fused query_key_value, q/k/v interleaved per head",
    ),
    (
        "transformers-persimmon",
        {"PersimmonAttention"},
        _persimmon_layout,
        "transformers Persimmon (and Fuyu's language model): fused query_key_value, q/k/v interleaved per head",
    ),
    (
        "transformers-bloom",
        {"BloomAttention"},
        _bloom_layout,
        "transformers BLOOM: fused query_key_value, q/k/v interleaved per head",
    ),
    (
        "transformers-falcon",
        {"FalconAttention"},
        _falcon_layout,
        "transformers Falcon: fused query_key_value (new decoder architecture: per key/value group; "
        "multi-query; or per head)",
    ),
    (
        "transformers-gpt-bigcode",
        {"GPTBigCodeAttention"},
        _gpt_bigcode_layout,
        "transformers GPTBigCode (StarCoder 1, SantaCoder): self-attention's fused c_attn (multi-query or per head)",
    ),
    ("transformers-mpt", {"MptAttention"}, _mpt_layout, "transformers MPT: fused Wqkv (q, k, v blocks)"),
    ("transformers-dbrx", {"DbrxAttention"}, _dbrx_layout, "transformers DBRX: fused Wqkv (q, k, v blocks; GQA)"),
    (
        "transformers-modernbert",
        {"ModernBertAttention"},
        _modernbert_layout,
        "transformers ModernBERT: fused Wqkv (q, k, v blocks)",
    ),
):
    register_adapter(
        ModelAdapter(
            _name,
            _description,
            (lambda classes: lambda m: _is(m, "transformers", classes))(frozenset(_classes)),
            _layout,
        )
    )
