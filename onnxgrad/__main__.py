"""``python -m onnxgrad`` is the ``onnxgrad`` command."""

import sys

try:
    from onnxgrad.cli import command
except KeyboardInterrupt:
    print("onnxgrad: error: interrupted", file=sys.stderr)
    sys.exit(130)

command()
