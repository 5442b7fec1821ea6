"""Every documented recipe runs as written.

For README.md and every ``docs/*.md`` (found anew each run, so a new page is covered), the
fenced blocks run in page order in a fresh folder: ``python`` blocks in one namespace per
page, ``bash``/``sh``/``shell`` blocks of ``onnxgrad`` commands through ``onnxgrad.cli.main`` in
this process, other shell blocks as bash scripts (``set -e``; ``onnxgrad`` is this
interpreter's ``python -m onnxgrad``). A block that cannot run here (an install, a browser,
several machines) says so in the markdown: it is fenced as ``text`` (or ``console``,
``json``...), never skipped silently. Any error fails the page's test.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: fence languages that run; every other fence is shown, not run
PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell"}

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^\n`]*)\n", re.MULTILINE)


def code_blocks(text: str) -> list[tuple[str, str, int]]:
    """``[(language, code, line)]`` of the fenced blocks of a markdown page, in order
    (``language`` is the first word of the info string, ``''`` when there is none)."""
    blocks, position = [], 0
    while True:
        opening = _FENCE.search(text, position)
        if opening is None:
            return blocks
        fence, indent = opening.group("fence"), opening.group("indent")
        closing = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}} *$", re.MULTILINE)
        end = closing.search(text, opening.end())
        line = text.count("\n", 0, opening.start()) + 1
        if end is None:
            raise ValueError(f"unclosed fence at line {line}")
        lines = text[opening.end() : end.start()].splitlines()
        code = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in lines)
        language = (opening.group("info").split() or [""])[0].lower()
        blocks.append((language, code, line))
        position = end.end()


def test_blocks_are_found_in_order():
    text = "a\n```python\nx = 1\n```\n\n  ```bash\n  echo 1\n  ```\n```\nplain\n```\n"
    assert code_blocks(text) == [("python", "x = 1", 2), ("bash", "echo 1", 6), ("", "plain", 9)]


def test_every_page_has_a_test():
    assert (ROOT / "docs" / "getting-started.md") in PAGES and len(PAGES) >= 8


def _environment() -> dict[str, str]:
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "MPLBACKEND": "Agg",
    }


def onnxgrad_commands(code: str) -> list[list[str]] | None:
    """The argument lists of a shell block made of ``onnxgrad ...`` commands only (comments
    and line continuations allowed), or ``None`` when it needs a shell."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        if any(c in line.split("#")[0] for c in "|&;<>$`"):
            return None
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] != "onnxgrad":
            return None
        commands.append(words[1:])
    return commands


def test_onnxgrad_commands_are_recognised():
    code = "onnxgrad info m.onnx   # a comment\nonnxgrad train m.onnx \\\n  --epochs 2\n"
    assert onnxgrad_commands(code) == [["info", "m.onnx"], ["train", "m.onnx", "--epochs", "2"]]
    assert onnxgrad_commands("onnxgrad info m.onnx | head") is None
    assert onnxgrad_commands("cd x\nonnxgrad info m.onnx") is None


def _run_commands(commands: list[list[str]], where: str) -> None:
    """Each command through ``onnxgrad.cli.main`` in this process (no interpreter start)."""
    from onnxgrad.cli import main

    for args in commands:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(args)
            except SystemExit as exc:
                status = exc.code
        if status:
            pytest.fail(f"{where}: onnxgrad {shlex.join(args)} exited {status}:\n{err.getvalue()}")


def _run_shell(code: str, cwd: Path, where: str) -> None:
    prelude = f'set -euo pipefail\nonnxgrad() {{ "{sys.executable}" -m onnxgrad "$@"; }}\n'
    result = subprocess.run(
        ["bash", "-c", prelude + code],
        cwd=cwd,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        pytest.fail(
            f"{where} failed with status {result.returncode}:\n{code}\n--- stdout\n"
            f"{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
        )


def _run_python(code: str, namespace: dict, where: str) -> None:
    try:
        exec(compile(code, where, "exec"), namespace)
    except Exception as exc:
        raise AssertionError(f"{where} raised {type(exc).__name__}: {exc}\n{code}") from exc


@contextlib.contextmanager
def _inside(folder: Path):
    previous = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_runs_as_written(page, tmp_path):
    pytest.importorskip("matplotlib").use("Agg")
    namespace = {"__name__": "__main__"}
    with _inside(tmp_path):
        for language, code, line in code_blocks(page.read_text()):
            where = f"{page.relative_to(ROOT)}:{line}"
            if language in PYTHON:
                _run_python(code, namespace, where)
            elif language in SHELL:
                commands = onnxgrad_commands(code)
                if commands is None:
                    _run_shell(code, tmp_path, where)
                else:
                    _run_commands(commands, where)


def test_getting_started_lists_every_notebook():
    listed = set(
        re.findall(r"^\* `(\d\d_\w+)`", (ROOT / "docs" / "getting-started.md").read_text(), re.M)
    )
    assert listed == {path.stem for path in (ROOT / "notebooks").glob("*.ipynb")}
