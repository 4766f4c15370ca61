"""The per-port benchmark scripts' result files and docs blocks (benchmarks/_ports_report.py).

bench_torch.py, bench_decode.py, bench_jax.py, bench_keras.py, bench_onnx.py and
bench_headmix.py write every run's raw rounds to a JSON file and regenerate their
blocks of docs/benchmarks.md from it. These tests write synthetic result files
through each script's own writer (nothing is timed), then check that every ratio
the regenerated table prints is the one recomputed here from the stored rounds,
that ``--report`` rewrites only the script's own blocks of a copy of the real doc
(and again to the same bytes), and that a file of another benchmark, a broken file
or a --tiny run is refused by name. The scripts' --tiny runs, checked with the same
``check_result_file``, are in tests/test_benchmarks_quick.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
DOCS = ROOT / "docs" / "benchmarks.md"
sys.path.insert(0, str(BENCH))

import _harness  # noqa: E402
import _ports_report  # noqa: E402
import bench_decode  # noqa: E402  (each is light: its framework is imported only to measure)
import bench_headmix  # noqa: E402
import bench_jax  # noqa: E402
import bench_keras  # noqa: E402
import bench_onnx  # noqa: E402
import bench_torch  # noqa: E402

MODULES = {
    "bench_torch.py": bench_torch,
    "bench_decode.py": bench_decode,
    "bench_jax.py": bench_jax,
    "bench_keras.py": bench_keras,
    "bench_onnx.py": bench_onnx,
    "bench_headmix.py": bench_headmix,
}
SCRIPTS = list(MODULES)
RUN_FIELDS = {
    "command",
    "argv",
    "started",
    "finished",
    "tiny",
    "threads",
    "machine",
    "versions",
    "git",
    "loadavg_start",
    "loadavg_end",
}
med = statistics.median


# ------------------------------------------------------------------ reading the rendered tables


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every Markdown table of ``text``: (the last non-blank line above it, header cells, rows)."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines[:-1]):
        sep = lines[i + 1]
        if line.startswith("|") and sep.startswith("|") and "-" in sep and set(sep) <= set("|-: "):
            title = next((x for x in reversed(lines[:i]) if x.strip()), "")
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            found.append((title, _cells(line), rows))
    return found


def cell(text: str, title: str | None, key: dict[str, str], column: str) -> str:
    """The ``column`` cell of the row whose cells match ``key``, in the table (under a line
    containing ``title``, when given) that has those columns; fails when there is none."""
    for above, header, rows in tables(text):
        if (title is not None and title not in above) or not {column, *key} <= set(header):
            continue
        for row in rows:
            if all(row[header.index(k)] == v for k, v in key.items()):
                return row[header.index(column)]
    raise AssertionError(f"no row {key} with a {column!r} column under {title!r} in:\n{text}")


def expected_cells(script: str, entry: dict[str, Any]) -> list[tuple[str | None, dict[str, str], str, str]]:
    """(table title, row key, column, value) of the cells an entry's row must show, each
    recomputed here from the entry's stored rounds and readings."""
    t = entry.get("times", {})

    def ratio(num: str, den: str, kind: str = "wall") -> float:
        return med(t[num][kind]) / med(t[den][kind])

    if script == "bench_torch.py":
        key = {"N": str(entry["N"]), "mode": entry["mode"]}
        out = [
            (None, key, "rounds", str(entry["rounds"])),
            (None, key, "MHA wall ms", f"{1e3 * med(t['mha']['wall']):.0f}"),
            (None, key, "wall ratio", f"{ratio('damcha', 'mha'):.2f}"),
            (None, key, "CPU ratio", f"{ratio('damcha', 'mha', 'cpu'):.2f}"),
        ]
        if "memory" in entry:
            mib = entry["memory"]["mib"]
            out.append((None, key, "memory ratio", f"{mib['damcha'] / mib['mha']:.2f}" if mib["mha"] > 0 else "-"))
        return out
    if script == "bench_decode.py":
        key = {"B": str(entry["B"]), "step": "eager" if entry["mode"] == "eager" else "`torch.compile`"}
        out = [(None, key, "mha-sdpa ms/token", f"{1e3 * med(t['mha-sdpa']['wall']):.3f}")]
        out += [
            (None, key, impl, f"{ratio(impl, 'mha-sdpa'):.2f}x") for impl in ("mha-prealloc", "damcha-none", "damcha")
        ]
        return out + [(None, key, "damcha / mha-prealloc", f"{ratio('damcha', 'mha-prealloc'):.2f}")]
    if script == "bench_jax.py":
        key = {"N": str(entry["N"]), "pass": entry["pass"]}
        best = min(t["damcha"]["wall"]) / min(t["mha"]["wall"])
        return [
            (None, key, "ratio (median)", f"{ratio('damcha', 'mha'):.3f}"),
            (None, key, "ratio (min)", f"{best:.3f}"),
        ]
    if script == "bench_keras.py":
        return [(None, {"N": str(entry["N"])}, "ratio", f"{ratio('damcha', 'mha'):.3f}")]
    if script == "bench_onnx.py":
        if entry["id"].startswith("encoder/B="):
            key = {"B": str(entry["B"]), "N": str(entry["N"])}
            out = [
                (None, key, "DAMCHA/MHA", f"{ratio('ort/heads/23', 'ort/none/23'):.2f}"),
                (None, key, "ORT decomposed (opset 18) DAMCHA/MHA", f"{ratio('ort/heads/18', 'ort/none/18'):.2f}"),
            ]
            if "torch/heads" in t:
                column = "ORT DAMCHA / torch eager DAMCHA"
                out.append((None, key, column, f"{ratio('ort/heads/23', 'torch/heads'):.2f}"))
            return out
        if entry["id"] == "encoder/int8-error":
            return [("int8", {"measure": k}, "value", f"{v:.3g}") for k, v in entry["errors"].items()]
        if entry.get("runtime") in ("ort", "wasm") and "kind" in entry:
            key = {"model": entry["kind"], "B": str(entry["B"]), "N": str(entry["N"])}
            out = []
            for fmt in bench_onnx.FORMATS:
                if entry["runtime"] == "ort":
                    ms, r = 1e3 * med(t[f"heads|{fmt}"]["wall"]), ratio(f"heads|{fmt}", f"none|{fmt}")
                else:  # the rounds' medians where the run stored them (js/bench.mjs's own before)
                    rounds = entry.get("times_ms")
                    mid = {k: med(v) for k, v in rounds.items()} if rounds else entry["median_ms"]
                    ms, r = mid[f"heads|{fmt}"], mid[f"heads|{fmt}"] / mid[f"none|{fmt}"]
                title = "onnxruntime CPU" if entry["runtime"] == "ort" else "WASM"
                out.append((title, key, fmt, f"{ms:.2f} ({r:.2f})"))
            return out
        return []  # sizes and accuracy: one table each, not rounds
    if script == "bench_headmix.py":
        key = {"N": str(entry["N"]), "impl": entry["impl"]}
        if "error" in entry:
            return [(None, key, "fwd+bwd ms", f"failed: {entry['error'][:60]}")]
        return [(None, key, "fwd+bwd ms", f"{1e3 * med(t['wall']):.1f}")]
    raise AssertionError(script)


def headmix_ratios(entries: list[dict[str, Any]]) -> list[tuple[None, dict[str, str], str, str]]:
    """bench_headmix.py's ratios to the MHA row of the same N (each implementation ran on its own)."""
    by = {(e["impl"], e["N"]): e for e in entries if "error" not in e}
    out = []
    for (impl, n), e in by.items():
        mha = by.get(("mha", n))
        if mha is None:
            continue
        peak = {
            x: max(0, y["memory"]["peak_bytes"] - y["memory"]["base_bytes"]) / 2**20 for x, y in (("e", e), ("m", mha))
        }
        key = {"N": str(n), "impl": impl}
        out.append((None, key, "x MHA time", f"{med(e['times']['wall']) / med(mha['times']['wall']):.2f}"))
        out.append((None, key, "peak MiB", f"{peak['e']:.1f}"))
        out.append((None, key, "x MHA memory", f"{peak['e'] / peak['m']:.1f}" if peak["m"] > 0 else "-"))
    return out


def check_result_file(script: str, path: Path, *, tiny: bool, printed: str | None = None) -> str:
    """The checks of one run's result file: the run's metadata, every entry's rounds, and every
    ratio of the rendered blocks recomputed from those rounds (``printed``: the script's
    stdout, which must show the same rows). Returns the rendered blocks."""
    port = MODULES[script].PORT
    data = json.loads(path.read_text())
    assert data["format"] == port.file_format == f"damcha-bench-{port.name}/1"
    (run,) = data["runs"]
    assert set(run) >= RUN_FIELDS, sorted(RUN_FIELDS - set(run))
    assert f"benchmarks/{script}" in run["command"] and run["tiny"] is tiny and run["threads"] >= 1
    assert {"cpu", "cpu_count"} <= set(run["machine"]) and "python" in run["versions"]
    assert run["git"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", run["git"]), run["git"]
    assert run["started"] <= run["finished"] and all(len(run[k]) == 3 for k in ("loadavg_start", "loadavg_end"))
    entries = list(data["entries"].values())
    assert entries
    for e in entries:
        assert e["run"] == 0 and e["finished"] and "section" in e, e
        for rounds in (e.get("times") or {}).values():
            lists = rounds.values() if isinstance(rounds, dict) else [rounds]
            assert all(len(x) == e["rounds"] and min(x) > 0 for x in lists), e["id"]
    runs, loaded = port.load([path])
    text = "".join(block.render(runs, block.mine(loaded)) for block in port.blocks)
    checks = [c for e in entries for c in expected_cells(script, e)]
    if script == "bench_headmix.py":
        checks += headmix_ratios(entries)
    assert checks
    for title, key, column, value in checks:
        assert cell(text, title, key, column) == value, (key, column)
    assert run["command"] in text
    if printed is not None:  # the run printed the tables the doc gets
        for line in text.splitlines():
            if line.startswith("| "):
                assert line in printed, line
    return text


# ------------------------------------------------------------------ synthetic result files


def _rounds(rng: random.Random, names: tuple[str, ...] | list[str], n: int = 5) -> dict[str, dict[str, list[float]]]:
    # Five uneven rounds: the median, the mean, the minimum and the median of the paired
    # ratios all differ, so a table computed with the wrong one fails the check.
    return {name: {k: [rng.uniform(0.001, 0.01) for _ in range(n)] for k in ("wall", "cpu")} for name in names}


def _entries(script: str, rng: random.Random) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the run's settings, the entries) of a synthetic run of ``script``, as its writer records them."""
    if script == "bench_torch.py":
        entries = [
            {
                "id": f"torch/{mode}/N={n}",
                "section": "layer",
                "N": n,
                "mode": mode,
                "shape": {"B": 4, "N": n, "E": 512, "H": 8},
                "rounds": 5,
                "times": _rounds(rng, bench_torch.IMPLS),
                "memory": {"method": "peak", "mib": {"mha": rng.uniform(10, 20), "damcha": rng.uniform(10, 20)}},
            }
            for n in (256, 4096)
            for mode in bench_torch.MODES
        ]
        return {"shape": {"B": 4, "E": 512, "H": 8}}, entries
    if script == "bench_decode.py":
        entries = [
            {
                "id": f"decode/{mode}/B={b}",
                "section": "decode",
                "mode": mode,
                "B": b,
                "shape": {"B": b, "E": 512, "H": 8, "prompt": 512, "steps": 64},
                "rounds": 5,
                "times": _rounds(rng, bench_decode.IMPLS),
            }
            for mode in bench_decode.MODES
            for b in (1, 8)
        ]
        return {"modes": list(bench_decode.MODES)}, entries
    if script == "bench_jax.py":
        entries = [
            {
                "id": f"jax/{p}/N={n}",
                "section": "layer",
                "N": n,
                "pass": p,
                "shape": {"B": 4, "N": n, "E": 512, "H": 8},
                "rounds": 5,
                "times": _rounds(rng, ("mha", "damcha")),
            }
            for n in (256, 4096)
            for p in bench_jax.PASSES
        ]
        return {"jax_backend": "cpu"}, entries
    if script == "bench_keras.py":
        entries = [
            {
                "id": f"keras-tensorflow/N={n}",
                "section": "layer",
                "N": n,
                "backend": "tensorflow",
                "shape": {"B": 4, "N": n, "E": 512, "H": 8},
                "rounds": 5,
                "times": _rounds(rng, ("mha", "damcha")),
            }
            for n in (256, 4096)
        ]
        return {"backend": "tensorflow", "metric": "heads"}, entries
    if script == "bench_onnx.py":
        shapes = [(1, 128), (8, 512)]
        pairs = [f"{m}|{f}" for m in ("heads", "none") for f in bench_onnx.FORMATS]
        entries = [
            {
                "id": f"encoder/B={b}/N={n}",
                "section": "encoder",
                "B": b,
                "N": n,
                "rounds": 5,
                "times": _rounds(rng, bench_onnx.ORT_KEYS + bench_onnx.TORCH_KEYS),
            }
            for b, n in shapes
        ]
        errors = {"max_abs_vs_float32": 0.0543, "rel_rms_vs_float32": 0.0124, "max_abs_int8_vs_reference": 0.05}
        entries.append({"id": "encoder/int8-error", "section": "encoder", "B": 2, "N": 64, "errors": errors})
        for runtime in ("ort", "wasm"):
            for kind in bench_onnx.KINDS:
                for b, n in shapes:
                    entry = {"id": f"edge/{runtime}/{kind}/B={b}/N={n}", "section": "edge", "runtime": runtime}
                    entry.update(kind=kind, B=b, N=n, rounds=5)
                    if runtime == "ort":
                        entry["times"] = _rounds(rng, pairs)
                    else:
                        # js/bench.mjs's medians (the upper middle of an even count) and, from the
                        # second stored run on, 4 rounds: the table takes the rounds' true median.
                        entry["median_ms"] = {p: rng.uniform(1, 10) for p in pairs}
                        if kind == bench_onnx.KINDS[0]:
                            entry["times_ms"] = {p: [rng.uniform(1, 10) for _ in range(4)] for p in pairs}
                    entries.append(entry)
        sizes = {k: {p: rng.randrange(10_000, 99_999) for p in pairs} for k in bench_onnx.KINDS}
        entries.append({"id": "edge/sizes", "section": "edge", "bytes": sizes})
        acc = {k: {f: {"rel_rms": 1e-3, "max_abs": 2e-3} for f in bench_onnx.FORMATS} for k in bench_onnx.KINDS}
        entries.append({"id": "edge/accuracy", "section": "edge", "B": 2, "N": 64, "errors": acc})
        model = {"width": 256, "heads": 8, "layers": 2, "ffn": 1024}
        return {"section": "all", "model": model, "node": "v20.20.2"}, entries
    if script == "bench_headmix.py":
        entries = []
        for n in (512, 2048):
            for impl in bench_headmix.IMPLS:
                entry = {"id": f"headmix/{impl}/N={n}", "section": "headmix", "impl": impl, "N": n}
                entry.update(shape={"B": 1, "N": n, "E": 128, "H": 4}, rounds=5)
                if (impl, n) == ("talking-heads", 2048):
                    entry["error"] = "MemoryError: out of memory"
                else:
                    base = rng.randrange(100, 200) * 2**20
                    entry["times"] = _rounds(rng, ("x",))["x"]
                    entry["memory"] = {"base_bytes": base, "peak_bytes": base + rng.randrange(1, 50) * 2**20}
                entries.append(entry)
        return {"lengths": [512, 2048]}, entries
    raise AssertionError(script)


def synthetic(script: str, path: Path, *, tiny: bool = False, seed: int = 0) -> Path:
    """A result file of ``script`` written through its own writer (``Port.start/record/finish``)."""
    port = MODULES[script].PORT
    settings, entries = _entries(script, random.Random(seed))
    results = _harness.Results(path, resume=False, file_format=port.file_format)
    with contextlib.redirect_stdout(io.StringIO()):  # (it prints its tables)
        run = port.start(results, ["--json", str(path)], tiny=tiny, threads=2, **settings)
        for entry in entries:
            port.record(results, run, entry)
        args = argparse.Namespace(docs=path.with_suffix(".md"), tiny=tiny, no_docs=True)
        assert port.finish(results, run, args) == 0
    return path


@pytest.fixture()
def doc(tmp_path: Path) -> Path:
    """A copy of the real docs/benchmarks.md."""
    copy = tmp_path / "benchmarks.md"
    copy.write_bytes(DOCS.read_bytes())
    return copy


def _outside(text: str, blocks: list[_ports_report.Block]) -> list[str]:
    """``text`` without the given blocks (in document order), markers included."""
    parts, rest = [], text
    for block in blocks:
        before, begin, after = rest.partition(block.begin)
        assert begin, f"{block.begin} missing"
        body, end, rest = after.partition(block.end)
        assert end and block.begin not in body, f"{block.end} missing"
        parts.append(before)
    return [*parts, rest]


# ------------------------------------------------------------------ the tests


@pytest.mark.parametrize("script", SCRIPTS)
def test_tables_are_recomputed_from_the_stored_rounds(script: str, tmp_path: Path) -> None:
    text = check_result_file(script, synthetic(script, tmp_path / "r.json"), tiny=False)
    assert f"`{tmp_path / 'r.json'}`" in text  # the file the rounds are in is cited


@pytest.mark.parametrize("script", SCRIPTS)
def test_report_rewrites_only_its_own_blocks_and_again_the_same(script: str, tmp_path: Path, doc: Path) -> None:
    module = MODULES[script]
    path = synthetic(script, tmp_path / "r.json")
    before = doc.read_text()
    assert module.main(["--report", str(path), "--docs", str(doc)]) == 0
    after = doc.read_text()
    blocks = list(module.PORT.blocks)
    assert _outside(after, blocks) == _outside(before, blocks)  # every other byte as it was
    for block in blocks:
        body = after.split(block.begin)[1].split(block.end)[0]
        assert "copied by hand" not in body and str(path) in body and "--json" in body
        assert after.count(block.begin) == after.count(block.end) == 1
    assert module.main(["--report", str(path), "--docs", str(doc)]) == 0
    assert doc.read_text() == after  # idempotent


@pytest.mark.parametrize("script", SCRIPTS)
def test_report_refuses_foreign_and_malformed_files(
    script: str, tmp_path: Path, doc: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = MODULES[script]
    other = SCRIPTS[(SCRIPTS.index(script) + 1) % len(SCRIPTS)]
    broken = json.loads(synthetic(script, tmp_path / "own.json").read_text())
    first = next(e for e in broken["entries"].values() if "times" in e)
    del first["times"]
    bad = {
        "foreign.json": json.loads(synthetic(other, tmp_path / "other.json").read_text()),
        "dropin.json": {"format": "damcha-dropin/1", "runs": [], "entries": {}},
        "broken.json": broken,
        "list.json": [1, 2],
    }
    paths = []
    for name, data in bad.items():
        (tmp_path / name).write_text(json.dumps(data))
        paths.append(tmp_path / name)
    (tmp_path / "text.json").write_text("{not json")
    paths += [tmp_path / "text.json", tmp_path / "missing.json"]
    before = doc.read_bytes()
    for path in paths:
        assert module.main(["--report", str(tmp_path / "own.json"), str(path), "--docs", str(doc)]) == 2, path
        err = capsys.readouterr().err
        assert f"{path}:" in err, err
        assert doc.read_bytes() == before
    assert "no field 'times'" in _load_error(module, tmp_path / "broken.json")
    assert f"expected '{module.PORT.file_format}'" in _load_error(module, tmp_path / "foreign.json")


def _load_error(module: Any, path: Path) -> str:
    with pytest.raises(ValueError) as info:
        module.PORT.load([path])
    return str(info.value)


def test_report_refuses_tiny_runs(tmp_path: Path, doc: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = synthetic("bench_jax.py", tmp_path / "tiny.json", tiny=True)
    before = doc.read_bytes()
    assert bench_jax.main(["--report", str(path), "--docs", str(doc)]) == 2
    assert "--tiny" in capsys.readouterr().err and doc.read_bytes() == before


def test_tiny_runs_write_nothing_into_the_results_folder(tmp_path: Path) -> None:
    port = bench_torch.PORT
    with contextlib.ExitStack() as stack:
        tiny = port.output_path(None, True, stack)
        assert tiny is not None and not tiny.resolve().is_relative_to(_ports_report.RESULTS.resolve())
        tiny.write_text("{}")
    assert not tiny.exists()  # the temporary folder went with the run
    full = port.output_path(None, False, contextlib.ExitStack())
    assert (
        full is not None
        and full.parent == _ports_report.RESULTS
        and re.fullmatch(r"torch-\d{8}-\d{6}\.json", full.name)
    )
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    assert port.output_path(taken, False, contextlib.ExitStack()) is None  # never overwrites a run


def test_each_block_defaults_to_the_newest_file_that_measured_it(tmp_path: Path) -> None:
    """bench_onnx.py --section encoder after a full run: the encoder block takes the newer
    file, the edge block keeps the older one (which alone measured it)."""
    older = synthetic("bench_onnx.py", tmp_path / "onnx-20261201-100000.json")
    newer = synthetic("bench_onnx.py", tmp_path / "onnx-20261202-100000.json", seed=1)
    data = json.loads(newer.read_text())
    data["runs"][0]["started"] = "2999-01-01T00:00:00+00:00"
    data["entries"] = {k: e for k, e in data["entries"].items() if e["section"] == "encoder"}
    newer.write_text(json.dumps(data))
    (tmp_path / "jax-20261203-100000.json").write_text("{}")  # another script's file: not looked at
    encoder, edge = bench_onnx.PORT.blocks
    assert encoder.result_files(tmp_path) == [newer] and edge.result_files(tmp_path) == [older]


def test_the_doc_holds_each_block_once_among_the_port_sections() -> None:
    text = DOCS.read_text()
    start, stop = text.index("\n## PyTorch\n"), text.index("<!-- models:begin")
    for module in MODULES.values():
        for block in module.PORT.blocks:
            assert text.count(block.begin) == text.count(block.end) == 1, block.key
            assert start < text.index(block.begin) < text.index(block.end) < stop, block.key


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_committed_blocks_are_earlier_runs_or_what_their_reports_write(script: str) -> None:
    """Each block of the real doc either still holds the earlier, hand-copied run (marked so)
    or equals a fresh render of the result files it cites: no hand edit inside the markers,
    no cited file missing from benchmarks/results/."""
    text = DOCS.read_text()
    for block in MODULES[script].PORT.blocks:
        committed = text[text.index(block.begin) : text.index(block.end) + len(block.end)] + "\n"
        if "copied by hand, no stored raw output" in committed:
            continue
        paths = [ROOT / p for p in dict.fromkeys(re.findall(r"Every round: `([^`]+)`", committed))]
        assert paths and all(p.is_file() for p in paths), [str(p) for p in paths if not p.is_file()]
        assert committed == block.render(*block.load(paths))
