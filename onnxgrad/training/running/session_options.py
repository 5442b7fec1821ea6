"""onnxruntime session options for training sessions, chosen by measurement.

A train step runs the same graph on same-shaped batches again and again, holding weights and
optimizer state in buffers of its own, so onnxruntime's defaults, made for inference, cost
memory for no speed (``benchmarks/bench_memory.py``, one thread, resnet18 and a Llama-like
LM; see docs/benchmarks.md):

* ``enable_mem_pattern = False``: the memory pattern plans one block for every intermediate
  from the second run on, allocated beside the arena chunks of the first run, which are
  never released: the Llama-like step (4 layers, hidden 256, flat update) grew from 189 MiB
  after one step to 237 after three, 190 without it; resnet18 (batch 16) 417 against 390.
  Step CPU time: medians within 2%, inside the run-to-run spread;
* the CPU arena stays on: without it intermediates go back to glibc's heap, which keeps them
  under its default settings (the transformer classifier at sequence 256: 208 MiB against
  135 with the arena; resnet18 at batch 64: 400 against 355; the 8-layer Llama: 549 against
  506). Where glibc returns large blocks to the system (``MALLOC_MMAP_THRESHOLD_=131072``),
  ``enable_cpu_mem_arena=False`` saves 10-15% more (115, 277 and 460 MiB against 135, 314
  and 505), at the same step time;
* ``enable_mem_reuse = False``: onnxruntime 1.19's memory-reuse planner is quadratic in the
  graph's size (it scans every freed buffer for each new value): the Llama-like gradient
  (hidden 64, 16 and 32 layers, 3,065 and 6,025 nodes) took 0.40 and 1.55 s to create with
  no graph optimisation, 0.08 and 0.22 without reuse, and the fused step 2.7 s against 1.0 at
  32 layers. Without the memory pattern the arena already hands freed blocks to later values,
  so the step's peak stays the same (the 4-layer Llama: 121 MiB against 123) at the same step
  time; onnxruntime 1.32 creates the sessions in the same time either way
  (``benchmarks/bench_session_creation.py``);
* the CPU arena is one arena shared by the process's training sessions, grown by what a
  request lacks instead of by powers of two (:mod:`onnxgrad.training.running.cpu_arena`): the
  transformer classifier at sequence 256 peaks at 39.6 MiB instead of 44.1, the 8-layer
  Llama-like LM at 286 instead of 331, for +1.3 % and +4.3 % of step CPU time; not with
  ``enable_cpu_mem_arena=False``;
* ``execution_order = PRIORITY_BASED``: onnxruntime's ``DEFAULT`` order is a depth-first
  walk back from the graph's leaves, which reaches a node only from its consumers. On
  onnxruntime 1.32 (not 1.19) the walk reaches the backward's ``Shape`` of a forward value
  (the gradient of a ``Reshape`` needs its input's shape) only when the backward does, so the
  forward value stays alive across the whole step for a few bytes of shape: the transformer
  classifier at sequence 256 held its packed q/k/v projections and their views (a liveness
  replay of onnxruntime's profile: 48 MiB of tensors at the peak against 24 on 1.19; the
  step 46 MiB over the imports against PyTorch's 25). ``PRIORITY_BASED`` is Kahn's
  algorithm that runs every ready ``Shape`` and ``Size`` first and the other ready nodes by
  position, so a shape is taken as soon as its tensor exists, and the rest runs in the
  graph's own order (forward, backward in the order :mod:`onnxgrad.training.step.node_order`
  and the engine emit it, update). Measured on onnxruntime 1.32 (``bench_memory.py``, 3
  steps, MiB over the imports, glibc's default / ``MALLOC_MMAP_THRESHOLD_=131072``): the
  transformer 46 / 46 -> 29 / 29, resnet18 253 / 250 -> 243 / 235, the 8-layer Llama
  325 / 324 -> 330 / 328; step CPU time, both orders alternated in one process, within
  1 %. ``MEMORY_EFFICIENT`` is refused outside onnxruntime's training build;
* ``session.qdq_matmulnbits_accuracy_level = 1``: from 1.20 on, onnxruntime turns
  ``MatMul(x, DequantizeLinear(W))`` with integer weights into ``MatMulNBits`` and, by default,
  rounds ``x`` to int8 inside it: a 256 x 64 product of int8 weights came 4.1e-3 (per column)
  and 6.0e-3 (blocks of 32) of its largest value away from the float product the ONNX
  specification defines, 3.9e-7 and 5.5e-7 at level 1 (float32 compute). A gradient or a
  train step is checked against the specification, so the fused kernel computes in float32
  here; onnxruntime 1.19 ignores the entry.

Callers passing their own ``SessionOptions`` get exactly theirs; :func:`training_session_options`
builds the defaults with any of them overridden.
"""

from __future__ import annotations

from typing import Any

import onnxruntime as ort

from onnxgrad.training.running.cpu_arena import use_shared_cpu_arena

#: attribute of ``onnxruntime.SessionOptions`` -> value for training sessions
TRAINING_SESSION_OPTIONS: dict[str, Any] = {
    "enable_mem_pattern": False,
    "enable_mem_reuse": False,
    "execution_order": ort.ExecutionOrder.PRIORITY_BASED,
}

#: ``SessionOptions.add_session_config_entry`` key -> value for training sessions
TRAINING_SESSION_CONFIG: dict[str, str] = {"session.qdq_matmulnbits_accuracy_level": "1"}


def training_session_options(
    intra_op_num_threads: int | None = None, **overrides: Any
) -> ort.SessionOptions:
    """``SessionOptions`` with :data:`TRAINING_SESSION_OPTIONS`, then ``overrides`` (any
    attribute of ``SessionOptions``, e.g. ``enable_mem_pattern=True``), and the config entries
    of :data:`TRAINING_SESSION_CONFIG`."""
    options = ort.SessionOptions()
    for name, value in {**TRAINING_SESSION_OPTIONS, **overrides}.items():
        if not hasattr(options, name):
            raise ValueError(f"onnxruntime.SessionOptions has no option {name!r}")
        setattr(options, name, value)
    for key, value in TRAINING_SESSION_CONFIG.items():
        options.add_session_config_entry(key, value)
    if intra_op_num_threads is not None:
        options.intra_op_num_threads = int(intra_op_num_threads)
    return use_shared_cpu_arena(options) if options.enable_cpu_mem_arena else options


__all__ = ["TRAINING_SESSION_CONFIG", "TRAINING_SESSION_OPTIONS", "training_session_options"]
