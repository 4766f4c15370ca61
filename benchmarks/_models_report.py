"""The "Converted third-party models" section of docs/benchmarks.md, written from bench_models.py's JSON files.

Reading the files, pooling the runs of one commit (one median over every
round of every run, each run's own median listed) and the table cells are
``_dropin_report``'s, so both sections turn repeated runs into numbers the
same way; this module adds the section's markers, method text and layout.
The hand-written history below the end marker is left as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _dropin_report as dr  # benchmarks/ is on sys.path

FORMAT = "damcha-models/1"
BEGIN = "<!-- models:begin (written by benchmarks/bench_models.py; edits here are overwritten) -->"
END = "<!-- models:end -->"
HEADING = "## Converted third-party models (PyTorch)"

# Issue 13: converted / original, with recompute, at sequence lengths >= 512.
TARGET_TIME = 1.10
TARGET_MEMORY = 1.05
TARGET_MIN_N = 512
MODEL_ORDER = ("gpt2", "llama", "gptneox", "vit")

METHOD = """\
Whole models built from configs with random weights: GPT-2 (transformers
`GPT2LMHeadModel`, 4 layers, hidden 512, 8 heads of 64, fused `c_attn`
Conv1D, vocabulary 4096, B=2), a Llama-style LM (`LlamaForCausalLM`, 4
layers, hidden 512, 8 query / 4 key-value heads of 64: GQA, so separate
query and key maps; RoPE, MLP 1376, vocabulary 4096, B=2), a GPT-NeoX
(`GPTNeoXForCausalLM`, Pythia's layout: 4 layers, hidden 512, 8 heads of 64
in one `query_key_value` holding each head's query, key and value in turn,
an interleaved site; rotary on a quarter of each head, MLP 2048, vocabulary
4096, B=2), all three with sdpa attention and dropout 0, and ViT-Tiny
(timm `vit_tiny_patch16_224`: 12 blocks, 192 features, 3 heads, patch 16, at
an image size giving N patches, N=576: 384x384; B=4). Each is measured
against itself
before conversion: "original" is the model as built, "DAMCHA" the same model
(same weights, same inputs) after `damcha_torch.convert(model)` (metric
"heads", coupling auto, `recompute=True`). Before it is timed, the converted
model with its gates still closed is checked to reproduce the original's
output (relative difference <= 1e-4, float32; a failed check is marked
**check failed**); then every gate is opened to 0.5, so the maps do their
full work (a trained model's cost). "forward" is eval mode under
`torch.inference_mode`; "fwd+bwd" is one training step without the
optimizer (train mode, backward of the mean logit); "generate" (the three
LMs) is greedy `generate` with the host's KV cache in eval mode under
`torch.inference_mode`: the N-token prompt, then 32 new tokens, B as above
(every step after the prompt maps B tokens per site, with the C kernel
where it is built: docs/torch.md). The two models are
built in one process and called alternately (A B, then B A) after a warm-up
call; a cell shows the median of the per-round ratios DAMCHA / original and,
in brackets, their quartiles. Runs of the same commit and thread count are
pooled: the median and quartiles are over every round of every run, and
`[k runs: ...]` lists each run's own median (single idle runs of unchanged
code have moved rows by up to 0.18 on this machine); a run of another commit
replaces the rows it measured. Peak memory: resident-set high-water mark
(VmHWM) of one call after a warm-up call, each (model, N, mode,
implementation) in a fresh process with glibc told to unmap freed blocks
>= 64 KiB (`MALLOC_MMAP_THRESHOLD_=65536`); one measurement, the latest
run's. float32, CPU.

Targets (issue 13): time ratio <= 1.10 and memory ratio <= 1.05 at
N >= 512 (with `recompute=True`); **missed** marks a median ratio above its
target.

Commands (`make bench` runs the first with the other benchmarks):

    .venv/bin/python benchmarks/bench_models.py                  # gpt2, llama, gptneox, vit at N = 576, 1024; 9 rounds
    .venv/bin/python benchmarks/bench_models.py --report         # rewrite this section from the result files
    .venv/bin/python benchmarks/bench_models.py --counts --lengths 64   # aten ops and copies per converted layer
    .venv/bin/python benchmarks/bench_models.py --tiny           # checks the script; measures nothing

A run writes `benchmarks/results/models-<date>-<time>.json` (or
`--json FILE`): the machine, versions, thread count, command line, commit,
load average, every round's wall and CPU time and the peaks, entry by entry.
Then it rewrites this section from every `benchmarks/results/models-*.json`,
oldest run first, so repeated runs of the newest commit pool and replace
older commits' rows (`--report FILE...` uses only the files given, in that
order)."""


def time_target(n: int) -> float | None:
    """The issue-13 target of a time ratio at sequence length ``n`` (None: informative only)."""
    return TARGET_TIME if n >= TARGET_MIN_N else None


def memory_target(n: int) -> float | None:
    """The issue-13 target of a peak-memory ratio at sequence length ``n``."""
    return TARGET_MEMORY if n >= TARGET_MIN_N else None


def load(paths: Sequence[str | Path], *, pool: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(runs, entries) of bench_models.py result files: ``_dropin_report.load``
    (later commits replace, runs of one commit pool), refusing other formats."""
    return dr.load(paths, pool=pool, file_format=FORMAT)


def result_files(folder: str | Path) -> list[Path]:
    """Every ``models-*.json`` in ``folder``, oldest run first (the order ``load`` needs
    for a newer commit's rows to replace an older one's), except bench_models_keras.py's
    ``models-keras-*.json``, which the glob matches too and ``load`` would refuse."""
    found = (p for p in Path(folder).glob("models-*.json") if not p.name.startswith("models-keras-"))
    return sorted(found, key=dr.started_order)


def _order(entry: dict[str, Any]) -> tuple:
    case = entry.get("case", "")
    rank = MODEL_ORDER.index(case) if case in MODEL_ORDER else len(MODEL_ORDER)
    return (rank, case, dr._n_of(entry), entry.get("mode", ""))


def table(entries: list[dict[str, Any]]) -> list[str]:
    """The measured entries as one Markdown table, in model, N, mode order."""
    return dr._table_model(sorted((e for e in entries if "error" not in e), key=_order), baseline="original")


def render(runs: list[dict[str, Any]], entries: list[dict[str, Any]]) -> str:
    """The whole section (between and including the markers)."""
    out = [BEGIN, HEADING, "", METHOD, ""]
    measured = sorted((e for e in entries if "error" not in e), key=_order)
    if not measured:
        out += [
            "**Not yet measured with the JSON results.** The table appears here after",
            "`.venv/bin/python benchmarks/bench_models.py` on an idle machine; the earlier runs'",
            "numbers are below.",
            "",
        ]
    else:
        out += dr.runs_block(runs, measured)
        out += dr.sizes_line(measured)
        out += table(measured)
        out.append("")
    out += dr.failed_block(sorted((e for e in entries if "error" in e), key=_order))
    out.append(END)
    return "\n".join(out) + "\n"


def write_section(doc: str | Path, text: str) -> None:
    """Replace this section of ``doc`` (between its markers) with ``text``; the rest stays."""
    dr.write_section(doc, text, begin=BEGIN, end=END)
