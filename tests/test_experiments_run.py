"""A tiny run of each experiment completes and writes its JSON and plots;
models are matched in size and DAMCHA starts exactly at MHA."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from damcha_core import DamchaValueError
from damcha_experiments import _cli, _train
from damcha_experiments._models import VARIANTS, attention_factory

TINY = ["--seeds", "2", "--steps", "2", "--eval-size", "8", "--no-progress"]


@pytest.mark.parametrize(
    "task, variants",
    [
        ("crosshead", "mha,damcha-heads-tied-shared,damcha-lowrank-tied"),
        ("charlm", "mha,damcha-heads-query"),
        ("listops", "talking-heads,damcha-heads-separate"),
    ],
    ids=["crosshead", "charlm", "listops"],
)
def test_tiny_run_writes_json_and_plots(task, variants, tmp_path, capsys):
    assert _cli.main([task, "--variants", variants, "--out", str(tmp_path), *TINY]) == 0
    names = variants.split(",")
    result = json.loads((tmp_path / f"{task}.json").read_text())
    assert result["task"] == task and list(result["variants"]) == names and result["seeds"] == 2
    for name in names:
        r = result["variants"][name]
        finals = [run["final_metric"] for run in r["runs"]]
        assert [run["seed"] for run in r["runs"]] == [0, 1]
        assert r["mean"] == pytest.approx(np.mean(finals)) and r["std"] == pytest.approx(np.std(finals, ddof=1))
        assert all(run["curve"]["step"][-1] == 2 and run["time_per_step_s"] > 0 for run in r["runs"])
        assert np.isfinite(finals).all()
        # DAMCHA layers produce a heatmap per layer, baselines none.
        maps = r["head_maps_seed0"]
        assert (maps is None) == (r["kind"] != "damcha")
        if maps is not None:
            assert np.array(maps).shape == (2, 4, 4)
    if "mha" in names:
        assert {c["variant"] for c in result["comparison_vs_mha"]} == set(names) - {"mha"}
    for suffix in ("curves", "final") + (("metric",) if any("damcha" in n for n in names) else ()):
        png = tmp_path / f"{task}_{suffix}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| variant | params |" in capsys.readouterr().out
    # Replotting from the JSON reproduces the table without training.
    again = tmp_path / "again"
    assert _cli.main([task, "--from-json", str(tmp_path / f"{task}.json"), "--out", str(again)]) == 0
    assert json.loads((again / f"{task}.json").read_text()) == result
    assert (again / f"{task}_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_models_are_matched_in_parameter_count():
    spec = _train.get_task("crosshead")
    data = _train._TaskData(spec, steps=1, eval_size=4)
    widths = _train.matched_widths(data, [VARIANTS[n] for n in _train.DEFAULT_VARIANTS])
    counts = [p for _, p in widths.values()]
    # Within one MLP hidden unit per layer of each other.
    assert max(counts) - min(counts) <= spec.num_layers * (2 * spec.embed_dim + 1)
    assert widths["damcha-heads-tied"][0] < widths["mha"][0]  # the baseline got the wider MLP


def test_shared_variant_shares_one_generator_across_layers():
    factory = attention_factory(VARIANTS["damcha-heads-tied-shared"], 16, 4, 2)
    a, b = factory(0).inner, factory(1).inner
    assert a.metric_generators["qk"] is b.metric_generators["qk"]
    assert a.metric_gates["qk"] is not b.metric_gates["qk"]
    own = attention_factory(VARIANTS["damcha-heads-tied"], 16, 4, 2)
    assert own(0).inner.metric_generators["qk"] is not own(1).inner.metric_generators["qk"]


@pytest.mark.parametrize("name", ["damcha-heads-tied", "damcha-lowrank-tied", "talking-heads"])
def test_fresh_variant_model_equals_mha_model(name):
    """Same weights: a fresh DAMCHA (gates 0) or identity talking-heads model is the MHA model."""
    spec = _train.get_task("listops")
    data = _train._TaskData(spec, steps=1, eval_size=8)
    torch.manual_seed(0)
    mha = _train.build_model(data, VARIANTS["mha"], 32)
    other = _train.build_model(data, VARIANTS[name], 32)
    state = mha.state_dict()
    missing, unexpected = other.load_state_dict(state, strict=False)
    assert not unexpected and all("metric" in k or "_mix" in k for k in missing)
    x = torch.from_numpy(data.eval_inputs)
    with torch.no_grad():
        torch.testing.assert_close(other(x), mha(x), rtol=1e-5, atol=1e-5)


def test_seed_noise_comparison_uses_two_standard_errors():
    summary = {"mha": {"mean": 0.5, "std": 0.02, "n": 3}, "a": {"mean": 0.56, "std": 0.02, "n": 3},
               "b": {"mean": 0.51, "std": 0.02, "n": 3}}
    rows = {r["variant"]: r for r in _train.seed_noise_comparison(summary, "mha", higher_is_better=True)}
    se = np.sqrt(2 * 0.02**2 / 3)
    assert rows["a"]["stderr"] == pytest.approx(se)
    assert rows["a"]["exceeds_noise"] is True and rows["a"]["direction"] == "better"  # 0.06 > 2 se
    assert rows["b"]["exceeds_noise"] is False  # 0.01 < 2 se
    single = _train.seed_noise_comparison({k: dict(v, n=1) for k, v in summary.items()}, "mha", True)
    assert all(r["exceeds_noise"] is None for r in single)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["crosshead", "--variants", "mha,nope"], "unknown variant(s) ['nope']"),
        (["crosshead", "--seeds", "0"], "--seeds must be >= 1, got 0"),
        (["listops", "--steps", "0"], "--steps must be >= 1, got 0"),
    ],
    ids=["variant", "seeds", "steps"],
)
def test_cli_rejects_bad_arguments(argv, message, capsys):
    assert _cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_damcha_command_dispatches_to_experiments(capsys):
    from damcha_core._cli import main as damcha_main

    assert damcha_main(["experiment", "listops", "--seeds", "0"]) == 2
    assert "--seeds must be >= 1" in capsys.readouterr().err


def test_unknown_task_is_named():
    with pytest.raises(DamchaValueError, match="unknown task 'nope'"):
        _train.get_task("nope")
