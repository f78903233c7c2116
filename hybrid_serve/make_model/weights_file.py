"""Writing one safetensors file of a checkpoint with the permissions of any other file.

`safetensors.torch.save_file` creates its file readable by its owner alone (mode 0600), unlike
the config and tokenizer files beside it; a checkpoint written by one user and served by another
(a container's user, a shared model directory) would then fail to load. `save_weights` writes
the file, then gives it the mode a new file gets from the process umask (0644 under the usual
022), as `open()` would.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def default_file_mode() -> int:
    """The mode `open()` gives a new file under this process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def save_weights(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """`save_file(tensors, path, metadata)`, the file then given `default_file_mode()`."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, default_file_mode())
