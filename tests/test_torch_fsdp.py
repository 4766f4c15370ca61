"""DAMCHA stacks with a shared generator train under FSDP2 (``fully_shard``), per layer,
on 2 CPU processes (gloo): the result equals single-process training."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from damcha_torch import build_decoder, build_encoder, shard_stack

WORLD, STEPS, BATCH = 2, 2, 4  # BATCH per rank
CAUSAL = torch.ones(6, 6, dtype=torch.bool).triu(1)


def _model_and_data(kind: str):
    torch.manual_seed(0)
    build = build_encoder if kind == "encoder" else build_decoder
    model = build(16, 4, 2, dim_feedforward=32, dropout=0.0, share_metric=True)
    with torch.no_grad():  # open the gates so the shared generators are in the gradient path
        for name, gate in model.named_parameters():
            if "metric_gates" in name:
                gate.fill_(0.5)
    g = torch.Generator().manual_seed(1)
    return (
        model,
        torch.randn(STEPS, WORLD * BATCH, 6, 16, generator=g),
        torch.randn(STEPS, WORLD * BATCH, 5, 16, generator=g),
    )


def _step(kind, model, opt, x, memory):
    opt.zero_grad()
    out = (
        model(x, is_causal=True, mask=CAUSAL)
        if kind == "encoder"
        else model(x, memory, tgt_mask=CAUSAL, tgt_is_causal=True)
    )
    out.square().mean().backward()
    opt.step()


def _full(state):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        for kind in ("encoder", "decoder"):
            model, x, memory = _model_and_data(kind)
            shard_stack(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            rows = slice(rank * BATCH, (rank + 1) * BATCH)
            for step in range(STEPS):
                _step(kind, model, opt, x[step, rows], memory[step, rows])
            torch.save(_full(model.state_dict()), os.path.join(out_dir, f"{kind}{rank}.pt"))
        # Every rank done before any tears down: a gloo peer that exits while the other
        # still talks to it can abort ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_shard_stack_trains_like_one_process(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    for kind in ("encoder", "decoder"):
        states = [torch.load(tmp_path / f"{kind}{r}.pt") for r in range(WORLD)]
        model, x, memory = _model_and_data(kind)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(STEPS):
            _step(kind, model, opt, x[step], memory[step])
        reference = model.state_dict()
        assert set(states[0]) == set(reference)
        for name in reference:
            torch.testing.assert_close(
                states[1][name], states[0][name], rtol=0, atol=0, msg=f"{kind}: replicas differ: {name}"
            )
            torch.testing.assert_close(
                states[0][name], reference[name], rtol=1e-5, atol=1e-6, msg=f"{kind}: FSDP != single: {name}"
            )
        moved = reference["metric_generators.qk.weight"] - before["metric_generators.qk.weight"]
        assert moved.abs().max() > 1e-4, f"{kind}: the shared generator did not train"
        # still one generator for every layer after sharding and training
        assert torch.equal(
            states[0]["layers.1.self_attn.metric_generators.qk.weight"], states[0]["metric_generators.qk.weight"]
        )


def test_shard_stack_rejects_other_modules():
    from damcha_core import DamchaTypeError

    with pytest.raises(
        DamchaTypeError, match=r"Invalid argument `stack`: expected a DamchaTransformerEncoder.*Received: stack="
    ):
        shard_stack(torch.nn.Linear(2, 2))
