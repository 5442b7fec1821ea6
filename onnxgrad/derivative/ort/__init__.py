"""The ``backend="ort"`` gradient builder: onnxruntime-training's, kept apart from the native one.

:mod:`.backend` is the entry (:func:`~.backend.ort_derivative`); :mod:`.process` runs the
builder in a child interpreter (:mod:`.worker`, executed by path); :mod:`.graph` turns its
output into a gradient graph, :mod:`.standard` replaces its training operators by standard
ones and :mod:`.checks` refuses the builder's known wrong cases.
"""
