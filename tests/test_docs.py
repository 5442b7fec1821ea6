"""The documentation builds (``python docs/build.py``): guides, benchmark tables and the API
reference of every public name."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import onnxgrad

pytest.importorskip("pdoc")

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "docs" / "build.py"


def _build_module():
    spec = importlib.util.spec_from_file_location("docs_build", BUILD_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The documentation built by the script, as ``python3 dev.py docs`` runs it."""
    output = tmp_path_factory.mktemp("site")
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    result = subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), "--output", str(output), "--no-execute"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return output


def test_guides_are_built_and_linked(site):
    for page in ("index.html", "getting-started.html", "concepts.html", "benchmarks.html"):
        text = (site / page).read_text()
        links = re.findall(r'href="([^"#:]+)"', text)
        assert links, page
        for link in links:
            assert (site / link).exists(), f"{page} links to missing {link}"
    assert "onnxgrad demo" in (site / "getting-started.html").read_text()


def test_api_reference_documents_every_public_name(site):
    reference = (site / "api" / "onnxgrad.html").read_text()
    missing = [name for name in onnxgrad.__all__ if f'id="{name}"' not in reference]
    assert missing == []
    plotting = (site / "api" / "onnxgrad" / "plotting.html").read_text()
    assert 'id="plot_onnxs"' in plotting and 'id="to_dot"' in plotting
    assert 'id="main"' in (site / "api" / "onnxgrad" / "cli.html").read_text()


def test_benchmark_results_replace_the_fill_in_table(tmp_path):
    build = _build_module()
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert build.with_benchmark_results(text, tmp_path / "none") == text
    (tmp_path / "mlp.csv").write_text("framework,seconds\nscikit-learn,1.9\nonnxgrad,1.7\n")
    rows = [{"model": "mlp", "native_ms": 1.23456}, {"model": "cnn", "ort_ms": 2.0}]
    (tmp_path / "gradient.json").write_text(json.dumps(rows))
    page = build.with_benchmark_results(text, tmp_path)
    assert "*to fill*" not in page
    assert "| framework | seconds |" in page and "| onnxgrad | 1.7 |" in page
    assert "| model | native_ms | ort_ms |" in page and "| mlp | 1.235 |  |" in page


def test_broken_links_are_reported():
    build = _build_module()
    source = ROOT / "docs" / "concepts.md"
    text = "[fine](getting-started.md) [gone](missing.md) [web](https://example.org)"
    assert build._broken_links(text, source) == ["missing.md"]


def test_notebooks_are_rendered_with_their_outputs(site):
    listing = (site / "notebooks.html").read_text()
    pages = re.findall(r'href="(notebook-[^"]+\.html)"', listing)
    assert len(pages) == len(list((ROOT / "notebooks").glob("*.ipynb")))
    for page in pages:
        assert (
            '<code class="language-python">' in (site / page).read_text()
            or "<pre>" in (site / page).read_text()
        )
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("# A title"),
            nbformat.v4.new_code_cell(
                "print(1)",
                outputs=[
                    nbformat.v4.new_output("stream", name="stdout", text="1\n"),
                    nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo="}),
                ],
            ),
        ]
    )
    text = _build_module().notebook_markdown(notebook)
    assert text.split("\n\n") == [
        "# A title",
        "```python\nprint(1)\n```",
        "```text\n1\n```",
        '<img alt="output" src="data:image/png;base64,iVBORw0KGgo=">',
    ]
