"""The module-by-module divergence tool (benchmarks/sglang_gpu_divergence.py) and its capture hook
(benchmarks/sglang_forward_capture.py), on CPU with the tiny classifier.

The "SGLang" captures here are the Transformers forward's own module outputs, recorded in the order
and layout SGLang's hooks write them; one variant has one MLP output perturbed. The tool must find
no difference in the first and exactly that MLP in the second, and its propagation must reproduce
the perturbed logits. (On the GPU machine the same tool ran against SGLang 0.5.23's real captures:
results_h200/sglang_gpu/divergence_g303_mamba/.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

import sglang_forward_capture as capture

torch = pytest.importorskip("torch")


def record(model_dir: Path, rows: dict[str, list[int]], out: Path, perturb: tuple[str, float] | None = None) -> dict:
    """Run the Transformers classifier on each row, saving its module outputs as SGLang's hooks would
    (out/len{T}.pt) and the logits (returned). perturb=(capture key, amount) adds to that output."""
    import sglang_gpu_divergence as tool

    from openjev.engine.classifier import load_classifier

    clf = load_classifier(model_dir, "cpu", "float16")
    layers, _, types = tool.text_parts(clf.model)
    emb = clf.model.get_input_embeddings()
    out.mkdir(parents=True, exist_ok=True)
    logits = {}
    for rid, ids in rows.items():
        caps: dict = {}
        counts: dict = {}

        def rec(kind):
            def hook(mod, inp, o):
                t = o[0] if isinstance(o, tuple) else o
                n = counts.get(kind, 0)
                counts[kind] = n + 1
                key = f"{kind}.{n}"
                t2 = t[0] if t.dim() == 3 else t
                if perturb and perturb[0] == key:
                    t2 = t2 + perturb[1]
                caps[key] = t2.detach().clone()
                if t.dim() == 3 and perturb and perturb[0] == key:
                    new = t2[None]
                    return (new,) + tuple(o[1:]) if isinstance(o, tuple) else new
                return None
            return hook

        def core(mod, args):
            n = counts.get("gdn_core", 0)
            counts["gdn_core"] = n + 1
            caps[f"gdn_core.{n}"] = args[0].detach().clone()

        handles = [emb.register_forward_hook(rec("embed"))]
        for layer, t in zip(layers, types):
            if t == "gdn":
                handles.append(layer.linear_attn.norm.register_forward_pre_hook(core))
                handles.append(layer.linear_attn.register_forward_hook(rec("gdn_out")))
            else:
                handles.append(layer.self_attn.register_forward_hook(rec("attn_out")))
            handles.append(layer.mlp.register_forward_hook(rec("mlp_out")))
        try:
            with torch.inference_mode():
                lg = clf.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        finally:
            for h in handles:
                h.remove()
        torch.save(caps, out / f"len{len(ids)}.pt")
        logits[rid] = lg.tolist()
    (out / "logits.json").write_text(json.dumps(logits))
    return {"types": types, "logits": logits}


def run_tool(model_dir: Path, tokens: Path, caps: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sglang_gpu_divergence.py"), "--model", str(model_dir),
                           "--tokens", str(tokens), "--captures", str(caps), "--sglang-logits", str(caps / "logits.json"),
                           "--out", str(out), "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "divergence.json").read_text())


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    g = torch.Generator().manual_seed(7)
    rows = {f"r{n}": torch.randint(5, 400, (n,), generator=g).tolist() for n in (23, 41)}
    path = tmp_path_factory.mktemp("div") / "rows.tokens.jsonl"
    path.write_text("".join(json.dumps({"id": k, "input_ids": v}) + "\n" for k, v in rows.items()))
    return rows, path


def test_the_reference_against_itself_shows_no_difference(tiny_model, rows, tmp_path):
    model = tiny_model["checkpoint"]
    rows, tokens = rows
    record(model, rows, tmp_path / "caps")
    got = run_tool(model, tokens, tmp_path / "caps", tmp_path / "out")
    assert "truth_error" not in got
    for rid, entry in got["rows"].items():
        assert entry["reconstruct"]["max_abs_vs_sglang"] == 0.0, rid
        for kind, per_layer in entry["local_per_layer"].items():
            assert all(x == 0.0 for x in per_layer), (rid, kind, per_layer)
        assert all(v.get("dp_e_vs_clean", 0.0) == 0.0 for v in entry["propagation"].values()), entry["propagation"]
        assert entry["truth"]["gdn_mixer"]["sglang_vs_fp32"]["median_rel_rms"] > 0  # FP16 is not exact arithmetic


def test_one_perturbed_mlp_is_found_and_its_effect_reproduced(tiny_model, rows, tmp_path):
    model = tiny_model["checkpoint"]
    rows, tokens = rows
    made = record(model, rows, tmp_path / "caps", perturb=("mlp_out.1", 0.05))
    got = run_tool(model, tokens, tmp_path / "caps", tmp_path / "out")
    types = made["types"]
    assert types[1] == "gdn"
    for rid, entry in got["rows"].items():
        per = entry["local_per_layer"]
        assert per["mlp_after_gdn"][1] > 0.01, per
        assert [x for i, x in enumerate(per["mlp_after_gdn"]) if i != 1] == [0.0] * (len(per["mlp_after_gdn"]) - 1)
        for kind in ("gdn_mixer", "attn_mixer", "mlp_after_attn", "gdn_core", "gdn_after_core"):
            assert all(x == 0.0 for x in per[kind]), (kind, per[kind])
        prop = entry["propagation"]
        assert prop["mlps"]["dp_e_vs_clean"] != 0.0
        assert prop["gdn_mixers"]["dp_e_vs_clean"] == 0.0 and prop["attn_mixers"]["dp_e_vs_clean"] == 0.0
        assert abs(prop["all"]["dp_e_vs_clean"] - prop["sglang"]["dp_e_vs_clean"]) < 1e-3


def test_the_capture_hook_keeps_only_the_chosen_lengths(tmp_path):
    layers = 2
    hooks = {kind: capture.capture_hook({"kind": kind, "dir": str(tmp_path), "lengths": [5], "layers": layers})
             for kind in capture.TARGETS}
    specs = json.loads(capture.specs(str(tmp_path), [5], layers))
    assert {s["config"]["kind"] for s in specs} == set(capture.TARGETS)
    assert all(s["hook_factory"] == "sglang_forward_capture:capture_hook" for s in specs)

    def forward(n: int, base: float) -> None:
        hooks["embed"](None, (), torch.full((n, 4), base))
        hooks["gdn_out"](None, (), (torch.full((n, 4), base + 1), None))
        hooks["mlp_out"](None, (), torch.full((n, 4), base + 2))
        hooks["attn_out"](None, (), torch.full((n, 4), base + 3))
        hooks["mlp_out"](None, (), torch.full((n, 4), base + 4))
        hooks["final_norm"](None, (), (torch.full((n, 4), base + 5), torch.zeros(n, 4)))

    forward(7, 0.0)  # a warm-up pass of another length: ignored
    forward(5, 10.0)
    forward(9, 20.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["len5.final_norm.pt", "len5.pt"]
    caps = torch.load(tmp_path / "len5.pt")
    assert sorted(caps) == ["attn_out.0", "embed.0", "gdn_out.0", "mlp_out.0", "mlp_out.1"]
    assert caps["mlp_out.1"][0, 0].item() == 14.0 and caps["gdn_out.0"].shape == (5, 4)
    assert torch.load(tmp_path / "len5.final_norm.pt")[0, 0].item() == 15.0


def test_rows_of_refuses_missing_rows_and_equal_lengths(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "a", "input_ids": [1, 2]}) + "\n" + json.dumps({"id": "b", "input_ids": [3, 4]}) + "\n")
    with pytest.raises(SystemExit, match="not in"):
        capture.rows_of(str(path), ["a", "c"])
    with pytest.raises(SystemExit, match="distinct lengths"):
        capture.rows_of(str(path), ["a", "b"])
