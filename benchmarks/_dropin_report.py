"""The "Drop-in speed" section of docs/benchmarks.md, written from bench_dropin.py's JSON files.

The section sits between two marker comments; everything else in the file
belongs to the other benchmarks' owners and is left as it is.

bench_models.py's report (``_models_report.py``) uses the same reading and
pooling of result files (``load``), the same cells, run lines and model
table, and ``write_section`` with its own markers: one implementation of
how repeated runs become one number.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

BEGIN = "<!-- dropin:begin (written by benchmarks/bench_dropin.py; edits here are overwritten) -->"
END = "<!-- dropin:end -->"
HEADING = "## Drop-in speed: the calls users already write (issue 12)"

PORT_TITLES = {
    "torch": "PyTorch (`nn.MultiheadAttention`)",
    "keras-tensorflow": "Keras 3, TensorFlow backend",
    "keras-jax": "Keras 3, JAX backend",
    "keras-torch": "Keras 3, PyTorch backend",
    "jax": "Flax NNX (`nnx.MultiHeadAttention`)",
}
SECTION_TITLES = {"layer": "layer calls", "decode": "decoding with a KV cache", "model": "whole models"}

METHOD = """\
Every number is a ratio DAMCHA / MHA of the framework's own multi-head
attention, both built in one process and called alternately (A B, then B A)
after warm-up calls, so that load drifts hit both. A cell shows the median of
the per-round ratios and, in brackets, their quartiles. Where the same
commit was measured in several runs, their rounds are pooled: the median and
quartiles are over every round, and `[k runs: ...]` lists each run's own
median (idle runs of unchanged code differ by up to {spread} in these tables,
more than one run's quartiles show; a cell whose runs fall on both sides of
its target says so: its verdict is the pooled median's, and another run may
turn it). Runs are pooled only when they measured the same commit on the same
machine (its platform string names the VM) with the same thread count. DAMCHA layers are
made from the MHA the way a user makes them (`from_mha`, `replace_mha`; same
weights), are checked to reproduce MHA's output with closed gates (relative
difference <= 1e-4; a failed check is marked **check failed**). Since the
forty-fourth session (PyTorch's layer and model rows) and the forty-fifth
(125925c: the Keras and Flax rows, and PyTorch's and Flax's decoding steps)
a run checks what each row times, listed per entry under `check.checked`
in the result files: PyTorch the training rows' outputs and input or parameter
gradients and the second baseline's output; Flax the grad and train rows'
loss and the gradient of every MHA parameter; Keras `predict_on_batch`'s
output and one `train_on_batch` step per model (plain SGD, every weight put
back after) giving MHA's loss and changing each MHA weight as it changes
DAMCHA's copy of it (a learning rate of 2^16, so that a weight's change is
its gradient scaled; the layer runs of 289f34f used 1, whose changes carry
the weights' own float32 rounding, up to 1.8e-5 of the largest change there);
since 289f34f a whole model's attention layers' gradients (Keras: weight
changes) also on their own scale; every timed decoding step,
`torch.compile`d and jitted ones included, against the plain MHA step
(gradients or weight changes that are zero everywhere fail the check). The
training losses: whole models, next-token cross-entropy (LM) and the
encoder's distance to its input (until 289f34f mean(y^2) of the final
LayerNorm's output, about 1 whatever the layers do, which tested the
attention's gradients little: the forty-fourth session's PyTorch model
runs); layers, PyTorch the sum of the output (its gradients with respect to
the inputs), Flax mean(y^2) over the query rows that see a key, Keras the
mean squared output (the mask Keras propagates keeps padded rows out of it).
Runs stored before then checked the forward or inference output only. The
layers are
timed with every gate opened to 0.5 so the cross-head map does its full work
(a trained layer's cost). float32, CPU, fixed thread count (each port in its
own process, pinned to that many cores). Whole models: DAMCHA layers share
one metric generator. Peak memory: resident-set high-water mark (VmHWM) of
one call after a warm-up call, each model in a fresh process, with glibc told
to unmap freed blocks >= 64 KiB (`MALLOC_MMAP_THRESHOLD_=65536`), the method
of `bench_torch.py` (Keras on torch too); Flax and Keras on JAX: XLA's own
estimate of what the compiled call or training step allocates beyond its
arguments (`memory_analysis()`: temp + output - alias bytes; the arguments,
parameters and inputs, exist before the call, as they do before a torch
call whose resident-set increase is measured; "XLA MiB" columns, every part
kept in the result files, and runs stored before the forty-fourth session,
which compared temp + argument + output - alias, re-rendered this way), as a jitted JAX call's resident
set is set by XLA's allocator (the same rows read 0.40-2.58 across two runs);
Keras on TensorFlow: not measured ("-"), as TensorFlow's CPU runtime keeps a
step's buffers between calls (a warm call's resident-set increase read a few
MiB for a step whose attention scores alone need 128 MiB) and reports no CPU
peak of its own.

Keras's `forward` rows call the model eagerly: on JAX, DAMCHA's layer compiles
its maps and attention (`jax.jit`) inside the eager call while Keras's MHA runs
op by op, so those rows (0.5 at N=1024) measure MHA's dispatch as much as
DAMCHA; the `predict` and `train` rows compare both models compiled, as
`model.predict`/`fit` run them. Keras decoding is timed with eager steps;
KerasHub's `generate` compiles its step, which these tables do not time.

Targets (issue 12): layer and whole-model time <= 1.05 at N >= 1024 and
<= 1.10 at N = 256; decode per token <= 1.15 at B=1 (eager) and <= 1.05 at
B=8; a `torch.compile`d DAMCHA step no slower than the eager one
(compiled/eager <= 1.00); peak memory <= 1.05. **missed** marks a median
ratio above its target.

What is measured (B=4, E=512, H=8, d=64 unless a table says otherwise):
layer calls at N in {256, 1024} in the tables below (the script's default adds
4096; every committed layer run passed `--lengths 256 1024`), each Keras backend
in a subprocess of its own; decoding with a KV cache, per token, a
512-token prompt then 32 steps, B=1 and 8, one layer fed random token vectors
and a 4-block LM decoding greedily (PyTorch: eager and `torch.compile`d steps;
Flax: the module's `decode=True` and the functional `decode_step`, jitted;
Keras: eager steps);
whole models, a 6-layer encoder and a 6-layer causal LM (FFN 2048, vocabulary
1024), one training step (SGD) and one inference pass, at N in {256, 1024,
4096} in PyTorch and {256, 1024} in Flax and Keras, whose CPU attention
materialises (B, H, N, N) scores (2 GiB per layer at N=4096: six layers of
training do not fit in this machine's memory). Timed rounds per run: layer
calls 11 at N=256, 7 at N=1024, 3 at N=4096; whole models 7, 5 and 3;
decoding 21 decodes per implementation, each an untimed prompt then 32 timed
steps (7 in the runs before the thirty-sixth session: a B=1 step is about
half a millisecond, and 7 rounds left one run's median to the VM's spread).

Commands (`make bench` runs the first with the other benchmarks):

    .venv/bin/python benchmarks/bench_dropin.py                      # every port and section
    .venv/bin/python benchmarks/bench_dropin.py --port torch --section decode
    .venv/bin/python benchmarks/bench_dropin.py --resume benchmarks/results/dropin-<stamp>.json
    .venv/bin/python benchmarks/bench_dropin.py --report             # rewrite this section from the files it lists
    .venv/bin/python benchmarks/_counts.py --detail                  # aten calls / jaxpr equations, DAMCHA beside MHA

A full run takes about 3 hours 20 minutes on the idle 2-core machine
(PyTorch ~60 min, Flax ~35 min, Keras ~35 min per backend; the decoding
sections about 30 min of it). Each run writes
`benchmarks/results/dropin-<date>-<time>.json` with the machine, versions,
thread count, command line and every raw timing, entry by entry, so an
interrupted run continues with `--resume`; `--only REGEX` selects entries by
id (e.g. `'torch/layer/mask\\+hint/'`); `--tiny` checks the script in about a
minute per port and is never written here."""


def _fmt_ratio(c: dict[str, Any]) -> str:
    r = c["ratio"]
    text = f"{r['median']:.3f} ({r['q1']:.2f}-{r['q3']:.2f})"
    if c.get("per_run"):
        text += f" [{len(c['per_run'])} runs: " + ", ".join(f"{m:.2f}" for m in c["per_run"]) + "]"
    if straddles(c):
        text += " (runs on both sides of the target)"
    return text


def straddles(c: dict[str, Any]) -> bool:
    """A pooled comparison whose runs' own medians fall strictly on both sides of its
    target: the pooled verdict stands, but the runs disagree on it."""
    per_run, target = c.get("per_run") or [], c.get("target")
    return target is not None and any(m > target for m in per_run) and any(m < target for m in per_run)


def run_spread(entries: Iterable[dict[str, Any]]) -> float:
    """The largest difference between two runs' medians of one pooled cell."""
    return max(
        (max(c["per_run"]) - min(c["per_run"]) for e in entries for c in e.get("comparisons", []) if c.get("per_run")),
        default=0.0,
    )


def _fmt_target(target: float | None, met: bool | None) -> str:
    if target is None:
        return "-"
    return f"<= {target:.2f}" + ("" if met else " **missed**")


def _check_mark(entry: dict[str, Any]) -> str:
    check = entry.get("check")
    if check and not check.get("ok", True):
        return f" **check failed** ({check.get('max_rel_diff', float('nan')):.1e})"
    return ""


def _n_of(entry: dict[str, Any]) -> int:
    return int(entry.get("shape", {}).get("N", entry.get("shape", {}).get("B", 0)))


def _machine(run: dict[str, Any]) -> str:
    """The machine a run measured: its platform string (the kernel release names
    the VM image: three "AMD EPYC" VMs measured these tables) and CPU name."""
    m = run.get("machine", {})
    return f"{m.get('platform', '?')}/{m.get('cpu', '?')}"


def _commit(run: dict[str, Any]) -> str:
    """The code a run measured: its commit without the "+dirty" mark where the files
    that differ are docs and result files only (what makes a benchmark checkout dirty;
    runs before the list was recorded are taken so); a run whose code differed from its
    commit is its own (the same files may hold other edits in another run): never pooled."""
    commit = str(run.get("git", "?")).split("+", 1)[0]
    code = [f for f in run.get("git_dirty") or [] if not f.startswith(("docs/", "benchmarks/results/"))]
    return commit + (f"+code-dirty@{run.get('started', '?')}" if code else "")


def _pool(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """One entry from two runs of the same code: every raw timing concatenated and
    each comparison recomputed over all rounds, so the cell's median and quartiles
    are over every round of every run; ``per_run`` keeps each run's own median (the
    spread between idle runs is larger than the spread within one)."""
    from _harness import comparison

    times = {
        name: {kind: list(old["times"][name][kind]) + list(new["times"][name][kind]) for kind in new["times"][name]}
        for name in new["times"]
    }
    comparisons = []
    for c_old, c_new in zip(old["comparisons"], new["comparisons"]):
        pooled = comparison(c_new["label"], times, c_new["num"], c_new["den"], c_new["target"])
        pooled["per_run"] = c_old.get("per_run", [c_old["ratio"]["median"]]) + [c_new["ratio"]["median"]]
        comparisons.append(pooled)
    checks = [e.get("check", {"ok": True}) for e in (old, new)]
    check = {
        "ok": all(c.get("ok", True) for c in checks),
        "max_rel_diff": max(c.get("max_rel_diff", 0.0) for c in checks),
    }
    pooled_entry = {**new, "times": times, "comparisons": comparisons, "check": check}
    pooled_entry["runs"] = old.get("runs", [old["run"]]) + [new["run"]]
    return pooled_entry


def xla_own_memory(memory: dict[str, Any]) -> dict[str, Any]:
    """A memory record holding XLA's parts (``xla_mib``), compared by what each
    program allocates beyond its arguments (``_harness.xla_own``), whichever
    definition the run recorded: one definition across ports and runs."""
    from _harness import memory_comparison, xla_own

    parts = memory["xla_mib"]
    den = "mha" if "mha" in parts else "original"
    own = {impl: xla_own(p) for impl, p in parts.items()}
    return {**memory, **memory_comparison(own, "damcha", den, memory.get("target"))}


def started_order(path: Path) -> tuple[float, str]:
    """A result file's sort key, oldest run first (the order ``load`` needs for a
    newer commit's rows to replace an older one's): its first run's start, then
    its name."""
    try:
        with open(path) as fh:
            runs = json.load(fh).get("runs") or [{}]
        stamp = datetime.datetime.fromisoformat(runs[0]["started"]).timestamp()
    except (OSError, ValueError, KeyError, TypeError):
        stamp = float("inf")  # unreadable or unstamped: last; load() reports what is wrong with it
    return stamp, path.name


def load(
    paths: Sequence[str | Path], *, pool: bool = True, file_format: str | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(runs, entries) of several result files, in the order given.

    A later file's entry replaces an earlier one's, unless both runs measured the
    same commit on the same machine with the same timing setup (rounds' shapes,
    threads): then, with
    ``pool``, the two are pooled (see ``_pool``), so repeated idle runs of one
    code state report one median over all their rounds. Memory is the later
    run's (it is one measurement, not a sample). With ``file_format``, a file
    of another format (another benchmark's) is refused with a ValueError."""
    runs: list[dict[str, Any]] = []
    entries: dict[str, dict[str, Any]] = {}
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        if file_format is not None and data.get("format") != file_format:
            raise ValueError(f"{path}: format {data.get('format')!r}, expected {file_format!r}")
        offset = len(runs)
        for run in data["runs"]:
            runs.append({**run, "file": str(path)})
        for entry_id, entry in data["entries"].items():
            entry = {**entry, "run": entry["run"] + offset}
            if entry.get("memory", {}).get("xla_mib"):
                entry["memory"] = xla_own_memory(entry["memory"])
            old = entries.get(entry_id)
            if (
                pool
                and old is not None
                and "times" in old
                and "times" in entry
                and _commit(runs[old["run"]]) == _commit(runs[entry["run"]])
                and _machine(runs[old["run"]]) == _machine(runs[entry["run"]])
                and runs[old["run"]].get("threads") == runs[entry["run"]].get("threads")
                and set(old["times"]) == set(entry["times"])
                and [c["label"] for c in old["comparisons"]] == [c["label"] for c in entry["comparisons"]]
            ):
                entry = _pool(old, entry)
            entries[entry_id] = entry
    return runs, list(entries.values())


def _commands(runs: list[dict[str, Any]], entries: Iterable[dict[str, Any]]) -> list[str]:
    seen: list[str] = []
    for e in entries:
        for r in e.get("runs", [e["run"]]):
            cmd = runs[r]["command"]
            if cmd not in seen:
                seen.append(cmd)
    return seen


def _run_line(run: dict[str, Any]) -> str:
    v = run.get("versions", {})
    versions = ", ".join(
        f"{k} {v[k]}"
        for k in ("torch", "jax", "flax", "keras", "tensorflow-cpu", "tensorflow", "transformers", "timm")
        if k in v
    )
    m = run.get("machine", {})
    load_ = run.get("loadavg_start"), run.get("loadavg_end")
    return (
        f"{run.get('started', '?')} to {run.get('finished', '?')} on {m.get('cpu', '?')} "
        f"({m.get('cpu_count', '?')} CPUs; {m.get('platform', '?')}"
        + (f"; {' '.join(m['cpu_flags'])}" if m.get("cpu_flags") else "")
        + f"), {run.get('threads', '?')} threads per process; {versions}; "
        f"load average at start {load_[0]}, at end {load_[1]}; commit {run.get('git', '?')}"
    )


def time_cells(e: dict[str, Any]) -> str:
    """An entry's row up to its time target, from its first comparison: case, mode, N,
    baseline ms, DAMCHA ms, ratio (quartiles), target (each table appends its own cells)."""
    c = e["comparisons"][0]
    return (
        f"| {e['case']} | {e['mode']} | {_n_of(e)} | {c['ms'][c['den']]:.1f} | {c['ms'][c['num']]:.1f} "
        f"| {_fmt_ratio(c)}{_check_mark(e)} | {_fmt_target(c['target'], c['met'])} |"
    )


# Further baselines of a layer or model entry (``record_timed(also=...)``), by their
# implementation's name: the column heading of their time and memory.
IMPL_HEADS = {"mha-nofast": "MHA, fast path off"}


def _extra_labels(entries: list[dict[str, Any]]) -> dict[str, str]:
    """The further baselines any entry of a table has, in order: comparison label ->
    implementation."""
    labels: dict[str, str] = {}
    for e in entries:
        for c in e["comparisons"][1:]:
            labels.setdefault(c["label"], c["den"])
    return labels


def _extra_heads(labels: dict[str, str]) -> tuple[str, str]:
    heads = "".join(f" {IMPL_HEADS.get(impl, impl)} ms | DAMCHA/it (quartiles) | target |" for impl in labels.values())
    return heads, "---:|---|---|" * len(labels)


def _extra_cells(e: dict[str, Any], labels: dict[str, str]) -> str:
    """The cells of each further baseline (``-`` where the entry was not measured against it:
    a mode without that baseline, or a run before it was added)."""
    by_label = {c["label"]: c for c in e["comparisons"][1:]}
    cells = ""
    for label in labels:
        c = by_label.get(label)
        if c is None:
            cells += " - | - | - |"
        else:
            cells += f" {c['ms'][c['den']]:.1f} | {_fmt_ratio(c)} | {_fmt_target(c['target'], c['met'])} |"
    return cells


def _table_layer(entries: list[dict[str, Any]]) -> list[str]:
    labels = _extra_labels(entries)
    heads, rule = _extra_heads(labels)
    lines = [
        "| case | mode | N | MHA ms | DAMCHA ms | DAMCHA/MHA (quartiles) | target |" + heads,
        "|---|---|---:|---:|---:|---|---|" + rule,
    ]
    return lines + [time_cells(e) + _extra_cells(e, labels) for e in entries]


def _table_decode(entries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| decoder | B | step | MHA ms/token | DAMCHA ms/token | ratio (quartiles) | target |",
        "|---|---:|---|---:|---:|---|---|",
    ]
    for e in entries:
        for c in e["comparisons"]:
            lines.append(
                f"| {e['case']} | {e['shape']['B']} | {c['label']} ({c['num']} / {c['den']}) | "
                f"{c['ms'][c['den']]:.3f} | {c['ms'][c['num']]:.3f} | {_fmt_ratio(c)}{_check_mark(e)} | "
                f"{_fmt_target(c['target'], c['met'])} |"
            )
    return lines


def _memory_unit(entries: list[dict[str, Any]]) -> str:
    """What a model table's memory columns hold: XLA's estimate (Flax) or the peak RSS."""
    xla = any(e.get("memory", {}).get("method", "").startswith("XLA") for e in entries)
    return "XLA MiB" if xla else "peak MiB"


def _table_model(entries: list[dict[str, Any]], baseline: str = "MHA") -> list[str]:
    """Whole-model rows: time and memory of DAMCHA (each entry's first comparison's
    ``num``) against ``baseline`` (its ``den``: MHA here, the original model in
    bench_models.py's report)."""
    unit = _memory_unit(entries)
    labels = _extra_labels(entries)
    heads, rule = _extra_heads(labels)
    also_mem = sorted({impl for e in entries for impl in e.get("memory", {}).get("also", {})})
    lines = [
        f"| model | mode | N | {baseline} ms | DAMCHA ms | time ratio (quartiles) | target | {baseline} {unit} | "
        f"DAMCHA {unit} | memory ratio | target |"
        + heads
        + "".join(f" {IMPL_HEADS.get(impl, impl)} {unit} | memory ratio | target |" for impl in also_mem),
        "|---|---|---:|---:|---:|---|---|---:|---:|---:|---|" + rule + "---:|---:|---|" * len(also_mem),
    ]
    for e in entries:
        c = e["comparisons"][0]
        mem = e.get("memory")
        if mem:
            ratio = "-" if mem["ratio"] is None else f"{mem['ratio']:.2f}"
            if unit == "XLA MiB" and not mem.get("method", "").startswith("XLA"):
                ratio += " (peak RSS, an older run)"
            mcells = (
                f"{mem['mib'][c['den']]:.1f} | {mem['mib'][c['num']]:.1f} | {ratio} | "
                f"{_fmt_target(mem['target'], mem['met'])}"
            )
        else:
            mcells = "- | - | - | -"
        extra = _extra_cells(e, labels)
        for impl in also_mem:
            m = (mem or {}).get("also", {}).get(impl)
            if m is None:
                extra += " - | - | - |"
            else:
                r = "-" if m["ratio"] is None else f"{m['ratio']:.2f}"
                extra += f" {m['mib'][impl]:.1f} | {r} | {_fmt_target(m['target'], m['met'])} |"
        lines.append(f"{time_cells(e)} {mcells} |{extra}")
    return lines


TABLES = {"layer": _table_layer, "decode": _table_decode, "model": _table_model}


def _order(entry: dict[str, Any]) -> tuple:
    return (entry["case"], entry["mode"], _n_of(entry))


def runs_block(runs: list[dict[str, Any]], entries: list[dict[str, Any]]) -> list[str]:
    """The lines naming every run the entries come from (command, machine, versions,
    load, commit) and counting the measurements, missed targets and failed checks."""
    used = sorted({r for e in entries for r in e.get("runs", [e["run"]])})
    out = ["Runs:", ""]
    for r in used:
        out.append(f"- `{runs[r]['command']}`: {_run_line(runs[r])}")
    out.append("")
    missed = [(e["id"], c["label"]) for e in entries for c in e.get("comparisons", []) if c.get("met") is False]
    missed += [(e["id"], "memory") for e in entries if e.get("memory", {}).get("met") is False]
    missed += [
        (e["id"], f"memory/{impl}")
        for e in entries
        for impl, m in e.get("memory", {}).get("also", {}).items()
        if m.get("met") is False
    ]
    failed = [e["id"] for e in entries if not e.get("check", {}).get("ok", True)]
    split = [(e["id"], c["label"]) for e in entries for c in e.get("comparisons", []) if straddles(c)]
    out.append(
        f"{len(entries)} measurements; targets missed: {len(missed)}"
        + (f"; time cells whose runs fall on both sides of their target: {len(split)}" if split else "")
        + (f"; equality checks failed: {len(failed)}" if failed else "")
        + "."
    )
    out.append("")
    return out


def render(runs: list[dict[str, Any]], entries: list[dict[str, Any]]) -> str:
    """The whole section (between and including the markers)."""
    spread = run_spread(entries)
    method = METHOD.replace(
        "idle runs of unchanged code differ by up to {spread} in these tables",
        f"idle runs of unchanged code differ by up to {spread:.2f} in these tables"
        if spread
        else "no cell here pools several runs; idle runs of unchanged code have differed by 0.2 and more",
    )
    out = [BEGIN, HEADING, "", method, ""]
    if not entries:
        out += [
            "**Not yet measured on an idle machine.** The tables appear here after",
            "`make bench` (or `.venv/bin/python benchmarks/bench_dropin.py`) on a quiet machine.",
            "",
            END,
        ]
        return "\n".join(out) + "\n"
    out += runs_block(runs, entries)
    ports = [p for p in PORT_TITLES if any(e["port"] == p for e in entries)]
    ports += sorted({e["port"] for e in entries} - set(ports))
    for port in ports:
        out.append(f"### {PORT_TITLES.get(port, port)}")
        out.append("")
        for section in ("layer", "decode", "model"):
            group = sorted(
                (e for e in entries if e["port"] == port and e.get("section") == section and "error" not in e),
                key=_order,
            )
            if not group:
                continue
            first = group[0]
            out.append(
                f"**{SECTION_TITLES[section].capitalize()}**, "
                + ", ".join(f"{k}={v}" for k, v in first["shape"].items() if k not in ("N",))
                + ". Command: "
                + "; ".join(f"`{c}`" for c in _commands(runs, group))
            )
            out.append("")
            calls: dict[str, tuple[str, str]] = {}
            for e in group:
                calls.setdefault(e["case"], (e.get("call", ""), e.get("baseline", "")))
            for case, (call, baseline) in calls.items():
                out.append(f"- `{case}`: {call}. Baseline: {baseline}.")
            out.append("")
            out += TABLES[section](group)
            out.append("")
        # A call pattern the run could not measure (the port refused it, or the benchmark
        # broke) has no times: it is listed, never dropped and never put in a table.
        out += failed_block(sorted((e for e in entries if e["port"] == port and "error" in e), key=lambda e: e["id"]))
    out.append(END)
    return "\n".join(out) + "\n"


def failed_block(failed: list[dict[str, Any]]) -> list[str]:
    """The entries a run could not measure (the port refused the call, or the
    benchmark broke), listed in the given order: never dropped, never in a table."""
    if not failed:
        return []
    return ["Not measured (the run raised):", "", *(f"- `{e['id']}`: {e['error']}" for e in failed), ""]


def sizes_line(measured: list[dict[str, Any]]) -> list[str]:
    """ "Measured sizes: ..." of the measured entries' models, each model's shape but N, in order."""
    shapes: dict[str, str] = {}
    for e in measured:
        shapes.setdefault(e["case"], ", ".join(f"{k}={v}" for k, v in e["shape"].items() if k != "N"))
    return ["Measured sizes: " + "; ".join(f"`{case}` {shape}" for case, shape in shapes.items()) + ".", ""]


def _section(begin: str, end: str) -> re.Pattern[str]:
    """The section between the markers, its body as group 1 (and the newline after ``end``)."""
    return re.compile(re.escape(begin) + r"(.*?)" + re.escape(end) + r"\n?", re.S)


def listed_files(doc: str | Path, *, begin: str = BEGIN, end: str = END) -> list[Path]:
    """The result files the section in ``doc`` was written from (its run lines' ``--json FILE``),
    in the order listed; empty when the section is absent or lists none."""
    path = Path(doc)
    match = _section(begin, end).search(path.read_text() if path.exists() else "")
    if match is None:
        return []
    names = re.findall(r"--json (\S+?\.json)", match.group(1))
    return [Path(n) for n in dict.fromkeys(names)]


def write_section(doc: str | Path, text: str, *, begin: str = BEGIN, end: str = END) -> None:
    """Replace the section of ``doc`` between the markers ``begin`` and ``end``
    (this section's by default) with ``text``; append it when absent."""
    path = Path(doc)
    old = path.read_text() if path.exists() else ""
    pattern = _section(begin, end)
    if pattern.search(old):
        new = pattern.sub(lambda _: text, old, count=1)
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text
    path.write_text(new)
