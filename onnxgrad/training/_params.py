"""scikit-learn's parameter protocol without depending on scikit-learn.

Constructors store their arguments unchanged under the same names; ``get_params`` reads them
back from the signature, so ``sklearn.base.clone`` rebuilds an equal, unfitted object.
Estimators add scikit-learn's tags (:class:`EstimatorMixin`).
"""

from __future__ import annotations

import inspect
from typing import Any

from onnx import ModelProto


class ParamsMixin:
    """``get_params``/``set_params`` and a ``repr`` listing the parameters."""

    @classmethod
    def _get_param_names(cls) -> list[str]:
        signature = inspect.signature(cls.__init__)
        return [
            name
            for name, p in signature.parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        params = {}
        for name in self._get_param_names():
            value = getattr(self, name)
            params[name] = value
            if deep and hasattr(value, "get_params") and not isinstance(value, type):
                params.update({f"{name}__{k}": v for k, v in value.get_params().items()})
        return params

    def set_params(self, **params: Any) -> ParamsMixin:
        valid = set(self._get_param_names())
        nested: dict[str, dict[str, Any]] = {}
        for key, value in params.items():
            name, _, sub = key.partition("__")
            if name not in valid:
                raise ValueError(
                    f"invalid parameter {name!r} for {type(self).__name__}, "
                    f"expected one of {sorted(valid)}"
                )
            if sub:
                nested.setdefault(name, {})[sub] = value
            else:
                setattr(self, name, value)
        for name, sub_params in nested.items():
            getattr(self, name).set_params(**sub_params)
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={_short_repr(v)}" for k, v in self.get_params(deep=False).items())
        return f"{type(self).__name__}({args})"


class EstimatorMixin(ParamsMixin):
    """What scikit-learn's model selection (``clone``, ``GridSearchCV``,
    ``check_is_fitted``) asks of an estimator, scikit-learn imported only when it asks;
    subclasses tell whether they are fitted with ``__sklearn_is_fitted__``.
    """

    def __sklearn_tags__(self):
        from sklearn.utils import InputTags, Tags, TargetTags

        return Tags(
            estimator_type=None,
            target_tags=TargetTags(required=True),
            input_tags=InputTags(two_d_array=True, allow_nan=False),
        )


def _short_repr(value: Any) -> str:
    if isinstance(value, ModelProto):
        return f"<ModelProto {value.graph.name!r}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
