"""The smoke preset of every task, variant and ablation runs end to end; runs are
fair (fixed budget, independent of the other variants), resumable bit for bit, and
DAMCHA/talking-heads models start exactly at the MHA model."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from damcha_core import DamchaValueError
from damcha_experiments import _analysis as an
from damcha_experiments import _cli
from damcha_experiments._cost import saved_activation_bytes
from damcha_experiments._models import as_variant, count_parameters, damcha_layers
from damcha_experiments._suite import choose_lr, run_suite
from damcha_experiments._tasks import PRESETS, TASK_NAMES, TaskData, task_config
from damcha_experiments._train import (
    RunInterrupted,
    RunState,
    UnreadableResultWarning,
    build_model,
    check_run_dir,
    model_width,
    param_groups,
    plateau_rule,
    run_identity,
    train_run,
)
from damcha_experiments._variants import ABLATION, HEADLINE, VARIANTS

TIMING_KEYS = {"time_per_step_s", "cpu_per_step_s", "train_time_s", "resumed_at_step"}
# Which code ran a run and when (``_provenance``): a record, like the timings, never a number of the run.
PROVENANCE_KEYS = {"code_version", "started_utc", "finished_utc", "stretches"}


def _strip_timing(obj):
    """A result without its wall/CPU measurements and provenance (the only fields a resumed run may change)."""
    if isinstance(obj, dict):
        return {k: _strip_timing(v) for k, v in obj.items() if k not in TIMING_KEYS | PROVENANCE_KEYS}
    if isinstance(obj, list):
        return [_strip_timing(v) for v in obj]
    return obj


@pytest.fixture(scope="module")
def smoke_data():
    return {task: TaskData(task_config(task, "smoke")) for task in TASK_NAMES}


# ------------------------------------------------------------ end to end


def _smoke_folder(out):
    """Every task's headline suite and two ablation suites at the smoke preset, through the CLI, in one folder.

    Plots are drawn for crosshead (token model) and digits (ViT); the plotting
    code is shared by all tasks.
    """
    for task in TASK_NAMES:
        plots = [] if task in ("crosshead", "digits") else ["--no-plots"]
        assert _cli.main([task, "--preset", "smoke", "--out", str(out), "--no-progress", *plots]) == 0, task
    for task in ("digits", "crosshead"):
        assert (
            _cli.main(
                [
                    task,
                    "--preset",
                    "smoke",
                    "--suite",
                    "ablation",
                    "--out",
                    str(out),
                    "--no-progress",
                    "--no-plots",
                    "--no-cost",
                ]
            )
            == 0
        ), task
    return out


def _check_headline(task, out):
    cfg = task_config(task, "smoke")
    res = json.loads((out / f"{task}.json").read_text())
    assert res["task"] == task and res["preset"] == "smoke" and list(res["variants"]) == list(HEADLINE)
    for name, r in res["variants"].items():
        assert [run["seed"] for run in r["runs"]] == list(range(cfg.seeds)), name
        assert r["chosen_lr"] in cfg.lrs and all(run["lr"] == r["chosen_lr"] for run in r["runs"])
        assert len(r["lr_sweep"]["runs"]) == len(cfg.lrs) * cfg.sweep_seeds
        tests = [run["test_metric"] for run in r["runs"]]
        assert np.isfinite(tests).all() and r["test"]["mean"] == pytest.approx(np.mean(tests))
        # The reported test metric is the one at the best validation evaluation.
        for run in r["runs"]:
            i = run["curve"]["step"].index(run["best_step"])
            assert run["test_metric"] == run["curve"]["test_metric"][i]
            assert run["best_val_metric"] == (max if res["higher_is_better"] else min)(run["curve"]["val_metric"])
        assert abs(r["params"] - cfg.param_budget) <= count_parameters_per_unit(task, name) / 2, name
        assert (r["head_maps_seed0"] is None) == (r["kind"] != "damcha"), name
    cost = json.loads((out / f"{task}_cost.json").read_text())
    assert set(cost["variants"]) == set(HEADLINE) and cost["variants"]["mha"]["time_ratio_vs_mha"] == 1.0
    assert all(e["activation_bytes"] > 0 and e["s_per_step"] > 0 for e in cost["variants"].values())
    if task in ("crosshead", "digits"):
        for suffix in ("curves", "final", "lr", "time", "metric"):
            assert (out / f"{task}_{suffix}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", suffix
        # The command checks each file of OUTPUT_SUFFIXES up front (a read-only one is refused before
        # any training): every file of this task's headline suite must be one of them.
        from damcha_experiments._report import OUTPUT_SUFFIXES

        written = {
            p.name for p in out.iterdir() if p.name.startswith((f"{task}.", f"{task}_")) and "_ablation" not in p.name
        }
        assert written == {f"{task}{suffix}" for suffix in OUTPUT_SUFFIXES.values()}


def _check_ablation(task, out):
    res = json.loads((out / f"{task}_ablation.json").read_text())
    assert res["suite"] == "ablation" and list(res["variants"]) == list(ABLATION)
    assert all(np.isfinite([run["test_metric"] for run in r["runs"]]).all() for r in res["variants"].values())
    # Variants shared with the headline suite are the very same runs (same folder, same numbers).
    head = json.loads((out / f"{task}.json").read_text())
    assert res["variants"]["mha"]["runs"] == head["variants"]["mha"]["runs"]


def test_smoke_preset_of_every_task_variant_and_ablation_end_to_end(tmp_path, capsys):
    """One test (one xdist worker) for the whole smoke folder: every check below reads what it wrote."""
    out = _smoke_folder(tmp_path / "out")
    for task in TASK_NAMES:
        _check_headline(task, out)
    for task in ("digits", "crosshead"):
        _check_ablation(task, out)
    # The report: a verdict per claim, the tables, the equal-time plot redrawn with the cost file.
    md = tmp_path / "report.md"
    assert _cli.main(["report", str(out), "--out", str(md)]) == 0
    text = md.read_text()
    summary = json.loads(md.with_suffix(".json").read_text())
    assert [v["claim"] for v in summary["verdicts"]] == [1, 2, 3, 4]
    assert all(v["verdict"] in ("supported", "not supported", "inconclusive") for v in summary["verdicts"])
    assert "## crosshead" in text and "## Ablations on digits" in text and "Holm" in text
    assert (out / "crosshead_time.png").read_bytes()[:4] == b"\x89PNG"
    # The same command again, on a copy of the runs: nothing is retrained (timings are read back too).
    again_out = tmp_path / "again"
    shutil.copytree(out / "runs", again_out / "runs")
    capsys.readouterr()
    assert (
        _cli.main(["listops", "--preset", "smoke", "--out", str(again_out), "--no-progress", "--no-cost", "--no-plots"])
        == 0
    )
    first = json.loads((out / "listops.json").read_text())
    again = json.loads((again_out / "listops.json").read_text())
    assert again["variants"] == first["variants"]
    assert "| variant | params | lr |" in capsys.readouterr().out
    # Replotting from the JSON reproduces the file without training.
    assert _cli.main(["listops", "--from-json", str(again_out / "listops.json"), "--out", str(tmp_path / "re")]) == 0
    assert json.loads((tmp_path / "re" / "listops.json").read_text()) == again
    assert (tmp_path / "re" / "listops_curves.png").read_bytes()[:4] == b"\x89PNG"


def count_parameters_per_unit(task: str, name: str) -> int:
    data = TaskData(task_config(task, "smoke"))
    v = VARIANTS[name]
    return count_parameters(build_model(data, v, 9)) - count_parameters(build_model(data, v, 8))


# -------------------------------------------------------------- fairness


def test_a_run_does_not_depend_on_the_other_variants(smoke_data):
    cfg = smoke_data["crosshead"].cfg
    alone = run_suite(cfg, ["mha"], "headline", out=None)
    beside = run_suite(cfg, ["damcha-heads-separate", "mha"], "headline", out=None)
    assert _strip_timing(alone["variants"]["mha"]) == _strip_timing(beside["variants"]["mha"])


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "large"])
@pytest.mark.parametrize("task", TASK_NAMES)
def test_every_variant_meets_the_fixed_budget(task, preset):
    cfg = task_config(task, preset, train_size=60_000 if task == "charlm" else 64, val_size=8, test_size=8)
    data = TaskData(cfg)
    for name, v in VARIANTS.items():
        width, params = model_width(data, v)
        assert params == count_parameters(build_model(data, v, width))
        per_unit = count_parameters(build_model(data, v, width + 1)) - params
        assert abs(params - cfg.param_budget) <= per_unit / 2, name


@pytest.mark.parametrize("task", TASK_NAMES)
def test_large_preset_budget_fits_the_extreme_variants(task):
    """The GPU preset: the smallest (mha) and largest (separate) variants reach its budget too."""
    cfg = task_config(task, "large", train_size=60_000 if task == "charlm" else 64, val_size=8, test_size=8)
    data = TaskData(cfg)
    for name in ("mha", "damcha-heads-separate"):
        width, params = model_width(data, VARIANTS[name])
        per_unit = count_parameters(build_model(data, VARIANTS[name], width + 1)) - params
        assert abs(params - cfg.param_budget) <= per_unit / 2, name


def test_cost_only_measures_without_training(tmp_path):
    out = tmp_path / "out"
    assert (
        _cli.main(
            [
                "digits",
                "--preset",
                "smoke",
                "--cost-only",
                "--variants",
                "mha",
                "damcha-heads-tied",
                "--out",
                str(out),
                "--no-plots",
            ]
        )
        == 0
    )
    cost = json.loads((out / "digits_cost.json").read_text())
    mha, tied = cost["variants"]["mha"], cost["variants"]["damcha-heads-tied"]
    cfg = task_config("digits", "smoke")
    assert len(mha["round_s_per_step"]) == cfg.cost_rounds
    # The interleaved schedule's fields: every step on both clocks, the clock the ratio used, its interval.
    assert cost["cost_format"] == 2 and cost["clock"] == "thread_time" and cost["torch_threads"] == 1
    assert cost["ratio_interval"] == {
        "confidence": 0.95,
        "method": "percentile bootstrap over rounds",
        "resamples": 10_000,
        "seed": 0,
    }
    for e in (mha, tied):
        assert [len(r) for r in e["step_cpu_s"]] == [len(r) for r in e["step_wall_s"]] == [cfg.cost_steps] * 2
        assert e["round_s_per_step"] == [float(np.median(r)) for r in e["step_cpu_s"]]
        assert all(c > 0 for r in e["step_cpu_s"] for c in r)
    lo, hi = tied["time_ratio_ci_vs_mha"]
    assert lo <= tied["time_ratio_vs_mha"] <= hi and mha["time_ratio_ci_vs_mha"] == [1.0, 1.0]
    assert tied["activation_ratio_vs_mha"] == pytest.approx(tied["activation_bytes"] / mha["activation_bytes"])
    assert tied["activation_bytes"] > mha["activation_bytes"]  # the stored maps (recompute=False)
    assert not (out / "runs").exists() and not (out / "digits.json").exists()


def test_a_stop_request_ends_the_cost_measurement_between_steps(monkeypatch):
    """damcha experiment's Ctrl-C / SIGTERM was recorded but never acted on while the cost was
    measured (the command ran to its end and exited 0): the measurement asks between steps."""
    from damcha_experiments import _cost
    from damcha_experiments._train import RunInterrupted

    cfg = dataclasses.replace(task_config("crosshead", "smoke"), cost_steps=4, cost_rounds=3)
    timed = {"steps": 0}
    real_step = _cost._step

    def counted(*args, **kwargs):
        timed["steps"] += 1
        return real_step(*args, **kwargs)

    monkeypatch.setattr(_cost, "_step", counted)
    asked = {"n": 0}

    def stop_after_three():
        asked["n"] += 1
        return asked["n"] > 3

    with pytest.raises(RunInterrupted, match="while measuring the cost"):
        _cost.measure_cost(cfg, ["mha", "damcha-heads-tied"], should_stop=stop_after_three)
    # two warm-up steps, then three timed rounds of both variants before the fourth question
    assert timed["steps"] == 2 + 3 * 2


def test_a_stalled_step_does_not_move_a_cost_round(monkeypatch):
    """A round's time is the median of its steps: one step stalled 50x (a
    preemption) in every MHA round leaves MHA's rounds, and the ratio, where
    the other steps put them; round means would have moved 1.5-3x."""
    from damcha_experiments import _cost

    cfg = dataclasses.replace(task_config("crosshead", "smoke"), cost_steps=5, cost_rounds=3)
    clock = {"now": 0.0, "mha_steps": 0}
    step_s = {"mha": 0.010, "damcha-heads-tied": 0.012}
    real_step = _cost._step

    def timed_step(model, opt, x, y, penalty, clip):
        real_step(model, opt, x, y, penalty, clip)
        name = "mha" if not any(True for _ in damcha_layers(model)) else "damcha-heads-tied"
        seconds = step_s[name]
        if name == "mha":
            clock["mha_steps"] += 1
            if clock["mha_steps"] % cfg.cost_steps == 2:
                seconds *= 50
        clock["now"] += seconds

    monkeypatch.setattr(_cost, "_step", timed_step)
    # One fake clock for both (the ratio reads thread CPU time at one torch thread, as in tests).
    monkeypatch.setattr(_cost.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(_cost.time, "thread_time", lambda: clock["now"])
    cost = _cost.measure_cost(cfg, ["mha", "damcha-heads-tied"])
    mha, tied = cost["variants"]["mha"], cost["variants"]["damcha-heads-tied"]
    assert cost["clock"] == "thread_time"
    assert mha["round_statistic"] == "median step"
    assert mha["round_s_per_step"] == pytest.approx([0.010] * 3)
    assert tied["time_ratio_vs_mha"] == pytest.approx(1.2)
    assert tied["time_ratio_ci_vs_mha"] == pytest.approx([1.2, 1.2])
    assert mha["round_mean_s_per_step"] == pytest.approx([(4 * 0.010 + 0.5) / 5] * 3)  # what a mean would say


def test_a_cost_subset_without_mha_still_measures_its_ratio(monkeypatch):
    """Every ratio is taken against MHA's interleaved steps: a subset that leaves MHA out
    (``--cost-only --variants damcha-heads-tied``) times MHA too, rather than giving no ratio."""
    from damcha_experiments import _cost

    cfg = dataclasses.replace(task_config("crosshead", "smoke"), cost_steps=3, cost_rounds=3)
    clock = {"now": 0.0}
    real_step = _cost._step

    def timed_step(model, opt, x, y, penalty, clip):
        real_step(model, opt, x, y, penalty, clip)
        clock["now"] += 0.015 if any(True for _ in damcha_layers(model)) else 0.010

    monkeypatch.setattr(_cost, "_step", timed_step)
    monkeypatch.setattr(_cost.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(_cost.time, "thread_time", lambda: clock["now"])
    cost = _cost.measure_cost(cfg, ["damcha-heads-tied"])
    assert list(cost["variants"]) == ["mha", "damcha-heads-tied"]
    assert cost["variants"]["damcha-heads-tied"]["time_ratio_vs_mha"] == pytest.approx(1.5)


def _fake_clocks(monkeypatch, cfg, mha_s, tied_s=0.012, *, thread=None):
    """Fake perf_counter and thread_time advanced by each timed step: an MHA step by ``mha_s``, a
    DAMCHA step by ``tied_s``; ``thread`` (a function of the wall time) replaces thread_time."""
    from damcha_experiments import _cost

    clock = {"now": 0.0}
    real_step = _cost._step

    def timed_step(model, opt, x, y, penalty, clip):
        real_step(model, opt, x, y, penalty, clip)
        clock["now"] += tied_s if any(True for _ in damcha_layers(model)) else mha_s

    monkeypatch.setattr(_cost, "_step", timed_step)
    monkeypatch.setattr(_cost.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(_cost.time, "thread_time", lambda: clock["now"] if thread is None else thread(clock["now"]))
    return _cost


@pytest.mark.parametrize(
    "thread",
    [lambda now: 5.0, lambda now: 0.0156 * math.floor(now / 0.0156)],
    ids=["frozen", "15.6ms-ticks"],
)
def test_a_thread_clock_coarser_than_a_step_falls_back_to_the_wall_clock(thread, monkeypatch):
    """A thread CPU clock that does not advance within a step gave MHA round times of 0:
    ratio_interval refused them after the whole measurement (``mha_rounds[0]=0.0``), losing it; one
    that advances in ticks longer than a step (Windows' 15.6 ms) reads steps as 0 or a tick, and its
    round medians could all be a tick (a ratio of 1.0). The wall clock times every step: the ratio
    uses it, and the file says why."""
    cfg = dataclasses.replace(task_config("crosshead", "smoke"), cost_steps=3, cost_rounds=3)
    _cost = _fake_clocks(monkeypatch, cfg, 0.010, thread=thread)
    cost = _cost.measure_cost(cfg, ["mha", "damcha-heads-tied"])
    mha, tied = cost["variants"]["mha"], cost["variants"]["damcha-heads-tied"]
    assert cost["clock"] == "perf_counter" and cost["torch_threads"] == 1
    (why,) = cost["unusable_clocks"].values()
    assert list(cost["unusable_clocks"]) == ["thread_time"] and re.fullmatch(r"round \d, step \d of \S+: 0\.0 s", why)
    assert cost["clock_note"].startswith(f"thread CPU time could not time the steps ({why}: a clock coarser")
    assert mha["round_s_per_step"] == pytest.approx([0.010] * 3) and mha["s_per_step"] == pytest.approx(0.010)
    assert tied["time_ratio_vs_mha"] == pytest.approx(1.2) and tied["time_ratio_ci_vs_mha"] == pytest.approx([1.2] * 2)
    assert tied["wall_time_ratio_vs_mha"] == pytest.approx(1.2)
    json.dumps(cost, allow_nan=False)  # no NaN or infinity anywhere
    assert an.time_ratio(cost, "damcha-heads-tied")["clock"] == "perf_counter"


@pytest.mark.parametrize(
    "bad, read",
    # inf: the warm-up step before the timing already moved the clock to inf, so a step reads inf - inf.
    [(0.0, "0.0"), (-0.01, "-0.01"), (math.nan, "nan"), (math.inf, "nan")],
    ids=["zero", "negative", "nan", "inf"],
)
def test_clocks_that_cannot_time_a_step_give_no_ratio_and_say_why(bad, read, monkeypatch):
    """Both clocks read an MHA step as 0 (too coarse), negative (stepped back), NaN or infinite: a
    round time of 0 raised in ratio_interval (the same for a negative or NaN one) and a wall ratio
    divided by it. Now no ratio is written (None, not inf or NaN), the file names the first bad
    step on each clock, and the report prints n/a and says why claim 3 has no timing."""
    from damcha_experiments._report import cost_caption, cost_table

    cfg = dataclasses.replace(task_config("crosshead", "smoke"), cost_steps=3, cost_rounds=2)
    _cost = _fake_clocks(monkeypatch, cfg, bad)
    cost = _cost.measure_cost(cfg, ["mha", "damcha-heads-tied"])
    mha, tied = cost["variants"]["mha"], cost["variants"]["damcha-heads-tied"]
    assert cost["clock"] == "thread_time"  # the chosen clock, recorded as such
    assert set(cost["unusable_clocks"]) == {"thread_time", "perf_counter"}
    assert cost["unusable_clocks"]["thread_time"] == f"round 0, step 0 of mha: {read} s"
    for e in (mha, tied):
        assert e["s_per_step"] is None and e["wall_s_per_step"] is None
        assert e["time_ratio_vs_mha"] is None and e["time_ratio_ci_vs_mha"] is None
        assert e["wall_time_ratio_vs_mha"] is None
    assert tied["train_bytes_ratio_vs_mha"] > 0  # memory is exact and still there
    derived = {k: v for e in (mha, tied) for k, v in e.items() if not k.startswith(("step_", "round_"))}
    json.dumps(derived, allow_nan=False)  # only the raw clock readings keep what the clock said
    assert an.time_ratio(cost, "damcha-heads-tied") is None and an._s_per_step(cost, "mha") is None
    rows = [line for line in cost_table(cost).splitlines() if line.startswith(("| mha |", "| damcha-heads-tied |"))]
    assert len(rows) == 2 and all(row.count("| n/a |") >= 3 for row in rows)  # ms/step, ratio, CI, wall ratio
    assert "no time ratio: thread CPU time" in cost_caption(cost)
    reason = an.no_time_ratio(cost)
    assert reason == f"thread CPU time: {cost['unusable_clocks']['thread_time']}", reason
    # The commands read such a file (its zero or non-finite rounds state no ratio), not refuse it.
    from damcha_experiments._jsonfile import check_results_object

    check_results_object("crosshead_cost.json", json.loads(json.dumps(cost)) | {"format": "damcha-experiment/2"})


def test_choose_clock_picks_thread_time_only_for_one_cpu_thread():
    """The clock a measurement times with: thread CPU time on one CPU thread, else the wall clock, with why."""
    from damcha_experiments._cost import choose_clock

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert choose_clock(torch.device("cpu"))[0] == "thread_time"
        assert choose_clock(torch.device("meta")) == (
            "perf_counter",
            "device meta: the work runs on the device, so wall time",
        )
        torch.set_num_threads(2)
        clock, why = choose_clock(torch.device("cpu"))
        assert clock == "perf_counter" and why.startswith("2 torch intra-op threads")
    finally:
        torch.set_num_threads(threads)


def test_cost_steps_alternate_variants_step_by_step(monkeypatch):
    """Within a round every variant takes one step before any takes its next (an MHA step sits
    next to each DAMCHA step), and the order rotates every step so each variant leads equally
    often; on more than one torch thread the ratio falls back to the wall clock."""
    from damcha_experiments import _cost

    names = ["mha", "talking-heads", "damcha-heads-tied"]
    cfg = dataclasses.replace(task_config("crosshead", "smoke"), cost_steps=3, cost_rounds=4)
    calls: list[str] = []
    real_build, real_step = _cost.build_model, _cost._step

    def build(data, v, width):
        model = real_build(data, v, width)
        model.cost_test_name = v.name
        return model

    def step(model, opt, x, y, penalty, clip):
        calls.append(model.cost_test_name)
        real_step(model, opt, x, y, penalty, clip)

    monkeypatch.setattr(_cost, "build_model", build)
    monkeypatch.setattr(_cost, "_step", step)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cost = _cost.measure_cost(cfg, names)
    finally:
        torch.set_num_threads(threads)
    assert calls[: len(names)] == names  # one untimed step each: optimiser state, warm caches
    timed = calls[len(names) :]
    assert len(timed) == cfg.cost_rounds * cfg.cost_steps * len(names)
    cycles = [timed[i : i + len(names)] for i in range(0, len(timed), len(names))]
    assert all(sorted(c) == sorted(names) for c in cycles)
    leads = [c[0] for c in cycles]
    assert leads[:4] == ["mha", "talking-heads", "damcha-heads-tied", "mha"]
    assert all(leads.count(n) == len(cycles) // len(names) for n in names)
    assert cost["clock"] == "perf_counter" and "2 torch intra-op threads" in cost["clock_note"]
    for e in cost["variants"].values():
        assert e["round_s_per_step"] == [float(np.median(r)) for r in e["step_wall_s"]]


def test_same_seed_same_data_order_for_every_variant(smoke_data):
    data = smoke_data["listops"]
    batches = [data.batch(data.order(3))[0] for _ in range(2)]
    np.testing.assert_array_equal(*batches)
    assert not np.array_equal(batches[0], data.batch(data.order(4))[0])


def test_choose_lr_uses_validation_and_avoids_divergence():
    cfg = task_config("crosshead", "smoke")
    lm = task_config("charlm", "smoke")

    def run(val, loss=1.0, diverged=False):
        return {"best_val_metric": val, "best_val_loss": loss, "diverged": diverged}

    assert choose_lr(cfg, {1e-3: [run(0.5), run(0.7)], 3e-3: [run(0.65), run(0.6)]}) == 3e-3  # mean 0.6 < 0.625
    assert choose_lr(lm, {1e-3: [run(2.0)], 3e-3: [run(2.1)]}) == 1e-3  # bits per char: lower wins
    assert choose_lr(cfg, {1e-3: [run(0.5)], 3e-3: [run(0.5, loss=0.9)]}) == 3e-3  # tie -> lower val loss
    assert choose_lr(cfg, {1e-3: [run(0.4)], 3e-3: [run(0.9, diverged=True)]}) == 1e-3


# ------------------------------------------------------------ the loop


def test_plateau_rule_decays_then_stops():
    cfg = task_config("crosshead", "smoke", patience=2, max_decays=1, min_delta=0.01, lr_decay=0.5)
    state = RunState()
    events = []
    for step, val in enumerate([0.5, 0.6, 0.605, 0.6, 0.7, 0.7, 0.69], start=1):
        state.step = step
        state.curve["step"].append(step)
        state.curve["val_metric"].append(val)
        plateau_rule(cfg, state)
        events.append((state.best_index, state.lr_scale, state.stop_reason))
    # 0.605 is not 0.01 better than 0.6: flat, flat -> decay at step 4; 0.7 is a new best; two flat -> stop.
    assert [e[0] for e in events] == [0, 1, 1, 1, 4, 4, 4]
    assert state.decays == [4] and events[3][1] == 0.5
    assert [e[2] for e in events] == [None] * 6 + ["plateau"]


def test_resume_after_interruption_is_bitwise_identical(smoke_data, tmp_path):
    """Interrupted at a step that is not an evaluation, then resumed: the same curve, metrics and weights."""
    data = TaskData(task_config("listops", "smoke", max_steps=7, eval_every=2, patience=5))
    v = VARIANTS["damcha-heads-tied-pen1e-2"]
    width, _ = model_width(data, v)
    whole = train_run(data, v, 1e-3, 1, width, run_dir=tmp_path / "whole")
    stops = []
    with pytest.raises(RunInterrupted):
        train_run(data, v, 1e-3, 1, width, run_dir=tmp_path / "cut", should_stop=lambda s: stops.append(s) or s == 3)
    assert stops == [1, 2, 3] and (tmp_path / "cut" / "checkpoint.pt").exists()
    resumed = train_run(data, v, 1e-3, 1, width, run_dir=tmp_path / "cut")
    assert resumed["resumed_at_step"] == 3 and not (tmp_path / "cut" / "checkpoint.pt").exists()
    assert _strip_timing(resumed) == _strip_timing(whole)
    assert resumed["final_params_sha256"] == whole["final_params_sha256"]
    # A finished run is read back, not retrained; a folder of other settings is refused.
    assert train_run(data, v, 1e-3, 1, width, run_dir=tmp_path / "cut") == resumed
    with pytest.raises(DamchaValueError, match="other settings"):
        train_run(data, v, 3e-3, 1, width, run_dir=tmp_path / "cut")


def test_a_raised_step_cap_reuses_runs_the_plateau_rule_stopped(tmp_path):
    """The step cap only stops a run: one the plateau rule stopped under a cap of 12 is, weights
    and curve, the run a cap of 40 trains (checked here by training both), so a raised cap reads
    it back under the new identity instead of refusing the folder. A run that stopped at its cap,
    a lowered cap below a run's stop, or any other difference is still refused, naming why."""
    from damcha_experiments import _train

    # min_delta 1: no evaluation improves on the first, so the plateau rule stops the run early.
    low, high = (
        task_config("listops", "smoke", max_steps=cap, eval_every=1, patience=1, max_decays=1, min_delta=1.0)
        for cap in (12, 40)
    )
    v = VARIANTS["damcha-heads-tied"]
    data_low, data_high = TaskData(low), TaskData(high)
    width, _ = model_width(data_low, v)
    old = train_run(data_low, v, 1e-3, 0, width, run_dir=tmp_path / "old")
    assert old["stop_reason"] == "plateau" and old["steps"] < 12
    fresh = train_run(data_high, v, 1e-3, 0, width, run_dir=tmp_path / "fresh")
    assert fresh["final_params_sha256"] == old["final_params_sha256"]
    assert _strip_timing(fresh) == dict(_strip_timing(old), identity=fresh["identity"])
    stored = (tmp_path / "old" / "result.json").read_text()
    identity = run_identity(high, v, 1e-3, 0, width, torch.device("cpu"))
    assert check_run_dir(tmp_path / "old", identity) is True
    reused = train_run(data_high, v, 1e-3, 0, width, run_dir=tmp_path / "old")
    assert reused == dict(old, identity=fresh["identity"], reused_from_max_steps=12)
    assert (tmp_path / "old" / "result.json").read_text() == stored  # left as it was
    # A cap below the run's stop: the new cap would have stopped it sooner.
    lower = TaskData(dataclasses.replace(low, max_steps=old["steps"] - 1))
    with pytest.raises(_train.RunSettingsMismatch, match=f"ran {old['steps']} steps, beyond the cap"):
        train_run(lower, v, 1e-3, 0, width, run_dir=tmp_path / "old")
    # A run that stopped at its cap has more to train.
    capped = TaskData(dataclasses.replace(low, max_steps=2))
    assert train_run(capped, v, 1e-3, 0, width, run_dir=tmp_path / "capped")["stop_reason"] == "max_steps"
    with pytest.raises(_train.RunSettingsMismatch, match=r"stopped at its step cap \(2 steps\).*cap of 40") as info:
        check_run_dir(tmp_path / "capped", identity)
    assert info.value.differs == ["config.max_steps"]
    # The cap and anything else: refused as before.
    other = TaskData(dataclasses.replace(high, min_delta=0.5))
    with pytest.raises(_train.RunSettingsMismatch, match=r"differing: config.max_steps, config.min_delta"):
        train_run(other, v, 1e-3, 0, width, run_dir=tmp_path / "old")
    # Lowered below a capped run's steps: it ran beyond the new cap (the message said it "would
    # train on").
    with pytest.raises(_train.RunSettingsMismatch, match=r"ran 2 steps, beyond the cap of 1"):
        check_run_dir(
            tmp_path / "capped",
            run_identity(dataclasses.replace(low, max_steps=1), v, 1e-3, 0, width, torch.device("cpu")),
        )


def test_a_plateau_at_an_off_grid_cap_is_not_reused_under_a_higher_cap(tmp_path):
    """A cap off the evaluation grid adds an evaluation at the cap; the plateau rule stopped a run
    there, which a higher cap never evaluates: it was read back as the higher cap's run (curve
    [2, 4, 5] where a fresh run evaluates [2, 4, 6])."""
    from damcha_experiments import _train

    low, high = (
        task_config("listops", "smoke", max_steps=cap, eval_every=2, patience=1, max_decays=1, min_delta=1.0)
        for cap in (5, 7)
    )
    v = VARIANTS["mha"]
    data_low, data_high = TaskData(low), TaskData(high)
    width, _ = model_width(data_low, v)
    old = train_run(data_low, v, 1e-3, 0, width, run_dir=tmp_path / "old")
    assert old["stop_reason"] == "plateau" and old["curve"]["step"] == [2, 4, 5]
    fresh = train_run(data_high, v, 1e-3, 0, width, run_dir=tmp_path / "fresh")
    assert fresh["curve"]["step"] == [2, 4, 6]
    identity = run_identity(high, v, 1e-3, 0, width, torch.device("cpu"))
    with pytest.raises(_train.RunSettingsMismatch, match=r"off the every-2-steps grid \(step 5\)") as info:
        check_run_dir(tmp_path / "old", identity)
    assert info.value.differs == ["config.max_steps"]


def test_a_damaged_result_json_is_an_unfinished_run(tmp_path, monkeypatch):
    """A result.json cut off mid-write made a rerun exit 2 ("delete that folder"), and train_run
    itself raise a JSONDecodeError; one with a field missing was read back as a finished run. Now
    either is an unfinished run: a note (UnreadableResultWarning), then it resumes from its
    checkpoint or trains again, giving the uninterrupted numbers, and the file is rewritten."""
    import os

    data = TaskData(task_config("listops", "smoke", max_steps=7, eval_every=2, patience=5))
    v = VARIANTS["mha"]
    width, _ = model_width(data, v)
    identity = run_identity(data.cfg, v, 1e-3, 0, width, torch.device("cpu"))
    whole = train_run(data, v, 1e-3, 0, width, run_dir=tmp_path / "whole")
    result = tmp_path / "whole" / "result.json"
    text = result.read_text()
    for damaged, why in ((text[: len(text) // 2], "is not valid JSON"), ("[1]", "holds a JSON list")):
        result.write_text(damaged)
        assert check_run_dir(tmp_path / "whole", identity) is False  # no exit before training
        with pytest.warns(UnreadableResultWarning, match=f"{why}.*trains again from step 0"):
            again = train_run(data, v, 1e-3, 0, width, run_dir=tmp_path / "whole")
        assert _strip_timing(again) == _strip_timing(whole) and again["resumed_at_step"] is None
        assert json.loads(result.read_text()) == again
    # A checkpoint beside a result lacking a field: resumed from the checkpoint.
    with pytest.raises(RunInterrupted):
        train_run(data, v, 1e-3, 0, width, run_dir=tmp_path / "cut", should_stop=lambda s: s == 3)
    (tmp_path / "cut" / "result.json").write_text(json.dumps({k: x for k, x in whole.items() if k != "curve"}))
    with pytest.warns(UnreadableResultWarning, match="lacks curve.*resumes from its checkpoint"):
        resumed = train_run(data, v, 1e-3, 0, width, run_dir=tmp_path / "cut")
    assert resumed["resumed_at_step"] == 3 and _strip_timing(resumed) == _strip_timing(whole)
    # Written atomically: a temporary file in the run's folder, renamed over result.json; a
    # process that dies before the rename leaves no result.json, the checkpoint, and no temporary.
    real, renames = os.replace, []

    def dies_at_the_result(src, dst):
        renames.append((Path(src).parent, Path(dst)))
        if Path(dst).name == "result.json":
            raise OSError("the machine died")
        real(src, dst)

    monkeypatch.setattr(os, "replace", dies_at_the_result)
    with pytest.raises(OSError, match="died"):
        train_run(data, v, 1e-3, 0, width, run_dir=tmp_path / "died")
    monkeypatch.setattr(os, "replace", real)
    assert (tmp_path / "died" / "result.json") in [dst for _, dst in renames]
    assert all(src == dst.parent for src, dst in renames)
    assert sorted(p.name for p in (tmp_path / "died").iterdir()) == ["checkpoint.pt"]
    assert _strip_timing(train_run(data, v, 1e-3, 0, width, run_dir=tmp_path / "died")) == _strip_timing(whole)


def test_one_json_reader_tells_a_damaged_run_result_from_an_unreadable_one(tmp_path):
    """The run's result.json and the results/cost files share one parser (``read_json_object``)
    whose outcomes differ by class, so each caller keeps its policy. A result.json of bytes that
    are not UTF-8 raised a bare UnicodeDecodeError out of check_run_dir and train_run (the run's
    own reader caught only OSError and JSON errors); it is damaged content like a cut-off file,
    so the run counts as unfinished. A file the system cannot read still ends the command."""
    from damcha_experiments._jsonfile import (
        InvalidJsonFile,
        JsonFileError,
        NotAJsonObject,
        UnreadableJsonFile,
        read_json_object,
    )
    from damcha_experiments._train import RunSettingsMismatch

    data = TaskData(task_config("listops", "smoke"))
    v = VARIANTS["mha"]
    identity = run_identity(data.cfg, v, 1e-3, 0, model_width(data, v)[0], torch.device("cpu"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = run_dir / "result.json"
    assert read_json_object(result) is None  # missing: no error
    cases = [
        (b"\xff\xfe", InvalidJsonFile, "cannot be read (UnicodeDecodeError"),
        (b"", InvalidJsonFile, "is empty"),
        (b'{"identity": {', InvalidJsonFile, "is not valid JSON"),
        (b"[1]", NotAJsonObject, "holds a JSON list"),
    ]
    for content, kind, why in cases:
        result.write_bytes(content)
        with pytest.raises(kind) as info:
            read_json_object(result)
        assert str(info.value) == f"{result} {info.value.reason}" and info.value.reason.startswith(why)
        assert not isinstance(info.value, UnreadableJsonFile)
        assert check_run_dir(run_dir, identity) is False, content  # damaged: unfinished, no exit
    result.unlink()
    result.mkdir()  # the system cannot read it (IsADirectoryError): named, not taken for damage
    with pytest.raises(UnreadableJsonFile, match="cannot be read \\(IsADirectoryError") as info:
        read_json_object(result)
    assert isinstance(info.value, JsonFileError) and isinstance(info.value, DamchaValueError)
    with pytest.raises(RunSettingsMismatch, match="IsADirectoryError.*delete that folder"):
        check_run_dir(run_dir, identity)


def test_suite_resumes_where_it_stopped(smoke_data, tmp_path):
    cfg = smoke_data["crosshead"].cfg
    names = ["mha", "damcha-heads-query"]
    whole = run_suite(cfg, names, "headline", out=tmp_path / "a")
    calls = {"n": 0}

    def stop(step):
        calls["n"] += 1
        return calls["n"] == 9  # in the middle of the third run

    with pytest.raises(RunInterrupted):
        run_suite(cfg, names, "headline", out=tmp_path / "b", should_stop=stop)
    resumed = run_suite(cfg, names, "headline", out=tmp_path / "b")
    assert _strip_timing(resumed["variants"]) == _strip_timing(whole["variants"])
    assert any(r["resumed_at_step"] for v in resumed["variants"].values() for r in v["runs"])


def test_divergence_and_spikes_are_recorded_not_raised(smoke_data):
    data = smoke_data["crosshead"]
    cfg = data.cfg
    calls = {"n": 0}

    def poison(module, args, output):
        calls["n"] += 1
        # After a few normal steps the loss jumps (a spike), then turns NaN (a divergence).
        return output * 50.0 if calls["n"] == 5 else (output * math.nan if calls["n"] >= 7 else output)

    data = copy.copy(data)
    data.cfg = dataclasses.replace(
        cfg, max_steps=12, eval_every=100, warmup=1, spike_window=3, spike_factor=1.5, val_size=cfg.val_size
    )
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, o: poison(m, a, o) if m.__class__.__name__ == "TinyTransformer" and m.training else o
    )
    try:
        result = train_run(data, VARIANTS["mha"], 1e-3, 0, 16)
    finally:
        handle.remove()
    assert result["diverged"] and result["stop_reason"] == "diverged" and result["steps"] == 7
    assert result["loss_spikes"] == 1 and result["spike_steps"] == [5]


# ------------------------------------------------------------ the models


@pytest.mark.parametrize("name", ["damcha-heads-tied", "damcha-lowrank-tied", "damcha-heads-separate", "talking-heads"])
def test_fresh_variant_model_equals_mha_model(name, smoke_data):
    """Same weights: a fresh DAMCHA (gates 0) or identity talking-heads token model is the MHA model."""
    data = smoke_data["listops"]
    torch.manual_seed(0)
    mha = build_model(data, VARIANTS["mha"], 32)
    other = build_model(data, VARIANTS[name], 32)
    missing, unexpected = other.load_state_dict(mha.state_dict(), strict=False)
    assert not unexpected and all("metric" in k or "_mix" in k for k in missing)
    x = torch.from_numpy(data.val[0])
    with torch.no_grad():
        torch.testing.assert_close(other(x), mha(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name", ["damcha-heads-tied", "damcha-heads-query-shared", "damcha-lowrank-tied", "talking-heads"]
)
def test_replace_mha_vit_equals_the_mha_vit(name, smoke_data):
    """The digits ViT is converted as a user would (replace_mha): the converted model computes the same."""
    data = smoke_data["digits"]
    torch.manual_seed(0)
    mha = build_model(data, VARIANTS["mha"], 24)
    converted = as_variant(copy.deepcopy(mha), VARIANTS[name])
    assert not any(isinstance(m, torch.nn.MultiheadAttention) for m in converted.modules())
    x = torch.from_numpy(data.val[0])
    for mode in ("train", "eval"):  # eval: nn.TransformerEncoderLayer must not take its fused MHA kernel
        getattr(mha, mode)()
        getattr(converted, mode)()
        with torch.no_grad():
            torch.testing.assert_close(converted(x), mha(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("task", ["crosshead", "digits"])
def test_ablation_options_reach_the_model(task, smoke_data):
    data = smoke_data[task]
    shared = build_model(data, VARIANTS["damcha-heads-tied-shared"], 16)
    layers = damcha_layers(shared)
    assert len(layers) == data.cfg.num_layers or task == "digits"
    gens = {id(layer.metric_generators["qk"]) for layer in layers}
    gates = {id(layer.metric_gates["qk"]) for layer in layers}
    assert len(gens) == 1 and len(gates) == len(layers)
    own = damcha_layers(build_model(data, VARIANTS["damcha-heads-tied"], 16))
    assert len({id(layer.metric_generators["qk"]) for layer in own}) == len(own)
    gated = damcha_layers(build_model(data, VARIANTS["damcha-heads-tied-gate0.1"], 16))
    assert all(torch.all(layer.metric_gates["qk"] == 0.1) for layer in gated)
    assert all(
        layer.track_metric_penalty
        for layer in damcha_layers(build_model(data, VARIANTS["damcha-heads-tied-pen1e-2"], 16))
    )
    model = build_model(data, VARIANTS["damcha-heads-tied-mlr10"], 16)
    groups = param_groups(model, 1e-3, VARIANTS["damcha-heads-tied-mlr10"], 0.01)
    metric_ids = {id(p) for layer in damcha_layers(model) for p in layer.metric_gates.parameters()}
    metric_ids |= {id(p) for layer in damcha_layers(model) for p in layer.metric_generators.parameters()}
    for g in groups:
        ids = {id(p) for p in g["params"]}
        assert ids <= metric_ids or not ids & metric_ids
        assert g["base_lr"] == pytest.approx(1e-2 if ids <= metric_ids else 1e-3)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    decayed = {id(p) for g in groups if g["weight_decay"] for p in g["params"]}
    no_decay = [
        p for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.LayerNorm)) for p in m.parameters()
    ] + [p for n, p in model.named_parameters() if p.dim() < 2 or n == "positions"]
    assert no_decay and not decayed & {id(p) for p in no_decay}
    assert any(id(p) in decayed for layer in damcha_layers(model) for p in layer.metric_generators.parameters())


def test_generator_gets_no_gradient_until_the_gates_move(smoke_data):
    """Why the anchoring ablation exists: with gates at 0 the generator's gradient is exactly 0."""
    data = smoke_data["crosshead"]
    x, y = (torch.from_numpy(a) for a in data.batch(data.order(0)))
    grads = {}
    for name in ("damcha-heads-tied", "damcha-heads-tied-gate0.1"):
        torch.manual_seed(0)
        model = build_model(data, VARIANTS[name], 16)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        layer = damcha_layers(model)[0]
        grads[name] = (
            layer.metric_generators["qk"].weight.grad.abs().max().item(),
            layer.metric_gates["qk"].grad.abs().max().item(),
        )
    assert grads["damcha-heads-tied"][0] == 0.0 and grads["damcha-heads-tied"][1] > 0
    assert grads["damcha-heads-tied-gate0.1"][0] > 0


# ------------------------------------------------------ device plumbing


@pytest.mark.parametrize("task", TASK_NAMES)
def test_models_and_batches_follow_the_device(task, smoke_data):
    """Device-agnostic code: on the meta device every parameter and the output stay there."""
    data = smoke_data[task]
    name = "damcha-heads-query-shared"
    model = build_model(data, VARIANTS[name], 16).to("meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    x = torch.from_numpy(data.val[0][:2]).to("meta")
    out = model(x)
    assert out.device.type == "meta" and out.shape[0] == 2


# ----------------------------------------------------------------- cost


def test_saved_activation_bytes_hand_checked():
    class Scale(torch.nn.Module):
        def __init__(self, twice=False, relu=False):
            super().__init__()
            self.w, self.twice, self.relu = torch.nn.Parameter(torch.ones(3)), twice, relu

        def forward(self, x):
            y = x * self.w + x * self.w if self.twice else x * self.w
            return torch.relu(y) if self.relu else y

    x, y = torch.randn(5, 3), torch.zeros(5, dtype=torch.long)
    base = saved_activation_bytes(Scale(), x, y)
    assert saved_activation_bytes(Scale(twice=True), x, y) == base  # x saved twice, one storage; w excluded
    assert saved_activation_bytes(Scale(relu=True), x, y) - base == 5 * 3 * 4  # relu keeps its float32 output


def test_first_version_names_still_work_and_warn(tmp_path):
    import damcha_experiments as de

    with pytest.warns(DeprecationWarning, match="DEFAULT_VARIANTS is deprecated"):
        assert tuple(de.DEFAULT_VARIANTS) == HEADLINE
    with pytest.warns(DeprecationWarning, match="TASKS is deprecated"):
        assert de.TASKS["listops"].preset == "default"
    with pytest.warns(DeprecationWarning, match="run_experiment is deprecated"):
        res = de.run_experiment("charlm", ["mha"], seeds=1, steps=2, eval_size=4)
    assert res["variants"]["mha"]["runs"][0]["steps"] == 2 and res["config"]["val_size"] == 4


@pytest.mark.parametrize(
    "value, recent, spike",
    [
        (0.03, [0.01, 0.01, 0.012], False),  # 3x a converged median, but a 0.02-nat wobble
        (0.40, [0.01, 0.01, 0.012], True),  # a real jump from near zero
        (2.5, [1.0, 1.1, 0.9], True),  # 2.5x and 1.5 nats
        (1.9, [1.0, 1.1, 0.9], False),  # under the factor
    ],
    ids=["converged-wobble", "jump-from-converged", "mid-training-jump", "under-factor"],
)
def test_spike_rule_needs_a_relative_and_an_absolute_jump(value, recent, spike, smoke_data):
    from damcha_experiments._train import is_spike

    assert is_spike(value, recent, smoke_data["crosshead"].cfg) is spike


# The saved-run folders (experiments/results) and the overrides of the commands that trained
# them: the convergence extensions raised the step cap.
SAVED_RUNS = {
    "full-in-progress": {},
    "listops30k-in-progress": {"max_steps": 30_000},
    "charlm30k-in-progress": {"max_steps": 30_000},
    "listops3-probe": {},
    "charlm30k4-in-progress": {"max_steps": 30_000},
    "charlm30k5-in-progress": {"max_steps": 30_000},
    "listops3x3-in-progress": {},
}


@pytest.mark.parametrize("folder", list(SAVED_RUNS))
def test_saved_runs_still_match_the_identity_this_code_computes(folder):
    """Every finished run kept in experiments/results/FOLDER is reused by its command, not retrained.

    A change to what a run's identity holds (a field for every task, not only the task whose
    data changed) would silently orphan these runs; listops' identity alone names a data version.
    A run of a lower cap that the plateau rule stopped counts (``check_run_dir`` reuses it).
    """
    import pathlib

    from damcha_experiments._tasks import DATA_VERSIONS
    from damcha_experiments._train import check_run_dir, run_identity

    root = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "results" / folder / "runs"
    files = sorted(root.glob("*/*/*/*/result.json"))
    assert files, f"no saved runs in {root}"
    threads = torch.get_num_threads()
    try:
        for path in files:
            stored = json.loads(path.read_text())["identity"]
            torch.set_num_threads(stored["torch_threads"])
            cfg = task_config(stored["config"]["task"], stored["config"]["preset"], **SAVED_RUNS[folder])
            # A task whose data changed (DATA_VERSIONS) has the version in its identity:
            # runs saved on older data no longer match, runs on the current data do.
            now = run_identity(
                cfg,
                VARIANTS[stored["variant"]["name"]],
                stored["lr"],
                stored["seed"],
                stored["mlp_hidden"],
                torch.device(stored["device"]),
            )
            assert check_run_dir(path.parent, now), path
    finally:
        torch.set_num_threads(threads)
    listops = run_identity(task_config("listops", "smoke"), VARIANTS["mha"], 1e-3, 0, 16, torch.device("cpu"))
    assert listops["data_version"] == DATA_VERSIONS["listops"] == 2


def _without_environment(result):
    return {k: v for k, v in result.items() if k not in ("environment", "environments")}


def test_a_resume_in_another_environment_is_recorded_and_warned_once(tmp_path, monkeypatch):
    """The result lists every environment a run ran in, with its first step; the numbers are untouched."""
    from damcha_experiments import _train

    data = TaskData(task_config("listops", "smoke", max_steps=7, eval_every=2, patience=5))
    v = VARIANTS["mha"]
    width, _ = model_width(data, v)
    here = json.loads(json.dumps(_train.run_environment(torch.device("cpu"))))
    assert {"python", "torch", "numpy", "machine", "processor", "cpu_count", "torch_threads", "device"} <= set(here)
    assert here["torch"] == torch.__version__ and here["numpy"] == np.__version__ and here["device"] == "cpu"
    whole = train_run(data, v, 1e-3, 1, width, run_dir=tmp_path / "whole")
    assert whole["environment"] == here and whole["environments"] == [{"first_step": 1, "environment": here}]

    cut = tmp_path / "cut"
    with pytest.raises(RunInterrupted):
        train_run(data, v, 1e-3, 1, width, run_dir=cut, should_stop=lambda s: s == 3)
    payload = torch.load(cut / "checkpoint.pt", weights_only=True)
    assert json.loads(payload["environments"]) == whole["environments"]

    elsewhere = {**here, "torch": "9.9.9", "cpu_capability": "NONE"}
    monkeypatch.setattr(_train, "run_environment", lambda device: dict(elsewhere))
    with pytest.warns(_train.ResumedElsewhereWarning) as record, pytest.raises(RunInterrupted):
        train_run(data, v, 1e-3, 1, width, run_dir=cut, should_stop=lambda s: s == 5)
    ours = [w for w in record if issubclass(w.category, _train.ResumedElsewhereWarning)]
    assert len(ours) == 1  # once, although the run saved checkpoints after the resume
    message = str(ours[0].message)
    assert "resuming at step 3" in message and f"torch {here['torch']!r} -> '9.9.9'" in message
    assert "cpu_capability" in message and "numpy" not in message
    # Resumed again in that same environment: no warning, no new entry.
    with warnings.catch_warnings():
        warnings.simplefilter("error", _train.ResumedElsewhereWarning)
        resumed = train_run(data, v, 1e-3, 1, width, run_dir=cut)
    assert resumed["resumed_at_step"] == 5 and resumed["environment"] == elsewhere
    assert resumed["environments"] == [
        {"first_step": 1, "environment": here},
        {"first_step": 4, "environment": elsewhere},
    ]
    # Recording the environment changes no number: bitwise the uninterrupted run.
    assert _strip_timing(_without_environment(resumed)) == _strip_timing(_without_environment(whole))
    assert json.loads((cut / "result.json").read_text()) == resumed


def test_a_run_folder_of_another_device_type_is_refused_naming_device(tmp_path):
    """check_run_dir took a device it never used: the identity carries the device type, and the
    checkpoint is read onto the CPU for its identity alone. A folder of a CUDA run (here: a CPU
    checkpoint relabelled as one) is refused for a CPU run naming ``device``, before and at training,
    and is still recognised as resumable for a CUDA run from a machine that need not have CUDA."""
    import inspect

    from damcha_experiments import _train

    assert list(inspect.signature(_train.check_run_dir).parameters) == ["run_dir", "identity"]
    data = TaskData(task_config("listops", "smoke", max_steps=5, eval_every=2, patience=5))
    v = VARIANTS["mha"]
    width, _ = model_width(data, v)
    cut = tmp_path / "cut"
    with pytest.raises(RunInterrupted):
        train_run(data, v, 1e-3, 0, width, run_dir=cut, should_stop=lambda s: s == 3)
    on_cuda = _train.run_identity(data.cfg, v, 1e-3, 0, width, torch.device("cuda"))
    on_cpu = _train.run_identity(data.cfg, v, 1e-3, 0, width, torch.device("cpu"))
    payload = torch.load(cut / "checkpoint.pt", weights_only=True)
    payload["identity"] = json.dumps(on_cuda)
    torch.save(payload, cut / "checkpoint.pt")
    assert _train.check_run_dir(cut, on_cuda) is False  # resumable there, not finished
    with pytest.raises(_train.RunSettingsMismatch, match="differing: device, torch_threads") as info:
        _train.check_run_dir(cut, on_cpu)
    assert info.value.differs == ["device", "torch_threads"] and info.value.path == cut / "checkpoint.pt"
    with pytest.raises(_train.RunSettingsMismatch, match="differing: device, torch_threads"):
        train_run(data, v, 1e-3, 0, width, run_dir=cut)
    # A finished run's result (every field; one lacking a field is an unfinished run).
    (cut / "result.json").write_text(json.dumps(dict.fromkeys(_train.RESULT_FIELDS) | {"identity": on_cuda}))
    assert _train.check_run_dir(cut, on_cuda) is True
    with pytest.raises(_train.RunSettingsMismatch, match="differing: device, torch_threads"):
        _train.check_run_dir(cut, on_cpu)


def test_a_checkpoint_or_result_written_before_environments_were_recorded_still_loads(tmp_path):
    from damcha_experiments import _train

    data = TaskData(task_config("listops", "smoke", max_steps=7, eval_every=2, patience=5))
    v = VARIANTS["mha"]
    width, _ = model_width(data, v)
    cut = tmp_path / "cut"
    with pytest.raises(RunInterrupted):
        train_run(data, v, 1e-3, 1, width, run_dir=cut, should_stop=lambda s: s == 3)
    payload = torch.load(cut / "checkpoint.pt", weights_only=True)
    del payload["environments"]  # as the checkpoints of earlier sessions are
    torch.save(payload, cut / "checkpoint.pt")
    with pytest.warns(_train.ResumedElsewhereWarning, match="records no environment"):
        resumed = train_run(data, v, 1e-3, 1, width, run_dir=cut)
    here = json.loads(json.dumps(_train.run_environment(torch.device("cpu"))))
    assert resumed["environments"] == [{"first_step": 1, "environment": None}, {"first_step": 4, "environment": here}]
    # An old result.json (no environment fields) is read back as is.
    old = _without_environment(resumed)
    (cut / "result.json").write_text(json.dumps(old))
    assert train_run(data, v, 1e-3, 1, width, run_dir=cut) == old


# ------------------------------------------------------------ provenance


def _git_cli(folder, *args):
    import subprocess

    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_code_version_reads_the_commit_and_dirty_flag_and_never_fails(tmp_path, monkeypatch):
    """The commit and dirty flag of the checkout holding a folder, compared with git's own answer;
    None (never an exception) outside a repository, in an untracked folder inside one (a virtual
    environment), in a repository without a commit, without git, or when git fails."""
    import subprocess

    from damcha_experiments import _provenance

    plain = tmp_path / "plain"
    plain.mkdir()
    assert _provenance.code_version(plain) is None
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git_cli(repo, "init", "-q")
    assert _provenance.code_version(repo) is None  # no commit yet
    (repo / "pkg" / "mod.py").write_text("x = 1\n")
    _git_cli(repo, "add", "pkg/mod.py")
    _git_cli(repo, "commit", "-q", "-m", "first")
    head = _git_cli(repo, "rev-parse", "HEAD")
    assert re.fullmatch(r"[0-9a-f]{40}", head)
    assert _provenance.code_version(repo / "pkg") == {"commit": head, "dirty": False}
    (repo / "pkg" / "new_untracked.py").write_text("")  # untracked files do not make it dirty
    assert _provenance.code_version(repo / "pkg") == {"commit": head, "dirty": False}
    (repo / "pkg" / "mod.py").write_text("x = 2\n")
    assert _provenance.code_version(repo / "pkg") == {"commit": head, "dirty": True}
    (repo / "venv").mkdir()  # an installed copy in an untracked folder is not this repository's code
    (repo / "venv" / "mod.py").write_text("x = 1\n")
    assert _provenance.code_version(repo / "venv") is None
    # This package, asked once per process: the same commit git reports for its folder.
    package = Path(_provenance.__file__).resolve().parent
    try:
        expected = _git_cli(package, "rev-parse", "HEAD")
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "--", "."], cwd=package).returncode == 0
    except subprocess.CalledProcessError:
        expected, tracked = None, False
    mine = _provenance.code_version()
    if tracked:
        assert mine is not None and mine["commit"] == expected and isinstance(mine["dirty"], bool)
    else:
        assert mine is None
    # No git on the PATH, or git failing or hanging: None.
    monkeypatch.setenv("PATH", str(plain))
    assert _provenance.code_version(repo / "pkg") is None
    monkeypatch.undo()

    def hangs(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], 10)

    monkeypatch.setattr(_provenance.subprocess, "run", hangs)
    assert _provenance.code_version(repo / "pkg") is None


def test_a_result_records_its_code_version_and_utc_times_per_stretch(tmp_path, monkeypatch):
    """Each result.json records the code that ran it (per process stretch, the last one's as
    ``code_version``) and when its first step started and it finished, in UTC; a checkpoint written
    before this was recorded resumes with that stretch unknown (null), never refused."""
    from datetime import datetime, timezone

    from damcha_experiments import _train

    def parse(stamp):
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)

    data = TaskData(task_config("listops", "smoke", max_steps=7, eval_every=2, patience=5))
    v = VARIANTS["mha"]
    width, _ = model_width(data, v)
    first = {"commit": "a" * 40, "dirty": False}
    second = {"commit": "b" * 40, "dirty": True}
    monkeypatch.setattr(_train, "code_version", lambda: dict(first))
    before = datetime.now(timezone.utc).replace(microsecond=0)
    cut = tmp_path / "cut"
    with pytest.raises(RunInterrupted):
        train_run(data, v, 1e-3, 1, width, run_dir=cut, should_stop=lambda s: s == 3)
    payload = torch.load(cut / "checkpoint.pt", weights_only=True)
    (stored,) = json.loads(payload["stretches"])
    assert stored["first_step"] == 1 and stored["code_version"] == first
    monkeypatch.setattr(_train, "code_version", lambda: dict(second))
    resumed = train_run(data, v, 1e-3, 1, width, run_dir=cut)
    after = datetime.now(timezone.utc)
    assert resumed["code_version"] == second  # the code that finished it
    assert [(s["first_step"], s["code_version"]) for s in resumed["stretches"]] == [(1, first), (4, second)]
    assert resumed["started_utc"] == stored["started_utc"] == resumed["stretches"][0]["started_utc"]
    assert before <= parse(resumed["started_utc"]) <= parse(resumed["stretches"][1]["started_utc"])
    assert parse(resumed["stretches"][1]["started_utc"]) <= parse(resumed["finished_utc"]) <= after
    assert json.loads((cut / "result.json").read_text()) == resumed
    # Uninterrupted, with the real code_version: one stretch, the package's own answer.
    monkeypatch.undo()
    from damcha_experiments._provenance import code_version

    whole = train_run(data, v, 1e-3, 1, width, run_dir=tmp_path / "whole")
    assert whole["code_version"] == code_version()
    assert [s["first_step"] for s in whole["stretches"]] == [1]
    assert _strip_timing(resumed) == _strip_timing(whole)  # provenance changes no number
    # A checkpoint from before stretches were recorded.
    old = tmp_path / "old"
    with pytest.raises(RunInterrupted):
        train_run(data, v, 1e-3, 1, width, run_dir=old, should_stop=lambda s: s == 3)
    payload = torch.load(old / "checkpoint.pt", weights_only=True)
    del payload["stretches"]
    torch.save(payload, old / "checkpoint.pt")
    legacy = train_run(data, v, 1e-3, 1, width, run_dir=old)
    assert legacy["started_utc"] is None and legacy["stretches"][0] == {
        "first_step": 1,
        "started_utc": None,
        "code_version": None,
    }
    assert legacy["stretches"][1]["first_step"] == 4 and parse(legacy["finished_utc"]) <= datetime.now(timezone.utc)


def test_a_suite_and_a_cost_measurement_record_their_code_version_and_utc_times(monkeypatch):
    from datetime import datetime, timezone

    from damcha_experiments import _cost, _suite

    def parse(stamp):
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)

    code = {"commit": "c" * 40, "dirty": False}
    monkeypatch.setattr(_suite, "code_version", lambda: dict(code))
    monkeypatch.setattr(_cost, "code_version", lambda: dict(code))
    cfg = task_config("crosshead", "smoke", max_steps=4, eval_every=2, seeds=1, sweep_seeds=1, lrs=(1e-3,))
    before = datetime.now(timezone.utc).replace(microsecond=0)
    res = run_suite(cfg, ["mha"], "headline", out=None)
    cost = _cost.measure_cost(dataclasses.replace(cfg, cost_rounds=2, cost_steps=1), ["mha"])
    after = datetime.now(timezone.utc)
    for obj in (res, cost):
        assert obj["code_version"] == code
        assert before <= parse(obj["started_utc"]) <= parse(obj["finished_utc"]) <= after
    assert parse(res["finished_utc"]) <= parse(cost["started_utc"])
