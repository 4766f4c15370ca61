"""NaN in gives NaN out on every torch path (issue 11): fused, explicit, decode, compiled.

torch's CPU SDPA kernel returns 0, not NaN, for a query row whose logits are
all NaN (it reads them as masked), and the cross-head map spreads one NaN
weight over every row; before the fix, one NaN weight gave output =
out_proj.bias and loss 0 while the gradients were NaN.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from damcha_core import DamchaValueError
from damcha_torch import DamchaAttention, DamchaKVCache, build_encoder, damcha_attention, softmax_attend

E, H = 16, 4


def _layer(batch_first: bool = True, training: bool = False, **kw) -> DamchaAttention:
    """A seeded layer with every gate opened to 0.5 (the map does its full work)."""
    torch.manual_seed(0)
    layer = DamchaAttention(E, H, batch_first=batch_first, **kw).train(training)
    with torch.no_grad():
        for gate in layer.metric_gates.values():
            gate.fill_(0.5)
    return layer


def _poison(layer: DamchaAttention, where: str) -> None:
    with torch.no_grad():
        if where == "generator":
            next(iter(layer.metric_generators.values())).weight[0, 0] = float("nan")
        elif where == "query-weight":
            layer._proj_weights()[0][0, 0] = float("nan")
        elif where == "key-weight":
            layer._proj_weights()[1][0, 0] = float("nan")
        elif where == "gate":
            next(iter(layer.metric_gates.values()))[0] = float("inf")


PATHS = ["fused", "weights", "decode", "fused-causal", "fused-padding"]


def _run(layer: DamchaAttention, x: torch.Tensor, path: str) -> torch.Tensor:
    if path == "decode":
        cache = DamchaKVCache()
        return torch.cat(
            [
                layer(
                    x[:, i : i + 1],
                    x[:, i : i + 1],
                    x[:, i : i + 1],
                    is_causal=True,
                    need_weights=False,
                    kv_cache=cache,
                )[0]
                for i in range(x.shape[1])
            ],
            1,
        )
    kw = {"need_weights": path == "weights"}
    if path == "fused-causal":
        kw["is_causal"] = True
    if path == "fused-padding":
        pad = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool)
        pad[:, -1] = True
        kw["key_padding_mask"] = pad
    return layer(x, x, x, **kw)[0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["generator", "query-weight", "key-weight", "gate"])
def test_a_non_finite_weight_gives_nan_outputs_and_loss(where, path):
    layer = _layer()
    _poison(layer, where)
    x = torch.randn(2, 5, E)
    out = _run(layer, x, path)
    assert torch.isnan(out).all(dim=-1).all(), out  # every output row, not only some
    assert torch.isnan(out.square().mean())


@pytest.mark.parametrize("path", PATHS)
def test_a_nan_token_gives_nan_in_the_rows_that_read_it(path):
    layer = _layer(coupling="separate")
    x = torch.randn(2, 5, E)
    x[1, 0, 3] = float("nan")  # batch 1, token 0: every query of batch 1 sees key 0
    out = _run(layer, x, path)
    assert torch.isnan(out[1]).all()
    assert torch.isfinite(out[0]).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", ["attn_mask", "key_padding_mask", "mask"])
def test_eager_cpu_refuses_nan_or_inf_in_a_float_mask(name, bad):
    """Where the forward reads mask values (eager, CPU) a NaN or +inf, which would make its rows
    NaN, is a mask error, as in the jax and keras ports (tests/test_cross_port_hardening.py)."""
    layer = _layer()
    x = torch.randn(2, 5, E)
    mask = torch.zeros((2, 5) if name == "key_padding_mask" else (5, 5))
    mask[1, 3] = bad
    with pytest.raises(
        DamchaValueError, match=f"Invalid argument `{name}`.*holding {'NaN' if bad != bad else '[+]inf'}"
    ):
        if name == "mask":
            params = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in layer.to_canonical().items()}
            damcha_attention(params, layer.config, x, mask=mask)
        else:
            layer(x, x, x, need_weights=False, **{name: mask})
    mask[1, 3] = float("-inf")  # -inf hides the key: fine
    if name != "mask":
        assert torch.isfinite(layer(x, x, x, need_weights=False, **{name: mask})[0]).all()
    # The is_causal hint's 2-D mask is never read (nn.MultiheadAttention's contract): not checked either.
    if name == "attn_mask":
        mask[1, 3] = bad
        out, _ = layer(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(7,), (3, 37), (2, 3, 64, 67)], ids=["1d", "2d", "4d"])
def test_mask_value_check_finds_every_nan_and_inf_entry(shape, dtype):
    """The check reads row maxima (vectorised; a max propagates NaN): a NaN or +inf anywhere,
    in any lane of the vector loop and beside -inf entries, is found; -inf and finite values
    are not. Against the entrywise definition, for every position of a small mask and random
    positions of larger ones."""
    from damcha_torch._functional import check_mask_values

    g = torch.Generator().manual_seed(sum(shape))
    base = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    base[torch.rand(shape, generator=g) < 0.3] = float("-inf")
    check_mask_values("attn_mask", base)  # finite and -inf only
    flat = list(range(base.numel())) if base.numel() < 300 else torch.randperm(base.numel(), generator=g)[:40]
    for bad in (float("nan"), float("inf")):
        for i in flat:
            mask = base.clone()
            mask.view(-1)[int(i)] = bad
            assert not bool((mask < float("inf")).all())  # the entrywise definition
            with pytest.raises(DamchaValueError, match="holding " + ("NaN" if bad != bad else "[+]inf")):
                check_mask_values("attn_mask", mask)


@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
def test_a_nan_in_a_float_attn_mask_gives_nan_as_mha_does_where_values_are_not_read(need_weights):
    """Compiled (or traced, or on a GPU) the mask's values are not read (a host sync per call);
    there, MHA's rule: it adds the float mask to the logits, so a NaN poisons its row; it is not
    'every key hidden' (the rule that gives output 0)."""
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    layer = DamchaAttention.from_mha(mha).eval()
    x = torch.randn(2, 5, E)
    mask = torch.zeros(5, 5)
    mask[1, 2] = float("nan")  # one entry of row 1
    mask[3, :] = float("nan")  # all of row 3
    mask[4, :] = float("-inf")  # row 4 genuinely hidden
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad():
        out, _ = compiled(x, x, x, attn_mask=mask, need_weights=need_weights)
    expected, _ = mha(x, x, x, attn_mask=mask, need_weights=True)  # MHA's explicit path
    assert torch.isnan(out[:, [1, 3]]).all() and torch.isnan(expected[:, [1, 3]]).all()
    torch.testing.assert_close(out[:, [0, 2]], expected[:, [0, 2]], rtol=1e-5, atol=1e-6)
    # the all-masked rule holds for the genuinely hidden row: attention output 0
    torch.testing.assert_close(out[:, 4], layer.out_proj.bias.expand(2, E), rtol=0, atol=0)


def test_softmax_attend_propagates_nan_keys_and_queries():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    q_nan = q.clone()
    q_nan[0, 0, 1] = float("nan")  # every logit of row 1, head 0 is NaN: the kernel alone returns 0
    o, _ = softmax_attend(q_nan, k, v)
    assert torch.isnan(o[0, 0, 1]).all() and torch.isfinite(o[0, 0, [0, 2, 3]]).all()
    k_nan = k.clone()
    k_nan[..., 0] = float("nan")  # every key NaN
    o, _ = softmax_attend(q, k_nan, v, causal=True)
    assert torch.isnan(o).all()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_layer_keeps_nan(backend):
    layer = _layer()
    _poison(layer, "generator")
    x = torch.randn(2, 5, E)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    with torch.no_grad():
        out, _ = compiled(x, x, x, need_weights=False, is_causal=True)
    assert torch.isnan(out).all()


def test_encoder_stack_with_a_nan_weight_gives_nan_loss_and_all_masked_rows_stay_finite():
    torch.manual_seed(3)
    enc = build_encoder(E, H, 2, dim_feedforward=32, dropout=0.0).eval()
    x = torch.randn(2, 5, E)
    hidden = torch.zeros(5, 5, dtype=torch.bool)
    hidden[2] = True  # query 2 sees no key: a finite row by the all-masked rule
    out = enc(x, mask=hidden)
    assert torch.isfinite(out).all()
    with torch.no_grad():
        enc.layers[0].self_attn.metric_generators["qk"].bias[0] = float("nan")
        enc.layers[0].self_attn.metric_gates["qk"].fill_(0.5)
    assert torch.isnan(enc(x)).all()


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "training"])
def test_a_nan_query_gives_nan_in_its_own_output_row_only(batch_first, grad):
    """Cross-attention without a mask guards the output rows (the fused path's
    NaN guard on y, not on o): the row of a NaN query is NaN, in either token
    layout, and every other row, which reads only finite keys, stays finite;
    a NaN key of the context makes its whole batch entry NaN."""
    layer = _layer(batch_first=batch_first, training=grad)
    x, c = torch.randn(2, 5, E), torch.randn(2, 3, E)
    x[1, 2, 0] = float("nan")
    c2 = c.clone()
    c2[0, 1, 5] = float("nan")

    def run(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        if not batch_first:
            q, kv = q.transpose(0, 1), kv.transpose(0, 1)
        with torch.set_grad_enabled(grad):
            out = layer(q, kv, kv, need_weights=False)[0]
        return out if batch_first else out.transpose(0, 1)

    out = run(x, c)
    nan_rows = torch.isnan(out).any(dim=-1)
    expected = torch.zeros(2, 5, dtype=torch.bool)
    expected[1, 2] = True
    assert torch.equal(nan_rows, expected), nan_rows
    assert torch.isnan(out[1, 2]).all()
    out = run(x, c2)
    assert torch.isnan(out[0]).all() and torch.isnan(out[1, 2]).all()
    assert torch.isfinite(out[1, :2]).all() and torch.isfinite(out[1, 3:]).all()


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "training"])
@pytest.mark.parametrize("kind", ["padding", "bool-mask"])
def test_rows_a_mask_empties_give_the_bias_and_nan_reaches_every_other_row_it_should(kind, grad):
    """With a mask and no causal hint the fused path guards the output rows and
    sets the rows the mask empties on y (not on o): an empty row is
    out_proj.bias exactly, a NaN query makes its own row NaN, a NaN key its
    batch entry's visible rows, and a NaN output weight every row (the
    reference's 0 * W_o + b_o for the empty ones)."""
    layer = _layer(training=grad)
    x, c = torch.randn(2, 5, E), torch.randn(2, 3, E)
    empty = torch.zeros(2, 5, dtype=torch.bool)
    if kind == "padding":
        pad = torch.zeros(2, 3, dtype=torch.bool)
        pad[1] = True  # batch entry 1 sees no key
        pad[0, 2] = True
        masks = {"key_padding_mask": pad}
        empty[1] = True
    else:
        hidden = torch.zeros(5, 3, dtype=torch.bool)
        hidden[4] = True  # query 4 sees no key
        hidden[0, 1:] = True
        masks = {"attn_mask": hidden}
        empty[:, 4] = True
    x[0, 2, 0] = float("nan")

    def run(q, kv):
        with torch.set_grad_enabled(grad):
            return layer(q, kv, kv, need_weights=False, **masks)[0].detach()

    bias = layer.out_proj.bias.detach()
    out = run(x, c)
    expected = torch.zeros(2, 5, dtype=torch.bool)
    expected[0, 2] = True
    assert torch.equal(torch.isnan(out).any(dim=-1), expected)
    assert torch.isnan(out[0, 2]).all()
    torch.testing.assert_close(out[empty], bias.expand(int(empty.sum()), E), rtol=0, atol=0)
    c2 = c.clone()
    c2[0, 0, 5] = float("nan")
    out = run(x, c2)
    assert torch.equal(torch.isnan(out).all(dim=-1), (torch.arange(2)[:, None] == 0) & ~empty)
    torch.testing.assert_close(out[empty], bias.expand(int(empty.sum()), E), rtol=0, atol=0)
    with torch.no_grad():
        layer.out_proj.weight[0, 0] = float("nan")
    assert torch.isnan(run(x, c)[..., 0]).all()
