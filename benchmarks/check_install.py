"""Install onnxgrad into fresh virtual environments, one per extra, as a new user would.

    python benchmarks/check_install.py [--python 3.11=PATH ...] [--only NAME ...] [--keep DIR]

For each case: ``pip install`` from this checkout into a new venv, the size of its
site-packages, the onnxruntime flavours ``pip list`` shows (exactly one is expected), and
whether ``onnxgrad demo --epochs 2`` (or, for the core-only cases, a native derivative)
runs. The cases with an onnxruntime installed before onnxgrad check that the core does not
pull a second flavour over it. Slow (minutes, network or package cache): not part of the
test suite nor of ``dev.py bench``.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAVOURS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-training", "onnxruntime-training-cpu")
CORE_CHECK = (
    "from onnxgrad import add_loss_output, onnx_derivative\n"
    "from onnx import TensorProto, helper\n"
    "g = helper.make_graph([helper.make_node('Tanh', ['x'], ['y'])], 'g',\n"
    "    [helper.make_tensor_value_info('x', TensorProto.FLOAT, ['N', 2])],\n"
    "    [helper.make_tensor_value_info('y', TensorProto.FLOAT, ['N', 2])])\n"
    "m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 18)])\n"
    "print(len(onnx_derivative(m, inputs=['x'], weights=[]).graph.node), 'gradient nodes')\n"
)

#: name -> (python version, packages installed first, what to install, run the demo?)
CASES = {
    "cpu-3.13": ("3.13", [], ".[cpu]", True),
    "cpu-3.11": ("3.11", [], ".[cpu]", True),
    "training-3.11": ("3.11", [], ".[training]", True),
    "core-beside-onnxruntime-3.13": ("3.13", ["onnxruntime"], ".", True),
    "core-beside-onnxruntime-gpu-3.13": ("3.13", ["onnxruntime-gpu"], ".", False),
    "core-only-3.13": ("3.13", [], ".", False),
    "before: onnxruntime-training (CUDA) 3.11": ("3.11", [], "onnxruntime-training==1.19.2", None),
}


def find_python(version: str, given: dict[str, str]) -> str | None:
    if version in given:
        return given[version]
    pyenv = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    found = sorted(glob.glob(os.path.join(pyenv, "versions", f"{version}.*", "bin", "python3")))
    return found[-1] if found else shutil.which(f"python{version}")


def _pip(python: Path, *args: str) -> None:
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--progress-bar", "off", *args],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def _size_mb(venv: Path) -> float:
    site = next(venv.glob("lib/python3.*/site-packages"))
    total = sum(f.stat().st_size for f in site.rglob("*") if f.is_file() and not f.is_symlink())
    return total / 2**20


def _flavours(python: Path) -> list[str]:
    out = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True
    ).stdout
    return [line for line in out.splitlines() if line.split("==")[0].lower() in FLAVOURS]


def run_case(name: str, python: str, first: list[str], target: str, demo, where: Path) -> str:
    venv = where / name.replace(" ", "_").replace(":", "").replace("(", "").replace(")", "")
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    bin_python = venv / "bin" / "python"
    _pip(bin_python, "--upgrade", "pip")
    for package in first:
        _pip(bin_python, package)
    _pip(bin_python, target)
    flavours = _flavours(bin_python)
    if demo is None:
        outcome = "(size reference)"
    elif demo:
        result = subprocess.run(
            [str(venv / "bin" / "onnxgrad"), "demo", "--epochs", "2", "-o", str(venv / "demo")],
            capture_output=True,
            text=True,
        )
        outcome = "demo ran" if result.returncode == 0 else f"demo FAILED: {result.stderr[-300:]}"
    else:
        result = subprocess.run(
            [str(bin_python), "-c", CORE_CHECK], capture_output=True, text=True, cwd=where
        )
        outcome = result.stdout.strip() if result.returncode == 0 else f"FAILED {result.stderr}"
    runtimes = ", ".join(flavours) or "no onnxruntime"
    return f"{name:42} {_size_mb(venv):8.0f} MB  {runtimes:40} {outcome}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", default=[], help="VERSION=PATH")
    parser.add_argument("--only", action="append", default=[], help="case names to run")
    parser.add_argument("--keep", type=Path, help="keep the venvs in this folder")
    args = parser.parse_args()
    given = dict(item.split("=", 1) for item in args.python)
    where = args.keep or Path(tempfile.mkdtemp(prefix="onnxgrad-install-"))
    where.mkdir(parents=True, exist_ok=True)
    print(f"{'case':42} {'site-packages':>11}  {'onnxruntime flavours':40} outcome")
    failures = 0
    for name, (version, first, target, demo) in CASES.items():
        if args.only and name not in args.only:
            continue
        python = find_python(version, given)
        if python is None:
            print(f"{name:42} no Python {version} found")
            failures += 1
            continue
        try:
            line = run_case(name, python, first, target, demo, where)
        except subprocess.CalledProcessError as exc:
            line = f"{name:42} install FAILED ({exc})"
        failures += "FAILED" in line
        print(line, flush=True)
    if args.keep is None:
        shutil.rmtree(where, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
