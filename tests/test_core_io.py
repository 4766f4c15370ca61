"""safetensors I/O: round trips, and loud rejection of anything that does not match."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import damcha_core as dc

CFG = dc.DamchaConfig(
    query_dim=8, num_heads=4, key_dim=2, metric="lowrank", metric_rank=3, coupling="separate", context_dim=6
)


def test_round_trip_is_exact_and_keeps_config(tmp_path):
    params = dc.init_params(CFG, seed=7)
    params["metric.q.gate"] = np.linspace(-1, 1, 4)
    path = tmp_path / "layer.safetensors"
    dc.save_params(path, params, CFG)
    loaded, cfg = dc.load_params(path)
    assert cfg == CFG
    assert set(loaded) == set(params)
    for k in params:
        assert loaded[k].dtype == np.float64
        np.testing.assert_array_equal(loaded[k], params[k])
    # an independent reader sees canonical names and the config in the metadata
    raw = load_file(str(path))
    assert set(raw) == set(CFG.param_shapes())
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    assert meta["format"] == "damcha-v1"
    assert dc.DamchaConfig.from_dict(json.loads(meta["damcha_config"])) == CFG


def test_float32_tensors_keep_their_dtype(tmp_path):
    params = {k: v.astype(np.float32) for k, v in dc.init_params(CFG).items()}
    dc.save_params(tmp_path / "f32.safetensors", params, CFG)
    loaded, _ = dc.load_params(tmp_path / "f32.safetensors")
    assert all(v.dtype == np.float32 for v in loaded.values())
    assert set(loaded) == set(params) and all(np.array_equal(loaded[k], params[k]) for k in params)


def _rewrite(path, tensors):
    meta = {"format": "damcha-v1", "damcha_config": json.dumps(CFG.to_dict())}
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda t: t.pop("metric.k.u"), r"missing \['metric.k.u'\]"),
        (lambda t: t.__setitem__("metric.qk.gate", np.zeros(4)), r"unexpected \['metric.qk.gate'\]"),
        (
            lambda t: t.__setitem__("value.bias", np.zeros((4, 2), np.int32)),
            r"\['value.bias'\]`: expected a real floating array",
        ),
        (
            lambda t: t.__setitem__("key.kernel", np.zeros((6, 4, 3))),
            r"Invalid argument `tensors in .*\['key.kernel'\]`: expected shape \(6, 4, 2\)",
        ),
    ],
    ids=["missing", "extra", "integer-tensor", "misshaped"],
)
def test_load_rejects_missing_extra_or_misshaped(tmp_path, edit, pattern):
    tensors = dc.init_params(CFG)
    edit(tensors)
    path = tmp_path / "bad.safetensors"
    _rewrite(path, tensors)
    with pytest.raises(dc.DamchaError, match=pattern):
        dc.load_params(path)


def test_load_rejects_files_without_damcha_metadata(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"x": np.zeros(2)}, str(path))
    with pytest.raises(
        dc.DamchaValueError, match=r"Invalid argument `path`: expected a DAMCHA parameter file.*metadata keys=\[\]"
    ):
        dc.load_params(path)
    # A file of another format (transformers writes format="pt") says which one it holds.
    save_file({"x": np.zeros(2)}, str(path), metadata={"format": "pt"})
    with pytest.raises(dc.DamchaValueError, match=r"metadata keys=\['format'\], format='pt'$"):
        dc.load_params(path)


def test_save_rejects_params_that_do_not_match_config(tmp_path):
    params = dc.init_params(CFG)
    params["output.kernel"] = params["output.kernel"][:3]
    with pytest.raises(dc.DamchaValueError, match=r"output.kernel'\]`: expected shape \(4, 2, 8\)"):
        dc.save_params(tmp_path / "x.safetensors", params, CFG)
    assert not (tmp_path / "x.safetensors").exists()


# ------------------------------------------------ files that are not what they should be


def _saved(tmp_path, name="layer.safetensors"):
    path = tmp_path / name
    dc.save_params(path, dc.init_params(CFG, seed=1), CFG)
    return path


def _truncated(tmp_path):
    path = _saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-40])
    return path


def _npz(tmp_path):
    path = tmp_path / "params.npz"
    np.savez(path, **dc.init_params(CFG))
    return path


def _text(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("query.kernel = [[1, 2], [3, 4]]\n" * 20)
    return path


def _empty(tmp_path):
    path = tmp_path / "empty.safetensors"
    path.write_bytes(b"")
    return path


def _short(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x05\x00")
    return path


def _header_garbage(tmp_path):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes((16).to_bytes(8, "little") + b"{not json at all" + b"\x00" * 32)
    return path


def _bad_config(tmp_path):
    path = tmp_path / "badcfg.safetensors"
    save_file({"x": np.zeros(2)}, str(path), metadata={"format": "damcha-v1", "damcha_config": "{'query_dim': 8"})
    return path


def _invalid_config(tmp_path):
    path = tmp_path / "invalidcfg.safetensors"
    bad = {**CFG.to_dict(), "num_heads": 0}
    save_file({"x": np.zeros(2)}, str(path), metadata={"format": "damcha-v1", "damcha_config": json.dumps(bad)})
    return path


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda t: t / "missing.safetensors", r"Invalid argument `path`: expected an existing file; it does not exist"),
        (lambda t: t, r"Invalid argument `path`: expected a safetensors file, not a directory"),
        (_empty, r"expected a DAMCHA parameter file; this is not one: the file is empty"),
        (_short, r"the file is 2 bytes long, too short"),
        (_text, r"announce a \d+-byte header but the file is \d+ bytes long"),
        (_npz, r"announce a \d+-byte header|header is not safetensors JSON"),
        (_header_garbage, r"its header is not safetensors JSON"),
        (_truncated, r"the file is truncated: its header describes \d+ bytes of tensors, it holds \d+"),
        (_bad_config, r"its damcha_config metadata is not valid JSON"),
        (
            _invalid_config,
            r"its damcha_config metadata is not a valid config \(Invalid argument `num_heads`: expected an int >= 1",
        ),
    ],
    ids=[
        "missing",
        "directory",
        "empty",
        "short",
        "text",
        "npz",
        "header-garbage",
        "truncated",
        "config-json",
        "config-invalid",
    ],
)
def test_load_rejects_bad_files_naming_the_path(tmp_path, make, pattern):
    path = make(tmp_path)
    with pytest.raises(dc.DamchaValueError, match=pattern) as info:
        dc.load_params(path)
    assert f"path={str(path)!r}" in str(info.value)
    assert "\n" not in str(info.value)


def test_load_rejects_a_flipped_payload_byte_as_corrupted(tmp_path):
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # a byte of the last tensor: still a finite float, a silent change without the checksum
    path.write_bytes(bytes(data))
    with pytest.raises(
        dc.DamchaValueError,
        match=rf"Invalid argument `path`: expected an intact file; it is corrupted: .*checksum.*Received: path={str(path)!r}",
    ):
        dc.load_params(path)


def test_checksum_is_stored_and_files_without_it_still_load(tmp_path):
    from safetensors import safe_open

    params = dc.init_params(CFG, seed=2)
    path = _saved(tmp_path)
    with safe_open(str(path), framework="numpy") as f:
        stored = f.metadata()["damcha_checksum"]
    assert stored.startswith("sha256:") and len(stored) == 7 + 64
    # an independent recomputation: sha256 over (name, dtype, shape, bytes), each length-prefixed, names sorted
    import hashlib
    import struct

    raw = load_file(str(path))
    h = hashlib.sha256()
    for name in sorted(raw):
        for part in (
            name.encode(),
            raw[name].dtype.name.encode(),
            json.dumps(list(raw[name].shape)).encode(),
            raw[name].tobytes(),
        ):
            h.update(struct.pack("<Q", len(part)) + part)
    assert stored == "sha256:" + h.hexdigest()
    old = tmp_path / "old.safetensors"
    _rewrite(old, params)  # written as before the checksum existed
    loaded, cfg = dc.load_params(old)
    assert cfg == CFG and all(np.array_equal(loaded[k], params[k]) for k in params)


def test_a_changed_config_in_the_metadata_is_caught_by_its_checksum(tmp_path):
    """The tensors' checksum does not cover the damcha_config string: a one-byte change there
    (dropout 0.0 -> 0.1) loaded silently as another layer."""
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    at = data.index(b'dropout\\": 0.0') + len(b'dropout\\": 0.0') - 1  # JSON in the JSON header: escaped quotes
    data[at] = ord("1")
    path.write_bytes(bytes(data))
    with pytest.raises(
        dc.DamchaValueError,
        match=r"it is corrupted: its damcha_config does not match the checksum .*damcha_config_checksum",
    ):
        dc.load_params(path)
    old = tmp_path / "old.safetensors"
    params = dc.init_params(CFG, seed=2)
    _rewrite(old, params)  # written before the config checksum existed: still loads
    assert dc.load_params(old)[1] == CFG


def test_save_params_refuses_a_stack_config(tmp_path):
    stack = dc.EncoderConfig(dc.DamchaConfig(8, 2, 4), num_layers=2, ffn_dim=16)
    with pytest.raises(
        dc.DamchaTypeError, match=r"Invalid argument `config`: expected a DamchaConfig .*Received: config=EncoderConfig"
    ):
        dc.save_params(tmp_path / "s.safetensors", dc.init_encoder_params(stack), stack)
    assert not list(tmp_path.iterdir())


def test_save_uses_the_umask_and_replaces_atomically(tmp_path):
    import os
    import stat

    old_umask = os.umask(0o022)
    try:
        path = _saved(tmp_path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        os.umask(0o027)
        other = _saved(tmp_path, "other.safetensors")
        assert stat.S_IMODE(other.stat().st_mode) == 0o640
    finally:
        os.umask(old_umask)
    params = dc.init_params(CFG, seed=5)
    dc.save_params(path, params, CFG)  # replaces the earlier file
    assert np.array_equal(dc.load_params(path)[0]["query.kernel"], params["query.kernel"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "layer.safetensors",
        "other.safetensors",
    ]  # no temp files left


def test_failed_save_leaves_the_earlier_file_intact(tmp_path, monkeypatch):
    import os

    path = _saved(tmp_path)
    before = path.read_bytes()

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(
        dc.DamchaValueError,
        match=rf"Invalid argument `path`: expected a writable file path; it could not be written \(No space left on device\).*unchanged.*path={str(path)!r}",
    ):
        dc.save_params(path, dc.init_params(CFG, seed=9), CFG)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["layer.safetensors"]


@pytest.mark.parametrize(
    "make, error, pattern",
    [
        (lambda t: t, dc.DamchaValueError, r"Invalid argument `path`: expected a file path, not a directory"),
        (
            lambda t: t / "nowhere" / "x.safetensors",
            dc.DamchaValueError,
            r"Invalid argument `path`: expected a path in an existing folder.*does not exist",
        ),
        (lambda t: "", dc.DamchaValueError, r"Invalid argument `path`: expected a non-empty file path"),
        (lambda t: 3, dc.DamchaTypeError, r"Invalid argument `path`: expected a str or os.PathLike\. Received: path=3"),
    ],
    ids=["directory", "missing-folder", "empty", "type"],
)
def test_save_rejects_unusable_paths(tmp_path, make, error, pattern):
    with pytest.raises(error, match=pattern):
        dc.save_params(make(tmp_path), dc.init_params(CFG), CFG)


@pytest.mark.parametrize("existing", [True, False], ids=["link-to-file", "dangling-link"])
def test_save_through_a_symbolic_link_writes_its_file_and_keeps_the_link(tmp_path, existing):
    # As open(path, "w") and safetensors' own save_file do: the link is not cut from its file.
    store = tmp_path / "store"
    store.mkdir()
    real = _saved(store, "weights.safetensors") if existing else store / "weights.safetensors"
    link = tmp_path / "current.safetensors"
    link.symlink_to(real)
    params = dc.init_params(CFG, seed=11)
    dc.save_params(link, params, CFG)
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert np.array_equal(dc.load_params(real)[0]["query.kernel"], params["query.kernel"])
    assert sorted(p.name for p in store.iterdir()) == ["weights.safetensors"]  # no temporary file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current.safetensors", "store"]


def test_save_refuses_a_read_only_target(tmp_path):
    path = _saved(tmp_path)
    before = path.read_bytes()
    path.chmod(0o444)
    with pytest.raises(
        dc.DamchaValueError,
        match=rf"Invalid argument `path`: expected a path that is not a read-only file \(it is not replaced\)\. Received: path={str(path)!r}",
    ):
        dc.save_params(path, dc.init_params(CFG, seed=4), CFG)
    assert path.read_bytes() == before


def test_bfloat16_files_load_without_ml_dtypes(tmp_path):
    """A Keras bfloat16 layer's file failed in damcha_core ("data type 'bfloat16' not
    understood") unless ml_dtypes happened to be imported: now the bits are widened."""
    import subprocess
    import sys

    import ml_dtypes

    params = {k: v.astype(ml_dtypes.bfloat16) for k, v in dc.init_params(CFG, seed=3).items()}
    path = tmp_path / "bf16.safetensors"
    dc.save_params(path, params, CFG)
    want = {k: v.astype(np.float32) for k, v in params.items()}
    np.savez(tmp_path / "want.npz", **want)
    script = (
        "import sys; sys.modules['ml_dtypes'] = None\n"  # as in an environment without it
        "import numpy as np, damcha_core as dc\n"
        f"p, c = dc.load_params({str(path)!r}); w = np.load({str(tmp_path / 'want.npz')!r})\n"
        "assert all(p[k].dtype == np.float32 and np.array_equal(p[k], w[k]) for k in w), 'values'\n"
        "print('ok', sorted(p) == sorted(w))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok True", proc.stderr
    # In this process too (ml_dtypes imported): the same float32 values, checksum verified.
    loaded, config = dc.load_params(path)
    assert config == CFG
    for k in want:
        assert loaded[k].dtype == np.float32
        np.testing.assert_array_equal(loaded[k], want[k])
    # A flipped bit in a bfloat16 tensor still fails the stored checksum.
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(dc.DamchaValueError, match="corrupted"):
        dc.load_params(path)


def test_load_refuses_a_named_pipe(tmp_path):
    """load_params on a FIFO blocked forever in open()."""
    import os
    import signal

    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)

    def hung(*_):
        raise AssertionError("load_params blocked on a named pipe")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)  # fail, not hang, where the refusal is missing
    try:
        with pytest.raises(dc.DamchaValueError, match="a regular file; this is a named pipe"):
            dc.load_params(fifo)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_torch_tensors_bfloat16_or_requiring_grad():
    """save_params with torch bfloat16 raised a bare TypeError after check_params accepted
    them; damcha_attention with tensors that require grad raised a bare RuntimeError."""
    torch = pytest.importorskip("torch")
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    params = dc.init_params(config, seed=0)
    bf16 = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in params.items()}
    exact = {k: v.float().numpy() for k, v in bf16.items()}
    x = np.random.default_rng(0).normal(size=(1, 3, 8))
    with pytest.raises(dc.DamchaTypeError, match=r"`query`: expected an array NumPy can read .*requires grad"):
        dc.damcha_attention(params, config, torch.from_numpy(x).requires_grad_())
    grad_params = {k: torch.from_numpy(v).requires_grad_() for k, v in params.items()}
    with pytest.raises(dc.DamchaTypeError, match=r"`params\['query.kernel'\]`: expected an array NumPy can read"):
        dc.damcha_attention(grad_params, config, x)
    # bfloat16 widens to float32 exactly, in the reference and in save_params.
    np.testing.assert_array_equal(dc.damcha_attention(bf16, config, x), dc.damcha_attention(exact, config, x))


def test_save_params_widens_torch_bfloat16(tmp_path):
    torch = pytest.importorskip("torch")
    config = dc.DamchaConfig(query_dim=8, num_heads=2, key_dim=4)
    bf16 = {k: torch.from_numpy(v).to(torch.bfloat16).requires_grad_() for k, v in dc.init_params(config).items()}
    dc.save_params(tmp_path / "t.safetensors", bf16, config)
    loaded, _ = dc.load_params(tmp_path / "t.safetensors")
    for k, v in bf16.items():
        np.testing.assert_array_equal(loaded[k], v.detach().float().numpy())


# ------------------------------------------------ headers that lie or are not safetensors' form


def _raw_file(path, header: dict, data: bytes = b""):
    """A file with ``header`` as its JSON header, unchecked (what a hostile or broken writer makes)."""
    import struct

    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


_META = {"format": "damcha-v1", "damcha_config": json.dumps(CFG.to_dict())}


def _entry(**fields):
    return {"__metadata__": _META, "query.bias": {"dtype": "F64", "shape": [4, 2], "data_offsets": [0, 64], **fields}}


@pytest.mark.parametrize(
    "header, pattern",
    [
        (_entry(data_offsets=64), r"the header entry of tensor 'query.bias' is malformed"),
        (_entry(data_offsets=[]), r"the header entry of tensor 'query.bias' is malformed"),
        (_entry(data_offsets=None), r"the header entry of tensor 'query.bias' is malformed"),
        (_entry(data_offsets={"end": 64}), r"the header entry of tensor 'query.bias' is malformed"),
        (_entry(data_offsets=[64, 0]), r"the header entry of tensor 'query.bias' is malformed"),
        (_entry(dtype="BF16", data_offsets=[-16, 0]), r"the header entry of tensor 'query.bias' is malformed"),
        (_entry(dtype="BF16", shape="ab"), r"the header entry of tensor 'query.bias' is malformed"),
        ({"__metadata__": _META, "query.bias": 5}, r"the header entry of tensor 'query.bias' is malformed"),
        (
            {"__metadata__": {"format": "damcha-v1", "damcha_config": 5}},
            r"its damcha_config metadata is not a string: 5",
        ),
        (
            {"__metadata__": {"format": "damcha-v1", "damcha_config": {"query_dim": 8}}},
            r"its damcha_config metadata is not a string",
        ),
    ],
    ids=[
        "offsets-int",
        "offsets-empty",
        "offsets-null",
        "offsets-dict",
        "offsets-reversed",
        "bf16-offsets-negative",
        "bf16-shape-string",
        "entry-not-object",
        "config-int",
        "config-object",
    ],
)
def test_load_rejects_malformed_headers_naming_the_path(tmp_path, header, pattern):
    """These escaped as TypeError, IndexError or KeyError (or, for BF16, as a message that
    held a second "Invalid argument `path`" inside the first)."""
    path = _raw_file(tmp_path / "lies.safetensors", header, b"\0" * 64)
    with pytest.raises(dc.DamchaValueError, match=pattern) as info:
        dc.load_params(path)
    message = str(info.value)
    assert message.startswith("Invalid argument `path`: expected a DAMCHA parameter file; this is not one: ")
    assert message.count("Invalid argument") == 1 and message.endswith(f"Received: path={str(path)!r}")


def test_load_rejects_a_deeply_nested_header(tmp_path):
    """json.loads raised RecursionError on "[[[[...]]]]"."""
    import struct

    text = b"[" * 50_000 + b"]" * 50_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(dc.DamchaValueError, match=r"its header is not safetensors JSON"):
        dc.load_params(path)


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2", "F4"])
def test_load_refuses_dtypes_numpy_cannot_read_by_tensor(tmp_path, dtype):
    """safetensors' NumPy reader raised a bare AttributeError (numpy has no float8_e4m3fn)."""
    tensors = {k: v.astype(np.float64) for k, v in dc.init_params(CFG).items()}
    path = tmp_path / "f8.safetensors"
    _rewrite(path, tensors)
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    header["query.bias"]["dtype"] = dtype
    begin, _ = header["query.bias"]["data_offsets"]
    header["query.bias"]["data_offsets"] = [begin, begin + 8]  # 8 one-byte values
    _raw_file(path, header, b"\0" * max(e["data_offsets"][1] for n, e in header.items() if n != "__metadata__"))
    with pytest.raises(
        dc.DamchaTypeError,
        match=rf"Invalid argument `tensors in {str(path)!r}\['query.bias'\]`: expected a real floating array "
        rf".*Received: .* of dtype '{dtype}', shape=\(4, 2\)",
    ):
        dc.load_params(path)


@pytest.mark.skipif(np.dtype(np.longdouble).itemsize <= 8, reason="long double is float64 here")
def test_save_refuses_float128_naming_the_tensor(tmp_path):
    """validate_params accepts any real float; safetensors then raised its own SafetensorError."""
    params = dc.init_params(CFG)
    params["query.bias"] = params["query.bias"].astype(np.longdouble)
    with pytest.raises(
        dc.DamchaTypeError,
        match=r"`params\['query.bias'\]`: expected an array of one of the floating dtypes a safetensors file stores",
    ):
        dc.save_params(tmp_path / "ld.safetensors", params, CFG)
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_a_ragged_list_naming_the_tensor(tmp_path):
    """np.asarray's ValueError ("inhomogeneous shape") escaped from check_params."""
    params = dict(dc.init_params(CFG))
    params["query.bias"] = [[0.0], [0.0, 1.0]]
    for call in (
        lambda: dc.save_params(tmp_path / "r.safetensors", params, CFG),
        lambda: dc.validate_params(params, CFG),
        lambda: dc.check_params(params, CFG),
    ):
        with pytest.raises(dc.DamchaTypeError, match=r"`params\['query.bias'\]`: expected an array NumPy can read"):
            call()


@pytest.mark.parametrize(
    "name, pattern",
    [
        ("a\0b.safetensors", r"expected a file path without NUL characters"),
        ("n" * 300 + ".safetensors", r"expected a usable file path; it cannot be checked \(File name too long\)"),
    ],
    ids=["nul", "name-too-long"],
)
def test_save_refuses_paths_the_os_refuses(tmp_path, name, pattern):
    """A NUL byte raised a bare ValueError, a name over 255 bytes a bare OSError."""
    with pytest.raises(dc.DamchaValueError, match=rf"Invalid argument `path`: {pattern}"):
        dc.save_params(tmp_path / name, dc.init_params(CFG), CFG)
    assert list(tmp_path.iterdir()) == []


def test_save_to_a_long_valid_name(tmp_path):
    """A 250-byte name is valid, but the temporary name beside it (".<name>.XXXXXXXX.tmp")
    was not: the write failed after the checks had passed."""
    path = tmp_path / ("n" * 238 + ".safetensors")
    dc.save_params(path, dc.init_params(CFG, seed=3), CFG)
    assert dc.load_params(path)[1] == CFG
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
