"""Parent side of ``backend="ort"``: talks to :mod:`onnxgrad.derivative.ort.worker`.

onnxruntime-training's native code runs in a child interpreter, so that a segfault
there becomes a :class:`RuntimeError` here instead of killing the user's process. One child
serves a whole :func:`~onnxgrad.derivative.ort.backend.ort_derivative` call (builds, retries and
the final loading check).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")

_BOOTSTRAP = (
    "import json, runpy, sys; sys.path[:] = json.loads(sys.argv[2]); "
    "runpy.run_path(sys.argv[1], run_name='__main__')"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: seconds the child may take to answer one request (a build of a large model included)
TIMEOUT_S = 600.0


class BuilderError(Exception):
    """onnxruntime-training raised an error (the child is still alive)."""


class OrtCrashError(RuntimeError):
    """The child running onnxruntime-training died."""


def worker_command() -> list[str]:
    """The command starting a child with the parent's interpreter and module path."""
    return [sys.executable, "-c", _BOOTSTRAP, str(WORKER), json.dumps(sys.path)]


class OrtChild:
    """A child interpreter running onnxruntime-training; a context manager.

    :param workdir: a private directory for the child's stderr log.
    """

    def __init__(self, workdir: str | os.PathLike):
        self._stderr_path = Path(workdir) / "ort_child_stderr.txt"
        self._stderr = open(self._stderr_path, "wb")  # noqa: SIM115
        try:
            self._process = subprocess.Popen(
                worker_command(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                text=True,
            )
        except OSError as exc:
            self._stderr.close()
            raise RuntimeError(
                f"backend='ort' could not start the child process running "
                f"onnxruntime-training with {sys.executable!r}: {exc}"
            ) from exc

    def __enter__(self) -> OrtChild:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def build(
        self, model: Path, output: Path, weights: Sequence[str], inputs: Sequence[str]
    ) -> dict:
        """Build the ``YieldOp`` gradient graph of ``model`` into ``output``; its GraphInfo."""
        request = {
            "command": "build",
            "model": str(model),
            "output": str(output),
            "weights": list(weights),
            "inputs": list(inputs),
        }
        return self._call(request, "building the gradient graph")["info"]

    def load(self, model: Path) -> None:
        """Create an onnxruntime ``InferenceSession`` on ``model`` (CPU)."""
        self._call({"command": "load", "model": str(model)}, "loading the gradient graph")

    def close(self) -> None:
        """Stop the child: it holds no state worth a clean exit, and onnxruntime's own
        teardown would cost more than the build of a small model."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        for stream in (self._process.stdin, self._process.stdout, self._stderr):
            # closing flushes a request a dead child never read: BrokenPipeError
            with contextlib.suppress(OSError):
                stream.close()

    def _call(self, request: dict, activity: str) -> dict:
        try:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            self._wait_for_reply(activity)
            line = self._process.stdout.readline()
        except OSError:
            line = ""
        if not line:
            raise self._crash(activity)
        reply = json.loads(line)
        if not reply["ok"]:
            raise BuilderError(reply["error"])
        return reply

    def _wait_for_reply(self, activity: str) -> None:
        """Kill a child that neither answers nor dies within ``TIMEOUT_S`` seconds."""
        with selectors.DefaultSelector() as selector:
            selector.register(self._process.stdout, selectors.EVENT_READ)
            if selector.select(TIMEOUT_S):
                return
        self._process.kill()
        raise OrtCrashError(
            f"onnxruntime-training did not answer within {TIMEOUT_S:g} s while {activity} "
            "with backend='ort'; the child process was stopped. Use backend='onnx' for this "
            "model."
        )

    def _crash(self, activity: str) -> OrtCrashError:
        code = self._process.wait()
        if code < 0:
            how = f"signal {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        self._stderr.flush()
        log = _tail(self._stderr_path.read_text(errors="replace"))
        return OrtCrashError(
            f"onnxruntime-training crashed ({how}) while {activity} with backend='ort'; "
            "it ran in a child process, yours is unaffected. Use backend='onnx' for this "
            "model." + (f"\nLast messages of onnxruntime:\n{log}" if log else "")
        )


def _tail(text: str, lines: int = 10) -> str:
    kept = [line for line in _ANSI.sub("", text).splitlines() if line.strip()]
    return "\n".join(kept[-lines:])
