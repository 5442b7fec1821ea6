"""Epoch checkpoints of an estimator: written at every epoch's end, read to resume.

A checkpoint ``NAME.json`` is a tensor file (:mod:`onnxgrad.training.artifacts.checkpoint`: the
weights and the optimizer state named as :meth:`get_full_state` names them) and
``NAME.progress.json`` beside it: the epochs and samples seen, the shuffling generator's
state, the loss curves, and the SHA-256 of both tensor files, so that a half-written or
mixed pair is refused. The progress file is written last. In data-parallel training only
rank 0 writes; every rank reads the same files when it resumes.

A checkpoint to resume may come from elsewhere: its three files are read as a checkpoint's
are (:func:`onnxgrad._untrusted.read_confined`: in the folder, regular, one link, bounded,
read once), the digests are those of the bytes loaded, and every field of the progress is
checked with its type and range before anything is set (:func:`checked_progress`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from onnxgrad._files import write_atomically
from onnxgrad._untrusted import MAX_MANIFEST_BYTES, read_confined, sha256_hex
from onnxgrad.training.artifacts.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from onnxgrad.training.running.distributed import rank

FORMAT = "onnxgrad.progress"
_CURVES = ("train_losses_", "validation_losses_", "validation_scores_")
#: The largest tensor data file a checkpoint to resume may have.
MAX_DATA_BYTES = 2**40
#: The most samples a progress file may count (exact in a float64).
MAX_SAMPLES = 2**53


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
        return {name: sha256_hex(data) for name, data in self._read_tensor_files().items()}

    def _read_tensor_files(self) -> dict[str, bytes]:
        """The bytes of the tensor manifest and its data file, each read once (see the
        module docstring)."""
        folder, files = self.path.parent, {}
        for name, limit in (
            (self.path.name, MAX_MANIFEST_BYTES),
            (self._data_name, MAX_DATA_BYTES),
        ):
            files[name] = read_confined(
                folder, name, limit, "a checkpoint file", self.progress_path
            )
        return files

    @property
    def _data_name(self) -> str:
        return self.path.with_suffix(".bin").name

    def restore(self, estimator) -> dict[str, Any]:
        """Put the checkpoint's weights, optimizer state, schedule, shuffling and curves
        into ``estimator`` (initialized on the same model); returns the stored ``extra``.
        ``ValueError`` names the file and the field when anything is off."""
        where = self.progress_path
        try:
            text = read_confined(
                where.parent, where.name, MAX_MANIFEST_BYTES, "the progress file", where
            )
            progress = json.loads(text)
        except (OSError, ValueError, RecursionError) as exc:
            raise ValueError(f"cannot resume: {str(where)!r} unreadable ({exc})") from None
        files = self._read_tensor_files()
        checked = checked_progress(
            progress, where, getattr(estimator, "max_iter", None), self.extra
        )
        if checked["sha256"] != {name: sha256_hex(data) for name, data in files.items()}:
            raise ValueError(
                f"cannot resume: {str(self.path)!r} and its data do not match the progress "
                f"file {str(where)!r} (half-written or mixed checkpoint)"
            )
        checkpoint = load_checkpoint(self.path, files)
        estimator.set_state({**checkpoint.weights, **checkpoint.optimizer_state})
        try:
            estimator._shuffling.bit_generator.state = checked["shuffling"]
        except (TypeError, ValueError, KeyError, OverflowError) as exc:
            raise ValueError(
                f"cannot resume: {str(where)!r} has an invalid shuffling state ({exc})"
            ) from None
        estimator.n_iter_ = checked["n_iter"]
        estimator.t_ = checked["t"]
        for name in _CURVES:
            setattr(estimator, name, list(checked[name]))
        return dict(checked["extra"])


def checked_progress(progress: object, where: Path, max_iter, extra: dict) -> dict:
    """``progress`` once every field has its type and range: ``0 <= n_iter <= max_iter``,
    ``0 <= t <= 2**53`` integers, the shuffling state an object, each curve a list of at
    most ``n_iter`` numbers, ``extra`` holding the keys given to the saver, with values of
    the same kinds, and ``sha256`` naming the two tensor files."""
    label = f"cannot resume: {str(where)!r}"
    if not isinstance(progress, dict) or progress.get("format") != FORMAT:
        raise ValueError(f"{label} is no progress file")
    limit = max_iter if _is_int(max_iter) else MAX_SAMPLES
    n_iter, t = progress.get("n_iter"), progress.get("t")
    if not _is_int(n_iter) or not 0 <= n_iter <= limit:
        raise ValueError(
            f"{label}: n_iter is {_short(n_iter)}, expected an integer in [0, {limit}]"
        )
    if not _is_int(t) or not 0 <= t <= MAX_SAMPLES:
        raise ValueError(f"{label}: t is {_short(t)}, expected an integer in [0, {MAX_SAMPLES}]")
    if not isinstance(progress.get("shuffling"), dict):
        raise ValueError(
            f"{label}: shuffling is {_short(progress.get('shuffling'))}, expected an object"
        )
    for name in _CURVES:
        curve = progress.get(name)
        if not isinstance(curve, list) or len(curve) > n_iter or not all(map(_is_number, curve)):
            raise ValueError(
                f"{label}: {name} is {_short(curve)}, expected a list of at most {n_iter} numbers"
            )
    stored = progress.get("extra")
    if not isinstance(stored, dict) or any(
        key not in stored or _is_number(value) != _is_number(stored[key])
        for key, value in extra.items()
    ):
        raise ValueError(f"{label}: extra is {_short(stored)}, expected the keys {sorted(extra)}")
    digests = progress.get("sha256")
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        raise ValueError(f"{label}: sha256 is {_short(digests)}, expected file digests")
    return progress


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def checkpoint_epochs(estimator, path: str | os.PathLike, extra=None) -> EpochCheckpoint:
    """Make ``estimator`` write ``path`` at the end of every epoch from now on."""
    saver = EpochCheckpoint(path, extra)
    estimator.epoch_callbacks = [saver]
    return saver


__all__ = ["EpochCheckpoint", "checkpoint_epochs"]
