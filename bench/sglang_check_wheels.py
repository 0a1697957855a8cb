"""One carry folder for bench/gpu_sglang_session.sh: SGLang's wheel without what the check never loads.

    python bench/sglang_check_wheels.py .whl/sglang-cp312 .whl/sglang-cp312-extra --out .whl/sglang-check

Copies every wheel of the given folders into ``--out``, except those of ``PRESENT`` (torch, triton
and torch's own requirements, which any machine with a pip-installed torch has; ``--keep-all``
copies them too) and SGLang's, which is rewritten
without ``TRIM`` (its Rust server / benchmark / gRPC / multimodal extensions, the diffusion
runtime ``multimodal_gen``, its tests and benchmarks: about 22 of its 37 MiB, none of it imported
by the check; ``bench/sglang_cuda_branch.py`` lists what is) and with its RECORD cut to match.
Prints each wheel's size and the total, to check against one device call's 64 MiB carry.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import zipfile
from pathlib import Path

TRIM = (
    "sglang/srt/rust_extensions/_server.",
    "sglang/srt/rust_extensions/_bench.",
    "sglang/srt/rust_extensions/_grpc.",
    "sglang/srt/rust_extensions/_multimodal.",
    "sglang/multimodal_gen/",
    "sglang/test/",
    "sglang/benchmark/",
)

PRESENT = frozenset({"torch", "triton", "filelock", "typing_extensions", "sympy", "mpmath", "networkx",
                     "jinja2", "markupsafe", "fsspec", "setuptools"})


def distribution(wheel: Path) -> str:
    return wheel.name.split("-", 1)[0].lower().replace(".", "_")


def trimmed(name: str) -> bool:
    return name.startswith(TRIM)


def trim_wheel(src: Path, dst: Path) -> int:
    """Write ``src`` without the TRIM members to ``dst``; returns how many were left out."""
    left_out = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if trimmed(info.filename):
                left_out += 1
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not trimmed(line.split(",", 1)[0])).encode()
            zout.writestr(info, data)
    return left_out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--keep-all", action="store_true", help="copy the wheels of PRESENT too")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    total = 0
    for wheel in sorted(w for folder in args.folders for w in folder.glob("*.whl")):
        dst = args.out / wheel.name
        if not args.keep_all and (distribution(wheel) in PRESENT or distribution(wheel).startswith("nvidia_")):
            print(f"  left out  {wheel.name}  (the GPU machine's torch brings it)")
            continue
        if distribution(wheel) == "sglang":
            n = trim_wheel(wheel, dst)
            note = f"trimmed: {n} members left out, {wheel.stat().st_size / 2**20:.1f} MiB before"
        else:
            shutil.copyfile(wheel, dst)
            note = ""
        total += dst.stat().st_size
        print(f"{dst.stat().st_size / 2**20:6.2f} MiB  {dst.name}  {note}")
    print(f"{total / 2**20:6.2f} MiB in {args.out} (one device call carries 64 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
