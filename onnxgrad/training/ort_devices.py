"""onnxruntime's own device objects, under the seeds' names (``onnxruntime_helper``).

onnxgrad's estimators and runners take ``'cpu'``, ``'cuda'`` or ``'cuda:N'``
(:mod:`onnxgrad.training.devices`); these helpers convert between that spelling and
onnxruntime's ``OrtDevice`` (``C_OrtDevice``), for code written against the seeds.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnxruntime.capi._pybind_state import OrtDevice as C_OrtDevice

from onnxgrad.training.devices import parse_device

_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def get_ort_device_type(device: str) -> int:
    """``C_OrtDevice.cpu()`` or ``C_OrtDevice.cuda()`` for ``'cpu'``, ``'cuda'``, ``'cuda:N'``."""
    kind = parse_device(device).kind
    return C_OrtDevice.cuda() if kind == "cuda" else C_OrtDevice.cpu()


def get_ort_device(device) -> C_OrtDevice:
    """An ``OrtDevice`` from ``'cpu'``, ``'cuda'``, ``'cuda:N'`` or an ``OrtDevice`` (returned
    as is), default memory."""
    if isinstance(device, C_OrtDevice):
        return device
    parsed = parse_device(device)
    return C_OrtDevice(get_ort_device_type(str(parsed)), C_OrtDevice.default_memory(), parsed.index)


def ort_device_to_string(device: C_OrtDevice) -> str:
    """``'cpu'`` or ``'cuda:N'`` for an ``OrtDevice`` (``'cuda'`` for ``cuda:0``, as the seeds)."""
    if not isinstance(device, C_OrtDevice):
        raise TypeError(f"device must be an OrtDevice, got {type(device).__name__}")
    if device.device_type() == C_OrtDevice.cpu():
        return "cpu"
    if device.device_type() == C_OrtDevice.cuda():
        return "cuda" if device.device_id() == 0 else f"cuda:{device.device_id()}"
    raise ValueError(f"unsupported device type {device.device_type()} (only cpu and cuda)")


def device_to_providers(device) -> list[str]:
    """The execution providers of ``device`` (a string or an ``OrtDevice``):
    ``['CPUExecutionProvider']`` or ``['CUDAExecutionProvider']`` (onnxruntime adds the CPU
    provider itself for the nodes CUDA lacks)."""
    name = ort_device_to_string(device) if isinstance(device, C_OrtDevice) else device
    return [_PROVIDERS[parse_device(name).kind]]


def provider_to_device(provider_name: str) -> str:
    """``'cpu'`` for ``CPUExecutionProvider``, ``'cuda'`` for ``CUDAExecutionProvider``."""
    for kind, provider in _PROVIDERS.items():
        if provider == provider_name:
            return kind
    raise ValueError(
        f"unexpected provider {provider_name!r}, expected one of {list(_PROVIDERS.values())}"
    )


def numpy_to_ort_value(arr: np.ndarray, device=None) -> ort.OrtValue:
    """An ``OrtValue`` holding ``arr`` on ``device`` (``None``: the CPU; a string or an
    ``OrtDevice``). On the CPU it shares ``arr``'s memory, which must outlive it."""
    target = get_ort_device("cpu" if device is None else device)
    array = np.ascontiguousarray(arr)
    if target.device_type() == C_OrtDevice.cpu():
        return ort.OrtValue.ortvalue_from_numpy(array)
    return ort.OrtValue.ortvalue_from_numpy(array, "cuda", target.device_id())


__all__ = [
    "C_OrtDevice",
    "device_to_providers",
    "get_ort_device",
    "get_ort_device_type",
    "numpy_to_ort_value",
    "ort_device_to_string",
    "provider_to_device",
]
