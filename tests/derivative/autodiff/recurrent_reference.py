"""RNN, GRU and LSTM in numpy (float64) from the ONNX specification, for onnx's
``ReferenceEvaluator`` (``new_ops``), whose own kernels support few attributes.

Independent of the gradient rule's lowering: plain loops over time and batch entries;
checked against onnxruntime's kernels (float32) in ``test_recurrent.py``.
"""

from __future__ import annotations

import numpy as np
from onnx import helper
from onnx.reference.op_run import OpRun

_ALPHA_BETA = {
    "affine": (1.0, 0.0),
    "leakyrelu": (0.01, None),
    "thresholdedrelu": (1.0, None),
    "scaledtanh": (1.0, 1.0),
    "hardsigmoid": (0.2, 0.5),
    "elu": (1.0, None),
}


def _function(name, alpha, beta):
    functions = {
        "relu": lambda x: np.maximum(x, 0),
        "tanh": np.tanh,
        "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
        "affine": lambda x: alpha * x + beta,
        "leakyrelu": lambda x: np.where(x >= 0, x, alpha * x),
        "thresholdedrelu": lambda x: np.where(x > alpha, x, 0),
        "scaledtanh": lambda x: alpha * np.tanh(beta * x),
        "hardsigmoid": lambda x: np.clip(alpha * x + beta, 0, 1),
        "elu": lambda x: np.where(x >= 0, x, alpha * (np.exp(x) - 1)),
        "softsign": lambda x: x / (1 + np.abs(x)),
        "softplus": lambda x: np.log1p(np.exp(x)),
    }
    return functions[name]


class _Recurrent(OpRun):
    op_domain = ""
    defaults: list[str] = []

    def attribute(self, name, default=None):
        for attr in self.onnx_node.attribute:
            if attr.name == name:
                value = helper.get_attribute_value(attr)
                if isinstance(value, bytes):
                    return value.decode()
                if isinstance(value, list) and value and isinstance(value[0], bytes):
                    return [v.decode() for v in value]
                return value
        return default

    def functions(self, n_dirs):
        names = self.attribute("activations") or self.defaults * n_dirs
        if len(names) == len(self.defaults) and n_dirs == 2:
            names = names * 2
        alphas = list(self.attribute("activation_alpha") or [])
        betas = list(self.attribute("activation_beta") or [])
        result = []
        for name in names:
            key = name.lower()
            alpha, beta = _ALPHA_BETA.get(key, (None, None))
            if alpha is not None and alphas:
                alpha = alphas.pop(0)
            if beta is not None and betas:
                beta = betas.pop(0)
            result.append(_function(key, alpha, beta))
        k = len(self.defaults)
        return [result[d * k : (d + 1) * k] for d in range(n_dirs)]

    def _run(self, X, W, R, B=None, sequence_lens=None, initial_h=None, *extra, **_):
        layout = self.attribute("layout", 0)
        direction = self.attribute("direction", "forward")
        clip = self.attribute("clip")
        n_dirs, gh, hidden = R.shape
        if layout:
            X = X.transpose(1, 0, 2)
            initial_h = None if initial_h is None else initial_h.transpose(1, 0, 2)
            extra = [e.transpose(1, 0, 2) if e is not None and e.ndim == 3 else e for e in extra]
        steps, batch, _ = X.shape
        lens = np.full(batch, steps) if sequence_lens is None else sequence_lens
        functions = self.functions(n_dirs)
        Y = np.zeros((steps, n_dirs, batch, hidden), dtype=X.dtype)
        Y_h = np.zeros((n_dirs, batch, hidden), dtype=X.dtype)
        Y_c = np.zeros((n_dirs, batch, hidden), dtype=X.dtype)
        for d in range(n_dirs):
            reverse = direction == "reverse" or d == 1
            bias = np.zeros(2 * gh, dtype=X.dtype) if B is None else B[d]
            for n in range(batch):
                h = np.zeros(hidden) if initial_h is None else initial_h[d, n].copy()
                c = self.initial_c(extra, d, n, hidden)
                order = range(lens[n] - 1, -1, -1) if reverse else range(lens[n])
                for step in order:
                    h, c = self.step(
                        X[step, n], h, c, W[d], R[d], bias, functions[d], clip, extra, d
                    )
                    Y[step, d, n] = h
                Y_h[d, n], Y_c[d, n] = h, c
        if layout:
            Y, Y_h, Y_c = Y.transpose(2, 0, 1, 3), Y_h.transpose(1, 0, 2), Y_c.transpose(1, 0, 2)
        return (Y, Y_h, Y_c)[: len(self.onnx_node.output)]

    def initial_c(self, extra, d, n, hidden):
        return None


def _clip(x, clip):
    return x if clip is None else np.clip(x, -clip, clip)


class RNN(_Recurrent):
    defaults = ["Tanh"]

    def step(self, x, h, c, w, r, bias, functions, clip, extra, d):
        (f,) = functions
        hidden = h.shape[0]
        pre = w @ x + r @ h + bias[:hidden] + bias[hidden:]
        return f(_clip(pre, clip)), None


class GRU(_Recurrent):
    defaults = ["Sigmoid", "Tanh"]

    def step(self, x, h, c, w, r, bias, functions, clip, extra, d):
        f, g = functions
        n = h.shape[0]
        wb, rb = bias[: 3 * n], bias[3 * n :]
        z = f(_clip(w[:n] @ x + r[:n] @ h + wb[:n] + rb[:n], clip))
        rr = f(_clip(w[n : 2 * n] @ x + r[n : 2 * n] @ h + wb[n : 2 * n] + rb[n : 2 * n], clip))
        if self.attribute("linear_before_reset", 0):
            pre = w[2 * n :] @ x + rr * (r[2 * n :] @ h + rb[2 * n :]) + wb[2 * n :]
        else:
            pre = w[2 * n :] @ x + r[2 * n :] @ (rr * h) + rb[2 * n :] + wb[2 * n :]
        candidate = g(_clip(pre, clip))
        return (1 - z) * candidate + z * h, None


class LSTM(_Recurrent):
    defaults = ["Sigmoid", "Tanh", "Tanh"]

    def initial_c(self, extra, d, n, hidden):
        initial_c = extra[0] if extra else None
        return np.zeros(hidden) if initial_c is None else initial_c[d, n].copy()

    def step(self, x, h, c, w, r, bias, functions, clip, extra, d):
        f, g, act_h = functions
        n = h.shape[0]
        peepholes = extra[1] if len(extra) > 1 and extra[1] is not None else None
        p_i, p_o, p_f = (np.zeros(n),) * 3 if peepholes is None else np.split(peepholes[d], 3)
        gates = w @ x + r @ h + bias[: 4 * n] + bias[4 * n :]
        i_pre, o_pre, f_pre, c_pre = np.split(gates, 4)
        i = f(_clip(i_pre + p_i * c, clip))
        if self.attribute("input_forget", 0):
            forget = 1 - i
        else:
            forget = f(_clip(f_pre + p_f * c, clip))
        c_new = forget * c + i * g(_clip(c_pre, clip))
        o = f(_clip(o_pre + p_o * c_new, clip))
        return o * act_h(c_new), c_new


OPS = [RNN, GRU, LSTM]
