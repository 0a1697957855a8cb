"""Launch shapes of the mHC kernels at decode batch sizes (Flash: four bf16 streams of 4,096).

The 43-layer bf16 benchmark model at 128K x 17 spent 1.58 ms a step in ``_mix_partial_kernel``
(87 launches, 18 us each) and 1.36 ms in ``_expand_kernel`` (86, 16 us each), against 3 and 2 us
at one token (docs/PERF.md, session 12): both read and write well under a megabyte. This times,
at T = 1, 4, 17, 32 and 64 tokens:

- ``mhc_expand`` at each ``block_d`` x ``num_warps``, each output checked bit for bit against the
  default launch's (every element is the same fp32 expression; a launch whose reduction over the
  four streams runs in another order shows as DIFFERS);
- ``mhc_mix_from_streams`` (split-K partial dots with ``fn`` [24, 16384] fp32, then the Sinkhorn
  finalize) at each tokens-per-program x ``num_warps`` (the same chunks, so the same partials up to
  the order of a chunk's 128-term sum), with its largest difference from the default's outputs;
- a sub-layer boundary (expand, then the next mix and collapse-norm) in four launches against three,
  the expand computing the next mix's partials (``mhc_expand_partials``).

Each figure is a CUDA graph of 20 calls on the same inputs, replayed, divided by 20: the inputs
stay in L2, as they are in the step (the previous kernel just wrote them).

    python3 bench/probe_mhc.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dsv4_backend.kernels import mhc  # noqa: E402

HC, D, CALLS = 4, 4096, 20


def graph_us(fn) -> float:
    """Microseconds per call of ``fn`` from a graph of CALLS calls (after one eager call)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return do_bench(graph.replay, warmup=5, rep=30, return_mode="median") * 1e3 / CALLS


def report(what: str, default_us: float, rows: list, results: list, describe) -> None:
    """Keep ``rows`` in ``results`` and print the default's time and the five fastest launches."""
    results.extend(rows)
    rows.sort(key=lambda r: r["us"])
    print(f"{what}: default {default_us:.2f} us; fastest:", flush=True)
    for r in rows[:5]:
        print(f"    {r['us']:6.2f} us  {describe(r)}", flush=True)


def probe_expand(T: int, results: list) -> None:
    g = torch.Generator(device="cuda").manual_seed(T)
    X = torch.randn(T, HC, D, device="cuda", generator=g).to(torch.bfloat16)
    f = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    post = torch.rand(T, HC, device="cuda", generator=g)
    C = torch.rand(T, HC, HC, device="cuda", generator=g)
    ref = mhc.mhc_expand(X, f, post, C)
    rows = []
    for bd, nw in itertools.product((64, 128, 256, 512, 1024), (1, 2, 4, 8)):
        fn = lambda: mhc.mhc_expand(X, f, post, C, block_d=bd, num_warps=nw)  # noqa: E731
        same = bool(torch.equal(fn(), ref))
        rows.append(dict(kernel="mhc_expand", tokens=T, block_d=bd, num_warps=nw, us=graph_us(fn), same=same))
    report(f"mhc_expand T={T}", graph_us(lambda: mhc.mhc_expand(X, f, post, C)), rows, results,
           lambda r: f"block_d {r['block_d']:4d} warps {r['num_warps']}  {'same' if r['same'] else 'DIFFERS'}")


def mix_args(T: int, seed: int):
    """(generator, the mix's arguments): T tokens of Flash's streams, fn, scale and base, 20 Sinkhorn rounds."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = HC * (2 + HC)
    X = torch.randn(T, HC, D, device="cuda", generator=g).to(torch.bfloat16)
    fn_w = torch.randn(n, HC * D, device="cuda", generator=g) * 0.01
    scale = torch.rand(3, device="cuda", generator=g)
    base = torch.randn(n, device="cuda", generator=g) * 0.1
    return g, (X, fn_w, scale, base, HC, 20, 1e-6, 1e-6)


def probe_mix(T: int, results: list) -> None:
    """The broadcast-product partials at each tokens-a-program x warps (the same chunks)."""
    g, args = mix_args(T, 100 + T)
    ref = mhc.mhc_mix_from_streams(*args)
    rows = []
    for bt, nw in itertools.product((1, 2, 4, 8, 16), (2, 4, 8)):
        if bt > max(T, 1) * 2:
            continue
        fn = lambda: mhc.mhc_mix_from_streams(*args, block_t=bt, num_warps=nw, dot=False)  # noqa: E731
        out = fn()
        diff = max(float((a - b).abs().max()) for a, b in zip(out, ref))
        rows.append(dict(kernel="mhc_mix_from_streams", tokens=T, block_t=bt, num_warps=nw, us=graph_us(fn),
                         max_diff=diff))
    report(f"mhc_mix_from_streams T={T}", graph_us(lambda: mhc.mhc_mix_from_streams(*args)), rows, results,
           lambda r: f"tokens a program {r['block_t']:2d} warps {r['num_warps']}  max diff {r['max_diff']:.1e}")


def probe_sublayer(T: int, results: list) -> None:
    """A sub-layer's entry as the model runs it: ``mhc_mix_from_streams`` then ``mhc_collapse_norm``
    (three launches), at the default launch (``mhc.mix_launch``), the finalize on 1 / 4 warps, and the
    tl.dot partials at each tokens-a-program x warps x chunk; the split-K partials alone beside them.
    (Session 13 also timed a finalize fused with the collapse-norm: no faster, so not kept.)"""
    g, args = mix_args(T, 200 + T)
    X, fn_w = args[:2]
    n = fn_w.shape[0]
    w = torch.rand(D, device="cuda", generator=g).to(torch.bfloat16)

    def entry(**kw):
        mix = mhc.mhc_mix_from_streams(*args, **kw)
        return mix, mhc.mhc_collapse_norm(X, mix.pre, w, 1e-6, torch.bfloat16)

    ref_mix, ref_y = entry(dot=False, chunk=128, finalize_warps=4)   # the launch before session 13

    def diff(out) -> float:
        mix, y = out
        diffs = [float((a - b).abs().max()) for a, b in zip(mix, ref_mix)]
        return max(diffs + [float((y - ref_y).float().abs().max())])

    rows = []
    variants = [dict(), dict(dot=False, chunk=128, finalize_warps=4), dict(dot=False, chunk=128, finalize_warps=1)]
    variants += [dict(dot=True, block_t=bt, num_warps=nw, chunk=ch, finalize_warps=1)
                 for bt, nw, ch in itertools.product((16, 32, 64), (2, 4), (64, 128)) if bt <= max(16, 2 * T)]
    for kw in variants:
        fn = lambda: entry(**kw)  # noqa: E731
        d = diff(fn())
        rows.append(dict(kernel="sublayer", tokens=T, **kw, us=graph_us(fn), max_diff=d))
    for kw in [dict(dot=False), dict(dot=True)]:
        launch = mhc.mix_launch(T, n, **kw)
        fn = lambda: mhc._launch_partials(X, fn_w, launch)  # noqa: E731
        rows.append(dict(kernel="partials", tokens=T, launch=launch._asdict(), us=graph_us(fn)))
        print(f"  partials T={T} {launch}: {rows[-1]['us']:.2f} us", flush=True)
    report(f"sub-layer entry T={T} (default {mhc.mix_launch(T, n)})", rows[0]["us"],
           [r for r in rows if r["kernel"] == "sublayer"], results,
           lambda r: f"{dict((k, r[k]) for k in ('dot', 'block_t', 'num_warps', 'chunk', 'finalize_warps') if k in r)}"
                     f"  max diff {r['max_diff']:.1e}")
    results.extend(r for r in rows if r["kernel"] == "partials")


def probe_boundary(T: int, results: list) -> None:
    """A sub-layer boundary as the model runs it (the expand of one sub-layer's output, then the next
    sub-layer's mix and input): ``mhc_expand`` + ``mhc_mix_from_streams`` + ``mhc_collapse_norm`` (four
    launches) against ``mhc_expand_partials`` + ``mhc_mix_finalize`` + ``mhc_collapse_norm`` (three)."""
    g, args = mix_args(T, 300 + T)
    X, fn_w, scale, base = args[:4]
    f = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    post = torch.rand(T, HC, device="cuda", generator=g) * 2
    C = torch.rand(T, HC, HC, device="cuda", generator=g)
    w = torch.rand(D, device="cuda", generator=g).to(torch.bfloat16)

    def separate():
        Xn = mhc.mhc_expand(X, f, post, C)
        mix = mhc.mhc_mix_from_streams(Xn, *args[1:])
        return mix, mhc.mhc_collapse_norm(Xn, mix.pre, w, 1e-6, torch.bfloat16)

    def fused():
        Xn, part = mhc.mhc_expand_partials(X, f, post, C, fn_w)
        mix = mhc.mhc_mix_finalize(part, HC * D, scale, base, HC, 20, 1e-6, 1e-6)
        return mix, mhc.mhc_collapse_norm(Xn, mix.pre, w, 1e-6, torch.bfloat16)

    (m1, y1), (m2, y2) = separate(), fused()
    diff = max([float((a - b).abs().max()) for a, b in zip(m1, m2)] + [float((y1 - y2).float().abs().max())])
    row = dict(kernel="boundary", tokens=T, separate_us=graph_us(separate), fused_us=graph_us(fused), max_diff=diff)
    results.append(row)
    print(f"sub-layer boundary T={T}: four launches {row['separate_us']:.2f} us, expand + partials fused "
          f"{row['fused_us']:.2f} us, max diff {diff:.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,4,17,32,64")
    ap.add_argument("--parts", default="expand,mix,sublayer,boundary", help="which probes to run (comma-separated)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results: list = []
    parts = set(args.parts.split(","))
    for T in (int(v) for v in args.tokens.split(",")):
        for name, probe in (("expand", probe_expand), ("mix", probe_mix), ("sublayer", probe_sublayer),
                            ("boundary", probe_boundary)):
            if name in parts:
                probe(T, results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
