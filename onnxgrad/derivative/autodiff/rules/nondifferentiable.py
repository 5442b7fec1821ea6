"""Ops whose outputs carry no gradient.

Either they are not differentiable (integer or boolean results, shapes, indices, random
samples) or they are piecewise constant, with a derivative of zero almost everywhere (Sign,
Floor, Ceil, Round, Hardmax). The engine treats their outputs as constants and never asks
for a rule. Ops with integer or boolean outputs would be skipped anyway; listing them keeps
the table explicit.

A documented choice: ``OneHot``'s ``values`` input is non-differentiable, as the ONNX schema
marks it. A float ``Range`` is differentiable in ``start`` and ``delta`` and has a rule
(:mod:`.shape`). ``Mod`` is differentiable for floats
and has a rule (:mod:`.elementwise`); ``Unique``'s values output is differentiable and has
none, so the engine reports it.
"""

from onnxgrad.derivative.autodiff.registry import register_zero_gradient

register_zero_gradient(
    # shapes, sizes and constants
    "Shape", "Size", "ConstantOfShape", "Constant", "EyeLike",
    # random samples
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
    "Bernoulli",
    # window and filter-bank generators (integer sizes in, constants out)
    "BlackmanWindow", "HammingWindow", "HannWindow", "MelWeightMatrix",
    # comparisons and logic
    "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf",
    # indices
    "ArgMax", "ArgMin", "NonZero", "OneHot", "NonMaxSuppression",
    # piecewise constant
    "Sign", "Floor", "Ceil", "Round", "Hardmax",
    # integer arithmetic
    "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot",
    # strings
    "StringNormalizer", "StringConcat", "StringSplit", "RegexFullMatch",
)  # fmt: skip
