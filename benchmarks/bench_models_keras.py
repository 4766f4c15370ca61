"""Converted KerasHub models vs the originals on CPU, on each Keras 3 backend: time ratios (issue 13).

Usage:
    .venv/bin/python benchmarks/bench_models_keras.py            # 3 backends; gpt2, llama, gptneox, bert; N=256, 1024
    .venv/bin/python benchmarks/bench_models_keras.py --backends jax --models llama --lengths 1024
    .venv/bin/python benchmarks/bench_models_keras.py --resume benchmarks/results/models-keras-<stamp>.json
    .venv/bin/python benchmarks/bench_models_keras.py --report [FILE...]   # rewrite the docs section only
    .venv/bin/python benchmarks/bench_models_keras.py --tiny     # about a minute per backend: checks the script

The Keras counterpart of bench_models.py. Models (random weights, KerasHub
classes built from configs, ``preprocessor=None``; nothing is downloaded):
- "gpt2": ``GPT2CausalLM`` on a ``GPT2Backbone`` (KerasHub's
  ``CachedMultiHeadAttention``): 4 layers, hidden 512, 8 heads of 64,
  MLP 2048, vocab 4096, dropout 0.
- "llama": ``LlamaCausalLM``: 4 layers, hidden 512, 8 query heads of 64,
  4 key/value heads (GQA, so separate query and key maps), MLP 1376,
  vocab 4096.
- "gptneox": ``GPTNeoXCausalLM``: 4 layers, hidden 512, 8 heads of 64 in
  one fused ``_qkv_dense`` (each head's query, key and value side by
  side: an interleaved site), rotary on a quarter of each head, MLP 2048,
  vocab 4096, dropout 0.
- "bert": ``BertTextClassifier`` (2 classes) on a ``BertBackbone``: 4
  layers, hidden 512, 8 heads of 64, MLP 2048, vocab 4096, dropout 0; an
  encoder (no generate).
B=2, N tokens, no padding.

"original" is the model as built; "DAMCHA" a second copy given the
original's weights (``set_weights``) and then ``damcha_keras.convert(model)``
(metric "heads", coupling auto). Each (model, N) first checks that the
converted model with closed gates gives the original's output (the LMs'
logits, BERT's ``sequence_output``, by ``predict_on_batch``;
``_harness.closed_gate_check``) and, with "generate", the same greedy
tokens; then opens every gate to 0.5 (the generators keep their initial
weights: an open map costs the same, but is honest) and checks that the
output moved (a compiled function that had frozen the closed gates would
time the wrong computation). Modes: "predict" is
``model.predict_on_batch(x)``; "train" is ``model.train_on_batch(x, y)``
after ``compile(optimizer=SGD(1e-4), loss=SparseCategoricalCrossentropy(
from_logits=True))`` without metrics (LMs: next-token labels; BERT: a
class); both compiled as Keras does by default (``jit_compile="auto"``:
a ``tf.function`` graph without XLA on a CPU-only TensorFlow, ``jax.jit``
on JAX, eager on torch; each entry records ``jit_compile``). "generate"
(the LMs) is KerasHub's ``generate`` with the greedy sampler and its KV
cache (``stop_token_ids=None``): the N-token prompt, then 32 new tokens
(4 with --tiny).

Each backend runs in its own worker process (``KERAS_BACKEND`` is read once,
at import), pinned to ``--threads`` cores with its thread pools told so
before Keras is imported (``_harness.fix_threads``, ``_dropin_keras.setup``).
Times: both models are built in the worker and called alternately (A B,
then B A: ``_harness.interleaved``), ``--repeats`` rounds (default 7; on
torch 5, its generate 3) after two warm-up rounds (compilation, then first
touch; one for generate, whose token check was the first call); every
round's wall and process CPU time is kept, and the ratios DAMCHA / original are taken per round
(median and quartiles). Memory, JAX only: XLA's ``memory_analysis()`` of
the step Keras compiles (``_dropin_keras._xla_memory``), compared by what
the step allocates beyond its arguments: temp + output - alias
(``_harness.xla_own``). Not on TensorFlow (its CPU runtime keeps a step's buffers
between calls, so a warm call's RSS increase is not its footprint, and it
reports no CPU peak), not on torch (the fresh-process RSS method would
double the run), not for "generate". Targets (issue 13): time ratio <= 1.10,
memory ratio <= 1.05 at N >= 512.

A full run is 4 models x 2 lengths x (3 or 2) modes per backend: by the
smoke runs' times (N=256, on a loaded 2-core machine), about 10-15 minutes
for TensorFlow and for JAX on an idle one, and 20-30 minutes for torch,
where Keras runs eagerly and KerasHub's generate costs ~0.5 s per token at
these sizes (``--modes predict train`` there for a shorter run).

Results: every entry (backend, model, mode, N) is written, as soon as it is
measured, to a JSON file (``--json FILE``; default ``benchmarks/results/
models-keras-<date>-<time>.json``; with ``--tiny`` a temporary file, removed
at exit, unless ``--json`` is given) with the run's command, commit,
machine, versions, threads and load average (``"format":
"damcha-models-keras/1"``); ``--resume FILE`` continues a run, skipping the
entries it has. After a run (not ``--tiny``, not ``--no-docs``) the
"Converted KerasHub models (Keras 3)" section of docs/benchmarks.md is
rewritten from every ``benchmarks/results/models-keras-*.json``: runs of one
commit pooled, later commits replacing earlier ones
(``_models_keras_report.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402  (benchmarks/ on sys.path first)
import _models_keras_report as rep  # noqa: E402

RESULTS = HERE / "results"
DOCS = h.REPO / "docs" / "benchmarks.md"
IMPLS = ("original", "damcha")
MODES = rep.MODE_ORDER  # predict, train, generate
BACKENDS = rep.BACKENDS
SECTION = "models"  # entry ids: keras-<backend>/models/<model>/<mode>/N=<n>
CAUSAL = ("gpt2", "llama", "gptneox")
GENERATE_TOKENS = {False: 32, True: 4}  # new tokens per generate call: full, --tiny
WARMUP = 2  # rounds before timing: the first compiles (tf.function, jax.jit), the second touches memory
# Timed rounds per entry by default (--repeats overrides): Keras on torch runs eagerly, a few times
# slower, and KerasHub's eager generate there costs ~0.5 s per new token at these sizes (the host's
# overhead, the original's too): fewer rounds keep a backend's run near 15 minutes; a generate call
# is 32 steps, so its per-call noise is smaller.
REPEATS = {"tensorflow": 7, "jax": 7, "torch": 5}
GENERATE_REPEATS = {"tensorflow": 7, "jax": 7, "torch": 3}

DESCRIPTIONS = {
    "gpt2": "KerasHub `GPT2CausalLM` (`CachedMultiHeadAttention`), dropout 0",
    "llama": "KerasHub `LlamaCausalLM`, GQA (separate query and key maps), RoPE",
    "gptneox": "KerasHub `GPTNeoXCausalLM` (per-head interleaved fused `_qkv_dense`), partial RoPE, dropout 0",
    "bert": "KerasHub `BertTextClassifier` on a `BertBackbone` (encoder), dropout 0",
}
MODE_TEXT = {
    "predict": "model.predict_on_batch(x)",
    "train": "model.train_on_batch(x, y) (SGD, sparse categorical cross-entropy, no metrics)",
    "generate": "model.generate(prompt, stop_token_ids=None), greedy sampler, KV cache",
}
XLA_METHOD = (
    "XLA's estimate for the compiled step, jax.jit(model.predict_step or model.train_step).lower(state, data)"
    ".compile().memory_analysis(): temp + output - alias bytes (what the step allocates beyond its arguments)"
)
TINY = {
    "gpt2": dict(hidden=32, heads=4, mlp=64, vocab=64, layers=1, batch=2),
    "llama": dict(hidden=32, heads=4, kv=2, mlp=64, vocab=64, layers=1, batch=2),
    "gptneox": dict(hidden=32, heads=4, mlp=64, vocab=64, layers=1, batch=2),
    "bert": dict(hidden=32, heads=4, mlp=64, vocab=64, layers=1, batch=2),
}
# The sizes of bench_models.py's PyTorch models (GPT-2's and BERT's MLP: 4 x hidden, as GPT-2's).
FULL = {
    "gpt2": dict(hidden=512, heads=8, mlp=2048, vocab=4096, layers=4, batch=2),
    "llama": dict(hidden=512, heads=8, kv=4, mlp=1376, vocab=4096, layers=4, batch=2),
    "gptneox": dict(hidden=512, heads=8, mlp=2048, vocab=4096, layers=4, batch=2),
    "bert": dict(hidden=512, heads=8, mlp=2048, vocab=4096, layers=4, batch=2),
}


def _modes(model: str, given: list[str] | None = None) -> list[str]:
    return [m for m in (given or MODES) if m != "generate" or model in CAUSAL]


def _shape(model: str, n: int, tiny: bool) -> dict[str, Any]:
    sizes = (TINY if tiny else FULL)[model]
    return {"B": sizes["batch"], "N": n, **{k: v for k, v in sizes.items() if k != "batch"}}


# ------------------------------------------------------------------ models (in a worker)


def _build(model: str, n: int, tiny: bool) -> Any:
    """The KerasHub task ``model`` at N tokens, compiled for training and greedy generation."""
    import keras
    import keras_hub

    s = (TINY if tiny else FULL)[model]
    # Position tables end at max_sequence_length: room for the prompt and the generated tokens.
    longest = max(n, 64) + GENERATE_TOKENS[False]
    models = keras_hub.models
    if model == "gpt2":
        backbone = models.GPT2Backbone(
            vocabulary_size=s["vocab"],
            num_layers=s["layers"],
            num_heads=s["heads"],
            hidden_dim=s["hidden"],
            intermediate_dim=s["mlp"],
            dropout=0.0,  # KerasHub's default is 0.1: the two models would drop different units
            max_sequence_length=longest,
        )
        task = models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    elif model == "llama":
        backbone = models.LlamaBackbone(
            vocabulary_size=s["vocab"],
            num_layers=s["layers"],
            num_query_heads=s["heads"],
            num_key_value_heads=s["kv"],
            hidden_dim=s["hidden"],
            intermediate_dim=s["mlp"],
        )
        task = models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    elif model == "gptneox":
        backbone = models.GPTNeoXBackbone(
            vocabulary_size=s["vocab"],
            num_layers=s["layers"],
            num_heads=s["heads"],
            hidden_dim=s["hidden"],
            intermediate_dim=s["mlp"],
            dropout=0.0,
            rotary_percentage=0.25,  # Pythia's
            max_sequence_length=longest,
        )
        task = models.GPTNeoXCausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = models.BertBackbone(
            vocabulary_size=s["vocab"],
            num_layers=s["layers"],
            num_heads=s["heads"],
            hidden_dim=s["hidden"],
            intermediate_dim=s["mlp"],
            dropout=0.0,
            max_sequence_length=max(n, 64),
        )
        task = models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None, dropout=0.0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # No metrics: the step timed is the model's (the PyTorch benchmark's backward has none either).
    if model in CAUSAL:
        task.compile(optimizer=keras.optimizers.SGD(1e-4), loss=loss, weighted_metrics=[], sampler="greedy")
    else:
        task.compile(optimizer=keras.optimizers.SGD(1e-4), loss=loss, metrics=[])
    return task


def _data(model: str, n: int, tiny: bool) -> dict[str, Any]:
    """Inputs ``x``, labels ``y`` and (LMs) the generate prompt: N tokens, then room for the new ones."""
    import numpy as np

    s = (TINY if tiny else FULL)[model]
    rng = np.random.default_rng(n)
    ids = rng.integers(1, s["vocab"], (s["batch"], n)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}
    if model == "bert":
        x["segment_ids"] = np.zeros_like(ids)
        return {"x": x, "y": rng.integers(0, 2, (s["batch"],)).astype("int32")}
    new = GENERATE_TOKENS[tiny]
    # KerasHub generates into the padded positions of token_ids: prompt mask True, the rest False.
    prompt = {
        "token_ids": np.concatenate([ids, np.zeros((s["batch"], new), "int32")], axis=1),
        "padding_mask": np.concatenate([np.ones_like(ids, bool), np.zeros((s["batch"], new), bool)], axis=1),
    }
    return {"x": x, "y": np.roll(ids, -1, axis=1), "prompt": prompt}


def _pair(model: str, n: int, tiny: bool) -> dict[str, Any]:
    """Both models with the same weights (the DAMCHA one converted, gates closed) and their data."""
    import keras

    import damcha_keras as dk

    keras.utils.set_random_seed(0)
    built = {impl: _build(model, n, tiny) for impl in IMPLS}
    # Same weights by copy, not by seed: the copies are NumPy arrays, so on JAX no buffer is
    # shared between the models (a compiled step donates its state's buffers).
    built["damcha"].set_weights(built["original"].get_weights())
    dk.convert(built["damcha"])
    return {**built, **_data(model, n, tiny)}


def _np(x: Any) -> Any:
    import keras
    import numpy as np

    return np.asarray(keras.ops.convert_to_numpy(x))


def _output(task: Any, model: str, x: Any) -> Any:
    """What the closed-gate check compares: the LMs' logits, BERT's per-token ``sequence_output``
    (the classifier's two logits per row would hide most of the model)."""
    if model == "bert":
        return _np(task.backbone.predict_on_batch(x)["sequence_output"])
    return _np(task.predict_on_batch(x))


def _tokens(task: Any, prompt: Any) -> Any:
    return _np(task.generate(prompt, stop_token_ids=None)["token_ids"])


def _open_gates(task: Any) -> None:
    import numpy as np

    import damcha_keras as dk

    gates = dk.damcha_variables(task, generators=False)
    if not gates:
        raise RuntimeError("the converted model has no DAMCHA gate")
    for v in gates:
        v.assign(np.full(tuple(v.shape), 0.5, dtype=str(v.dtype)))


def _sync(out: Any) -> Any:
    """Wait for a result: the first value of a dict or list, converted to NumPy."""
    if isinstance(out, dict):
        out = next(iter(out.values()))
    if isinstance(out, (list, tuple)):
        out = out[0]
    return _np(out).ravel()[:1]


def _call(pair: dict[str, Any], impl: str, mode: str) -> Callable[[], Any]:
    task = pair[impl]
    if mode == "predict":
        return lambda: task.predict_on_batch(pair["x"])
    if mode == "train":
        return lambda: task.train_on_batch(pair["x"], pair["y"])
    return lambda: task.generate(pair["prompt"], stop_token_ids=None)


def _xla_memory(pair: dict[str, Any], mode: str, n: int) -> dict[str, Any]:
    """The ``memory`` record on JAX: XLA's estimates of both models' compiled steps."""
    from _dropin_keras import _xla_memory as lowered  # the drop-in's lowering of Keras's JAX step

    mems = {impl: lowered(pair[impl], pair["x"], pair["y"], mode) for impl in IMPLS}
    own = {impl: h.xla_own(m) for impl, m in mems.items()}
    return {
        "method": XLA_METHOD,
        **h.memory_comparison(own, "damcha", "original", rep.memory_target(n)),
        "xla_mib": mems,
    }


def measure_case(ses: h.Session, model: str, n: int, todo: dict[str, str], *, repeats: dict[str, int]) -> None:
    """The entries ``todo`` (mode -> id) of ``model`` at N tokens: one pair of models, their
    closed-gate check, then each mode timed with the gates open (``repeats``: mode -> rounds),
    each under its own ``attempt``."""
    import keras

    backend = keras.backend.backend()
    pair = _pair(model, n, ses.tiny)
    outs = {impl: _output(pair[impl], model, pair["x"]) for impl in IMPLS}
    check = h.closed_gate_check(outs["damcha"], outs["original"])
    checks = dict.fromkeys(todo, check)
    if "generate" in todo:
        # Bit-exact at init, so greedy decoding must pick the same tokens (this also compiles generate).
        tokens = {impl: _tokens(pair[impl], pair["prompt"]) for impl in IMPLS}
        differing = int((tokens["damcha"] != tokens["original"]).sum())
        checks["generate"] = {**check, "tokens_differing": differing, "ok": check["ok"] and differing == 0}
    _open_gates(pair["damcha"])
    moved = h.max_rel_diff(_output(pair["damcha"], model, pair["x"]), outs["original"])
    if not moved > 0.0:
        raise RuntimeError(f"{model}: opening the gates left the output unchanged: the maps are not running")
    for mode, entry_id in todo.items():
        with ses.attempt([entry_id], section=SECTION, case=model, mode=mode):
            calls = {impl: _call(pair, impl, mode) for impl in IMPLS}
            # generate: the token check above was each model's first call (KerasHub compiled it then).
            warmup = 1 if mode == "generate" else WARMUP
            times = h.interleaved(calls, repeats=repeats[mode], warmup=warmup, sync=_sync)
            record = h.entry(
                entry_id,
                SECTION,
                model,
                mode,
                shape=_shape(model, n, ses.tiny),
                call=f"{DESCRIPTIONS[model]}; {MODE_TEXT[mode]}",
                baseline="the same KerasHub model before `damcha_keras.convert`",
                backend=backend,
                jit_compile=pair["original"].jit_compile,
                **({"new_tokens": GENERATE_TOKENS[ses.tiny]} if mode == "generate" else {}),
                times=times,
                check={**checks[mode], "open_gates_rel_diff": moved},
                comparisons=[h.comparison("time", times, "damcha", "original", rep.time_target(n))],
            )
            # XLA's estimate on JAX only (see the module docstring); generate is a loop, not one step.
            # (ses.memory: with --tiny only once per worker, which checks the path, two compilations.)
            if backend == "jax" and mode != "generate" and ses.memory:
                record["memory"] = _xla_memory(pair, "train" if mode == "train" else "inference", n)
            ses.record(record)
    del pair
    keras.backend.clear_session()  # the next pair's memory, not this one's, while it is timed
    gc.collect()


def worker(args: argparse.Namespace, path: Path) -> int:
    """One backend's entries, into the results file ``path`` (the parent's run ``--run-index``)."""
    threads = h.fix_threads(args.threads)  # before Keras (and its backend) is imported
    import keras
    from _dropin_keras import setup  # imports Keras: after fix_threads

    if keras.backend.backend() != args.worker:
        print(f"worker {args.worker}: Keras runs {keras.backend.backend()} (KERAS_BACKEND)", file=sys.stderr)
        return 2
    env = {**threads, **setup(args.threads), "pid": os.getpid()}
    results = h.Results(path, resume=True, file_format=rep.FORMAT)
    ses = h.Session(port=f"keras-{args.worker}", sizes=h.Sizes(args.tiny), results=results, run=args.run_index, env=env)
    repeats = dict.fromkeys(MODES, args.repeats or REPEATS[args.worker])
    repeats["generate"] = args.repeats or GENERATE_REPEATS[args.worker]
    for model in args.models:
        for n in args.lengths:
            todo = ses.todo(SECTION, model, n, _modes(model, args.modes))
            if not todo:
                continue
            # Building or checking the pair failed: every mode of it is recorded as an error.
            with ses.attempt(list(todo.values()), section=SECTION, case=model):
                measure_case(ses, model, n, todo, repeats=repeats)
    return 1 if ses.errors else 0


# ------------------------------------------------------------------ driver


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--models", nargs="+", default=list(rep.MODEL_ORDER), choices=list(rep.MODEL_ORDER))
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, help="the modes to measure (default all; BERT has no generate)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        help="timed rounds per entry, each calling both models (default: tensorflow and jax 7; torch 5, "
        "its generate 3)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny models, N=16, 2 repeats: a smoke run")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (and cores) per worker")
    parser.add_argument(
        "--json",
        type=Path,
        help="results file (default benchmarks/results/models-keras-<time>.json; --tiny: none); must not exist",
    )
    parser.add_argument("--resume", type=Path, metavar="FILE", help="continue FILE, skipping the entries it has")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the Markdown file whose section is rewritten")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs section after the run")
    parser.add_argument(
        "--report",
        nargs="*",
        type=Path,
        metavar="FILE",
        help="only rewrite the docs section from these result files, in this order "
        "(default: every benchmarks/results/models-keras-*.json, oldest run first)",
    )
    # Internal: one backend's worker, writing into the parent's file as its run --run-index.
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--run-index", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def report(paths: list[Path], docs: Path) -> int:
    """Rewrite the section of ``docs`` from ``paths`` (none: every results file)."""
    return h.write_report(rep, paths, docs, RESULTS, f"{rep.PREFIX}*.json", "converted-KerasHub-models")


def _worker_argv(args: argparse.Namespace, backend: str, path: Path, run: int) -> list[str]:
    """The options a worker needs, passed on explicitly (the file and run index always)."""
    argv = [str(Path(__file__).resolve()), "--worker", backend, "--run-index", str(run), "--json", str(path)]
    argv += ["--threads", str(args.threads)] + (["--repeats", str(args.repeats)] if args.repeats else [])
    argv += ["--models", *args.models, "--lengths", *map(str, args.lengths)]
    if args.modes:
        argv += ["--modes", *args.modes]
    return argv + (["--tiny"] if args.tiny else [])


def run(args: argparse.Namespace, argv: list[str], path: Path) -> int:
    results = h.Results(path, resume=bool(args.resume), file_format=rep.FORMAT)
    index = results.start_run(
        {
            "command": shlex.join([".venv/bin/python", "benchmarks/bench_models_keras.py", *argv]),
            "argv": argv,
            "started": h.now(),
            "tiny": args.tiny,
            "threads": args.threads,
            "backends": args.backends,
            "models": args.models,
            "lengths": args.lengths,
            "modes": args.modes or list(MODES),
            "repeats": args.repeats
            or {b: {"generate": GENERATE_REPEATS[b], "other": REPEATS[b]} for b in args.backends},
            "generate_tokens": GENERATE_TOKENS[args.tiny],
            "machine": h.machine(),
            "versions": h.versions(),
            "git": h.git_commit(),
            "git_dirty": h.git_dirty_files(),
            "loadavg_start": h.loadavg(),
        }
    )
    print(f"results: {path}", flush=True)
    failed = []
    for backend in args.backends:
        print(f"\n# keras-{backend}", flush=True)
        # KERAS_BACKEND is read once, at import: a process per backend (and no other
        # framework's thread pools in the timings).
        env = {**os.environ, "KERAS_BACKEND": backend}
        if subprocess.run([sys.executable, *_worker_argv(args, backend, path, index)], env=env).returncode:
            failed.append(backend)
    results.update_run(index, finished=h.now(), loadavg_end=h.loadavg(), failed=failed)
    entries = [e for e in results.data["entries"].values() if e.get("run") == index]
    errors = sum("error" in e for e in entries)
    print(
        f"\nfloat32, CPU, {args.threads} threads per worker; time: median (quartiles) of the per-round "
        f"ratios of alternating rounds; memory (JAX): XLA's estimate of the compiled step"
    )
    for port in rep.backends_of(entries):
        print(f"\n{rep.BACKEND_TITLES.get(port, port)}\n")
        print("\n".join(rep.table([e for e in entries if e.get("port") == port])))
    print(
        f"\nresults: {path}"
        + (f"; {errors} entries failed" if errors else "")
        + (f"; failed workers: {failed}" if failed else ""),
        flush=True,
    )
    return 1 if failed or errors else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.report is not None:
        return report(list(args.report), args.docs)
    if args.tiny:
        args.lengths, args.repeats = [16], 2
    if args.worker:
        return worker(args, args.json)
    if args.resume and args.json and args.resume != args.json:
        print("give --resume FILE or --json FILE, not both", file=sys.stderr)
        return 2
    if args.resume and not args.resume.exists():
        print(f"--resume: no such file {args.resume}", file=sys.stderr)
        return 2
    if args.json is not None and args.json.exists() and not args.resume:
        print(
            f"--json: {args.json} exists; continue it with --resume {args.json} or choose another file", file=sys.stderr
        )
        return 2
    with contextlib.ExitStack() as stack:
        path = args.resume or args.json
        if path is None and args.tiny:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="damcha-models-keras-tiny-"))
            path = Path(folder) / "models-keras.json"
        elif path is None:
            path = RESULTS / f"{rep.PREFIX}{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
        rc = run(args, argv, path)
    if args.tiny or args.no_docs:
        return rc
    files = rep.result_files(RESULTS)
    if path.resolve() not in {f.resolve() for f in files}:
        files.append(path)
    return report(files, args.docs) or rc


if __name__ == "__main__":
    sys.exit(main())
