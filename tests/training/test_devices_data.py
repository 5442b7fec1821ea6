"""Devices and the data loader."""

from __future__ import annotations

import numpy as np
import pytest
from onnxruntime.capi._pybind_state import OrtValue as C_OrtValue

from onnxgrad.training import Device, OrtDataLoader, check_device, parse_device
from onnxgrad.training.running.devices import _cuda_provider_loads


@pytest.mark.parametrize(
    ("text", "expected"),
    [("cpu", Device("cpu")), ("CUDA", Device("cuda", 0)), ("cuda:3", Device("cuda", 3))],
)
def test_parse_device(text, expected):
    device = parse_device(text)
    assert device == expected
    assert parse_device(device) is device


@pytest.mark.parametrize("text", ["tpu", "cuda:x", "cpu:1", "gpu:x", ""])
def test_unknown_devices(text):
    with pytest.raises(ValueError, match="device"):
        parse_device(text)


def test_device_type():
    with pytest.raises(TypeError, match="device must be a string"):
        parse_device(0)


def test_cuda_without_provider_names_it():
    if _cuda_provider_loads(0):
        pytest.skip("CUDA works on this machine")
    with pytest.raises(ValueError, match="CUDAExecutionProvider"):
        check_device("cuda")
    assert check_device("cpu").providers == ["CPUExecutionProvider"]


def test_loader_batches_cover_every_row_once():
    X = np.arange(23 * 2, dtype=np.float32).reshape((23, 2))
    y = np.arange(23, dtype=np.float32)
    loader = OrtDataLoader(X, y, batch_size=5, random_state=0)
    assert len(loader) == 23 and loader.n_batches == 5
    batches = list(loader)
    assert [len(b[0]) for b in batches] == [5, 5, 5, 5, 3]
    assert all(b[1].shape == (len(b[0]), 1) for b in batches)  # float targets as a column
    rows = np.concatenate([b[1] for b in batches]).ravel()
    assert sorted(rows.tolist()) == list(range(23))
    for bx, by in batches:
        np.testing.assert_array_equal(bx[:, 0], 2 * by.ravel())
    second = np.concatenate([b[1] for b in loader]).ravel()
    assert not np.array_equal(rows, second)


def test_loader_ortvalues_and_weights():
    X = np.ones((7, 3), np.float32)
    y = np.zeros(7, np.float32)
    w = np.linspace(0, 1, 7).astype(np.float32)
    loader = OrtDataLoader(X, y, w, batch_size=4)
    batches = list(loader.iter_ortvalue())
    assert all(isinstance(v, C_OrtValue) for b in batches for v in b)
    assert sorted(np.concatenate([b[2].numpy() for b in batches]).tolist()) == w.tolist()
    data = loader.device_data()
    assert data is loader.device_data()
    np.testing.assert_array_equal(data[0].numpy(), X)


def test_loader_errors():
    with pytest.raises(ValueError, match="different numbers of observations"):
        OrtDataLoader(np.zeros((3, 2)), np.zeros(4))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        OrtDataLoader(np.zeros((3, 2)), np.zeros(3), batch_size=0)
    with pytest.raises(ValueError, match="sample_weight must be a vector of 3"):
        OrtDataLoader(np.zeros((3, 2)), np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError, match="no observation"):
        OrtDataLoader(np.zeros((0, 2)), np.zeros(0))


def test_epoch_batches_slice_the_epoch_order():
    X = np.arange(11, dtype=np.float32).reshape((11, 1))
    loader = OrtDataLoader(X, X.ravel(), batch_size=4, random_state=5)
    twin = OrtDataLoader(X, X.ravel(), batch_size=4, random_state=5)
    order = twin.epoch_order()
    assert order.dtype == np.int64
    assert order.tolist() == np.random.default_rng(5).permutation(11).tolist()
    batches = loader.epoch_batches()
    np.testing.assert_array_equal(np.concatenate(batches), order)
    assert [len(b) for b in batches] == [4, 4, 3]
