"""onnxgrad: turn ONNX models into trainable and differentiable graphs, and train them.

Layers, each importing only from the ones before it:

* :mod:`onnxgrad.graph` — pure rewrites ``ModelProto -> ModelProto``;
* :mod:`onnxgrad.functions` — small fixed graphs authored with onnxscript;
* :mod:`onnxgrad.derivative` — ``onnx_derivative`` with the native and ORT backends;
* :mod:`onnxgrad.training` — fused train steps, the runner and sklearn-style estimators.
"""

from onnxgrad._runtime import import_onnxruntime

import_onnxruntime()

from onnxgrad.derivative import *  # noqa: E402, F403
from onnxgrad.derivative import __all__ as _derivative_all  # noqa: E402
from onnxgrad.exceptions import ConvergenceError  # noqa: E402
from onnxgrad.functions import *  # noqa: E402, F403
from onnxgrad.functions import __all__ as _functions_all  # noqa: E402
from onnxgrad.graph import *  # noqa: E402, F403
from onnxgrad.graph import __all__ as _graph_all  # noqa: E402
from onnxgrad.plotting import plot_onnxs, to_dot  # noqa: E402
from onnxgrad.training import *  # noqa: E402, F403
from onnxgrad.training import __all__ as _training_all  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "ConvergenceError",
    "__version__",
    "plot_onnxs",
    "to_dot",
    *_graph_all,
    *_functions_all,
    *_derivative_all,
    *_training_all,
]
