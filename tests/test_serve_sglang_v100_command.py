"""app/serve_sglang_v100.sh, the launcher systemd units call: the command and environment it composes.

Every test runs the real script with bash in a controlled environment (tests/_serve_sglang_support.py):
the defaults, hosts, GPU profiles, GCC 10, the embedded Transformers backend, the port check and the
exec into the server, usage errors and help, and the static checks of the script. The emitted flags
against SGLang's own parsers and the version matrix: tests/test_serve_sglang_v100_runtimes.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

import pytest
from _serve_sglang_support import (BASH, LAUNCHER, PY, REPO, SM70, SM90, _write_exe, error_line, flag_map, launcher_env,
                                   printed)
from _serve_sglang_support import checkpoint, root, run, tools  # noqa: F401 - fixtures
from conftest import SHELLCHECK_MISSING, shellcheck

SM70_BACKEND_FLAGS = {"--attention-backend": "tilelang_fa_v100", "--linear-attn-prefill-backend": "tilelang",
                      "--linear-attn-decode-backend": "triton", "--sampling-backend": "pytorch"}
SM70_ONLY_ENV = {"SGLANG_MAMBA_CONV_DTYPE": "float16", "SGLANG_MAMBA_SSM_DTYPE": "float16"}
CACHE_ENV = {"TILELANG_CACHE_DIR": "tilelang_cache", "TRITON_CACHE_DIR": "triton",
             "FLASHINFER_WORKSPACE_BASE": "flashinfer_workspace", "TORCH_EXTENSIONS_DIR": "torch_extensions",
             "CUDA_CACHE_PATH": "cuda_cache"}


# ---------------------------------------------------------------- defaults
def test_default_sm70_command_and_environment(run, root, checkpoint, tools):
    env, argv = printed(run(checkpoint, 31003, "--print-command", env=SM70))
    assert argv[:3] == [PY, "-m", "sglang_openjev.launch_server"]
    flags = flag_map(argv)
    assert flags == {
        "--model-path": str(checkpoint), "--host": "127.0.0.1", "--port": "31003", "--is-embedding": None,
        "--dtype": "float16", "--context-length": "8192", "--mem-fraction-static": "0.8",
        "--max-running-requests": "16", "--schedule-policy": "lpm", "--disable-cuda-graph": None,
        "--disable-piecewise-cuda-graph": None, "--mamba-scheduler-strategy": "extra_buffer",
        "--mamba-full-memory-ratio": "3", "--enable-metrics": None, **SM70_BACKEND_FLAGS,  # SGLang's own /metrics
    }
    gcc, gxx = str(tools["gcc10"] / "gcc-10"), str(tools["gcc10"] / "g++-10")
    assert env == {
        "CUDA_VISIBLE_DEVICES": "0", "OPENJEV_BACKEND": "sglang", "OPENJEV_ARCH_PROFILE": "sm70-tilelang",
        "OPENJEV_V100_ROOT": str(root), "PYTHONPATH": str(REPO), "SGLANG_EXTERNAL_MODEL_PACKAGE": "sglang_openjev",
        "OPENJEV_SGLANG_RUNTIME": "fork-unknown", "PYTHONPYCACHEPREFIX": str(root / "pycache"),  # no bytecode in sglang_openjev/
        **SM70_ONLY_ENV, "SGLANG_V100_DYNAMIC_PAGED": "1", "CC": gcc, "CXX": gxx, "CUDAHOSTCXX": gxx,
        **{k: str(root / v) for k, v in CACHE_ENV.items()},
    }
    assert not root.exists(), "--print-command must not create anything"


def test_sglang_entry_point_override(run, checkpoint):
    _, argv = printed(run(checkpoint, 31003, "--print-command", env={**SM70, "OPENJEV_SGLANG_MODULE": "sglang.launch_server"}))
    assert argv[1:3] == ["-m", "sglang.launch_server"] and flag_map(argv)["--is-embedding"] is None
    proc = run(checkpoint, 31003, "--print-command", env={**SM70, "OPENJEV_SGLANG_MODULE": "x; rm -rf /"})
    assert proc.returncode == 1 and "OPENJEV_SGLANG_MODULE" in error_line(proc)


def test_cuda_home_from_root_when_present(run, root, checkpoint):
    (root / "cuda126" / "bin").mkdir(parents=True)
    env, _ = printed(run(checkpoint, 31003, "--print-command", env=SM70))
    assert env["CUDA_HOME"] == str(root / "cuda126")
    assert env["PATH"].split(os.pathsep)[0] == str(root / "cuda126" / "bin")


def test_disable_radix_cache_switches_to_no_buffer(run, checkpoint):
    env, argv = printed(run(checkpoint, 31003, "--disable-radix-cache", "--print-command", env=SM70))
    flags = flag_map(argv)
    assert flags["--mamba-scheduler-strategy"] == "no_buffer"
    assert "--disable-radix-cache" in flags and flags["--disable-radix-cache"] is None
    # before the positionals too
    _, argv2 = printed(run("--disable-radix-cache", checkpoint, 31003, "--print-command", env=SM70))
    assert flag_map(argv2) == flags


def test_environment_overrides(run, root, checkpoint):
    overrides = {"MAX_RUNNING_REQUESTS": "32", "SCHEDULE_POLICY": "fcfs", "CONTEXT_LENGTH": "4096",
                 "CUDA_VISIBLE_DEVICES": "3", "SGLANG_V100_DYNAMIC_PAGED": "0", "MEM_FRACTION_STATIC": "0.75",
                 "MAMBA_FULL_MEMORY_RATIO": "0.9", "PYTHONPATH": "/opt/extra"}
    env, argv = printed(run(checkpoint, 31003, "--print-command", env={**SM70, **overrides}))
    flags = flag_map(argv)
    assert flags["--max-running-requests"] == "32"
    assert flags["--schedule-policy"] == "fcfs"
    assert flags["--context-length"] == "4096"
    assert flags["--mem-fraction-static"] == "0.75"
    assert flags["--mamba-full-memory-ratio"] == "0.9"
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["SGLANG_V100_DYNAMIC_PAGED"] == "0"
    assert env["PYTHONPATH"] == f"{REPO}{os.pathsep}/opt/extra"


def test_pass_through_flags_keep_order_and_replace_defaults(run, checkpoint):
    extra = ["--chunked-prefill-size", "4096", "--log-level", "debug", "--mem-fraction-static=0.7",
             "--attention-backend", "triton", "--enable-metrics"]
    _, argv = printed(run(checkpoint, 31003, *extra, "--print-command", env=SM70))
    assert argv[-len(extra):] == extra, "pass-through flags come last, unchanged and in order"
    flags = flag_map(argv)  # also asserts that no flag appears twice
    assert flags["--mem-fraction-static"] == "0.7"
    assert flags["--attention-backend"] == "triton"
    assert flags["--linear-attn-prefill-backend"] == "tilelang"  # the other defaults stay


def test_print_command_is_the_exec_line(run, checkpoint):
    proc = run(checkpoint, 31003, "--print-command", env=SM70)
    env, argv = printed(proc)
    assert "--print-command" not in argv
    # the last line is valid shell that re-creates exactly argv
    echo = subprocess.run([BASH, "-c", f"printf '%s\\n' {proc.stdout.splitlines()[-1]}"],
                          capture_output=True, text=True, check=True)
    assert echo.stdout.splitlines() == argv


# ---------------------------------------------------------------- hosts
def test_binds_loopback_by_default(run, checkpoint):
    for env in (SM70, SM90, {"OPENJEV_BACKEND": "transformers"}):
        _, argv = printed(run(checkpoint, 31003, "--print-command", env=env))
        assert argv[argv.index("--host") + 1] == "127.0.0.1"


@pytest.mark.parametrize("host_args,expected", [(["--host", "0.0.0.0"], "0.0.0.0"), (["--host=::1"], "::1")])
def test_explicit_host(run, checkpoint, host_args, expected):
    _, argv = printed(run(checkpoint, 31003, *host_args, "--print-command", env=SM70))
    assert argv.count("--host") == 1 and argv[argv.index("--host") + 1] == expected
    _, argv2 = printed(run(*host_args, checkpoint, 31003, "--print-command", env=SM70))
    assert argv2 == argv


# ---------------------------------------------------------------- GPU profiles
def test_sm90_uses_stock_backends(run, root, checkpoint):
    env, argv = printed(run(checkpoint, 31003, "--print-command", env=SM90, gcc=False))
    flags = flag_map(argv)
    assert not set(SM70_BACKEND_FLAGS) & set(flags), "stock profile leaves attention/GDN backends to SGLang"
    assert env["OPENJEV_ARCH_PROFILE"] == "stock"
    assert not set(SM70_ONLY_ENV) & set(env) and "SGLANG_V100_DYNAMIC_PAGED" not in env
    assert "CC" not in env, "without gcc-10 the stock profile keeps the host compiler"
    # same contract otherwise
    for flag, value in {"--dtype": "float16", "--context-length": "8192", "--max-running-requests": "16",
                        "--schedule-policy": "lpm", "--mamba-scheduler-strategy": "extra_buffer",
                        "--mamba-full-memory-ratio": "3", "--mem-fraction-static": "0.8", "--is-embedding": None,
                        "--disable-cuda-graph": None}.items():
        assert flags[flag] == value, flag
    assert env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "sglang_openjev"
    assert {k: env[k] for k in CACHE_ENV} == {k: str(root / v) for k, v in CACHE_ENV.items()}


def test_sm90_uses_gcc10_when_present(run, checkpoint, tools):
    env, _ = printed(run(checkpoint, 31003, "--print-command", env=SM90, gcc=True))
    assert env["CC"] == str(tools["gcc10"] / "gcc-10")


@pytest.mark.parametrize("cap,profile", [("7.0", "sm70-tilelang"), ("9.0", "stock")])
def test_compute_capability_from_nvidia_smi_on_the_chosen_gpu(run, checkpoint, tmp_path, cap, profile):
    smi_dir = tmp_path / "smi"
    smi_dir.mkdir()
    log = tmp_path / "smi.args"
    _write_exe(smi_dir / "nvidia-smi", f"#!/bin/sh\necho \"$@\" > '{log}'\necho '{cap}'\n")
    env, argv = printed(run(checkpoint, 31003, "--print-command", extra_path=(smi_dir,),
                            env={"CUDA_VISIBLE_DEVICES": "2,3", "OPENJEV_SGLANG_RUNTIME": "fork"}))
    assert env["OPENJEV_ARCH_PROFILE"] == profile
    assert log.read_text().split() == ["--query-gpu=compute_cap", "--format=csv,noheader", "-i", "2"]
    assert ("--attention-backend" in flag_map(argv)) == (profile == "sm70-tilelang")


def test_unknown_gpu_refused_clearly(run, checkpoint, tmp_path):
    proc = run(checkpoint, 31003, "--print-command")  # no nvidia-smi on PATH, no OPENJEV_GPU_ARCH
    assert proc.returncode == 1 and "OPENJEV_GPU_ARCH" in error_line(proc) and "nvidia-smi" in proc.stderr
    smi_dir = tmp_path / "smi"
    smi_dir.mkdir()
    _write_exe(smi_dir / "nvidia-smi", "#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    proc = run(checkpoint, 31003, "--print-command", extra_path=(smi_dir,))
    assert proc.returncode == 1 and "could not query GPU '0'" in error_line(proc)
    for bad, needle in (("volta", "OPENJEV_GPU_ARCH must look like"), ("70", "OPENJEV_GPU_ARCH must look like"),
                        ("sm60", "older than Volta")):
        proc = run(checkpoint, 31003, "--print-command", env={"OPENJEV_GPU_ARCH": bad})
        assert proc.returncode == 1 and needle in error_line(proc), bad


# ---------------------------------------------------------------- GCC 10
def test_sm70_without_gcc10_is_refused(run, root, checkpoint):
    proc = run(checkpoint, 31003, "--print-command", env=SM70, gcc=False)
    assert proc.returncode == 1 and proc.stdout == ""
    line = error_line(proc)
    assert "GCC 10" in line and "OPENJEV_CC" in line and "OPENJEV_CXX" in line
    proc = run(checkpoint, 31003, env=SM70, gcc=False)  # a real launch is refused the same way
    assert proc.returncode == 1 and "GCC 10" in error_line(proc)
    assert not root.exists()


def test_gcc_override(run, checkpoint, tools):
    cc, cxx = shutil.which("sh"), shutil.which("cat")  # any executables: the launcher only records them
    env, _ = printed(run(checkpoint, 31003, "--print-command", gcc=False,
                         env={**SM70, "OPENJEV_CC": cc, "OPENJEV_CXX": "cat"}))
    assert (env["CC"], env["CXX"], env["CUDAHOSTCXX"]) == (cc, str(tools["bin"] / "cat"), str(tools["bin"] / "cat"))
    proc = run(checkpoint, 31003, "--print-command", gcc=False, env={**SM70, "OPENJEV_CC": cc})
    assert proc.returncode == 1 and "both OPENJEV_CC and OPENJEV_CXX" in error_line(proc)
    proc = run(checkpoint, 31003, "--print-command", gcc=False,
               env={**SM70, "OPENJEV_CC": "/nonexistent/gcc-10", "OPENJEV_CXX": cxx})
    assert proc.returncode == 1 and "OPENJEV_CC" in error_line(proc)


# ---------------------------------------------------------------- the embedded Transformers backend
def test_transformers_backend_command(run, root, checkpoint):
    env, argv = printed(run(checkpoint, 31004, "--disable-radix-cache", "--device", "cpu", "--print-command",
                            env={"OPENJEV_BACKEND": "transformers", "MAX_RUNNING_REQUESTS": "8",
                                 "SCHEDULE_POLICY": "fcfs", "CONTEXT_LENGTH": "4096"}, gcc=False))
    assert argv == [PY, str(REPO / "app" / "serve_transformers.py"), str(checkpoint), "31004",
                    "--host", "127.0.0.1", "--context-length", "4096", "--max-running-requests", "8",
                    "--schedule-policy", "fcfs", "--disable-radix-cache", "--device", "cpu"]
    assert env == {"CUDA_VISIBLE_DEVICES": "0", "OPENJEV_BACKEND": "transformers", "OPENJEV_V100_ROOT": str(root),
                   "PYTHONPATH": str(REPO), "PYTHONPYCACHEPREFIX": str(root / "pycache")}


def test_transformers_backend_accepts_the_cpu_only_case(run, checkpoint):
    env, argv = printed(run(checkpoint, 31004, "--print-command", gcc=False,
                            env={"OPENJEV_BACKEND": "transformers", "CUDA_VISIBLE_DEVICES": ""}))
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    proc = run(checkpoint, 31004, "--print-command", env={**SM70, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1 and "CUDA_VISIBLE_DEVICES" in error_line(proc)


# ---------------------------------------------------------------- the port check and exec
@pytest.mark.parametrize("backend_env", [SM90, {"OPENJEV_BACKEND": "transformers"}], ids=["sglang", "transformers"])
def test_port_in_use_is_refused(run, root, checkpoint, backend_env):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        proc = run(checkpoint, port, env=backend_env, gcc=False)
    assert proc.returncode == 1 and proc.stdout == ""
    line = error_line(proc)
    assert f"port {port} on 127.0.0.1 is already in use" in line
    assert not root.exists(), "a refused launch creates nothing"


def test_launch_execs_the_server_with_its_environment(run, tools, root, checkpoint, tmp_path):
    """The launcher process becomes the server (same PID, as systemd needs) with the printed env."""
    out = tmp_path / "out"
    out.mkdir()
    fake_python = _write_exe(tmp_path / "python", (
        "#!/bin/sh\n"
        f"case \"$1\" in -B) exec '{PY}' \"$@\";; esac\n"  # the launcher's port check runs the real interpreter
        f"echo $$ > '{out}/pid'\n"
        f"for a in \"$@\"; do printf '%s\\n' \"$a\"; done > '{out}/argv'\n"
        f"env > '{out}/env'\n"))
    env = {**SM70, "OPENJEV_PYTHON": str(fake_python)}
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([BASH, str(LAUNCHER), str(checkpoint), str(port)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=launcher_env(tools, root, env, True, ()))
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert int((out / "pid").read_text()) == proc.pid
    exec_env, exec_argv = printed(run(checkpoint, port, "--print-command", env=env))
    assert [str(fake_python), *(out / "argv").read_text().splitlines()] == exec_argv
    server_env = dict(line.split("=", 1) for line in (out / "env").read_text().splitlines() if "=" in line)
    for key, value in exec_env.items():
        assert server_env.get(key) == value, key
    assert all((root / d).is_dir() for d in CACHE_ENV.values()), "JIT cache directories exist at launch"


# ---------------------------------------------------------------- usage errors and help
@pytest.mark.parametrize("args,needle,code", [
    (["{ckpt}"], "expected CHECKPOINT and PORT", 2),
    (["{ckpt}", "abc"], "PORT must be an integer", 2),
    (["{ckpt}", "65536"], "PORT must be an integer", 2),
    (["{ckpt}", "31003", "--port", "31004"], "positional", 2),
    (["{ckpt}", "31003", "--model-path", "/x"], "positional", 2),
    (["{ckpt}", "31003", "--host"], "--host needs a value", 2),
    (["/nonexistent/model", "31003"], "does not exist", 1),
    (["{ckpt}", "31003", "--pp-size", "2"], "--pp-size 2 is not supported", 1),
    (["{ckpt}", "31003", "--pipeline-parallel-size=4"], "--pipeline-parallel-size 4 is not supported", 1),
    (["{ckpt}", "31003", "--pp-size", "x"], "--pp-size needs an integer", 2),
])
def test_usage_errors(run, checkpoint, args, needle, code):
    proc = run(*[a.replace("{ckpt}", str(checkpoint)) for a in args], "--print-command", env=SM70)
    assert proc.returncode == code and needle in error_line(proc)


@pytest.mark.parametrize("var,value", [
    ("MAX_RUNNING_REQUESTS", "0"), ("MAX_RUNNING_REQUESTS", "x"), ("CONTEXT_LENGTH", "-1"),
    ("SCHEDULE_POLICY", "lpm; rm"), ("MEM_FRACTION_STATIC", "1.5"), ("MEM_FRACTION_STATIC", "0"),
    ("MAMBA_FULL_MEMORY_RATIO", "three"), ("SGLANG_V100_DYNAMIC_PAGED", "yes"), ("OPENJEV_BACKEND", "vllm"),
])
def test_bad_environment_values_refused(run, checkpoint, var, value):
    proc = run(checkpoint, 31003, "--print-command", env={**SM70, var: value})
    assert proc.returncode == 1 and var in error_line(proc)


def test_help_documents_every_flag_and_variable(run):
    proc = run("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    for word in ("--host", "--disable-radix-cache", "--print-command", "--help", "OPENJEV_BACKEND",
                 "OPENJEV_V100_ROOT", "OPENJEV_PYTHON", "OPENJEV_SGLANG_MODULE", "CUDA_VISIBLE_DEVICES", "OPENJEV_GPU_ARCH", "CONTEXT_LENGTH",
                 "OPENJEV_SGLANG_RUNTIME", "--mamba-radix-cache-strategy", "--cuda-graph-backend-decode",
                 "MAX_RUNNING_REQUESTS", "SCHEDULE_POLICY", "MEM_FRACTION_STATIC", "MAMBA_FULL_MEMORY_RATIO",
                 "SGLANG_V100_DYNAMIC_PAGED", "OPENJEV_CC", "OPENJEV_CXX", "OPENJEV_ARCH_PROFILE",
                 "SGLANG_EXTERNAL_MODEL_PACKAGE", "SGLANG_MAMBA_CONV_DTYPE", "SGLANG_MAMBA_SSM_DTYPE", "CUDAHOSTCXX",
                 "CUDA_HOME", "TILELANG_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE",
                 "TORCH_EXTENSIONS_DIR", "CUDA_CACHE_PATH", "--mamba-scheduler-strategy", "--mamba-full-memory-ratio",
                 "--attention-backend", "--linear-attn-prefill-backend", "--linear-attn-decode-backend",
                 "--sampling-backend",
                 "--disable-cuda-graph", "--is-embedding", "--mem-fraction-static"):
        assert word in proc.stdout, word


# ---------------------------------------------------------------- static checks
def test_bash_syntax():
    subprocess.run([BASH, "-n", str(LAUNCHER)], check=True)


@pytest.mark.skipif(shellcheck() is None, reason=SHELLCHECK_MISSING)
def test_shellcheck_clean():
    proc = subprocess.run([shellcheck(), str(LAUNCHER)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
