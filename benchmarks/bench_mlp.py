"""Seed 004's benchmark: an MLPRegressor (100 -> 50 -> 10 -> 1) trained 100 epochs.

make_regression(1000 x 100), batches of 15, SGD with Nesterov momentum 0.9 and the
'invscaling' schedule (power_t=0.5), side by side in one process:

* scikit-learn's ``MLPRegressor``;
* onnxgrad's ``OrtGradientForwardBackwardOptimizer`` (one fused train step per batch);
* the per-tensor baseline of the seeds: a gradient graph, then one small ``axpyw2`` graph
  per weight tensor per batch, every call through IOBinding;
* PyTorch eager (when installed).

All start from the same initial weights. scikit-learn minimises half the squared error,
the others the squared error, so they use half its learning rate: the trajectories are
the same up to the batch order. ``alpha=0``: no L2 penalty anywhere.

Every framework runs on ``--threads`` threads (default 1: the fastest for batches of 15
rows, and fair on a busy machine); the runs alternate ``--repeat`` times, the best kept.

Run: ``python benchmarks/bench_mlp.py [--epochs 100] [--backend onnx|ort] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
import warnings

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from skl2onnx import to_onnx
from sklearn.datasets import make_regression
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import r2_score
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPRegressor
from threadpoolctl import threadpool_limits

from onnxgrad import (
    DerivativeOptions,
    LearningRateSGDNesterov,
    OrtGradientForwardBackwardOptimizer,
    SquareLearningLoss,
    function_onnx_graph,
    make_loss_model,
    onnx_derivative,
)
from onnxgrad.training import (
    OrtDataLoader,
    TrainingRunner,
    check_device,
    make_train_step,
    with_batch_indices,
)
from onnxgrad.training.step.composition import weights_as_inputs

BATCH_SIZE = 15
SKL_LR = 5e-5
POWER_T = 0.5
MOMENTUM = 0.9


def data():
    X, y = make_regression(1000, n_features=100, bias=2, random_state=0)
    X, y = X.astype(np.float32), y.astype(np.float32)
    return train_test_split(X, y, random_state=0)


def sklearn_model(epochs: int, X, y) -> MLPRegressor:
    """An MLPRegressor holding scikit-learn's initial weights (one step at a tiny rate)."""
    init = MLPRegressor(
        hidden_layer_sizes=(50, 10),
        solver="sgd",
        max_iter=1,
        batch_size=len(X),
        learning_rate_init=1e-30,
        alpha=0.0,
        random_state=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        init.fit(X, y)
    model = copy.deepcopy(init)
    model.set_params(
        warm_start=True,
        max_iter=epochs,
        batch_size=BATCH_SIZE,
        learning_rate_init=SKL_LR,
        learning_rate="invscaling",
        power_t=POWER_T,
        momentum=MOMENTUM,
        nesterovs_momentum=True,
        n_iter_no_change=10 * epochs,
        tol=0.0,
    )
    return model


def optimizer() -> LearningRateSGDNesterov:
    return LearningRateSGDNesterov(
        eta0=SKL_LR / 2, learning_rate="invscaling", power_t=POWER_T, momentum=MOMENTUM
    )


def timed(fit):
    """Wall-clock seconds of ``fit()`` (and its result); the CPU seconds of this process go
    to ``CPU_SECONDS``, a measure a busy machine disturbs less."""
    cpu, start = time.process_time(), time.perf_counter()
    result = fit()
    CPU_SECONDS.append(time.process_time() - cpu)
    return time.perf_counter() - start, result


CPU_SECONDS: list[float] = []


def bench_sklearn(model, X, y, X_test, y_test):
    model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        seconds, _ = timed(lambda: model.fit(X, y))
    return seconds, r2_score(y_test, model.predict(X_test))


def bench_onnxgrad(onx, epochs, backend, threads, X, y, X_test, y_test):
    est = OrtGradientForwardBackwardOptimizer(
        onx,
        max_iter=epochs,
        batch_size=BATCH_SIZE,
        learning_rate=optimizer(),
        learning_loss=SquareLearningLoss(reduction="mean"),  # scikit-learn averages its loss
        random_state=0,
        backend=backend,
        intra_op_num_threads=threads,
    )
    est.fit(X, y)  # builds and caches the graphs and sessions
    seconds, _ = timed(lambda: est.fit(X, y))
    return seconds, r2_score(y_test, est.predict(X_test).ravel())


class PerTensorBaseline:
    """The seeds' loop: per batch, one gradient call then one ``axpyw2`` call per weight."""

    def __init__(self, onx, backend: str, threads: int | None):
        weights = [i.name for i in onx.graph.initializer if i.name != "shape_tensor"]
        lm = make_loss_model(onx, SquareLearningLoss(reduction="mean"), weights=weights)
        gradient = onnx_derivative(
            lm.model,
            weights=weights,
            inputs=[],
            options=DerivativeOptions.Loss,
            loss=lm.loss,
            label=lm.label,
            backend=backend,
        )
        self.features, self.label, self.weights = lm.features[0], lm.label, weights
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.grad = ort.InferenceSession(
            gradient.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        self.grad_outputs = [o.name for o in gradient.graph.output]
        self.predict_session = ort.InferenceSession(
            weights_as_inputs(onx, weights).SerializeToString(), providers=["CPUExecutionProvider"]
        )
        init = {
            i.name: numpy_helper.to_array(i) for i in onx.graph.initializer if i.name in weights
        }
        self.initial = init
        self.updates = {}
        for name, value in init.items():
            shapes = {"X1": list(value.shape), "X2": list(value.shape), "G": list(value.shape)}
            update = function_onnx_graph("axpyw2", target_opset=15, input_shapes=shapes)
            self.updates[name] = ort.InferenceSession(
                update.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )

    def fit(self, X, y, epochs: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        y = y.reshape((-1, 1))
        values = {k: ort.OrtValue.ortvalue_from_numpy(v.copy()) for k, v in self.initial.items()}
        velocity = {
            k: ort.OrtValue.ortvalue_from_numpy(np.zeros_like(v)) for k, v in self.initial.items()
        }
        beta = ort.OrtValue.ortvalue_from_numpy(np.array([MOMENTUM], np.float32))
        t = 0
        for _ in range(epochs):
            lr = optimizer().learning_rate_at(t)
            alpha = ort.OrtValue.ortvalue_from_numpy(np.array([-lr], np.float32))
            order = rng.permutation(len(X))
            for start in range(0, len(X), BATCH_SIZE):
                rows = order[start : start + BATCH_SIZE]
                binding = self.grad.io_binding()
                xb = ort.OrtValue.ortvalue_from_numpy(X[rows])
                yb = ort.OrtValue.ortvalue_from_numpy(y[rows])
                binding.bind_ortvalue_input(self.features, xb)
                binding.bind_ortvalue_input(self.label, yb)
                for name in self.weights:
                    binding.bind_ortvalue_input(name, values[name])
                for name in self.grad_outputs:
                    binding.bind_output(name, "cpu")
                self.grad.run_with_iobinding(binding)
                grads = dict(zip(self.grad_outputs, binding.get_outputs()))
                for name in self.weights:
                    update = self.updates[name].io_binding()
                    update.bind_ortvalue_input("X1", grads[f"{name}_grad"])
                    update.bind_ortvalue_input("X2", values[name])
                    update.bind_ortvalue_input("G", velocity[name])
                    update.bind_ortvalue_input("alpha", alpha)
                    update.bind_ortvalue_input("beta", beta)
                    update.bind_output("Y", "cpu")
                    update.bind_output("Z", "cpu")
                    self.updates[name].run_with_iobinding(update)
                    values[name], velocity[name] = update.get_outputs()
            t += len(X)
        self.values = values
        return self

    def predict(self, X):
        feeds = {self.features: X, **{k: v.numpy().copy() for k, v in self.values.items()}}
        return self.predict_session.run(None, feeds)[0]


def bench_per_tensor(onx, epochs, backend, threads, X, y, X_test, y_test):
    baseline = PerTensorBaseline(onx, backend, threads)
    seconds, _ = timed(lambda: baseline.fit(X, y, epochs))
    return seconds, r2_score(y_test, baseline.predict(X_test).ravel())


class EpochLoop:
    """A whole epoch in one graph: an ONNX ``Loop`` over the batches around the fused step
    (per-weight layout, the data on the device, the batches as rows of an index matrix).
    Compared with the runner on the same per-weight step, it measures whether one
    ``InferenceSession.run`` an epoch beats one a batch."""

    def __init__(self, onx, backend: str, threads: int | None, n_rows: int):
        self.step = make_train_step(
            onx, learning_rate=optimizer(), backend=backend, layout="per_weight"
        )
        self.batches = n_rows // BATCH_SIZE
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(
            self._model().SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        self.runner_step = TrainingRunner(
            self.step, check_device("cpu"), self._initial(onx), None, options
        )

    def _initial(self, onx):
        inits = {i.name: numpy_helper.to_array(i) for i in onx.graph.initializer}
        return {w: inits[w] for w in self.step.weights}

    def _model(self):
        step = self.step
        indexed = with_batch_indices(step, "batch_indices")
        graph = indexed.graph
        carried = [*step.weights, *step.state]
        typed = {i.name: i for i in graph.input}
        body_inputs = [
            helper.make_tensor_value_info("iteration", TensorProto.INT64, []),
            helper.make_tensor_value_info("condition", TensorProto.BOOL, []),
            *[typed[name] for name in carried],
        ]
        outputs = {o.name: o for o in graph.output}
        body_outputs = [
            helper.make_tensor_value_info("condition_out", TensorProto.BOOL, []),
            *[outputs[n] for n in (*step.new_weights, *step.new_state)],
            outputs[step.loss],
        ]
        nodes = [
            helper.make_node("Identity", ["condition"], ["condition_out"]),
            helper.make_node("Gather", ["batches", "iteration"], ["batch_indices"], axis=0),
            *graph.node,
        ]
        body = helper.make_graph(nodes, "epoch_body", body_inputs, body_outputs, graph.initializer)
        outer_inputs = [typed[n] for n in (*step.data_inputs, step.learning_rate)]
        outer_inputs.append(
            helper.make_tensor_value_info("batches", TensorProto.INT64, [None, BATCH_SIZE])
        )
        outer_inputs.append(helper.make_tensor_value_info("trips", TensorProto.INT64, []))
        for name in carried:
            info = onnx.ValueInfoProto()
            info.CopyFrom(typed[name])
            info.name = f"{name}_in"
            outer_inputs.append(info)
        loop_outputs = [f"{n}_out" for n in carried] + ["losses"]
        loop = helper.make_node(
            "Loop", ["trips", "", *[f"{n}_in" for n in carried]], loop_outputs, body=body
        )
        outer_outputs = []
        for name in carried:
            info = onnx.ValueInfoProto()
            info.CopyFrom(typed[name])
            info.name = f"{name}_out"
            outer_outputs.append(info)
        outer_outputs.append(helper.make_tensor_value_info("losses", TensorProto.FLOAT, [None]))
        model = helper.make_model(
            helper.make_graph([loop], "epoch", outer_inputs, outer_outputs),
            opset_imports=indexed.opset_import,
            ir_version=indexed.ir_version,
        )
        onnx.checker.check_model(model)
        return model

    def fit_loop(self, X, y, epochs: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        data = [X, y.reshape((-1, 1))]
        values = {**self.runner_step.get_weights(), **self.step.initial_state()}
        # an OrtValue made from a numpy array shares its memory: keep the arrays alive
        arrays = [{k: v.copy() for k, v in values.items()} for _ in range(2)]
        sets = [{k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in a.items()} for a in arrays]
        lr = np.zeros((), np.float32)
        order = np.zeros((self.batches, BATCH_SIZE), np.int64)
        trips = np.array(self.batches, np.int64)
        fixed = {
            **dict(zip(self.step.data_inputs, data)),
            self.step.learning_rate: lr,
            "batches": order,
            "trips": trips,
        }
        fixed_values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in fixed.items()}
        bindings = []
        for parity in (0, 1):
            binding = self.session.io_binding()
            for name, value in fixed_values.items():
                binding.bind_ortvalue_input(name, value)
            for name in values:
                binding.bind_ortvalue_input(f"{name}_in", sets[parity][name])
                binding.bind_ortvalue_output(f"{name}_out", sets[1 - parity][name])
            binding.bind_output("losses", "cpu")
            bindings.append(binding)
        t = 0
        for epoch in range(epochs):
            lr[...] = optimizer().learning_rate_at(t)
            order[:] = rng.permutation(len(X))[: order.size].reshape(order.shape)
            self.session.run_with_iobinding(bindings[epoch % 2])
            t += len(X)
        self.weights = {w: arrays[epochs % 2][w].copy() for w in self.step.weights}
        return self

    def fit_runner(self, X, y, epochs: int, seed: int = 0):
        loader = OrtDataLoader(X, y.reshape((-1, 1)), batch_size=BATCH_SIZE, random_state=seed)
        t = 0
        for _ in range(epochs):
            self.runner_step.run_epoch(loader, optimizer().learning_rate_at(t))
            t += len(X)
        return self


def bench_epoch_loop(onx, epochs, backend, threads, X, y, X_test, y_test):
    """(seconds with a Loop an epoch, seconds with a run a batch), same per-weight step."""
    n_rows = (len(X) // BATCH_SIZE) * BATCH_SIZE
    X, y = X[:n_rows], y[:n_rows]
    looped = EpochLoop(onx, backend, threads, n_rows)
    loop_seconds, _ = timed(lambda: looped.fit_loop(X, y, epochs))
    runner_seconds, _ = timed(lambda: looped.fit_runner(X, y, epochs))
    return loop_seconds, runner_seconds


def bench_torch(skl_init, epochs, threads, X, y, X_test, y_test):
    try:
        import torch
    except ImportError:
        return None
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    layers = []
    for i, (coef, intercept) in enumerate(zip(skl_init.coefs_, skl_init.intercepts_)):
        linear = torch.nn.Linear(*coef.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(coef.T.astype(np.float32)))
            linear.bias.copy_(torch.from_numpy(intercept.astype(np.float32)))
        layers.append(linear)
        if i < len(skl_init.coefs_) - 1:
            layers.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*layers)
    sgd = torch.optim.SGD(net.parameters(), lr=SKL_LR / 2, momentum=MOMENTUM, nesterov=True)
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y.reshape((-1, 1)))
    schedule = optimizer()
    generator = torch.Generator().manual_seed(0)

    def fit():
        t = 0
        for _ in range(epochs):
            for group in sgd.param_groups:
                group["lr"] = schedule.learning_rate_at(t)
            order = torch.randperm(len(Xt), generator=generator)
            for start in range(0, len(Xt), BATCH_SIZE):
                rows = order[start : start + BATCH_SIZE]
                sgd.zero_grad()
                loss = ((net(Xt[rows]) - yt[rows]) ** 2).mean()
                loss.backward()
                sgd.step()
            t += len(Xt)

    seconds, _ = timed(fit)
    with torch.no_grad():
        prediction = net(torch.from_numpy(X_test)).numpy().ravel()
    return seconds, r2_score(y_test, prediction)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--backend", default="onnx", choices=["onnx", "ort"])
    parser.add_argument("--repeat", type=int, default=1, help="keep the best of n runs")
    parser.add_argument(
        "--loop", action="store_true", help="also time a whole epoch in one ONNX Loop"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="threads of every framework (0: their default)"
    )
    args = parser.parse_args(argv)
    threads = args.threads or None
    # limited from the start: OpenBLAS threads that ran before the limits (scikit-learn's
    # initial fit) keep spinning and made the first timed scikit-learn fit 30 % slower,
    # with CPU time above wall-clock time
    with threadpool_limits(threads) if threads else contextlib.nullcontext():
        _run(args, threads)


def _run(args, threads) -> None:
    X_train, X_test, y_train, y_test = data()
    skl = sklearn_model(args.epochs, X_train, y_train)
    onx = to_onnx(skl, X_train[:1], target_opset=15)
    runs = {
        "scikit-learn": lambda: bench_sklearn(skl, X_train, y_train, X_test, y_test),
        "onnxgrad": lambda: bench_onnxgrad(
            onx, args.epochs, args.backend, threads, X_train, y_train, X_test, y_test
        ),
        "per-tensor baseline": lambda: bench_per_tensor(
            onx, args.epochs, args.backend, threads, X_train, y_train, X_test, y_test
        ),
        "torch eager": lambda: bench_torch(
            skl, args.epochs, threads, X_train, y_train, X_test, y_test
        ),
    }
    results = {}
    measures_by_name = {name: [] for name in runs}
    cpu_by_name = {name: [] for name in runs}
    for _ in range(args.repeat):
        for name, run in runs.items():
            measures_by_name[name].append(run())
            cpu_by_name[name].append(CPU_SECONDS[-1] if CPU_SECONDS else None)
    for name, measures in measures_by_name.items():
        if measures[0] is None:
            print(f"{name:>20}: not installed")
            continue
        results[name] = (*min(measures), min(cpu_by_name[name]))
    reference, cpu_reference = results["scikit-learn"][0], results["scikit-learn"][2]
    print(f"epochs={args.epochs} batch={BATCH_SIZE} backend={args.backend} threads={threads}")
    print(f"{'':>20}  {'seconds':>8}  {'x sklearn':>9}  {'cpu s':>7}  {'x sklearn':>9}  {'R2':>7}")
    for name, (seconds, r2, cpu) in results.items():
        print(
            f"{name:>20}  {seconds:8.3f}  {seconds / reference:9.3f}  {cpu:7.3f}  "
            f"{cpu / cpu_reference:9.3f}  {r2:7.4f}"
        )
    if args.loop:
        timings = [
            bench_epoch_loop(onx, args.epochs, args.backend, threads, X_train, y_train, None, None)
            for _ in range(args.repeat)
        ]
        loop_seconds = min(t[0] for t in timings)
        runner_seconds = min(t[1] for t in timings)
        print(
            f"per-weight step, one Loop run an epoch: {loop_seconds:.3f} s, one run a batch: "
            f"{runner_seconds:.3f} s ({loop_seconds / runner_seconds:.2f}x)"
        )


if __name__ == "__main__":
    main()
