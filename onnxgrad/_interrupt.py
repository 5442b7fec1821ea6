"""Ctrl-C for the ``onnxgrad`` command: interrupt the work, never a finished result.

While a command works, SIGINT raises :class:`KeyboardInterrupt` as usual and is recorded
(a library whose import it interrupts may turn it into another error: numpy's ImportError
does). While the command imports its libraries (:func:`importing`), a Ctrl-C is held back
until the imports end: an extension module interrupted as it initializes may also crash the
interpreter (onnx's does, SIGSEGV). Once the command writes its result and says so
(:func:`finishing`), a Ctrl-C no longer interrupts it: the file is whole and announced, so
the command has succeeded, and status 130 beside a written file would contradict it.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

_received = False
_finishing = False
_importing = False


def record_sigint():
    """Install the command's SIGINT handler; return the one it replaces (None off the main
    thread, where no handler can be set)."""
    global _received, _finishing
    _received = _finishing = False

    def on_sigint(signum, frame):
        global _received
        _received = True
        if not (_finishing or _importing):
            raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGINT, on_sigint)
    except ValueError:
        return None


def restore_sigint(previous) -> None:
    """Put back the handler :func:`record_sigint` replaced."""
    global _finishing
    if previous is not None:
        signal.signal(signal.SIGINT, previous)
    _finishing = False  # after: a Ctrl-C in between finds the command still finishing


def sigint_received() -> bool:
    """Whether a Ctrl-C came since :func:`record_sigint`."""
    return _received


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """Import the command's libraries whole: a Ctrl-C during the imports is held back, then
    raised as :class:`KeyboardInterrupt` once they end (whatever error they ended with)."""
    global _importing
    _importing = True
    try:
        yield
    finally:
        _importing = False
        if _received:
            raise KeyboardInterrupt from None


@contextlib.contextmanager
def finishing() -> Iterator[None]:
    """The command's last step: write its result and say so.

    A Ctrl-C during the step is held back. When the step completes, the command has
    succeeded and stays out of Ctrl-C's reach until it returns; when the step fails
    (the atomic write leaves no file), a held-back Ctrl-C is raised instead of the error.
    """
    global _finishing
    _finishing = True
    try:
        yield
    except BaseException:
        _finishing = False
        if _received:
            raise KeyboardInterrupt from None
        raise
