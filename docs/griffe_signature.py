"""Griffe extension of the docs build: show signatures that are set at import.

``Feeder.__init__`` takes ``**options`` in its source; the options are declared
once, in ``feeder.engine.config.Config``, and ``feeder/_feeder.py`` sets
``Feeder.__init__.__signature__`` from them. Static analysis sees only
``**options``, so the API reference would list no default. For every function
whose runtime object carries an explicit ``__signature__``, this extension
replaces the parameters found in the source with the runtime ones.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import griffe

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


def _runtime(path: str) -> Any:
    """The live object at a dotted path (module, then attributes), or None."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return None
        return obj
    return None


def _annotation(value: Any) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    return value if isinstance(value, str) else inspect.formatannotation(value)


class RuntimeSignatures(griffe.Extension):
    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        obj = _runtime(func.path)
        signature = getattr(obj, "__signature__", None)
        if not isinstance(signature, inspect.Signature):
            return
        params = [griffe.Parameter(p.name, kind=_KINDS[p.kind], annotation=_annotation(p.annotation),
                                   default=None if p.default is inspect.Parameter.empty else repr(p.default))
                  for p in signature.parameters.values()]
        func.parameters = griffe.Parameters(*params)
