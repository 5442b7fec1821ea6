"""onnxruntime session options for training sessions, chosen by measurement.

A train step runs the same graph on same-shaped batches again and again, holding weights and
optimizer state in buffers of its own, so onnxruntime's defaults, made for inference, cost
memory for no speed (``benchmarks/bench_memory.py``, one thread, resnet18 and a Llama-like
LM; see docs/benchmarks.md):

* ``enable_mem_pattern = False``: the memory pattern plans one block for every intermediate
  from the second run on, allocated beside the arena chunks of the first run, which are
  never released: +25 MiB on the Llama-like step at 1 step, and growing to 3 steps; no step
  time measured either way (within 2%);
* ``enable_cpu_mem_arena = False``: the arena keeps the peak of every size class it served
  and rounds extensions up; without it intermediates go back to the heap when freed (-73 MiB
  on resnet18 at batch 16, -24 MiB on the Llama), step time within the noise (<= 4%);
* the execution order stays ``DEFAULT``: ``PRIORITY_BASED`` raised resnet18's peak by 16%,
  and ``MEMORY_EFFICIENT`` is refused outside onnxruntime's training build.

Callers passing their own ``SessionOptions`` get exactly theirs; :func:`training_session_options`
builds the defaults with any of them overridden.
"""

from __future__ import annotations

from typing import Any

import onnxruntime as ort

#: attribute of ``onnxruntime.SessionOptions`` -> value for training sessions
TRAINING_SESSION_OPTIONS: dict[str, Any] = {
    "enable_mem_pattern": False,
    "enable_cpu_mem_arena": False,
}


def training_session_options(
    intra_op_num_threads: int | None = None, **overrides: Any
) -> ort.SessionOptions:
    """``SessionOptions`` with :data:`TRAINING_SESSION_OPTIONS`, then ``overrides`` (any
    attribute of ``SessionOptions``, e.g. ``enable_mem_pattern=True``)."""
    options = ort.SessionOptions()
    for name, value in {**TRAINING_SESSION_OPTIONS, **overrides}.items():
        if not hasattr(options, name):
            raise ValueError(f"onnxruntime.SessionOptions has no option {name!r}")
        setattr(options, name, value)
    if intra_op_num_threads is not None:
        options.intra_op_num_threads = int(intra_op_num_threads)
    return options


__all__ = ["TRAINING_SESSION_OPTIONS", "training_session_options"]
