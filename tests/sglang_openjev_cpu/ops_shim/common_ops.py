"""`common_ops` as sgl_kernel imports it when its CUDA library cannot load (sgl_kernel/load_utils.py
falls back to a plain `import common_ops`): registers the CPU ops chosen by OPENJEV_SGL_CPU_OPS
(sglang_openjev_cpu.runtime.load_ops). This folder is on PYTHONPATH only for SGLang's CPU engine."""
from sglang_openjev_cpu.runtime import load_ops as _load_ops

LOADED = _load_ops()
