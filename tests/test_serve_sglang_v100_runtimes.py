"""app/serve_sglang_v100.sh against the SGLang runtimes it launches: the flag spelling of each runtime
and version, the runtime it detects, the emitted flags checked against the installed sglang's own
argument parser when sglang is importable and always against the checked-in table of the pinned
runtime, and the version matrix of docs/sglang_adapter.md. The launcher runs as in tests/_serve_sglang_support.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _serve_sglang_support import (BASH, LAUNCHER, PY, REPO, SM70, SM90, error_line, flag_map, launcher_env, printed,
                                   sglang_flags)
from _serve_sglang_support import checkpoint, root, run, tools  # noqa: F401 - fixtures

TABLE_PATH = REPO / "app" / "sglang_flags_v100-dca48890.json"
TABLE = json.loads(TABLE_PATH.read_text())


# ---------------------------------------------------------------- the flag reference
def _table_reference() -> dict[str, list | None]:
    ref: dict[str, list | None] = {}
    for entry in TABLE["flags"]:
        for name in entry["names"]:
            ref[name] = entry.get("choices")
    return ref


def _parser_reference() -> tuple[dict[str, list | None] | None, str]:
    try:
        import sglang  # noqa: F401  (only on a machine with the runtime installed)
        from sglang.srt.server_args import ServerArgs
    except Exception as exc:  # noqa: BLE001 - any import failure means "no runtime here"
        return None, f"{type(exc).__name__}: {exc}"
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ref = {}
    for action in parser._actions:
        for opt in action.option_strings:
            ref[opt] = list(action.choices) if action.choices is not None else None
    return ref, f"sglang-{getattr(sys.modules['sglang'], '__version__', 'unknown')}"


TABLE_REF = _table_reference()
TABLE_LABEL = f"table-{TABLE['source']['repo'].split('/')[1]}@{TABLE['source']['commit'][:8]}"
PARSER_REF, PARSER_LABEL = _parser_reference()
if PARSER_REF is None and os.environ.get("OPENJEV_REQUIRE_SGLANG") == "1":
    # `make test` runs this module in each real-SGLang venv with this set: no silent skips there.
    raise RuntimeError(f"OPENJEV_REQUIRE_SGLANG=1 but sglang's parser is not importable: {PARSER_LABEL}")
# Stock SGLang has no SM70 backends (tilelang_fa_v100 is the fork's): SM70 scenarios are checked
# against the fork's table, stock scenarios against the installed parser.
INSTALLED_IS_FORK = bool(PARSER_REF) and "tilelang_fa_v100" in (PARSER_REF.get("--attention-backend") or [])


# ---------------------------------------------------------------- the flag tables
SCENARIOS = {
    "sm70-default": ([], SM70),
    "sm70-disable-radix-cache": (["--disable-radix-cache"], SM70),
    "sm70-env-overrides": ([], {**SM70, "MAX_RUNNING_REQUESTS": "32", "SCHEDULE_POLICY": "fcfs",
                                "CONTEXT_LENGTH": "4096", "MEM_FRACTION_STATIC": "0.7",
                                "MAMBA_FULL_MEMORY_RATIO": "0.9", "SGLANG_V100_DYNAMIC_PAGED": "0"}),
    "sm90-stock": ([], SM90),
    "sm90-disable-radix-cache": (["--disable-radix-cache"], SM90),
}


def _check_against(reference: dict, run, checkpoint, args, env) -> None:
    _, argv = printed(run(checkpoint, 31003, *args, "--print-command", env=env))
    for flag, value in sglang_flags(argv):
        assert flag in reference, f"{flag} is not an argument of the reference parser"
        choices = reference[flag]
        if choices is not None:
            assert value in [str(c) for c in choices], f"{flag} {value} not in {choices}"


@pytest.mark.parametrize("scenario", list(SCENARIOS), ids=[f"{s}-vs-{TABLE_LABEL}" for s in SCENARIOS])
def test_emitted_flags_exist_in_pinned_runtime_table(run, checkpoint, scenario):
    args, env = SCENARIOS[scenario]
    _check_against(TABLE_REF, run, checkpoint, args, env)


# ---------------------------------------------------------------- runtimes and their flag dialects
STOCK_VERSIONS = ("0.5.13", "0.5.14", "0.5.23")
INSTALLED = (("fork-" if INSTALLED_IS_FORK else "stock-") + PARSER_LABEL.removeprefix("sglang-")) if PARSER_REF else None
LEGACY = {"--disable-cuda-graph": None, "--disable-piecewise-cuda-graph": None}
NEW = {"--cuda-graph-backend-decode": "disabled", "--cuda-graph-backend-prefill": "disabled"}


def dialect_flags(runtime: str, strategy: str) -> dict:
    legacy = runtime.startswith("fork") or runtime == "stock-0.5.13"
    return {**LEGACY, "--mamba-scheduler-strategy": strategy} if legacy else {**NEW, "--mamba-radix-cache-strategy": strategy}


@pytest.mark.parametrize("runtime", ["fork", "stock-0.5.13", "stock-0.5.14", "stock-0.5.23", "stock-0.6.1"])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_each_runtime_gets_its_own_flag_spelling(run, checkpoint, runtime, cached):
    args = [] if cached else ["--disable-radix-cache"]
    env, argv = printed(run(checkpoint, 31003, *args, "--print-command", gcc=False,
                            env={**SM90, "OPENJEV_SGLANG_RUNTIME": runtime}))
    flags = flag_map(argv)
    want = dialect_flags(runtime, "extra_buffer" if cached else "no_buffer")
    assert {k: flags.get(k, "<absent>") for k in want} == want
    other = set(LEGACY) | set(NEW) | {"--mamba-scheduler-strategy", "--mamba-radix-cache-strategy"}
    assert not (other - set(want)) & set(flags), "no flag of the other dialect"
    assert ("--disable-radix-cache" in flags) is not cached
    assert flags["--max-running-requests"] == "16" and flags["--schedule-policy"] == "lpm"
    assert env["OPENJEV_SGLANG_RUNTIME"] == (runtime if runtime != "fork" else "fork-unknown")


def test_the_other_strategy_spelling_replaces_the_default(run, checkpoint):
    _, argv = printed(run(checkpoint, 31003, "--mamba-scheduler-strategy", "no_buffer", "--print-command", gcc=False,
                          env={**SM90, "OPENJEV_SGLANG_RUNTIME": "stock-0.5.14"}))
    assert "--mamba-radix-cache-strategy" not in flag_map(argv)
    _, argv = printed(run(checkpoint, 31003, "--mamba-radix-cache-strategy=no_buffer", "--print-command", env=SM70))
    assert "--mamba-scheduler-strategy" not in flag_map(argv)


@pytest.mark.parametrize("value,needle", [
    ("stock-0.5.12", "older than 0.5.13"), ("vllm", "OPENJEV_SGLANG_RUNTIME must be"), ("stock", "must be"),
    ("stock-latest", "cannot read the SGLang version"),
])
def test_unsupported_runtime_refused(run, checkpoint, value, needle):
    proc = run(checkpoint, 31003, "--print-command", env={**SM90, "OPENJEV_SGLANG_RUNTIME": value})
    assert proc.returncode == 1 and needle in error_line(proc) and proc.stdout == ""


@pytest.mark.parametrize("version", STOCK_VERSIONS)
def test_sm70_needs_the_fork(run, checkpoint, version):
    proc = run(checkpoint, 31003, "--print-command", env={**SM70, "OPENJEV_SGLANG_RUNTIME": f"stock-{version}"})
    assert proc.returncode == 1 and f"has stock SGLang {version}" in error_line(proc) and "fork" in proc.stderr


def test_runtime_is_detected_from_the_interpreter(run, checkpoint):
    """No OPENJEV_SGLANG_RUNTIME: the launcher reads the SGLang that OPENJEV_PYTHON imports."""
    proc = run(checkpoint, 31003, "--print-command", gcc=False, env={"OPENJEV_GPU_ARCH": "sm90"})
    if PARSER_REF is None:
        assert proc.returncode == 1
        line = error_line(proc)
        assert "sglang is not importable with" in line and "OPENJEV_SGLANG_RUNTIME" in line
        return
    env, argv = printed(proc)
    assert env["OPENJEV_SGLANG_RUNTIME"] == INSTALLED
    assert dialect_flags(INSTALLED, "extra_buffer").items() <= flag_map(argv).items()


def test_runtime_is_detected_through_the_operators_pythonpath(run, checkpoint, tmp_path):
    """SGLang installed with `pip install --target DIR` and reached through PYTHONPATH (as on a machine
    whose image already has torch): detection sees what the launched server will import."""
    site = tmp_path / "site"
    (site / "sglang" / "srt").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    (site / "sglang" / "srt" / "server_args.py").write_text("# stock\n")
    (site / "sglang-0.5.23.dist-info").mkdir()
    (site / "sglang-0.5.23.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
    env = {"OPENJEV_GPU_ARCH": "sm90", "PYTHONPATH": str(site)}
    proc = run(checkpoint, 31003, "--print-command", gcc=False, env=env)
    got, _ = printed(proc)
    assert got["OPENJEV_SGLANG_RUNTIME"] == "stock-0.5.23"
    assert got["PYTHONPATH"] == f"{REPO}:{site}"


def test_runtime_line_and_adaptation_helpers():
    from sglang_openjev import launch_server as ls

    assert ls.parse_runtime("stock-0.5.14") == ls.Runtime("stock", "0.5.14", "0.5.14")
    assert ls.parse_runtime("fork-0.5.13") == ls.Runtime("fork", "0.5.13", "legacy")
    assert ls.parse_runtime("stock-0.5.13.post1").dialect == "legacy"
    assert "newer than the newest version checked" in ls.runtime_line("stock-0.6.1")
    argv = ["--mamba-radix-cache-strategy", "extra_buffer", "--is-embedding"]
    closest, note = ls.closest_without_extra_buffer(argv)
    assert closest == ["--mamba-radix-cache-strategy", "no_buffer", "--is-embedding", "--disable-overlap-schedule"]
    assert "closest setting" in note and "prefix cache on" in note
    assert ls.closest_without_extra_buffer(["--mamba-scheduler-strategy=extra_buffer"])[0][0] == \
        "--mamba-scheduler-strategy=no_buffer"
    unchanged = ["--mamba-scheduler-strategy", "no_buffer"]
    assert ls.closest_without_extra_buffer(unchanged) == (unchanged, None)

    class Hardcoded:  # the 0.5.14 shape: a method with a hard-coded architecture list
        linear_attn_backend = "triton"

        def _support_mamba_cache_extra_buffer(self, model_arch):
            return model_arch == "Qwen3_5ForConditionalGeneration" and self.linear_attn_backend == "triton"

    assert Hardcoded()._support_mamba_cache_extra_buffer("Qwen3_5ForSequenceClassification") is False
    admitted, note = ls.adapt_extra_buffer(Hardcoded, [])
    assert admitted and "hard-coded" in note
    assert Hardcoded()._support_mamba_cache_extra_buffer("Qwen3_5ForSequenceClassification") is True
    assert Hardcoded()._support_mamba_cache_extra_buffer("LlamaForCausalLM") is False
    assert ls.adapt_extra_buffer(Hardcoded, []) == (True, None)  # once only
    assert ls.adapt_extra_buffer(object, ["support_mamba_cache_extra_buffer"]) == (True, None)
    assert ls.adapt_extra_buffer(object, []) == (False, None)


def test_server_info_reports_the_runtime_and_the_adaptations():
    """What adapt_to_runtime leaves in the environment reaches /server_info's adapter keys."""
    from types import SimpleNamespace

    from sglang_openjev import contract, routes

    sa = SimpleNamespace(model_path="/m", dtype="float16", device="cpu", schedule_policy="lpm",
                         max_running_requests=16, disable_radix_cache=False, mamba_radix_cache_strategy="extra_buffer",
                         mamba_full_memory_ratio=3.0, attention_backend=None)
    tm = SimpleNamespace(server_args=sa, served_model_name="m")
    limits = contract.Limits(vocab_size=96, context_length=8192, max_batch_size=512)
    note = "extra_buffer admitted for Qwen3_5ForSequenceClassification as for Qwen3_5ForConditionalGeneration"
    info = routes.adapter_server_info(tm, limits, routes.Counters(), {
        "OPENJEV_SGLANG_RUNTIME": "stock-0.5.14", "OPENJEV_LAUNCH_ADAPTATIONS": json.dumps([note])})
    assert (info["sglang_runtime"], info["launch_adaptations"]) == ("stock-0.5.14", [note])
    assert info["mamba_scheduler_strategy"] == "extra_buffer" and info["radix_cache"] is True
    info = routes.adapter_server_info(tm, limits, routes.Counters(), {})
    assert (info["sglang_runtime"], info["launch_adaptations"]) == (None, [])


# ------------------------------------------------- the version matrix (docs/sglang_adapter.md)
# Rows: runtime x scenario. Command: the SGLang flags beyond COMMON_FLAGS, as --print-command composes
# them. Verdict: the fork's rows against its checked-in table (every environment); a stock version's
# rows against that version's own parser and prepare_server_args (only in that version's venv).
MATRIX_RUNTIMES = {"fork table": "fork", **{v: f"stock-{v}" for v in STOCK_VERSIONS}}
MATRIX_SCENARIOS = {"SM70 cached": ("sm70", []), "SM70 uncached": ("sm70", ["--disable-radix-cache"]),
                    "SM90 cached": ("sm90", []), "SM90 uncached": ("sm90", ["--disable-radix-cache"])}
COMMON_FLAGS = {"--model-path": None, "--host": "127.0.0.1", "--port": "31003", "--is-embedding": None,
                "--dtype": "float16", "--context-length": "8192", "--mem-fraction-static": "0.8",
                "--max-running-requests": "16", "--schedule-policy": "lpm", "--mamba-full-memory-ratio": "3",
                "--enable-metrics": None}
MATRIX_DOC = REPO / "docs" / "sglang_adapter.md"
MATRIX_BEGIN, MATRIX_END = "<!-- version-matrix:begin -->", "<!-- version-matrix:end -->"
CPU_STOP = "stops only at the GPU check"


def matrix_command(run, checkpoint, runtime: str, scenario: str) -> tuple[str, list[str] | None]:
    arch, args = MATRIX_SCENARIOS[scenario]
    proc = run(checkpoint, 31003, *args, "--print-command", gcc=arch == "sm70",
               env={"OPENJEV_GPU_ARCH": arch, "OPENJEV_SGLANG_RUNTIME": runtime})
    if proc.returncode != 0:
        return f"refused by the launcher: {error_line(proc).split('error: ', 1)[1].split(' (haohervchb')[0]}", None
    _, argv = printed(proc)
    pairs = sglang_flags(argv)
    for flag, value in COMMON_FLAGS.items():
        assert (flag, str(checkpoint) if flag == "--model-path" else value) in pairs, flag
    rest = [f"{f} {v}" if v is not None else f for f, v in pairs if f not in COMMON_FLAGS]
    return "`" + " ".join(rest) + "`", argv[argv.index("-m") + 2:]


def documented_matrix() -> dict[tuple[str, str], tuple[str, str]]:
    text = MATRIX_DOC.read_text()
    assert MATRIX_BEGIN in text and MATRIX_END in text, f"{MATRIX_DOC.name} has no {MATRIX_BEGIN} ... {MATRIX_END} table"
    rows = {}
    for line in text.split(MATRIX_BEGIN, 1)[1].split(MATRIX_END, 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 4 and cells[0] in MATRIX_RUNTIMES:
            rows[(cells[0], cells[1])] = (cells[2], cells[3])
    return rows


def expected_row(run, checkpoint, column: str, scenario: str, verdicts: dict) -> tuple[str, str | None]:
    command, argv = matrix_command(run, checkpoint, MATRIX_RUNTIMES[column], scenario)
    if argv is None:
        return command, "not composed"
    if column == "fork table":
        for flag, value in sglang_flags(["-m", "x", *argv]):
            assert flag in TABLE_REF and (TABLE_REF[flag] is None or value in map(str, TABLE_REF[flag])), (flag, value)
        return command, f"accepted: every flag and value is in {TABLE_PATH.name}"
    return command, verdicts.get(scenario)


def test_documented_version_matrix_matches_what_the_launcher_composes(run, checkpoint, stock_verdicts):
    """Every command cell in every environment; the verdict cells of the fork (its table) everywhere and
    of the installed stock version (its real parser) here. The message lists the rows to paste."""
    documented = documented_matrix()
    expected, mismatches = {}, []
    for column in MATRIX_RUNTIMES:
        mine = INSTALLED == MATRIX_RUNTIMES[column]
        for scenario in MATRIX_SCENARIOS:
            command, verdict = expected_row(run, checkpoint, column, scenario, stock_verdicts if mine else {})
            got = documented.get((column, scenario), ("<missing>", "<missing>"))
            expected[(column, scenario)] = (command, verdict if verdict is not None else got[1])
            if got[0] != command or (verdict is not None and got[1] != verdict):
                mismatches.append(f"| {column} | {scenario} | {command} | {expected[(column, scenario)][1]} |")
    assert not mismatches, "docs/sglang_adapter.md's version matrix differs; expected rows:\n" + "\n".join(mismatches)
    assert set(documented) == set(expected), sorted(set(documented) ^ set(expected))


@pytest.fixture(scope="module")
def stock_verdicts(tools, tmp_path_factory) -> dict[str, str]:
    """Verdicts of the installed stock SGLang for the SM90 scenarios ({} without one)."""
    if PARSER_REF is None or INSTALLED_IS_FORK:
        return {}
    base = tmp_path_factory.mktemp("matrix")
    root, ckpt = base / "root", base / "model"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(PROBE_CONFIG))

    def _run(*args, env=None, gcc=True):
        return subprocess.run([BASH, str(LAUNCHER), *map(str, args)], capture_output=True, text=True, timeout=60,
                              env=launcher_env(tools, root, env, gcc, ()))

    argvs = {}
    for scenario in ("SM90 cached", "SM90 uncached"):
        arch, args = MATRIX_SCENARIOS[scenario]
        _, argv = printed(_run(ckpt, 31003, *args, "--print-command", gcc=False, env={"OPENJEV_GPU_ARCH": arch}))
        argvs[scenario] = argv[argv.index("-m") + 2:]
    out = base / "verdicts.json"
    proc = subprocess.run([PY, __file__, "--server-args-probe", str(out), json.dumps(argvs)], capture_output=True,
                          text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0 and out.exists(), f"probe failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    probe = json.loads(out.read_text())
    verdicts = {}
    for scenario, argv in argvs.items():
        verdicts[scenario] = stock_verdict(scenario, argv, probe[scenario])
    adapted = [a for a in probe["SM90 cached"]["adaptations"] if "hard-coded" in a]
    if adapted:  # 0.5.14: without the adaptation SGLang refuses extra_buffer for the architecture
        assert "extra_buffer is not supported for Qwen3_5ForSequenceClassification" in probe["unadapted"], probe
        verdicts["SM90 cached"] += (f"; needs the adapter's admission (without: \"{probe['unadapted'].split(': ', 1)[1]}\")")
    elif probe["unadapted"] is not None:  # the other versions admit it through the registry alone
        assert probe["unadapted"] == probe["SM90 cached"].get("error"), probe
    # A runtime the launcher was told that is not the installed one is listed, not silently believed.
    assert f"OPENJEV_SGLANG_RUNTIME=fork-0.5.13, but the installed SGLang is {INSTALLED}" in probe["given_fork"]
    return verdicts


def stock_verdict(scenario: str, argv: list[str], probe: dict) -> str:
    """The installed version's argparse and prepare_server_args on ARGV, with the intended meaning checked."""
    parser = argparse.ArgumentParser()
    from sglang.srt.server_args import ServerArgs

    ServerArgs.add_cli_args(parser)
    actions = {o: a for a in parser._actions for o in a.option_strings}
    parser.parse_args(argv)  # SystemExit (a test failure) on anything this version's argparse refuses
    for flag, _ in sglang_flags(["-m", "x", *argv]):
        assert "deprecated" not in (actions[flag].help or "").lower(), f"{flag} is deprecated in {PARSER_LABEL}"
    cached = "--disable-radix-cache" not in argv
    strategy = "extra_buffer" if cached else "no_buffer"
    if probe["ok"]:
        fields = probe["fields"]
        assert fields["disable_radix_cache"] is (not cached)
        assert fields["strategy"] == strategy and fields["cuda_graph_off"] is True
        assert (fields["max_running_requests"], fields["schedule_policy"], fields["is_embedding"]) == (16, "lpm", True)
        return (f"accepted: argparse; prepare_server_args (--device cpu): radix cache {'on' if cached else 'off'}, "
                f"{strategy}, CUDA graphs off, lpm, cap 16")
    assert cached, f"prepare_server_args refused the uncached profile: {probe['error']}"
    # On this GPU-less host SGLang's extra_buffer check ends at its platform assertion, which each
    # version makes after the architecture check; anything else (e.g. the 0.5.14 architecture list) fails.
    gpu_only = ("only supported on CUDA", "needs CUDA/MUSA/NPU", "requires platform support")
    assert probe["error"].startswith("AssertionError") and any(m in probe["error"] for m in gpu_only), probe["error"]
    return (f"accepted: argparse; prepare_server_args (--device cpu) admits extra_buffer for the architecture and "
            f"{CPU_STOP} (\"{probe['error'].split(': ', 1)[1].rstrip('.')}\")")


# A Qwen3.5 classifier config.json as Transformers writes it, shrunk: ServerArgs reads the config only.
PROBE_CONFIG = {
    "architectures": ["Qwen3_5ForSequenceClassification"], "model_type": "qwen3_5", "torch_dtype": "float16",
    "id2label": {"0": "contradiction", "1": "entailment", "2": "neutral"},
    "label2id": {"contradiction": 0, "entailment": 1, "neutral": 2}, "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen3_5_text", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
                    "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                    "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
                    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
                    "layer_types": ["linear_attention", "full_attention"] * 2, "max_position_embeddings": 32768,
                    "pad_token_id": 0, "eos_token_id": 1},
    "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32},
}


def server_args_probe(out: str, argvs_json: str) -> None:
    """In a fresh process: what launch_server does before SGLang parses (environment, config preflight,
    architecture registration, version adaptations), then the version's prepare_server_args with
    --device cpu (this host has no GPU) for each scenario. Writes {scenario: {ok, fields|error}}."""
    import logging

    logging.disable(logging.WARNING)
    from sglang_openjev import launch_server as ls, routes

    report = {}
    from sglang.srt.server_args import prepare_server_args

    scenarios = json.loads(argvs_json)
    # First the cached profile as SGLang alone takes it (architecture registered, no version adaptation).
    ls.prepare_environment(os.environ)
    ls.register_hybrid_architectures()
    try:
        prepare_server_args([*ls.with_embedding_flag(scenarios["SM90 cached"]), "--device", "cpu"])
        report["unadapted"] = None
    except Exception as exc:  # noqa: BLE001 - recorded and judged by the test
        report["unadapted"] = f"{type(exc).__name__}: {exc}"
    for scenario, argv in scenarios.items():
        ls.prepare_environment(os.environ)
        ls.preflight_checkpoint(ls.model_path_from_argv(argv))
        argv, adaptations, _ = ls.adapt_to_runtime(ls.with_embedding_flag(argv), os.environ)
        try:
            sa = prepare_server_args([*argv, "--device", "cpu"])
        except Exception as exc:  # noqa: BLE001 - recorded and judged by the test
            report[scenario] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "adaptations": adaptations}
            continue
        graphs_off = getattr(sa, "disable_cuda_graph", False) or (
            getattr(sa, "cuda_graph_backend_decode", None) == "disabled"
            and getattr(sa, "cuda_graph_backend_prefill", None) == "disabled")
        report[scenario] = {"ok": True, "adaptations": adaptations, "fields": {
            "disable_radix_cache": sa.disable_radix_cache, "strategy": routes.mamba_strategy(sa),
            "cuda_graph_off": bool(graphs_off), "max_running_requests": sa.max_running_requests,
            "schedule_policy": sa.schedule_policy, "is_embedding": sa.is_embedding}}
    report["given_fork"] = ls.adapt_to_runtime([], {"OPENJEV_SGLANG_RUNTIME": "fork-0.5.13"})[1]
    Path(out).write_text(json.dumps(report, indent=2))


def test_flag_table_names_its_source():
    assert TABLE["runtime"]["pinned_revision"] == json.loads((REPO / "HF_SOURCE.json").read_text())["runtime"]["revision"]
    assert re.fullmatch(r"[0-9a-f]{40}", TABLE["source"]["commit"])
    assert TABLE["source"]["path"] == "python/sglang/srt/server_args.py"
    names = [n for e in TABLE["flags"] for n in e["names"]]
    assert len(names) == len(set(names)) and TABLE["flag_count"] == len(TABLE["flags"])
    assert "tilelang_fa_v100" in TABLE_REF["--attention-backend"]
    assert "tilelang" in TABLE_REF["--linear-attn-prefill-backend"]
    assert TABLE_REF["--mamba-scheduler-strategy"] == ["auto", "no_buffer", "extra_buffer"]
    assert "--mamba-radix-cache-strategy" not in TABLE_REF  # the 0.5.14+ name is not the pinned runtime's


if __name__ == "__main__" and sys.argv[1:2] == ["--server-args-probe"]:
    server_args_probe(sys.argv[2], sys.argv[3])
