"""Warm-up of the embedded classifier before timed or served work (app/serve_transformers.py,
app/score_reference.py): GPU kernels compiled and autotuned, fused modules applied."""

from __future__ import annotations

import logging
import os
import time

from openjev.engine.classifier import score_exact, score_padded
from openjev.engine.kernels import compile_pointwise, kernel_path, warm_fla_shapes
from openjev.engine.packing import install_packed_mlp, packed_mlp_record

log = logging.getLogger("openjev.kernels")


def warm_up(clf, rows: list[list[int]], forwards: int = 2, padded: bool = False, batch: int = 8) -> dict:
    """Untimed forwards before any timed or served work: Triton compiles and autotunes the GDN
    kernels, cuBLAS/cuDNN pick their algorithms. Lengths are spread over the rows given (a length
    that is not a multiple of 16 is included: Triton specialises integer arguments on it).
    Results are discarded; the arithmetic of later forwards does not depend on them."""
    if forwards <= 0 or not rows:
        return {"forwards": 0, "seconds": 0.0, "lengths": []}
    by_len = sorted(rows, key=len)
    shapes = warm_fla_shapes(clf, batch if padded else 1, max(len(r) for r in rows) * (batch if padded else 1))
    picks = [by_len[round(i * (len(by_len) - 1) / max(1, forwards - 1))] for i in range(forwards)]
    t0 = time.perf_counter()
    for row in picks:
        score_exact(clf, [row])
    if padded:
        score_padded(clf, by_len[:batch])
    seconds = round(time.perf_counter() - t0, 3)
    log.info("warm-up: %d forwards in %.1f s", len(picks) + int(padded), seconds)
    return {"forwards": len(picks) + int(padded), "seconds": seconds, "lengths": [len(r) for r in picks],
            "fla_shapes": shapes}


def synthetic_rows(vocab_size: int, lengths=(80, 700), count: int = 8) -> list[list[int]]:
    """Deterministic in-vocabulary rows for warming a server before its first request."""
    out = []
    for j in range(count):
        n = lengths[j % len(lengths)] - j
        out.append([(1 + 7919 * (i + 31 * j)) % vocab_size for i in range(max(1, n))])
    return out


WARM_TOKENS_ENV = "OPENJEV_WARM_TOKENS"


def prepare_serving(clf, batching: str, max_rows: int = 16, max_tokens: int | None = None) -> dict:
    """What the embedded server does after loading: on a GPU, the fused kernels of openjev/engine/fused.py
    where they are bitwise Transformers' modules (OPENJEV_FUSED=off keeps none) or, instead,
    torch.compile of the norm/MLP modules (OPENJEV_COMPILE=1); with OPENJEV_PACKED_MLP=on, padded
    forwards' MLPs on their real tokens (openjev/engine/packing.py); fla autotune warm-up for forwards
    of up to `max_rows` rows and `max_tokens` padded tokens (default $OPENJEV_WARM_TOKENS or
    16384), then warm-up forwards; the kernel path is read again afterwards (the load's checks kept)."""
    compiled = 0
    if os.environ.get("OPENJEV_COMPILE") == "1" and clf.device != "cpu":
        compiled = compile_pointwise(clf.model)
    else:
        from openjev.engine.fused import apply_fused

        apply_fused(clf.model, clf.device)
    install_packed_mlp(clf.model, clf.device)
    tokens = max_tokens or int(os.environ.get(WARM_TOKENS_ENV) or 16384)
    shapes = warm_fla_shapes(clf, max_rows if batching != "exact" else 1, tokens if batching != "exact" else 4096)
    warm = warm_up(clf, synthetic_rows(clf.vocab_size), padded=batching != "exact")
    warm["compiled_modules"] = compiled
    warm["fla_shapes"] = shapes
    clf.kernels = {**(clf.kernels or {}), **kernel_path(clf.model),  # the load's checks stay
                   "packed_mlp": packed_mlp_record(clf.model)}
    return warm
