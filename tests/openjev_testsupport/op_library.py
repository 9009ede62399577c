"""Registering pure-PyTorch stand-ins for a compiled op library under its own torch.ops namespace.

Both stand-in packages (sgl-kernel's CPU ops and its CUDA norms) define their ops here with the
library's schemas. `OPENJEV_STANDIN_CALL_LOG=/path/file` makes each process append `<pid> <op>` there
on the first call of each op, so a test can show which stand-ins an engine ran.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Callable, Mapping, Sequence

import torch

_LOGGED: set[str] = set()


def call_logged(name: str, fn: Callable) -> Callable:
    path = os.environ.get("OPENJEV_STANDIN_CALL_LOG")
    if not path:
        return fn

    def wrapper(*args, **kwargs):
        if name not in _LOGGED:
            _LOGGED.add(name)
            with open(path, "a") as fh:
                fh.write(f"{os.getpid()} {name}\n")
        return fn(*args, **kwargs)

    return wrapper


def defined(namespace: str, name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"{namespace}::{name}", "")
        return True
    except RuntimeError:
        return False


def define_ops(namespace: str, schemas: Mapping[str, str], ops: ModuleType, dispatch_keys: Sequence[str],
               who: str) -> torch.library.Library:
    """Define every op of SCHEMAS under NAMESPACE, implemented by OPS.<name> for DISPATCH_KEYS.

    Refuses, naming the ops, when the namespace already holds one of them (the compiled library is loaded).
    """
    taken = [name for name in schemas if defined(namespace, name)]
    if taken:
        raise RuntimeError(f"{who}: torch.ops.{namespace} already defines {', '.join(taken)} (the compiled "
                           "library is loaded); use one or the other")
    lib = torch.library.Library(namespace, "FRAGMENT")
    for name, schema in schemas.items():
        lib.define(schema)
        fn = call_logged(name, getattr(ops, name))
        for key in dispatch_keys:
            lib.impl(name, fn, key)
    return lib
