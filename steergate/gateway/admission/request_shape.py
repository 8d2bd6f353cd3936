"""The shape of what a body asks of vLLM (chat ``messages``, the Responses API's ``input``
items, ``tools``, a completion's ``prompt``, and every other list or object), checked in
full before vLLM sees it.

vLLM validates these fields against unions of many OpenAI types, and a value that fits
none of them yields an error per member, per nested field, per element: 20,000 items of
``{"role": "user", "content": 5}`` in one 640 KB ``/v1/responses`` body made 4.6 million
errors, and the engine's API server grew to 19 GB until the kernel killed it: every
tenant's requests failed (found from outside). 100,000 ``null`` in ``stop_token_ids``
(585 KB) are 100,000 errors and seconds of the API server's event loop, every tenant's.
What passes here fits at least one member of vLLM's union where there is one, and
everything else is bounded in count, so that vLLM's validation stays small. Every
refusal is a 400 naming the field.

Pure: no I/O, no vLLM (``tests/gateway/admission/test_request_shape.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from steergate.shared.errors import InvalidField

#: Messages of a chat, or items of a Responses ``input``: far above what a context holds
#: (each message costs template tokens), far below what costs the engine a second.
MAX_MESSAGES = 4096
#: Content parts (and annotations, a chat message's tool calls and tools) over the whole
#: conversation.
MAX_PARTS = 8192
#: Tools one request may declare, and tool calls one message may carry.
MAX_TOOLS = 256
#: List entries and object members in all of a body's other fields, at any depth (a
#: JSON schema, ``logit_bias``, ``allowed_token_ids``, ``stop``, ``tools``' schemas...).
MAX_ENTRIES = 65_536
#: Fields with their own rules (``steering`` and ``capture`` are the gateway's own, and
#: never reach vLLM's validation as sent).
OWN_RULES = ("messages", "input", "prompt", "tokens", "steering", "capture")

#: A chat message's string fields besides ``role`` and ``content``.
MESSAGE_STRINGS = ("name", "tool_call_id", "refusal", "reasoning", "reasoning_content", "task")
INPUT_ROLES = ("user", "assistant", "system", "developer")
#: The Responses input items vLLM serves (``vllm/entrypoints/openai/responses/utils.py``
#: refuses every other type after validating it).
ITEM_TYPES = (
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
)
INPUT_PARTS = ("input_text", "input_image", "input_file")
OUTPUT_PARTS = ("output_text", "refusal")
IMAGE_DETAIL = ("low", "high", "auto")
ITEM_STATUS = ("in_progress", "completed", "incomplete")
#: Responses API fields that need vLLM's response store: one dict per engine process,
#: shared by every tenant and lost on restart (a ``previous_response_id`` could name
#: another tenant's response). ``conversation_id`` + a latch carry a conversation instead.
RESPONSES_UNSUPPORTED = ("previous_response_id", "background")


class _Budget:
    """Counts parts across a conversation (one budget per body)."""

    def __init__(self) -> None:
        self.parts = 0

    def take(self, n: int, param: str) -> None:
        self.parts += n
        if self.parts > MAX_PARTS:
            raise InvalidField(
                param,
                f"'{param}': a conversation has at most {MAX_PARTS} content parts, tool calls "
                "and tools in all",
            )


def check_chat(body: Mapping[str, Any]) -> None:
    """``messages`` (chat completions, tokenize) and ``tools``, when present."""
    messages = body.get("messages")
    if messages is not None:
        _list(messages, "messages", MAX_MESSAGES)  # an empty one: vLLM says why not
        budget = _Budget()
        for i, message in enumerate(messages):
            _chat_message(message, f"messages[{i}]", budget)
    _tools(body.get("tools"))
    _check_entries(body)


def check_completion(body: Mapping[str, Any]) -> None:
    """``prompt`` (completions, tokenize): a string, a list of token ids, a list of
    strings, or a list of lists of token ids; then the rest of the body."""
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        _list(prompt, "prompt")  # vLLM bounds how many prompts, and their lengths
        if prompt and isinstance(prompt[0], list):
            for i, ids in enumerate(prompt):
                _list(ids, f"prompt[{i}]")
                _token_ids(ids, f"prompt[{i}]")
        elif prompt and isinstance(prompt[0], str):
            for i, text in enumerate(prompt):
                _string(text, f"prompt[{i}]")
        else:
            _token_ids(prompt, "prompt")
    _check_entries(body)


def check_detokenize(body: Mapping[str, Any]) -> None:
    """``tokens`` (detokenize): a list of token ids."""
    tokens = body.get("tokens")
    if tokens is not None:
        _list(tokens, "tokens")
        _token_ids(tokens, "tokens")
    _check_entries(body)


def _check_entries(body: Mapping[str, Any]) -> None:
    """Every field without its own rules holds at most ``MAX_ENTRIES`` list entries and
    object members, at any depth (the count stops at the first field past it); then the
    sampling lists vLLM validates element by element are checked in full."""
    _count_entries(body)
    _sampling_lists(body)


def _count_entries(body: Mapping[str, Any]) -> None:
    left = MAX_ENTRIES
    for name, value in body.items():
        if name in OWN_RULES or not isinstance(value, (list, dict)):
            continue
        stack = [value]
        while stack:
            node = stack.pop()
            left -= len(node)
            if left < 0:
                raise InvalidField(
                    name,
                    f"'{name}': a body holds at most {MAX_ENTRIES} list entries and object "
                    "members outside messages, input, prompt and tokens",
                )
            children = node.values() if isinstance(node, dict) else node
            stack.extend(c for c in children if isinstance(c, (list, dict)))


def check_responses(body: Mapping[str, Any]) -> None:
    """The Responses API's ``input``, ``instructions`` and ``tools``; the fields that need
    a response store are refused (the route forces ``store`` off)."""
    for field in RESPONSES_UNSUPPORTED:
        if body.get(field) not in (None, False):
            raise InvalidField(
                field,
                f"'{field}' is not supported by this gateway; send the conversation's "
                "input with each request (and 'conversation_id' to keep its steering)",
                "unsupported_parameter",
            )
    if "input" not in body:
        raise InvalidField("input", "'input' is required: a string or a list of items")
    value = body["input"]
    if not isinstance(value, str):
        _list(value, "input", MAX_MESSAGES)
        budget = _Budget()
        for i, item in enumerate(value):
            _input_item(item, f"input[{i}]", budget)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidField("instructions", "'instructions' must be a string")
    _tools(body.get("tools"))
    _check_entries(body)


def _chat_message(message: Any, at: str, budget: _Budget) -> None:
    _object(message, at)
    if not _string(message.get("role"), f"{at}.role"):  # vLLM takes custom roles ("ipython")
        raise InvalidField(f"{at}.role", f"'{at}.role' must not be empty")
    _optional_strings(message, at, MESSAGE_STRINGS)
    tools = message.get("tools")  # vLLM's custom message: a developer's tools
    if tools is not None:
        _tools(tools, f"{at}.tools")
        budget.take(len(tools), f"{at}.tools")
    calls = message.get("tool_calls")
    if calls is not None:
        _list(calls, f"{at}.tool_calls", MAX_TOOLS)
        budget.take(len(calls), f"{at}.tool_calls")
        for j, call in enumerate(calls):
            _object(call, f"{at}.tool_calls[{j}]")
            for name in ("id", "type"):  # vLLM requires both (4 errors per call without)
                _string(call.get(name), f"{at}.tool_calls[{j}].{name}")
            function = call.get("function")
            _object(function, f"{at}.tool_calls[{j}].function")
            for name in ("name", "arguments"):
                _string(function.get(name), f"{at}.tool_calls[{j}].function.{name}")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    _list(content, f"{at}.content", MAX_PARTS)
    budget.take(len(content), f"{at}.content")
    for j, part in enumerate(content):
        where = f"{at}.content[{j}]"
        _object(part, where)
        kind = _string(part.get("type"), f"{where}.type")
        if kind == "text":
            _string(part.get("text"), f"{where}.text")


def _input_item(item: Any, at: str, budget: _Budget) -> None:
    _object(item, at)
    kind = item.get("type")
    if kind is None and "role" in item:
        kind = "message"
    _one_of(kind, ITEM_TYPES, f"{at}.type")
    if kind == "message":
        _input_message(item, at, budget)
    elif kind in ("function_call", "custom_tool_call"):
        for name in ("call_id", "name", "arguments" if kind == "function_call" else "input"):
            _string(item.get(name), f"{at}.{name}")
        _optional_status(item, at)
    elif kind in ("function_call_output", "custom_tool_call_output"):
        _string(item.get("call_id"), f"{at}.call_id")
        output = item.get("output")
        if not isinstance(output, str):
            _parts(output, f"{at}.output", INPUT_PARTS, budget)
        _optional_status(item, at)
    else:  # reasoning
        _string(item.get("id"), f"{at}.id")
        for name, part_type in (("summary", "summary_text"), ("content", "reasoning_text")):
            parts = item.get(name)
            if parts is None and name == "content":
                continue
            _list(parts, f"{at}.{name}", MAX_PARTS)
            budget.take(len(parts), f"{at}.{name}")
            for j, part in enumerate(parts):
                _object(part, f"{at}.{name}[{j}]")
                _one_of(part.get("type"), (part_type,), f"{at}.{name}[{j}].type")
                _string(part.get("text"), f"{at}.{name}[{j}].text")
        encrypted = item.get("encrypted_content")
        if encrypted is not None:  # vLLM refuses it; said here, before any work
            raise InvalidField(
                f"{at}.encrypted_content", f"'{at}.encrypted_content' is not supported"
            )


def _input_message(item: Mapping[str, Any], at: str, budget: _Budget) -> None:
    role = _one_of(item.get("role"), INPUT_ROLES, f"{at}.role")
    content = item.get("content")
    if isinstance(content, str):
        return
    _list(content, f"{at}.content", MAX_PARTS)
    output = any(isinstance(p, Mapping) and p.get("type") in OUTPUT_PARTS for p in content)
    if not output:  # an input message: user, system, developer or assistant text
        _parts(content, f"{at}.content", INPUT_PARTS, budget)
        return
    # An earlier answer's output message, as the API returned it: every field it has.
    if role != "assistant":
        raise InvalidField(f"{at}.role", f"'{at}.role' must be 'assistant' for output content")
    _string(item.get("id"), f"{at}.id")
    _one_of(item.get("status"), ITEM_STATUS, f"{at}.status")
    _parts(content, f"{at}.content", OUTPUT_PARTS, budget)


def _parts(value: Any, at: str, kinds: tuple[str, ...], budget: _Budget) -> None:
    _list(value, at, MAX_PARTS)
    budget.take(len(value), at)
    for j, part in enumerate(value):
        where = f"{at}[{j}]"
        _object(part, where)
        kind = _one_of(part.get("type"), kinds, f"{where}.type")
        if kind in ("input_text", "output_text"):
            _string(part.get("text"), f"{where}.text")
        elif kind == "refusal":
            _string(part.get("refusal"), f"{where}.refusal")
        elif kind == "input_image":
            detail = part.get("detail")
            if detail is not None:
                _one_of(detail, IMAGE_DETAIL, f"{where}.detail")
            _optional_strings(part, where, ("image_url", "file_id"))
        elif kind == "input_file":
            _optional_strings(part, where, ("file_id", "file_data", "file_url", "filename"))
        if kind == "output_text":
            annotations = part.get("annotations")
            _list(annotations, f"{where}.annotations", MAX_PARTS)
            budget.take(len(annotations), f"{where}.annotations")
            for k, note in enumerate(annotations):
                _object(note, f"{where}.annotations[{k}]")
                _string(note.get("type"), f"{where}.annotations[{k}].type")


def _tools(tools: Any, at: str = "tools") -> None:
    if tools is None:
        return
    _list(tools, at, MAX_TOOLS)
    for i, tool in enumerate(tools):
        _object(tool, f"{at}[{i}]")
        _string(tool.get("type"), f"{at}[{i}].type")


def _optional_status(item: Mapping[str, Any], at: str) -> None:
    if item.get("status") is not None:
        _one_of(item["status"], ITEM_STATUS, f"{at}.status")


def _optional_strings(part: Mapping[str, Any], at: str, names: tuple[str, ...]) -> None:
    for name in names:
        if part.get(name) is not None:
            _string(part[name], f"{at}.{name}")


def _list(value: Any, at: str, most: int | None = None) -> None:
    if not isinstance(value, list):
        raise InvalidField(at, f"'{at}' must be a list")
    if most is not None and len(value) > most:
        raise InvalidField(at, f"'{at}' has {len(value)} entries; at most {most}")


def _sampling_lists(body: Mapping[str, Any]) -> None:
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        _list(stop, "stop")
        for i, text in enumerate(stop):
            _string(text, f"stop[{i}]")
    for name in ("stop_token_ids", "allowed_token_ids"):
        if body.get(name) is not None:
            _list(body[name], name)
            _token_ids(body[name], name)
    if body.get("bad_words") is not None:
        _list(body["bad_words"], "bad_words")
        for i, text in enumerate(body["bad_words"]):
            _string(text, f"bad_words[{i}]")
    bias = body.get("logit_bias")
    if bias is not None:
        _object(bias, "logit_bias")
        for token, value in bias.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise InvalidField(
                    f"logit_bias.{token[:32]}", "'logit_bias' maps token ids to numbers"
                )


def _token_ids(ids: list[Any], at: str) -> None:
    if all(type(t) is int for t in ids) and min(ids, default=0) >= 0:
        return  # the common case, at C speed (a long prompt is on the event loop)
    for i, token in enumerate(ids):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise InvalidField(f"{at}[{i}]", f"'{at}[{i}]' must be a token id (an integer >= 0)")


def _object(value: Any, at: str) -> None:
    if not isinstance(value, dict):
        raise InvalidField(at, f"'{at}' must be an object")


def _string(value: Any, at: str) -> str:
    if not isinstance(value, str):
        raise InvalidField(at, f"'{at}' must be a string")
    return value


def _one_of(value: Any, allowed: tuple[str, ...], at: str) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise InvalidField(at, f"'{at}' must be one of {', '.join(allowed)}")
    return value
