#!/usr/bin/env python3
"""Set up onnxgrad on a fresh machine and run its main jobs.

    python3 dev.py demo     # create .venv, install onnxgrad, run `onnxgrad demo`
    python3 dev.py test     # create .venv (+ an inference-only venv), lint, run the tests
    python3 dev.py docs     # build the API reference into docs/_build
    python3 dev.py bench    # run the benchmarks

Only the Python standard library is used here, so a newcomer needs nothing but Python.
Installation is skipped when pyproject.toml has not changed since the last one.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
INFERENCE_VENV = ROOT / ".venv-inference"
INFERENCE_PACKAGES = ["onnxruntime", "onnx", "numpy"]
SUPPORTED_PYTHON = ((3, 10), (3, 12))


def _python(env_dir: Path) -> Path:
    sub = "Scripts" if os.name == "nt" else "bin"
    return env_dir / sub / ("python.exe" if os.name == "nt" else "python")


def _run(*cmd: object, check: bool = True, env: dict | None = None) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    rc = subprocess.call([str(c) for c in cmd], cwd=ROOT, env=env)
    if check and rc != 0:
        sys.exit(rc)
    return rc


def _check_python() -> None:
    if not SUPPORTED_PYTHON[0] <= sys.version_info[:2] <= SUPPORTED_PYTHON[1]:
        sys.exit(
            f"error: onnxgrad needs Python 3.10 to 3.12 (onnxruntime-training 1.19.2 has no "
            f"wheel for {sys.version.split()[0]}); run dev.py with such an interpreter"
        )


def _usable(python: Path) -> bool:
    """The venv's interpreter runs, has pip, and is the version running this script."""
    probe = "import sys, pip; print(sys.version_info[:2])"
    try:
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    except OSError:
        return False
    return out.returncode == 0 and out.stdout.strip() == str(sys.version_info[:2])


def _ensure_venv(env_dir: Path, stamp_text: str, install) -> Path:
    """Create ``env_dir`` (again if it is broken or of another Python) and run
    ``install(python)`` when ``stamp_text`` or the Python version changed."""
    python = _python(env_dir)
    if not _usable(python):
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    stamp = env_dir / ".onnxgrad-stamp"
    digest = hashlib.sha256(f"{sys.version}\n{stamp_text}".encode()).hexdigest()
    if not stamp.exists() or stamp.read_text() != digest:
        install(python)
        stamp.write_text(digest)
    return python


def ensure_dev_env(with_torch: bool = False) -> Path:
    """The main virtual environment: onnxgrad (editable) with its dev extra."""

    def install(python: Path) -> None:
        _run(python, "-m", "pip", "install", "-q", "--upgrade", "pip")
        _run(python, "-m", "pip", "install", "-q", "-e", ".[dev]")

    text = (ROOT / "pyproject.toml").read_text()
    python = _ensure_venv(VENV, text, install)
    if with_torch:
        ensure_torch(python)
    return python


def ensure_torch(python: Path) -> None:
    """PyTorch is a test extra: tests that need it skip when this install fails."""
    has_torch = subprocess.call(
        [str(python), "-c", "import torch"], stderr=subprocess.DEVNULL, cwd=ROOT
    )
    if has_torch != 0:
        rc = _run(python, "-m", "pip", "install", "-q", "-e", ".[torch]", check=False)
        if rc != 0:
            print("warning: PyTorch could not be installed; the torch tests will skip.")


def ensure_inference_env() -> Path:
    """A separate venv with the newest inference-only onnxruntime (it cannot share one with
    onnxruntime-training): the portability tests run native gradient graphs there."""

    def install(python: Path) -> None:
        _run(python, "-m", "pip", "install", "-q", "--upgrade", *INFERENCE_PACKAGES)

    return _ensure_venv(INFERENCE_VENV, " ".join(INFERENCE_PACKAGES), install)


def _bin(python: Path, name: str) -> Path:
    return python.parent / name


def cmd_demo(args: list[str]) -> int:
    python = ensure_dev_env()
    return _run(_bin(python, "onnxgrad"), "demo", *args, check=False)


def cmd_test(args: list[str]) -> int:
    python = ensure_dev_env(with_torch=True)
    inference_python = ensure_inference_env()
    _run(_bin(python, "ruff"), "check", ".")
    _run(_bin(python, "ruff"), "format", "--check", ".")
    env = dict(os.environ, ONNXGRAD_INFERENCE_PYTHON=str(inference_python))
    env.setdefault("MPLBACKEND", "Agg")
    rc = _run(python, "-m", "pytest", "-n", "2", "--timeout", "900", *args, check=False, env=env)
    if rc == 5:
        print("error: no test ran", file=sys.stderr)
        return 1
    return rc


def cmd_docs(args: list[str]) -> int:
    python = ensure_dev_env()
    return _run(python, "docs/build.py", *args, check=False)


def cmd_bench(args: list[str]) -> int:
    python = ensure_dev_env(with_torch=True)
    rc = 0
    for script in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        rc |= _run(python, script, *args, check=False)
    return rc


COMMANDS = {"demo": cmd_demo, "test": cmd_test, "docs": cmd_docs, "bench": cmd_bench}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        return 2
    _check_python()
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
