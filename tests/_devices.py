"""Devices the torch tests run on: the CPU, plus CUDA where a GPU exists (the same
code path; this machine and CI have none, so there the list holds only "cpu").
On a GPU machine, ``pytest tests -k cuda`` runs every device-parametrised test there."""

from __future__ import annotations

import torch

TORCH_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
