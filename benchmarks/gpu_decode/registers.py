"""Registers, spills and shared memory of every Triton kernel variant the GPU path
launches, compiled ahead of time for a GPU architecture, with no GPU needed.

Each variant (``attend`` at the tile sizes ``triton_kernels._row_tiles`` picks for groups
of 1-64 rows and for the suffix rows, per head geometry and dtype, whole-row and
member-slot outputs; ``merge`` per head count; and the three launches of the capturable
grouped decode, ``gpu_decode.variants``, per geometry and dtype) is compiled by Triton for
``--arch``
(default sm_90, Hopper) about as its JIT would specialise it (unit strides as
constants, aligned data pointers and row strides, the index arrays free), and Triton's
``cuobjdump`` reads each cubin's resource use.  What runs on the device may differ with
its Triton release (the lent H200 has 3.6).

    .venv/bin/python benchmarks/gpu_decode/registers.py          # ~1 min on 2 cores

Writes registers.json and registers.md into results/SET/ (``--set``, default the commit).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from feather_sched.attention import gpu_decode
from feather_sched.attention import triton_kernels as tk
from feather_sched.bench.study import Study, markdown_table
from feather_sched.bench.study import parser as study_parser

GEOMETRIES = ((32, 8, 128), (32, 32, 128), (64, 8, 128), (16, 4, 256))
"""(query heads, KV heads, head size) per rank: Llama-3-8B (GQA 4), an MHA model, GQA 8,
a 256-wide head."""
BLOCK_SIZE = 16
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
ALIGNMENT_FREE = {"table_ptr", "seg_rows_ptr", "seg_starts_ptr", "seg_lengths_ptr",
                  "members_ptr", "rows_ptr", "q_rows_ptr", "count_ptr"}
MAX_ROWS, NUM_SMS = 256, 132
"""The grouped decode's limits here (an H200's SMs); neither changes what compiles."""


UNIT_STRIDES = {"q_stride_dim", "k_stride_dim", "v_stride_dim", "table_stride_col",
                "out_stride_dim"}
"""Strides the JIT sees equal to 1, which it turns into constants."""


def signature(kernel, pointers: dict[str, str]) -> tuple[dict[str, str], dict[str, int]]:
    """Triton's signature for ``kernel`` and the unit strides as constants: ``pointers``
    maps data pointer names to their element type, other ``*_ptr`` arrays are int32, the
    rest int32 scalars (fp32 ``scale``)."""
    types, units = {}, {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr or name in UNIT_STRIDES:
            types[name] = "constexpr"
            if name in UNIT_STRIDES:
                units[name] = 1
        elif name in pointers:
            types[name] = f"*{pointers[name]}"
        elif name.endswith("_ptr"):
            types[name] = "*i32"
        else:
            types[name] = "fp32" if name == "scale" else "i32"
    return types, units


def attrs(kernel) -> dict:
    """Divisibility as the JIT would see it: data pointers 16-byte aligned, strides of
    whole rows and blocks multiples of 16; the index arrays and the sizes that vary per
    call left free (``do_not_specialize``, ``do_not_specialize_on_alignment``)."""
    specs = {}
    for index, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr or name in UNIT_STRIDES or param.do_not_specialize:
            continue
        if (name.endswith("_ptr") and name not in ALIGNMENT_FREE) or "_stride_" in name:
            specs[(index,)] = [["tt.divisibility", 16]]
    return specs


def compile_variant(kernel, pointers: dict[str, str], constexprs: dict, arch: int):
    """The compiled kernel (Triton's ``CompiledKernel``) for ``arch``."""
    types, units = signature(kernel, pointers)
    source = ASTSource(kernel, types, constexprs={**constexprs, **units}, attrs=attrs(kernel))
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 4, "num_stages": 2})


def resources(compiled) -> dict:
    """Registers and stack (spill) bytes of the cubin (``cuobjdump``), its shared memory
    (static and dynamic, Triton's metadata), and what the TTGIR multiplies and loads
    with: Hopper's warp-group MMA or ``mma.sync``, and whether loads are pipelined
    through shared memory (``async_copy``)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(compiled.asm["cubin"])
        handle.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", handle.name],
                              capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", text))
    ttgir = compiled.asm["ttgir"]
    return {"registers": int(found.get("REG", 0)), "stack_bytes": int(found.get("STACK", 0)),
            "shared_bytes": int(found.get("SHARED", 0)) + int(compiled.metadata.shared),
            "mma": "wgmma" if "warp_group_dot" in ttgir else
            ("mma.sync" if "tt.dot" in ttgir or "mma" in ttgir else "-"),
            "async_copy": "async_copy" in ttgir}


def main() -> None:
    arguments = study_parser(__doc__)
    arguments.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    args = arguments.parse_args()
    study = Study(__file__, set_name=args.set)
    attend, merge, _ = tk._kernels()
    import torch

    records = []

    def record(kernel, launch: str, geometry: tuple[int, int, int], name: str,
               pointers: dict[str, str], constexprs: dict) -> None:
        q_heads, kv_heads, head_dim = geometry
        cubin = compile_variant(kernel, pointers, constexprs, args.arch)
        records.append({"kernel": kernel.__name__, "launch": launch, "q_heads": q_heads,
                        "kv_heads": kv_heads, "head_dim": head_dim, "dtype": name,
                        "block_q": constexprs.get("BLOCK_Q"),
                        "block_t": constexprs.get("BLOCK_T"),
                        "by_member_slot": constexprs.get("BY_MEMBER_SLOT"),
                        **resources(cubin)})
        study.progress(f"{launch} {kernel.__name__} {q_heads}/{kv_heads}/d{head_dim} {name} "
                       f"BLOCK_Q {constexprs.get('BLOCK_Q')}")

    for geometry in GEOMETRIES:
        q_heads, kv_heads, head_dim = geometry
        gqa = q_heads // kv_heads
        rows_limit = tk._tile_limits(head_dim)[0]
        block_qs = sorted({max(16, min(rows_limit, tk._pow2(m * gqa))) for m in (1, 4, 16, 64)})
        limits = gpu_decode.DecodeLimits.for_device(NUM_SMS, MAX_ROWS, *geometry)
        for name, dtype in DTYPES.items():
            data = {"q_ptr": name, "k_ptr": name, "v_ptr": name, "parts_ptr": "fp32",
                    "lse_ptr": "fp32"}
            for block_q in block_qs:
                for by_slot in (False, True):
                    record(attend, "segments", geometry, name, data, tk.attend_constants(
                        getattr(torch, dtype), kv_heads, gqa, head_dim, BLOCK_SIZE, block_q,
                        by_slot))
            grouped = gpu_decode.variants(limits, getattr(torch, dtype), BLOCK_SIZE)
            for launch in ("prefix", "suffix"):
                record(attend, f"grouped {launch}", geometry, name, data, grouped[launch])
            record(merge, "grouped merge", geometry, name,
                   {"parts_ptr": "fp32", "lse_ptr": "fp32", "out_ptr": name,
                    "out_lse_ptr": "fp32"}, grouped["merge"])
        record(merge, "segments", geometry, "bf16",
               {"parts_ptr": "fp32", "lse_ptr": "fp32", "out_ptr": "bf16",
                "out_lse_ptr": "fp32"},
               tk.merge_constants(q_heads, head_dim, has_rows=True, has_lse=False,
                                  has_count=False))
    rows = [[r["kernel"], r["launch"], f"{r['q_heads']}/{r['kv_heads']}/d{r['head_dim']}",
             r["dtype"], "-" if r["block_q"] is None else str(r["block_q"]),
             "-" if r["by_member_slot"] is None else ("slots" if r["by_member_slot"]
                                                      else "rows"),
             r["mma"], "yes" if r["async_copy"] else "no", str(r["registers"]),
             str(r["stack_bytes"]), f"{r['shared_bytes'] // 1024} KiB"]
            for r in records]
    text = (f"Triton {triton.__version__}, sm_{args.arch}, num_warps 4, num_stages 2; the "
            f"grouped decode's limits: {MAX_ROWS} rows, {NUM_SMS} SMs\n\n" +
            markdown_table(["kernel", "launch", "q/kv/head", "dtype", "BLOCK_Q", "output",
                            "MMA", "pipelined loads", "registers", "stack (spill) bytes",
                            "shared memory"], rows))
    study.save("registers", {"triton": triton.__version__, "arch": args.arch,
                             "max_rows": MAX_ROWS, "num_sms": NUM_SMS, "records": records},
               text)


if __name__ == "__main__":
    main()
