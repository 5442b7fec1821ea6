"""Facts one normalisation pass learns of the model that a later pass would recompute.

The pipeline (:mod:`onnxgrad.normalize.pipeline`) hands one :class:`Facts` to the passes
that take it, in turn, and forgets what it holds after any pass that does not: a fact
stays only while every pass since it was learnt has kept it true (a pass that rewrites the
graph clears it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Facts:
    """What the passes so far know of the model as it stands."""

    #: onnx's plain shape inference of the main graph, as it stands, gives every graph input
    #: and node output a rank (or a non-tensor type), and no node holds a subgraph: the rank
    #: rules of :mod:`onnxgrad.normalize.ranks` (for values of unknown rank, Loop/Scan
    #: bodies) have nothing to find; data propagation only adds to what inference knows.
    ranks_known: bool = False

    def forget(self) -> None:
        """Drop every fact: the model may have changed."""
        self.ranks_known = False
