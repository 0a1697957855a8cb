"""The packed FP4 experts at prefill sizes: the MMA kernels (routed mode) against bf16 grouped GEMMs
over experts dequantised a few at a time (``kernels/fp4_moe_prefill.py``), on one GPU.

    python3 bench/probe_fp4_prefill.py [--tokens 1024,2048,4096,8192]

Flash's MoE (E = 256, D = 4096, I = 2048, top-6), random release-format weights packed once,
random distinct experts per token. Per T: both paths' milliseconds (eager calls, L2 flushed
before each: ``triton.testing.do_bench`` median; the prefill path reads the expert offsets back
once), their TFLOP/s (2 T k 3 I D), the dequantisation of all 256 experts alone against its
byte floor (FP4 bytes read + bf16 bytes written over the copy bandwidth of this run), and how far
the two outputs are apart (max |diff| / max |y| and the relative error norm: the same contract,
fp32 sums in other orders, so a bf16 rounding may tip). The exact agreement with the float64
contract is tests/test_fp4_moe_prefill.py's (run it on the GPU too).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from _floor import copy_gbps  # noqa: E402
from dsv4_backend.kernels import fp4_mma as mma  # noqa: E402
from dsv4_backend.kernels import fp4_moe_prefill as pre  # noqa: E402

E, D, I, TOP = 256, 4096, 2048, 6
LIMIT = 10.0


def log(msg: str) -> None:
    print(msg, flush=True)


def random_packs(gen: torch.Generator) -> tuple[mma.Fp4MmaPack, mma.Fp4MmaPack]:
    """Flash's w13 and w2 as random release-format FP4 (any nibbles; scale bytes near 2^-4 and
    2^-6, so the products stay in range) packed for the MMA kernels, on gen's device."""
    def r(lo, hi, shape):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=gen, device=gen.device)
    return (mma.pack_fp4_mma(r(0, 256, (E, 2 * I, D // 2)), r(123, 128, (E, 2 * I, D // 32))),
            mma.pack_fp4_mma(r(0, 256, (E, D, I // 2)), r(118, 126, (E, D, I // 32))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,2048,4096,8192")
    ap.add_argument("--chunks", default="8,16,32", help="experts dequantised at a time to try at the largest T")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    p13, p2 = random_packs(gen)
    torch.cuda.empty_cache()
    bw = copy_gbps(dev)
    log(f"{torch.cuda.get_device_name(dev)}: copy bandwidth {bw:.0f} GB/s")

    for name, pack in (("w13", p13), ("w2", p2)):
        fp4_bytes = (pack.words[:pre.DEQUANT_EXPERTS].numel() + pack.scales[:pre.DEQUANT_EXPERTS].numel()) * 4
        bf16_bytes = pre.DEQUANT_EXPERTS * pack.n * pack.k * 2
        ms = do_bench(lambda: pre.dequant_experts(pack, 0, pre.DEQUANT_EXPERTS), rep=50, return_mode="median")
        floor = (fp4_bytes + bf16_bytes) / (bw * 1e9) * 1e3
        log(f"dequant {pre.DEQUANT_EXPERTS} experts of {name}: {ms * 1e3:8.1f} us, floor {floor * 1e3:7.1f} us "
            f"({100 * floor / ms:.0f}%); all {E}: {ms * E / pre.DEQUANT_EXPERTS:.2f} ms")

    tokens = [int(t) for t in args.tokens.split(",")]
    for T in tokens:
        ids = torch.rand(T, E, generator=gen, device=dev).topk(TOP, dim=1).indices
        x = torch.randn(T, D, generator=gen, device=dev).to(torch.bfloat16)
        wts = torch.rand(T, TOP, generator=gen, device=dev)
        flops = 2.0 * T * TOP * 3 * I * D
        routed = mma.MmaConfig(1, mma.PREFETCH, 1, True)
        old = mma.fp4_moe_mma(x, ids, wts, p13, p2, LIMIT, routed, routed)
        new = pre.fp4_moe_prefill(x, ids, wts, p13, p2, LIMIT)
        diff = (new.float() - old.float())
        rel_max = float(diff.abs().max() / old.float().abs().max())
        rel_norm = float(diff.norm() / old.float().norm())
        t_old = do_bench(lambda: mma.fp4_moe_mma(x, ids, wts, p13, p2, LIMIT, routed, routed), rep=100,
                         return_mode="median")
        t_new = do_bench(lambda: pre.fp4_moe_prefill(x, ids, wts, p13, p2, LIMIT), rep=100, return_mode="median")
        log(f"T={T:5d}: MMA routed {t_old:7.2f} ms ({flops / t_old / 1e9:5.0f} TFLOP/s) | bf16 grouped "
            f"{t_new:7.2f} ms ({flops / t_new / 1e9:5.0f} TFLOP/s) | {t_old / t_new:4.2f}x | outputs apart: "
            f"max {rel_max:.2e}, norm {rel_norm:.2e}")
        if T == tokens[-1]:
            for c in (int(v) for v in args.chunks.split(",")):
                pre.DEQUANT_EXPERTS = c
                t = do_bench(lambda: pre.fp4_moe_prefill(x, ids, wts, p13, p2, LIMIT), rep=50, return_mode="median")
                log(f"         {c:3d} experts at a time: {t:7.2f} ms")
            pre.DEQUANT_EXPERTS = 16
    log(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
