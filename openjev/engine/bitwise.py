"""The load checks' comparison: are two computations' outputs bit for bit the same, and where they
are not, by how much (openjev/engine/fused.py, gdn.py, packing.py, packed.py)."""

from __future__ import annotations


class Bitwise:
    """torch.equal over every pair given (`compare(want, got)`); `same` while all were equal, `worst`
    the largest absolute difference seen (0.0 when equal)."""

    def __init__(self) -> None:
        self.same, self.worst = True, 0.0

    def __call__(self, want, got) -> None:
        import torch

        if not torch.equal(want, got):
            self.same = False
            self.worst = max(self.worst, float((want.float() - got.float()).abs().max()))

    @property
    def result(self) -> tuple[bool, float]:
        return self.same, self.worst
