"""``--feed NAME=FILE.npy``: the inputs of a model besides ``X`` for ``onnxgrad train``.

A feed holding one row per row of ``X`` (for an input whose first dimension is free) is
batched with ``X``; any other one (a sample rate, an initial state) is fed as is with every
batch (:mod:`onnxgrad.training.running.feeds`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from onnxgrad.cli_common import CommandError, one_line

if TYPE_CHECKING:  # the parser registers --feed without loading numpy or onnx
    import numpy as np
    from onnx import ModelProto


def add_feed_option(sub) -> None:
    sub.add_argument(
        "--feed",
        action="append",
        default=[],
        metavar="NAME=FILE.npy",
        help="a value for the model input NAME besides X (repeat for several): one row per row "
        "of X is batched with it, any other array is fed as is to every batch",
    )


def read_feeds(specs: list[str]) -> dict[str, np.ndarray]:
    """``{input name: array}`` of the ``NAME=FILE.npy`` specifications."""
    import numpy as np

    feeds = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not (sep and name and path):
            raise CommandError(f"--feed {spec!r}: expected NAME=FILE.npy")
        if name in feeds:
            raise CommandError(f"--feed: input {name!r} is given twice")
        if not os.path.isfile(path):
            raise CommandError(f"--feed {spec!r}: file {path!r} does not exist")
        try:
            feeds[name] = np.load(path, allow_pickle=False)
        except Exception as exc:  # numpy raises many types for a corrupt file
            message = f"--feed {spec!r}: not a readable .npy file: {one_line(exc)}"
            raise CommandError(message) from None
        if not isinstance(feeds[name], np.ndarray):
            raise CommandError(f"--feed {spec!r}: a .npy file holding one array is expected")
    return feeds


def with_feeds(model: ModelProto, X: np.ndarray, feeds: dict[str, np.ndarray]):
    """``(X, fixed)``: ``X`` with the per-row feeds (:class:`~onnxgrad.training.running.feeds.Rows`
    when there are some), and the fixed feeds."""
    from onnxgrad._onnx_utils import real_inputs
    from onnxgrad.training.running.feeds import Rows, split_inputs

    if not feeds:
        return X, {}
    names = [i.name for i in real_inputs(model)]
    try:
        per_row, fixed = split_inputs(model, names, X, feeds)
    except ValueError as exc:
        raise CommandError(f"--feed: {exc}") from None
    return (Rows(per_row) if len(per_row) > 1 else X), fixed
