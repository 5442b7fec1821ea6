"""Ops whose outputs carry no gradient.

Either they are not differentiable (integer or boolean results, shapes, indices) or they
are piecewise constant, with a derivative of zero almost everywhere (Sign, Floor, Ceil,
Round). The engine treats their outputs as constants and never asks for a rule.
"""

from onnxgrad.derivative.autodiff.registry import register_zero_gradient

register_zero_gradient(
    # shapes, sizes and constants
    "Shape", "Size", "ConstantOfShape", "Constant", "Range", "EyeLike",
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
    "Bernoulli",
    # comparisons and logic
    "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf",
    # indices
    "ArgMax", "ArgMin", "NonZero", "OneHot", "Unique",
    # piecewise constant
    "Sign", "Floor", "Ceil", "Round",
    # integer arithmetic
    "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "Mod",
)  # fmt: skip
