"""The ``onnxgrad`` command (placeholder until the CLI issue lands)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print("onnxgrad: no subcommand implemented yet", file=sys.stderr)
    return 2
