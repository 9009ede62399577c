"""The Transformers side of OpenJEV, shared by the reference scorer and the embedded backend.

Both call the same unmodified `AutoModelForSequenceClassification` forward, so the embedded
backend can be checked against the reference bit for bit where the arithmetic allows it:

  exact   one unpadded forward per row, exactly what `score_reference.py` does by default.
          CPU float32 results are bitwise equal to the reference's.
  padded  rows of one scheduling step right-padded into one batch with an attention mask.
          Faster on a GPU. The full-attention layers attend row by row, each row unpadded,
          through the same SDPA call the exact forward makes (openjev/engine/attention.py), and cuBLAS
          runs without split-K (openjev/engine/kernels.py configure_backends), so on a GPU a padded
          forward repeats the exact forward's arithmetic: bitwise equal on the H200
          (results_h200/embedded_gpu/call9-rowwise). On a CPU the PyTorch GDN fallback is not
          batch-invariant, so the last bits differ and the agreement tolerance applies.

Pooling is Transformers' own: the rightmost token that is not `pad_token_id`
(GenericForSequenceClassification), identical in both modes.

Loading is strict, as in the SGLang adapter (sglang_openjev/weights.py): a checkpoint with a
missing, unexpected (other than lm_head.*, mtp.*, the vision tower), duplicated or wrong-shape
tensor is refused with the list (Transformers itself would only warn and initialise at random).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from openjev.common import LABELS, UserError, sha256_file
from openjev.engine.attention import check_batching, check_packed_calls, padded_rows, rowwise_attention
from openjev.engine.transfer import to_device
from sglang_openjev import weights
from sglang_openjev.contract import check_label_order

DTYPES = ("auto", "float16", "bfloat16", "float32")


@dataclass
class Classifier:
    model: object
    tokenizer: object | None
    path: Path
    device: str
    dtype: str
    vocab_size: int
    pad_token_id: int | None
    name: str
    kernels: dict | None = None  # what the forward runs (openjev/engine/kernels.py kernel_path)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} asked for, but torch {torch.__version__} sees no CUDA device")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":  # FP16 is the GPU reference of the spec; CPU has no fast FP16, so float32 (recorded)
        return "float32" if device == "cpu" else "float16"
    return dtype


def strict_loading_problems(info: dict, duplicated: list[str]) -> list[str]:
    """Transformers' loading report (output_loading_info) -> the strict-loading problems, worded as
    the SGLang adapter words them. Ignored as there: lm_head.*, mtp.* and the vision tower."""
    missing = [k for k in info.get("missing_keys", ()) if not weights.is_ignored(k)]
    unexpected = [k for k in info.get("unexpected_keys", ()) if not weights.is_ignored(k)]
    mismatched = []
    for entry in info.get("mismatched_keys", ()):
        if isinstance(entry, (tuple, list)) and len(entry) == 3:  # (name, checkpoint shape, model shape)
            mismatched.append(f"{entry[0]} {list(entry[1])} (expected {list(entry[2])})")
        else:
            mismatched.append(str(entry))
    return weights.loading_problems(missing, unexpected, duplicated, mismatched,
                                    [str(e) for e in info.get("error_msgs", ()) if e])


def load_classifier(path: str | Path, device: str = "auto", dtype: str = "auto") -> Classifier:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"model directory {path} has no config.json")
    config = json.loads((path / "config.json").read_text())
    try:
        check_label_order(config.get("id2label"), config.get("num_labels", len(config.get("id2label") or {})))
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    from openjev.engine.kernels import kernel_path, select_kernels

    select_kernels(device, config)  # before Transformers imports the Qwen3.5 modeling module
    duplicated = weights.duplicated_names(weights.checkpoint_weight_files(path))
    # Transformers only warns about missing/unexpected tensors (and initialises the missing ones
    # at random); its loading report is checked here, as the SGLang adapter checks its own.
    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=getattr(torch, dtype), output_loading_info=True, ignore_mismatched_sizes=True)
    problems = strict_loading_problems(info, duplicated)
    if problems:
        try:
            weights.refuse_if_problems(problems, f" {path}")
        except ValueError as exc:
            raise UserError(str(exc)) from None
    model = model.to(device).eval()
    rowwise_attention()
    text_cfg = model.config.get_text_config()
    kernels = kernel_path(model)
    kernels["padded_attention_shared_calls"] = check_batching(text_cfg, device, model.dtype)
    kernels["prefix_attention_varlen"] = check_packed_calls(text_cfg, device, model.dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None
    return Classifier(model=model, tokenizer=tokenizer, path=path, device=device, dtype=dtype,
                      vocab_size=int(text_cfg.vocab_size), pad_token_id=text_cfg.pad_token_id, name=path.name,
                      kernels=kernels)


def score_exact(clf: Classifier, rows: list[list[int]], threads: int = 1, progress=None) -> np.ndarray:
    """One unpadded forward per row -> float32 [n, 3] logits in C/E/N order.

    The forward is Transformers' own with use_cache=False: a classifier never reads the cache
    object (conv and recurrent states, key/value pairs) that use_cache would build and fill.
    The logits are bitwise those of the default call (H200, results_h200/embedded_gpu/call5-variants:
    128 rows bitwise equal; CPU: tests/test_score_reference.py). Logits stay on the device and are
    copied back once, so no row waits for the previous one to finish.

    threads > 1 (CUDA only; a CPU runs one): that many Python threads share the model, each with
    its own CUDA stream, rows handed out longest first. A warm exact forward is launch-bound (CPU
    time above GPU time), so a second thread fills the GPU while the first launches. Each row runs
    the same kernels on the same shapes, so the logits are bitwise those of one thread (measured on
    the H200 in call5-variants). `progress(n)` is called as rows are queued."""
    import torch

    if not rows:
        return np.empty((0, len(LABELS)), dtype=np.float32)
    if threads > 1 and str(clf.device).startswith("cuda"):
        kept = _exact_in_threads(clf, rows, threads, progress)
    else:
        kept = []
        with torch.inference_mode():
            for row in rows:
                kept.append(_forward(clf, torch.tensor([row], dtype=torch.long, device=clf.device))[0])
                if progress is not None:
                    progress(1)
    with torch.inference_mode():
        return torch.stack(kept).float().cpu().numpy().astype(np.float32, copy=False)


def _forward(clf: Classifier, ids, mask=None):
    return clf.model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def _exact_in_threads(clf: Classifier, rows: list[list[int]], threads: int, progress) -> list:
    import threading

    import torch

    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    lock = threading.Lock()
    nxt = [0]
    kept: list = [None] * len(rows)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            stream = torch.cuda.Stream(device=clf.device)
            with torch.inference_mode(), torch.cuda.stream(stream):
                while not errors:
                    with lock:
                        if nxt[0] >= len(order):
                            break
                        i = order[nxt[0]]
                        nxt[0] += 1
                    kept[i] = _forward(clf, torch.tensor([rows[i]], dtype=torch.long, device=clf.device))[0]
                    if progress is not None:
                        progress(1)
                stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(exc)

    workers = [threading.Thread(target=work, name=f"exact-{k}", daemon=True) for k in range(min(threads, len(rows)))]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if errors:
        raise errors[0]
    return kept


def padded_logits(clf: Classifier, rows: list[list[int]]):
    """Launch one right-padded forward of `rows` and return its logits left on the device
    ([n, 3], the model's dtype), so a caller can queue several forwards before one host copy
    (ids and mask copied by to_device)."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), clf.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    with torch.inference_mode(), padded_rows([len(r) for r in rows]):
        return _forward(clf, to_device(ids, clf.device), to_device(mask, clf.device))


def score_padded(clf: Classifier, rows: list[list[int]]) -> np.ndarray:
    """Rows right-padded into one forward with an attention mask -> float32 [n, 3]
    (use_cache=False as in score_exact; attention row by row, see rowwise_attention)."""
    if clf.pad_token_id is None:  # Transformers cannot pool a padded batch without a pad id
        return score_exact(clf, rows)
    return padded_logits(clf, rows).float().cpu().numpy().astype(np.float32, copy=False)


def weight_files(path: Path) -> list[dict]:
    """sha256 of the checkpoint's weight and config files (resolving overlay symlinks)."""
    names = sorted(p for p in path.iterdir()
                   if p.suffix in (".safetensors", ".bin") or p.name in ("config.json", "model.safetensors.index.json"))
    return [{"file": p.name, "sha256": sha256_file(p.resolve())} for p in names]
