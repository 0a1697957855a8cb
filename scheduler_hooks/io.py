"""What crosses the engine's boundary: sampling parameters, a request, and its outputs.

The offline ``Engine.generate`` and the HTTP server both speak these types; field names
follow SGLang's ``sampling_params`` and ``meta_info`` so that clients written for SGLang
read our responses unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional


class InvalidRequest(ValueError):
    """A request the engine refuses before admitting it; ``param`` names the offending field."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


# Temperatures below this are greedy (SGLang's threshold): dividing logits by a denormal
# overflows them to inf, and the softmax of such a row is NaN.
GREEDY_TEMPERATURE = 1e-5
# The smallest repetition penalty: positive logits are divided by it, so a tiny penalty
# overflows them (1e-320 makes every seen token's logit inf).
MIN_REPETITION_PENALTY = 1e-2


class EngineOverloaded(RuntimeError):
    """The engine's waiting queue is over ``max_queued_requests``; retry later (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1              # -1: no limit
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: Optional[int] = None

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> "SamplingParams":
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {unknown}", param=unknown[0])
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        for k in ("stop", "stop_token_ids"):
            if d.get(k) is None:
                d.pop(k, None)
        p = cls(**d)
        p.validate()
        return p

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise InvalidRequest(f"{param} {msg}", param=param)

        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")
        for name in ("max_new_tokens", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(name, f"must be an integer, got {v!r}")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be a boolean, got {getattr(self, name)!r}")
        if not isinstance(self.stop, list) or not all(isinstance(x, str) for x in self.stop):
            bad("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if any(x == "" for x in self.stop):
            bad("stop", "must not contain an empty string")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in self.stop_token_ids):
            bad("stop_token_ids", f"must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not (-(2 ** 63) <= self.seed < 2 ** 64)):
            bad("seed", f"must be an integer that fits in 64 bits, got {self.seed!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad("max_new_tokens", f"must be a positive integer, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not (MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0):
            bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, 2], got {self.repetition_penalty}")

    def normalize(self, vocab_size: int) -> None:
        """Rewrite equivalent settings into the ones sampling handles exactly (after ``validate``):
        a temperature below ``GREEDY_TEMPERATURE`` is greedy, a top_k of the whole vocabulary is off."""
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        if self.top_k >= vocab_size:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1     # -1: output tokens only (SGLang's default)
    top_logprobs_num: int = 0
    stream: bool = False


# One logprob entry: (logprob, token_id, decoded text or None), SGLang's shape.
LogprobEntry = tuple[Optional[float], int, Optional[str]]


@dataclass
class RequestOutput:
    """A request's state after a step. ``delta_*`` is what this step added (for streaming)."""

    rid: str
    output_ids: list[int]
    delta_ids: list[int]
    text: str
    delta_text: str
    finished: bool
    finish_reason: Optional[dict[str, Any]]   # {"type": "stop"|"length"|"abort", "matched": ...}
    prompt_tokens: int
    completion_tokens: int
    input_token_logprobs: Optional[list[LogprobEntry]] = None
    output_token_logprobs: Optional[list[LogprobEntry]] = None
    input_top_logprobs: Optional[list[Optional[list[LogprobEntry]]]] = None
    output_top_logprobs: Optional[list[list[LogprobEntry]]] = None
    error: Optional[str] = None
    cached_tokens: int = 0      # prompt ids served from the prefix cache (not prefilled)

    def meta_info(self) -> dict[str, Any]:
        m: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
        }
        for k in ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs"):
            v = getattr(self, k)
            if v is not None:
                m[k] = v
        return m

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self.meta_info()}
