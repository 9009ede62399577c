"""make_synthetic_inputs.py: option groups share their token prefix; lengths stay in range."""

from __future__ import annotations

import json

from conftest import error_lines, run_script


def rows(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def test_groups_share_prefixes_and_lengths_are_in_range(tmp_path):
    run_script("make_synthetic_inputs.py", tmp_path / "s", "--rows", "40", "--premise-tokens", "20:30",
               "--hypothesis-tokens", "3:5", "--instruction-tokens", "4", "--vocab", "100", check=True)
    inputs, tokens = rows(tmp_path / "s.jsonl"), rows(tmp_path / "s.tokens.jsonl")
    assert len(inputs) == len(tokens) == 40 and [r["id"] for r in inputs] == [t["id"] for t in tokens]
    by_group = {}
    for r, t in zip(inputs, tokens):
        assert 4 + 20 + 3 <= len(t["input_ids"]) <= 4 + 30 + 5
        assert all(3 <= i < 100 for i in t["input_ids"])
        by_group.setdefault((r["premise"], r["instruction"]), []).append(t["input_ids"])
    multi = [g for g in by_group.values() if len(g) > 1]
    assert multi, "expected some option groups"
    for g in multi:
        premise_len = min(len(x) for x in g) - 5
        assert all(x[:premise_len] == g[0][:premise_len] for x in g)


def test_same_seed_same_files_and_existing_output_refused(tmp_path):
    run_script("make_synthetic_inputs.py", tmp_path / "a", "--rows", "5", check=True)
    run_script("make_synthetic_inputs.py", tmp_path / "b", "--rows", "5", check=True)
    assert (tmp_path / "a.tokens.jsonl").read_bytes() == (tmp_path / "b.tokens.jsonl").read_bytes()
    before = (tmp_path / "a.jsonl").read_bytes()
    proc = run_script("make_synthetic_inputs.py", tmp_path / "a", "--rows", "7")
    assert proc.returncode == 1 and "already exists" in error_lines(proc.stderr)[0]
    assert (tmp_path / "a.jsonl").read_bytes() == before


def test_bad_range_is_a_usage_error(tmp_path):
    proc = run_script("make_synthetic_inputs.py", tmp_path / "a", "--rows", "5", "--premise-tokens", "9:3")
    assert proc.returncode == 2 and "MIN <= MAX" in proc.stderr
