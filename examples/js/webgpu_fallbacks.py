"""List the nodes of an artifact folder that onnxruntime-web's WebGPU provider leaves to the
CPU, from the verbose log of a session of each model in headless Chromium.

    python examples/js/webgpu_fallbacks.py ARTIFACTS [--chromium /usr/bin/chromium]

Prints, per model, the *fallback* nodes (float data computed on the CPU: they count), the
*shape* nodes (integer or boolean outputs, on the CPU by design) and the nodes onnxruntime's
optimizer inserted; exits with 1 when a model has a fallback node, 2 when no WebGPU adapter
can be had (the page's reason is printed). See :mod:`onnxgrad.training.artifacts.webgpu`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from pathlib import Path

import onnx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serve import make_server  # noqa: E402

from onnxgrad.training.artifacts.webgpu import (  # noqa: E402
    Placement,
    classify_placement,
    parse_placements,
    report_lines,
)


def browser_report(url: str, chromium: str = "/usr/bin/chromium", timeout: int = 300) -> dict:
    """The JSON report of ``run-browser.mjs --webgpu`` on ``url`` (its ``console`` holds the
    page's log)."""
    command = ["node", str(HERE / "run-browser.mjs"), url, "--webgpu", "--chromium", chromium]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=HERE)
    if not result.stdout.strip():
        raise RuntimeError(f"run-browser.mjs printed nothing: {result.stderr[-2000:]}")
    return json.loads(result.stdout)


def webgpu_placements(artifacts: str | Path, chromium: str = "/usr/bin/chromium") -> dict:
    """``{model file: Placement}`` for the models of ``artifacts`` on WebGPU, or
    ``{'error': reason}`` when the page did not get an adapter."""
    folder = Path(artifacts).resolve()
    server = make_server(folder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://localhost:{server.server_port}/index.html?artifacts=/artifacts/&ep=webgpu&placements=1"
        report = browser_report(url, chromium)
    finally:
        server.shutdown()
        server.server_close()
    if report.get("error") or report.get("provider") != "webgpu":
        return {"error": report.get("error") or report.get("fallback")}
    sessions = parse_placements(report["console"])
    return {
        name: classify_placement(onnx.load(folder / name), sessions.get(name, {}))
        for name in report["sessions"]
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifacts", help="a folder written by 'onnxgrad artifacts'")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    placements = webgpu_placements(args.artifacts, args.chromium)
    if "error" in placements:
        print(f"no WebGPU session: {placements['error']}")
        return 2
    for name, placement in placements.items():
        assert isinstance(placement, Placement)
        print("\n".join(report_lines(name, placement)))
    return 1 if any(p.fallbacks for p in placements.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
