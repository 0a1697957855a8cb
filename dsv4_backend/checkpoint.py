"""DeepSeek-V4 checkpoints in the release's tensor names (DSV4.md section 3).

A checkpoint directory holds ``config.json`` and either one ``model.safetensors`` or shards
listed by ``model.safetensors.index.json``. ``CheckpointReader`` checks every name, shape and
dtype against ``weight_specs(cfg)`` from the headers alone (``CheckpointError`` lists every
problem, naming the tensor), then streams the tensors shard by shard, one at a time, onto the
device: dequantised to the compute dtype, or (``keep_quantized``) in the stored FP8 / FP4 form
that ``DSV4Model(quantized=True)`` runs. ``load_checkpoint`` collects the stream into a dict.

Stored formats, per tensor (the file's dtype decides, not the config):

- FP8 weights: ``float8_e4m3fn [out, in]`` plus ``<module>.scale``
  (``layers.0.attn.wq_a.weight`` -> ``layers.0.attn.wq_a.scale``), ``float8_e8m0fnu``
  ``[ceil(out/128), ceil(in/128)]``: one power-of-two scale per 128 x 128 block.
- FP4 routed experts: ``int8 [out, in/2]``, two e2m1 codes per byte (low nibble = even
  K index, bit 3 of a nibble = sign) plus ``<module>.scale`` ``float8_e8m0fnu [out, in/32]``.
- plain floats (fp32 / bf16 / fp16 / fp64) and the int64 hash-routing table as they are.

``save_checkpoint`` is a small writer for test checkpoints in the same layout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator, NamedTuple, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from .config import DSV4Config
from .weights import (FP4_BLOCK, FP8_BLOCK, WeightKind, WeightSpec, fp4_packed_shape, fp4_scale_shape,
                      fp8_scale_shape, keeps_quantized, model_tensors, param_dtype, scale_name, weight_specs)

FP8_MAX = 448.0          # largest finite e4m3 value
FP4_MAX = 6.0            # largest e2m1 value
MIN_SCALE_EXP = -126     # scales never go below 2^-126 (all-zero blocks would ask for 2^-inf)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FORMATS = ("fp32", "bf16", "fp8")

_FLOAT_DTYPES = ("F64", "F32", "BF16", "F16")  # safetensors dtype tags of plain float tensors
_SCALE_DTYPES = ("F8_E8M0",) + _FLOAT_DTYPES    # ue8m0 as released; plain float scales also read
_TAG_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1,
              "I64": 8, "I32": 4}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; ``problems`` lists every mismatch."""

    def __init__(self, path: str | Path, problems: list[str]):
        self.problems = list(problems)
        lines = "\n  ".join(self.problems)
        super().__init__(f"checkpoint {path}: {len(self.problems)} problem(s)\n  {lines}")


class LoadedCheckpoint(NamedTuple):
    config: DSV4Config
    weights: dict[str, torch.Tensor]  # release names, dtypes per weights.model_tensors
    quantized: bool = False           # FP8 / FP4 weights kept in their stored form


class FP8Weight(NamedTuple):
    weight: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor   # float8_e8m0fnu [ceil(out/128), ceil(in/128)]


class FP4Weight(NamedTuple):
    packed: torch.Tensor  # int8 [out, in/2]
    scale: torch.Tensor   # float8_e8m0fnu [out, in/32]


# ---- power-of-two (ue8m0) scales ---------------------------------------------------------

def _pow2_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Integer e with 2^e = 2^ceil(log2(amax / qmax)), floored at 2^MIN_SCALE_EXP.

    Exact: frexp gives amax/qmax = mant * 2^k with mant in [0.5, 1), so ceil(log2) is k - 1
    when mant == 0.5 (an exact power of two) and k otherwise. Done in float64, where the
    division cannot round a float32/bf16 amax across a power of two.
    """
    r = (amax.to(torch.float64) / qmax).clamp_min(2.0 ** MIN_SCALE_EXP)
    mant, k = torch.frexp(r)
    return torch.where(mant == 0.5, k - 1, k).to(torch.int32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    return torch.exp2(e.to(torch.float64))  # exact for integer exponents


def _e8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    # ue8m0 stores exponent + 127 in one byte (no sign, no mantissa)
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _scale_values(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scale tensor (e8m0, or any float dtype) as ``dtype``; powers of two convert exactly.

    An e8m0 byte b is 2^(b - 127): built as the float32 whose exponent field is b (exact by
    construction, on any device), 2^-127 for b = 0 (a float32 subnormal), NaN for b = 255."""
    if scale.dtype != torch.float8_e8m0fnu:
        return scale.to(torch.float32).to(dtype)
    b = scale.view(torch.uint8).to(torch.int32)
    v = (b << 23).view(torch.float32)
    v = torch.where(b == 0, torch.full_like(v, 2.0 ** -127), v)
    return torch.where(b == 255, torch.full_like(v, float("nan")), v).to(dtype)


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D weight [out, in], got shape {list(t.shape)}")


# ---- FP8 e4m3, 128 x 128 blocks -----------------------------------------------------------

def quantize_fp8_blockwise(w: torch.Tensor) -> FP8Weight:
    """w: [out, in] float -> e4m3 values and one ue8m0 scale per 128 x 128 block.

    Scale = 2^ceil(log2(amax / 448)) per block (edge blocks may be partial); values are
    w / scale rounded to nearest even e4m3 and clamped to +-448.
    """
    _check_2d("quantize_fp8_blockwise", w)
    out, inn = w.shape
    ob, ib = fp8_scale_shape(w.shape)
    a = torch.nn.functional.pad(w.detach().abs(), (0, ib * FP8_BLOCK - inn, 0, ob * FP8_BLOCK - out))
    amax = a.view(ob, FP8_BLOCK, ib, FP8_BLOCK).amax(dim=(1, 3))               # [ob, ib]
    e = _pow2_exponent(amax, FP8_MAX)
    s = _pow2(e).repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inn]
    q = (w.detach() / s).to(torch.float32).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return FP8Weight(q, _e8m0_from_exponent(e))


def dequantize_fp8_blockwise(w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [out, in] with block scales [ceil(out/128), ceil(in/128)] -> ``dtype`` [out, in].

    Exact in bf16/fp32/fp64 (an e4m3 value times a power of two). Needs one output-sized
    tensor: the scale is applied block-column by block-column in place.
    """
    _check_2d("dequantize_fp8_blockwise", w_fp8)
    out, inn = w_fp8.shape
    if tuple(scale.shape) != fp8_scale_shape(w_fp8.shape):
        raise ValueError(f"fp8 scale shape {list(scale.shape)} does not fit weight {list(w_fp8.shape)}: "
                         f"expected {list(fp8_scale_shape(w_fp8.shape))}")
    x = w_fp8.to(dtype)
    rows = _scale_values(scale, dtype).repeat_interleave(FP8_BLOCK, 0)[:out]   # [out, ib]
    full = inn // FP8_BLOCK
    if full:
        x[:, : full * FP8_BLOCK].unflatten(1, (full, FP8_BLOCK)).mul_(rows[:, :full, None])
    if inn % FP8_BLOCK:
        x[:, full * FP8_BLOCK:].mul_(rows[:, full:])
    return x


# ---- FP4 e2m1, 32 along K -----------------------------------------------------------------

def _e2m1_codes(mag: torch.Tensor) -> torch.Tensor:
    """|x| (already divided by the scale, <= 6) -> e2m1 magnitude code 0..7, nearest, ties to even code."""
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for k in range(len(E2M1_GRID) - 1):
        mid = (E2M1_GRID[k] + E2M1_GRID[k + 1]) / 2
        up_is_even = (k + 1) % 2 == 0
        code += (mag > mid) | ((mag == mid) & up_is_even)
    return code


def quantize_fp4(w: torch.Tensor) -> FP4Weight:
    """w: [out, in] (in a multiple of 32) -> packed e2m1 pairs and a ue8m0 scale per 32 along K.

    Scale = 2^ceil(log2(amax / 6)) per block of 32, so |w| / scale <= 6; each value rounds
    to the nearest of 0, .5, 1, 1.5, 2, 3, 4, 6 (ties to the even code). Byte k of a row
    holds K index 2k in its low nibble and 2k+1 in its high nibble; bit 3 is the sign
    (set only for nonzero codes, so zero is always stored as +0).
    """
    _check_2d("quantize_fp4", w)
    out, inn = w.shape
    if inn % FP4_BLOCK:
        raise ValueError(f"quantize_fp4: in dim {inn} is not a multiple of {FP4_BLOCK}")
    blocks = w.detach().reshape(out, inn // FP4_BLOCK, FP4_BLOCK)
    e = _pow2_exponent(blocks.abs().amax(dim=-1), FP4_MAX)                       # [out, in/32]
    x = (blocks.to(torch.float64) / _pow2(e)[..., None]).reshape(out, inn)
    code = _e2m1_codes(x.abs().clamp_max(FP4_MAX))
    nib = code | (((x < 0) & (code > 0)).to(torch.uint8) << 3)
    packed = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return FP4Weight(packed.view(torch.int8), _e8m0_from_exponent(e))


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [out, in/2] e2m1 pairs with scales [out, in/32] -> ``dtype`` [out, in] (exact)."""
    _check_2d("dequantize_fp4", packed)
    out, half = packed.shape
    if tuple(scale.shape) != (out, 2 * half // FP4_BLOCK) or (2 * half) % FP4_BLOCK:
        raise ValueError(f"fp4 scale shape {list(scale.shape)} does not fit packed weight {list(packed.shape)}: "
                         f"expected {[out, 2 * half // FP4_BLOCK]}")
    grid = torch.tensor(E2M1_GRID, dtype=dtype, device=packed.device)
    table = torch.cat([grid, -grid])                        # code | sign << 3 -> value
    b = packed.view(torch.uint8)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).view(out, 2 * half).long()
    x = table[codes].view(out, -1, FP4_BLOCK)
    x.mul_(_scale_values(scale, dtype)[..., None])
    return x.view(out, 2 * half)


# ---- writer -----------------------------------------------------------------------------

def _encode(name: str, w: torch.Tensor, kind: WeightKind | None, fmt: str) -> dict[str, torch.Tensor]:
    """One model tensor -> the tensors stored for it in format ``fmt`` (quantised on the tensor's
    device, a GPU's when it is there; stored from the CPU)."""
    w = w.detach()
    if not w.is_floating_point():
        out = {name: w}
    elif fmt == "fp32" or kind is WeightKind.FP32:
        out = {name: w.to(torch.float32)}
    elif fmt == "fp8" and kind is WeightKind.FP8:
        q = quantize_fp8_blockwise(w)
        out = {name: q.weight, scale_name(name): q.scale}
    elif fmt == "fp8" and kind is WeightKind.FP4:
        q = quantize_fp4(w)
        out = {name: q.packed, scale_name(name): q.scale}
    else:
        out = {name: w.to(torch.bfloat16)}
    return {n: t.cpu().contiguous() for n, t in out.items()}


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in insertion order; a weight and its scale (adjacent) rarely part."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def save_checkpoint(
    path: str | Path,
    cfg: DSV4Config,
    weights: dict[str, torch.Tensor],
    fmt: str = "fp32",
    max_shard_bytes: int | None = None,
) -> None:
    """Write a test checkpoint: config.json plus one safetensors file or index + shards.

    fmt "fp32": every float tensor fp32. "bf16": bf16, except WeightKind.FP32 tensors (fp32).
    "fp8": as released: FP8 kinds e4m3 + ``.scale``, FP4 kinds (routed experts) int8-packed
    e2m1 + ``.scale``, BF16 kinds bf16, FP32 kinds fp32. Integer tensors are kept as they are.
    config.json carries the release's quantization_config only for "fp8".

    Tensors are written as given (names are not checked: that is the loader's job, and
    tests write broken checkpoints on purpose). Earlier model files in ``path`` are removed.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; choose one of {list(FORMATS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in [path / INDEX_FILE, path / SINGLE_FILE, *path.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)

    quantized = fmt == "fp8"
    hf = cfg.replace(quantization="fp8" if quantized else None,
                     expert_dtype="fp4" if quantized else None).to_hf_config()
    (path / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")

    kinds = {s.name: s.kind for s in weight_specs(cfg)}
    stored: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        stored.update(_encode(name, w, kinds.get(name), fmt))

    if max_shard_bytes is None:
        save_file(stored, str(path / SINGLE_FILE))
        return
    shards = _shards(stored, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname))
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in stored.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


# ---- loader -----------------------------------------------------------------------------

class _Stored(NamedTuple):
    file: Path
    dtype: str               # safetensors tag: F8_E4M3, F8_E8M0, I8, BF16, F32, I64, ...
    shape: tuple[int, ...]


class _Plan(NamedTuple):
    spec: WeightSpec
    how: str                 # "fp8", "fp4" or "plain"


def _tensor_files(path: Path) -> tuple[dict[Path, set[str] | None], list[str]]:
    """Files to read -> names the index assigns to them (None: no index, take all)."""
    index = path / INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files: dict[Path, set[str] | None] = {}
        problems = []
        for name, fname in weight_map.items():
            files.setdefault(path / fname, set()).add(name)
        for f in files:
            if not f.exists():
                problems.append(f"missing: shard {f.name} is listed in {INDEX_FILE} but does not exist")
        return {f: n for f, n in files.items() if f.exists()}, problems
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return {}, [f"no {INDEX_FILE} and no *.safetensors files in {path}"]
    return dict.fromkeys(files), []


def _read_headers(files: dict[Path, set[str] | None]) -> tuple[dict[str, _Stored], list[str]]:
    """Name -> (file, dtype, shape) from the safetensors headers alone (no tensor data)."""
    stored: dict[str, _Stored] = {}
    problems = []
    for f, listed in files.items():
        with safe_open(str(f), framework="pt") as h:
            keys = set(h.keys())
            for name in sorted(keys):
                if name in stored:
                    problems.append(f"duplicate: {name} is in both {stored[name].file.name} and {f.name}")
                    continue
                sl = h.get_slice(name)
                stored[name] = _Stored(f, sl.get_dtype(), tuple(sl.get_shape()))
        for name in sorted((listed or set()) - keys):
            problems.append(f"missing: {name} is listed in {INDEX_FILE} under {f.name} but that shard lacks it")
    return stored, problems


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _plan(specs: list[WeightSpec], stored: dict[str, _Stored], skip_mtp: bool,
          quantized: bool) -> tuple[list[_Plan], list[str]]:
    """Match stored tensors to the specs; every mismatch becomes one problem line.

    ``quantized``: the weights the model keeps quantised (``weights.keeps_quantized``) must be
    stored so (e4m3 + scale, e2m1 + e8m0 scale); anything else is a dtype problem."""
    plan: list[_Plan] = []
    problems: list[str] = []
    used: set[str] = set()

    def need(name: str, shape: tuple[int, ...], what: str, dtypes: tuple[str, ...] | None = None) -> bool:
        st = stored.get(name)
        if st is None:
            problems.append(f"missing: {name} {_fmt_shape(shape)} ({what})")
            return False
        used.add(name)
        if st.shape != shape:
            problems.append(f"shape: {name} expected {_fmt_shape(shape)}, found {_fmt_shape(st.shape)} ({st.dtype})")
            return False
        if dtypes is not None and st.dtype not in dtypes:
            problems.append(f"dtype: {name} is stored as {st.dtype}, expected one of {list(dtypes)} ({what})")
            return False
        return True

    for spec in specs:
        st = stored.get(spec.name)
        if st is None:
            problems.append(f"missing: {spec.name} {_fmt_shape(spec.shape)} ({spec.kind.value})")
            continue
        used.add(spec.name)
        if quantized and keeps_quantized(spec):
            want = ("F8_E4M3",) if spec.kind is WeightKind.FP8 else ("I8", "U8")
            if st.dtype not in want:
                problems.append(f"dtype: {spec.name} is stored as {st.dtype}; a quantised load keeps it as "
                                f"{' or '.join(want)} with a .scale (keep_quantized=False dequantises)")
                continue
        scale_dtypes = ("F8_E8M0",) if quantized and spec.kind is WeightKind.FP4 else _SCALE_DTYPES
        if st.dtype == "F8_E4M3" and len(spec.shape) == 2 and spec.kind is not WeightKind.INT64:
            ok = need(spec.name, spec.shape, "e4m3")
            ok &= need(scale_name(spec.name), fp8_scale_shape(spec.shape), f"block scale of e4m3 {spec.name}",
                       _SCALE_DTYPES)
            how = "fp8"
        elif st.dtype in ("I8", "U8") and spec.kind is WeightKind.FP4:
            ok = need(spec.name, fp4_packed_shape(spec.shape), f"packed e2m1 of {_fmt_shape(spec.shape)}")
            ok &= need(scale_name(spec.name), fp4_scale_shape(spec.shape), f"scale of e2m1 {spec.name}",
                       scale_dtypes)
            how = "fp4"
        elif st.dtype in _FLOAT_DTYPES and spec.kind is not WeightKind.INT64:
            ok, how = need(spec.name, spec.shape, spec.kind.value), "plain"
        elif st.dtype in ("I64", "I32") and spec.kind is WeightKind.INT64:
            ok, how = need(spec.name, spec.shape, "int64"), "plain"
        else:
            problems.append(f"dtype: {spec.name} is stored as {st.dtype}, which cannot hold a "
                            f"{spec.kind.value} weight {_fmt_shape(spec.shape)}")
            ok = False
        if ok:
            plan.append(_Plan(spec, how))

    for name in sorted(set(stored) - used):
        if skip_mtp and name.startswith("mtp."):
            continue
        st = stored[name]
        problems.append(f"unexpected: {name} {_fmt_shape(st.shape)} ({st.dtype}) in {st.file.name}")
    return plan, problems


def _safetensors_device(device: str | torch.device) -> str:
    dev = torch.device(device)
    if dev.type == "cpu":
        return "cpu"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return f"{dev.type}:{index}"


class WeightStream(Protocol):
    """What a model can be filled from (``ModelRunner``, ``Engine(weight_stream=...)``): a config,
    whether the weights come quantised, their device bytes, and ``(name, tensor)`` one at a time."""

    config: DSV4Config
    quantized: bool
    include_mtp: bool

    @property
    def nbytes(self) -> int: ...

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class CheckpointReader:
    """A checkpoint directory, checked against its config, that streams its tensors.

    Construction reads ``config.json`` and the safetensors headers only; every missing,
    unexpected, mis-shaped or wrongly typed tensor is collected and ``CheckpointError`` names
    them all before any data is read. :meth:`stream` then yields ``(name, tensor)`` shard by
    shard, one stored tensor at a time (a weight and its scale), each decoded on ``device``
    and handed over: host memory holds at most one tensor's bytes beside what the caller
    keeps, so a model can be filled without a second copy of its weights
    (``DSV4Model.load_stream``).

    ``keep_quantized``: True keeps what ``weights.model_tensors(cfg, dtype, quantized=True)``
    lists (FP8 linears as e4m3 + fp32 block scale, routed experts as e2m1 bytes + e8m0 scale
    bytes, ``wo_a`` as e4m3 + scale too, multiplied W8A16) and refuses a checkpoint that does not
    store them quantised; False dequantises everything to ``weights.param_dtype``; None
    (default) keeps an FP8 checkpoint (``quantization_config`` in config.json) quantised on
    CUDA and dequantises it elsewhere.
    """

    def __init__(self, path: str | Path, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", include_mtp: bool = True,
                 keep_quantized: bool | None = None, progress: bool | None = None):
        self.path = path = Path(path)
        if not (path / CONFIG_FILE).exists():
            raise CheckpointError(path, [f"missing: {CONFIG_FILE}"])
        self.config = cfg = DSV4Config.from_json(path / CONFIG_FILE)
        self.dtype, self.device, self.include_mtp, self.progress = dtype, torch.device(device), include_mtp, progress
        if keep_quantized is None:
            keep_quantized = cfg.quantization == "fp8" and self.device.type == "cuda"
        self.quantized = bool(keep_quantized)

        files, problems = _tensor_files(path)
        self._stored, header_problems = _read_headers(files)
        self._plan, match_problems = _plan(weight_specs(cfg, include_mtp), self._stored,
                                           skip_mtp=not include_mtp, quantized=self.quantized)
        problems += header_problems + match_problems
        if problems:
            raise CheckpointError(path, problems)

    @property
    def nbytes(self) -> int:
        """Bytes the loaded tensors take on the device (the model's weights)."""
        return sum(t.nbytes for t in model_tensors(self.config, self.dtype, self.include_mtp, self.quantized))

    def tensor_names(self) -> list[str]:
        """The names :meth:`stream` yields (``weights.model_tensors``' order)."""
        return [t.name for t in model_tensors(self.config, self.dtype, self.include_mtp, self.quantized)]

    def _stored_bytes(self, name: str) -> int:
        st = self._stored[name]
        return math.prod(st.shape) * _TAG_BYTES[st.dtype]

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(release name, tensor)`` for every tensor of ``model_tensors``, shard by shard."""
        by_file: dict[Path, list[_Plan]] = {}
        for item in self._plan:
            by_file.setdefault(self._stored[item.spec.name].file, []).append(item)
        total = sum(self._stored_bytes(n) for item in self._plan for n in _stored_names(item))
        st_device = _safetensors_device(self.device)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {self.path.name}",
                  disable=None if self.progress is None else not self.progress) as bar:
            for f, items in by_file.items():
                with safe_open(str(f), framework="pt", device=st_device) as h:
                    for item in items:
                        yield from self._decode(item, f, h, st_device)
                        bar.update(sum(self._stored_bytes(n) for n in _stored_names(item)))

    def _decode(self, item: _Plan, f: Path, h, st_device: str) -> Iterator[tuple[str, torch.Tensor]]:
        spec, how = item
        name = spec.name

        def get(n: str) -> torch.Tensor:
            if self._stored[n].file == f:
                return h.get_tensor(n)
            with safe_open(str(self._stored[n].file), framework="pt", device=st_device) as other:
                return other.get_tensor(n)   # a scale the writer put in the next shard

        target = param_dtype(name, spec.kind, self.dtype)
        if self.quantized and keeps_quantized(spec):
            if how == "fp8":
                yield name, _owned(get(name))
                yield scale_name(name), _scale_values(get(scale_name(name)), torch.float32)
            else:
                yield name, _owned(get(name).view(torch.uint8))
                yield scale_name(name), _owned(get(scale_name(name)).view(torch.uint8))
        elif how == "fp8":
            yield name, dequantize_fp8_blockwise(get(name), get(scale_name(name)), target)
        elif how == "fp4":
            yield name, dequantize_fp4(get(name), get(scale_name(name)), target)
        else:
            # a copy, not a view of the file mapping: that is aligned only to 8 bytes,
            # and CPU matmuls on it take other code paths (last-bit different results)
            yield name, get(name).to(target, copy=True)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor copied out of the file mapping (only 8-byte aligned; see "plain" above);
    one read onto a GPU is already a tensor of its own."""
    return t.clone() if t.device.type == "cpu" else t


def _stored_names(item: _Plan) -> tuple[str, ...]:
    return (item.spec.name,) if item.how == "plain" else (item.spec.name, scale_name(item.spec.name))


def load_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    include_mtp: bool = True,
    keep_quantized: bool | None = None,
    progress: bool | None = None,
) -> LoadedCheckpoint:
    """Read config.json and the weights of a checkpoint directory into a dict.

    Every tensor of ``weight_specs(cfg, include_mtp)`` must be present with its shape (FP8 /
    FP4 storage with a ``.scale`` of the right shape); otherwise ``CheckpointError`` lists
    all missing, unexpected and mis-shaped tensors at once, before any tensor is read.
    With ``include_mtp=False`` the MTP tensors are neither required nor loaded.

    Dequantised (``keep_quantized`` False, or None off CUDA), tensors come as
    ``weights.param_dtype(name, kind, dtype)``: ``dtype`` for matrices and norms, fp32 for the
    fp32 parameters (unless dtype is float64), int64 for the hash table. Kept quantised, as
    ``weights.model_tensors(cfg, dtype, quantized=True)`` lists (see :class:`CheckpointReader`).
    Placed on ``device``; a tqdm bar shows progress on a terminal (``progress`` forces it).
    """
    reader = CheckpointReader(path, dtype=dtype, device=device, include_mtp=include_mtp,
                              keep_quantized=keep_quantized, progress=progress)
    return LoadedCheckpoint(reader.config, dict(reader.stream()), reader.quantized)
