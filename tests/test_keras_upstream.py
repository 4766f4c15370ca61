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
in its Keras process (tests/_keras_processes.py, part ``upstream``: one process
per backend per test session, shared with the other tests that need that
backend; tensorflow in the test process), pytest inside it; the results come
back as JSON and each upstream test becomes one item here,
``test_upstream[BACKEND-CONFIG-TEST]``. ``python tests/test_keras_upstream.py
BACKEND`` (with ``KERAS_BACKEND=BACKEND``) prints them. Every remaining failure is a
strict ``xfail`` with its reason (``EXPECTED_FAILURES``), so a fix shows up as
an XPASS; tests that reach into private attributes or protected methods of
Keras's class are listed in ``PRIVATE`` and counted separately.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from _keras_processes import part_results

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


def _params():
    for backend in BACKENDS:
        for config in CONFIGS:
            for test_id in upstream_test_ids():
                reason = _expected_failure(backend, config, test_id)
                marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
                yield pytest.param(backend, config, test_id, id=f"{backend}-{config}-{test_id}", marks=marks)


@pytest.mark.parametrize("backend, config, test_id", list(_params()))
def test_upstream(backend, config, test_id, tmp_path_factory, request):
    results = part_results(backend, "upstream", tmp_path_factory, request)
    ours = results[config].get(test_id)
    assert ours is not None, f"{test_id} did not run; ran: {sorted(results[config])}"
    baseline = results.get("mha", {}).get(test_id)
    if baseline is not None:
        assert baseline["outcome"] != "failed", f"fails for Keras MHA itself: {baseline['message']}"
    if ours["outcome"] == "skipped":
        # Only the upstream file's own skip decorators and pytest.skip calls skip.
        pytest.skip(f"Keras's own suite skips this test on {backend}: {ours['message']}")
    assert ours["outcome"] == "passed", ours["message"]


# ------------------------------------------ in the backend's Keras process


class _Substitute:
    """Points the upstream module's ``layers`` at ``proxy`` once pytest has
    imported it: pytest imports it, not this process, so its marks are checked
    against the inner run's configuration (where Keras's markers are declared),
    also when this runs inside the test process (tensorflow)."""

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy

    def pytest_collection_finish(self, session: Any) -> None:
        sys.modules[UPSTREAM_MODULE].layers = self.proxy


def run(backend: str, workdir: str) -> dict:
    """Keras's suite on this process's backend, once per configuration: each
    test's outcome and message by configuration and test id (a JSON-able dict)."""
    import importlib
    import types

    import keras
    from _keras_processes import run_pytest
    from keras.src.backend.common import global_state

    from damcha_keras import DamchaAttention

    assert keras.backend.backend() == backend
    real_layers = importlib.import_module("keras.src.layers")

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

    args = [str(_upstream_file()), "-c", os.devnull, "--rootdir", workdir, "-W", "ignore"]
    args += ["-o", "markers=requires_trainable_backend"]
    results: dict = {"backend": backend}
    configs = (("mha",) if os.environ.get("DAMCHA_UPSTREAM_MHA") == "1" else ()) + tuple(CONFIGS)
    # Keras's test case clears Keras's global state (layer name counters, seeds, dtype
    # policy) before each test: put the process's back, for the tests run after it here.
    state = (global_state.GLOBAL_STATE_TRACKER, global_state.GLOBAL_SETTINGS_TRACKER)
    try:
        for config in configs:
            proxy = types.ModuleType("layers")
            proxy.__getattr__ = lambda name: getattr(real_layers, name)  # type: ignore[method-assign]
            proxy.MultiHeadAttention = substitute(config)
            results[config] = run_pytest(args, plugins=(_Substitute(proxy),))["tests"]
    finally:
        if UPSTREAM_MODULE in sys.modules:
            sys.modules[UPSTREAM_MODULE].layers = real_layers
        global_state.GLOBAL_STATE_TRACKER, global_state.GLOBAL_SETTINGS_TRACKER = state
    return results


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(sys.argv[1], tmp)))
