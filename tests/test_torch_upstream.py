"""PyTorch's own module-test inputs for nn.MultiheadAttention, fed to DamchaAttention.

PyTorch's generic module suite (test/test_modules.py, not in the wheel) runs every
module in ``torch.testing._internal.common_modules.module_db`` through the same
checks: forward against the entry's reference function, gradients and second
gradients by finite differences, pickling, factory kwargs, the meta device,
parameter swapping on ``.to()``, non-contiguous inputs. The wheel ships
``module_db``; its nn.MultiheadAttention entry holds 64 inputs (bias, add_bias_kv,
add_zero_attn, batch_first, key padding and 3-D attention masks, all unbatched).
Here every one of them is run through those checks with DamchaAttention built
from the same constructor arguments, gates open (0.5) so the cross-head map is
in every output, and with gates closed against nn.MultiheadAttention itself.
The checks are written for this project after reading upstream's; nothing is copied.
"""

from __future__ import annotations

import copy
import io

import hypothesis
import pytest
import torch
from _devices import TORCH_DEVICES
from torch import nn

import damcha_torch as dt

# torch's test helpers freeze torch.backends' global flags when imported (its own
# suite sets them only inside `with flags(...)`); this worker's other tests may set
# them directly, so the freeze is undone once the module database is read.
_frozen = torch.backends.flags_frozen()
# ... and wrap TorchScript's call methods in a profiling shim: put back as well.
_script_calls = (torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__)
# ... and load hypothesis's "dev" profile (10 examples where this suite's profile asks
# 100) for every @given decorated after it in the process: put back too.
_hypothesis_profile = hypothesis.settings._current_profile
from torch.testing._internal.common_modules import module_db  # noqa: E402

torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__ = _script_calls  # type: ignore[method-assign]
if _hypothesis_profile is not None:
    hypothesis.settings.load_profile(_hypothesis_profile)

if not _frozen:
    # The flag is a global of torch.backends' functions (the module object itself may be
    # wrapped): set where flags_frozen() reads it, and checked.
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    assert not torch.backends.flags_frozen()

INFO = next(m for m in module_db if m.module_cls is nn.MultiheadAttention)


def _samples(device: str, dtype: torch.dtype, requires_grad: bool = False) -> list:
    return list(INFO.module_inputs_func(INFO, device=device, dtype=dtype, requires_grad=requires_grad, training=True))


def _sample_id(sample) -> str:
    c, f = sample.constructor_input.kwargs, sample.forward_input.kwargs
    flags = [
        "batch_first" if c["batch_first"] else "seq_first",
        "bias" if c["bias"] else "no-bias",
        *(["bias_kv"] if c["add_bias_kv"] else []),
        *(["zero_attn"] if c["add_zero_attn"] else []),
        *(["kpm"] if f.get("key_padding_mask") is not None else []),
        *(["mask3d"] if f.get("attn_mask") is not None else []),
    ]
    return "-".join(flags)


# The inputs depend on nothing but the entry: listed once, for the ids.
IDS = [_sample_id(s) for s in _samples("cpu", torch.float64)]
assert len(IDS) == len(set(IDS)) == 64, "torch's module_db entry for nn.MultiheadAttention changed"
INDEX = range(len(IDS))
DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOL = {torch.float64: {"rtol": 1e-10, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}


def _open(layer: dt.DamchaAttention, value: float = 0.5) -> dt.DamchaAttention:
    with torch.no_grad():
        for gate in layer.metric_gates.values():
            gate.fill_(value)
    return layer


def _damcha(sample, device: str, dtype: torch.dtype, seed: int) -> dt.DamchaAttention:
    c = sample.constructor_input
    torch.manual_seed(seed)
    return _open(dt.DamchaAttention(*c.args, **c.kwargs, device=device, dtype=dtype))


def _call(layer: nn.Module, sample, args=None, **extra):
    f = sample.forward_input
    return layer(*(f.args if args is None else args), **f.kwargs, **extra)


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_forward_equals_the_entrys_reference_function(device, dtype, train):
    """upstream's test_forward: the unbatched call equals the entry's reference
    (the same inputs given a batch of one), outputs and averaged weights, in
    training mode and in eval under no_grad (the layers' fused paths)."""
    for i, sample in enumerate(_samples(device, dtype)):
        layer = _damcha(sample, device, dtype, seed=i).train(train)
        with torch.set_grad_enabled(train):
            out, weights = _call(layer, sample)
            ref_out, ref_weights = sample.reference_fn(layer, *sample.forward_input.args, **sample.forward_input.kwargs)
        assert out.shape == sample.forward_input.args[0].shape, IDS[i]
        torch.testing.assert_close(out, ref_out, **TOL[dtype], msg=lambda m, i=i: f"{IDS[i]}: {m}")
        torch.testing.assert_close(weights, ref_weights, **TOL[dtype], msg=lambda m, i=i: f"{IDS[i]}: {m}")


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("metric", ["heads", "none"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_closed_gates_equal_nn_multiheadattention_on_every_input(device, metric, train):
    """A layer made from the MHA (from_mha, gates 0, or metric "none") returns
    what nn.MultiheadAttention returns for each of upstream's inputs."""
    for i, sample in enumerate(_samples(device, torch.float64)):
        c = sample.constructor_input
        torch.manual_seed(i)
        mha = nn.MultiheadAttention(*c.args, **c.kwargs, device=device, dtype=torch.float64)
        with torch.no_grad():
            for p in mha.parameters():  # upstream's zero biases would hide a bias handled wrongly
                p.normal_()
        layer = dt.DamchaAttention.from_mha(mha, metric=metric)
        mha.train(train)
        layer.train(train)
        with torch.set_grad_enabled(train):
            expected = _call(mha, sample)
            got = _call(layer, sample)
        for name, a, b in zip(("output", "weights"), got, expected):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, i=i, n=name: f"{IDS[i]} {n}: {m}")


def _functional(layer: dt.DamchaAttention, sample):
    """The output as a function of the inputs and every parameter, for gradcheck."""
    names = [n for n, _ in layer.named_parameters()]
    n_in = len(sample.forward_input.args)

    def fn(*tensors):
        params = dict(zip(names, tensors[n_in:]))
        return torch.func.functional_call(layer, params, tensors[:n_in], sample.forward_input.kwargs)

    return fn, [p.detach().clone().requires_grad_() for p in layer.parameters()]


# Second derivatives by finite differences cost ~10x the first: every option and
# mask appears in this subset (both layouts, bias, bias_kv, zero_attn, kpm, mask3d).
GRADGRAD = [
    "batch_first-bias-bias_kv-zero_attn-kpm-mask3d",
    "seq_first-no-bias-bias_kv",
    "seq_first-bias-zero_attn-kpm",
    "batch_first-no-bias-mask3d",
]


assert set(GRADGRAD) <= set(IDS), sorted(set(GRADGRAD) - set(IDS))


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("index", INDEX, ids=IDS)
def test_gradients_by_finite_differences(device, index):
    """upstream's test_grad (and test_gradgrad on a subset): float64 gradients of
    the output and averaged weights with respect to the inputs and every
    parameter (gates and generator included) match finite differences."""
    sample = _samples(device, torch.float64, requires_grad=True)[index]
    layer = _damcha(sample, device, torch.float64, seed=index)
    fn, params = _functional(layer, sample)
    inputs = [a.detach().clone().requires_grad_() for a in sample.forward_input.args] + params
    assert torch.autograd.gradcheck(fn, inputs, check_batched_grad=False)
    if IDS[index] in GRADGRAD:
        assert torch.autograd.gradgradcheck(fn, inputs, check_batched_grad=False)


@pytest.mark.parametrize("device", TORCH_DEVICES)
def test_save_load_deepcopy_and_state_dict_keep_the_outputs(device):
    """upstream's test_save_load: torch.save/torch.load of the whole module, a
    deepcopy and a state_dict loaded into a fresh layer give the same outputs,
    after a forward (the layer records its penalty) and in train and eval."""
    for i, sample in enumerate(_samples(device, torch.float64)):
        layer = _damcha(sample, device, torch.float64, seed=i)
        expected = _call(layer, sample)
        buf = io.BytesIO()
        torch.save(layer, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        fresh = _damcha(sample, device, torch.float64, seed=i + 1000)
        fresh.load_state_dict(layer.state_dict())
        for other in (loaded, copy.deepcopy(layer), fresh):
            for a, b in zip(_call(other, sample), expected):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"{IDS[i]}: {m}")


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_factory_kwargs_meta_device_and_to_empty(device, dtype):
    """upstream's test_factory_kwargs, test_device_ctx_init and test_to_empty:
    device= and dtype= reach every parameter and buffer (the gates and the
    generators too); a layer built under ``with torch.device("meta")`` has no
    storage; materialised with to_empty and reset_parameters (its generators'
    too) it holds finite values, its bias_k/bias_v drawn as MHA draws them."""
    for i, sample in enumerate(_samples(device, dtype)):
        c = sample.constructor_input
        layer = dt.DamchaAttention(*c.args, **c.kwargs, device=device, dtype=dtype)
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
            assert t.device.type == torch.device(device).type, f"{IDS[i]}: {name} on {t.device}"
            if t.is_floating_point():
                assert t.dtype == dtype, f"{IDS[i]}: {name} is {t.dtype}"
        if c.kwargs["add_bias_kv"]:  # drawn at construction (MHA's xavier_normal_), not left as memory held
            for t in (layer.bias_k, layer.bias_v):
                assert torch.isfinite(t).all() and 1e-3 < float(t.detach().abs().max()) < 100, IDS[i]
        with torch.device("meta"):
            meta = dt.DamchaAttention(*c.args, **c.kwargs, dtype=dtype)
        assert all(p.is_meta for p in meta.parameters()), IDS[i]
        meta.to_empty(device=device)
        with torch.no_grad():
            for p in meta.parameters():
                p.fill_(float("nan"))  # what uninitialised memory may hold
        for module in meta.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        bad = [n for n, p in meta.named_parameters() if not torch.isfinite(p).all()]
        assert not bad, f"{IDS[i]}: not re-initialised by reset_parameters: {bad}"
        if c.kwargs["add_bias_kv"]:
            assert float(meta.bias_k.detach().std()) > 0 and float(meta.bias_v.detach().std()) > 0, IDS[i]
        out, _ = _call(meta, sample)
        assert torch.isfinite(out).all(), IDS[i]


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("swap", [False, True], ids=["assign", "swap"])
def test_to_converts_parameters_and_their_gradients_in_place(device, swap):
    """upstream's test_to: ``.to(dtype)`` after a backward keeps each Parameter
    object (references held by an optimizer stay valid) with its data and its
    .grad converted, under torch's swap_module_params_on_conversion both off and on;
    the converted layer equals a layer built in the new dtype with the same values."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        for i, sample in enumerate(_samples(device, torch.float32)):
            layer = _damcha(sample, device, torch.float32, seed=i)
            _call(layer, sample)[0].sum().backward()
            held = dict(layer.named_parameters())
            layer.to(torch.float64)
            for name, p in layer.named_parameters():
                assert p is held[name], f"{IDS[i]}: {name} replaced by .to()"
                assert p.dtype == torch.float64, f"{IDS[i]}: {name} is {p.dtype}"
                assert p.grad is None or p.grad.dtype == torch.float64, f"{IDS[i]}: {name}.grad is {p.grad.dtype}"
            args64 = [a.double() for a in sample.forward_input.args]
            twin = _damcha(sample, device, torch.float64, seed=i)
            twin.load_state_dict(layer.state_dict())
            for a, b in zip(_call(layer, sample, args64), _call(twin, sample, args64)):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"{IDS[i]}: {m}")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("device", TORCH_DEVICES)
def test_non_contiguous_inputs_and_output_gradients(device):
    """upstream's test_non_contiguous_tensors: strided views of the inputs (and a
    strided output gradient) give the contiguous call's output and input and
    parameter gradients."""
    for i, sample in enumerate(_samples(device, torch.float64)):
        layer = _damcha(sample, device, torch.float64, seed=i)
        dense = [a.detach().clone().requires_grad_() for a in sample.forward_input.args]
        strided = [torch.stack([a, torch.zeros_like(a)], -1)[..., 0].detach().requires_grad_() for a in dense]
        assert not any(s.is_contiguous() for s in strided)
        results = []
        for inputs in (dense, strided):
            layer.zero_grad(set_to_none=True)
            out, _ = _call(layer, sample, inputs)
            grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(i), dtype=out.dtype).to(device)
            if inputs is strided:
                grad_out = grad_out.transpose(-1, -2).contiguous().transpose(-1, -2)
                assert not grad_out.is_contiguous()
            out.backward(grad_out)
            grads = [p.grad for p in layer.parameters()]
            assert all(g is not None for g in grads), IDS[i]
            results.append((out.detach(), [a.grad for a in inputs], [g.clone() for g in grads]))
        (o1, gi1, gp1), (o2, gi2, gp2) = results
        torch.testing.assert_close(o2, o1, rtol=1e-12, atol=1e-13, msg=lambda m, i=i: f"{IDS[i]} output: {m}")
        for a, b in zip(gi2 + gp2, gi1 + gp1):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=lambda m, i=i: f"{IDS[i]} gradient: {m}")


def test_reading_torchs_test_helpers_leaves_this_process_as_it_was():
    """torch.testing._internal freezes torch.backends' flags, wraps TorchScript's call
    methods and loads a hypothesis profile when imported: all are put back (a frozen flag made another test's
    `torch.backends.mkldnn` setting raise in the same pytest-xdist worker)."""
    assert torch.backends.flags_frozen() is _frozen
    assert hypothesis.settings._current_profile == _hypothesis_profile
    assert (torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__) == _script_calls
    torch.backends.mkldnn.enabled = torch.backends.mkldnn.enabled  # raised RuntimeError while frozen
