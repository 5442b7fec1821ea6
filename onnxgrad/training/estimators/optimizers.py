"""scikit-learn style estimators training an ONNX model with fused train steps.

* :class:`OrtGradientForwardBackwardOptimizer`: the model predicts; the loss is a separate
  object (:mod:`onnxgrad.training.step.losses`) composed with it.
* :class:`OrtGradientOptimizer`: the model already ends in a loss output (see
  :func:`onnxgrad.add_loss_output`).

Both follow scikit-learn's conventions (parameters stored unchanged by the constructor,
``get_params``/``set_params``, fitted attributes ending with ``_``) without importing it.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import ModelProto

from onnxgrad._onnx_utils import copy_message, first_float_output, np_dtype
from onnxgrad._progress import epoch_progress
from onnxgrad.derivative.api import graph_inputs
from onnxgrad.derivative.recompute import TRAINING_RECOMPUTE
from onnxgrad.exceptions import ConvergenceError, ConvergenceWarning, not_fitted_error
from onnxgrad.graph import select_model_inputs_outputs
from onnxgrad.graph._scores import n_classes_of
from onnxgrad.graph.loss_table import PROBABILITIES
from onnxgrad.normalize import normalized_model
from onnxgrad.normalize.trained import trained_model
from onnxgrad.training.estimators._stopping import NoImprovement, validation_rows
from onnxgrad.training.estimators.compat import save_loss_gradient
from onnxgrad.training.estimators.invariants import check_still_a_distribution, probabilities_error
from onnxgrad.training.running.batch_axis import free_batch_axis, symbolic_batch_axis
from onnxgrad.training.running.data import OrtDataLoader
from onnxgrad.training.running.devices import check_device
from onnxgrad.training.running.distributed import agreed, data_parallel, make_runner, rank
from onnxgrad.training.running.distributed import world_size as _world_size
from onnxgrad.training.running.feeds import (
    FixedFeeds,
    as_rows,
    checked_rows,
    data_loader,
    flat,
    split_inputs,
)
from onnxgrad.training.running.runner import GraphRunner
from onnxgrad.training.running.session_options import training_session_options
from onnxgrad.training.step._inputs import (
    check_batch_axis,
    check_labels,
    check_sample_weight,
    input_info,
    tensor_dims,
)
from onnxgrad.training.step._params import EstimatorMixin, ResolvedParam
from onnxgrad.training.step.composition import (
    LossModel,
    TrainStep,
    make_eval_step,
    make_predict_model,
    make_train_step,
)
from onnxgrad.training.step.learning_rate import BaseLearningRate, select_learning_rate
from onnxgrad.training.step.losses import BaseLearningLoss, select_learning_loss
from onnxgrad.training.step.master_weights import as_master, as_stored
from onnxgrad.training.step.penalties import (
    BaseLearningPenalty,
    NoLearningPenalty,
    select_learning_penalty,
)
from onnxgrad.training.step.split_step import make_split_step
from onnxgrad.training.step.train_step import default_layout

#: parameters the composed graphs do not depend on
_RUN_PARAMS = frozenset(
    [
        "max_iter",
        "batch_size",
        "device",
        "warm_start",
        "verbose",
        "validation_every",
        "exc",
        "random_state",
        "early_stopping",
        "validation_fraction",
        "n_iter_no_change",
        "tol",
        "enable_logging",
    ]
)

#: the logger of ``enable_logging=True``: one INFO line an epoch
logger = logging.getLogger("onnxgrad.training")

#: fitted attributes holding onnxruntime sessions: dropped by pickling, rebuilt on first use
_SESSIONS = ("runner_", "evaluator_", "validator_", "predictor_", "graphs_")


@dataclass
class _Graphs:
    """What an estimator runs for one configuration of its graph parameters.

    Built in the order a fit needs them: the objects the parameters name and the graphs
    without derivative first (the data is checked against :attr:`evaluation`), the train
    steps, whose derivative is the costly part, last (:meth:`BaseOrtOptimizer._train_step`).
    """

    learning_rate: BaseLearningRate
    penalty: BaseLearningPenalty
    loss: BaseLearningLoss | None
    #: the loss of a batch: score and losses
    evaluation: LossModel
    prediction: ModelProto | None
    #: keyword arguments of :func:`make_train_step` that name the loss and its inputs
    step_options: dict[str, Any]
    #: train steps by layout
    steps: dict[str, TrainStep] = field(default_factory=dict)
    #: the loss plus the penalty, the objective the train steps minimise and report:
    #: validation losses (:attr:`evaluation` itself without penalty)
    objective: LossModel | None = None
    #: the number of classes of a classification loss (labels in ``0..n_classes-1``)
    n_classes: int | None = None
    #: the model output the loss compares with the labels (None: unknown)
    output: str | None = None


class BaseOrtOptimizer(EstimatorMixin):
    """The training loop shared by the estimators (see the subclasses for parameters).

    A fit checks its parameters, then its data, before it builds the train step; fitted
    attributes change only once the new runners exist, so a fit that fails early leaves
    the estimator as it was.

    ``learning_rate``, ``learning_penalty`` (and ``learning_loss``) read back as objects:
    ``'SGD'`` as ``LearningRateSGD()``, ``None`` as ``NoLearningPenalty()``, and after a fit
    the objects it trained with (``learning_rate_``...), as onnxcustom's estimators did;
    ``get_params`` and ``clone`` keep the values as given and a fit never changes them.
    """

    learning_rate = ResolvedParam(BaseLearningRate, select_learning_rate)
    learning_penalty = ResolvedParam(BaseLearningPenalty, select_learning_penalty)

    # -- to define in subclasses ----------------------------------------------------------
    def _build_graphs(self, model: ModelProto, with_weight: bool, fixed=()) -> _Graphs:
        """Everything but the train steps; ``fixed``: the inputs fed as is."""
        raise NotImplementedError

    # -- fitting ----------------------------------------------------------------------------
    def fit(self, X, y, sample_weight=None, X_val=None, y_val=None, use_numpy=False, feeds=None):
        """Train for ``max_iter`` epochs of shuffled batches of ``batch_size`` observations.

        ``use_numpy`` is accepted for the seeds' code and changes nothing: the seeds chose
        between copying each batch from numpy and binding device tensors; onnxgrad always
        binds the batches of the data set held on the device (the same numbers, faster).

        ``X`` of any real dtype is cast to the float type the model input declares (float64
        to float32 rounds to the nearest float32, as ``numpy.astype``).

        ``early_stopping=True`` holds out ``validation_fraction`` of the data (stratified
        for a classifier) unless ``X_val, y_val`` are given, scores it after every epoch
        (:meth:`score`) into :attr:`validation_scores_`, and stops as scikit-learn's MLP
        does: once the score has not exceeded the best one by ``tol`` for more than
        ``n_iter_no_change`` epochs in a row; the weights of the best epoch are kept
        (:attr:`best_validation_score_`). Without it, every epoch runs (the seeds' loop).

        Both loss curves are the training objective, the loss of a batch plus the penalty,
        averaged over batches of ``batch_size`` rows (weighted by their rows for the
        reduction ``'mean'``, so the mean over every row; each batch once for ``'sum'``, so
        the sum over a batch), as :meth:`objective`:

        * :attr:`train_losses_`: per epoch, the average over its batches of their objective
          with the weights before their update;
        * :attr:`validation_losses_` (given ``X_val, y_val``): the objective on the
          validation data (its consecutive batches) with the weights at the end of an epoch, every
          ``validation_every`` epochs (a fraction of ``max_iter`` below 1, a number of
          epochs otherwise, ``0`` never), counted since the last cold start so that short
          warm starts validate too.

        :meth:`score` and :meth:`losses` leave the penalty out, as scikit-learn's scores do.
        Raises :class:`~onnxgrad.ConvergenceError` (``exc=True``, else a warning) when a
        loss or a weight stops being finite; the estimator then keeps the weights of the
        last epoch that ended finite.

        A model with several inputs takes ``X`` as a dict ``{input: array}`` of per-row
        arrays and/or ``feeds={input: array}``: a feed with one row per observation is
        batched with ``X``, any other (a sample rate, an initial state) is fed as is with
        every batch and kept for :meth:`predict` and :meth:`score`, which take the same
        arguments (:mod:`onnxgrad.training.running.feeds`).
        """
        return self._fit(
            X, y, sample_weight, X_val, y_val, self.max_iter, self.warm_start, feeds=feeds
        )

    def initialize(self, X, y, sample_weight=None, feeds=None):
        """Build the graphs and sessions for ``(X, y)`` and start from the model's weights
        without training: :meth:`score` is then the starting loss, and :meth:`partial_fit`
        (or :meth:`fit` with ``warm_start=True``) trains from there."""
        return self._fit(X, y, sample_weight, None, None, 0, False, stopping=False, feeds=feeds)

    def partial_fit(self, X, y, sample_weight=None, feeds=None):
        """One epoch over ``(X, y)`` from the current weights, optimizer state and schedule
        (the first call starts from the model); no early stopping, as scikit-learn."""
        return self._fit(X, y, sample_weight, None, None, 1, True, stopping=False, feeds=feeds)

    def _fit(self, X, y, sample_weight, X_val, y_val, epochs, warm, stopping=None, feeds=None):
        self._check_params()
        stopping = self.early_stopping if stopping is None else stopping
        model = normalized_model(self.model_onnx)
        device = check_device(self.device)
        kept = self.runner_.feeds.arrays if warm and self.__sklearn_is_fitted__() else None
        per_row, fixed = self._split_inputs(model, X, feeds, defaults=kept)
        model = free_batch_axis(model, per_row, fixed)
        self._per_row_inputs = tuple(per_row)
        X = as_rows(per_row)
        graphs = self._graphs_for(model, sample_weight is not None, tuple(fixed))
        fixed = FixedFeeds(graphs.evaluation, device, fixed).arrays
        data = self._training_data(graphs, X, y, sample_weight)
        validation = self._validation_data(graphs, X_val, y_val)
        if stopping and validation is None:
            data, validation = self._held_out(data)
        step = self._train_step(model, graphs, device)
        if not (warm and self.__sklearn_is_fitted__()):
            self._start(model, graphs, step, device)
        elif self.runner_.step is not step or self.device_ != device:
            self._switch_graphs(model, graphs, step, device)
        self.runner_.set_feeds(fixed)
        X, y, *weight = data
        size = self.batch_size * _world_size()  # per rank, as DistributedDataParallel
        loader = data_loader(
            X, y, *weight, batch_size=size, device=device, random_state=self._shuffling
        )
        if self.n_iter_ == 0:
            self._check_probabilities(X)
        before = probabilities_error(self, X)
        self._train(loader, validation, epochs, stopping)
        check_still_a_distribution(self, X, before)
        return self

    def _output_values(self, X, feeds=None) -> np.ndarray:
        """The output the loss is put on, for the features ``X`` (and ``feeds``, as
        :meth:`fit`), as float64 ``[N, -1]``."""
        predictor = self.predictor_
        per_row, fixed = self._split_inputs(None, X, feeds, fitted=True)
        X = checked_rows(predictor.model, predictor.data_inputs, as_rows(per_row))
        names = [o.name for o in predictor.model.graph.output]
        values = predictor.run(flat([X]), self._bound(fixed))[names.index(self.graphs_.output)]
        return np.asarray(values, dtype=np.float64).reshape(len(X), -1)

    def _check_probabilities(self, X) -> None:
        """Warn when a probabilities loss meets an output whose first rows are not
        probabilities (outside [0, 1], or several columns not summing to 1)."""
        loss = self.graphs_.loss
        if loss is None or loss.spec.prediction != PROBABILITIES or self.graphs_.output is None:
            return
        values = self._output_values(X[:256])
        in_range = ((values >= 0) & (values <= 1)).all()
        sums_to_one = values.shape[1] == 1 or np.allclose(values.sum(axis=1), 1, atol=1e-3)
        if not (in_range and sums_to_one):
            logits = "log_logits" if values.shape[1] == 1 else "cross_entropy_logits"
            warnings.warn(
                f"loss {loss.loss_name!r} expects probabilities but output "
                f"{self.graphs_.output!r} holds values outside [0, 1] or rows that do not sum "
                f"to 1 (first row: {np.round(values[0], 4).tolist()}): if it holds logits, "
                f"use learning_loss={logits!r}",
                UserWarning,
                stacklevel=4,
            )

    def _held_out(self, data: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """``(training, validation)``: ``validation_fraction`` of the rows drawn with
        ``random_state`` (per class for a classifier); the validation rows lose their
        sample weights, as in scikit-learn."""
        X, y = data[0], data[1]
        rng = np.random.default_rng(self.random_state)
        held = validation_rows(y if self._stratify else None, len(X), self.validation_fraction, rng)
        kept = np.setdiff1d(np.arange(len(X)), held)
        return [a[kept] for a in data], [X[held], y[held]]

    #: whether the held-out validation rows are drawn per class
    _stratify = False

    def _check_params(self) -> None:
        for name in ("max_iter", "batch_size", "n_iter_no_change"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        every = self.validation_every
        if (
            isinstance(every, bool)
            or not isinstance(every, (int, float, np.integer, np.floating))
            or not 0 <= every < np.inf
        ):
            raise ValueError(f"validation_every must be a finite number >= 0, got {every!r}")
        if not 0 < self.validation_fraction < 1:
            raise ValueError(
                f"validation_fraction must be in (0, 1), got {self.validation_fraction!r}"
            )
        if not (isinstance(self.tol, (int, float, np.number)) and self.tol >= 0):
            raise ValueError(f"tol must be a number >= 0, got {self.tol!r}")
        threads = self.intra_op_num_threads
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, (int, np.integer))
        ):
            raise TypeError(f"intra_op_num_threads must be an integer, got {threads!r}")

    def _split_inputs(self, model: ModelProto, X, feeds, fitted: bool = False, defaults=None):
        """``(per_row, fixed)`` arrays by input name (see :func:`split_inputs`); ``fitted``:
        the inputs of the fitted graphs, the fixed feeds of the fit by default."""
        if fitted:
            evaluation = self.graphs_.evaluation
            model, data = evaluation.model, {*evaluation.features, *evaluation.fixed}
            names = [n for n in graph_inputs(model) if n in data]
            defaults = self.runner_.feeds.arrays
        else:
            names = [n for n in graph_inputs(model) if n not in self._not_features()]
        return split_inputs(model, names, X, feeds, defaults)

    def _not_features(self) -> set[str]:
        """The model inputs that are neither features nor fixed feeds."""
        return set()

    def _bound(self, fixed=None) -> dict:
        """The weights, and the fixed feeds of the fit or ``fixed``, as bound ``OrtValue``."""
        feeds = self.runner_.feeds
        values = {**self.runner_.current.values, **feeds.values}
        fixed = {n: a for n, a in (fixed or {}).items() if a is not feeds.arrays.get(n)}
        if fixed:
            given = {**feeds.arrays, **fixed}
            values.update(FixedFeeds(self.graphs_.evaluation, self.device_, given).values)
        return values

    def _graphs_for(self, model: ModelProto, with_weight: bool, fixed=()) -> _Graphs:
        """The graphs of the current parameters, rebuilt only when a parameter they depend
        on changed (a warm start keeps them and the runner)."""
        params = self.get_params(deep=True)
        graph_params = {
            k: v for k, v in params.items() if k not in _RUN_PARAMS and k != "model_onnx"
        }
        key = (with_weight, repr(graph_params), fixed)
        cached = getattr(self, "_graphs_cache", None)
        if cached is None or cached[0] != key or cached[1] is not self.model_onnx:
            graphs = self._build_graphs(model, with_weight, fixed)
            graphs.objective = graphs.evaluation
            if not isinstance(graphs.penalty, NoLearningPenalty):
                graphs.objective = make_eval_step.normalized(
                    copy_message(model),
                    graphs.evaluation.weights,
                    penalty=graphs.penalty,
                    **graphs.step_options,
                )
            self._graphs_cache = (key, self.model_onnx, graphs)
        return self._graphs_cache[2]

    def _train_step(self, model: ModelProto, graphs: _Graphs, device) -> TrainStep:
        """The train step of ``graphs`` for ``device``, built on first use.

        See :func:`~onnxgrad.training.step.train_step.default_layout`. On several ranks the step
        is split around the gradients' all-reduce
        (:mod:`onnxgrad.training.running.distributed`), its update on all weights end to end.
        """
        scaling = {"recompute": self.recompute}
        if data_parallel():
            key, build, layout = "split", make_split_step, "flat"
        else:
            layout = default_layout(model, graphs.evaluation.weights, device.kind)
            key, build = layout, make_train_step
            scaling["loss_scale"] = self.loss_scale
        if key not in graphs.steps:
            graphs.steps[key] = build.normalized(
                copy_message(model),
                graphs.evaluation.weights,
                learning_rate=graphs.learning_rate,
                penalty=graphs.penalty,
                backend=self.backend,
                layout=layout,
                **graphs.step_options,
                **scaling,
            )
        return graphs.steps[key]

    def _training_data(self, graphs: _Graphs, X, y, sample_weight) -> list[np.ndarray]:
        evaluation = graphs.evaluation
        check_batch_axis(evaluation.model, evaluation.data_inputs)
        return self._checked_data(graphs, X, y, sample_weight)

    def _validation_data(self, graphs: _Graphs, X_val, y_val):
        if X_val is None and y_val is None:
            return None
        if X_val is None or y_val is None:
            raise ValueError("give both X_val and y_val, or neither")
        return self._checked_data(graphs, X_val, y_val, None, "_val")

    def _start(self, model: ModelProto, graphs: _Graphs, step: TrainStep, device) -> None:
        weights = _initializers(model, step.weights)
        if self._runners_reusable(graphs, step, device):
            self.runner_.set_values({**weights, **step.initial_state()})
        else:
            self._install(graphs, device, self._make_runners(graphs, step, device, weights, None))
            self._runners_key = self._runners_key_for(device)
        self._shuffling = np.random.default_rng(self.random_state)
        self.train_losses_: list[float] = []
        self.validation_losses_: list[float] = []
        self.validation_scores_: list[float] = []
        self.n_iter_ = 0
        self.t_ = 0

    def _runners_key_for(self, device) -> tuple:
        return (str(device), self.intra_op_num_threads)

    def _runners_reusable(self, graphs: _Graphs, step: TrainStep, device) -> bool:
        """Whether a cold start may keep the sessions of the last one (same train step,
        device and threads): only the weights and optimizer state start again."""
        return (
            getattr(self, "runner_", None) is not None
            and self.graphs_ is graphs
            and self.runner_.step is step
            and getattr(self, "_runners_key", None) == self._runners_key_for(device)
        )

    def _switch_graphs(self, model: ModelProto, graphs: _Graphs, step: TrainStep, device) -> None:
        """Continue with new graphs from the current weights and optimizer state.

        The state tensors the new optimizer shares with the old one (same name, e.g. Adam's
        moments when only ``eta0`` changed) carry over, the others start fresh (SGD to
        Adam: zero moments, step 0); a weight trained only now starts from the model.
        """
        old = self.runner_
        named = step.state_by_weight(step.initial_state())
        kept = old.step.state_by_weight(old.get_state())
        named.update({name: value for name, value in kept.items() if name in named})
        current = old.get_weights()
        fresh = [w for w in step.weights if w not in current]
        weights = {**_initializers(model, fresh), **current}
        weights = {w: weights[w] for w in step.weights}
        state = step.state_inputs(named)
        self._install(graphs, device, self._make_runners(graphs, step, device, weights, state))
        self._runners_key = self._runners_key_for(device)

    def _session_options(self) -> ort.SessionOptions:
        return training_session_options(self.intra_op_num_threads)

    def _make_runners(self, graphs: _Graphs, step: TrainStep, device, weights, state) -> tuple:
        """``(runner, evaluator, validator, predictor)``, nothing assigned yet."""
        options = self._session_options()
        runner = make_runner(step, device, weights, state, options)
        evaluation, objective = graphs.evaluation, graphs.objective
        evaluator = GraphRunner(evaluation.model, evaluation.data_inputs, device, options)
        validator = evaluator
        if objective is not evaluation:
            validator = GraphRunner(objective.model, objective.data_inputs, device, options)
        predictor = None
        if graphs.prediction is not None:
            trained = set(step.weights)
            inputs = graphs.prediction.graph.input
            features = [
                i.name for i in inputs if i.name not in trained and i.name not in evaluation.fixed
            ]
            predictor = GraphRunner(graphs.prediction, features, device, options)
        return runner, evaluator, validator, predictor

    def _install(self, graphs: _Graphs, device, runners: tuple) -> None:
        """Make ``graphs`` and their runners the estimator's fitted state."""
        self.runner_, self.evaluator_, self.validator_, self.predictor_ = runners
        self.device_ = device
        self.graphs_ = graphs
        self.learning_rate_ = graphs.learning_rate
        self.learning_penalty_ = graphs.penalty
        BaseOrtOptimizer.learning_rate.use(self, graphs.learning_rate)
        BaseOrtOptimizer.learning_penalty.use(self, graphs.penalty)
        if graphs.loss is not None:
            self.learning_loss_ = graphs.loss
            OrtGradientForwardBackwardOptimizer.learning_loss.use(self, graphs.loss)

    def _train(self, loader: OrtDataLoader, validation, n_epochs: int, stopping: bool) -> None:
        every = self._validation_period()
        lr = self.learning_rate_
        good = self._snapshot()
        stopper = NoImprovement(self.tol, self.n_iter_no_change) if stopping else None
        best = None
        epochs = range(n_epochs)
        bar = epoch_progress(epochs) if self.verbose and n_epochs and rank() == 0 else None
        sizes = _batch_sizes(len(loader), loader.batch_size)
        for _ in bar if bar is not None else epochs:
            lr.update_learning_rate(self.t_)
            losses = self.runner_.run_epoch(loader, lr.value)
            snapshot = self._snapshot()
            weights = (snapshot[w] for w in self.runner_.step.weights)
            if not (np.isfinite(losses).all() and all(np.isfinite(w).all() for w in weights)):
                self._diverged(good, losses)
                return
            good = snapshot
            self.t_ += len(loader)
            self.n_iter_ += 1
            self.train_losses_.append(self._epoch_loss(losses, sizes))
            if getattr(self, "enable_logging", False):
                logger.info(
                    "epoch %d loss %g lr %g", self.n_iter_, self.train_losses_[-1], lr.value
                )
            if validation is not None and every and self.n_iter_ % every == 0:
                self.validation_losses_.append(agreed(self._batched_objective(validation)))
            for callback in self.__dict__.get("epoch_callbacks", ()):
                callback(self)
            if bar is not None:
                bar.set_postfix(loss=f"{self.train_losses_[-1]:.4g}", lr=f"{lr.value:.3g}")
            if stopper is not None:
                self.validation_scores_.append(agreed(self._validation_score(validation)))
                if stopper.update(self.validation_scores_[-1]):
                    best = snapshot
                if stopper.should_stop:
                    break
        if stopper is not None:
            self.best_validation_score_ = stopper.best
            if best is not None:
                self.runner_.set_values(best)
        self.trained_coef_ = self.runner_.get_weights()

    def _epoch_loss(self, batch_losses: np.ndarray, sizes: np.ndarray) -> float:
        """The batches' objectives averaged: weighted by their rows for ``'mean'``, each
        batch once for ``'sum'`` (a batch's sum: a smaller last batch weighs as much)."""
        loss = self.graphs_.loss
        summed = loss is not None and loss.reduction == "sum"
        return float(np.average(batch_losses, weights=None if summed else sizes))

    def _batched_objective(self, arrays: list[np.ndarray], fixed=None) -> float:
        """The objective of ``arrays`` on the scale of :attr:`train_losses_`: consecutive
        batches of ``batch_size`` rows, averaged by :meth:`_epoch_loss`."""
        n = len(arrays[0])
        sizes = _batch_sizes(n, self.batch_size * _world_size())
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        losses = [
            self._evaluate([a[i : i + k] for a in arrays], self.validator_, fixed)
            for i, k in zip(starts, sizes)
        ]
        return self._epoch_loss(np.array(losses), sizes)

    def objective(self, X, y, sample_weight=None, feeds=None) -> float:
        """The training objective (loss plus penalty) on ``(X, y)`` with the current weights,
        on the scale of :attr:`train_losses_` and :attr:`validation_losses_`."""
        arrays, fixed = self._checked(X, y, sample_weight, feeds)
        return self._batched_objective(arrays, fixed)

    def _validation_score(self, arrays: list[np.ndarray]) -> float:
        """The score early stopping watches: minus the loss (penalty excepted)."""
        return -self._evaluate(arrays)

    def _validation_period(self) -> int:
        every = self.validation_every
        if every == 0:
            return 0
        if every < 1:
            return max(1, int(every * self.max_iter))
        return int(every)

    def _snapshot(self) -> dict[str, np.ndarray]:
        return {**self.runner_.get_weights(), **self.runner_.get_state()}

    def _diverged(self, good: dict[str, np.ndarray], losses: np.ndarray) -> None:
        self.runner_.set_values(good)
        self.trained_coef_ = self.runner_.get_weights()
        bad = np.flatnonzero(~np.isfinite(losses))
        where = f"batch {bad[0]}" if bad.size else "the weights after the last batch"
        message = (
            f"the training diverged at epoch {self.n_iter_ + 1} ({where} is not finite, "
            f"learning rate {self.learning_rate_.value:.3g}); the weights of the last "
            "finite epoch are kept: lower the learning rate"
        )
        if self.exc:
            raise ConvergenceError(message)
        # the caller of fit or partial_fit: (partial_)fit -> _fit -> _train -> _diverged
        warnings.warn(message, ConvergenceWarning, stacklevel=5)

    # -- evaluation -------------------------------------------------------------------------
    def __sklearn_is_fitted__(self) -> bool:
        return "runner_" in self.__dict__ or "_restore" in self.__dict__

    def _check_fitted(self) -> None:
        if not self.__sklearn_is_fitted__():
            raise not_fitted_error()(
                f"this {type(self).__name__} is not fitted yet: call fit first"
            )

    # -- pickling ---------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Everything but the onnxruntime sessions; a fitted estimator keeps its weights,
        optimizer state and schedule, and rebuilds its graphs and sessions on first use."""
        state = self.__dict__.copy()
        if "runner_" in state:
            runner = self.runner_
            state["_restore"] = {
                "weights": runner.get_weights(),
                "state": runner.get_state(),
                "with_weight": self._graphs_cache[0][0],
                "feeds": runner.feeds.arrays,
                "learning_rate": self.learning_rate_,
            }
        for name in (*_SESSIONS, "_graphs_cache"):
            state.pop(name, None)
        return state

    def __getattr__(self, name: str):
        if name in _SESSIONS and "_restore" in self.__dict__:
            self._rebuild()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _rebuild(self) -> None:
        restore = self.__dict__.pop("_restore")
        model = normalized_model(self.model_onnx)
        model = symbolic_batch_axis(model, self.__dict__.get("_per_row_inputs", ()))
        feeds = restore.get("feeds", {})
        graphs = self._graphs_for(model, restore["with_weight"], tuple(feeds))
        graphs.learning_rate = restore["learning_rate"]
        step = self._train_step(model, graphs, self.device_)
        runners = self._make_runners(
            graphs, step, self.device_, restore["weights"], restore["state"]
        )
        self._install(graphs, self.device_, runners)
        self.runner_.set_feeds(feeds)

    @staticmethod
    def _checked_data(graphs: _Graphs, X, y, sample_weight, suffix: str = "") -> list[np.ndarray]:
        """``[X, y]`` (and the sample weights when the graph takes some: ones by default)
        checked against the data inputs of the evaluation graph; class labels must lie in
        ``0..n_classes-1``."""
        evaluation = graphs.evaluation
        model = evaluation.model
        X = checked_rows(model, evaluation.features, X, f"X{suffix}")
        y = check_labels(
            model, evaluation.label, y, X.shape[0], f"y{suffix}", n_classes=graphs.n_classes
        )
        arrays = [X, y]
        if evaluation.sample_weight is not None:
            weight = np.ones(X.shape[0]) if sample_weight is None else sample_weight
            arrays.append(check_sample_weight(model, evaluation.sample_weight, weight, len(X)))
        elif sample_weight is not None:
            raise ValueError("sample_weight is given but the model has no sample-weight input")
        return arrays

    def _evaluate(self, arrays, evaluator: GraphRunner | None = None, fixed=None) -> float:
        evaluator = evaluator or self.evaluator_
        return float(evaluator.run(flat(arrays), self._bound(fixed))[0])

    def _checked(self, X, y, sample_weight, feeds=None):
        """The checked data arrays and the fixed feeds of a call."""
        self._check_fitted()
        per_row, fixed = self._split_inputs(None, X, feeds, fitted=True)
        X = as_rows(per_row)
        return self._checked_data(self.graphs_, X, y, sample_weight), fixed

    def losses(self, X, y, sample_weight=None, feeds=None) -> np.ndarray:
        """The loss of each observation (the loss of a batch of that one row, penalty
        excepted)."""
        arrays, fixed = self._checked(X, y, sample_weight, feeds)
        return np.array(
            [
                self._evaluate([a[i : i + 1] for a in arrays], fixed=fixed)
                for i in range(len(arrays[0]))
            ]
        )

    def score(self, X, y, sample_weight=None, feeds=None) -> float:
        """The opposite of the training loss (penalty excepted) on ``(X, y)`` taken as one
        batch: greater is better, as in scikit-learn."""
        arrays, fixed = self._checked(X, y, sample_weight, feeds)
        return -self._evaluate(arrays, fixed=fixed)

    def predict(self, X, feeds=None) -> np.ndarray:
        """The first output of the model (the first besides the loss) with the current
        weights (``X`` and ``feeds`` as in :meth:`fit`)."""
        self._check_fitted()
        if self.predictor_ is None:
            raise ValueError("the model has no output besides the loss: nothing to predict")
        per_row, fixed = self._split_inputs(None, X, feeds, fitted=True)
        X = as_rows(per_row)
        X = checked_rows(self.predictor_.model, self.predictor_.data_inputs, X)
        return self.predictor_.run(flat([X]), self._bound(fixed))[0]

    # -- state ------------------------------------------------------------------------------
    def get_state(self) -> dict[str, np.ndarray]:
        """The current weights by name (numpy copies)."""
        self._check_fitted()
        return self.runner_.get_weights()

    def get_full_state(self) -> dict[str, np.ndarray]:
        """The current weights and optimizer state: ``<weight>_<state>`` (``_velocity``,
        ``_m``, ``_v``) and the shared ``step`` count."""
        self._check_fitted()
        step = self.runner_.step
        return {**self.runner_.get_weights(), **step.state_by_weight(self.runner_.get_state())}

    def set_state(self, state: dict[str, np.ndarray]) -> BaseOrtOptimizer:
        """Overwrite weights and optimizer state named as :meth:`get_full_state` names them."""
        self._check_fitted()
        step = self.runner_.step
        named = step.state_by_weight(self.runner_.get_state())
        unknown = sorted(set(state) - set(step.weights) - set(named))
        if unknown:
            raise ValueError(f"unknown weights or state {unknown}, see get_full_state()")
        weights = {k: v for k, v in state.items() if k in step.weights}
        named.update({k: v for k, v in state.items() if k not in step.weights})
        self.runner_.set_values({**weights, **step.state_inputs(named)})
        self.trained_coef_ = self.runner_.get_weights()
        return self

    def get_trained_onnx(self, model=None) -> ModelProto:
        """``model`` (default: ``model_onnx``) with the trained weights as initializers, in
        its own output format (a converted model keeps its ai.onnx.ml outputs, ZipMap
        included; see :func:`onnxgrad.lower_ml_operators`)."""
        self._check_fitted()
        base = self.model_onnx if model is None else model
        return trained_model(base, as_stored(base, self.runner_.get_weights()))

    def save_onnx_graph(self, folder: str | os.PathLike) -> dict[str, str]:
        """Save every graph the estimator runs into ``folder``; returns their paths by role."""
        self._check_fitted()
        os.makedirs(folder, exist_ok=True)
        models = {
            "train_step": self.runner_.step.model,
            "train_step_indexed": self.runner_.model,
            "evaluation": self.graphs_.evaluation.model,
            "prediction": self.graphs_.prediction,
        }
        paths = {}
        for role, proto in models.items():
            if proto is None:
                continue
            paths[role] = os.path.join(os.fspath(folder), f"{type(self).__name__}.{role}.onnx")
            onnx.save(proto, paths[role])
        return paths


class OrtGradientForwardBackwardOptimizer(BaseOrtOptimizer):
    """Trains a model that predicts, with a separate loss object.

    :param model_onnx: ModelProto or path; never modified
    :param weights_to_train: initializer names (default: every weight
        :func:`onnxgrad.get_train_initializer` finds)
    :param loss_output_name: name of the loss in the composed graphs
    :param max_iter: number of epochs
    :param batch_size: observations per batch
    :param learning_rate: a number (``eta0`` of SGD), ``'SGD'``, ``'Nesterov'``,
        ``'Momentum'``, ``'Adam'`` or an optimizer object
        (:mod:`~onnxgrad.training.step.learning_rate`)
    :param device: ``'cpu'``, ``'cuda'`` or ``'cuda:N'``
    :param warm_start: continue from the current weights, optimizer state and schedule
    :param verbose: show the loss and the learning rate at each epoch: a tqdm bar on a
        terminal (or in a notebook), one line per epoch on standard error elsewhere
    :param validation_every: see :meth:`fit`
    :param learning_loss: a name of the loss table (``'squared_error'``, ``'absolute_error'``,
        ``'elastic'``, ``'log'``, ``'log_logits'``, ``'cross_entropy'``,
        ``'cross_entropy_logits'`` or an alias, see :mod:`onnxgrad.graph.loss_table`) or a
        loss object
    :param weight_name: name of the sample-weight input added when ``fit`` gets weights
    :param learning_penalty: ``None`` or a penalty object
    :param exc: raise :class:`~onnxgrad.ConvergenceError` on divergence (else warn and stop)
    :param output: the model output the loss applies to (default: the first float one)
    :param random_state: seed of the batch shuffling
    :param backend: :func:`onnxgrad.onnx_derivative` backend
    :param intra_op_num_threads: threads of each onnxruntime session (default: onnxruntime's
        choice, one per core; small batches often run fastest on one)
    :param early_stopping, validation_fraction, n_iter_no_change, tol: scikit-learn's MLP
        early stopping (see :meth:`fit`); off by default
    :param enable_logging: log the loss and the learning rate of every epoch (INFO, logger
        ``onnxgrad.training``)
    :param loss_scale: loss scaling of the train step (:func:`make_train_step`; default
        ``'auto'``: dynamic for a model computing in float16; one process only, the split
        step of data-parallel training does not scale)
    :param recompute: forward values the train step's backward recomputes instead of keeping
        them (default ``'attention'``: attentions with large scores in tiles; ``'auto'``,
        or regular expressions naming blocks to checkpoint, e.g. ``[r"layers\\.\\d+"]``;
        :mod:`onnxgrad.derivative.recompute`); ``None``: none
    """

    learning_loss = ResolvedParam(BaseLearningLoss, select_learning_loss)

    def __init__(
        self,
        model_onnx,
        weights_to_train=None,
        loss_output_name="loss",
        max_iter=100,
        batch_size=10,
        learning_rate="SGD",
        device="cpu",
        warm_start=False,
        verbose=0,
        validation_every=0.1,
        learning_loss="squared_error",
        weight_name=None,
        learning_penalty=None,
        exc=True,
        output=None,
        random_state=None,
        backend="onnx",
        intra_op_num_threads=None,
        early_stopping=False,
        validation_fraction=0.1,
        n_iter_no_change=10,
        tol=1e-4,
        enable_logging=False,
        loss_scale="auto",
        recompute=TRAINING_RECOMPUTE,
    ):
        self.loss_scale = loss_scale
        self.recompute = recompute
        self.enable_logging = enable_logging
        self.model_onnx = model_onnx
        self.weights_to_train = weights_to_train
        self.loss_output_name = loss_output_name
        self.max_iter = max_iter
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.device = device
        self.warm_start = warm_start
        self.verbose = verbose
        self.validation_every = validation_every
        self.learning_loss = learning_loss
        self.weight_name = weight_name
        self.learning_penalty = learning_penalty
        self.exc = exc
        self.output = output
        self.random_state = random_state
        self.backend = backend
        self.intra_op_num_threads = intra_op_num_threads
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.n_iter_no_change = n_iter_no_change
        self.tol = tol

    def _build_graphs(self, model: ModelProto, with_weight: bool, fixed=()) -> _Graphs:
        loss = select_learning_loss(self.learning_loss)
        options = {
            "fixed_inputs": fixed,
            "loss": loss,
            "output": self.output,
            "loss_output_name": self.loss_output_name,
            "weight_name": (self.weight_name or "weight") if with_weight else None,
        }
        evaluation = make_eval_step.normalized(
            copy_message(model), self.weights_to_train, **options
        )
        return _Graphs(
            learning_rate=select_learning_rate(self.learning_rate).init_learning_rate(),
            penalty=select_learning_penalty(self.learning_penalty),
            loss=loss,
            evaluation=evaluation,
            prediction=make_predict_model(model, evaluation.weights),
            step_options={**options, "label_name": evaluation.label},
            n_classes=_n_classes(model, self.output) if loss.classification else None,
            output=self.output or _first_float_output(model),
        )


class OrtGradientOptimizer(BaseOrtOptimizer):
    """Trains a model that already ends in a loss (:func:`onnxgrad.add_loss_output`).

    :param weights_to_train: initializer names to train
    :param loss_output_name: the model's loss output
    :param label_name: the model's label input
    :param sample_weight_name: the model's sample-weight input, if it has one
    :param saved_gradient: a file name: the gradient graph of the loss (``onnx_derivative``
        with ``DerivativeOptions.Loss``) is saved there when the graphs are built

    The other parameters are those of :class:`OrtGradientForwardBackwardOptimizer`.
    """

    def __init__(
        self,
        model_onnx,
        weights_to_train,
        loss_output_name="loss",
        max_iter=100,
        batch_size=10,
        learning_rate="SGD",
        device="cpu",
        warm_start=False,
        verbose=0,
        validation_every=0.1,
        label_name="label",
        sample_weight_name="weight",
        learning_penalty=None,
        exc=True,
        random_state=None,
        backend="onnx",
        intra_op_num_threads=None,
        early_stopping=False,
        validation_fraction=0.1,
        n_iter_no_change=10,
        tol=1e-4,
        saved_gradient=None,
        enable_logging=False,
        loss_scale="auto",
        recompute=TRAINING_RECOMPUTE,
    ):
        self.loss_scale = loss_scale
        self.recompute = recompute
        self.saved_gradient = saved_gradient
        self.enable_logging = enable_logging
        self.model_onnx = model_onnx
        self.weights_to_train = weights_to_train
        self.loss_output_name = loss_output_name
        self.max_iter = max_iter
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.device = device
        self.warm_start = warm_start
        self.verbose = verbose
        self.validation_every = validation_every
        self.label_name = label_name
        self.sample_weight_name = sample_weight_name
        self.learning_penalty = learning_penalty
        self.exc = exc
        self.random_state = random_state
        self.backend = backend
        self.intra_op_num_threads = intra_op_num_threads
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.n_iter_no_change = n_iter_no_change
        self.tol = tol

    def _not_features(self) -> set[str]:
        return {self.label_name, self.sample_weight_name}

    def _build_graphs(self, model: ModelProto, with_weight: bool, fixed=()) -> _Graphs:
        inputs = {i.name for i in model.graph.input}
        has_weight = self.sample_weight_name in inputs
        if with_weight and not has_weight:
            raise ValueError(
                f"sample_weight is given but the model has no input {self.sample_weight_name!r}"
                " (see sample_weight_name)"
            )
        options = {
            "fixed_inputs": fixed,
            "loss": None,
            "loss_output_name": self.loss_output_name,
            "label_name": self.label_name,
            "weight_name": self.sample_weight_name if has_weight else None,
        }
        evaluation = make_eval_step.normalized(
            copy_message(model), self.weights_to_train, **options
        )
        if self.saved_gradient is not None:
            save_loss_gradient(model, evaluation, self.saved_gradient, self.backend)
        predictions = [o.name for o in model.graph.output if o.name != self.loss_output_name]
        prediction = None
        if predictions:
            without_loss = select_model_inputs_outputs(model, outputs=predictions)
            prediction = make_predict_model(without_loss, evaluation.weights)
        label = input_info(evaluation.model, evaluation.label)
        classification = np_dtype(label.type.tensor_type.elem_type).kind in "iu"
        return _Graphs(
            learning_rate=select_learning_rate(self.learning_rate).init_learning_rate(),
            penalty=select_learning_penalty(self.learning_penalty),
            loss=None,
            evaluation=evaluation,
            prediction=prediction,
            step_options=options,
            n_classes=_n_classes(prediction, None) if classification and prediction else None,
        )


def _initializers(model: ModelProto, names) -> dict[str, np.ndarray]:
    wanted = set(names)
    return as_master(
        {
            init.name: onnx.numpy_helper.to_array(init)
            for init in model.graph.initializer
            if init.name in wanted
        }
    )


def _first_float_output(model: ModelProto) -> str | None:
    info = first_float_output(model.graph)
    return None if info is None else info.name


def _n_classes(model: ModelProto, output: str | None) -> int | None:
    """The columns of the classification output ``output`` (default: the first float one),
    2 for a single column (binary); ``None`` when unknown."""
    chosen = next((o for o in model.graph.output if o.name == output), None) if output else None
    chosen = chosen or first_float_output(model.graph)
    if chosen is None:
        return None
    if len(tensor_dims(chosen)) == 1:
        return 2
    try:
        columns = n_classes_of(chosen)
    except ValueError:  # not [N, C] with a known C
        return None
    return 2 if columns == 1 else columns


def _batch_sizes(n: int, batch_size: int) -> np.ndarray:
    sizes = np.full(-(-n // batch_size), batch_size)
    sizes[-1] = n - batch_size * (len(sizes) - 1)
    return sizes


__all__ = ["BaseOrtOptimizer", "OrtGradientForwardBackwardOptimizer", "OrtGradientOptimizer"]
