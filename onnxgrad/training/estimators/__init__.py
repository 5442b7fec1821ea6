"""Estimators: scikit-learn style ``fit``/``predict`` objects over the steps and the runner.

:mod:`.optimizers` holds the regressors (``OrtGradientOptimizer``,
``OrtGradientForwardBackwardOptimizer``), :mod:`.classifier` the classifier;
:mod:`.resume` writes and reads their epoch checkpoints, :mod:`.invariants` checks a trained
classifier, and :mod:`.forward_backward` and :mod:`.compat` keep onnxcustom's other objects.
"""
