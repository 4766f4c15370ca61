"""A small DAMCHA stack trains under DistributedDataParallel (2 CPU processes, gloo)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from damcha_torch import build_encoder

WORLD, STEPS, BATCH = 2, 2, 4  # BATCH per rank


def _model_and_data():
    torch.manual_seed(0)
    model = build_encoder(16, 4, 2, dim_feedforward=32, dropout=0.0, share_metric=True)
    with torch.no_grad():  # open the gates so the generator is in the gradient path
        for layer in model.layers:
            layer.self_attn.metric_gates["qk"].fill_(0.5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, WORLD * BATCH, 6, 16, generator=g)
    return model, x


def _step(model, opt, x):
    opt.zero_grad()
    model(x, is_causal=True, mask=torch.ones(6, 6, dtype=torch.bool).triu(1)).square().mean().backward()
    opt.step()


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model, x = _model_and_data()
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        for step in range(STEPS):
            _step(ddp, opt, x[step, rank * BATCH : (rank + 1) * BATCH])
        torch.save(
            {k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out_dir, f"rank{rank}.pt")
        )
        # Every rank done before any tears down: a gloo peer that exits while the other
        # still talks to it can abort ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ddp_replicas_agree_and_match_single_process(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    # single process on the full batch: DDP's averaged gradient is the full-batch mean's
    model, x = _model_and_data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        _step(model, opt, x[step])
    reference = model.state_dict()
    for name in reference:
        torch.testing.assert_close(states[1][name], states[0][name], rtol=0, atol=0, msg=f"replicas differ: {name}")
        torch.testing.assert_close(states[0][name], reference[name], rtol=1e-5, atol=1e-6, msg=f"DDP != single: {name}")
    gate = "layers.1.self_attn.metric_gates.qk"
    assert not torch.equal(states[0][gate], before[gate])
    shared = "layers.0.self_attn.metric_generators.qk.weight"
    torch.testing.assert_close(states[0][shared], states[0]["layers.1.self_attn.metric_generators.qk.weight"])
    assert not torch.equal(states[0][shared], before[shared])
