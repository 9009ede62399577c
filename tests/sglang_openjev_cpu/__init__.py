"""SGLang's CPU engine for the OpenJEV adapter: tests and recorded runs, not the V100 bundle.

    OPENJEV_SGL_CPU_OPS=/path/to/common_ops.so python -m sglang_openjev_cpu.serve --model-path CKPT ...
    OPENJEV_SGL_CPU_OPS=standin                python -m sglang_openjev_cpu.serve --model-path CKPT ...

Modules
  runtime   chooses the CPU ops (a built sgl-kernel CPU library, or the project's pure-PyTorch
            stand-ins in openjev_testsupport.sgl_kernel_cpu_standin) and works around what SGLang
            0.5.23's CPU engine needs at run time (no installed file is edited)
  serve     the entry point: sglang_openjev.launch_server with `--device cpu` and CPU defaults
  ops_shim  a folder put on PYTHONPATH whose `common_ops` module is what sgl_kernel loads when its
            CUDA library cannot load (sgl_kernel/load_utils.py falls back to `import common_ops`)

This package is kept apart from sglang_openjev/ (whose files are pinned in HF_SOURCE.json and
shipped to the V100 machines, and all of whose modules SGLang imports in its scheduler processes).
"""
