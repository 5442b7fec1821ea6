"""Epoch checkpoints of an estimator: written at every epoch's end, read to resume.

A checkpoint ``NAME.json`` is a tensor file (:mod:`onnxgrad.training.checkpoint`: the
weights and the optimizer state named as :meth:`get_full_state` names them) and
``NAME.progress.json`` beside it: the epochs and samples seen, the shuffling generator's
state, the loss curves, and the SHA-256 of both tensor files, so that a half-written or
mixed pair is refused. The progress file is written last. In data-parallel training only
rank 0 writes; every rank reads the same files when it resumes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from onnxgrad._files import write_atomically
from onnxgrad.training.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from onnxgrad.training.distributed import rank

FORMAT = "onnxgrad.progress"
_CURVES = ("train_losses_", "validation_losses_", "validation_scores_")


class EpochCheckpoint:
    """Saves an estimator's training position at the end of every epoch (an estimator's
    ``epoch_callbacks`` entry, see :func:`checkpoint_epochs`).

    :param path: the tensor file's manifest, ending in ``.json``
    :param extra: JSON values stored with the progress (the command's starting loss)
    """

    def __init__(self, path: str | os.PathLike, extra: dict[str, Any] | None = None):
        self.path = Path(path)
        if self.path.suffix != ".json":
            raise ValueError(f"a checkpoint is named by its .json manifest, got {str(path)!r}")
        self.extra = dict(extra or {})

    @property
    def progress_path(self) -> Path:
        return self.path.with_suffix(".progress.json")

    def __call__(self, estimator) -> None:
        if rank() == 0:
            self.save(estimator)

    def save(self, estimator) -> None:
        weights = set(estimator.runner_.step.weights)
        state = estimator.get_full_state()
        save_checkpoint(
            Checkpoint(
                weights={k: v for k, v in state.items() if k in weights},
                optimizer_state={k: v for k, v in state.items() if k not in weights},
            ),
            self.path,
        )
        progress = {
            "format": FORMAT,
            "n_iter": estimator.n_iter_,
            "t": estimator.t_,
            "shuffling": estimator._shuffling.bit_generator.state,
            **{name: [float(v) for v in getattr(estimator, name)] for name in _CURVES},
            "extra": self.extra,
            "sha256": self._digests(),
        }
        text = json.dumps(progress, indent=1)
        write_atomically(self.progress_path, lambda tmp: Path(tmp).write_text(text))

    def _digests(self) -> dict[str, str]:
        files = (self.path, self.path.with_suffix(".bin"))
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}

    def restore(self, estimator) -> dict[str, Any]:
        """Put the checkpoint's weights, optimizer state, schedule, shuffling and curves
        into ``estimator`` (initialized on the same model); returns the stored ``extra``."""
        try:
            progress = json.loads(self.progress_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            where = str(self.progress_path)
            raise ValueError(f"cannot resume: {where!r} unreadable ({exc})") from exc
        if not isinstance(progress, dict) or progress.get("format") != FORMAT:
            raise ValueError(f"cannot resume: {str(self.progress_path)!r} is no progress file")
        if progress.get("sha256") != self._digests():
            raise ValueError(
                f"cannot resume: {str(self.path)!r} and its data do not match the progress "
                f"file {str(self.progress_path)!r} (half-written or mixed checkpoint)"
            )
        checkpoint = load_checkpoint(self.path)
        estimator.set_state({**checkpoint.weights, **checkpoint.optimizer_state})
        estimator.n_iter_ = int(progress["n_iter"])
        estimator.t_ = progress["t"]
        estimator._shuffling.bit_generator.state = progress["shuffling"]
        for name in _CURVES:
            setattr(estimator, name, [float(v) for v in progress[name]])
        return dict(progress.get("extra", {}))


def checkpoint_epochs(estimator, path: str | os.PathLike, extra=None) -> EpochCheckpoint:
    """Make ``estimator`` write ``path`` at the end of every epoch from now on."""
    saver = EpochCheckpoint(path, extra)
    estimator.epoch_callbacks = [saver]
    return saver


__all__ = ["EpochCheckpoint", "checkpoint_epochs"]
