"""Reading and writing the small safetensors files Limelight keeps beside a model (a distilled
head, a fitted masked-LM head).

Through Python's own file calls rather than safetensors' ``save_file``/``load_file``: those
create files readable by their owner only (mode 0600), which a sidecar running as another user
(the image's uid 10001) cannot read, and report every failure to open — a permission refused
included — as "No such file or directory". Here a new file gets the mode the umask gives any
other file, and an unreadable one raises the ``OSError`` that says why, with its path.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load, save

from limelight.files import write_atomically


def save_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    write_atomically(Path(path), save({k: v.contiguous() for k, v in tensors.items()}))


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load(Path(path).read_bytes())
