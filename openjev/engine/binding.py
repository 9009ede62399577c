"""What a function of Transformers' modeling modules runs: its hub-kernel wrapper's bound
implementation, and a name for it (openjev/engine/kernels.py kernel_path, openjev/engine/gdn.py)."""

from __future__ import annotations

import inspect


def bound_implementation(func) -> object:
    """The implementation a Transformers fallback wrapper calls (its closure's `implementation`),
    through up to five wrappers that name theirs in `__wrapped__`."""
    seen = 0
    while func is not None and seen < 5:
        nonlocals = inspect.getclosurevars(func).nonlocals if inspect.isfunction(func) else {}
        if "implementation" in nonlocals:
            return nonlocals["implementation"]
        func = getattr(func, "__wrapped__", None)
        seen += 1
    return None


def describe(func) -> str | None:
    if func is None:
        return None
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', getattr(func, '__name__', '?'))}"
