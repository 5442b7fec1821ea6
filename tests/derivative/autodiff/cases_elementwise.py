"""Rule table entries: Pow, Clip, Max, Min, Sum, Mean, Where, Mod (with broadcasting)."""

import numpy as np

from tests.derivative.autodiff.gradcheck import OpCase, second_order

rng = np.random.default_rng(4)


def r(*shape):
    return rng.standard_normal(shape)


def positive(*shape):
    return rng.uniform(0.5, 2.0, shape)


def distinct(*arrays):
    """Arrays shifted apart so that no two broadcast elements tie (Max/Min kinks)."""
    return [a + 0.37 * k for k, a in enumerate(arrays)]


def clip_input(*shape, bounds=(-0.5, 0.5), margin=0.1):
    values = rng.uniform(-1.5, 1.5, shape)
    for bound in bounds:
        close = np.abs(values - bound) < margin
        values[close] = bound + margin * np.sign(values[close] - bound + 1e-12)
    return values


CASES = [
    OpCase("Pow", {"x": positive(2, 3), "p": r(2, 3)}, opset=13, id="Pow-both-opset13"),
    OpCase("Pow", {"x": positive(2, 3), "p": r(3)}, opset=15, id="Pow-broadcast-exponent"),
    OpCase("Pow", {"x": positive(3), "p": r(2, 1)}, opset=18, id="Pow-broadcast-both"),
    OpCase("Pow", {"x": r(2, 3), "p": np.array(3.0)}, constants=("p",), opset=18, id="Pow-cube"),
    OpCase("Pow", {"x": r(2, 3), "p": np.array(2, np.int64)}, opset=21, id="Pow-int-exponent"),
    OpCase("Pow", {"x": r(2, 3), "p": np.array(2.0)}, constants=("p",), opset=18, id="Pow-square"),
    OpCase("Pow", {"x": r(2, 3), "p": np.array([1.0])}, constants=("p",), opset=18, id="Pow-one"),
    OpCase("Pow", {"x": positive(3), "p": np.array([[-1.5]])}, constants=("p",), opset=18,
           id="Pow-constant-broadcast"),
    # x^0 = 1 (0^0 included): a zero gradient, not 0 * 0^-1 = NaN
    OpCase("Pow", {"x": np.array([[0.0, 1.5, -2.0], [0.3, 0.0, 2.0]]), "p": np.array(0.0)},
           constants=("p",), opset=18, id="Pow-zero-exponent"),
    OpCase("Pow", {"x": np.array([[0.0, 0.5, 1.2], [0.0, 2.0, 0.7]]),
                   "p": np.array([[0.0, 0.5, -1.3], [0.0, 2.5, 3.0]])},
           wrt=("x",), opset=18, id="Pow-zero-exponent-at-zero"),
    OpCase(
        "Pow", {"x": positive(2, 3), "p": np.array(0.5)}, wrt=("p",), opset=21,
        id="Pow-exponent-only",
    ),
    OpCase(
        "Clip", {"x": clip_input(3, 4), "lo": np.array(-0.5), "hi": np.array(0.5)},
        constants=("lo", "hi"), opset=13, id="Clip-both-bounds",
    ),
    OpCase(
        "Clip", {"x": clip_input(3, 4, bounds=(-0.5,)), "lo": np.array(-0.5), "hi": None},
        constants=("lo",), opset=18, id="Clip-min-only",
    ),
    OpCase(
        "Clip", {"x": clip_input(3, 4, bounds=(0.5,)), "lo": None, "hi": np.array(0.5)},
        constants=("hi",), opset=13, id="Clip-max-only",
    ),
    OpCase("Clip", {"x": r(3, 4)}, opset=21, id="Clip-no-bounds"),
    OpCase(
        "Clip", {"x": clip_input(3, 4), "lo": np.array(-0.5), "hi": np.array(0.5)}, opset=18,
        id="Clip-bounds-differentiated",
    ),
    OpCase(
        "Clip", {"x": clip_input(3, 4, bounds=(0.5, -0.5)), "lo": np.array(0.5),
                 "hi": np.array(-0.5)}, opset=18, id="Clip-min-above-max",
    ),
    OpCase(
        "Clip", {"x": clip_input(3, 4, bounds=(0.5, -0.5)), "lo": np.array(0.5),
                 "hi": np.array(-0.5)}, opset=11, id="Clip-min-above-max-opset11",
        dynamic_shapes=False,
    ),
    OpCase("Max", {"a": r(2, 3)}, opset=13, id="Max-single"),
    OpCase("Max", dict(zip("ab", distinct(r(2, 3), r(2, 3)))), opset=13, id="Max-two"),
    OpCase(
        "Max", dict(zip("abc", distinct(r(2, 3), r(3), r(2, 1)))), opset=18,
        id="Max-three-broadcast",
    ),
    OpCase(
        "Max", {"a": np.array([[1.0, 2.0], [3.0, -1.0]]), "b": np.array([1.0, 0.5])},
        opset=21, id="Max-tie-split",
    ),
    OpCase("Min", dict(zip("ab", distinct(r(2, 3), r(2, 3)))), opset=13, id="Min-two"),
    OpCase(
        "Min", dict(zip("abc", distinct(r(4, 1), r(1, 3), r(3)))), opset=18,
        id="Min-three-broadcast",
    ),
    OpCase(
        "Min", {"a": np.array([2.0, -1.0, 0.5]), "b": np.array([2.0, 1.0, 0.7]),
                "c": np.array([3.0, -1.0, 0.5])},
        opset=21, id="Min-two-way-ties",
    ),
    OpCase("Sum", {"a": r(2, 3)}, opset=13, id="Sum-single"),
    OpCase("Sum", {"a": r(2, 3), "b": r(3), "c": r(2, 1)}, opset=13, id="Sum-three-broadcast"),
    OpCase("Sum", {"a": r(1, 3), "b": r(2, 1)}, opset=21, id="Sum-outer"),
    OpCase("Mean", {"a": r(2, 3)}, opset=13, id="Mean-single"),
    OpCase("Mean", {"a": r(2, 3), "b": r(3), "c": r(2, 1)}, opset=18, id="Mean-three-broadcast"),
    OpCase(
        "Where", {"c": rng.random((2, 3)) > 0.5, "x": r(2, 3), "y": r(2, 3)}, opset=13,
        id="Where-same",
    ),
    OpCase(
        "Where", {"c": rng.random((2, 1)) > 0.5, "x": r(3), "y": r()}, opset=16,
        id="Where-broadcast",
    ),
    OpCase(
        "Where", {"c": np.array([True, False, True]), "x": r(2, 3), "y": r(2, 3)},
        wrt=("y",), opset=21, id="Where-y-only",
    ),
    OpCase(
        "Mod",
        {"x": np.array([[2.3, -3.7, 5.2], [-0.4, 7.9, -6.1]]), "d": np.array([1.5, -2.0, 2.5])},
        {"fmod": 1}, opset=13, id="Mod-fmod",
    ),
    OpCase(
        "Mod", {"x": np.array([[2.3, -3.7, 5.2], [0.4, 7.9, -6.1]]), "d": np.array([1.5])},
        {"fmod": 1}, wrt=("x",), opset=18, id="Mod-x-only",
    ),
]  # fmt: skip

SECOND_ORDER_IDS = {
    "Pow-broadcast-both", "Pow-int-exponent", "Pow-square", "Pow-constant-broadcast",
    "Clip-bounds-differentiated", "Clip-min-above-max",
    "Max-three-broadcast", "Min-two", "Sum-three-broadcast", "Mean-three-broadcast",
    "Where-broadcast", "Mod-fmod",
}  # fmt: skip
SECOND_ORDER = [second_order(case) for case in CASES if case.id in SECOND_ORDER_IDS]
assert len(SECOND_ORDER) == len(SECOND_ORDER_IDS), "a second-order id names no case"
CASES += SECOND_ORDER
