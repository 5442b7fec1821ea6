"""Every deployed form of the architectures of ``tests.architectures`` (by default its third set:
Mistral, BLOOM, GPT-NeoX, ALBERT, BART, Segformer) checked as the suite checks one form of
each, against references that are not onnxgrad:

- ``lowered``: the normalised model's outputs against onnxruntime's run of the deployed file;
- ``weights``: default weights against the PyTorch module's ``parameters()``
  (``tests/graph/test_weight_roles.py``'s property);
- ``gradient``: the gradient of the default weights along a random direction against central
  differences of the deployed file (activation rounding and ReLU masks frozen at the point,
  :mod:`tests.normalize.unrounded`), the step taken as the weights' stored type rounds it;
- ``lora``: ``add_lora`` + ``generate_artifacts`` + 15 Adam steps at onnxruntime's default
  optimization level, losses finite and falling (``test_architecture_forms.py``);
- ``round trip``: ``merge_lora`` keep/requantize and ``runtime_adapter_model`` hold the
  deployed operators and predict what the training graph does (``test_round_trip.py``);
- ``speed`` (not by default): what comes back against the deployed file, one thread, batch
  64, ``ROUNDS`` interleaved runs (``bench_round_trip.py``'s timing and models, rank 8):
  the merged model (``keep`` over float weights, ``requantize`` over quantized ones) and the
  runtime adapter model, with the adapters' share of the products' FLOPs.

``python benchmarks/sweep_architectures.py [--kinds mistral,bart] [--forms int8,qdq]
[--checks weights,gradient] [--conv-variants]``: one line per cell, ``ok`` or the failure;
the exit status is the count of failed cells. The exports and their forms are cached as the
suite caches them (``tests.architectures.cache_dir``); the optimized forms need torch (the training
environment makes them; another environment reads no form it cannot make), the 4-bit form
onnxruntime >= 1.20: make it with the newer environment, then read it in the training one
with ``ONNXGRAD_TEST_FORMS_OF=<that version>`` (LoRA and the round trip need torch's
environment for their test modules).

Measured (third set, onnxruntime 1.19 and 1.32, 48 cells): lowering, weights and gradient
pass in every cell made (gradients 6e-8 to 3.1e-2 relative, float16 against its float32
source); LoRA in every cell made by or read in the training environment; the round trip in
all but ALBERT QDQ ``requantize`` (0.067 for a bound of 0.026: both readers of its shared
layer weights adapted, the activations' codes flip; the file reading ``W + s A B``
unrounded is 0.031 off); Segformer int8 is not made
by onnxruntime 1.19's ``quantize_dynamic`` and its 1.32 file needs a ``ConvInteger`` kernel
1.19 lacks; its gradient was 2.7e-2 off (codes moved by ``Transpose``/``Reshape`` before a
``ConvInteger`` read with rounding held), 3.7e-6 since they are read straight through.
Speed: merged models 0.82-1.05x of the deployed file (47 cells); the runtime adapter model
0.97-1.29x, but Segformer's float and 4-bit forms 2.4-2.7x (its Conv kernels updated per
run; 2.0-2.3x measured again, and 3.1-3.4x with a branch beside each Conv instead:
``--conv-variants``). Table: docs/deployed-models.md.

Fourth set (``--kinds deberta,gemma,wav2vec2,convnext,swin,clip``, 46 forms; lowering,
weights and gradient with onnxruntime 1.19 and 1.32): lowering in every cell; gradients
4.3e-7 to 2.4e-4 (float16 1.9e-4 to 2.2e-2, QDQ 4.1e-7 to 1.3e-3 at ``FLOAT64_EPS``; at 1e-3
wav2vec2 QDQ was 4.6e-2 to 1.3e-1, its steps crossing calibrated clipping bounds) but CLIP
float16 (the all-weights step; every weight alone within 2e-2); default weights are the
parameters, or what a tool folded from them (``tests.architectures.FOLDED``: DeBERTa's
position projections), in every cell; LoRA in every cell made by the training environment;
the round trip but wav2vec2 4-bit (a file nothing was quantized in) and CLIP float16 (4
float16 steps). Before: DeBERTa's relative table, LayerNorm and position kernels were no
defaults and its gradient refused at a ``Tile`` in six forms; wav2vec2 QDQ held GroupNorm's
ones and zeros as defaults. The int8 files of wav2vec2, ConvNeXt and Swin need 1.32
(``ConvInteger``). Speed (``--checks speed``; 4-bit and those int8 files with 1.32): merged
models 0.83-1.03x of the deployed file (46 cells); the runtime adapter model 0.95-1.24x but
ConvNeXt float32, initializers and 4-bit, 3.4-4.2x (its four ``Conv`` kernels updated per
run lose onnxruntime's blocked layout: the deployed file with those kernels made graph
inputs is 3.7x). wav2vec2 int8 (1.32) failed the round trip, a bias ``Add`` per layer left
out of ``SkipLayerNormalization`` by a branch joining before it; such a branch joins the
residual now. Table: docs/deployed-models.md."""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the point differentiated: not a calibration batch of static quantization (seeds 0-3),
#: whose extreme activations sit on the clipping bounds
POINT = 4
CHECKS = ("lowered", "weights", "gradient", "lora", "round_trip")
ROUNDS, SPEED_BATCH = 31, 64
#: ``--conv-variants``: ``speed`` also times the runtime adapter model with every adapted
#: ``Conv`` kernel updated per run and with a branch beside every such ``Conv``
CONV_VARIANTS = False
#: relative error of the directional derivative against central differences (float16: its
#: outputs' rounding over a step of ``EPS``)
BOUND = {"float16": 5e-2}
EPS = {"float16": 1e-2}
#: QDQ files' steps where the reference is float64 (onnx's evaluator): their weights rounded
#: as activations sit on the calibrated clipping bounds, activations near them, and a step
#: of 1e-3 crosses those kinks (wav2vec2 1.3e-1, CLIP 1.5e-2; 1.6e-6, 4.2e-7 at 1e-4)
FLOAT64_EPS = {"qdq": 1e-4}


def _values(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """The tensors of the main graph's initializers and ``Constant`` nodes, by name."""
    found = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute[0].name == "value":
            found[node.output[0]] = node.attribute[0].t
    return found


def _moved(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers or ``Constant`` tensors named in ``values`` hold
    them (in their stored type)."""
    from onnx import numpy_helper

    moved = onnx.ModelProto()
    moved.CopyFrom(model)
    for name, tensor in _values(moved).items():
        if name in values:
            tensor.CopyFrom(numpy_helper.from_array(values[name], name))
    return moved


def _dequantize_linear():
    """``DequantizeLinear`` for onnx's reference evaluator at every opset (it has kernels from
    opset 19): ``(q - z) s``, per tensor or along ``axis``, in the scale's type."""
    from onnx.reference.op_run import OpRun

    class DequantizeLinear(OpRun):
        op_domain = ""

        def _run(self, codes, scale, zero=None, axis=1, block_size=0, output_dtype=0):
            shape = [1] * codes.ndim
            if np.ndim(scale) == 1 and codes.ndim > 1:
                shape[axis] = -1
            zero = np.zeros(1) if zero is None else zero
            value = codes.astype(np.float64) - np.reshape(zero, shape if np.ndim(zero) else ())
            return (
                (value * np.reshape(scale, shape if np.ndim(scale) else ())).astype(scale.dtype),
            )

    return DequantizeLinear


def _gather_elements():
    """``GatherElements`` for onnx's reference evaluator with indices smaller than the data
    on the other axes (DeBERTa's position scores; onnxruntime reads ``data[i, j, idx]`` at
    the indices' own coordinates): the data cropped to them, then ``take_along_axis``."""
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        op_domain = ""

        def _run(self, data, indices, axis=0):
            axis = axis % data.ndim
            crop = tuple(
                slice(None) if a == axis else slice(0, indices.shape[a]) for a in range(data.ndim)
            )
            index = np.where(indices < 0, indices + data.shape[axis], indices)
            return (np.take_along_axis(data[crop], index, axis=axis),)

    return GatherElements


def _standard(model: onnx.ModelProto) -> bool:
    """Whether onnx defines every operator (onnxruntime's optimizer writes its
    ``SimplifiedLayerNormalization`` in the default domain)."""
    return all(n.domain in ("", "ai.onnx") and onnx.defs.has(n.op_type) for n in model.graph.node)


def _score(model: onnx.ModelProto, feeds, seed) -> float:
    """``<seed, f(feeds)>`` in float64 (onnx's reference evaluator), or where it lacks an
    operator (onnxruntime's contrib operators) by onnxruntime in the model's own types."""
    from onnx.reference import ReferenceEvaluator

    from tests.derivative.fd import to_double
    from tests.normalize.kernels import run

    if _standard(model):
        doubled = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}
        outputs = ReferenceEvaluator(
            to_double(model), new_ops=[_dequantize_linear(), _gather_elements()]
        ).run(None, doubled)
    else:
        outputs = run(model, feeds)
    return float(np.sum(outputs[0].astype(np.float64) * seed))


def check_gradient(model: onnx.ModelProto, feeds, form: str, source: onnx.ModelProto) -> str:
    """``<g, d>`` of ``onnx_derivative`` against ``(f(w + e d) - f(w - e d)) / 2``, ``d`` random,
    each step as the weights' stored type rounds it. ``f`` is the deployed file with its
    activation rounding and ReLU masks frozen at the point, or for a float16 conversion its
    float32 ``source`` (the float16 file's masks). A form with no default weight (QDQ: every
    weight quantized) is checked through its LoRA adapters (``B`` moved off zero)."""
    from onnx import numpy_helper

    from onnxgrad import add_lora, get_train_initializer, onnx_derivative
    from tests.normalize.deployed import trained_adapters
    from tests.normalize.kernels import run
    from tests.normalize.unrounded import with_frozen_rounding

    names = sorted(get_train_initializer(model))
    what = "weights"
    if not names:
        model = source = trained_adapters(add_lora(model, rank=4))
        names, what = sorted(get_train_initializer(model)), "adapter weights"
    stored = {n: numpy_helper.to_array(t) for n, t in _values(model).items() if n in names}
    outputs = run(model, feeds)[0]
    rng = np.random.default_rng(1)
    seed = rng.standard_normal(outputs.shape).astype(np.float32)
    gradient = onnx_derivative(model, inputs=[], weights=names)
    declared = {i.name for i in gradient.graph.input}
    batch = {**feeds, **stored, "logits_grad": seed}
    got = run(gradient, {k: v for k, v in batch.items() if k in declared})
    grads = dict(zip([o.name for o in gradient.graph.output], got, strict=True))
    plus, minus = {}, {}
    eps = FLOAT64_EPS.get(form, EPS.get(form, 1e-3)) if _standard(model) else EPS.get(form, 1e-3)
    for name, value in stored.items():
        scale = max(float(np.abs(value).max()), 1e-2)
        step = eps * rng.standard_normal(value.shape) * scale
        plus[name] = (value.astype(np.float64) + step).astype(value.dtype)
        minus[name] = (value.astype(np.float64) - step).astype(value.dtype)
        if value.dtype == np.float32 and _standard(model):  # a float64 reference: exact steps
            plus[name], minus[name] = value + step, value - step
    along = sum(
        float(np.sum(grads[f"{n}_grad"].astype(np.float64) * (plus[n] - minus[n]).astype(float)))
        for n in names
    )
    if form == "float16":
        frozen = with_frozen_rounding(source, feeds, masks_from=model)
        plus = {n: v.astype(np.float32) for n, v in plus.items()}
        minus = {n: v.astype(np.float32) for n, v in minus.items()}
    else:
        frozen = with_frozen_rounding(model, feeds)
    want = _score(_moved(frozen, plus), feeds, seed) - _score(_moved(frozen, minus), feeds, seed)
    error = abs(along - want) / max(abs(want), 1e-12)
    bound = BOUND.get(form, 1e-2)
    verdict = "ok" if error < bound else "FAIL"
    return f"{verdict} {len(names)} {what}, relative error {error:.1e} (bound {bound:.0e})"


def check_lowered(model: onnx.ModelProto, feeds) -> str:
    from onnxgrad.normalize import normalized_model
    from tests.normalize.kernels import run

    want = run(model, feeds)[0]
    got = run(normalized_model(model), feeds)[0]
    error = float(np.abs(got - want).max() / np.abs(want).max())
    return f"{'ok' if error < 2e-3 else 'FAIL'} relative {error:.1e}"


def check_speed(model: onnx.ModelProto, kind: str, form: str) -> str:
    from bench_round_trip import _adapter_share, _returned, _times

    from tests import architectures

    returned = _returned(model, form)
    merged = "requantize" if form in ("int8", "qdq", "int4") else "keep"
    models = {"deployed": model, merged: returned[merged], "runtime": returned["runtime"]}
    if CONV_VARIANTS:  # every adapted Conv kernel updated per run, or a branch beside each
        from bench_conv_branch import served

        for name, branches in (("conv-update", False), ("conv-branch", True)):
            models[name] = served(model, branches, returned["adapted"])
    times = _times(models, architectures.feeds(kind, POINT, batch=SPEED_BATCH), ROUNDS)
    share = _adapter_share(model, returned["adapted"])
    ratios = ", ".join(
        f"{n} {times[n] / times['deployed']:.2f}x" for n in models if n != "deployed"
    )
    return f"deployed {times['deployed']:.2f} ms, {ratios} (adapter FLOP share {share:.1%})"


def _run_check(check: str, kind: str, form: str, folder: Path) -> str:
    from tests import architectures

    path = architectures.deployed_form(kind, form)
    model = onnx.load(path)
    feeds = architectures.feeds(kind)
    if check == "lowered":
        return check_lowered(model, feeds)
    if check == "weights":
        from tests.graph.test_weight_roles import (
            test_default_weights_of_every_deployed_form_are_the_parameters as weights,
        )

        weights(kind, form)
        return "ok"
    if check == "speed":
        return check_speed(model, kind, form)
    if check == "gradient":
        source = onnx.load(architectures.deployed_form(kind, "float32"))
        return check_gradient(model, architectures.feeds(kind, POINT), form, source)
    if check == "lora":
        from tests.normalize.test_architecture_forms import (
            test_lora_training_of_architecture_form as lora,
        )

        lora(kind, form, folder)
        return "ok"
    from tests.normalize.test_round_trip import _assert_round_trip

    _assert_round_trip(
        model, form, feeds, folder, onnx.load(architectures.deployed_form(kind, "float32"))
    )
    return "ok"


def main() -> int:
    from tests import architectures

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(architectures.THIRD_SET))
    parser.add_argument("--forms", default="")
    parser.add_argument("--checks", default=",".join(CHECKS))
    parser.add_argument("--conv-variants", action="store_true")
    args = parser.parse_args()
    global CONV_VARIANTS
    CONV_VARIANTS = args.conv_variants
    failed = 0
    for kind in args.kinds.split(","):
        forms = args.forms.split(",") if args.forms else architectures.forms(kind)
        for form in forms:
            for check in args.checks.split(","):
                with tempfile.TemporaryDirectory() as folder:
                    try:
                        line = _run_check(check, kind, form, Path(folder))
                    except KeyboardInterrupt:
                        raise
                    except BaseException as error:  # pytest.skip raises one
                        if type(error).__name__ == "Skipped" or isinstance(error, ImportError):
                            line = f"skipped: {error}"
                        else:
                            tail = traceback.format_exc().strip().splitlines()[-1]
                            line = f"FAIL {tail[:400]}"
                failed += line.startswith("FAIL")
                print(f"{kind:10} {form:12} {check:10} {line}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
