"""prepare_v100_model.py on real files: symlink overlay, hash checks, refusals, idempotence,
and the pinned hub download served from a loopback HTTP server speaking the hub's resolve API."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from conftest import REPO, error_lines, run_script, tree_digest

REVISION = "0123456789abcdef0123456789abcdef01234567"


def sources_with(tmp_path: Path, *, revision=None, pins=None) -> Path:
    src = json.loads((REPO / "HF_SOURCE.json").read_text())
    src["base_model"]["revision"] = revision
    src["base_model"]["files"] = pins or {"preprocessor_config.json": None, "video_preprocessor_config.json": None}
    path = tmp_path / "HF_SOURCE.json"
    path.write_text(json.dumps(src))
    return path


def real_pins(processor: Path) -> dict:
    return {n: hashlib.sha256((processor / n).read_bytes()).hexdigest()
            for n in ("preprocessor_config.json", "video_preprocessor_config.json")}


def copy_checkpoint(tiny_model, tmp_path: Path, edit=None) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model["checkpoint"], ckpt)
    if edit:
        cfg = json.loads((ckpt / "config.json").read_text())
        edit(cfg)
        (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


def prepare_args(tiny_model, ckpt: Path, out: Path) -> tuple:
    """The script and its arguments: an overlay of ckpt at out, with the tiny model's processor, unpinned."""
    return ("prepare_v100_model.py", ckpt, out, "--processor-dir", tiny_model["processor"], "--allow-unpinned")


def prepared_copy(tiny_model, tmp_path: Path) -> tuple[Path, Path, tuple]:
    """A copy of the tiny checkpoint with an overlay built from it: (checkpoint, overlay, the arguments)."""
    ckpt, out = copy_checkpoint(tiny_model, tmp_path), tmp_path / "model"
    args = prepare_args(tiny_model, ckpt, out)
    run_script(*args, check=True)
    return ckpt, out, args


def assert_refused(proc, out: Path, *words):
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if ".partial" in p.name], "half-made staging left behind"


def test_overlay_links_every_entry_and_leaves_checkpoint_untouched(tiny_model, tmp_path):
    ckpt = tiny_model["checkpoint"]
    before = tree_digest(ckpt)
    out = tmp_path / "model"
    proc = run_script("prepare_v100_model.py", ckpt, out, "--processor-dir", tiny_model["processor"],
                      "--sources", sources_with(tmp_path, pins=real_pins(tiny_model["processor"])))
    assert proc.returncode == 0, proc.stderr
    assert tree_digest(ckpt) == before
    for entry in ckpt.iterdir():
        link = out / entry.name
        assert link.is_symlink() and link.resolve() == entry.resolve()
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        assert (out / name).is_file() and not (out / name).is_symlink()
        assert (out / name).read_bytes() == (tiny_model["processor"] / name).read_bytes()
    marker = json.loads((out / ".openjev_overlay.json").read_text())
    assert marker["checkpoint"] == str(ckpt.resolve())
    assert marker["allow_unpinned"] is False
    assert all(e["pinned"] for e in marker["processor_files"].values())


def test_rerun_is_idempotent(tiny_model, tmp_path):
    out = tmp_path / "model"
    args = prepare_args(tiny_model, tiny_model["checkpoint"], out)
    run_script(*args, check=True)
    before = tree_digest(out)
    mtime = (out / ".openjev_overlay.json").stat().st_mtime_ns
    proc = run_script(*args)
    assert proc.returncode == 0, proc.stderr
    assert "nothing to do" in proc.stdout
    assert tree_digest(out) == before
    assert (out / ".openjev_overlay.json").stat().st_mtime_ns == mtime


def test_rerun_after_checkpoint_gains_a_file_rebuilds_atomically(tiny_model, tmp_path):
    ckpt, out, args = prepared_copy(tiny_model, tmp_path)
    (ckpt / "generation_config.json").write_text("{}")
    proc = run_script(*args)
    assert proc.returncode == 0, proc.stderr
    assert (out / "generation_config.json").resolve() == (ckpt / "generation_config.json").resolve()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model.")]


@pytest.mark.parametrize("edit,words", [
    (lambda c: c.update(num_labels=2, id2label={"0": "contradiction", "1": "entailment"}), ["3-label"]),
    (lambda c: c.update(model_type="llama"), ["model_type", "llama"]),
    (lambda c: c.update(model_type="qwen3_5_text", architectures=["Qwen3_5TextForSequenceClassification"]),
     ["qwen3_5_text", "launcher refuses it too"]),
    (lambda c: c.update(architectures=["Qwen3_5ForCausalLM"]), ["architectures"]),
    (lambda c: c.update(id2label={"0": "entailment", "1": "contradiction", "2": "neutral"}), ["id2label"]),
], ids=["two-labels", "not-qwen3.5", "text-only", "not-a-classifier", "wrong-label-order"])
def test_refuses_a_checkpoint_that_is_not_openjev(tiny_model, tmp_path, edit, words):
    ckpt = copy_checkpoint(tiny_model, tmp_path, edit)
    before = tree_digest(ckpt)
    out = tmp_path / "model"
    proc = run_script(*prepare_args(tiny_model, ckpt, out))
    assert_refused(proc, out, "not an OpenJEV classifier", *words)
    assert tree_digest(ckpt) == before


def test_refuses_hash_mismatch_even_with_allow_unpinned(tiny_model, tmp_path):
    pins = real_pins(tiny_model["processor"])
    pins["video_preprocessor_config.json"] = "0" * 64
    out = tmp_path / "model"
    proc = run_script("prepare_v100_model.py", tiny_model["checkpoint"], out, "--processor-dir",
                      tiny_model["processor"], "--sources", sources_with(tmp_path, pins=pins), "--allow-unpinned")
    assert_refused(proc, out, "video_preprocessor_config.json", "sha256", "0" * 64)


def test_refuses_null_pin_without_allow_unpinned(tiny_model, tmp_path):
    out = tmp_path / "model"
    proc = run_script("prepare_v100_model.py", tiny_model["checkpoint"], out, "--processor-dir",
                      tiny_model["processor"], "--sources", sources_with(tmp_path))
    assert_refused(proc, out, "no pinned sha256", "--allow-unpinned")


def test_refuses_missing_processor_file(tiny_model, tmp_path):
    proc_dir = tmp_path / "proc"
    proc_dir.mkdir()
    shutil.copy(tiny_model["processor"] / "preprocessor_config.json", proc_dir)
    out = tmp_path / "model"
    proc = run_script("prepare_v100_model.py", tiny_model["checkpoint"], out, "--processor-dir", proc_dir,
                      "--allow-unpinned")
    assert_refused(proc, out, "video_preprocessor_config.json")


def test_refuses_an_existing_out_it_did_not_make(tiny_model, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    before = tree_digest(out)
    proc = run_script(*prepare_args(tiny_model, tiny_model["checkpoint"], out))
    assert proc.returncode != 0
    assert len(error_lines(proc.stderr)) == 1 and "not an overlay" in proc.stderr
    assert tree_digest(out) == before


def test_refuses_an_overlay_of_another_checkpoint_unless_replace(tiny_model, tmp_path):
    other = copy_checkpoint(tiny_model, tmp_path)
    out = tmp_path / "model"
    run_script(*prepare_args(tiny_model, tiny_model["checkpoint"], out), check=True)
    proc = run_script(*prepare_args(tiny_model, other, out))
    assert proc.returncode != 0 and "--replace" in error_lines(proc.stderr)[0]
    proc = run_script(*prepare_args(tiny_model, other, out), "--replace")
    assert proc.returncode == 0, proc.stderr
    assert (out / "config.json").resolve() == (other / "config.json").resolve()


def test_missing_checkpoint_is_one_clear_line(tmp_path):
    proc = run_script("prepare_v100_model.py", tmp_path / "nope", tmp_path / "model")
    assert proc.returncode != 0 and error_lines(proc.stderr) == [
        f"prepare_v100_model.py: error: checkpoint {tmp_path / 'nope'} is not a directory"]


def test_default_out_is_under_openjev_root(tiny_model, tmp_path):
    proc = run_script("prepare_v100_model.py", tiny_model["checkpoint"], "--processor-dir", tiny_model["processor"],
                      "--allow-unpinned", env={"OPENJEV_V100_ROOT": str(tmp_path / "root")})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "root" / "model" / ".openjev_overlay.json").is_file()


# ---------------------------------------------------------------- pinned hub download over loopback
class FakeHub(http.server.ThreadingHTTPServer):
    """Serves /{repo}/resolve/{revision}/{file} as the hub does: HEAD metadata, then GET bytes."""

    def __init__(self, files: dict[str, bytes], revision: str):
        self.files, self.revision, self.requests = files, revision, []
        super().__init__(("127.0.0.1", 0), _HubHandler)


class _HubHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):  # keep test output clean
        pass

    def _resolve(self):
        self.server.requests.append((self.command, self.path))
        parts = self.path.split("?")[0].strip("/").split("/")
        # Qwen/Qwen3.5-4B/resolve/<rev>/<file>
        # the default branch ("main") resolves to the served revision, as the hub's does
        if len(parts) == 5 and parts[2] == "resolve" and parts[3] in (self.server.revision, "main") \
                and parts[4] in self.server.files:
            return self.server.files[parts[4]]
        return None

    def _headers(self, body: bytes | None):
        if body is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return False
        self.send_response(200)
        self.send_header("X-Repo-Commit", self.server.revision)
        self.send_header("ETag", '"' + hashlib.sha256(body).hexdigest() + '"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return True

    def do_HEAD(self):
        self._headers(self._resolve())

    def do_GET(self):
        body = self._resolve()
        if self._headers(body):
            self.wfile.write(body)


@pytest.fixture()
def fake_hub(tiny_model):
    files = {n: (tiny_model["processor"] / n).read_bytes()
             for n in ("preprocessor_config.json", "video_preprocessor_config.json")}
    hub = FakeHub(files, REVISION)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    yield hub
    hub.shutdown()


def hub_env(hub, tmp_path):
    return {"HF_ENDPOINT": f"http://127.0.0.1:{hub.server_address[1]}", "HF_HUB_CACHE": str(tmp_path / "hfcache"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}


def test_downloads_processor_configs_at_the_pinned_revision(tiny_model, fake_hub, tmp_path):
    out = tmp_path / "model"
    src = sources_with(tmp_path, revision=REVISION, pins=real_pins(tiny_model["processor"]))
    proc = run_script("prepare_v100_model.py", tiny_model["checkpoint"], out, "--sources", src,
                      env=hub_env(fake_hub, tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert {p for _, p in fake_hub.requests} >= {
        f"/Qwen/Qwen3.5-4B/resolve/{REVISION}/preprocessor_config.json",
        f"/Qwen/Qwen3.5-4B/resolve/{REVISION}/video_preprocessor_config.json"}
    marker = json.loads((out / ".openjev_overlay.json").read_text())
    assert marker["processor_files"]["preprocessor_config.json"]["source"].startswith(f"hf://Qwen/Qwen3.5-4B@{REVISION}")


def test_downloaded_file_with_wrong_hash_is_refused(tiny_model, fake_hub, tmp_path):
    pins = real_pins(tiny_model["processor"])
    pins["preprocessor_config.json"] = hashlib.sha256(b"something else").hexdigest()
    out = tmp_path / "model"
    proc = run_script("prepare_v100_model.py", tiny_model["checkpoint"], out,
                      "--sources", sources_with(tmp_path, revision=REVISION, pins=pins), env=hub_env(fake_hub, tmp_path))
    assert_refused(proc, out, "preprocessor_config.json", "sha256")


def test_unpinned_revision_refuses_to_download(tiny_model, fake_hub, tmp_path):
    out = tmp_path / "model"
    proc = run_script("prepare_v100_model.py", tiny_model["checkpoint"], out,
                      "--sources", sources_with(tmp_path, pins=real_pins(tiny_model["processor"])),
                      env=hub_env(fake_hub, tmp_path))
    assert_refused(proc, out, "pins no revision")
    assert fake_hub.requests == []


def test_pins_recorded_on_first_use_are_verified_after(tiny_model, fake_hub, tmp_path):
    """Where HF_SOURCE.json pins neither the revision nor the hashes: refused without a choice;
    --record-pins records the default branch's commit and both sha256 (the receipt says so); a later
    run downloads at that commit and verifies against the record; a changed upstream file or an
    edited record is refused; verify_sources.py lists the host's pins as such."""
    src, pins_file = sources_with(tmp_path), tmp_path / "root" / "pins.json"
    env = hub_env(fake_hub, tmp_path)

    def prepare(out, *extra, cache="hfcache"):
        return run_script("prepare_v100_model.py", tiny_model["checkpoint"], tmp_path / out, "--sources", src,
                          "--pins", pins_file, *extra, env={**env, "HF_HUB_CACHE": str(tmp_path / cache)})

    assert_refused(prepare("m0"), tmp_path / "m0", "pins no revision", "--record-pins")
    first = prepare("m1", "--record-pins")
    assert first.returncode == 0, first.stderr
    assert ("GET", "/Qwen/Qwen3.5-4B/resolve/main/preprocessor_config.json") in fake_hub.requests
    pins = json.loads(pins_file.read_text())
    assert pins["kind"] == "openjev-host-pins" and pins["pins"]["base_model.revision"]["value"] == REVISION
    assert pins["pins"]["base_model.files.preprocessor_config.json"]["value"] == real_pins(tiny_model["processor"])[
        "preprocessor_config.json"]
    marker = json.loads((tmp_path / "m1" / ".openjev_overlay.json").read_text())
    assert marker["processor_files"]["preprocessor_config.json"]["pin"] == "recorded now (trust on first use)"
    fake_hub.requests.clear()
    second = prepare("m2", cache="hfcache2")
    assert second.returncode == 0, second.stderr
    assert {p for _, p in fake_hub.requests} == {f"/Qwen/Qwen3.5-4B/resolve/{REVISION}/{n}" for n in
                                                 ("preprocessor_config.json", "video_preprocessor_config.json")}
    marker = json.loads((tmp_path / "m2" / ".openjev_overlay.json").read_text())
    assert marker["processor_files"]["video_preprocessor_config.json"]["pin"] == "host"
    listed = run_script("verify_sources.py", "--pins", pins_file)
    assert listed.returncode == 0 and "host pin  base_model.revision = " + REVISION in listed.stdout, listed.stdout
    fake_hub.files["preprocessor_config.json"] += b"\n"  # upstream changed
    assert_refused(prepare("m3", cache="hfcache3"), tmp_path / "m3", "preprocessor_config.json", "recorded")
    doc = json.loads(pins_file.read_text())
    doc["pins"]["base_model.files.video_preprocessor_config.json"]["value"] = "0" * 64
    pins_file.write_text(json.dumps(doc))
    fake_hub.files["preprocessor_config.json"] = (tiny_model["processor"] / "preprocessor_config.json").read_bytes()
    assert_refused(prepare("m4", cache="hfcache4"), tmp_path / "m4", "video_preprocessor_config.json", "0" * 64)


def test_help_documents_the_options():
    proc = run_script("prepare_v100_model.py", "--help")
    assert proc.returncode == 0
    for flag in ("--processor-dir", "--sources", "--allow-unpinned", "--replace", "OPENJEV_V100_ROOT"):
        assert flag in proc.stdout


# ---------------------------------------------------------------- incomplete checkpoints, carried configs
def _shard(ckpt: Path) -> None:
    """Split the single-file checkpoint into two shards and their index (real tensors)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(ckpt / "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in halves.items():
        save_file({n: state[n] for n in part}, str(ckpt / shard))
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        n: shard for shard, part in halves.items() for n in part}}))


@pytest.mark.parametrize("remove,words", [
    (("model.safetensors",), ("incomplete", "model.safetensors (no weights")),
    (("tokenizer.json",), ("incomplete", "tokenizer.json")),
    (("tokenizer_config.json", "tokenizer.json"), ("incomplete", "tokenizer_config.json, tokenizer.json")),
])
def test_refuses_an_incomplete_checkpoint_with_the_list(tiny_model, tmp_path, remove, words):
    ckpt = copy_checkpoint(tiny_model, tmp_path)
    for name in remove:
        (ckpt / name).unlink()
    out = tmp_path / "model"
    proc = run_script(*prepare_args(tiny_model, ckpt, out))
    assert_refused(proc, out, *words)


def test_sharded_checkpoint_needs_every_shard_its_index_names(tiny_model, tmp_path):
    ckpt = copy_checkpoint(tiny_model, tmp_path)
    _shard(ckpt)
    out = tmp_path / "model"
    args = prepare_args(tiny_model, ckpt, out)
    second = (ckpt / "model-00002-of-00002.safetensors").read_bytes()
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    assert_refused(run_script(*args), out, "incomplete", "model-00002-of-00002.safetensors")
    assert "model-00001" not in error_lines(run_script(*args).stderr)[0]
    (ckpt / "model-00002-of-00002.safetensors").write_bytes(second)
    proc = run_script(*args)
    assert proc.returncode == 0, proc.stderr
    assert (out / "model-00002-of-00002.safetensors").is_symlink()


def _rewrite_weights(ckpt: Path, case: str) -> None:
    from safetensors.torch import load_file, save_file

    path = ckpt / "model.safetensors"
    if case == "empty":
        path.write_bytes(b"")
    elif case == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 1000])
    elif case == "fifteen_missing":
        state = load_file(str(path))
        for name in sorted(n for n in state if n.startswith("model.language_model.layers."))[:15]:
            del state[name]
        save_file(state, str(path))
    elif case == "no_head":
        state = load_file(str(path))
        del state["score.weight"]
        save_file(state, str(path))


@pytest.mark.parametrize("case,words", [
    ("empty", ("would not load", "model.safetensors has 0 bytes")),
    ("truncated", ("would not load", "truncated")),
    ("fifteen_missing", ("would not load", "15 missing tensor(s)")),
    ("no_head", ("would not load", "no 'score.weight'")),
])
def test_refuses_weights_that_would_not_load_read_from_their_headers(tiny_model, tmp_path, case, words):
    ckpt = copy_checkpoint(tiny_model, tmp_path)
    _rewrite_weights(ckpt, case)
    out = tmp_path / "model"
    proc = run_script(*prepare_args(tiny_model, ckpt, out))
    assert_refused(proc, out, *words)


def test_missing_checkpoint_files_pure():
    from prepare_v100_model import missing_checkpoint_files
    full = {"config.json", "tokenizer_config.json", "tokenizer.json", "model.safetensors"}
    assert missing_checkpoint_files(full, None) == []
    assert missing_checkpoint_files(full - {"tokenizer.json"} | {"vocab.json", "merges.txt"}, None) == []
    assert missing_checkpoint_files({"config.json"}, {"weight_map": {}})[-1].startswith("model.safetensors.index.json")
    assert missing_checkpoint_files(full, {"weight_map": {"a": "s1", "b": "s2", "c": "s1"}}) == ["s1", "s2"]


def test_processor_config_carried_by_the_checkpoint_is_checked_against_the_pin(tiny_model, tmp_path):
    ckpt = copy_checkpoint(tiny_model, tmp_path)
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        shutil.copy(tiny_model["processor"] / name, ckpt / name)
    pins = real_pins(tiny_model["processor"])
    out = tmp_path / "model"
    # the pinned bytes: accepted and recorded as pinned
    proc = run_script("prepare_v100_model.py", ckpt, out, "--sources", sources_with(tmp_path, pins=pins))
    assert proc.returncode == 0, proc.stderr
    marker = json.loads((out / ".openjev_overlay.json").read_text())
    assert {e["source"] for e in marker["processor_files"].values()} == {"checkpoint"}
    assert all(e["pinned"] for e in marker["processor_files"].values())
    shutil.rmtree(out)
    # a carried config that differs from the pin: refused, then accepted only with --allow-unpinned (recorded)
    cfg = json.loads((ckpt / "preprocessor_config.json").read_text())
    cfg["image_mean"] = [0.0, 0.0, 0.0]
    (ckpt / "preprocessor_config.json").write_text(json.dumps(cfg))
    digest = hashlib.sha256((ckpt / "preprocessor_config.json").read_bytes()).hexdigest()
    proc = run_script("prepare_v100_model.py", ckpt, out, "--sources", sources_with(tmp_path, pins=pins))
    assert_refused(proc, out, "carries preprocessor_config.json", digest, pins["preprocessor_config.json"],
                   "--allow-unpinned")
    # a null pin for a carried config is refused as well
    proc = run_script("prepare_v100_model.py", ckpt, out, "--sources", sources_with(tmp_path))
    assert_refused(proc, out, "carries", "null", "--allow-unpinned")
    proc = run_script("prepare_v100_model.py", ckpt, out, "--sources", sources_with(tmp_path, pins=pins),
                      "--allow-unpinned")
    assert proc.returncode == 0, proc.stderr
    assert "unpinned processor configs accepted" in proc.stderr
    entry = json.loads((out / ".openjev_overlay.json").read_text())["processor_files"]["preprocessor_config.json"]
    assert entry["pinned"] is False and entry["sha256"] == digest and entry["accepted_by"] == "--allow-unpinned"


def test_rebuild_never_deletes_a_file_it_did_not_create(tiny_model, tmp_path):
    ckpt, out, args = prepared_copy(tiny_model, tmp_path)
    (out / "operator_notes.txt").write_text("mine\n")
    assert run_script(*args).returncode == 0  # nothing changed: a no-op keeps the file
    (ckpt / "generation_config.json").write_text("{}")  # the checkpoint changed: a rebuild is due
    proc = run_script(*args)
    assert proc.returncode != 0
    (line,) = error_lines(proc.stderr)
    assert "did not create" in line and "operator_notes.txt" in line
    assert (out / "operator_notes.txt").read_text() == "mine\n"
    assert not (out / "generation_config.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model.")]


def test_stale_partial_of_a_dead_run_is_cleaned_with_a_line(tiny_model, tmp_path):
    import subprocess
    import sys
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".model.partial-{dead.pid}"
    (stale / "sub").mkdir(parents=True)
    out = tmp_path / "model"
    proc = run_script(*prepare_args(tiny_model, tiny_model["checkpoint"], out))
    assert proc.returncode == 0, proc.stderr
    assert f"removing .model.partial-{dead.pid}" in proc.stderr
    assert not stale.exists() and out.is_dir()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions, so a read-only parent cannot be made")
def test_read_only_parent_is_one_clear_line(tiny_model, tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        proc = run_script("prepare_v100_model.py", tiny_model["checkpoint"], parent / "model", "--processor-dir",
                          tiny_model["processor"], "--allow-unpinned")
    finally:
        parent.chmod(0o755)
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr)
    assert "Traceback" not in proc.stderr and "ermission denied" in line


def test_unwritable_out_location_is_one_clear_line(tiny_model, tmp_path):
    (tmp_path / "afile").write_text("not a folder\n")  # OUT's parent is a file: an OSError as root too
    proc = run_script("prepare_v100_model.py", tiny_model["checkpoint"], tmp_path / "afile" / "model",
                      "--processor-dir", tiny_model["processor"], "--allow-unpinned")
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr)
    assert "Traceback" not in proc.stderr and "afile" in line and "nothing was changed" in line
    assert (tmp_path / "afile").read_text() == "not a folder\n"
