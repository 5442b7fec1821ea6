"""Fixtures of the deployed-form tests: the forms onnxruntime's tools make of two tiny
transformers, made once per session."""

from __future__ import annotations

import pytest

from tests.normalize import deployed


@pytest.fixture(scope="session")
def forms(tmp_path_factory):
    """``(kind, form) -> path``, made once per session."""
    folder = tmp_path_factory.mktemp("deployed")
    made: dict[tuple[str, str], object] = {}

    def get(kind: str, form: str):
        if (kind, form) not in made:
            source = folder / f"{kind}.onnx"
            if not source.exists():
                getattr(deployed, f"export_{kind}")(source)
            try:
                made[kind, form] = deployed.make_form(source, form, kind, folder)
            except ImportError as exc:  # a tool whose kernel this onnxruntime build lacks
                made[kind, form] = exc
        found = made[kind, form]
        if isinstance(found, ImportError):
            pytest.skip(f"this onnxruntime cannot make the {form} form: {found}")
        return found

    return get
