"""Keras's own MultiHeadAttention test suite, run with ``DamchaAttention`` substituted.

The suite ships inside the installed keras package
(``keras/src/layers/attention/multi_head_attention_test.py``); it is imported
from there, never copied, and its assertions are untouched. The name it
looks up, ``layers.MultiHeadAttention``, is patched to a subclass of
``DamchaAttention`` that takes MHA's constructor (the subclass fixes the DAMCHA
configuration): once with fresh gates (``metric="heads"``, the default), once
with ``metric="none"``, and once with Keras's own MHA as the baseline (a test
that fails or skips for MHA itself on this machine says so).

Keras fixes its backend per process, so each backend runs every configuration
in one subprocess (``python tests/test_keras_upstream.py BACKEND OUT``), pytest
inside it; the results come back as JSON and each upstream test becomes one
item here, ``test_upstream[BACKEND-CONFIG-TEST]``. Every remaining failure is a
strict ``xfail`` with its reason (``EXPECTED_FAILURES``), so a fix shows up as
an XPASS; tests that reach into private attributes or protected methods of
Keras's class are listed in ``PRIVATE`` and counted separately.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _keras_processes import run_once_locked

BACKENDS = ("tensorflow", "jax", "torch")
CONFIGS = {"heads": {}, "none": {"metric": "none"}}
UPSTREAM_MODULE = "keras.src.layers.attention.multi_head_attention_test"


def _upstream_file() -> Path:
    spec = importlib.util.find_spec("keras")
    assert spec is not None and spec.origin is not None, "keras is not installed"
    return Path(spec.origin).parent / "src" / "layers" / "attention" / "multi_head_attention_test.py"


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    return ast.unparse(target)


def upstream_test_ids() -> list[str]:
    """The test method names absl's ``parameterized`` generates for the upstream
    class, read from its source (no import: the parent process stays light)."""
    tree = ast.parse(_upstream_file().read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MultiHeadAttentionTest")
    ids = []
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("test"):
            continue
        names = [fn.name]
        for deco in fn.decorator_list:
            kind = _decorator_name(deco)
            if kind == "parameterized.named_parameters":
                names = [f"{fn.name}_{ast.literal_eval(arg.elts[0])}" for arg in deco.args]
            elif kind == "parameterized.parameters":
                args = deco.args[0].elts if len(deco.args) == 1 and isinstance(deco.args[0], ast.List) else deco.args
                names = [f"{fn.name}{i}" for i in range(len(args))]
        ids.extend(names)
    return ids


# ------------------------------------------------------------- expectations

# Upstream tests that reach into private attributes or protected methods of Keras's
# class (found by reading the file): counted apart from the public-behaviour tests.
# DamchaAttention keeps MHA's sublayer attribute names (_query_dense, ...), its
# _compute_attention hook, _sliding_window and _flash_attention, so they run too.
PRIVATE: dict[str, str] = {
    "test_initializer": "_query_dense, _key_dense, _value_dense, _output_dense, _gate_dense",
    "test_causal_only_skipped_for_subclass": "overrides _compute_attention",
    "test_compute_attention_combines_causal_and_explicit_mask": "calls _compute_attention",
    "test_sliding_window_serialization": "_sliding_window",
    "test_mha_constraints": "_query_dense, _key_dense, _value_dense, _gate_dense",
    "test_dtype_policy_map": "_query_dense._kernel, _key_dense._kernel, _value_dense._kernel",
    "test_flash_attention_with_errors": "_flash_attention",
    "test_quantize_int8": "_flatten_layers, _query_dense._kernel, ... (every projection's _kernel)",
}

_WEIGHT_COUNT = (
    "asserts MultiHeadAttention's weight count: DAMCHA's metric adds trainable weights (the generator's kernel "
    "and bias, the layer's gate: 11 where MHA has 8), by design"
)

# (config or "*", test id or prefix ending in "*", backend or "*") -> reason.
EXPECTED_FAILURES: dict[tuple[str, str, str], str] = {
    ("heads", "test_basics", "*"): _WEIGHT_COUNT,
    ("heads", "test_high_dim_attention_*", "*"): _WEIGHT_COUNT,
    ("heads", "test_lora", "*"): _WEIGHT_COUNT,
    # run_layer_test with MHA's counts; Keras's suite skips it on tensorflow.
    ("heads", "test_basics_with_flash_attention", "jax"): _WEIGHT_COUNT,
    ("heads", "test_basics_with_flash_attention", "torch"): _WEIGHT_COUNT,
}


def _expected_failure(backend: str, config: str, test_id: str) -> str | None:
    for (cfg, test, be), reason in EXPECTED_FAILURES.items():
        if cfg not in ("*", config) or be not in ("*", backend):
            continue
        if test == test_id or (test.endswith("*") and test_id.startswith(test[:-1])):
            return reason
    return None


_RESULTS: dict[str, dict] = {}


def _results(backend: str, shared_dir: Path, needed: set[str]) -> dict:
    """The upstream suite's results on ``backend``, run once per test session.

    Under pytest-xdist every worker asks for them: the first one runs the
    subprocess under a file lock in the directory the workers share and writes
    the JSON; the others read it. A worker that finds the backend it needs
    already running first runs a backend nobody has started, then waits, so
    no backend runs twice and no worker idles while one is left.
    """
    if backend not in _RESULTS:
        if not _run_once(backend, shared_dir, wait=False):
            for other in BACKENDS:
                if other != backend and other in needed:
                    _run_once(other, shared_dir, wait=False)
            _run_once(backend, shared_dir, wait=True)
        _RESULTS[backend] = json.loads((shared_dir / f"keras-upstream-{backend}.json").read_text())
    return _RESULTS[backend]


def _run_once(backend: str, shared_dir: Path, *, wait: bool) -> bool:
    """Run ``backend``'s subprocess unless its results exist; False when another
    worker holds its lock and ``wait`` is False."""
    out = shared_dir / f"keras-upstream-{backend}.json"
    lock = shared_dir / f"keras-upstream-{backend}.lock"
    return run_once_locked(out, lock, lambda: _run_subprocess(backend, out), wait=wait)


def _run_subprocess(backend: str, out: Path) -> None:
    env = {**os.environ, "KERAS_BACKEND": backend}
    if backend == "jax":
        # Compilation, not running, dominates: cheaper codegen cuts it by about a third.
        env.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
    partial = out.with_suffix(".partial")
    proc = subprocess.run(
        [sys.executable, __file__, backend, str(partial)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0 and partial.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    partial.replace(out)


def _params():
    for backend in BACKENDS:
        for config in CONFIGS:
            for test_id in upstream_test_ids():
                reason = _expected_failure(backend, config, test_id)
                # One xdist group per backend: with --dist loadgroup one worker runs it all.
                marks = [pytest.mark.xdist_group(f"keras-upstream-{backend}")]
                marks += [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
                yield pytest.param(backend, config, test_id, id=f"{backend}-{config}-{test_id}", marks=marks)


@pytest.mark.parametrize("backend, config, test_id", list(_params()))
def test_upstream(backend, config, test_id, tmp_path_factory, request):
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: the workers' common root
    needed = {
        item.callspec.params["backend"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_upstream"
    }
    results = _results(backend, shared, needed)
    ours = results[config].get(test_id)
    assert ours is not None, f"{test_id} did not run; ran: {sorted(results[config])}"
    baseline = results.get("mha", {}).get(test_id)
    if baseline is not None:
        assert baseline["outcome"] != "failed", f"fails for Keras MHA itself: {baseline['message']}"
    if ours["outcome"] == "skipped":
        # Only the upstream file's own skip decorators and pytest.skip calls skip.
        pytest.skip(f"Keras's own suite skips this test on {backend}: {ours['message']}")
    assert ours["outcome"] == "passed", ours["message"]


# ------------------------------------------------------------- subprocess


def _run(backend: str, out: str) -> None:
    import importlib
    import types

    import keras
    import pytest as pt

    from damcha_keras import DamchaAttention

    assert keras.backend.backend() == backend
    module = importlib.import_module(UPSTREAM_MODULE)
    real_layers = module.layers

    def substitute(config: str) -> type:
        if config == "mha":
            return keras.layers.MultiHeadAttention
        options = CONFIGS[config]

        @keras.saving.register_keras_serializable(package=f"damcha_upstream_{config}")
        class MultiHeadAttention(DamchaAttention):
            """MHA's constructor, DamchaAttention with this configuration's options."""

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **{**options, **kwargs})

        return MultiHeadAttention

    class Collector:
        def __init__(self) -> None:
            self.results: dict[str, dict] = {}

        def pytest_runtest_logreport(self, report) -> None:
            test_id = report.nodeid.split("::")[-1]
            entry = self.results.setdefault(test_id, {"outcome": "passed", "message": ""})
            if report.failed or (report.skipped and entry["outcome"] == "passed"):
                entry["outcome"] = "failed" if report.failed else "skipped"
                if report.skipped and isinstance(report.longrepr, tuple):
                    entry["message"] = str(report.longrepr[2])
                else:
                    entry["message"] = str(report.longrepr)[-1500:]

    results = {}
    configs = (("mha",) if os.environ.get("DAMCHA_UPSTREAM_MHA") == "1" else ()) + tuple(CONFIGS)
    for config in configs:
        proxy = types.ModuleType("layers")
        proxy.__getattr__ = lambda name: getattr(real_layers, name)  # type: ignore[method-assign]
        proxy.MultiHeadAttention = substitute(config)
        module.layers = proxy
        collector = Collector()
        pt.main(
            [
                str(_upstream_file()),
                "-q",
                "-p",
                "no:cacheprovider",
                "-c",
                os.devnull,
                "--rootdir",
                os.path.dirname(out),
                "-o",
                "markers=requires_trainable_backend",
                "-W",
                "ignore",
                "--tb=short",
                "--no-header",
                "-o",
                "console_output_style=classic",
            ],
            plugins=[collector],
        )
        results[config] = collector.results
    module.layers = real_layers
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    _run(sys.argv[1], sys.argv[2])
