"""Where the served checkpoint comes from: `--model-path`, or a preset written on first use.

With no `--model-path` the server and `hybrid-serve generate` use the `tiny` preset, written to
`~/.cache/hybrid-serve/tiny` (`$HYBRID_SERVE_CACHE` moves the cache).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("hybrid-serve")

DEFAULT_CACHE = Path(os.environ.get("HYBRID_SERVE_CACHE", Path.home() / ".cache" / "hybrid-serve"))


def default_model_path(preset: str = "tiny") -> Path:
    """The preset checkpoint under the cache directory, written on first use."""
    from hybrid_serve.make_model.presets import write_preset

    path = DEFAULT_CACHE / preset
    if not (path / "config.json").is_file():
        logger.info("writing the %s preset to %s", preset, path)
        write_preset(preset, path)
    return path


def checkpoint_dir(model_path: str | None) -> Path:
    """`model_path`, or the tiny preset; ValueError when it holds no checkpoint."""
    path = Path(model_path) if model_path else default_model_path("tiny")
    if not (path / "config.json").is_file():
        raise ValueError(f"no checkpoint at {path} (config.json not found)")
    return path
