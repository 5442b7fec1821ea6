"""Progress of a training loop: a tqdm bar on a terminal, plain lines elsewhere.

A bar repaints itself with carriage returns, which a log file, a pipe or torchrun's
collected output keeps as one long line mixed with whatever else is printed; there each
epoch gets one line instead. Notebooks draw the bar (their kernel is no terminal, but the
front end renders it).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TextIO


def draws_bars(stream: TextIO | None = None) -> bool:
    """Whether a progress bar written to ``stream`` (default: standard error) is drawn as a
    bar: ``stream`` is a terminal, or the code runs in a notebook's kernel."""
    stream = sys.stderr if stream is None else stream
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # closed, or no real file
        terminal = False
    return terminal or _in_notebook()


def _in_notebook() -> bool:
    """Whether the code runs in a notebook's kernel: IPython's shell there is a
    ``ZMQInteractiveShell`` (the module ``ipykernel`` alone may be imported anywhere)."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


class EpochLines:
    """Iterates over ``epochs`` like a tqdm bar; :meth:`set_postfix` prints one line for
    the current epoch (``epoch 3/10  loss 0.25  lr 0.01``) on ``file``."""

    def __init__(self, epochs: Iterable, file: TextIO | None = None):
        self._epochs = list(epochs)
        self._file = file
        self._done = 0

    def __iter__(self) -> Iterator:
        for done, epoch in enumerate(self._epochs, start=1):
            self._done = done
            yield epoch

    def set_postfix(self, **values) -> None:
        shown = "".join(f"  {name} {value}" for name, value in values.items())
        file = sys.stderr if self._file is None else self._file
        print(f"epoch {self._done}/{len(self._epochs)}{shown}", file=file, flush=True)

    def close(self) -> None:
        """Nothing to clear (a tqdm bar's ``close``)."""


def epoch_progress(epochs: Iterable, file: TextIO | None = None):
    """A tqdm bar over ``epochs`` where :func:`draws_bars`, else :class:`EpochLines`."""
    if draws_bars(file):
        from tqdm import tqdm

        return tqdm(epochs, file=file, unit="epoch")
    return EpochLines(epochs, file)
