"""bench_dropin.py, PyTorch: the call patterns of issue 12 against ``nn.MultiheadAttention``.

Runs in its own worker process (``bench_dropin.py --worker torch``). Every
DAMCHA model here is made from the MHA model the way a user makes it
(``DamchaAttention.from_mha`` / ``replace_mha``: same weights), checked to
give MHA's output with its gates closed, then its gates are opened to 0.5 so
that it does its full work while timed.
"""

from __future__ import annotations

import copy
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _counts import mha_decode_step
from _harness import (
    Session,
    closed_gate_check,
    combined_check,
    comparison,
    decode_entry,
    decode_target,
    each_case,
    each_decode,
    interleaved,
    padded,
    parameter_check,
)
from torch import nn

import damcha_torch as dt

PORT = "torch"


def open_gates(model: nn.Module, value: float = 0.5) -> None:
    """Set every DAMCHA gate of ``model`` to ``value`` (0.5: the map does its full work)."""
    found = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "metric_gates" in name:
                p.fill_(value)
                found += 1
    if not found:
        raise RuntimeError(f"no DAMCHA gate found in {type(model).__name__}")


def without_mha_fastpath(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` with torch's MHA fast path off (``torch.backends.mha.set_fastpath_enabled``).

    In eval without gradients nn.MultiheadAttention and nn.TransformerEncoderLayer
    take torch's fused inference path, which drops ``is_causal`` and builds the
    (B, H, N, N) weights on CPU: slower than their SDPA path at every length
    measured here. DAMCHA has no such path, so its inference rows are also
    compared with MHA on its SDPA path (the faster of the two), where a ratio
    below 1 cannot come from MHA's slow default."""

    def off() -> Any:
        before = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            return call()
        finally:
            torch.backends.mha.set_fastpath_enabled(before)

    return off


# The second baseline of the forward/inference rows, its comparison's label.
NOFAST, NOFAST_LABEL = "mha-nofast", "time, MHA fast path off"


def _check(a: torch.Tensor, b: torch.Tensor, *, nonzero: bool = False) -> dict[str, Any]:
    return closed_gate_check(a.detach().float().numpy(), b.detach().float().numpy(), nonzero=nonzero)


def _train_check(damcha: nn.Module, mha: nn.Module, f_damcha: Callable, f_mha: Callable, inputs: tuple) -> dict:
    """What the fwd+bwd rows time, checked with closed gates: training-mode outputs and
    the gradients of every input equal MHA's."""
    results = []
    for model, fn in ((damcha, f_damcha), (mha, f_mha)):
        model.train()
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = fn(model, *leaves)
        results.append((out.detach(), torch.autograd.grad(out.sum(), leaves)))
        model.zero_grad(set_to_none=True)
    (out_d, grads_d), (out_m, grads_m) = results
    return {
        "train output": _check(out_d, out_m),
        **{f"input {i} gradient": _check(a, b, nonzero=True) for i, (a, b) in enumerate(zip(grads_d, grads_m))},
    }


# ------------------------------------------------------------------ layer


LAYER_CASES = {
    "mask+hint": {
        "call": "attn(x, x, x, attn_mask=causal_bool, is_causal=True, need_weights=False)",
        "baseline": "the same call",
    },
    "hint-only": {
        "call": "attn(x, x, x, is_causal=True, need_weights=False)",
        "baseline": "MHA with attn_mask=causal_bool, is_causal=True (nn.MultiheadAttention requires attn_mask "
        "with is_causal)",
    },
    "padding+causal": {
        "call": "attn(x, x, x, key_padding_mask=pad_bool, attn_mask=causal_bool, is_causal=True, need_weights=False)",
        "baseline": "the same call",
    },
    "encoder": {
        "call": "nn.TransformerEncoder(2 pre-norm layers)(x, mask=square_subsequent_mask, is_causal=True), "
        "after replace_mha",
        "baseline": "the same encoder before replace_mha",
    },
    "cross": {
        "call": "attn(x, c, c, attn_mask=rect_causal_bool (N, N/2), is_causal=True, need_weights=False)",
        "baseline": "the same call",
    },
    "encoder-mask-only": {
        "call": "nn.TransformerEncoder(2 pre-norm layers)(x, mask=square_subsequent_mask), after replace_mha "
        "(no is_causal: the encoder's own causal-mask detection sets the hint)",
        "baseline": "the same encoder before replace_mha",
    },
    "decoder": {
        "call": "nn.TransformerDecoder(2 pre-norm layers)(x, c, tgt_mask=square_subsequent_mask, "
        "tgt_is_causal=True), c of N/2 tokens, after replace_mha (self- and cross-attention)",
        "baseline": "the same decoder before replace_mha",
    },
}
LAYER_MODES = ("forward", "fwd+bwd")


def _layer_models(case: str, n: int, s: Any) -> tuple[nn.Module, nn.Module, Callable, Callable, tuple]:
    """(mha_model, damcha_model, mha_call, damcha_call, inputs); a call is f(model, *inputs) -> output."""
    B, E, H = s.B, s.E, s.H
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(B, n, E, generator=g)
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)  # True = masked out (nn.MultiheadAttention)
    if case in ("encoder", "encoder-mask-only"):
        layer = nn.TransformerEncoderLayer(E, H, s.ffn, dropout=0.0, batch_first=True, norm_first=True)
        mha = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        damcha = dt.replace_mha(copy.deepcopy(mha))
        square = nn.Transformer.generate_square_subsequent_mask(n)
        hint = True if case == "encoder" else None

        def enc(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return m(x, mask=square, is_causal=hint)

        return mha, damcha, enc, enc, (x,)
    if case == "decoder":
        layer = nn.TransformerDecoderLayer(E, H, s.ffn, dropout=0.0, batch_first=True, norm_first=True)
        mha = nn.TransformerDecoder(layer, 2)
        damcha = dt.replace_mha(copy.deepcopy(mha))
        square = nn.Transformer.generate_square_subsequent_mask(n)
        c = torch.randn(B, max(1, n // 2), E, generator=g)

        def dec(m: nn.Module, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return m(x, c, tgt_mask=square, tgt_is_causal=True)

        return mha, damcha, dec, dec, (x, c)
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    damcha = dt.DamchaAttention.from_mha(mha)
    if case == "cross":
        m = max(1, n // 2)
        c = torch.randn(B, m, E, generator=g)
        rect = torch.ones(n, m, dtype=torch.bool).triu(1)  # top-left causal, as SDPA's is_causal: no empty row

        def cross(mod: nn.Module, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return mod(x, c, c, attn_mask=rect, is_causal=True, need_weights=False)[0]

        return mha, damcha, cross, cross, (x, c)
    if case == "padding+causal":
        # Each sequence pads its last few keys; no query row loses every key.
        lengths = [n - padded(n, i) for i in range(B)]
        pad = torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]

        def with_padding(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return mod(x, x, x, key_padding_mask=pad, attn_mask=causal, is_causal=True, need_weights=False)[0]

        return mha, damcha, with_padding, with_padding, (x,)

    def hinted(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return mod(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]

    if case == "hint-only":

        def hint_only(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return mod(x, x, x, is_causal=True, need_weights=False)[0]

        return mha, damcha, hinted, hint_only, (x,)
    return mha, damcha, hinted, hinted, (x,)


def _runner(model: nn.Module, fn: Callable, inputs: tuple, mode: str) -> Callable[[], Any]:
    if mode == "forward":
        model.eval()

        def forward() -> Any:
            with torch.inference_mode():
                return fn(model, *inputs)

        return forward
    model.train()
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]  # each model its own leaves

    def train() -> None:
        fn(model, *leaves).sum().backward()
        for t in leaves:
            t.grad = None
        model.zero_grad(set_to_none=True)

    return train


def layer_section(ses: Session) -> None:
    each_case(ses, "layer", LAYER_CASES, ses.sizes.lengths, LAYER_MODES, functools.partial(_layer_case, ses))


def _layer_case(ses: Session, case: str, info: dict[str, str], n: int, todo: dict[str, str]) -> None:
    s = ses.sizes
    mha, damcha, f_mha, f_damcha, inputs = _layer_models(case, n, s)
    # Each timed callable checked with closed gates on the inputs it is timed on.
    mha.eval(), damcha.eval()
    with torch.inference_mode():
        expected = f_mha(mha, *inputs)
        checks = {
            "forward": combined_check(
                output=_check(f_damcha(damcha, *inputs), expected),
                # The second baseline computes what MHA's default path does.
                **{"mha fast path off": _check(without_mha_fastpath(lambda: f_mha(mha, *inputs))(), expected)},
            )
        }
    if "fwd+bwd" in todo:
        checks["fwd+bwd"] = combined_check(**_train_check(damcha, mha, f_damcha, f_mha, inputs))
    open_gates(damcha)
    for mode, entry_id in todo.items():
        calls = {
            "damcha": _runner(damcha, f_damcha, inputs, mode),
            "mha": _runner(mha, f_mha, inputs, mode),
        }
        if mode == "forward":
            calls[NOFAST] = without_mha_fastpath(_runner(mha, f_mha, inputs, mode))
        times = interleaved(calls, repeats=s.repeats(n), warmup=1)
        ses.record_timed(
            entry_id,
            "layer",
            case,
            mode,
            n,
            call=info["call"],
            baseline=info["baseline"],
            times=times,
            check=checks[mode],
            also=[(NOFAST_LABEL, NOFAST)] if mode == "forward" else [],
        )


# ----------------------------------------------------------------- decode


def _decode_models(depth: str, s: Any) -> dict[str, Any]:
    """The MHA and DAMCHA decoders of one depth, their step functions and cache factories.

    "layer": one self-attention layer fed random token vectors. "stack": a
    small greedy LM, embedding -> ``stack_layers`` pre-norm blocks (attention,
    FFN) -> LayerNorm -> vocabulary head -> argmax -> next token; DAMCHA's
    layers share one generator.
    """
    E, H = s.E, s.H
    torch.manual_seed(0)
    layers = 1 if depth == "layer" else s.stack_layers
    mhas = [nn.MultiheadAttention(E, H, batch_first=True).eval() for _ in range(layers)]
    first = dt.DamchaAttention.from_mha(mhas[0])
    shared = dict(first.metric_generators)
    damchas = [first] + [dt.DamchaAttention.from_mha(m, metric_generator=shared) for m in mhas[1:]]
    for m in damchas:
        m.eval()

    def mha_attn(i: int, h: torch.Tensor, caches: list) -> torch.Tensor:
        return mha_decode_step(mhas[i], h, caches[i])

    def damcha_attn(i: int, h: torch.Tensor, caches: list) -> torch.Tensor:
        return damchas[i](h, h, h, is_causal=True, need_weights=False, kv_cache=caches[i])[0]

    # Two MHA baselines on the same step code: the usual cache by torch.cat, and
    # DAMCHA's own preallocated in-place cache, which isolates DAMCHA's per-token work.
    new_caches = {
        "mha": lambda: [[] for _ in mhas],
        "mha-prealloc": lambda: [dt.DamchaKVCache() for _ in mhas],
        "damcha": lambda: [dt.DamchaKVCache() for _ in damchas],
    }
    if depth == "layer":
        steps = {
            "mha": lambda x, c: mha_attn(0, x, c),
            "mha-prealloc": lambda x, c: mha_attn(0, x, c),
            "damcha": lambda x, c: damcha_attn(0, x, c),
        }
        return {"steps": steps, "caches": new_caches, "greedy": False, "modules": mhas + damchas}
    norms1 = nn.ModuleList(nn.LayerNorm(E) for _ in range(layers))
    norms2 = nn.ModuleList(nn.LayerNorm(E) for _ in range(layers))
    ffns = nn.ModuleList(nn.Sequential(nn.Linear(E, s.ffn), nn.GELU(), nn.Linear(s.ffn, E)) for _ in range(layers))
    embed, norm, head = nn.Embedding(s.vocab, E), nn.LayerNorm(E), nn.Linear(E, s.vocab)

    def lm(attn: Callable) -> Callable:
        def step(ids: torch.Tensor, caches: list) -> torch.Tensor:
            h = embed(ids)
            for i in range(layers):
                h = h + attn(i, norms1[i](h), caches)
                h = h + ffns[i](norms2[i](h))
            return head(norm(h[:, -1:]))  # logits of the last position

        return step

    steps = {"mha": lm(mha_attn), "mha-prealloc": lm(mha_attn), "damcha": lm(damcha_attn)}
    return {
        "steps": steps,
        "caches": new_caches,
        "greedy": True,
        "modules": mhas + damchas + [norms1, norms2, ffns, embed, norm, head],
    }


def _decode_call(
    step: Callable, new_cache: Callable, prompt: torch.Tensor, tokens: torch.Tensor | None, steps: int, greedy: bool
) -> Callable[[], tuple[float, float]]:
    """One decode: the prompt in one call (untimed), then ``steps`` single-token steps (timed, per token)."""

    def call() -> tuple[float, float]:
        with torch.inference_mode():
            caches = new_cache()
            out = step(prompt, caches)
            w0, c0 = time.perf_counter(), time.process_time()
            for i in range(steps):
                nxt = out.argmax(-1) if greedy else tokens[:, i : i + 1]  # type: ignore[index]
                out = step(nxt, caches)
            return (time.perf_counter() - w0) / steps, (time.process_time() - c0) / steps

    return call


def _decode_outputs(
    steps: dict[str, Callable],
    caches: dict[str, Callable],
    prompt: torch.Tensor,
    tokens: torch.Tensor | None,
    greedy: bool,
) -> dict[str, torch.Tensor]:
    """Each step function's output after the prompt and 2 steps, the same tokens fed to all."""
    outs = {}
    with torch.inference_mode():
        for impl, step in steps.items():
            cache = caches[impl.removesuffix("-compiled")]()
            out = step(prompt, cache)
            for i in range(2):
                nxt = prompt[:, i : i + 1] if greedy else tokens[:, i : i + 1]  # type: ignore[index]
                out = step(nxt, cache)
            outs[impl] = out
    return outs


def decode_section(ses: Session) -> None:
    each_decode(ses, functools.partial(_decode_case, ses))


def _decode_case(ses: Session, depth: str, B: int, entry_id: str) -> None:
    s = ses.sizes
    models = _decode_models(depth, s)
    g = torch.Generator().manual_seed(B)
    if models["greedy"]:
        prompt = torch.randint(0, s.vocab, (B, s.prompt), generator=g)
        tokens = None
    else:
        prompt = torch.randn(B, s.prompt, s.E, generator=g)
        tokens = torch.randn(B, s.steps, s.E, generator=g)
    # The eager steps and their torch.compile'd versions (the cache length becomes
    # a dynamic dim after two sizes, so the steps do not recompile per token).
    # --tiny compiles with the "eager" backend: dynamo's tracing without inductor.
    backend = "eager" if s.tiny else "inductor"
    # A fresh dynamo cache per entry: the step functions share code objects across
    # entries, and recompiles past the limit would silently fall back to eager.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # The stack's step functions share one code object, and two of them grow a
    # DamchaKVCache (a few graphs each while the storage grows): room for both,
    # so neither falls back to eager at dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    steps = dict(models["steps"])
    steps.update({f"{impl}-compiled": torch.compile(step, backend=backend) for impl, step in models["steps"].items()})
    # Every timed step (eager and compiled, both caches) checked with closed gates: DAMCHA's
    # decode reproduces MHA's, and each MHA baseline the plain one.
    outs = _decode_outputs(steps, models["caches"], prompt, tokens, models["greedy"])
    check = combined_check(
        **{impl: _check(out, outs["mha"]) for impl, out in outs.items() if impl != "mha"},
    )
    for m in models["modules"]:
        if isinstance(m, dt.DamchaAttention):
            open_gates(m)
    calls = {
        impl: _decode_call(
            step, models["caches"][impl.removesuffix("-compiled")], prompt, tokens, s.steps, models["greedy"]
        )
        for impl, step in steps.items()
    }
    times = interleaved(calls, repeats=s.decode_repeats(), warmup=1, self_timed=True)
    compile_stats = {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if k in ("stats", "frames")}
    target = decode_target(B)
    what = (
        "one self-attention layer, random token vectors"
        if depth == "layer"
        else f"greedy LM: embedding, {s.stack_layers} pre-norm blocks (attention + FFN {s.ffn}), "
        f"head over {s.vocab} tokens; DAMCHA layers share one generator"
    )
    ses.record(
        decode_entry(
            entry_id,
            depth,
            B,
            s,
            call=f"{what}; DAMCHA: layer(x, x, x, is_causal=True, need_weights=False, kv_cache=DamchaKVCache())",
            baseline="hand-written MHA step on the same weights (packed projection, one SDPA call; "
            "_counts.mha_decode_step), with its cache by torch.cat (mha) and in DamchaKVCache's "
            "preallocated storage (mha-prealloc)",
            compile_backend=backend,
            compile_stats=compile_stats,
            times=times,
            check=check,
            comparisons=[
                comparison("eager", times, "damcha", "mha", target),
                # The same step with the same in-place cache: DAMCHA's own per-token work.
                comparison("eager, same cache", times, "damcha", "mha-prealloc", target),
                # Issue 12 sets the B=1 target for eager steps; B>1 targets hold for any step.
                comparison("compiled", times, "damcha-compiled", "mha-compiled", None if B == 1 else target),
                comparison(
                    "compiled, same cache",
                    times,
                    "damcha-compiled",
                    "mha-prealloc-compiled",
                    None if B == 1 else target,
                ),
                comparison("compiled/eager", times, "damcha-compiled", "damcha", 1.0),
                comparison("mha compiled/eager", times, "mha-prealloc-compiled", "mha-prealloc", None),
            ],
        )
    )


# ------------------------------------------------------------------ model


class CausalLM(nn.Module):
    """A decoder-only LM from torch's own blocks: token + learned position
    embeddings, ``nn.TransformerEncoder`` of pre-norm layers run with a causal
    mask and ``is_causal=True``, final LayerNorm, vocabulary head."""

    def __init__(self, s: Any, layers: int, max_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(s.vocab, s.E)
        self.pos = nn.Embedding(max_len, s.E)
        self.body = encoder(s, layers)
        self.head = nn.Linear(s.E, s.vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        h = self.tok(ids) + self.pos.weight[:n]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device, dtype=h.dtype)
        return self.head(self.body(h, mask=mask, is_causal=True))


def encoder(s: Any, layers: int) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(s.E, s.H, s.ffn, dropout=0.0, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(s.E), enable_nested_tensor=False)


MODEL_MODES = ("inference", "train")
MODELS = {
    "encoder": "nn.TransformerEncoder, {L} pre-norm layers (FFN {F}) + final LayerNorm, no mask",
    "lm": "decoder-only LM: embeddings, nn.TransformerEncoder of {L} pre-norm layers with "
    "mask=square_subsequent_mask, is_causal=True, LayerNorm, head over {V} tokens",
}


def _model(kind: str, impl: str, n: int, s: Any) -> tuple[nn.Module, torch.Tensor]:
    """The model (DAMCHA: ``replace_mha`` of the MHA model, one shared generator, gates 0.5) and its input."""
    torch.manual_seed(0)
    model = encoder(s, s.model_layers) if kind == "encoder" else CausalLM(s, s.model_layers, n)
    if impl == "damcha":
        shared = dt.MetricGenerator(s.E, s.H, s.E // s.H)
        dt.replace_mha(model, metric_generator=shared)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(s.B, n, s.E, generator=g) if kind == "encoder" else torch.randint(0, s.vocab, (s.B, n), generator=g)
    return model, x


def _loss(model: nn.Module, x: torch.Tensor, kind: str) -> torch.Tensor:
    """The train rows' loss (timed, and checked with closed gates): next-token
    cross-entropy for the LM, the encoder's distance to its input (mean(y**2) of the
    final LayerNorm's output is about 1 whatever the layers do, which left every
    gradient below that norm near zero)."""
    out = model(x)
    if kind == "lm":
        V = out.shape[-1]
        return F.cross_entropy(out[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
    return (out - x).pow(2).mean()


def _model_call(model: nn.Module, x: torch.Tensor, kind: str, mode: str) -> Callable[[], Any]:
    if mode == "inference":
        model.eval()

        def infer() -> Any:
            with torch.inference_mode():
                return model(x)

        return infer
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        _loss(model, x, kind).backward()
        opt.step()

    return step


def _model_train_check(damcha: nn.Module, mha: nn.Module, x: torch.Tensor, kind: str) -> dict[str, Any]:
    """What the train rows time, checked with closed gates: the loss and the gradient of
    every MHA-model parameter (by name; DAMCHA keeps MHA's names) equal MHA's, and
    the attention layers' own gradients on their own scale."""
    grads, losses = [], []
    for model in (damcha, mha):
        model.train()
        model.zero_grad(set_to_none=True)
        loss = _loss(model, x, kind)
        loss.backward()
        losses.append(loss.detach().reshape(1))
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    ours, theirs = ({k: g.float().numpy() for k, g in sorted(grad.items())} for grad in grads)
    return {
        "loss": _check(losses[0], losses[1]),
        "parameter gradients": parameter_check(ours, theirs),
        "attention gradients": parameter_check(ours, theirs, [k for k in theirs if ".self_attn." in k]),
    }


def memory_worker(kind: str, impl: str, n: int, mode: str, s: Any) -> dict[str, Any]:
    """Peak RSS increase of one call of one model, in this fresh process (``NOFAST``:
    the MHA model with torch's MHA fast path off)."""
    from _harness import measure_peak

    model, x = _model(kind, "mha" if impl == NOFAST else impl, n, s)
    if impl == "damcha":
        open_gates(model)
    call = _model_call(model, x, kind, mode)
    return {"peak_mib": measure_peak(without_mha_fastpath(call) if impl == NOFAST else call)}


def model_section(ses: Session) -> None:
    each_case(ses, "model", MODELS, ses.sizes.model_lengths, MODEL_MODES, functools.partial(_model_case, ses))


def _model_case(ses: Session, kind: str, text: str, n: int, todo: dict[str, str]) -> None:
    s = ses.sizes
    mha, x = _model(kind, "mha", n, s)
    damcha, _ = _model(kind, "damcha", n, s)
    damcha.load_state_dict(mha.state_dict(), strict=False)  # MHA's weights; gates 0, fresh generator
    mha.eval(), damcha.eval()
    with torch.inference_mode():
        expected = mha(x)
        checks = {
            "inference": combined_check(
                output=_check(damcha(x), expected),
                **{"mha fast path off": _check(without_mha_fastpath(lambda: mha(x))(), expected)},
            )
        }
    if "train" in todo:
        checks["train"] = combined_check(**_model_train_check(damcha, mha, x, kind))
    open_gates(damcha)
    for mode, entry_id in todo.items():
        calls = {"damcha": _model_call(damcha, x, kind, mode), "mha": _model_call(mha, x, kind, mode)}
        if mode == "inference":
            calls[NOFAST] = without_mha_fastpath(_model_call(mha, x, kind, mode))
        times = interleaved(calls, repeats=s.model_repeats(n), warmup=1)
        check = checks[mode]
        ses.record_timed(
            entry_id,
            "model",
            kind,
            mode,
            n,
            call=text.format(L=s.model_layers, F=s.ffn, V=s.vocab)
            + (
                "; train: SGD step on " + ("next-token cross-entropy" if kind == "lm" else "mean((y - x)^2)")
                if mode == "train"
                else "; inference: eval() under torch.inference_mode"
            ),
            baseline="the same model with nn.MultiheadAttention (DAMCHA: replace_mha(model, "
            "metric_generator=one shared MetricGenerator))",
            times=times,
            check=check,
            memory="peak RSS increase (VmHWM) of one call after a warm-up call, each model in a "
            "fresh process, MALLOC_MMAP_THRESHOLD_=65536",
            # --tiny measures nothing: one worker process checks that path.
            in_process=functools.partial(memory_worker, kind, n=n, mode=mode, s=s) if s.tiny else None,
            also=[(NOFAST_LABEL, NOFAST)] if mode == "inference" else [],
        )


SECTIONS = {"layer": layer_section, "decode": decode_section, "model": model_section}


def setup(threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    from damcha_torch import _functional as fn

    if os.environ.get("DAMCHA_BENCH_TORCH_OPS") == "1":
        # The decoding step's map by torch ops, as without the C kernel: the
        # before/after comparison on one machine (docs/benchmarks.md).
        fn._HEADMIX = None
    return {
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "dtype": "float32",
        "device": "cpu",
        # Which path mapped the decoding steps (damcha_torch.has_decode_kernel()).
        "decode_kernel": "c" if fn._HEADMIX is not None else "torch-ops",
    }
