"""The OpenAI protocol as this server speaks it: request bodies, errors, SSE, and limits on input.

Everything here is a pure function of the request (no engine): the routes in ``server.py``
parse a body with :func:`read_json_body` (size, depth and text checked before anything else
runs), validate it into one of the request models, and refuse with :class:`APIError`, which
renders OpenAI's ``{"error": {"message", "type", "param", "code"}}``. The request models are
also what ``/openapi.json`` declares for the POST routes (:func:`add_request_bodies`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from scheduler_hooks.io import SamplingParams


# ---- errors ---------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param)


# ---- request bodies -------------------------------------------------------------------------------


class _Body(BaseModel):
    # Unknown fields are ignored (SGLang does the same), so clients with extra_body keys still work.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """OpenAI sampling fields plus SGLang's extras (top_k, min_p, ignore_eos, ...)."""

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class GenerateReqInput(_Body):
    """SGLang's native /generate request."""

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[dict[str, Any]] = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    rid: Optional[str] = None


def validation_error(errs: list[dict[str, Any]]) -> APIError:
    """A pydantic validation failure as a 400 naming the first offending field."""
    loc = [str(x) for x in (errs[0].get("loc", ()) if errs else ()) if x != "body"]
    msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body') or 'body'}: {er.get('msg')}"
                    for er in errs[:5])
    return bad_request(f"invalid request: {msg}", loc[0] if loc else None)


def add_request_bodies(schema: dict[str, Any], bodies: dict[str, type[BaseModel]]) -> dict[str, Any]:
    """Declare ``{path: model}`` as the JSON request bodies of those POST routes in an OpenAPI
    ``schema`` (the routes read the body themselves, so FastAPI cannot see them)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return schema


# ---- limits on what one request may ask for -------------------------------------------------------


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on the work one request can cause; each refusal is a 400 naming the field
    (413 for the body size). Built by the server from its flags (docs/server.md, "Limits")."""

    max_request_bytes: int
    max_json_depth: int
    max_prompt_chars: int
    max_stop_strings: int
    max_top_logprobs: int
    max_top_k: int

    def check_prompt_chars(self, n_chars: int, param: str) -> None:
        """Before tokenizing: text this long cannot be a prompt the server takes."""
        if n_chars > self.max_prompt_chars:
            raise bad_request(f"the prompt has {n_chars} characters; the limit is {self.max_prompt_chars} "
                              f"(--max-prompt-chars)", param)

    def check_top_logprobs(self, n: Optional[int], param: str) -> None:
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.max_top_logprobs):
            raise bad_request(f"{param} must be an integer in [0, {self.max_top_logprobs}], got {n!r}", param)

    def check_sampling(self, p: SamplingParams, prefix: str = "") -> None:
        """Stop sequences and top_k of validated SamplingParams; ``prefix`` goes before the field name."""
        for name in ("stop", "stop_token_ids"):
            if len(getattr(p, name)) > self.max_stop_strings:
                raise bad_request(f"{name} has {len(getattr(p, name))} entries; the limit is "
                                  f"{self.max_stop_strings} (--max-stop-strings)", prefix + name)
        if p.top_k > self.max_top_k:
            raise bad_request(f"top_k must be -1 (off) or in [1, {self.max_top_k}], got {p.top_k}", prefix + "top_k")


# An escape that may decode to a lone surrogate, which no tokenizer (nor UTF-8) can take.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_non_finite(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def read_json_body(request: Request, limits: RequestLimits) -> dict[str, Any]:
    """The body as a JSON object, whatever the Content-Type (curl -d sends form encoding).

    Refused: over ``max_request_bytes`` (413, read no further), not JSON, NaN / Infinity,
    nested deeper than ``max_json_depth``, a string holding a lone UTF-16 surrogate."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_request_bytes:
        raise _too_large(limits)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_request_bytes:
            raise _too_large(limits)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        data = json.loads(raw, parse_constant=_reject_non_finite)
    except RecursionError:
        raise bad_request(f"the request body is nested deeper than {limits.max_json_depth} levels (--max-json-depth)")
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}")
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    _check_json_tree(data, limits.max_json_depth, check_text=_SURROGATE_ESCAPE.search(raw) is not None)
    return data


def _too_large(limits: RequestLimits) -> APIError:
    return APIError(413, f"the request body is over {limits.max_request_bytes} bytes (--max-request-bytes)",
                    code="request_too_large")


def _check_json_tree(data: dict[str, Any], max_depth: int, check_text: bool) -> None:
    """Depth (the body object is level 1) and, when ``check_text``, lone surrogates; the error's
    ``param`` is the top-level field that holds the offence. Iterative: no recursion to exhaust."""
    stack: list[tuple[Any, int, Optional[str]]] = [(data, 1, None)]
    while stack:
        node, depth, field = stack.pop()
        if depth > max_depth:
            raise bad_request(f"the request body is nested deeper than {max_depth} levels (--max-json-depth)", field)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            where = field if field is not None else str(key)
            if check_text:
                for text in ((key, value) if isinstance(key, str) else (value,)):
                    if isinstance(text, str) and not _is_unicode(text):
                        raise bad_request(f"{where} holds a lone UTF-16 surrogate (not a Unicode character)", where)
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1, where))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def read_body(request: Request, model: type[BaseModel], limits: RequestLimits) -> Any:
    """The JSON body validated as ``model``."""
    data = await read_json_body(request, limits)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors())


# ---- server-sent events ---------------------------------------------------------------------------


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"

