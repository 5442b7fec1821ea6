"""Install what the JavaScript example and its tests need (stdlib only).

``ensure_js_env(root)`` runs ``npm ci`` in ``examples/js`` (onnxruntime-node's download of
optional CUDA binaries skipped) when its ``node_modules`` is missing or older than the lock
file, and installs Debian's ``chromium`` with apt-get when ``/usr/bin/chromium`` is missing
and apt-get can run. It never downloads a browser of its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
EXAMPLE = Path("examples") / "js"


def ensure_js_env(root: str | os.PathLike = ".") -> bool:
    """Make node's packages and Chromium ready; ``True`` when both are, else ``False``
    (with the reason on stderr)."""
    return _ensure_npm_packages(Path(root) / EXAMPLE) & _ensure_chromium()


def _ensure_npm_packages(example: Path) -> bool:
    npm = shutil.which("npm")
    if npm is None:
        _say("npm is not installed: the JavaScript example cannot be set up")
        return False
    installed = example / "node_modules" / ".package-lock.json"
    lock = example / "package-lock.json"
    if installed.is_file() and installed.stat().st_mtime >= lock.stat().st_mtime:
        return True
    env = dict(os.environ, ONNXRUNTIME_NODE_INSTALL="skip")
    return _run([npm, "ci", "--no-audit", "--no-fund"], cwd=example, env=env)


def _ensure_chromium() -> bool:
    if os.path.exists(CHROMIUM):
        return True
    apt = shutil.which("apt-get")
    if apt is None or (hasattr(os, "geteuid") and os.geteuid() != 0):
        _say(f"{CHROMIUM} is missing and apt-get cannot run here: install Debian's chromium")
        return False
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    return (
        _run([apt, "update", "-q"], env=env)
        and _run([apt, "install", "-y", "-q", "chromium"], env=env)
        and os.path.exists(CHROMIUM)
    )


def _run(command: list[str], **kwargs) -> bool:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=900, **kwargs)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _say(f"{' '.join(command)} failed: {exc}")
        return False
    if result.returncode != 0:
        _say(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        return False
    return True


def _say(message: str) -> None:
    print(f"ensure_js_env: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(0 if ensure_js_env(Path(__file__).resolve().parents[2]) else 1)
