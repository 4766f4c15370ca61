"""The benchmark reports' pooling of repeated runs (benchmarks/_dropin_report.py, and
benchmarks/_models_report.py for bench_models.py, which uses the same function).

A row measured in several idle runs of the same commit is reported as one
median over every round of every run, with each run's own median beside it;
runs of different commits are never pooled (the later replaces the earlier).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _dropin_report  # noqa: E402
import _harness  # noqa: E402
import _models_keras_report  # noqa: E402
import _models_report  # noqa: E402
import bench_models  # noqa: E402  (light: torch is imported only when something is measured)
import bench_models_keras  # noqa: E402  (light: Keras is imported only in its per-backend workers)

ENTRY_ID = "torch/layer/cross/forward/N=256"


def _result_file(path: Path, commit: str, damcha: list[float], mha: list[float], *, threads: int = 2) -> Path:
    """A bench_dropin.py results file holding one layer entry with these wall times."""
    ratios = [a / b for a, b in zip(damcha, mha)]
    entry = {
        "id": ENTRY_ID,
        "port": "torch",
        "section": "layer",
        "case": "cross",
        "mode": "forward",
        "shape": {"B": 4, "N": 256, "E": 512, "H": 8},
        "call": "attn(x, c, c)",
        "baseline": "the same call",
        "run": 0,
        "times": {"damcha": {"wall": damcha, "cpu": damcha}, "mha": {"wall": mha, "cpu": mha}},
        "check": {"ok": True, "max_rel_diff": 1e-7},
        "comparisons": [
            {
                "label": "time",
                "num": "damcha",
                "den": "mha",
                "target": 1.10,
                "met": statistics.median(ratios) <= 1.10,
                "ms": {"damcha": 1e3 * statistics.median(damcha), "mha": 1e3 * statistics.median(mha)},
                "ratio": {"median": statistics.median(ratios), "q1": min(ratios), "q3": max(ratios)},
            }
        ],
    }
    run = {"command": f"bench_dropin.py --json {path.name}", "git": commit, "threads": threads, "tiny": False}
    path.write_text(json.dumps({"runs": [run], "entries": {ENTRY_ID: entry}}))
    return path


@pytest.fixture()
def two_runs(tmp_path: Path) -> tuple[Path, Path, list[float]]:
    # Run 1 reads 1.2 in every round, run 2 reads 1.0: pooled, the median of the
    # six per-round ratios is 1.1 (any pooling that keeps one run reads 1.2 or 1.0).
    first = _result_file(tmp_path / "a.json", "abc123+dirty", [1.2, 1.2, 1.2], [1.0, 1.0, 1.0])
    second = _result_file(tmp_path / "b.json", "abc123", [2.0, 2.0, 2.0], [2.0, 2.0, 2.0])
    return first, second, [1.2] * 3 + [1.0] * 3


def test_runs_of_one_commit_are_pooled(two_runs: tuple[Path, Path, list[float]]) -> None:
    first, second, ratios = two_runs
    runs, entries = _dropin_report.load([first, second])
    (entry,) = entries
    c = entry["comparisons"][0]
    assert c["ratio"]["rounds"] == 6 and c["ratio"]["median"] == pytest.approx(statistics.median(ratios))
    assert c["per_run"] == pytest.approx([1.2, 1.0]) and entry["runs"] == [0, 1]
    assert c["met"] is (statistics.median(ratios) <= 1.10)
    assert len(entry["times"]["damcha"]["wall"]) == 6
    text = _dropin_report.render(runs, entries)
    assert "1.100 (" in text and "[2 runs: 1.20, 1.00]" in text
    # Both runs' commands and run lines are cited.
    assert "--json a.json" in text and "--json b.json" in text


def test_runs_on_two_machines_are_not_pooled(two_runs: tuple[Path, Path, list[float]]) -> None:
    """Three "AMD EPYC" VMs (one with AVX-512) measured these tables: runs of one commit
    on different machines (platform strings) are not pooled; the later replaces the
    earlier, as for another commit."""
    first, second, _ = two_runs
    for path, platform in ((first, "Linux-6.18-fc-v1045"), (second, "Linux-6.18-fc-v1300")):
        data = json.loads(path.read_text())
        data["runs"][0]["machine"] = {"platform": platform, "cpu": "AMD EPYC", "cpu_count": 2}
        path.write_text(json.dumps(data))
    runs, (entry,) = _dropin_report.load([first, second])
    c = entry["comparisons"][0]
    assert len(entry["times"]["damcha"]["wall"]) == 3 and c["ratio"]["median"] == pytest.approx(1.0)
    assert "per_run" not in c
    assert "Linux-6.18-fc-v1300" in _dropin_report.render(runs, [entry])


def test_a_cell_whose_runs_disagree_on_its_target_says_so(two_runs: tuple[Path, Path, list[float]]) -> None:
    """Pooled runs reading 1.20 and 1.00 against a 1.10 target: the cell keeps the pooled
    median's verdict and says its runs fall on both sides; the count line counts it and
    the method text gives the largest spread between runs (0.20); runs on one side
    (1.20 and 1.15) are not marked."""
    first, second, _ = two_runs
    runs, entries = _dropin_report.load([first, second])
    text = _dropin_report.render(runs, entries)
    assert "[2 runs: 1.20, 1.00] (runs on both sides of the target)" in text
    assert "time cells whose runs fall on both sides of their target: 1" in text
    assert "differ by up to 0.20 in these tables" in text
    same_side = _result_file(second.parent / "c.json", "abc123", [2.3, 2.3, 2.3], [2.0, 2.0, 2.0])
    runs, entries = _dropin_report.load([first, same_side])
    text = _dropin_report.render(runs, entries)
    assert "[2 runs: 1.20, 1.15] |" in text and "both sides" not in text.split("Runs:", 1)[1]


def test_report_without_files_rewrites_the_section_from_the_files_it_lists(tmp_path: Path) -> None:
    """`bench_dropin.py --report` with no file took the newest result file alone: run on the real
    doc it rewrote the pooled section (172 entries from 31 files) as one run's rows, dropping every
    miss. Now it reads the files the section's run lines list, in their order."""
    import bench_dropin

    old = _result_file(tmp_path / "a.json", "abc123", [1.2, 1.2, 1.2], [1.0, 1.0, 1.0])
    other = json.loads(old.read_text())
    other["entries"]["torch/layer/self/forward/N=256"] = dict(
        other["entries"].pop(ENTRY_ID), id="torch/layer/self/forward/N=256", case="self"
    )
    newest = tmp_path / "b.json"
    newest.write_text(json.dumps(other))
    for path in (old, newest):  # the run lines name the files as the command gave them
        data = json.loads(path.read_text())
        data["runs"][0]["command"] = f"bench_dropin.py --json {path}"
        path.write_text(json.dumps(data))
    doc = tmp_path / "doc.md"
    doc.write_text("# Benchmarks\n\nkept\n")
    _dropin_report.write_section(doc, _dropin_report.render(*_dropin_report.load([old, newest])))
    written = doc.read_text()
    assert _dropin_report.listed_files(doc) == [old, newest]
    assert bench_dropin.report([], doc) == 0
    assert doc.read_text() == written
    assert _dropin_report.listed_files(tmp_path / "missing.md") == []


def test_runs_of_different_commits_are_not_pooled(tmp_path: Path) -> None:
    first = _result_file(tmp_path / "a.json", "abc123", [1.2, 1.2, 1.2], [1.0, 1.0, 1.0])
    second = _result_file(tmp_path / "b.json", "def456", [2.0, 2.0, 2.0], [2.0, 2.0, 2.0])
    runs, entries = _dropin_report.load([first, second])
    (entry,) = entries
    c = entry["comparisons"][0]
    assert c["ratio"]["median"] == pytest.approx(1.0) and "per_run" not in c and "runs" not in entry
    text = _dropin_report.render(runs, entries)
    assert "[2 runs:" not in text and "--json a.json" not in text


def test_runs_with_other_thread_counts_are_not_pooled(tmp_path: Path) -> None:
    first = _result_file(tmp_path / "a.json", "abc123", [1.2, 1.2, 1.2], [1.0, 1.0, 1.0], threads=1)
    second = _result_file(tmp_path / "b.json", "abc123", [2.0, 2.0, 2.0], [2.0, 2.0, 2.0])
    _, entries = _dropin_report.load([first, second])
    assert entries[0]["comparisons"][0]["ratio"]["median"] == pytest.approx(1.0)


def test_pooling_can_be_switched_off(two_runs: tuple[Path, Path, list[float]]) -> None:
    first, second, _ = two_runs
    _, entries = _dropin_report.load([first, second], pool=False)
    assert entries[0]["comparisons"][0]["ratio"]["median"] == pytest.approx(1.0)


def test_a_call_pattern_that_raised_is_listed_not_tabled(tmp_path: Path) -> None:
    # bench_dropin's Session.attempt records an entry with no times and no mode when
    # a port refuses a call pattern; the report must still render and must name it.
    path = _result_file(tmp_path / "a.json", "abc123", [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    data = json.loads(path.read_text())
    failed_id = "torch/layer/cross/fwd+bwd/N=256"
    data["entries"][failed_id] = {
        "id": failed_id,
        "port": "torch",
        "section": "layer",
        "case": "cross",
        "error": "DamchaValueError: attn_mask.shape=(3, 3) refused",
        "error_kind": "damcha",
        "run": 0,
    }
    path.write_text(json.dumps(data))
    runs, entries = _dropin_report.load([path])
    text = _dropin_report.render(runs, entries)
    table_rows = [line for line in text.splitlines() if line.startswith("| cross |")]
    assert len(table_rows) == 1 and "| forward |" in table_rows[0]
    assert f"- `{failed_id}`: DamchaValueError: attn_mask.shape=(3, 3) refused" in text
    assert "2 measurements; targets missed: 0." in text


# ------------------------------------------------ bench_models.py's report (issue 13)


def _model_entry(
    model: str,
    mode: str,
    n: int,
    damcha: list[float],
    original: list[float],
    *,
    peaks: tuple[float, float] = (100.0, 100.0),
    check_ok: bool = True,
) -> dict:
    """A bench_models.py entry built the way bench_models.measure builds one, from these wall times."""
    times = {"damcha": {"wall": damcha, "cpu": damcha}, "original": {"wall": original, "cpu": original}}
    entry = _harness.entry(
        f"models/{model}/{mode}/N={n}",
        "model",
        model,
        mode,
        shape={"B": 2, "N": n, "hidden": 32},
        call=bench_models.DESCRIPTIONS[model],
        baseline="the same model before conversion",
        times=times,
        check={"ok": check_ok, "max_rel_diff": 0.0 if check_ok else 0.5},
        comparisons=[_harness.comparison("time", times, "damcha", "original", _models_report.time_target(n))],
    )
    memory = _harness.memory_comparison(
        {"damcha": peaks[0], "original": peaks[1]}, "damcha", "original", _models_report.memory_target(n)
    )
    return {**entry, "port": "torch", "run": 0, "memory": {"method": "peak RSS", **memory}}


def _models_file(
    path: Path, commit: str, entries: list[dict], *, started: str = "2026-12-01T20:00:00+00:00", tiny: bool = False
) -> Path:
    run = {
        "command": f".venv/bin/python benchmarks/bench_models.py --json {path.name}",
        "git": commit,
        "threads": 2,
        "tiny": tiny,
        "started": started,
        "versions": {"torch": "2.13.0", "transformers": "4.0"},
    }
    data = {"format": _models_report.FORMAT, "runs": [run], "entries": {e["id"]: e for e in entries}}
    path.write_text(json.dumps(data))
    return path


def test_models_runs_of_one_commit_are_pooled_and_marked(tmp_path: Path) -> None:
    # Each run's own median is 1.3 and 1.0; pooled, the six rounds' median is 1.15,
    # above the 1.10 target although the later run alone meets it.
    first = _models_file(
        tmp_path / "models-a.json", "abc123+dirty", [_model_entry("vit", "fwd+bwd", 576, [1.3] * 3, [1.0] * 3)]
    )
    second = _models_file(
        tmp_path / "models-b.json", "abc123", [_model_entry("vit", "fwd+bwd", 576, [2.0] * 3, [2.0] * 3)]
    )
    runs, entries = _models_report.load([first, second])
    (entry,) = entries
    c = entry["comparisons"][0]
    assert c["ratio"]["rounds"] == 6 and c["ratio"]["median"] == pytest.approx(1.15)
    assert c["per_run"] == pytest.approx([1.3, 1.0]) and entry["runs"] == [0, 1] and c["met"] is False
    assert _models_report.load([second])[1][0]["comparisons"][0]["met"] is True
    text = _models_report.render(runs, entries)
    row = next(line for line in text.splitlines() if line.startswith("| vit |"))
    assert "1.150 (" in row and "[2 runs: 1.30, 1.00]" in row and "<= 1.10 **missed**" in row
    assert "--json models-a.json" in text and "--json models-b.json" in text and "targets missed: 1" in text


def test_models_newer_commit_replaces_older_rows(tmp_path: Path) -> None:
    old = _models_file(
        tmp_path / "models-z-old.json",
        "abc123",
        [
            _model_entry("gpt2", "forward", 1024, [1.3] * 3, [1.0] * 3),
            _model_entry("llama", "forward", 1024, [1.2] * 3, [1.0] * 3),
        ],
        started="2026-12-01T20:00:00+00:00",
    )
    new = _models_file(
        tmp_path / "models-a-new.json",
        "def456",
        [_model_entry("gpt2", "forward", 1024, [1.0] * 3, [1.0] * 3)],
        started="2026-12-01T21:00:00+00:00",
    )
    # The default file list is ordered by when each run started, not by name.
    assert _models_report.result_files(tmp_path) == [old, new]
    runs, entries = _models_report.load(_models_report.result_files(tmp_path))
    by_id = {e["id"]: e for e in entries}
    gpt2 = by_id["models/gpt2/forward/N=1024"]["comparisons"][0]
    assert gpt2["ratio"]["median"] == pytest.approx(1.0) and "per_run" not in gpt2
    assert by_id["models/llama/forward/N=1024"]["comparisons"][0]["ratio"]["median"] == pytest.approx(1.2)
    text = _models_report.render(runs, entries)
    assert "[2 runs:" not in text and "commit def456" in text and "commit abc123" in text
    lines = text.splitlines()
    assert lines.index(next(x for x in lines if x.startswith("| gpt2 |"))) < lines.index(
        next(x for x in lines if x.startswith("| llama |"))
    )


def test_models_targets_apply_from_n_512(tmp_path: Path) -> None:
    entries = [
        _model_entry("llama", "forward", 256, [1.5] * 3, [1.0] * 3, peaks=(120.0, 100.0)),
        _model_entry("llama", "forward", 576, [1.05] * 3, [1.0] * 3, peaks=(106.0, 100.0)),
        _model_entry("llama", "fwd+bwd", 576, [1.0] * 3, [1.0] * 3, check_ok=False),
    ]
    runs, loaded = _models_report.load([_models_file(tmp_path / "m.json", "abc", entries)])
    rows = {line.split(" | ")[2] + line.split(" | ")[1]: line for line in _models_report.table(loaded)[2:]}
    # N < 512: informative only, whatever the ratio.
    assert rows["256forward"].count("| - |") == 2 and "missed" not in rows["256forward"]
    assert "<= 1.10 |" in rows["576forward"] and "1.06 | <= 1.05 **missed**" in rows["576forward"]
    assert "**check failed**" in rows["576fwd+bwd"] and "1.00 | <= 1.05 |" in rows["576fwd+bwd"]
    assert "targets missed: 1; equality checks failed: 1." in _models_report.render(runs, loaded)


def test_models_section_replacement_keeps_the_rest_of_the_doc(tmp_path: Path) -> None:
    before = "# Benchmarks\n\n## PyTorch\n\nhand-written, kept\n\n"
    after = (
        "\n### Earlier runs\n\nhistory, kept\n\n"
        + _dropin_report.BEGIN
        + "\ndrop-in tables\n"
        + _dropin_report.END
        + "\n"
    )
    doc = tmp_path / "benchmarks.md"
    doc.write_text(before + _models_report.BEGIN + "\nstale table\n" + _models_report.END + "\n" + after)
    entries = [_model_entry("gpt2", "forward", 576, [1.0] * 3, [1.0] * 3)]
    text = _models_report.render(*_models_report.load([_models_file(tmp_path / "m.json", "abc", entries)]))
    _models_report.write_section(doc, text)
    _models_report.write_section(doc, text)  # replaced, not appended twice
    assert doc.read_text() == before + text + after
    # The real doc has one models section, before the drop-in one (so it is replaced in place).
    real = (BENCH.parent / "docs" / "benchmarks.md").read_text()
    assert real.count(_models_report.BEGIN) == 1 and real.count(_models_report.END) == 1
    assert real.index(_models_report.END) < real.index(_dropin_report.BEGIN)


def test_models_report_command_refuses_tiny_and_other_formats(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    entries = [_model_entry("vit", "forward", 16, [1.0] * 2, [1.0] * 2)]
    tiny = _models_file(tmp_path / "tiny.json", "abc", entries, tiny=True)
    assert bench_models.main(["--report", str(tiny), "--docs", str(doc)]) == 2
    dropin = _result_file(tmp_path / "dropin.json", "abc", [1.0], [1.0])
    assert bench_models.main(["--report", str(dropin), "--docs", str(doc)]) == 2
    assert doc.read_text() == "# Benchmarks\n"
    real = _models_file(tmp_path / "real.json", "abc", [_model_entry("vit", "forward", 576, [1.0] * 2, [1.0] * 2)])
    assert bench_models.main(["--report", str(real), "--docs", str(doc)]) == 0
    assert (
        doc.read_text().startswith("# Benchmarks\n\n" + _models_report.BEGIN)
        and "| vit | forward | 576 |" in doc.read_text()
    )


# ------------------------------------------ bench_models_keras.py's report (issue 13)


def _keras_entry(
    backend: str,
    model: str,
    mode: str,
    n: int,
    damcha: list[float],
    original: list[float],
    *,
    xla: tuple[float, float] | None = None,
    check_ok: bool = True,
) -> dict:
    """A bench_models_keras.py entry built the way its worker builds one (``xla``: XLA's
    estimated totals, DAMCHA's and the original's, as the JAX worker records them)."""
    times = {"original": {"wall": original, "cpu": original}, "damcha": {"wall": damcha, "cpu": damcha}}
    entry = _harness.entry(
        f"keras-{backend}/models/{model}/{mode}/N={n}",
        "models",
        model,
        mode,
        shape={"B": 2, "N": n, "hidden": 32},
        call=bench_models_keras.DESCRIPTIONS[model],
        baseline="the same KerasHub model before `damcha_keras.convert`",
        backend=backend,
        times=times,
        check={"ok": check_ok, "max_rel_diff": 0.0 if check_ok else 0.5},
        comparisons=[_harness.comparison("time", times, "damcha", "original", _models_keras_report.time_target(n))],
    )
    entry = {**entry, "port": f"keras-{backend}", "run": 0}
    if xla is not None:
        parts = {
            impl: {"temp": t, "argument": 0.0, "output": 0.0, "alias": 0.0, "total": t}
            for impl, t in zip(("damcha", "original"), xla)
        }
        totals = {impl: p["total"] for impl, p in parts.items()}
        memory = _harness.memory_comparison(totals, "damcha", "original", _models_keras_report.memory_target(n))
        entry["memory"] = {"method": bench_models_keras.XLA_METHOD, **memory, "xla_mib": parts}
    return entry


def _keras_file(path: Path, commit: str, entries: list[dict], *, tiny: bool = False) -> Path:
    run = {
        "command": f".venv/bin/python benchmarks/bench_models_keras.py --json {path.name}",
        "git": commit,
        "threads": 2,
        "tiny": tiny,
        "started": "2026-12-01T20:00:00+00:00",
        "versions": {"keras": "3.15.1", "keras-hub": "0.32.0", "jax": "0.10.2"},
    }
    data = {"format": _models_keras_report.FORMAT, "runs": [run], "entries": {e["id"]: e for e in entries}}
    path.write_text(json.dumps(data))
    return path


def test_models_keras_report_renders_a_table_per_backend(tmp_path: Path) -> None:
    entries = [
        # JAX: XLA's memory estimate; N=1024 is held to the targets, N=256 is informative.
        _keras_entry("jax", "llama", "train", 1024, [1.2] * 3, [1.0] * 3, xla=(110.0, 100.0)),
        _keras_entry("jax", "llama", "predict", 256, [1.5] * 3, [1.0] * 3, xla=(100.0, 100.0)),
        # TensorFlow: no memory record, so no memory columns; listed after GPT-2 and predict.
        _keras_entry("tensorflow", "bert", "predict", 1024, [1.0] * 3, [1.0] * 3, check_ok=False),
        _keras_entry("tensorflow", "gpt2", "generate", 1024, [1.05] * 3, [1.0] * 3),
        _keras_entry("tensorflow", "gpt2", "predict", 1024, [1.05] * 3, [1.0] * 3),
        {
            "id": "keras-torch/models/gptneox/train/N=256",
            "port": "keras-torch",
            "section": "models",
            "case": "gptneox",
            "mode": "train",
            "run": 0,
            "error": "RuntimeError: boom",
            "error_kind": "other",
        },
    ]
    path = _keras_file(tmp_path / "models-keras-20261201-200000.json", "abc123", entries)
    text = _models_keras_report.render(*_models_keras_report.load([path]))
    assert text.startswith(_models_keras_report.BEGIN + "\n## Converted KerasHub models (Keras 3)\n")
    assert text.rstrip().endswith(_models_keras_report.END)
    assert "--json models-keras-20261201-200000.json" in text and "keras-hub 0.32.0." in text
    assert "5 measurements; targets missed: 2; equality checks failed: 1." in text  # llama's time and memory
    lines = text.splitlines()
    tf, jax = lines.index("### TensorFlow backend"), lines.index("### JAX backend")
    assert tf < jax and "### PyTorch backend" not in text  # the failed backend has no table, only its error
    tf_rows = [x for x in lines[tf:jax] if x.startswith("| ")]
    assert tf_rows[0].startswith("| model | mode | N | original ms | DAMCHA ms |") and "MiB" not in tf_rows[0]
    order = [r.split(" | ")[:2] for r in tf_rows[1:]]  # (the "|---|" line does not start with "| ")
    assert order == [["| gpt2", "predict"], ["| gpt2", "generate"], ["| bert", "predict"]]
    assert "**check failed**" in tf_rows[3] and tf_rows[1].endswith("| <= 1.10 |")
    jax_rows = [x for x in lines[jax:] if x.startswith("| ")]
    assert "original XLA MiB | DAMCHA XLA MiB" in jax_rows[0]
    assert jax_rows[1].startswith("| llama | predict | 256 |") and jax_rows[1].count("| - |") == 2
    assert "| 100.0 | 110.0 | 1.10 | <= 1.05 **missed** |" in jax_rows[2] and "<= 1.10 **missed**" in jax_rows[2]
    assert "- `keras-torch/models/gptneox/train/N=256`: RuntimeError: boom" in text
    # The section replaces itself in the doc; the rest stays.
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nkept\n")
    _models_keras_report.write_section(doc, text)
    _models_keras_report.write_section(doc, text)
    assert doc.read_text() == "# Benchmarks\n\nkept\n\n" + text


def test_models_keras_files_and_torch_model_files_stay_apart(tmp_path: Path) -> None:
    """Both benchmarks' default files start with "models-": each report reads only its own
    (the PyTorch one refused the whole directory once a Keras file was there)."""
    keras_file = _keras_file(
        tmp_path / "models-keras-20261201-200000.json",
        "abc",
        [_keras_entry("jax", "gpt2", "predict", 1024, [1.0] * 2, [1.0] * 2)],
    )
    torch_file = _models_file(
        tmp_path / "models-20261201-200000.json", "abc", [_model_entry("vit", "forward", 576, [1.0] * 2, [1.0] * 2)]
    )
    assert _models_report.result_files(tmp_path) == [torch_file]
    assert _models_keras_report.result_files(tmp_path) == [keras_file]
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    assert bench_models_keras.main(["--report", str(torch_file), "--docs", str(doc)]) == 2  # another format
    tiny = _keras_file(
        tmp_path / "tiny.json", "abc", [_keras_entry("jax", "gpt2", "predict", 16, [1.0] * 2, [1.0] * 2)], tiny=True
    )
    assert bench_models_keras.main(["--report", str(tiny), "--docs", str(doc)]) == 2
    assert doc.read_text() == "# Benchmarks\n"
    assert bench_models_keras.main(["--report", str(keras_file), "--docs", str(doc)]) == 0
    assert "| gpt2 | predict | 1024 |" in doc.read_text() and _models_keras_report.BEGIN in doc.read_text()


def test_the_results_file_is_synced_with_its_folder_and_resumes(tmp_path, monkeypatch, sync_events):
    """Results.save wrote a temporary file and renamed it without a sync: a power loss during a
    long benchmark could leave an empty results file under the final name. Now the file's
    data is on disk before its rename and its folder after (recorded through os.fsync, by
    inode), and a resumed run still reads the entries back."""
    events = sync_events
    path = tmp_path / "runs" / "results.json"
    results = _harness.Results(path, resume=False)
    results.start_run({"commit": "abc"})
    results.add({"id": "e1", "value": 1.5})
    monkeypatch.undo()

    def inode(p: Path) -> tuple[int, int]:
        st = p.stat()
        return (st.st_dev, st.st_ino)

    assert events[-3:] == [("fsync", inode(path)), ("replace", str(path)), ("fsync", inode(path.parent))]
    assert sorted(p.name for p in path.parent.iterdir()) == ["results.json"]  # no temporary file left
    resumed = _harness.Results(path, resume=True)
    assert resumed.data["runs"] == [{"commit": "abc"}] and resumed.has("e1")


@pytest.mark.parametrize(
    "report", [_dropin_report, _models_report, _models_keras_report], ids=["dropin", "models", "models-keras"]
)
def test_the_committed_sections_are_what_their_reports_write_from_the_files_they_list(report) -> None:
    """docs/benchmarks.md's generated sections equal a fresh render of the result files
    their run lines list (paths relative to the repository, as the commands gave them):
    no hand edit inside the markers, no report change left unapplied, no listed file
    missing from benchmarks/results/."""
    root = BENCH.parent
    doc = root / "docs" / "benchmarks.md"
    begin, end = report.BEGIN, report.END
    paths = [root / p for p in _dropin_report.listed_files(doc, begin=begin, end=end)]
    assert paths and all(p.is_file() for p in paths), [str(p) for p in paths if not p.is_file()]
    text = report.render(*report.load(paths))
    real = doc.read_text()
    committed = real[real.index(begin) : real.index(end) + len(end)] + "\n"
    assert committed == text


def test_the_fast_path_off_baseline_runs_mha_through_sdpa() -> None:
    """The drop-in benchmark's second PyTorch baseline (MHA with torch's fast path off):
    in eval without gradients nn.MultiheadAttention takes torch's fused inference kernel
    (which builds the weights); with the switch off it calls SDPA, and the switch is
    restored after the call."""
    import torch
    from _dropin_torch import without_mha_fastpath

    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 8, 16)
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1)

    def call():
        with torch.inference_mode():
            return mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]

    def ops(fn) -> set[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        return {e.key for e in prof.key_averages()}

    assert "aten::_native_multi_head_attention" in ops(call)
    off = ops(without_mha_fastpath(call))
    assert "aten::_native_multi_head_attention" not in off and "aten::scaled_dot_product_attention" in off
    assert torch.backends.mha.get_fastpath_enabled()
    torch.testing.assert_close(without_mha_fastpath(call)(), call(), rtol=1e-5, atol=1e-6)


def test_a_further_baseline_gets_its_own_columns_and_verdicts(tmp_path: Path) -> None:
    """An entry timed against a second baseline (record_timed(also=...)) shows its ms,
    ratio and target in columns of their own, entries without it '-', and a miss
    against it (time or memory) counts with the others."""
    path = _result_file(tmp_path / "a.json", "abc", [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    data = json.loads(path.read_text())
    entry = data["entries"][ENTRY_ID]
    entry["times"]["mha-nofast"] = {"wall": [0.8, 0.8, 0.8], "cpu": [0.8, 0.8, 0.8]}
    entry["comparisons"].append(
        _harness.comparison("time, MHA fast path off", entry["times"], "damcha", "mha-nofast", 1.10)
    )
    other = dict(entry, id="torch/layer/cross/fwd+bwd/N=256", mode="fwd+bwd", comparisons=entry["comparisons"][:1])
    data["entries"][other["id"]] = other
    path.write_text(json.dumps(data))
    runs, entries = _dropin_report.load([path])
    text = _dropin_report.render(runs, entries)
    assert "| MHA, fast path off ms | DAMCHA/it (quartiles) | target |" in text
    assert "| 800.0 | 1.250 (1.25-1.25) | <= 1.10 **missed** |" in text
    assert "| fwd+bwd | 256 |" in text and text.split("| fwd+bwd | 256 |", 1)[1].split("\n", 1)[0].endswith(
        " - | - | - |"
    )
    assert "targets missed: 1" in text


def test_xla_memory_is_compared_by_what_the_call_allocates(tmp_path: Path) -> None:
    """XLA's estimates (Flax, Keras on JAX) are compared by temp + output - alias, what the
    call allocates beyond its arguments, as a torch call's resident-set increase leaves out
    the parameters; a run stored with the total (arguments counted) renders the same way."""
    path = _result_file(tmp_path / "a.json", "abc", [1.0] * 3, [1.0] * 3)
    data = json.loads(path.read_text())
    entry = data["entries"][ENTRY_ID]
    parts = {
        "damcha": {"temp": 105.0, "argument": 900.0, "output": 0.0, "alias": 0.0, "total": 1005.0},
        "mha": {"temp": 100.0, "argument": 900.0, "output": 0.0, "alias": 0.0, "total": 1000.0},
    }
    # As the runs before the change recorded it: the totals compared (1.005, met).
    entry["memory"] = {
        "method": "XLA",
        **_harness.memory_comparison({"damcha": 1005.0, "mha": 1000.0}, "damcha", "mha"),
    }
    entry["memory"]["xla_mib"] = parts
    path.write_text(json.dumps(data))
    _, (loaded,) = _dropin_report.load([path])
    assert loaded["memory"]["ratio"] == pytest.approx(1.05) and loaded["memory"]["mib"] == {
        "damcha": 105.0,
        "mha": 100.0,
    }
    assert _harness.xla_memory_record("XLA", parts)["ratio"] == pytest.approx(1.05)


def test_runs_whose_code_differed_from_their_commit_are_never_pooled(
    two_runs: tuple[Path, Path, list[float]],
) -> None:
    """Two runs at one commit with the same code file edited (perhaps differently) are
    each their own: the later replaces the earlier; docs-only differences still pool."""
    first, second, _ = two_runs
    for path, dirty in ((first, ["backends/torch/_layer.py"]), (second, ["backends/torch/_layer.py", "docs/x.md"])):
        data = json.loads(path.read_text())
        data["runs"][0].update(git_dirty=dirty, started=path.name)
        path.write_text(json.dumps(data))
    _, (entry,) = _dropin_report.load([first, second])
    assert "per_run" not in entry["comparisons"][0] and len(entry["times"]["damcha"]["wall"]) == 3
    for path in (first, second):
        data = json.loads(path.read_text())
        data["runs"][0]["git_dirty"] = ["docs/benchmarks.md", "benchmarks/results/a.json"]
        path.write_text(json.dumps(data))
    _, (entry,) = _dropin_report.load([first, second])
    assert entry["comparisons"][0]["per_run"] == pytest.approx([1.2, 1.0])


def test_a_section_without_pooled_cells_claims_no_spread(tmp_path: Path) -> None:
    """One run: the method text said 'differ by up to 0.00'; it now says no cell pools runs."""
    runs, entries = _dropin_report.load([_result_file(tmp_path / "a.json", "abc", [1.0] * 3, [1.0] * 3)])
    text = _dropin_report.render(runs, entries)
    assert "up to 0.00" not in text and "no cell here pools several runs" in text
