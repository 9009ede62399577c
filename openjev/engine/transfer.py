"""Host-to-device copies that do not wait for the GPU work already queued."""

from __future__ import annotations


def to_device(tensor, device):
    """A host tensor on `device` without waiting for queued GPU work: on a GPU copied from pinned
    memory with non_blocking=True (PyTorch's default copy synchronizes the stream, i.e. waits for
    the forwards already queued); elsewhere as is."""
    if not str(device).startswith("cuda"):
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
