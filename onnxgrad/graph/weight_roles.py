"""What a weight is: the role an initializer plays where it meets the data.

A weight is a parameter the model was trained to have (what PyTorch's ``parameters()``
holds): kernels, biases, embeddings, normalisation scales. A float initializer can also be a
structural constant: an epsilon, an attention scale, a mask or its fill value, a rotary
cos/sin table, the 1 of ``1 - p``, a quantization scale. The rule below tells them apart by
the graph alone (never by names), as if constants were folded:

*Data* flows from every graph input whatever its type: what carries a gradient from a float
graph input (through differentiable edges), what a lookup (``Gather*``) reads from a table
with indices depending on a graph input (a quantized table included), and *index data*: the
float values computed from the values of ids, bytes, masks or positions without a float
input (``Cast``, ``OneHot``, ``Equal`` then ``Cast``, ``Where`` on a mask), and the float
outputs a schema marks non-differentiable. The *spectrum* of the data (what ``STFT`` or
``DFT`` computes from it, then its power or magnitude: squares, sums, roots, moves) is data;
a non-negative constant matrix multiplying it (``MatMul``, ``Gemm``) is a filterbank (mel,
Kaldi's, constant-Q), a fixed transform like a rotary table, not a weight. A ``Conv`` or
``MatMul`` of the data by a windowed DFT basis (``w_n cos(2 pi k n / N)``, ``w_n sin(...)``:
an STFT written as a convolution, the cosine and sine rows in one kernel or two) computes a
spectrum too; its kernel is no weight, nor is a normalised smoothing window a ``Conv``
applies (non-negative, symmetric, summing to 1: a Gaussian blur, a moving average). Two reads
of the data are not data: its *shape* (``Shape``, ``Size`` and what is computed from them and
constants: positions ``Range(seq)``), and its *statistics* (``DynamicQuantizeLinear``'s scale
and zero point, and what they compute). A layer whose only data operand is index data is a lookup
into its constant operand (one-hot rows times a kernel are an embedding; positions times
rotary frequencies a table, settled by use through ``Cos``/``Sin``). A fake quantization of
a value (a ``QuantizeLinear``/``DequantizeLinear`` pair, or the straight-through form
normalisation writes) has that value's role.

A value computed from initializers alone, or from them and shapes, is a *derived constant*;
the initializers behind it share its role, except the scale and zero point of a weight-only
dequantization written with plain ops (``(Cast(q) - z) s`` of 4-, 8- or 16-bit integer codes
``q``: quantization constants, as ``DequantizeLinear``'s), one number broadcast to a shape
(``Expand``, ``Tile``: a fill value) and the constants of *coordinates*: values computed
from the data's shape by a ``Range`` over it or by arithmetic with its values (a detector's
anchor grid ``Range(w) + 0.5`` times its stride, a sine position encoding
``2 pi i / (h + eps)``, or such a grid a static export folded: a table of three or more
distinct multiples of 1/2, or of eight or more evenly spaced values (``linspace``: the
centres of a radial-basis expansion ``exp(-gamma (d - mu_k)^2)`` of distances) or values in
geometric progression (the frequencies ``10000^(-k/n)`` of a sinusoidal time embedding),
added to, subtracted from or scaling the data), and the scale 1 and bias 0 of an
``InstanceNormalization`` whose output, reshaped, only meets a ``Mul`` (PyTorch's lowered
``GroupNorm``: its ``gamma`` and ``beta`` follow); a constant only moved or broadcast
by a shape keeps its role.
An initializer is a weight when a derived constant holding it meets data in a parameter
role:

* **layer**: an input of ``MatMul``, ``Gemm``, ``Conv``, a normalisation layer, ``Concat``
  or any op without a role below (custom and contrib ops included), a graph output;
* **embedding**: the table of a lookup (``Gather*``) by data indices whose rows are used
  other than as a factor of data (rotary cos/sin caches gathered by positions only
  multiply the queries and keys), or by constant indices whose rows are added to data
  (learned position embeddings, T5's relative attention bias);
* **scale**: a factor of ``Mul`` (or the divisor of ``Div``) spanning exactly one axis
  (a per-channel or per-feature scale: RMSNorm's weight), or one number scaling an affine
  value of one feature (``y = a x`` with ``x`` of shape ``[N, 1]``), or a factor of ``Mul``
  spanning several axes (an elementwise weight) unless its product is half of a rotation
  ``x T1 + r(x) T2``, ``r`` rearranging ``x`` (rotary cos/sin tables, computed or folded);
* **shift**: a term of ``Add``, ``Sum``, ``Mean`` added to an affine value, or subtracted
  from it by ``Sub`` (a bias), or spanning exactly one axis (a per-feature bias, TensorFlow's
  folded ``beta - mean k`` included); one number added where the sum only feeds ``Log``,
  ``Sqrt``, ``Reciprocal`` or a divisor is an epsilon (``log(W x + eps)``); ``c - x`` with
  ``c`` one number is a complement (``1 - p``), never a bias; nor is an exact 1 added where
  the sum only multiplies (the modulation ``x (1 + s)`` of an adaptive norm); a table added
  to attention scores (``q k^T``, scaled, masked) on their way to a ``Softmax`` is a
  relative-position bias an export folded (Swin's) when it holds many finite values not
  linear in ``j - i`` (a folded ALiBi is, and a mask holds two or three values).

*Affine* values are float graph inputs, outputs of layers (``MatMul``, ``Gemm``, ``Conv``
with a constant operand, a frozen or dequantized weight included), scaled or shifted affine
values, sums with an affine value and what moves them without other arithmetic (reshapes,
slices, gathers, ``Concat``, ``Neg``, sums and means over axes). So these are not weights: a
number scaling several features (attention scales, GELU's 0.5), the tables of a rotation, a
mask, a factor computed with a statistic of the data (a weight's quantization scale times
``DynamicQuantizeLinear``'s scale of the activations), a term added to a non-affine value
(RMSNorm's epsilon after ``ReduceMean``, the 1 of ``1 - p`` after a sigmoid), any operand of
``Pow``, ``Where``, ``Max``, ``Min``, ``Clip``, ``Mod`` (exponents, fill values, bounds), the
scales and zero points of quantized ops, the statistics a converter's preprocessing step was
fitted to (a lowered ``Scaler``'s offset and scale, marked
:data:`~onnxgrad.graph._builder.FITTED_STATISTIC`). ``If`` branches are walked as parts of
the graph (an output of the ``If`` has the roles of the branch outputs it may be), and so are
``Loop`` and ``Scan`` bodies, their inputs bound to the outer values they stand for (a scan
input has its sequence's role, a carried value is data when the data reaches it, the
iteration number counts positions; see :mod:`onnxgrad.graph._loop_roles`); initializers of
other ops' subgraphs count as weights (their role is not analysed).
Any initializer named explicitly is trained whatever its role.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import ModelProto, NodeProto, numpy_helper

from onnxgrad._onnx_utils import FLOAT_TYPES, normalize_domain, real_inputs, subgraphs
from onnxgrad.graph._builder import FITTED_STATISTIC
from onnxgrad.graph._differentiable import input_is_differentiable, output_is_differentiable
from onnxgrad.graph._loop_roles import LoopBinding, loop_binding, reached_states
from onnxgrad.graph._scopes import free_names

Shape = tuple[int | str | None, ...] | None

_LOOKUPS = frozenset({"Gather", "GatherElements", "GatherND"})
#: ops whose product with a constant (a frozen or dequantized weight) is a layer output
_LAYERS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})
_NEVER = frozenset({"Pow", "Where", "Max", "Min", "Clip", "Mod"})
_SCALES = frozenset({"Mul", "Div"})
_SHIFTS = frozenset({"Add", "Sub", "Sum", "Mean"})
#: ops whose output is affine when one of their data inputs is
_MOVES = _SHIFTS | {
    "Identity", "Cast", "CastLike", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten",
    "Slice", "Split", "Concat", "Expand", "Tile", "Pad", "Dropout", "Neg", "ReduceSum",
    "ReduceMean", *_LOOKUPS,
}  # fmt: skip
#: ops moving values without arithmetic
_PURE_MOVES = frozenset(
    {"Identity", "Cast", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice",
     "Expand", "Tile"}
)  # fmt: skip
#: ops whose non-differentiable float outputs summarise the data (not data themselves)
_STATISTICS = frozenset({"DynamicQuantizeLinear", "DynamicQuantizeMatMul"})
#: transforms of the data's values whose schemas mark them non-differentiable
_SPECTRAL = frozenset({"STFT", "DFT"})
#: ops turning a spectrum into its power or magnitude, or moving it: still a spectrum
_SPECTRUM_MAPS = _PURE_MOVES | {
    "ReduceSumSquare", "ReduceSum", "ReduceL2", "Mul", "Div", "Pow", "Abs", "Sqrt", "Add",
    "Sum", "Clip", "Max", "Concat", "Split", "Gather", "Pad",
}  # fmt: skip
#: the layers a filterbank multiplies a spectrum with
_FILTERBANKS = frozenset({"MatMul", "Gemm"})
#: ops broadcasting one number to a shape: a fill value, never a weight (TensorFlow's
#: LayerNorm as a BatchNormalization over ones and zeros expanded to the batch)
_FILLS = frozenset({"Expand", "Tile"})
#: elementwise maps of looked-up rows that keep them a table (rotary angles to cos/sin)
_ROW_MAPS = frozenset({"Cos", "Sin"})
#: ops rearranging their data input without other arithmetic than a sign
_REARRANGES = _PURE_MOVES | {"Neg", "Concat", "Split", "Gather", "GatherElements"}
#: contrib ops reading position tables: the indices of their cos/sin caches
_POSITION_TABLES = {"RotaryEmbedding": frozenset({2, 3}), "GroupQueryAttention": frozenset({7, 8})}
#: quantized ops: the indices of their float inputs that are weights (biases); every other
#: float input is a scale or a zero point
_QUANTIZED_BIASES = {
    "DynamicQuantizeMatMul": frozenset({4}),
    "MatMulIntegerToFloat": frozenset({6}),
    "QAttention": frozenset({2}),
    "MatMulNBits": frozenset({5}),
}
#: at most this many nodes in a fake quantization (the straight-through form has ~25)
_FAKE_QUANTIZATION_NODES = 64
_QUANTIZED_PREFIXES = ("QLinear", "QOrdered", "Quantize", "Dequantize", "DynamicQuantize", "QGemm")
#: integer types of quantized weights' codes (wider ones are shapes, positions, ids)
_CODE_TYPES = frozenset(
    {
        onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.INT8,
        onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16,
    }
)  # fmt: skip


def weight_initializers(model: ModelProto, candidates: set[str]) -> set[str]:
    """The ``candidates`` (float initializers of a checked model, nodes in topological order)
    that play a parameter role (see the module docstring), less the fitted preprocessing
    statistics a lowered converter operator holds."""
    fitted = {i.name for i in model.graph.initializer if i.doc_string == FITTED_STATISTIC}
    return _Roles(model, candidates - fitted).weights


def fake_quantized(graph) -> dict[str, tuple[str, list[NodeProto]]]:
    """``{output: (x, nodes)}`` for each fake quantization of a value ``x``: a
    ``DequantizeLinear(QuantizeLinear(x))`` pair, or the straight-through form normalisation
    writes of it (``DequantizeLinear(QuantizeLinear(sg(x))) + m (x - sg(x))``, see
    :mod:`onnxgrad.normalize.ste`); ``nodes`` computes ``output`` from ``x`` and constants."""
    producer = {o: n for n in graph.node for o in n.output if o}
    constants = {i.name for i in graph.initializer}
    found = {}
    for node in graph.node:
        source = _rounded_source(node, producer)
        if source is None:
            continue
        nodes = _nodes_between(node, source, producer, constants)
        if nodes is not None:
            found[node.output[0]] = (source, nodes)
    return found


def _rounded_source(node: NodeProto, producer: dict) -> str | None:
    def op(name: str) -> NodeProto | None:
        found = producer.get(name)
        return found if found is not None and not normalize_domain(found.domain) else None

    def quantized_from(name: str) -> str | None:
        dq = op(name)
        if dq is None or dq.op_type != "DequantizeLinear":
            return None
        q = op(dq.input[0])
        return q.input[0] if q is not None and q.op_type == "QuantizeLinear" else None

    if node.op_type == "DequantizeLinear" and not normalize_domain(node.domain):
        return quantized_from(node.output[0])
    if node.op_type != "Add" or len(node.input) != 2 or normalize_domain(node.domain):
        return None
    for first, second in (node.input, reversed(node.input)):
        mul = op(second)
        if quantized_from(first) is None or mul is None or mul.op_type != "Mul":
            continue
        names = list(mul.input)
        for _ in range(3):  # the difference may sit under a guard (Where) or a Cast
            found = [n for n in map(op, names) if n is not None]
            subs = [n for n in found if n.op_type == "Sub"]
            if subs:
                return subs[0].input[0]
            names = [i for n in found for i in n.input]
    return None


def _nodes_between(node: NodeProto, source: str, producer: dict, constants: set[str]):
    """The few nodes computing ``node``'s output from ``source`` and ``constants`` (``None``
    when another value, a graph input say, or a long computation reaches it)."""
    nodes, stack, seen = [node], list(node.input), {source}
    while stack:
        name = stack.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        found = producer.get(name)
        if found is None and name not in constants:
            return None
        if found is not None and found.op_type != "Constant":
            nodes.append(found)
            stack.extend(found.input)
        if len(nodes) > _FAKE_QUANTIZATION_NODES:
            return None
    return nodes


def _quantized_biases(op_type: str) -> frozenset[int] | None:
    if op_type in _QUANTIZED_BIASES:
        return _QUANTIZED_BIASES[op_type]
    if op_type.startswith(_QUANTIZED_PREFIXES) or op_type in {"MatMulInteger", "ConvInteger"}:
        return frozenset()
    return None


#: a folded grid has one entry per anchor (thousands); hand-written tables are smaller
_GRID_SIZE = 16


def _is_half_integer_grid(values: np.ndarray) -> bool:
    """At least :data:`_GRID_SIZE` finite values, three distinct, all multiples of 1/2."""
    flat = np.asarray(values).ravel()
    head = flat[:_GRID_SIZE].astype(np.float64) * 2  # a trained table fails here, uncopied
    if flat.size < _GRID_SIZE or not np.all(head == np.round(head)):
        return False
    doubled = flat.astype(np.float64) * 2
    if not np.all(np.isfinite(doubled)):
        return False
    return bool(np.all(doubled == np.round(doubled))) and np.unique(doubled).size >= 3


#: radial-basis expansions take 8 to 128 centres; fewer values may be a trained vector
_EVEN_GRID_SIZE = 8


def _is_even_grid(values: np.ndarray) -> bool:
    """At least :data:`_EVEN_GRID_SIZE` finite values along one axis, evenly spaced by a
    step that is not 0 (``linspace``: the centres ``mu_k`` of a radial-basis expansion
    ``exp(-gamma (d - mu_k)^2)``), up to float32 rounding."""
    if sum(1 for d in values.shape if d != 1) != 1 or values.size < _EVEN_GRID_SIZE:
        return False
    flat = values.ravel().astype(np.float64)
    if not np.all(np.isfinite(flat)):
        return False
    steps = np.diff(flat)
    if steps[0] == 0:
        return False
    return bool(np.abs(steps - steps[0]).max() <= 1e-5 * np.abs(flat).max())


def _is_progression(values: np.ndarray) -> bool:
    """Evenly spaced values (:func:`_is_even_grid`) or positive values evenly spaced in log
    (the frequencies ``10000^(-k/n)`` of a sinusoidal embedding of a time or noise level)."""
    if _is_even_grid(values):
        return True
    return bool(np.all(values > 0)) and _is_even_grid(np.log(values.astype(np.float64)))


#: what attention scores go through between ``q k^T`` and their ``Softmax``
_SCORE_STEPS = frozenset(
    {"Mul", "Div", "Add", "Sub", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Where"}
)
#: ops carrying a shift of every element alike on to their output (``Where`` on a mask)
_UNIFORM_SHIFTS = frozenset(
    {"Add", "Sub", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Where", "Identity", "Cast"}
)
#: more distinct values than a mask holds (0, a fill, their sum)
_BIAS_VALUES = 4
#: no learned bias reaches this; masks' fills do
_BIAS_BOUND = 1e3


def _is_bias_table(values: np.ndarray) -> bool:
    """A learned bias over (query, key) pairs: two trailing axes of more than one entry,
    finite and below a mask's fill, of more than three distinct values, and not linear in
    ``j - i`` along the keys (ALiBi's ``-m |i - j|`` is, within each causal half: its slope
    is constant in ``j``)."""
    if values.ndim < 2 or min(values.shape[-2:]) < 2 or not np.all(np.isfinite(values)):
        return False
    if np.abs(values).max() >= _BIAS_BOUND:
        return False  # a mask's fill (-1e4, -1e9, the lowest float) folded in
    if np.unique(values).size < _BIAS_VALUES:
        return False
    steps = np.diff(values.astype(np.float64), axis=-1)
    upper = np.triu(np.ones(steps.shape[-2:], bool))  # keys at or after the query
    lower = ~upper
    for half in (upper, lower):
        spread = steps[..., half]
        if spread.size and np.ptp(spread, axis=-1).max() > 1e-6 * (np.abs(spread).max() + 1):
            return True
    return False


def _may_be_dft_basis(bins: int, size: int) -> bool:
    """Whether a ``bins x size`` kernel has the shape of :func:`_is_dft_basis`'s bases, one
    or two stacked."""
    if size < 4:
        return False
    return 2 <= bins <= size // 2 + 1 or (bins % 2 == 0 and 2 <= bins // 2 <= size // 2 + 1)


def _is_dft_basis(kernel: np.ndarray) -> bool:
    """Rows ``k = 0 .. F-1`` (``F <= N/2 + 1``) of a windowed DFT basis over ``N`` samples:
    ``w_n cos(2 pi k n / N)`` (row 0 is the window ``w``), or ``+-w_n sin(2 pi k n / N)``
    with ``w >= 0`` (row 0 is zero; ``w_n^2 = sum_k K_kn^2 / sum_k sin^2``), to 1e-4 of the
    largest entry. Read a row at a time (a layer's kernel fails at its first rows, and no
    float64 copy of it is made)."""
    bins, size = kernel.shape
    if not _may_be_dft_basis(bins, size) or bins > size // 2 + 1:
        return False
    tolerance = 1e-4 * float(max(kernel.max(), -kernel.min()))
    if not np.isfinite(tolerance) or tolerance == 0:
        return False
    samples = np.arange(size)

    def row(k: int) -> np.ndarray:
        return kernel[k].astype(np.float64)

    def angle(k: int) -> np.ndarray:
        return 2 * np.pi * k * samples / size

    def close(k: int, expected: np.ndarray) -> bool:
        return bool(np.abs(row(k) - expected).max() <= tolerance)

    window = row(0)
    if np.abs(window).max() > tolerance:
        return all(close(k, window * np.cos(angle(k))) for k in range(1, bins))
    squares = sum(np.square(row(k)) for k in range(bins))
    sines = sum(np.square(np.sin(angle(k))) for k in range(bins))
    window = np.sqrt(squares / np.maximum(sines, 1e-12))
    return any(
        all(close(k, sign * window * np.sin(angle(k))) for k in range(bins)) for sign in (1, -1)
    )


def _spans_one_axis(shape: Shape) -> bool | None:
    """Whether a broadcast operand varies along exactly one axis (``None``: unknown)."""
    if shape is None:
        return None
    return sum(1 for d in shape if not (isinstance(d, int) and d == 1)) == 1


def _is_single(shape: Shape) -> bool:
    return shape is not None and all(isinstance(d, int) and d == 1 for d in shape)


def _value_shapes(model: ModelProto) -> dict[str, Shape]:
    from onnxgrad._model_checks import weightless_view

    try:
        inferred = onnx.shape_inference.infer_shapes(weightless_view(model))
    except Exception:  # shapes are a hint: an unknown shape keeps the conservative answer
        inferred = model
    graph = inferred.graph
    shapes: dict[str, Shape] = {i.name: tuple(i.dims) for i in model.graph.initializer}
    for info in [*graph.input, *graph.output, *graph.value_info]:
        tensor = info.type.tensor_type
        if info.type.HasField("tensor_type") and tensor.HasField("shape"):
            shapes.setdefault(
                info.name,
                tuple(
                    d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in tensor.shape.dim
                ),
            )
    return shapes


class _Roles:
    """One forward walk over the main graph tracking data, affine values and derived
    constants (``sources``: the candidate initializers each one holds)."""

    def __init__(self, model: ModelProto, candidates: set[str]):
        from onnxgrad.graph._differentiable import model_opsets, value_elem_types

        self.opsets: Mapping[str, int] = model_opsets(model)
        self.types = value_elem_types(model)
        self.shapes = _value_shapes(model)
        inputs = [i.name for i in real_inputs(model)]
        self.any_data: set[str] = set(inputs)
        self.data = {n for n in inputs if self._is_float(n)}
        self.affine = set(self.data)
        #: values depending on the data only through its shape (``Shape``, ``Size``)
        self.shape_only: set[str] = set()
        #: of those, derived constants only moved or broadcast by a shape (``Expand``,
        #: ``Tile`` to the batch): they keep their role, no coordinates
        self.broadcast: set[str] = set()
        #: float values computed from the data's values without a float input (casts of
        #: ids, bytes, masks, one-hot encodings, positions): data, not affine
        self.index_data: set[str] = set()
        #: values depending on the data through float outputs its op schemas mark
        #: non-differentiable (``DynamicQuantizeLinear``'s scale); integer ones (codes,
        #: comparisons, a float input cast to byte values) are index data
        self.statistics: set[str] = set()
        self.sources: dict[str, frozenset[str]] = {n: frozenset({n}) for n in candidates}
        #: data values that are a spectrum of the data, its power or its magnitude
        self.spectra: set[str] = set()
        self.initializers = {i.name: i for i in model.graph.initializer}
        #: derived constants holding rows of a table (a lookup by constant indices)
        self.rows: set[str] = set()
        #: derived constants combined with statistics of the data (non-differentiable reads
        #: of it: ``DynamicQuantizeLinear``'s scale), recomputed for every input
        self.rescales: set[str] = set()
        #: data looked up in a table, moved without arithmetic yet: its table's sources
        self.looked_up: dict[str, frozenset[str]] = {}
        #: data products by a table spanning several axes, undecided: (sources, data root)
        self.tabled: dict[str, tuple[frozenset[str], str]] = {}
        #: the value each data value is a rearrangement of (slices, signs, concatenations)
        self.root: dict[str, str] = {}
        self.weights: set[str] = set()
        #: constant integer codes cast to float, moved or less a zero point: ``Cast(q) - z``
        self.codes: set[str] = set()
        #: attention scores: products of two data values (``q k^T``), scaled, masked, moved
        self.scores: set[str] = set()
        #: ``(op_type, input index)`` of each use of a value in the main graph
        self.uses: dict[str, list[tuple[str, int]]] = {}
        #: the nodes reading each value in the main graph
        self.readers: dict[str, list[NodeProto]] = {}
        self.graph_outputs = {o.name for o in model.graph.output}
        for node in model.graph.node:
            for index, name in enumerate(node.input):
                self.uses.setdefault(name, []).append((node.op_type, index))
                self.readers.setdefault(name, []).append(node)
        rounded = fake_quantized(model.graph)
        #: the fake quantization of each value so rounded: ``{x: its rounded output}``
        self.rounded_to = {source: output for output, (source, _) in rounded.items()}
        inside = {id(n) for _, nodes in rounded.values() for n in nodes}
        for node in model.graph.node:
            if node.output and node.output[0] in rounded:
                self._alias(node.output[0], rounded[node.output[0]][0])
            elif id(node) not in inside:
                self._visit(node)
        for output in model.graph.output:
            self.weights.update(self.sources.get(output.name, ()))
            self.weights.update(self.looked_up.get(output.name, ()))
        for sources, _ in self.tabled.values():
            self.weights.update(sources)
        self.weights &= candidates

    def _alias(self, name: str, source: str) -> None:
        """``name`` holds ``source`` rounded (fake quantization): the same role."""
        for group in (self.any_data, self.data, self.affine, self.shape_only, self.index_data,
                      self.statistics, self.rows, self.rescales):  # fmt: skip
            if source in group:
                group.add(name)
        for table in (self.sources, self.looked_up, self.tabled):
            if source in table:
                table[name] = table.pop(source) if table is not self.sources else table[source]
        if source in self.data:
            self.root[name] = self.root.get(source, source)

    def _is_float(self, name: str) -> bool:
        return self.types.get(name, onnx.TensorProto.FLOAT) in FLOAT_TYPES

    def _visit(self, node: NodeProto) -> None:
        if subgraphs(node):
            self._visit_with_subgraphs(node)
            return
        self._settle_lookups(node)
        self._settle_tables(node)
        diff = [
            (i, name)
            for i, name in enumerate(node.input)
            if name and input_is_differentiable(node, i, self.opsets)
        ]
        constants = [(i, n) for i, n in diff if n in self.sources]
        data = [n for _, n in diff if n in self.data]
        lookup = (
            node.op_type in _LOOKUPS
            and len(node.input) > 1
            and node.input[0] in self.sources
            and node.input[1] in self.any_data
        )
        touches_data = any(n in self.any_data for n in node.input)
        outputs = [
            o
            for i, o in enumerate(node.output)
            if o and self._is_float(o) and output_is_differentiable(node, i, self.opsets)
        ]
        if touches_data and self._reads_shape_only(node):
            self.shape_only.update(o for o in node.output if o)
            if self._broadcasts(node):
                self.broadcast.update(o for o in node.output if o)
        elif not data and not lookup and touches_data:
            values = self._index_values(node)
            floats = [o for o in node.output if o and self._is_float(o)]
            if not values:
                self.statistics.update(o for o in node.output if o)
            elif floats and node.op_type in _SPECTRAL:
                data, outputs = values, floats
                self.spectra.update(outputs)
            elif floats:  # OneHot's schema marks its output non-differentiable: still data
                data, outputs = values, floats
                self.index_data.update(outputs)
        if not data and not lookup:
            held = frozenset().union(*(self.sources[n] for _, n in constants))
            if not touches_data and self._dequantizes(node):
                held = frozenset()
            if self._computes_a_grid(node, diff):
                held = self._tables_added(node, held)
            table = node.op_type in _LOOKUPS and node.input[0] in self.sources
            from_rows = table or any(n in self.rows for _, n in constants)
            fill = node.op_type in _FILLS and _is_single(self.shapes.get(node.input[0]))
            for out in outputs:
                if held and not fill:
                    self.sources[out] = held
                if held and from_rows:
                    self.rows.add(out)
            if touches_data:
                self.any_data.update(o for o in node.output if o)
                if held:
                    self.rescales.update(outputs)
            return
        if not lookup and self._is_index_product(node, data):
            lookup = True
            tables = [self.sources[n] for _, n in constants]
            self.looked_up.update((o, frozenset().union(*tables)) for o in outputs)
            constants = []
        elif lookup:
            self.looked_up.update((o, self.sources[node.input[0]]) for o in outputs)
        weight_found = lookup
        fourier = self._is_fourier_transform(node, constants, data)
        fixed = self._is_filterbank(node, constants, data) or self._is_smoothing(node, constants)
        if fourier or fixed:
            constants = []
        for index, name in constants:
            if index == 0 and lookup:
                continue
            added_rows = name in self.rows and node.op_type in _SHIFTS
            if self._is_table_factor(node, index, data):
                root = self.root.get(data[0], data[0])
                self.tabled.update((o, (self.sources[name], root)) for o in outputs)
                weight_found = True
            elif added_rows or self._is_weight_role(node, index, data):
                self.weights.update(self.sources[name])
                weight_found = True
        self.any_data.update(o for o in node.output if o)
        self.data.update(outputs)
        self._undifferentiated_outputs(node, outputs)
        if not lookup and all(n in self.index_data for n in data if self._is_float(n)):
            self.index_data.update(outputs)
        self._track_root(node, data, outputs)
        self._track_scores(node, data, outputs)
        if fourier or self._keeps_a_spectrum(node, data, weight_found):
            self.spectra.update(outputs)
        if self._output_is_affine(node, data, weight_found, lookup):
            self.affine.update(outputs)

    def _dequantizes(self, node: NodeProto) -> bool:
        """Whether ``node`` computes integer codes as floats (``Cast`` of 4- to 16-bit
        integers, moved, less a zero point) or scales them (``codes s``, ``codes / s``): a
        weight-only dequantization, whose scale and zero point are no weights."""
        op, first = node.op_type, node.input[0] if node.input else ""
        if normalize_domain(node.domain):
            return False
        if op in ("Cast", "CastLike") and self.types.get(first) in _CODE_TYPES:
            codes = True
        elif op in _PURE_MOVES or op == "Sub":
            codes = first in self.codes
        elif op in _SCALES:
            return first in self.codes or (op == "Mul" and node.input[1] in self.codes)
        else:
            return False
        if codes:
            self.codes.update(o for o in node.output if o)
        return codes

    def _keeps_a_spectrum(self, node: NodeProto, data: list[str], weight_found: bool) -> bool:
        """Power, magnitude or a move of a spectrum, with no weight of its own."""
        return (
            node.op_type in _SPECTRUM_MAPS
            and not normalize_domain(node.domain)
            and not weight_found
            and all(n in self.spectra for n in data)
        )

    def _is_filterbank(self, node: NodeProto, constants: list, data: list[str]) -> bool:
        """A non-negative constant matrix multiplying a spectrum of the data (its power or
        magnitude): a mel or constant-Q filterbank, a fixed transform (a trained layer on a
        spectrum has weights of both signs)."""
        if node.op_type not in _FILTERBANKS or normalize_domain(node.domain) or not data:
            return False
        if not all(n in self.spectra for n in data) or not constants:
            return False
        held = frozenset().union(*(self.sources[n] for _, n in constants))
        return all(self._non_negative(n) for n in held)

    def _is_fourier_transform(self, node: NodeProto, constants: list, data: list[str]) -> bool:
        """A ``Conv`` or ``MatMul`` of the data by a windowed DFT basis, or by the cosine rows
        stacked on the sine rows (an STFT written as a convolution: torchlibrosa's, nnAudio's,
        silero's ``forward_basis_buffer``): a spectrum, its kernel a fixed transform."""
        if node.op_type not in ("Conv", "MatMul") or normalize_domain(node.domain):
            return False
        if len(data) != 1 or [i for i, _ in constants] != [1]:
            return False
        tensor = self.initializers.get(constants[0][1])
        if tensor is None:
            return False
        dims = list(tensor.dims)
        if node.op_type == "MatMul":
            rows = dims[::-1] if len(dims) == 2 else None
        elif len(dims) >= 3 and sum(d != 1 for d in dims[1:]) == 1:
            rows = [dims[0], int(np.prod(dims[1:]))]
        else:
            rows = None
        if rows is None or not _may_be_dft_basis(*rows):
            return False  # read before the values: a layer's kernel is not copied
        kernel = numpy_helper.to_array(tensor)
        kernel = kernel.T if node.op_type == "MatMul" else kernel.reshape(rows)
        halves = np.split(kernel, 2) if kernel.shape[0] % 2 == 0 else []
        return _is_dft_basis(kernel) or bool(halves and all(map(_is_dft_basis, halves)))

    def _is_smoothing(self, node: NodeProto, constants: list) -> bool:
        """A ``Conv`` by a normalised smoothing window: one kernel for every channel (one
        input channel each), of three or more taps, non-negative, symmetric, summing to 1
        (a Gaussian blur, a moving average: silero's adaptive normalisation filter)."""
        if node.op_type != "Conv" or normalize_domain(node.domain):
            return False
        if [i for i, _ in constants] != [1]:
            return False
        tensor = self.initializers.get(constants[0][1])
        if tensor is None:
            return False
        dims = list(tensor.dims)
        if len(dims) < 3 or dims[1] != 1 or np.prod(dims[1:]) < 3:
            return False  # read before the values: a layer's kernel is not copied
        kernel = numpy_helper.to_array(tensor).astype(np.float64)
        spatial = tuple(range(1, kernel.ndim))
        return bool(
            np.all(kernel >= 0)
            and np.all(kernel == kernel[:1])
            and np.allclose(kernel, np.flip(kernel, axis=spatial[1:]), rtol=0, atol=1e-7)
            and abs(kernel[0].sum() - 1) <= 1e-5
        )

    def _non_negative(self, name: str) -> bool:
        tensor = self.initializers.get(name)
        return tensor is not None and bool(np.all(numpy_helper.to_array(tensor) >= 0))

    def _undifferentiated_outputs(self, node: NodeProto, outputs: list[str]) -> None:
        """Float outputs of data that a schema marks non-differentiable: statistics for a
        dynamic quantization's scale and zero point, index data otherwise (``STFT``'s
        spectrum is data though it has no gradient)."""
        floats = [o for o in node.output if o and o not in outputs and self._is_float(o)]
        if node.op_type in _STATISTICS:
            self.statistics.update(floats)
        else:
            self.data.update(floats)
            self.index_data.update(floats)

    def _reads_shape_only(self, node: NodeProto) -> bool:
        """Whether the data reaches ``node``'s outputs through shapes only: a ``Shape`` or
        ``Size`` of it, or values computed from such shapes and constants."""
        if node.op_type in ("Shape", "Size"):
            return True
        read = [n for n in node.input if n in self.any_data]
        return bool(read) and all(n in self.shape_only for n in read)

    def _computes_a_grid(self, node: NodeProto, diff: list[tuple[int, str]]) -> bool:
        """Whether ``node`` computes coordinates from the data's shape: a ``Range`` over it,
        or arithmetic with values of the shape (``Range(w) + 0.5``, a stride times a grid,
        ``2 pi i / (h + eps)``). Its constants are coordinates (offsets, strides, sine
        position encodings' scales), not parameters; a constant moved or broadcast by a
        shape (``Expand``, ``Reshape``, ``Resize``'s sizes, ``Slice``'s ends) keeps its role."""
        if not any(n in self.shape_only for n in node.input):
            return False
        return node.op_type == "Range" or any(
            n in self.shape_only and n not in self.broadcast for _, n in diff
        )

    def _broadcasts(self, node: NodeProto) -> bool:
        """Whether ``node`` only moves a derived constant (or one so broadcast already) by a
        shape of the data: its moved input holds initializers, no other input is data."""
        if node.op_type not in _PURE_MOVES or not node.input:
            return False
        moved = node.input[0]
        held = moved in self.sources and (moved not in self.shape_only or moved in self.broadcast)
        return held and moved not in self.data

    def _tables_added(self, node: NodeProto, held: frozenset[str]) -> frozenset[str]:
        """Of the constants of a node computing coordinates, the bias tables it adds (Swin's
        folded position bias added to a window mask computed from the shape): they keep
        their role; offsets, strides and scales are coordinates."""
        if node.op_type not in _SHIFTS:
            return frozenset()
        return frozenset(
            n
            for n in held
            if n in self.initializers
            and _is_bias_table(numpy_helper.to_array(self.initializers[n]))
        )

    def _index_values(self, node: NodeProto) -> list[str]:
        """The data values (ids, bytes, masks, positions, index data) a node without float
        data computes its float outputs from: they make those outputs data. Statistics of
        float data (``DynamicQuantizeLinear``'s scale) and shapes do not."""
        return [
            n
            for n in node.input
            if n in self.any_data
            and n not in self.shape_only
            and n not in self.statistics
            and (not self._is_float(n) or n in self.index_data or self._read_as_data(node, n))
        ]

    def _read_as_data(self, node: NodeProto, name: str) -> bool:
        """Float data that a spectral transform reads where its schema gives no gradient
        (``STFT``'s signal): still data (a ``CastLike`` target is read for its type only)."""
        return name in self.data and node.op_type in _SPECTRAL

    def _is_index_product(self, node: NodeProto, data: list[str]) -> bool:
        """A layer whose only data operand is index data (a one-hot encoding, positions)
        with a constant operand is a lookup into that constant: one-hot rows times a kernel
        are an embedding, positions times rotary frequencies a position table."""
        return (
            node.op_type in _LAYERS
            and not normalize_domain(node.domain)
            and bool(data)
            and all(n in self.index_data for n in data)
            and any(n in self.sources for n in node.input[:2])
        )

    def _settle_lookups(self, node: NodeProto) -> None:
        """Rows looked up by data indices are an embedding (their table a weight) once used,
        unless they only multiply other data (rotary cos/sin caches): moves, ``Cos``/``Sin``,
        concatenations of rows and products by constants pass them on."""
        pending = [n for n in node.input if n in self.looked_up]
        if not pending:
            return
        if self._passes_rows_on(node, pending):
            table = frozenset().union(*(self.looked_up[n] for n in pending))
            self.looked_up.update((o, table) for o in node.output if o)
            return
        others = [n for n in node.input if n in self.data and n not in self.looked_up]
        if node.op_type == "Mul" and others:
            return
        for name in pending:
            self.weights.update(self.looked_up[name])

    def _passes_rows_on(self, node: NodeProto, pending: list[str]) -> bool:
        if node.op_type in _PURE_MOVES or node.op_type in _ROW_MAPS:
            return node.input[0] in self.looked_up
        if node.op_type == "Concat":
            return all(n in self.looked_up for n in node.input if n in self.data)
        if node.op_type in _SCALES:
            return not any(n in self.data for n in node.input if n not in pending)
        return False

    def _is_table_factor(self, node: NodeProto, index: int, data: list[str]) -> bool:
        """A factor of ``Mul`` spanning several axes of one data operand: a weight unless the
        product turns out to be half of a rotation (see :meth:`_settle_tables`)."""
        if node.op_type != "Mul" or normalize_domain(node.domain) or len(data) != 1:
            return False
        shape = self.shapes.get(node.input[index])
        return shape is not None and not _spans_one_axis(shape) and not _is_single(shape)

    def _track_root(self, node: NodeProto, data: list[str], outputs: list[str]) -> None:
        if node.op_type not in _REARRANGES or not data:
            return
        roots = {self.root.get(n, n) for n in data}
        if len(roots) == 1:
            root = roots.pop()
            self.root.update((o, root) for o in outputs)

    def _settle_tables(self, node: NodeProto) -> None:
        """``x T1 + r(x) T2`` with ``r`` a rearrangement of ``x`` (rotate-half, interleaved
        pairs) is a rotation: ``T1``, ``T2`` are position tables (cos/sin), not weights. A
        table product used any other way makes its table a weight."""
        pending = [n for n in node.input if n in self.tabled]
        if not pending:
            return
        roots = {self.tabled[n][1] for n in pending}
        rotation = (
            node.op_type in ("Add", "Sub")
            and len(node.input) == len(pending) == 2
            and len(roots) == 1
        )
        for name in pending:
            sources, _ = self.tabled.pop(name)
            if not rotation:
                self.weights.update(sources)

    def _visit_with_subgraphs(self, node: NodeProto) -> None:
        if node.op_type == "If" and not normalize_domain(node.domain):
            self._visit_branches(node)
            return
        binding = loop_binding(node, self.opsets.get("", 0))
        if binding is not None:
            self._visit_body(binding)
            return
        read = set(node.input)
        for sub in subgraphs(node):
            read |= free_names(sub)
        for name in read:
            self.weights.update(self.sources.get(name, ()))
            self.weights.update(self.looked_up.get(name, ()))
        if any(n in self.any_data for n in read):
            self.any_data.update(o for o in node.output if o)
            self.data.update(o for o in node.output if o and self._is_float(o))

    def _visit_branches(self, node: NodeProto) -> None:
        """An ``If``: both branches are walked as parts of the graph (they read the outer
        values by name), and each output takes the roles of the branch outputs it may be."""
        branches = subgraphs(node)
        for branch in branches:
            for inner in branch.node:
                self._visit(inner)
        for index, name in enumerate(node.output):
            if name:
                self._merge(name, [b.output[index].name for b in branches])

    def _visit_body(self, binding: LoopBinding) -> None:
        """A ``Loop`` or ``Scan``: its body walked as a part of the graph, its inputs bound
        to the outer values they stand for (see :mod:`onnxgrad.graph._loop_roles`)."""
        reached = reached_states(binding, self._carries_data)
        for inner, outer in [*binding.states, *binding.slices]:
            if inner in reached and not self._carries_data(outer):
                self.any_data.add(inner)  # the data reaches it through an iteration
                if self._is_float(inner):
                    self.data.add(inner)
            elif outer:
                self._merge(inner, [outer])
        if binding.counter is not None:
            counter, trips = binding.counter
            if trips in self.any_data:  # positions up to a length of the data
                self.any_data.add(counter)
                self.shape_only.add(counter)
        for inner in binding.body.node:
            for index, name in enumerate(inner.input):
                self.uses.setdefault(name, []).append((inner.op_type, index))
                self.readers.setdefault(name, []).append(inner)
        for inner in binding.body.node:
            self._visit(inner)
        for name, inner in binding.results:
            self._merge(name, [inner])

    def _carries_data(self, name: str) -> bool:
        """Whether ``name`` holds values of the data (not only its shape or statistics)."""
        return name in self.any_data and name not in self.shape_only and name not in self.statistics

    def _merge(self, name: str, sources: list[str]) -> None:
        """``name`` is one of ``sources`` (an ``If``'s output): data, affine when one of them
        is; a spectrum, a shape, index data, codes... only when all are."""
        for group in (self.any_data, self.data, self.affine):
            if any(s in group for s in sources):
                group.add(name)
        for group in (self.shape_only, self.index_data, self.statistics, self.rows,
                      self.rescales, self.spectra, self.codes, self.scores):  # fmt: skip
            if all(s in group for s in sources):
                group.add(name)
        for table in (self.sources, self.looked_up):
            held = [table[s] for s in sources if s in table]
            if held:
                table[name] = frozenset().union(*held)
        tabled = [self.tabled[s] for s in sources if s in self.tabled]
        if tabled:
            self.tabled[name] = tabled[0]
        roots = {self.root.get(s, s) for s in sources if s in self.data}
        if len(roots) == 1:
            self.root[name] = roots.pop()

    def _is_weight_role(self, node: NodeProto, index: int, data: list[str]) -> bool:
        op = node.op_type
        biases = _quantized_biases(op)
        if biases is not None:
            return index in biases
        domain = normalize_domain(node.domain)
        if domain != "":
            return index not in _POSITION_TABLES.get(op, frozenset())
        if op in _NEVER:
            return False
        if (op in _SCALES or op in _SHIFTS) and self._is_folded_grid(node.input[index]):
            return False
        if op == "InstanceNormalization" and index and self._is_lowered_group_norm(node):
            return False
        if op in _SCALES:
            return self._is_scale(node, index, data)
        if op in _SHIFTS:
            shape = self.shapes.get(node.input[index])
            if _spans_one_axis(shape) and not _is_single(shape):
                return True  # a per-feature bias: ``beta - mean k`` of a folded norm too
            complement = op == "Sub" and index == 0
            if complement:
                return False
            if _is_single(shape) and self._guards_a_singularity(node.output[0]):
                return False  # an epsilon: log(W x + eps)
            if _is_single(shape) and self._is_unit_offset(node, index):
                return False  # the 1 of a modulation x (1 + s)
            if _is_single(shape) and self._only_shifts_softmax(node.output[0]):
                return False  # softmax(x + c) = softmax(x): no gradient reaches c
            if self._is_position_bias(node, index, data):
                return True
            return any(n in self.affine for n in data)
        return True

    def _track_scores(self, node: NodeProto, data: list[str], outputs: list[str]) -> None:
        """Attention scores: a ``MatMul`` of two data values (``q k^T``), then what scales,
        masks or moves them."""
        product = node.op_type == "MatMul" and len(data) == 2
        step = node.op_type in _SCORE_STEPS and data and all(n in self.scores for n in data)
        if product or step:
            self.scores.update(outputs)

    def _is_position_bias(self, node: NodeProto, index: int, data: list[str]) -> bool:
        """A relative-position bias an export folded (Swin's ``Gather(table, index)`` made
        one ``[1, heads, S, S]`` constant): a term added to attention scores on their way to
        a ``Softmax``, spanning several axes, holding many finite values, and not a function
        of ``j - i`` linear in it (a folded ALiBi slope) nor a mask (two or three values:
        ``0`` and a fill)."""
        if node.op_type != "Add" or not data or not all(n in self.scores for n in data):
            return False
        if not self._reaches_softmax(node.output[0]):
            return False
        arrays = [
            numpy_helper.to_array(self.initializers[n])
            for n in self.sources.get(node.input[index], ())
            if n in self.initializers
        ]
        return bool(arrays) and all(_is_bias_table(a) for a in arrays)

    def _reaches_softmax(self, name: str, steps: int = 4) -> bool:
        """Whether ``name`` feeds a ``Softmax`` within ``steps`` score steps (a mask added,
        a reshape)."""
        for reader in self.readers.get(name, ()):
            if reader.op_type in ("Softmax", "LogSoftmax"):
                return True
            onward = steps and reader.op_type in _SCORE_STEPS and reader.output
            if onward and self._reaches_softmax(reader.output[0], steps - 1):
                return True
        return False

    def _only_shifts_softmax(self, name: str, steps: int = 8) -> bool:
        """Whether ``name`` only reaches ``Softmax`` or ``LogSoftmax`` inputs, through sums,
        moves and a mask's ``Where`` (its shape aside): a number added to it shifts every
        score alike, which they are invariant to (DeBERTa's ``score = 0`` folded)."""
        if name in self.graph_outputs:
            return False
        readers = [r for r in self.readers.get(name, ()) if r.op_type not in ("Shape", "Size")]
        for reader in readers:
            if reader.op_type in ("Softmax", "LogSoftmax"):
                continue
            moves = reader.op_type in _UNIFORM_SHIFTS and reader.output and steps
            if not moves or (reader.op_type == "Where" and reader.input[0] == name):
                return False
            if not self._only_shifts_softmax(reader.output[0], steps - 1):
                return False
        return bool(readers)

    def _is_folded_grid(self, name: str) -> bool:
        """Coordinates a static export folded (a detector's anchor centres ``k + 1/2``, its
        strides 8, 16, 32): a table of one entry per anchor, at least three distinct values,
        every one a multiple of 1/2, added to or multiplying the data; or evenly spaced
        values, a ``linspace`` (radial-basis centres subtracted from distances), or a geometric
        progression (sinusoidal frequencies). Trained biases and scales take arbitrary values
        (a fresh model's ones and zeros are one value)."""
        arrays = [
            numpy_helper.to_array(self.initializers[n])
            for n in self.sources.get(name, ())
            if n in self.initializers
        ]
        return bool(arrays) and all(_is_half_integer_grid(a) or _is_progression(a) for a in arrays)

    def _is_lowered_group_norm(self, node: NodeProto) -> bool:
        """``GroupNorm`` as PyTorch's dynamo export lowers it: ``InstanceNormalization`` of
        the groups with scale 1 and bias 0, reshaped back (each step quantized and
        dequantized by ``quantize_static``), then ``x gamma + beta`` per channel. Its ones
        and zeros are structure; ``gamma`` and ``beta`` are the weights."""
        constants = []
        for name in node.input[1:3]:
            sources = [n for n in self.sources.get(name, ()) if n in self.initializers]
            if len(sources) != 1:
                return False
            constants.append(numpy_helper.to_array(self.initializers[sources[0]]))
        if len(constants) != 2 or np.any(constants[0] != 1) or np.any(constants[1] != 0):
            return False
        value = node.output[0]
        while True:
            value = self.rounded_to.get(value, value)
            readers = self.readers.get(value, [])
            if len(readers) != 1 or readers[0].op_type != "Reshape":
                return bool(readers) and all(r.op_type == "Mul" for r in readers)
            value = readers[0].output[0]

    def _one_feature_affine(self, data: list[str]) -> bool:
        """Whether some data operand is an affine value of one feature (``[N, 1]``)."""
        return any(n in self.affine and (s := self.shapes.get(n)) and s[-1] == 1 for n in data)

    def _guards_a_singularity(self, name: str) -> bool:
        """Whether every use of ``name`` is a ``Log``, ``Sqrt``, ``Reciprocal`` or a divisor:
        a number added there keeps them away from 0."""
        uses = self.uses.get(name, [])
        return bool(uses) and all(
            op in ("Log", "Sqrt", "Reciprocal") or (op == "Div" and index == 1)
            for op, index in uses
        )

    def _is_unit_offset(self, node: NodeProto, index: int) -> bool:
        """Whether ``node`` adds exactly 1 to a value only read as a factor of ``Mul``: the
        identity of a modulation ``x (1 + s)`` (an adaptive norm's or FiLM's scale ``s``
        computed from a condition), as the 1 of ``1 - p`` is a complement, not a bias."""
        if node.op_type != "Add":
            return False
        arrays = [
            numpy_helper.to_array(self.initializers[n])
            for n in self.sources.get(node.input[index], ())
            if n in self.initializers
        ]
        if not arrays or not all(a.size == 1 and float(a.ravel()[0]) == 1.0 for a in arrays):
            return False
        uses = self.uses.get(node.output[0], [])
        return bool(uses) and all(op == "Mul" for op, _ in uses)

    def _is_scale(self, node: NodeProto, index: int, data: list[str]) -> bool:
        if (node.op_type == "Div" and index != 1) or node.input[index] in self.rescales:
            return False
        shape = self.shapes.get(node.input[index])
        spans = _spans_one_axis(shape)
        if spans is None or spans:
            return True
        if not _is_single(shape):
            return False
        return self._one_feature_affine(data)

    def _output_is_affine(self, node, data, weight_found: bool, lookup: bool) -> bool:
        op = node.op_type
        if lookup or (weight_found and op not in _SHIFTS):
            return True
        if op in _LAYERS and any(n not in self.any_data for n in node.input[:2] if n):
            return True
        affine_in = any(n in self.affine for n in data)
        if op in _MOVES:
            return affine_in
        if op in _SCALES and len(data) == 1:
            return affine_in
        return False
