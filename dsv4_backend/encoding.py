"""DeepSeek-V4 chat encoding: OpenAI-style messages to the prompt text, and completions back.

No Jinja template ships with the model; the prompt is built in code. The format, as the release's
four golden cases show it (``tests/data/dsv4_encoding/``)::

    <｜begin▁of▁sentence｜>[effort prefix]{system}[\\n\\n{tools block}]
    [<｜latest_reminder｜>{reminder}]
    <｜User｜>{user}[\\n\\n{more user parts / <tool_result>…</tool_result>}]
    <｜Assistant｜><think>{reasoning}</think>{answer}[\\n\\n{DSML tool calls}]<｜end▁of▁sentence｜>
    ...
    <｜User｜>{open turn}<｜Assistant｜><think>            (thinking mode; "</think>" in chat mode)

- An assistant turn keeps ``<think>{reasoning}</think>`` only in thinking mode and only when its
  reasoning is not dropped; otherwise it opens with ``</think>``. With ``drop_thinking`` the turns
  before the last user turn lose their reasoning, unless any message carries tools.
- Tool results (role ``tool``) join the next user turn, ordered like the calls of the assistant
  turn they answer; consecutive user / tool messages share one ``<｜User｜>`` turn, parts joined by
  a blank line.
- ``developer`` renders like a user turn and may carry tools; ``latest_reminder`` has its own token.
- ``task`` on a user message ends that turn with a quick-instruction token (``action`` after the
  assistant prefix, the others directly); the assistant turn that answers it is bare text + EOS.
  ``task: "title"`` on an assistant message appends ``<｜title｜>`` after its EOS.

``parse_message_from_completion_text`` reads what the model generated after the prompt (reasoning
up to ``</think>`` in thinking mode, then the answer and any DSML tool calls) and never raises on
truncated output.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any, Optional

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"

# Quick-instruction tasks: the token that triggers each one.
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")
ROLES = ("system", "user", "assistant", "tool", "developer", "latest_reminder")

# Prepended right after BOS in thinking mode with reasoning_effort="max" (the release's wording).
# "high" is the model's default thinking depth and adds nothing.
EFFORT_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

_TOOLS_HEADER = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{TOOL_CALLS_START}" block like the following:

{TOOL_CALLS_START}
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
{TOOL_CALLS_END}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

"""
_TOOLS_FOOTER = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


class EncodingError(ValueError):
    """A conversation the encoder cannot render; the message says which message and why."""


# ---- encoding ---------------------------------------------------------------------------------


def _json(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False)


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or a list of OpenAI text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise EncodingError(f"{where}[{i}]: only text content parts are supported")
        return "\n\n".join(parts)
    raise EncodingError(f"{where}: content must be a string or a list of text parts")


def render_tools(tools: list[dict[str, Any]]) -> str:
    """The tools block of a system / developer message: the DSML instructions and one schema per line."""
    schemas = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EncodingError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}")
        schemas.append(_json(fn))
    return _TOOLS_HEADER + "\n".join(schemas) + _TOOLS_FOOTER


def _arguments_dict(arguments: Any, where: str) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or arguments == "":
        return {}
    try:
        value = json.loads(arguments)
    except (TypeError, ValueError) as e:
        raise EncodingError(f"{where}: arguments are not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise EncodingError(f"{where}: arguments must be a JSON object")
    return value


def render_tool_calls(tool_calls: list[dict[str, Any]], where: str = "tool_calls") -> str:
    """DSML for an assistant turn's calls: strings verbatim with string="true", the rest as JSON."""
    invokes = []
    for i, call in enumerate(tool_calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EncodingError(f"{where}[{i}]: a tool call needs function.name")
        args = _arguments_dict(fn.get("arguments"), f"{where}[{i}]")
        params = []
        for key, value in args.items():
            is_str = isinstance(value, str)
            shown = value if is_str else _json(value)
            params.append(f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">'
                          f"{shown}</{DSML}parameter>")
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"\n\n{TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _merge_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fold tool results and consecutive user messages into single user turns.

    A merged user turn is ``{"role": "user", "parts": [...], "task": ...}``; each part is text,
    tool results rendered as ``<tool_result>…</tool_result>`` and sorted by the order of the
    calls (by ``tool_call_id``) of the assistant turn they answer.
    """
    merged: list[dict[str, Any]] = []
    call_order: dict[str, int] = {}
    for i, m in enumerate(messages):
        role = m["role"]
        if role in ("user", "tool"):
            if role == "tool":
                part = {"tool": True, "id": m.get("tool_call_id"),
                        "text": f"<tool_result>{_text_of(m.get('content'), f'messages[{i}].content')}</tool_result>"}
            else:
                part = {"tool": False, "text": _text_of(m.get("content"), f"messages[{i}].content")}
            prev = merged[-1] if merged else None
            if prev is not None and prev["role"] == "user" and "parts" in prev and prev.get("task") is None:
                prev["parts"].append(part)
            else:
                merged.append({"role": "user", "parts": [part]})
            if role == "user" and m.get("task") is not None:
                merged[-1]["task"] = m["task"]
            continue
        out = dict(m)
        if role == "assistant":
            ids = [c.get("id") for c in (m.get("tool_calls") or []) if isinstance(c, dict)]
            call_order = {cid: k for k, cid in enumerate(ids) if cid}
        merged.append(out)
        if role == "assistant":
            out["_call_order"] = call_order
    # Sort each turn's tool results into call order (results without a known id keep their place).
    order: dict[str, int] = {}
    for turn in merged:
        if turn["role"] == "assistant":
            order = turn.pop("_call_order")
        elif "parts" in turn:
            tool_parts = [p for p in turn["parts"] if p["tool"]]
            if len(tool_parts) > 1 and all(p.get("id") in order for p in tool_parts):
                it = iter(sorted(tool_parts, key=lambda p: order[p["id"]]))
                turn["parts"] = [next(it) if p["tool"] else p for p in turn["parts"]]
    return merged


def _validate(messages: Any, thinking_mode: str, reasoning_effort: Optional[str]) -> None:
    if thinking_mode not in THINKING_MODES:
        raise EncodingError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise EncodingError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    if not isinstance(messages, list) or not messages:
        raise EncodingError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise EncodingError(f"messages[{i}] must be an object")
        if m.get("role") not in ROLES:
            raise EncodingError(f"messages[{i}].role: unknown role {m.get('role')!r}; expected one of {ROLES}")
        task = m.get("task")
        if task is not None and task not in TASK_TOKENS:
            raise EncodingError(f"messages[{i}].task: unknown task {task!r}")
        if m.get("tools") and m["role"] not in ("system", "developer"):
            raise EncodingError(f"messages[{i}]: tools belong on a system or developer message")


def encode_messages(
    messages: list[dict[str, Any]],
    thinking_mode: str = "chat",
    drop_thinking: bool = True,
    reasoning_effort: Optional[str] = None,
    tools: Optional[list[dict[str, Any]]] = None,
    add_bos: bool = True,
) -> str:
    """The prompt text for ``messages`` (OpenAI-style dicts; see the module docstring for the format).

    ``tools`` (OpenAI function tools) are attached to the first message when it is a system
    message, otherwise to a new empty system message in front. When the conversation does not end
    with an assistant turn, the prompt ends with the assistant prefix the model continues from.
    """
    _validate(messages, thinking_mode, reasoning_effort)
    messages = copy.deepcopy(messages)
    if tools:
        if messages[0]["role"] == "system":
            messages[0]["tools"] = list(messages[0].get("tools") or []) + list(tools)
        else:
            messages.insert(0, {"role": "system", "content": "", "tools": list(tools)})
    thinking = thinking_mode == "thinking"
    drop = drop_thinking and not any(m.get("tools") for m in messages)
    turns = _merge_turns(messages)
    last_user = max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)

    out = [BOS] if add_bos else []
    if thinking and reasoning_effort == "max":
        out.append(EFFORT_MAX_PREFIX)
    prev: Optional[dict[str, Any]] = None
    for i, turn in enumerate(turns):
        role = turn["role"]
        where = f"turn {i} ({role})"
        if role == "system" or role == "developer":
            body = [_text_of(turn.get("content"), where)]
            if turn.get("tools"):
                body.append(render_tools(turn["tools"]))
            out.append((USER if role == "developer" else "") + "\n\n".join(p for p in body if p))
        elif role == "latest_reminder":
            out.append(LATEST_REMINDER + _text_of(turn.get("content"), where))
        elif role == "user":
            out.append(USER + "\n\n".join(p["text"] for p in turn["parts"]))
            task = turn.get("task")
            if task == "action":
                out.append(ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task])
            elif task is not None:
                out.append(TASK_TOKENS[task])
        else:  # assistant
            answers_task = prev is not None and prev.get("task") is not None
            if not answers_task:
                keep = thinking and (not drop or i > last_user)
                reasoning = _text_of(turn.get("reasoning_content"), where + ".reasoning_content")
                out.append(ASSISTANT + (THINK_START + reasoning + THINK_END if keep else THINK_END))
            out.append(_text_of(turn.get("content"), where + ".content"))
            if turn.get("tool_calls"):
                out.append(render_tool_calls(turn["tool_calls"], where + ".tool_calls"))
            out.append(EOS)
            if turn.get("task") is not None:
                out.append(TASK_TOKENS[turn["task"]])
        prev = turn
    if prev is not None and prev["role"] != "assistant" and prev.get("task") is None:
        # An open turn: the model answers next (its reasoning is after the last user turn: kept).
        out.append(ASSISTANT + (THINK_START if thinking else THINK_END))
    return "".join(out)


# ---- parsing ----------------------------------------------------------------------------------

_INVOKE_RE = re.compile(rf'<{DSML}invoke name="([^"]*)">(.*?)(?:</{DSML}invoke>|$)', re.S)
_PARAM_RE = re.compile(
    rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)(?:</{DSML}parameter>|$)', re.S)


def _parse_value(raw: str, is_string: bool) -> Any:
    if is_string:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # a malformed (or truncated) JSON value stays text rather than failing the reply


def parse_tool_calls(block: str) -> list[dict[str, str]]:
    """``[{name, arguments (JSON string)}]`` from the text after ``<｜DSML｜tool_calls>``.

    An invoke cut off by the token limit still yields the parameters that were complete.
    """
    calls = []
    for name, body in _INVOKE_RE.findall(block):
        args = {key: _parse_value(raw, flag == "true") for key, flag, raw in _PARAM_RE.findall(body)}
        calls.append({"name": name, "arguments": _json(args)})
    return calls


def parse_message_from_completion_text(text: str, thinking_mode: str = "chat") -> dict[str, Any]:
    """The assistant message in generated ``text`` (what follows the prompt's assistant prefix).

    Returns ``{"role": "assistant", "content", "reasoning_content", "tool_calls": [{name, arguments}]}``.
    In thinking mode the text up to ``</think>`` is reasoning (all of it when ``</think>`` never
    came); the answer runs to the DSML tool-call block or EOS. Truncated output never raises.
    """
    if thinking_mode not in THINKING_MODES:
        raise EncodingError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    reasoning = ""
    rest = text
    if thinking_mode == "thinking":
        if rest.startswith(THINK_START):
            rest = rest[len(THINK_START):]
        end = rest.find(THINK_END)
        if end < 0:
            return {"role": "assistant", "content": "", "reasoning_content": rest.split(EOS, 1)[0],
                    "tool_calls": []}
        reasoning, rest = rest[:end], rest[end + len(THINK_END):]
    elif rest.startswith(THINK_END):
        rest = rest[len(THINK_END):]
    rest = rest.split(EOS, 1)[0]
    tool_calls: list[dict[str, str]] = []
    start = rest.find(TOOL_CALLS_START)
    if start >= 0:
        block = rest[start + len(TOOL_CALLS_START):].split(TOOL_CALLS_END, 1)[0]
        tool_calls = parse_tool_calls(block)
        content = rest[:start]
        if content.endswith("\n\n"):
            content = content[:-2]
    else:
        content = rest
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls}
