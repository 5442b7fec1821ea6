"""Child-process side of ``backend="ort"``: runs onnxruntime-training's native code.

onnxruntime-training 1.19.2 can crash (segfault) on some models, so its gradient builder
and session loading run here, in a separate interpreter started by
:mod:`onnxgrad.derivative.ort.process`, never in the user's process.

The file is executed by path and imports nothing from onnxgrad (importing the package
would pull every layer into the child). Protocol: one JSON object a line on stdin, one
JSON reply a line on the original stdout; native code writing to stdout is redirected to
stderr so that it cannot corrupt the replies.

* ``{"command": "build", "model": path, "output": path, "weights": [...], "inputs": [...]}``
  builds the gradient graph (``YieldOp`` placeholders) with ``OrtModuleGraphBuilder``,
  saves it to ``output`` and replies ``{"ok": true, "info": {...}}`` (the builder's
  ``GraphInfo``);
* ``{"command": "load", "model": path}`` creates an ``InferenceSession`` on CPU;
* ``{"command": "quit"}`` (or the end of stdin) exits.

A failure replies ``{"ok": false, "error": message}``.
"""

from __future__ import annotations

import json
import os
import sys

_GRAPH_INFO_FIELDS = (
    "user_input_names",
    "user_output_names",
    "user_input_grad_names",
    "initializer_names_to_train",
    "initializer_grad_names_to_train",
    "module_output_gradient_name",
    "output_grad_indices_non_differentiable",
)


def _import_pybind():
    # onnxruntime's __init__ validates the training build by importing ORTModule, which
    # imports PyTorch (1-2 s); nothing here needs it.
    if "torch" not in sys.modules:
        sys.modules["torch"] = None
    from onnxruntime.capi import _pybind_state

    _pybind_state.set_default_logger_severity(3)
    return _pybind_state


def _build(pybind, request: dict) -> dict:
    config = pybind.OrtModuleGraphBuilderConfiguration()
    config.initializer_names = request["weights"]
    config.initializer_names_to_train = request["weights"]
    config.input_names_require_grad = request["inputs"]
    config.build_gradient_graph = True
    builder = pybind.OrtModuleGraphBuilder()
    with open(request["model"], "rb") as f:
        builder.initialize(f.read(), config)
    builder.build(pybind.TrainingGraphTransformerConfiguration())
    with open(request["output"], "wb") as f:
        f.write(builder.get_gradient_model())
    info = builder.get_graph_info()
    return {field: _plain(getattr(info, field)) for field in _GRAPH_INFO_FIELDS}


def _plain(value):
    return dict(value) if isinstance(value, dict) else list(value)


def _load(request: dict) -> dict:
    import onnxruntime

    onnxruntime.InferenceSession(request["model"], providers=["CPUExecutionProvider"])
    return {}


def main() -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    pybind = _import_pybind()
    for line in sys.stdin:
        request = json.loads(line)
        if request["command"] == "quit":
            break
        try:
            if request["command"] == "build":
                reply = {"ok": True, "info": _build(pybind, request)}
            elif request["command"] == "load":
                reply = {"ok": True, **_load(request)}
            else:
                reply = {"ok": False, "error": f"unknown command {request['command']!r}"}
        except Exception as exc:
            reply = {"ok": False, "error": str(exc)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
