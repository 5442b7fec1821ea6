"""Tells a wrong gradient from a difference step that crosses ``Relu`` kinks (issue 30).

For each weight, along a random direction ``v`` of the weight's size, in float64 (onnx's
reference evaluator): the gradient's projection ``<dL/dw, v>``; central differences at steps
1e-7 and 1e-9 with the number of ``Relu`` inputs whose sign differs at ``w +- h v`` from the
point; and central differences at step 1e-7 of the model whose ``Relu`` multiply by their
mask at the point (smooth, same derivative at the point). A rule at fault shows in the
frozen differences; a kink shows as sign changes and a gap that closes when none remain.

Default: basic-pitch 0.4.0's ``nmp.onnx`` and its front-end weights, 0.3 * N(0, 1) audio.

    python benchmarks/relu_kinks.py [--model PATH] [--weights W1,W2]
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from onnxgrad import onnx_derivative
from onnxgrad.normalize import normalized_model
from tests.derivative.fd import to_double
from tests.realmodels import reference
from tests.realmodels.wheels import wheel_models

FRONT_END = (
    "const_fold_opt__664,const_fold_opt__655,const_fold_opt__734,"
    "model_1/cq_t2010v2_1/Sqrt;model_1/cq_t2010v2_1/Sqrt"
)
#: "free": plain Relu, counting sign changes against ``masks``; "record": store the masks;
#: "frozen": ``x * mask``.
STATE: dict = {"mode": "free", "masks": {}, "flips": 0}


class Relu(OpRun):
    op_domain = ""

    def _run(self, x):
        key = self.onnx_node.output[0]
        if STATE["mode"] == "record":
            STATE["masks"][key] = x > 0
        elif STATE["mode"] == "frozen":
            return (x * STATE["masks"][key],)
        elif key in STATE["masks"]:
            STATE["flips"] += int(np.sum((x > 0) != STATE["masks"][key]))
        return (np.maximum(x, 0),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--weights", default=FRONT_END)
    args = parser.parse_args()
    path = args.model or next(
        str(p) for p in wheel_models("basic-pitch", "0.4.0") if p.name == "nmp.onnx"
    )
    model = normalized_model(path)
    weights = args.weights.split(",")
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    rng = np.random.default_rng(0)
    feeds = {
        i.name: 0.3 * rng.standard_normal([d.dim_value or 1 for d in i.type.tensor_type.shape.dim])
        for i in model.graph.input
    }
    ref = reference.Reference(model)
    ref_ops = [*reference._FIXED_OPS, Relu]
    STATE["mode"] = "record"
    outputs = ReferenceEvaluator(ref.model, new_ops=ref_ops).run(None, feeds)
    seeds = {
        f"{o.name}_grad": rng.standard_normal(v.shape) for o, v in zip(model.graph.output, outputs)
    }
    gradient = onnx_derivative(model, weights=weights, inputs=[])
    known = {i.name for i in gradient.graph.input}
    grad_feeds = {k: v for k, v in {**feeds, **values, **seeds}.items() if k in known}
    evaluator = ReferenceEvaluator(to_double(gradient), new_ops=reference._FIXED_OPS)
    grads = dict(zip([o.name for o in gradient.graph.output], evaluator.run(None, grad_feeds)))

    def score(name: str, value: np.ndarray) -> float:
        model_ = ref.model
        slot = ref._slot(name)
        saved = onnx.TensorProto()
        saved.CopyFrom(slot)
        slot.CopyFrom(numpy_helper.from_array(value, name))
        try:
            outs = ReferenceEvaluator(model_, new_ops=ref_ops).run(None, feeds)
        finally:
            slot.CopyFrom(saved)
        return sum(
            float(np.sum(o * seeds[f"{i.name}_grad"])) for i, o in zip(model.graph.output, outs)
        )

    for name in weights:
        base = values[name].astype(np.float64)
        direction = rng.standard_normal(base.shape) * np.sqrt(np.mean(np.square(base)))
        predicted = float(np.sum(grads[f"{name}_grad"] * direction))
        STATE["mode"] = "frozen"
        frozen = (
            score(name, base + 1e-7 * direction) - score(name, base - 1e-7 * direction)
        ) / 2e-7
        STATE["mode"] = "free"
        free = []
        for step in (1e-7, 1e-9):
            STATE["flips"] = 0
            up, down = score(name, base + step * direction), score(name, base - step * direction)
            free.append(
                f"h={step:g}: {(up - down) / (2 * step):.9g} ({STATE['flips']} Relu sign changes)"
            )
        print(
            f"{name[:40]}: gradient {predicted:.9g}, frozen-mask differences {frozen:.9g}; "
            + "; ".join(free)
        )


if __name__ == "__main__":
    main()
