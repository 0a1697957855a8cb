"""Registers, spills, shared memory and SASS instruction counts of the decode and indexer kernels
for sm_90a, compiled on any machine (no GPU: Triton's own ptxas and cuobjdump).

    python bench/sass_report.py                 # the decode configurations and the indexer paths
    python bench/sass_report.py --dump-sass DIR # also write each kernel's SASS
    python bench/sass_report.py --quick         # the default decode configuration and indexer only

Each kernel is compiled from its source for an H100/H200 target with the argument
specialisations a real launch gets (pointers and the page strides divisible by 16). What the
counts mean for speed is in docs/kernels.md and docs/PERF.md: e.g. LDL/STL are register spills,
HGMMA/QGMMA the Hopper bf16/FP8 matrix instructions, UTMALDG the bulk tensor copies.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dsv4_backend.kernels import indexer as I  # noqa: E402
from dsv4_backend.kernels import sparse_attention as SA  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
OPS = ("HGMMA", "QGMMA", "HMMA", "UTMALDG", "LDG", "LDS", "STS", "LDL", "STL", "BAR")


def _compile(fn, consts: dict, types: dict, num_warps: int, num_stages: int):
    names = fn.arg_names
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in names}
    aligned = [n for n in names if n.endswith("_ptr") or n.endswith("_ps") or n == "page_stride"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))


def _count(op: str, sass: str) -> int:
    return len(re.findall(r"\b" + op + r"\b", sass))


def report(name: str, compiled, dump: Path | None) -> str:
    """One line: registers and spills from ptxas, instruction counts from the SASS."""
    work = Path("/tmp") / f"sass_report_{name}"
    work.mkdir(parents=True, exist_ok=True)
    (work / "k.ptx").write_text(compiled.asm["ptx"])
    res = subprocess.run([str(BIN / "ptxas"), "-arch=sm_90a", "-v", str(work / "k.ptx"), "-o",
                          str(work / "k.cubin")], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(work / "k.cubin")],
                          capture_output=True, text=True).stdout
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{name}.sass").write_text(sass)
    counts = " ".join(f"{op}={_count(op, sass)}" for op in OPS)
    return (f"{name:<34} regs={regs.group(1) if regs else '?'} spill={spill.group(1) if spill else '?'}B "
            f"smem={compiled.metadata.shared} {counts}")


def decode_kernels():
    types = {"q_ptr": "*bf16", "swa_ptr": "*u8", "win_ptr": "*i32", "ext_ptr": "*u8", "ext_idx_ptr": "*i32",
             "sink_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "po_ptr": "*fp32",
             "plse_ptr": "*fp32", "scale_log2": "fp32"}
    import bench_kernels as bk
    for cfg in bk.DECODE_CONFIGS:
        consts = dict(BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, SPLIT=False, HALVES=cfg.halves,
                      WORD_SCALES=cfg.scales == "word", NATIVE=True, DOT_DTYPE=tl.bfloat16, PDL=False)
        name = "decode " + ",".join(str(x) for x in cfg)
        yield name, _compile(SA._sparse_decode_kernel, consts, types, cfg.num_warps, cfg.num_stages)


def indexer_kernels():
    cfg = I.IndexerConfig()
    for fp8 in (False, True):
        types = {"q_ptr": "*u8" if fp8 else "*bf16", "w_ptr": "*fp32", "qs_ptr": "*fp32", "table_ptr": "*i32",
                 "nvis_ptr": "*i32", "score_ptr": "*fp32", "codes": "tensordesc<fp8e4nv[64, 128]>",
                 "scales": "tensordesc<fp32[1, 64]>"}
        f16 = cfg.products == "f16" and not fp8
        consts = dict(H=64, BLOCK_H=64, P=64, PAGE_ROWS_2D=66, Q_FP8=fp8, DOT_DTYPE=tl.float16 if f16 else tl.bfloat16,
                      NUM_STAGES=cfg.num_stages, GROUP=cfg.group or (1 if fp8 else 4), Q_POW2=f16, PDL=False)
        yield (f"indexer pages {'fp8' if fp8 else cfg.products}",
               _compile(I._indexer_paged_kernel, consts, types, cfg.num_warps, cfg.num_stages))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump-sass", type=Path, default=None, help="write each kernel's SASS here")
    ap.add_argument("--quick", action="store_true", help="the default decode configuration and indexer only")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the report compiles the kernels for sm_90a")
    if not (BIN / "ptxas").exists():
        sys.exit(f"no ptxas in {BIN}: this Triton build has no NVIDIA back-end tools")
    for gen in (decode_kernels, indexer_kernels):
        for i, (name, compiled) in enumerate(gen()):
            print(report(name.replace(" ", "_").replace(",", "-"), compiled, args.dump_sass), flush=True)
            if args.quick:
                break


if __name__ == "__main__":
    main()
