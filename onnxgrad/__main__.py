"""``python -m onnxgrad`` is the ``onnxgrad`` command."""

import sys

from onnxgrad.cli import main

sys.exit(main())
