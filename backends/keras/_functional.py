"""The DAMCHA math in ``keras.ops``: free functions named after the reference's steps.

Each function here computes one step of ``damcha_core`` (same name), on any
Keras backend, without variables or layers: ``rms_normalise`` (phi),
``generator`` (A(t) or u(t)), ``apply_map`` (L(t) y), ``visibility`` (the
boolean may-attend mask), ``softmax_attend`` (the masked softmax with the
all-masked-row rule), ``attend`` (attention on the mapped heads, fused or
explicit), ``metric_penalty`` and ``damcha_attention`` (the whole forward from
canonical tensors); ``Layout`` folds inputs of rank > 3 (MHA's
``attention_axes``) into tokens. ``DamchaAttention`` calls them with its
sublayers' outputs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

import damcha_core as dc
import keras
from damcha_core import RMS_EPS, DamchaConfig
from keras import ops


def _einsum(subscripts: str, *operands: Any) -> Any:
    """``ops.einsum``, but TensorFlow's own where an operand has a size-0 dim:
    Keras's TensorFlow einsum reshapes with an inferred (-1) dim, ambiguous at
    size 0, and returns (1, 0, ...) for an empty batch of no query (the next
    einsum then fails). A static check: it costs nothing once traced."""
    if keras.backend.backend() == "tensorflow" and any(0 in tuple(x.shape) for x in operands):
        import tensorflow as tf

        return tf.einsum(subscripts, *operands)
    return ops.einsum(subscripts, *operands)


def dtype_name(x: Any) -> str:
    return keras.backend.standardize_dtype(x.dtype)


def _wide(dtype: str) -> str:
    """At least float32: 16-bit statistics and softmaxes lose too much."""
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def rms_normalise(tokens: Any) -> Any:
    """phi(t) = t / sqrt(mean(t^2 over features) + 1e-6), in at least float32.

    16-bit compute dtypes would overflow t^2 for |t| > 256 (float16) and round
    the mean coarsely, so the statistic is taken in float32 and cast back.
    ``keras.ops.rms_normalization`` (Keras >= 3.9) computes exactly this in
    one call (in at least float32, torch's fused ``rms_norm`` on that backend).
    """
    dtype = dtype_name(tokens)
    # float64 stays on the formula: Keras 3.15's torch rms_normalization runs it in
    # float32 (its result_type misreads torch dtypes).
    if _RMS_OP is not None and dtype != "float64" and not _onnx_export():
        return _RMS_OP(tokens, axis=-1, epsilon=RMS_EPS)
    wide = ops.cast(tokens, "float32") if dtype != _wide(dtype) else tokens
    # sum / E rather than ops.mean: Keras 3.15's torch mean runs float64 in float32.
    mean_square = ops.sum(ops.square(wide), axis=-1, keepdims=True) / tokens.shape[-1]
    return ops.cast(wide * ops.rsqrt(mean_square + RMS_EPS), dtype)


_RMS_OP = getattr(ops, "rms_normalization", None)


def _onnx_export() -> bool:
    """Whether torch.onnx is tracing (Keras's ``model.export(format="onnx")``):
    its exporter has no ``aten::rms_norm`` at the opsets it targets."""
    if keras.backend.backend() != "torch":
        return False
    import torch

    return torch.onnx.is_in_onnx_export()


def _as(x: Any, dtype: str) -> Any:
    """x in ``dtype``, without a cast call when it already is (each call costs
    a dispatch in eager mode)."""
    return x if dtype_name(x) == dtype else ops.cast(x, dtype)


def _eye(size: int, dtype: str) -> Any:
    """The identity (S, S) in ``dtype``: a NumPy constant (no op) where NumPy has the dtype."""
    if dtype == "bfloat16":
        return ops.convert_to_tensor(np.eye(size, dtype="float32"), dtype=dtype)
    return _EYES.setdefault((size, dtype), np.eye(size, dtype=dtype))


_EYES: dict[tuple[int, str], np.ndarray] = {}


def generator(metric: str, kernel: Any, bias: Any, tokens: Any) -> Any:
    """The data-adaptive coefficients of tokens (B, T, E): A(t) = phi(t)·W + b
    (B, T, S, S) for metric "heads", u(t) (B, T, r) for "lowrank"."""
    phi = rms_normalise(tokens)
    if metric == "heads":
        return _einsum("bte,ehk->bthk", phi, kernel) + bias
    # einsum, not matmul: Keras 3.15's torch matmul returns float32 for float64.
    return _einsum("bte,er->btr", phi, kernel) + bias


def apply_map(y: Any, coeff: Any, gate: Any, *, metric: str, u: Any = None, v: Any = None) -> Any:
    """L(t) y for stacked heads y (B, T, S, d), without forming L:
    ``y^h + g_h * sum_a A[h, a] y^a`` ("heads") or
    ``y + g * U diag(u(t)) V^T y`` ("lowrank"), in y's dtype."""
    dtype = dtype_name(y)
    coeff, gate = ops.cast(coeff, dtype), ops.cast(gate, dtype)
    if metric == "heads":
        delta = _einsum("btha,btad->bthd", coeff, y)
    else:
        z = _einsum("btad,adr->btr", y, ops.cast(v, dtype))
        delta = _einsum("hdr,btr->bthd", ops.cast(u, dtype), coeff * z)
    return y + gate[:, None] * delta


def map_matrix(tokens: Any, kernel: Any, bias: Any, gate: Any) -> Any:
    """The generator and the gate in one step, for metric "heads": the
    per-token head matrix of L(t), I + diag(g) A(t) (B, T, S, S), with
    A(t) = phi(t)·W + b (``generator``). ``apply_map_matrix`` applies it; a
    tied self-attention maps its queries and keys with one matrix.

    Written for few and small ``keras.ops`` calls (each eager call costs a
    dispatch, each pass over the (B, T, E) tokens costs memory traffic):
    phi(t) W = sqrt(E) (t W) / sqrt(sum(t^2) + E eps), so phi is never
    formed: one GEMM on the raw tokens (which the projections read anyway),
    a (B, T, 1) statistic, and the gate, identity, bias and sqrt(E) folded
    into the (E, S, S) weights and an (S, S) constant, so that only the small
    (B, T, S, S) product gets a scale and an offset. 16-bit tokens keep phi
    (its statistic in float32, ``rms_normalise``): t W could overflow there.
    """
    dtype = dtype_name(tokens)
    S = gate.shape[0]
    if dtype == _wide(dtype) and keras.backend.backend() == "torch":
        return _torch_map_matrix(tokens, kernel, bias, gate, dtype)
    kernel, bias, gate = _as(kernel, dtype), _as(bias, dtype), ops.reshape(_as(gate, dtype), (S, 1))
    if dtype != _wide(dtype):
        coeff = _einsum("bte,ehk->bthk", rms_normalise(tokens), kernel) + bias
        return ops.add(coeff * gate, _eye(S, dtype))
    E = tokens.shape[-1]
    weights, offset = _folded_map_weights(kernel, bias, gate, E, dtype)
    if keras.backend.backend() == "jax":
        return _flat_map_matrix(tokens, weights, offset)
    inv_norm = ops.rsqrt(_sum_squares(tokens) + E * RMS_EPS)  # (B, T, 1)
    return _einsum("bte,ehk->bthk", tokens, weights) * ops.expand_dims(inv_norm, -1) + offset


def _folded_map_weights(kernel: Any, bias: Any, gate: Any, E: int, dtype: str) -> tuple[Any, Any]:
    """``map_matrix``'s weights diag(g) W sqrt(E) (E, S, S) and constant
    I + diag(g) b (S, S), from the generator's kernel and bias and the gate
    (S, 1), all in ``dtype``."""
    weights = kernel * (gate * math.sqrt(E))
    offset = ops.add(bias * gate, _eye(gate.shape[0], dtype))
    return weights, offset


def _flat_map_matrix(tokens: Any, weights: Any, offset: Any) -> Any:
    """``map_matrix``'s float32/float64 form on JAX: the generator product
    and the RMS statistic over the tokens as one (B*T, E) matrix, the shape in
    which the projections' products read them, reshaped to (B, T, S, S) at the
    end.

    Why: with (B, T, E) tokens, XLA:CPU fed the statistic's reduction its own
    (B, T, E) copy of whatever produced the tokens. For an
    ``Embedding(mask_zero=True)`` that is the looked-up rows, which were then
    written three times per call (the gather, and its masked select once per
    shape) where MHA writes them once: in the compiled step at B=4, N=256,
    E=512, ``cost_analysis`` bytes 152.8 -> 144.4 MB forward (MHA 121.7) and
    471.8 -> 467.6 MB training (MHA 417.8), 2 and 1 kernels and 3 copies fewer.
    The weights keep their (E, S, S) form: as an (E, S*S) matrix the weight
    gradient left YNNPACK for a native XLA ``dot``."""
    E, S = tokens.shape[-1], offset.shape[-1]
    flat = ops.reshape(tokens, (-1, E))
    inv_norm = _flat_inv_norm(flat)
    matrix = _einsum("ne,ehk->nhk", flat, weights) * ops.expand_dims(inv_norm, -1) + offset
    return ops.reshape(matrix, (*ops.shape(tokens)[:-1], S, S))


def _flat_inv_norm(flat: Any) -> Any:
    """1 / sqrt(sum(t^2) + E eps) of each row t of the (B*T, E) tokens, (B*T, 1):
    phi(t) = sqrt(E) t times it."""
    return ops.rsqrt(ops.sum(ops.square(flat), axis=-1, keepdims=True) + flat.shape[-1] * RMS_EPS)


def _torch_map_matrix(tokens: Any, kernel: Any, bias: Any, gate: Any, dtype: str) -> Any:
    """``map_matrix``'s float32/float64 form in torch calls, each one aten op
    (``keras.ops`` adds conversions, dtype checks and casts around each): the
    generator product as one GEMM on the (B*T, E) tokens against the (E, S*S)
    weights, and its scale and offset as one ``addcmul``."""
    import torch

    S, E = gate.shape[0], tokens.shape[-1]
    kernel, bias, gate = (x if x.dtype == tokens.dtype else x.to(tokens.dtype) for x in (kernel, bias, gate))
    gate = gate.reshape(S, 1)
    weights = (kernel * (gate * math.sqrt(E))).reshape(E, S * S)  # diag(g) W sqrt(E)
    offset = torch.addcmul(_torch_eye(S, tokens), bias, gate).reshape(S * S)  # I + diag(g) b
    inv_norm = torch.rsqrt(_sum_squares(tokens) + E * RMS_EPS)  # (B, T, 1)
    matrix = torch.addcmul(offset, torch.matmul(tokens, weights), inv_norm)  # (B, T, S*S)
    return matrix.reshape(*matrix.shape[:-1], S, S)


def _torch_eye(size: int, like: Any) -> Any:
    """The identity (S, S) as a torch tensor of ``like``'s dtype and device, made once."""
    key = (size, str(like.dtype), str(like.device))
    eye = _TORCH_EYES.get(key)
    if eye is None:
        import torch

        eye = _TORCH_EYES[key] = torch.eye(size, dtype=like.dtype, device=like.device)
    return eye


_TORCH_EYES: dict[tuple[int, str, str], Any] = {}


def _sum_squares(tokens: Any) -> Any:
    """sum(t^2) over the features, (B, T, 1), in the tokens' dtype.

    On torch one norm kernel (no (B, T, E) temporary; ``torch.linalg`` directly:
    Keras 3.15's torch ``ops.norm`` returns float32 for float64), except under
    torch.onnx export, which keeps the plain ops. Tokens that need a gradient
    (from an ``Embedding``, a previous layer) take ``_torch_sum_squares``: the
    same forward, and the gradient 2 t g in one product (autograd's rule for
    ``square(vector_norm)`` divides by the norm, guards zero norms with a
    comparison and a fill, and scales: four passes over the tokens).
    """
    if keras.backend.backend() == "torch" and not _onnx_export():
        import torch

        if tokens.requires_grad and torch.is_grad_enabled():
            return _torch_sum_squares().apply(tokens)
        return torch.square(torch.linalg.vector_norm(tokens, dim=-1, keepdim=True))
    return ops.sum(ops.square(tokens), axis=-1, keepdims=True)


@functools.cache
def _torch_sum_squares() -> Any:
    """sum(t^2) over the last axis (keepdim) as a torch autograd function:
    forward ``square(vector_norm(t))``, backward ``t * (2 g)`` (written in torch
    ops, so it is differentiable again)."""
    import torch

    class SumSquares(torch.autograd.Function):
        # forward and setup_context apart, a vmap rule and a jvp: torch.func's
        # transforms (grad, vmap, jacrev) and forward-mode AD work through it.
        generate_vmap_rule = True

        @staticmethod
        def forward(tokens: Any) -> Any:
            return torch.square(torch.linalg.vector_norm(tokens, dim=-1, keepdim=True))

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            (tokens,) = inputs
            ctx.save_for_backward(tokens)
            ctx.save_for_forward(tokens)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (tokens,) = ctx.saved_tensors
            return tokens * (2 * grad)

        @staticmethod
        def jvp(ctx: Any, tangent: Any) -> Any:
            (tokens,) = ctx.saved_tensors
            return 2 * (tokens * tangent).sum(-1, keepdim=True)

    return SumSquares


def apply_map_matrix(matrix: Any, y: Any) -> Any:
    """L(t) y for stacked heads y (B, T, S, d) from ``map_matrix``'s (B, T, S, S):
    one batched product per token (the ``apply_map`` step for metric "heads").

    ``matmul``, which torch runs as one batched GEMM (its einsum permutes and
    copies first); float64 takes ``einsum``: Keras 3.15's torch matmul returns
    float32 for float64."""
    if keras.backend.backend() == "torch":
        import torch

        return torch.matmul(matrix, y)  # any float dtype: Keras's float64 issue is its wrapper's
    if keras.backend.backend() == "jax":
        return _jax_mix_heads()(matrix, y)
    if dtype_name(y) == "float64":
        return _einsum("btha,btad->bthd", matrix, y)
    return ops.matmul(matrix, y)


@functools.cache
def _jax_mix_heads() -> Callable[[Any, Any], Any]:
    """The (B, T, S, S) x (B, T, S, d) per-token product on JAX, with a
    derivative rule that keeps its transpose a plain batched product.

    Plain autodiff gets y's cotangent as l^T g, a product contracting l's
    *row* axis per token, which XLA:CPU does not hand to its GEMM library:
    it stays a native per-token loop of tiny products (``dot`` in the
    compiled training step, next to the library fusions of MHA's own
    products). With l^T materialised (an (S, S) transpose per token, 1/d of
    y's size; the barrier keeps XLA from folding it back) and contracted
    over its minor axis, the transpose is the same kind of product as the
    forward one. ``damcha_jax``'s ``_mix_heads`` does the same for the Flax
    port.
    """
    import jax
    import jax.numpy as jnp

    @jax.custom_jvp
    def mix(matrix: Any, y: Any) -> Any:
        return jnp.matmul(matrix, y)

    @mix.defjvp
    def mix_jvp(primals: tuple[Any, Any], tangents: tuple[Any, Any]) -> tuple[Any, Any]:
        matrix, y = primals
        d_matrix, d_y = tangents
        matrix_t = jax.lax.optimization_barrier(jnp.swapaxes(matrix, -1, -2))
        d_out = jnp.matmul(d_matrix, y) + jnp.einsum("btah,btad->bthd", matrix_t, d_y)
        return mix(matrix, y), d_out

    return mix


def packed_self_heads(
    tokens: Any,
    kernel: Any,
    bias: Any,
    gate: Any,
    q_kernel: Any,
    q_bias: Any,
    k_kernel: Any,
    k_bias: Any,
    v_kernel: Any,
    v_bias: Any,
) -> tuple[Any, Any, Any]:
    """A tied self-attention's q~ (B, T, H, d), k~ (B, T, G, d) and v (B, T, G, d_v)
    from one product of the tokens (B, T, E) with the query, key and value
    kernels (E, H|G, d|d_v) and the map's folded generator weights joined
    side by side (E, H*d + G*d + G*d_v + S*S); biases (H|G, d|d_v) or None.

    Why (JAX, float32/float64): the three projections and the generator are
    four products of the same tokens, and in a training step four more for
    the weights' gradients. Joined, the forward is one product (MHA makes
    three) and so is the weights' gradient, and XLA:CPU has fewer small
    steps to order: measured at B=4, E=512, H=8 (one process, interleaved
    rounds), against the four products: the ``Embedding(mask_zero=True)``
    training step at N=256 0.95x, ``use_causal_mask`` training 0.96x, the
    eager forward 0.95x, at N=1024 0.98-1.01x.

    What it must not cost is memory (``_jax_joined_product``): the joined
    weights (E x 1600 floats at E=512, 3.1 MiB) are made inside this layer's
    step and not kept for backward. XLA's estimate of a 6-layer encoder's
    compiled steps at N=256 (MHA 102.2 and 624.7 MiB): predict 102.8 ->
    102.3 MiB, training 652.7 -> 649.3 MiB; without the two measures below
    (``_zero_of``, ``_jax_joined_product``) 115.9 and 662.1. The map is
    ``map_matrix``'s float form: phi is never formed (``_flat_map_matrix``).
    """
    dtype = dtype_name(tokens)
    E, S = tokens.shape[-1], gate.shape[0]
    kernel, bias, gate = _as(kernel, dtype), _as(bias, dtype), ops.reshape(_as(gate, dtype), (S, 1))
    weights, offset = _folded_map_weights(kernel, bias, gate, E, dtype)
    blocks = [q_kernel, k_kernel, v_kernel]
    widths = [int(np.prod(w.shape[1:])) for w in blocks]
    columns = [ops.reshape(_as(w, dtype), (E, n)) for w, n in zip(blocks, widths)]
    flat = ops.reshape(tokens, (-1, E))
    inv_norm = _flat_inv_norm(flat)
    # The zero comes from the statistic, which reads the tokens anyway: taken from the
    # tokens themselves it made XLA write an Embedding's looked-up tokens twice.
    out = _jax_joined_product()(flat, _zero_of(inv_norm), *columns, ops.reshape(weights, (E, S * S)))
    lead = tuple(ops.shape(tokens)[:-1])
    heads, start = [], 0
    for w, b, n in zip(blocks, (q_bias, k_bias, v_bias), widths):
        y = out[:, start : start + n]
        if b is not None:
            y = y + ops.reshape(_as(b, dtype), (n,))
        heads.append(ops.reshape(y, (*lead, *w.shape[1:])))
        start += n
    matrix = ops.reshape(out[:, start:] * inv_norm + ops.reshape(offset, (S * S,)), (*lead, S, S))
    q, k, v = heads
    return apply_map_matrix(matrix, q), apply_map_matrix(matrix, k), v


def _zero_of(t: Any) -> Any:
    """An exact 0 of t's dtype computed from t's first entry (``nan_to_num``
    makes it finite first, so it is 0 for any value), or a constant 0 where t
    is empty; no gradient flows through it. ``_jax_joined_product`` adds it to
    the weights it joins so that joining them depends on the layer's tokens
    (through t, their RMS statistic): XLA:CPU schedules a computation of parameters alone at the start of a
    step, where every layer's joined weights then stayed alive under the
    attention's peak (an optimization barrier is no help: XLA:CPU removes
    barriers before it schedules)."""
    import jax
    import jax.numpy as jnp

    if 0 in t.shape:
        return jnp.zeros((), t.dtype)
    return jax.lax.stop_gradient(0 * jnp.nan_to_num(t[0, 0]))


@functools.cache
def _jax_joined_product() -> Callable[..., Any]:
    """``(flat, zero, *columns) -> flat @ [c + zero for c in columns]`` joined
    side by side (flat (T, E), each column block (E, n_i), zero from
    ``_zero_of``), with a derivative rule that keeps the joined weights out
    of what reverse mode saves.

    Plain autodiff saves the joined weights for the tokens' gradient g W^T,
    one (E, sum n_i) array per layer kept from forward to backward (3.1 MiB
    at E=512: a 6-layer training step 652.7 -> 662.1 MiB in XLA's estimate).
    Here the tangent of the tokens is taken per block (d_flat @ c_i, joined),
    so reverse mode saves only the tokens and the parameters and computes the
    tokens' gradient as one product per block, as separate projections do;
    the weights' gradient stays one product, tokens^T g, split per block.
    Forward mode works too (``jax.jvp``)."""
    import jax
    import jax.numpy as jnp

    @jax.custom_jvp
    def joined(flat: Any, zero: Any, *columns: Any) -> Any:
        return jnp.matmul(flat, jnp.concatenate([c + zero for c in columns], axis=1))

    @joined.defjvp
    def joined_jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
        flat, zero, *columns = primals
        d_flat, _, *d_columns = tangents
        d_out = jnp.concatenate([jnp.matmul(d_flat, c) for c in columns], axis=1)
        return joined(flat, zero, *columns), d_out + jnp.matmul(flat, jnp.concatenate(d_columns, axis=1))

    return joined


def map_heads(tokens: Any, kernel: Any, bias: Any, gate: Any, y: Any) -> Any:
    """L(t) y for metric "heads": ``map_matrix`` then ``apply_map_matrix``."""
    return apply_map_matrix(map_matrix(tokens, kernel, bias, gate), y)


def map_heads_pair(tokens: Any, kernel: Any, bias: Any, gate: Any, q: Any, k: Any) -> tuple[Any, Any]:
    """L(t) q and L(t) k with one matrix: a tied self-attention's queries and keys."""
    matrix = map_matrix(tokens, kernel, bias, gate)
    return apply_map_matrix(matrix, q), apply_map_matrix(matrix, k)


def torch_keeps_recipes() -> bool:
    """Whether a torch call saves its mapped heads for backward as recipes
    (``saved_as_recipes``): one that records gradients, eager and on plain
    tensors (no compiler, tracer, torch.func transform or ONNX export), with
    no saved-tensor hooks of the caller's (gradient checkpointing,
    ``save_on_cpu``) that the layer's own would displace."""
    if keras.backend.backend() != "torch":
        return False
    import torch

    return (
        torch.is_grad_enabled() and _torch_eager() and torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    )


def _torch_eager() -> bool:
    """Whether torch runs eagerly: no compiler, tracer, torch.func transform or
    ONNX export, which would bake a branch on values (or saved-tensor hooks)
    into what they record, or refuse it."""
    import torch

    return not (
        torch.compiler.is_compiling()
        or torch._C._is_tracing()
        or torch._C._are_functorch_transforms_active()
        or torch.onnx.is_in_onnx_export()
    )


class _Recipe:
    """A mapped block L y saved as its recipe: the map matrix and y (which the
    product's own backward keeps anyway) and the saved view's geometry."""

    __slots__ = ("matrix", "offset", "size", "stride", "versions", "y")

    def __init__(self, matrix: Any, y: Any, view: Any) -> None:
        self.matrix, self.y = matrix, y
        self.versions = (matrix._version, y._version)
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()

    def make(self) -> Any:
        import torch

        if (self.matrix._version, self.y._version) != self.versions:
            raise RuntimeError(
                "a map matrix or the heads it maps, saved for backward by DamchaAttention, was modified in place "
                "after the forward"
            )
        return torch.matmul(self.matrix, self.y).as_strided(self.size, self.stride, self.offset)


def saved_as_recipes(blocks: list[tuple[Any, Any, Any]]) -> Any:
    """Saved-tensor hooks (torch) under which attention saves its mapped heads as
    recipes: a tensor saved for backward that lies in a block L y of ``blocks``
    (triples of the block, the map matrix and y, from ``apply_map_matrix``)
    is kept as the matrix and y and made again, with the same product, when
    backward reads it; any other tensor is saved as autograd saves it.

    Why: the map's product keeps y and the matrix for its own backward, and
    attention keeps the mapped q~ and k~ for its: as two nodes a training call
    kept both (19% more activations than Keras MHA's at B=4, N=1024, E=512,
    H=8; a 6-layer model's training peak 1.06-1.07x MHA's). The layer passes
    one block (q~): that brings what it keeps to MHA's, and each recipe costs
    backward the per-token product again, which is not cheap on CPU (a batched
    product of tiny matrices; docs/keras.md has the measurements)."""
    import torch

    table = {}
    for block, matrix, y in blocks:
        storage = block.untyped_storage()
        # Not detached (an aten call each): neither holds the attention's node, so no cycle.
        table[storage.data_ptr()] = (storage.nbytes(), matrix, y)

    def pack(t: Any) -> Any:
        if type(t) is torch.Tensor:
            storage = t.untyped_storage()
            found = table.get(storage.data_ptr())
            if found is not None and found[0] == storage.nbytes():
                return _Recipe(found[1], found[2], t)
        # Detached, as autograd saves it: an op's output kept as is would hold its own node.
        return t if t.grad_fn is None else t.detach()

    def unpack(packed: Any) -> Any:
        return packed.make() if isinstance(packed, _Recipe) else packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def compiled(fn: Callable, *args: Any) -> Any:
    """``fn(*args)``, run eagerly as one call of the backend's compiler
    (``tf.function``, ``jax.jit``) for the small fixed chains of ops of the
    map: eager Keras pays a dispatch per op, a compiled call pays one. When
    already traced (``tf.function``, ``jit``, export) and on torch, ``fn`` runs
    as it is. Compiled once per layer geometry and dtypes (jax: and per shape).
    ``args``: tokens (B, T, E), the generator's kernel and bias, the gate
    (tensors, or on TensorFlow the ``tf.Variable``s from ``map_weights``), then
    heads (B, T, S, d), or (``packed_self_heads``, jax only) the projections'
    kernels and biases, None for a bias the layer does not have."""
    backend = keras.backend.backend()
    if backend == "torch":
        return fn(*args)
    if backend == "tensorflow":
        import tensorflow as tf

        if not tf.executing_eagerly():
            return fn(*args)
    elif backend == "jax":
        import jax

        if any(isinstance(a, jax.core.Tracer) for a in args):
            return fn(*args)
    else:
        return fn(*args)
    # One function per layer geometry (the weights' shapes, the heads' sizes, the
    # dtypes): only the batch and length dims of the tokens and heads vary within it.
    varying = [i == 0 or i > 3 for i in range(len(args))]
    key = (
        fn,
        backend,
        tuple(
            None if a is None else (tuple(a.shape[2:] if v else a.shape), dtype_name(a), _is_tf_variable(a))
            for a, v in zip(args, varying)
        ),
    )
    call: Any = _COMPILED.get(key)
    if call is None:
        if backend == "tensorflow":
            # One concrete function traced for any batch and length: calling it skips
            # tf.function's per-call signature matching, a large part of an eager
            # call's cost at short lengths. A variable is traced as itself: an input
            # of the function (any variable of its shape and dtype), not a capture.
            specs = [
                a if _is_tf_variable(a) else tf.TensorSpec((None, None, *a.shape[2:]) if v else a.shape, a.dtype)
                for a, v in zip(args, varying)
            ]
            call = tf.function(fn, autograph=False).get_concrete_function(*specs)
        else:
            call = jax.jit(fn)
        _COMPILED[key] = call
    if backend == "tensorflow" and not _tape_may_record() and hasattr(call, "_call_flat"):
        # The flat call (what ConcreteFunction.__call__ ends in, without binding the
        # arguments to the Python signature: about a thousand Python calls fewer). With
        # no tape recording, nothing needs the variables marked as read.
        flat = [a.handle if _is_tf_variable(a) else a for a in args]
        if all(isinstance(a, tf.Tensor) for a in flat):
            return call._call_flat(flat, call.captured_inputs)
    return call(*args)


def _is_tf_variable(x: Any) -> bool:
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return isinstance(x, tf.Variable)


def _tape_may_record() -> bool:
    """Whether a TensorFlow gradient tape is active (True when it cannot be told)."""
    try:
        from tensorflow.python.eager import record
    except ImportError:  # pragma: no cover - a TensorFlow without the module: the safe answer
        return True
    return bool(record.could_possibly_record())


def map_weights(variables: tuple[Any, ...]) -> tuple[Any, ...]:
    """The map's weights (the generator's kernel and bias, the gate) as
    ``compiled`` takes them. On eager TensorFlow with no gradient tape
    recording, the ``tf.Variable``s themselves: the compiled function reads
    them, where reading them first costs an eager ``ReadVariableOp`` each per
    call. Otherwise (a tape, a trace, another backend, a dtype policy that
    casts the variables) their values as tensors. None (a bias a layer does
    not have) stays None."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if tf.executing_eagerly():
            # A Keras variable's value: its tf.Variable, or under a dtype policy's
            # autocast the variable cast to the compute dtype.
            values = tuple(getattr(v, "value", v) for v in variables)
            if not _tape_may_record() and all(isinstance(v, tf.Variable) for v in values):
                return values
            return tuple(None if v is None else tf.convert_to_tensor(v) for v in values)
    if keras.backend.backend() == "torch":
        # The variables' tensors (under a dtype policy's autocast, cast), without
        # convert_to_tensor's device move and its aten call per weight.
        return tuple(getattr(v, "value", v) for v in variables)
    return tuple(None if v is None else ops.convert_to_tensor(v) for v in variables)


_COMPILED: dict = {}


def as_4d(mask: Any) -> Any:
    """A Keras attention mask (N, M), (B, N, M) or (B, H, N, M) as (B|1, H|1, N|1, M|1)."""
    while len(mask.shape) < 4:  # Keras convention: (N, M) -> (1, N, M) -> (1, 1, N, M)
        mask = ops.expand_dims(mask, -3)
    return mask


def visibility(
    n: Any,
    m: Any,
    *,
    query_mask: Any = None,
    value_mask: Any = None,
    key_mask: Any = None,
    attention_mask: Any = None,
    causal: bool = False,
    query_offset: Any = None,
    valid_length: Any = None,
    window: int | None = None,
) -> Any:
    """Boolean (B|1, H|1, N|1, M|1), True = query i may attend key j, or None
    when nothing is hidden.

    The masks are boolean (True = may attend): ``query_mask`` (B, N),
    ``value_mask``/``key_mask`` (B, M), ``attention_mask`` in a Keras shape.
    ``causal`` hides key j from query i when j > i + ``query_offset`` (0:
    top-left, as Keras); ``valid_length`` hides keys j >= it (cache slots not
    yet written); ``window`` hides keys with |i + query_offset - j| >= window
    (Keras MHA's symmetric ``sliding_window`` band).
    """
    parts = []
    if attention_mask is not None:
        parts.append(as_4d(attention_mask))
    if query_mask is not None:
        parts.append(query_mask[:, None, :, None])
    for key_side in (value_mask, key_mask):
        if key_side is not None:
            parts.append(key_side[:, None, None, :])
    if causal or valid_length is not None or window is not None:
        cols = ops.expand_dims(ops.arange(m, dtype="int32"), 0)
        rows = ops.expand_dims(ops.arange(n, dtype="int32"), 1)
        if query_offset is not None:
            rows = rows + ops.cast(query_offset, "int32")
        if causal:
            parts.append(ops.greater_equal(rows, cols)[None, None])
        if window is not None:
            parts.append(ops.less(ops.abs(rows - cols), window)[None, None])
        if valid_length is not None:
            parts.append(ops.less(cols, ops.cast(valid_length, "int32"))[None, None])
    if not parts:
        return None
    visible = parts[0]
    for part in parts[1:]:
        visible = ops.logical_and(visible, part)
    return visible


def softmax_attend(logits: Any, visible: Any) -> Any:
    """Masked softmax over the last axis, in at least float32; hidden keys and
    rows with no visible key get probability exactly 0 (v1's rule)."""
    wide = _wide(dtype_name(logits))
    logits = ops.cast(logits, wide)
    if visible is None:
        return ops.softmax(logits, axis=-1)
    # A finite fill: a row that sees nothing then stays finite (uniform), and
    # the product with `visible` below makes it exactly 0. NaN logits at
    # visible keys stay NaN.
    hidden = ops.convert_to_tensor(-1e9 if wide != "float64" else -1e300, dtype=wide)
    probs = ops.softmax(ops.where(visible, logits, hidden), axis=-1)
    return probs * ops.cast(visible, wide)


def _scaled(q: Any, scale: float) -> Any:
    # convert_to_tensor with the dtype keeps the scale exact in float64; the
    # TensorFlow backend rounds a Python float scale through float32.
    return ops.multiply(q, ops.convert_to_tensor(scale, dtype=dtype_name(q)))


def key_side_mask(key_mask: Any = None, attention_mask: Any = None) -> Any:
    """A mask that depends on the key alone, (B|1, H|1, 1, M) bool, or None:
    ``key_mask`` (B, M) ANDed with an ``attention_mask`` whose query dim is 1
    (4-D). Padding reaches the kernel in this form, never as an N x M mask."""
    parts = []
    if key_mask is not None:
        parts.append(key_mask[:, None, None, :])
    if attention_mask is not None:
        parts.append(attention_mask)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else ops.logical_and(parts[0], parts[1])


def kernel_masks(query_mask: Any, key_side: Any, *, causal: bool, rows: Any = None) -> Any:
    """What the fused kernel needs for masks that are causal and/or padding
    only, without an N x M mask: the rows that see some key, as a
    multiplier (B|1, N|1, H|1, 1) bool in the output's layout (None: all).
    ``query_mask`` (B, N) and ``rows`` (B|1, H|1, N) (from ``split_mask``)
    hide query rows.

    ``key_side`` (B|1, H|1, 1, M) goes to the kernel as its mask (with
    ``is_causal`` when ``causal``; the caller makes sure N == M then). A row
    that sees no key comes out of every backend's kernel finite (their masks
    fill hidden logits with a large finite negative) and is zeroed here: the
    all-masked-row rule. With ``causal`` row i sees a key iff some key j <= i
    is kept: a running count over M (B|1, H|1, 1, M) read as rows.
    """
    keep = None
    if key_side is not None:
        if causal:
            seen = ops.greater(ops.cumsum(ops.cast(key_side, "int32"), axis=-1), 0)
            keep = ops.transpose(seen, (0, 3, 1, 2))  # (B|1, N, H|1, 1): N == M
        else:
            keep = ops.transpose(ops.any(key_side, axis=-1, keepdims=True), (0, 2, 1, 3))
    if rows is not None:
        rows = ops.transpose(ops.convert_to_tensor(rows, dtype="bool"), (0, 2, 1))[..., None]
        keep = rows if keep is None else ops.logical_and(keep, rows)
    if query_mask is not None:
        rows = query_mask[:, :, None, None]
        keep = rows if keep is None else ops.logical_and(keep, rows)
    return keep


def host_values(mask: Any) -> np.ndarray | None:
    """A concrete mask's values as NumPy when reading them costs no device
    transfer (a NumPy array, an eager tensor on the CPU, a constant of a
    TensorFlow graph); None otherwise (traced under jit / tf.function /
    torch.compile, or on an accelerator)."""
    if isinstance(mask, np.ndarray):
        return mask
    try:
        backend = keras.backend.backend()
        if backend == "tensorflow":
            import tensorflow as tf

            if not tf.executing_eagerly():
                # A constant of the graph (a NumPy mask, ops.tril(ops.ones(...)) made in
                # the traced call): known when tracing.
                return _tf_static_value(mask)
            if "GPU" in mask.device or "TPU" in mask.device:
                return None
            # _numpy() shares the tensor's buffer (read only here); numpy() would copy it.
            return mask._numpy() if hasattr(mask, "_numpy") else mask.numpy()
        if backend == "torch":
            import torch

            if not isinstance(mask, torch.Tensor) or mask.device.type != "cpu" or torch.compiler.is_compiling():
                return None
            return mask.detach().numpy()
        if backend == "jax":
            import jax

            if isinstance(mask, jax.core.Tracer) or any(d.platform != "cpu" for d in mask.devices()):
                return None
            return np.asarray(mask)
    except Exception:  # noqa: BLE001 - a symbolic or fake tensor: its values are not known
        return None
    return None


def _tf_static_value(tensor: Any, depth: int = 0) -> np.ndarray | None:
    """A traced TensorFlow tensor's value when the graph holds it as constants:
    ``tf.get_static_value``, which also folds the few ops a mask built inside a
    traced call is made of: ``ops.tril``/``ops.triu`` of ``ops.ones`` (a
    ``MatrixBandPart`` of a ``Fill``), casts, ``expand_dims``, ``reshape`` and
    ``broadcast_to``. None when any input is not a constant."""
    import tensorflow as tf

    value = tf.get_static_value(tensor)
    if value is not None or depth > 8 or not hasattr(tensor, "op"):
        return value
    op = tensor.op
    if op.type not in _FOLDED_OPS:
        return None
    inputs: list[Any] = [_tf_static_value(t, depth + 1) for t in op.inputs]
    if any(v is None for v in inputs):
        return None
    x = np.asarray(inputs[0])
    if op.type == "Identity":
        return x
    if op.type == "Cast":
        return x.astype(tensor.dtype.as_numpy_dtype)
    if op.type == "MatrixBandPart":
        # TensorFlow's rule: (i, j) is kept iff (lower < 0 or i - j <= lower) and (upper < 0 or j - i <= upper).
        lower, upper = int(inputs[1]), int(inputs[2])
        offset = np.arange(x.shape[-2])[:, None] - np.arange(x.shape[-1])[None, :]
        band = ((lower < 0) | (offset <= lower)) & ((upper < 0) | (-offset <= upper))
        return np.where(band, x, np.zeros((), x.dtype))
    if op.type == "ExpandDims":
        return np.expand_dims(x, int(inputs[1]))
    if op.type == "Reshape":
        return x.reshape(tuple(int(d) for d in np.asarray(inputs[1]).ravel()))
    return np.broadcast_to(x, tuple(int(d) for d in np.asarray(inputs[1]).ravel()))  # BroadcastTo


_FOLDED_OPS = ("Identity", "Cast", "MatrixBandPart", "ExpandDims", "Reshape", "BroadcastTo")


@functools.lru_cache(maxsize=4)
def _tri(n: int) -> np.ndarray:
    """The boolean lower triangle (N, N) (read-only: shared by calls)."""
    tri = np.tri(n, n, dtype=bool)
    tri.flags.writeable = False
    return tri


@functools.lru_cache(maxsize=8)
def _tri_as(n: int, dtype: np.dtype) -> np.ndarray:
    """``_tri(n)`` as 0/1 of ``dtype`` (read-only: shared by calls)."""
    tri = _tri(n).astype(dtype)
    tri.flags.writeable = False
    return tri


def causal_values(values: np.ndarray) -> np.ndarray | None:
    """The cached boolean lower triangle ``_tri(N)`` when an (N, N) mask's
    values are exactly it (bool, or 0/1 of any dtype): one comparison, which
    also proves a float mask's values 0/1, and ``split_mask`` then knows the
    mask by identity (no second pass); None for any other mask."""
    if values.ndim != 2 or values.shape[0] != values.shape[1] or values.shape[0] < 2:
        return None
    n = values.shape[0]
    want = _tri(n) if values.dtype == bool else _tri_as(n, values.dtype)
    return _tri(n) if np.array_equal(values, want) else None


def split_mask(mask: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None, bool] | None:
    """A boolean (B|1, H|1, N, M) mask read as the fused kernel's parts, when it
    is exactly one: ``(rows, keys, causal)`` with ``rows`` (B|1, H|1, N) the
    query rows that see some key (None: all), ``keys`` (B|1, H|1, 1, M) the
    kept keys (None: all) and ``causal`` the top-left rule (only when N == M),
    such that ``mask == rows & keys & (tril if causal)``; None when the mask is
    anything else (it then goes to the kernel as it is).

    This is how a causal ``attention_mask`` (``ops.tril(ops.ones((N, N)))``,
    KerasHub's causal-and-padding masks, a padding mask broadcast over the
    queries) reaches the kernel's causal path and a (B, 1, 1, M) key mask.
    """
    n, m = mask.shape[-2:]
    if n == m and n > 1 and (mask.base is _tri(n) or np.array_equal(np.broadcast_to(_tri(n), mask.shape), mask)):
        return None, None, True  # the common case, in one pass: exactly top-left causal
    rows = np.asarray(mask.any(axis=-1))
    keys = np.asarray(mask.any(axis=-2, keepdims=True))
    outer = rows[..., None] & keys
    for causal in (False, True) if n == m else (False,):
        rebuilt = outer & _tri(n) if causal else outer
        if np.array_equal(rebuilt, np.broadcast_to(mask, rebuilt.shape)):
            return (None if rows.all() else rows), (None if keys.all() else keys), causal
    return None


def fused_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: float,
    mask: Any = None,
    is_causal: bool = False,
    keep: Any = None,
    flash_attention: bool | None = None,
) -> Any:
    """``keras.ops.dot_product_attention`` on the mapped heads, (B, N, H, d_v).

    Args:
        q: (B, N, H, d) mapped queries.
        k: (B, M, G, d) mapped keys; G divides H.
        v: (B, M, G, d_v).
        scale: the softmax scale.
        mask: bool (B|1, H|1, N|1, M) for the kernel, True = may attend.
        is_causal: the kernel's own top-left causal rule (with or without ``mask``).
        keep: bool (B|1, N|1, H|1, 1), rows whose output is kept; the others
            are set to 0 by a product (NaN from the kernel stays NaN).
        flash_attention: passed to the kernel.
    """
    if keras.backend.backend() == "jax" and dtype_name(q) == "float32" and _jax_concrete(q, k, v, mask, keep):
        call = _jax_fused_attention(ops.dot_product_attention)
        return call(q, k, v, mask, keep, scale, is_causal, flash_attention)
    return _fused_attention(
        q, k, v, scale=scale, mask=mask, is_causal=is_causal, keep=keep, flash_attention=flash_attention
    )


def _jax_concrete(*args: Any) -> bool:
    """Whether no argument is a JAX tracer (an eager call, not under ``jit``/``grad``),
    off TPU: there Keras's eager kernel takes its Splash path only with a concrete mask."""
    import jax

    return not any(isinstance(a, jax.core.Tracer) for a in args) and not _jax_on_tpu()


@functools.cache
def _jax_on_tpu() -> bool:
    import jax

    return jax.devices()[0].platform == "tpu"


@functools.lru_cache(maxsize=4)
def _jax_fused_attention(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``_fused_attention`` as one compiled call, for eager calls on JAX.

    Eagerly, Keras runs ``jax.nn.dot_product_attention`` op by op: each of its
    steps (the logits, their scale, a ``ones_like`` of them, the mask ANDs,
    the fill, the softmax's max, subtraction, exponential, sum and division,
    the product with the values) is a dispatch and a pass over the
    (B, H, N, M) logits in memory. Compiled, XLA fuses the masking and the
    softmax into a few loops over them, as in a compiled ``predict``. Under
    tracing (``jit``, ``predict``, training) the steps are traced as they are.
    float32 only: XLA:CPU compiles no float16 product with float32 results
    (Keras's kernel asks for one), which the eager steps run. Compiled once
    per shape (as any ``jit``) and per scale, causal flag and flash setting. ``kernel`` is the ``keras.ops.dot_product_attention``
    the body calls: a kernel replaced later (a wrapper, a spy) gets a function
    of its own, traced anew."""
    import jax

    def run(q: Any, k: Any, v: Any, mask: Any, keep: Any, scale: float, is_causal: bool, flash: Any) -> Any:
        return _fused_attention(
            q, k, v, scale=scale, mask=mask, is_causal=is_causal, keep=keep, flash_attention=flash, kernel=kernel
        )

    return jax.jit(run, static_argnums=(5, 6, 7))


def _fused_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: float,
    mask: Any,
    is_causal: bool,
    keep: Any,
    flash_attention: bool | None,
    kernel: Callable[..., Any] | None = None,
) -> Any:
    """``fused_attention``'s computation, traced or eager; ``kernel``: the
    ``keras.ops.dot_product_attention`` to call (default: the current one)."""
    group = q.shape[2] // k.shape[2]
    heads_k = k  # the probe's keys before the repeat: their finiteness is the repeat's, one G-th of the reads
    if group > 1:
        # Repeating keeps every backend's dot_product_attention on its plain MHA path.
        k, v = ops.repeat(k, group, axis=2), ops.repeat(v, group, axis=2)
    if flash_attention is not True and keras.backend.backend() == "tensorflow" and dtype_name(q) in _TF_KERNEL_DTYPES:
        out = _tf_attention(q, k, v, scale=scale, mask=mask, is_causal=is_causal)
        return out if keep is None else out * ops.cast(keep, out.dtype)
    if dtype_name(q) == "float64":
        q, scale = _scaled(q, scale), 1.0
    # Read on the queries the probe would read (scaled: a finite q times a scale
    # above 1 may overflow); the zero channels of the padding below change no sum.
    probe = mask is None and not _torch_certainly_finite(q, heads_k)
    d, d_v = q.shape[-1], v.shape[-1]
    if d != d_v:
        # jax.nn.dot_product_attention needs d == d_v; zero channels change
        # neither the logits nor the kept outputs.
        width = max(d, d_v)
        pad = lambda x: ops.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])  # noqa: E731
        q, k, v = (pad(x) if x.shape[-1] < width else x for x in (q, k, v))
    if flash_attention is not True and keras.backend.backend() == "torch":
        out = _torch_attention(q, k, v, scale=scale, is_causal=is_causal, mask=mask)
    else:
        out = (kernel or ops.dot_product_attention)(
            q, k, v, mask=mask, scale=scale, is_causal=is_causal, flash_attention=flash_attention
        )
    if d != d_v:
        out = out[..., :d_v]
    if probe:
        out = _nan_probe(out, q, k)
    if keep is not None:
        out = out * ops.cast(keep, out.dtype)
    return out


def attend(
    q: Any,
    k: Any,
    v: Any,
    visible: Any,
    *,
    scale: float,
    causal_only: bool = False,
    explicit: bool = False,
    dropout: Callable[[Any], Any] | None = None,
    flash_attention: bool | None = None,
) -> tuple[Any, Any]:
    """Scaled dot-product attention on the mapped heads, given a full mask.

    Args:
        q: (B, N, H, d) mapped queries.
        k: (B, M, G, d) mapped keys; G divides H (query head h reads kv head
            h // (H/G)).
        v: (B, M, G, d_v).
        visible: bool (B|1, H|1, N|1, M|1) or None (nothing hidden).
        scale: the softmax scale.
        causal_only: the only mask is top-left causal and ``visible`` is None:
            the fused kernel's causal path.
        explicit: the einsum/softmax path (attention probabilities, dropout,
            float64) instead of ``keras.ops.dot_product_attention``.
        dropout: applied to the probabilities on the explicit path.
        flash_attention: passed to ``keras.ops.dot_product_attention``.

    Returns:
        ``(o, probs)``: o (B, N, H, d_v) and, on the explicit path, the
        probabilities (B, H, N, M) before dropout (else None).
    """
    if explicit:
        group = q.shape[2] // k.shape[2]
        if group > 1:
            k, v = ops.repeat(k, group, axis=2), ops.repeat(v, group, axis=2)
        q = _scaled(q, scale)
        if causal_only:
            visible = visibility(ops.shape(q)[1], ops.shape(k)[1], causal=True)
        probs = softmax_attend(_einsum("bnhd,bmhd->bhnm", q, k), visible)
        probs = ops.cast(probs, q.dtype)
        dropped = dropout(probs) if dropout is not None else probs
        return _einsum("bhnm,bmhd->bnhd", dropped, v), probs
    if visible is None:
        return fused_attention(q, k, v, scale=scale, is_causal=causal_only, flash_attention=flash_attention), None
    any_visible = ops.any(visible, axis=-1, keepdims=True)  # (B|1, H|1, N|1, 1)
    if flash_attention:
        # A flash kernel may give NaN (not a finite average) for a row that
        # sees nothing: unhide such rows for it; their output is zeroed below.
        visible = ops.logical_or(visible, ops.logical_not(any_visible))
    keep = ops.transpose(any_visible, (0, 2, 1, 3))  # (B|1, N|1, H|1, 1)
    return fused_attention(q, k, v, scale=scale, mask=visible, keep=keep, flash_attention=flash_attention), None


def _torch_attention(q: Any, k: Any, v: Any, *, scale: float, is_causal: bool, mask: Any = None) -> Any:
    """torch's ``scaled_dot_product_attention`` on (B, H, N, d) views of the
    heads (B, N, H, d): the kernel ``keras.ops.dot_product_attention`` runs,
    without the wrapper's conversions, casts and the three ``contiguous``
    copies of the heads (the CPU kernels read strided heads).

    ``mask`` (bool (B|1, H|1, N|1, M), True = may attend) reaches the kernel
    as the wrapper hands it over: an additive mask of the heads' dtype, 0 or
    the wrapper's large finite negative (a row that sees nothing comes out
    finite, uniform, and ``keep`` zeroes it; ``-inf`` would make it NaN). With
    ``is_causal`` too (causal and padding) the top-left triangle is folded into
    it first, as the wrapper does: the kernel takes a mask or ``is_causal``."""
    import torch

    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            mask = ops.convert_to_tensor(mask, dtype="bool")
        if is_causal:
            mask, is_causal = torch.logical_and(mask, _torch_tril(q.shape[1], k.shape[1], mask.device)), False
        mask = torch.where(mask, 0.0, _torch_large_negative(q))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=is_causal, scale=scale
    )
    return out.transpose(1, 2)


def _torch_large_negative(like: Any) -> Any:
    """Keras's torch fill for hidden logits, a 0-dim tensor of ``like``'s dtype and device, made once."""
    key = (str(like.dtype), str(like.device))
    value = _TORCH_NEGATIVES.get(key)
    if value is None:
        import torch

        fill = -0.7 * (65500.0 if like.dtype == torch.float16 else 3.38953e38)
        value = _TORCH_NEGATIVES[key] = torch.tensor(fill, dtype=like.dtype, device=like.device)
    return value


_TORCH_NEGATIVES: dict[tuple[str, str], Any] = {}


@functools.lru_cache(maxsize=8)
def _torch_tril(n: int, m: int, device: Any) -> Any:
    """The top-left causal rule (N, M) bool on ``device``, made once per size."""
    import torch

    return torch.ones((n, m), dtype=torch.bool, device=device).tril()


_TF_KERNEL_DTYPES = ("float32", "float64")
# Keras's TensorFlow kernel fills hidden logits with this (finite: a row that sees
# nothing comes out uniform, then ``keep`` zeroes it).
_TF_LARGE_NEGATIVE = -0.7 * 3.38953e38


def _tf_attention(q: Any, k: Any, v: Any, *, scale: float, mask: Any, is_causal: bool) -> Any:
    """Scaled dot-product attention in TensorFlow ops, (B, N, H, d_v), for
    float32/float64 heads: ``keras.ops.dot_product_attention``'s computation
    (TensorFlow has no fused kernel: Keras composes it from einsums, a masked
    fill and a softmax) with fewer passes over the (B, H, N, M) logits.

    Keras's composition scales the logits (a (B, H, N, M) product, and its
    gradient in training) and builds its mask at the logits' full size (a
    ``ones_like`` of them, ANDed with the mask and again with the causal
    triangle) before the fill. Here the scale multiplies the queries
    ((B, N, H, d), 1/M of the logits) and the small masks are combined at their
    own size ((N, M) triangle and a (B|1, H|1, 1|N, M) mask), so the fill
    ``where`` is the only masking op over the logits, as it is the only one
    that needs them. Same rule as Keras's: hidden logits are set to the same
    large finite negative, so NaN at a hidden key stays hidden (the
    reference's rule), and a row that sees nothing comes out uniform
    (``fused_attention``'s ``keep`` zeroes it).

    Args:
        q: (B, N, H, d); k: (B, M, H, d); v: (B, M, H, d_v) (heads repeated).
        scale: the softmax scale.
        mask: bool (B|1, H|1, N|1, M), True = may attend, or None.
        is_causal: top-left causal (N == M where the callers set it).
    """
    import tensorflow as tf

    if scale != 1.0:
        q = q * tf.constant(scale, dtype=q.dtype)
    logits = tf.einsum("bnhd,bmhd->bhnm", q, k)
    if is_causal:
        tri = _tf_causal(q, k)
        mask = tri if mask is None else tf.logical_and(mask, tri)
    if mask is not None:
        logits = tf.where(mask, logits, tf.constant(_TF_LARGE_NEGATIVE, dtype=logits.dtype))
    probs = tf.nn.softmax(logits, axis=-1)
    return tf.einsum("bhnm,bmhd->bnhd", probs, v)


def _tf_causal(q: Any, k: Any) -> Any:
    """The top-left causal rule (N, M) bool for (B, N, H, d) queries and
    (B, M, H, d) keys: eagerly a tensor made once per (N, M) (no op per call),
    in a traced graph two small ops (an (N, M) fill and its band)."""
    import tensorflow as tf

    n, m = q.shape[1], k.shape[1]
    if tf.executing_eagerly() and n is not None and m is not None:
        return _tf_eager_tri(int(n), int(m))
    n, m = tf.shape(q)[1], tf.shape(k)[1]
    return tf.linalg.band_part(tf.ones((n, m), tf.bool), -1, 0)


@functools.lru_cache(maxsize=8)
def _tf_eager_tri(n: int, m: int) -> Any:
    import tensorflow as tf

    with tf.init_scope():
        return tf.linalg.band_part(tf.ones((n, m), tf.bool), -1, 0)


def _torch_certainly_finite(q: Any, k: Any) -> bool:
    """On the torch backend, whether q~ and k~ certainly hold no NaN or inf:
    one sum of each, read only where a forward may branch on values (eager, on
    CPU: no device sync; not under torch.compile, tracing, a torch.func
    transform or an ONNX export, which would bake the branch into their graph;
    elsewhere, and on the other backends, False).

    A NaN or inf anywhere makes the sum NaN or inf, so a finite sum proves
    every element finite (a sum that overflows says False, which only costs
    the probe). ``_nan_probe`` then adds 0 everywhere and is skipped: one read
    of q~ and of k~ instead of its row sums of q~, sum of k~ and pass over the
    output (as ``damcha_torch``'s ``_certainly_finite``).
    """
    if keras.backend.backend() != "torch":
        return False
    import torch

    if not (
        type(q) is torch.Tensor  # not a fake, functional or other subclass tensor of a tracer
        and type(k) is torch.Tensor
        and q.device.type == "cpu"
        and k.device.type == "cpu"
        and _torch_eager()
    ):
        return False
    with torch.no_grad():
        return math.isfinite(q.sum().item()) and math.isfinite(k.sum().item())


def _nan_probe(out: Any, q: Any, k: Any) -> Any:
    """NaN in, NaN out through torch's fused kernel without a mask.

    Torch's CPU SDPA returns finite rows (0) where every logit of a row is NaN
    and no mask is given (a NaN query, or NaN in every key, e.g. from the key
    bias); with a mask it gives NaN. Adding 0 * (row sum of q + sum of k)
    makes exactly the rows that read a NaN or inf NaN and changes nothing
    else (0 * x is not folded for floats). TensorFlow's and JAX's kernels
    propagate NaN themselves.
    """
    if keras.backend.backend() != "torch":
        return out
    import torch

    # torch calls (one aten op each), the probe (B, N, H, 1) added with alpha=0:
    # out + 0 * probe in one pass over the output (0 * NaN = NaN). The probe is
    # made without autograd: its gradient is 0 * the output's, so autograd would only
    # add zeros to q's and k's (a product, two sums, two expands and two adds over
    # the heads in every backward); NaN still reaches the output, hence the loss
    # and every gradient that depends on it.
    with torch.no_grad():
        probe = torch.sum(q, dim=-1, keepdim=True) + torch.sum(k, dim=(1, 2, 3), keepdim=True)
    return torch.add(out, probe, alpha=0)


def _prod(dims: Any) -> Any:
    total: Any = 1
    for dim in dims:
        total = total * dim
    return total


def fold_tokens(x: Any, batch_axes: tuple[int, ...], attention_axes: tuple[int, ...]) -> Any:
    """Tokens (B, *dims, E) as (B', T, E): the axes not attended over join the
    batch (B' = B * their sizes), the attended ones are flattened row-major into
    T. Keras MHA's ``attention_axes`` are then plain attention over T."""
    rank = len(x.shape)
    perm = (0, *batch_axes, *attention_axes, rank - 1)
    if perm != tuple(range(rank)):
        x = ops.transpose(x, perm)
    shape = ops.shape(x)
    return ops.reshape(x, (-1, _prod(shape[1 + len(batch_axes) : rank - 1]), shape[-1]))


def fold_token_mask(mask: Any, batch_axes: tuple[int, ...], attention_axes: tuple[int, ...]) -> Any:
    """A (B, *dims) token mask folded as ``fold_tokens`` folds its tokens: (B', T)."""
    perm = (0, *batch_axes, *attention_axes)
    if perm != tuple(range(len(perm))):
        mask = ops.transpose(mask, perm)
    shape = ops.shape(mask)
    return ops.reshape(mask, (-1, _prod(shape[1 + len(batch_axes) :])))


def unfold_tokens(y: Any, batch_axes: tuple[int, ...], attention_axes: tuple[int, ...], dims: tuple) -> Any:
    """Undo ``fold_tokens`` on outputs (B', T, *F): back to (B, *dims, *F), the
    axes in their original order. ``dims`` are the sizes of (B, *dims)."""
    features = tuple(y.shape[2:])
    order = (0, *batch_axes, *attention_axes)
    y = ops.reshape(y, tuple(dims[a] for a in order) + features)
    inverse = tuple(order.index(a) for a in range(len(order)))
    if inverse != tuple(range(len(order))):
        y = ops.transpose(y, inverse + tuple(range(len(order), len(order) + len(features))))
    return y


class Layout:
    """How inputs of rank > 3 map to DAMCHA's (B', T, E) tokens: the axes not
    attended over join the batch, the attended ones are flattened into T.

    The cross-head map is per token, so it acts on the heads of every position
    alike: a token is one position of the attended axes within one entry of
    the batch-like axes.
    """

    def __init__(self, rank: int, attention_axes: tuple[int, ...]) -> None:
        self.rank = rank
        self.attention_axes = attention_axes
        self.batch_axes = tuple(a for a in range(1, rank - 1) if a not in attention_axes)

    @property
    def folded(self) -> bool:
        return self.rank != 3

    def fold(self, x: Any) -> Any:
        return fold_tokens(x, self.batch_axes, self.attention_axes) if self.folded else x

    def fold_mask(self, m: Any) -> Any:
        return fold_token_mask(m, self.batch_axes, self.attention_axes) if self.folded and m is not None else m

    def fold_attention_mask(self, mask: Any, query: Any, value: Any, heads: int) -> Any:
        """A Keras attention mask as (B'|1, H|1, N, M) bool.

        Keras MHA inserts missing dims of the mask before its attention dims:
        (B, *batch_axes, H, *q_axes, *k_axes) is the full layout."""
        if not self.folded:
            return as_4d(mask)
        n_att = len(self.attention_axes)
        full_rank = 2 + len(self.batch_axes) + 2 * n_att
        while len(mask.shape) < full_rank:
            mask = ops.expand_dims(mask, -2 * n_att - 1)
        q_shape, v_shape = ops.shape(query), ops.shape(value)
        lead = [q_shape[0]] + [q_shape[a] for a in self.batch_axes]
        target = (
            *lead,
            mask.shape[len(lead)],
            *[q_shape[a] for a in self.attention_axes],
            *[v_shape[a] for a in self.attention_axes],
        )
        mask = ops.broadcast_to(mask, target)
        n = _prod(target[len(lead) + 1 : len(lead) + 1 + n_att])
        return ops.reshape(mask, (-1, target[len(lead)], n, _prod(target[len(lead) + 1 + n_att :])))

    def unfold(self, y: Any, query: Any) -> Any:
        return unfold_tokens(y, self.batch_axes, self.attention_axes, ops.shape(query)[:-1]) if self.folded else y

    def unfold_scores(self, scores: Any, query: Any, value: Any) -> Any:
        """(B', H, N, M) probabilities in MHA's layout (B, *batch_axes, H, *q_axes, *k_axes)."""
        if not self.folded or scores is None:
            return scores
        q_shape, v_shape = ops.shape(query), ops.shape(value)
        shape = (
            [q_shape[0]]
            + [q_shape[a] for a in self.batch_axes]
            + [scores.shape[1]]
            + [q_shape[a] for a in self.attention_axes]
            + [v_shape[a] for a in self.attention_axes]
        )
        return ops.reshape(scores, tuple(shape))

    def scores_shape(self, query_shape: tuple, value_shape: tuple, heads: int) -> tuple:
        if not self.folded:
            return (query_shape[0], heads, query_shape[1], value_shape[1])
        return (
            query_shape[0],
            *[query_shape[a] for a in self.batch_axes],
            heads,
            *[query_shape[a] for a in self.attention_axes],
            *[value_shape[a] for a in self.attention_axes],
        )


def metric_penalty(config: DamchaConfig, side: str, coeff: Any, gate: Any, u: Any = None, v: Any = None) -> Any:
    """mean_t ||L(t) - I||_F^2 / (S*d) of one side from its coefficients, in
    at least float32 (``damcha_core.role_penalty``'s formula, evaluated with
    keras.ops): float64 layers keep float64, as the torch and JAX ports do."""
    wide = _wide(dtype_name(coeff))
    params = {f"metric.{side}.gate": ops.cast(gate, wide)}
    if config.metric == "lowrank":
        params[f"metric.{side}.u"] = ops.cast(u, wide)
        params[f"metric.{side}.v"] = ops.cast(v, wide)
    return dc.role_penalty(ops, params, config, side, ops.cast(coeff, wide))


def _project(params: Mapping[str, Any], config: DamchaConfig, name: str, tokens: Any) -> Any:
    y = _einsum("bte,ehd->bthd", tokens, ops.cast(params[f"{name}.kernel"], dtype_name(tokens)))
    if config.use_bias:
        y = y + ops.cast(params[f"{name}.bias"], dtype_name(tokens))
    return y


def damcha_attention(
    params: Mapping[str, Any],
    config: DamchaConfig,
    query: Any,
    context: Any = None,
    *,
    value: Any = None,
    mask: Any = None,
    causal: bool = False,
    return_weights: bool = False,
) -> Any:
    """The whole DAMCHA forward from canonical tensors (inference: no dropout).

    The same steps as ``damcha_core.damcha_attention``, in keras.ops and the
    query's dtype; ``DamchaAttention.call`` runs them with its sublayers.

    Args:
        params: canonical name -> tensor or array (``config.param_shapes()``).
        config: the layer's ``DamchaConfig``.
        query: x (B, N, E_q).
        context: c (B, M, E_kv), the key tokens; ``None`` for self-attention.
        value: the value tokens (B, M, E_v); ``None``: the context.
        mask: boolean, True = may attend, (N, M), (B, N, M) or (B, H, N, M).
        causal: hide key j from query i when j > i.
        return_weights: also return the probabilities (B, H, N, M).

    Returns:
        y (B, N, E_o), or ``(y, weights)``.
    """
    c = query if context is None else context
    q = _project(params, config, "query", query)
    k = _project(params, config, "key", c)
    v = _project(params, config, "value", c if value is None else value)
    for role, tokens in (("q", query), ("k", c)):
        side = dc.side_of(config, role)
        if side is None:
            continue
        p = f"metric.{side}"
        coeff = generator(config.metric, params[f"{p}.kernel"], params[f"{p}.bias"], tokens)
        y = q if role == "q" else k
        y = apply_map(
            y, coeff, params[f"{p}.gate"], metric=config.metric, u=params.get(f"{p}.u"), v=params.get(f"{p}.v")
        )
        q, k = (y, k) if role == "q" else (q, y)
    visible = visibility(ops.shape(q)[1], ops.shape(k)[1], attention_mask=mask, causal=causal)
    o, weights = attend(q, k, v, visible, scale=config.softmax_scale, explicit=True)
    y = _einsum("bnhd,hde->bne", o, ops.cast(params["output.kernel"], dtype_name(o)))
    if config.use_bias:
        y = y + ops.cast(params["output.bias"], dtype_name(o))
    return (y, weights) if return_weights else y
