"""Forward hooks for SGLang's `--forward-hooks`: capture the module outputs of chosen prefills.

SGLang attaches `capture_hook(config)` to the modules a spec names (its own seam for debugging a
model). One spec per kind of output; config {"kind": KIND, "dir": DIR, "lengths": [T, ...],
"layers": N}. A forward pass whose embedding has T tokens, T in `lengths`, is kept: every hooked
output in call order, copied to the CPU, saved to DIR/len{T}.pt when the last layer's MLP has
run (the final norm, if hooked, goes to DIR/len{T}.final_norm.pt). Other passes (the warm-up,
other requests) are ignored. `python benchmarks/sglang_forward_capture.py hooks|send ...` builds the --forward-hooks JSON
and sends the rows.

Kinds, in the order a Qwen3.5 layer calls them:
  embed       model.embed_tokens               [T, hidden]
  gdn_core    model.layers.*.linear_attn.attn  the gated delta rule's output (before the gated norm)
  gdn_norm    model.layers.*.linear_attn.norm  the gated RMS norm's output
  gdn_out     model.layers.*.linear_attn       the token mixer's output (after out_proj)
  attn_out    model.layers.*.o_proj            the full-attention mixer's output
  mlp_out     model.layers.*.mlp               the MLP's output
  final_norm  model.norm
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TARGETS = {
    "embed": ["model.embed_tokens"],
    "gdn_core": ["model.layers.*.linear_attn.attn"],
    "gdn_norm": ["model.layers.*.linear_attn.norm"],
    "gdn_out": ["model.layers.*.linear_attn"],
    "attn_out": ["model.layers.*.o_proj"],
    "mlp_out": ["model.layers.*.mlp"],
    "final_norm": ["model.norm"],
}

_state: dict = {"keep": None, "tensors": {}, "counts": {}}


def specs(out_dir: str, lengths: list[int], layers: int) -> str:
    return json.dumps([{"name": f"capture_{kind}", "target_modules": pats,
                        "hook_factory": "sglang_forward_capture:capture_hook",
                        "config": {"kind": kind, "dir": str(out_dir), "lengths": list(lengths), "layers": layers}}
                       for kind, pats in TARGETS.items()])


def _first_tensor(output, tensor_type):
    if isinstance(output, tensor_type):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, tensor_type):
                return item
    return None


def capture_hook(config: dict):
    import torch

    kind, out_dir = config["kind"], Path(config["dir"])
    lengths, layers = set(int(t) for t in config["lengths"]), int(config["layers"])

    def save(obj, name: str) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{name}.{os.getpid()}"
        torch.save(obj, tmp)
        os.replace(tmp, out_dir / name)

    def hook(module, inputs, output):
        t = _first_tensor(output, torch.Tensor)
        if t is None:
            return None
        if kind == "embed":
            n = int(t.shape[0])
            _state.update(keep=n if n in lengths else None, tensors={}, counts={})
        n = _state["keep"]
        if n is None:
            return None
        i = _state["counts"].get(kind, 0)
        _state["counts"][kind] = i + 1
        if kind == "final_norm":
            save(t.detach().cpu(), f"len{n}.final_norm.pt")
            return None
        _state["tensors"][f"{kind}.{i}"] = t.detach().cpu().clone()
        if kind == "mlp_out" and i + 1 == layers:
            save(_state["tensors"], f"len{n}.pt")
            _state["tensors"] = {}
        return None

    return hook


def rows_of(tokens: str, ids: list[str]) -> list[tuple[str, list[int]]]:
    sel = {}
    with open(tokens) as fh:
        for line in fh:
            if line.strip():
                r = json.loads(line)
                if r["id"] in ids:
                    sel[r["id"]] = r["input_ids"]
    missing = [i for i in ids if i not in sel]
    if missing:
        raise SystemExit(f"rows not in {tokens}: {' '.join(missing)}")
    lengths = [len(sel[i]) for i in ids]
    if len(set(lengths)) != len(lengths):
        raise SystemExit(f"rows must have distinct lengths (a capture is named by its length): {lengths}")
    return [(i, sel[i]) for i in ids]


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description="Capture SGLang's module outputs for chosen rows: 'hooks' prints the "
                                "--forward-hooks JSON, 'send' posts each row alone to /classify and saves the logits.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("hooks", "send"):
        q = sub.add_parser(name)
        q.add_argument("--tokens", required=True, help="token file (id, input_ids)")
        q.add_argument("--ids", required=True, nargs="+", help="row ids (distinct lengths)")
    sub.choices["hooks"].add_argument("--dir", required=True, help="where SGLang's scheduler writes len{T}.pt")
    sub.choices["hooks"].add_argument("--layers", type=int, required=True, help="decoder layers of the model")
    sub.choices["send"].add_argument("--url", required=True)
    sub.choices["send"].add_argument("--out", required=True, help="JSON {row id: [c, e, n]}")
    a = p.parse_args()
    rows = rows_of(a.tokens, a.ids)
    if a.cmd == "hooks":
        print(specs(a.dir, [len(r) for _, r in rows], a.layers))
        return 0
    import requests

    out = {}
    for rid, ids in rows:
        r = requests.post(a.url.rstrip("/") + "/classify", json={"input_ids": [ids]}, timeout=600)
        r.raise_for_status()
        out[rid] = r.json()["logits"][0]
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
