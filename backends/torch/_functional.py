"""The torch port's functional core: DAMCHA v1 as free functions named after
the reference's steps (``rms_normalise``, ``generator``, ``apply_map``,
``visibility``, ``softmax_attend``, ``damcha_attention``, ``metric_penalty``).

The public functions take canonical parameters (``damcha_core`` names and
shapes) as torch tensors and a ``DamchaConfig``, like the reference.
Internally every step computes on the torch layout of the same weights
(``LayerWeights``/``SideWeights``: ``nn.Linear``'s (out, in) matrices, so that
each projection is one ``F.linear``); canonical tensors become that layout by
views, and ``DamchaAttention`` hands its own parameters over directly, so the
layer and the functions run one implementation.

Tensor layouts follow the projections, token-major: q (B, N, H, d),
k (B, M, G, d), v (B, M, G, d_v). The cross-head maps act on a token's
stacked heads, so they run in this layout; only the attention itself
transposes (views, no copies) to SDPA's (B, H, N, d).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import damcha_core as dc
import torch
import torch.nn.functional as F
from damcha_core import DamchaConfig, DamchaTypeError, DamchaValueError, config_sizes, describe
from damcha_core._validators import unknown_fields
from torch import Tensor, nn
from torch.nn.utils.prune import BasePruningMethod as _BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm as _SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm as _WeightNorm
from torch.utils.checkpoint import checkpoint

# The calling convention of the C kernel this code calls (_headmix.c's DAMCHA_HEADMIX_ABI).
_HEADMIX_ABI = 3
_HEADMIX: Any
try:
    # The fused CPU map of a decoding step (setup.py; _headmix.c says why).
    from damcha_torch import _headmix as _HEADMIX
except ImportError:  # built without a C compiler: the torch ops compute the same step
    _HEADMIX = None
if getattr(_HEADMIX, "ABI", None) != _HEADMIX_ABI:
    _HEADMIX = None  # a stale build of an older source: not called (CI fails on a missing kernel)

if TYPE_CHECKING:  # pragma: no cover
    from ._cache import DamchaKVCache
    from ._models_fused import MapRecipes

__all__ = [
    "LayerWeights",
    "SideWeights",
    "apply_map",
    "causal_visibility",
    "damcha_attention",
    "generator",
    "metric_penalty",
    "rms_normalise",
    "safe_attention",
    "softmax_attend",
    "visibility",
]

_NEG_INF = float("-inf")


# ------------------------------------------------------------ torch layout


class SideWeights(NamedTuple):
    """One metric side in torch layout: ``weight`` (S*S, E) or (r, E) as
    ``nn.Linear`` stores it, ``bias`` (S*S,) or (r,), ``gate`` (S,), and for
    "lowrank" ``u``, ``v`` (S, d, r)."""

    metric: str
    weight: Tensor
    bias: Tensor
    gate: Tensor
    u: Tensor | None = None
    v: Tensor | None = None


class LayerWeights(NamedTuple):
    """A layer's weights in torch layout, as ``nn.MultiheadAttention`` keeps them.

    ``in_proj`` is the packed (H*d + G*d + G*d_v, E) weight when the three
    projections read inputs of one size (one GEMM for self-attention), else
    ``None`` and ``q``/``k``/``v`` hold (out, in) weights; ``in_bias`` is the
    packed (H*d + G*d + G*d_v,) bias or ``None``; ``output`` maps
    (..., H*d_v) to (..., E_o) (the layer passes its ``out_proj`` module, so
    hooks on it run); ``sides`` maps a canonical side to its ``SideWeights``.
    ``bias_k`` (1, 1, G*d), ``bias_v`` (1, 1, G*d_v) and ``zero_attn`` are
    nn.MultiheadAttention's ``add_bias_kv``/``add_zero_attn`` (see
    ``_append_keys``); canonical parameters have neither. ``output_params``:
    (weight (E_o, H*d_v), bias or None) when ``output`` is exactly
    ``F.linear`` with them (no hooks, no wrapper), else ``None``: the fused
    path then sets y's all-masked rows and NaN guard on y (see
    ``attend_weights``), otherwise on o.
    """

    sizes: tuple[int, int, int]
    in_proj: Tensor | None
    q: Tensor | None
    k: Tensor | None
    v: Tensor | None
    in_bias: Tensor | None
    output: Callable[[Tensor], Tensor]
    sides: Mapping[str, SideWeights]
    bias_k: Tensor | None = None
    bias_v: Tensor | None = None
    zero_attn: bool = False
    output_params: tuple[Tensor, Tensor | None] | None = None

    def projections(self) -> tuple[tuple[Tensor, Tensor | None], ...]:
        """(weight, bias) of the query, key and value projections."""
        weights = self.in_proj.split(self.sizes) if self.in_proj is not None else (self.q, self.k, self.v)
        biases = (None,) * 3 if self.in_bias is None else self.in_bias.split(self.sizes)
        return tuple(zip(weights, biases))


def _side_from_canonical(params: Mapping[str, Tensor], config: DamchaConfig, side: str) -> SideWeights:
    from ._generator import TORCH_LEAVES  # the one table of torch layouts (it imports this module)

    leaves = {
        name: leaf.from_canonical(params[f"metric.{side}.{name}"]) for name, leaf in TORCH_LEAVES[config.metric].items()
    }
    return SideWeights(
        config.metric, leaves["kernel"], leaves["bias"], params[f"metric.{side}.gate"], leaves.get("u"), leaves.get("v")
    )


def weights_from_canonical(params: Mapping[str, Tensor], config: DamchaConfig) -> LayerWeights:
    """``LayerWeights`` of canonical tensors, by views (no copies where strides allow)."""
    H, d = config.num_heads, config.key_dim
    _, _, Eo, G, dv = config_sizes(config)
    sizes = (H * d, G * d, G * dv)
    q, k, v = (params[f"{n}.kernel"].reshape(params[f"{n}.kernel"].shape[0], -1).T for n in ("query", "key", "value"))
    bias = None
    if config.use_bias:
        bias = torch.cat([params[f"{n}.bias"].reshape(-1) for n in ("query", "key", "value")])
    out_w = params["output.kernel"].reshape(-1, Eo).T
    out_b = params["output.bias"] if config.use_bias else None

    def output(o: Tensor) -> Tensor:
        return F.linear(o, out_w, out_b)

    sides = {side: _side_from_canonical(params, config, side) for side in config.metric_sides}
    return LayerWeights(sizes, None, q, k, v, bias, output, sides, output_params=(out_w, out_b))


# ------------------------------------------------------------------ steps


_HYPOT_CONSTANTS: dict[tuple[int, torch.dtype], Tensor] = {}


def _hypot_constant(features: int, dtype: torch.dtype) -> Tensor:
    """sqrt(E * eps) as a 0-d CPU tensor of ``dtype`` (``torch.hypot`` takes no
    Python float); a CPU scalar tensor combines with tensors on any device.
    Made once per (E, dtype), outside inference mode (hypot's backward saves
    it, which an inference tensor refuses)."""
    with torch.inference_mode(False):
        const = _HYPOT_CONSTANTS[features, dtype] = torch.tensor(math.sqrt(features * dc.RMS_EPS), dtype=dtype)
    return const


_ZEROS: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def _zero_bias(n: int, x: Tensor) -> Tensor:
    """A constant (n,) zero vector of x's dtype and device: the bias of a GEMM
    whose bias is added later (see ``few_tokens_step``). Made once per (n,
    dtype, device), outside inference mode, as ``_hypot_constant``; derived
    from no parameter, so it never goes stale."""
    key = (n, x.dtype, x.device)
    z = _ZEROS.get(key)
    if z is None:
        with torch.inference_mode(False):
            z = _ZEROS[key] = torch.zeros(n, dtype=x.dtype, device=x.device)
    return z


def _rms_denominator(t: Tensor) -> Tensor:
    """sqrt(sum(t^2 over features) + E * eps), (..., 1).

    phi(t) = sqrt(E) * t / this. Two kernels (a norm and ``hypot``), where
    t * t, sum, + eps and rsqrt took four: it matters when decoding one token.
    """
    norm = torch.linalg.vector_norm(t, dim=-1, keepdim=True)
    if torch.compiler.is_compiling():
        # No module-level tensor in traced graphs: the same value, elementwise.
        c2 = t.shape[-1] * dc.RMS_EPS
        return torch.sqrt(norm * norm + c2)
    const = _HYPOT_CONSTANTS.get((t.shape[-1], norm.dtype))
    if const is None:
        const = _hypot_constant(t.shape[-1], norm.dtype)
    return torch.hypot(norm, const)


def rms_normalise(t: Tensor) -> Tensor:
    """phi(t) = t / sqrt(mean(t^2 over features) + 1e-6): the generator's input."""
    return torch.div(t, _rms_denominator(t)) * math.sqrt(t.shape[-1])


def coefficients_of(P: Tensor, r: Tensor, bias: Tensor, width: int) -> Tensor:
    """A = b + sqrt(E) P / r from the generator's product P = t W^T (T, k),
    the tokens' RMS denominator r (T, 1) and their width E: the one
    expression the layers and the converted models' projections
    (_models_fused: forward, remake and backward must agree bit for bit) make
    A with; the decoding steps write it out inline (a call per step counts)."""
    return torch.addcdiv(bias, P, r, value=math.sqrt(width))


def _coefficients(weight: Tensor, bias: Tensor, tokens: Tensor) -> Tensor:
    """phi(t) W + b without building phi.

    (t W) * sqrt(E) / sqrt(sum(t^2) + E eps) + b is one GEMM on the raw
    tokens, which autograd already keeps for the projections, plus a pass over
    the small output; materialising phi would cost a pass and a stored
    (B, T, E) tensor.
    """
    return coefficients_of(F.linear(tokens, weight), _rms_denominator(tokens), bias, tokens.shape[-1])


def _cast(t: Tensor | None, dtype: torch.dtype) -> Any:
    # .to() of the same dtype is free, but skipping it keeps traced graphs small.
    return t if t is None or t.dtype == dtype else t.to(dtype)


def head_map_weights(side: SideWeights, tokens: Tensor) -> Tensor:
    """l(t) = I + diag(g) A(t), (B, T, S, S), for metric "heads".

    The factor itself, for ``return_metric`` and ``MetricGenerator.head_map``;
    the forward pass never forms it (it computes y + diag(g) A(t) y).
    """
    dtype = tokens.dtype
    S = side.gate.shape[0]
    A = _coefficients(_cast(side.weight, dtype), _cast(side.bias, dtype), tokens).unflatten(-1, (S, S))
    return torch.addcmul(torch.eye(S, dtype=dtype, device=tokens.device), A, _cast(side.gate, dtype).view(S, 1))


# A decoding step of at most this many tokens (B * N) may take the flat path
# (few_tokens_step): at B = 1 a step's time is its kernel launches.
_FEW_TOKENS = 16


def _exact_matmul(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a GEMM of ``dtype`` on ``device`` rounds like its own dtype:
    float64, or float32 on CPU with no reduced-precision matmul mode set
    (``torch.set_float32_matmul_precision``, or oneDNN's bf16/tf32 modes set
    through ``torch.backends[.mkldnn[.matmul]].fp32_precision``)."""
    if device.type != "cpu":
        return False
    if dtype is torch.float64:
        return True
    if dtype is not torch.float32:
        return False
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    if matmul is not None and hasattr(matmul, "fp32_precision"):
        # Read, this setting resolves its inheritance (global -> mkldnn ->
        # matmul) and the legacy setter writes it too ("high" tf32, "medium"
        # bf16). torch.get_float32_matmul_precision() is not asked: it raises
        # once any fp32_precision setting has been used, e.g. a GPU user's
        # torch.backends.cuda.matmul.fp32_precision = "tf32".
        return str(matmul.fp32_precision) in ("none", "ieee")
    return torch.get_float32_matmul_precision() == "highest"  # torch without the fp32_precision API


def _map_heads(
    side: SideWeights,
    tokens: Tensor,
    ys: tuple[Tensor, ...],
    in_place: bool = False,
    sole: bool = False,
    product: Tensor | None = None,
) -> tuple[Tensor, ...]:
    dtype = tokens.dtype
    if side.metric == "heads":
        # Written out (no helper calls): this runs once per call, which is
        # the cost that matters when decoding one token at a time.
        weight, bias, gate = side.weight, side.bias, side.gate
        if weight.dtype != dtype or bias.dtype != dtype or gate.dtype != dtype:
            weight, bias, gate = weight.to(dtype), bias.to(dtype), gate.to(dtype)
        S = gate.shape[0]
        # A(t) = phi(t) W + b as in _coefficients, (tokens, S, S); then diag(g) A(t):
        # the gate scales row h of each token's matrix.
        if product is None:
            product = F.linear(tokens, weight)
        A = torch.addcdiv(bias, product, _rms_denominator(tokens), value=math.sqrt(tokens.shape[-1]))
        A, g = A.view(-1, S, S), gate.view(S, 1)
        # The residual form y + (diag(g) A) y, never (I + diag(g) A) y: a GEMM
        # in TF32 or bf16 then rounds only the small correction, and gates at 0
        # give y bit for bit (a fresh or converted layer is exactly MHA).
        out = []
        gA = None
        for y in ys:
            flat = y.reshape(-1, S, y.shape[-1])
            if sole and len(ys) == 1 and _writable(flat) and _exact_matmul(flat.dtype, flat.device):
                # (I + diag(g) A) y in one bmm into a new tensor: reads y and
                # writes q~ (2 passes over the heads), where the residual form
                # writes A y, then reads y and A y and writes y (5). Only where
                # y is the sole view of its projection's output (a query
                # projection of its own), which is freed after, so no tensor
                # outlives the call; and where the GEMM rounds in y's own
                # dtype (float64; float32 on CPU at "highest" precision): I + g A
                # holds the 1s exactly, gates at 0 give I and y's values, and
                # float64 agrees with the reference's y + g A y to ~1e-16.
                # I + diag(g) A is made in A's own storage (this call's, read by
                # nothing else; one y): no (T, S, S) tensor more at the peak.
                IgA = A.mul_(g)
                IgA.diagonal(dim1=-2, dim2=-1).add_(1.0)
                out.append(torch.bmm(IgA, flat).view(y.shape))
            elif in_place and _writable(flat):
                # y + g * (A y), row h of A y scaled by g_h: the same residual
                # form, added into y's own storage (the projection's output,
                # which nothing else reads) by one addcmul_, with no gated copy
                # of A: q~ and k~ then take no tensors of their own beside the
                # projection's output, which v keeps alive, as
                # nn.MultiheadAttention's q, k, v views of it.
                out.append(flat.addcmul_(torch.bmm(A, flat), g).view(y.shape))
            else:
                if gA is None:
                    gA = A * g
                out.append(torch.baddbmm(flat, gA, flat).view(y.shape))
        return tuple(out)
    u = _coefficients(_cast(side.weight, dtype), _cast(side.bias, dtype), tokens)  # (B, T, r)
    v = _cast(side.v, dtype).flatten(0, 1)  # (S*d, r)
    gated_u = (_cast(side.u, dtype) * _cast(side.gate, dtype).view(-1, 1, 1)).flatten(0, 1).transpose(0, 1)  # (r, S*d)
    out = []
    for y in ys:
        flat = y.flatten(-2)  # (B, T, S*d)
        z = torch.matmul(flat, v)  # (B, T, r)
        out.append(torch.addmm(flat.flatten(0, -2), (u * z).flatten(0, -2), gated_u).view_as(y))
    return tuple(out)


def apply_map_weights(
    side: SideWeights,
    tokens: Tensor,
    ys: tuple[Tensor, ...],
    *,
    in_place: bool = False,
    sole: bool = False,
    product: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """L(t) y for each y in ``ys`` (B, T, S, d), one generator call for all.

    16-bit heads (or autocast) are mapped in float32: l sits near I, and in a
    16-bit type it would round q~ twice (l, then l q); the map is tiny next
    to attention.

    ``in_place``: the caller owns each y (a fresh projection output that
    nothing else reads); where no autograd records it (inference), the
    metric "heads" map is then written into y itself. ``sole``: moreover
    nothing else reads y after the map (it is freed once mapped; a
    ``product`` made in the same GEMM may share its storage, and is read
    before y is mapped), so the map may make a new tensor instead, in fewer
    passes (see ``_map_heads``).
    ``product``: the generator's product t W^T, made by the caller in the
    projection's GEMM (``_linear_and_product``: metric "heads", tokens and
    weights of one float32/float64 dtype, no autocast).
    """
    dtype = ys[0].dtype
    if product is not None:
        return _map_heads(side, tokens, ys, in_place, sole, product)
    if dtype == torch.float16 or dtype == torch.bfloat16:
        with torch.autocast(ys[0].device.type, enabled=False):
            out = _map_heads(side, tokens.float(), tuple(t.float() for t in ys))
        return tuple(t.to(dtype) for t in out)
    return _map_heads(side, tokens if tokens.dtype == dtype else tokens.to(dtype), ys, in_place, sole)


def role_penalty_weights(side: SideWeights, tokens: Tensor, head_dim: int) -> Tensor:
    """mean over tokens of ||L(t) - I||_F^2 / (S*d), a 0-d tensor in the tokens' dtype.

    16-bit tokens (or autocast) are computed in float32: sum(t^2) over the
    features overflows float16 for moderately large tokens.
    """
    dtype = torch.float32 if tokens.dtype in (torch.float16, torch.bfloat16) else tokens.dtype
    device = tokens.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            return _role_penalty(side, tokens.to(dtype), dtype, head_dim).to(tokens.dtype)
    return _role_penalty(side, tokens.to(dtype), dtype, head_dim).to(tokens.dtype)


def _canonical_leaves(side: SideWeights, dtype: torch.dtype) -> dict[str, Tensor]:
    """The side's leaves that act on coefficients (gate, u, v), canonical layout."""
    leaves = {"gate": side.gate, "u": side.u, "v": side.v}
    return {k: v.to(dtype) for k, v in leaves.items() if v is not None}


def _role_penalty(side: SideWeights, tokens: Tensor, dtype: torch.dtype, d: int) -> Tensor:
    structure = dc.METRIC_STRUCTURES[side.metric]
    S = side.gate.shape[0]
    coeff = _coefficients(side.weight.to(dtype), side.bias.to(dtype), tokens)
    coeff = coeff.unflatten(-1, structure.coefficient_shape(S, coeff.shape[-1]))
    # damcha_core's formula of ||L(t) - I||_F^2, evaluated on torch tensors.
    sq = structure.penalty_sq(torch, coeff, _canonical_leaves(side, dtype), d)
    # Over no token (an empty batch or sequence) 0, as the reference's role_penalty, not mean()'s NaN.
    return (sq.mean() if sq.numel() != 0 else sq.sum()) / (S * d)


def causal_visibility(n: int, m: int, query_offset: int = 0, device: torch.device | None = None) -> Tensor:
    """Bool (N, M), True = may attend: query i sits at position ``query_offset + i``
    and sees keys j <= query_offset + i (top-left for offset 0, bottom-right with
    a cache of ``query_offset = M - N`` earlier tokens)."""
    rows = torch.arange(n, device=device).unsqueeze(-1) + query_offset
    return torch.arange(m, device=device) <= rows


def _combine(mask: Tensor | None, visible: Tensor) -> Tensor:
    """Hide what ``visible`` (bool, True = attend) hides in a bool or additive mask."""
    if mask is None:
        return visible
    if mask.dtype == torch.bool:
        return mask & visible
    return mask.masked_fill(~visible, _NEG_INF)


def visibility(
    n: int,
    m: int,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    query_offset: int = 0,
    device: torch.device | None = None,
) -> Tensor | None:
    """The may-attend mask of N queries over M keys, broadcastable to (B, H, N, M).

    Args:
        n, m: N queries, M keys.
        mask: bool, True = may attend (the reference's convention), or an
            additive float mask (-inf hides); any shape broadcastable to
            (B, H, N, M).
        causal: also hide key j from query i when j > query_offset + i.
        query_offset: position of query 0 (the cache length when decoding).
        device: where to build the causal part (default: the mask's device).

    Returns:
        ``mask`` with the causal rule applied (bool stays bool, float stays
        additive), or ``None`` when every key is visible.
    """
    if causal and query_offset < m - 1:
        return _combine(mask, causal_visibility(n, m, query_offset, device if mask is None else mask.device))
    return mask


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None,
    causal: bool,
    query_offset: int,
    scale: float | None,
    dropout_p: float,
    need_weights: bool,
    guard: tuple[Tensor, Tensor] | None,
    recipes: list[MapRecipes] | None = None,
    rows_out: bool = False,
) -> tuple[Tensor, Tensor | None, _Rows | None]:
    """``softmax_attend`` given the NaN ``guard`` (a, b) of the fused path: the
    output becomes o + 0 * a * b, see ``_guard``. ``recipes``: the store-mode
    nodes that made q and k; SDPA saves q~ and k~ as their recipes.

    ``rows_out`` (fused path only, the caller guards the output rows): what the
    mask says about each query row is returned as ``_Rows`` for the caller
    to apply to y instead of o, where it can: the all-masked rows when they
    are the same for every head (zeroing them in o would make a copy of o that
    the output projection saves beside SDPA's own output, one (B, N, H*d_v)
    activation more than nn.MultiheadAttention), and a float mask's NaN rows.
    Rows that are empty for some heads only are still zeroed in o."""
    n, m = q.shape[-2], k.shape[-2]
    # Python ints even under torch.jit.trace, which records sizes as tensors.
    heads, kv_heads = int(q.shape[1]), int(k.shape[1])
    if causal and query_offset >= m - 1:
        # Query 0 already sees every key (a one-token decoding step, or M = 1),
        # so the rule hides nothing: skip building a mask on the hot path.
        causal = False
    if causal and (mask is not None or query_offset or need_weights):
        mask = _combine(mask, causal_visibility(n, m, query_offset, q.device))
        causal = False
    row_ok = None
    rows = None
    if mask is not None:
        # SDPA turns a row with no visible key into NaN (0/0) or 0 depending
        # on the kernel; v1 defines it as 0 with finite gradients: such rows
        # are unhidden for the kernel and zeroed after. Which rows they are is
        # read from the mask alone, never from the logits.
        row_max = None
        if _has_empty_dim(k, (-2,)):
            # M = 0, only with n == 0 (the shape rules refuse queries without keys): no
            # row to unhide or zero, and no key to reduce over.
            mask = mask if mask.dtype == torch.bool else mask.to(q.dtype)
        elif mask.dtype == torch.bool:
            if not _reads_values(mask) or not bool(mask[..., 0].all()):
                row_ok = mask.any(dim=-1, keepdim=True)
                mask = mask | ~row_ok
            # else every query sees key 0 (the causal rule never hides it), so
            # no row is empty: no pass to unhide rows or to zero them after
            # (a padding mask that keeps each sequence's first token).
        else:
            # One pass over the mask: the row maximum is -inf exactly when every
            # key is hidden, and NaN when the row holds a NaN (which must reach
            # the output, as in nn.MultiheadAttention: it is not "hidden").
            if torch.compiler.is_exporting():
                # torch.export traces M as >= 2 and drops the M = 0 branch above: one -inf key
                # more changes no row's maximum and gives amax a key to reduce over at M = 0.
                row_max = F.pad(mask, (0, 1), value=_NEG_INF).amax(dim=-1, keepdim=True)
            else:
                row_max = mask.amax(dim=-1, keepdim=True)
            row_ok = row_max != _NEG_INF
            mask = mask.masked_fill(~row_ok, 0.0).to(q.dtype)
            if guard is not None:
                # + 0 * row_max: NaN for a NaN row, 0 for any finite one (also -1e9).
                guard = (guard[0], torch.add(guard[1], row_max, alpha=0).to(q.dtype))
        if rows_out:
            if row_max is not None and row_ok is not None:  # both set by a float mask
                # 0 where the row is empty (its -inf would make 0 * row_max NaN),
                # one value per row over the heads: NaN if any head's row has one.
                row_max = _per_row(row_max.masked_fill(~row_ok, 0.0))
            if row_ok is not None and row_ok.dim() >= 3 and row_ok.shape[-3] != 1:
                # Empty for some heads only (the caller passes no such mask):
                # zeroed in o below.
                rows = _Rows(None, row_max)
            else:
                rows = _Rows(None if row_ok is None else _per_row(row_ok), row_max)
                row_ok = None
    if not need_weights:
        hooks: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if recipes:
            from ._models_fused import saved_as_recipes  # it imports this module

            hooks = saved_as_recipes(recipes)
        with hooks:
            o = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=causal,
                scale=scale,
                enable_gqa=kv_heads != heads,
            )
        for r in recipes or ():
            r.settle()
        if guard is not None:
            # SDPA's CPU kernel returns 0, not NaN, for a row whose logits are
            # all NaN (it reads them as masked): one NaN weight would give a
            # finite output. o + 0 * a * b makes such rows NaN and changes
            # nothing else (value=0 keeps NaN * 0 = NaN; compilers do not fold
            # it away): one pass. Detached: the guard adds nothing to the
            # gradient, so autograd keeps no tensor and runs no backward for it.
            a, b = guard
            if a.shape[-1] != o.shape[-1]:
                a = a.sum(dim=-1, keepdim=True)
            # Where nothing records o (inference) SDPA's fresh output is guarded
            # in place: a copy would allocate and write a (B, H, N, d_v) tensor
            # more per call than nn.MultiheadAttention. Always detach otherwise:
            # one graph for jit.trace.
            o = o.addcmul_(a, b, value=0) if _writable(o) else torch.addcmul(o, a.detach(), b.detach(), value=0)
        return (o if row_ok is None else torch.where(row_ok, o, 0.0)), None, rows
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, _NEG_INF) if mask.dtype == torch.bool else logits + mask
    probs = torch.softmax(logits, dim=-1)
    if row_ok is not None:
        probs = torch.where(row_ok, probs, 0.0)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v), probs, None


class _Rows(NamedTuple):
    """What a mask says about each query row, (B|1, N|1, 1) like the rows of
    y (B, N, E_o): ``ok`` (bool) False where the row sees no key, or None
    when no row is empty; ``nan`` a float mask's row maximum (NaN where the
    row holds a NaN, else finite), or None."""

    ok: Tensor | None
    nan: Tensor | None


def _per_row(t: Tensor) -> Tensor:
    """(B|1, 1, N|1, 1) from a per-row tensor broadcastable to (B, H, N, 1)
    (any leading dims missing; the head dim reduced or 1): (B|1, N|1, 1)."""
    if t.dim() < 4:
        t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    if t.shape[1] != 1:
        t = t.amax(dim=1, keepdim=True)
    return t[:, 0]


def _saved_tensor_hooks_on() -> bool:
    """Whether saved-tensor hooks of the caller's are active (checkpoint, save_on_cpu)."""
    hooks: object = torch._C._autograd._top_saved_tensors_default_hooks(True)  # None when there are none
    return hooks is not None


def _reads_values(t: Tensor) -> bool:
    """Whether a forward may branch on values of ``t`` (a mask): eager, on
    CPU, where reading one costs no device sync and no trace, compiled
    graph or torch.func transform would bake the branch in."""
    return (
        type(t) is Tensor  # not a fake, functional or other subclass tensor of a tracer
        and t.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not torch._C._is_tracing()
        and not torch._C._are_functorch_transforms_active()
    )


def check_mask_values(name: str, mask: Tensor) -> None:
    """Refuse a float (additive) mask holding NaN or +inf, where a forward reads values (``_reads_values``).

    Either makes every output of its row NaN (softmax of +inf - +inf, or a NaN
    logit), which the other ports refuse as a mask error. One read of the mask
    you passed, eager on CPU only: elsewhere the read would sync the device
    per call (CUDA) or bake a branch into a trace or compiled graph, so the
    values are not read there (docs/torch.md).
    """
    if not (mask.is_floating_point() and mask.numel() and _reads_values(mask)):
        return
    # The largest entry is NaN (a max propagates it) or +inf exactly when the mask holds either.
    # Row maxima, then their maximum: one vectorised pass over the mask, 7-18x faster on CPU than
    # comparing every entry and reducing the bool result (N = 256 / 1024: 69 -> 5, 1,690 -> 92 us).
    top = mask.amax(dim=-1).max() if mask.dim() else mask
    if not bool(top < math.inf):
        found = "NaN" if bool(mask.isnan().any()) else "+inf"
        raise DamchaValueError(
            dc.invalid_argument(
                name,
                "an additive float mask of finite values and -inf (0 = attend, -inf = masked out); NaN or +inf "
                "would make every output of its rows NaN (pass a bool mask, or -inf for hidden keys)",
                f"{name}={describe(mask)} holding {found}",
            )
        )


def _writable(t: Tensor) -> bool:
    """Whether an op's fresh output ``t`` may be written in place: no autograd
    records it, and no tracer, compiler or torch.func transform sees the
    call (they keep the out-of-place op, one graph for every grad mode)."""
    return (
        not (torch.is_grad_enabled() and t.requires_grad)
        and type(t) is Tensor
        and not torch.compiler.is_compiling()
        and not torch._C._is_tracing()
        and not torch._C._are_functorch_transforms_active()
    )


def _certainly_finite(q: Tensor, k: Tensor) -> bool:
    """Whether q~ and k~ certainly hold no NaN or inf: one sum of each, read
    where a forward may branch on values (``_reads_values``; elsewhere False).

    A NaN or inf anywhere makes the sum NaN or inf, so a finite sum proves
    every element finite (one that overflows says False, which only costs
    the guard). The NaN guard then adds 0 everywhere, and the call skips it:
    one read of q~ and of k~ instead of max |k~| (abs, amax), the pass over o
    (read q~ and o, write o) or, in training, max |q~| per token and a copy
    of y; about 13 (B, N, E)-sized passes -> 3 in a training cross-attention
    call (tests/test_torch_ops.py).
    """
    if not (_reads_values(q) and type(k) is Tensor):
        return False
    with torch.no_grad():
        return math.isfinite(q.sum().item()) and math.isfinite(k.sum().item())


def jit_tracing() -> bool:
    """Whether torch.jit.trace records this call (never true under torch.compile:
    Dynamo cannot trace ``_is_tracing``, so it is not asked there)."""
    return not torch.compiler.is_compiling() and torch._C._is_tracing()


def _has_empty_dim(t: Tensor, dims: tuple[int, ...]) -> bool:
    """Whether one of ``dims`` of ``t`` has size 0. Never under torch.jit.trace, which
    records sizes as tensors (a bool of one warns and pins the branch): a traced
    example has no empty dim worth a branch of its own."""
    if jit_tracing():
        return False
    return any(t.shape[i] == 0 for i in dims)


def _abs_max(t: Tensor, dim: tuple[int, ...], keepdim: bool = False) -> Tensor:
    """max |t| over ``dim``. amax refuses a size-0 dim; one holds no key, and
    then no query either (the shape rules refuse N >= 1 queries over M = 0
    keys), so the guard has no row to act on: 0 of the reduced shape serves.

    Under torch.export the size-0 branch cannot be kept: export traces a dynamic
    dim as >= 2 and drops it, so the program failed in amax when called with
    M = 0. There the guard's value is sum(0 * t) instead, with no branch: 0 where
    every element is finite, NaN otherwise (all the guard reads of it: 0 * a * b),
    and 0 over an empty dim."""
    if torch.compiler.is_exporting():
        return (t * 0).sum(dim=dim, keepdim=keepdim)
    if _has_empty_dim(t, dim):
        shape = (
            [1 if i in dim else s for i, s in enumerate(t.shape)]
            if keepdim
            else [s for i, s in enumerate(t.shape) if i not in dim]
        )
        return t.new_zeros(shape)
    return t.abs().amax(dim=dim, keepdim=keepdim)


def _guard(q: Tensor, k: Tensor, own_keys: bool = False) -> tuple[Tensor, Tensor]:
    """The fused path's NaN guard (a, b): o + 0 * a * b is NaN in every row
    whose query has a NaN or inf, and in every row of a batch with a non-finite
    key of this call (a row whose logits are all NaN would otherwise be 0).

    In general b = max |k| over batch b's keys (B, 1, 1, 1): a reduction,
    which unlike a sum cannot overflow (float16), written abs + amax (a fifth
    of ``vector_norm(ord=inf)``'s time on CPU) and out of autograd (b is used
    detached). With ``own_keys`` (self-
    attention without a mask, G = H, d = d_v, so each query sees its own
    token's key, the causal rule included) the keys themselves serve: a row
    whose visible logits are all NaN has a NaN own key, and any other row
    that reads a NaN key also reads a finite one, and SDPA propagates it.
    No extra kernel then (a decoding step's keys are one token).
    """
    if own_keys:
        return q, k
    with torch.no_grad():
        return q, _abs_max(k, (1, 2, 3), keepdim=True)


def _row_guard(q: Tensor, k: Tensor, own_keys: bool, batch_dim: int) -> tuple[Tensor, Tensor]:
    """``_guard`` reduced to output rows, from token-major q (B, N, H, d) and
    k (B, M, G, d), or (N, B, ...) and (M, B, ...) with ``batch_dim`` 1: (a, b)
    with y + 0 * a * b NaN exactly in the rows of y (B, N, E_o) (or (N, B,
    E_o)) that the per-element guard makes NaN in o, i.e. where the row's
    query (over all heads) or, with ``own_keys``, the row's own key, else any
    key of the batch, is not finite. a = max |q| per token (.., .., 1); b
    likewise or one per batch entry. Maxima (NaN-propagating), never sums, so
    finite values cannot overflow (float16); addcmul's 0 * a * b is
    (0 * a) * b, so neither does the product."""
    # Out of autograd: the guard adds nothing to the gradient, so autograd
    # keeps no tensor and runs no backward for it (no_grad rather than a
    # detach of each input: one dispatched op fewer per tensor). abs + amax:
    # about a fifth of vector_norm(ord=inf)'s time on CPU (0.4 vs 2.2 ms for
    # (4, 256, 8, 64)).
    with torch.no_grad():
        a = q.abs().amax(dim=(2, 3)).unsqueeze(-1)
        if own_keys:
            b = k.abs().amax(dim=(2, 3)).unsqueeze(-1)
        else:
            b = _abs_max(k, (1 - batch_dim, 2, 3), keepdim=True).squeeze(-1)
    return a, b


def softmax_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    query_offset: int = 0,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Scaled dot-product attention in SDPA layout with v1's all-masked rule.

    Args:
        q: (B, H, N, d) queries.
        k: (B, G, M, d) keys; G divides H and query head h reads kv head
            h // (H / G).
        v: (B, G, M, d_v) values.
        mask: bool (True = may attend) or additive float, broadcastable to
            (B, H, N, M). Not validated here (``damcha_attention`` does).
        causal: hide key j from query i when j > i + query_offset.
        query_offset: position of query 0 (the cache length when decoding).
        scale: logit scale; ``None`` is 1/sqrt(d).
        dropout_p: attention-probability dropout (pass 0.0 outside training).
        need_weights: compute explicitly and also return the probabilities
            (B, H, N, M); otherwise one fused SDPA call, no N x M tensor
            beyond the mask the caller passed.

    Returns:
        ``(o, weights)``: o (B, H, N, d_v); weights or ``None``. A query that
        sees no key gets probabilities 0 and output 0, in value and gradient.
        A NaN or inf in q, k or a float mask gives NaN in the rows it reaches
        (the fused kernel alone would return 0 for some of them).

    Raises:
        DamchaValueError: q, k, v not (B, H, N, d), (B, G, M, d), (B, G, M, d_v)
            with G dividing H (the fused kernel reads values of another
            length without complaint on CPU).
    """
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    if not (
        len(qs) == len(ks) == len(vs) == 4
        and qs[0] == ks[0] == vs[0]
        and ks[1:3] == vs[1:3]
        and qs[3] == ks[3]
        and ks[1] > 0
        and qs[1] % ks[1] == 0
    ):
        raise DamchaValueError(
            dc.invalid_argument(
                "q, k, v",
                "shapes (B, H, N, d), (B, G, M, d), (B, G, M, d_v) with G dividing H",
                f"q.shape={qs}, k.shape={ks}, v.shape={vs}",
            )
        )
    o, weights, _ = _attend(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        query_offset=query_offset,
        scale=scale,
        dropout_p=dropout_p,
        need_weights=need_weights,
        guard=_guard(q, k),
    )
    return o, weights


def safe_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    is_causal: bool = False,
    query_offset: int = 0,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Deprecated alias of ``softmax_attend`` (``is_causal`` is its ``causal``)."""
    warnings.warn(
        "damcha_torch.safe_attention is deprecated; use damcha_torch.softmax_attend "
        "(same arguments, `is_causal` renamed `causal`).",
        DeprecationWarning,
        stacklevel=2,
    )
    return softmax_attend(
        q,
        k,
        v,
        mask=mask,
        causal=is_causal,
        query_offset=query_offset,
        scale=scale,
        dropout_p=dropout_p,
        need_weights=need_weights,
    )


# ---------------------------------------------------------- layer forward


def _queries_keys(
    w: LayerWeights,
    config: DamchaConfig,
    x: Tensor,
    c: Tensor,
    self_attention: bool,
    qk_proj: tuple[Tensor, Tensor | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """q~ (B, N, H, d) and k~ (B, M, G, d). ``qk_proj``: the packed weight's
    and bias's q/k rows, split off by the caller (see ``_project``)."""
    H, d = config.num_heads, config.key_dim
    G = config_sizes(config)[3]
    sole = False
    if self_attention and w.in_proj is not None:
        if qk_proj is None:
            n_qk = w.sizes[0] + w.sizes[1]
            qk_proj = (w.in_proj[:n_qk], None if w.in_bias is None else w.in_bias[:n_qk])
        q, k = F.linear(x, *qk_proj).split_with_sizes(w.sizes[:2], dim=-1)
    else:
        (W_q, b_q), (W_k, b_k), _ = w.projections()
        q, k = F.linear(x, W_q, b_q), F.linear(c, W_k, b_k)
        sole = True  # two GEMM outputs of their own
    q, k = q.view(q.shape[0], q.shape[1], H, d), k.view(k.shape[0], k.shape[1], G, d)
    return _apply_maps(w, config, x, c, q, k, self_attention, (sole, sole))


def _apply_maps(
    w: LayerWeights,
    config: DamchaConfig,
    x: Tensor,
    c: Tensor,
    q: Tensor,
    k: Tensor,
    self_attention: bool,
    sole: tuple[bool, bool] = (False, False),
) -> tuple[Tensor, Tensor]:
    """q~ and k~ from the projections q (B, N, H, d) and k (B, M, G, d), fresh
    outputs of this call's projections (mapped in place in inference).
    ``sole``: q, k is a projection output of its own (not a view of a packed
    one that v also views), which the map may replace (``apply_map_weights``)."""
    if self_attention and config.metric != "none" and config.coupling == "tied":
        # One generator, one set of tokens: build l(t) once for both sides.
        return apply_map_weights(w.sides["qk"], x, (q, k), in_place=True)  # type: ignore[return-value]
    sq, sk = dc.side_of(config, "q"), dc.side_of(config, "k")
    if sq is not None:
        (q,) = apply_map_weights(w.sides[sq], x, (q,), in_place=True, sole=sole[0])
    if sk is not None:
        (k,) = apply_map_weights(w.sides[sk], c, (k,), in_place=True, sole=sole[1])
    return q, k


def _merges_products(w: LayerWeights, config: DamchaConfig, x: Tensor) -> bool:
    """Whether the generators' products t W^T may come out of the projections'
    GEMMs (``_linear_and_product``): where a training call's nodes could run
    (``_fusable``: metric "heads", every weight in the tokens' float32/float64
    dtype, so the map computes in that dtype as ``apply_map_weights`` would;
    no autocast, which would make the product in 16 bits; not compiling or
    tracing), and moreover on a plain tensor outside torch.func transforms (a
    tracer, compiler or exporter would bake ``_linear_and_product``'s branch
    on the token count into its graph, or guard a dynamic length on it)."""
    return type(x) is Tensor and not torch._C._are_functorch_transforms_active() and _fusable(w, config, x)


def _linear_and_product(
    t: Tensor, weight: Tensor, bias: Tensor | None, side: SideWeights | None
) -> tuple[Tensor, Tensor | None]:
    """(F.linear(t, weight, bias), t W_g^T) with ``side``'s generator weight
    W_g (S*S, E) appended to ``weight``: one GEMM of out + S*S columns where
    the product alone, S*S = 64 columns, ran well below the GEMM rate on CPU.
    The weights are joined per call, so only where there are at least as many
    tokens as joined rows: the copy (out + S*S, E) is then no larger than the
    (tokens, E) input, its time small next to the GEMM's, and the call's peak
    memory stays below nn.MultiheadAttention's (tests/test_torch_saved.py).
    Both results are views of one output. Otherwise (or without ``side``):
    F.linear alone, and None (the map makes the product itself)."""
    n = weight.shape[0]
    if side is None or t.numel() < (n + side.weight.shape[0]) * t.shape[-1]:
        return F.linear(t, weight, bias), None
    extra = side.weight.shape[0]
    joined_bias = None if bias is None else torch.cat((bias, _zero_bias(extra, t)))
    out = F.linear(t, torch.cat((weight, side.weight)), joined_bias)
    return out[..., :n], out[..., n:]


def _project(
    w: LayerWeights,
    config: DamchaConfig,
    x: Tensor,
    c: Tensor,
    value: Tensor,
    self_attention: bool,
    recompute: bool,
    recipes: list[MapRecipes] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """q~ (B, N, H, d), k~ (B, M, G, d), v (B, M, G, d_v).

    ``recipes``: a list where the fused nodes may run in store mode (see
    ``_project_fused``); the ``MapRecipes`` of each are appended to it."""
    # torch.func's grad/vjp/jacrev reject the saved-tensor hooks checkpoint
    # uses, so under a functorch transform the maps are stored instead. Under
    # torch.jit.trace too: its check traces again under no_grad and needs one
    # graph for every grad mode (and a traced fused node would be a Python op,
    # which torch.jit.save cannot write).
    recompute = (
        recompute
        and torch.is_grad_enabled()
        and config.metric != "none"
        and not torch._C._are_functorch_transforms_active()
        and not jit_tracing()
    )
    if recompute and _fusable(w, config, x):
        return _project_fused(w, config, x, c, value, self_attention, recipes)
    G, dv = config_sizes(config)[3:]
    if self_attention and w.in_proj is not None and not recompute:
        # One packed GEMM for q, k, v, as nn.MultiheadAttention does.
        B, N = x.shape[0], x.shape[1]
        q, k, v = F.linear(x, w.in_proj, w.in_bias).split_with_sizes(w.sizes, dim=-1)
        q, k = _apply_maps(
            w,
            config,
            x,
            x,
            q.view(B, N, config.num_heads, config.key_dim),
            k.view(B, N, G, config.key_dim),
            True,
        )
    elif not recompute and not self_attention and w.in_proj is not None and value is c:
        # Cross-attention with one tensor for key and value: k and v from one
        # GEMM, as nn.MultiheadAttention projects them.
        n_q, n_kv = w.sizes[0], w.sizes[1] + w.sizes[2]
        W_q, W_kv = w.in_proj.split_with_sizes((n_q, n_kv))
        b_q, b_kv = (None, None) if w.in_bias is None else w.in_bias.split_with_sizes((n_q, n_kv))
        sq, sk = dc.side_of(config, "q"), dc.side_of(config, "k")
        k, v = F.linear(c, W_kv, b_kv).split_with_sizes(w.sizes[1:], dim=-1)
        # The query side's generator product comes out of the query GEMM where
        # that pays (_linear_and_product). Not the key side's: its columns
        # would share the k/v output that v keeps alive through SDPA, S*S
        # floats per key above nn.MultiheadAttention's peak.
        side = w.sides[sq] if sq is not None and _merges_products(w, config, x) else None
        q, P_x = _linear_and_product(x, W_q, b_q, side)
        q = q.view(*x.shape[:2], config.num_heads, config.key_dim)
        if sq is not None:
            # q is its own GEMM's output (sole): mapped into a new tensor, and
            # let go (with P_x, a view of the same output) before the keys are
            # mapped: the call's peak stays nn.MultiheadAttention's.
            (q,) = apply_map_weights(w.sides[sq], x, (q,), in_place=True, sole=True, product=P_x)
        del P_x
        k = k.view(*c.shape[:2], G, config.key_dim)
        if sk is not None:
            # k shares the k/v GEMM's output with v: mapped in place.
            (k,) = apply_map_weights(w.sides[sk], c, (k,), in_place=True)
    else:
        qk_proj = None
        if self_attention and w.in_proj is not None:
            # One split of the packed weight (and bias) into q/k rows and v
            # rows: its backward is one cat, where a slice for q/k and another
            # for v would each fill a zero gradient of the whole weight.
            n_qk, n_v = w.sizes[0] + w.sizes[1], w.sizes[2]
            W_qk, W_v = w.in_proj.split_with_sizes((n_qk, n_v))
            b_qk, b_v = (None, None) if w.in_bias is None else w.in_bias.split_with_sizes((n_qk, n_v))
            qk_proj = (W_qk, b_qk)
        else:
            W_v, b_v = w.projections()[2]
        if recompute:
            # Storing q, k and q~, k~ would cost 2E floats per token more than
            # MHA; recomputing them in backward costs one q/k projection.
            q, k = checkpoint(_queries_keys, w, config, x, c, self_attention, qk_proj, use_reentrant=False)
        else:
            q, k = _queries_keys(w, config, x, c, self_attention, qk_proj)
        v = F.linear(value, W_v, b_v)
    return q, k, v.view(v.shape[0], v.shape[1], G, dv)


def _fusable(w: LayerWeights, config: DamchaConfig, x: Tensor) -> bool:
    """Whether a training call's projections and maps may run as
    ``FusedProjectionMaps``/``SplitLinearMaps`` nodes: metric "heads", every weight in x's dtype
    (float32/float64), no autocast, and eager autograd (compiling, tracing and
    exporting keep the composite path, which they decompose themselves)."""
    dtype = x.dtype
    if config.metric != "heads" or (dtype is not torch.float32 and dtype is not torch.float64):
        return False
    device = x.device.type
    if (
        (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device))
        or torch.compiler.is_compiling()
        or torch._C._is_tracing()
    ):
        return False
    tensors = [w.in_proj, w.q, w.k, w.v, w.in_bias]
    for side in w.sides.values():
        tensors += [side.weight, side.bias, side.gate]
    return all(t is None or t.dtype is dtype for t in tensors)


def _project_fused(
    w: LayerWeights,
    config: DamchaConfig,
    x: Tensor,
    c: Tensor,
    value: Tensor,
    self_attention: bool,
    recipes: list[MapRecipes] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``_project`` of a training call with recompute, one autograd node per projection GEMM.

    Each projection and the maps of the heads it produces are one autograd
    node (``FusedProjectionMaps``, or ``SplitLinearMaps`` where the output holds
    several of q, k, v; see ``_models_fused``): it saves only its input and
    weights, maps its output in place, and in backward recomputes the mapped
    rows and writes the map's gradients by hand, where
    ``torch.utils.checkpoint`` ran the q/k projection and every op of the maps
    again and autograd stored their intermediates. q~, k~ and v are views of
    the projections' outputs, as nn.MultiheadAttention's q, k and v are.
    Self-attention is one packed GEMM; cross-attention with one tensor for
    key and value (``value is c``) and the packed weight is two, as in
    nn.MultiheadAttention (queries; keys and values).

    With ``recipes`` (a list) the nodes run in store mode: q~ and k~ are fresh
    tensors, each node keeps its projection's output unmapped and projects
    nothing again in backward, and the ``MapRecipes`` of each node are
    appended to ``recipes`` for the attention to save q~ and k~ as (see
    ``attend_weights``).
    """
    from ._models_fused import MapRecipes, SideBlocks, SplitLinearMaps  # it imports this module

    H, d = config.num_heads, config.key_dim
    G, dv = config_sizes(config)[3:]
    sq, sk = dc.side_of(config, "q"), dc.side_of(config, "k")

    def leaves(side: str) -> tuple[Tensor, Tensor, Tensor]:
        s = w.sides[side]
        return s.weight, s.bias, s.gate

    def store() -> MapRecipes | None:
        if recipes is None:
            return None
        recipes.append(MapRecipes())
        return recipes[-1]

    def mapped(t: Tensor, weight: Tensor, bias: Tensor | None, side: str | None) -> Tensor:
        """F.linear(t, weight, bias) (all S*d features: one role's heads) mapped by ``side``."""
        if side is None:
            return F.linear(t, weight, bias)
        blocks = (SideBlocks(side, config.side_heads(side), d, (0,)),)
        (out,) = SplitLinearMaps.apply(blocks, (weight.shape[0],), store(), t, weight, bias, *leaves(side))
        return out

    if self_attention and w.in_proj is not None:
        if sq is not None and sq == sk:
            # Tied: the query and key blocks share one generator call.
            sides: tuple[SideBlocks, ...] = (SideBlocks(sq, H, d, (0, H * d)),)
            side_leaves: tuple[Tensor, ...] = leaves(sq)
        else:
            sides, side_leaves = (), ()
            for side, heads, offset in ((sq, H, 0), (sk, G, H * d)):
                if side is not None:
                    sides += (SideBlocks(side, heads, d, (offset,)),)
                    side_leaves += leaves(side)
        q, k, v = SplitLinearMaps.apply(sides, w.sizes, store(), x, w.in_proj, w.in_bias, *side_leaves)
    elif w.in_proj is not None and value is c:
        # One weight split (its backward is one cat) and one GEMM for k and v.
        n_q, n_kv = w.sizes[0], w.sizes[1] + w.sizes[2]
        W_q, W_kv = w.in_proj.split_with_sizes((n_q, n_kv))
        b_q, b_kv = (None, None) if w.in_bias is None else w.in_bias.split_with_sizes((n_q, n_kv))
        q = mapped(x, W_q, b_q, sq)
        if sk is None:
            k, v = F.linear(c, W_kv, b_kv).split_with_sizes(w.sizes[1:], dim=-1)
        else:
            blocks = (SideBlocks(sk, G, d, (0,)),)
            k, v = SplitLinearMaps.apply(blocks, w.sizes[1:], store(), c, W_kv, b_kv, *leaves(sk))
    else:
        (W_q, b_q), (W_k, b_k), (W_v, b_v) = w.projections()
        q, k, v = mapped(x, W_q, b_q, sq), mapped(c, W_k, b_k, sk), F.linear(value, W_v, b_v)
    return q.view(*x.shape[:2], H, d), k.view(*c.shape[:2], G, d), v.view(v.shape[0], v.shape[1], G, dv)


def attend_weights(
    w: LayerWeights,
    config: DamchaConfig,
    query: Tensor,
    context: Tensor | None,
    value: Tensor | None,
    *,
    mask: Tensor | None,
    causal: bool,
    query_offset: int,
    kv_cache: DamchaKVCache | None,
    dropout_p: float,
    need_weights: bool,
    recompute: bool,
    seq_first: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The forward pass on validated inputs: y (B, N, E_o) and the per-head
    probabilities (B, H, N, M) or ``None``. ``DamchaAttention.forward`` and
    ``damcha_attention`` both end here.

    ``seq_first``: the tokens are (N, B, E) and (M, B, E) and y is (N, B, E_o)
    (nn.MultiheadAttention's default layout). The projections and maps act
    on each token alone, so they run in that order; SDPA reads permuted
    views, and only its output is copied into (N, B) order, as MHA copies it.
    Not with ``kv_cache``."""
    self_attention = context is None
    c = query if context is None else context
    # Store mode of the fused nodes (see _project_fused) where the one consumer
    # of q~ and k~ that saves them is this call's SDPA kernel, on CPU (whose
    # kernel saves its inputs as given: measured, see docs/torch.md): SDPA
    # then saves each as its recipe and autograd stores the unmapped
    # projections, what MHA stores, and backward projects nothing again. Not
    # under saved-tensor hooks of the caller's (torch.utils.checkpoint,
    # save_on_cpu): only one pair applies at a time, and theirs must see SDPA's.
    recipes: list[MapRecipes] | None = None
    if (
        recompute
        and not need_weights
        and kv_cache is None
        and w.bias_k is None
        and not w.zero_attn
        and query.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and torch.is_grad_enabled()
        and not _saved_tensor_hooks_on()
    ):
        recipes = []
    q, k, v = _project(w, config, query, c, c if value is None else value, self_attention, recompute, recipes)
    row_guard = None
    # The NaN guard adds 0 everywhere when q~ and k~ are finite (a float mask
    # brings NaN rows of its own, and a cache keys this call does not hold).
    finite = (
        not need_weights and kv_cache is None and (mask is None or mask.dtype == torch.bool) and _certainly_finite(q, k)
    )
    guard_rows = False
    # A mask with a head dim may leave a row empty for some heads only, which
    # y cannot express: its rows are guarded and zeroed in o, as before.
    per_head = mask is not None and mask.dim() >= 3 and mask.shape[-3] != 1
    # Without autograd nothing is saved, so the cheaper guard on o serves
    # (0 * q~ * max|k~| elementwise: no reduction over q~, and none at all in
    # self-attention without a mask): one or two reductions fewer per call.
    # (Traced or compiled: one graph for every grad mode, as before; torch.jit.trace
    # checks its graph again under another one.)
    recording = (
        torch.compiler.is_compiling()
        or torch._C._is_tracing()
        or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    )
    if (
        recording
        and not need_weights
        and w.bias_k is None
        and not w.zero_attn
        and (mask is None or (w.output_params is not None and not per_head))
    ):
        # Guarding the (B, N, E_o) output instead of o keeps o itself (saved by
        # SDPA for its backward) the output projection's input: a guarded copy
        # of o would be a second (B, N, H*d_v) activation that the projection
        # saves too, one more per layer than nn.MultiheadAttention. Read in the
        # tokens' own order, so y's, with no permuted views. With a mask, the
        # rows it leaves empty are set on y too (see below), and every key of
        # the batch entry counts (the row's own key may be hidden).
        guard_rows = True
        if not finite:
            own = mask is None and self_attention and q.shape[-2] == k.shape[-2] and q.shape[-1] == v.shape[-1]
            row_guard = _row_guard(q, k, own_keys=own, batch_dim=1 if seq_first else 0)
    if seq_first:
        q, k, v = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
    else:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # The NaN guard reads this call's keys only, not a whole cache: a cached
    # NaN key is read by a query next to this call's finite ones, and SDPA
    # propagates it itself.
    guard = None
    if not need_weights and not guard_rows and not finite:
        own = self_attention and mask is None and q.shape[1] == k.shape[1] and q.shape[-1] == v.shape[-1]
        guard = _guard(q, k, own_keys=own)
    fixed = None
    if kv_cache is not None:
        if mask is None and not need_weights and not query_offset and w.bias_k is None and not w.zero_attn:
            # A compiled step of a fixed_shape cache: the whole capacity and the
            # mask of its cached positions, never the length as a Python int.
            fixed = kv_cache._append_fixed(k, v, causal)
        if fixed is not None:
            k, v, mask = fixed
            causal = False
        else:
            query_offset = query_offset + len(kv_cache)
            k, v = kv_cache.update(k, v)
    if w.bias_k is not None or w.zero_attn:
        k, v, mask, causal = _append_keys(w, k, v, mask, causal, query_offset, q.shape[-2])
    o, weights, rows = _attend(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        query_offset=query_offset,
        scale=config.softmax_scale,
        dropout_p=dropout_p,
        need_weights=need_weights,
        guard=guard,
        recipes=recipes,
        rows_out=guard_rows and w.output_params is not None,
    )
    # Nothing past attention reads q~, k~ or v (nor the guard's q~): let them
    # go before the output projection allocates y. In inference they (and the
    # packed projection's output, which v views in self-attention) would
    # otherwise stay allocated beside o and y, the call's peak; in training
    # autograd keeps what it saved either way.
    del q, k, v, guard, fixed
    y = w.output((o.permute(2, 0, 1, 3) if seq_first else o.transpose(1, 2)).flatten(-2))
    if row_guard is not None:
        # y + 0 * a * b: NaN in exactly the rows the per-element guard of
        # ``_guard`` makes NaN in o, since the output projection mixes every
        # head and column of a row (a NaN anywhere in a row of o fills y's row).
        a, b = row_guard
        if rows is not None and rows.nan is not None:
            # A float mask's NaN rows (0 * NaN), in y's layout.
            b = torch.add(b, rows.nan.transpose(0, 1) if seq_first else rows.nan, alpha=0).to(y.dtype)
        y = torch.addcmul(y, a, b, value=0)
    if rows is not None and rows.ok is not None:
        # The rows the mask leaves empty: attention output 0, so y is the
        # output projection of 0 (its bias; NaN if a weight is, as in the
        # reference's 0 * W_o + b_o). A select, whose backward keeps only the
        # small condition: the projection's input stays SDPA's saved output,
        # where zeroing those rows of o would make a copy that it saves too.
        # The rows' gradient is 0 through y, so q, k and v get none from them.
        assert w.output_params is not None  # rows_out
        W_o, b_o = w.output_params
        empty = F.linear(o.new_zeros(1, W_o.shape[1]), W_o, b_o)
        y = torch.where(rows.ok.transpose(0, 1) if seq_first else rows.ok, y, empty)
    return y, weights


def few_tokens_step(
    sizes: tuple[int, int, int, int, float | None],
    x: Tensor,
    in_proj: Tensor,
    in_bias: Tensor | None,
    maps: tuple[tuple[Tensor, Tensor, Tensor] | None, tuple[Tensor, Tensor, Tensor] | None],
    output: Callable[[Tensor], Tensor] | tuple[Tensor, Tensor | None],
    kv_cache: DamchaKVCache | None,
    causal: bool,
    traced: bool = False,
) -> Tensor:
    """``attend_weights`` for a decoding step, written out flat: y (B, N, E_o).

    The call it stands for: self-attention on x (B, N, E) with the packed
    projection, at most ``_FEW_TOKENS`` tokens, no mask, no weights returned,
    no dropout, no autograd, metric "none" or "heads", parameters in x's dtype
    (float32/64), and either an empty cache or a causal rule that hides
    nothing (N = 1) or no causal rule. ``sizes`` is the config's (num_heads,
    num_kv_heads, key_dim, value_dim, scale) (the layer's ``_flat_sizes``).
    ``maps`` holds (weight, bias, gate
    column (S, 1)) of the q side and of the k side (the same tuple when tied;
    None for none). ``output`` is the output projection: a callable (the
    layer's ``out_proj`` module, so its hooks run), or (weight, bias) when
    that module's call is exactly ``F.linear`` with them, which is then
    called directly (no module call: a few microseconds per step).
    ``traced``: the call runs under ``torch.compile`` (the layer's
    ``_traced_few_tokens_step``): no module-level constant tensor and no
    ``storage_offset()`` (it would break the graph), so an eager step asks
    nothing about compilation.

    The math is the general path's; at B = 1 a step's kernels are tiny, so
    what it costs is their number, the tensors made around them and Python:
    - phi's norm is computed once for both sides;
    - q, k and v are read out of the packed projection's output by one
      ``as_strided`` each, straight in SDPA's (B, heads, N, d) layout (or the
      (T, S, d) layout of the head mix), where split/view/transpose took three;
    - tied with one token, q and k are mixed by one batched product;
    - separate, the two sides' phi scaling and gate products are one foreach
      call each (``torch._foreach_addcdiv``/``_foreach_mul``: one dispatch for
      both sides, the same kernels).
    Nothing computed from the parameters is kept between steps (the layer
    keeps only views of its gates, which share their storage): a cache keyed
    on their version would miss writes through ``.data`` (an EMA update, a
    gate set by hand), and the step would silently use stale weights. So the
    generator GEMM stays apart from the projection's (one concatenated weight
    would have to be rebuilt every step, a copy of the whole (3E, E) weight),
    and the gates scale A(x) (S x S per token), not the generator's rows.
    """
    B, N, E = x.shape
    T = B * N
    H, G, d, dv, scale = sizes
    # F.linear's output is contiguous (contiguous() then returns it without a
    # call); the strides below read q, k and v out of that layout.
    qkv = F.linear(x, in_proj, in_bias).contiguous()
    # (Traced: a fresh intermediate's offset is 0, and storage_offset() would break the graph.)
    width, at = qkv.shape[-1], 0 if traced else qkv.storage_offset()
    v = qkv.as_strided((B, G, N, dv), (N * width, dv, width, 1), at + (H + G) * d)
    mq, mk = maps
    fused = None
    if not traced and _HEADMIX is not None and (mq is not None or mk is not None):
        fused = _fused_maps(x, qkv, at, maps, H, G, d)
    if fused is not None:
        q, k = fused
    elif mq is None and mk is None:
        q = qkv.as_strided((B, H, N, d), (N * width, d, width, 1), at)
        k = qkv.as_strided((B, G, N, d), (N * width, d, width, 1), at + H * d)
    else:
        # phi(x) W + b as _coefficients computes it: x W scaled by sqrt(E) / ||x||_eps
        # (F.rms_norm is one aten call but several kernels on CPU: 18 us where
        # vector_norm, hypot and the addcdiv below take 10 at E = 512).
        norm, root = torch.linalg.vector_norm(x, dim=-1, keepdim=True), math.sqrt(E)
        if traced:
            denom = torch.sqrt(norm * norm + E * dc.RMS_EPS)  # no module-level tensor in traced graphs
        else:
            const = _HYPOT_CONSTANTS.get((E, x.dtype))
            if const is None:
                const = _hypot_constant(E, x.dtype)
            denom = torch.hypot(norm, const)
        if mk is mq and T == 1:
            # Tied, one token: q and k are adjacent in qkv, (2, H, d) is a view of
            # it, and one baddbmm maps both with the same (H, H) matrix, which the
            # gate product writes out twice (A read with a zero batch stride). The
            # residual form y + (diag(g) A) y, as on the general path: gates at 0
            # give y bit for bit.
            weight, bias, gate = mq  # type: ignore[misc]
            A = torch.addcdiv(bias, F.linear(x, weight), denom, value=root)
            gA = torch.mul(A.as_strided((2, H, H), (0, H, 1)), gate)
            qk = qkv.as_strided((2, H, d), (H * d, d, 1), at)
            mixed = torch.baddbmm(qk, gA, qk)  # (2, H, d): q~ then k~, read as (B, H, N, d) = (1, H, 1, d)
            q = mixed.as_strided((1, H, 1, d), (H * d, d, d, 1), 0)
            k = mixed.as_strided((1, H, 1, d), (H * d, d, d, 1), H * d)
        else:
            gA_q = gA_k = None
            # x W of T > 1 tokens on CPU adds a constant zero bias: MKL runs a
            # bias-free GEMM of a few rows (beta = 0) in two OpenMP parallel
            # regions and one with a bias in one, and at 2 threads each region
            # of such a tiny op costs more than the op. The (T, S*S) copy of
            # the zeros is all it adds, with no op more: b and the phi scaling
            # stay in the addcdiv after (a true bias there would need phi(x),
            # a (T, E) pass and more ops; tests/test_torch_fastpath.py). One
            # token's x W is not serial either (an M = 1 SGEMM, which at 2
            # threads also runs under libgomp, as the projections' do), but
            # there the zero bias only adds work: 35.1K instructions per call
            # against 28.8K bias-free (callgrind, one thread, E = 512, S = 8).
            zq = zk = None
            if T > 1 and not traced and x.is_cpu:
                zq = None if mq is None else _zero_bias(mq[0].shape[0], x)
                zk = zq if mk is mq else (None if mk is None else _zero_bias(mk[0].shape[0], x))
            if mq is not None and mk is not None and mk is not mq:
                # Separate coupling: both sides' phi scaling in one call and both
                # gate products in another (foreach ops: one dispatch for the two).
                (w_q, b_q, g_q), (w_k, b_k, g_k) = mq, mk
                A_q, A_k = torch._foreach_addcdiv(
                    [b_q, b_k], [F.linear(x, w_q, zq), F.linear(x, w_k, zk)], [denom, denom], root
                )
                gA_q, gA_k = torch._foreach_mul([A_q.view(T, H, H), A_k.view(T, G, G)], [g_q, g_k])
            elif mq is not None:
                weight, bias, gate = mq
                gA_q = torch.addcdiv(bias, F.linear(x, weight, zq), denom, value=root).view(T, H, H) * gate
                gA_k = gA_q if mk is mq else None
            elif mk is not None:
                weight, bias, gate = mk
                gA_k = torch.addcdiv(bias, F.linear(x, weight, zk), denom, value=root).view(T, G, G) * gate
            if gA_q is not None:
                flat = qkv.as_strided((T, H, d), (width, d, 1), at)
                q = torch.baddbmm(flat, gA_q, flat)
                q = q.view(B, H, 1, d) if N == 1 else q.view(B, N, H, d).transpose(1, 2)
            else:
                q = qkv.as_strided((B, H, N, d), (N * width, d, width, 1), at)
            if gA_k is not None:
                flat = qkv.as_strided((T, G, d), (width, d, 1), at + H * d)
                k = torch.baddbmm(flat, gA_k, flat)
                k = k.view(B, G, 1, d) if N == 1 else k.view(B, N, G, d).transpose(1, 2)
            else:
                k = qkv.as_strided((B, G, N, d), (N * width, d, width, 1), at + H * d)
    # The NaN guard (see _guard), written out: with G = H and d = d_v each query
    # reads its own token's key; otherwise one max |k| per batch row (and with
    # d != d_v the sum of each query head, one number per head).
    if G == H and d == dv:
        a, b = q, k
    else:
        a = q if d == dv else q.sum(dim=-1, keepdim=True)
        b = torch.linalg.vector_norm(k, ord=math.inf, dim=(1, 2, 3), keepdim=True)
    if kv_cache is not None:
        k, v = kv_cache._extend(k, v)
    o = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None,
        dropout_p=0.0,
        # The rule hides something only for N > 1 (the flat path takes a causal
        # chunk only on an empty cache; one token sees every cached key).
        is_causal=causal and N > 1,
        # None is SDPA's own 1/sqrt(d), the same double as config.softmax_scale.
        scale=scale,
        enable_gqa=G != H,
    )
    # Added into SDPA's own output (nothing else holds it, and no autograd
    # records this path): no second (B, H, N, d_v) tensor.
    o.addcmul_(a, b, value=0)
    # (B, H, 1, d_v) -> (B, 1, H * d_v) is a view for SDPA's output layouts; reshape copies otherwise.
    o = o.reshape(B, 1, H * dv) if N == 1 else o.transpose(1, 2).reshape(B, N, H * dv)
    if type(output) is tuple:
        return F.linear(o, output[0], output[1])
    return output(o)  # type: ignore[operator]  # the callable form


# What the C kernel may read by pointer (here and in _models_fused._kernel_map_):
# plain tensors (a subclass, DTensor say, may have no storage), strided.
_PLAIN = (Tensor, nn.Parameter)
_STRIDED = torch.strided


def has_decode_kernel() -> bool:
    """Whether this install has the C kernel that maps a CPU decoding step's
    tokens in one call (``damcha_torch._headmix``, built by ``pip install``
    where a C compiler is found; docs/torch.md, "Incremental decoding"). Without it the
    same step runs as torch ops: the same outputs, about 40 us more per
    layer and token at B = 1 (docs/benchmarks.md)."""
    return _HEADMIX is not None


def _fused_maps(
    x: Tensor,
    qkv: Tensor,
    at: Any,
    maps: tuple[tuple[Tensor, Tensor, Tensor] | None, tuple[Tensor, Tensor, Tensor] | None],
    H: int,
    G: int,
    d: int,
) -> tuple[Tensor, Tensor] | None:
    """q~ and k~ (B, H, N, d) and (B, G, N, d) of ``few_tokens_step`` by the C
    kernel (``_headmix.map``: phi's norm, the generator GEMV, the scaling, the
    gate and the head mix of each token in one call), or None where it does
    not apply: a tensor off the CPU or not a plain strided one, x whose tokens
    are not rows of one stride (B, N, E) -> (T, E), a dtype other than
    float32/64, parameters not contiguous, of another dtype or size. The
    caller has checked the rest (no autograd, not traced).

    Tied, both sides come out of one call (the same A maps q and k, adjacent
    in ``qkv``); separate, one call per side; a side without a map is read out
    of ``qkv`` as on the torch path.
    """
    if not x.is_cpu or x.layout is not _STRIDED or qkv.__class__ is not Tensor:
        return None
    B, N, E = x.shape
    sb, sn, se = x.stride()
    if (se != 1 and E > 1) or B * N == 0:
        return None  # (no tokens: nothing to map, and the kernel takes T >= 1)
    if N == 1:
        row = sb
    elif B == 1 or sb == N * sn:
        row = sn
    else:
        return None
    mq, mk = maps
    dtype = x.dtype
    if (
        (dtype is not torch.float32 and dtype is not torch.float64)
        or qkv.dtype is not dtype  # (contiguous: few_tokens_step made it so)
        or qkv.shape[-1] < (H + G) * d  # q's and k's blocks lie in each row (v's follow)
        or (mk is mq and G != H)  # tied: both sides' S heads from one A
    ):
        return None  # what the layer's checks imply today, kept here because the kernel trusts it
    # Each side's (weight, bias, gate column) as the kernel reads them: CPU,
    # x's dtype, contiguous, sized for its S heads and E features (the kernel
    # trusts its pointers: this keeps it in bounds). Inline, not a helper: a
    # Python frame per step costs as much as a check (tests/test_torch_ops.py).
    for side, S in ((mq, H), (None if mk is mq else mk, G)):
        if side is not None and not (
            # Plain tensors (a subclass, DTensor say, may have no storage) in CPU memory.
            side[0].__class__ in _PLAIN
            and side[1].__class__ in _PLAIN
            and side[2].__class__ in _PLAIN
            and side[0].is_cpu
            and side[1].is_cpu
            and side[2].is_cpu
            and side[0].layout is _STRIDED
            and side[1].layout is _STRIDED
            and side[2].layout is _STRIDED
            and side[0].dtype is dtype
            and side[1].dtype is dtype
            and side[2].dtype is dtype
            and side[0].is_contiguous()
            and side[1].is_contiguous()
            and side[2].is_contiguous()
            and side[0].shape == (S * S, E)
            and side[1].shape == (S * S,)
            and side[2].shape == (S, 1)
        ):
            return None
    T, width, double = B * N, qkv.shape[-1], dtype is torch.float64
    xp, yp, item = x.data_ptr(), qkv.data_ptr(), 8 if double else 4
    # (side, S, the side's blocks in qkv, blocks per call, element offset in out)
    calls: list[tuple[Any, int, int, int, int]]
    if mk is mq:  # tied (G = H): one A per token maps q and k, adjacent in qkv
        out = torch.empty((T, 2, H, d), dtype=dtype, device=x.device)
        calls = [(mq, H, yp, 2, 0)]
    else:
        out = torch.empty(
            T * ((H if mq is not None else 0) + (G if mk is not None else 0)) * d, dtype=dtype, device=x.device
        )
        calls = [] if mq is None else [(mq, H, yp, 1, 0)]
        if mk is not None:
            calls.append((mk, G, yp + H * d * item, 1, 0 if mq is None else T * H * d))
    base = out.data_ptr()
    for (w, b, g), S, y_at, blocks, offset in calls:  # a loop, not a helper: no Python frame per call
        _HEADMIX.map(
            double,
            T,
            E,
            S,
            d,
            xp,
            row,
            w.data_ptr(),
            b.data_ptr(),
            g.data_ptr(),
            y_at,
            width,
            blocks,
            base + offset * item,
            0,  # out holds (T, blocks, S, d) at each offset
            dc.RMS_EPS,
            d,  # y's heads consecutive
            S * d,  # and its blocks (q's then k's, tied)
        )
    if mk is mq:
        strides = (N * 2 * H * d, d, 2 * H * d, 1)
        return out.as_strided((B, H, N, d), strides, 0), out.as_strided((B, H, N, d), strides, H * d)
    if mq is None:
        q = qkv.as_strided((B, H, N, d), (N * width, d, width, 1), at)
    else:
        q = out.as_strided((B, H, N, d), (N * H * d, d, H * d, 1), 0)
    if mk is None:
        k = qkv.as_strided((B, G, N, d), (N * width, d, width, 1), at + H * d)
    else:
        k = out.as_strided((B, G, N, d), (N * G * d, d, G * d, 1), calls[-1][4])
    return q, k


def _append_keys(
    w: LayerWeights, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, query_offset: int, n: int
) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """nn.MultiheadAttention's add_bias_kv and add_zero_attn: the learned bias
    key/value, then a zero key/value, appended after the M real keys (in the
    cache's layout (B, G, M, d), so they are never cached), visible to every
    query. The causal rule becomes an explicit mask over the real keys."""
    B, G, m = k.shape[0], k.shape[1], k.shape[2]
    keys, values = [k], [v]
    if w.bias_k is not None and w.bias_v is not None:
        keys.append(w.bias_k.view(1, G, 1, -1).expand(B, G, 1, -1).to(k.dtype))
        values.append(w.bias_v.view(1, G, 1, -1).expand(B, G, 1, -1).to(v.dtype))
    if w.zero_attn:
        keys.append(k.new_zeros(B, G, 1, k.shape[-1]))
        values.append(v.new_zeros(B, G, 1, v.shape[-1]))
    extra = len(keys) - 1
    if causal:
        mask = _combine(mask, causal_visibility(n, m, query_offset, k.device))
        causal = False
    if mask is not None:
        # Visible columns for the appended keys: True, or 0 in an additive mask.
        mask = F.pad(mask, (0, extra), value=True if mask.dtype == torch.bool else 0.0)
    return torch.cat(keys, dim=2), torch.cat(values, dim=2), mask, causal


def _check_bool(name: str, value: Any) -> bool:
    """The layer's rule (dc.check_bool: a bool or a NumPy bool, never a tensor or
    an int), with an identity test first so a Python bool costs one comparison."""
    if value.__class__ is bool:
        return value
    return dc.check_bool(name, value)


def _check_float(name: str, value: Any) -> Tensor:
    if not isinstance(value, Tensor) or not value.is_floating_point() or value.is_complex():
        raise dc.float_dtype_error(name, value)
    return value


def _check_params(params: Any, config: Any) -> DamchaConfig:
    """Names, shapes and dtypes (damcha_core's rules), never values: a forward
    pass must not read parameters (it would sync a device and break tracing)."""
    dc.check_config(config)
    dc.check_params(params, config)
    for name, t in params.items():
        if not isinstance(t, Tensor):
            raise DamchaTypeError(
                dc.invalid_argument(f"params[{name!r}]", "a torch tensor", f"params[{name!r}]={describe(t)}")
            )
    return config


def _check_mask(mask: Any, config: DamchaConfig, B: int, N: int, M: int) -> Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise dc.mask_dtype_error(mask, expected="boolean (True = may attend) or floating (additive, -inf = hidden)")
    Ekv, Ev = config_sizes(config)[:2]
    dc.check_shapes(config, (B, N, config.query_dim), (B, M, Ekv), tuple(mask.shape), value_shape=(B, M, Ev))
    check_mask_values("mask", mask)
    return mask


_KEYWORDS = ("mask", "causal", "query_offset", "kv_cache", "dropout_p", "return_weights", "return_metric", "recompute")


def damcha_attention(
    params: Mapping[str, Tensor] | Tensor,
    config: DamchaConfig | Any = None,
    query: Tensor | Any = None,
    context: Tensor | None = None,
    value: Tensor | None = None,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    query_offset: int = 0,
    kv_cache: DamchaKVCache | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    return_metric: bool = False,
    recompute: bool = False,
    **deprecated: Any,
) -> Any:
    """DAMCHA v1 forward pass in torch, the reference's ``damcha_attention``.

    Args:
        params: canonical parameters as torch tensors (see
            ``config.param_shapes()``): any views, e.g. of a layer's own
            parameters (gradients flow to them).
        config: the layer's ``damcha_core.DamchaConfig``.
        query: x (B, N, E_q).
        context: c (B, M, E_kv); ``None`` for self-attention (c = x).
        value: value tokens (B, M, E_v) (``config.value_input_dim``); default
            ``context`` (the query with ``context=None``, whose keys it then pairs with).
        mask: bool, True = may attend (the reference's convention), or an
            additive float mask (-inf hides); shape (N, M) or (B, H, N, M) with
            size-1 dims allowed. With ``kv_cache``, M counts the cached keys.
        causal: hide key j from query i when j > i + query_offset.
        query_offset: position of query 0 for the causal rule (P when P keys
            were seen before these queries); with ``kv_cache`` it is added to
            the cache length.
        kv_cache: a ``DamchaKVCache``: this call's k~ and v are appended and
            the queries attend over the whole cache.
        dropout_p: attention-probability dropout (pass 0.0 outside training).
        return_weights: also return the probabilities (B, H, N, M) (explicit
            path); otherwise one fused SDPA call.

    Inputs and params of different float dtypes compute in their promoted
    dtype (``torch.promote_types``; float64 params with a float32 query give
    a float64 result), as the JAX functional does; the layer instead requires
    its inputs in its parameters' dtype, as nn.MultiheadAttention does.
        return_metric: also return the per-token map factors ``{"q": ..., "k": ...}``
            as the reference does.
        recompute: recompute q~ and k~ in backward (``torch.utils.checkpoint``)
            instead of storing them.

    Returns:
        y (B, N, E_o) alone, or ``(y, weights?, metric?)`` with the asked-for
        extras in that order. A query with no visible key gets attention
        output 0, so y = output.bias there.

    The old form ``damcha_attention(q, k, v, *, q_tokens=..., q_generator=...)``
    on projected heads still works for one release, with a DeprecationWarning.
    """
    if isinstance(params, Tensor):
        return _heads_attention(
            params, config, query, mask=mask, query_offset=query_offset, dropout_p=dropout_p, **deprecated
        )
    if deprecated:
        # A typo, or the deprecated projected-heads form's keywords (q_tokens, ...) with params.
        raise DamchaTypeError(
            unknown_fields(
                sorted(deprecated),
                _KEYWORDS,
                "keyword arguments of damcha_attention(params, config, query, context, value, ...)",
                "keyword argument",
            )
        )
    config = _check_params(params, config)
    x = _check_float("query", query)
    c = None if context is None else _check_float("context", context)
    # With context None, as in the reference: keys from the query, values from ``value``.
    vt = None if value is None else _check_float("value", value)
    B, N, M = dc.check_shapes(
        config,
        tuple(x.shape),
        None if c is None else tuple(c.shape),
        value_shape=None if vt is None else tuple(vt.shape),
    )
    causal = _check_bool("causal", causal)
    return_weights = _check_bool("return_weights", return_weights)
    return_metric = _check_bool("return_metric", return_metric)
    recompute = _check_bool("recompute", recompute)
    dc.check_offset("query_offset", query_offset)
    dc.check_rate("dropout_p", dropout_p)
    if kv_cache is not None:
        from ._cache import DamchaKVCache

        if not isinstance(kv_cache, DamchaKVCache):
            raise DamchaTypeError(
                dc.invalid_argument("kv_cache", "a DamchaKVCache or None", f"kv_cache={describe(kv_cache)}")
            )
    mask = _check_mask(mask, config, B, N, M + (0 if kv_cache is None or mask is None else len(kv_cache)))
    params, (promoted, c, vt) = _promote(params, x, c, vt)
    assert promoted is not None  # (the query is always there)
    x = promoted
    w = weights_from_canonical(params, config)
    y, weights = attend_weights(
        w,
        config,
        x,
        c,
        vt,
        mask=mask,
        causal=causal,
        query_offset=int(query_offset),
        kv_cache=kv_cache,
        dropout_p=float(dropout_p),
        need_weights=return_weights,
        recompute=recompute,
    )
    extras: list[Any] = []
    if return_weights:
        extras.append(weights)
    if return_metric:
        extras.append(_metric_factors(w, config, x, x if c is None else c))
    return (y, *extras) if extras else y


def _promote(params: Mapping[str, Tensor], *tokens: Tensor | None) -> tuple[dict[str, Tensor], list[Tensor | None]]:
    """Params and tokens in one computation dtype: torch's promotion of all of
    them (as the JAX functional and Flax do), e.g. float64 params from
    ``damcha_core.init_params`` with a float32 query compute in float64.
    Under autocast the GEMMs cast on their own; nothing is cast here then."""
    present = [t for t in tokens if t is not None]
    device = present[0].device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return dict(params), list(tokens)
    dtype = present[0].dtype
    for t in [*present[1:], *params.values()]:
        dtype = torch.promote_types(dtype, t.dtype)
    return ({n: _cast(t, dtype) for n, t in params.items()}, [None if t is None else _cast(t, dtype) for t in tokens])


def _metric_factors(w: LayerWeights, config: DamchaConfig, x: Tensor, c: Tensor) -> dict[str, Tensor]:
    """l(t) (B, T, S, S) for "heads", the dense L(t) (B, T, S, d, S, d) for "lowrank"."""
    out = {}
    for role, tokens in (("q", x), ("k", c)):
        side = dc.side_of(config, role)
        if side is None:
            continue
        sw = w.sides[side]
        structure = dc.METRIC_STRUCTURES[sw.metric]
        if structure.compact_head_map:
            out[role] = head_map_weights(sw, tokens)
            continue
        S, d = sw.gate.shape[0], config.key_dim
        coeff = _coefficients(_cast(sw.weight, tokens.dtype), _cast(sw.bias, tokens.dtype), tokens)
        leaves = _canonical_leaves(sw, tokens.dtype)
        delta = structure.dense_delta(torch, coeff, leaves, d)
        identity = torch.eye(S * d, dtype=delta.dtype, device=delta.device).reshape(S, d, S, d)
        out[role] = identity + leaves["gate"].view(S, 1, 1, 1) * delta
    return out


def _check_side(params: Any, config: Any, side: Any, tokens: Any, y: Any = None) -> Tensor:
    """The arguments of ``generator``/``apply_map``: the side's leaves (names,
    shapes, dtypes), tokens (B, T, E_side) and heads y (B, T, S, d)."""
    dc.check_config(config)
    if side not in config.metric_sides:
        raise DamchaValueError(
            dc.invalid_argument("side", f"one of config.metric_sides={config.metric_sides}", f"side={describe(side)}")
        )
    if not isinstance(params, Mapping):
        raise DamchaTypeError(
            dc.invalid_argument("params", "a mapping of canonical names to tensors", f"params={describe(params)}")
        )
    for name, shape in config.param_shapes().items():
        if not name.startswith(f"metric.{side}."):
            continue
        if name not in params:
            raise DamchaValueError(
                dc.invalid_argument("params", f"the tensor {name!r} for side {side!r}", f"params={describe(params)}")
            )
        t = params[name]
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise DamchaTypeError(
                dc.invalid_argument(
                    f"params[{name!r}]", "a real floating torch tensor", f"params[{name!r}]={describe(t)}"
                )
            )
        if tuple(t.shape) != shape:
            raise DamchaValueError(
                dc.invalid_argument(
                    f"params[{name!r}]", f"shape {shape} for this config", f"params[{name!r}].shape={tuple(t.shape)}"
                )
            )
    tokens = _check_float("tokens", tokens)
    E = config.side_features(side)
    if tokens.dim() != 3 or tokens.shape[-1] != E:
        raise DamchaValueError(
            dc.invalid_argument("tokens", f"shape (B, T, {E}) for side {side!r}", f"tokens.shape={tuple(tokens.shape)}")
        )
    if y is not None:
        y = _check_float("y", y)
        S, d = config.side_heads(side), config.key_dim
        if tuple(y.shape) != (*tokens.shape[:2], S, d):
            raise DamchaValueError(
                dc.invalid_argument(
                    "y",
                    f"the stacked heads (B, T, S, d) = {(*tuple(tokens.shape[:2]), S, d)} of the tokens",
                    f"y.shape={tuple(y.shape)}, tokens.shape={tuple(tokens.shape)}",
                )
            )
    return tokens


def generator(params: Mapping[str, Tensor], config: DamchaConfig, side: str, tokens: Tensor) -> Tensor:
    """The data-adaptive coefficients of ``side`` for tokens (B, T, E):
    A(t) (B, T, S, S) for metric "heads", u(t) (B, T, r) for "lowrank"."""
    tokens = _check_side(params, config, side, tokens)
    sw = _side_from_canonical(params, config, side)
    coeff = _coefficients(_cast(sw.weight, tokens.dtype), _cast(sw.bias, tokens.dtype), tokens)
    if config.metric == "heads":
        S = config.side_heads(side)
        return coeff.unflatten(-1, (S, S))
    return coeff


def apply_map(
    params: Mapping[str, Tensor], config: DamchaConfig, side: str, tokens: Tensor, y: Tensor, *more: Tensor
) -> Tensor | tuple[Tensor, ...]:
    """L(t) y for tokens (B, T, E) and their stacked heads y (B, T, S, d), without forming L.

    Extra head tensors in ``more`` reuse the same coefficients (a tuple is
    returned then). 16-bit heads are mapped in float32 and cast back.
    """
    tokens = _check_side(params, config, side, tokens, y)
    for extra in more:
        _check_side(params, config, side, tokens, extra)
    out = apply_map_weights(_side_from_canonical(params, config, side), tokens, (y, *more))
    return out if more else out[0]


def metric_penalty(
    params: Mapping[str, Tensor], config: DamchaConfig, query: Tensor, context: Tensor | None = None
) -> Tensor:
    """Mean over adapted roles of mean_t ||L(t) - I||_F^2 / (S*d), as the reference.

    A 0-d tensor (0 for metric "none"), differentiable, for the training loss.
    """
    config = _check_params(params, config)
    x = _check_float("query", query)
    c = x if context is None else _check_float("context", context)
    params, (px, pc) = _promote(params, x, c)
    assert px is not None and pc is not None  # _promote returns a tensor for each tensor given
    x, c = px, pc
    # The values play no part in the penalty.
    dc.check_shapes(
        config,
        tuple(x.shape),
        None if context is None else tuple(c.shape),
        value_shape=(*c.shape[:2], config_sizes(config)[1]),
    )
    return penalty_weights(weights_from_canonical(params, config), config, x, c)


def penalty_weights(w: LayerWeights, config: DamchaConfig, x: Tensor, c: Tensor) -> Tensor:
    """``metric_penalty`` on validated inputs (the layer's method ends here)."""
    terms = []
    for role, tokens in (("q", x), ("k", c)):
        side = dc.side_of(config, role)
        if side is not None:
            terms.append(role_penalty_weights(w.sides[side], tokens, config.key_dim))
    if not terms:
        return x.new_zeros(())
    return torch.stack(terms).mean()


# ------------------------------------------------------------- deprecated


def _heads_attention(
    q: Tensor,
    k: Any,
    v: Any,
    *,
    q_tokens: Tensor | None = None,
    k_tokens: Tensor | None = None,
    q_generator: Any = None,
    k_generator: Any = None,
    q_gate: Tensor | None = None,
    k_gate: Tensor | None = None,
    mask: Tensor | None = None,
    is_causal: bool = False,
    query_offset: int = 0,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The 0.1 ``damcha_attention(q, k, v, ...)`` on projected heads (deprecated)."""
    warnings.warn(
        "damcha_attention(q, k, v, q_tokens=..., q_generator=...) on projected heads is deprecated; use "
        "damcha_attention(params, config, query, context, ...) as in damcha_core, or the steps apply_map "
        "and softmax_attend.",
        DeprecationWarning,
        stacklevel=3,
    )
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_float(name, t)
        if t.dim() != 4:
            raise DamchaValueError(
                dc.invalid_argument(name, "rank 4, (batch, length, heads, head_dim)", f"{name}.shape={tuple(t.shape)}")
            )
    (B, N, H, d), (Bk, M, G, dk) = q.shape, k.shape
    if Bk != B or dk != d or H % G or v.shape[:3] != k.shape[:3]:
        raise DamchaValueError(
            dc.invalid_argument(
                "k" if Bk != B or dk != d or H % G else "v",
                "`q`, `k`, `v` of shapes (B, N, H, d), (B, M, G, d), (B, M, G, d_v) with G dividing H",
                f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}",
            )
        )
    if mask is not None:
        if not isinstance(mask, Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
            raise dc.mask_dtype_error(mask, expected="boolean (True = may attend) or floating (added to the scores)")
        if mask.dim() not in (2, 4) or any(s not in (1, t) for s, t in zip(mask.shape[::-1], (B, H, N, M)[::-1])):
            raise DamchaValueError(
                dc.invalid_argument(
                    "mask",
                    f"shape (N, M) or (B, H, N, M) with size-1 dims allowed, broadcastable to {(B, H, N, M)}",
                    f"mask.shape={tuple(mask.shape)}",
                )
            )
    for role, gen, gate, tokens in (("q", q_generator, q_gate, q_tokens), ("k", k_generator, k_gate, k_tokens)):
        if gen is None:
            continue
        if tokens is None or gate is None:
            missing = f"{role}_tokens" if tokens is None else f"{role}_gate"
            raise DamchaValueError(
                dc.invalid_argument(
                    missing,
                    f"a tensor with `{role}_generator` (it needs `{role}_tokens` and `{role}_gate`)",
                    f"{role}_tokens={describe(tokens)}, {role}_gate={describe(gate)}",
                )
            )
        if role == "q":
            q = gen(tokens, q, gate)
        else:
            k = gen(tokens, k, gate)
    o, weights = softmax_attend(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask=mask,
        causal=is_causal,
        query_offset=query_offset,
        scale=scale,
        dropout_p=dropout_p,
        need_weights=need_weights,
    )
    return o.transpose(1, 2), weights


def param_entry(module: nn.Module, name: str) -> Any:
    """``module``'s parameter ``name``: its registry entry (one dict read, the
    common case), else the attribute. For a module the layer calls (the layer
    itself, ``out_proj``): parametrizations (weight_norm, spectral_norm,
    torch.nn.utils.parametrize) remove the entry and compute the effective
    tensor as the attribute, and the hook-based tools (pruning, the old
    torch.nn.utils.weight_norm/spectral_norm) set the attribute in a forward
    pre-hook of the module, run by its call. See ``tool_entry`` for modules
    the layer reads but never calls."""
    p = module._parameters
    return p[name] if name in p else getattr(module, name)


def tool_entry(module: nn.Module, name: str, *, power_iteration: bool | None = None) -> Any:
    """``module``'s tensor ``name`` as a call of ``module`` would make it, for a
    module the layer reads but never calls (the gates' ParameterDict, a
    MetricGenerator) and for canonical reads (the values the next forward
    uses). The registry entry; else a hook-based tool's tensor made here, as
    its forward pre-hook would make it on a call, which never comes: pruning's
    ``orig * mask``, the old weight_norm's ``g v / |v|``, the old
    spectral_norm's ``W / sigma`` (with its power iteration when
    ``power_iteration``, by default in training, as its hook); else the
    attribute (parametrizations compute it on access). The attribute of a
    hook-based tool holds the value as of the tool's last hook run."""
    p = module._parameters
    if name in p:
        return p[name]
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, _BasePruningMethod) and hook._tensor_name == name:
            return hook.apply_mask(module)
        if isinstance(hook, _WeightNorm) and hook.name == name:
            return hook.compute_weight(module)
        if isinstance(hook, _SpectralNorm) and hook.name == name:
            iterate = module.training if power_iteration is None else power_iteration
            return hook.compute_weight(module, do_power_iteration=iterate)
    return getattr(module, name)


def no_hooks(*modules: nn.Module) -> bool:
    """No forward hook or instance-level forward on ``modules``, and no global
    forward hook: a caller may compute what their calls compute without
    calling them."""
    from torch.nn.modules import module as _module

    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in modules)


def traced_call(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """``module``'s call as one ``call_module`` node when torch.fx traces it
    symbolically (an argument is an ``fx.Proxy``) inside a model, else None.

    torch.fx's tracers record torch.nn's own modules (nn.MultiheadAttention, the
    Transformer layers and stacks) as leaves: one node, never traced into.
    DAMCHA's modules live outside torch.nn, so a tracer would trace their
    forward, whose shape and mask checks no Proxy can pass, and the fx tools a
    model with MHA works with (torchvision's ``create_feature_extractor``, FX
    graph-mode quantization) would fail after ``replace_mha``. Recording the
    call the way torch.nn's modules are recorded keeps them working; the graph
    calls the module, so its hooks and checks run when the graph runs.
    """
    proxy = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.fx.Proxy)), None)
    if proxy is None:
        return None
    tracer = proxy.tracer
    if not isinstance(tracer, torch.fx.Tracer):
        return None  # proxies of a graph built by hand (fx.Proxy(node)): no module tree to record in
    path = tracer.path_of_module(module)
    if not path:
        # The module is the traced root: a node calling the root would call
        # itself. Its forward is traced, as torch.nn's roots are (and fails
        # as theirs do).
        return None
    for name, value in kwargs.items():
        if value is not None and not isinstance(value, (Tensor, torch.fx.Proxy, bool, int, float)):
            # A tracer holds tensors, proxies and plain values as a node's
            # arguments; an object such as a DamchaKVCache it refuses with
            # "argument of type ..." and no name.
            raise DamchaTypeError(
                dc.invalid_argument(
                    name,
                    "None, a tensor or a plain value while torch.fx traces the module",
                    f"{name}={describe(value)}",
                )
            )
    return tracer.create_proxy("call_module", path, tuple(args), dict(kwargs))
