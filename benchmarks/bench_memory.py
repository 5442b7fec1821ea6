"""Peak memory of training steps: onnxgrad's fused train step against PyTorch eager.

Three models, each ending in its mean cross-entropy loss, the same initial weights, data and
optimizer on both sides (the ONNX model is exported from the PyTorch module, which trains in
evaluation mode so that both compute the same function: BatchNorm on running statistics):

* ``resnet18``: torchvision's layers (``_zoo.py``), 64x64 images, SGD with momentum 0.9;
* ``transformer``: the classifier of ``bench_train.py`` (embedding, 2 encoder layers, mean
  pool, linear), Adam;
* ``llama``: a Llama-like causal LM (transformers configuration, random weights, eager
  attention) with the next-token loss, Adam.

Each case runs in a fresh process on one thread: after the imports and the data it builds
the model and optimizer (onnxgrad: the train step, its session and buffers), then runs 1 and
3 steps. Resident memory comes from ``/proc/self/status``; the peak (``VmHWM``) is reset
through ``/proc/self/clear_refs`` after the build, so the step columns are the peak over the
steps alone, counted above the resident memory after the imports and the data. With
``--malloc both`` every case runs again under ``MALLOC_MMAP_THRESHOLD_=131072``, which keeps
glibc from growing its heap for large blocks (steadier figures, and PyTorch's lower).

``--recompute`` chooses what onnxgrad's step recomputes in the backward
(:mod:`onnxgrad.derivative.recompute`): ``default`` is ``make_train_step``'s default
(``attention`` since it has one), ``none`` nothing, ``attention`` large attentions in tiles,
``auto`` that and cheap values, ``blocks`` checkpoints each residual stage of resnet18 and
each layer of the transformer and the Llama (:data:`BLOCKS`).

    python benchmarks/bench_memory.py [--size small|issue] [--models resnet18,llama]
        [--malloc default|mmap|both] [--steps 3]
        [--recompute default|none|attention|auto|blocks]
        [--ort-python PATH] [--json out.json]

``--ort-python`` runs onnxgrad's cases under another interpreter (its own onnxruntime, e.g.
an environment with the current onnxruntime and no PyTorch); PyTorch's cases and the exports
run under this one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MMAP_THRESHOLD = "131072"

#: model -> size -> configuration
CONFIGS = {
    "resnet18": {
        "small": {"batch": 16, "image": 64, "classes": 1000},
        "issue": {"batch": 64, "image": 64, "classes": 1000},
    },
    "transformer": {
        "small": {"batch": 32, "tokens": 64, "vocab": 100, "dim": 32},
        "issue": {"batch": 32, "tokens": 256, "vocab": 100, "dim": 32},
    },
    "llama": {
        "small": {"batch": 4, "tokens": 64, "vocab": 2000, "hidden": 256, "layers": 4},
        "issue": {"batch": 8, "tokens": 128, "vocab": 2000, "hidden": 256, "layers": 8},
    },
}

#: model -> the block pattern of ``--recompute blocks`` (node names, or the exporter's namespace)
BLOCKS = {"resnet18": r"inner\.\d+/", "transformer": r"layers\.\d+", "llama": r"layers\.\d+"}


# -- measuring ---------------------------------------------------------------------------------
def memory_mib() -> dict[str, float]:
    """``{'rss': ..., 'peak': ...}`` of this process in MiB (``VmRSS``, ``VmHWM``)."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values["rss" if key == "VmRSS" else "peak"] = int(rest.split()[0]) / 1024
    return values


def reset_peak() -> None:
    """Set the peak resident memory to the current one (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


# -- the models (parent process: needs torch) -------------------------------------------------
def torch_module(torch, name: str, config: dict):
    """``module(x, label) -> mean cross-entropy``."""
    nn, F = torch.nn, torch.nn.functional
    torch.manual_seed(0)
    if name == "resnet18":
        from _zoo import resnet18

        inner = resnet18(config["classes"])
    elif name == "transformer":
        from bench_train import transformer

        inner = transformer(torch, vocab=config["vocab"], dim=config["dim"])
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        llama = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=config["vocab"],
                hidden_size=config["hidden"],
                intermediate_size=2 * config["hidden"],
                num_hidden_layers=config["layers"],
                num_attention_heads=8,
                num_key_value_heads=4,
                max_position_embeddings=config["tokens"],
                use_cache=False,
                attn_implementation="eager",
            )
        )

        class Logits(nn.Module):
            def __init__(self):
                super().__init__()
                self.llama = llama

            def forward(self, ids):
                return self.llama(input_ids=ids).logits.reshape(-1, config["vocab"])

        inner = Logits()

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x, label):
            return F.cross_entropy(self.inner(x), label.reshape(-1))

    return _untied(torch, WithLoss())


def _untied(torch, module):
    """``module`` with its parameters made distinct: a constant one (norm scales of ones,
    biases of zeros) or one equal to another (``nn.TransformerEncoder`` clones its first
    layer) moves by a little noise. The exporter merges equal initializers, so the ONNX model
    would otherwise train one tied tensor where PyTorch trains several, and the losses after
    the first step would differ."""
    generator = torch.Generator().manual_seed(1)
    seen = set()
    with torch.no_grad():
        for parameter in module.parameters():
            flat = parameter.reshape(-1)
            key = (tuple(parameter.shape), flat.numpy().tobytes())
            if key in seen or (flat.numel() > 1 and bool((flat == flat[0]).all())):
                noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
                parameter.add_(1e-2 * noise)
            seen.add((tuple(parameter.shape), flat.numpy().tobytes()))
    return module


def make_data(name: str, config: dict) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    n = config["batch"]
    if name == "resnet18":
        x = rng.standard_normal((n, 3, config["image"], config["image"])).astype(np.float32)
        return x, rng.integers(0, config["classes"], n).astype(np.int64)
    tokens = config["tokens"]
    x = rng.integers(0, config["vocab"], (n, tokens)).astype(np.int64)
    if name == "transformer":
        return x, rng.integers(0, 4, n).astype(np.int64)
    return x, np.roll(x, -1, axis=1)


def export_case(name: str, config: dict, folder: Path) -> None:
    """``model.onnx`` (inputs ``x``, ``label``, output ``loss``), ``state.pt`` and
    ``data.npz`` in ``folder``."""
    import warnings

    import torch

    module = torch_module(torch, name, config).eval()
    x, label = make_data(name, config)
    torch.save(module.state_dict(), folder / "state.pt")
    np.savez(folder / "data.npz", x=x, label=label)
    example = (torch.from_numpy(x[:2]), torch.from_numpy(label[:2]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name != "resnet18":  # TorchScript exports neither the encoder nor Llama's mask
            batch = torch.export.Dim("batch", min=1)
            program = torch.onnx.export(
                module,
                example,
                dynamo=True,
                opset_version=18,
                input_names=["x", "label"],
                output_names=["loss"],
                dynamic_shapes=({0: batch}, {0: batch}),
                verbose=False,
            )
            program.save(str(folder / "model.onnx"))
        else:
            torch.onnx.export(
                module,
                example,
                str(folder / "model.onnx"),
                dynamo=False,
                opset_version=18,
                input_names=["x", "label"],
                output_names=["loss"],
                dynamic_axes={"x": {0: "batch"}, "label": {0: "batch"}},
            )


# -- one case (child process) ------------------------------------------------------------------
def make_trainer(framework: str, name: str, folder: Path, x, label, lr: float):
    """``step() -> loss`` of one framework on the batch ``(x, label)``."""
    if framework == "torch":
        import torch

        module = torch_module(torch, name, CONFIGS[name][_size_of(folder)])
        module.load_state_dict(torch.load(folder / "state.pt"))
        module.eval()
        if name == "resnet18":
            optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
        else:
            optimizer = torch.optim.Adam(module.parameters(), lr=lr)
        xt, yt = torch.from_numpy(x), torch.from_numpy(label)

        def step() -> float:
            optimizer.zero_grad()
            loss = module(xt, yt)
            loss.backward()
            optimizer.step()
            return float(loss)

        return step

    import onnx

    from onnxgrad.graph import get_train_initializer
    from onnxgrad.training.running.data import OrtDataLoader
    from onnxgrad.training.running.devices import parse_device
    from onnxgrad.training.running.runner import TrainingRunner
    from onnxgrad.training.step.composition import make_train_step
    from onnxgrad.training.step.learning_rate import LearningRateAdam, LearningRateSGDNesterov

    model = onnx.load(folder / "model.onnx")
    if name == "resnet18":
        optimizer = LearningRateSGDNesterov(
            eta0=lr, learning_rate="constant", momentum=0.9, nesterov=False
        )
    else:
        optimizer = LearningRateAdam(eta0=lr)
    layout = _layout()
    if layout == "auto":
        try:
            from onnxgrad.training.step.train_step import default_layout
        except ImportError:  # before default_layout, the estimators updated flat on the CPU
            layout = "flat"
        else:
            layout = default_layout(model, get_train_initializer(model), "cpu")
    train_step = make_train_step(
        model, loss=None, learning_rate=optimizer, layout=layout, **_recompute(name)
    )
    weights = {
        i.name: onnx.numpy_helper.to_array(i)
        for i in model.graph.initializer
        if i.name in train_step.weights
    }
    del model
    runner = TrainingRunner(train_step, parse_device("cpu"), weights, None, _ort_options())
    del weights
    loader = OrtDataLoader(x, label, batch_size=len(x), random_state=0)

    def step() -> float:
        return float(runner.run_epoch(loader, lr)[0])

    return step


def child(framework: str, name: str, folder: Path, steps: int, lr: float) -> dict:
    """Build and run ``steps`` steps after a warm-up of the same model on 2 rows (which
    loads the code both frameworks load on first use), then freed."""
    if framework == "torch":
        import torch

        torch.set_num_threads(1)
    else:
        import onnxruntime  # noqa: F401

        import onnxgrad  # noqa: F401
    data = np.load(folder / "data.npz")
    x, label = data["x"], data["label"]
    warm = make_trainer(framework, name, folder, x[:2], label[:2], lr)
    warm()
    del warm
    _trim_heap()
    base = memory_mib()["rss"]
    reset_peak()
    start = time.perf_counter()
    step = make_trainer(framework, name, folder, x, label, lr)
    build_s = time.perf_counter() - start
    build_peak = memory_mib()["peak"]
    reset_peak()
    losses, times, peaks = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
        peaks.append(memory_mib()["peak"])
    return {
        "base": base,
        "build": build_peak - base,
        "build_s": build_s,
        "steps": [p - base for p in peaks],
        "times": times,
        "losses": losses,
    }


def _trim_heap() -> None:
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _recompute(name: str) -> dict:
    """``make_train_step``'s ``recompute`` for ``--recompute`` (nothing for ``default``, and
    for ``none`` with an onnxgrad that has no such parameter)."""
    import inspect

    from onnxgrad.training.step.composition import make_train_step

    choice = os.environ.get("BENCH_RECOMPUTE", "default")
    if choice == "default":
        return {}
    if choice == "none":
        known = inspect.signature(make_train_step).parameters
        return {"recompute": None} if "recompute" in known else {}
    return {"recompute": choice if choice in ("auto", "attention") else [BLOCKS[name]]}


def _layout() -> str:
    return os.environ.get("BENCH_LAYOUT", "auto")


def _ort_options():
    """onnxgrad's options for training sessions on one thread, then the ``--session-option``
    values (``BENCH_SESSION_OPTIONS``)."""
    import onnxruntime

    try:
        from onnxgrad.training.running.session_options import training_session_options
    except ImportError:  # an onnxgrad before them: onnxruntime's defaults

        def training_session_options(threads, **overrides):
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = threads
            for key, value in overrides.items():
                setattr(options, key, value)
            return options

    overrides = {"inter_op_num_threads": 1}
    for item in filter(None, os.environ.get("BENCH_SESSION_OPTIONS", "").split(",")):
        key, value = item.split("=")
        if key == "execution_order":
            overrides[key] = getattr(onnxruntime.ExecutionOrder, value)
        elif key == "graph_optimization_level":
            overrides[key] = getattr(onnxruntime.GraphOptimizationLevel, value)
        else:
            overrides[key] = bool(int(value))
    return training_session_options(1, **overrides)


def _size_of(folder: Path) -> str:
    return folder.name.rsplit("-", 1)[1]


# -- the parent --------------------------------------------------------------------------------
def run_case(
    framework: str, name: str, folder: Path, steps: int, mmap: bool, python: str = sys.executable
) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap:
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    command = [python, __file__, "--child", framework, name, str(folder), str(steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine(ort_python: str) -> str:
    import onnx
    import torch

    import onnxgrad

    ort_version = subprocess.run(
        [ort_python, "-c", "import onnxruntime; print(onnxruntime.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return (
        f"{cpu}, {os.cpu_count()} cores, {memory:.0f} GiB; Python {platform.python_version()}, "
        f"torch {torch.__version__}, onnxruntime {ort_version}, onnx "
        f"{onnx.__version__}, onnxgrad {onnxgrad.__version__}; one thread each"
    )


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["small", "issue"], default="small")
    parser.add_argument("--models", default=",".join(CONFIGS))
    parser.add_argument("--malloc", choices=["default", "mmap", "both"], default="mmap")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--session-option",
        action="append",
        default=[],
        help="onnxruntime session option for onnxgrad, e.g. enable_mem_pattern=0 or "
        "execution_order=PRIORITY_BASED (repeatable)",
    )
    parser.add_argument(
        "--layout",
        choices=["auto", "flat", "per_weight"],
        default="auto",
        help="the train step's update layout (auto: the estimators' choice on the CPU)",
    )
    parser.add_argument(
        "--recompute",
        choices=["default", "none", "auto", "attention", "blocks"],
        default="default",
        help="values onnxgrad's backward recomputes: make_train_step's default, none, "
        "attention in tiles (attention), that and cheap values (auto), each block's (blocks)",
    )
    parser.add_argument(
        "--ort-python",
        default=sys.executable,
        help="the interpreter of onnxgrad's cases (default: this one)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=4, metavar=("FRAMEWORK", "MODEL", "FOLDER", "STEPS"))
    args = parser.parse_args(argv)
    if args.child:
        framework, name, folder, steps = args.child
        print(json.dumps(child(framework, name, Path(folder), int(steps), args.lr)))
        return []
    try:
        import torch  # noqa: F401
    except ImportError:
        print("PyTorch is not installed: nothing to compare with")
        return []
    os.environ["BENCH_SESSION_OPTIONS"] = ",".join(args.session_option)
    os.environ["BENCH_LAYOUT"] = args.layout
    os.environ["BENCH_RECOMPUTE"] = args.recompute
    print(machine(args.ort_python))
    variants = {"default": [False], "mmap": [True], "both": [False, True]}[args.malloc]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        for name in args.models.split(","):
            config = CONFIGS[name][args.size]
            folder = Path(tmp) / f"{name}-{args.size}"
            folder.mkdir()
            export_case(name, config, folder)
            weights_mib = (folder / "model.onnx").stat().st_size / 2**20
            for mmap in variants:
                row = {"model": name, "config": config, "mmap": mmap, "model_mib": weights_mib}
                row["recompute"] = args.recompute
                pythons = {"torch": sys.executable, "onnxgrad": args.ort_python}
                for framework, python in pythons.items():
                    row[framework] = run_case(framework, name, folder, args.steps, mmap, python)
                rows.append(row)
                _print_row(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def _print_row(row: dict) -> None:
    t, o = row["torch"], row["onnxgrad"]
    head = f"{row['model']:11s} {'mmap' if row['mmap'] else 'default':7s}"
    head += f" recompute={row.get('recompute', 'none')}"
    if "error" in t or "error" in o:
        print(f"{head} error: torch {t.get('error')}, onnxgrad {o.get('error')}")
        return
    ratio1, ratio = o["steps"][0] / t["steps"][0], o["steps"][-1] / t["steps"][-1]
    time_ratio = o["times"][-1] / t["times"][-1]
    print(
        f"{head} {row['config']}\n    model {row['model_mib']:.0f} MiB | MiB over imports, "
        f"1 step / {len(t['steps'])} steps: torch {t['steps'][0]:.0f} / {t['steps'][-1]:.0f}, "
        f"onnxgrad {o['steps'][0]:.0f} / {o['steps'][-1]:.0f} (x{ratio1:.2f} / x{ratio:.2f}); "
        f"onnxgrad build peak {o['build']:.0f} in {o['build_s']:.1f} s; last step "
        f"{t['times'][-1] * 1e3:.0f} / {o['times'][-1] * 1e3:.0f} ms (x{time_ratio:.2f}); "
        f"first loss {t['losses'][0]:.6f} / {o['losses'][0]:.6f}"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
