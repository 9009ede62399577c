"""tokenize_nli.py and score_reference.py: exact ids, the reference receipt, refusals."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from conftest import SAMPLE, error_lines, run_script, token_rows, tree_digest


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


def test_custom_template_changes_the_ids(overlay, sample_tokens, tmp_path):
    out = tmp_path / "t.jsonl"
    run_script("tokenize_nli.py", "--model", overlay, "--inputs", SAMPLE, "--out", out,
               "--template", "{premise} => {hypothesis}", check=True)
    assert token_rows(out)[1] != token_rows(sample_tokens)[1]
    proc = run_script("tokenize_nli.py", "--model", overlay, "--inputs", SAMPLE, "--out", tmp_path / "u.jsonl",
                      "--template", "{premise} {oops}")
    assert proc.returncode == 1 and "unknown field" in error_lines(proc.stderr)[0]
