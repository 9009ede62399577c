#!/usr/bin/env python3
"""Write tests/data/sgl_cpu_ops/manifest.json from the recorded cases under it.

Each tests/data/sgl_cpu_ops/<op>/<case>.json is one recorded call of the real sgl-kernel CPU op
(tests/sglang_openjev_cpu/record.py: from SGLang's engine, "source": "engine"; or
benchmarks/sgl_cpu_ops_record_direct.py: "source": "direct"). The manifest lists per op its schema,
argument names, the arguments it changed in place, its cases with their dtypes, and where the
kernel came from (--revision, the library's sha256, the torch it was built against).

    python benchmarks/sgl_cpu_ops_manifest.py --data tests/data/sgl_cpu_ops \\
        --revision "github:mingfeima/sglang 2f14d6c (sgl-kernel)" --build-json /tmp/sgl-cpu-build/out/build.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--revision", required=True)
    ap.add_argument("--build-json", type=Path, required=True)
    ap.add_argument("--note", default="")
    a = ap.parse_args(argv)
    build = json.loads(a.build_json.read_text())
    lib = Path(build["library"])
    ops = {}
    total = 0
    for op_dir in sorted(p for p in a.data.iterdir() if p.is_dir()):
        cases = []
        for meta_path in sorted(op_dir.glob("*.json")):
            m = json.loads(meta_path.read_text())
            cases.append({"case": m["case"], "source": m.get("source", "engine"),
                          "dtypes": {x["name"]: x["dtype"] for x in m["args"] if "dtype" in x},
                          "shapes": {x["name"]: x["shape"] for x in m["args"] if "shape" in x},
                          "mutated": m["mutated"], "compaction": m.get("compaction")})
            schema = m["schema"]
            arg_names = [x["name"] for x in m["args"]]
        total += sum(f.stat().st_size for f in op_dir.iterdir())
        ops[op_dir.name] = {"schema": schema, "args": arg_names,
                            "mutated_in_place": sorted({n for c in cases for n in c["mutated"]}), "cases": cases}
    manifest = {
        "what": "inputs and outputs of real sgl-kernel CPU op calls, to check the pure-PyTorch stand-ins "
                "(openjev_testsupport.sgl_kernel_cpu_standin) against",
        "format": "per op folder: <case>.json (arguments: tensors by file, scalars inline, None as null; outputs; "
                  "'mutated': tensor arguments the call changed in place, saved after the call as "
                  "<case>.<arg>.after.npy); bfloat16 tensors are stored as their uint16 bit patterns "
                  "(torch.from_numpy(a).view(torch.bfloat16)); state pools are compacted to the rows the call "
                  "indexes and the op re-run on them ('compaction' records that its outputs equal the original call's)",
        "kernel_source": a.revision, "library_sha256": hashlib.sha256(lib.read_bytes()).hexdigest(),
        "built_against_torch": build.get("torch"), "cflags": build.get("cflags"), "ldflags": build.get("ldflags"),
        "note": a.note, "bytes": total, "ops": ops,
    }
    (a.data / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{a.data / 'manifest.json'}: {len(ops)} ops, {total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
