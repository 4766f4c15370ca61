"""Operation counts of one call, DAMCHA beside its framework's MHA (no timing).

On a shared machine timings are noise; the number of aten calls (torch) or
jaxpr equations (JAX) of one call is exact and repeatable, and it is what the
per-token overhead of a small call (a B=1 decode step, N=256) is made of.

    .venv/bin/python benchmarks/_counts.py                      # every case, torch and JAX
    .venv/bin/python benchmarks/_counts.py --port torch --case decode --detail

Library use (tests import this file: ``sys.path.insert(0, "benchmarks")``
then ``import _counts``; it imports nothing else from benchmarks/):

- ``torch_op_counts(fn)``: Counter of the aten operators ``fn()`` dispatches
  (``TorchDispatchMode``: the calls below autograd, backward ops too when
  ``fn`` runs backward). With autograd on, composite ops (``linear``,
  ``scaled_dot_product_attention``) arrive decomposed into their kernels;
  under ``torch.inference_mode`` they arrive whole, one count each.
- ``torch_sdpa_calls(fn)``: every scaled-dot-product-attention kernel call of
  ``fn()`` with its ``is_causal`` flag and whether it got a mask.
- ``mha_decode_step(mha, x, cache)``: the usual hand-written decode step on
  ``nn.MultiheadAttention``'s weights (the baseline of the decode benchmarks).
- ``jax_eqn_counts(fn, *args)``: Counter of the primitives in ``fn``'s jaxpr,
  nested jaxprs (pjit, custom_jvp, scan, cond...) counted recursively.
- ``jax_hlo_op_count(fn, *args)``: instructions in the entry computation of
  the compiled XLA module (after fusion: about the kernels run per call).
- ``side_by_side(columns)``: a text table of Counters, one column each.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "jax_eqn_counts",
    "jax_hlo_op_count",
    "mha_decode_step",
    "side_by_side",
    "torch_op_counts",
    "torch_sdpa_calls",
]

# scaled_dot_product_attention and the aten kernels it dispatches to on each device.
SDPA_KERNELS = (
    "scaled_dot_product_attention",  # reaches the mode undecomposed under inference_mode
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_fused_attention_overrideable",
)


# --------------------------------------------------------------------- torch


def _recorder(record: Callable[[Any, tuple, dict], None]):
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            record(func, args, kwargs)
            return func(*args, **kwargs)

    return _Record()


def torch_op_counts(fn: Callable[[], Any]) -> Counter[str]:
    """Counter of the aten operators ``fn()`` runs, keyed ``"aten.name"`` (overloads merged)."""
    counts: Counter[str] = Counter()

    def record(func: Any, args: tuple, kwargs: dict) -> None:
        counts[func._schema.name.replace("::", ".")] += 1  # "aten.add": overloads merged

    with _recorder(record):
        fn()
    return counts


def torch_sdpa_calls(fn: Callable[[], Any]) -> list[dict[str, Any]]:
    """Each SDPA kernel call of ``fn()``: ``{"op", "is_causal", "has_mask", "q_shape"}``."""
    calls: list[dict[str, Any]] = []

    def record(func: Any, args: tuple, kwargs: dict) -> None:
        name = func.overloadpacket.__name__
        if name not in SDPA_KERNELS:
            return
        values = dict(zip([a.name for a in func._schema.arguments], args))
        values.update(kwargs)
        calls.append(
            {
                "op": name,
                "is_causal": bool(values.get("is_causal", False)),
                "has_mask": values.get("attn_mask") is not None,
                "q_shape": tuple(args[0].shape) if args else None,
            }
        )

    with _recorder(record):
        fn()
    return calls


def mha_decode_step(mha: Any, x: Any, cache: Any) -> Any:
    """One incremental step of the usual hand-written decoder around ``nn.MultiheadAttention``.

    Packed q/k/v projection, cache by concatenation (``cache`` is a list,
    empty at the start, then ``[k, v]`` of shape (B, H, P, d)) or, when
    ``cache`` is a ``damcha_torch.DamchaKVCache``, in its preallocated storage
    (``cache.update``: the same in-place appends as a DAMCHA step), one SDPA call
    with a bottom-right causal mask (none for a single new token), output
    projection. ``x`` is (B, T, E) (``batch_first``); returns (B, T, E).
    """
    import torch
    import torch.nn.functional as F

    B, T, E = x.shape
    H = mha.num_heads
    q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).view(B, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
    if not isinstance(cache, list):
        k, v = cache.update(k, v)
    else:
        if cache:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        cache[:] = [k, v]
    if T == 1:  # one new token sees every cached key: no mask at all
        o = F.scaled_dot_product_attention(q, k, v)
    else:
        P = k.shape[2] - T
        mask = torch.ones(T, P + T, dtype=torch.bool, device=x.device).tril(P)  # bottom-right causal
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.linear(o.transpose(1, 2).reshape(B, T, E), mha.out_proj.weight, mha.out_proj.bias)


# ----------------------------------------------------------------------- JAX


def _sub_jaxprs(params: Mapping[str, Any]):
    from jax import core as jcore

    extend = getattr(jcore, "ClosedJaxpr", None)
    for value in params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if extend is not None and isinstance(item, extend):
                yield item.jaxpr
            elif hasattr(item, "eqns") and hasattr(item, "invars"):
                yield item
            elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                yield item.jaxpr


def _count_jaxpr(jaxpr: Any, counts: Counter[str]) -> None:
    for eqn in jaxpr.eqns:
        subs = list(_sub_jaxprs(eqn.params))
        if subs:  # a call-like primitive: count what it runs, not the wrapper
            for sub in subs:
                _count_jaxpr(sub, counts)
        else:
            counts[eqn.primitive.name] += 1


def jax_eqn_counts(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Counter[str]:
    """Counter of primitives in ``jax.make_jaxpr(fn)(*args, **kwargs)``, nested jaxprs inlined."""
    import jax

    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    counts: Counter[str] = Counter()
    _count_jaxpr(closed.jaxpr, counts)
    return counts


def jax_hlo_op_count(fn: Callable[..., Any], *args: Any) -> int:
    """Instructions in the ENTRY computation of ``jax.jit(fn)`` compiled for ``args``
    (parameters, tuples and constants excluded): about the kernels run per call."""
    import jax

    text = jax.jit(fn).lower(*args).compile().as_text()
    count, inside = 0, False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("ENTRY "):
            inside = True
            continue
        if inside:
            if stripped.startswith("}"):
                break
            if "=" in stripped and not any(
                f" {op}(" in stripped for op in ("parameter", "tuple", "constant", "get-tuple-element", "bitcast")
            ):
                count += 1
    return count


# --------------------------------------------------------------------- report


def side_by_side(columns: Mapping[str, Counter[str]], *, detail: bool = True) -> str:
    """A text table: one row per operator (when ``detail``), one column per Counter, totals last."""
    names = list(columns)
    width = max([len("total")] + [len(k) for c in columns.values() for k in c]) if detail else len("total")
    head = f"{'op':<{width}} " + " ".join(f"{n:>12}" for n in names)
    lines = [head, "-" * len(head)]
    if detail:
        ops = sorted({k for c in columns.values() for k in c}, key=lambda k: (-max(c[k] for c in columns.values()), k))
        for op in ops:
            lines.append(f"{op:<{width}} " + " ".join(f"{columns[n][op]:>12}" for n in names))
        lines.append("-" * len(head))
    lines.append(f"{'total':<{width}} " + " ".join(f"{sum(columns[n].values()):>12}" for n in names))
    return "\n".join(lines)


# ------------------------------------------------------------------- the CLI


def _torch_cases(n: int, batch: int, embed: int, heads: int) -> dict[str, dict[str, Callable[[], Any]]]:
    import torch
    from torch import nn

    from damcha_torch import DamchaAttention, DamchaKVCache

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(embed, heads, batch_first=True)
    damcha = DamchaAttention.from_mha(mha)
    with torch.no_grad():
        for name, p in damcha.named_parameters():
            if "metric_gates" in name:
                p.fill_(0.5)
    x = torch.randn(batch, n, embed)
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)  # True = masked out, as nn.MultiheadAttention

    def forward(layer: nn.Module, **kw: Any) -> Callable[[], Any]:
        def call() -> Any:
            layer.eval()
            with torch.inference_mode():
                return layer(x, x, x, need_weights=False, **kw)[0]

        return call

    def train(layer: nn.Module, **kw: Any) -> Callable[[], Any]:
        xg = x.clone().requires_grad_(True)

        def call() -> Any:
            layer.train()
            layer(xg, xg, xg, need_weights=False, **kw)[0].sum().backward()

        return call

    def decode(step: Callable[[Any, Any], Any], new_cache: Callable[[], Any]) -> Callable[[], Any]:
        # The counts of one steady-state single-token step: after a prompt of n
        # tokens and one token step (DAMCHA's flat path starts once a shape is seen).
        g = torch.Generator().manual_seed(1)
        prompt, first = torch.randn(1, n, embed, generator=g), torch.randn(1, 1, embed, generator=g)
        token = torch.randn(1, 1, embed, generator=g)
        state: dict[str, Any] = {}

        def prepare() -> None:
            with torch.inference_mode():
                state["cache"] = new_cache()
                step(prompt, state["cache"])
                step(first, state["cache"])

        def call() -> Any:
            with torch.inference_mode():
                return step(token, state["cache"])

        call.prepare = prepare  # type: ignore[attr-defined]
        return call

    mha.eval(), damcha.eval()
    hint = {"attn_mask": causal, "is_causal": True}
    return {
        "forward": {
            "mha": forward(mha, **hint),
            "damcha": forward(damcha, **hint),
            "damcha is_causal only": forward(damcha, is_causal=True),
        },
        "fwd+bwd": {
            "mha": train(mha, **hint),
            "damcha": train(damcha, **hint),
            "damcha is_causal only": train(damcha, is_causal=True),
        },
        "decode": {
            "mha": decode(lambda t, c: mha_decode_step(mha, t, c), list),
            "mha, preallocated cache": decode(lambda t, c: mha_decode_step(mha, t, c), DamchaKVCache),
            "damcha": decode(
                lambda t, c: damcha(t, t, t, is_causal=True, need_weights=False, kv_cache=c)[0], DamchaKVCache
            ),
        },
    }


def _jax_cases(n: int, batch: int, embed: int, heads: int) -> dict[str, dict[str, tuple]]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import damcha_jax as dj

    mha = nnx.MultiHeadAttention(heads, embed, decode=False, rngs=nnx.Rngs(0))
    damcha = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))
    for _, module in nnx.iter_modules(damcha):
        if isinstance(module, dj.CrossHeadMap):
            module.gate[...] = jnp.full(module.gate.shape, 0.5, module.gate[...].dtype)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, n, embed)), jnp.float32)
    mask = nnx.make_causal_mask(jnp.ones((batch, n)))

    def forward(module: Any) -> tuple:
        graphdef, state = nnx.split(module)
        return (lambda s, x, m: nnx.merge(graphdef, s)(x, mask=m)), (state, x, mask)

    def grad(module: Any) -> tuple:
        graphdef, state = nnx.split(module)

        def loss(s, x, m):
            return jnp.sum(nnx.merge(graphdef, s)(x, mask=m) ** 2)

        return jax.grad(loss, argnums=(0, 1)), (state, x, mask)

    config = damcha.config
    params = damcha.arrays()
    cache = dj.init_cache(config, 1, n + 1, jnp.float32)
    cache = dict(cache, index=jnp.asarray(n, jnp.int32))
    token = x[:1, :1]

    mha_dec = nnx.MultiHeadAttention(heads, embed, decode=True, rngs=nnx.Rngs(0))
    mha_dec.init_cache((1, n + 1, embed))
    mha_dec.cache_index[...] = jnp.asarray(n, jnp.int32)
    graphdef, state = nnx.split(mha_dec)

    def mha_step(s, t):
        module = nnx.merge(graphdef, s)
        return module(t, decode=True), nnx.state(module)

    return {
        "forward": {"mha": forward(mha), "damcha": forward(damcha)},
        "grad": {"mha": grad(mha), "damcha": grad(damcha)},
        "decode": {
            "mha": (mha_step, (state, token)),
            "damcha": (lambda p, c, t: dj.decode_step(p, config, c, t), (params, cache, token)),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", choices=("torch", "jax", "all"), default="all")
    parser.add_argument("--case", action="append", help="forward, fwd+bwd / grad, decode (default: all)")
    parser.add_argument("-n", "--length", type=int, default=64, help="sequence length (decode: prompt length)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--detail", action="store_true", help="one row per operator, not just totals")
    parser.add_argument("--hlo", action="store_true", help="JAX: also count the compiled XLA entry instructions")
    args = parser.parse_args(argv)
    if args.port in ("torch", "all"):
        for case, calls in _torch_cases(args.length, args.batch, args.embed, args.heads).items():
            if args.case and case not in args.case:
                continue
            columns = {}
            for name, call in calls.items():
                if hasattr(call, "prepare"):
                    call.prepare()
                columns[name] = torch_op_counts(call)
            sdpa = {name: torch_sdpa_calls(call) for name, call in calls.items() if not hasattr(call, "prepare")}
            print(
                f"\n# torch, {case}: aten calls of one call (N={args.length}, B={args.batch}, E={args.embed}, "
                f"H={args.heads})"
            )
            print(side_by_side(columns, detail=args.detail))
            for name, found in sdpa.items():
                print(
                    f"  {name}: SDPA "
                    + (
                        ", ".join(f"{c['op']}(is_causal={c['is_causal']}, mask={c['has_mask']})" for c in found)
                        or "not called"
                    )
                )
    if args.port in ("jax", "all"):
        for case, calls in _jax_cases(args.length, args.batch, args.embed, args.heads).items():
            if args.case and case not in args.case:
                continue
            print(f"\n# JAX, {case}: jaxpr equations (N={args.length}, B={args.batch}, E={args.embed}, H={args.heads})")
            print(side_by_side({name: jax_eqn_counts(fn, *a) for name, (fn, a) in calls.items()}, detail=args.detail))
            if args.hlo:
                print(
                    "  compiled entry instructions: "
                    + ", ".join(f"{name} {jax_hlo_op_count(fn, *a)}" for name, (fn, a) in calls.items())
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
