"""Devices: ``'cpu'``, ``'cuda'``, ``'cuda:N'``, their execution providers and a probe.

onnxruntime lists ``CUDAExecutionProvider`` whenever the wheel carries it, even when the CUDA
libraries it needs are missing; a session then silently falls back to the CPU. The probe
creates a session on a one-node model and checks the provider really loaded.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import onnxruntime as ort
from onnx import TensorProto, helper

from onnxgrad._onnx_utils import MAX_IR_VERSION
from onnxgrad._runtime import restore_logger_severity

_DEVICE_PATTERN = re.compile(r"^(cpu|cuda|gpu)(?::(\d+))?$")


@dataclass(frozen=True)
class Device:
    """A device onnxruntime can place tensors and run kernels on."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def providers(self) -> list:
        """Execution providers for ``InferenceSession(providers=...)``."""
        if self.kind == "cpu":
            return ["CPUExecutionProvider"]
        return [("CUDAExecutionProvider", {"device_id": str(self.index)}), "CPUExecutionProvider"]

    @property
    def ort_type(self) -> str:
        """The device name ``OrtValue`` expects (``'cpu'`` or ``'cuda'``)."""
        return self.kind


def parse_device(device: str | Device) -> Device:
    """``'cpu'``, ``'cuda'`` or ``'cuda:N'`` as a :class:`Device` (no availability check);
    ``'gpu'`` and ``'gpu:N'``, onnxcustom's spelling, mean ``'cuda'`` and ``'cuda:N'``."""
    if isinstance(device, Device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda:0', got {device!r}")
    match = _DEVICE_PATTERN.match(device.strip().lower())
    if match is None:
        raise ValueError(f"unknown device {device!r}, expected 'cpu', 'cuda' or 'cuda:N'")
    kind, index = match.group(1).replace("gpu", "cuda"), match.group(2)
    if kind == "cpu" and index not in (None, "0"):
        raise ValueError(f"unknown device {device!r}: there is only one CPU device")
    return Device(kind, int(index or 0))


def check_device(device: str | Device) -> Device:
    """The parsed device, after checking onnxruntime can really run on it.

    Raises ``ValueError`` naming ``CUDAExecutionProvider`` when CUDA is requested but the
    provider is not in the wheel or cannot load (no GPU, missing CUDA/cuDNN libraries).
    """
    device = parse_device(device)
    if device.kind == "cuda" and not _cuda_provider_loads(device.index):
        raise ValueError(
            f"device {str(device)!r} needs onnxruntime's CUDAExecutionProvider, which is "
            f"unavailable here (available providers: {ort.get_available_providers()}; "
            f"the CUDA provider needs a GPU and {_cuda_build_requirements()})"
        )
    return device


def _cuda_build_requirements() -> str:
    """The CUDA toolkit the installed onnxruntime wheel was built against (11.8 for
    onnxruntime-training 1.19.2, which also needs cuDNN 8)."""
    try:
        from onnxruntime.capi.build_and_package_info import cuda_version
    except ImportError:
        return "the CUDA and cuDNN libraries the wheel was built for"
    return f"the CUDA {cuda_version} and matching cuDNN libraries the wheel was built for"


@functools.cache
def _cuda_provider_loads(index: int) -> bool:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=MAX_IR_VERSION
    )
    options = ort.SessionOptions()
    options.log_severity_level = 4
    ort.set_default_logger_severity(4)  # the failed library load is logged, then reported
    try:
        session = ort.InferenceSession(
            model.SerializeToString(), options, providers=Device("cuda", index).providers
        )
    except Exception:  # onnxruntime raises several types when a provider fails
        return False
    finally:
        restore_logger_severity()
    return "CUDAExecutionProvider" in session.get_providers()
