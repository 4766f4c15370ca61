"""A whole model's compiled cost, DAMCHA beside the same model with Flax's MHA
(issue 12, "whole models"): XLA's own counts of the compiled programs, never
timings.

The model is a small pre-norm encoder whose DAMCHA layers share one metric
generator, as in ``benchmarks/_dropin_jax.py``. What DAMCHA may add to it is
the maps' own work: the generator (a GEMM and an RMS scale over the tokens,
per layer), the S x S coefficients, and one (S, S) @ (S, d) product per token
for each of q and k (and their derivatives in training). Anything beyond that
(a second pass over q or k, a per-token loop of tiny matrix products, the
generator's gradient done per copy) is a defect these tests catch.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import damcha_jax as dj

B, N, E, H, FFN, LAYERS = 2, 128, 128, 8, 256, 2
D = E // H
TOKENS = B * N * LAYERS  # token-layers: every per-token cost below is multiplied by this


class Block(nnx.Module):
    def __init__(self, attn: nnx.Module, rngs: nnx.Rngs) -> None:
        self.ln1, self.ln2 = nnx.LayerNorm(E, rngs=rngs), nnx.LayerNorm(E, rngs=rngs)
        self.attn = attn
        self.fc1, self.fc2 = nnx.Linear(E, FFN, rngs=rngs), nnx.Linear(FFN, E, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        h = h + self.attn(self.ln1(h))
        return h + self.fc2(nnx.gelu(self.fc1(self.ln2(h))))


def _encoder(impl: str) -> nnx.List:
    if impl == "mha":
        attns = [nnx.MultiHeadAttention(H, E, decode=False, rngs=nnx.Rngs(i)) for i in range(LAYERS)]
    else:
        config = dj.DamchaAttention(H, E, rngs=nnx.Rngs(0)).config
        shared = dj.make_metric_generators(config, rngs=nnx.Rngs(1))
        attns = [dj.DamchaAttention(H, E, metric_generator=shared, rngs=nnx.Rngs(2 + i)) for i in range(LAYERS)]
        for attn in attns:  # open gates: a gate at 0 must not be what keeps the cost low
            attn.metric["qk"].gate[...] = jnp.full((H,), 0.5)
    return nnx.List([Block(a, nnx.Rngs(9)) for a in attns])


_COMPILED: dict[tuple[str, str], Any] = {}


def _compiled(impl: str, mode: str) -> Any:
    """The compiled forward ("inference") or value-and-grad ("train") on the CPU backend."""
    if (impl, mode) not in _COMPILED:
        graphdef, state = nnx.split(_encoder(impl))

        def forward(state: Any, x: jax.Array) -> jax.Array:
            h = x
            for block in nnx.merge(graphdef, state):
                h = block(h)
            return h

        fn = forward if mode == "inference" else jax.value_and_grad(lambda s, x: jnp.mean(forward(s, x) ** 2))
        with jax.default_device(jax.devices("cpu")[0]):
            x = jnp.ones((B, N, E), jnp.float32)
            _COMPILED[impl, mode] = jax.jit(fn).lower(state, x).compile()
    return _COMPILED[impl, mode]


def _cost(impl: str, mode: str) -> dict[str, float]:
    cost = _compiled(impl, mode).cost_analysis()
    return cost[0] if isinstance(cost, list) else cost


def _unfused_dots(impl: str, mode: str) -> list[str]:
    """Shapes of the dots XLA:CPU left outside its library fusions: each runs
    as a loop over its batch of matrix products (one per token for a per-token
    product)."""
    text = _compiled(impl, mode).as_text()
    entry = text[text.index("\nENTRY") :]
    return re.findall(r"= (\S+) dot\(", entry)


def test_training_step_has_no_per_token_loop_of_matrix_products() -> None:
    # Plain autodiff of q~ = l(t) q gave q's gradient as l^T g contracting l's
    # row axis, which XLA:CPU ran as 4 such loops here (one per side and layer).
    assert sorted(_unfused_dots("damcha", "train")) == sorted(_unfused_dots("mha", "train"))


def test_training_step_flops_are_mha_plus_the_maps_own_work() -> None:
    S = H
    # Per token and layer: generator GEMM E*S*S (forward, and its two
    # gradient GEMMs), the (S,S)@(S,d) product for q and k (forward, and the
    # gradients of l and of y for each); 2 flops per multiply-add.
    maps = 3 * 2 * E * S * S + 2 * 3 * 2 * S * S * D
    extra = _cost("damcha", "train")["flops"] - _cost("mha", "train")["flops"]
    assert 0.8 * maps * TOKENS <= extra <= 1.2 * maps * TOKENS, (extra, maps * TOKENS)


def test_forward_bytes_are_mha_plus_the_generators_passes() -> None:
    S = H
    # The generator reads the tokens twice (its GEMM and its RMS scale; XLA
    # writes the LayerNorm output once more for the second), and its S*S
    # coefficients are written once and read by the q and k passes (budget
    # 8 S*S for both). The maps themselves fuse into the passes MHA makes over
    # q and k anyway; a separate map pass costs 4 S*d more per token and side.
    budget = 4 * (4 * E + 8 * S * S) * TOKENS
    extra = _cost("damcha", "inference")["bytes accessed"] - _cost("mha", "inference")["bytes accessed"]
    assert 0 < extra <= budget, (extra, budget)
