"""The training script's `[export]`: the trained model written as a serving artifact.

    python -m hybrid.train --config configs/synthetic.toml --export artifacts/synthetic --quantize int8
    python -m hybrid.train --config ... --set checkpoint.dir=runs/x --resume --export-only --export DIR
    python -m hybrid.serving serve --artifact artifacts/synthetic --port 8000

`refuse_to_replace_export` runs before any data is read (an existing `export.dir` is
refused unless `export.overwrite` / `--overwrite`); `export_run` writes the artifact with
`hybrid.export` (after `hybrid.quantize` when `export.quantize` is set), the first
`export.max_batch_size` eval samples (default `train.batch_size`) as the example that fixes
the dense width and traces the tower. Single-process runs only (a torchrun run's tables
live in several processes).
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

from hybrid._errors import ConfigError

__all__ = ["export_run", "refuse_to_replace_export"]


def refuse_to_replace_export(config, *, processes: int = 1) -> None:
    """Refuse, before any work, an export that could not be written at the end of the run."""
    path = config.export.dir
    if not path:
        if config.export.quantize:
            raise ConfigError(
                f"export.quantize = {config.export.quantize!r} but export.dir is empty; name the "
                "artifact's directory (--export DIR or --set export.dir=DIR)"
            )
        return
    if processes > 1:
        raise ConfigError(
            "export.dir is set but exports are written by single-process runs only so far; unset it "
            "under torchrun and export from the run's checkpoint (--resume --export-only)"
        )
    if os.path.exists(path) and not config.export.overwrite:
        raise ConfigError(
            f"export.dir {path} already exists; refusing to replace it. Pass --overwrite (or --set "
            "export.overwrite=true) to replace it, or choose another directory (--export DIR)"
        )


def export_run(model, evaluation, config) -> pathlib.Path:
    """Write `model` (trained or restored) to `config.export.dir`; returns the path."""
    import hybrid

    e = config.export
    max_batch = e.max_batch_size or config.train.batch_size
    n = min(max_batch, len(evaluation))
    dense, sparse, _ = evaluation.rows(np.arange(n))
    served = model.eval()
    if e.quantize:
        served = hybrid.quantize(served, e.quantize)
    try:
        return hybrid.export(
            served,
            e.dir,
            example=(dense.cpu(), sparse),
            max_batch_size=max_batch,
            overwrite=e.overwrite,
        )
    finally:
        model.train()
