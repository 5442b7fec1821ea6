"""Rule table entries: RNN, GRU and LSTM, one per attribute variant (directions, layout,
sequence_lens, initial states, peepholes, clip, input_forget, linear_before_reset,
activations with alpha/beta), against float64 finite differences of the numpy kernels of
:mod:`recurrent_reference` (onnx's reference evaluator supports few of these attributes)."""

from functools import partial

import numpy as np
from onnx.reference import ReferenceEvaluator

from tests.derivative.autodiff.gradcheck import OpCase, second_order
from tests.derivative.autodiff.recurrent_reference import OPS

rng = np.random.default_rng(12)
STEPS, BATCH, INPUT, HIDDEN = 3, 2, 3, 2
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def reference(model):
    return ReferenceEvaluator(model, new_ops=OPS)


def inputs(op_type, directions=1, layout=0, bias=True, lens=False, initial=False, peep=False):
    """Inputs in the operator's order (``None`` for an omitted optional input)."""
    g = GATES[op_type]
    x_shape = (BATCH, STEPS, INPUT) if layout else (STEPS, BATCH, INPUT)
    h_shape = (BATCH, directions, HIDDEN) if layout else (directions, BATCH, HIDDEN)
    values = {
        "X": rng.standard_normal(x_shape),
        "W": rng.standard_normal((directions, g * HIDDEN, INPUT)) * 0.6,
        "R": rng.standard_normal((directions, g * HIDDEN, HIDDEN)) * 0.6,
        "B": rng.standard_normal((directions, 2 * g * HIDDEN)) * 0.3 if bias else None,
        "sequence_lens": np.array([STEPS, STEPS - 1], dtype=np.int32) if lens else None,
        "initial_h": rng.standard_normal(h_shape) * 0.5 if initial else None,
    }
    if op_type == "LSTM":
        values["initial_c"] = rng.standard_normal(h_shape) * 0.5 if initial else None
        values["P"] = rng.standard_normal((directions, 3 * HIDDEN)) * 0.5 if peep else None
    while values and next(reversed(values.values())) is None:
        values.popitem()
    return values


def case(op_type, id, directions=1, layout=0, bias=True, lens=False, initial=False,
         peep=False, opset=18, dynamic_shapes=True, **attrs):  # fmt: skip
    direction = {1: attrs.pop("direction", "forward"), 2: "bidirectional"}[directions]
    if layout:
        attrs["layout"] = 1
    return OpCase(
        op_type,
        inputs(op_type, directions, layout, bias, lens, initial, peep),
        attrs={"hidden_size": HIDDEN, "direction": direction, **attrs},
        n_outputs=3 if op_type == "LSTM" else 2,
        opset=opset,
        evaluator=reference,
        rtol=1e-4,
        atol=1e-6,
        dynamic_shapes=dynamic_shapes,
        id=f"{op_type}-{id}",
    )


rnn, gru, lstm = partial(case, "RNN"), partial(case, "GRU"), partial(case, "LSTM")
CASES = [
    rnn("forward"),
    rnn("reverse-no-bias", direction="reverse", bias=False),
    rnn("bidirectional-initial_h", directions=2, initial=True),
    rnn("layout1-bidirectional", directions=2, layout=1, initial=True),
    rnn("sequence_lens-bidirectional", directions=2, lens=True, initial=True),
    rnn("sequence_lens-reverse", direction="reverse", lens=True),
    rnn("clip", clip=0.6),
    rnn("relu", activations=["Relu"]),
    rnn("affine", activations=["Affine"], activation_alpha=[0.7], activation_beta=[0.2]),
    rnn(
        "bidirectional-leakyrelu-elu",
        directions=2,
        activations=["LeakyRelu", "Elu"],
        activation_alpha=[0.2, 0.7],
    ),
    rnn("softsign", activations=["Softsign"]),
    rnn("opset11", opset=11, dynamic_shapes=False),
    gru("forward"),
    gru("linear_before_reset", linear_before_reset=1, initial=True),
    gru("linear_before_reset-no-bias", linear_before_reset=1, bias=False),
    gru("reverse", direction="reverse", initial=True),
    gru("bidirectional-sequence_lens", directions=2, lens=True, initial=True),
    gru("layout1-bidirectional", directions=2, layout=1, initial=True),
    gru("clip", clip=0.5, linear_before_reset=1),
    gru(
        "hardsigmoid-scaledtanh",
        activations=["HardSigmoid", "ScaledTanh"],
        activation_alpha=[0.3, 0.8],
        activation_beta=[0.4, 1.2],
    ),
    gru("elu-softplus", activations=["Elu", "Softplus"], activation_alpha=[0.9]),
    lstm("forward"),
    lstm("peepholes-initial", peep=True, initial=True),
    lstm("input_forget", input_forget=1, initial=True),
    lstm("reverse-peepholes", direction="reverse", peep=True),
    lstm("bidirectional-sequence_lens", directions=2, lens=True, initial=True, peep=True),
    lstm("layout1-bidirectional", directions=2, layout=1, initial=True, peep=True),
    lstm("clip", clip=0.5, peep=True),
    lstm(
        "activations",
        activations=["HardSigmoid", "Softsign", "ThresholdedRelu"],
        activation_alpha=[0.25, 0.1],
        activation_beta=[0.45],
    ),
    lstm("opset14-layout1", layout=1, opset=14, initial=True),
]


def _only(output_index, base):
    """``base`` with a single output (the others omitted), for second derivatives."""
    outputs = [""] * output_index + ["y0"]

    def graph(names, _outputs):
        from onnx import helper

        return [helper.make_node(base.op_type, names, outputs, **base.attrs)]

    return OpCase(
        base.op_type,
        base.inputs,
        attrs=base.attrs,
        graph=graph,
        opset=base.opset,
        evaluator=reference,
        rtol=1e-4,
        id=f"{base.id}-output{output_index}",
    )


_BY_ID = {c.id: c for c in CASES}
CASES += [
    second_order(_only(output, _BY_ID[id]), rtol=1e-4, atol=1e-5)
    for output, id in [
        (0, "RNN-bidirectional-initial_h"),
        (1, "GRU-linear_before_reset"),
        (1, "LSTM-peepholes-initial"),
    ]
]
