"""The exported models in onnxruntime for JavaScript: onnxruntime-node and
onnxruntime-web (WASM), under Node.js, pinned in js/package.json.

One Node process per runtime runs every vector (js/run_vectors.mjs): the
catalogue and decode cases exported by ``damcha conform --export-vectors``,
plus stack and token-model vectors written here in the same format from the
NumPy reference. Models are exported from the parameters stored in the vector
files; the expected values are the files' too. Node.js and ``npm ci`` in js/
(``make test`` runs it) are required: without them these tests fail, never skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from safetensors.numpy import load_file, save_file

import damcha_core as dc
import damcha_onnx as do
from damcha_conformance import CATALOGUE, TOLERANCES, WEIGHTS_CASES

ROOT = Path(__file__).resolve().parents[1]
JS = ROOT / "js"
FORMAT = "damcha-conformance-vectors-v1"
RUNTIMES = ["node", "web"]
PINNED = json.loads((JS / "package.json").read_text())["dependencies"]
# float16 in JavaScript on one case of each kind (Python checks every case in
# float16), and on the float16-only large-activation cases (a vector's "dtypes"); float32 at
# opsets 23 and 17 on every other case. Catalogue runs of a case with attention weights
# (a vector's "weights") export them too and compare them as well.
FLOAT16_CASES = {
    "heads-tied-large-tokens",
    "lowrank-separate-large-tokens-cross",
    "heads-tied-padding",
    "heads-separate-per-head-cross",
    "heads-tied-all-masked-row",
    "heads-query-causal-tall",
    "heads-separate-gqa-cross",
    "lowrank-tied-rank1-small-tokens",
    "heads-tied-long-512",
    "decode-heads-query-gqa",
    "decode-lowrank-separate",
}

# The conformance cases with an empty batch or no query: onnxruntime refuses them (see
# _catalogue_runs), so JavaScript runs every case but these.
EMPTY_CASES = {c.name for c in CATALOGUE if c.batch == 0 or c.query_len == 0}


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.fail(
            "Node.js (>= 20) is required for the onnxruntime-node/-web checks and was not found on PATH; "
            "install it, then run `make test` (which runs `npm ci` in js/)."
        )
    for package in PINNED:
        if not (JS / "node_modules" / package / "package.json").is_file():
            pytest.fail(
                f"js/node_modules/{package} is missing: run `make js-deps` (`cd js && npm ci --ignore-scripts`)."
            )
    return node


def _node_run(*args, timeout=600):
    return subprocess.run([_node(), *map(str, args)], cwd=JS, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------ the vectors


def _catalogue_runs(vectors: Path) -> list[dict]:
    runs = []
    models = vectors / "models"
    models.mkdir()
    for name in json.loads((vectors / "index.json").read_text())["cases"]:
        desc = json.loads((vectors / f"{name}.json").read_text())
        tensors = load_file(str(vectors / desc["tensors"]))
        if 0 in tensors["inputs.query"].shape[:2]:
            # onnxruntime (Python, node and web alike) refuses an empty batch or query in the
            # Attention kernel and the decomposed graph's Reshape; damcha_onnx's Python helpers
            # return the empty outputs without running the graph (tests/test_onnx_empty.py), and a
            # JavaScript caller handles B = 0 itself (docs/onnx.md). Which cases: EMPTY_CASES.
            continue
        config = dc.DamchaConfig.from_dict(desc["config"])
        params = {k[len("params.") :]: v for k, v in tensors.items() if k.startswith("params.")}
        inputs = {"query": "inputs.query"}
        if "inputs.context" in tensors:
            inputs["context"] = "inputs.context"
        if "inputs.value" in tensors:
            inputs["value"] = "inputs.value"
        if "inputs.mask" in tensors:
            inputs["mask"] = "inputs.mask"
        for opset, dtype in ((23, "float32"), (17, "float32"), (23, "float16")):
            if dtype == "float16" and name not in FLOAT16_CASES:
                continue
            if desc["dtypes"] is not None and dtype not in desc["dtypes"]:
                continue
            file = f"models/{name}.opset{opset}.{dtype}.onnx"
            run = {
                "id": f"{name}@opset{opset}/{dtype}",
                "case": name,
                "model": file,
                "dtype": dtype,
                "output": "output",
                "expected": "expected.output",
            }
            if desc["decode"] is not None:
                do.export(params, config, vectors / file, opset=opset, causal=True, kv_cache=True, dtype=dtype)
                P, L = desc["decode"]["prefix_len"], desc["decode"]["prefix_len"] + desc["decode"]["new_len"]
                run.update(inputs=inputs, step_input="query", steps=[[0, P], [P, P + 1], [P + 1, L]], keep_from_step=1)
                run["prefill"] = desc["decode"]["prefill"]  # the first step's outputs, compared too
            else:
                do.export(
                    params,
                    config,
                    vectors / file,
                    opset=opset,
                    causal=desc["causal"],
                    cross=not desc["self_attention"],
                    mask="mask" in inputs,
                    dtype=dtype,
                    return_weights=desc["weights"] is not None,
                )
                run["inputs"] = inputs
                if desc["weights"] is not None:
                    run["weights"] = {"output": "weights", "expected": desc["weights"]}
            runs.append(run)
    return runs


def _bad_layer_inputs(run: dict, tensors: dict) -> list[dict]:
    B, N, E = tensors["inputs.query"].shape
    bad = [
        {"name": "query-features", "feeds": {"query": {"dtype": run["dtype"], "shape": [B, N, E + 1], "fill": 0.5}}},
        {"name": "query-rank", "feeds": {"query": {"dtype": run["dtype"], "shape": [N, E], "fill": 0.5}}},
    ]
    if "inputs.mask" in tensors:
        mask = tensors["inputs.mask"].shape
        M = mask[-1]
        bad += [
            {
                "name": "mask-one-key-too-many",
                "feeds": {"mask": {"dtype": "bool", "shape": [B, 1, 1, M + 1], "fill": 1}},
            },
            {"name": "mask-batch", "feeds": {"mask": {"dtype": "bool", "shape": [B + 1, 1, 1, M], "fill": 1}}},
            {"name": "mask-heads", "feeds": {"mask": {"dtype": "bool", "shape": [B, 3, 1, M], "fill": 1}}},
        ]
    if "inputs.context" in tensors:
        _, M, Ec = tensors["inputs.context"].shape
        bad.append(
            {
                "name": "context-batch",
                "feeds": {"context": {"dtype": run["dtype"], "shape": [B + 1, M, Ec], "fill": 0.5}},
            }
        )
    return bad


def _stack_vectors(vectors: Path) -> list[dict]:
    """Encoder and token-model vectors in the catalogue's format, expected values from the NumPy reference."""
    rng = np.random.default_rng(21)
    attn = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, num_kv_heads=2, coupling="query")
    enc = dc.EncoderConfig(attn, num_layers=2, ffn_dim=24, causal=True)
    tm = dc.TokenModelConfig(enc, vocab_size=40, max_len=12, num_classes=5)
    params = dc.init_token_model_params(tm, 21)
    params = {k: rng.uniform(-1, 1, v.shape) if k.endswith(".gate") else v for k, v in params.items()}
    eparams = {k[len("encoder.") :]: v for k, v in params.items() if k.startswith("encoder.")}
    x = rng.normal(size=(2, 9, 16))
    padding = np.arange(9)[None, :] < np.array([9, 6])[:, None]
    tokens = rng.integers(0, 40, (2, 9))
    cases = {
        "stack-encoder": {
            "inputs.query": x,
            "inputs.mask": padding,
            "expected.output": dc.encoder_forward(eparams, enc, x, mask=padding[:, None, None, :]),
        },
        "stack-token-model": {"inputs.tokens": tokens, "expected.logits": dc.token_model_forward(params, tm, tokens)},
    }
    for name, tensors in cases.items():
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(vectors / f"{name}.safetensors"))
        desc = {
            "format": FORMAT,
            "name": name,
            "tensors": f"{name}.safetensors",
            "tolerances": {k: vars(v) for k, v in TOLERANCES.items()},
        }
        (vectors / f"{name}.json").write_text(json.dumps(desc))
    runs = []
    for opset, dtype in ((23, "float32"), (17, "float32"), (23, "float16")):
        tag = f"opset{opset}.{dtype}"
        do.export_encoder(
            eparams, enc, vectors / f"models/encoder.{tag}.onnx", opset=opset, dtype=dtype, mask="padding"
        )
        runs.append(
            {
                "id": f"encoder@{tag}",
                "case": "stack-encoder",
                "model": f"models/encoder.{tag}.onnx",
                "dtype": dtype,
                "inputs": {"query": "inputs.query", "mask": "inputs.mask"},
                "output": "output",
                "expected": "expected.output",
                "bad": [
                    {"name": "padding-mask-keys", "feeds": {"mask": {"dtype": "bool", "shape": [2, 10], "fill": 1}}},
                    # Size-1 dims a 4-D mask may have: a (B, M) padding mask must not broadcast them.
                    {"name": "padding-mask-batch-1", "feeds": {"mask": {"dtype": "bool", "shape": [1, 9], "fill": 1}}},
                    {"name": "padding-mask-one-key", "feeds": {"mask": {"dtype": "bool", "shape": [2, 1], "fill": 1}}},
                ],
            }
        )
        do.export_token_model(params, tm, vectors / f"models/token.{tag}.onnx", opset=opset, dtype=dtype)
        too_long = {"dtype": "int64", "shape": [1, 13], "fill": 1}
        runs.append(
            {
                "id": f"token-model@{tag}",
                "case": "stack-token-model",
                "model": f"models/token.{tag}.onnx",
                "dtype": dtype,
                "inputs": {"tokens": "inputs.tokens"},
                "output": "logits",
                "expected": "expected.logits",
                "bad": [
                    {
                        "name": "negative-id",
                        "feeds": {"tokens": {"dtype": "int64", "shape": [1, 3], "values": [2, -1, 3]}},
                    },
                    {
                        "name": "id-past-vocabulary",
                        "feeds": {"tokens": {"dtype": "int64", "shape": [1, 2], "values": [40, 1]}},
                    },
                    {"name": "longer-than-positions", "feeds": {"tokens": too_long}},
                ],
            }
        )
        do.export_token_model(
            params, tm, vectors / f"models/token-step.{tag}.onnx", opset=opset, dtype=dtype, kv_cache=True
        )
        runs.append(
            {
                "id": f"token-model-kv-cache@{tag}",
                "case": "stack-token-model",
                "model": f"models/token-step.{tag}.onnx",
                "dtype": dtype,
                "inputs": {"tokens": "inputs.tokens"},
                "output": "logits",
                "expected": "expected.logits",
                "step_input": "tokens",
                "steps": [[0, 4], [4, 5], [5, 9]],
                "keep_from_step": 0,
                "bad": [
                    {
                        "name": "cache-batch",
                        "feeds": {
                            "past_key.0": {"dtype": dtype, "shape": [3, 2, 1, 4], "fill": 0.1},
                            "past_value.0": {"dtype": dtype, "shape": [3, 2, 1, 4], "fill": 0.1},
                        },
                    },
                    {
                        "name": "cache-lengths-differ",
                        "feeds": {"past_key.1": {"dtype": dtype, "shape": [2, 2, 2, 4], "fill": 0.1}},
                    },
                    {
                        "name": "negative-id",
                        "feeds": {"tokens": {"dtype": "int64", "shape": [2, 1], "values": [-2, 1]}},
                    },
                ],
            }
        )
    return runs


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    """The vectors and models, written once per test session: under xdist the
    two runtimes' tests may run on different workers; the first one writes
    them under a file lock in the workers' common temporary folder, the other
    waits for it and reads them."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = shared / "onnx-js-vectors" / "manifest.json"
    with open(shared / "onnx-js-vectors.lock", "w") as handle:
        try:
            import fcntl
        except ImportError:  # not POSIX: one folder per worker, no sharing
            path = base / "onnx-js-vectors" / "manifest.json"
        else:
            fcntl.flock(handle, fcntl.LOCK_EX)
        if not path.exists():
            _write_manifest(path)
    return path


def _write_manifest(path: Path) -> None:
    vectors = path.parent
    # The vectors exactly as the CLI writes them.
    subprocess.run(
        [sys.executable, "-m", "damcha_core._cli", "conform", "--export-vectors", str(vectors)],
        check=True,
        capture_output=True,
        text=True,
    )
    runs = _catalogue_runs(vectors)
    for run in runs:
        if run.get("steps") is None and run["case"] in ("heads-tied-padding", "heads-separate-per-head-cross"):
            desc = json.loads((vectors / f"{run['case']}.json").read_text())
            run["bad"] = _bad_layer_inputs(run, load_file(str(vectors / desc["tensors"])))
        if run.get("steps") and run["case"] == "decode-heads-query-gqa":
            run["bad"] = [
                {
                    "name": "cache-batch",
                    "feeds": {
                        "past_key": {"dtype": run["dtype"], "shape": [2, 2, 1, 4], "fill": 0.1},
                        "past_value": {"dtype": run["dtype"], "shape": [2, 2, 1, 4], "fill": 0.1},
                    },
                }
            ]
    runs += _stack_vectors(vectors)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"runs": runs}))
    partial.replace(path)  # complete or absent: a failed run leaves nothing that looks done


@pytest.mark.parametrize("runtime", RUNTIMES, ids=[f"onnxruntime-{r}" for r in RUNTIMES])
def test_exported_models_match_the_vectors_in_javascript(manifest, runtime):
    proc = _node_run("run_vectors.mjs", "--runtime", runtime, manifest)
    assert proc.stdout.strip(), f"no report from node (exit {proc.returncode}): {proc.stderr[-2000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = json.loads(manifest.read_text())["runs"]
    assert report["runtime"] == runtime
    version = report["versions"].get(runtime) or report["versions"].get("common")
    assert version == PINNED[f"onnxruntime-{runtime}"], report["versions"]
    assert [r["run"] for r in report["results"]] == [r["id"] for r in runs]  # every run reported, none skipped
    failed = [r for r in report["results"] if not r.get("ok")]
    assert not failed, failed[:5]
    # The attention weights were compared wherever a vector has them, in both dtypes.
    weighed = {r["run"] for r in report["results"] if r.get("weights", {}).get("ok")}
    assert weighed == {r["id"] for r in runs if "weights" in r} and len(weighed) >= 2 * len(WEIGHTS_CASES) - 4
    # ... and the decoding runs' prefill outputs.
    prefilled = {r["run"] for r in report["results"] if r.get("prefill", {}).get("ok")}
    assert prefilled == {r["id"] for r in runs if "prefill" in r} and len(prefilled) >= 2 * 4
    assert {r["id"].split("/")[-1] for r in runs if "/" in r["id"]} == {"float32", "float16"}
    kinds = {r["id"].split("@")[0] for r in runs}
    # Only the empty-shape cases are left out of JavaScript, and all of them (see _catalogue_runs).
    catalogue = set(json.loads((manifest.parent / "index.json").read_text())["cases"])
    assert catalogue - kinds == EMPTY_CASES, catalogue - kinds
    assert {
        "token-model",
        "token-model-kv-cache",
        "encoder",
        "decode-heads-tied",
        "heads-tied-all-masked-row",
        "heads-separate-gqa-cross",
        "heads-tied-causal-padding",
    } <= kinds
    # Bad inputs make the session throw: never a wrong answer.
    expected_bad = sum(len(r.get("bad", [])) for r in runs)
    assert len(report["bad"]) == expected_bad >= 20
    silent = [b for b in report["bad"] if not b["raised"]]
    assert not silent, silent
    assert proc.returncode == 0, proc.stderr[-2000:]


# ------------------------------------------------------------ the example


def _docs_example() -> str:
    text = (ROOT / "docs" / "onnx.md").read_text()
    blocks = re.findall(r"```js\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/onnx.md has no ```js example"
    return blocks[0]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_docs_javascript_example_runs_and_decodes_like_the_reference(tmp_path, dtype):
    # float16: the empty cache takes the model's input type (it was built as float32 and refused).
    assert _docs_example() == (JS / "example.mjs").read_text(), "docs/onnx.md's JS example must be js/example.mjs"
    attn = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4, metric="lowrank", metric_rank=2)
    tm = dc.TokenModelConfig(dc.EncoderConfig(attn, num_layers=2, ffn_dim=32, causal=True), 50, 16, 50)  # an LM
    rng = np.random.default_rng(8)
    params = {
        k: rng.uniform(-1, 1, v.shape) if k.endswith(".gate") else v
        for k, v in dc.init_token_model_params(tm, 8).items()
    }
    params["head.kernel"] = params["head.kernel"] * 20.0  # decisive logits: greedy choices far from ties
    path = tmp_path / "lm.onnx"
    do.export_token_model(params, tm, path, kv_cache=True, dtype=dtype)
    prompt, steps = [3, 1, 4, 1, 5], 6
    proc = _node_run("example.mjs", path, json.dumps(prompt), steps, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = list(prompt)
    for _ in range(steps):  # greedy decoding with the full reference forward each step
        logits = dc.token_model_forward(params, tm, np.array([expected]))
        expected.append(int(np.argmax(logits[0, -1])))
    assert ids == expected


# ------------------------------------------------------------ opsets

#: The newest opset onnxruntime-node/-web 1.30 load (docs/onnx.md, "Opsets"): opset 27 is refused
#: as "under development" (official support till 26), opset 28 needs IR version 14 (they read 13).
JS_MAX_OPSET = 26

_LOAD_EVERY_OPSET = """
import { readFileSync } from 'node:fs';
const [runtime, manifest] = process.argv.slice(1);
const ort = runtime === 'node' ? await import('onnxruntime-node') : await import('onnxruntime-web');
if (runtime === 'web') ort.env.wasm.numThreads = 1;
const report = {};
for (const [opset, file] of Object.entries(JSON.parse(readFileSync(manifest, 'utf8')))) {
  try {
    const session = await ort.InferenceSession.create(readFileSync(file));
    const query = new ort.Tensor('float32', Float32Array.from({ length: 2 * 3 * 8 }, (_, i) => Math.sin(i)), [2, 3, 8]);
    const out = await session.run({ query });
    report[opset] = { output: Array.from(out.output.data) };
  } catch (e) {
    report[opset] = { error: String(e).slice(-400) };
  }
}
console.log(JSON.stringify(report));
"""


@pytest.mark.parametrize("runtime", RUNTIMES, ids=[f"onnxruntime-{r}" for r in RUNTIMES])
def test_which_opsets_javascript_runtimes_load(tmp_path, runtime):
    # The exporter accepts opsets up to the installed onnx's newest (28 with onnx 1.23), which
    # onnxruntime for Python (1.32) runs; the pinned JavaScript runtimes stop at JS_MAX_OPSET.
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    params = dc.init_params(config, 1)
    params["metric.qk.gate"] = np.full(2, 0.5)
    newest = onnx.defs.onnx_opset_version()
    files = {}
    for opset in range(do.MIN_OPSET, newest + 1):
        files[str(opset)] = str(tmp_path / f"layer{opset}.onnx")
        do.export(params, config, files[str(opset)], opset=opset, causal=True)
    (tmp_path / "opsets.json").write_text(json.dumps(files))
    proc = _node_run("--input-type=module", "-e", _LOAD_EVERY_OPSET, runtime, tmp_path / "opsets.json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    x = np.sin(np.arange(2 * 3 * 8)).reshape(2, 3, 8)
    expected = dc.damcha_attention(params, config, x, causal=True).reshape(-1)
    loaded = sorted(int(o) for o, r in report.items() if "output" in r)
    assert loaded == list(range(do.MIN_OPSET, min(newest, JS_MAX_OPSET) + 1)), {
        o: r.get("error") for o, r in report.items()
    }
    for opset in loaded:
        np.testing.assert_allclose(report[str(opset)]["output"], expected, rtol=1e-4, atol=1e-5, err_msg=str(opset))
    for opset, result in report.items():
        if int(opset) > JS_MAX_OPSET:
            assert re.search(r"opset|IR version", result["error"]), result["error"]
