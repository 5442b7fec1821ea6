"""``ai.onnx.ml`` operators without a usable derivative.

Converted scikit-learn models reach the engine through
:func:`onnxgrad.lower_ml_operators`, which turns the differentiable ``ai.onnx.ml``
operators (linear models, scalers, normalizers...) into standard ONNX: those need no rule
here. What remains are operators whose output is piecewise constant in their float
inputs (tree ensembles split on thresholds, lookup tables map values to values): their
derivative is 0 almost everywhere and undefined at the jumps, so a gradient through them
would be silently zero. The engine refuses such a model with one error naming the
operator. ``Binarizer``, ``ZipMap`` and the map conversions carry no gradient at all.
"""

from onnxgrad.derivative.autodiff.registry import (
    register_not_differentiable,
    register_zero_gradient,
)

ML_DOMAIN = "ai.onnx.ml"

register_not_differentiable(
    "TreeEnsembleRegressor",
    "TreeEnsembleClassifier",
    "TreeEnsemble",
    domain=ML_DOMAIN,
    reason="is a tree ensemble: its output is piecewise constant in the input (the "
    "derivative is 0 almost everywhere, undefined at the split thresholds)",
)
register_not_differentiable(
    "LabelEncoder",
    "CategoryMapper",
    "OneHotEncoder",
    domain=ML_DOMAIN,
    reason="looks values up in a table: its output is piecewise constant in the input",
)
register_zero_gradient("Binarizer", "ZipMap", "CastMap", "DictVectorizer", domain=ML_DOMAIN)
