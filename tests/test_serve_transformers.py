"""The embedded backend over real HTTP on 127.0.0.1: contract, errors, batching, lifecycle."""

from __future__ import annotations

import json
import math
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import strict_loading_cases
from conftest import error_lines, free_port, run_script, start_server, token_rows

from openjev import http_front as http_front

LABELS = ["contradiction", "entailment", "neutral"]


def classify(url, body, raw=False):
    data = body if raw else json.dumps(body)
    return requests.post(f"{url}/classify", data=data, headers={"Content-Type": "application/json"}, timeout=120)


def test_logits_equal_the_reference_bitwise(server, sample_tokens, reference):
    ids, rows = token_rows(sample_tokens)
    resp = classify(server.url, {"input_ids": rows})
    assert resp.status_code == 200
    body = resp.json()
    assert body["labels"] == LABELS
    got = np.asarray(body["logits"], dtype=np.float32)
    ref = np.load(reference / "reference.npy")
    assert got.shape == (len(rows), 3)
    assert np.array_equal(got, ref), np.abs(got - ref).max()


def test_single_row_form_and_input_order(server, sample_tokens, reference):
    _, rows = token_rows(sample_tokens)
    ref = np.load(reference / "reference.npy")
    one = classify(server.url, {"input_ids": rows[3]}).json()["logits"]
    assert np.array_equal(np.asarray(one, dtype=np.float32), ref[3:4])
    rev = classify(server.url, {"input_ids": rows[::-1]}).json()["logits"]
    assert np.array_equal(np.asarray(rev, dtype=np.float32), ref[::-1])


@pytest.mark.parametrize("body,status,words", [
    (b"{not json", 400, ["not valid JSON"]),
    (b"[1, 2]", 400, ["JSON object"]),
    ({"input_ids": []}, 400, ["empty"]),
    ({"input_ids": [[1, 2], []]}, 400, ["row 1", "empty"]),
    ({"input_ids": [[1, 2.5]]}, 400, ["not an integer"]),
    ({"input_ids": [[1, True]]}, 400, ["not an integer"]),
    ({"input_ids": [["7"]]}, 400, ["not an integer"]),
    ({"input_ids": [[1, 512]]}, 400, ["out of vocabulary", "512"]),
    ({"input_ids": [[-1]]}, 400, ["out of vocabulary"]),
    ({"input_ids": [[1] * 8192]}, 400, ["8192", "context length", "exactly equal"]),
    ({"input_ids": [[1]] * 513}, 413, ["513", "512"]),
    ({"input_ids": [[1]], "text": "x"}, 400, ["exactly one"]),
    ({}, 400, ["exactly one"]),
], ids=["bad-json", "not-object", "empty", "empty-row", "float", "bool", "string", "oov", "negative",
        "at-context-length", "over-batch-limit", "ids-and-text", "nothing"])
def test_each_error_case(server, body, status, words):
    resp = classify(server.url, body, raw=isinstance(body, bytes))
    assert resp.status_code == status
    err = resp.json()["error"]
    assert err["code"] == status and err["type"]
    for w in words:
        assert w in err["message"], err["message"]


def test_one_below_context_length_is_accepted(overlay, tmp_path):
    srv = start_server(overlay, tmp_path / "log", "--context-length", "64")
    try:
        assert classify(srv.url, {"input_ids": [[5] * 63]}).status_code == 200
        resp = classify(srv.url, {"input_ids": [[5] * 64]})
        assert resp.status_code == 400 and "64" in resp.json()["error"]["message"]
    finally:
        srv.stop()


def test_bad_rows_do_not_disturb_concurrent_good_requests(server, sample_tokens, reference):
    _, rows = token_rows(sample_tokens)
    ref = np.load(reference / "reference.npy")
    bad = {"input_ids": [rows[0], [1, 10**9]]}

    def good(i):
        sel = [(i + k) % len(rows) for k in range(5)]
        r = classify(server.url, {"input_ids": [rows[j] for j in sel]})
        return r.status_code, np.asarray(r.json()["logits"], dtype=np.float32), sel

    with ThreadPoolExecutor(12) as pool:
        goods = [pool.submit(good, i) for i in range(16)]
        bads = [pool.submit(classify, server.url, bad) for _ in range(8)]
        for f in goods:
            status, got, sel = f.result()
            assert status == 200 and np.array_equal(got, ref[sel])
        for f in bads:
            assert f.result().status_code == 400
    info = requests.get(f"{server.url}/server_info").json()
    assert info["counters"]["steps"] < info["counters"]["requests"], "concurrent requests were never batched together"


def test_text_input_uses_the_tokenizer(server, overlay):
    from transformers import AutoTokenizer

    text = "Premise: the cat sleeps.\nHypothesis: an animal rests."
    ids = AutoTokenizer.from_pretrained(overlay)(text)["input_ids"]
    by_text = classify(server.url, {"text": [text]}).json()["logits"]
    by_ids = classify(server.url, {"input_ids": [ids]}).json()["logits"]
    assert by_text == by_ids


def test_v1_classify_shape_softmax_and_raw(server, sample_tokens, reference):
    _, rows = token_rows(sample_tokens)
    ref = np.load(reference / "reference.npy")
    model = requests.get(f"{server.url}/v1/models").json()["data"][0]["id"]  # vLLM: another name is 404
    body = requests.post(f"{server.url}/v1/classify", json={"model": model, "input": rows[:3]}).json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for d, r in zip(body["data"], ref[:3]):
        assert d["num_classes"] == 3 and d["label"] == LABELS[int(np.argmax(r))]
        e = np.exp(r.astype(np.float64) - r.max())
        assert np.allclose(d["probs"], e / e.sum(), rtol=0, atol=1e-7)
        assert math.isclose(sum(d["probs"]), 1.0, abs_tol=1e-9)
    assert body["usage"]["prompt_tokens"] == sum(len(r) for r in rows[:3])
    raw = requests.post(f"{server.url}/v1/classify", json={"model": model, "input": rows[:3], "use_activation": False}).json()
    assert np.array_equal(np.asarray([d["probs"] for d in raw["data"]], dtype=np.float32), ref[:3])
    bad = requests.post(f"{server.url}/v1/classify", json={"model": model, "input": [[1, 99999]]})
    assert bad.status_code == 400 and "out of vocabulary" in bad.json()["error"]["message"]


def test_flush_cache_is_a_counted_no_op_and_server_info(server, overlay):
    before = requests.get(f"{server.url}/server_info").json()["flush_cache_calls"]
    r = requests.post(f"{server.url}/flush_cache")
    assert r.status_code == 200 and r.json()["flushed"] is False and "no prefix cache" in r.json()["message"]
    info = requests.get(f"{server.url}/server_info").json()
    assert info["flush_cache_calls"] == before + 1
    from sglang_openjev.contract import SERVER_INFO_KEYS

    assert set(SERVER_INFO_KEYS) <= set(info)
    assert info["backend"] == "transformers" and info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["context_length"] == 8192 and info["radix_cache"] is False and info["batching"] == "exact"
    assert info["model_path"] == str(overlay)


def test_health_is_503_while_loading_then_200(overlay, tmp_path):
    srv = start_server(overlay, tmp_path / "log", wait=False)
    try:
        statuses, refused = [], 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                r = requests.get(f"{srv.url}/health", timeout=2)
            except requests.ConnectionError:
                time.sleep(0.05)
                continue
            statuses.append(r.status_code)
            if r.status_code == 503:
                c = classify(srv.url, {"input_ids": [[1, 2]]})
                if c.status_code == 200:  # loading ended between the two requests: ready now, then
                    assert requests.get(f"{srv.url}/health", timeout=2).status_code == 200
                    statuses.append(200)
                    break
                assert c.status_code == 503 and c.json()["error"]["type"] == "service_unavailable"
                refused += 1
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert statuses[0] == 503 and statuses[-1] == 200, statuses
        assert refused >= 1 or statuses.count(503) == 1, statuses  # a classify while loading got 503
        # start-up answers are not errors, and HEAD /health (as load balancers send it) is served
        assert requests.get(f"{srv.url}/server_info", timeout=5).json()["counters"]["errors_5xx"] == 0
        metrics = requests.get(f"{srv.url}/metrics", timeout=5).text
        assert 'openjev_errors_total{type="service_unavailable"} 0.0' in metrics
        assert 'openjev_http_requests_total{route="/health",status="503"}' in metrics
        head = requests.head(f"{srv.url}/health", timeout=5)
        assert head.status_code == 200 and head.content == b""
    finally:
        srv.stop()


def test_port_out_of_range_is_one_line(overlay):
    for port in ("70000", "0", "-1"):
        proc = run_script("serve_transformers.py", overlay, port, timeout=60)
        lines = error_lines(proc.stderr)
        assert proc.returncode == 1 and len(lines) == 1 and f"port {port} is out of range" in lines[0], proc.stderr


def test_port_in_use_is_refused(overlay):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        proc = run_script("serve_transformers.py", overlay, port, timeout=60)
        assert proc.returncode == 1
        assert error_lines(proc.stderr) == [
            error_lines(proc.stderr)[0]] and f"port {port} on 127.0.0.1 is already in use" in proc.stderr
    finally:
        holder.close()


def test_model_that_fails_to_load_exits_nonzero_with_one_line(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "num_labels": 3,
                                                 "id2label": {"0": "contradiction", "1": "entailment", "2": "neutral"}}))
    proc = run_script("serve_transformers.py", bad, free_port(), timeout=120)
    assert proc.returncode == 1
    assert len(error_lines(proc.stderr)) == 1 and "failed to load" in error_lines(proc.stderr)[0]


def test_padded_batching_agrees_within_float32_tolerance(overlay, sample_tokens, reference, tmp_path):
    _, rows = token_rows(sample_tokens)
    ref = np.load(reference / "reference.npy")
    srv = start_server(overlay, tmp_path / "log", "--batching", "padded", "--max-running-requests", "8",
                       "--log-level", "debug")
    try:
        got = np.asarray(classify(srv.url, {"input_ids": rows}).json()["logits"], dtype=np.float32)
        info = requests.get(f"{srv.url}/server_info").json()
    finally:
        srv.stop()
    from openjev.engine.batching import length_groups

    groups = length_groups([len(r) for r in rows], 8)  # one step: the whole request fits the budget
    forwards, padded = len(groups), sum(max(len(rows[i]) for i in g) * len(g) for g in groups)
    assert sum(len(r) for r in rows) <= 16384 and forwards >= math.ceil(len(rows) / 8)
    assert info["batching"] == "padded" and info["counters"]["forward_passes"] == forwards
    assert info["counters"]["padded_tokens"] == padded >= sum(len(r) for r in rows)
    # --log-level debug: one line per step with its rows, forwards and padded tokens
    assert (f"step 1: {len(rows)} rows of 1 requests, {sum(len(r) for r in rows)} tokens, {forwards} forwards, "
            f"{padded} padded tokens") in (tmp_path / "log").read_text()
    assert np.abs(got - ref).max() < 1e-5
    assert (got.argmax(1) == ref.argmax(1)).all()


def test_sigterm_stops_gracefully(overlay, tmp_path):
    srv = start_server(overlay, tmp_path / "log")
    # uvicorn finishes in-flight requests, then re-raises the signal it caught, as a Unix
    # server should (systemd counts SIGTERM as a clean stop).
    assert srv.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    log = srv.log.read_text()
    assert "Shutting down" in log and "Finished server process" in log


def test_sigterm_under_load_answers_every_admitted_request(overlay, tmp_path):
    """A request that cannot finish within the drain window gets a 503 with Retry-After before the
    server exits; one that can finish gets its 200; no client sees a dropped connection."""
    # a drain window the short request meets on a loaded 2-core machine (it waits for one step of the
    # long one, then runs), and a long request of 1.3M tokens, about a minute there, that none meets
    srv = start_server(overlay, tmp_path / "log", "--drain-seconds", "10")
    answers: dict[str, object] = {}

    def send(name, rows):
        try:
            r = classify(srv.url, {"input_ids": rows})
            answers[name] = (r.status_code, r.headers.get("Retry-After"), r.json())
        except requests.RequestException as exc:
            answers[name] = exc

    long = threading.Thread(target=send, args=("long", [[7] * 8191] * 160))
    short = threading.Thread(target=send, args=("short", [[8] * 4000] * 2))
    long.start()
    time.sleep(0.3)
    short.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    long.join(120)
    short.join(120)
    assert srv.proc.wait(60) in (0, -signal.SIGTERM)
    assert answers["short"][0] == 200, answers["short"]
    status, retry_after, body = answers["long"]
    assert status == 503 and retry_after and "shutting down" in body["error"]["message"], answers["long"]
    assert time.monotonic() - t0 < 30  # the drain window, not uvicorn's own 30 s


# ---------------------------------------------------------------- strict loading
@pytest.mark.parametrize("case", strict_loading_cases.CASES)
def test_embedded_loader_refuses_the_corrupted_checkpoints(tiny_model, tmp_path, case):
    """The five checkpoints SGLang's loader refuses (tests/test_sglang_openjev_model_loading.py) are refused here
    too, with the same words; Transformers alone would warn and initialise at random."""
    from openjev.common import UserError
    from openjev.engine.classifier import load_classifier

    expect = strict_loading_cases.write_case(tiny_model["checkpoint"], tmp_path / case, case)
    with pytest.raises(UserError) as err:
        load_classifier(tmp_path / case, "cpu")
    assert str(err.value).startswith(f"refusing the checkpoint {tmp_path / case}: ")
    for fragment in expect:
        assert fragment in str(err.value)


def test_documented_ignored_tensors_still_load(tiny_model, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from openjev.engine.classifier import load_classifier

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model["checkpoint"], ckpt)
    state = load_file(str(ckpt / "model.safetensors"))
    hidden = state["score.weight"].shape[1]
    state.update({"lm_head.weight": torch.zeros(8, hidden), "mtp.fc.weight": torch.zeros(2, 2)})
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    assert load_classifier(ckpt, "cpu").model.score.weight.shape[1] == hidden


def test_server_with_a_corrupted_checkpoint_never_reports_healthy(tiny_model, tmp_path):
    expect = strict_loading_cases.write_case(tiny_model["checkpoint"], tmp_path / "deleted", "deleted")
    srv = start_server(tmp_path / "deleted", tmp_path / "log", wait=False)
    statuses = []
    try:
        deadline = time.monotonic() + 120
        while srv.proc.poll() is None and time.monotonic() < deadline:
            try:
                statuses.append(requests.get(f"{srv.url}/health", timeout=2).status_code)
            except requests.ConnectionError:
                pass
            time.sleep(0.05)
    finally:
        code = srv.stop()
    log = srv.log.read_text()
    assert code == 1 and 200 not in statuses and set(statuses) <= {503}, (code, statuses, log[-2000:])
    lines = error_lines(log)
    assert len(lines) == 1 and "model failed to load" in lines[0] and expect[0] in lines[0], log[-2000:]


def _server_writes_per_response(http_protocol) -> list[int]:
    """Serve three JSON responses (FastAPI, as the backend) with uvicorn on 127.0.0.1 and count the
    writes the server's real asyncio transports made for each (a counting wrapper around
    _SelectorSocketTransport.write; the client is http.client, so every counted write is the server's)."""
    import asyncio
    import http.client
    import threading
    from asyncio import selector_events

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from openjev.common import bind_listen_socket

    app = FastAPI()

    @app.post("/classify")
    async def classify():
        return JSONResponse({"logits": [[0.25, -1.5, 3.0]]})

    writes: list[bytes] = []
    original = selector_events._SelectorSocketTransport.write

    def counting(self, data):
        writes.append(bytes(data))
        return original(self, data)

    port = free_port()
    sock = bind_listen_socket("127.0.0.1", port)
    kwargs = {} if http_protocol is None else {"http": http_protocol}
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", **kwargs))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    selector_events._SelectorSocketTransport.write = counting
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        counts = []
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for _ in range(3):
            before = len(writes)
            conn.request("POST", "/classify", body=b"{}", headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read()) == {"logits": [[0.25, -1.5, 3.0]]}
            counts.append(len(writes) - before)
        conn.close()
    finally:
        selector_events._SelectorSocketTransport.write = original
        server.should_exit = True
        thread.join(10)
        sock.close()
    return counts


def test_a_response_leaves_the_backend_in_one_write():
    """A replica SIGKILLed between the header write and the body write (failover under load) left
    the gateway with headers and no body: the client got IncompleteRead, which HAProxy cannot
    retry (CI, test_replica_crash_fails_no_request_and_the_replica_rejoins). uvicorn alone writes
    each response in pieces; the backend's protocol writes each response once."""
    assert all(n >= 2 for n in _server_writes_per_response(None))  # the defect: several writes
    assert _server_writes_per_response(http_front.coalescing_h11_protocol()) == [1, 1, 1]
