"""Prefix reuse in the embedded backend (openjev/engine/prefix.py): the cache's bookkeeping, the
shared-prefix plan, continuation logits against the exact forward on the tiny model, and a real
server with --prefix-reuse (/classify, /server_info, /flush_cache, /metrics)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import requests
from conftest import REPO, free_port, start_server

from openjev.engine.prefix import PrefixCache, PrefixState, shared_prefixes

TOL = 1e-5  # float32 on a CPU: the prefix is summed apart from the rest, the last bits may differ


def _state(length: int, nbytes: int):
    import torch

    empty = torch.zeros(0)
    return PrefixState(length, torch.zeros(nbytes // 4, dtype=torch.float32), empty, empty, empty)


def longest(cache, row, limit):
    """The cached state of the longest prefix of `row` within `limit`, counted, as a step takes it."""
    return cache.claim(*cache.find(row, limit)[:2])


def test_cache_finds_the_longest_cached_prefix_and_counts():
    cache = PrefixCache(budget_bytes=10_000)
    row = list(range(100, 140))
    cache.put(row[:10], _state(10, 400))
    cache.put(row[:25], _state(25, 400))
    cache.put([7] * 30, _state(30, 400))
    assert longest(cache, row, limit=39).length == 25
    assert longest(cache, row, limit=24).length == 10
    assert longest(cache, [1, 2, 3], limit=2) is None
    s = cache.stats()
    assert (s["hits"], s["misses"], s["entries"], s["bytes"], s["tokens_reused"]) == (2, 1, 3, 1200, 35)
    # a look for the step planner counts nothing and keeps the eviction order
    order = list(cache.entries)
    assert (cache.find(row, 39)[1], cache.find(row, 9)[1], cache.find([5], 0)[1]) == (25, 0, 0)
    assert cache.stats() == s and list(cache.entries) == order


def test_cache_evicts_least_recently_used_within_its_budget_and_clears():
    cache = PrefixCache(budget_bytes=1000)
    a, b, c = [1] * 5, [2] * 5, [3] * 5
    cache.put(a, _state(5, 400))
    cache.put(b, _state(5, 400))
    assert longest(cache, a + [9], 5) is not None  # a is now the most recent
    cache.put(c, _state(5, 400))                   # over budget: b goes
    assert longest(cache, b + [9], 5) is None and longest(cache, c + [9], 5) is not None
    cache.put([4] * 5, _state(5, 4000))            # larger than the whole budget: not kept
    s = cache.stats()
    assert (s["entries"], s["bytes"], s["evicted"]) == (2, 800, 1)
    assert cache.clear() == 2 and cache.stats()["bytes"] == 0 and not cache.lengths


def test_shared_prefixes_groups_rows_by_their_longest_shared_prefix():
    rng = random.Random(1)
    head = [rng.randrange(50) for _ in range(5)]          # shared by all rows, too short to matter
    p1, p2 = head + [rng.randrange(50) for _ in range(130)], head + [rng.randrange(50) for _ in range(200)]
    rows = [p1 + [1, 2], p2 + [3], p1 + [4, 5, 6], p2 + [7, 8], head + [9] * 170]
    n = len(rows)
    # shared lengths 135 and 205, cut to the GDN chunk: 128 and 192
    got = shared_prefixes(rows, [0] * n, [len(r) - 1 for r in rows], min_tokens=32)
    assert got == {0: 128, 2: 128, 1: 192, 3: 192}
    # what a row already has from the cache counts: no gain of min_tokens (row 0), then row 2 alone
    assert shared_prefixes(rows, [128, 0, 64, 0, 0], [len(r) - 1 for r in rows], 32) == {1: 192, 3: 192}
    # rows of other attention groups do not share: row 0 has no partner of its group
    groups = [b"a", b"a", b"b", b"a", b"a"]
    assert shared_prefixes(rows, [0] * n, [len(r) - 1 for r in rows], 32, groups) == {1: 192, 3: 192}


def test_attention_class_follows_flashattentions_key_split():
    """16 heads of 256 on 132 SMs (an H100 or H200): calls of up to 13 query blocks (832 tokens) split
    their keys, by their number of key blocks; whole tiles are a class of their own."""
    from openjev.engine.attention import attention_class

    def cls(n):
        return attention_class(n, 16, 256, 132)

    assert cls(832) == (True, False, 13) and cls(833) == (False, False, 0)
    assert cls(901) == cls(1500) != cls(1024) != cls(1088)
    assert cls(394) == cls(405) == cls(416) != cls(327) != cls(319)
    assert attention_class(500, 32, 256, 132) == (False, False, 0)  # 32 heads fill the GPU sooner
    assert attention_class(300, 16, 128, 132)[2] == 3  # 128-key blocks for heads of 128


def test_rows_share_prefix_states_only_within_their_attention_group(clf, monkeypatch):
    """Rows of one option group whose whole attention calls differ in class run their shared prefix
    apart and cache it apart; every forward's rows attend with their whole row's call length."""
    from openjev.engine import attention
    from openjev.engine.classifier import score_exact
    from openjev.engine.prefix import PrefixEngine

    attended = []  # (prefix and tokens, call) of every row call that does not end its row
    real = attention.attend_after_prefix
    monkeypatch.setattr(attention, "attend_after_prefix", lambda inner, module, q, k, v, prefix, call=None, **kw: (
        attended.append((prefix + q.shape[2], call)) or real(inner, module, q, k, v, prefix, call=call, **kw)))

    rows = _rows(clf.vocab_size)
    ref = score_exact(clf, rows)
    one = PrefixEngine(clf, 64 << 20, min_tokens=16)
    split = PrefixEngine(clf, 64 << 20, min_tokens=16)
    split.classes = lambda n: bytes([n % 2])  # two classes, as a GPU's key split makes them
    seen = []
    run = split.forwards.run
    split.forwards.run = lambda items, want, keep=None: seen.extend(
        (s.length if s is not None else 0, len(t), c) for s, t, c in items) or run(items, want, keep)
    together, apart = one.run_step(rows, max_rows=8), split.run_step(rows, max_rows=8)
    assert np.abs(apart.logits - ref).max() <= TOL
    assert apart.computed_tokens > together.computed_tokens
    assert all(p + n <= c for p, n, c in seen) and any(p + n < c for p, n, c in seen)
    assert sorted(c for p, n, c in seen if p + n == c) == sorted(map(len, rows))  # each row ends once
    assert any(c > n for n, c in attended) and all(c >= n for n, c in attended)  # state-keeping calls: whole rows
    warm = split.run_step(rows, max_rows=8)
    assert warm.computed_tokens == tails(rows) and np.abs(warm.logits - ref).max() <= TOL


def _rows(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    rows = []
    for _ in range(4):
        premise = toks(rng.randrange(100, 300))
        rows += [premise + toks(rng.randrange(2, 20)) for _ in range(3)]
    return rows + [toks(rng.randrange(10, 200)) for _ in range(3)] + [toks(1)]


def tails(rows) -> int:
    """Tokens a warm pass runs: each row after its last 64-token chunk boundary."""
    return sum(len(r) - (len(r) - 1) // 64 * 64 for r in rows)


@pytest.fixture(scope="module")
def clf(tiny_model):
    from openjev.engine.classifier import load_classifier

    return load_classifier(tiny_model["checkpoint"], "cpu", "float32")


@pytest.mark.parametrize("budget_mb,attention", [(0, "whole-row"), (64, "whole-row"), (64, "varlen"),
                                                  (64, "varlen-tails"), (64, "varlen-exact")])
def test_prefix_path_matches_the_exact_forward_cold_and_warm(clf, budget_mb, attention, monkeypatch):
    """Cold and warm, without and with the cross-request cache; OPENJEV_PREFIX_ATTENTION=varlen,
    varlen-tails and varlen-exact with the varlen kernel replaced by its row-at-a-time reference (a
    CPU has no FlashAttention)."""
    from openjev.engine import attention as attention_module
    from openjev.engine.classifier import score_exact
    from openjev.engine.prefix import PrefixEngine
    from openjev_testsupport.varlen_reference import varlen_reference

    monkeypatch.setenv("OPENJEV_PREFIX_ATTENTION", attention)
    packed = []
    if attention != "whole-row":
        monkeypatch.setattr(attention_module, "packed_calls_allowed", lambda *_: True)
        monkeypatch.setattr(attention_module, "unsplit_varlen_allowed", lambda *_: True)
        monkeypatch.setattr(attention_module, "device_sms", lambda _device: 8)  # short rows' calls split
        monkeypatch.setattr(attention_module, "varlen_flash",
                            lambda *a: packed.append(len(a[3]) - 1) or varlen_reference(*a))
    rows = _rows(clf.vocab_size)
    ref = score_exact(clf, rows)
    engine = PrefixEngine(clf, budget_mb << 20, min_tokens=16)
    cold = engine.run_step(rows, max_rows=8)
    assert np.abs(cold.logits - ref).max() <= TOL
    total = sum(map(len, rows))
    assert cold.computed_tokens < total and cold.reused_tokens == total - cold.computed_tokens
    warm = engine.run_step(rows, max_rows=8)
    assert np.abs(warm.logits - ref).max() <= TOL
    costs = [engine.step_cost()(r) for r in rows]  # what the planner counts for a row alone now
    if budget_mb:  # every row comes from its cached state but its tail
        assert sum(costs) == tails(rows)
    else:
        assert costs == [len(r) for r in rows]
    if budget_mb:
        assert warm.computed_tokens == tails(rows) and engine.stats()["cache"]["hits"] >= len(rows) - 3
    else:
        assert warm.computed_tokens == cold.computed_tokens and engine.stats()["cache"] is None
    if attention == "varlen-exact":  # rows of up to 192 tokens split here: they keep their own calls
        assert packed and max(packed) < len(rows) and sum(len(r) > 192 for r in rows) in packed
    assert bool(packed) == (attention != "whole-row")


@pytest.mark.parametrize("budget_mb", [0, 64])
def test_a_step_plan_counts_what_the_step_computes(clf, budget_mb):
    """The step budget's cost of a plan's rows (PrefixEngine.step_cost) sums to the tokens the step then
    computes, cold (a shared premise counted once, by the first row of its group) and warm (tails)."""
    from openjev.engine.prefix import PrefixEngine

    rows = _rows(clf.vocab_size, seed=3)
    engine = PrefixEngine(clf, budget_mb << 20, min_tokens=16)
    for _ in range(2):
        cost = engine.step_cost()
        planned = [cost(r) for r in rows]
        step = engine.run_step(rows, max_rows=8)
        assert sum(planned) == step.computed_tokens < sum(map(len, rows))
    first = range(0, 12, 3)  # each group's first row pays for its premise when cold
    cold = PrefixEngine(clf, 0, min_tokens=16).step_cost()
    costs = [cold(r) for r in rows]
    assert all(costs[k] == len(rows[k]) and costs[k + 1] < len(rows[k + 1]) for k in first)


def test_a_warm_steps_tails_run_in_one_forward_of_up_to_128_rows(clf):
    """Tails are at most 64 tokens: a warm step of 96 rows runs them in one forward, not two of 64."""
    from openjev.engine.prefix import PrefixEngine

    rng = random.Random(7)
    rows = [[rng.randrange(3, clf.vocab_size) for _ in range(rng.randrange(70, 120))] for _ in range(96)]
    engine = PrefixEngine(clf, 64 << 20, min_tokens=16)
    engine.run_step(rows, max_rows=16)
    warm = engine.run_step(rows, max_rows=16)
    assert warm.computed_tokens == tails(rows) and warm.forwards == 1


def test_a_cold_step_runs_its_shared_prefixes_beside_the_rows_that_do_not_go_on_from_them(clf, monkeypatch):
    """A step's shared prefixes run in the forwards of the rows that do not continue them (here two
    rows with no sibling, of about the prefix's length), then the continuations in forwards of their
    own: two forwards, where running the prefixes first and every row after took three (the long rows
    and the short continuations too unlike to share a forward). The same logits as the exact forward."""
    from openjev.engine.classifier import score_exact
    from openjev.engine.prefix import PrefixEngine

    rng = random.Random(11)

    def toks(n):
        return [rng.randrange(3, clf.vocab_size) for _ in range(n)]

    premise = toks(256)
    rows = [premise + toks(rng.randrange(10, 40)) for _ in range(40)] + [toks(300), toks(290)]
    engine = PrefixEngine(clf, 64 << 20, min_tokens=16)
    forwards = []
    run = engine.forwards.run
    monkeypatch.setattr(engine.forwards, "run",
                        lambda items, *a: forwards.append(sorted(len(t) for _, t, _ in items)) or run(items, *a))
    cold = engine.run_step(rows, max_rows=8)
    assert np.abs(cold.logits - score_exact(clf, rows)).max() <= TOL
    assert cold.forwards == len(forwards) == 2
    assert forwards[0] == [256, 290, 300]  # the prefix and the two rows without a sibling
    assert len(forwards[1]) == 40 and max(forwards[1]) < 40  # each continuation after the prefix


def test_a_rows_cached_prefix_is_looked_up_once_while_the_cache_is_unchanged(clf, monkeypatch):
    """The scheduler asks for a row's cost while it waits and as it plans, and the step looks the row up
    again: one search of the cache a row while nothing comes or goes; a state put in between is found."""
    from openjev.engine.prefix import PrefixEngine

    rng = random.Random(13)
    rows = [[rng.randrange(3, clf.vocab_size) for _ in range(rng.randrange(140, 300))] for _ in range(6)]
    engine = PrefixEngine(clf, 64 << 20, min_tokens=16)
    engine.run_step(rows, max_rows=8)  # every row keeps a state
    searched = []
    find = engine.cache.find
    monkeypatch.setattr(engine.cache, "find", lambda row, *a: searched.append(len(row)) or find(row, *a))
    later = [list(r) for r in rows]  # the same tokens arriving again, as new row objects
    assert [engine.step_cost()(r) for r in later] == [engine.step_cost()(r) for r in later]
    assert len(searched) == len(rows)
    warm = engine.run_step(later, max_rows=8)
    assert len(searched) == len(rows) and warm.reused_tokens > 0  # the step took the planned answers
    assert engine.stats()["cache"]["hits"] >= len(rows)
    again = [list(r) for r in rows]
    before = [engine.step_cost()(r) for r in again]
    engine.cache.clear()  # the cache changes after planning: the step searches again and runs whole rows
    cold = engine.run_step(again, max_rows=8)
    assert len(searched) == 3 * len(rows) and before == [len(r) - (len(r) - 1) // 64 * 64 for r in rows]
    assert cold.reused_tokens == 0
    assert not engine._looked_up  # a step drops the rows it ran


def test_tail_forwards_are_cut_at_their_own_forward_cost(clf, monkeypatch):
    """A cheap forward cuts a cold step's rows into many forwards; the warm step's tails (a chunk a row
    at most) are cut at the tail phase's cost, here one forward for all of them."""
    from openjev.engine.classifier import score_exact
    from openjev.engine.prefix import PrefixEngine

    rng = random.Random(12)
    rows = [[rng.randrange(3, clf.vocab_size) for _ in range(rng.randrange(70, 400))] for _ in range(12)]
    engine = PrefixEngine(clf, 64 << 20, min_tokens=16)
    engine.forward_cost, engine.tail_forward_cost = 1, 10**6
    cold = engine.run_step(rows, max_rows=16)
    warm = engine.run_step(rows, max_rows=16)
    assert cold.forwards > 4 and warm.forwards == 1, (cold.forwards, warm.forwards)
    ref = score_exact(clf, rows)
    assert max(np.abs(cold.logits - ref).max(), np.abs(warm.logits - ref).max()) <= TOL


def test_prefix_path_under_a_small_budget_and_rows_ending_in_the_pad_id(clf):
    """Evictions leave the answers unchanged; a row ending in the pad id runs whole, so the pooled token
    is the exact forward's (its rightmost non-pad token)."""
    from openjev.engine.classifier import score_exact
    from openjev.engine.prefix import PrefixEngine

    rows = _rows(clf.vocab_size, seed=3)
    rows[1] = rows[1] + [clf.pad_token_id]
    ref = score_exact(clf, rows)
    engine = PrefixEngine(clf, budget_bytes=300_000, min_tokens=16)
    for _ in range(3):
        assert np.abs(engine.run_step(rows, max_rows=4).logits - ref).max() <= TOL
    s = engine.stats()["cache"]
    assert s["evicted"] > 0 and s["bytes"] <= 300_000


HANDED_ON = r"""
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[2])
from test_prefix_reuse import _rows
from openjev.engine import fused, prefix
from openjev.engine.classifier import load_classifier
from openjev.engine.prefix import PrefixEngine
clf = load_classifier(sys.argv[1], device="cpu", dtype=sys.argv[3])
gdn = next(m for m in clf.model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
modeling = sys.modules[type(gdn).__module__]
fused._install(clf.model, modeling, {"conv_silu"}, cached_conv=sys.argv[3] == "float16")
calls = []
kernel = fused.conv_silu_blc
fused.conv_silu_blc = lambda x, w, state=None: calls.append(state is not None) or kernel(x, w, state=state)
rows = _rows(clf.vocab_size)
in_place = []
write = prefix._keys_written_in_place
prefix._keys_written_in_place = lambda *a: in_place.append(1) or write(*a)

def run():
    engine = PrefixEngine(clf, 64 << 20, min_tokens=16)
    cold = engine.run_step(rows, max_rows=8).logits
    return cold, engine.run_step(rows, max_rows=8).logits, list(engine.cache.entries.values())

import gc, weakref
made = []
build = prefix.ContinuationForwards._cache
prefix.ContinuationForwards._cache = lambda self, *a: (lambda c: made.extend(
    [weakref.ref(c)] + [weakref.ref(layer) for layer in c.layers]) or c)(build(self, *a))
gc.collect()
gc.disable()
handed = run()
assert made and not any(r() is not None for r in made), "a forward's cache outlived it"
gc.enable()
prefix.ContinuationForwards._cache = build
handed_calls = list(calls)
assert in_place
prefix._conv_state_handed_on = lambda layer, record: layer.update_conv_state  # the cache concatenates, as Transformers'
prefix._keys_written_in_place = lambda layer, keys, values: layer.update
calls.clear()
concatenated = run()
assert np.array_equal(handed[0], concatenated[0]) and np.array_equal(handed[1], concatenated[1])
assert len(handed[2]) == len(concatenated[2]) > 0
for a, b in zip(handed[2], concatenated[2]):
    assert a.length == b.length and all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("conv", "recurrent", "keys", "values"))
print(sum(handed_calls), sum(calls), len(calls))
"""


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_cache_that_does_not_concatenate_keeps_every_bit(tiny_model, dtype):
    """A forward from prefix states concatenates neither each attention layer's new keys and values to
    the cached ones (they are written into room left after them) nor, with the fused conv installed,
    each GDN layer's new conv inputs to the start state: the state kernel reads it in place (FP16,
    under Triton's interpreter) or the wrapper concatenates for Transformers' conv (float32, a layout
    the kernel was not checked on). Logits and the states kept are bitwise those of Transformers'
    concatenating cache."""
    from conftest import run_py

    proc = run_py(HANDED_ON, {"TRITON_INTERPRET": "1"}, timeout=600, args=(tiny_model["checkpoint"], REPO / "tests", dtype))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with_state, concatenated, fused_calls = map(int, proc.stdout.split()[-3:])
    if dtype == "float16":  # every forward from a state: the state kernel; without: none
        assert with_state > 0 and concatenated == 0 and fused_calls > 0
    else:
        assert with_state == concatenated == fused_calls == 0


def test_a_forwards_cache_is_freed_when_it_returns(clf, monkeypatch):
    """The cache object of a forward from prefix states (its keys, values, conv inputs and states:
    gigabytes at the 4B shape) is freed by reference counting when the forward returns, not left to
    the cyclic garbage collector, which large tensors do not prompt (on the H100 two warm passes ran
    out of memory when the cache layers' replaced methods referred back to their layers)."""
    import gc
    import weakref

    from openjev.engine import prefix
    from openjev.engine.prefix import PrefixEngine

    made = []
    build = prefix.ContinuationForwards._cache

    def cache(self, *args):
        c = build(self, *args)
        made.append(weakref.ref(c))
        made.extend(weakref.ref(layer) for layer in c.layers)
        return c

    monkeypatch.setattr(prefix.ContinuationForwards, "_cache", cache)
    rows = _rows(clf.vocab_size)
    engine = PrefixEngine(clf, 64 << 20, min_tokens=16)
    gc.collect()
    gc.disable()
    try:
        engine.run_step(rows, max_rows=8)
        engine.run_step(rows, max_rows=8)
        alive = sum(r() is not None for r in made)
    finally:
        gc.enable()
    assert made and alive == 0, f"{alive} of {len(made)} caches and cache layers outlived their forward"


def test_server_with_prefix_reuse(overlay, tmp_path):
    from openjev.engine.classifier import load_classifier, score_exact

    clf = load_classifier(overlay, "cpu", "float32")
    rows = _rows(clf.vocab_size, seed=5)
    ref = score_exact(clf, rows)
    budget = 1024  # under the set's tokens, over its tails: a warm request fits one step
    assert tails(rows) <= budget < sum(map(len, rows))
    srv = start_server(overlay, tmp_path / "log", "--prefix-reuse", "--prefix-cache-mb", "16",
                       "--prefix-min-tokens", "16", "--step-token-budget", str(budget))
    try:
        def classify():
            r = requests.post(srv.url + "/classify", json={"input_ids": rows}, timeout=60)
            assert r.status_code == 200, r.text
            return np.asarray(r.json()["logits"], dtype=np.float32)

        started = requests.get(srv.url + "/server_info", timeout=10).json()
        warm = started["warmup"]["prefix_path"]  # compiled before the first request, nothing of it kept
        assert warm["rows"] == 6 and warm["forwards"] >= 2 and warm["seconds"] > 0
        assert {k: started["prefix_reuse"]["cache"][k] for k in ("entries", "bytes", "hits", "misses", "flushes")} \
            == dict.fromkeys(("entries", "bytes", "hits", "misses", "flushes"), 0)
        assert started["counters"]["steps"] == 0
        first = classify()
        info = requests.get(srv.url + "/server_info", timeout=10).json()
        assert info["serving_path"] == "prefix-reuse (padded)" and info["radix_cache"] is True  # a CPU: auto pads
        cache = info["prefix_reuse"]["cache"]
        assert cache["entries"] > 0 and cache["budget_bytes"] == 16 << 20
        c1 = info["counters"]
        assert c1["computed_tokens"] < c1["tokens"]
        second = classify()
        c2 = requests.get(srv.url + "/server_info", timeout=10).json()["counters"]
        assert c2["computed_tokens"] - c1["computed_tokens"] == tails(rows)  # only the tails ran
        assert c1["steps"] > 1 and c2["steps"] - c1["steps"] == 1  # the budget counts computed tokens
        for got in (first, second):
            assert np.abs(got - ref).max() <= TOL
        metrics = requests.get(srv.url + "/metrics", timeout=10).text
        assert "openjev_prefix_cache_hits" in metrics and "openjev_computed_tokens_total" in metrics
        flushed = requests.post(srv.url + "/flush_cache", timeout=10).json()
        assert flushed["flushed"] is True and flushed["states_dropped"] == cache["entries"]
        assert requests.get(srv.url + "/server_info", timeout=10).json()["prefix_reuse"]["cache"]["entries"] == 0
    finally:
        srv.stop()


def send_together(url: str, requests_rows: list) -> None:
    """POST each request's rows to /classify from its own thread, 50 ms apart, all answered 200."""
    import threading
    import time

    status = []
    threads = [threading.Thread(target=lambda r=r: status.append(requests.post(
        url + "/classify", json={"input_ids": r}, timeout=120).status_code)) for r in requests_rows]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert status == [200] * len(requests_rows)


def test_a_batch_wait_counts_the_tokens_a_warm_step_computes(overlay, tmp_path):
    """--batch-wait-ms with --prefix-reuse: a warm request whose rows' tokens exceed the step budget, but
    whose tails (what the step computes) do not, still waits for the requests sent with it, so a warm
    pass of four requests sent together runs in one step (on the H100 it ran in two: the wait stopped
    at the first request's raw tokens)."""
    from openjev.engine.classifier import load_classifier

    clf = load_classifier(overlay, "cpu", "float32")
    rows = _rows(clf.vocab_size, seed=10)
    requests_rows = [rows[k::4] for k in range(4)]
    budget = 640
    assert all(sum(map(len, r)) > budget for r in requests_rows) and tails(rows) <= budget
    srv = start_server(overlay, tmp_path / "log", "--prefix-reuse", "--prefix-cache-mb", "16", "--prefix-min-tokens",
                       "16", "--step-token-budget", str(budget), "--batch-wait-ms", "3000")
    try:
        def steps():
            return requests.get(srv.url + "/server_info", timeout=10).json()["counters"]["steps"]

        send_together(srv.url, requests_rows)  # cold: the states are cached
        before = steps()
        send_together(srv.url, requests_rows)
        assert steps() - before == 1, f"a warm pass of four requests sent together ran in {steps() - before} steps"
    finally:
        srv.stop()


def test_a_cold_pass_of_option_groups_counts_each_premise_once_against_the_step_budget(overlay, tmp_path):
    """--prefix-reuse, cache flushed: four requests of option-group rows sent together, whose tokens
    exceed the step budget but whose computed tokens (each shared premise once) do not, run in one
    step, as they would with a budget over their raw tokens (on the H100 a flushed pass ran as two
    steps of 65,536 raw tokens, 1.35-1.73 s, against one of 1.27-1.35 s)."""
    from openjev.engine.classifier import load_classifier
    from openjev.engine.prefix import PrefixEngine

    clf = load_classifier(overlay, "cpu", "float32")
    rows = _rows(clf.vocab_size, seed=11)
    requests_rows = [rows[k::4] for k in range(4)]
    computed = PrefixEngine(clf, 0, min_tokens=16).run_step(rows, 16).computed_tokens
    budget = computed + 16
    assert budget < sum(map(len, rows))
    srv = start_server(overlay, tmp_path / "log", "--prefix-reuse", "--prefix-cache-mb", "16", "--prefix-min-tokens",
                       "16", "--step-token-budget", str(budget), "--batch-wait-ms", "3000")
    try:
        info = lambda: requests.get(srv.url + "/server_info", timeout=10).json()["counters"]  # noqa: E731
        before = info()
        send_together(srv.url, requests_rows)
        after = info()
        assert after["steps"] - before["steps"] == 1, f"a cold pass ran in {after['steps'] - before['steps']} steps"
        assert after["computed_tokens"] - before["computed_tokens"] == computed
    finally:
        srv.stop()


@pytest.mark.parametrize("mode,message", [
    ("bogus", "OPENJEV_PREFIX_ATTENTION='bogus': expected whole-row, varlen, varlen-tails or varlen-exact"),
    ("varlen", "OPENJEV_PREFIX_ATTENTION=varlen needs a CUDA device (FlashAttention's varlen call); this model runs "
               "on cpu: unset it")])
def test_server_refuses_a_prefix_attention_it_cannot_run(overlay, mode, message):
    """A typo fails before the port is bound; a varlen mode on a CPU fails the load with one line."""
    proc = subprocess.run([sys.executable, str(REPO / "app" / "serve_transformers.py"), str(overlay), str(free_port()),
                           "--prefix-reuse", "--device", "cpu"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OPENJEV_PREFIX_ATTENTION=mode))
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_compute_bound_counts_the_tokens_the_forwards_ran():
    from compute_bound import computed_share

    def snap(tokens, computed):
        return {"counters": {"tokens": tokens, "computed_tokens": computed}}

    assert computed_share({"info_before": snap(100, 100), "info_after": snap(1100, 350)}) == 0.25
    assert computed_share({"info_before": {"counters": {"tokens": 0}}, "info_after": snap(10, 10)}) is None  # SGLang
    assert computed_share({"info_before": snap(5, 5), "info_after": snap(5, 5)}) is None


def test_padding_inert_chunk_gives_each_padded_row_its_own_final_state():
    """The wrapper over a right-padded batch (here around a float64 recurrence) against each row run
    alone: the same outputs on the real tokens and each row's own final state, bit for bit."""
    import torch

    from openjev.engine.attention import padded_layout
    from openjev.engine.prefix import padding_inert_chunk

    def recurrence(q, k, v, g, beta, initial_state=None, output_final_state=False, **_):
        outs, finals = [], []
        for b in range(q.shape[0]):
            state = initial_state[b:b + 1].double() if initial_state is not None else None
            o, s = _with_state(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], state)
            outs.append(o)
            finals.append(s)
        return torch.cat(outs), torch.cat(finals)

    def _with_state(q, k, v, g, beta, state):
        # the gated delta rule in float64, q and k L2-normalised, from a given state
        qn = q.double() / q.double().norm(dim=-1, keepdim=True).clamp_min(1e-6) * q.shape[-1] ** -0.5
        kn = k.double() / k.double().norm(dim=-1, keepdim=True).clamp_min(1e-6)
        h = state if state is not None else torch.zeros(1, k.shape[2], k.shape[3], v.shape[3], dtype=torch.float64)
        out = torch.zeros(1, q.shape[1], q.shape[2], v.shape[3], dtype=torch.float64)
        for t in range(q.shape[1]):
            h = h * g[:, t].double().exp()[..., None, None]
            delta = (v[:, t].double() - torch.einsum("bhk,bhkv->bhv", kn[:, t], h)) * beta[:, t].double()[..., None]
            h = h + torch.einsum("bhk,bhv->bhkv", kn[:, t], delta)
            out[:, t] = torch.einsum("bhk,bhkv->bhv", qn[:, t], h)
        return out, h

    gen = torch.Generator().manual_seed(0)
    lengths, width, heads, dk, dv = [5, 9, 2], 9, 2, 4, 3
    q, k = (torch.randn(3, width, heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(3, width, heads, dv, generator=gen)
    g, beta = -torch.rand(3, width, heads, generator=gen), torch.rand(3, width, heads, generator=gen)
    init = torch.randn(3, heads, dk, dv, generator=gen, dtype=torch.float64)
    wrapped = padding_inert_chunk(recurrence)
    with padded_layout(lengths, per_row_states=True):
        out, finals = wrapped(q, k, v, g, beta, initial_state=init, output_final_state=True)
    for b, n in enumerate(lengths):
        o, s = _with_state(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], g[b:b + 1, :n], beta[b:b + 1, :n], init[b:b + 1])
        assert torch.equal(out[b, :n], o[0]) and torch.equal(finals[b], s[0])
    # keeping the state after fewer tokens than a row runs: the state there, every real token's output
    keep = [3, 9, 1]
    with padded_layout(lengths, per_row_states=True, keep=keep):
        out, finals = wrapped(q, k, v, g, beta, initial_state=init, output_final_state=True)
    for b, (n, kept) in enumerate(zip(lengths, keep)):
        o, _ = _with_state(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], g[b:b + 1, :n], beta[b:b + 1, :n], init[b:b + 1])
        _, s = _with_state(q[b:b + 1, :kept], k[b:b + 1, :kept], v[b:b + 1, :kept], g[b:b + 1, :kept],
                           beta[b:b + 1, :kept], init[b:b + 1])
        assert torch.equal(out[b, :n], o[0]) and torch.equal(finals[b], s[0])


@pytest.mark.gpu
def test_a_state_kept_inside_a_forward_is_bitwise_two_forwards_on_a_gpu():
    """fla's chunked rule at Qwen3.5-4B's GDN shape in FP16: rows that run past the chunk boundary whose
    state they keep give that state and every output bit for bit as a forward to the boundary and a
    forward of the rest from its state, as the prefix path ran them before."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: fla's kernels are Triton GPU kernels")
    chunk = pytest.importorskip("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    from openjev.engine.attention import padded_layout
    from openjev.engine.prefix import padding_inert_chunk

    def inner(q, k, v, g, beta, initial_state=None, output_final_state=False, **kw):
        return chunk(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=True)

    gen = torch.Generator().manual_seed(3)
    lengths, keep = [700, 1217, 130, 64], [640, 1216, 128, 64]
    width, heads = max(lengths), 32

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to("cuda", torch.float16)

    q, k, v = rnd(4, width, heads, 128), rnd(4, width, heads, 128), rnd(4, width, heads, 128)
    g = -torch.rand(4, width, heads, generator=gen).cuda() * 0.1
    beta = torch.rand(4, width, heads, generator=gen).to("cuda", torch.float16)
    init = torch.randn(4, heads, 128, 128, generator=gen).cuda()
    wrapped = padding_inert_chunk(inner)
    with torch.inference_mode():
        with padded_layout(lengths, per_row_states=True, keep=keep):
            out, kept = wrapped(q, k, v, g, beta, initial_state=init, output_final_state=True)
        w = max(keep)
        with padded_layout(keep, per_row_states=True):
            body, state = wrapped(q[:, :w], k[:, :w], v[:, :w], g[:, :w], beta[:, :w], initial_state=init,
                                  output_final_state=True)
        assert torch.equal(kept, state)
        tail_len = max(n - kk for n, kk in zip(lengths, keep))
        for b, (n, kk) in enumerate(zip(lengths, keep)):
            assert torch.equal(out[b, :kk], body[b, :kk]), b
            if n > kk:
                idx = torch.arange(kk, kk + tail_len).clamp(max=width - 1)
                tail, _ = inner(*(x[b:b + 1, idx] for x in (q, k, v, g, beta)), initial_state=state[b:b + 1])
                assert torch.equal(out[b, kk:n], tail[0, : n - kk]), b


@pytest.mark.gpu
def test_calls_of_one_attention_class_give_a_shared_prefix_the_same_bits():
    """At Qwen3.5-4B's attention shape in FP16, two rows that share a prefix and whose whole causal
    calls are of one attention class get the same outputs on the prefix's positions, bit for bit."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: FlashAttention is a GPU kernel")
    from openjev.engine.attention import attention_class

    heads, kv_heads, dim = 16, 4, 256
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, 1600, dim, device="cuda", dtype=torch.float16, generator=gen)
    k, v = (torch.randn(1, kv_heads, 1600, dim, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))

    def call(n):
        out = torch.nn.functional.scaled_dot_product_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], is_causal=True,
                                                               scale=dim ** -0.5, enable_gqa=True)
        return out.transpose(1, 2)

    for a, b in [(394, 416), (130, 190), (900, 1500), (1025, 1100), (650, 700)]:
        assert attention_class(a, heads, dim, sms) == attention_class(b, heads, dim, sms), (a, b, sms)
        p = min(a, b) // 64 * 64
        assert torch.equal(call(a)[:, :p], call(b)[:, :p]), (a, b)


@pytest.mark.gpu
def test_attention_after_a_prefix_is_bitwise_the_whole_rows_causal_attention():
    """A continuation's attention (its queries after a prefix ending on a 64-token boundary, the
    prefix's keys and its own) against the whole row's causal SDPA call, the call an exact forward
    makes, on the positions after the prefix: bit for bit on a GPU (FlashAttention's query tiles)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: FlashAttention is a GPU kernel")
    from openjev.engine.attention import attend_after_prefix

    def inner(_module, q, k, v, mask, scaling=None, **_):  # Transformers' call for an unpadded row
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scaling,
                                                               enable_gqa=True)
        return out.transpose(1, 2), None

    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, dim = 16, 4, 256
    for prefix, n in [(64, 1), (128, 63), (640, 65), (1344, 37), (64, 700)]:
        q = torch.randn(1, heads, prefix + n, dim, device="cuda", dtype=torch.float16, generator=gen)
        k, v = (torch.randn(1, kv_heads, prefix + n, dim, device="cuda", dtype=torch.float16, generator=gen)
                for _ in range(2))
        whole = inner(None, q, k, v, None, scaling=dim ** -0.5)[0]
        after = attend_after_prefix(inner, None, q[:, :, prefix:], k, v, prefix, scaling=dim ** -0.5)
        assert torch.equal(after, whole[:, prefix:]), (prefix, n, float((after - whole[:, prefix:]).abs().max()))
        # a state-keeping forward stops on a tile boundary inside the row: from 0 or from a prefix
        for start in (0, prefix - 64):
            stop = prefix  # the tile boundary the forward stops on
            cut = attend_after_prefix(inner, None, q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], start,
                                       call=prefix + n, scaling=dim ** -0.5)
            assert torch.equal(cut, whole[:, start:stop]), (start, stop, float((cut - whole[:, start:stop]).abs().max()))


def test_forwards_from_prefix_states_make_their_own_masks(clf, monkeypatch):
    """Forwards of the prefix path give the model its masks by layer type (none for the row-by-row
    attention, the new tokens' padding mask for the GDN layers), so Transformers' mask functions, which
    read the mask back to the host, never run; logits and kept states are bitwise those of the 2-D mask."""
    torch = pytest.importorskip("torch")
    from openjev.engine import prefix
    from openjev.engine.fused import gdn_modeling

    rows = _rows(clf.vocab_size)

    def run():
        engine = prefix.PrefixEngine(clf, 64 << 20, min_tokens=16)
        cold = engine.run_step(rows, max_rows=8).logits
        return cold, engine.run_step(rows, max_rows=8).logits, list(engine.cache.entries.values())

    modeling = gdn_modeling(clf.model)
    with monkeypatch.context() as mp:
        for name in ("create_causal_mask", "create_recurrent_attention_mask"):
            mp.setattr(modeling, name, lambda *a, _n=name, **k: pytest.fail(f"Transformers' {_n} ran"))
        own = run()
    monkeypatch.setattr(prefix.ContinuationForwards, "_masks", lambda self, mask, offset: mask)
    two_d = run()
    assert np.array_equal(own[0], two_d[0]) and np.array_equal(own[1], two_d[1])
    assert len(own[2]) == len(two_d[2]) > 0
    for a, b in zip(own[2], two_d[2]):
        assert a.length == b.length and all(torch.equal(getattr(a, k), getattr(b, k))
                                            for k in ("conv", "recurrent", "keys", "values"))


def test_the_masked_attention_mode_keeps_transformers_masks(clf, monkeypatch):
    """The GDN layers' mask is the one Transformers' function makes; with OPENJEV_PADDED_ATTENTION=masked
    Transformers' attention function runs, which needs its mask: the prefix path then hands the model
    the 2-D mask."""
    torch = pytest.importorskip("torch")
    from transformers.masking_utils import create_recurrent_attention_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from openjev.engine import attention, prefix

    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])  # a left-padded prefix, a right-padded token
    forwards = prefix.PrefixEngine(clf, 0).forwards
    made = forwards._masks(mask, 3)
    theirs = create_recurrent_attention_mask(clf.model.config.get_text_config(), torch.zeros((2, 2, 8)), mask)
    assert made["full_attention"] is None and torch.equal(made["linear_attention"], theirs)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", attention._INNER[0])  # as if never wrapped
    assert forwards._masks(mask, 3) is mask
