"""scikit-learn's parameter protocol without depending on scikit-learn.

Constructors store their arguments unchanged under the same names; ``get_params`` reads them
back from the signature, so ``sklearn.base.clone`` rebuilds an equal, unfitted object.
Estimators add scikit-learn's tags (:class:`EstimatorMixin`). A parameter declared with
:class:`ResolvedParam` is read back as the object it selects, ``get_params`` still giving the
value as given.
"""

from __future__ import annotations

import inspect
from typing import Any

from onnx import ModelProto


class ResolvedParam:
    """A parameter given as a shorthand (a name, a number, ``None``) or an object, read back
    as the object.

    ``get_params``, ``set_params`` and ``clone`` see the value as given (scikit-learn's
    protocol); the attribute reads the object: the parameter passed to ``resolve`` (an object
    of ``kind`` is kept as is), or, once a fit called :meth:`use`, the object that fit trains
    with, its state live. Setting the parameter again forgets both.
    """

    def __init__(self, kind: type, resolve):
        self.kind = kind
        self.resolve = resolve

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __set__(self, obj, value: Any) -> None:
        obj.__dict__[f"_{self.name}_param"] = value
        obj.__dict__.pop(f"_{self.name}_object", None)

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        key = f"_{self.name}_object"
        if key not in obj.__dict__:
            value = self.given(obj)
            obj.__dict__[key] = value if isinstance(value, self.kind) else self.resolve(value)
        return obj.__dict__[key]

    def given(self, obj) -> Any:
        """The parameter as given to the constructor or ``set_params``."""
        try:
            return obj.__dict__[f"_{self.name}_param"]
        except KeyError:
            raise AttributeError(f"{type(obj).__name__!r} has no parameter {self.name!r}") from None

    def use(self, obj, value: Any) -> None:
        """Make ``value``, the object a fit trains with, what the attribute reads."""
        obj.__dict__[f"_{self.name}_object"] = value


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
            value = self._given(name)
            params[name] = value
            if deep and hasattr(value, "get_params") and not isinstance(value, type):
                params.update({f"{name}__{k}": v for k, v in value.get_params().items()})
        return params

    def _given(self, name: str) -> Any:
        """Parameter ``name`` as given (a :class:`ResolvedParam` unresolved)."""
        declared = getattr(type(self), name, None)
        return declared.given(self) if isinstance(declared, ResolvedParam) else getattr(self, name)

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
        """``Class(param=value, ...)`` with every nested object whole; a :class:`ResolvedParam`
        shows the object it selects (``learning_rate=LearningRateSGD(...)`` for ``'SGD'``)."""
        args = ", ".join(f"{k}={_param_repr(self, k)}" for k in self._get_param_names())
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


def _param_repr(obj: ParamsMixin, name: str) -> str:
    try:
        value = getattr(obj, name)
    except (TypeError, ValueError):  # a shorthand that resolves to nothing: fit will say why
        value = obj._given(name)
    if isinstance(value, ModelProto):
        return f"<ModelProto {value.graph.name!r}>"
    return repr(value)
