"""Every rewrite leaves its argument untouched and returns a valid model onnxruntime loads."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnxgrad._onnx_utils import MAX_IR_VERSION
from onnxgrad.graph import (
    add_initializer,
    add_loss_output,
    get_train_initializer,
    onnx_rename_weights,
    onnx_simple_text_plot,
    remove_unused_nodes,
    replace_initializers_into_onnx,
    select_model_inputs_outputs,
)
from tests.graph.sklearn_models import linear_regression, logistic_regression, mlp_regressor
from tests.models import seed004_model


def seed004_new_ir() -> onnx.ModelProto:
    """Seed 004 stamped with the newest IR version onnx knows (above what ORT loads)."""
    model = seed004_model()
    model.ir_version = onnx.IR_VERSION
    return model


MODELS = {
    "seed004": seed004_model,
    "seed004_new_ir": seed004_new_ir,
    "linear_regression": lambda: linear_regression().onnx,
    "mlp_regressor": lambda: mlp_regressor().onnx,
    "logistic_regression": lambda: logistic_regression().onnx,
}


def doubled_first_weight(model):
    name, (value, _) = next(iter(get_train_initializer(model).items()))
    return {name: value * 2}


def first_float_output(model):
    return next(o.name for o in model.graph.output if o.type.tensor_type.elem_type in (1, 11))


REWRITES = {
    "add_loss_output": lambda m: add_loss_output(m, output_index=first_float_output(m)),
    "onnx_rename_weights": onnx_rename_weights,
    "replace_initializers_into_onnx": lambda m: replace_initializers_into_onnx(
        m, doubled_first_weight(m)
    ),
    "add_initializer": lambda m: add_initializer(m, "brand_new", np.ones(2, np.float32)),
    "select_model_inputs_outputs": lambda m: select_model_inputs_outputs(
        m, outputs=[first_float_output(m)]
    ),
    "remove_unused_nodes": remove_unused_nodes,
}


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("rewrite_name", REWRITES)
def test_rewrite_is_pure_valid_and_loadable(model_name, rewrite_name):
    model = MODELS[model_name]()
    before = model.SerializeToString()
    result = REWRITES[rewrite_name](model)
    assert model.SerializeToString() == before
    assert result is not model
    onnx.checker.check_model(result, full_check=True)
    assert result.ir_version <= MAX_IR_VERSION
    assert {(o.domain, o.version) for o in result.opset_import} >= {
        (o.domain, o.version) for o in model.opset_import if o.domain == ""
    }
    ort.InferenceSession(result.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("model_name", MODELS)
def test_read_only_functions_are_pure(model_name):
    model = MODELS[model_name]()
    before = model.SerializeToString()
    found = get_train_initializer(model)
    onnx_simple_text_plot(model)
    assert model.SerializeToString() == before
    for name, (array, proto) in found.items():
        array += 1
        assert proto is not next(i for i in model.graph.initializer if i.name == name)
    expected = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for name in found:
        assert not np.array_equal(found[name][0], expected[name])
    assert model.SerializeToString() == before


def test_rewrites_of_an_ir_3_model_stay_valid():
    """Below IR 4 initializers must be graph inputs; results are raised to a valid version."""
    model = seed004_model()
    model.ir_version = 3
    result = add_initializer(model, "extra", np.ones(2, np.float32))
    onnx.checker.check_model(result, full_check=True)
    assert result.ir_version >= 4
