"""bench_dropin.py, JAX / Flax NNX: the issue-12 call patterns against ``nnx.MultiHeadAttention``.

Runs in its own worker process (``bench_dropin.py --worker jax``). Masks are
built the way Flax users build them (``nnx.make_causal_mask``,
``nnx.combine_masks``), the calls are jitted the way NNX users jit them
(``nnx.jit``, ``nnx.value_and_grad``). DAMCHA layers carry the MHA's
projections (``from_mha``, or a copy of the four ``LinearGeneral`` kernels
where a shared generator is needed), are checked to give MHA's output with
their gates closed, then their gates are opened to 0.5.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _harness import (
    Session,
    closed_gate_check,
    combined_check,
    comparison,
    compiled_memory,
    decode_entry,
    decode_target,
    each_case,
    each_decode,
    entry,
    interleaved,
    padded,
    parameter_check,
    time_target,
    xla_memory_record,
)
from flax import nnx, traverse_util

import damcha_jax as dj

PORT = "jax"


def open_gates(model: nnx.Module, value: float = 0.5) -> None:
    found = 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, dj.CrossHeadMap):
            module.gate[...] = jnp.full(module.gate.shape, value, module.gate[...].dtype)
            found += 1
    if not found:
        raise RuntimeError(f"no DAMCHA gate found in {type(model).__name__}")


def _sync(out: Any) -> Any:
    return jax.block_until_ready(out)


def copy_projections(src: nnx.Module, dst: nnx.Module) -> None:
    """Give ``dst`` (DamchaAttention) the projections of ``src`` (nnx.MultiHeadAttention):
    both hold ``query``/``key``/``value``/``out`` LinearGeneral modules of one layout."""
    for name in ("query", "key", "value", "out"):
        a, b = getattr(src, name), getattr(dst, name)
        b.kernel[...] = a.kernel[...]
        if a.bias is not None:
            b.bias[...] = a.bias[...]


def _flat(tree: Any) -> dict[tuple, np.ndarray]:
    """An nnx.State (parameters or their gradients) as path -> NumPy array."""
    return {path: np.asarray(v) for path, v in traverse_util.flatten_dict(nnx.to_pure_dict(tree)).items()}


def gradient_check(damcha: tuple[Any, Any], mha: tuple[Any, Any], attention: str | None = None) -> dict[str, Any]:
    """``(loss, gradients)`` of DAMCHA and of MHA, checked with closed gates: the losses
    equal, and so do the gradients of every MHA parameter (by path: DAMCHA keeps the
    ``query``/``key``/``value``/``out`` names; its generator and gates have no counterpart);
    with ``attention`` (the attribute holding the attention layers in a model) also the
    attention layers' own gradients, on their own scale."""
    ours, theirs = _flat(damcha[1]), _flat(mha[1])
    parts = {
        "loss": closed_gate_check(np.reshape(damcha[0], 1), np.reshape(mha[0], 1)),
        "parameter gradients": parameter_check(ours, theirs),
    }
    if attention is not None:
        parts["attention gradients"] = parameter_check(ours, theirs, [p for p in theirs if attention in p])
    return parts


# ------------------------------------------------------------------ layer


LAYER_CASES = {
    "causal-mask": "attn(x, mask=nnx.make_causal_mask(ones((B, N))))",
    "combined-mask": "attn(x, mask=nnx.combine_masks(nnx.make_causal_mask(ids), nnx.make_attention_mask(valid, valid)))",
    "is_causal": "attn(x, is_causal=True)",
    # Not a call Flax users write: what the same mask costs when DAMCHA is told what it is (docs/jax.md).
    "combined-mask+hint": "the combined-mask call; DAMCHA also gets mask_hint='causal' (MHA has no such argument)",
}
LAYER_MODES = ("forward", "grad")


def _masks(case: str, B: int, n: int) -> tuple[Any, Any]:
    """(mask or None, bool rows (B, N) of queries that see a key)."""
    valid = np.ones((B, n), bool)
    if case == "is_causal":
        return None, valid
    causal = nnx.make_causal_mask(jnp.ones((B, n)))
    if case == "causal-mask":
        return causal, valid
    # combined-mask and combined-mask+hint: the same mask
    for i in range(B):  # pad the last few tokens of each sequence
        valid[i, n - padded(n, i) :] = False
    return nnx.combine_masks(causal, nnx.make_attention_mask(jnp.asarray(valid), jnp.asarray(valid))), valid


def _apply(case: str, damcha: bool) -> Callable:
    if case == "is_causal":
        return lambda m, x, mask: m(x, is_causal=True)
    if case.endswith("+hint") and damcha:
        return lambda m, x, mask: m(x, mask=mask, mask_hint="causal")
    return lambda m, x, mask: m(x, mask=mask)


_FNS: dict[tuple[str, str, bool], Callable] = {}


def _layer_fns(case: str, mode: str, damcha: bool) -> Callable:
    """The jitted call of a (case, mode) for DAMCHA or MHA, made once (a new nnx.jit object would compile again)."""
    if (case, mode, damcha) not in _FNS:
        _FNS[case, mode, damcha] = _make_layer_fn(case, mode, damcha)
    return _FNS[case, mode, damcha]


def _make_layer_fn(case: str, mode: str, damcha: bool) -> Callable:
    apply = _apply(case, damcha)
    if mode == "forward":
        return nnx.jit(apply)

    def loss(m: nnx.Module, x: Any, mask: Any, rows: Any) -> Any:
        # Over the query rows that see a key, as a user masks padding out of a loss: where
        # every key is masked Flax's MHA averages all the values and DAMCHA outputs 0.
        return jnp.mean(jnp.where(rows[..., None], apply(m, x, mask), 0.0) ** 2)

    return nnx.jit(lambda m, x, mask, rows: nnx.value_and_grad(loss)(m, x, mask, rows))


def layer_section(ses: Session) -> None:
    each_case(ses, "layer", LAYER_CASES, ses.sizes.lengths, LAYER_MODES, functools.partial(_layer_case, ses))


def _layer_case(ses: Session, case: str, call: str, n: int, todo: dict[str, str]) -> None:
    s = ses.sizes
    mha = nnx.MultiHeadAttention(s.H, s.E, decode=False, rngs=nnx.Rngs(0))
    damcha = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))
    x = jnp.asarray(np.random.default_rng(n).normal(size=(s.B, n, s.E)), jnp.float32)
    mask, rows = _masks(case, s.B, n)
    # Each timed call checked with closed gates, on the rows that see a key.
    args = {"forward": (x, mask), "grad": (x, mask, jnp.asarray(rows))}
    checks = {
        "forward": closed_gate_check(
            _layer_fns(case, "forward", True)(damcha, *args["forward"]),
            _layer_fns(case, "forward", False)(mha, *args["forward"]),
            rows,
        ),
    }
    if "grad" in todo:
        checks["grad"] = combined_check(
            **gradient_check(
                _layer_fns(case, "grad", True)(damcha, *args["grad"]),
                _layer_fns(case, "grad", False)(mha, *args["grad"]),
            )
        )
    open_gates(damcha)
    for mode, entry_id in todo.items():
        calls = {
            "damcha": functools.partial(_layer_fns(case, mode, True), damcha, *args[mode]),
            "mha": functools.partial(_layer_fns(case, mode, False), mha, *args[mode]),
        }
        times = interleaved(calls, repeats=s.repeats(n), warmup=2 if n <= 1024 else 1, sync=_sync)
        ses.record_timed(
            entry_id,
            "layer",
            case,
            mode,
            n,
            call=call
            + (
                " under nnx.jit"
                if mode == "forward"
                else "; nnx.jit(nnx.value_and_grad(mean(y**2) over the rows that see a key))"
            ),
            baseline="nnx.MultiHeadAttention, the same call",
            times=times,
            check=checks[mode],
        )


# ----------------------------------------------------------------- blocks


class Block(nnx.Module):
    """A pre-norm transformer block around any attention module with Flax's call convention."""

    def __init__(self, attn: nnx.Module, E: int, ffn: int, rngs: nnx.Rngs) -> None:
        self.ln1, self.ln2 = nnx.LayerNorm(E, rngs=rngs), nnx.LayerNorm(E, rngs=rngs)
        self.attn = attn
        self.fc1, self.fc2 = nnx.Linear(E, ffn, rngs=rngs), nnx.Linear(ffn, E, rngs=rngs)

    def __call__(self, h: Any, **attn_kwargs: Any) -> Any:
        h = h + self.attn(self.ln1(h), **attn_kwargs)
        return h + self.fc2(nnx.gelu(self.fc1(self.ln2(h))))


class Stack(nnx.Module):
    """Encoder (float inputs) or causal LM (token ids, learned positions, vocabulary head)."""

    def __init__(self, attns: list, s: Any, *, lm: bool, max_len: int, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([Block(a, s.E, s.ffn, rngs) for a in attns])
        self.norm = nnx.LayerNorm(s.E, rngs=rngs)
        self.lm = lm
        if lm:
            self.tok = nnx.Embed(s.vocab, s.E, rngs=rngs)
            self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (max_len, s.E)))
            self.head = nnx.Linear(s.E, s.vocab, rngs=rngs)

    def __call__(self, x: Any, *, positions: bool = True, **attn_kwargs: Any) -> Any:
        h = x
        if self.lm:
            h = self.tok(x)
            if positions:
                h = h + self.pos[...][: x.shape[1]]
        for block in self.blocks:
            h = block(h, **attn_kwargs)
        h = self.norm(h)
        return self.head(h) if self.lm else h


def _attentions(impl: str, layers: int, s: Any, *, decode: bool = False) -> list:
    """``layers`` attention modules: Flax MHAs, or DAMCHA layers with the same projections
    sharing one generator (``dj.make_metric_generators``)."""
    mhas = [nnx.MultiHeadAttention(s.H, s.E, decode=decode, rngs=nnx.Rngs(10 + i)) for i in range(layers)]
    if impl == "mha":
        return mhas
    first = dj.DamchaAttention(s.H, s.E, decode=decode, rngs=nnx.Rngs(100))
    shared = dj.make_metric_generators(first.config, rngs=nnx.Rngs(101))
    damchas = [
        dj.DamchaAttention(s.H, s.E, decode=decode, metric_generator=shared, rngs=nnx.Rngs(102 + i))
        for i in range(layers)
    ]
    for m, d in zip(mhas, damchas):
        copy_projections(m, d)
    return damchas


def _stack(impl: str, layers: int, s: Any, *, lm: bool, max_len: int, decode: bool = False) -> Stack:
    return Stack(_attentions(impl, layers, s, decode=decode), s, lm=lm, max_len=max_len, rngs=nnx.Rngs(7))


# ----------------------------------------------------------------- decode


def _cached_module(depth: str, impl: str, s: Any, B: int, max_len: int) -> nnx.Module:
    """One attention layer ("layer") or the greedy LM ("stack") of ``impl`` (mha or
    damcha), in decode mode with caches of ``max_len`` tokens for batch ``B``."""
    module: nnx.Module
    if depth == "layer":
        module = _attentions(impl, 1, s, decode=True)[0]
        module.init_cache((B, max_len, s.E))
    else:
        module = _stack(impl, s.stack_layers, s, lm=True, max_len=max_len, decode=True)
        for block in module.blocks:
            block.attn.init_cache((B, max_len, s.E))
    return module


def _decoder(depth: str, impl: str, s: Any, B: int, max_len: int, gate: float = 0.5) -> tuple[Callable, Any, Any]:
    """A jitted decode step ``step(cache, x) -> (out, cache)`` (cache donated), the
    parameters closed over, and a fresh cache. ``impl``: mha, damcha (module decode),
    damcha-fn (the functional ``decode_step``, one layer only); DAMCHA's gates set to
    ``gate`` (0: closed, for the check)."""
    if impl == "damcha-fn":
        layer = _attentions("damcha", 1, s)[0]
        open_gates(layer, gate)
        params, config = layer.arrays(), layer.config
        cache = dj.init_cache(config, B, max_len, jnp.float32)
        fn = jax.jit(lambda c, x, p: dj.decode_step(p, config, c, x), donate_argnums=0)
        return (lambda c, x: fn(c, x, params)), cache, layer
    module = _cached_module(depth, impl, s, B, max_len)
    if impl != "mha":
        open_gates(module, gate)
    graphdef, cache, params = nnx.split(module, nnx.Cache, ...)

    def step(cache: Any, x: Any, params: Any) -> tuple[Any, Any]:
        m = nnx.merge(graphdef, cache, params)
        out = m(x, decode=True) if depth == "layer" else m(x, positions=False, decode=True)[:, -1:]
        return out, nnx.state(m, nnx.Cache)

    fn = jax.jit(step, donate_argnums=0)
    return (lambda c, x: fn(c, x, params)), cache, module


def _copy(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def _prefilled(step: Callable, cache: Any, prompt: Any, *, one_by_one: bool) -> tuple[Any, Any]:
    """The cache after the prompt and the prompt's last output. Flax's MHA decodes one
    token per call, so its prompt goes in token by token (untimed either way)."""
    if not one_by_one:
        return step(cache, prompt)[::-1]
    out = None
    for i in range(prompt.shape[1]):
        out, cache = step(cache, prompt[:, i : i + 1])
    return cache, out


def _decode_call(
    step: Callable, cache0: Any, first_out: Any, tokens: Any, steps: int, greedy: bool
) -> Callable[[], tuple[float, float]]:
    def call() -> tuple[float, float]:
        cache = _copy(cache0)
        jax.block_until_ready(cache)
        out = first_out
        w0, c0 = time.perf_counter(), time.process_time()
        for i in range(steps):
            nxt = jnp.argmax(out, -1).astype(jnp.int32) if greedy else tokens[:, i : i + 1]
            out, cache = step(cache, nxt)
        jax.block_until_ready(out)
        return (time.perf_counter() - w0) / steps, (time.process_time() - c0) / steps

    return call


def decode_section(ses: Session) -> None:
    each_decode(ses, functools.partial(_decode_case, ses))


def _decode_case(ses: Session, depth: str, B: int, entry_id: str) -> None:
    s = ses.sizes
    max_len = s.prompt + s.steps + 1
    rng = np.random.default_rng(B)
    greedy = depth == "stack"
    if greedy:
        prompt = jnp.asarray(rng.integers(0, s.vocab, (B, s.prompt)), jnp.int32)
        tokens = None
    else:
        prompt = jnp.asarray(rng.normal(size=(B, s.prompt, s.E)), jnp.float32)
        tokens = jnp.asarray(rng.normal(size=(B, s.steps, s.E)), jnp.float32)
    impls = ["mha", "damcha"] + (["damcha-fn"] if depth == "layer" else [])
    calls, firsts = {}, {}
    for impl in impls:
        step, cache, _ = _decoder(depth, impl, s, B, max_len)
        cache, out = _prefilled(step, cache, prompt, one_by_one=impl == "mha")
        firsts[impl] = out
        calls[impl] = _decode_call(step, cache, out, tokens, s.steps, greedy)
    check = _decode_check(depth, impls, s, B, max_len, prompt, tokens)
    times = interleaved(calls, repeats=s.decode_repeats(), warmup=1, self_timed=True)
    target = decode_target(B)
    comps = [comparison("module", times, "damcha", "mha", target)]
    if "damcha-fn" in calls:
        comps.append(comparison("decode_step", times, "damcha-fn", "mha", target))
    ses.record(
        decode_entry(
            entry_id,
            depth,
            B,
            s,
            call=(
                "one layer, random token vectors: layer(x, decode=True) after init_cache; "
                "decode_step(params, config, cache, x)"
                if depth == "layer"
                else f"greedy LM, {s.stack_layers} pre-norm blocks (FFN {s.ffn}), head over {s.vocab} tokens, "
                "layer(x, decode=True); DAMCHA layers share one generator"
            )
            + "; each step jax.jit(merge -> call -> state), cache donated",
            baseline="nnx.MultiHeadAttention(decode=True), same projections, the same jitted step",
            times=times,
            check=check,
            comparisons=comps,
        )
    )


def _decode_check(
    depth: str, impls: list[str], s: Any, B: int, max_len: int, prompt: Any, tokens: Any
) -> dict[str, Any]:
    """The timed steps (the same step code, jitted again, on the same weights) with
    DAMCHA's gates closed: each DAMCHA step's output equals the Flax MHA's after the prompt (prefilled
    as timed) and 2 steps, the same tokens fed to both."""
    outs = {}
    for impl in impls:
        step, cache, _ = _decoder(depth, impl, s, B, max_len, gate=0.0)
        cache, out = _prefilled(step, cache, prompt, one_by_one=impl == "mha")
        for i in range(2):
            out, cache = step(cache, prompt[:, i : i + 1] if tokens is None else tokens[:, i : i + 1])
        outs[impl] = out
    return combined_check(**{impl: closed_gate_check(outs[impl], outs["mha"]) for impl in impls if impl != "mha"})


# ------------------------------------------------------------------ model


MODEL_MODES = ("inference", "train")
MODELS = {
    "encoder": "{L} pre-norm blocks (attention, FFN {F}) + final LayerNorm, no mask",
    "lm": "decoder-only LM: embeddings, {L} pre-norm blocks with mask=nnx.make_causal_mask(ids), LayerNorm, "
    "head over {V} tokens",
}


class ModelStep:
    """One jitted whole-model call (``nnx.jit``): ``step(model, x)`` runs it,
    ``step.memory(model, x)`` is XLA's memory estimate of its compiled program."""

    def __init__(self, jitted: Any, *extra: Any) -> None:
        self.jitted, self.extra = jitted, extra  # extra: arguments between the model and x (the optimizer)

    def __call__(self, m: Stack, x: Any) -> Any:
        return self.jitted(m, *self.extra, x)

    def memory(self, m: Stack, x: Any) -> dict[str, float]:
        return compiled_memory(self.jitted.lower(m, *self.extra, x).compile())


def _apply_model(kind: str) -> Callable:
    def apply(m: Stack, x: Any) -> Any:
        if kind == "lm":
            return m(x, mask=nnx.make_causal_mask(x))
        return m(x)

    return apply


def _model_loss(kind: str) -> Callable:
    """The train rows' loss (timed, and checked with closed gates): next-token
    cross-entropy for the LM, the encoder's distance to its input (mean(y**2) of the
    final LayerNorm's output is about 1 whatever the layers do, which left every
    gradient below that norm near zero)."""
    apply = _apply_model(kind)

    def loss(m: Stack, x: Any) -> Any:
        out = apply(m, x)
        if kind == "lm":
            return optax.softmax_cross_entropy_with_integer_labels(out[:, :-1], x[:, 1:]).mean()
        return jnp.mean((out - x) ** 2)

    return loss


def _model_fns(kind: str, mode: str, model: Stack) -> ModelStep:
    if mode == "inference":
        return ModelStep(nnx.jit(_apply_model(kind)))
    loss = _model_loss(kind)
    optimizer = nnx.Optimizer(model, optax.sgd(1e-4), wrt=nnx.Param)

    @nnx.jit
    def train(m: Stack, opt: nnx.Optimizer, x: Any) -> Any:
        value, grads = nnx.value_and_grad(loss)(m, x)
        opt.update(m, grads)
        return value

    return ModelStep(train, optimizer)


def _model(kind: str, impl: str, n: int, s: Any) -> tuple[Stack, Any]:
    model = _stack(impl, s.model_layers, s, lm=kind == "lm", max_len=n)
    rng = np.random.default_rng(n)
    if kind == "lm":
        x = jnp.asarray(rng.integers(0, s.vocab, (s.B, n)), jnp.int32)
    else:
        x = jnp.asarray(rng.normal(size=(s.B, n, s.E)), jnp.float32)
    return model, x


MEMORY_METHOD = (
    "XLA's estimate for the compiled call, jitted.lower(...).compile().memory_analysis(): temp + output - alias "
    "bytes, what the call allocates beyond its arguments (the process's resident set is XLA's allocator's, not "
    "the program's: 0.4-2.6 across runs)"
)


def memory_worker(kind: str, impl: str, n: int, mode: str, s: Any) -> dict[str, Any]:
    """XLA's memory estimate of one model's compiled call (``compiled_memory``), as
    ``bench_dropin.py --memory-worker`` asks; ``peak_mib`` is what it allocates (``xla_own``)."""
    model, x = _model(kind, impl, n, s)
    if impl == "damcha":
        open_gates(model)
    mem = _model_fns(kind, mode, model).memory(model, x)
    return {"peak_mib": mem["own"], **mem}


def model_section(ses: Session) -> None:
    each_case(ses, "model", MODELS, ses.sizes.lengths_slow, MODEL_MODES, functools.partial(_model_case, ses))


def _model_case(ses: Session, kind: str, text: str, n: int, todo: dict[str, str]) -> None:
    s = ses.sizes
    models = {"damcha": _model(kind, "damcha", n, s)[0]}
    models["mha"], x = _model(kind, "mha", n, s)
    # Same projections; the blocks' other weights come from the same seeds.
    infer = {impl: _model_fns(kind, "inference", m) for impl, m in models.items()}
    checks = {"inference": closed_gate_check(infer["damcha"](models["damcha"], x), infer["mha"](models["mha"], x))}
    if "train" in todo:
        # The train step's loss and gradients (its update is optax.sgd's, the same for both).
        grad = nnx.jit(nnx.value_and_grad(_model_loss(kind)))
        checks["train"] = combined_check(
            **gradient_check(grad(models["damcha"], x), grad(models["mha"], x), attention="attn")
        )
    open_gates(models["damcha"])
    for mode, entry_id in todo.items():
        fns = infer if mode == "inference" else {impl: _model_fns(kind, mode, m) for impl, m in models.items()}
        calls = {impl: functools.partial(fns[impl], models[impl], x) for impl in ("damcha", "mha")}
        times = interleaved(calls, repeats=s.model_repeats(n), warmup=1, sync=_sync)
        record = entry(
            entry_id,
            "model",
            kind,
            mode,
            shape=s.model_shape(n, kind),
            call=text.format(L=s.model_layers, F=s.ffn, V=s.vocab)
            + (
                "; train: nnx.jit(value_and_grad + nnx.Optimizer(optax.sgd) update)"
                if mode == "train"
                else "; inference: nnx.jit"
            ),
            baseline="the same model with nnx.MultiHeadAttention (DAMCHA layers: same projections, one "
            "generator shared by all layers)",
            times=times,
            check=checks[mode],
            comparisons=[comparison("time", times, "damcha", "mha", time_target(n))],
        )
        if ses.memory:
            # In this process: XLA's numbers do not depend on what ran before (RSS would).
            mems = {impl: fns[impl].memory(models[impl], x) for impl in ("damcha", "mha")}
            record["memory"] = xla_memory_record(MEMORY_METHOD, mems)
        ses.record(record)


SECTIONS = {"layer": layer_section, "decode": decode_section, "model": model_section}


def setup(threads: int) -> dict[str, Any]:
    return {"jax_backend": jax.default_backend(), "jax_devices": jax.device_count(), "dtype": "float32"}
