"""Declared dimensions as onnx's checker and onnxruntime read them."""

from __future__ import annotations

from onnx import ModelProto

from onnxgrad.graph._scopes import iter_graphs


def dynamic_dims(model: ModelProto) -> ModelProto:
    """Negative declared dimensions (PaddlePaddle's ``-1``) of inputs, outputs and values
    become unknown ones, as onnx's checker and onnxruntime take them (a negative initializer
    dimension is an error of the structure pass: its data has a definite shape). In place;
    returns ``model``."""
    for graph in iter_graphs(model.graph):
        for info in [*graph.input, *graph.output, *graph.value_info]:
            if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
                for dim in info.type.tensor_type.shape.dim:
                    if dim.HasField("dim_value") and dim.dim_value < 0:
                        dim.ClearField("dim_value")
    return model
