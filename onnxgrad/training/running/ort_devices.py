"""onnxruntime's own device objects, under the seeds' names (``onnxruntime_helper``).

onnxgrad's estimators and runners take ``'cpu'``, ``'cuda'`` or ``'cuda:N'`` (``'gpu'``,
``'gpu:N'`` alike)
(:mod:`onnxgrad.training.running.devices`); these helpers convert between that spelling and
onnxruntime's ``OrtDevice`` (``C_OrtDevice``), for code written against the seeds.
"""

from __future__ import annotations

import numpy as np
from onnxruntime.capi._pybind_state import OrtDevice as C_OrtDevice
from onnxruntime.capi._pybind_state import OrtValue as C_OrtValue

from onnxgrad.training.running.devices import parse_device

_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def get_ort_device_type(device) -> int:
    """``C_OrtDevice.cpu()`` or ``C_OrtDevice.cuda()`` for ``'cpu'``, ``'cuda'``, ``'cuda:N'``
    (``'gpu'``, ``'gpu:N'`` alike) or an ``OrtDevice``."""
    if isinstance(device, C_OrtDevice):
        return device.device_type()
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


def numpy_to_ort_value(arr: np.ndarray, device=None) -> C_OrtValue:
    """onnxruntime's C-level ``OrtValue`` (``onnxruntime.capi._pybind_state.OrtValue``, as
    onnxcustom returned) holding a copy of ``arr`` on ``device`` (``None``: the CPU; a string
    or an ``OrtDevice``): it owns its memory, ``arr`` may change or go.
    ``onnxruntime.OrtValue(value)`` wraps it for ``InferenceSession.run_with_ortvalues``."""
    array = np.ascontiguousarray(arr)
    value = C_OrtValue.ortvalue_from_shape_and_type(
        list(array.shape), array.dtype.type, get_ort_device("cpu" if device is None else device)
    )
    value.update_inplace(array)
    return value


def get_ort_device_from_session(session) -> C_OrtDevice:
    """The ``OrtDevice`` of the first execution provider of ``session`` (an
    ``InferenceSession`` or its C-level ``_sess``): where it places its outputs."""
    provider = session.get_providers()[0]
    options = session.get_provider_options().get(provider, {})
    device = provider_to_device(provider)
    index = int(options.get("device_id", 0)) if device == "cuda" else 0
    return get_ort_device(device if index == 0 else f"{device}:{index}")


__all__ = [
    "C_OrtDevice",
    "C_OrtValue",
    "device_to_providers",
    "get_ort_device",
    "get_ort_device_from_session",
    "get_ort_device_type",
    "numpy_to_ort_value",
    "ort_device_to_string",
    "provider_to_device",
]
