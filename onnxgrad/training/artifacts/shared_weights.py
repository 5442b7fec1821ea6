"""The inference model's big weights kept once on disk: as external data into the checkpoint.

The artifacts' ``inference_model.onnx`` is the model as given, with its initial weights;
``checkpoint.bin`` holds the same initial weights (raw little-endian, each at a multiple of
64 bytes, :mod:`onnxgrad.training.artifacts.checkpoint`), which is exactly how ONNX stores
external data. So an initializer of at least :data:`SHARED_FROM` bytes of raw data equal to
the normalised model's tensor written as a checkpoint weight (name, element type, dims,
bytes) is written as a reference into ``checkpoint.bin`` (``location``, ``offset``,
``length``) instead of a second copy: every
ONNX reader (onnxruntime, ``onnx.load``) resolves it beside the model, and the folder's
digests (``artifacts.json``) cover both files. Smaller weights stay in the model (a browser
fetches a small model's bytes alone).
"""

from __future__ import annotations

import math

import numpy as np
from onnx import ModelProto, TensorProto
from onnx.numpy_helper import to_array

from onnxgrad._external_data import PACKED_TYPES
from onnxgrad._onnx_utils import np_dtype, tensor_nbytes
from onnxgrad.graph.ml_lowering import needs_lowering
from onnxgrad.normalize.constants import constant_weights
from onnxgrad.training.artifacts.checkpoint import MAPPED_FROM

#: Initializers of at least this many bytes are shared with the checkpoint (those its
#: mapped loads map rather than copy).
SHARED_FROM = MAPPED_FROM


def merged_in_place(model: ModelProto, weights) -> bool:
    """Whether :func:`~onnxgrad.training.artifacts.generate.merge_checkpoint` puts the
    checkpoint's ``weights`` straight into the initializers of ``model`` (no operator
    lowered, no weight held by a ``Constant`` node), never reading their old data."""
    return not needs_lowering(model) and not constant_weights(model) & set(weights)


class SharedWeights:
    """Collects, while the checkpoint is written, the initializers of ``model`` that can
    point into it (``data_name``, the checkpoint's data file beside the model);
    :attr:`references` maps their names to the tensors written in their place."""

    def __init__(self, model: ModelProto, data_name: str):
        self._data_name = data_name
        self._initializers = {
            init.name: init
            for init in model.graph.initializer
            if init.HasField("raw_data") and tensor_nbytes(init) >= SHARED_FROM
        }
        self.references: dict[str, TensorProto] = {}

    def offer(self, tensor: TensorProto, offset: int, nbytes: int) -> None:
        """``tensor`` (of the normalised model) was written at ``offset``, ``nbytes`` long,
        little-endian: share it when the initializer of its name is the same message (same
        type, dims and raw bytes; protobuf compares them in place, no copy of the data)."""
        init = self._initializers.pop(tensor.name, None)
        if init is None or init != tensor:
            return
        reference = TensorProto(name=init.name, data_type=init.data_type, dims=init.dims)
        reference.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self._data_name), ("offset", offset)):
            reference.external_data.add(key=key, value=str(value))
        reference.external_data.add(key="length", value=str(nbytes))
        self.references[init.name] = reference


def tensor_view(tensor: TensorProto) -> np.ndarray:
    """The array of ``tensor``: a view of its raw data (little-endian, as ONNX stores it)
    when it has some, else converted."""
    if not tensor.HasField("raw_data") or tensor.data_type in PACKED_TYPES:
        return to_array(tensor)
    dtype = np_dtype(tensor.data_type).newbyteorder("<")
    raw = tensor.raw_data
    if len(raw) != dtype.itemsize * math.prod(tensor.dims):
        raise ValueError(
            f"weight {tensor.name!r} has {len(raw)} bytes of raw data, its dims "
            f"{list(tensor.dims)} need {dtype.itemsize * math.prod(tensor.dims)}"
        )
    return np.frombuffer(raw, dtype).reshape(tuple(tensor.dims))
