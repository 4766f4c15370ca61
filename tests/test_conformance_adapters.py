"""The built-in adapters live in damcha_conformance.adapters, imported lazily;
the ports' old ConformanceAdapter names still work for one release, with a
DeprecationWarning."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import damcha_core as dc
from damcha_conformance import ReferenceAdapter, load_adapter
from damcha_conformance.adapters import BUILTIN


def test_importing_the_adapters_package_imports_no_framework():
    code = (
        "import sys, damcha_conformance.adapters as a;"
        "assert sorted(a.__all__) == a.__all__;"
        "bad = [m for m in ('torch', 'jax', 'keras', 'tensorflow', 'onnx', 'onnxruntime') if m in sys.modules];"
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


_DEPRECATED = """
import warnings
import damcha_conformance.adapters as new
import damcha_jax, damcha_keras, damcha_onnx, damcha_torch
for port, cls in ((damcha_torch, "TorchAdapter"), (damcha_jax, "JaxAdapter"), (damcha_keras, "KerasAdapter"),
                  (damcha_onnx, "OnnxAdapter")):
    assert "ConformanceAdapter" not in port.__all__, port
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = port.ConformanceAdapter
    assert old is getattr(new, cls), (port, old)
    [w] = caught
    assert w.category is DeprecationWarning and "damcha_conformance.adapters." + cls in str(w.message), w
    assert w.filename == "<string>", w.filename  # stacklevel points at the caller
    try:
        port.NoSuchName
    except AttributeError as exc:
        assert "NoSuchName" in str(exc)
    else:
        raise AssertionError("no AttributeError")
print("ok")
"""


def test_ports_keep_the_old_adapter_names_with_a_deprecation_warning():
    proc = subprocess.run(
        [sys.executable, "-c", _DEPRECATED],
        capture_output=True,
        text=True,
        env={**os.environ, "KERAS_BACKEND": "torch"},
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_load_adapter_knows_every_builtin_and_refuses_bad_specs():
    assert isinstance(load_adapter("reference"), ReferenceAdapter)
    assert set(BUILTIN) >= {
        "reference",
        "torch",
        "jax",
        "keras-tensorflow",
        "keras-jax",
        "keras-torch",
        "onnxruntime",
        "torch-cuda",
    }
    assert [n for n, b in BUILTIN.items() if b.on_request] == ["torch-cuda"]
    instance = load_adapter("_conformance_fixtures:WrongMask")
    assert instance.name == "wrong-mask"
    for spec, says in [
        ("nosuch", "module:attr"),
        ("nosuchmodule_xyz:X", "not importable"),
        ("_conformance_fixtures:Nope", "does not have"),
        ("", "Received: spec=''"),
    ]:
        with pytest.raises(dc.DamchaValueError, match=says):
            load_adapter(spec)
    # What a factory builds is checked here, so that the CLI and the pytest plugin refuse it as a
    # usage error naming the spec, instead of a FAILED run or an AttributeError from inside pytest.
    with pytest.raises(dc.DamchaValueError, match="raised RuntimeError: no such device") as info:
        load_adapter("_conformance_fixtures:make_raises")
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(
        dc.DamchaValueError, match="spec='_conformance_fixtures_broken:Port': importing it raised"
    ) as info:
        load_adapter("_conformance_fixtures_broken:Port")
    assert isinstance(info.value.__cause__, RuntimeError)
    for spec, says in [
        ("os:getcwd", "returned str: adapter lacks name"),
        ("_conformance_fixtures:make_no_unsupported", "adapter lacks unsupported"),
        ("_conformance_fixtures:no_unsupported_instance", "adapter lacks unsupported"),
    ]:
        with pytest.raises(dc.DamchaTypeError, match=f"spec='{spec}'.*{says}"):
            load_adapter(spec)
