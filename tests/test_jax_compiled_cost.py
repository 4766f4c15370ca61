"""A whole model's compiled cost, DAMCHA beside the same model with Flax's MHA
(issue 12, "whole models"): XLA's own counts of the compiled programs, never
timings.

The model is a small pre-norm encoder whose DAMCHA layers share one metric
generator, as in ``benchmarks/_dropin_jax.py``. What DAMCHA may add to it is
the maps' own work: the generator (a GEMM and an RMS scale over the tokens,
per layer), the S x S coefficients, and one (S, S) @ (S, d) product per token
for each of q and k (and their derivatives in training). Anything beyond that
(a map fused into the attention's transposes, a per-token loop of tiny
matrix products, the generator's gradient done per copy, saved residuals
beyond the maps' inputs) is a defect these tests catch.

Small sizes keep the four compilations (DAMCHA and MHA, forward and training
step) to a few seconds; they take the same code paths as the benchmark's
(B=4, N=1024, E=512) models.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import damcha_jax as dj

B, N, E, H, FFN = 2, 64, 64, 8, 64
D = E // H
# Two layers share the generator in the training step (its gradient sums over
# them); one layer shows the forward's passes (each layer's are the same).
LAYERS = {"train": 2, "inference": 1}


class Block(nnx.Module):
    def __init__(self, attn: nnx.Module, rngs: nnx.Rngs, width: int = E, ffn: int = FFN) -> None:
        self.ln1, self.ln2 = nnx.LayerNorm(width, rngs=rngs), nnx.LayerNorm(width, rngs=rngs)
        self.attn = attn
        self.fc1, self.fc2 = nnx.Linear(width, ffn, rngs=rngs), nnx.Linear(ffn, width, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        h = h + self.attn(self.ln1(h))
        return h + self.fc2(nnx.gelu(self.fc1(self.ln2(h))))


def _tokens(mode: str) -> int:
    """Token-layers of a mode's model: every per-token cost below is multiplied by this."""
    return B * N * LAYERS[mode]


def _encoder(impl: str, layers: int) -> nnx.List:
    if impl == "mha":
        attns = [nnx.MultiHeadAttention(H, E, decode=False, rngs=nnx.Rngs(i)) for i in range(layers)]
    else:
        config = dj.DamchaAttention(H, E, rngs=nnx.Rngs(0)).config
        shared = dj.make_metric_generators(config, rngs=nnx.Rngs(1))
        attns = [dj.DamchaAttention(H, E, metric_generator=shared, rngs=nnx.Rngs(2 + i)) for i in range(layers)]
    return nnx.List([Block(a, nnx.Rngs(9)) for a in attns])


_COMPILED: dict[tuple[str, str], Any] = {}


def _compiled(impl: str, mode: str) -> Any:
    """The compiled forward ("inference") or value-and-grad ("train") on the CPU backend."""
    if (impl, mode) not in _COMPILED:
        # Abstract parameters (no initialisation runs): the compiled program
        # cannot depend on their values, so neither can a gate at 0 keep it cheap.
        graphdef, state = nnx.split(nnx.eval_shape(lambda: _encoder(impl, LAYERS[mode])))

        def forward(state: Any, x: jax.Array) -> jax.Array:
            h = x
            for block in nnx.merge(graphdef, state):
                h = block(h)
            return h

        fn = forward if mode == "inference" else jax.value_and_grad(lambda s, x: jnp.mean(forward(s, x) ** 2))
        with jax.default_device(jax.devices("cpu")[0]):
            x = jax.ShapeDtypeStruct((B, N, E), jnp.float32)
            _COMPILED[impl, mode] = jax.jit(fn).lower(state, x).compile()
    return _COMPILED[impl, mode]


def _cost(impl: str, mode: str) -> dict[str, float]:
    cost = _compiled(impl, mode).cost_analysis()
    return cost[0] if isinstance(cost, list) else cost


def _entry(impl: str, mode: str) -> tuple[str, str]:
    """(the whole HLO text, its ENTRY computation)."""
    text = _compiled(impl, mode).as_text()
    return text, text[text.index("\nENTRY") :]


def _unfused_dots(impl: str, mode: str) -> list[str]:
    """Shapes of the dots XLA:CPU left outside its library fusions: each runs
    as a loop over its batch of matrix products (one per token for a per-token
    product)."""
    return re.findall(r"= (\S+) dot\(", _entry(impl, mode)[1])


def _attention_transposes(impl: str) -> list[tuple[str, int]]:
    """(shape, multiplies) of each forward loop fusion that writes q, k or v
    in the attention's head-major layouts, (B, H, N, 1, d) or (B, H, d, M):
    the copies MHA makes around the attention's products, and what else
    runs in them."""
    text, entry = _entry(impl, "inference")
    found = []
    for shape, called in re.findall(r"= (f32\[[0-9,]+\])\S* fusion\([^)]*\), kind=kLoop, calls=%([\w.\-]+)", entry):
        dims = [int(v) for v in shape[4:-1].split(",")]
        if dims in ([B, H, N, 1, D], [B, H, D, N]):
            body = text[text.index(f"%{called} ") :]
            body = body[: body.index("\n}")]
            found.append((shape, body.count(" multiply(")))
    return sorted(found)


def test_attention_transposes_of_k_and_v_are_mhas_plain_copies() -> None:
    # l(t) y written as S multiply-adds was fused by XLA into these copies:
    # k's (B, H, d, M) transpose then gathered S strided values per element,
    # 4-10x the copy's time at N=1024 (the largest part of what the maps added
    # to a 6-layer encoder's inference). k's map must run as its own batched
    # product; k's and v's copies are MHA's. q's map (its projection bias
    # included, _functional._mix_query) rides in q's (B, H, N, 1, d) copy,
    # which reads each token's (S, d) block contiguously: S multiply-adds
    # per element (and l's gate products), no pass of its own.
    damcha, mha = _attention_transposes("damcha"), _attention_transposes("mha")
    assert len(mha) == 3 * LAYERS["inference"] and all(mults == 0 for _, mults in mha)  # q, k and v
    assert [shape for shape, _ in damcha] == [shape for shape, _ in mha]
    q_copy = f"f32[{B},{H},{N},1,{D}]"
    assert all(mults == 0 for shape, mults in damcha if shape != q_copy), damcha
    assert all(H <= mults <= 2 * H for shape, mults in damcha if shape == q_copy), damcha


def test_training_step_has_no_per_token_loop_of_matrix_products() -> None:
    # Plain autodiff of q~ = l(t) q gave q's gradient as l^T g contracting l's
    # row axis, which XLA:CPU ran as 4 such loops here (one per side and layer).
    assert sorted(_unfused_dots("damcha", "train")) == sorted(_unfused_dots("mha", "train"))


def test_training_step_flops_are_mha_plus_the_maps_own_work() -> None:
    S = H
    # Per token and layer: generator GEMM E*S*S (forward, and its two
    # gradient GEMMs), the (S,S)@(S,d) product for q and k (forward, again
    # in the backward pass where q~ and k~ are recomputed rather than saved,
    # and the gradients of l and of y for each); 2 flops per multiply-add.
    # Up to 1.3x: q's map, fused into the attention's copies of q~
    # (_functional._mix_query), is counted once per copy that reads it, with
    # its bias add and l's gate product evaluated per element (1.22x here).
    maps = 3 * 2 * E * S * S + 2 * 4 * 2 * S * S * D
    extra = _cost("damcha", "train")["flops"] - _cost("mha", "train")["flops"]
    tokens = _tokens("train")
    assert 0.8 * maps * tokens <= extra <= 1.3 * maps * tokens, (extra, maps * tokens)


def _maps_bytes_per_token() -> int:
    """What the maps may add to a forward pass per token and layer, in bytes.

    In float32 values: the generator reads the tokens twice (its GEMM and
    its RMS scale) and writes S*S coefficients; k is written once more
    before its map (the projection's bias) and the map reads it and l and
    writes k~; q's map, its bias included, rides in the attention's copy of
    q~ (it reads l there). Budget: 4 E + 4 S*d + 8 S*S values. With q's
    bias added in a pass of its own and q's map its own product (8 S*d) it
    was 1.10x this budget, a second map pass or a copy of the (B, H, N, M)
    scores would exceed it more.
    """
    S = H
    return 4 * (4 * E + 4 * S * D + 8 * S * S)


def test_forward_bytes_are_mha_plus_the_maps_passes() -> None:
    budget = _maps_bytes_per_token() * _tokens("inference")
    extra = _cost("damcha", "inference")["bytes accessed"] - _cost("mha", "inference")["bytes accessed"]
    assert 0 < extra <= budget, (extra, budget)


# ------------------------------------------------------------ layer calls
# One layer called as Flax users call nnx.MultiHeadAttention (issue 12, the
# "Flax NNX" layer rows of docs/benchmarks.md), under nnx.jit: DAMCHA's
# compiled program beside MHA's for the same call.

# combined-mask+hint: the combined mask, DAMCHA also told mask_hint="causal" (MHA has no such argument).
LAYER_CASES = ("causal-mask", "is_causal", "combined-mask", "combined-mask+hint")


def _layer_mask(case: str) -> jax.Array | None:
    if case == "is_causal":
        return None
    causal = nnx.make_causal_mask(jnp.ones((B, N)))
    if case == "causal-mask":
        return causal
    valid = jnp.arange(N)[None, :] < jnp.array([[N], [N - 5]])
    return nnx.combine_masks(causal, nnx.make_attention_mask(valid, valid))


_LAYER: dict[tuple[str, str, str], Any] = {}


def _layer_compiled(impl: str, case: str, mode: str) -> Any:
    """The compiled layer call ("forward") or its value-and-grad ("grad"), the mask an argument."""
    if impl == "mha":
        case = case.removesuffix("+hint")  # the same call for MHA
    if (impl, case, mode) not in _LAYER:
        mha = nnx.MultiHeadAttention(H, E, decode=False, rngs=nnx.Rngs(0))
        layer = mha if impl == "mha" else dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))

        hint = {"mask_hint": "causal"} if impl == "damcha" and case.endswith("+hint") else {}

        def apply(m: nnx.Module, x: jax.Array, mask: jax.Array | None) -> jax.Array:
            return m(x, is_causal=True) if case == "is_causal" else m(x, mask=mask, **hint)

        fn = nnx.jit(
            apply if mode == "forward" else nnx.value_and_grad(lambda m, x, mask: jnp.mean(apply(m, x, mask) ** 2))
        )
        with jax.default_device(jax.devices("cpu")[0]):
            x = jnp.ones((B, N, E), jnp.float32)
            _LAYER[impl, case, mode] = fn.lower(layer, x, _layer_mask(case)).compile()
    return _LAYER[impl, case, mode]


def _layer_cost(impl: str, case: str, mode: str = "forward") -> dict[str, float]:
    cost = _layer_compiled(impl, case, mode).cost_analysis()
    return cost[0] if isinstance(cost, list) else cost


def _mask_reads(impl: str, case: str, mode: str) -> int:
    """How many instructions of the ENTRY computation read the mask argument (the last parameter)."""
    text = _layer_compiled(impl, case, mode).as_text()
    entry = text[text.index("\nENTRY") :]
    params = re.findall(r"%([\w.\-]+) = f32\[[0-9,]+\]\S* parameter\((\d+)\)", entry)
    mask = max(params, key=lambda p: int(p[1]))[0]
    return len(re.findall(rf"\(([^)]*, )?%{re.escape(mask)}[,)]", entry))


@pytest.mark.parametrize("mode", ["forward", "grad"])
@pytest.mark.parametrize("case", ["causal-mask", "combined-mask"])
def test_layer_reads_a_traced_mask_once_more_than_mha(case: str, mode: str) -> None:
    # A traced float mask (nnx.make_causal_mask under nnx.jit) needs the 0/1
    # rule and, for v1's empty-row rule, which rows show a key: one pass over
    # it gives both (_masks._traced_numeric). They were two passes (and two
    # bool copies), 4% of the forward's bytes at N=1024.
    assert _mask_reads("damcha", case, mode) <= _mask_reads("mha", case, mode) + 1


@pytest.mark.parametrize("case", LAYER_CASES)
def test_layer_forward_flops_are_mha_plus_the_maps_own_work(case: str) -> None:
    S = H
    # Per token: the generator GEMM E*S*S and the (S,S)@(S,d) product for q and k.
    maps = 2 * E * S * S + 2 * 2 * S * S * D
    extra = _layer_cost("damcha", case)["flops"] - _layer_cost("mha", case)["flops"]
    assert 0.8 * maps * B * N <= extra <= 1.3 * maps * B * N, (extra, maps * B * N)


# What a mask may add over is_causal=True, DAMCHA minus MHA, in bytes per mask
# element. Without a hint: one read of the float mask and an int8 copy of it
# written and read (6), and the per-row results; two passes were 12. With
# mask_hint="causal" the mask does not reach the kernel (MHA reads it there
# once) and the hint's check reads it twice, its float32 counts fused into
# the two reductions (_masks._float_counts): about 4.7 here. Scored with
# compares and selects, XLA:CPU wrote a bool and an int32 copy of the mask for
# the reductions to read (about 15; 73 MiB against 32 at the benchmark's
# B=4, N=1024); five separate reductions were 28.
MASK_BYTES = {"causal-mask": 7, "combined-mask": 7, "combined-mask+hint": 6}


@pytest.mark.parametrize("case", list(MASK_BYTES))
def test_layer_mask_costs_at_most_its_reads_beyond_is_causal(case: str) -> None:
    extra = {
        c: _layer_cost("damcha", c)["bytes accessed"] - _layer_cost("mha", c)["bytes accessed"]
        for c in (case, "is_causal")
    }
    assert extra[case] - extra["is_causal"] <= MASK_BYTES[case] * B * N * N, extra


@pytest.mark.parametrize("case", LAYER_CASES)
def test_layer_forward_bytes_are_mha_plus_the_maps_passes(case: str) -> None:
    # The maps' passes (_maps_bytes_per_token) and what the mask may add. q's
    # projection bias in a pass of its own before q's map product (the old
    # code) exceeded it at every case: 1.04x for is_causal, 1.02x with a mask
    # (at the benchmark's B=4, N=1024, E=512: 1.069 -> 1.042 of MHA's bytes
    # for is_causal, 1.087 -> 1.061 with a mask).
    mask = 0 if case == "is_causal" else MASK_BYTES[case] * B * N * N
    extra = _layer_cost("damcha", case)["bytes accessed"] - _layer_cost("mha", case)["bytes accessed"]
    assert 0 < extra <= _maps_bytes_per_token() * B * N + mask, extra


# A layer's training step where the (B, H, N, N) scores, not the maps, decide
# the bytes (at N=64 the maps' per-token passes are as large as the scores).
GRAD_B, GRAD_N = 2, 256


def _layer_grad_cost(impl: str, case: str) -> dict[str, float]:
    mha = nnx.MultiHeadAttention(H, E, decode=False, rngs=nnx.Rngs(0))
    layer = mha if impl == "mha" else dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))
    causal = nnx.make_causal_mask(jnp.ones((GRAD_B, GRAD_N)))
    hint = {"mask_hint": "causal"} if impl == "damcha" and case.endswith("+hint") else {}

    def loss(m: nnx.Module, x: jax.Array, mask: jax.Array) -> jax.Array:
        y = m(x, is_causal=True) if case == "is_causal" else m(x, mask=mask, **hint)
        return jnp.mean(y**2)

    with jax.default_device(jax.devices("cpu")[0]):
        x = jnp.ones((GRAD_B, GRAD_N, E), jnp.float32)
        cost = nnx.jit(nnx.value_and_grad(loss)).lower(layer, x, causal).compile().cost_analysis()
    return cost[0] if isinstance(cost, list) else cost


@pytest.mark.parametrize("case", ["is_causal", "causal-mask+hint"])
def test_layer_training_step_bytes_are_not_above_mhas(case: str) -> None:
    # The attention's softmax under mapped_attention's checkpoint takes
    # jax.nn.softmax's own derivative rule (jax.softmax_custom_jvp): 0.85x
    # MHA's bytes here. With JAX's default autodiff of exp / sum the
    # checkpoint saved the exp behind a reduce_precision (a no-op XLA:CPU
    # keeps, a pass of its own over the scores): 1.06x here, 1.056x at the
    # benchmark's B=4, N=1024, E=512 (now 0.865x).
    damcha, mha = (_layer_grad_cost(impl, case)["bytes accessed"] for impl in ("damcha", "mha"))
    assert damcha <= mha, damcha / mha


# ---------------------------------------------------------- training memory
# XLA's memory estimate (memory_analysis().temp_size_in_bytes: activations and
# saved residuals) of a training step, DAMCHA beside MHA. A shape where the
# attention's tensors, not the tiny parameters, decide the peak (at B=2, N=64,
# E=64 the maps' (S, S) factors are as large as q and XLA's schedule dominates).
MEM_B, MEM_N, MEM_E, MEM_H, MEM_LAYERS = 2, 256, 256, 8, 2


def _train_temp(impl: str) -> int:
    def make() -> nnx.List:
        if impl == "mha":
            attns = [nnx.MultiHeadAttention(MEM_H, MEM_E, decode=False, rngs=nnx.Rngs(i)) for i in range(MEM_LAYERS)]
        else:
            config = dj.DamchaAttention(MEM_H, MEM_E, rngs=nnx.Rngs(0)).config
            shared = dj.make_metric_generators(config, rngs=nnx.Rngs(1))
            attns = [
                dj.DamchaAttention(MEM_H, MEM_E, metric_generator=shared, rngs=nnx.Rngs(2 + i))
                for i in range(MEM_LAYERS)
            ]
        return nnx.List([Block(a, nnx.Rngs(9), MEM_E, 2 * MEM_E) for a in attns])

    graphdef, state = nnx.split(nnx.eval_shape(make))

    def loss(state: Any, x: jax.Array) -> jax.Array:
        h = x
        for block in nnx.merge(graphdef, state):
            h = block(h)
        return jnp.mean(h**2)

    with jax.default_device(jax.devices("cpu")[0]):
        x = jax.ShapeDtypeStruct((MEM_B, MEM_N, MEM_E), jnp.float32)
        compiled = jax.jit(jax.value_and_grad(loss)).lower(state, x).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def test_training_memory_is_not_above_mhas() -> None:
    # The attention's backward needs q~ and k~, the maps' backward the
    # unmapped q and k: saving all four was 1.06x MHA's temp bytes here
    # (1.04x for the 6-layer benchmark models at N=1024). Under
    # _functional.mapped_attention's checkpoint q~ and k~ are recomputed in
    # the backward pass from q, k and the small maps (0.93x here).
    temp = {impl: _train_temp(impl) for impl in ("damcha", "mha")}
    assert temp["damcha"] <= temp["mha"], temp


# ------------------------------------------------------------ decode steps
# One cached decoding step (issue 12, "Decoding with a kv cache"), jitted with
# the cache donated as the benchmark's step is: the programs' thunks (the
# ENTRY computation's fusions, dots, custom calls and copies, each one
# dispatch of XLA:CPU's runtime), DAMCHA beside Flax's MHA.
DEC_B, DEC_LEN = 2, 16


def _thunks(text: str) -> list[str]:
    return re.findall(r"= \S+ (fusion|dot|custom-call|copy)\(", text[text.index("\nENTRY") :])


def _decode_thunks(impl: str) -> list[str]:
    x = jax.ShapeDtypeStruct((DEC_B, 1, E), jnp.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        mha = nnx.MultiHeadAttention(H, E, decode=True, rngs=nnx.Rngs(0))
        layer = mha if impl == "mha" else dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))
        if impl == "decode_step":
            config = layer.config
            cache = dj.init_cache(config, DEC_B, DEC_LEN, jnp.float32)
            fn = jax.jit(lambda c, x, p: dj.decode_step(p, config, c, x), donate_argnums=0)
            return _thunks(fn.lower(cache, x, layer.arrays()).compile().as_text())
        layer.init_cache((DEC_B, DEC_LEN, E))
        graphdef, cache, params = nnx.split(layer, nnx.Cache, ...)

        def step(cache: Any, x: jax.Array, params: Any) -> Any:
            m = nnx.merge(graphdef, cache, params)
            return m(x, decode=True), nnx.state(m, nnx.Cache)

        return _thunks(jax.jit(step, donate_argnums=0).lower(cache, x, params).compile().as_text())


@pytest.mark.parametrize("impl", ["damcha", "decode_step"])
def test_decode_step_adds_only_the_generators_thunks(impl: str) -> None:
    # What a step may add to MHA's: the generator's (the RMS reduction, its
    # GEMM, the scale and the coefficients). The maps' multiply-adds ride in
    # the cache update of k~ and the copy of q~ (cross_head_maps' terms);
    # as batched products they were a library call each, with k's and q's
    # bias adds and l in fusions of their own before them: 8 more than MHA
    # here, 7 at the benchmark's B=8, E=512, where a step is ~4 ms.
    extra = len(_decode_thunks(impl)) - len(_decode_thunks("mha"))
    assert 0 < extra <= 4, (extra, sorted(_decode_thunks(impl)))
