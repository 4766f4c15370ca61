"""Budgets, comparisons and the verdict per claim, on hand-made results whose answer is known."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from damcha_experiments import _analysis as an
from damcha_experiments._report import build_report, sweep_threshold_table, write_json


def _run(seed, steps, val, test, times=None):
    return {
        "seed": seed,
        "diverged": False,
        "test_metric": test[-1] if len(set(val)) == 1 else test[int(np.argmax(val))],
        "stop_reason": "plateau",
        "steps": steps[-1],
        "steps_to_threshold": {},
        "loss_spikes": 0,
        "curve": {
            "step": list(steps),
            "val_metric": list(val),
            "test_metric": list(test),
            "train_time_s": list(times or [s * 0.01 for s in steps]),
        },
    }


def _results(task, finals: dict[str, list[float]], *, higher=True, margin=0.02, kinds=None):
    """One eval point per run whose val and test metric are the given final values."""
    variants = {}
    for name, values in finals.items():
        runs = [_run(s, [100], [v], [v]) for s, v in enumerate(values)]
        kind = (kinds or {}).get(name) or ("damcha" if name.startswith("damcha") else name)
        variants[name] = {
            "kind": kind,
            "runs": runs,
            "divergences": 0,
            "sweep_divergences": 0,
            "loss_spikes": 0,
            "params": 1000,
            "chosen_lr": 1e-3,
            "test": {"mean": float(np.mean(values)), "std": 0.0, "ci": None},
            "steps": {"mean": 100.0},
            "lr_sweep": {"lrs": [1e-3], "runs": [], "chosen_lr": 1e-3},
        }
    return {
        "format": "damcha-experiment/2",
        "task": task,
        "suite": "headline",
        "preset": "full",
        "device": "cpu",
        "metric": "accuracy" if higher else "bits_per_char",
        "higher_is_better": higher,
        "seeds": 5,
        "config": {"margin": margin, "max_steps": 1000, "thresholds": [], "param_budget": 1000, "description": task},
        "data": {},
        "variants": variants,
    }


NOISE = [0.001, -0.002, 0.0, 0.002, -0.001]


def _base(level):
    return [level + n for n in NOISE]


def _other(level):
    """Seeds whose noise differs from _base's: a paired gain with a real spread (an identical gain on
    every seed is only worth the sign test's p = 0.0625 with 5 seeds)."""
    return [level + n for n in reversed(NOISE)]


def test_value_at_reads_the_best_validation_point_within_the_budget():
    res = _results("crosshead", {"mha": [0.5]})
    run = _run(0, [100, 200, 300], [0.4, 0.6, 0.5], [0.41, 0.61, 0.51], times=[1.0, 2.0, 3.0])
    assert an.value_at(res, run) == 0.61
    assert an.value_at(res, run, max_step=150) == 0.41
    assert an.value_at(res, run, max_time=2.5) == 0.61
    assert an.value_at(res, run, max_time=3.0, s_per_step=0.02) == 0.41  # modelled time: step 200 is at 4 s
    assert math.isnan(an.value_at(res, run, max_step=50))


def test_budgets_are_the_largest_every_run_reached():
    res = _results("crosshead", {"mha": [0.5, 0.5], "damcha-heads-tied": [0.5, 0.5]})
    res["variants"]["mha"]["runs"][0]["curve"] = _run(0, [100, 200], [0.1, 0.2], [0.1, 0.2])["curve"]
    b = an.budgets(res, ["mha", "damcha-heads-tied"])
    assert b["steps"] == 100 and b["time_source"] == "run"
    cost = {"variants": {"mha": {"s_per_step": 0.01}, "damcha-heads-tied": {"s_per_step": 0.03}}}
    b = an.budgets(res, ["mha", "damcha-heads-tied"], cost)
    assert b["time_source"] == "cost" and b["time_s"] == pytest.approx(1.0)  # mha's 100 steps x 0.01 s
    # A variant the cost file does not time: every run on its own clock (1.0 s per 100 steps here), not
    # the budget on a mix of clocks (0.001 s x 100 steps for mha against tied's own 1.0 s) read on another.
    del cost["variants"]["damcha-heads-tied"]
    cost["variants"]["mha"]["s_per_step"] = 0.001
    b = an.budgets(res, ["mha", "damcha-heads-tied"], cost)
    assert b["time_source"] == "run" and b["time_s"] == pytest.approx(1.0)


def test_claim1_supported_when_a_damcha_variant_beats_both_baselines():
    res = _results(
        "crosshead",
        {
            "mha": _base(0.60),
            "talking-heads": _base(0.62),
            "damcha-heads-query": _other(0.80),
            "damcha-heads-tied": [0.63, 0.58, 0.61, 0.57, 0.62],
        },
    )
    v = {x["claim"]: x for x in an.verdicts({"crosshead": res}, {}, {})}
    assert v[1]["verdict"] == "supported" and "damcha-heads-query" in v[1]["reason"]
    rows = an.compare(res, ["damcha-heads-query", "damcha-heads-tied"], "mha")
    assert rows[0]["decision"] == "better" and rows[1]["decision"] == "within noise"
    assert rows[0]["p_holm"] >= rows[0]["p"]


def test_verdicts_of_a_partly_trained_task_file():
    """A task whose file holds DAMCHA variants only (the state between the documented
    --variants subset commands against one --out) made the sign-flip reading's
    min() run over no rows: the whole report crashed. Its verdicts are those of
    the complete task beside it."""
    full = _results("crosshead", {"mha": _base(0.6), "talking-heads": _base(0.6), "damcha-heads-tied": _other(0.9)})
    partial = _results("crosshead1", {"damcha-heads-tied": _other(0.9)})
    alone = {x["claim"]: x["verdict"] for x in an.verdicts({"crosshead": full}, {}, {})}
    both = {x["claim"]: x["verdict"] for x in an.verdicts({"crosshead": full, "crosshead1": partial}, {}, {})}
    assert both[1] == alone[1] == "supported", (alone, both)


def test_claim1_not_supported_when_the_interval_excludes_a_meaningful_gain():
    res = _results(
        "crosshead",
        {"mha": _base(0.60), "talking-heads": _base(0.60), "damcha-heads-query": [0.60 + 0.5 * n for n in NOISE]},
    )
    one_layer = dict(res, task="crosshead1")
    v = {x["claim"]: x for x in an.verdicts({"crosshead": res, "crosshead1": one_layer}, {}, {})}
    assert v[1]["verdict"] == "not supported"
    # Both depths are part of claim 1: one of them missing leaves it open.
    v = {x["claim"]: x for x in an.verdicts({"crosshead": res}, {}, {})}
    assert v[1]["verdict"] == "inconclusive" and "missing: ['crosshead1']" in v[1]["reason"]


def test_claim1_supported_by_the_one_layer_configuration_alone():
    two = _results("crosshead", {"mha": _base(0.99), "talking-heads": _base(0.99), "damcha-heads-query": _base(0.99)})
    one = _results("crosshead1", {"mha": _base(0.90), "talking-heads": _base(0.91), "damcha-heads-query": _other(0.97)})
    v = {x["claim"]: x for x in an.verdicts({"crosshead": two, "crosshead1": one}, {}, {})}
    assert v[1]["verdict"] == "supported"
    assert "crosshead1: better than mha, talking-heads: damcha-heads-query" in v[1]["reason"]
    assert "crosshead: no DAMCHA variant beats every baseline" in v[1]["reason"]


def test_claim1_inconclusive_with_noisy_seeds():
    res = _results(
        "crosshead",
        {
            "mha": [0.5, 0.7, 0.6, 0.4, 0.8],
            "talking-heads": [0.6] * 5,
            "damcha-heads-query": [0.7, 0.5, 0.65, 0.45, 0.75],
        },
    )
    assert an.verdicts({"crosshead": res}, {}, {})[0]["verdict"] == "inconclusive"


def test_claim2_needs_every_task_and_lower_is_better_for_bits_per_char():
    good = {"mha": _base(0.6), "talking-heads": _base(0.6), "damcha-heads-tied": _other(0.7)}
    lm = _results(
        "charlm", {"mha": _base(2.0), "talking-heads": _base(2.0), "damcha-heads-tied": _other(1.9)}, higher=False
    )
    tasks = {"charlm": lm, "listops": _results("listops", good), "digits": _results("digits", good)}
    v = {x["claim"]: x for x in an.verdicts(tasks, {}, {})}
    assert v[2]["verdict"] == "supported"
    worse_lm = _results(
        "charlm", {"mha": _base(2.0), "talking-heads": _base(2.0), "damcha-heads-tied": _other(2.1)}, higher=False
    )
    v = {x["claim"]: x for x in an.verdicts(tasks | {"charlm": worse_lm}, {}, {})}
    assert v[2]["verdict"] == "not supported" and "charlm" in v[2]["reason"]
    v = {x["claim"]: x for x in an.verdicts({"listops": _results("listops", good)}, {}, {})}
    assert v[2]["verdict"] == "inconclusive" and "missing" in v[2]["reason"]


def _cost(ratio, load=0.1, memory=1.05, *, noise=0.02, rounds=41, clock="thread_time"):
    """A cost file of the interleaved schedule: MHA's rounds drift 1.6x (fast and slow phases of the
    machine, as on the shared VM), DAMCHA's follow them at ``ratio`` with ``noise`` of its own."""
    mha = [0.010 * (1.6 if r % 3 == 0 else 1.0) for r in range(rounds)]
    z = np.random.default_rng(0).standard_normal(rounds)
    tied = [m * ratio * (1 + noise * zr) for m, zr in zip(mha, z)]
    return {
        "format": "damcha-experiment/2",
        "kind": "cost",
        "task": "crosshead",
        "batch": 64,
        "cost_rounds": rounds,
        "cost_steps": 5,
        "cost_format": 2,
        "clock": clock,
        "environment": {"loadavg": [load], "loadavg_after": [load], "cpu_count": 2, "device": "cpu"},
        "variants": {
            "mha": {
                "params": 1000,
                "activation_bytes": 1024,
                "round_s_per_step": mha,
                "time_ratio_vs_mha": 1.0,
                "train_bytes_ratio_vs_mha": 1.0,
                "s_per_step": 0.01,
            },
            "damcha-heads-tied": {
                "params": 1000,
                "activation_bytes": 1024,
                "round_s_per_step": tied,
                "time_ratio_vs_mha": float(np.median(np.array(tied) / np.array(mha))),
                "train_bytes_ratio_vs_mha": memory,
                "s_per_step": 0.01 * ratio,
            },
        },
    }


def _claim3(cost):
    res = _results("crosshead", {"mha": _base(0.6), "damcha-heads-tied": _base(0.6)})
    return an.verdicts({"crosshead": res}, {}, {"crosshead": cost})[2]


@pytest.mark.parametrize(
    "cost, verdict, status",
    [
        (_cost(1.1), "supported", "within"),
        (_cost(1.3), "not supported", "over"),
        (_cost(1.24, noise=0.1), "inconclusive", "uncertain"),
        (_cost(2.0), "not supported", "over"),
        (_cost(1.1, memory=1.6), "not supported", "over"),
        (_cost(1.1, load=3.0, clock="perf_counter"), "inconclusive", "within"),
        (_cost(1.1, load=3.0), "supported", "within"),
    ],
    ids=["ci-below", "ci-above", "ci-straddles", "slow", "memory", "busy-wall-clock", "busy-thread-clock"],
)
def test_claim3_rule(cost, verdict, status):
    """Claim 3 reads the bootstrap interval of the median per-round ratio against the tolerance;
    MHA's rounds drift 1.6x in every case (the drift gate that rejected all of them is gone)."""
    ratio = an.time_ratio(cost, "damcha-heads-tied")
    lo, hi = ratio["ci"]
    assert lo < ratio["median"] < hi and ratio["n"] == 41 and ratio["clock"] == cost["clock"]
    claim3 = _claim3(cost)
    assert claim3["verdict"] == verdict
    (row,) = claim3["rows"]
    assert row["status"] == status and row["time_ci"] == [lo, hi]
    assert claim3["equal_time"] == {"crosshead": {"better": [], "worse": []}}
    if status == "uncertain":
        assert lo < an.OVERHEAD_TOLERANCE < hi and "interval straddles it" in claim3["reason"]
    if cost["environment"]["loadavg"][0] > 1:
        busy = "load average 3.00 on 2 cores"
        assert busy in claim3["reason"]
        assert ("wall clock of a busy machine" in claim3["reason"]) == (cost["clock"] == "perf_counter")
        assert ("caveat" in claim3["reason"]) == (cost["clock"] == "thread_time")


def test_claim3_is_not_supported_off_a_subset_of_the_variants():
    """A cost file measured with --variants naming some DAMCHA variants only gave "supported" from
    those: every headline DAMCHA variant of a measured task must be in it."""
    res = _results("crosshead", {"mha": _base(0.6), "damcha-heads-tied": _base(0.6), "damcha-heads-query": _base(0.6)})
    claim3 = an.verdicts({"crosshead": res}, {}, {"crosshead": _cost(1.1)})[2]
    assert claim3["verdict"] == "inconclusive", claim3["reason"]
    assert "not measured: damcha-heads-query (crosshead)" in claim3["reason"]
    assert _claim3(_cost(1.1))["verdict"] == "supported"  # the same file, every variant measured
    # Every measured one over, but not every one measured: not "not supported" either.
    claim3 = an.verdicts({"crosshead": res}, {}, {"crosshead": _cost(2.0)})[2]
    assert claim3["verdict"] == "inconclusive" and "not measured: damcha-heads-query (crosshead)" in claim3["reason"]
    assert _claim3(_cost(2.0))["verdict"] == "not supported"


def test_report_keeps_an_ablation_cost_file_out_of_claim3(tmp_path):
    """TASK_ablation_cost.json was filed as the task's cost: claim 3 was decided on the ablation's
    variants (and the headline cost file, when both were there, was replaced by whichever came later)."""
    res = _results("crosshead", {"mha": _base(0.6), "damcha-heads-tied": _base(0.6)})
    write_json(res, tmp_path / "crosshead.json")
    ablation_cost = dict(_cost(2.0), suite="ablation")
    ablation_cost["variants"]["damcha-heads-tied-pen1e-3"] = ablation_cost["variants"].pop("damcha-heads-tied")
    write_json(ablation_cost, tmp_path / "crosshead_ablation_cost.json")
    _, summary = build_report(tmp_path)
    assert summary["verdicts"][2]["verdict"] == "inconclusive"
    assert summary["verdicts"][2]["reason"] == "no cost measurement"
    write_json(dict(_cost(1.1), suite="headline"), tmp_path / "crosshead_cost.json")
    _, summary = build_report(tmp_path)
    assert summary["verdicts"][2]["verdict"] == "supported"
    assert [r["variant"] for r in summary["verdicts"][2]["rows"]] == ["damcha-heads-tied"]


def test_claim3_interval_is_reproducible_and_resamples_rounds():
    cost = _cost(1.2, noise=0.05)
    first, again = an.time_ratio(cost, "damcha-heads-tied"), an.time_ratio(cost, "damcha-heads-tied")
    assert first == again
    tied, mha = (np.array(cost["variants"][n]["round_s_per_step"]) for n in ("damcha-heads-tied", "mha"))
    # The per-round ratios, independently: a percentile bootstrap of their median from the same seed.
    ratios = tied / mha
    draws = np.median(ratios[np.random.default_rng(0).integers(0, 41, size=(10_000, 41))], axis=1)
    assert first["median"] == pytest.approx(np.median(ratios))
    assert first["ci"] == pytest.approx(list(np.quantile(draws, [0.025, 0.975])), abs=0)
    # More rounds of the same noise narrow it.
    many = an.time_ratio(_cost(1.2, noise=0.05, rounds=161), "damcha-heads-tied")["ci"]
    assert many[1] - many[0] < first["ci"][1] - first["ci"][0]


def test_claim3_reads_old_cost_files():
    """Files before cost_format 2 (7 rounds of 20 consecutive steps, wall clock, no interval stored):
    the same interval from their round_s_per_step; the wall clock makes a busy machine inconclusive."""
    old = _cost(1.1, rounds=7)
    for key in ("cost_format", "clock"):
        del old[key]
    # The drifting crosshead file of session 9: MHA 16 ms down to 7 ms over its rounds.
    old["variants"]["mha"]["round_s_per_step"] = [0.0163, 0.0126, 0.0119, 0.0118, 0.0089, 0.0085, 0.0072]
    old["variants"]["damcha-heads-tied"]["round_s_per_step"] = [
        m * r for m, r in zip(old["variants"]["mha"]["round_s_per_step"], [1.10, 1.12, 1.08, 1.11, 1.09, 1.10, 1.13])
    ]
    ratio = an.time_ratio(old, "damcha-heads-tied")
    assert ratio["clock"] == "perf_counter" and ratio["n"] == 7 and ratio["median"] == pytest.approx(1.10)
    assert 1.08 <= ratio["ci"][0] < ratio["ci"][1] <= 1.13
    assert an.round_spread(old) == pytest.approx(0.0163 / 0.0072)
    assert _claim3(old)["verdict"] == "supported"
    old["environment"]["loadavg"] = [3.0]
    assert _claim3(old)["verdict"] == "inconclusive"
    # Nothing to resample (a ratio stored without rounds or interval): uncertain, not within.
    bare = _cost(1.1)
    for e in bare["variants"].values():
        del e["round_s_per_step"]
    claim3 = _claim3(bare)
    assert claim3["verdict"] == "inconclusive" and claim3["rows"][0]["status"] == "uncertain"
    assert "no interval" in claim3["reason"]


def test_claim3_says_why_a_cost_file_has_no_time_ratio():
    """A cost file whose clock could not time the steps has no ratio (None): claim 3 said "no cost
    measurement" as if none had run; it now names the clock and the first bad round."""
    cost = _cost(1.1)
    cost["unusable_clocks"] = {"thread_time": "round 0, step 0 of mha: 0.0 s"}
    for e in cost["variants"].values():
        e.update(s_per_step=None, time_ratio_vs_mha=None)
    claim3 = _claim3(cost)
    assert claim3["verdict"] == "inconclusive" and claim3["rows"] == []
    assert claim3["reason"].startswith("no time ratio: crosshead (thread CPU time: round 0, step 0 of mha: 0.0 s);")
    assert an.no_time_ratio(_cost(1.1)) is None
    cost["unusable_clocks"] = {"perf_counter": "round 1, step 0 of mha: nan s"}  # the other clock only
    assert an.no_time_ratio(cost) is None


def test_recorded_clock_reads_the_cost_files_clock():
    """``recorded_clock`` reads a cost file's clock (old files: the wall clock); it was one of two
    ``timing_clock`` functions, the other (``_cost.choose_clock``) chooses the clock for a device."""
    from damcha_experiments import _cost as cost_module

    assert an.recorded_clock(_cost(1.1)) == "thread_time"
    assert an.recorded_clock(_cost(1.1, clock="perf_counter")) == "perf_counter"
    old = _cost(1.1)
    del old["clock"]
    assert an.recorded_clock(old) == "perf_counter"
    assert not hasattr(an, "timing_clock") and not hasattr(cost_module, "timing_clock")


def test_report_cost_section_states_the_interval_and_clock(tmp_path):
    res = _results("crosshead", {"mha": _base(0.6), "damcha-heads-tied": _base(0.6)})
    write_json(res, tmp_path / "crosshead.json")
    cost = _cost(1.2, noise=0.05, load=3.0)
    write_json(cost, tmp_path / "crosshead_cost.json")
    text, summary = build_report(tmp_path)
    ratio = an.time_ratio(cost, "damcha-heads-tied")
    assert "41 interleaved rounds x 5 steps, the variants alternating step by step" in text
    assert "clock: thread CPU time" in text and "95% bootstrap interval over rounds (seed 0)" in text
    assert "MHA's slowest / fastest round 1.60x (diagnostic)" in text
    assert "caveat: load average 3.00 on 2 cores" in text
    assert "| 95% CI |" in text and f"| [{ratio['ci'][0]:.2f}, {ratio['ci'][1]:.2f}] |" in text
    assert summary["verdicts"][2]["rows"][0]["time_ci"] == ratio["ci"]


@pytest.mark.parametrize(
    "shared, verdict",
    [(_other(0.70), "supported"), ([0.60] * 5, "not supported"), ([0.7, 0.6, 0.75, 0.55, 0.8], "inconclusive")],
    ids=["non-inferior", "worse", "noisy"],
)
def test_claim4_sharing_rule(shared, verdict):
    res = _results(
        "crosshead", {"mha": _base(0.6), "damcha-heads-tied": _base(0.70), "damcha-heads-tied-shared": shared}
    )
    res["suite"] = "ablation"
    assert an.verdicts({}, {"crosshead": res}, {})[3]["verdict"] == verdict


def test_steps_to_threshold_censors_runs_that_never_reach_it():
    res = _results("crosshead", {"mha": [0.5] * 3, "damcha-heads-query": [0.9] * 3})
    res["config"]["thresholds"] = [0.9]
    for r, s in zip(res["variants"]["mha"]["runs"], [None, 800, None]):
        r["steps_to_threshold"] = {"0.9": s}
    for r, s in zip(res["variants"]["damcha-heads-query"]["runs"], [300, 400, 500]):
        r["steps_to_threshold"] = {"0.9": s}
    rows = {r["variant"]: r for r in an.threshold_summary(res)}
    assert rows["mha"]["reached"] == 1 and rows["damcha-heads-query"]["median_steps"] == 400
    # Censored at max_steps = 1000: gains (fewer steps) 700, 400, 500.
    assert rows["damcha-heads-query"]["vs_mha"]["mean"] == pytest.approx(1600 / 3)


def _stuck_results() -> dict:
    """tied: its chosen rate 2e-3 learns; one 4e-3 sweep run sticks at chance. mha: one chosen-rate seed sticks."""
    res = _results("crosshead", {"mha": [0.9] * 3, "damcha-heads-tied": [0.9] * 3})
    res["config"]["thresholds"] = [0.5, 0.95]
    for name, chosen_hits in (("mha", [400, None, 500]), ("damcha-heads-tied", [300, 300, 300])):
        v = res["variants"][name]
        v["chosen_lr"] = 2e-3
        for r, hit in zip(v["runs"], chosen_hits):
            r["steps_to_threshold"] = {"0.5": hit, "0.95": None}
        # Seed 0 is the sweep seed: its chosen-rate run is both in the sweep and in runs.
        v["lr_sweep"] = {
            "lrs": [2e-3, 4e-3],
            "chosen_lr": 2e-3,
            "runs": [
                {"lr": 2e-3, "seed": 0, "steps_to_threshold": {"0.5": chosen_hits[0], "0.95": None}},
                {"lr": 4e-3, "seed": 0, "steps_to_threshold": {"0.5": None if name != "mha" else 200, "0.95": None}},
            ],
        }
    return res


def test_stability_counts_runs_that_never_reach_the_first_threshold():
    res = _stuck_results()
    rows = {r["variant"]: r for r in an.stability(res)}
    # mha: seed 1 (chosen rate, not a sweep seed) stuck: counted once in each column.
    assert (rows["mha"]["not_learned"], rows["mha"]["sweep_not_learned"]) == (1, 1)
    # tied: only the 4e-3 sweep run is stuck; no divergence shows it.
    assert (rows["damcha-heads-tied"]["not_learned"], rows["damcha-heads-tied"]["sweep_not_learned"]) == (0, 1)
    assert rows["damcha-heads-tied"]["divergences"] == 0
    from damcha_experiments._report import stability_table

    text = stability_table(res)
    assert "| damcha-heads-tied | 3 | 0 / 0 | 0 / 1 |" in text
    assert "never reached 0.5" in text
    # A task without thresholds has no level to fail: "-" and no footnote.
    plain = _results("crosshead", {"mha": [0.9] * 2})
    assert an.stability(plain)[0]["not_learned"] is None
    assert "| mha | 2 | 0 / 0 | - |" in stability_table(plain)
    assert "never reached" not in stability_table(plain)


def test_claim4_sharing_is_not_stable_when_more_shared_runs_fail_to_learn():
    res = _results(
        "crosshead", {"mha": _base(0.6), "damcha-heads-tied": _base(0.70), "damcha-heads-tied-shared": _other(0.70)}
    )
    res["suite"] = "ablation"
    res["config"]["thresholds"] = [0.5]
    assert an.verdicts({}, {"crosshead": res}, {})[3]["verdict"] == "supported"
    res["variants"]["damcha-heads-tied-shared"]["runs"][3]["steps_to_threshold"] = {"0.5": None}
    claim4 = an.verdicts({}, {"crosshead": res}, {})[3]
    assert claim4["verdict"] == "inconclusive" and "stability_ok=False" in claim4["reason"]


def _sweep(steps_by_lr: dict[float, list[int | None]], chosen: float) -> dict:
    runs = [
        {"lr": lr, "seed": seed, "steps_to_threshold": {"0.95": s}}
        for lr, ss in steps_by_lr.items()
        for seed, s in enumerate(ss)
    ]
    return {"lrs": list(steps_by_lr), "runs": runs, "chosen_lr": chosen}


def test_sweep_thresholds_compare_every_rate_not_only_the_chosen_one():
    res = _results("crosshead", {"mha": [1.0] * 2, "damcha-heads-tied": [1.0] * 2})
    res["config"]["thresholds"] = [0.5, 0.95]
    res["variants"]["mha"]["chosen_lr"] = 2e-3
    res["variants"]["mha"]["lr_sweep"] = _sweep({1e-3: [2000, 2500], 2e-3: [1250, 1500], 4e-3: [1000, 1000]}, 2e-3)
    res["variants"]["damcha-heads-tied"]["chosen_lr"] = 1e-3
    res["variants"]["damcha-heads-tied"]["lr_sweep"] = _sweep({1e-3: [900, 1100], 2e-3: [700, None]}, 1e-3)
    rows = {r["variant"]: r for r in an.sweep_thresholds(res)}
    assert rows["mha"]["threshold"] == 0.95
    assert rows["mha"]["median_steps_by_lr"] == {1e-3: 2250.0, 2e-3: 1375.0, 4e-3: 1000.0}
    assert rows["mha"]["fastest"] == 1000.0
    # A rate where one sweep seed never reached the threshold has no median.
    assert rows["damcha-heads-tied"]["median_steps_by_lr"] == {1e-3: 1000.0, 2e-3: None}
    assert rows["damcha-heads-tied"]["fastest"] == 1000.0
    text = sweep_threshold_table(res)
    assert "| mha | 2250 | **1375** | 1000 | 1000 |" in text
    # "never": a sweep seed did not reach it; "-": the rate is not in this variant's sweep.
    assert "| damcha-heads-tied | **1000** | never | - | 1000 |" in text


def test_sweep_thresholds_skip_results_written_before_the_field():
    res = _results("crosshead", {"mha": [1.0]})
    res["config"]["thresholds"] = [0.9]
    res["variants"]["mha"]["lr_sweep"] = {"lrs": [1e-3], "runs": [{"lr": 1e-3, "seed": 0}], "chosen_lr": 1e-3}
    assert an.sweep_thresholds(res) == []


def test_report_of_a_folder(tmp_path):
    res = _results("crosshead", {"mha": _base(0.60), "talking-heads": _base(0.62), "damcha-heads-query": _other(0.8)})
    write_json(res, tmp_path / "crosshead.json")
    write_json([1, 2], tmp_path / "notes.json")  # other JSON files are ignored
    text, summary = build_report(tmp_path)
    assert summary["verdicts"][0]["verdict"] == "supported"
    assert "| damcha-heads-query | mha | converged |" in text and "better" in text


def test_report_names_the_json_files_it_skips(tmp_path, capsys):
    from damcha_experiments._cli import main

    res = _results("crosshead", {"mha": _base(0.60), "talking-heads": _base(0.62), "damcha-heads-query": _other(0.8)})
    write_json(res, tmp_path / "crosshead.json")
    # Not named as results files (a damaged one of those exits 2: test_report_refuses_a_damaged_results_file).
    (tmp_path / "notes.json").write_text("garbage")
    (tmp_path / "latin1.json").write_bytes(b"\xff\xfe")
    (tmp_path / "list.json").write_text("[1, 2]")  # valid JSON of another kind: ignored, not named
    assert main(["report", str(tmp_path), "--no-plots"]) == 0
    err = capsys.readouterr().err
    assert f"skipped {tmp_path / 'notes.json'}: it is not valid JSON" in err
    assert f"skipped {tmp_path / 'latin1.json'}: it cannot be read (UnicodeDecodeError" in err
    assert "list.json" not in err
    assert (tmp_path / "report.md").exists()


def test_claim1_baselines_at_the_ceiling_leave_it_open():
    """A baseline within the margin of 1.0 cannot be beaten by the margin: 'ceiling', not 'no gain'."""
    top = [0.999, 0.9985, 0.9995, 0.999, 0.9988]
    res = _results("crosshead", {"mha": top, "talking-heads": top, "damcha-heads-query": list(reversed(top))})
    one = dict(res, task="crosshead1")
    v = {x["claim"]: x for x in an.verdicts({"crosshead": res, "crosshead1": one}, {}, {})}
    assert v[1]["verdict"] == "inconclusive"
    assert "(ceiling: mha, talking-heads within the margin of 1.0)" in v[1]["reason"]
    # The same gains far from the ceiling are evidence against the claim.
    low = {k: [x - 0.3 for x in vals] for k, vals in (("mha", top), ("talking-heads", top))}
    res = _results("crosshead", low | {"damcha-heads-query": [x - 0.3 for x in reversed(top)]})
    v = {x["claim"]: x for x in an.verdicts({"crosshead": res, "crosshead1": dict(res, task="crosshead1")}, {}, {})}
    assert v[1]["verdict"] == "not supported"
    # Bits per character has no known floor: never at the ceiling.
    lm = _results("charlm", {"mha": _base(0.01)}, higher=False)
    assert an.headroom(lm, "mha") == math.inf


def test_equal_time_reads_the_interleaved_ratio_not_each_variants_median():
    """Rounds that drift move each median; the per-round ratio stays (the drifting crosshead cost file:
    tied's median 0.995x MHA's, its ratio 1.25x)."""
    cost = _cost(1.5, noise=0.0)
    cost["variants"]["damcha-heads-tied"]["s_per_step"] = 0.01  # its own median: as fast as MHA
    assert an._s_per_step(cost, "damcha-heads-tied") == pytest.approx(0.015)
    assert an._s_per_step(cost, "mha") == pytest.approx(0.01)
    res = _results("crosshead", {"mha": [0.6], "damcha-heads-tied": [0.6]})
    for name in ("mha", "damcha-heads-tied"):
        res["variants"][name]["runs"][0]["curve"]["step"] = [1000]
    assert an.budgets(res, ["mha", "damcha-heads-tied"], cost)["time_s"] == pytest.approx(10.0)


def _spiky(ref_spikes, shared_spikes, steps=(4000,) * 5):
    res = _results(
        "crosshead", {"mha": _base(0.6), "damcha-heads-tied": _base(0.70), "damcha-heads-tied-shared": _other(0.70)}
    )
    res["suite"] = "ablation"
    for name, spikes in (("damcha-heads-tied", ref_spikes), ("damcha-heads-tied-shared", shared_spikes)):
        for run, k, n in zip(res["variants"][name]["runs"], spikes, steps):
            run["loss_spikes"], run["steps"] = k, n
        res["variants"][name]["loss_spikes"] = sum(spikes)
    return res


@pytest.mark.parametrize(
    "ref, shared, verdict",
    [
        # 42 vs 40 raw spikes (the two-layer tied pair): per-seed rates straddle 0.
        ([5, 4, 16, 4, 11], [12, 12, 12, 1, 5], "supported"),
        ([1, 2, 1, 2, 1], [9, 11, 10, 12, 9], "inconclusive"),
    ],
    ids=["noisy-spikes", "more-spikes"],
)
def test_claim4_compares_spike_rates_not_raw_counts(ref, shared, verdict):
    claim4 = an.verdicts({}, {"crosshead": _spiky(ref, shared)}, {})[3]
    assert claim4["verdict"] == verdict


def test_fresh_seeds_drop_every_seed_that_chose_a_rate_and_edges_are_flagged():
    res = _results("crosshead", {"mha": _base(0.6), "damcha-heads-tied": _other(0.7)})
    res["variants"]["mha"]["lr_sweep"] = {"lrs": [1e-3, 2e-3, 4e-3], "seeds": [0], "chosen_lr": 4e-3, "runs": []}
    res["variants"]["mha"]["chosen_lr"] = 4e-3
    res["variants"]["damcha-heads-tied"]["lr_sweep"] = {"lrs": [1e-3, 2e-3, 4e-3], "seeds": [0, 1], "runs": []}
    res["variants"]["damcha-heads-tied"]["chosen_lr"] = 2e-3
    fresh = an.fresh_seeds(res)
    # Seeds 0 and 1 chose some variant's rate: both leave every variant (the pairs stay paired).
    assert [r["seed"] for r in fresh["variants"]["mha"]["runs"]] == [2, 3, 4]
    assert [r["seed"] for r in fresh["variants"]["damcha-heads-tied"]["runs"]] == [2, 3, 4]
    assert an.at_grid_edge(res, "mha") == "highest" and an.at_grid_edge(res, "damcha-heads-tied") is None
    from damcha_experiments._report import markdown_table

    assert "| mha | 1,000 | 0.004 (highest of the grid) |" in markdown_table(res)
    for r in res["variants"].values():
        r["lr_sweep"]["seeds"] = [0, 1, 2, 3, 4]
    assert an.fresh_seeds(res) is None


def test_claim4_at_the_ceiling_is_not_supported_by_non_inferiority():
    top = [0.999, 0.9985, 0.9995, 0.999, 0.9988]
    res = _results("crosshead", {"mha": top, "damcha-heads-tied": top, "damcha-heads-tied-shared": top[::-1]})
    res["suite"] = "ablation"
    claim4 = an.verdicts({}, {"crosshead": res}, {})[3]
    assert claim4["verdict"] == "inconclusive" and "ceiling (damcha-heads-tied within the margin" in claim4["reason"]


def _sharing(task, ref, shared):
    res = _results(task, {"mha": _base(0.6), "damcha-heads-tied": ref, "damcha-heads-tied-shared": shared})
    res["suite"] = "ablation"
    return res


def test_claim4_a_ceiling_task_neither_supports_nor_vetoes_another_task():
    """Until the nineteenth session a saturated ablation (crosshead's) kept claim 4 from ever being supported,
    whatever a task with headroom showed; now it is left out of 'supported' but can still count against."""
    top = [0.999, 0.9985, 0.9995, 0.999, 0.9988]
    ceiling = _sharing("crosshead", top, top[::-1])
    digits = _sharing("digits", _base(0.70), _other(0.70))
    claim4 = an.verdicts({}, {"crosshead": ceiling, "digits": digits}, {})[3]
    assert claim4["verdict"] == "supported"
    assert claim4["reason"] == (
        "every shared variant non-inferior and no less stable on digits (at the ceiling, not counted: crosshead)"
    )
    # The task with headroom still decides: a shared variant not shown non-inferior there leaves it open.
    loose = _sharing("digits", _base(0.70), [x + d for x, d in zip(_base(0.70), (0.03, -0.05, 0.02, -0.04, 0.0))])
    claim4 = an.verdicts({}, {"crosshead": ceiling, "digits": loose}, {})[3]
    assert claim4["verdict"] == "inconclusive" and "non-inferior=False" in claim4["reason"]
    # A ceiling comparison can still count against the claim: a shared variant worse there.
    worse = _sharing("crosshead", top, [x - d for x, d in zip(top, (0.0005, 0.0007, 0.0006, 0.0008, 0.0004))])
    claim4 = an.verdicts({}, {"crosshead": worse, "digits": digits}, {})[3]
    assert claim4["verdict"] == "not supported" and "damcha-heads-tied-shared on crosshead: worse" in claim4["reason"]


_ENV = {"python": "3.11.9", "torch": "2.5.1", "numpy": "2.1.0", "cpu_capability": "AVX512", "torch_threads": 1}


def test_report_lists_runs_whose_environment_changed(tmp_path):
    """A run resumed on another machine or other versions records each environment it ran in;
    the report did not show them (a resumed run equals an uninterrupted one only within one)."""
    res = _results("crosshead", {"mha": _base(0.60), "talking-heads": _base(0.62), "damcha-heads-query": _other(0.8)})
    for name, entry in res["variants"].items():
        for run in entry["runs"]:
            run.update(variant=name, lr=1e-3, environments=[{"first_step": 1, "environment": _ENV}])
    write_json(res, tmp_path / "crosshead.json")
    text, summary = build_report(tmp_path)
    assert "## Runs whose environment changed\n\nA run resumed" in text
    assert text.split("## Runs whose environment changed", 1)[1].split("##", 1)[0].strip().endswith("None.")
    assert summary["environment_changes"] == [] and summary["runs_without_environment"] == 0

    # One run of the results file resumed with another torch and thread count, and a sweep run at
    # another rate (only in runs/) resumed from a checkpoint that recorded none.
    moved = dict(_ENV, torch="2.6.0", torch_threads=2)
    res["variants"]["damcha-heads-query"]["runs"][3]["environments"].append({"first_step": 1201, "environment": moved})
    write_json(res, tmp_path / "crosshead.json")
    from damcha_experiments._train import RESULT_FIELDS

    blank = dict.fromkeys(RESULT_FIELDS)  # a whole result.json (one lacking a field is damaged)
    sweep_run = blank | {
        "identity": {"config": {"task": "crosshead", "preset": "full"}},
        "variant": "mha",
        "lr": 4e-3,
        "seed": 1,
        "environments": [{"first_step": 1, "environment": None}, {"first_step": 501, "environment": _ENV}],
    }
    old_run = blank | {"identity": sweep_run["identity"], "variant": "mha", "lr": 2e-3, "seed": 0}
    for run, where in ((sweep_run, "mha/lr0.004/seed1"), (old_run, "mha/lr0.002/seed0")):
        (tmp_path / "runs" / "crosshead-full-cpu" / where).mkdir(parents=True)
        write_json(run, tmp_path / "runs" / "crosshead-full-cpu" / where / "result.json")
    text, summary = build_report(tmp_path)
    assert [(r["variant"], r["lr"], r["seed"]) for r in summary["environment_changes"]] == [
        ("damcha-heads-query", 1e-3, 3),
        ("mha", 4e-3, 1),
    ]
    assert summary["runs_without_environment"] == 1  # the older result.json
    assert (
        "| crosshead (full) | damcha-heads-query | 0.001 | 3 | at step 1201: torch '2.5.1' -> '2.6.0', "
        "torch_threads 1 -> 2 |" in text
    )
    assert (
        "| crosshead (full) | mha | 0.004 | 1 | at step 501: the checkpoint records no environment (written before "
        "runs recorded theirs) |" in text
    )
    assert "Runs that record no environment (written before runs recorded theirs; unknown): 1." in text


def _drop_seed(res, name, seed):
    res["variants"][name]["runs"] = [r for r in res["variants"][name]["runs"] if r["seed"] != seed]


def test_comparisons_pair_runs_by_seed_not_by_position():
    # Seed s shares its data order across variants; a variant missing seed 1 (a run still training,
    # a smaller --seeds) must be compared on seeds 0, 2, 3, 4, not shifted onto the baseline's 0-3.
    mha = [0.50, 0.90, 0.55, 0.60, 0.65]
    tied = [0.52, 0.92, 0.57, 0.63, 0.66]  # +0.02, +0.02, +0.02, +0.03, +0.01 on the same seeds
    res = _results("crosshead", {"mha": mha, "damcha-heads-tied": tied})
    _drop_seed(res, "damcha-heads-tied", 1)
    row = an.compare(res, ["damcha-heads-tied"], "mha")[0]
    assert row["n"] == 4
    assert row["mean"] == pytest.approx((0.02 + 0.02 + 0.03 + 0.01) / 4)  # by position it would be -0.1
    for r, steps in zip(res["variants"]["mha"]["runs"], [500, 900, 600, 700, 800]):
        r["steps_to_threshold"] = {"0.9": steps}
    for r, steps in zip(res["variants"]["damcha-heads-tied"]["runs"], [400, 500, 600, 700]):  # seeds 0, 2, 3, 4
        r["steps_to_threshold"] = {"0.9": steps}
    res["config"]["thresholds"] = [0.9]
    rows = {r["variant"]: r for r in an.threshold_summary(res)}
    assert rows["damcha-heads-tied"]["vs_mha"]["mean"] == pytest.approx((100 + 100 + 100 + 100) / 4)
    for r, spikes in zip(res["variants"]["mha"]["runs"], [0, 50, 1, 2, 3]):
        r["loss_spikes"] = spikes
    spikes = an.spike_rate_difference(res, "damcha-heads-tied", "mha")  # tied has none
    assert spikes["n"] == 4 and spikes["mean"] == pytest.approx(-1000 * (0 + 1 + 2 + 3) / 4 / 100)


@pytest.mark.parametrize("capped", [{}, {"mha": [3]}, {"mha": [0, 1, 2, 3, 4], "damcha-heads-tied": [0, 1, 2, 3, 4]}])
def test_verdicts_name_final_runs_stopped_at_the_step_cap(capped):
    # A run stopped at max_steps enters the converged budget with its value at the cap: the
    # verdict must say so, or "trained until the plateau" overstates what was compared.
    res = _results("listops", {"mha": _base(0.8), "damcha-heads-tied": _other(0.81)})
    for name, seeds in capped.items():
        for r in res["variants"][name]["runs"]:
            if r["seed"] in seeds:
                r["stop_reason"] = "max_steps"
    claim2 = an.verdicts({"listops": res}, {}, {})[1]
    assert claim2["claim"] == 2 and claim2["tasks"][0]["capped"] == capped
    if not capped:
        assert "cap" not in claim2["reason"]
    elif len(capped) == 1:
        assert "listops: final runs stopped at the 1,000-step cap, not converged: mha 1 of 5" in claim2["reason"]
    else:
        assert "listops: every final run stopped at the 1,000-step cap: an equal-steps comparison" in claim2["reason"]


def test_a_merged_cost_file_pairs_each_ratio_with_its_own_mha_rounds_and_load(tmp_path):
    """Two cost measurements of separate --variants subsets merged into one file (_cli._merge_cost):
    the second ran in a phase twice as slow, on a quiet machine; the first on a busy one. Each
    variant's ratio is the one of its own measurement (paired with its own MHA rounds, not the
    file's MHA entry, which is the second's), and the first's load still makes claim 3's caveat."""
    from damcha_experiments._cli import _merge_cost

    first = _cost(1.1, load=3.0)
    second = _cost(1.3, load=0.1)
    for entry in second["variants"].values():
        entry["round_s_per_step"] = [2 * x for x in entry["round_s_per_step"]]
    second["variants"]["damcha-heads-query"] = second["variants"].pop("damcha-heads-tied")
    write_json(first, tmp_path / "crosshead_cost.json")
    merged = _merge_cost(tmp_path / "crosshead_cost.json", second, "headline")
    assert list(merged["variants"]) == ["mha", "damcha-heads-tied", "damcha-heads-query"]
    assert merged["variants"]["damcha-heads-tied"]["environment"] == first["environment"]
    assert an.time_ratio(merged, "damcha-heads-tied") == an.time_ratio(first, "damcha-heads-tied")
    assert an.time_ratio(merged, "damcha-heads-query") == an.time_ratio(second, "damcha-heads-query")
    res = _results("crosshead", {n: _base(0.6) for n in ("mha", "damcha-heads-tied", "damcha-heads-query")})
    claim3 = an.verdicts({"crosshead": res}, {}, {"crosshead": merged})[2]
    assert {r["variant"]: r["status"] for r in claim3["rows"]} == {
        "damcha-heads-tied": "within",
        "damcha-heads-query": "over",
    }
    assert "caveat" in claim3["reason"] and "load average 3.00 on 2 cores" in claim3["reason"]


def test_claim2_secondary_analysis_reads_bonferroni_corrected_intervals():
    """The rule's 95% intervals over 6 task x baseline cases can call 'no gain' where 99.17% ones do not
    (charlm in the eighteenth session); the report says so beside the verdict without changing it."""
    good = {"mha": _base(0.6), "talking-heads": _base(0.6), "damcha-heads-tied": _other(0.7)}
    gains = [0.015, -0.015, 0.01, -0.01, 0.0]  # 95% upper end +0.016 < 0.02; 99.17% upper end above it
    lm = _results(
        "charlm",
        {
            "mha": _base(2.0),
            "talking-heads": _base(2.0),
            "damcha-heads-tied": [2.0 + n - g for n, g in zip(NOISE, gains)],
        },
        higher=False,
    )
    tasks = {"charlm": lm, "listops": _results("listops", good), "digits": _results("digits", good)}
    claim2 = an.verdicts(tasks, {}, {})[1]
    assert claim2["verdict"] == "not supported"
    second = claim2["secondary"]
    assert second["cases"] == 6 and second["confidence"] == pytest.approx(1 - 0.05 / 6)
    assert second["verdict"] == "inconclusive"
    assert "where the rule says not supported" in second["text"]
    # The same data far from the margin: both readings agree.
    clear = {k: v for k, v in tasks.items() if k != "charlm"} | {
        "charlm": _results(
            "charlm", {"mha": _base(2.0), "talking-heads": _base(2.0), "damcha-heads-tied": _other(2.05)}, higher=False
        )
    }
    claim2 = an.verdicts(clear, {}, {})[1]
    assert claim2["verdict"] == claim2["secondary"]["verdict"] == "not supported"
    assert claim2["secondary"]["text"].endswith(": the same")


def _failing(task, failed: dict[str, list[int]], n=15):
    res = _results(task, {name: _base(0.99)[:1] * n for name in ("mha", "talking-heads", "damcha-heads-query")})
    res["config"]["thresholds"] = [0.5, 0.95]
    for name, entry in res["variants"].items():
        for run in entry["runs"]:
            stuck = run["seed"] in failed.get(name, [])
            run["steps_to_threshold"] = {"0.5": None if stuck else 500, "0.95": None if stuck else 1000}
    return res


def test_claim1_secondary_analysis_tests_the_failure_rate_by_seed():
    # MHA fails on 3 of 15 seeds (crosshead1 in the eighteenth session): 3 discordant seeds give p = 0.25.
    res = _failing("crosshead1", {"mha": [2, 7, 11], "damcha-heads-query": [4]})
    rows = an.failure_comparison(res, ["damcha-heads-query"], "mha")
    assert rows == [
        {
            "variant": "damcha-heads-query",
            "baseline": "mha",
            "n": 15,
            "variant_failed": 1,
            "baseline_failed": 3,
            "only_baseline_failed": 3,
            "only_variant_failed": 1,
            "p": pytest.approx(0.625),  # 2 x P(X <= 1), X ~ Bin(4, 1/2)
            "p_holm": pytest.approx(0.625),
        }
    ]
    claim1 = an.verdicts({"crosshead1": res}, {}, {})[0]
    assert (
        "crosshead1 vs mha: mha failed on 3 of 15 seeds, the DAMCHA variants on 1 each" in claim1["secondary"]["text"]
    )
    assert claim1["secondary"]["better"] == []
    # Fewer failures than *every* baseline, beyond noise: the failure-rate reading would differ from the rule's.
    res = _failing("crosshead1", {"mha": list(range(7)), "talking-heads": list(range(8, 15))})
    second = an.verdicts({"crosshead1": res}, {}, {})[0]["secondary"]
    assert second["better"] == ["damcha-heads-query on crosshead1"]
    assert "crosshead1 vs mha: mha failed on 7 of 15 seeds, the DAMCHA variants on none" in second["text"]
    # Only one baseline failing: not enough (the rule asks for better than both).
    res = _failing("crosshead1", {"mha": list(range(7))})
    assert an.verdicts({"crosshead1": res}, {}, {})[0]["secondary"]["better"] == []
    # A task without thresholds has no failure to count.
    assert (
        an.failure_comparison(
            _results("crosshead1", {"mha": [0.9], "damcha-heads-query": [0.9]}), ["damcha-heads-query"], "mha"
        )
        == []
    )


def test_claim4_secondary_analysis_says_up_to_which_confidence_non_inferiority_holds():
    from scipy import stats

    ref = _base(0.70)
    shared = [x + d for x, d in zip(ref, (-0.004, 0.002, -0.009, 0.001, -0.005))]
    res = _sharing("digits", ref, shared)
    res["config"]["margin"] = 0.01
    claim4 = an.verdicts({}, {"digits": res}, {})[3]
    gain = claim4["checks"][0]["gain"]
    c = an.non_inferiority_confidence(gain)
    expected = 2 * stats.t.cdf((gain["mean"] + 0.01) / gain["se"], gain["n"] - 1) - 1
    assert c == pytest.approx(expected, rel=1e-9)
    # At that confidence the interval's lower end sits exactly on -margin; a little wider fails.
    row = an.compare(res, ["damcha-heads-tied-shared"], "damcha-heads-tied", confidence=c)[0]
    assert row["ci"][0] == pytest.approx(-0.01, abs=1e-9)
    assert 0.95 < c < 0.99 and claim4["verdict"] == "supported"
    assert f"damcha-heads-tied-shared on digits (5 seeds): up to {c:.1%}" in claim4["secondary"]["text"]
    # Ceiling comparisons are left out of it, as out of the verdict.
    top = [0.999, 0.9985, 0.9995, 0.999, 0.9988]
    only_ceiling = an.verdicts({}, {"crosshead": _sharing("crosshead", top, top[::-1])}, {})[3]
    assert only_ceiling["secondary"] is None


def test_a_run_result_lacking_a_field_is_listed_as_damaged(tmp_path):
    """A runs/**/result.json that is valid JSON but lacks a field the trainer writes (its
    command treats it as unfinished and retrains the run) was used by the report as if whole
    (a missing "variant" counted as a run of variant None; an "identity" of null crashed it).
    It is now listed with the damaged run results, naming the missing fields, like a file cut
    off mid-write; a whole result beside it is still read."""
    from damcha_experiments._train import RESULT_FIELDS

    res = _results("crosshead", {"mha": _base(0.60), "talking-heads": _base(0.62)})
    write_json(res, tmp_path / "crosshead.json")
    identity = {"config": {"task": "crosshead", "preset": "full"}}
    whole = dict.fromkeys(RESULT_FIELDS) | {"identity": identity, "variant": "mha", "lr": 4e-3, "seed": 1}
    whole["environments"] = [{"first_step": 1, "environment": None}, {"first_step": 501, "environment": _ENV}]
    runs = tmp_path / "runs" / "crosshead-full-cpu"
    files = {
        "mha/lr0.004/seed1": whole,
        "mha/lr0.004/seed2": {k: v for k, v in whole.items() if k != "test_metric"},
        "mha/lr0.004/seed3": {k: v for k, v in whole.items() if k not in ("variant", "curve")},
        "mha/lr0.004/seed4": whole | {"identity": None, "seed": 4},
    }
    for where, run in files.items():
        (runs / where).mkdir(parents=True)
        write_json(run, runs / where / "result.json")
    text, summary = build_report(tmp_path)
    damaged = {str(Path(p).relative_to(runs)): why for p, why in summary["damaged_run_results"]}
    assert damaged == {
        "mha/lr0.004/seed2/result.json": "lacks test_metric",
        "mha/lr0.004/seed3/result.json": "lacks variant, curve",
        "mha/lr0.004/seed4/result.json": "holds an identity that is not a JSON object (None)",
    }
    # The whole result is read: its environment change is listed.
    assert [(r["variant"], r["lr"], r["seed"]) for r in summary["environment_changes"]] == [("mha", 4e-3, 1)]
    listing = text.split("Run results that could not be read", 1)[1].split("\n", 1)[0]
    assert "`runs/crosshead-full-cpu/mha/lr0.004/seed2/result.json` (lacks test_metric)" in listing


def test_claim2_reads_listops3x3_in_listops_place_once_its_protocol_has_finished():
    """Declared in the twenty-sixth session: the converged depth-3 task replaces depth-2 listops in
    claim 2's rule when every headline variant has all its final seeds, and not before."""
    from damcha_experiments._variants import HEADLINE

    good = {n: _base(0.6) for n in ("mha", "talking-heads")} | {
        n: _other(0.7) for n in HEADLINE if n.startswith("damcha")
    }
    flat = {n: _base(0.6) for n in ("mha", "talking-heads")} | {
        n: _other(0.6) for n in HEADLINE if n.startswith("damcha")
    }
    lm = _results("charlm", {n: [2.0 - (v - 0.6) for v in good[n]] for n in HEADLINE}, higher=False)
    tasks = {"charlm": lm, "listops": _results("listops", flat), "digits": _results("digits", good)}
    v = an.verdicts(tasks, {}, {})[1]
    assert [g["task"] for g in v["tasks"]] == ["charlm", "listops", "digits"]
    assert v["verdict"] == "not supported" and "no gain on listops" in v["reason"]
    deeper = _results("listops3x3", good)
    assert an.verdicts(tasks | {"listops3x3": deeper}, {}, {})[1]["verdict"] == "supported"
    assert [g["task"] for g in an.verdicts(tasks | {"listops3x3": deeper}, {}, {})[1]["tasks"]] == [
        "charlm",
        "listops3x3",
        "digits",
    ]
    # One variant short of its seeds, or one missing: depth-2 listops is still the one read.
    short = _results("listops3x3", good | {"damcha-lowrank-tied": _other(0.7)[:4]})
    missing = _results("listops3x3", {n: good[n] for n in HEADLINE if n != "talking-heads"})
    # Every variant with all the seeds its file asks for, but not the declared protocol: a smoke
    # run, or a full run cut to --seeds 2 (each took listops' place).
    smoke = dict(_results("listops3x3", {n: values[:1] for n, values in good.items()}), preset="smoke", seeds=1)
    cut = dict(_results("listops3x3", {n: values[:2] for n, values in good.items()}), seeds=2)
    for partial in (short, missing, smoke, cut):
        v = an.verdicts(tasks | {"listops3x3": partial}, {}, {})[1]
        assert [g["task"] for g in v["tasks"]] == ["charlm", "listops", "digits"] and v["verdict"] == "not supported"


def test_verdicts_say_when_tasks_of_different_presets_are_combined():
    """Claim 2 combined a smoke file with full ones without a word (the verdict read as the protocol's)."""
    from damcha_experiments._variants import HEADLINE

    good = {n: _base(0.6) for n in ("mha", "talking-heads")} | {
        n: _other(0.7) for n in HEADLINE if n.startswith("damcha")
    }
    lm = _results("charlm", {n: [2.0 - (v - 0.6) for v in good[n]] for n in HEADLINE}, higher=False)
    tasks = {"charlm": lm, "listops": _results("listops", good), "digits": _results("digits", good)}
    assert "preset" not in an.verdicts(tasks, {}, {})[1]["reason"]
    smoke = tasks | {"digits": dict(tasks["digits"], preset="smoke")}
    assert "preset digits 'smoke' is for trying the code, not a protocol" in an.verdicts(smoke, {}, {})[1]["reason"]
    mixed = tasks | {"digits": dict(tasks["digits"], preset="large")}
    reason = an.verdicts(mixed, {}, {})[1]["reason"]
    assert "presets differ: charlm 'full', listops 'full', digits 'large'" in reason, reason


def _exact_sign_flip(gains):
    """Every sign pattern as a row of a matrix (itertools, not the library's doubling): the two-sided p."""
    import itertools

    g = np.asarray(gains, dtype=float)
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(g))))
    return float(np.mean(np.abs(signs @ g) >= abs(g.sum()) - 1e-12))


def _holm_by_hand(ps):
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def test_the_report_prints_the_sign_flip_test_beside_the_t_test_on_crosshead1(tmp_path):
    """crosshead1 as published: MHA fails on 3 of 15 seeds, so the DAMCHA gains over it are about +0.6 on
    3 seeds and near 0 elsewhere. The paired t test (the rule) reads Holm 0.19, within noise; the exact
    sign-flip test, recomputed here from every sign pattern, reads Holm <= 0.0015. The rule's decision and
    verdict stay; the report prints both and says where they disagree."""
    import json
    import shutil

    published = Path(__file__).resolve().parents[1] / "docs" / "results" / "full" / "crosshead1.json"
    res = json.loads(published.read_text())
    names = an.damcha_names(res)
    rows = an.compare(res, names, "mha")
    mha = {r["seed"]: r["test_metric"] for r in res["variants"]["mha"]["runs"]}
    expected = []
    for name in names:
        mine = {r["seed"]: r["test_metric"] for r in res["variants"][name]["runs"]}
        expected.append(_exact_sign_flip([mine[s] - mha[s] for s in sorted(mha)]))
    assert [r["sign_flip"]["p"] for r in rows] == pytest.approx(expected, rel=1e-12)
    assert [r["sign_flip"]["p_holm"] for r in rows] == pytest.approx(_holm_by_hand(expected), rel=1e-12)
    assert max(r["sign_flip"]["p_holm"] for r in rows) == pytest.approx(0.0015, abs=5e-5)
    assert all(r["decision"] == "within noise" and r["p_holm"] == pytest.approx(0.188, abs=1e-3) for r in rows)
    assert all(r["sign_flip"]["decision"] == "better" and r["sign_flip"]["method"] == "exact" for r in rows)
    claim1 = an.verdicts({"crosshead1": res}, {}, {})[0]
    assert claim1["verdict"] == "inconclusive"  # the rule reads the t test: unchanged
    text = claim1["sign_flip"]["text"]
    assert "crosshead1: damcha-heads-tied vs mha t Holm 0.19 (within noise), sign-flip Holm 0.0015 (better)" in text
    # Against talking-heads (at the ceiling) the t test's two 'better' do not survive the sign-flip test.
    assert "crosshead1: damcha-heads-separate vs talking-heads t Holm 0.042 (better), sign-flip Holm 0.063" in text
    assert claim1["sign_flip"]["verdict"] == "inconclusive" and text.endswith("would say inconclusive: the same")
    shutil.copy(published, tmp_path / "crosshead1.json")
    md, summary = build_report(tmp_path)
    # The first such row is the paired-comparisons table's (the selection-bias check's follows).
    row = next(line for line in md.splitlines() if line.startswith("| damcha-heads-tied | mha | converged |"))
    assert "| within noise | no | 0.00146 [0.00146] -> better |" in row
    assert "sign-flip p [Holm]" in md and "Claim 1, the exact sign-flip permutation test" in md
    assert summary["verdicts"][0]["sign_flip"]["verdict"] == "inconclusive"


def test_the_sign_flip_test_flags_t_test_only_labels_with_five_seeds():
    """With 5 seeds no sign pattern test can reach p < 0.05 (its floor is 2 / 32): a t-test 'better'
    there (charlm's) is labelled t-test-only, in the table and in claim 2's secondary analysis."""
    from damcha_experiments._report import sign_flip_cell

    lm = _results(
        "charlm",
        {"mha": _base(2.06), "talking-heads": _base(2.06), "damcha-heads-tied": _other(2.03)},
        higher=False,
    )
    (row,) = an.compare(lm, ["damcha-heads-tied"], "mha")
    assert row["decision"] == "better" and row["p_holm"] < 0.05
    assert row["sign_flip"]["p"] == row["sign_flip"]["floor"] == 0.0625 == _exact_sign_flip([0.03] * 5)
    assert sign_flip_cell(row) == "0.0625 [0.0625] (floor 0.0625) -> within noise"
    claim2 = [v for v in an.verdicts({"charlm": lm}, {}, {}) if v["claim"] == 2][0]
    assert (
        "charlm (5 seeds: no sign-flip p below 0.0625; t-test-only labels: damcha-heads-tied vs mha, "
        "damcha-heads-tied vs talking-heads)" in claim2["sign_flip"]["text"]
    )
