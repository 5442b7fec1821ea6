"""What a process learns from its environment: torchrun's WORLD_SIZE and RANK, and the
ImportError naming the extra when torch is missing (no torch needed for these)."""

from __future__ import annotations

import sys

import pytest

from onnxgrad.training.running import distributed
from onnxgrad.training.running.devices import check_device


def test_world_size_and_rank_come_from_torchrun(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert (distributed.world_size(), distributed.rank(), distributed.data_parallel()) == (
        1,
        0,
        False,
    )
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert (distributed.world_size(), distributed.rank(), distributed.data_parallel()) == (
        4,
        3,
        True,
    )
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not a number of processes"):
        distributed.world_size()


def test_missing_torch_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"pip install 'onnxgrad\[distributed\]'"):
        distributed.process_group(check_device("cpu"))


def test_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("ONNXGRAD_DIST_TIMEOUT", raising=False)
    assert distributed.timeout_seconds() == distributed.DEFAULT_TIMEOUT
    monkeypatch.setenv("ONNXGRAD_DIST_TIMEOUT", "7.5")
    assert distributed.timeout_seconds() == 7.5
    monkeypatch.setenv("ONNXGRAD_DIST_TIMEOUT", "0")
    with pytest.raises(ValueError, match="ONNXGRAD_DIST_TIMEOUT must be a positive number"):
        distributed.timeout_seconds()
