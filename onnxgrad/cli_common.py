"""What the ``onnxgrad`` subcommands share: the one-line error, the parser, the model and
data readers and the common options.

Nothing heavy is imported here at module level: ``onnxgrad --help`` and usage errors answer
without loading numpy, onnx or onnxruntime; the readers import what they use when called.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import re
import sys
import textwrap
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from onnx import ModelProto

USAGE_ERROR = 2


class LazyChoices(Sequence):
    """The ``choices`` of an option, read from ``module.name`` when argparse first checks or
    shows them, so building the parser imports nothing heavy (give the option a ``metavar``:
    argparse lists the choices of an option without one as it is added)."""

    def __init__(self, module: str, name: str):
        self._where = (module, name)

    @functools.cached_property
    def _values(self) -> tuple[str, ...]:
        module, name = self._where
        return tuple(getattr(importlib.import_module(module), name))

    def __getitem__(self, index):
        return self._values[index]

    def __len__(self) -> int:
        return len(self._values)


class CommandError(Exception):
    """A failure the command reports in one line (status 2), without a traceback."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


#: Python spellings in library messages -> the command line's
_CLI_SPELLINGS = {"backend='ort'": "--backend ort", "backend='onnx'": "--backend onnx"}
#: ``learning_loss='cross_entropy_logits'``, or ``use 'cross_entropy_logits'``: a loss name
_LOSS_ADVICE = re.compile(r"(?:learning_loss=|(?<=use ))'([a-z_0-9]+)'")


def cli_spelling(text: str) -> str:
    """A library message's Python spellings (``backend='ort'``,
    ``learning_loss='cross_entropy_logits'``) as the command line's options."""
    for python, cli in _CLI_SPELLINGS.items():
        text = text.replace(python, cli)
    return _LOSS_ADVICE.sub(lambda m: f"--loss {m.group(1)}", text)


def one_line(exc: BaseException) -> str:
    """``exc`` as one line, options spelled as on the command line."""
    text = cli_spelling(" ".join(str(exc).split()))
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    return text or type(exc).__name__


@contextlib.contextmanager
def warnings_as_lines(prog: str):
    """Show the library's warnings as ``PROG: warning: ...`` lines on standard error, in
    the command line's words, each advice once (Python shows a warning with its source line,
    once per place that raises it)."""
    shown: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None):
        text = cli_spelling(" ".join(str(message).split()))
        advice = text[text.rfind("use --") :] if "use --" in text else text
        if advice not in shown:
            shown.add(advice)
            print(f"{prog}: warning: {text}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("always")  # the deduplication is ours, by advice
        warnings.showwarning = show
        yield


def read_model(path: str) -> ModelProto:
    """The model stored at ``path``, once onnx's full checker (strict shape inference
    included) accepts it; ``CommandError`` names the file when it cannot be read or is
    invalid (a cycle, inconsistent shapes...)."""
    if os.path.isdir(path):
        raise CommandError(f"{path!r} is a folder, not an ONNX file")
    if os.path.exists(path) and not os.access(path, os.R_OK):
        raise CommandError(f"{path!r} cannot be read (permission denied)")
    from onnx.checker import ValidationError, check_model
    from onnx.shape_inference import InferenceError

    from onnxgrad._model_checks import check_structure
    from onnxgrad._onnx_utils import load_model, weightless_view
    from onnxgrad.normalize.structure import runtime_ops_as_contrib

    model = load_model(path)
    try:
        check_structure(model)  # names the node or value at fault; sorts the nodes
        view = weightless_view(model)  # past 2 GiB too, no copy
        del view.graph.value_info[:]  # hints onnxruntime re-infers (genai's builder errs)
        with runtime_ops_as_contrib(view):  # onnxruntime's default-domain extras
            check_model(view, full_check=True)
    except (ValueError, ValidationError, InferenceError) as exc:
        raise CommandError(f"{path!r} is not a valid ONNX model: {one_line(exc)}") from None
    return model


def normalized(model: ModelProto, path: str) -> ModelProto:
    """``model`` (read from ``path``, private) made regular by
    :func:`onnxgrad.normalize.normalize_in_place`; ``CommandError`` names the file and why not."""
    from onnxgrad.normalize import normalize_in_place

    try:
        return normalize_in_place(model)
    except (ValueError, NotImplementedError) as exc:
        raise CommandError(f"{path!r} cannot be used for training: {one_line(exc)}") from None


def check_destination(path: str) -> Path:
    """``path`` as a Path whose folder exists, checked before any work is done."""
    destination = Path(path)
    folder = destination.parent
    if not folder.is_dir():
        raise CommandError(f"the folder of the output {path!r} does not exist")
    if destination.is_dir():
        raise CommandError(f"the output {path!r} is a folder, expected a file name")
    return destination


def number(text: str, what: str) -> float:
    """``text`` as a float; ``CommandError`` names ``what`` otherwise."""
    try:
        return float(text)
    except ValueError:
        raise CommandError(f"{what}: {text!r} is not a number") from None


def read_training_data(path: str, model: ModelProto):
    """Arrays ``X`` and ``y`` of the ``.npz`` file ``path``; float arrays are cast to the
    element type of the model's first input and first float output."""
    from onnxgrad._npz import load_arrays  # only the arrays used, sizes checked first
    from onnxgrad._onnx_utils import FLOAT_TYPES, np_dtype

    if not os.path.isfile(path):
        raise CommandError(f"data file {path!r} does not exist or is not a regular file")
    try:
        arrays = load_arrays(path, ["X", "y"])
    except KeyError as exc:
        raise CommandError(exc.args[0]) from None
    except ValueError as exc:
        raise CommandError(one_line(exc)) from None
    except Exception as exc:  # zipfile raises many types for a corrupt file
        raise CommandError(f"{path!r} is not a readable .npz file: {one_line(exc)}") from None
    X, y = arrays["X"], arrays["y"]
    if X.dtype.kind == "f":
        X = X.astype(np_dtype(first_input(model).type.tensor_type.elem_type), copy=False)
    output = next(
        (o for o in model.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES), None
    )
    if y.dtype.kind == "f" and output is not None:
        y = y.astype(np_dtype(output.type.tensor_type.elem_type), copy=False)
    return X, y


def first_input(model: ModelProto):
    """The model's first input that is not an initializer (``X``'s)."""
    from onnxgrad._onnx_utils import real_inputs

    inputs = real_inputs(model)
    if not inputs:
        raise CommandError("the model has no input to feed X to")
    return inputs[0]


def subcommand(commands, name: str, run, summary: str, examples: str) -> OneLineParser:
    """The parser of subcommand ``name``, which runs ``run(args)``, with its examples."""
    sub = commands.add_parser(
        name,
        help=summary,
        description=summary,
        epilog="examples:\n" + textwrap.indent(textwrap.dedent(examples).strip(), "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub.set_defaults(run=run, prog=f"onnxgrad {name}")
    return sub


def add_optimizer_option(sub: argparse.ArgumentParser, default: str, note: str) -> None:
    """``--optimizer NAME`` of the learning-rate table (read when the choices are checked)."""
    sub.add_argument(
        "--optimizer",
        type=str.lower,  # "SGD" as the estimators and the migration page write it
        choices=LazyChoices("onnxgrad.training.step.learning_rate", "LEARNING_RATE_NAMES"),
        metavar="NAME",
        default=default,
        help=f"one of %(choices)s; {note} (default: %(default)s)",
    )


def add_loss_options(sub: argparse.ArgumentParser, flag: str) -> None:
    """The loss name and its reduction, both read from the one loss table."""
    sub.add_argument(
        flag,
        choices=LazyChoices("onnxgrad.graph.loss_table", "LOSS_NAMES"),
        default="squared_error",
        metavar="NAME",
        help="a loss of docs/losses.md: squared_error, absolute_error, elastic, log, "
        "log_logits, cross_entropy, cross_entropy_logits or an alias (l2, l1, square_error...; "
        "default: %(default)s)",
    )
    sub.add_argument(
        "--reduction",
        choices=LazyChoices("onnxgrad.graph.loss_table", "REDUCTIONS"),
        metavar="{sum,mean}",
        help="the loss over a batch: sum (default, as the seeds) or mean; train reports "
        "either averaged over its batches (docs/losses.md)",
    )


def add_recompute_options(sub: argparse.ArgumentParser, default: str) -> None:
    """``--recompute MODE`` and ``--checkpoint-blocks PATTERN...`` (``recompute=``)."""
    sub.add_argument(
        "--recompute",
        choices=("none", "attention", "auto"),
        default=default,
        help="forward values the backward recomputes: attention (large attentions in tiles), "
        "auto (that and cheap values) or none (default: %(default)s)",
    )
    sub.add_argument(
        "--checkpoint-blocks",
        nargs="+",
        metavar="PATTERN",
        help="checkpoint these blocks instead (regular expressions on node names or on the "
        "exporter's module paths, e.g. 'layers\\.\\d+'): the backward recomputes each",
    )


def recompute_option(args: argparse.Namespace) -> str | list[str] | None:
    """``recompute=`` of ``--recompute`` and ``--checkpoint-blocks``."""
    if args.checkpoint_blocks:
        return list(args.checkpoint_blocks)
    return None if args.recompute == "none" else args.recompute


def reduction_option(args: argparse.Namespace) -> dict[str, str]:
    """The ``reduction`` keyword of ``--reduction``, none when not given."""
    return {} if args.reduction is None else {"reduction": args.reduction}


def positive_int(text: str) -> int:
    """argparse type: an integer above 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value
