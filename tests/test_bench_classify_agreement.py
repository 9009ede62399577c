"""bench_classify_v100.py's pure functions (`openjev/bench/`): percentiles and softmax, agreement with the
reference, option groups, the group audit's rules, the exit status and the receipt helpers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openjev.bench import agreement as bench_agreement
from openjev.bench import client as bench_client
from openjev.bench import receipt as bench_receipt


# ---------------------------------------------------------------- pure functions
def test_percentiles_and_softmax():
    s = bench_agreement.percentile_summary([1.0, 2.0, 3.0, 4.0])
    assert s["p50"] == 2.5 and s["max"] == 4.0 and s["count"] == 4 and s["p99"] == pytest.approx(3.97)
    assert bench_agreement.percentile_summary([])["p50"] is None
    from openjev.common import softmax

    p = softmax(np.array([[1000.0, 1000.0, 1000.0], [0.0, 0.0, np.log(2.0)]]))
    assert np.allclose(p[0], 1 / 3) and np.allclose(p[1], [0.25, 0.25, 0.5])


def test_agreement_lists_argmax_changes():
    ref = np.array([[0, 1, 0], [1, 0, 0]], dtype=np.float32)
    cand = np.array([[0, 1, 0], [0, 0, 2]], dtype=np.float32)
    a = bench_agreement.agreement(cand, ref, ["r0", "r1"], full=True)
    assert a["argmax_changes"] == [{"id": "r1", "reference": "contradiction", "candidate": "neutral"}]
    assert a["max_abs_logit_diff"] == 2.0 and not a["bitwise_equal"] and a["worst_rows"][0]["id"] == "r1"
    assert bench_agreement.agreement(ref, ref, ["r0", "r1"])["max_abs_dp_e"] == 0


def test_option_groups_key_on_premise_and_instruction():
    rows = [{"id": "a", "premise": "P", "instruction": "I"}, {"id": "b", "premise": "P", "instruction": "I"},
            {"id": "c", "premise": "P"}, {"id": "d", "premise": "P", "instruction": None},
            {"id": "e", "premise": "P", "instruction": ""}, {"id": "f", "premise": "Q", "instruction": "I"}]
    groups, singletons = bench_agreement.option_groups(rows)
    assert groups == [[0, 1], [2, 3]] and singletons == 2  # absent == null; "" is a value of its own


def test_audit_rules():
    ids = ["a", "b", "c"]
    g = [[0, 1, 2]]
    pe = lambda *x: np.array(x, dtype=np.float64)  # noqa: E731
    ok = bench_agreement.audit_pass(g, pe(0.1, 0.5, 0.2), pe(0.2, 0.6, 0.1), ids)
    assert ok["passed"] and ok["failures_count"] == ok["ties_count"] == 0
    bad = bench_agreement.audit_pass(g, pe(0.1, 0.5, 0.2), pe(0.1, 0.2, 0.3), ids)
    assert not bad["passed"] and bad["failures"][0]["outside_winners"] == ["c"]
    # how near a tie the failure was: the reference's lead of its winner over the row chosen, and the
    # candidate's lead of that row over the reference's winner (p_e)
    assert bad["failures"][0]["reference_margin"] == pytest.approx(0.3)
    assert bad["failures"][0]["candidate_margin"] == pytest.approx(0.1)
    # a candidate tie between the winner and a non-winner fails (position could pick the non-winner)
    ctie = bench_agreement.audit_pass(g, pe(0.1, 0.5, 0.2), pe(0.1, 0.5, 0.5), ids)
    assert not ctie["passed"] and ctie["failures"][0]["candidate_choice"] == ["b", "c"]
    # the reference ties a and b exactly; the candidate picks b: a tie, not a failure
    tie = bench_agreement.audit_pass(g, pe(0.5, 0.5, 0.2), pe(0.4, 0.6, 0.1), ids)
    assert tie["passed"] and tie["ties_count"] == 1 and tie["ties"][0]["candidate_choice"] == "b"
    assert tie["reference_tied_groups"] == 1
    # ... picks a (the reference's first winner): neither; the candidate tying both winners: candidate-tied only
    assert bench_agreement.audit_pass(g, pe(0.5, 0.5, 0.2), pe(0.6, 0.4, 0.1), ids)["ties_count"] == 0
    both = bench_agreement.audit_pass(g, pe(0.5, 0.5, 0.2), pe(0.5, 0.5, 0.1), ids)
    assert both["passed"] and both["ties_count"] == 0 and both["candidate_tied_groups"] == 1


def test_exit_status_precedence_and_helpers():
    assert bench_agreement.decide_exit(False, False, None) == 0 and bench_agreement.decide_exit(False, False, True) == 0
    assert bench_agreement.decide_exit(True, True, False) == 2
    assert bench_agreement.decide_exit(False, True, False) == 4
    assert bench_agreement.decide_exit(False, False, False) == 3
    assert [bench_client.backoff_s(i) for i in range(5)] == [0.25, 0.5, 1.0, 2.0, 2.0]
    label = bench_receipt.derive_machine_label
    assert label(None, "cuda:0 (Tesla V100-SXM2-32GB, sm_70)", None, True, "Linux", "x") == "Tesla V100-SXM2-32GB"
    assert label(None, "cpu", None, True, "Linux-x", "AMD EPYC") == "cpu: Linux-x (AMD EPYC)"
    assert label(None, "cpu", "NVIDIA H200", True, "Linux", None) == "NVIDIA H200"
    assert label("eva01 V100", "cpu", None, True, "Linux", None) == "eva01 V100"
    assert bench_receipt.out_paths(Path("/r/b.json"))["passes"] == Path("/r/b.passes.npy")
