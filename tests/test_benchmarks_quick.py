"""The benchmark scripts keep running: each at its --tiny sizes (a check, not a measurement).

Nothing here times anything or asserts a ratio; speed is measured by `make bench`
on an idle machine. These tests fail when a script no longer runs, writes
malformed results, or (bench_dropin.py) when DAMCHA with closed gates stops
reproducing the framework's MHA in a benchmarked call pattern, which would make
its ratios compare different computations. The operation counters of
benchmarks/_counts.py, which the issue-12 tests use, are checked against known
answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import _counts  # noqa: E402
import _dropin_report  # noqa: E402
import _models_keras_report  # noqa: E402
import _models_report  # noqa: E402
import run_all  # noqa: E402


def _run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    # (XLA_FLAGS, conftest.py's cheaper codegen, is inherited: tiny JAX runs are compile time.)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# bench_dropin.py, bench_models.py and bench_models_keras.py get their own tests below; the others
# are the per-port scripts of benchmarks/_ports_report.py (tests/test_benchmarks_ports.py).
TABLE_SCRIPTS = [
    s for s in run_all.scripts() if s not in ("bench_dropin.py", "bench_models.py", "bench_models_keras.py")
]


def _listing(folder: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir()) if folder.is_dir() else []


@pytest.mark.parametrize("script", TABLE_SCRIPTS)
def test_script_runs_tiny(script: str, tmp_path: Path) -> None:
    """Each per-port script at its --tiny sizes writes its run's metadata and every round to
    --json's file, whose rounds give the ratios of the tables it prints (recomputed by
    test_benchmarks_ports.check_result_file), and touches neither the results folder nor the docs."""
    from test_benchmarks_ports import SCRIPTS, check_result_file

    assert set(TABLE_SCRIPTS) == set(SCRIPTS)  # a new table script gets a result file and its checks
    path = tmp_path / "results.json"
    docs, results = (ROOT / "docs" / "benchmarks.md").read_bytes(), _listing(BENCH / "results")
    out = _run([str(BENCH / script), "--tiny", "--json", str(path)])
    assert out.returncode == 0, f"{script} --tiny failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    assert f"results: {path}" in out.stdout
    check_result_file(script, path, tiny=True, printed=out.stdout)
    assert (ROOT / "docs" / "benchmarks.md").read_bytes() == docs and _listing(BENCH / "results") == results


def test_run_all_lists_every_script() -> None:
    on_disk = {p.name for p in BENCH.glob("bench_*.py")}
    assert set(run_all.scripts()) == on_disk
    assert run_all.scripts()[-1] == "bench_dropin.py"  # the long one last


# One layer call pattern, one decode and one whole model of each port: every part of
# the harness (timing, checks, JSON, a memory worker) runs through each port's code,
# without the full --tiny sweep (`benchmarks/run_all.py --quick` runs that, and the
# Keras JAX/torch backends).
DROPIN_PORTS = {
    # Both modes of torch's layer and model (the forward/inference rows add MHA with its fast path
    # off); --tiny measures memory in the first model entry only (lm inference).
    "torch": ([r"^torch/(layer/mask\+hint/|decode/layer/B=1$|model/lm/)"], True),
    # Flax's model memory is XLA's memory_analysis() in the worker process (two small compilations);
    # the grad and train rows check their gradients.
    "jax": ([r"^jax/(layer/combined-mask/|decode/stack/B=1$|model/encoder/)"], True),
    # TensorFlow's CPU runtime keeps a step's buffers between calls: no model memory is recorded there.
    "keras-tensorflow": (
        [r"^keras-tensorflow/(layer/embedding-padding/train/|decode/stack/B=1$|model/lm/)"],
        False,
    ),
    # Keras on JAX: XLA's memory_analysis() of the train step Keras compiles, as for Flax.
    "keras-jax": ([r"^keras-jax/(layer/mask-float/predict/|decode/layer/B=1$|model/encoder/train/)"], True),
}


@pytest.mark.parametrize("port", list(DROPIN_PORTS))
def test_dropin_tiny(port: str, tmp_path: Path) -> None:
    path = tmp_path / "dropin.json"
    (only, *extra), memory = DROPIN_PORTS[port]
    out = _run([str(BENCH / "bench_dropin.py"), "--tiny", "--port", port, "--only", only, *extra, "--json", str(path)])
    assert out.returncode == 0, f"bench_dropin --port {port} failed:\n{out.stdout[-3000:]}\n{out.stderr[-4000:]}"
    data = json.loads(path.read_text())
    assert data["format"] == "damcha-dropin/1"
    (run,) = data["runs"]
    assert run["tiny"] is True and run["threads"] >= 1 and run["finished"] and run["failed"] == []
    assert run["command"].startswith(".venv/bin/python benchmarks/bench_dropin.py")
    assert {"cpu", "cpu_count"} <= set(run["machine"]) and "numpy" in run["versions"]
    entries = data["entries"]
    assert {e.split("/")[1] for e in entries} == {"layer", "decode", "model"}, sorted(entries)
    for entry_id, e in entries.items():
        assert e["id"] == entry_id and e["port"] == port and e["run"] == 0
        assert "error" not in e, f"{entry_id}: {e['error']}"
        assert e["check"]["ok"], f"{entry_id}: DAMCHA with closed gates differs from MHA: {e['check']}"
        rounds = {len(t["wall"]) for t in e["times"].values()} | {len(t["cpu"]) for t in e["times"].values()}
        assert rounds == {2}, f"{entry_id}: {rounds}"
        assert all(x > 0 for t in e["times"].values() for x in t["wall"])
        for c in e["comparisons"]:
            r = c["ratio"]
            assert r["q1"] <= r["median"] <= r["q3"] and r["rounds"] == 2
            assert c["met"] is None or c["met"] == (r["median"] <= c["target"])
        assert e["env"]["threads"] == run["threads"]
    peaks = [e["memory"] for e in entries.values() if "memory" in e]
    assert len(peaks) == memory
    for e in entries.values():
        if "memory" not in e:
            continue
        nofast = port == "torch" and e["mode"] == "inference"
        assert set(e["memory"]["mib"]) == ({"damcha", "mha", "mha-nofast"} if nofast else {"damcha", "mha"})
        assert set(e["memory"].get("also", {})) == ({"mha-nofast"} if nofast else set())
    if port == "torch":  # the forward/inference rows, and only they, also compare with MHA's fast path off
        for e in entries.values():
            labels = [c["label"] for c in e["comparisons"]]
            off = e["section"] in ("layer", "model") and e["mode"] in ("forward", "inference")
            if e["section"] != "decode":
                assert labels == (["time", "time, MHA fast path off"] if off else ["time"]), (e["id"], labels)
                assert ("mha-nofast" in e["times"]) == off
                # Each timed callable checked with closed gates on its own inputs: the second
                # baseline's output, the training rows' gradients.
                checked = set(e["check"]["checked"])
                if off:
                    assert checked == {"output", "mha fast path off"}, (e["id"], checked)
                elif e["section"] == "layer":
                    assert {"train output", "input 0 gradient"} <= checked, (e["id"], checked)
                else:
                    assert checked == {"loss", "parameter gradients", "attention gradients"}, (e["id"], checked)
    # Every training row checks the step it times: Flax the loss and every MHA parameter's
    # gradient (a model's attention layers' also on their own scale), Keras one
    # train_on_batch's loss and weight changes (SGD, learning rate 1).
    for e in entries.values():
        if port != "torch" and e["mode"] in ("grad", "train"):
            if port == "jax":
                trained = {"loss", "parameter gradients"} | (
                    {"attention gradients"} if e["section"] == "model" else set()
                )
            else:
                trained = {"train loss", "weight updates", "attention weight updates"}
            assert set(e["check"]["checked"]) == trained, (e["id"], e["check"])
    assert port == "torch" or any(e["mode"] in ("grad", "train") for e in entries.values())
    if port in ("torch", "jax"):  # every timed decode step (compiled ones too) against the plain MHA step
        for e in entries.values():
            if e["section"] == "decode":
                assert set(e["check"]["checked"]) == set(e["times"]) - {"mha"}, (e["id"], e["check"])
    if port in ("jax", "keras-jax") and peaks:  # XLA's parts add up to the recorded total, for both models
        parts = peaks[0]["xla_mib"]
        assert all(
            abs(m["argument"] + m["output"] + m["temp"] - m["alias"] - m["total"]) < 1e-9 for m in parts.values()
        )
        # Compared: what each program allocates beyond its arguments (parameters and inputs
        # exist before the call, as before a torch call whose resident-set increase is compared).
        assert all(abs(m["temp"] + m["output"] - m["alias"] - m["own"]) < 1e-9 for m in parts.values())
        assert {impl: m["own"] for impl, m in parts.items()} == peaks[0]["mib"] and peaks[0]["mib"]["mha"] > 0
    # The docs section renders from it (tests only: tiny results never go into the docs).
    runs, loaded = _dropin_report.load([path])
    text = _dropin_report.render(runs, loaded)
    assert text.startswith(_dropin_report.BEGIN) and text.rstrip().endswith(_dropin_report.END)
    assert run["command"] in text and text.count("| DAMCHA") >= 1
    if port == "torch":  # resuming measures nothing already in the file; a new run never overwrites it
        again = _run(
            [str(BENCH / "bench_dropin.py"), "--tiny", "--port", port, "--only", only, *extra, "--resume", str(path)]
        )
        assert again.returncode == 0, again.stderr[-3000:]
        resumed = json.loads(path.read_text())
        assert len(resumed["runs"]) == 2 and resumed["entries"] == entries and "already in" in again.stdout
        refused = _run([str(BENCH / "bench_dropin.py"), "--tiny", "--port", port, "--json", str(path)])
        assert refused.returncode == 2 and "--resume" in refused.stderr


def test_models_tiny_writes_every_round(tmp_path: Path) -> None:
    """bench_models.py --tiny --json: every model, mode and implementation is timed, checked
    (closed gates reproduce the original model) and measured, with the run's metadata."""
    path = tmp_path / "models.json"
    out = _run([str(BENCH / "bench_models.py"), "--tiny", "--threads", "1", "--json", str(path)])
    assert out.returncode == 0, f"bench_models --tiny failed:\n{out.stdout[-3000:]}\n{out.stderr[-4000:]}"
    assert "| gpt2 | forward | 16 |" in out.stdout  # the table of this run is printed too
    data = json.loads(path.read_text())
    assert data["format"] == _models_report.FORMAT
    (run,) = data["runs"]
    assert run["tiny"] is True and run["threads"] == 1 and run["torch_threads"] == 1
    assert run["command"] == f".venv/bin/python benchmarks/bench_models.py --tiny --threads 1 --json {path}"
    assert run["finished"] and run["errors"] == 0 and run["git"] and len(run["loadavg_end"]) == 3
    assert {"cpu", "cpu_count"} <= set(run["machine"]) and {"torch", "transformers", "timm"} <= set(run["versions"])
    entries = data["entries"]
    modes = ("forward", "fwd+bwd", "generate")  # the ViT has no generate
    want = {f"models/{m}/{mode}/N=16" for m in ("gpt2", "llama", "gptneox", "vit") for mode in modes} - {
        "models/vit/generate/N=16"
    }
    assert set(entries) == want
    assert run["decode_kernel"] == "c"  # the C kernel was built (CI requires it)
    for entry_id, e in entries.items():
        assert "error" not in e, f"{entry_id}: {e['error']}"
        assert e["check"]["ok"], f"{entry_id}: the converted model with closed gates differs: {e['check']}"
        assert set(e["times"]) == {"original", "damcha"} and e["run"] == 0 and e["env"]["threads"] == run["threads"]
        assert all(len(t[k]) == 2 and min(t[k]) > 0 for t in e["times"].values() for k in ("wall", "cpu"))
        (c,) = e["comparisons"]
        assert (c["num"], c["den"], c["target"], c["met"]) == ("damcha", "original", None, None)  # N < 512
        assert c["ratio"]["rounds"] == 2 and c["ratio"]["q1"] <= c["ratio"]["median"] <= c["ratio"]["q3"]
        assert set(e["memory"]["mib"]) == {"original", "damcha"} and e["memory"]["target"] is None
    runs, loaded = _models_report.load([path])
    text = _models_report.render(runs, loaded)
    assert run["command"] in text and text.count("| vit |") == 2


def test_models_keras_tiny_on_tensorflow(tmp_path: Path) -> None:
    """bench_models_keras.py --tiny --backends tensorflow --json: every KerasHub model and mode
    is timed in the TensorFlow worker, checked (closed gates reproduce the original model, and
    its greedy tokens; opened gates move the output), with the run's metadata. (JAX and torch:
    `benchmarks/run_all.py --quick`, a few minutes.)"""
    path = tmp_path / "models-keras.json"
    argv = ["--tiny", "--backends", "tensorflow", "--threads", "1", "--json", str(path)]
    out = _run([str(BENCH / "bench_models_keras.py"), *argv])
    assert out.returncode == 0, f"bench_models_keras --tiny failed:\n{out.stdout[-3000:]}\n{out.stderr[-4000:]}"
    assert "| llama | train | 16 |" in out.stdout  # the table of this run is printed too
    data = json.loads(path.read_text())
    assert data["format"] == _models_keras_report.FORMAT
    (run,) = data["runs"]
    assert run["command"] == ".venv/bin/python benchmarks/bench_models_keras.py " + " ".join(argv)
    assert run["tiny"] is True and run["threads"] == 1 and run["backends"] == ["tensorflow"]
    assert run["finished"] and run["failed"] == [] and run["git"] and len(run["loadavg_end"]) == 3
    assert {"cpu", "cpu_count"} <= set(run["machine"]) and {"keras", "keras-hub"} <= set(run["versions"])
    entries = data["entries"]
    modes = ("predict", "train", "generate")  # BERT has no generate
    want = {f"keras-tensorflow/models/{m}/{mode}/N=16" for m in ("gpt2", "llama", "gptneox", "bert") for mode in modes}
    assert set(entries) == want - {"keras-tensorflow/models/bert/generate/N=16"}
    for entry_id, e in entries.items():
        assert "error" not in e, f"{entry_id}: {e['error']}"
        assert e["check"]["ok"], f"{entry_id}: the converted model with closed gates differs: {e['check']}"
        assert e["check"]["open_gates_rel_diff"] > 0 and e["check"].get("tokens_differing", 0) == 0
        assert e["port"] == "keras-tensorflow" and e["backend"] == "tensorflow" and e["jit_compile"] is False
        assert e["env"]["threads"] == 1 and e["env"]["tf_intra_op_threads"] == 1 and e["run"] == 0
        assert set(e["times"]) == {"original", "damcha"}
        assert all(len(t[k]) == 2 and min(t[k]) > 0 for t in e["times"].values() for k in ("wall", "cpu"))
        (c,) = e["comparisons"]
        assert (c["num"], c["den"], c["target"], c["met"]) == ("damcha", "original", None, None)  # N < 512
        assert "memory" not in e  # TensorFlow: not measured (see the script's docstring)
    runs, loaded = _models_keras_report.load([path])
    text = _models_keras_report.render(runs, loaded)
    assert run["command"] in text and "### TensorFlow backend" in text and text.count("| bert |") == 2


def test_dropin_report_writes_only_its_section(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## PyTorch\n\nkept\n")
    entry = {
        "id": "torch/layer/mask+hint/forward/N=256",
        "port": "torch",
        "section": "layer",
        "case": "mask+hint",
        "mode": "forward",
        "shape": {"B": 4, "N": 256, "E": 512, "H": 8},
        "call": "attn(x)",
        "baseline": "MHA",
        "run": 0,
        "check": {"ok": True, "max_rel_diff": 0.0},
        "comparisons": [
            {
                "label": "time",
                "num": "damcha",
                "den": "mha",
                "target": 1.10,
                "met": False,
                "ms": {"damcha": 12.0, "mha": 10.0},
                "ratio": {"median": 1.2, "q1": 1.1, "q3": 1.3, "min": 1.0, "max": 1.4, "rounds": 3},
            }
        ],
    }
    runs = [{"command": ".venv/bin/python benchmarks/bench_dropin.py --port torch", "tiny": False}]
    text = _dropin_report.render(runs, [entry])
    assert "1.200 (1.10-1.30)" in text and "<= 1.10 **missed**" in text
    assert "`.venv/bin/python benchmarks/bench_dropin.py --port torch`" in text
    _dropin_report.write_section(doc, text)
    _dropin_report.write_section(doc, text)  # replaced, not appended twice
    body = doc.read_text()
    assert body.startswith("# Benchmarks\n\n## PyTorch\n\nkept\n") and body.count(_dropin_report.BEGIN) == 1


# ----------------------------------------------------------- _counts.py


def test_torch_op_counts_counts_dispatched_aten_ops() -> None:
    import torch

    counts = _counts.torch_op_counts(lambda: torch.ones(3) + torch.ones(3) * 2)
    assert counts == Counter({"aten.ones": 2, "aten.mul": 1, "aten.add": 1})


def test_torch_sdpa_calls_sees_the_hint_and_the_mask() -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    q = torch.randn(1, 2, 5, 4)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    assert [
        (c["is_causal"], c["has_mask"])
        for c in _counts.torch_sdpa_calls(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    ] == [(False, True)]
    assert [
        (c["is_causal"], c["has_mask"])
        for c in _counts.torch_sdpa_calls(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    ] == [(True, False)]
    # nn.MultiheadAttention's contract: with is_causal=True the causal attn_mask is only a hint.
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    calls = _counts.torch_sdpa_calls(
        lambda: mha(x, x, x, attn_mask=~mask, is_causal=True, need_weights=False)[0].sum().backward()
    )
    assert [(c["is_causal"], c["has_mask"]) for c in calls] == [(True, False)]


def test_mha_decode_step_is_mha_run_causally() -> None:
    """The decode benchmarks' baseline computes nn.MultiheadAttention's causal output."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64).eval()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
    want = mha(x, x, x, attn_mask=causal, need_weights=False)[0]
    cache: list = []
    got = [_counts.mha_decode_step(mha, x[:, :4], cache)]  # a prompt, then one token at a time
    got += [_counts.mha_decode_step(mha, x[:, i : i + 1], cache) for i in range(4, 7)]
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-12, atol=1e-12)
    assert cache[0].shape == (2, 4, 7, 4)


def test_jax_eqn_counts_inlines_nested_jaxprs() -> None:
    import jax
    import jax.numpy as jnp

    inner = jax.jit(lambda x: jnp.sin(x) * 2.0)
    counts = _counts.jax_eqn_counts(lambda x: inner(x) + jnp.cos(x), jnp.ones(3))
    assert counts == Counter({"sin": 1, "mul": 1, "cos": 1, "add": 1})
    assert _counts.jax_hlo_op_count(lambda x: jnp.sin(x) * 2.0, jnp.ones(3)) >= 1


def test_the_keras_train_check_fails_when_one_copied_weight_differs():
    """The drop-in Keras train check compares one train_on_batch's weight changes: a DAMCHA
    model whose copy of one MHA weight is off (its gradient then differs) fails it, and
    every weight of both models is put back afterwards."""
    import _dropin_keras as dk
    import numpy as np
    from _harness import Sizes

    m = dk._layer_models("mask-float", 16, Sizes(tiny=True))
    weights = {id(v): np.array(v.numpy()) for model in (m["damcha"], m["mha"]) for v in model.variables}
    passed = dk._train_check(m["damcha"], m["mha"], m["pairs"], m["inputs"], m["target"], "mse")
    assert all(part["ok"] for part in passed.values()), passed
    _, damcha = m["pairs"][0]
    value = damcha._projections()["value"].kernel
    value.assign(value.numpy() * 1.5)
    weights[id(value)] = value.numpy()
    failed = dk._train_check(m["damcha"], m["mha"], m["pairs"], m["inputs"], m["target"], "mse")
    assert not failed["attention weight updates"]["ok"] and not failed["train loss"]["ok"], failed
    for model in (m["damcha"], m["mha"]):
        for v in model.variables:
            np.testing.assert_array_equal(v.numpy(), weights[id(v)], err_msg=v.path)


def test_the_flax_gradient_check_fails_when_one_copied_weight_differs():
    """The drop-in Flax grad check compares every MHA parameter's gradient: a DAMCHA layer
    whose copy of MHA's value kernel is off fails it; an all-zero gradient fails too."""
    import _dropin_jax as dj_bench
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import damcha_jax as dj

    mha = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0))
    damcha = dj.DamchaAttention.from_mha(mha, rngs=nnx.Rngs(1))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 8)), jnp.float32)
    mask, rows = dj_bench._masks("combined-mask", 2, 5)
    grad = dj_bench._layer_fns("combined-mask", "grad", True), dj_bench._layer_fns("combined-mask", "grad", False)
    args = (x, mask, jnp.asarray(rows))
    assert not rows.all()  # a padded row: its all-masked query rows are left out of the loss
    ok = dj_bench.gradient_check(grad[0](damcha, *args), grad[1](mha, *args))
    assert all(part["ok"] for part in ok.values()), ok
    damcha.value.kernel[...] = damcha.value.kernel[...] * 1.5
    off = dj_bench.gradient_check(grad[0](damcha, *args), grad[1](mha, *args))
    assert not off["parameter gradients"]["ok"], off
    loss, grads = grad[1](mha, *args)
    zero = dj_bench.gradient_check((loss, grads), (loss, jax.tree.map(jnp.zeros_like, grads)))
    assert not zero["parameter gradients"]["ok"] and "all zero" in zero["parameter gradients"]["note"]
