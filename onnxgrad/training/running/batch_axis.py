"""Training a model exported with a fixed batch dimension (``[1, 3, 224, 224]``).

Training feeds batches of any size, so the fixed first dimension ``B`` of the per-row
inputs is made symbolic (``N``), on the outputs too, and the stale intermediate shapes are
dropped. That is safe when the model treats each group of ``B`` rows on its own, which the
rewrite checks (a check, not a proof) before training starts:

1. onnx's shape inference of the rewritten model carries ``N`` to the first dimension of
   every output (a ``Reshape`` to a constant ``[1, -1]`` or a sum over the batch axis does
   not);
2. on the first rows of the training data (``k`` groups of ``B`` rows, ``2 <= k <= 4``, when
   there are at least ``2 B``), the rewritten model run on the ``k B`` rows at once gives
   the outputs of the original model run group by group.

A model that fails either is refused with the reason: export it with a dynamic batch axis.
Splitting each batch into groups of ``B`` rows with summed gradients (the alternative) would
cost ``batch_size / B`` runs a step and is not done.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import ModelProto

from onnxgrad._onnx_utils import load_model
from onnxgrad.training.running.feeds import checked_fixed
from onnxgrad.training.step._inputs import check_features, input_info, tensor_dims

SYMBOL = "N"


def fixed_batch(model: ModelProto, names) -> int | None:
    """The fixed first dimension shared by the inputs ``names`` (``None``: all free);
    ``ValueError`` when they declare different ones."""
    sizes = {n: tensor_dims(input_info(model, n))[:1] for n in names}
    fixed = {n: d[0] for n, d in sizes.items() if d and d[0] is not None}
    if not fixed:
        return None
    if len(set(fixed.values())) > 1 or len(fixed) < len(names):
        raise ValueError(
            f"the per-row inputs declare different first dimensions {fixed} (the others are "
            "free): they must share one batch axis"
        )
    return next(iter(fixed.values()))


def free_batch_axis(
    model: ModelProto,
    per_row: Mapping[str, np.ndarray],
    fixed: Mapping[str, np.ndarray] | None = None,
) -> ModelProto:
    """``model`` with the fixed batch dimension of the inputs ``per_row`` made symbolic,
    checked on ``per_row`` (see the module docstring); ``model`` itself when it is free."""
    size = fixed_batch(model, list(per_row))
    if size is None:
        return model
    rewritten = _symbolic(model, list(per_row), size)
    _check_shapes(rewritten, size, list(per_row))
    _check_rows(model, rewritten, per_row, dict(fixed or {}), size)
    return rewritten


def symbolic_batch_axis(model: ModelProto, names) -> ModelProto:
    """The rewrite of :func:`free_batch_axis` without its checks (a model checked before)."""
    size = fixed_batch(model, list(names))
    return model if size is None else _symbolic(model, list(names), size)


def _symbolic(model: ModelProto, names: list[str], size: int) -> ModelProto:
    model = load_model(model)
    graph = model.graph
    for info in [*(i for i in graph.input if i.name in names), *graph.output]:
        dims = info.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value == size:
            dims[0].dim_param = SYMBOL
    del graph.value_info[:]
    return model


def _check_shapes(model: ModelProto, size: int, names: list[str]) -> None:
    batched = {
        o.name for o in model.graph.output if tensor_dims(o)[:1] == [None] and _dims(o)[0] == SYMBOL
    }
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except Exception as exc:  # onnx raises InferenceError and ValidationError
        raise _refused(names, size, f"shape inference fails: {exc}") from None
    for info in inferred.graph.output:
        if info.name in batched and isinstance(_dims(info)[0], int):
            raise _refused(names, size, f"output {info.name!r} gets the shape {_dims(info)}")


def _dims(info) -> list:
    dims = info.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in dims] or [None]


def _check_rows(original, rewritten, per_row, fixed, size: int) -> None:
    n = len(next(iter(per_row.values())))
    groups = min(n // size, 4)
    if groups < 2:
        return
    rows = groups * size
    run_original = _session(original)
    run_rewritten = _session(rewritten)
    batch = {name: check_features(original, name, a[:rows]) for name, a in per_row.items()}
    fixed = {name: checked_fixed(input_info(original, name), a) for name, a in fixed.items()}
    try:
        together = run_rewritten({**fixed, **batch})
    except Exception as exc:  # onnxruntime's errors have many types
        raise _refused(list(per_row), size, f"it fails on {rows} rows: {exc}") from None
    apart = [
        run_original({**fixed, **{n: a[g * size : (g + 1) * size] for n, a in batch.items()}})
        for g in range(groups)
    ]
    names = [o.name for o in original.graph.output]
    for j, name in enumerate(names):
        expected = np.concatenate([np.asarray(out[j]) for out in apart])
        got = np.asarray(together[j])
        scale = max(float(np.max(np.abs(expected), initial=0.0)), 1.0)
        if got.shape != expected.shape or not np.allclose(
            got, expected, rtol=1e-4, atol=1e-5 * scale
        ):
            raise _refused(
                list(per_row),
                size,
                f"output {name!r} on {rows} rows at once differs from the model run on "
                f"groups of {size} rows: the model mixes rows",
            )


def _session(model: ModelProto):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    wanted = {i.name for i in session.get_inputs()}
    return lambda feeds: session.run(None, {k: v for k, v in feeds.items() if k in wanted})


def _refused(names, size: int, reason: str) -> ValueError:
    return ValueError(
        f"inputs {names} have a fixed batch dimension {size} and training feeds batches of "
        f"any size; the batch axis cannot be made free: {reason}. Export the model with a "
        "dynamic batch axis"
    )


__all__ = ["fixed_batch", "free_batch_axis", "symbolic_batch_axis"]
