"""SGLang 0.5.23 plugin: our Triton DSV4 attention backend and pool configurator inside SGLang.

The only module that imports SGLang. SGLang calls ``register()`` through the entry point
``dsv4_triton`` of group ``sglang.srt.plugins`` (pyproject.toml) in the launcher before
argument parsing, in ``Engine.__init__`` and in every scheduler process. It:

1. registers ``TritonDSV4AttnBackend`` under the name ``dsv4_triton`` in SGLang's attention
   registry and adds the name to the ``--attention-backend`` choices;
2. keeps it selected for DeepSeek-V4 checkpoints: SGLang's model override for
   ``DeepseekV4ForCausalLM`` declares ``attention_backend="dsv4"``, which silently replaces
   the user's ``--attention-backend``. We add a predicate-keyed override provider (SGLang's own
   registry; predicate providers run after the per-architecture ones and the last writer
   wins) that declares ``dsv4_triton`` for all three backend fields when the user asked for it;
3. wraps ``create_memory_pool_configurator`` (``HookRegistry``, AROUND): when ``dsv4_triton``
   is the backend of a DeepSeek-V4 model, SGLang's ``DSV4PoolConfigurator`` is replaced by
   ``TritonDSV4PoolConfigurator``, which prices the pools with ``memory.sglang_sizing`` and
   returns SGLang's ``MemoryPoolConfig``. The pool classes stay SGLang's.

What stays SGLang's: scheduler, radix cache, model code, weights, MoE, the DSV4 pools and
their page layout, the backend's metadata and CUDA-graph machinery (inherited). What is ours:
the KV store (``store_cache``) on SGLang's SWA pool pages, and the configurator.

``torchvision``: SGLang imports it at module level in one multimodal helper only. When it is
not installed (a ``--no-deps`` install, as in our tests), ``_stub_torchvision()`` puts a module
in its place whose every attribute raises ImportError when used, after telling transformers it
is absent; an installed torchvision is never touched.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import math
import sys
import types

logger = logging.getLogger(__name__)

BACKEND_NAME = "dsv4_triton"
DSV4_ARCH = "DeepseekV4ForCausalLM"
_CONFIGURATOR_TARGET = "sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator"


class _MissingTorchvision:
    """Stands for any torchvision attribute; using it raises ImportError."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_MissingTorchvision":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _MissingTorchvision(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self._name} needs torchvision, which is not installed")


def _stub_torchvision() -> None:
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.utils import import_utils  # caches "absent" before the stub exists

    import_utils.is_torchvision_available()
    import_utils.is_torchvision_v2_available()

    def attr_of(module_name: str):
        def getattr_(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _MissingTorchvision(f"{module_name}.{attr}")
        return getattr_

    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []
        mod.__getattr__ = attr_of(name)
        sys.modules[name] = mod


_stub_torchvision()

import torch  # noqa: E402

from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices  # noqa: E402
from sglang.srt.arg_groups.model_override_base import register_model_override_predicate  # noqa: E402
from sglang.srt.layers.attention.attention_registry import register_attention_backend  # noqa: E402
from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend  # noqa: E402
from sglang.srt.model_executor.pool_configurator import (  # noqa: E402
    MemoryPoolConfig, MemoryPoolConfigurator,
)
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402

from dsv4_backend.kernels.kv_store import kv_store_rows  # noqa: E402
from memory.sglang_sizing import SGLangPoolInputs, SGLangPoolSizes, SGLangPoolSizing  # noqa: E402


# ---- the backend ----------------------------------------------------------------------------

class TritonDSV4AttnBackend(DeepseekV4AttnBackend):
    """SGLang's DSV4 backend with our Triton KV store on SGLang's SWA pool.

    Everything else (metadata, ``init_forward_metadata``, CUDA-graph state, compression
    slots, the indexer and attention calls) is inherited. The SWA pool is SGLang's uint8
    ``[pages, 149,760]``: 256 rows of ``[576-byte nope|rope parts | 8-byte scale groups]``
    padded to 576-byte blocks, which our kernels address as P = page_bytes // 584 rows at a
    page stride of the tensor's row stride.
    """

    def store_cache(self, layer_id: int, swa_k: torch.Tensor, forward_batch) -> None:
        # swa_k: [N, 512] finished rows (kv_norm + RoPE applied); swa_loc: [N] SWA slots
        swa_loc = self.get_swa_out_cache_loc(forward_batch)
        kv_store_rows(self.token_to_kv_pool.get_swa_raw_buffer(layer_id), swa_loc, swa_k)


def create_backend(runner) -> TritonDSV4AttnBackend:
    return TritonDSV4AttnBackend(runner)


# ---- keeping the backend for DeepSeek-V4 ----------------------------------------------------

def keep_backend_for_dsv4(server_args, hf_config) -> dict:
    """Override provider: re-declare ``dsv4_triton`` after SGLang's DSV4 override forced "dsv4".

    Reads the user's raw fields (resolution never mutates them). Any of the three backend
    flags naming ``dsv4_triton`` selects it for both phases.
    """
    asked = (server_args.attention_backend, server_args.prefill_attention_backend,
             server_args.decode_attention_backend)
    if BACKEND_NAME not in asked:
        return {}
    return {"attention_backend": BACKEND_NAME, "prefill_attention_backend": BACKEND_NAME,
            "decode_attention_backend": BACKEND_NAME}


# ---- the configurator -----------------------------------------------------------------------

class TritonDSV4PoolConfigurator(MemoryPoolConfigurator):
    """Sizes SGLang's DSV4 pools with ``memory.sglang_sizing``; returns ``MemoryPoolConfig``.

    Built from the same inputs SGLang's ``DSV4PoolConfigurator`` reads: the model (this
    stage's compress ratios), the env flags, speculative decoding, HiSparse's
    host-to-device ratio, attention DP (requests per worker) and the SWA sizing mode (the
    operator's ``--swa-full-tokens-ratio``, else SGLang's request cap when chunked prefill is
    on). Modes our kernels do not serve are refused by name.
    """

    def __init__(self, kvc) -> None:
        from sglang.srt.environ import envs
        from sglang.srt.model_executor.pool_configurator import (
            DSV4_DEFAULT_SWA_FULL_TOKENS_RATIO, _get_dsv4_compress_state_dtype_sizes,
            _operator_swa_full_tokens_ratio,
        )
        from sglang.srt.runtime_context import (
            get_disagg, get_exec, get_memory, get_schedule, get_spec, max_speculative_num_draft_tokens,
        )

        cfg = kvc.model_config
        ratios = tuple(cfg.compress_ratios[kvc.layer_info.start_layer:kvc.layer_info.end_layer])
        if any(r in (1, 2) for r in ratios):
            raise ValueError(f"{BACKEND_NAME}: compress ratios 1/2 (DeepSeek-V4.1) are not supported")
        if get_exec().features.enable_encoder_swa_bounded_replay:
            raise ValueError(f"{BACKEND_NAME}: --enable-encoder-swa-bounded-replay is not supported")
        if get_disagg().disaggregation_mode == "decode":
            raise ValueError(f"{BACKEND_NAME}: --disaggregation-mode decode is not supported")
        self.page_size = kvc.page_size
        self.sliding_window_size = kvc.sliding_window_size
        schedule = get_schedule()
        if schedule.max_running_requests is None:
            raise ValueError(f"{BACKEND_NAME}: max_running_requests must be resolved (SGLang's DSV4 "
                             "defaults set 256)")
        requests = max(1, schedule.max_running_requests // kvc.attn_dp_size)
        speculative = get_spec().speculative_algorithm is not None
        operator_ratio = _operator_swa_full_tokens_ratio()
        self.inputs = SGLangPoolInputs(
            layer_ratios=ratios,
            sliding_window=kvc.sliding_window_size,
            max_running_requests=requests,
            state_bytes=_get_dsv4_compress_state_dtype_sizes()[0],
            swa_ratio=operator_ratio if operator_ratio is not None else DSV4_DEFAULT_SWA_FULL_TOKENS_RATIO,
            swa_cap_tokens=None if operator_ratio is not None else self._swa_cap(kvc, requests),
            speculative=speculative,
            draft_tokens=(max_speculative_num_draft_tokens() or 0),
            online_compress=bool(envs.SGLANG_OPT_USE_ONLINE_COMPRESS.get()),
            c4_shrink_factor=self._shrink(get_memory()),
            page=kvc.page_size,
        )
        self.sizing = SGLangPoolSizing(self.inputs)

    @staticmethod
    def _shrink(memory) -> int:
        if not memory.enable_hisparse:
            return 1
        from sglang.srt.mem_cache.sparsity import parse_hisparse_config
        return parse_hisparse_config().host_to_device_ratio

    @staticmethod
    def _swa_cap(kvc, requests: int) -> int | None:
        """SGLang's cap mode (scheduler policy): worst-case live SWA slots plus radix headroom."""
        from sglang.srt.model_executor.pool_configurator import compute_swa_request_cap
        from sglang.srt.runtime_context import get_disagg, get_memory, get_schedule

        schedule = get_schedule()
        chunk = schedule.chunked_prefill_size
        if get_disagg().disaggregation_mode != "decode" and (chunk is None or chunk <= 0):
            return None
        cap = compute_swa_request_cap(page_size=kvc.page_size, window=kvc.sliding_window_size,
                                      attn_dp_size=kvc.attn_dp_size)
        tails = schedule.swa_prefix_tails
        if tails is None:
            tails = 0 if get_memory().disable_radix_cache else 4 * requests
        headroom = tails * (kvc.sliding_window_size + kvc.page_size)
        return math.ceil((cap + headroom) / kvc.page_size) * kvc.page_size

    def _config(self, sizes: SGLangPoolSizes) -> MemoryPoolConfig:
        full = sizes.full_max_total_num_tokens
        return MemoryPoolConfig(
            max_total_num_tokens=full, full_max_total_num_tokens=full,
            swa_max_total_num_tokens=sizes.swa_max_total_num_tokens,
            c4_max_total_num_tokens=sizes.c4_max_total_num_tokens,
            c128_max_total_num_tokens=sizes.c128_max_total_num_tokens,
            c4_state_pool_size=sizes.c4_state_pool_size,
            c128_state_pool_size=0,  # request-scoped: set by finalize_with_max_running_requests
        )

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> MemoryPoolConfig:
        self._check_page(page_size)
        return self._config(self.sizing.sizes_for_budget(available_bytes))

    def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens: int,
                                             page_size: int) -> MemoryPoolConfig:
        self._check_page(page_size)
        return self._config(self.sizing.sizes_for_tokens(max_total_num_tokens))

    def finalize_with_max_running_requests(self, config: MemoryPoolConfig) -> MemoryPoolConfig:
        slots = config.max_running_requests + 1
        config.c128_state_pool_size = slots * self.sizing.c128_ring if self.inputs.count(128) else 0
        return config

    def _check_page(self, page_size: int) -> None:
        if page_size != self.inputs.page:
            raise ValueError(f"{BACKEND_NAME}: page_size {page_size} differs from the configured "
                             f"{self.inputs.page}")


def _uses_our_backend() -> bool:
    from sglang.srt.runtime_context import get_exec
    return get_exec().kernel.attention_backend == BACKEND_NAME


def create_configurator(original, kvc):
    """AROUND hook on ``create_memory_pool_configurator``: ours for DSV4 under dsv4_triton."""
    from sglang.srt.configs.model_config import is_deepseek_v4

    if is_deepseek_v4(kvc.model_config.hf_config) and kvc.is_hybrid_swa and _uses_our_backend():
        return TritonDSV4PoolConfigurator(kvc)
    return original(kvc)


# ---- the entry point ------------------------------------------------------------------------

_registered = False


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    register_attention_backend(BACKEND_NAME)(create_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_model_override_predicate(lambda arch: arch == DSV4_ARCH)(keep_backend_for_dsv4)
    HookRegistry.register(_CONFIGURATOR_TARGET, create_configurator, HookType.AROUND)
    logger.info("registered attention backend %s and its DSV4 pool configurator", BACKEND_NAME)


__all__ = ["BACKEND_NAME", "TritonDSV4AttnBackend", "TritonDSV4PoolConfigurator",
           "create_configurator", "keep_backend_for_dsv4", "register"]
