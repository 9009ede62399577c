"""The five corrupted checkpoints of the strict-loading tests, shared by both backends.

`write_case(src_dir, out_dir, case)` copies a good Transformers Qwen3.5 classifier checkpoint
(config, tokenizer, one model.safetensors) and rewrites its weights in one of these ways:

  deleted      two backbone tensors removed
  renamed      every backbone tensor renamed (model.language_model.* -> backbone.*)
  extra        one tensor that is not a Qwen3.5 classifier's added
  duplicated   two shards + index, one backbone tensor stored in both shards
  wrong_shape  one backbone tensor with 8 more rows (SGLang's sharded loader would narrow it)

and returns the fragments the refusal must contain (the names, with counts and shapes), as
sglang_openjev.weights.loading_problems words them for either backend.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CASES = ("deleted", "renamed", "extra", "duplicated", "wrong_shape")
P = "model.language_model."
DELETED = (P + "layers.0.mlp.up_proj.weight", P + "norm.weight")
EXTRA = P + "layers.0.mlp.extra_proj.weight"
DUPLICATED = P + "layers.1.mlp.down_proj.weight"
RESHAPED = P + "layers.0.mlp.up_proj.weight"


def write_case(src: Path, out: Path, case: str) -> list[str]:
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    backbone = sorted(k for k in state if k.startswith(P))
    if case == "deleted":
        for name in DELETED:
            del state[name]
        expect = [f"2 missing tensor(s): {', '.join(sorted(DELETED))}"]
    elif case == "renamed":
        state = {("backbone." + k[len(P):] if k.startswith(P) else k): v for k, v in state.items()}
        n = len(backbone)
        expect = [f"{n} missing tensor(s): {backbone[0]}", f"{n} unexpected tensor(s): backbone.{backbone[0][len(P):]}"]
    elif case == "extra":
        state[EXTRA] = torch.zeros(2, 2)
        expect = [f"1 unexpected tensor(s): {EXTRA}"]
    elif case == "duplicated":
        names = sorted(set(state) - {DUPLICATED})
        first = {k: state[k] for k in names[: len(names) // 2]}
        second = {k: state[k] for k in names[len(names) // 2:]}
        first[DUPLICATED] = state[DUPLICATED] + 1.0  # a different value: which copy wins would matter
        second[DUPLICATED] = state[DUPLICATED]
        shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
        weight_map = {}
        for fname, tensors in shards.items():
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
            for k in tensors:
                weight_map.setdefault(k, fname)
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return [f"1 tensor name(s) given more than once: {DUPLICATED}"]
    elif case == "wrong_shape":
        good = state[RESHAPED]
        state[RESHAPED] = torch.cat([good, good[:8]])
        expect = [f"1 tensor(s) of the wrong shape: {RESHAPED} {[good.shape[0] + 8, good.shape[1]]} "
                  f"(expected {list(good.shape)})"]
    else:
        raise ValueError(case)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return expect
