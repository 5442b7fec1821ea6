"""The ``onnxgrad`` command (also ``python -m onnxgrad``).

Each subcommand reads its model (which onnx's full checker must accept), does one job with
the public API, and writes its result through a temporary file in the destination folder
renamed at the end, so a failure never leaves a partial file. Expected failures (missing,
unreadable or invalid files, bad options, models the library or onnxruntime rejects) print
one line on stderr and exit with status 2; a training that diverges exits with status 1.
A reader that stops reading the output (``| head``) is no failure: status 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from onnxgrad._interrupt import (
    finishing,
    importing,
    record_sigint,
    restore_sigint,
    sigint_received,
)
from onnxgrad.cli_common import (
    USAGE_ERROR,
    CommandError,
    OneLineParser,
    add_loss_options,
    add_recompute_options,
    check_destination,
    normalized,
    number,
    one_line,
    positive_int,
    read_model,
    recompute_option,
    reduction_option,
    subcommand,
    warnings_as_lines,
)

JOB_FAILED = 1
#: onnxruntime's own log (fatal only): its failures reach the user as one-line errors.
ORT_LOG_SEVERITY = 4
#: Subcommands that run models, so need an onnxruntime.
RUNTIME_COMMANDS = ("onnxgrad train", "onnxgrad demo", "onnxgrad artifacts")


def _import_libraries(args: argparse.Namespace) -> None:
    """Import what the subcommands use, once the arguments are parsed: ``onnxgrad --help``
    and usage errors answer without loading numpy, onnx or onnxruntime, and the commands
    that run no model (``info``, ``text``, ``add-loss``, ``derivative``) load neither
    onnxruntime nor onnxscript (``tests/test_import.py``)."""
    global ProtobufError, ModelProto, ValidationError, InferenceError, ort_state
    global save_model, write_atomically, write_bytes, derive_in_place
    global real_inputs, subgraphs, import_onnxruntime, set_logger_severity
    global DerivativeOptions, find_rule, has_zero_gradient, ConvergenceError
    global add_loss_output, get_train_initializer, onnx_simple_text_plot
    global plot_onnxs, tensor_text, to_dot, type_text
    import numpy  # noqa: F401  (loaded here, where an interrupt waits for the imports)
    from google.protobuf.message import Error as ProtobufError
    from onnx import ModelProto
    from onnx.checker import ValidationError
    from onnx.shape_inference import InferenceError

    from onnxgrad._files import save_model, write_atomically, write_bytes
    from onnxgrad._onnx_utils import real_inputs, subgraphs
    from onnxgrad._runtime import import_onnxruntime, set_logger_severity
    from onnxgrad.derivative import DerivativeOptions
    from onnxgrad.derivative.api import derive_in_place
    from onnxgrad.derivative.autodiff.registry import find_rule, has_zero_gradient
    from onnxgrad.exceptions import ConvergenceError
    from onnxgrad.graph import add_loss_output, get_train_initializer, onnx_simple_text_plot
    from onnxgrad.plotting import plot_onnxs, tensor_text, to_dot, type_text

    ort_state = _onnxruntime_errors(args)


def _onnxruntime_errors(args: argparse.Namespace):
    """onnxruntime's error classes, imported when the command runs models, else None."""
    if args.prog not in RUNTIME_COMMANDS and getattr(args, "backend", "onnx") != "ort":
        return None
    try:
        import_onnxruntime()
    except ImportError:
        if args.prog in RUNTIME_COMMANDS:
            raise  # the ImportError that says what to install
        return None  # derivative --backend ort says what it needs itself
    from onnxruntime.capi import onnxruntime_pybind11_state

    return onnxruntime_pybind11_state


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Exceptions meaning "bad input", as raised by onnxgrad, onnx, protobuf and onnxruntime
    (whose run failures, a shape only known at run time say, are plain RuntimeErrors)."""
    ort_errors = (
        "Fail",
        "InvalidArgument",
        "InvalidGraph",
        "InvalidProtobuf",
        "NoSuchFile",
        "NoModel",
        "NotImplemented",
        "RuntimeException",
        "EPFail",
    )
    return (
        CommandError,
        ValueError,
        TypeError,
        OSError,
        RuntimeError,
        ImportError,
        ValidationError,
        InferenceError,
        ProtobufError,
        *(getattr(ort_state, name) for name in ort_errors if hasattr(ort_state, name)),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``onnxgrad`` command with ``argv`` (default: ``sys.argv[1:]``); return its status.

    Ctrl-C at any moment before the result is written prints ``interrupted`` and gives status
    130 (see :mod:`onnxgrad._interrupt`)."""
    previous = record_sigint()
    try:
        return _main(argv)
    except KeyboardInterrupt:
        _fail("onnxgrad", "interrupted")
        return 130
    finally:
        restore_sigint(previous)


def command() -> NoReturn:
    """The ``onnxgrad`` console script and ``python -m onnxgrad``: :func:`main`, then exit.

    :func:`main` puts back the Ctrl-C handler it found; ignoring Ctrl-C here first means a
    Ctrl-C that comes after the command has ended (its result written and announced) cannot
    turn the interpreter's exit into a death by SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(main())


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        with importing():  # checking an option's choices (--optimizer) may import the library
            args = parser.parse_args(argv)
    except ImportError as exc:
        _fail(parser.prog, one_line(exc))
        return USAGE_ERROR
    try:
        with importing():
            _import_libraries(args)
    except KeyboardInterrupt:
        _fail(args.prog, "interrupted")
        return 130
    except ImportError as exc:
        _fail(args.prog, one_line(exc))
        return USAGE_ERROR
    if ort_state is None:
        return _run(args)
    previous_severity = set_logger_severity(ORT_LOG_SEVERITY)
    try:
        return _run(args)
    finally:
        set_logger_severity(previous_severity)


def _run(args: argparse.Namespace) -> int:
    try:
        with warnings_as_lines(args.prog):
            status = args.run(args) or 0
        sys.stdout.flush()
        return status
    except BrokenPipeError as exc:
        if not _stdout_closed():  # another pipe broke (a child process died): a failure
            _fail(args.prog, f"a pipe closed unexpectedly: {one_line(exc)}")
            return USAGE_ERROR
        _discard_stdout()  # the reader stopped reading (`onnxgrad text m.onnx | head`)
        return 0
    except KeyboardInterrupt:
        _fail(args.prog, "interrupted")
        return 130
    except ConvergenceError as exc:
        _fail(args.prog, f"training diverged: {exc}")
        return JOB_FAILED
    except _expected_errors() as exc:
        if _caused_by_interrupt(exc):
            _fail(args.prog, "interrupted")
            return 130
        _fail(args.prog, one_line(exc))
        return USAGE_ERROR
    except Exception as exc:  # any other failure is still one line, never a traceback
        if _caused_by_interrupt(exc):
            _fail(args.prog, "interrupted")
            return 130
        _fail(args.prog, f"{type(exc).__name__}: {one_line(exc)}")
        return USAGE_ERROR


def _caused_by_interrupt(exc: BaseException) -> bool:
    if sigint_received():
        return True
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll reports an error)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or not a real file
        return True
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _discard_stdout() -> None:
    """Send what is left of standard output to the null device, so the interpreter's last
    flush does not fail on the closed pipe again (the recipe of Python's signal docs)."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file, as under a test runner
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


def _fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)


# ----------------------------------------------------------------------------- info


def cmd_info(args: argparse.Namespace) -> None:
    original = read_model(args.model)
    from onnxgrad.graph.ml_lowering import lowerable_nodes
    from onnxgrad.normalize.report import deployed_operator_lines, deployed_operators
    from onnxgrad.normalize.ste import quantized_activations

    lowered = lowerable_nodes(original)
    deployed = deployed_operators(original)
    opset, promoted = _imported_opset(original), _promoted_weights(original)
    header = f"  ir_version {original.ir_version}, opsets {_opsets_text(original)}" + (
        f", producer {original.producer_name}" if original.producer_name else ""
    )
    file_outputs = [(o.name, type_text(o.type)) for o in original.graph.output]
    mode = args.quantized_activations
    with quantized_activations(mode):
        model = normalized(original, args.model)  # rewrites ``original`` in place
    weights = get_train_initializer.normalized(model)  # reads the model, changes nothing
    graph = model.graph
    inputs = real_inputs(model)
    constants = [init for init in graph.initializer if init.name not in weights]
    size = sum(int(value.size) for value, _ in weights.values())
    failures, without_rule = _dry_build_failures(model), _ops_without_rule(model)
    stops = [*without_rule, *failures] if failures else []
    lines = [
        f"model: {args.model}",
        header,
        f"inputs ({len(inputs)}):",
        *_table((i.name, type_text(i.type)) for i in inputs),
        f"outputs ({len(file_outputs)}):",
        *_table(file_outputs),
        *_training_output_lines(file_outputs, model),
        *_normalisation_lines(opset, promoted, model),
        *_converter_lines(lowered, model),
        *deployed_operator_lines(deployed, model, mode),
        f"trainable initializers ({len(weights)}, {size} values):",
        *_table((name, tensor_text(proto)) for name, (_, proto) in weights.items()),
        *_shared_weight_lines(model, weights),
        f"other initializers ({len(constants)}):",
        *_table((init.name, tensor_text(init)) for init in constants),
        f"ops ({len(graph.node)} nodes):",
        *_wrapped(_op_counts(model)),
        "ops without a native gradient rule" + (" (once lowered):" if lowered else ":"),
        *_wrapped(", ".join(without_rule) or "none"),
        *(
            ["  (no gradient flows through them: the build needs none)"]
            if without_rule and not stops
            else []
        ),
        "what stops differentiation or training (a dry build of both):",
        *([f"  {line}" for line in stops] or ["  nothing: the gradient and the train step build"]),
    ]
    print("\n".join(lines))


def _shared_weight_lines(model: ModelProto, weights) -> list[str]:
    """The trainable initializers more than one node reads: they are trained as one tensor.
    Exporters tie weights on purpose (embeddings and output head) but also merge equal ones
    (PyTorch's exporter: norm scales all ones, layers cloned before training), which trains
    one tensor where the source model had several."""
    readers = Counter(
        name for node in _all_nodes(model.graph) for name in set(node.input) if name in weights
    )
    shared = [(name, f"read by {n} nodes") for name, n in readers.items() if n > 1]
    if not shared:
        return []
    return [f"shared trainable initializers ({len(shared)}, each trained as one):", *_table(shared)]


def _imported_opset(model: ModelProto) -> int | None:
    """The default-domain opset ``model`` imports (``None``: it imports ``ai.onnx.ml`` only)."""
    return next((op.version for op in model.opset_import if op.domain in ("", "ai.onnx")), None)


def _promoted_weights(model: ModelProto) -> tuple[int, int]:
    """How many weights normalisation makes main-graph initializers: ``Constant`` nodes, and
    initializers of subgraphs."""
    from onnxgrad.graph._scopes import iter_graphs
    from onnxgrad.normalize.constants import constant_weights

    names = constant_weights(model)
    inner = {i.name for g in list(iter_graphs(model.graph))[1:] for i in g.initializer}
    return len(names - inner), len(names & inner)


def _normalisation_lines(
    opset: int | None, promoted: tuple[int, int], model: ModelProto
) -> list[str]:
    """What :func:`onnxgrad.normalize.normalized_model` changed, in words: the default-domain
    ``opset`` the model had (``None``: none), the numbers of Constant weights and subgraph
    initializers it ``promoted``."""
    from onnxgrad._onnx_utils import default_opset

    changes = []
    if opset is None:
        changes.append(f"default-domain opset {default_opset(model)} imported")
    elif default_opset(model) != opset:
        changes.append(f"default-domain opset {opset} raised to {default_opset(model)}")
    constants, lifted = promoted
    if constants:
        changes.append(f"{constants} weights stored as Constant nodes made initializers")
    if lifted:
        changes.append(f"{lifted} weights stored in subgraphs made main-graph initializers")
    if not changes:
        return []
    return ["normalised for training (onnxgrad.normalize):", *(f"  {c}" for c in changes)]


def _dry_build_failures(model: ModelProto) -> list[str]:
    """Why the gradient (every float input and trainable weight) or the default train step
    (squared error on the first float output, every trainable weight) cannot be built.

    The train step is built with :func:`_plain_sgd`, whose update is written out instead of
    inlined from the authored graph: the authored updates are fixed graphs, tested on their
    own (tests/functions), and building them loads onnxscript, seconds for a small model."""
    from onnxgrad._onnx_utils import copy_message
    from onnxgrad.training.step.composition import make_train_step

    failures = []
    for what, build in (
        ("gradient", lambda: derive_in_place(copy_message(model))),
        (
            "train step",
            lambda: make_train_step.normalized(copy_message(model), learning_rate=_plain_sgd()),
        ),
    ):
        try:
            build()
        except Exception as exc:
            failures.append(f"{what}: {type(exc).__name__}: {one_line(exc)}")
    return failures


def _plain_sgd():
    """:class:`~onnxgrad.training.step.learning_rate.LearningRateSGD` whose update
    ``w <- w + alpha g`` (``alpha = -lr``, the authored ``axpy``) is two plain nodes."""
    from onnxgrad.training.step.learning_rate import LearningRateSGD

    class PlainSGD(LearningRateSGD):
        def emit_update(self, b, weight, grad, state, feeds, elem_type):
            return b.op("Add", b.op("Mul", feeds["alpha"], grad), weight), {}

    return PlainSGD()


def _opsets_text(model: ModelProto) -> str:
    """``ai.onnx 15, ai.onnx.ml 1``: each domain once (``''`` and ``'ai.onnx'`` are one), the
    default domain first, the others by name (converters list them in no fixed order)."""
    versions: dict[str, list[int]] = {}
    for op in model.opset_import:
        found = versions.setdefault(op.domain if op.domain not in ("", "ai.onnx") else "", [])
        if op.version not in found:
            found.append(op.version)
    texts = [f"{d or 'ai.onnx'} {' and '.join(map(str, v))}" for d, v in sorted(versions.items())]
    return ", ".join(texts) or "none"


def _training_output_lines(file_outputs, model: ModelProto) -> list[str]:
    """The outputs training sees, when normalisation changed them (a ZipMap's list of
    dictionaries becomes its probability tensor)."""
    outputs = [(o.name, type_text(o.type)) for o in model.graph.output]
    if outputs == list(file_outputs):
        return []
    return [
        "outputs for training (the model lowered; train puts its loss on the first float one):",
        *_table(outputs),
    ]


#: what the lowering does with a converter operator, beyond "standard ONNX, same outputs"
_CONVERTER_NOTES = {
    "ZipMap": "not trained: training reads the probability tensor before it, and the "
    "trained model keeps the ZipMap and the file's outputs",
}


def _converter_lines(lowered, model: ModelProto) -> list[str]:
    """One line per ai.onnx.ml operator type of the file: what happens to it."""
    if not lowered:
        return []
    counts = Counter(node.op_type for node in lowered)
    return [
        "converter operators (ai.onnx.ml), lowered for training (onnxgrad.lower_ml_operators):",
        *(
            f"  ai.onnx.ml::{op} x{n}: "
            + _CONVERTER_NOTES.get(
                op,
                "replaced by standard ONNX computing the same values (its parameters, if "
                "any, become the initializers below)",
            )
            for op, n in sorted(counts.items())
        ),
    ]


def _table(rows) -> list[str]:
    rows = list(rows)
    if not rows:
        return ["  none"]
    width = max(len(name) for name, _ in rows)
    return [f"  {name.ljust(width)}  {text}" for name, text in rows]


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(text, width=96, initial_indent="  ", subsequent_indent="  ") or ["  none"]


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from _all_nodes(sub)


def _op_key(node) -> str:
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    return f"{domain}::{node.op_type}" if domain else node.op_type


def _op_counts(model: ModelProto) -> str:
    counts = Counter(_op_key(node) for node in _all_nodes(model.graph))
    return ", ".join(f"{op} x{n}" for op, n in sorted(counts.items()))


def _ops_without_rule(model: ModelProto) -> list[str]:
    """Ops that neither have a native gradient rule at the model's opset nor are constant,
    nor give only non-float values (a ``QuantizeLinear``: no gradient flows back through
    integers, so the engine never asks for its rule)."""
    from onnx import TensorProto

    from onnxgrad._onnx_utils import FLOAT_TYPES
    from onnxgrad.graph._differentiable import value_elem_types

    opsets = {
        ("" if op.domain == "ai.onnx" else op.domain): op.version for op in model.opset_import
    }
    types = value_elem_types(model)
    missing = set()
    for node in _all_nodes(model.graph):
        domain = "" if node.domain == "ai.onnx" else node.domain
        opset = opsets.get(domain, 0)
        if all(types.get(out, TensorProto.FLOAT) not in FLOAT_TYPES for out in node.output):
            continue
        if find_rule(domain, node.op_type, opset) is None and not has_zero_gradient(
            domain, node.op_type
        ):
            missing.add(f"{_op_key(node)} (opset {opset})")
    return sorted(missing)


# ----------------------------------------------------------------------------- text, plot


def cmd_text(args: argparse.Namespace) -> None:
    print(onnx_simple_text_plot(read_model(args.model)))


def cmd_plot(args: argparse.Namespace) -> None:
    model = read_model(args.model)
    destination = check_destination(args.output)
    if destination.suffix.lower() in (".dot", ".gv"):
        with finishing():
            write_bytes(destination, to_dot(model).encode())
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CommandError(
            "matplotlib is not installed: pip install 'onnxgrad[plot]', or write a .dot file"
        ) from None
    image_format = destination.suffix.lower().lstrip(".")
    supported = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if image_format not in supported:
        raise CommandError(
            f"cannot draw {args.output!r}: use one of .{', .'.join(sorted(supported))} or .dot"
        )
    ax = plot_onnxs(model, title=args.title or Path(args.model).stem)
    try:
        _check_picture_size(ax.figure, args.dpi)
        with finishing():
            write_atomically(
                destination,
                lambda temporary: ax.figure.savefig(
                    temporary, format=image_format, bbox_inches="tight", dpi=args.dpi
                ),
            )
    finally:
        plt.close(ax.figure)


#: The largest picture side, in pixels, the command draws (matplotlib's limit is 2**16).
MAX_PICTURE_SIDE = 2**15


def _check_picture_size(figure, dpi: int) -> None:
    width, height = (int(inches * dpi) for inches in figure.get_size_inches())
    if max(width, height) > MAX_PICTURE_SIDE:
        largest = int(MAX_PICTURE_SIDE / max(figure.get_size_inches()))
        raise CommandError(
            f"--dpi {dpi} would draw a {width}x{height}-pixel picture of this graph, over "
            f"{MAX_PICTURE_SIDE} pixels a side: use --dpi {largest} or less, or a .svg or "
            ".dot file"
        )


# ----------------------------------------------------------------------------- add-loss


def cmd_add_loss(args: argparse.Namespace) -> None:
    model = read_model(args.model)
    destination = check_destination(args.output)
    result = add_loss_output(
        model,
        score_name=args.score,
        loss_name=args.loss_name,
        label_name=args.label,
        weight_name=args.weight,
        penalty=parse_penalties(args.penalty) or None,
        output_index=args.prediction,
        **reduction_option(args),
    )
    with finishing():
        save_model(result, destination)
        print(f"wrote {destination}: outputs {[o.name for o in result.graph.output]}")


def parse_penalties(specs: Sequence[str] | None) -> dict[str, dict[str, float]]:
    """``['coef=l1:0.1,l2:0.01', 'intercept=0.5']`` -> ``{'coef': {'l1': .1, 'l2': .01},
    'intercept': {'l2': .5}}`` (a bare number is an L2 coefficient)."""
    penalties: dict[str, dict[str, float]] = {}
    for spec in specs or ():
        name, sep, terms = spec.partition("=")
        if not sep or not name or not terms:
            raise CommandError(f"--penalty {spec!r}: expected NAME=l1:A,l2:B or NAME=B")
        if name in penalties:
            raise CommandError(f"--penalty names {name!r} twice")
        penalties[name] = {}
        for term in terms.split(","):
            kind, sep, value = term.rpartition(":")
            kind = kind if sep else "l2"
            if kind not in ("l1", "l2"):
                raise CommandError(
                    f"--penalty {spec!r}: unknown penalty kind {kind!r}, expected l1 or l2"
                )
            penalties[name][kind] = number(value, f"--penalty {spec!r}")
    return penalties


# ----------------------------------------------------------------------------- derivative


def cmd_derivative(args: argparse.Namespace) -> None:
    model = normalized(read_model(args.model), args.model)
    destination = check_destination(args.output)
    options = DerivativeOptions.Zero
    if args.keep_outputs:
        options |= DerivativeOptions.KeepOutputs
    if args.fill_grad:
        options |= DerivativeOptions.FillGrad
    if args.loss is not None:
        options |= DerivativeOptions.Loss
    elif args.label is not None:
        raise CommandError("--label needs --loss")
    gradient = derive_in_place(  # onnx_derivative without a copy of the weights
        model,
        weights=args.weights,
        inputs=args.inputs,
        options=options,
        loss=args.loss,
        label=args.label,
        backend=args.backend,
        outputs=args.outputs,
        recompute=recompute_option(args),
    )
    inputs = [i.name for i in gradient.graph.input]
    outputs = [o.name for o in gradient.graph.output]
    with finishing():
        save_model(gradient, destination)
        print(f"wrote {destination}: inputs {inputs}, outputs {outputs}")


# ----------------------------------------------------------------------------- train


# ----------------------------------------------------------------------------- parser


def build_parser() -> OneLineParser:
    """The argument parser of the ``onnxgrad`` command and its subcommands."""
    parser = OneLineParser(
        prog="onnxgrad",
        description="Turn ONNX models into trainable and differentiable graphs, and train them.",
        epilog="Run 'onnxgrad COMMAND --help' for the options and examples of a command.",
    )
    parser.add_argument(
        "--version", action=VersionAction, help="show the version of onnxgrad and exit"
    )
    commands = parser.add_subparsers(
        title="commands", dest="command", metavar="COMMAND", required=True
    )
    from onnxgrad.cli_artifacts import add_artifacts  # its own module, needs this one
    from onnxgrad.cli_train import add_train

    for add in (
        _add_demo,
        _add_info,
        _add_text,
        _add_plot,
        _add_add_loss,
        _add_derivative,
        add_train,
        add_artifacts,
    ):
        add(commands)
    return parser


class VersionAction(argparse.Action):
    """``--version``: looks the installed version up only when asked (importlib.metadata is
    slow to import)."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {_version()}")  # on standard output, as argparse's own action
        parser.exit()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("onnxgrad")
    except PackageNotFoundError:
        return "unknown"


def _add_demo(commands) -> None:
    sub = subcommand(
        commands,
        "demo",
        _run_demo,
        "Train an MLP regression end to end on generated data and save what it built.",
        """
        onnxgrad demo
        onnxgrad demo -o /tmp/demo --epochs 50
        """,
    )
    sub.add_argument(
        "-o",
        "--output",
        default="onnxgrad-demo",
        help="folder to write into (default: %(default)s)",
    )
    sub.add_argument("--epochs", type=positive_int, default=None, help="training epochs")


def _run_demo(args: argparse.Namespace) -> None:
    from onnxgrad.demo import run_demo

    run_demo(args.output, epochs=args.epochs)


def _add_info(commands) -> None:
    sub = subcommand(
        commands,
        "info",
        cmd_info,
        "Describe a model: inputs, outputs, trainable initializers, ops and missing rules.",
        "onnxgrad info model.onnx",
    )
    sub.add_argument("model", help="ONNX file")
    sub.add_argument(
        "--quantized-activations",
        choices=("straight_through", "exact"),  # onnxgrad.normalize.ste, not imported to parse
        default="straight_through",
        help="how rounded activations are differentiated: the straight-through estimator "
        "(default, for training) or 'exact', the derivative of the file itself (rounding held)",
    )


def _add_text(commands) -> None:
    sub = subcommand(
        commands,
        "text",
        cmd_text,
        "Print the graph as indented text, one line per node.",
        "onnxgrad text model.onnx",
    )
    sub.add_argument("model", help="ONNX file")


def _add_plot(commands) -> None:
    sub = subcommand(
        commands,
        "plot",
        cmd_plot,
        "Draw the graph (PNG, SVG, PDF... with matplotlib, or graphviz DOT text for .dot).",
        """
        onnxgrad plot model.onnx -o model.png
        onnxgrad plot model.onnx -o model.dot && dot -Tsvg model.dot > model.svg
        """,
    )
    sub.add_argument("model", help="ONNX file")
    sub.add_argument("-o", "--output", required=True, help="picture file (.png, .svg, .dot...)")
    sub.add_argument("--title", help="title of the picture (default: the file name)")
    sub.add_argument("--dpi", type=positive_int, default=100, help="resolution of raster images")


def _add_add_loss(commands) -> None:
    sub = subcommand(
        commands,
        "add-loss",
        cmd_add_loss,
        "Append a training loss (and weight penalties) to a model: outputs [loss, prediction].",
        """
        onnxgrad add-loss model.onnx -o model_loss.onnx
        onnxgrad add-loss model.onnx -o model_loss.onnx --score l1 --weight sample_weight
        onnxgrad add-loss model.onnx -o model_loss.onnx --penalty coef=l1:0.1,l2:0.01
        """,
    )
    sub.add_argument("model", help="ONNX file")
    sub.add_argument("-o", "--output", required=True, help="ONNX file to write")
    add_loss_options(sub, "--score")
    sub.add_argument("--label", default="label", help="name of the new label input")
    sub.add_argument("--weight", help="name of a new per-sample weight input")
    sub.add_argument("--loss-name", default="loss", help="name of the loss output")
    sub.add_argument("--prediction", help="the output the loss compares to the label")
    sub.add_argument(
        "--penalty",
        action="append",
        metavar="NAME=l1:A,l2:B",
        help="penalise initializer NAME by A*sum|W| + B*sum W^2 (repeatable; NAME=B means l2:B)",
    )


def _add_derivative(commands) -> None:
    sub = subcommand(
        commands,
        "derivative",
        cmd_derivative,
        "Write the gradient graph of a model (the pre-deployment step).",
        """
        onnxgrad derivative model.onnx -o grad.onnx
        onnxgrad derivative model.onnx -o grad.onnx --inputs x --weights --fill-grad
        onnxgrad derivative clf.onnx -o grad.onnx --weights --outputs probabilities
        onnxgrad derivative model_loss.onnx -o grad.onnx --loss loss --label label
        """,
    )
    sub.add_argument("model", help="ONNX file")
    sub.add_argument("-o", "--output", required=True, help="ONNX file to write")
    sub.add_argument(
        "--weights",
        nargs="*",
        metavar="NAME",
        help="initializers to differentiate (default: every trainable one; none if empty)",
    )
    sub.add_argument(
        "--inputs",
        nargs="*",
        metavar="NAME",
        help="inputs to differentiate (default: every float input; none if empty)",
    )
    sub.add_argument(
        "--outputs",
        nargs="+",
        metavar="NAME",
        help="outputs to differentiate, each with a NAME_grad input (default: every float output)",
    )
    sub.add_argument("--keep-outputs", action="store_true", help="also return the original outputs")
    sub.add_argument(
        "--fill-grad",
        action="store_true",
        help="seed every output gradient with ones instead of taking <output>_grad inputs",
    )
    sub.add_argument("--loss", metavar="NAME", help="differentiate the scalar loss output NAME")
    sub.add_argument("--label", metavar="NAME", help="with --loss, the label input")
    sub.add_argument(
        "--backend",
        choices=("onnx", "ort"),
        default="onnx",
        help="onnx: native engine, standard ops only (default); ort: onnxruntime-training",
    )
    add_recompute_options(sub, "none")
