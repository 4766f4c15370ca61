"""examples/convert_llama_vit.py runs end to end at tiny sizes: converted models
train (gates move), reload equal, and their ONNX exports match torch in
onnxruntime at shapes other than the export's."""

from __future__ import annotations

import importlib.util
import math
import os

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "convert_llama_vit.py")


def test_convert_llama_vit_example(tmp_path):
    spec = importlib.util.spec_from_file_location("convert_llama_vit", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    r = module.main(["--steps", "2", "--size", "32", "--out", str(tmp_path)])
    assert r["llama_exact_at_init"]
    for name in ("llama", "vit"):
        assert math.isfinite(r[f"{name}_loss"])
        assert r[f"{name}_mean_gate"] > 0  # gates start at 0; training moved them
        assert r[f"{name}_reload_equal"]
        assert r[f"{name}_onnx_max_diff"] < 1e-4
    assert os.path.isfile(tmp_path / "llama.onnx") and os.path.isfile(tmp_path / "vit.onnx")


def test_keras_text_classifier_example(tmp_path, capsys):
    """examples/keras_text_classifier.py (linked from README.md) at a tiny size: it trains,
    exports a TensorFlow SavedModel and checks the reloaded model's predictions against
    the Keras model's (assert_allclose inside main); the export folder exists, and the
    example's output is its own lines (model.export printed a TensorSpec per variable)."""
    path = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "keras_text_classifier.py")
    spec = importlib.util.spec_from_file_location("keras_text_classifier", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    accuracy = module.main(epochs=1, export_dir=str(tmp_path / "saved"), samples=256)
    assert 0.0 <= accuracy <= 1.0
    assert os.path.isfile(tmp_path / "saved" / "saved_model.pb")
    out = capsys.readouterr().out
    assert "predictions match" in out and "TensorSpec" not in out, out[-2000:]
