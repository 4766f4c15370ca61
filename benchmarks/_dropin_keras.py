"""bench_dropin.py, Keras 3: the issue-12 call patterns against ``keras.layers.MultiHeadAttention``.

Runs in a worker process per backend (``KERAS_BACKEND`` is read once per
process): ``bench_dropin.py --worker keras-tensorflow`` (and ``keras-jax``,
``keras-torch``). Models are built the way Keras users build them
(functional models, ``Embedding(mask_zero=True)`` masks propagated by Keras,
``use_causal_mask=True``, an explicit ``attention_mask``), run eagerly
(``model(x)``), compiled for inference (``predict_on_batch``) and trained
(``train_on_batch``, ``fit``'s step). DAMCHA layers come from the built MHA
(``DamchaAttention.from_mha``: same projections), are checked to give the
MHA's output with closed gates, then their gates are opened to 0.5.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
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
    interleaved,
    padded,
    parameter_check,
    xla_memory_record,
)
from keras import ops

from damcha_keras import DamchaAttention, MetricGenerator

PORT = "keras-" + keras.backend.backend()


def open_gates(layers: list, value: float = 0.5) -> None:
    """Open the gates of DAMCHA layers through the canonical parameter vocabulary."""
    for layer in layers:
        params = layer.to_canonical()
        gates = [k for k in params if k.endswith(".gate")]
        if not gates:
            raise RuntimeError(f"no DAMCHA gate in {layer.name}")
        layer.load_canonical({k: (np.full_like(v, value) if k in gates else v) for k, v in params.items()})


def from_mha(mha: keras.layers.MultiHeadAttention, **kwargs: Any) -> DamchaAttention:
    """``DamchaAttention.from_mha`` with its variables given buffers of their own.

    Why: on the JAX backend from_mha's ``assign`` leaves the new layer's kernels aliasing
    the MHA's arrays; a compiled step of either model donates them and the other model
    then fails with "Array has been deleted" (reported to the Keras port's owner).
    """
    layer = DamchaAttention.from_mha(mha, **kwargs)
    for v in layer.weights:
        v.assign(np.array(ops.convert_to_numpy(v.value)))
    return layer


def _np(x: Any) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(x))


def _check(a: Any, b: Any, rows: Any = None) -> dict[str, Any]:
    # rows: those that see a key (Keras MHA gives an all-masked row uniform weights, DAMCHA 0)
    return closed_gate_check(_np(a), _np(b), rows)


def _compile(model: keras.Model, loss: Any, learning_rate: float = 1e-4) -> None:
    """The timed training steps' compile: plain SGD (a large one for the check)."""
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss=loss)


def _copied_variables(pairs: list[tuple[Any, DamchaAttention]]) -> dict[int, Any]:
    """id of each MHA projection variable -> the DAMCHA variable ``from_mha`` copied it into
    (DamchaAttention keeps MHA's projection sublayers' attribute names)."""
    copied = {}
    for mha, damcha in pairs:
        for name in ("_query_dense", "_key_dense", "_value_dense", "_output_dense"):
            for attr in ("kernel", "bias"):
                if getattr(getattr(mha, name), attr, None) is not None:
                    copied[id(getattr(getattr(mha, name), attr))] = getattr(getattr(damcha, name), attr)
    return copied


def _train_check(
    damcha: keras.Model, mha: keras.Model, pairs: list, inputs: Any, target: Any, loss: Any
) -> dict[str, Any]:
    """What the train rows time (``train_on_batch``), checked with closed gates.

    One SGD step of each model from the same weights, with learning rate 2**16 so that a
    weight's change is its gradient times a power of two (with 1, the change carried the
    float32 rounding of the weight itself: up to 1.8e-5 of the largest change in a
    layer, more for a model's attention layers, whose gradients are smaller): the losses
    equal, and every trainable variable of the MHA model changes as DAMCHA's copy of it
    does (layers both models share: the same variable). Every variable is put back
    afterwards; the caller compiles again.
    """
    copied = _copied_variables(pairs)
    variables = {id(v): v for model in (damcha, mha) for v in model.variables}
    saved = {key: _np(v.value).copy() for key, v in variables.items()}
    ours = {id(v) for v in damcha.trainable_variables}
    matched = [(copied.get(id(v), v), v) for v in mha.trainable_variables]
    strays = [v.path for d, v in matched if id(d) not in ours]
    if strays:
        raise RuntimeError(f"no DAMCHA counterpart of the MHA model's trainable {strays[:3]}")
    losses, changes = [], []
    for model in (damcha, mha):
        _compile(model, loss, learning_rate=2.0**16)
        losses.append(np.asarray(model.train_on_batch(inputs, target), np.float64).reshape(1))
        changes.append({key: _np(v.value) - saved[key] for key, v in variables.items()})
        for key, v in variables.items():
            v.assign(saved[key])
    # Keyed by the MHA variable: DAMCHA's change is its counterpart's.
    ours = {id(v): changes[0][id(d)] for d, v in matched}
    theirs = {id(v): changes[1][id(v)] for _, v in matched}
    return {
        "train loss": closed_gate_check(losses[0], losses[1]),
        "weight updates": parameter_check(ours, theirs),
        # The attention layers' own, on their own scale (the other layers' may be larger).
        "attention weight updates": parameter_check(ours, theirs, [k for k in theirs if k in copied]),
    }


def _sync(out: Any) -> Any:
    if isinstance(out, (list, tuple)):
        out = out[0]
    return ops.convert_to_numpy(ops.ravel(out)[:1]) if hasattr(out, "shape") and len(out.shape) else out


# ------------------------------------------------------------------ layer


class CausalMaskCall(keras.layers.Layer):
    """``attn(x, x, attention_mask=mask)`` with the causal mask made in ``call``, as Keras
    users write it: ``ops.tril(ops.ones((N, N)))`` (float), or that cast to bool."""

    def __init__(self, attn: Any, boolean: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.attn, self.boolean = attn, boolean

    def call(self, x: Any) -> Any:
        n = x.shape[1]
        mask = ops.tril(ops.ones((n, n)))
        if self.boolean:
            mask = ops.cast(mask, "bool")
        return self.attn(x, x, attention_mask=mask)


LAYER_CASES = {
    "use_causal_mask": "y = attn(x, x, use_causal_mask=True)",
    "embedding-padding": "h = Embedding(V, E, mask_zero=True)(ids); y = attn(h, h) (Keras propagates the mask)",
    "mask-bool": "y = attn(x, x, attention_mask=ops.cast(ops.tril(ops.ones((N, N))), 'bool')) inside a layer's call",
    "mask-float": "y = attn(x, x, attention_mask=ops.tril(ops.ones((N, N)))) inside a layer's call (float 0/1)",
}
LAYER_MODES = ("forward", "predict", "train")
MODE_TEXT = {
    "forward": "model(inputs) eager",
    "predict": "model.predict_on_batch(inputs) (compiled)",
    "train": "model.train_on_batch(inputs, zeros) (compiled, SGD, mse)",
}


def _layer_models(case: str, n: int, s: Any) -> dict[str, Any]:
    B, E, H = s.B, s.E, s.H
    keras.utils.set_random_seed(n)
    rng = np.random.default_rng(n)
    mha = keras.layers.MultiHeadAttention(H, E // H)
    rows = np.ones((B, n), bool)
    if case == "embedding-padding":
        ids = rng.integers(1, s.vocab, (B, n)).astype("int32")
        for i in range(B):  # zeros pad the last few tokens of each sequence
            ids[i, n - padded(n, i) :] = 0
        rows = ids != 0
        embed = keras.layers.Embedding(s.vocab, E, mask_zero=True)
        inputs = ids

        def build(attn: Any) -> keras.Model:
            tokens = keras.Input((n,), batch_size=B, dtype="int32")
            h = embed(tokens)
            return keras.Model(tokens, attn(h, h))
    else:
        x = rng.normal(size=(B, n, E)).astype("float32")
        inputs = x

        def build(attn: Any) -> keras.Model:
            xs = keras.Input((n, E), batch_size=B)
            if case == "use_causal_mask":
                return keras.Model(xs, attn(xs, xs, use_causal_mask=True))
            return keras.Model(xs, CausalMaskCall(attn, boolean=case == "mask-bool")(xs))

    model_mha = build(mha)  # builds the MHA
    damcha = from_mha(mha)
    model_damcha = build(damcha)
    return {
        "mha": model_mha,
        "damcha": model_damcha,
        "pairs": [(mha, damcha)],
        "inputs": inputs,
        "rows": rows,
        "target": np.zeros(model_mha.output.shape, "float32"),
    }


def _mode_call(model: keras.Model, inputs: Any, target: Any, mode: str) -> Callable[[], Any]:
    if mode == "forward":
        tensor = ops.convert_to_tensor(inputs)
        return lambda: model(tensor, training=False)
    if mode == "predict":
        return lambda: model.predict_on_batch(inputs)
    _compile(model, "mse")
    return lambda: model.train_on_batch(inputs, target)


def layer_section(ses: Session) -> None:
    lengths = ses.sizes.lengths if PORT == "keras-tensorflow" else ses.sizes.lengths_slow
    each_case(ses, "layer", LAYER_CASES, lengths, LAYER_MODES, functools.partial(_layer_case, ses))


def _layer_case(ses: Session, case: str, call: str, n: int, todo: dict[str, str]) -> None:
    s = ses.sizes
    m = _layer_models(case, n, s)
    inputs, rows = m["inputs"], m["rows"]
    # Each timed call checked with closed gates on the inputs it is timed on.
    checks = {
        "forward": _check(m["damcha"](inputs, training=False), m["mha"](inputs, training=False), rows),
        "predict": _check(m["damcha"].predict_on_batch(inputs), m["mha"].predict_on_batch(inputs), rows),
    }
    if "train" in todo:
        checks["train"] = combined_check(**_train_check(m["damcha"], m["mha"], m["pairs"], inputs, m["target"], "mse"))
    open_gates([d for _, d in m["pairs"]])
    for mode, entry_id in todo.items():
        calls = {impl: _mode_call(m[impl], inputs, m["target"], mode) for impl in ("damcha", "mha")}
        times = interleaved(calls, repeats=s.repeats(n), warmup=2, sync=_sync)
        ses.record_timed(
            entry_id,
            "layer",
            case,
            mode,
            n,
            call=f"{call}; {MODE_TEXT[mode]}",
            baseline="keras.layers.MultiHeadAttention(H, E // H), the same model",
            times=times,
            check=checks[mode],
        )


# ----------------------------------------------------------------- decode


def _hub_cached_mha() -> Any:
    """KerasHub's ``CachedMultiHeadAttention`` when keras-hub is installed, else None."""
    try:
        import keras_hub
    except ImportError:
        return None
    return getattr(keras_hub.layers, "CachedMultiHeadAttention", None)


def _decode_mask(T: int, L: int, index: int, B: int) -> Any:
    """(B, T, L) bool: query i of a step at ``index`` sees cache slots j <= index + i."""
    mask = np.arange(L)[None, :] <= (index + np.arange(T))[:, None]
    return np.broadcast_to(mask[None], (B, T, L))


def mha_cached_call(mha: keras.layers.MultiHeadAttention, x: Any, cache: Any, index: int, mask: Any) -> tuple[Any, Any]:
    """A KerasHub-style cached step on a Keras MHA: cache (B, 2, L, H, d) updated with
    ``ops.slice_update`` at ``index``, then MHA's own attention over the whole cache."""
    q = mha.query_dense(x)
    k = ops.slice_update(cache[:, 0], (0, index, 0, 0), mha.key_dense(x))
    v = ops.slice_update(cache[:, 1], (0, index, 0, 0), mha.value_dense(x))
    out, _ = mha._compute_attention(q, k, v, attention_mask=mask, training=False)
    return mha.output_dense(out), ops.stack([k, v], axis=1)


def _decode_models(depth: str, s: Any, B: int, max_len: int) -> dict[str, Any]:
    E, H = s.E, s.H
    keras.utils.set_random_seed(0)
    layers = 1 if depth == "layer" else s.stack_layers
    probe = np.zeros((B, 1, E), "float32")
    hub = _hub_cached_mha()
    mhas = []
    for _ in range(layers):
        mha = keras.layers.MultiHeadAttention(H, E // H) if hub is None else hub(H, E // H)
        mha(probe, probe)
        mhas.append(mha)
    shared = MetricGenerator(H)
    damchas = [from_mha(m, metric_generator=shared) for m in mhas]
    masks: dict[tuple[int, int], Any] = {}

    def mask_of(T: int, index: int) -> Any:
        if (T, index) not in masks:
            masks[T, index] = ops.convert_to_tensor(_decode_mask(T, max_len, index, B))
        return masks[T, index]

    def mha_attn(i: int, h: Any, cache: Any, index: int) -> tuple[Any, Any]:
        if hub is not None:
            return mhas[i](h, h, attention_mask=mask_of(h.shape[1], index), cache=cache, cache_update_index=index)
        return mha_cached_call(mhas[i], h, cache, index, mask_of(h.shape[1], index))

    def damcha_attn(i: int, h: Any, cache: Any, index: int) -> tuple[Any, Any]:
        return damchas[i](h, h, use_causal_mask=True, cache=cache, cache_update_index=index)

    caches = {
        "mha": lambda: [ops.zeros((B, 2, max_len, H, E // H)) for _ in mhas],
        "damcha": lambda: [d.init_cache(B, max_len) for d in damchas],
    }
    baseline = (
        "keras_hub.layers.CachedMultiHeadAttention"
        if hub is not None
        else "Keras MHA with a KerasHub-style cache (B, 2, L, H, d): ops.slice_update, explicit mask, "
        "MHA's _compute_attention (keras-hub is not installed)"
    )
    if depth == "layer":

        def single(attn: Callable) -> Callable:
            def step(x: Any, cache: list, index: int) -> Any:
                y, cache[0] = attn(0, x, cache[0], index)
                return y

            return step

        return {
            "steps": {"mha": single(mha_attn), "damcha": single(damcha_attn)},
            "caches": caches,
            "greedy": False,
            "damchas": damchas,
            "baseline": baseline,
        }
    ln1 = [keras.layers.LayerNormalization() for _ in range(layers)]
    ln2 = [keras.layers.LayerNormalization() for _ in range(layers)]
    fc1 = [keras.layers.Dense(s.ffn, activation="gelu") for _ in range(layers)]
    fc2 = [keras.layers.Dense(E) for _ in range(layers)]
    embed, norm, head = (
        keras.layers.Embedding(s.vocab, E),
        keras.layers.LayerNormalization(),
        keras.layers.Dense(s.vocab),
    )

    def lm(attn: Callable) -> Callable:
        def step(ids: Any, cache: list, index: int) -> Any:
            h = embed(ids)
            for i in range(layers):
                a, cache[i] = attn(i, ln1[i](h), cache[i], index)
                h = h + a
                h = h + fc2[i](fc1[i](ln2[i](h)))
            return head(norm(h[:, -1:]))

        return step

    return {
        "steps": {"mha": lm(mha_attn), "damcha": lm(damcha_attn)},
        "caches": caches,
        "greedy": True,
        "damchas": damchas,
        "baseline": baseline,
    }


def _run_decode(
    step: Callable, new_cache: Callable, prompt: Any, feed: Callable[[Any, int], Any], steps: int
) -> tuple[Any, list]:
    cache = new_cache()
    out = step(prompt, cache, 0)
    index = prompt.shape[1]
    for i in range(steps):
        out = step(feed(out, i), cache, index + i)
    return out, cache


def _greedy_feed(out: Any, i: int) -> Any:
    """The next token of greedy decoding: the argmax of the logits."""
    return ops.cast(ops.argmax(out, -1), "int32")


def _slice_feed(tokens: Any, out: Any, i: int) -> Any:
    """The next token read from ``tokens`` (teacher forcing)."""
    return tokens[:, i : i + 1]


def _timed_decode(
    step: Callable, new_cache: Callable, prompt: Any, feed: Callable[[Any, int], Any], steps: int
) -> tuple[float, float]:
    """Prefill ``prompt``, then time ``steps`` decode steps: (wall, CPU) seconds per step."""
    cache = new_cache()
    out = step(prompt, cache, 0)
    _sync(out)
    index = prompt.shape[1]
    w0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        out = step(feed(out, i), cache, index + i)
    _sync(out)
    return (time.perf_counter() - w0) / steps, (time.process_time() - c0) / steps


def decode_section(ses: Session) -> None:
    each_decode(ses, functools.partial(_decode_case, ses))


def _decode_case(ses: Session, depth: str, B: int, entry_id: str) -> None:
    s = ses.sizes
    max_len = s.prompt + s.steps
    models = _decode_models(depth, s, B, max_len)
    rng = np.random.default_rng(B)
    if models["greedy"]:
        prompt = ops.convert_to_tensor(rng.integers(0, s.vocab, (B, s.prompt)).astype("int32"))
        feed, check_feed = _greedy_feed, functools.partial(_slice_feed, prompt)
    else:
        prompt = ops.convert_to_tensor(rng.normal(size=(B, s.prompt, s.E)).astype("float32"))
        tokens = ops.convert_to_tensor(rng.normal(size=(B, s.steps, s.E)).astype("float32"))
        feed = check_feed = functools.partial(_slice_feed, tokens)
    outs = {
        impl: _run_decode(models["steps"][impl], models["caches"][impl], prompt, check_feed, 2)[0]
        for impl in ("mha", "damcha")
    }
    check = _check(outs["damcha"], outs["mha"])
    open_gates(models["damchas"])
    calls = {
        impl: functools.partial(_timed_decode, models["steps"][impl], models["caches"][impl], prompt, feed, s.steps)
        for impl in ("damcha", "mha")
    }
    times = interleaved(calls, repeats=s.decode_repeats(), warmup=1, self_timed=True)
    ses.record(
        decode_entry(
            entry_id,
            depth,
            B,
            s,
            call=(
                "one layer, random token vectors"
                if depth == "layer"
                else f"greedy LM, {s.stack_layers} pre-norm blocks (FFN {s.ffn}), head over {s.vocab} tokens, "
                "DAMCHA layers share one MetricGenerator"
            )
            + "; DAMCHA: attn(x, x, use_causal_mask=True, cache=cache, cache_update_index=i) with "
            "attn.init_cache(B, L); eager steps",
            baseline=models["baseline"],
            times=times,
            check=check,
            comparisons=[comparison("eager", times, "damcha", "mha", decode_target(B))],
        )
    )


# ------------------------------------------------------------------ model


class AddPositions(keras.layers.Layer):
    """Learned position embeddings added to (B, N, E) tokens."""

    def build(self, input_shape: tuple) -> None:
        self.pos = self.add_weight(shape=tuple(input_shape[1:]), initializer="random_normal", name="pos")

    def call(self, x: Any) -> Any:
        return x + self.pos


MODEL_MODES = ("inference", "train")
MODELS = {
    "encoder": "functional model: {L} pre-norm blocks (attention, FFN {F}) + LayerNormalization, no mask",
    "lm": "functional decoder-only LM: Embedding + positions, {L} pre-norm blocks calling attention with "
    "use_causal_mask=True, LayerNormalization, Dense head over {V} tokens",
}


def _models(kind: str, n: int, s: Any) -> dict[str, Any]:
    """Both models of ``kind``, built from the same layer objects except the attention: the
    DAMCHA model's layers are ``from_mha`` of the MHA model's (one shared MetricGenerator), so
    the two have the same weights."""
    keras.utils.set_random_seed(0)
    E, H, L = s.E, s.H, s.model_layers
    rng = np.random.default_rng(n)
    if kind == "lm":
        x = rng.integers(0, s.vocab, (s.B, n)).astype("int32")
        y = np.roll(x, -1, axis=1)
        embed, positions, head = keras.layers.Embedding(s.vocab, E), AddPositions(), keras.layers.Dense(s.vocab)
    else:
        x = rng.normal(size=(s.B, n, E)).astype("float32")
        # The encoder learns to give back its input: against zeros the final LayerNorm's
        # output costs about 1 whatever the layers do, and every gradient below it is ~0.
        y = x.copy()
    ln1, ln2, final = (
        [keras.layers.LayerNormalization() for _ in range(L)],
        [keras.layers.LayerNormalization() for _ in range(L)],
        keras.layers.LayerNormalization(),
    )
    fc1 = [keras.layers.Dense(s.ffn, activation="gelu") for _ in range(L)]
    fc2 = [keras.layers.Dense(E) for _ in range(L)]

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True) if kind == "lm" else "mse"

    def build(attns: list) -> keras.Model:
        if kind == "lm":
            inp = keras.Input((n,), batch_size=s.B, dtype="int32")
            h = positions(embed(inp))
        else:
            inp = h = keras.Input((n, E), batch_size=s.B)
        for i, attn in enumerate(attns):
            a = ln1[i](h)
            h = h + (attn(a, a, use_causal_mask=True) if kind == "lm" else attn(a, a))
            h = h + fc2[i](fc1[i](ln2[i](h)))
        h = final(h)
        model = keras.Model(inp, head(h) if kind == "lm" else h)
        _compile(model, loss)
        return model

    mhas = [keras.layers.MultiHeadAttention(H, E // H) for _ in range(L)]
    mha = build(mhas)
    shared = MetricGenerator(H)
    damchas = [from_mha(m, metric_generator=shared) for m in mhas]
    return {"mha": mha, "damcha": build(damchas), "pairs": list(zip(mhas, damchas)), "x": x, "y": y, "loss": loss}


def _model_call(model: keras.Model, x: Any, y: Any, mode: str) -> Callable[[], Any]:
    if mode == "inference":
        return lambda: model.predict_on_batch(x)
    return lambda: model.train_on_batch(x, y)


RSS_METHOD = (
    "peak RSS increase (VmHWM) of one compiled call after a warm-up call, each model in a fresh process, "
    "MALLOC_MMAP_THRESHOLD_=65536"
)
XLA_METHOD = (
    "XLA's estimate for the compiled step, jax.jit(model.train_step or predict_step).lower(state, data)"
    ".compile().memory_analysis(): temp + output - alias bytes, what the step allocates beyond its arguments "
    "(Keras on JAX; its resident set is "
    "XLA's allocator's: one run read 0.04 and 27 for two training rows)"
)


def _xla_memory(model: keras.Model, x: Any, y: Any, mode: str) -> dict[str, float]:
    """XLA's memory estimate of the step Keras compiles for ``model`` (the JAX backend).

    Keras jits ``model.train_step`` / ``predict_step`` over its state tuple; the
    same functions are lowered here on the same state (``_get_jax_state``, the
    trainer's own accessor) and data, without donation, which XLA's
    ``alias`` then reports as 0."""
    import jax

    if mode == "train":
        state = model._get_jax_state(
            trainable_variables=True, non_trainable_variables=True, optimizer_variables=True, metrics_variables=True
        )
        lowered = jax.jit(model.train_step).lower(state, (x, y))
    else:
        state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True)
        lowered = jax.jit(model.predict_step).lower(state, (x,))
    return compiled_memory(lowered.compile())


def memory_worker(kind: str, impl: str, n: int, mode: str, s: Any) -> dict[str, Any]:
    from _harness import measure_peak

    m = _models(kind, n, s)
    if impl == "damcha":
        open_gates([d for _, d in m["pairs"]])
    call = _model_call(m[impl], m["x"], m["y"], mode)
    return {"peak_mib": measure_peak(lambda: _sync(call()))}


def model_section(ses: Session) -> None:
    each_case(ses, "model", MODELS, ses.sizes.lengths_slow, MODEL_MODES, functools.partial(_model_case, ses))


def _model_case(ses: Session, kind: str, text: str, n: int, todo: dict[str, str]) -> None:
    s = ses.sizes
    m = _models(kind, n, s)
    mha, damcha, x, y = m["mha"], m["damcha"], m["x"], m["y"]
    checks = {"inference": _check(damcha.predict_on_batch(x), mha.predict_on_batch(x))}
    if "train" in todo:
        checks["train"] = combined_check(**_train_check(damcha, mha, m["pairs"], x, y, m["loss"]))
        for model in (damcha, mha):
            _compile(model, m["loss"])  # the timed step's learning rate again
    open_gates([d for _, d in m["pairs"]])
    backend = keras.backend.backend()
    for mode, entry_id in todo.items():
        calls = {"damcha": _model_call(damcha, x, y, mode), "mha": _model_call(mha, x, y, mode)}
        times = interleaved(calls, repeats=s.model_repeats(n), warmup=2, sync=_sync)

        def xla_memory(mode: str = mode) -> dict[str, Any]:
            return xla_memory_record(XLA_METHOD, {impl: _xla_memory(m[impl], x, y, mode) for impl in ("damcha", "mha")})

        ses.record_timed(
            entry_id,
            "model",
            kind,
            mode,
            n,
            call=text.format(L=s.model_layers, F=s.ffn, V=s.vocab)
            + ("; train_on_batch (SGD)" if mode == "train" else "; predict_on_batch"),
            baseline="the same model with keras.layers.MultiHeadAttention (DAMCHA: from_mha of each, "
            "one MetricGenerator shared by all layers)",
            times=times,
            check=checks[mode],
            # TensorFlow's CPU runtime keeps a step's buffers between calls, so a warm call's
            # RSS increase is not its footprint (one run read 1.2x-2.2x on a few MiB) and TF
            # reports no CPU peak: not measured there. JAX: XLA's estimate, as for Flax.
            memory=RSS_METHOD if backend == "torch" else None,
            memory_in_process=xla_memory if backend == "jax" else None,
        )


SECTIONS = {"layer": layer_section, "decode": decode_section, "model": model_section}


def setup(threads: int) -> dict[str, Any]:
    info: dict[str, Any] = {"keras_backend": keras.backend.backend(), "dtype": "float32"}
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.get_logger().setLevel("ERROR")  # retracing notes of the many small models built here
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:  # already initialised: the environment variables applied
            pass
        info["tf_intra_op_threads"] = tf.config.threading.get_intra_op_parallelism_threads()
    elif keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(threads)
        info["torch_threads"] = torch.get_num_threads()
    return info
