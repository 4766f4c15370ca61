"""The "Converted KerasHub models (Keras 3)" section of docs/benchmarks.md, from bench_models_keras.py's JSON files.

Reading the files, pooling the runs of one commit and the table cells are
``_dropin_report``'s (as for ``_models_report``, the PyTorch models'
section), so every section turns repeated runs into numbers the same way;
the issue-13 targets are ``_models_report``'s. This module adds the
section's markers, method text and one table per Keras backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _dropin_report as dr  # benchmarks/ is on sys.path
import _models_report as mr

FORMAT = "damcha-models-keras/1"
BEGIN = "<!-- models-keras:begin (written by benchmarks/bench_models_keras.py; edits here are overwritten) -->"
END = "<!-- models-keras:end -->"
HEADING = "## Converted KerasHub models (Keras 3)"
PREFIX = "models-keras-"  # result files: benchmarks/results/models-keras-<date>-<time>.json

MODEL_ORDER = ("gpt2", "llama", "gptneox", "bert")
MODE_ORDER = ("predict", "train", "generate")
BACKENDS = ("tensorflow", "jax", "torch")
BACKEND_TITLES = {
    "keras-tensorflow": "TensorFlow backend",
    "keras-jax": "JAX backend",
    "keras-torch": "PyTorch backend",
}

# The targets are issue 13's, as for the PyTorch models (time <= 1.10, memory <= 1.05 at N >= 512).
time_target = mr.time_target
memory_target = mr.memory_target

METHOD = """\
KerasHub models (keras-hub 0.32) built from configs with random weights, at
the sizes of the PyTorch section: GPT-2 (`GPT2CausalLM`: 4 layers, hidden
512, 8 heads of 64, MLP 2048, vocabulary 4096; KerasHub's
`CachedMultiHeadAttention`), Llama (`LlamaCausalLM`: 4 layers, hidden 512,
8 query / 4 key-value heads of 64, GQA so separate query and key maps, RoPE,
MLP 1376, vocabulary 4096), GPT-NeoX (`GPTNeoXCausalLM`: 4 layers, hidden
512, 8 heads of 64 in one fused `_qkv_dense` holding each head's query, key
and value side by side, an interleaved site; rotary on a quarter of each
head, MLP 2048, vocabulary 4096) and BERT (`BertTextClassifier` on a
`BertBackbone`: 4 layers, hidden 512, 8 heads of 64, MLP 2048, vocabulary
4096, 2 classes), all with dropout 0, B=2, N tokens without padding. Each is
measured against itself before conversion: "original" is the model as
built, "DAMCHA" a second copy with the same weights after
`damcha_keras.convert(model)` (metric "heads", coupling auto). Before it is
timed, the converted model with its gates still closed is checked to
reproduce the original's output (the LMs' logits, BERT's
`sequence_output`; relative difference <= 1e-4, float32) and, for
"generate", the same tokens; a failed check is marked **check failed**.
Then every gate is opened to 0.5 (the generators keep their initial
weights), and the converted model's output is checked to have moved.
"predict" is `model.predict_on_batch(x)`, "train" one
`model.train_on_batch(x, y)` after `compile(optimizer=SGD(1e-4),
loss=SparseCategoricalCrossentropy(from_logits=True))` with no metrics (the
LMs' labels are the next tokens, BERT's a class), both compiled as Keras
compiles by default (`jit_compile="auto"`): a `tf.function` graph without
XLA on a CPU-only TensorFlow, `jax.jit` on JAX, eager on PyTorch. "generate"
(the three LMs) is KerasHub's `generate` with the greedy sampler and its KV
cache: the N-token prompt, then 32 new tokens (`stop_token_ids=None`),
compiled by KerasHub as the backend allows (TensorFlow: `tf.function`, JAX:
`jax.jit`, PyTorch: eager under `torch.no_grad`). Each backend runs in its
own process pinned to the thread count given. The two models are built in
one process and called alternately (A B, then B A) after two warm-up
rounds (one for "generate", whose token check made the first calls), 7
rounds on TensorFlow and JAX, 5 on PyTorch (3 for its generate, 32 eager
steps a call); a cell shows the median of the per-round ratios DAMCHA /
original and, in brackets, their quartiles. Runs of the same commit and
thread count are pooled: the median and quartiles are over every round of
every run, and `[k runs: ...]` lists each run's own median; a run of
another commit replaces the rows it measured. Memory (JAX only): XLA's estimate for the
step Keras compiles, `jax.jit(model.predict_step or
model.train_step).lower(state, data).compile().memory_analysis()`, argument
+ output + temp - alias bytes; one measurement, the latest run's. Not
measured on TensorFlow, whose CPU runtime keeps a step's buffers between
calls (a warm call's resident-set increase is not its footprint, and it
reports no CPU peak), on PyTorch (eager Keras; the resident-set method of
the PyTorch section would need a fresh process per model and mode, doubling
the run), nor for "generate" (a loop of cached steps). float32, CPU.

Targets (issue 13): time ratio <= 1.10 and memory ratio <= 1.05 at
N >= 512; **missed** marks a median ratio above its target.

Commands:

    .venv/bin/python benchmarks/bench_models_keras.py                  # every backend and model at N = 256, 1024
    .venv/bin/python benchmarks/bench_models_keras.py --backends jax --models llama
    .venv/bin/python benchmarks/bench_models_keras.py --resume benchmarks/results/models-keras-<stamp>.json
    .venv/bin/python benchmarks/bench_models_keras.py --report         # rewrite this section from the result files
    .venv/bin/python benchmarks/bench_models_keras.py --tiny           # checks the script; measures nothing

A run writes `benchmarks/results/models-keras-<date>-<time>.json` (or
`--json FILE`): the machine, versions, thread count, command line, commit,
load average, every round's wall and CPU time and XLA's estimates, entry by
entry. Then it rewrites this section from every
`benchmarks/results/models-keras-*.json`, oldest run first
(`--report FILE...` uses only the files given, in that order)."""


def load(paths: Sequence[str | Path], *, pool: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(runs, entries) of bench_models_keras.py result files: ``_dropin_report.load``
    (later commits replace, runs of one commit pool), refusing other formats."""
    return dr.load(paths, pool=pool, file_format=FORMAT)


def result_files(folder: str | Path) -> list[Path]:
    """Every ``models-keras-*.json`` in ``folder``, oldest run first (the order ``load``
    needs for a newer commit's rows to replace an older one's)."""
    return sorted(Path(folder).glob(f"{PREFIX}*.json"), key=dr.started_order)


def _rank(value: str, order: Sequence[str]) -> int:
    return order.index(value) if value in order else len(order)


def _order(entry: dict[str, Any]) -> tuple:
    case, mode = entry.get("case", ""), entry.get("mode", "")
    return (_rank(case, MODEL_ORDER), case, dr._n_of(entry), _rank(mode, MODE_ORDER), mode)


def backends_of(entries: list[dict[str, Any]]) -> list[str]:
    """The ports (``keras-<backend>``) of ``entries``, in the order of ``BACKEND_TITLES``."""
    ports = [p for p in BACKEND_TITLES if any(e.get("port") == p for e in entries)]
    return ports + sorted({e.get("port", "?") for e in entries} - set(ports))


def table(entries: list[dict[str, Any]]) -> list[str]:
    """The measured entries of one backend as a Markdown table, in model, N, mode order;
    with memory columns where some entry has a memory record (XLA's estimate on JAX)."""
    measured = sorted((e for e in entries if "error" not in e), key=_order)
    if any("memory" in e for e in measured):
        return dr._table_model(measured, baseline="original")
    lines = [
        "| model | mode | N | original ms | DAMCHA ms | time ratio (quartiles) | target |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    return lines + [dr.time_cells(e) for e in measured]


def render(runs: list[dict[str, Any]], entries: list[dict[str, Any]]) -> str:
    """The whole section (between and including the markers)."""
    out = [BEGIN, HEADING, "", METHOD, ""]
    measured = sorted((e for e in entries if "error" not in e), key=_order)
    if not measured:
        out += [
            "**Not yet measured.** The tables appear here after",
            "`.venv/bin/python benchmarks/bench_models_keras.py` on an idle machine.",
            "",
        ]
    else:
        out += dr.runs_block(runs, measured)
        used = {r for e in measured for r in e.get("runs", [e["run"]])}
        hub = sorted({runs[r]["versions"]["keras-hub"] for r in used if "keras-hub" in runs[r].get("versions", {})})
        if hub:
            out += ["keras-hub " + ", ".join(hub) + ".", ""]
        out += dr.sizes_line(measured)
        for port in backends_of(measured):
            out += [f"### {BACKEND_TITLES.get(port, port)}", ""]
            out += table([e for e in measured if e.get("port") == port])
            out.append("")
    out += dr.failed_block(sorted((e for e in entries if "error" in e), key=lambda e: (e.get("port", ""), *_order(e))))
    out.append(END)
    return "\n".join(out) + "\n"


def write_section(doc: str | Path, text: str) -> None:
    """Replace this section of ``doc`` (between its markers) with ``text``; append it when
    absent. The rest stays."""
    dr.write_section(doc, text, begin=BEGIN, end=END)
