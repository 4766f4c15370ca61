"""ONNX files: external data for large models, atomic writes, clear errors for unreadable files and bad feeds."""

from __future__ import annotations

import os
import stat

import numpy as np
import onnx
import pytest

import damcha_core as dc
import damcha_onnx as do
import damcha_onnx._io as onnx_io
from damcha_conformance import tolerance

CONFIG = dc.DamchaConfig(query_dim=16, num_heads=4, key_dim=4)


def _params(seed=0):
    params = dc.init_params(CONFIG, seed)
    params["metric.qk.gate"] = np.full(4, 0.5)  # open: the metric matters
    return params


def _x(seed=0):
    return np.random.default_rng(seed).normal(size=(2, 5, 16))


def _check_matches(model_or_path, params, **run):
    x = _x()
    expected = dc.damcha_attention(params, CONFIG, x, causal=True)
    out = do.run_ort(model_or_path, {"query": x}, **run)
    assert tolerance("float32").output_ratio(out, expected)[1] <= 1


# ----------------------------------------------------------- external data


def test_external_data_on_request(tmp_path):
    path = tmp_path / "layer.onnx"
    model = do.export(_params(), CONFIG, path, causal=True, external_data=True)
    data = tmp_path / "layer.onnx.data"
    assert data.is_file() and data.stat().st_size > 0
    assert path.stat().st_size < data.stat().st_size  # the weights left the .onnx file
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    _check_matches(path, _params())
    _check_matches(onnx.load(path), _params())  # onnx.load reads the data file beside it
    do.validate_model(onnx.load(path))
    with pytest.raises(dc.DamchaValueError, match="expected the path of the .onnx file of a model with external data"):
        do.run_ort(model, {"query": _x()})  # the returned proto refers to the file; run it from its path
    with pytest.raises(
        dc.DamchaValueError, match="Invalid argument `path`: expected a file path for a model saved with external data"
    ):
        do.export(_params(), CONFIG, None, causal=True, external_data=True)


@pytest.mark.parametrize("exporter", ["layer", "encoder", "token_model"])
def test_external_data_chosen_automatically_above_the_limit(tmp_path, monkeypatch, exporter):
    # Lowered threshold: the same code path as a model over protobuf's 2 GiB,
    # which onnx.save_model refuses with a raw EncodeError (and which cannot
    # even be held as one ModelProto: its initialisers are never assembled inline).
    monkeypatch.setattr(onnx_io, "EXTERNAL_DATA_THRESHOLD", 2000)
    path = tmp_path / "big.onnx"
    if exporter == "layer":
        do.export(_params(), CONFIG, path, causal=True)
        _check_matches(path, _params())
        with pytest.raises(dc.DamchaValueError, match="too many for one protobuf"):
            do.build_model(_params(), CONFIG, causal=True)
    elif exporter == "encoder":
        enc = dc.EncoderConfig(CONFIG, num_layers=2, ffn_dim=24, causal=True)
        params = dc.init_encoder_params(enc, 1)
        do.export_encoder(params, enc, path)
        x = _x()
        assert (
            tolerance("float32").output_ratio(do.run_ort(path, {"query": x}), dc.encoder_forward(params, enc, x))[1]
            <= 1
        )
    else:
        tm = dc.TokenModelConfig(dc.EncoderConfig(CONFIG, num_layers=1, ffn_dim=24, causal=True), 50, 8, 3)
        params = dc.init_token_model_params(tm, 1)
        do.export_token_model(params, tm, path, kv_cache=True)
        tokens = np.array([[1, 4, 9, 2]])
        out = do.run_ort(path, {"tokens": tokens, **do.empty_kv_cache(path, 1)})
        assert tolerance("float32").output_ratio(out, dc.token_model_forward(params, tm, tokens))[1] <= 1
    assert (tmp_path / "big.onnx.data").is_file()
    assert sorted(os.listdir(tmp_path)) == ["big.onnx", "big.onnx.data"]  # no staging left behind
    monkeypatch.setattr(onnx_io, "PROTOBUF_LIMIT", 2000)
    with pytest.raises(dc.DamchaValueError, match="external_data=False"):
        do.export(_params(), CONFIG, tmp_path / "forced.onnx", causal=True, external_data=False)
    assert not (tmp_path / "forced.onnx").exists()


def _refuse_inline_saves_over(monkeypatch, limit):
    """onnx.save_model refuses (as protobuf does past 2 GiB) any model over ``limit`` bytes saved
    as one file; with its weights in an external data file it still saves."""
    serializer = onnx.serialization._ProtobufSerializer
    serialize = serializer.serialize_proto

    def limited(self, proto):
        if isinstance(proto, onnx.ModelProto) and proto.ByteSize() > limit:
            raise ValueError(f"simulated protobuf limit: {proto.ByteSize()} bytes > {limit}")
        return serialize(self, proto)

    monkeypatch.setattr(serializer, "serialize_proto", limited)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_quantising_a_model_over_the_protobuf_limit(tmp_path, monkeypatch, kind):
    # An export over 2 GiB is saved with external data; the quantisers read it back into memory and
    # wrote it for onnxruntime's quantiser as one file, which failed with protobuf's raw EncodeError
    # (checked once for real: a 2.2 GiB layer quantised to a 0.6 GiB int8 file). Simulated here: a
    # lowered threshold and an onnx.save_model that refuses large single-file models (weights of
    # 1 KiB and more, int8 ones too, leave the file as they would at full size).
    config = dc.DamchaConfig(query_dim=64, num_heads=8, key_dim=8)
    params = dc.init_params(config, 0)
    params["metric.qk.gate"] = np.full(8, 0.5)
    monkeypatch.setattr(onnx_io, "EXTERNAL_DATA_THRESHOLD", 20_000)
    path = tmp_path / "big.onnx"
    do.export(params, config, path, causal=True)
    assert (tmp_path / "big.onnx.data").is_file()
    _refuse_inline_saves_over(monkeypatch, 40_000)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 64))
    if kind == "dynamic":
        q = do.quantize_int8(path, tmp_path / "big.int8.onnx")
    else:
        calibration = [{"query": rng.normal(size=(2, 5, 64))} for _ in range(4)]
        q = do.quantize_static_int8(path, calibration, tmp_path / "big.int8.onnx")
    assert any(n.op_type in ("MatMulInteger", "DequantizeLinear") for n in q.graph.node)
    expected = dc.damcha_attention(params, config, x, causal=True)
    out = do.run_ort(tmp_path / "big.int8.onnx", {"query": x})
    assert np.sqrt(np.mean((out - expected) ** 2)) / np.sqrt(np.mean(expected**2)) < 0.1


@pytest.mark.parametrize(
    "entry",
    [
        lambda m: do.quantize_int8(m),
        lambda m: do.quantize_static_int8(m, [{"query": _x()}]),
        lambda m: do.run_reference(m, {"query": _x()}),
        lambda m: do.ort_session(m),
    ],
    ids=["quantize_int8", "quantize_static_int8", "run_reference", "ort_session"],
)
def test_an_in_memory_model_with_external_data_is_refused_by_name(tmp_path, entry):
    # export(..., external_data=True) returns a ModelProto that refers to layer.onnx.data beside
    # the file: the quantisers raised onnx's ValidationError naming a temporary folder, and
    # run_reference onnx's "LargeContainer" RuntimeError.
    model = do.export(_params(), CONFIG, tmp_path / "layer.onnx", causal=True, external_data=True)
    with pytest.raises(
        dc.DamchaValueError,
        match=r"Invalid argument `model`: expected the path of the \.onnx file of a model with external data.*"
        r"layer\.onnx\.data",
    ):
        entry(model)


def test_save_model_writes_any_model_with_external_data(tmp_path):
    model = do.export(_params(), CONFIG, None, causal=True)
    files = onnx_io.save_model(model, tmp_path / "m.onnx", external_data=True)
    assert [os.path.basename(f) for f in files] == ["m.onnx", "m.onnx.data"]
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in model.graph.initializer)  # caller's copy intact
    _check_matches(tmp_path / "m.onnx", _params())


def test_a_later_single_file_export_removes_the_stale_data_file(tmp_path):
    path = tmp_path / "layer.onnx"
    do.export(_params(), CONFIG, path, causal=True, external_data=True)
    do.export(_params(1), CONFIG, path, causal=True)
    assert not (tmp_path / "layer.onnx.data").exists()
    _check_matches(path, _params(1))


# ----------------------------------------------------------- atomic writes


def _listing(directory):
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("external", [False, True], ids=["one-file", "external-data"])
def test_a_failed_write_keeps_the_earlier_file_and_leaves_nothing(tmp_path, monkeypatch, external):
    path = tmp_path / "layer.onnx"
    do.export(_params(0), CONFIG, path, causal=True, external_data=external)
    before = {name: (tmp_path / name).read_bytes() for name in _listing(tmp_path)}

    def broken_replace(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="simulated"):
        do.export(_params(1), CONFIG, path, causal=True, external_data=external)
    monkeypatch.undo()
    assert {name: (tmp_path / name).read_bytes() for name in _listing(tmp_path)} == before  # no temp files, old bytes
    _check_matches(path, _params(0))


def _inode(path):
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


@pytest.mark.parametrize("writer", ["export", "save_model", "cli"])
def test_external_data_files_and_their_folder_are_synced_around_the_renames(tmp_path, monkeypatch, sync_events, writer):
    """The model and its data file were staged and renamed into place without a sync: a power
    loss after the rename could leave an empty or partial file under the final name, or lose
    the name. Now each file's data is on disk before its rename and the folder after it."""
    (tmp_path / "out").mkdir()
    path = tmp_path / "out" / "m.onnx"
    events = sync_events
    if writer == "export":
        do.export(_params(), CONFIG, path, causal=True, external_data=True)
    elif writer == "save_model":
        onnx_io.save_model(do.export(_params(), CONFIG, None, causal=True), path, external_data=True)
    else:
        from damcha_onnx import _cli

        params_file = tmp_path / "p.safetensors"
        dc.save_params(params_file, _params(), CONFIG)
        assert (
            _cli.main(["--params", str(params_file), "--out", str(path), "--causal", "--external-data", "always"]) == 0
        )
    monkeypatch.undo()
    finals = [str(path) + ".data", str(path)]
    renames = [i for i, (what, dest) in enumerate(events) if what == "replace" and dest in finals]
    assert [events[i][1] for i in renames][-2:] == finals, events  # the data file first
    last = renames[-1]
    for final, at in zip(finals, renames[-2:]):
        assert ("fsync", _inode(final)) in events[:at], (final, events)
    assert ("fsync", _inode(tmp_path / "out")) in events[last:], events
    _check_matches(path, _params())


def test_a_failed_export_writes_nothing(tmp_path):
    path = tmp_path / "layer.onnx"
    do.export(_params(0), CONFIG, path, causal=True)
    good = path.read_bytes()
    bad = dict(_params(1), **{"query.kernel": np.full((16, 4, 4), np.nan)})
    with pytest.raises(dc.DamchaValueError, match="query.kernel"):
        do.export(bad, CONFIG, path, causal=True)
    assert path.read_bytes() == good and _listing(tmp_path) == ["layer.onnx"]


def test_output_paths_are_checked_before_any_work(tmp_path):
    cases = [
        ("", dc.DamchaValueError, "non-empty"),
        (tmp_path, dc.DamchaValueError, "not a directory"),
        (tmp_path / "missing" / "x.onnx", dc.DamchaValueError, "existing directory"),
        (3, dc.DamchaTypeError, "file path"),
        # The CLI's --out rule: binary protobuf in a .onnx file, with a name before the suffix.
        (tmp_path / "x.json", dc.DamchaValueError, "a .onnx file path with a name before the suffix"),
        (tmp_path / ".onnx", dc.DamchaValueError, "a .onnx file path with a name before the suffix"),
        (tmp_path / "x", dc.DamchaValueError, "a .onnx file path"),
    ]
    for path, error, text in cases:
        with pytest.raises(error, match=rf"`path`.*{text}"):
            do.export(_params(), CONFIG, path, causal=True)
    assert _listing(tmp_path) == []
    # The suffix in any case, as the CLI takes it (onnx.save_model writes binary protobuf for .ONNX).
    do.export(_params(), CONFIG, tmp_path / "z.ONNX", causal=True)
    _check_matches(str(tmp_path / "z.ONNX"), _params())


def _refused_before_any_work(monkeypatch, entry, path, match):
    """``entry`` writing to ``path`` raises DamchaValueError matching ``match``
    before the model is built and validated."""
    model = do.build_model(_params(), CONFIG, causal=True)  # quantize_int8's input, built before the spy
    encoder = do.EncoderConfig(CONFIG, num_layers=1, ffn_dim=8)
    encoder_params = do.init_encoder_params(encoder, seed=0)
    checked = []
    monkeypatch.setattr(onnx.checker, "check_model", lambda *a, **k: checked.append(a))
    calls = {
        "export": lambda: do.export(_params(), CONFIG, path, causal=True),
        "export_encoder": lambda: do.export_encoder(encoder_params, encoder, path),
        "quantize_int8": lambda: do.quantize_int8(model, path),
        "save_model": lambda: onnx_io.save_model(model, path),
    }
    with pytest.raises(dc.DamchaValueError, match=match):
        calls[entry]()
    assert not checked  # refused before the model was built and validated


@pytest.mark.parametrize("entry", ["export", "export_encoder", "quantize_int8"])
def test_a_read_only_file_is_refused_before_any_work_even_for_root(tmp_path, monkeypatch, entry):
    # 0444: root could write it (os.access says yes), but its owner marked it as
    # not to be replaced; the CLI refuses it too (damcha_core._cliutil.read_only).
    read_only = tmp_path / "ro.onnx"
    read_only.write_bytes(b"keep")
    read_only.chmod(0o444)
    _refused_before_any_work(monkeypatch, entry, read_only, r"Invalid argument `path`: .*read-only.*ro\.onnx")
    assert read_only.read_bytes() == b"keep" and _listing(tmp_path) == ["ro.onnx"]


# A directory in which no file can be created, even by root: os.access says it is
# writable (for root it always does), and it is not a read-only mount either.
UNWRITABLE_DIR = "/proc/self/fd"


@pytest.mark.skipif(not os.path.isdir(UNWRITABLE_DIR), reason="needs Linux's /proc")
@pytest.mark.parametrize("entry", ["export", "export_encoder", "quantize_int8", "save_model"])
def test_a_directory_where_no_file_can_be_created_is_refused_before_any_work(monkeypatch, entry):
    """check_path asked os.access, which answers yes for root: the export did all
    its work, then failed with a raw FileNotFoundError when it wrote. A file is
    now created (and removed) there first."""
    with pytest.raises(OSError), open(os.path.join(UNWRITABLE_DIR, "probe.onnx"), "xb"):
        pass  # the premise: the directory really takes no file
    match = (
        r"^Invalid argument `path`: expected a path in a writable directory\. "
        r"Received: path='/proc/self/fd/m\.onnx' \(no file can be created in '/proc/self/fd'\)$"
    )
    _refused_before_any_work(monkeypatch, entry, os.path.join(UNWRITABLE_DIR, "m.onnx"), match)


@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "named"])
def test_the_directory_probe_leaves_no_file_and_keeps_the_users(tmp_path, monkeypatch, tmpfile):
    """check_path creates a file of its own in the directory (a nameless O_TMPFILE
    one, or where that is not supported a fresh name opened with O_EXCL, never an
    existing file) and removes it: the directory is as it was, the user's file
    of the target's name untouched."""
    import tempfile

    monkeypatch.setattr(tempfile, "_O_TMPFILE_WORKS", tmpfile and hasattr(os, "O_TMPFILE"))
    opened = []
    real = os.open

    def spy(file, flags, *args, **kwargs):
        name = os.fspath(file)
        if name == str(tmp_path) or os.path.dirname(name) == str(tmp_path):
            opened.append((name, flags))
        return real(file, flags, *args, **kwargs)

    (tmp_path / "mine.onnx").write_bytes(b"keep")
    monkeypatch.setattr(os, "open", spy)
    for _ in range(3):
        assert onnx_io.check_path(tmp_path / "mine.onnx") == str(tmp_path / "mine.onnx")
        assert onnx_io.check_path(tmp_path / "new.onnx") == str(tmp_path / "new.onnx")
    monkeypatch.undo()
    assert _listing(tmp_path) == ["mine.onnx"] and (tmp_path / "mine.onnx").read_bytes() == b"keep"
    assert len(opened) >= 6, opened  # a file was really created, on each check
    for name, flags in opened:
        nameless = name == str(tmp_path) and hasattr(os, "O_TMPFILE") and flags & os.O_TMPFILE == os.O_TMPFILE
        fresh = flags & os.O_EXCL and os.path.basename(name) not in ("mine.onnx", "new.onnx")
        assert nameless or fresh, (name, flags)


def test_files_get_the_users_umask(tmp_path):
    old = os.umask(0o022)
    try:
        do.export(_params(), CONFIG, tmp_path / "a.onnx", causal=True)
        do.export(_params(), CONFIG, tmp_path / "b.onnx", causal=True, external_data=True)
    finally:
        os.umask(old)
    for name in ("a.onnx", "b.onnx", "b.onnx.data"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name


def test_a_replaced_model_keeps_its_permissions_and_a_link_is_written_through(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    real = store / "layer.onnx"
    do.export(_params(1), CONFIG, real, causal=True)
    real.chmod(0o600)
    link = tmp_path / "current.onnx"
    link.symlink_to(real)
    do.export(_params(2), CONFIG, link, causal=True)
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert stat.S_IMODE(real.stat().st_mode) == 0o600
    _check_matches(link, _params(2))
    assert sorted(p.name for p in store.iterdir()) == ["layer.onnx"]  # no staging folder or temporary file left
    do.export(_params(3), CONFIG, real, causal=True, external_data=True)  # an external-data export too keeps them
    assert stat.S_IMODE(real.stat().st_mode) == 0o600
    _check_matches(real, _params(3))


def test_a_link_into_a_missing_folder_is_refused_before_any_work(tmp_path):
    link = tmp_path / "current.onnx"
    link.symlink_to(tmp_path / "gone" / "layer.onnx")
    with pytest.raises(dc.DamchaValueError, match=r"a symbolic link into an existing, writable folder.*gone"):
        do.export(_params(), CONFIG, link, causal=True)
    (tmp_path / "a.onnx").symlink_to(tmp_path / "b.onnx")
    (tmp_path / "b.onnx").symlink_to(tmp_path / "a.onnx")
    with pytest.raises(dc.DamchaValueError, match=r"a path that resolves to a file.*Too many levels of symbolic links"):
        do.export(_params(), CONFIG, tmp_path / "a.onnx", causal=True)
    (tmp_path / "p").symlink_to(tmp_path / "q")
    (tmp_path / "q").symlink_to(tmp_path / "p")
    with pytest.raises(dc.DamchaValueError, match=r"a path that resolves to a file.*Too many levels of symbolic links"):
        dc.save_params(tmp_path / "p", dc.init_params(CONFIG), CONFIG)
    for name in ("a.onnx", "b.onnx", "p", "q"):
        (tmp_path / name).unlink()
    params_link = tmp_path / "current.safetensors"
    params_link.symlink_to(tmp_path / "gone" / "p.safetensors")
    with pytest.raises(dc.DamchaValueError, match=r"a symbolic link into an existing, writable folder.*gone"):
        dc.save_params(params_link, dc.init_params(CONFIG), CONFIG)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current.onnx", "current.safetensors"]


@pytest.mark.parametrize("external_data", [False, True], ids=["one-file", "external-data"])
def test_a_read_only_data_file_beside_path_is_neither_replaced_nor_removed(tmp_path, external_data):
    # A one-file export removes a stale <path>.data, an external-data export replaces it: a read-only
    # one is refused by name before any work, as a read-only path is (damcha export refuses it too).
    data = tmp_path / "layer.onnx.data"
    data.write_bytes(b"old")
    data.chmod(0o444)
    with pytest.raises(dc.DamchaValueError, match=r"data file is not read-only.*layer\.onnx\.data' is read-only"):
        do.export(_params(), CONFIG, tmp_path / "layer.onnx", causal=True, external_data=external_data)
    assert data.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["layer.onnx.data"]


# ----------------------------------------------------------- unreadable files


def _bad_files(tmp_path):
    good = tmp_path / "good.onnx"
    do.export(_params(), CONFIG, good, causal=True)
    raw = good.read_bytes()
    files = {"directory": tmp_path, "missing": tmp_path / "nothing.onnx"}
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"this is not a protobuf \x00\xff" * 10)
    files["garbage"] = garbage
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    files["empty"] = empty
    for frac in (0.1, 0.5, 0.9, 0.999):
        cut = tmp_path / f"cut{frac}.onnx"
        cut.write_bytes(raw[: int(len(raw) * frac)])
        files[f"truncated-{frac}"] = cut
    no_data = tmp_path / "nodata.onnx"
    do.export(_params(), CONFIG, no_data, causal=True, external_data=True)
    os.remove(tmp_path / "nodata.onnx.data")
    files["missing-external-data"] = no_data
    return files


@pytest.mark.parametrize("entry", ["run_ort", "ort_session", "run_reference", "empty_kv_cache", "quantize_int8"])
def test_unreadable_model_files_name_the_path(tmp_path, entry):
    calls = {
        "run_ort": lambda p: do.run_ort(p, {"query": _x()}),
        "ort_session": lambda p: do.ort_session(p),
        "run_reference": lambda p: do.run_reference(p, {"query": _x()}),
        "empty_kv_cache": lambda p: do.empty_kv_cache(p, 1),
        "quantize_int8": lambda p: do.quantize_int8(p),
    }
    for kind, path in _bad_files(tmp_path).items():
        with pytest.raises(dc.DamchaValueError) as info:
            calls[entry](path)
        message = str(info.value)
        assert "`model`" in message and repr(os.fspath(path)) in message, (kind, message)
        assert len(message) < 600, (kind, message)


def test_bad_inputs_are_described_by_shape_never_printed():
    model = do.export(_params(), CONFIG, None, causal=True, mask=True)
    big = np.arange(2 * 5 * 16, dtype=np.float64).reshape(2, 5, 16) + 0.25
    mask = np.ones((2, 1, 1, 5), dtype=np.float64)
    bad = [
        [big],
        (big, mask),
        {"query": big.tolist(), "mask": mask.tolist()},  # a float mask as nested lists
        {"query": big.astype(int).tolist(), "mask": mask.astype(bool)},
        {"query": [[1.0, 2.0], [3.0]], "mask": mask.astype(bool)},  # ragged
    ]
    for inputs in bad:
        with pytest.raises(dc.DamchaError) as info:
            do.run_ort(model, inputs)
        message = str(info.value)
        assert "shape=" in message or "len=" in message, message
        assert "0.25" not in message and "80.25" not in message and len(message) < 400, message


# ----------------------------------------------------------- what a model says about itself


def _layer_file(tmp_path, **options):
    # cross-attention with value tokens of their own: every kind of input at once
    extra = {"context_dim": 6, "value_input_dim": 5} if options.get("cross") else {}
    cfg = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4, **extra)
    path = tmp_path / "m.onnx"
    do.export(dc.init_params(cfg), cfg, path, **options)
    return path


def _stack_file(tmp_path, kind, **options):
    attn = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    encoder = do.EncoderConfig(attn, num_layers=2, ffn_dim=12, causal=options.pop("causal", False))
    path = tmp_path / "m.onnx"
    if kind == "encoder":
        do.export_encoder(do.init_encoder_params(encoder, 1), encoder, path, **options)
    else:
        config = do.TokenModelConfig(encoder, vocab_size=11, max_len=9, num_classes=3)
        do.export_token_model(do.init_token_model_params(config, 1), config, path, **options)
    return path


@pytest.mark.parametrize(
    "make, props",
    [
        (
            lambda t: _layer_file(t, dtype="float16", mask="padding", return_weights=True),
            {
                "damcha_dtype": "float16",
                "damcha_mask": "padding",
                "damcha_return_weights": "True",
                "damcha_cross": "False",
            },
        ),
        (
            lambda t: _layer_file(t, cross=True, mask=True),
            {"damcha_dtype": "float32", "damcha_mask": "4d", "damcha_return_weights": "False", "damcha_cross": "True"},
        ),
        (
            lambda t: _layer_file(t, causal=True, kv_cache=True, dtype="float64"),
            {"damcha_dtype": "float64", "damcha_mask": "none", "damcha_kv_cache": "True", "damcha_causal": "True"},
        ),
        (
            lambda t: _stack_file(t, "encoder", mask="padding", return_weights=True),
            {
                "damcha_dtype": "float32",
                "damcha_mask": "padding",
                "damcha_return_weights": "True",
                "damcha_num_layers": "2",
            },
        ),
        (
            lambda t: _stack_file(t, "token_model", causal=True, kv_cache=True, mask=True),
            {"damcha_mask": "4d", "damcha_kv_cache": "True", "damcha_vocab_size": "11"},
        ),
    ],
    ids=[
        "layer-padding-weights-f16",
        "layer-cross-4d",
        "layer-decode-step",
        "encoder-padding-weights",
        "token-decode-4d",
    ],
)
def test_every_input_and_output_is_described_and_the_export_options_are_in_the_metadata(tmp_path, make, props):
    import onnxruntime as ort

    path = make(tmp_path)
    model = onnx.load(path)
    for value in [*model.graph.input, *model.graph.output]:
        assert value.doc_string.strip(), f"{value.name} has no doc_string"
    for value in model.graph.input:
        if value.name.startswith("past_"):
            suffix = (
                value.name[len("past_key") :] if value.name.startswith("past_key") else value.name[len("past_value") :]
            )
            kind = "key" if value.name.startswith("past_key") else "value"
            present = next(v for v in model.graph.output if v.name == f"present_{kind}{suffix}")
            assert value.name in present.doc_string  # says which input it feeds at the next step
    # read by an independent consumer: onnxruntime's model metadata
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    metadata = session.get_modelmeta().custom_metadata_map
    assert {k: metadata.get(k) for k in props} == props
