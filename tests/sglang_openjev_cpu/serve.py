"""The adapter on SGLang's CPU engine: `python -m sglang_openjev_cpu.serve SGLANG_FLAGS...`.

Runs `sglang_openjev.launch_server` (checkpoint preflight, `--is-embedding`, the /classify routes)
with `--device cpu` after `sglang_openjev_cpu.runtime` has chosen the CPU ops (OPENJEV_SGL_CPU_OPS:
a built common_ops.so or `standin`) and installed its run-time patches. Defaults added when the
operator gives none (each can be overridden by giving the flag):

  --device cpu                     (any other --device is refused)
  --max-mamba-cache-size 32        GDN state slots (3 per running request with no_buffer: 10 running
                                   requests); without it SGLang sizes the pool from memory (GBs)
  --max-total-tokens 4096          KV cache tokens of the full-attention layers
  --mamba-radix-cache-strategy no_buffer
                                   extra_buffer (SGLang's default with the radix cache) needs state
                                   snapshots that the CPU platform does not support
  --disable-overlap-schedule       no_buffer requires it
  --attention-backend torch_native the CPU attention that needs no AMX (OPENJEV_SGL_CPU_AMX=0)

Exit status: SGLang's; 1 with one line on stderr when this entry point or the launcher refuses.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from sglang_openjev_cpu import runtime

PROG = "sglang_openjev_cpu.serve"

# Every process that SGLang spawns (spawn start method) imports this module again as __mp_main__
# before it unpickles its target, so the patches are in place before SGLang's modules load there.
if __name__ == "__mp_main__":
    runtime.install()


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _value(argv: Sequence[str], flag: str) -> Optional[str]:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def cpu_server_args(argv: Sequence[str], environ=os.environ) -> list[str]:
    argv = list(argv)
    device = _value(argv, "--device")
    if device is not None and device != "cpu":
        raise runtime.CpuRuntimeError(f"--device {device}: this entry point serves SGLang's CPU engine only")
    defaults = [("--device", "cpu"), ("--max-mamba-cache-size", "32"), ("--max-total-tokens", "4096"),
                ("--mamba-radix-cache-strategy", "no_buffer")]
    if not runtime.amx_enabled(environ):
        defaults.append(("--attention-backend", "torch_native"))
    for flag, value in defaults:
        if not _given(argv, flag):
            argv += [flag, value]
    if not _given(argv, "--disable-overlap-schedule"):
        argv.append("--disable-overlap-schedule")
    return argv


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        runtime.configure_environment(os.environ)
        runtime.install()
        argv = cpu_server_args(argv)
    except runtime.CpuRuntimeError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    from sglang_openjev import launch_server

    launch_server.main(argv)


if __name__ == "__main__":
    main()
