"""Whole converted models vs the originals on CPU: time and peak memory ratios (issue 13).

Usage:
    .venv/bin/python benchmarks/bench_models.py            # gpt2, llama, gptneox, vit at N=576, 1024, 9 rounds (idle machine)
    .venv/bin/python benchmarks/bench_models.py --models vit --lengths 576 --json FILE
    .venv/bin/python benchmarks/bench_models.py --report [FILE...]   # rewrite the docs section only
    .venv/bin/python benchmarks/bench_models.py --tiny     # seconds: checks the script, measures nothing
    .venv/bin/python benchmarks/bench_models.py --counts --lengths 64   # aten ops and copies per converted layer

Models (random weights, built from configs):
- "llama": a 4-layer Llama-style causal LM, hidden 512, 8 query heads of 64,
  4 key/value heads (GQA, so separate query/key maps), MLP 1376, vocab 4096,
  B=2, N tokens; sdpa attention.
- "gptneox": a 4-layer GPT-NeoX (transformers ``GPTNeoXForCausalLM``, Pythia's
  layout: one ``query_key_value`` holding each head's query, key and value in
  turn, an interleaved site; rotary on a quarter of each head), hidden 512, 8
  heads of 64, MLP 2048, vocab 4096, B=2, N tokens; sdpa attention, dropout 0.
- "gpt2": a 4-layer GPT-2 (transformers ``GPT2LMHeadModel``: fused ``c_attn``
  Conv1D, weight (in, out)), hidden 512, 8 heads of 64, vocab 4096, B=2, N
  tokens; sdpa attention, dropout 0 (the same masks in both models).
- "vit": ViT-Tiny (timm ``vit_tiny_patch16_224``: 12 blocks, 192 features,
  3 heads, patch 16) at an image size giving N patches (N=576: 384x384), B=4.

"original" is the model as built; "DAMCHA" is the same model after
``damcha_torch.convert(model)`` (metric "heads", coupling auto, recompute on).
Each entry first checks that the converted model with closed gates gives the
original's output (``_harness.closed_gate_check``), then opens every gate to
0.5 (an open map costs the same, but is honest). "forward" is eval mode under
``torch.inference_mode``; "fwd+bwd" is train mode with a backward of the mean
of the output (the logits); "generate" (GPT-2 and Llama) is eval mode under
``torch.inference_mode``, ``generate`` greedy with the host's KV cache: the
N-token prompt, then 32 new tokens (4 with --tiny).

Times: both models are built in this process and called alternately (A B,
then B A: ``_harness.interleaved``), ``--repeats`` rounds after a warm-up;
every round's wall and process CPU time is kept. Peak memory: each
(implementation, model, N, mode) runs once more in a fresh subprocess: after
a warm-up call the high-water mark (VmHWM) is reset and the RSS noted, then
one call runs; glibc mmaps every block >= 64 KiB so the RSS tracks live
memory. Targets (issue 13): time ratio <= 1.10, memory ratio <= 1.05 at
N >= 512.

Results: every entry (model, mode, N) is written, as soon as it is measured,
to a JSON file (``--json FILE``; default ``benchmarks/results/models-<date>-
<time>.json``; with ``--tiny`` a temporary file, removed at exit, unless ``--json`` is given) with the run's
command, commit, machine, versions, threads and load average (the format of
bench_dropin.py's files, ``"format": "damcha-models/1"``). After a run (not
``--tiny``, not ``--no-docs``) the "Converted third-party models" section of
docs/benchmarks.md is rewritten from every ``benchmarks/results/models-*.json``:
runs of one commit pooled, later commits replacing earlier ones
(``_models_report.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402  (benchmarks/ on sys.path first)
import _models_report as rep  # noqa: E402

RESULTS = HERE / "results"
DOCS = h.REPO / "docs" / "benchmarks.md"
IMPLS = ("original", "damcha")
MODES = ("forward", "fwd+bwd", "generate")
# "generate": greedy decoding with the host's KV cache after an N-token prompt (the language models).
GENERATE_TOKENS = {False: 32, True: 4}  # new tokens per call: full, --tiny


def _modes(model: str, given: list[str] | None = None) -> list[str]:
    return [m for m in (given or MODES) if m != "generate" or model != "vit"]


DESCRIPTIONS = {
    "gpt2": "transformers `GPT2LMHeadModel` (fused `c_attn` Conv1D), sdpa attention, dropout 0",
    "llama": "transformers `LlamaForCausalLM`, GQA (separate query and key maps), RoPE, sdpa attention",
    "gptneox": "transformers `GPTNeoXForCausalLM` (per-head interleaved `query_key_value`), partial RoPE, sdpa",
    "vit": "timm `vit_tiny_patch16_224` at an image size giving N patches (N=576: 384x384)",
}
MEMORY_METHOD = "peak RSS increase (VmHWM) of one call after a warm-up call, a fresh process each"
TINY = {
    "llama": dict(hidden=32, heads=4, kv=2, mlp=64, vocab=64, layers=1, batch=2),
    "gpt2": dict(hidden=32, heads=4, vocab=64, layers=1, batch=2),
    "gptneox": dict(hidden=32, heads=4, mlp=64, vocab=64, layers=1, batch=2),
    "vit": dict(embed=24, depth=1, heads=3, batch=2),
}
FULL = {
    "llama": dict(hidden=512, heads=8, kv=4, mlp=1376, vocab=4096, layers=4, batch=2),
    "gpt2": dict(hidden=512, heads=8, vocab=4096, layers=4, batch=2),
    "gptneox": dict(hidden=512, heads=8, mlp=2048, vocab=4096, layers=4, batch=2),
    "vit": dict(embed=192, depth=12, heads=3, batch=4),
}


def _build(model: str, n: int, tiny: bool):
    """(module, input) for ``model`` at N tokens (patches for the ViT)."""
    import torch

    # transformers and timm both import torchvision (docs/models.md, "Installing on a CPU-only machine").
    from damcha_torch import ensure_torchvision_importable

    ensure_torchvision_importable()
    sizes = (TINY if tiny else FULL)[model]
    if model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=sizes["vocab"],
            hidden_size=sizes["hidden"],
            intermediate_size=sizes["mlp"],
            num_hidden_layers=sizes["layers"],
            num_attention_heads=sizes["heads"],
            num_key_value_heads=sizes["kv"],
            max_position_embeddings=max(n, 64) + GENERATE_TOKENS[False],  # room for generate's tokens
            attn_implementation="sdpa",
        )
        module = LlamaForCausalLM(cfg)
        ids = torch.randint(0, sizes["vocab"], (sizes["batch"], n))
        return (lambda m, x: m(input_ids=x, use_cache=False).logits), module, ids
    if model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=sizes["vocab"],
            n_embd=sizes["hidden"],
            n_layer=sizes["layers"],
            n_head=sizes["heads"],
            n_positions=max(n, 64) + GENERATE_TOKENS[False],  # GPT-2's position table ends there
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,  # GPT-2's 50256 is outside the small vocabulary
            eos_token_id=0,
            attn_implementation="sdpa",
        )
        module = GPT2LMHeadModel(cfg)
        ids = torch.randint(0, sizes["vocab"], (sizes["batch"], n))
        return (lambda m, x: m(input_ids=x, use_cache=False).logits), module, ids
    if model == "gptneox":
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        cfg = GPTNeoXConfig(
            vocab_size=sizes["vocab"],
            hidden_size=sizes["hidden"],
            intermediate_size=sizes["mlp"],
            num_hidden_layers=sizes["layers"],
            num_attention_heads=sizes["heads"],
            rotary_pct=0.25,  # Pythia's
            max_position_embeddings=max(n, 64) + GENERATE_TOKENS[False],
            attention_dropout=0.0,
            hidden_dropout=0.0,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="sdpa",
        )
        module = GPTNeoXForCausalLM(cfg)
        ids = torch.randint(0, sizes["vocab"], (sizes["batch"], n))
        return (lambda m, x: m(input_ids=x, use_cache=False).logits), module, ids
    import timm

    side = int(round(n**0.5))
    patch = 4 if tiny else 16
    module = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=side * patch,
        patch_size=patch,
        embed_dim=sizes["embed"],
        depth=sizes["depth"],
        num_heads=sizes["heads"],
    )
    images = torch.randn(sizes["batch"], 3, side * patch, side * patch)
    return (lambda m, x: m(x)), module, images


def _instance(impl: str, model: str, n: int, tiny: bool) -> tuple[Any, Any, Any]:
    """(call, module, input) of one implementation; both are built from one seed, so
    they hold the same weights and inputs. DAMCHA's gates are still closed (0)."""
    import torch

    import damcha_torch as dt

    torch.manual_seed(0)
    fn, module, x = _build(model, n, tiny)
    if impl == "damcha":
        dt.convert(module)
    return fn, module, x


def _open_gates(module: Any) -> None:
    import torch

    import damcha_torch as dt

    with torch.no_grad():
        for p in dt.damcha_parameters(module, generators=False):
            p.fill_(0.5)


def _timed(fn: Any, module: Any, x: Any, mode: str, tiny: bool):
    """The call timed (and measured) in ``mode``."""
    import torch

    module.train(mode == "fwd+bwd")
    new = GENERATE_TOKENS[tiny]

    def call() -> None:
        if mode == "generate":
            with torch.inference_mode():
                module.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        elif mode == "forward":
            with torch.inference_mode():
                fn(module, x)
        else:
            fn(module, x).mean().backward()
            module.zero_grad(set_to_none=True)

    return call


def _make(impl: str, model: str, n: int, mode: str, tiny: bool):
    fn, module, x = _instance(impl, model, n, tiny)
    if impl == "damcha":
        _open_gates(module)
    return _timed(fn, module, x, mode, tiny)


COPIES = ("cat", "clone", "copy_", "_to_copy", "contiguous", "_reshape_copy", "fill_", "zero_")


def op_counts(model: str, n: int, mode: str, tiny: bool) -> dict[str, float]:
    """aten ops (as dispatched below autograd, backward included) per converted
    layer, DAMCHA minus the original: all of them, the copies, and the MACs of
    the 2-D GEMMs (``mm``, ``addmm``, ``addmm_``: projections, their gradients,
    the generators) relative to the original's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import damcha_torch as dt

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: dict[str, int] = {}
            self.macs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.counts[name] = self.counts.get(name, 0) + 1
            # addmm_: the fused nodes accumulate gradient pieces in place (their GEMMs count too).
            if name in ("addmm", "addmm_", "mm"):
                self.macs += args[-2].numel() * args[-1].shape[-1]
            return func(*args, **(kwargs or {}))

    out = {}
    for impl in ("original", "damcha"):
        call = _make(impl, model, n, mode, tiny)
        call()
        with Count() as counter:
            call()
        out[impl] = (counter.counts, counter.macs)
    layers = len(dt.converted_layers(_instance("damcha", model, n, tiny)[1]))
    (o, o_macs), (d, d_macs) = out["original"], out["damcha"]
    extra = {"ops": (sum(d.values()) - sum(o.values())) / layers}
    for op in COPIES:
        if d.get(op, 0) != o.get(op, 0):
            extra[op] = (d.get(op, 0) - o.get(op, 0)) / layers
    extra["mm MACs %"] = 100.0 * (d_macs - o_macs) / max(o_macs, 1)
    return extra


def _closed_gate_check(built: dict[str, tuple[Any, Any, Any]]) -> dict[str, Any]:
    """Converted with closed gates, the model must compute the original's output:
    otherwise the ratios would compare two different computations."""
    import torch

    outs = {}
    for impl, (fn, module, x) in built.items():
        module.eval()
        with torch.inference_mode():
            outs[impl] = fn(module, x).to(torch.float64).numpy()
    return h.closed_gate_check(outs["damcha"], outs["original"])


def peak_mib(impl: str, model: str, n: int, mode: str, *, tiny: bool, threads: int, fresh: bool = True) -> float:
    """Peak memory (MiB) of one call, in a fresh process (``fresh``) or in this one."""
    if not fresh:
        return h.measure_peak(_make(impl, model, n, mode, tiny))
    argv = [str(Path(__file__).resolve()), "--worker", impl, model, str(n), mode, "--threads", str(threads)]
    return float(h.peak_in_subprocess(argv + (["--tiny"] if tiny else []))["peak_mib"])


def _shape(model: str, n: int, tiny: bool) -> dict[str, Any]:
    sizes = (TINY if tiny else FULL)[model]
    return {"B": sizes["batch"], "N": n, **{k: v for k, v in sizes.items() if k != "batch"}}


def measure(
    model: str, n: int, mode: str, *, repeats: int, tiny: bool, threads: int, fresh: dict[str, bool] | None = None
) -> dict[str, Any]:
    """One entry: closed-gate check, ``repeats`` interleaved rounds of both models and
    each one's peak memory (``fresh``: impl -> whether in a fresh process; default all)."""
    peaks = {
        impl: peak_mib(impl, model, n, mode, tiny=tiny, threads=threads, fresh=(fresh or {}).get(impl, True))
        for impl in IMPLS
    }
    built = {impl: _instance(impl, model, n, tiny) for impl in IMPLS}
    check = _closed_gate_check(built)
    _open_gates(built["damcha"][1])
    times = h.interleaved({impl: _timed(*built[impl], mode, tiny) for impl in IMPLS}, repeats=repeats, warmup=1)
    record = h.entry(
        f"models/{model}/{mode}/N={n}",
        "model",
        model,
        mode,
        shape=_shape(model, n, tiny),
        call=DESCRIPTIONS[model],
        baseline="the same model before `damcha_torch.convert`",
        times=times,
        check=check,
        comparisons=[h.comparison("time", times, "damcha", "original", rep.time_target(n))],
    )
    record["memory"] = {
        "method": MEMORY_METHOD,
        **h.memory_comparison(peaks, "damcha", "original", rep.memory_target(n)),
    }
    return record


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(rep.MODEL_ORDER), choices=list(rep.MODEL_ORDER))
    parser.add_argument("--lengths", type=int, nargs="+", default=[576, 1024])
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, help="the modes to measure (default all; ViT has no generate)"
    )
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds per entry (each calls both models)")
    parser.add_argument("--tiny", action="store_true", help="tiny models, N=16, 2 repeats: a smoke run")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (and cores) of the process")
    parser.add_argument(
        "--json",
        type=Path,
        help="results file (default benchmarks/results/models-<time>.json; --tiny: none); must not exist",
    )
    parser.add_argument("--docs", type=Path, default=DOCS, help="the Markdown file whose models section is rewritten")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs section after the run")
    parser.add_argument(
        "--report",
        nargs="*",
        type=Path,
        metavar="FILE",
        help="only rewrite the docs section from these result files, in this order "
        "(default: every benchmarks/results/models-*.json, oldest run first)",
    )
    parser.add_argument(
        "--counts", action="store_true", help="print aten op and copy counts per converted layer instead of timing"
    )
    parser.add_argument("--worker", nargs=4, metavar=("IMPL", "MODEL", "N", "MODE"), help=argparse.SUPPRESS)
    return parser


def report(paths: list[Path], docs: Path) -> int:
    """Rewrite the models section of ``docs`` from ``paths`` (none: every results file)."""
    return h.write_report(rep, paths, docs, RESULTS, "models-*.json", "converted-models")


def run(args: argparse.Namespace, argv: list[str], path: Path, threads: dict[str, Any]) -> int:
    import torch

    from damcha_torch import _functional as fn

    if os.environ.get("DAMCHA_BENCH_TORCH_OPS") == "1":
        fn._HEADMIX = None  # the maps by torch ops, as without the C kernel: a before/after on one machine
    results = h.Results(path, resume=False, file_format=rep.FORMAT)
    index = results.start_run(
        {
            "command": shlex.join([".venv/bin/python", "benchmarks/bench_models.py", *argv]),
            "argv": argv,
            "started": h.now(),
            "tiny": args.tiny,
            "threads": args.threads,
            "torch_threads": torch.get_num_threads(),
            "models": args.models,
            "lengths": args.lengths,
            "repeats": args.repeats,
            "machine": h.machine(),
            "versions": h.versions(),
            "git": h.git_commit(),
            "git_dirty": h.git_dirty_files(),
            "loadavg_start": h.loadavg(),
            # Which path mapped a few tokens per site (damcha_torch.has_decode_kernel()).
            "decode_kernel": "c" if fn._HEADMIX is not None else "torch-ops",
        }
    )
    env = {**threads, "torch_threads": torch.get_num_threads(), "pid": os.getpid()}
    # The drop-in session records entries (run, env, time, load) and turns an exception into an
    # error entry so the other entries still run; its Sizes are the drop-in's and go unused here.
    ses = h.Session(port="torch", sizes=h.Sizes(args.tiny), results=results, run=index, env=env)
    for model in args.models:
        for n in args.lengths:
            for mode in _modes(model, args.modes):
                # Tiny measures nothing: one worker process checks that path, the rest run here.
                first = (model, n, mode) == (args.models[0], args.lengths[0], _modes(args.models[0], args.modes)[0])
                fresh = {"original": first, "damcha": False} if args.tiny else None
                entry_id = f"models/{model}/{mode}/N={n}"
                with ses.attempt([entry_id], section="model", case=model, mode=mode):
                    ses.record(
                        measure(model, n, mode, repeats=args.repeats, tiny=args.tiny, threads=args.threads, fresh=fresh)
                    )
    results.update_run(index, finished=h.now(), loadavg_end=h.loadavg(), errors=ses.errors)
    print(
        f"\nfloat32, CPU, {args.threads} threads; time: median (quartiles) of the per-round ratios of "
        f"{args.repeats} alternating rounds; peak: RSS increase of one call in a fresh process\n"
    )
    print("\n".join(rep.table(list(results.data["entries"].values()))))
    print(f"\nresults: {path}" + (f"; {ses.errors} entries failed" if ses.errors else ""), flush=True)
    return 1 if ses.errors else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.report is not None:
        return report(list(args.report), args.docs)
    threads = h.fix_threads(args.threads)  # before torch is imported
    if args.tiny:
        args.lengths, args.repeats = [16], 2
    if args.worker:
        impl, model, n, mode = args.worker
        print(json.dumps({"peak_mib": peak_mib(impl, model, int(n), mode, tiny=args.tiny, threads=0, fresh=False)}))
        return 0
    if args.counts:
        for model in args.models:
            for mode in _modes(model, args.modes):
                extra = op_counts(model, args.lengths[0], mode, args.tiny)
                print(
                    f"{model} {mode}: per converted layer, vs the original: "
                    + ", ".join(f"{k} {v:+.1f}" for k, v in extra.items()),
                    flush=True,
                )
        return 0
    if args.json is not None and args.json.exists():
        print(f"--json: {args.json} exists; choose another file (runs are pooled across files)", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        path = args.json
        if path is None and args.tiny:
            path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="damcha-models-tiny-"))) / "models.json"
        elif path is None:
            path = RESULTS / f"models-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
        rc = run(args, argv, path, threads)
    if args.tiny or args.no_docs:
        return rc
    files = rep.result_files(RESULTS)
    if path.resolve() not in {f.resolve() for f in files}:
        files.append(path)
    return report(files, args.docs) or rc


if __name__ == "__main__":
    sys.exit(main())
