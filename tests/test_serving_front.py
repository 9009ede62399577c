"""The serving front over real HTTP on 127.0.0.1: no request freezes or crashes the embedded server, vLLM
clients work unchanged, Prometheus metrics.

Each test reproduces a case measured against the old server (the list of measured cases) and checks the
outcome, not the speed: "/health answered while ..." is an answer within a 2 s client timeout (the
old server was frozen for 20 s), "the small request is not held behind the big one" is completion
order. Speed figures live in benchmarks/results_cpu/serving_front_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import psutil
import pytest
import requests
from conftest import REPO, start_server, token_rows

from openjev import http_front as http_front
from openjev.engine import batching
from openjev.engine import scheduler as engine_scheduler

LABELS = ["contradiction", "entailment", "neutral"]
LONG = 8191  # the longest input at the default 8192 context


def post(url, path, body, timeout=60, raw=False):
    data = body if raw else json.dumps(body)
    return requests.post(f"{url}{path}", data=data, headers={"Content-Type": "application/json"}, timeout=timeout)


def metric(text: str, name: str, missing: float | None = None, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels` (Prometheus text format);
    `missing` is returned when there is none (a labelled counter appears at its first increment)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(4))
            found = True
    if not found and missing is not None:
        return missing
    assert found, f"no sample {name}{labels} in /metrics"
    return total


def health_while(url: str, busy: threading.Thread, limit: float = 2.0) -> list[tuple[int, float]]:
    """Poll /health while `busy` runs; every answer must come within `limit` s (else the
    requests timeout fails the test: the server is frozen)."""
    out = []
    while busy.is_alive():
        t0 = time.perf_counter()
        r = requests.get(f"{url}/health", timeout=limit)
        out.append((r.status_code, time.perf_counter() - t0))
        time.sleep(0.05)
    return out


@pytest.fixture(scope="module")
def front(overlay, tmp_path_factory):
    srv = start_server(overlay, tmp_path_factory.mktemp("front") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model_name(front):
    return requests.get(f"{front.url}/v1/models").json()["data"][0]["id"]


# ---------------------------------------------------------------- bounded work before parsing
def test_20mb_text_is_413_fast_health_answers_and_memory_returns(front):
    proc = psutil.Process(front.proc.pid)
    for _ in range(3):  # settle the allocator with a few ordinary text requests
        assert post(front.url, "/classify", {"text": ["a cat sleeps"] * 4}).status_code == 200
    base = proc.memory_info().rss
    result = {}

    def big():
        result["r"] = post(front.url, "/classify", {"text": "x" * (20 * 1024 * 1024)}, timeout=120)

    t = threading.Thread(target=big)
    t.start()
    answers = health_while(front.url, t)
    t.join()
    r = result["r"]
    assert r.status_code == 413, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == 413 and err["type"] == "request_too_large" and "1048576" in err["message"]
    assert all(status == 200 for status, _ in answers), answers
    time.sleep(0.5)
    after = proc.memory_info().rss
    assert after <= base * 1.10, f"RSS {base / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after a 20 MB body"


def test_body_over_the_byte_limit_is_413_before_reading(overlay, tmp_path):
    srv = start_server(overlay, tmp_path / "log", "--max-body-bytes", "1000")
    try:
        r = post(srv.url, "/classify", {"input_ids": [[1] * 400]})
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]
        assert post(srv.url, "/classify", {"input_ids": [[1] * 10]}).status_code == 200
    finally:
        srv.stop()


def test_100_texts_of_200kb_are_413_and_health_answers(front):
    result = {}

    def big():
        result["r"] = post(front.url, "/classify", {"text": ["y" * 200_000] * 100}, timeout=120)

    t = threading.Thread(target=big)
    t.start()
    answers = health_while(front.url, t)
    t.join()
    assert result["r"].status_code == 413 and "characters" in result["r"].json()["error"]["message"]
    assert all(status == 200 for status, _ in answers)


def test_many_tiny_rows_are_413_quickly_and_do_not_stall_others(front):
    """1.5 M five-token rows (about 18 MB, under the 32 MiB body limit): refused for the batch limit,
    with /health and a 1-row classify answered meanwhile within the 2 s liveness bound of this module
    (the json module took 4-7 s to parse such a body, holding the interpreter)."""
    body = b'{"input_ids": [' + b",".join([b"[1,2,3,4,5]"] * 1_500_000) + b"]}"
    assert len(body) < 32 * 1024 * 1024
    results = {}

    def big(k):
        results[k] = post(front.url, "/classify", body, raw=True, timeout=120)

    threads = [threading.Thread(target=big, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    small = post(front.url, "/classify", {"input_ids": [[1, 2, 3]]}, timeout=2)
    answers = health_while(front.url, threads[0])
    for t in threads:
        t.join()
    for r in results.values():
        assert r.status_code == 413 and "1500000 inputs" in r.json()["error"]["message"], r.text[:300]
    assert small.status_code == 200
    assert all(status == 200 for status, _ in answers), answers


def test_half_sent_headers_are_closed_by_the_header_timeout(front):
    """Connections that never finish their request headers are closed (they held a slot forever)."""
    socks = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", front.port), timeout=30)
        s.sendall(b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        socks.append(s)
    time.sleep(http_front.HEADER_TIMEOUT_S + 2)
    closed = 0
    for s in socks:
        try:
            closed += s.recv(1024) == b""
        except (ConnectionResetError, socket.timeout):
            pass
        s.close()
    assert closed == 50
    assert requests.get(f"{front.url}/health", timeout=5).status_code == 200


# ---------------------------------------------------------------- every failure is a JSON error body
def test_deep_json_and_lone_surrogate_are_json_400s_counted_by_type(front):
    before = requests.get(f"{front.url}/metrics").text
    deep = post(front.url, "/classify", b"[" * 100_000 + b"]" * 100_000, raw=True)
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]
    lone = post(front.url, "/classify", b'{"text": "\\ud800"}', raw=True)
    assert lone.status_code == 400 and "surrogate" in lone.json()["error"]["message"]
    lone_v1 = post(front.url, "/v1/classify", b'{"input": ["ok", "\\udfff x"]}', raw=True)
    assert lone_v1.status_code == 400 and lone_v1.json()["error"]["type"] == "invalid_request_error"
    after = requests.get(f"{front.url}/metrics").text
    assert (metric(after, "openjev_errors_total", type="invalid_request_error")
            - metric(before, "openjev_errors_total", type="invalid_request_error")) == 3
    assert metric(after, "openjev_http_requests_total", route="/classify", status="400") >= 2
    unknown = requests.get(f"{front.url}/no/such/route")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == 404


def test_unexpected_exception_is_a_json_500_with_request_id(overlay, tmp_path):
    """A server whose engine is broken (ready, but no model): the handler's AttributeError becomes
    the contract's 500 with a request id, the traceback goes to the log, the error is counted."""
    import logging

    import serve_transformers as st
    import uvicorn

    args = st.build_parser().parse_args([str(overlay), "0"])
    engine = engine_scheduler.Engine(args, state="ready")  # no model loaded: every scoring call fails unexpectedly
    app = http_front.create_app(engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    st.log.addHandler(handler)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                requests.get(f"{url}/metrics", timeout=1)
                break
            except requests.ConnectionError:
                time.sleep(0.05)
        r = post(url, "/classify", {"input_ids": [[1, 2]]})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "internal_error" and err["request_id"] in err["message"]
        assert r.headers["X-Request-Id"] == err["request_id"]
        text = requests.get(f"{url}/metrics").text
        assert metric(text, "openjev_errors_total", type="internal_error:AttributeError") == 1
        assert metric(text, "openjev_http_requests_total", route="/classify", status="500") == 1
        assert any(err["request_id"] in r.getMessage() and "Traceback" in r.getMessage() for r in records)
    finally:
        st.log.removeHandler(handler)
        server.should_exit = True
        thread.join(10)
        sock.close()


# ---------------------------------------------------------------- scheduling, cancellation, watchdog
def test_client_disconnect_cancels_queued_rows(front):
    before = requests.get(f"{front.url}/server_info").json()["counters"]
    with pytest.raises(requests.exceptions.ReadTimeout):
        post(front.url, "/classify", {"input_ids": [[7] * LONG] * 40}, timeout=1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = requests.get(f"{front.url}/server_info").json()
        if info["counters"]["requests_cancelled"] > before["requests_cancelled"] and info["queue"]["rows"] == 0:
            break
        time.sleep(0.1)
    c = info["counters"]
    assert c["requests_cancelled"] == before["requests_cancelled"] + 1
    assert c["rows_cancelled"] - before["rows_cancelled"] >= 20, c  # most of the 40 rows never ran
    assert info["queue"] == {"requests": 0, "rows": 0}
    r = post(front.url, "/classify", {"input_ids": [[3, 4, 5]]})
    assert r.status_code == 200


def test_small_request_is_not_held_behind_a_big_one(front):
    done = []

    def big():
        r = post(front.url, "/classify", {"input_ids": [[9] * LONG] * 12}, timeout=300)
        done.append(("big", r.status_code))

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.5)
    r = post(front.url, "/classify", {"input_ids": [[1, 2, 3]]}, timeout=300)
    done.append(("small", r.status_code))
    t.join()
    assert done == [("small", 200), ("big", 200)], done
    info = requests.get(f"{front.url}/server_info").json()
    assert info["step_token_budget"] == 16384 and info["scheduler"]["step_token_budget"] == 16384


def test_small_request_behind_three_big_ones_is_served_within_two_steps(front):
    """Three requests of 6 rows x 8191 tokens fill every step (two rows a step at the default budget);
    a 1-row request sent while they run completes within two steps: the one running when it arrives
    and the next (before, it waited until the oldest two big requests had finished)."""
    big_status = []

    def big(k):
        r = post(front.url, "/classify", {"input_ids": [[5 + k] * LONG] * 6}, timeout=600)
        big_status.append(r.status_code)

    steps = lambda: requests.get(f"{front.url}/server_info").json()["counters"]["steps"]  # noqa: E731
    start = steps()
    threads = [threading.Thread(target=big, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    deadline = time.monotonic() + 120
    while steps() < start + 1 and time.monotonic() < deadline:  # the big requests are being served
        time.sleep(0.02)
    before = steps()
    r = post(front.url, "/classify", {"input_ids": [[1, 2, 3]]}, timeout=600)
    after = steps()
    for t in threads:
        t.join()
    assert r.status_code == 200 and big_status == [200, 200, 200]
    assert after - before <= 2, f"the 1-row request waited {after - before} steps"


def test_requests_sent_together_share_the_first_step_with_a_batch_wait(overlay, tmp_path):
    """--batch-wait-ms: four requests sent at once to an idle server run in one step, not the first
    alone; a request that fills the step budget by itself does not wait."""
    srv = start_server(overlay, tmp_path / "log", "--batch-wait-ms", "2000", "--step-token-budget", "4000")
    try:
        steps = lambda: requests.get(f"{srv.url}/server_info").json()["counters"]["steps"]  # noqa: E731
        status = []
        threads = [threading.Thread(target=lambda k=k: status.append(
            post(srv.url, "/classify", {"input_ids": [[3 + k] * 50] * 4}).status_code)) for k in range(4)]
        start = steps()
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        assert status == [200] * 4 and steps() - start == 1
        t0 = time.perf_counter()
        assert post(srv.url, "/classify", {"input_ids": [[7] * 4000]}).status_code == 200
        assert time.perf_counter() - t0 < 2.0, "a request that fills the budget waited for others"
        text = requests.get(f"{srv.url}/metrics").text
        # each request's queue time is observed once; the first of the four waited for the other three
        assert metric(text, "openjev_queue_seconds_count") == 5
        assert metric(text, "openjev_queue_seconds_bucket", le="0.1") <= 4
    finally:
        srv.stop()


def test_the_batch_wait_counts_from_the_first_queued_requests_arrival():
    """--batch-wait-ms bounds how long the first request waits: when the engine thread wakes late (busy
    parsing threads, a slow step's aftermath), the wait already spent counts, so a request queued
    longer ago than the wait runs at once."""
    args = argparse.Namespace(batch_wait_ms=5000, step_token_budget=1_000_000)
    engine = engine_scheduler.Engine(args)
    engine._pending.append(engine_scheduler.Job([[1, 2, 3]], None, None, queued_at=time.monotonic() - 6))
    t0 = time.monotonic()
    with engine._cv:
        engine._gather_arrivals()
    assert time.monotonic() - t0 < 1.0, "the wait restarted when the engine thread woke"


def test_the_batch_wait_ends_at_its_deadline_when_counting_the_queued_rows_takes_time():
    """The time spent counting what queued rows cost (prefix lookups: milliseconds a request) comes out
    of the wait, not on top of it."""
    def slow_cost(row):
        time.sleep(0.2)
        return len(row)

    args = argparse.Namespace(batch_wait_ms=300, step_token_budget=1_000_000)
    engine = engine_scheduler.Engine(args, prefix=types.SimpleNamespace(step_cost=lambda: slow_cost))
    engine._pending.append(engine_scheduler.Job([[1, 2, 3], [4, 5]], None, None))
    t0 = time.monotonic()
    with engine._cv:
        engine._gather_arrivals()
    assert time.monotonic() - t0 < 0.6, "the wait started over after counting the queued rows"


def test_a_negative_batch_wait_is_refused_in_one_line(overlay):
    r = subprocess.run([sys.executable, str(REPO / "app" / "serve_transformers.py"), str(overlay), "1",
                        "--batch-wait-ms", "-1"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].endswith(
        "--batch-wait-ms must not be negative"), r.stderr


def test_a_full_queue_answers_429_with_retry_after_and_loses_nothing(overlay, tmp_path):
    """Past --max-queued-requests a request is refused at once with 429 and Retry-After (TEI's
    overloaded answer) instead of the queue growing without limit; the admitted ones all finish."""
    srv = start_server(overlay, tmp_path / "log", "--max-queued-requests", "2")
    try:
        statuses = []

        def big():
            statuses.append(post(srv.url, "/classify", {"input_ids": [[4] * LONG] * 4}, timeout=300).status_code)

        threads = [threading.Thread(target=big) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while requests.get(f"{srv.url}/server_info").json()["queue"]["requests"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = post(srv.url, "/classify", {"input_ids": [[1, 2, 3]]})
        assert r.status_code == 429 and r.headers.get("Retry-After") == "1", r.text
        err = r.json()["error"]
        assert err["type"] == "overloaded" and "--max-queued-requests" in err["message"]
        for t in threads:
            t.join()
        assert statuses == [200, 200]
        assert post(srv.url, "/classify", {"input_ids": [[1, 2, 3]]}).status_code == 200
        metrics = requests.get(f"{srv.url}/metrics").text
        assert metric(metrics, "openjev_errors_total", type="overloaded") == 1
    finally:
        srv.stop()


def test_split_request_logits_equal_the_reference(front, sample_tokens, reference):
    """Rows of one request split over steps and regrouped by length come back bitwise, in order."""
    _, rows = token_rows(sample_tokens)
    ref = np.load(reference / "reference.npy")
    srv_rows = rows[::-1]
    got = np.asarray(post(front.url, "/classify", {"input_ids": srv_rows}).json()["logits"], dtype=np.float32)
    assert np.array_equal(got, ref[::-1])


def test_watchdog_turns_health_unhealthy_while_no_progress(overlay, tmp_path):
    srv = start_server(overlay, tmp_path / "log", "--watchdog-seconds", "1", "--step-token-budget", "1000000")
    try:
        result = {}

        def maximal():  # one step of 10 rows x 8191 tokens: no progress for several seconds
            result["r"] = post(srv.url, "/classify", {"input_ids": [[5] * LONG] * 10}, timeout=300)

        t = threading.Thread(target=maximal)
        t.start()
        answers = health_while(srv.url, t)
        t.join()
        assert result["r"].status_code == 200
        statuses = [s for s, _ in answers]
        assert 503 in statuses, statuses
        r = requests.get(f"{srv.url}/health", timeout=2)
        assert r.status_code == 200
        assert statuses[0] == 200 and statuses.index(503) > 0  # healthy first, unhealthy once stalled
    finally:
        srv.stop()


def test_torch_threads_from_cores_and_overridable(front, overlay, tmp_path):
    info = requests.get(f"{front.url}/server_info").json()
    cores = len(os.sched_getaffinity(0))
    assert info["threads"]["cores"] == cores and info["threads"]["torch_intra_op"] == max(1, cores - 1)
    srv = start_server(overlay, tmp_path / "log", env={"OPENJEV_TORCH_THREADS": "2"})
    try:
        assert requests.get(f"{srv.url}/server_info").json()["threads"]["torch_intra_op"] == 2
    finally:
        srv.stop()


# ---------------------------------------------------------------- vLLM / SGLang compatibility
class VLLMClassifyClient:
    """A client written to vLLM's documented OpenAI-compatible pooling API shapes:
    ClassificationRequest {model, input, truncate_prompt_tokens?, use_activation?} ->
    ClassificationResponse {id, object: "list", created, model, data: [{index, label, probs,
    num_classes}], usage: {prompt_tokens, total_tokens, completion_tokens, prompt_tokens_details}};
    TokenizeRequest {model, prompt, add_special_tokens, return_token_strs} -> {count, max_model_len,
    tokens, token_strs}; DetokenizeRequest {model, tokens} -> {prompt}."""

    def __init__(self, base: str, route: str, model: str):
        self.base, self.route, self.model = base, route, model

    def _post(self, path, payload):
        r = requests.post(self.base + path, json=payload, timeout=60)
        r.raise_for_status()
        return r.json()

    def classify(self, inputs, **extra):
        out = self._post(self.route, {"model": self.model, "input": inputs, **extra})
        assert set(out) >= {"id", "object", "created", "model", "data", "usage"}
        assert out["object"] == "list" and out["model"] == self.model and isinstance(out["created"], int)
        for i, d in enumerate(out["data"]):
            assert set(d) == {"index", "label", "probs", "num_classes"} and d["index"] == i
        assert set(out["usage"]) >= {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"}
        return out

    def tokenize(self, prompt, add_special_tokens=True, return_token_strs=False):
        out = self._post("/tokenize", {"model": self.model, "prompt": prompt, "add_special_tokens": add_special_tokens,
                                       "return_token_strs": return_token_strs})
        assert set(out) >= {"count", "max_model_len", "tokens"} and out["count"] == len(out["tokens"])
        return out

    def detokenize(self, tokens):
        return self._post("/detokenize", {"model": self.model, "tokens": tokens})["prompt"]


@pytest.mark.parametrize("route", ["/classify", "/v1/classify"])
def test_vllm_client_runs_unchanged_on_both_routes(front, model_name, route, sample_tokens, reference):
    client = VLLMClassifyClient(front.url, route, model_name)
    _, rows = token_rows(sample_tokens)
    ref = np.load(reference / "reference.npy")
    out = client.classify(rows[:4])
    for d, r in zip(out["data"], ref[:4]):
        e = np.exp(r.astype(np.float64) - r.max())
        assert np.allclose(d["probs"], e / e.sum(), atol=1e-7) and d["label"] == LABELS[int(r.argmax())]
        assert d["num_classes"] == 3
    assert out["usage"]["prompt_tokens"] == sum(len(r) for r in rows[:4])
    for flag in ({"use_activation": False}, {"activation": False}, {"softmax": False}):  # vLLM's deprecated names too
        raw = client.classify(rows[:2], **flag)
        assert np.array_equal(np.asarray([d["probs"] for d in raw["data"]], dtype=np.float32), ref[:2]), flag
    text = "Premise: the cat sleeps. Hypothesis: an animal rests."
    tok = client.tokenize(text, return_token_strs=True)
    assert tok["max_model_len"] == 8192 and len(tok["token_strs"]) == tok["count"]
    by_text = client.classify(text)["data"][0]["probs"]
    by_ids = client.classify([tok["tokens"]])["data"][0]["probs"]
    assert by_text == by_ids
    assert client.detokenize(tok["tokens"]).replace(" ", "") == text.replace(" ", "")
    # truncate_prompt_tokens keeps the last k tokens (vLLM's meaning) and is recorded in usage
    cut = client.classify([rows[0]], truncate_prompt_tokens=2)
    assert cut["usage"]["prompt_tokens"] == 2 and cut["truncation"]["truncate_prompt_tokens"] == 2
    assert cut["truncation"]["truncated_inputs"] == 1 and "truncated_inputs" not in cut["usage"]
    last2 = client.classify([rows[0][-2:]])
    assert cut["data"][0]["probs"] == last2["data"][0]["probs"]
    full = client.classify([rows[0]], truncate_prompt_tokens=-1)
    assert full["usage"]["prompt_tokens"] == len(rows[0]) and full["truncation"]["truncated_inputs"] == 0


def test_vllm_errors_unknown_model_whitespace_and_add_special_tokens(front, model_name, overlay):
    for route in ("/classify", "/v1/classify"):
        r = post(front.url, route, {"model": "no-such-model", "input": [[1, 2]]})
        assert r.status_code == 404 and "no-such-model" in r.json()["error"]["message"]
        r = post(front.url, route, {"model": model_name, "input": "   \n\t"})
        assert r.status_code == 400 and "whitespace" in r.json()["error"]["message"]
    r = post(front.url, "/classify", {"text": "  "})
    assert r.status_code == 400 and "whitespace" in r.json()["error"]["message"]
    r = post(front.url, "/tokenize", {"model": "other", "prompt": "x"})
    assert r.status_code == 404
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(overlay)
    text = "the cat sleeps"
    with_special = tok(text, add_special_tokens=True)["input_ids"]
    without = tok(text, add_special_tokens=False)["input_ids"]
    got = post(front.url, "/tokenize", {"model": model_name, "prompt": text, "add_special_tokens": False}).json()
    assert got["tokens"] == without
    got = post(front.url, "/tokenize", {"model": model_name, "prompt": text}).json()
    assert got["tokens"] == with_special
    a = post(front.url, "/v1/classify", {"input": text, "add_special_tokens": False}).json()
    b = post(front.url, "/v1/classify", {"input": [without]}).json()
    assert a["data"][0]["probs"] == b["data"][0]["probs"] and a["usage"]["prompt_tokens"] == len(without)


def test_native_contract_unchanged_with_vllm_on_the_same_route(front, sample_tokens):
    _, rows = token_rows(sample_tokens)
    r = post(front.url, "/classify", {"input_ids": rows[:2]})
    assert r.status_code == 200 and list(r.json()) == ["logits", "labels", "model"]
    assert r.headers["content-type"] == "application/json"
    expected = json.dumps(r.json(), ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
    assert r.content == expected.encode()  # Starlette's JSONResponse rendering, as before
    put = requests.put(f"{front.url}/classify", json={"input_ids": rows[:2]})  # SGLang registers PUT too
    assert put.status_code == 200 and put.json()["logits"] == r.json()["logits"]


# ---------------------------------------------------------------- /metrics
def test_metrics_in_prometheus_text_format(front, sample_tokens):
    _, rows = token_rows(sample_tokens)
    before = requests.get(f"{front.url}/metrics").text
    assert post(front.url, "/classify", {"input_ids": rows[:3]}).status_code == 200
    r = requests.get(f"{front.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert metric(text, "openjev_rows_total") - metric(before, "openjev_rows_total") == 3
    assert metric(text, "openjev_tokens_total") - metric(before, "openjev_tokens_total") == sum(len(x) for x in rows[:3])
    # the front serves exact batching (CPU): forwards run the tokens themselves, no padding
    assert (metric(text, "openjev_forward_tokens_total") - metric(before, "openjev_forward_tokens_total")
            == sum(len(x) for x in rows[:3]))
    assert (metric(text, "openjev_http_requests_total", route="/classify", status="200")
            - metric(before, "openjev_http_requests_total", missing=0, route="/classify", status="200")) == 1
    assert metric(text, "openjev_queue_rows") == 0 and metric(text, "openjev_queue_requests") == 0
    assert metric(text, "openjev_step_seconds_count") >= 1 and metric(text, "openjev_step_seconds_bucket", le="+Inf") >= 1
    assert metric(text, "openjev_step_token_budget") == 16384 and metric(text, "openjev_healthy") == 1
    assert "# TYPE openjev_step_seconds histogram" in text and "# TYPE openjev_errors_total counter" in text


# ---------------------------------------------------------------- the scheduler's pure parts
def test_plan_step_round_robin_within_the_token_budget():
    mk = lambda rows: engine_scheduler.Job(rows, None, None)  # noqa: E731 - loop/future unused by the planner
    huge, small = mk([[1] * 8000] * 5), mk([[2] * 10])
    first = engine_scheduler.plan_step([huge, small], 16384)
    assert [(j is huge, i) for j, i in first] == [(True, 0), (False, 0), (True, 1)]  # the small one rides along
    assert engine_scheduler.plan_step([huge, small], 16384) == [(huge, 2), (huge, 3)]
    assert engine_scheduler.plan_step([huge, small], 16384) == [(huge, 4)]
    assert engine_scheduler.plan_step([huge, small], 16384) == []
    alone = mk([[1] * 20000])  # longer than the budget: runs alone
    assert engine_scheduler.plan_step([alone], 16384) == [(alone, 0)]
    cancelled = mk([[1]] * 3)
    cancelled.cancelled = True
    assert engine_scheduler.plan_step([cancelled], 100) == []


def test_plan_step_counts_what_each_row_costs():
    """With prefix reuse a row costs the tokens it computes (its cached prefix is not run): rows far
    longer than the budget share one step when their cost fits, and the fair-share clock counts cost."""
    mk = lambda rows: engine_scheduler.Job(rows, None, None)  # noqa: E731 - loop/future unused by the planner
    jobs = [mk([[k] * 8000] * 4) for k in range(3)]
    picked = engine_scheduler.plan_step(jobs, 16384, cost=lambda row: 100)
    assert len(picked) == 12 and [j.served_tokens for j in jobs] == [400] * 3
    plain = mk([[1] * 8000] * 4)
    assert len(engine_scheduler.plan_step([plain], 16384)) == 2  # by length: two rows a step


def test_plan_step_serves_a_later_small_request_in_the_next_step():
    mk = lambda rows: engine_scheduler.Job(rows, None, None)  # noqa: E731 - loop/future unused by the planner
    bigs = [mk([[k] * 6000] * 8) for k in range(3)]
    queue = list(bigs)
    first = engine_scheduler.plan_step(queue, 16384)
    assert [bigs.index(j) for j, _ in first] == [0, 1]  # the third big request does not fit this step
    small = mk([[9] * 5])
    queue.append(small)
    second = engine_scheduler.plan_step(queue, 16384)
    assert [j for j, _ in second][:2] == [bigs[2], small]  # those not yet served go first
    for _ in range(20):  # the big requests then share the steps: none waits for another to finish
        engine_scheduler.plan_step(queue, 16384)
        served = [j.cursor for j in bigs]
        assert max(served) - min(served) <= 1 or max(served) == 8


def test_length_groups_and_thread_policy():
    # sorted 1 2 3 4 5 in runs of at most 2: [1] [2 3] [4 5] and [1 2] [3 4] [5] cost the same
    # (3 forwards, 17 padded tokens); the tie keeps the earlier cut
    assert batching.length_groups([5, 1, 3, 2, 4], 2) == [[1], [3, 2], [4, 0]]
    # short and long rows are not padded together when a forward costs less than the padding
    short_long = [100] * 8 + [1000] * 8
    assert batching.length_groups(short_long, 16) == [list(range(8)), list(range(8, 16))]
    assert batching.length_groups(short_long, 16, forward_cost=10**6) == [list(range(16))]  # fewest forwards
    import random

    rng = random.Random(14)
    for _ in range(300):
        lengths = [rng.randint(1, 1500) for _ in range(rng.randint(1, 70))]
        rows = rng.randint(1, 17)
        groups = batching.length_groups(lengths, rows)
        flat = [i for g in groups for i in g]
        assert sorted(flat) == list(range(len(lengths))) and all(1 <= len(g) <= rows for g in groups)
        assert [lengths[i] for i in flat] == sorted(lengths)  # consecutive runs of the sorted rows
        fixed = [sorted(range(len(lengths)), key=lambda i: lengths[i])[s:s + rows] for s in range(0, len(lengths), rows)]

        def cost(gs):
            return sum(max(lengths[i] for i in g) * len(g) + batching.FORWARD_COST_TOKENS for g in gs)

        assert cost(groups) <= cost(fixed)  # never worse than fixed-size cuts
    assert engine_scheduler.auto_torch_threads(2, "cpu") == 1 and engine_scheduler.auto_torch_threads(1, "cpu") == 1
    assert engine_scheduler.auto_torch_threads(16, "cpu") == 15 and engine_scheduler.auto_torch_threads(64, "cuda") == 4
