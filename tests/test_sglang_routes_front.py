"""The serving front on the SGLang adapter's routes (`sglang_openjev/routes.py`), over real HTTP on 127.0.0.1.

The routes run on SGLang's own FastAPI app where sglang is importable and on a plain FastAPI app
otherwise (the fake tokenizer manager of tests/_sglang_support.py stands in for SGLang's
scheduler either way). The SGLang-only checks (admin key on /flush_cache with SGLang's real
API-key middleware, PUT on /classify from SGLang's real route table) skip with the reason where
sglang is not importable; the logic they rely on is also checked on a plain app.
"""

from __future__ import annotations

import json

import pytest
import requests
from fastapi import FastAPI

from _sglang_support import SGLANG_ERROR, FakeTokenizerManager, LiveServer, server_args_stub

from sglang_openjev import contract, routes

needs_sglang = pytest.mark.skipif(SGLANG_ERROR is not None, reason=f"sglang is not importable here ({SGLANG_ERROR}); "
                                  "run with a venv that has sglang (`make test-sglang` makes one: tests/README.md)")


def post(url, path, payload=None, raw=None, method="POST", headers=None):
    data = raw if raw is not None else json.dumps(payload)
    return requests.request(method, url + path, data=data, timeout=30,
                            headers={"content-type": "application/json", **(headers or {})})


@pytest.fixture(scope="module")
def plain():
    """A plain FastAPI app that carries SGLang-style routes: /classify on POST and PUT, /flush_cache
    with a decorator attribute, as SGLang's auth_level decorator leaves on its endpoints."""
    app = FastAPI()

    async def classify():
        return {"embedding": "not the contract"}

    async def flush_cache():
        return {"sglang": True}

    flush_cache._auth_level = "ADMIN_OPTIONAL"
    app.add_api_route("/classify", classify, methods=["POST", "PUT"])
    app.add_api_route("/flush_cache", flush_cache, methods=["GET", "POST"])
    state = type("State", (), {})()
    state.tokenizer_manager = FakeTokenizerManager(server_args_stub())
    state.scheduler_info = {"max_req_input_len": 58}
    env = {"OPENJEV_MAX_BATCH_SIZE": "4", "OPENJEV_MAX_BODY_BYTES": "4096", "OPENJEV_MAX_TEXT_CHARS": "100"}
    routes.install_routes(app, routes.SGLangRuntime(lambda: state, lambda **kw: type("Req", (), kw)()), environ=env)
    server = LiveServer(app)
    yield server.url, app, state.tokenizer_manager
    server.stop()


def test_sglang_methods_and_decorator_attributes_are_kept(plain):
    url, app, tm = plain
    by_path = {}
    for r in app.router.routes:
        by_path.setdefault(getattr(r, "path", None), []).append(r)
    assert len(by_path["/classify"]) == 1 and set(by_path["/classify"][0].methods) == {"POST", "PUT"}
    assert getattr(by_path["/flush_cache"][0].endpoint, "_auth_level") == "ADMIN_OPTIONAL"
    put = post(url, "/classify", {"input_ids": [[5, 6]]}, method="PUT")
    assert put.status_code == 200 and put.json()["logits"] == [FakeTokenizerManager.logits_for([5, 6])]


def test_vllm_shape_on_classify_and_limits_before_parsing(plain):
    url, _, tm = plain
    r = post(url, "/classify", {"model": "openjev-tiny", "input": [[5, 6, 7]], "use_activation": False})
    assert r.status_code == 200 and r.json()["object"] == "list"
    assert r.json()["data"][0]["probs"] == FakeTokenizerManager.logits_for([5, 6, 7])
    r = post(url, "/classify", {"model": "openjev-tiny", "input": [[5, 6, 7]], "truncate_prompt_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == 1 and tm.requests[-1].input_ids == [[7]]
    assert post(url, "/v1/classify", {"model": "other", "input": [[1]]}).status_code == 404
    assert post(url, "/v1/classify", {"input": [[1]], "softmax": False}).json()["data"][0]["probs"] == \
        FakeTokenizerManager.logits_for([1])
    n = len(tm.requests)
    big = post(url, "/classify", {"input_ids": [[1] * 2000]})
    assert big.status_code == 413 and "4096 bytes" in big.json()["error"]["message"]
    text = post(url, "/classify", {"text": "a" * 101})
    assert text.status_code == 413 and "100 characters" in text.json()["error"]["message"]
    deep = post(url, "/classify", raw=b"[" * 2000 + b"]" * 2000)
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]
    lone = post(url, "/classify", raw=b'{"text": "\\ud800"}')
    assert lone.status_code == 400 and "surrogate" in lone.json()["error"]["message"]
    blank = post(url, "/v1/classify", {"input": " \t"})
    assert blank.status_code == 400 and "whitespace" in blank.json()["error"]["message"]
    assert len(tm.requests) == n  # nothing of the refused requests reached the runtime


def test_unexpected_exception_is_a_json_500_with_request_id(plain):
    url, _, tm = plain
    tm.fail_with = RuntimeError("scheduler pipe broken")
    try:
        r = post(url, "/classify", {"input_ids": [[1, 2]]})
    finally:
        tm.fail_with = None
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == contract.INTERNAL and err["request_id"] in err["message"] and "RuntimeError" in err["message"]


@needs_sglang
def test_flush_cache_keeps_sglangs_admin_key_and_classify_keeps_put():
    """SGLang's real app and API-key middleware: with --admin-api-key set, an unauthenticated
    POST /flush_cache is refused as SGLang's own route would be."""
    from sglang.srt.entrypoints import http_server
    from sglang.srt.utils import add_api_key_middleware

    app = FastAPI()
    for r in http_server.app.router.routes:
        if getattr(r, "path", None) in ("/flush_cache", "/classify"):
            app.router.routes.append(r)
    state = type("State", (), {})()
    state.tokenizer_manager = FakeTokenizerManager(server_args_stub())
    state.scheduler_info = {"max_req_input_len": 58}
    routes.install_routes(app, routes.SGLangRuntime(lambda: state, lambda **kw: type("Req", (), kw)()), environ={})
    add_api_key_middleware(app, api_key=None, admin_api_key="admin-secret")
    server = LiveServer(app)
    try:
        assert requests.post(server.url + "/flush_cache", timeout=10).status_code == 401
        ok = requests.post(server.url + "/flush_cache", headers={"Authorization": "Bearer admin-secret"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["flushed"] is True
        put = post(server.url, "/classify", {"input_ids": [[5]]}, method="PUT")
        assert put.status_code == 200
    finally:
        server.stop()
