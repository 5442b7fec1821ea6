"""Start-up cost: ``import onnxgrad``, ``onnxgrad --help`` and the commands that read a model
(``info``, ``text``, ``derivative``, ``add-loss`` on a small linear model), each in a fresh
interpreter.

    python benchmarks/bench_import.py [--repeat 7] [--source FOLDER]

For each command: the median wall time over ``--repeat`` runs (and the spread), the number of
modules loaded, whether a heavy library was loaded, and the five slowest imports by
cumulative time (``python -X importtime``). The floor is ``import numpy, onnx``, which every
model-reading command needs. Bytecode is written and reused (``PYTHONDONTWRITEBYTECODE``
unset), as for an installed package. ``--source`` measures another checkout of onnxgrad (an
older commit, say) with this interpreter, for before/after tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY = ("onnxruntime", "onnxscript", "networkx", "matplotlib", "torch", "sympy", "numpy", "onnx")


def _command(*argv: str) -> str:
    """``onnxgrad ARGV`` as ``python -m onnxgrad`` runs it, standard output discarded."""
    return (
        f"import sys\nsys.argv = ['onnxgrad', *{list(argv)!r}]\n"
        "sys.stdout = open('/dev/null', 'w')\n"
        "from onnxgrad.cli import main\ntry:\n    main()\nexcept SystemExit:\n    pass"
    )


def commands(folder: Path) -> dict[str, str]:
    """Name -> code of each command measured, the model written in ``folder``."""
    model = str(_small_model(folder))
    return {
        "import numpy, onnx": "import numpy, onnx",
        "import onnxgrad": "import onnxgrad",
        "onnxgrad --help": _command("--help"),
        "onnxgrad info": _command("info", model),
        "onnxgrad text": _command("text", model),
        "onnxgrad derivative": _command("derivative", model, "-o", str(folder / "grad.onnx")),
        "onnxgrad add-loss": _command("add-loss", model, "-o", str(folder / "loss.onnx")),
    }


def _small_model(folder: Path) -> Path:
    """``Y = X W + b``: the linear model of the tests, 3 features and 2 outputs."""
    import numpy as np
    from onnx import save

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.models import linear_regression_model

    path = folder / "small.onnx"
    save(linear_regression_model(np.ones((2, 3)), np.zeros(2)), str(path))
    return path


PROBE = "\nimport sys\nsys.stderr.write('MODULES ' + ' '.join(sys.modules) + '\\n')"


def _run(code: str, env: dict, importtime: bool = False) -> subprocess.CompletedProcess:
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run(
        [sys.executable, *flags, "-c", code],
        env=env,
        cwd=env["PYTHONPATH"],  # `-c` puts the working folder first on sys.path
        capture_output=True,
        text=True,
        check=True,
    )


def measure(code: str, env: dict, repeat: int) -> dict:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        _run(code, env)
        times.append(time.perf_counter() - start)
    probe = _run(code + PROBE, env).stderr
    modules = next(line for line in probe.splitlines() if line.startswith("MODULES ")).split()[1:]
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "modules": len(modules),
        "heavy": [name for name in HEAVY if name in modules],
        "slowest": _slowest_imports(_run(code, env, importtime=True).stderr),
    }


def _slowest_imports(report: str, count: int = 5) -> list[tuple[str, float]]:
    """Top-level imports (no indentation) by cumulative microseconds."""
    rows = []
    for line in report.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|")
        if cumulative.strip().isdigit() and not name.startswith("  "):
            rows.append((name.strip(), int(cumulative) / 1e6))
    return sorted(rows, key=lambda row: -row[1])[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--source", default=str(Path(__file__).resolve().parents[1]))
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=args.source)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    print(f"Python {sys.version.split()[0]}, onnxgrad from {args.source}")
    baseline = measure("pass", env, args.repeat)["median_s"]
    print(f"bare interpreter: {baseline:.3f} s")
    with tempfile.TemporaryDirectory() as folder:
        for name, code in commands(Path(folder)).items():
            _run(code, env)  # writes the bytecode, as installing a package does
            _report(name, measure(code, env, args.repeat))


def _report(name: str, result: dict) -> None:
    print(
        f"{name:20} {result['median_s']:.3f} s median "
        f"({result['min_s']:.3f}-{result['max_s']:.3f}), {result['modules']} modules, "
        f"heavy: {', '.join(result['heavy']) or 'none'}"
    )
    for module, seconds in result["slowest"]:
        print(f"    {seconds:7.3f} s  {module}")


if __name__ == "__main__":
    main()
