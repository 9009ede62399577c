"""tokenize_nli.py and score_reference.py: exact ids, the reference receipt, refusals."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from conftest import APP, PY, SAMPLE, error_lines, on_full_disk, run_script, token_rows, tree_digest


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tokens_follow_the_input_set_and_record_their_provenance(sample_tokens, overlay):
    ids, rows = token_rows(sample_tokens)
    assert ids == [json.loads(l)["id"] for l in SAMPLE.read_text().splitlines()]
    assert all(rows) and all(isinstance(t, int) for r in rows for t in r)
    receipt = json.loads(sample_tokens.with_name(sample_tokens.name + ".receipt.json").read_text())
    assert receipt["inputs"]["sha256"] == sha(SAMPLE) and receipt["tokens"]["sha256"] == sha(sample_tokens)
    assert receipt["tokenizer"]["tokenizer.json"] == sha((overlay / "tokenizer.json").resolve())


def test_reference_receipt_and_arrays(reference, sample_tokens):
    import torch  # the reference must be the unmodified Transformers forward: same numbers here
    from transformers import AutoModelForSequenceClassification

    meta = json.loads((reference / "reference.json").read_text())
    logits = np.load(reference / "reference.npy")
    ids, rows = token_rows(sample_tokens)
    assert logits.dtype == np.float32 and logits.shape == (len(rows), 3)
    assert meta["row_ids"] == ids and meta["labels"] == ["contradiction", "entailment", "neutral"]
    assert meta["tokens"]["sha256"] == sha(sample_tokens) and meta["inputs"]["sha256"] == sha(SAMPLE)
    assert meta["dtype"] == "float32" and meta["device"] == "cpu" and meta["mode"] == "exact"
    assert meta["tokens"]["truncate"] == 4096 and meta["tokens"]["truncated_rows"] == 0
    assert meta["logits_sha256"] == sha(reference / "reference.npy")
    assert meta["environment"]["torch_version"] and meta["environment"]["transformers_version"]
    assert (reference / "tokens.sha256").read_text() == f"{sha(sample_tokens)}  {sample_tokens.name}\n"
    model = AutoModelForSequenceClassification.from_pretrained(meta["model"]["path"]).eval()
    with torch.no_grad():
        direct = model(input_ids=torch.tensor([rows[5]])).logits[0].numpy()
    assert np.array_equal(direct, logits[5])


def test_truncation_is_recorded(overlay, tmp_path):
    tokens = tmp_path / "t.jsonl"
    tokens.write_text(json.dumps({"id": "long", "input_ids": list(range(1, 40))}) + "\n"
                      + json.dumps({"id": "short", "input_ids": [3, 4]}) + "\n")
    proc = run_script("score_reference.py", "--model", overlay, "--tokens", tokens, "--out", tmp_path / "r",
                      "--truncate", "16")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "r" / "reference.json").read_text())
    assert meta["tokens"]["truncate"] == 16 and meta["tokens"]["truncated_rows"] == 1
    assert meta["inputs"] is None


def test_refuses_existing_output(overlay, sample_tokens, reference):
    before = tree_digest(reference)
    proc = run_script("score_reference.py", "--model", overlay, "--tokens", sample_tokens, "--out", reference)
    assert proc.returncode == 1 and "already exists" in error_lines(proc.stderr)[0]
    assert tree_digest(reference) == before


def test_refuses_tokens_that_do_not_match_the_inputs(overlay, sample_tokens, tmp_path):
    other = tmp_path / "other.jsonl"
    lines = SAMPLE.read_text().splitlines()
    other.write_text("\n".join(lines[1:] + lines[:1]) + "\n")
    proc = run_script("score_reference.py", "--model", overlay, "--tokens", sample_tokens, "--inputs", other,
                      "--out", tmp_path / "r")
    assert proc.returncode == 1 and "do not match" in error_lines(proc.stderr)[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("content,words", [
    ('{"id": "a", "input_ids": []}\n', ["non-empty list"]),
    ('{"id": "a", "input_ids": [1, "2"]}\n', ["non-empty list"]),
    ('{"id": "a"\n', ["not valid JSON"]),
    ('', ["empty"]),
    ('{"id": "a", "input_ids": [1]}\n{"id": "a", "input_ids": [2]}\n', ["duplicate"]),
    ('{"id": "a", "input_ids": [100000]}\n', ["out of the model's vocabulary"]),
])
def test_malformed_token_files_are_refused(overlay, tmp_path, content, words):
    tokens = tmp_path / "t.jsonl"
    tokens.write_text(content)
    proc = run_script("score_reference.py", "--model", overlay, "--tokens", tokens, "--out", tmp_path / "r")
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr)
    assert all(w in line for w in words), line
    assert not (tmp_path / "r").exists()


def test_tokenize_refuses_bad_inputs_and_existing_output(overlay, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "premise": "p"}\n')
    proc = run_script("tokenize_nli.py", "--model", overlay, "--inputs", bad, "--out", tmp_path / "t.jsonl")
    assert proc.returncode == 1 and "'hypothesis' must be a non-empty string" in error_lines(proc.stderr)[0]
    existing = tmp_path / "exists.jsonl"
    existing.write_text("keep")
    proc = run_script("tokenize_nli.py", "--model", overlay, "--inputs", SAMPLE, "--out", existing)
    assert proc.returncode == 1 and existing.read_text() == "keep"


@pytest.mark.parametrize("read_only", [False, True], ids=["full-disk", "read-only"])
def test_outputs_on_a_full_or_read_only_disk_are_one_line_and_leave_nothing(overlay, sample_tokens, tmp_path,
                                                                            read_only):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # the two scripts side by side, each on its own disk
        tok = pool.submit(on_full_disk, tmp_path / "d1", PY, APP / "tokenize_nli.py", "--model", overlay, "--inputs",
                          SAMPLE, "--out", tmp_path / "d1" / "t.jsonl", read_only=read_only)
        ref = pool.submit(on_full_disk, tmp_path / "d2", PY, APP / "score_reference.py", "--model", overlay,
                          "--tokens", sample_tokens, "--inputs", SAMPLE, "--out", tmp_path / "d2" / "ref",
                          read_only=read_only)
        tok, ref = tok.result(), ref.result()
    want = "Read-only file system" if read_only else "No space left on device"
    for proc in (tok, ref):
        lines = error_lines(proc.stderr)
        assert proc.returncode == 1 and len(lines) == 1 and want in lines[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        assert proc.stdout.rstrip().splitlines()[-1] == "LEFT:", proc.stdout  # no file, no partial folder


def test_custom_template_changes_the_ids(overlay, sample_tokens, tmp_path):
    out = tmp_path / "t.jsonl"
    run_script("tokenize_nli.py", "--model", overlay, "--inputs", SAMPLE, "--out", out,
               "--template", "{premise} => {hypothesis}", check=True)
    assert token_rows(out)[1] != token_rows(sample_tokens)[1]
    proc = run_script("tokenize_nli.py", "--model", overlay, "--inputs", SAMPLE, "--out", tmp_path / "u.jsonl",
                      "--template", "{premise} {oops}")
    assert proc.returncode == 1 and "unknown field" in error_lines(proc.stderr)[0]


def test_receipt_records_kernel_path_warmup_and_compute_bound(reference):
    meta = json.loads((reference / "reference.json").read_text())
    kp = meta["kernel_path"]  # CPU: Transformers' PyTorch fallback, with the reason recorded
    assert kp["gdn"] == "torch-fallback" and kp["gdn_chunk_kernel"].endswith("torch_chunk_gated_delta_rule")
    assert "cpu" in kp["selection"]["reason"] and kp["attn_implementation"]
    assert meta["warmup"]["forwards"] == 2 and meta["workers"] == 1
    assert meta["threads"] == {"requested": 0, "ran": 1}  # auto: one on a CPU
    cb = meta["compute_bound"]
    assert cb["peak_fp16_tflops"] is None and cb["peak_dtype"] == "float32" and cb["peak_tflops"] > 0
    assert cb["model_flops_per_pass"] > 0 and 0 < cb["fraction_of_peak"]
    assert meta["rows_per_s"] > 0


def test_workers_give_the_same_logits_bitwise(overlay, sample_tokens, reference, tmp_path):
    proc = run_script("score_reference.py", "--model", overlay, "--tokens", sample_tokens, "--inputs", SAMPLE,
                      "--out", tmp_path / "r2", "--workers", "2", "--no-peak")
    assert proc.returncode == 0, proc.stderr
    assert np.array_equal(np.load(tmp_path / "r2" / "reference.npy"), np.load(reference / "reference.npy"))
    meta = json.loads((tmp_path / "r2" / "reference.json").read_text())
    assert meta["workers"] == 2 and len(meta["warmup"]["per_worker"]) == 2 and meta["compute_bound"] is None


def test_forced_torch_kernels_are_recorded(overlay, sample_tokens, tmp_path):
    proc = run_script("score_reference.py", "--model", overlay, "--tokens", sample_tokens, "--out", tmp_path / "r",
                      "--kernels", "torch", "--no-peak", "--warmup", "0")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "r" / "reference.json").read_text())
    assert "OPENJEV_KERNELS=torch" in meta["kernel_path"]["selection"]["reason"]
    assert meta["warmup"]["forwards"] == 0


@pytest.mark.parametrize("flag", [["--workers", "0"], ["--warmup", "-1"], ["--threads", "-1"], ["--verify-rows", "-1"],
                                  ["--verify-rows", "4"], ["--verify-rows", "4", "--batch-size", "4", "--workers", "2"]])
def test_bad_workers_or_warmup_are_refused(overlay, sample_tokens, tmp_path, flag):
    proc = run_script("score_reference.py", "--model", overlay, "--tokens", sample_tokens, "--out", tmp_path / "r",
                      *flag)
    assert proc.returncode == 1 and error_lines(proc.stderr) and not (tmp_path / "r").exists()


def test_threads_on_a_cpu_run_one_and_change_nothing(overlay, sample_tokens, reference, tmp_path):
    proc = run_script("score_reference.py", "--model", overlay, "--tokens", sample_tokens, "--inputs", SAMPLE,
                      "--out", tmp_path / "r", "--threads", "3", "--no-peak")
    assert proc.returncode == 0, proc.stderr
    assert np.array_equal(np.load(tmp_path / "r" / "reference.npy"), np.load(reference / "reference.npy"))
    assert json.loads((tmp_path / "r" / "reference.json").read_text())["threads"] == {"requested": 3, "ran": 1}
    assert "1 worker(s) x 1 thread(s)" in proc.stdout


def test_verify_picks_spread_from_shortest_to_longest():
    from score_reference import verify_picks

    rows = [[1] * n for n in (5, 1, 9, 3, 7, 2)]
    assert verify_picks(rows, 2) == [1, 2]  # the shortest and the longest row
    assert verify_picks(rows, 3) == [1, 2, 3]  # lengths 1, 3 (the middle of the sorted rows) and 9
    assert verify_picks(rows, 99) == list(range(6)) and verify_picks(rows, 0) == [] and verify_picks([], 3) == []


def test_verify_rows_refuses_a_padded_reference_that_is_not_exact(overlay, sample_tokens, tmp_path):
    """On a CPU the PyTorch GDN fallback is not batch-invariant, so padded logits differ from the
    unpadded ones in the last bits: --verify-rows must see it, say so and write nothing (on a GPU
    the same check passes: test_padded_reference_on_a_gpu_is_bitwise_the_exact_one)."""
    proc = run_script("score_reference.py", "--model", overlay, "--tokens", sample_tokens, "--out", tmp_path / "r",
                      "--batch-size", "4", "--verify-rows", "50", "--no-peak")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "are not bitwise their unpadded logits" in proc.stderr and "use --batch-size 1" in proc.stderr
    assert not (tmp_path / "r").exists() and not list(tmp_path.glob(".r.partial*"))


def _classifier_and_rows(overlay, sample_tokens):
    from openjev.engine.classifier import load_classifier

    _, rows = token_rows(sample_tokens)
    return load_classifier(overlay, "cpu"), rows


def test_exact_and_padded_forwards_without_the_cache_are_bitwise_the_default_call(overlay, sample_tokens):
    """score_exact/score_padded pass use_cache=False (no cache object built and filled); the logits
    must be bitwise those of Transformers' default call, which builds the cache."""
    torch = pytest.importorskip("torch")
    from openjev.engine.attention import padded_rows
    from openjev.engine.classifier import score_exact, score_padded

    clf, rows = _classifier_and_rows(overlay, sample_tokens)
    rows = rows[:4]
    with torch.inference_mode():
        default = np.stack([clf.model(input_ids=torch.tensor([r])).logits[0].float().numpy() for r in rows])
        width = max(map(len, rows))
        ids = torch.tensor([r + [clf.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        with padded_rows([len(r) for r in rows]):  # score_padded's row-by-row attention
            padded_default = clf.model(input_ids=ids, attention_mask=mask).logits.float().numpy()
    assert clf.model.config.get_text_config().use_cache  # the default call really builds a cache
    assert np.array_equal(score_exact(clf, rows), default)
    assert np.array_equal(score_padded(clf, rows), padded_default)
    seen = []
    assert np.array_equal(score_exact(clf, rows, threads=4, progress=seen.append), default)  # CPU: one thread
    assert sum(seen) == len(rows)


def _attention_calls(clf, rows):
    """The first full-attention module's inputs and output in each row's exact forward, and the
    attention mask of the rows' padded forward (forward pre-hooks on the unmodified model)."""
    import torch

    attn = next(m for n, m in clf.model.named_modules() if n.endswith("self_attn"))
    seen: list = []
    h1 = attn.register_forward_pre_hook(lambda m, a, kw: seen.append(dict(kw)), with_kwargs=True)
    h2 = attn.register_forward_hook(lambda m, a, kw, out: seen[-1].update(out=out[0]), with_kwargs=True)
    try:
        with torch.inference_mode():
            for r in rows:
                clf.model(input_ids=torch.tensor([r]), use_cache=False)
            width = max(map(len, rows))
            ids = torch.tensor([r + [clf.pad_token_id] * (width - len(r)) for r in rows])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
            clf.model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        h1.remove()
        h2.remove()
    return attn, seen[: len(rows)], seen[len(rows)]["attention_mask"]


def test_rowwise_attention_repeats_each_rows_unpadded_call(overlay, sample_tokens):
    """A padded batch through the full-attention module, with the rows' lengths given
    (padded_rows, as score_padded does), gives each row bitwise the output of its own unpadded
    forward: same queries, keys and values, attended through the same unmasked causal call."""
    torch = pytest.importorskip("torch")
    from openjev.engine.attention import padded_rows, rowwise_attention

    assert rowwise_attention() == "rowwise"
    clf, rows = _classifier_and_rows(overlay, sample_tokens)
    rows = sorted(rows[:6], key=len)
    attn, exact, mask = _attention_calls(clf, rows)
    assert mask is not None  # the padded forward really passes a mask
    width = max(map(len, rows))
    hidden = torch.zeros((len(rows), width, exact[0]["hidden_states"].shape[-1]))
    for j, call in enumerate(exact):
        hidden[j, : len(rows[j])] = call["hidden_states"][0]
    cos, sin = exact[-1]["position_embeddings"]  # the longest row: positions 0..width-1
    pos = (cos.expand(len(rows), -1, -1), sin.expand(len(rows), -1, -1))
    with torch.inference_mode():
        with padded_rows([len(r) for r in rows]):
            rowwise, _ = attn(hidden_states=hidden, position_embeddings=pos, attention_mask=mask)
        masked, _ = attn(hidden_states=hidden, position_embeddings=pos, attention_mask=mask)
    worst_masked = 0.0
    for j, call in enumerate(exact):
        n = len(rows[j])
        assert torch.equal(rowwise[j, :n], call["out"][0]), f"row {j} ({n} tokens)"
        assert not rowwise[j, n:].any()  # padding positions: zeros
        worst_masked = max(worst_masked, float((masked[j, :n] - call["out"][0]).abs().max()))
    assert worst_masked < 1e-4  # Transformers' masked call: the same values up to rounding


def test_padded_attention_mode_is_checked(monkeypatch):
    from openjev.common import UserError
    from openjev.engine.kernels import padded_attention_mode

    monkeypatch.setenv("OPENJEV_PADDED_ATTENTION", "masked")
    assert padded_attention_mode() == "masked"
    monkeypatch.setenv("OPENJEV_PADDED_ATTENTION", "fast")
    with pytest.raises(UserError, match="expected rowwise, shared or masked"):
        padded_attention_mode()


@pytest.mark.gpu
def test_padded_reference_on_a_gpu_is_bitwise_the_exact_one(overlay, sample_tokens, tmp_path):
    """On a GPU (cuBLAS without split-K, attention row by row) padded forwards repeat each row's
    unpadded forward bit for bit: --batch-size 8 with --verify-rows passes and equals --batch-size 1
    (measured on the H200: results_h200/embedded_gpu/call9-rowwise). Separate processes, so this test
    process keeps its CPU kernel binding."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: padded == exact is a GPU property (cuBLAS without split-K); "
                    "measured on an H200: results_h200/embedded_gpu/call9-rowwise")
    common = ["--model", overlay, "--tokens", sample_tokens, "--device", "cuda", "--dtype", "float16", "--no-peak"]
    run_script("score_reference.py", *common, "--out", tmp_path / "exact", check=True)
    run_script("score_reference.py", *common, "--out", tmp_path / "b8", "--batch-size", "8", "--verify-rows", "8",
               check=True)
    meta = json.loads((tmp_path / "b8" / "reference.json").read_text())
    assert meta["mode"] == "padded" and meta["verify"]["bitwise_equal"] and meta["verify"]["rows"] == 8
    assert meta["kernel_path"]["padded_attention"] == "rowwise"
    assert meta["kernel_path"]["cublas_workspace_config"] == ":0:0"
    assert np.array_equal(np.load(tmp_path / "exact" / "reference.npy"), np.load(tmp_path / "b8" / "reference.npy"))


@pytest.mark.gpu
def test_exact_threads_on_a_gpu_are_bitwise_one_thread(overlay, sample_tokens):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the threaded exact path (a CUDA stream per thread) needs one "
                    "(measured on an H200: results_h200/embedded_gpu/)")
    from openjev.engine.classifier import load_classifier, score_exact

    _, rows = token_rows(sample_tokens)
    clf = load_classifier(overlay, "cuda")
    one = score_exact(clf, rows)
    assert np.array_equal(score_exact(clf, rows, threads=2), one)
    assert np.array_equal(score_exact(clf, rows, threads=3), one)
