"""The drop-in report's pooling of repeated runs (benchmarks/_dropin_report.py).

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
