"""DeepSeek-V4 chat encoding: the release's four golden prompts byte for byte, parsing, and the
rules (open user turn, dropped reasoning, tool results in call order) on conversations built here."""

import json

import pytest

from tests.conftest import TESTDATA
from dsv4_backend.encoding import (
    ASSISTANT, BOS, DSML, EFFORT_MAX_PREFIX, EOS, THINK_END, THINK_START, USER, EncodingError,
    encode_messages, parse_message_from_completion_text,
)

GOLDEN = TESTDATA / "dsv4_encoding"
CASES = [(1, "thinking"), (2, "thinking"), (3, "thinking"), (4, "chat")]


def load_case(i: int) -> list[dict]:
    data = json.loads((GOLDEN / f"test_input_{i}.json").read_text(encoding="utf-8"))
    if isinstance(data, dict):  # case 1: tools ride on the first (system) message
        messages = data["messages"]
        messages[0]["tools"] = data["tools"]
        return messages
    return data


def golden(i: int) -> str:
    return (GOLDEN / f"test_output_{i}.txt").read_bytes().decode("utf-8")


def assistant_completions(prompt: str) -> list[str]:
    """Each assistant turn as the model would have generated it: text after the assistant prefix up to EOS."""
    out = []
    for piece in prompt.split(ASSISTANT)[1:]:
        body = piece.split(EOS, 1)[0] + EOS
        out.append(body[len(THINK_START):] if body.startswith(THINK_START) else body)
    return out


@pytest.mark.parametrize("case,mode", CASES)
def test_golden_prompt_byte_for_byte(case, mode):
    got = encode_messages(load_case(case), thinking_mode=mode)
    want = golden(case)
    if got != want:
        k = next((j for j in range(min(len(got), len(want))) if got[j] != want[j]), min(len(got), len(want)))
        pytest.fail(f"case {case} differs at char {k}: got {got[k - 40:k + 40]!r}, want {want[k - 40:k + 40]!r}")
    assert got.encode("utf-8") == (GOLDEN / f"test_output_{case}.txt").read_bytes()


def test_case1_tools_argument_matches_tools_on_system_message():
    data = json.loads((GOLDEN / "test_input_1.json").read_text(encoding="utf-8"))
    assert encode_messages(data["messages"], thinking_mode="thinking", tools=data["tools"]) == golden(1)


def test_parse_case1_tool_call_turn_and_final_turn():
    first, last = assistant_completions(golden(1))
    m = parse_message_from_completion_text(first, "thinking")
    assert m["reasoning_content"] == ("The user wants to know the weather in Beijing. "
                                      "I should use the get_weather tool.")
    assert m["content"] == ""
    assert [c["name"] for c in m["tool_calls"]] == ["get_weather"]
    assert json.loads(m["tool_calls"][0]["arguments"]) == {"location": "Beijing", "unit": "celsius"}
    m = parse_message_from_completion_text(last, "thinking")
    assert m["reasoning_content"] == "Got the weather data. Let me format a nice response."
    assert "22°C" in m["content"]
    assert m["tool_calls"] == []


def test_parse_case2_last_turn_and_dropped_first_reasoning():
    prompt = golden(2)
    m = parse_message_from_completion_text(assistant_completions(prompt)[-1], "thinking")
    assert m["reasoning_content"] == "The user asks about the capital of France. It is Paris."
    assert m["content"] == "The capital of France is Paris."
    assert m["tool_calls"] == []
    assert "The user said hello" not in prompt


def test_parse_case3_chinese_search_call():
    first = assistant_completions(golden(3))[0]
    m = parse_message_from_completion_text(first, "thinking")
    assert m["reasoning_content"] == "用户想知道小柴胡冲剂和布洛芬能否一起服用。"
    assert json.loads(m["tool_calls"][0]["arguments"]) == {"queries": "小柴胡冲剂 布洛芬 相互作用 一起吃"}


# ---- conversations built here ---------------------------------------------------------------------


def test_open_user_turn_ends_with_assistant_prefix():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert encode_messages(msgs, "chat") == f"{BOS}Be brief.{USER}Hi there{ASSISTANT}{THINK_END}"
    assert encode_messages(msgs, "thinking") == f"{BOS}Be brief.{USER}Hi there{ASSISTANT}{THINK_START}"
    # no system message: BOS then the user turn directly
    assert encode_messages(msgs[1:], "chat") == f"{BOS}{USER}Hi there{ASSISTANT}{THINK_END}"


def test_multi_turn_without_tools_drops_earlier_reasoning_only():
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
        {"role": "user", "content": "q3"},
    ]
    want = (f"{BOS}{USER}q1{ASSISTANT}{THINK_END}a1{EOS}{USER}q2{ASSISTANT}{THINK_END}a2{EOS}"
            f"{USER}q3{ASSISTANT}{THINK_START}")
    assert encode_messages(msgs, "thinking") == want
    kept = encode_messages(msgs, "thinking", drop_thinking=False)
    assert f"{ASSISTANT}{THINK_START}r1{THINK_END}a1{EOS}" in kept
    assert f"{ASSISTANT}{THINK_START}r2{THINK_END}a2{EOS}" in kept
    # chat mode never shows reasoning
    assert "r1" not in encode_messages(msgs, "chat") and "r2" not in encode_messages(msgs, "chat")


def test_tool_results_join_next_user_turn_in_call_order():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"y": "s"}'}}]
    msgs = [
        {"role": "user", "content": "do both"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c2", "content": "G"},   # answered out of order
        {"role": "tool", "tool_call_id": "c1", "content": "F"},
        {"role": "user", "content": "thanks"},
    ]
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("f", "g")]
    p = encode_messages(msgs, "chat", tools=tools)
    assert p.endswith(f"{EOS}{USER}<tool_result>F</tool_result>\n\n<tool_result>G</tool_result>\n\nthanks"
                      f"{ASSISTANT}{THINK_END}")
    assert p.count(USER) == 2
    # the tools land in a system block right after BOS, one schema per line
    assert p.startswith(BOS + "## Tools\n\n")
    assert '{"name": "f", "parameters": {"type": "object"}}\n{"name": "g"' in p


def test_reasoning_effort_max_prefix_only_in_thinking_mode():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert encode_messages(msgs, "thinking", reasoning_effort="max") == \
        f"{BOS}{EFFORT_MAX_PREFIX}S{USER}U{ASSISTANT}{THINK_START}"
    assert encode_messages(msgs, "thinking", reasoning_effort="high") == encode_messages(msgs, "thinking")
    assert encode_messages(msgs, "chat", reasoning_effort="max") == encode_messages(msgs, "chat")


def test_tool_call_rendering_and_parsing_round_trip_of_parameter_types():
    args = {"city": "Paris", "days": 3, "ratio": 0.5, "metric": True, "tags": ["a", "b"],
            "opts": {"k": None}, "empty": ""}
    calls = [{"type": "function", "function": {"name": "forecast", "arguments": json.dumps(args)}},
             {"type": "function", "function": {"name": "now", "arguments": "{}"}}]
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "On it.", "tool_calls": calls}]
    prompt = encode_messages(msgs, "chat")
    assert f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>' in prompt
    assert f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>' in prompt
    completion = prompt.split(f"{ASSISTANT}{THINK_END}", 1)[1]
    m = parse_message_from_completion_text(completion, "chat")
    assert m["content"] == "On it."
    assert [c["name"] for c in m["tool_calls"]] == ["forecast", "now"]
    assert json.loads(m["tool_calls"][0]["arguments"]) == args
    assert json.loads(m["tool_calls"][1]["arguments"]) == {}


def test_parse_tolerates_truncated_output():
    # reasoning cut off before </think>
    m = parse_message_from_completion_text("still thinking about", "thinking")
    assert (m["reasoning_content"], m["content"], m["tool_calls"]) == ("still thinking about", "", [])
    # no EOS at the end of an answer
    m = parse_message_from_completion_text("r</think>partial answ", "thinking")
    assert (m["reasoning_content"], m["content"]) == ("r", "partial answ")
    # a tool-call block cut inside the second parameter: the first parameter survives
    text = (f'x\n\n<{DSML}tool_calls>\n<{DSML}invoke name="f">\n'
            f'<{DSML}parameter name="a" string="false">[1, 2]</{DSML}parameter>\n'
            f'<{DSML}parameter name="b" string="true">hal')
    m = parse_message_from_completion_text(text, "chat")
    assert m["content"] == "x"
    assert m["tool_calls"][0]["name"] == "f"
    assert json.loads(m["tool_calls"][0]["arguments"])["a"] == [1, 2]
    # garbage never raises
    for junk in ["", THINK_END, f"<{DSML}tool_calls>", f'<{DSML}invoke name="', EOS * 3]:
        parse_message_from_completion_text(junk, "chat")
        parse_message_from_completion_text(junk, "thinking")


def test_task_tokens_and_developer_and_reminder():
    msgs = [{"role": "latest_reminder", "content": "2026-01-01"},
            {"role": "developer", "content": "dev says"},
            {"role": "user", "content": "search?", "task": "action"}]
    assert encode_messages(msgs, "thinking") == \
        f"{BOS}<｜latest_reminder｜>2026-01-01{USER}dev says{USER}search?{ASSISTANT}{THINK_START}<｜action｜>"
    msgs = [{"role": "user", "content": "q", "task": "query"}, {"role": "assistant", "content": "terms"}]
    assert encode_messages(msgs, "chat") == f"{BOS}{USER}q<｜query｜>terms{EOS}"


@pytest.mark.parametrize("bad", [
    [], [{"role": "wizard", "content": "x"}], [{"content": "no role"}], ["not a dict"],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
    [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
])
def test_invalid_conversations_raise_encoding_error(bad):
    with pytest.raises(EncodingError):
        encode_messages(bad, "chat")


def test_invalid_modes_raise():
    with pytest.raises(EncodingError):
        encode_messages([{"role": "user", "content": "x"}], "fast")
    with pytest.raises(EncodingError):
        encode_messages([{"role": "user", "content": "x"}], "thinking", reasoning_effort="extreme")
