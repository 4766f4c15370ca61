"""Convert a (random-weight) Llama and a timm ViT to DAMCHA, fine-tune a few
steps with the gates in their own optimizer group, save, reload, export to
ONNX (torch.onnx.export, dynamo) and run the exports in onnxruntime.

    python examples/convert_llama_vit.py [--steps 20] [--out /tmp/damcha-models]

With real checkpoints, replace the two ``build_*`` functions by
``LlamaForCausalLM.from_pretrained(...)`` and
``timm.create_model(..., pretrained=True)``; everything else is the same.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from damcha_torch import ensure_torchvision_importable

ensure_torchvision_importable()  # timm imports torchvision (docs/models.md, "Installing on a CPU-only machine")

import onnxruntime as ort  # noqa: E402
import timm  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import damcha_torch as dt  # noqa: E402


def build_llama(size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=size,
        intermediate_size=2 * size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def build_vit(size: int) -> torch.nn.Module:
    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        embed_dim=size,
        depth=2,
        num_heads=4,
        num_classes=10,
    )


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Gates and generators get a higher learning rate than the pretrained weights."""
    damcha = dt.damcha_parameters(model)
    ids = {id(p) for p in damcha}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return torch.optim.AdamW([{"params": rest, "lr": 1e-4}, {"params": damcha, "lr": 1e-2, "weight_decay": 0.0}])


def mean_gate(model: torch.nn.Module) -> float:
    gates = dt.damcha_parameters(model, generators=False)
    return float(torch.cat([g.detach().abs().flatten() for g in gates]).mean())


def onnx_check(module: torch.nn.Module, example: torch.Tensor, other: torch.Tensor, path: str, dynamic: dict) -> float:
    """Export with the dynamo exporter, run ``other`` (another shape) in onnxruntime,
    return the largest difference from torch. Example sizes are chosen unlike any
    model size (a batch or length equal to a head size would be tied to it)."""
    module.eval()
    program = torch.onnx.export(module, (example,), dynamo=True, dynamic_shapes=(dynamic,))
    program.save(path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: other.numpy()})[0]
    with torch.no_grad():
        want = module(other).numpy()
    return float(abs(got - want).max())


class LogitsOnly(torch.nn.Module):
    """The LM as a plain tensor -> tensor function for export (no cache)."""

    def __init__(self, lm: LlamaForCausalLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=64, help="hidden size of both models")
    parser.add_argument("--out", default=None, help="folder for checkpoints and ONNX files (default: a temp dir)")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="damcha-models-")
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    results: dict = {}

    # ---- Llama: convert, fine-tune, save_pretrained, reload, ONNX
    llama = build_llama(args.size)
    ids = torch.randint(0, 128, (4, 24))
    with torch.no_grad():
        before = llama(input_ids=ids).logits
    dt.convert(llama)  # GQA: separate query/key maps; exact at init
    with torch.no_grad():
        results["llama_exact_at_init"] = bool(torch.equal(llama(input_ids=ids).logits, before))
    opt = optimizer(llama)
    llama.train()
    for _ in range(args.steps):
        loss = llama(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    llama.eval()
    results["llama_loss"], results["llama_mean_gate"] = loss.item(), mean_gate(llama)
    llama.save_pretrained(os.path.join(out, "llama"))
    reloaded = dt.from_pretrained(LlamaForCausalLM, os.path.join(out, "llama"))
    with torch.no_grad():
        results["llama_reload_equal"] = bool(torch.equal(reloaded(input_ids=ids).logits, llama(input_ids=ids).logits))
    results["llama_onnx_max_diff"] = onnx_check(
        LogitsOnly(reloaded),
        ids[:3, :7],
        torch.randint(0, 128, (2, 11)),
        os.path.join(out, "llama.onnx"),
        {0: "batch", 1: "length"},
    )

    # ---- ViT: one generator shared by all layers (stack-wise sharing), own gates
    vit = build_vit(args.size)
    images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    dt.convert(vit, share_metric=True)
    opt = optimizer(vit)
    vit.train()
    for _ in range(args.steps):
        loss = torch.nn.functional.cross_entropy(vit(images), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    vit.eval()
    results["vit_loss"], results["vit_mean_gate"] = loss.item(), mean_gate(vit)
    path = os.path.join(out, "vit.safetensors")
    save_file(vit.state_dict(), path)
    twin = dt.convert(build_vit(args.size), share_metric=True)
    twin.load_state_dict(load_file(path))  # strict: every tensor, DAMCHA ones included
    twin.eval()
    with torch.no_grad():
        results["vit_reload_equal"] = bool(torch.equal(twin(images), vit(images)))
    results["vit_onnx_max_diff"] = onnx_check(
        twin, images[:3], torch.randn(5, 3, 32, 32), os.path.join(out, "vit.onnx"), {0: "batch"}
    )
    for key, value in results.items():
        print(f"{key}: {value}")
    return results


if __name__ == "__main__":
    main()
