"""Facts one normalisation pass learns of the model that a later pass would recompute.

The pipeline (:mod:`onnxgrad.normalize.pipeline`) hands one :class:`Facts` to the passes
that take it, in turn, and forgets what it holds after any pass that does not: a fact
stays only while every pass since it was learnt has kept it true (a pass that rewrites the
graph clears it).
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx import ModelProto


@dataclass
class Facts:
    """What the passes so far know of the model as it stands."""

    #: onnx's plain shape inference of the main graph, as it stands, gives every graph input
    #: and node output a rank (or a non-tensor type), and no node holds a subgraph: the rank
    #: rules of :mod:`onnxgrad.normalize.ranks` (for values of unknown rank, Loop/Scan
    #: bodies) have nothing to find; data propagation only adds to what inference knows.
    ranks_known: bool = False
    #: onnx's shape inference of the model's weightless view as the model stands, where it
    #: is what the gradient engine's own inference would give
    #: (:func:`~onnxgrad.derivative.autodiff.value_types.infer_value_types`): every value
    #: ranked (``ranks_known``), no ``value_info`` declared, every output declared as
    #: inferred with no dimension name the inputs do not use (onnx names the unknown
    #: dimensions it creates after the names it finds), no model-local function, and no
    #: operator that propagates data (:data:`~onnxgrad._bounded_inference.PROPAGATING_OPS`)
    #: but on float values (which hold no data to propagate): data propagation adds nothing.
    inferred: ModelProto | None = None

    def take_inferred(self) -> ModelProto | None:
        """:attr:`inferred`, forgotten: its one reader frees it once read."""
        inferred, self.inferred = self.inferred, None
        return inferred

    def forget(self) -> None:
        """Drop every fact: the model may have changed."""
        self.ranks_known = False
        self.inferred = None
