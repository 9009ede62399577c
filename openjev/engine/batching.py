"""How a scheduling step's rows become forwards, and what a step's forwards give back: shared by the
plain path (openjev/engine/scheduler.py) and prefix reuse (openjev/engine/prefix.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepResult:
    """What one scheduling step's forwards gave: logits [rows, 3] in the step's row order, and counts."""

    logits: object          # np.ndarray float32
    forwards: int
    computed_tokens: int    # real tokens the forwards ran (padding not counted)
    padded_tokens: int      # tokens the forwards ran, padding included
    reused_tokens: int      # tokens of the rows taken from prefix states instead of run


# What one more padded forward costs, in padded tokens, when a step's rows are cut into forwards
# (kernel launches and part-filled waves that do not grow with the rows). With 1024 the 128-row
# H200 set served as batches of 32 from 4 clients, --max-running-requests 16, step budget 65536,
# is padded by 6 % in 12 forwards instead of 16 % in 9 with fixed-size cuts (default budget 16384:
# 11 % instead of 43 %).
FORWARD_COST_TOKENS = 1024


def length_groups(lengths: list[int], max_rows: int, forward_cost: int = FORWARD_COST_TOKENS) -> list[list[int]]:
    """Indices of a step cut into padded forwards of at most max_rows rows, shortest rows first.

    The rows are sorted by length and cut into consecutive runs so that the padded tokens (each
    run's longest row times its row count) plus `forward_cost` per run are least: dynamic
    programming over the sorted lengths, O(rows x max_rows). forward_cost 0 gives runs of equal
    lengths; a large one gives the fewest forwards. Ties keep the earlier cut."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0] + [None] * n  # best[j]: least cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(max(0, j - max_rows), j):
            cost = best[i] + longest * (j - i) + forward_cost
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    groups = []
    while n > 0:
        groups.append(order[cut[n]:n])
        n = cut[n]
    return groups[::-1]


def forward_rows(clf, rows: list[list[int]], batching: str, max_rows: int) -> StepResult:
    """A step's rows without prefix reuse: exact forwards (one a row) or padded ones, cut by length
    (length_groups), the padded forwards' logits copied to the host once for the step."""
    import numpy as np

    from openjev.engine.classifier import padded_logits, score_exact

    logits = np.empty((len(rows), 3), dtype=np.float32)
    queued = []  # padded forwards of this step, their logits still on the device
    forwards = padded_tokens = 0
    for idx in length_groups([len(r) for r in rows], max_rows):
        group = [rows[i] for i in idx]
        if batching == "exact" or clf.pad_token_id is None:
            logits[idx] = score_exact(clf, group)
            forwards += len(group)
            padded_tokens += sum(map(len, group))
        else:  # similar lengths together keep padding small
            queued.append((idx, padded_logits(clf, group)))
            forwards += 1
            padded_tokens += max(map(len, group)) * len(group)
    if queued:
        import torch

        with torch.inference_mode():
            host = torch.cat([t for _, t in queued]).float().cpu().numpy()
        logits[[i for idx, _ in queued for i in idx]] = host
    return StepResult(logits, forwards, sum(map(len, rows)), padded_tokens, 0)
