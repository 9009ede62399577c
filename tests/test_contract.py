"""The `/classify` wire contract (`sglang_openjev/contract.py`, SPEC section 2) as pure functions.

Both servers (the SGLang adapter and the embedded Transformers backend) answer through these
functions, so every refusal and response shape is pinned here once; no server, no torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

from sglang_openjev import contract
from sglang_openjev.contract import ContractError, Limits

LIMITS = Limits(vocab_size=100, context_length=16, max_batch_size=4)


def refused(fn, *args) -> ContractError:
    with pytest.raises(ContractError) as info:
        fn(*args)
    return info.value


def tokenize(texts):
    return [[len(t), 1] for t in texts]


# ---------------------------------------------------------------- request parsing: accepted
def test_batch_and_single_rows():
    assert contract.parse_classify({"input_ids": [[1, 2], [3]]}, LIMITS) == [[1, 2], [3]]
    assert contract.parse_classify({"input_ids": [1, 2, 3]}, LIMITS) == [[1, 2, 3]]


def test_boundaries_accepted():
    assert contract.validate_rows([[0, 99]], LIMITS) == [[0, 99]]            # vocabulary edges
    assert contract.validate_rows([[1] * 15], LIMITS) == [[1] * 15]          # context length - 1
    assert len(contract.validate_rows([[1]] * 4, LIMITS)) == 4               # exactly the batch limit


def test_text_goes_through_the_tokenizer():
    assert contract.parse_classify({"text": "abc"}, LIMITS, tokenize) == [[3, 1]]
    assert contract.parse_classify({"text": ["a", "bb"]}, LIMITS, tokenize) == [[1, 1], [2, 1]]


def test_json_parsing():
    assert contract.parse_json(b'{"input_ids": [1]}') == {"input_ids": [1]}
    for raw in (b"{", b"\xff\xfe", b""):
        err = refused(contract.parse_json, raw)
        assert err.status == 400 and "not valid JSON" in err.message


# ---------------------------------------------------------------- request parsing: every 4xx
@pytest.mark.parametrize("body, status, message", [
    ([1, 2], 400, "JSON object"),
    ({}, 400, "exactly one of 'input_ids' or 'text'"),
    ({"input_ids": [1], "text": "x"}, 400, "exactly one"),
    ({"input_ids": []}, 400, "'input_ids' is empty"),
    ({"input_ids": None}, 400, "'input_ids' is empty"),
    ({"input_ids": "1 2"}, 400, "'input_ids' is empty"),
    ({"input_ids": [[1], []]}, 400, "row 1 of 'input_ids' is empty"),
    ({"input_ids": [[1], 2]}, 400, "row 1 of 'input_ids' is not a list"),
    ({"input_ids": [[1, 2.0]]}, 400, "row 0 position 1: token id 2.0 is not an integer"),
    ({"input_ids": [[1, "2"]]}, 400, "is not an integer"),
    ({"input_ids": [[True]]}, 400, "is not an integer"),
    ({"input_ids": [[1, -1]]}, 400, "token id -1 is out of vocabulary (vocab size 100)"),
    # the first bad token of a row is the one named, whatever follows it
    ({"input_ids": [[1], [5] * 9 + [True, -1, 2.0]]}, 400, "row 1 position 9: token id True is not an integer"),
    ({"input_ids": [[7] * 12 + [100, "x"]]}, 400, "row 0 position 12: token id 100 is out of vocabulary"),
    ({"input_ids": [[100]]}, 400, "token id 100 is out of vocabulary"),
    ({"input_ids": [[1] * 16]}, 400, "16 tokens, not below the server context length 16"),
    ({"input_ids": [[1] * 40]}, 400, "not below the server context length"),
    ({"input_ids": [[1]] * 5}, 413, "batch of 5 inputs exceeds this server's limit of 4"),
    ({"text": ""}, 400, "item 0 of 'text' is an empty string"),
    ({"text": []}, 400, "'text' is empty"),
    ({"text": ["a", 3]}, 400, "item 1 of 'text' is not a string"),
    ({"text": ["a"] * 5}, 413, "limit of 4"),
])
def test_classify_refusals(body, status, message):
    err = refused(contract.parse_classify, body, LIMITS, tokenize)
    assert err.status == status
    assert message in err.message
    assert err.type == (contract.TOO_LARGE if status == 413 else contract.BAD_REQUEST)
    assert err.body() == {"error": {"message": err.message, "type": err.type, "code": status}}


def test_int_subclasses_other_than_bool_are_token_ids():
    import enum

    class Tok(enum.IntEnum):
        A = 3

    assert contract.validate_rows([[1, Tok.A, 2]], LIMITS) == [[1, Tok.A, 2]]


def test_context_length_message_explains_the_equal_case():
    err = refused(contract.validate_rows, [[1] * 16], LIMITS)
    assert "exactly equal to it is rejected too" in err.message and "truncate client-side" in err.message


def test_text_without_a_tokenizer():
    err = refused(contract.parse_classify, {"text": "a"}, LIMITS, None)
    assert err.status == 400 and "no tokenizer" in err.message


def test_a_bad_row_refuses_the_whole_request_before_scoring():
    # The refusal names the bad row; nothing is returned for the good rows (nothing was scored).
    err = refused(contract.validate_rows, [[1, 2], [3, 200], [4]], LIMITS)
    assert err.message.startswith("row 1 ")


def test_runtime_input_limit_below_the_context_length():
    limits = Limits(vocab_size=100, context_length=16, max_batch_size=4, max_input_tokens=10)
    assert contract.validate_rows([[1] * 10], limits) == [[1] * 10]
    err = refused(contract.validate_rows, [[1] * 11], limits)
    assert err.status == 400 and "over this server's input limit of 10 tokens (context length 16" in err.message
    err = refused(contract.validate_rows, [[1] * 16], limits)  # the context-length message still wins
    assert "not below the server context length 16" in err.message
    assert Limits(100, 16, 4).max_input_tokens is None  # positional construction keeps working


# ---------------------------------------------------------------- /classify response
def test_classify_response_shape_and_order():
    body = contract.classify_response([[0.5, -1.0, 2.0], [1, 2, 3]], "m")
    assert body == {"logits": [[0.5, -1.0, 2.0], [1.0, 2.0, 3.0]],
                    "labels": ["contradiction", "entailment", "neutral"], "model": "m"}
    assert all(isinstance(x, float) for row in body["logits"] for x in row)
    json.dumps(body)


def test_float32_logits_survive_json_exactly():
    import struct

    f32 = struct.unpack("f", struct.pack("f", 0.1))[0]  # a float32 value
    body = json.loads(json.dumps(contract.classify_response([[f32, 0.0, -f32]], "m")))
    assert struct.pack("f", body["logits"][0][0]) == struct.pack("f", 0.1)


# ---------------------------------------------------------------- /v1/classify
@pytest.mark.parametrize("value, rows", [
    ([[1, 2], [3]], [[1, 2], [3]]),
    ([5, 6], [[5, 6]]),
    ("ab", [[2, 1]]),
    (["a", "bcd"], [[1, 1], [3, 1]]),
])
def test_v1_inputs(value, rows):
    got, use_activation = contract.parse_v1_classify({"model": "x", "input": value}, LIMITS, tokenize)
    assert got == rows and use_activation is True


def test_v1_use_activation():
    body = {"model": "x", "input": [[1]]}
    assert contract.parse_v1_classify({**body, "use_activation": False}, LIMITS)[1] is False
    assert contract.parse_v1_classify({**body, "use_activation": None}, LIMITS)[1] is True
    err = refused(contract.parse_v1_classify, {**body, "use_activation": "no"}, LIMITS)
    assert err.status == 400 and "use_activation" in err.message


@pytest.mark.parametrize("body, status, message", [
    ("x", 400, "JSON object with 'input'"),
    ({"model": "x"}, 400, "missing 'input'"),
    ({"input": []}, 400, "'input' is empty"),
    ({"input": [[1, 100]]}, 400, "out of vocabulary"),
    ({"input": [[1] * 16]}, 400, "context length"),
    ({"input": [[1]] * 5}, 413, "limit of 4"),
    ({"input": ["a"] * 5}, 413, "limit of 4"),
    ({"input": ["a", ""]}, 400, "empty string"),
])
def test_v1_refusals(body, status, message):
    err = refused(contract.parse_v1_classify, body, LIMITS, tokenize)
    assert err.status == status and message in err.message


def test_v1_response_softmax_by_default_raw_on_request():
    logits = [[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]]
    rows = [[1, 2, 3], [4]]
    soft = contract.v1_classify_response(logits, rows, "m", use_activation=True)
    raw = contract.v1_classify_response(logits, rows, "m", use_activation=False)
    assert soft["object"] == "list" and soft["model"] == "m" and soft["id"].startswith("classify-")
    assert isinstance(soft["created"], int)
    assert soft["usage"] == {"prompt_tokens": 4, "total_tokens": 4, "completion_tokens": 0,
                             "prompt_tokens_details": None}
    for i, row in enumerate(logits):
        d_soft, d_raw = soft["data"][i], raw["data"][i]
        assert d_soft["index"] == d_raw["index"] == i
        assert d_soft["num_classes"] == 3
        assert d_raw["probs"] == row
        expected = [math.exp(x) / sum(math.exp(y) for y in row) for x in row]
        assert d_soft["probs"] == pytest.approx(expected, rel=1e-12)
        assert math.isclose(sum(d_soft["probs"]), 1.0)
        assert d_soft["label"] == d_raw["label"] == contract.LABELS[row.index(max(row))]
    assert [d["label"] for d in soft["data"]] == ["entailment", "neutral"]


def test_softmax_is_stable_for_large_logits():
    probs = contract.softmax([1000.0, 1000.0, -1000.0])
    assert probs == pytest.approx([0.5, 0.5, 0.0])


# ---------------------------------------------------------------- label order and server info
def test_label_order_check():
    contract.check_label_order({0: "contradiction", 1: "entailment", 2: "neutral"}, 3)
    contract.check_label_order({"0": "Contradiction", "1": "ENTAILMENT", "2": "neutral"}, 3)
    with pytest.raises(ValueError, match="3-label"):
        contract.check_label_order({0: "contradiction", 1: "entailment"}, 2)
    with pytest.raises(ValueError, match="expected id2label"):
        contract.check_label_order({0: "entailment", 1: "neutral", 2: "contradiction"}, 3)
    with pytest.raises(ValueError, match="expected id2label"):
        contract.check_label_order(None, 3)


def test_server_info_requires_every_key():
    fields = {k: None for k in contract.SERVER_INFO_KEYS}
    assert contract.server_info(**fields, extra=1)["extra"] == 1
    fields.pop("flush_cache_calls")
    with pytest.raises(KeyError, match="flush_cache_calls"):
        contract.server_info(**fields)


# ---------------------------------------------------------------- bounded work, vLLM shapes
def tokenize_kw(texts, add_special_tokens=True):
    return [([99] if add_special_tokens else []) + [ord(c) % 90 for c in t] for t in texts]


def test_deep_json_is_a_400_not_a_recursion_error():
    err = refused(contract.parse_json, b"[" * 100_000 + b"]" * 100_000)
    assert err.status == 400 and "nested too deeply" in err.message


def test_text_limits_are_checked_before_the_tokenizer_runs():
    calls = []

    def counting(texts, add_special_tokens=True):
        calls.append(texts)
        return tokenize_kw(texts, add_special_tokens)

    limits = Limits(vocab_size=100, context_length=16, max_batch_size=4, max_text_chars=10)
    err = refused(contract.parse_classify, {"text": "x" * 11}, limits, counting)
    assert err.status == 413 and err.type == contract.TOO_LARGE and "10 characters" in err.message
    err = refused(contract.parse_classify, {"text": ["abcdef", "ghijk"]}, limits, counting)  # 11 in total
    assert err.status == 413
    for bad, words in (("\ud800", "surrogate"), (" \n\t", "whitespace"), ("", "empty")):
        err = refused(contract.parse_classify, {"text": ["ok", bad]}, limits, counting)
        assert err.status == 400 and words in err.message and "item 1" in err.message
    assert calls == []  # nothing reached the tokenizer
    refused(contract.check_body_size, 101, 100)
    contract.check_body_size(100, 100)


def test_tokenizer_exceptions_become_400():
    def broken(texts):
        raise TypeError("TextEncodeInput must be Union[...]")

    err = refused(contract.parse_classify, {"text": "abc"}, LIMITS, broken)
    assert err.status == 400 and "tokenizer refused" in err.message


def test_vllm_request_detection():
    assert contract.is_vllm_request({"model": "m", "input": [[1]]})
    assert not contract.is_vllm_request({"input_ids": [[1]]}) and not contract.is_vllm_request({"text": "x"})
    assert not contract.is_vllm_request({"input": [[1]], "input_ids": [[1]]}) and not contract.is_vllm_request([1])


def test_vllm_activation_flags_and_model():
    parse = contract.parse_vllm_classify
    assert parse({"input": [[1, 2]]}, LIMITS, served_model="m").use_activation is True
    for key in ("use_activation", "activation", "softmax"):
        assert parse({"input": [[1, 2]], key: False}, LIMITS).use_activation is False
        assert refused(parse, {"input": [[1]], key: "no"}, LIMITS).status == 400
    assert parse({"model": "m", "input": [[1]]}, LIMITS, served_model="m").rows == [[1]]
    assert parse({"model": None, "input": [[1]]}, LIMITS, served_model="m").rows == [[1]]
    err = refused(parse, {"model": "other", "input": [[1]]}, LIMITS, None, "m")
    assert err.status == 404 and err.type == contract.NOT_FOUND and "other" in err.message


def test_truncate_prompt_tokens_keeps_the_last_tokens_and_is_reported():
    parse = contract.parse_vllm_classify
    req = parse({"input": [[1, 2, 3, 4], [5]], "truncate_prompt_tokens": 2}, LIMITS)
    assert req.rows == [[3, 4], [5]] and req.truncated_rows == 1 and req.truncate_prompt_tokens == 2
    body = contract.v1_classify_response([[0.0, 1.0, 2.0]] * 2, req.rows, "m", True, request=req)
    assert body["usage"]["prompt_tokens"] == 3 and body["truncation"] == {"truncate_prompt_tokens": 2, "truncated_inputs": 1}
    assert set(body["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"}
    long = parse({"input": [[1] * 30], "truncate_prompt_tokens": -1}, LIMITS)  # -1: the server's limit (15)
    assert long.rows == [[1] * 15]
    for bad in (0, -2, 1.5, "3", 16):
        assert refused(parse, {"input": [[1]], "truncate_prompt_tokens": bad}, LIMITS).status == 400
    err = refused(parse, {"input": [[1] * 16]}, LIMITS)  # no truncation unless asked
    assert err.status == 400 and "truncate_prompt_tokens" in err.message and "never truncates" not in err.message
    assert "never truncates" in refused(contract.parse_classify, {"input_ids": [[1] * 16]}, LIMITS).message
    err = refused(parse, {"messages": [{"role": "user", "content": "a"}]}, LIMITS)
    assert err.status == 400 and "chat template" in err.message
    text = parse({"input": "abcd", "truncate_prompt_tokens": 2, "add_special_tokens": False}, LIMITS, tokenize_kw)
    assert text.rows == [[ord("c") % 90, ord("d") % 90]]
    assert parse({"input": ["ab"]}, LIMITS, tokenize_kw).rows == [[99, ord("a") % 90, ord("b") % 90]]


def test_tokenize_and_detokenize_requests():
    limits = Limits(vocab_size=100, context_length=16, max_batch_size=4, max_text_chars=5)
    assert contract.parse_tokenize({"model": "m", "prompt": "abc"}, limits, "m") == ("abc", True, False)
    assert contract.parse_tokenize({"prompt": "abc", "add_special_tokens": False, "return_token_strs": True},
                                   limits) == ("abc", False, True)
    assert refused(contract.parse_tokenize, {"prompt": "abcdef"}, limits).status == 413
    assert refused(contract.parse_tokenize, {"model": "x", "prompt": "a"}, limits, "m").status == 404
    assert refused(contract.parse_tokenize, {"messages": []}, limits).status == 400
    assert contract.tokenize_response([1, 2], 16) == {"count": 2, "max_model_len": 16, "tokens": [1, 2], "token_strs": None}
    assert contract.parse_detokenize({"tokens": [1, 99]}, limits) == [1, 99]
    assert refused(contract.parse_detokenize, {"tokens": [100]}, limits).status == 400
    assert refused(contract.parse_detokenize, {"tokens": "12"}, limits).status == 400


def test_rows_over_the_batch_limit_are_counted_before_parsing():
    assert contract.count_lists(b'{"input_ids": [[1, 2], [3]]}') == 3
    assert contract.count_lists(b'{"text": ["a [[[ b", "c\\" [ d"]}') == 1  # brackets inside strings do not count
    assert contract.parse_json(b'{"input_ids": [[1], [2], [3]]}', max_rows=3) == {"input_ids": [[1], [2], [3]]}
    assert contract.parse_json(b'{"input_ids": [1, 2, 3, 4, 5]}', max_rows=1) == {"input_ids": [1, 2, 3, 4, 5]}
    assert contract.parse_json(b'{"text": ["[[[[[[[[", "x"]}', max_rows=2) == {"text": ["[[[[[[[[", "x"]}
    assert contract.count_lists(b'{"input_ids": [[ [1]], [2]]}') is None  # three deep: left to the parser
    assert refused(contract.parse_json, b"[" * 5000 + b"]" * 5000, 3).status == 400  # nested too deeply
    err = refused(contract.parse_json, b'{"input_ids": [[1], [2], [3], [4]]}', 3)
    assert err.status == 413 and err.type == contract.TOO_LARGE and "batch of 4 inputs" in err.message
