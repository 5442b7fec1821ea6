#!/usr/bin/env python3
"""Set up onnxgrad on a fresh machine and run its main jobs.

    python3 dev.py demo     # create .venv, install onnxgrad, run `onnxgrad demo`
    python3 dev.py extras distributed   # add extras to .venv, keeping its onnxruntime
    python3 dev.py test     # set up two environments, lint, run the tests in both
    python3 dev.py docs     # build the documentation into docs/_build
    python3 dev.py bench    # run the benchmarks

Only the Python standard library is used here, so a newcomer needs nothing but Python 3.10 to
3.14. ``.venv`` is made with the Python running this script and gets the onnxruntime flavour
that Python has wheels for: onnxruntime-training-cpu (both derivative backends) on 3.10 and
3.11, the current inference onnxruntime on 3.12 and later. ``test`` also sets up a second
environment of the other kind, with the newest Python 3.12+ found on the machine (or a 3.10
or 3.11 when ``.venv`` is the inference one), so every change is tested on both runtimes.
The tests needing the current onnxruntime and PyTorch together (onnxruntime-genai's builder,
the 4-bit deployed forms) run in ``.venv-genai`` beside a training ``.venv``.
Installation is skipped when pyproject.toml has not changed since the last one, unless the
environment is broken: another onnxruntime flavour installed over its own (a ``pip install
".[cpu,...]"`` in the training ``.venv``), an onnxruntime that does not import, or onnxgrad
no longer installed editable from this checkout; dev.py says what it found and repairs it.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import runpy
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
SUPPORTED_PYTHON = ((3, 10), (3, 14))
#: the last Python with onnxruntime-training wheels (the ``training`` extra).
LAST_TRAINING_PYTHON = (3, 11)
#: the tests that need PyTorch and the current onnxruntime together, run alone in
#: ``.venv-genai`` beside a training ``.venv``: onnxruntime-genai's model builder, and the
#: deployed forms whose tools the training build lacks (the 4-bit ``MatMulNBits`` quantizer)
GENAI_TESTS = ["tests/normalize/test_genai_builder.py", "tests/normalize/test_deployed_forms.py"]
#: the onnxruntime wheel each runtime extra installs (all share the ``onnxruntime`` folder)
RUNTIME_FLAVOURS = {
    "cpu": "onnxruntime",
    "gpu": "onnxruntime-gpu",
    "training": "onnxruntime-training-cpu",
    "training-cuda": "onnxruntime-training",
}
#: every wheel that installs the ``onnxruntime`` folder (read from onnxgrad/_runtime.py, which
#: imports only the standard library, so dev.py needs nothing installed)
ALL_FLAVOURS = runpy.run_path(str(ROOT / "onnxgrad" / "_runtime.py"))["FLAVOURS"]
#: the extras ``dev.py extras`` added to ``.venv``, one a line
EXTRAS_FILE = ".onnxgrad-extras"
#: pip's lines worth showing while it works (the rest is noise on a first install).
PIP_PROGRESS = re.compile(r"^(Collecting|Installing collected|Successfully installed|ERROR)")


def _python(env_dir: Path) -> Path:
    sub = "Scripts" if os.name == "nt" else "bin"
    return env_dir / sub / ("python.exe" if os.name == "nt" else "python")


def _say(message: str) -> None:
    print(f"[dev.py] {message}", flush=True)


def _run(*cmd: object, check: bool = True, env: dict | None = None, cwd: Path = ROOT) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    rc = subprocess.call([str(c) for c in cmd], cwd=cwd, env=env)
    if check and rc != 0:
        sys.exit(rc)
    return rc


def _pip(python: Path, *args: str, what: str, check: bool = True) -> int:
    """``pip install ARGS`` in the venv of ``python``, showing what it fetches and installs."""
    _say(f"installing {what}")
    cmd = [str(python), "-m", "pip", "install", "--progress-bar", "off", *args]
    process = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    tail: list[str] = []
    for line in process.stdout:
        tail = [*tail[-40:], line.rstrip()]
        if PIP_PROGRESS.match(line):
            print("   ", line.rstrip()[:150], flush=True)
    rc = process.wait()
    if rc != 0:
        print("\n".join(tail), file=sys.stderr)
        _say(f"pip failed installing {what} (status {rc})")
        if check:
            sys.exit(rc)
    return rc


def _version_of(python: Path | str) -> tuple[int, int] | None:
    probe = "import sys; print('%d.%d' % sys.version_info[:2])"
    try:
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    except OSError:
        return None
    if out.returncode != 0:
        return None
    major, minor = out.stdout.strip().split(".")
    return int(major), int(minor)


def _check_python() -> None:
    if not SUPPORTED_PYTHON[0] <= sys.version_info[:2] <= SUPPORTED_PYTHON[1]:
        sys.exit(
            f"error: onnxgrad needs Python 3.10 to 3.14, this is {sys.version.split()[0]}; "
            "run dev.py with such an interpreter"
        )


def _runtime_extra(version: tuple[int, int]) -> str:
    """The onnxruntime flavour a Python gets: the training build where it has wheels."""
    return "training" if version <= LAST_TRAINING_PYTHON else "cpu"


def _usable(python: Path, version: tuple[int, int]) -> bool:
    """The venv's interpreter runs, has pip, and is of ``version``."""
    probe = "import sys, pip; print('%d.%d' % sys.version_info[:2])"
    try:
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    except OSError:
        return False
    return out.returncode == 0 and out.stdout.strip() == f"{version[0]}.{version[1]}"


def _create_venv(env_dir: Path, base_python: str, version: tuple[int, int]) -> None:
    _say(f"creating {env_dir.name} with Python {version[0]}.{version[1]} ({base_python})")
    if Path(base_python).resolve() == Path(sys.executable).resolve():
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    else:
        shutil.rmtree(env_dir, ignore_errors=True)
        _run(base_python, "-m", "venv", env_dir)


def ensure_env(
    env_dir: Path,
    base_python: str,
    version: tuple[int, int],
    with_torch: bool = False,
    extra: str | None = None,
) -> Path:
    """A venv at ``env_dir`` made from ``base_python`` with onnxgrad (editable), its ``dev``
    extra and ``extra`` (default: the onnxruntime flavour of its Python); re-installed when
    pyproject.toml changes."""
    python = _python(env_dir)
    added = added_extras(env_dir)
    if not _usable(python, version):
        _create_venv(env_dir, base_python, version)
        if added:
            (env_dir / EXTRAS_FILE).write_text("\n".join(added) + "\n")
    extra = ",".join([extra or _runtime_extra(version), *added])
    stamp = env_dir / ".onnxgrad-stamp"
    text = f"{version}\n{extra}\n{(ROOT / 'pyproject.toml').read_text()}"
    digest = hashlib.sha256(text.encode()).hexdigest()
    if stamp.exists():
        problems = environment_problems(_probe(python), extra, ROOT)
        if problems:
            _repair(python, env_dir, problems)
            stamp.unlink()
    if not stamp.exists() or stamp.read_text() != digest:
        _pip(python, "-q", "--upgrade", "pip", what=f"the newest pip into {env_dir.name}")
        _pip(
            python,
            "-e",
            f".[dev,{extra}]",
            what=f"onnxgrad with its dev tools and the extras {extra} (the first one picks "
            f"the onnxruntime) into {env_dir.name} (a few minutes the first time)",
        )
        problems = environment_problems(_probe(python), extra, ROOT)
        if problems:
            _say(f"error: {env_dir.name} is still broken after installing: {'; '.join(problems)}")
            sys.exit(1)
        stamp.write_text(digest)
    if with_torch:
        ensure_torch(python)
    return python


#: What :func:`environment_problems` needs to know of an environment, printed as JSON by its
#: interpreter (standard library only; onnxruntime imported without onnxruntime.training,
#: which would load PyTorch).
PROBE = f"""
import json, sys, importlib.metadata as metadata
names = {{(d.metadata["Name"] or "").lower().replace("_", "-"): d.version
         for d in metadata.distributions()}}
try:
    direct = json.loads(metadata.distribution("onnxgrad").read_text("direct_url.json") or "{{}}")
except metadata.PackageNotFoundError:
    direct = None
sys.modules["onnxruntime.training"] = None
try:
    import onnxruntime
    imports = ""
except Exception as exc:
    imports = f"{{type(exc).__name__}}: {{exc}}"
flavours = sorted(name for name in names if name in {ALL_FLAVOURS!r})
print(json.dumps({{"flavours": flavours, "onnxgrad": direct, "import_error": imports}}))
"""


def _probe(python: Path) -> dict:
    import json

    out = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, cwd="/")
    if out.returncode != 0:
        return {"flavours": [], "onnxgrad": None, "import_error": out.stderr.strip()[-300:]}
    return json.loads(out.stdout)


def environment_problems(probe: dict, extra: str, root: Path) -> list[str]:
    """What is wrong with an environment dev.py installed with ``extra`` (its first name the
    runtime extra), from :data:`PROBE`'s answer: [] when nothing is."""
    expected = RUNTIME_FLAVOURS.get(extra.split(",")[0])
    problems = []
    others = [name for name in probe["flavours"] if name != expected]
    if others:
        problems.append(f"{', '.join(others)} installed beside or over {expected}")
    elif expected not in probe["flavours"]:
        problems.append(f"{expected} is not installed")
    elif probe["import_error"]:
        problems.append(f"onnxruntime does not import ({probe['import_error']})")
    direct = probe["onnxgrad"]
    if direct is None:
        problems.append("onnxgrad is not installed")
    else:
        editable = direct.get("dir_info", {}).get("editable", False)
        where = direct.get("url", "").removeprefix("file://")
        if not editable or Path(where).resolve() != root.resolve():
            problems.append(
                f"onnxgrad is installed from {where or 'a wheel'}, not editable from {root}"
            )
    return problems


def _repair(python: Path, env_dir: Path, problems: list[str]) -> None:
    """Uninstall every onnxruntime flavour (several share one folder, so the survivor's files
    may be gone); the reinstall that follows puts back the right one and onnxgrad, editable."""
    _say(f"{env_dir.name} is broken: {'; '.join(problems)}. Repairing it.")
    flavours = _probe(python)["flavours"]
    if flavours:
        _run(python, "-m", "pip", "uninstall", "-y", *flavours)


def added_extras(env_dir: Path) -> list[str]:
    """The extras ``dev.py extras`` added to the environment."""
    path = env_dir / EXTRAS_FILE
    return path.read_text().split() if path.exists() else []


def ensure_dev_env(with_torch: bool = False) -> Path:
    """``.venv``, made with the Python running this script."""
    return ensure_env(VENV, sys.executable, sys.version_info[:2], with_torch)


def ensure_torch(python: Path) -> None:
    """PyTorch is a test extra: tests that need it skip, with the reason, when it is missing
    (transformers comes with it, for the benchmarks)."""
    has_torch = subprocess.call(
        [str(python), "-c", "import torch, transformers"], stderr=subprocess.DEVNULL, cwd=ROOT
    )
    if has_torch != 0:
        rc = _pip(
            python,
            "-e",
            ".[torch]",
            what="PyTorch and transformers (tests and benchmarks only)",
            check=False,
        )
        if rc != 0:
            _say("warning: PyTorch could not be installed; the torch tests will skip.")


def ensure_genai_env(main: Path) -> Path | None:
    """An environment with onnxruntime-genai, which needs the current onnxruntime (never
    installed over the training build) and, for its model builder, PyTorch: ``main`` when it
    is the inference one (it has PyTorch), else ``.venv-genai`` of the same Python. ``None``
    (its tests skip) when the install fails."""
    version = sys.version_info[:2]
    if _runtime_extra(version) == "training":
        try:
            return ensure_env(ROOT / ".venv-genai", sys.executable, version, True, "cpu,genai")
        except SystemExit:
            _say("warning: onnxruntime-genai could not be set up; its tests will not run")
            return None
    probe = [str(main), "-c", "import onnxruntime_genai"]
    if subprocess.call(probe, stderr=subprocess.DEVNULL, cwd=ROOT) == 0:
        return main
    rc = _pip(main, "-e", ".[genai]", what="onnxruntime-genai (tests only)", check=False)
    return main if rc == 0 else None


def _candidate_pythons() -> list[str]:
    """Python executables on PATH and in pyenv's versions folder."""
    found = [shutil.which(f"python3.{minor}") for minor in range(10, 15)]
    pyenv_root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    found += glob.glob(os.path.join(pyenv_root, "versions", "3.*", "bin", "python3"))
    return [path for path in dict.fromkeys(found) if path]


def second_python() -> tuple[str, tuple[int, int]] | None:
    """The interpreter of the second test environment: the newest Python 3.12+ on the machine
    when ``.venv`` has the training build, else the newest Python 3.10/3.11."""
    want_training = _runtime_extra(sys.version_info[:2]) == "cpu"
    best = None
    for path in _candidate_pythons():
        version = _version_of(path)
        if version is None or not SUPPORTED_PYTHON[0] <= version <= SUPPORTED_PYTHON[1]:
            continue
        if (_runtime_extra(version) == "training") != want_training:
            continue
        if best is None or version > best[1]:
            best = (path, version)
    return best


def ensure_js_env() -> None:
    """Node packages and Chromium for the JavaScript example's tests (examples/js/setup.py),
    installed once here rather than by two test workers at the same time."""
    _say("setting up the JavaScript example (npm packages, Debian's chromium)")
    setup = runpy.run_path(str(ROOT / "examples" / "js" / "setup.py"))
    if not setup["ensure_js_env"](ROOT):
        _say("warning: the JavaScript example could not be set up; its tests will skip")


def _environment_text(python: Path) -> str:
    probe = (
        "import sys, importlib.util as u\n"
        "from onnxgrad._runtime import flavour_description\n"
        "torch = 'torch' if u.find_spec('torch') else 'no torch'\n"
        'print(f"Python {sys.version.split()[0]}, {flavour_description()}, {torch}")\n'
    )
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip() or "(could not be described)"


def _bin(python: Path, name: str) -> Path:
    return python.parent / name


def _declared_extras() -> list[str]:
    """The optional-dependency groups of pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return re.findall(r"^([A-Za-z0-9_-]+)\s*=", section, re.MULTILINE)


def cmd_extras(args: list[str]) -> int:
    """Add extras (``distributed``, ``torch``, ``genai``...) to ``.venv``, which keeps the
    onnxruntime dev.py chose for it; they stay through later re-installs."""
    declared = _declared_extras()
    unknown = [name for name in args if name not in declared]
    runtimes = [name for name in args if name in RUNTIME_FLAVOURS]
    if not args or unknown or runtimes:
        choices = [name for name in declared if name not in RUNTIME_FLAVOURS]
        problem = (
            f"{', '.join(runtimes)}: .venv's onnxruntime is the one dev.py chose "
            f"({_runtime_extra(sys.version_info[:2])}); use an environment of your own for another"
            if runtimes
            else f"unknown extras {unknown}"
            if unknown
            else "name the extras to add"
        )
        print(f"error: {problem}; extras: {', '.join(choices)}", file=sys.stderr)
        return 2
    VENV.mkdir(exist_ok=True)
    extras = list(dict.fromkeys([*added_extras(VENV), *args]))
    (VENV / EXTRAS_FILE).write_text("\n".join(extras) + "\n")
    ensure_dev_env()
    _say(f".venv has onnxgrad with the extras {', '.join(extras)}")
    return 0


def cmd_demo(args: list[str]) -> int:
    python = ensure_dev_env()
    return _run(_bin(python, "onnxgrad"), "demo", *args, check=False)


def test_environment(inference_python: Path, environ: dict[str, str]) -> dict[str, str]:
    """The environment pytest runs in: ``environ`` with the inference interpreter named,
    matplotlib off screen, and bytecode written (into the git-ignored ``__pycache__``): with
    ``PYTHONDONTWRITEBYTECODE`` set, each pytest worker and each of the hundreds of processes
    the tests start (the command, onnxruntime-training's child, the docs' and notebooks'
    runs) would compile this checkout's modules again."""
    env = dict(environ, ONNXGRAD_INFERENCE_PYTHON=str(inference_python))
    env.setdefault("MPLBACKEND", "Agg")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _pytest(python: Path, inference_python: Path, args: list[str]) -> int:
    env = test_environment(inference_python, dict(os.environ))
    cmd = (python, "-m", "pytest", "-n", "2", "--timeout", "900", *args)
    rc = _run(*cmd, check=False, env=env)
    return 1 if rc == 5 else rc  # 5: no test ran, a failure


def cmd_test(args: list[str]) -> int:
    main = ensure_dev_env(with_torch=True)
    second = second_python()
    if second is None:
        training = _runtime_extra(sys.version_info[:2]) == "training"
        kind = "3.12 or newer" if training else "3.10 or 3.11"
        _say(
            f"error: the second test environment needs a Python {kind} on this machine "
            "(on PATH as python3.X, or installed with pyenv)"
        )
        return 1
    other_dir = ROOT / f".venv-py{second[1][0]}.{second[1][1]}"
    other = ensure_env(other_dir, second[0], second[1])
    ensure_js_env()
    _run(_bin(main, "ruff"), "check", ".")
    _run(_bin(main, "ruff"), "format", "--check", ".")
    genai = ensure_genai_env(main)
    inference = other if _runtime_extra(second[1]) == "cpu" else main
    runs = [(VENV.name, main, args), (other_dir.name, other, args)]
    if genai is not None and genai != main:
        runs.append((genai.parent.parent.name, genai, [*GENAI_TESTS, *args]))
    results = []
    for name, python, chosen in runs:
        description = _environment_text(python)
        _say(f"tests in {name}: {description}")
        rc = _pytest(python, inference, chosen)
        results.append((name, description, rc))
    _say("environments:")
    for name, description, rc in results:
        print(f"    {name:14} {description:60} {'passed' if rc == 0 else f'FAILED ({rc})'}")
    return next((rc for _, _, rc in results if rc != 0), 0)


def cmd_docs(args: list[str]) -> int:
    python = ensure_dev_env()
    return _run(python, "docs/build.py", *args, check=False)


def cmd_bench(args: list[str]) -> int:
    python = ensure_dev_env(with_torch=True)
    rc = 0
    for script in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        rc |= _run(python, script, *args, check=False)
    return rc


COMMANDS = {
    "demo": cmd_demo,
    "extras": cmd_extras,
    "test": cmd_test,
    "docs": cmd_docs,
    "bench": cmd_bench,
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        return 2
    _check_python()
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
