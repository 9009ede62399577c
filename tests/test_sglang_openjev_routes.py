"""The SGLang adapter's routes (`sglang_openjev/routes.py`) on a real FastAPI app served by uvicorn on
127.0.0.1: /classify, /v1/classify, /flush_cache and /server_info. SGLang's tokenizer manager (the GPU
scheduler's front) is the one stand-in. With sglang importable the app is SGLang's own
`http_server.app` with SGLang's /server_info merged, the request object is SGLang's
`EmbeddingReqInput` and the server arguments are a real ServerArgs.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from _sglang_support import (SGLANG_ERROR, FakeTokenizerManager, LiveServer, save_checkpoint_config, server_args_stub,
                             tiny_transformers_classifier)

from sglang_openjev import contract


# ================================================================ routes on a real HTTP server
@pytest.fixture(scope="module")
def live():
    """The adapter's routes on a real uvicorn server; SGLang's app and request class when importable."""
    from sglang_openjev import routes

    state = SimpleNamespace(tokenizer_manager=None, template_manager=None,
                            scheduler_info={"max_req_input_len": 58, "max_total_num_tokens": 4096})
    env = {"OPENJEV_MAX_BATCH_SIZE": "4", "OPENJEV_ARCH_PROFILE": "sm70-tilelang"}
    if SGLANG_ERROR is None:
        from sglang.srt.entrypoints import http_server
        from sglang.srt.managers.io_struct import EmbeddingReqInput

        app, request_cls = http_server.app, EmbeddingReqInput
        previous = http_server.get_global_state()
        http_server.set_global_state(state)  # SGLang's own /server_info reads the same state
        get_state = http_server.get_global_state
    else:
        from fastapi import FastAPI

        app, request_cls, previous, get_state = FastAPI(), SimpleNamespace, None, (lambda: state)

        @app.post("/classify")
        async def sglang_style_classify():  # what install_routes must replace
            return {"embedding": "not the contract"}

    counters = routes.install_routes(app, routes.SGLangRuntime(get_state, request_cls), environ=env)
    server = LiveServer(app)
    yield SimpleNamespace(url=server.url, state=state, counters=counters, app=app)
    server.stop()
    if SGLANG_ERROR is None:
        http_server.set_global_state(previous)


@pytest.fixture
def tm(live):
    if SGLANG_ERROR is None:
        sa = sglang_server_args()
    else:
        sa = server_args_stub()
    fake = FakeTokenizerManager(sa)
    live.state.tokenizer_manager = fake
    yield fake
    live.state.tokenizer_manager = None


def post(live, path, payload=None, raw=None):
    import requests

    data = raw if raw is not None else json.dumps(payload)
    return requests.post(live.url + path, data=data, headers={"content-type": "application/json"}, timeout=30)


def test_classify_batch_and_single_rows_in_order(live, tm):
    rows = [[5, 6, 7], [9], [40, 41]]
    r = post(live, "/classify", {"input_ids": rows})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["labels"] == ["contradiction", "entailment", "neutral"]
    assert body["model"] == "openjev-tiny"
    assert body["logits"] == [FakeTokenizerManager.logits_for(x) for x in rows]
    sent = tm.requests[-1]
    assert sent.input_ids == rows and type(sent).__name__ in ("EmbeddingReqInput", "SimpleNamespace")
    r = post(live, "/classify", {"input_ids": [5, 6, 7]})
    assert r.json()["logits"] == [FakeTokenizerManager.logits_for([5, 6, 7])]
    assert tm.requests[-1].input_ids == [[5, 6, 7]]


def test_sglang_route_was_replaced(live):
    paths = [(getattr(r, "path", None), tuple(sorted(getattr(r, "methods", None) or ()))) for r in live.app.router.routes]
    classify_routes = [m for p, m in paths if p == "/classify"]
    # one route, with SGLang's own methods kept (SGLang registers POST and PUT; the fake app POST only)
    assert len(classify_routes) == 1 and set(classify_routes[0]) == ({"POST", "PUT"} if SGLANG_ERROR is None else {"POST"})
    assert sum(p == "/server_info" for p, _ in paths) == 1


@pytest.mark.parametrize("payload, raw, status, message", [
    (None, b"{not json", 400, "not valid JSON"),
    ({"input_ids": []}, None, 400, "empty"),
    ({"input_ids": [[1, 2], []]}, None, 400, "row 1 of 'input_ids' is empty"),
    ({"input_ids": [[1, 2.5]]}, None, 400, "not an integer"),
    ({"input_ids": [[1, 96]]}, None, 400, "out of vocabulary (vocab size 96)"),
    ({"input_ids": [[1] * 64]}, None, 400, "not below the server context length 64"),
    ({"input_ids": [[1] * 58]}, None, 400, "over this server's input limit of 57"),
    ({"input_ids": [[1]] * 5}, None, 413, "limit of 4"),
    ({"input_ids": [1], "text": "x"}, None, 400, "exactly one"),
])
def test_classify_errors(live, tm, payload, raw, status, message):
    r = post(live, "/classify", payload, raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["code"] == status
    assert err["type"] == (contract.TOO_LARGE if status == 413 else contract.BAD_REQUEST)
    assert tm.requests == []  # refused before anything reached the scheduler


def test_longest_accepted_input_reaches_the_runtime(live, tm):
    r = post(live, "/classify", {"input_ids": [[1] * 57]})
    assert r.status_code == 200, r.text


def test_runtime_validation_error_is_a_400_and_503_while_starting(live, tm):
    tm.fail_with = ValueError("The input (70 tokens) is longer than the model's context length (64 tokens).")
    r = post(live, "/classify", {"input_ids": [[1, 2]]})
    assert r.status_code == 400 and "rejected by the runtime" in r.json()["error"]["message"]
    tm.fail_with = None
    tm.server_status = SimpleNamespace(name="Starting")
    r = post(live, "/classify", {"input_ids": [[1, 2]]})
    assert r.status_code == 503 and r.json()["error"]["type"] == contract.UNAVAILABLE


def test_503_before_sglang_sets_its_state(live):
    assert live.state.tokenizer_manager is None
    for path in ("/classify", "/v1/classify"):
        assert post(live, path, {"input_ids": [[1]]}).status_code == 503
    import requests

    assert requests.get(live.url + "/server_info", timeout=10).status_code == 503


def test_text_input_uses_the_tokenizer(live, tm):
    r = post(live, "/classify", {"text": ["ab", "c"]})
    assert r.status_code == 200
    assert tm.requests[-1].input_ids == [[95, 95], [95]]  # ord() capped to the vocab by the fake tokenizer
    tm.tokenizer = None
    r = post(live, "/classify", {"text": "ab"})
    assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]


def test_v1_classify_softmax_by_default_and_raw_on_request(live, tm):
    rows = [[5, 6, 7], [9, 9]]
    soft = post(live, "/v1/classify", {"model": "openjev-tiny", "input": rows}).json()
    raw = post(live, "/v1/classify", {"model": "openjev-tiny", "input": rows, "use_activation": False}).json()
    assert soft["object"] == "list" and soft["model"] == "openjev-tiny"
    assert soft["usage"]["prompt_tokens"] == 5
    for i, row in enumerate(rows):
        logits = FakeTokenizerManager.logits_for(row)
        assert raw["data"][i]["probs"] == logits
        assert math.isclose(sum(soft["data"][i]["probs"]), 1.0, rel_tol=1e-9)
        assert soft["data"][i]["label"] == contract.LABELS[logits.index(max(logits))]
        assert soft["data"][i]["num_classes"] == 3 and soft["data"][i]["index"] == i
    assert post(live, "/v1/classify", {"model": "openjev-tiny", "input": [[1]] * 5}).status_code == 413


def test_flush_cache_counts_and_reports_failure(live, tm):
    import requests

    before = live.counters.flush_cache_calls
    r = requests.post(live.url + "/flush_cache", timeout=10)
    assert r.status_code == 200 and r.json()["flushed"] is True
    assert requests.get(live.url + "/flush_cache?timeout=2.5", timeout=10).status_code == 200
    assert tm.flushes == [None, 2.5]
    tm.flush_ok = False
    r = requests.post(live.url + "/flush_cache", timeout=10)
    assert r.status_code == 400 and "busy" in r.json()["error"]["message"]
    assert requests.post(live.url + "/flush_cache?timeout=x", timeout=10).status_code == 400
    assert live.counters.flush_cache_calls == before + 3
    info = requests.get(live.url + "/server_info", timeout=10).json()
    assert info["flush_cache_calls"] == before + 3 and info["flush_cache_failures"] >= 1


def test_server_info_has_the_contract_keys(live, tm):
    import requests

    info = requests.get(live.url + "/server_info", timeout=10).json()
    missing = [k for k in contract.SERVER_INFO_KEYS if k not in info]
    assert not missing
    assert info["backend"] == "sglang" and info["arch_profile"] == "sm70-tilelang"
    assert info["context_length"] == 64 and info["max_input_tokens"] == 57 and info["max_batch_size"] == 4
    from sglang_openjev.routes import mamba_strategy

    # --mamba-scheduler-strategy (fork, 0.5.13) is ServerArgs.mamba_radix_cache_strategy from 0.5.14 on
    assert info["mamba_scheduler_strategy"] == mamba_strategy(tm.server_args) is not None
    assert info["radix_cache"] is (not tm.server_args.disable_radix_cache)
    assert info["pid"] == os.getpid()
    assert set(info["bundle_git"]) >= {"commit", "dirty"}
    if SGLANG_ERROR is None:  # merged with SGLang's own /server_info
        assert info.get("internal_states") == [{"fake_internal": True}], info.get("sglang_server_info_error")
        assert "version" in info and "max_total_num_tokens" in info


def test_max_batch_size_env():
    from sglang_openjev import routes

    assert routes.max_batch_size({}) == 512
    assert routes.max_batch_size({"OPENJEV_MAX_BATCH_SIZE": "32"}) == 32
    for bad in ("0", "-1", "x"):
        with pytest.raises(ValueError, match="OPENJEV_MAX_BATCH_SIZE"):
            routes.max_batch_size({"OPENJEV_MAX_BATCH_SIZE": bad})


# ---------------------------------------------------------------- SGLang's real ServerArgs (sglang venv only)
_SGLANG_ARGS_CACHE: dict = {}


def sglang_server_args():
    """A real ServerArgs for a tiny local config (sglang venv only)."""
    if "sa" not in _SGLANG_ARGS_CACHE:
        import tempfile

        from sglang.srt.server_args import ServerArgs

        d = Path(tempfile.mkdtemp(prefix="openjev-sa-"))
        save_checkpoint_config(tiny_transformers_classifier(), d)
        sa = ServerArgs(model_path=str(d), device="cpu", is_embedding=True, skip_tokenizer_init=True,
                        dtype="float32", schedule_policy="lpm", max_running_requests=16)
        if hasattr(sa, "resolve_once"):  # 0.5.23 resolves on demand; its /server_info reads the result
            sa.resolve_once()
        _SGLANG_ARGS_CACHE["sa"] = sa
    return _SGLANG_ARGS_CACHE["sa"]
