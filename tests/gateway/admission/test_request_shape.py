"""What a body asks of vLLM is checked in full before vLLM's union validation sees it
(chat ``messages``, Responses ``input`` items, ``tools``, ``prompt``, detokenize
``tokens``) and every other field is bounded in entries: what passes here, vLLM's own
request models accept (they are the oracle), and what does not is a 400 naming the
field. Found from outside: 20,000 items of ``{"role": "user", "content": 5}`` in one
640 KB ``/v1/responses`` body made vLLM build 4.6 million validation errors, and the
engine's API server was killed at 19 GB (every tenant's requests then failed)."""

from __future__ import annotations

from typing import Any

import pytest

from steergate.gateway.admission import request_shape as shape
from steergate.shared.errors import InvalidField

#: What the OpenAI SDK sends, and what the API returns and clients send back.
GOOD_INPUTS: list[Any] = [
    "Describe the sea.",
    [{"role": "user", "content": "hi"}],
    [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "x"}]}],
    [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
        {"type": "input_image", "file_id": "file_1"},
        {"type": "input_file", "file_id": "file_2", "filename": "a.pdf"},
    ]}],
    [{"role": "assistant", "content": "an earlier answer"}],
    [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
      "content": [{"type": "output_text", "text": "an answer", "annotations": []},
                  {"type": "refusal", "refusal": "no"}]}],
    [{"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
     {"type": "function_call_output", "call_id": "c1", "output": "42"},
     {"type": "function_call_output", "call_id": "c1",
      "output": [{"type": "input_text", "text": "42"}]}],
    [{"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "t"}]},
     {"type": "reasoning", "id": "rs_2", "summary": [],
      "content": [{"type": "reasoning_text", "text": "t"}]}],
    [{"type": "custom_tool_call", "call_id": "c2", "name": "sh", "input": "ls"},
     {"type": "custom_tool_call_output", "call_id": "c2", "output": "a b"}],
]  # fmt: skip

BAD_INPUTS: list[tuple[Any, str]] = [
    (5, "input"),
    (None, "input"),
    ({"role": "user"}, "input"),
    ([5], "input[0]"),
    ([{"role": "user", "content": 5}] * 20_000, "input"),  # the attack: too many
    ([{"role": "user", "content": 5}] * 4, "input[0].content"),  # the attack's item
    ([{"role": "robot", "content": "x"}], "input[0].role"),
    ([{"type": "web_search_call", "id": "w"}], "input[0].type"),
    ([{"role": "user", "content": [{"type": "input_text"}]}], "input[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "input_text", "text": "x"}] * 9000}],
     "input[0].content"),
    ([{"role": "user", "content": [{"type": "input_image", "detail": "max"}]}],
     "input[0].content[0].detail"),
    ([{"role": "user", "content": [{"type": "output_text", "text": "x", "annotations": []}]}],
     "input[0].role"),
    ([{"role": "assistant", "content": [{"type": "output_text", "text": "x"}]}], "input[0].id"),
    ([{"id": "m", "type": "message", "role": "assistant", "status": "done",
       "content": [{"type": "output_text", "text": "x", "annotations": []}]}], "input[0].status"),
    ([{"id": "m", "type": "message", "role": "assistant", "status": "completed",
       "content": [{"type": "output_text", "text": "x"}]}], "input[0].content[0].annotations"),
    ([{"type": "function_call", "call_id": "c", "name": "f"}], "input[0].arguments"),
    ([{"type": "function_call_output", "call_id": "c", "output": 5}], "input[0].output"),
    ([{"type": "reasoning", "id": "r"}], "input[0].summary"),
    ([{"type": "reasoning", "id": "r", "summary": [], "encrypted_content": "x"}],
     "input[0].encrypted_content"),
]  # fmt: skip


def test_responses_needs_input_and_a_string_instructions() -> None:
    for body, param in (({}, "input"), ({"input": "x", "instructions": 5}, "instructions")):
        with pytest.raises(InvalidField) as refused:
            shape.check_responses(body)
        assert refused.value.param == param


GOOD_CHATS: list[Any] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "42"}],
    [{"role": "ipython", "content": "a custom role vLLM takes"}],
    [{"role": "developer", "content": "use these", "task": "t",
      "tools": [{"type": "function", "function": {"name": "f"}}]}],
]  # fmt: skip

BAD_CHATS: list[tuple[Any, str]] = [
    ("hi", "messages"),
    ([{"role": 5}] * 760_000, "messages"),  # an 8 MiB body of them
    ([{"role": 5}], "messages[0].role"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": ""}], "messages[0].role"),
    ([7], "messages[0]"),
    ([{"role": "user", "content": 5}] , "messages[0].content"),
    ([{"role": "user", "content": [{"type": 5}] * 3}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": "x", "name": 5}] * 4096, "messages[0].name"),  # 57,344
    ([{"role": "user", "content": [{"type": "text", "text": "x"}] * 5000}] * 2,
     "messages[1].content"),
    ([{"role": "tool", "content": "x", "task": 5}] * 4096, "messages[0].task"),  # 40,960
    ([{"role": "tool", "content": "x", "tools": 5}] * 4096, "messages[0].tools"),  # 40,960
    ([{"role": "developer", "tools": [{"function": {}}]}], "messages[0].tools[0].type"),
    ([{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}] * 256}] * 40,
     "messages[32].tool_calls"),  # 10,240 calls in all
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{}"}}] * 256}] * 32, "messages[0].tool_calls[0].id"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": "{}"}}]}], "messages[0].tool_calls[0].type"),
]  # fmt: skip


#: Each conversation field: the check that guards it, and vLLM's request model (module,
#: class) that is the oracle for what passes.
CONVERSATIONS = {
    "input": (shape.check_responses, "responses.protocol", "ResponsesRequest"),
    "messages": (shape.check_chat, "chat_completion.protocol", "ChatCompletionRequest"),
}
GOOD = [("input", v) for v in GOOD_INPUTS] + [("messages", v) for v in GOOD_CHATS]
BAD = [("input", *case) for case in BAD_INPUTS] + [("messages", *case) for case in BAD_CHATS]


@pytest.mark.parametrize(("field", "value"), GOOD)
def test_a_conversation_that_passes_is_one_vllm_accepts(field: str, value: Any) -> None:
    check, module, model = CONVERSATIONS[field]
    check({field: value})
    protocol = pytest.importorskip(f"vllm.entrypoints.openai.{module}")
    getattr(protocol, model).model_validate({field: value})


@pytest.mark.parametrize(("field", "value", "param"), BAD)
def test_a_bad_conversation_is_refused_naming_the_field(field: str, value: Any, param: str) -> None:
    check, _, _ = CONVERSATIONS[field]
    with pytest.raises(InvalidField) as refused:
        check({field: value})
    assert refused.value.param == param
    assert refused.value.message.startswith(f"'{param}'"), refused.value.message


def test_responses_fields_that_need_a_response_store_are_refused() -> None:
    """vLLM keeps stored responses in one dict per engine process, shared by every tenant:
    a ``previous_response_id`` could name another tenant's response."""
    for field, value in (("previous_response_id", "resp_1"), ("background", True)):
        with pytest.raises(InvalidField) as refused:
            shape.check_responses({"input": "hi", field: value})
        assert (refused.value.param, refused.value.code) == (field, "unsupported_parameter")
    shape.check_responses({"input": "hi", "previous_response_id": None, "background": False})


def test_tools_are_objects_with_a_type_and_bounded() -> None:
    shape.check_chat({"tools": [{"type": "function", "function": {"name": "f"}}]})
    for tools, param in (({"type": "function"}, "tools"), ([5], "tools[0]"),
                         ([{"function": {}}], "tools[0].type"),
                         ([{"type": "function"}] * 300, "tools")):  # fmt: skip
        with pytest.raises(InvalidField) as refused:
            shape.check_responses({"input": "x", "tools": tools})
        assert refused.value.param == param


@pytest.mark.parametrize("prompt", ["x", [1, 2], ["a", "b"], [[1, 2], [3]], []])
def test_a_prompt_that_passes_is_one_vllm_accepts(prompt: Any) -> None:
    shape.check_completion({"prompt": prompt})
    if prompt == []:
        return  # vLLM says why it is not a prompt
    protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    protocol.CompletionRequest.model_validate({"prompt": prompt})


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        (5, "prompt"),
        ([None] * 3, "prompt[0]"),
        ([[None] * 100_000], "prompt[0][0]"),  # 100,003 errors in vLLM, 585 KB
        (["a", 1], "prompt[1]"),
        ([1, "a"], "prompt[1]"),
        ([True], "prompt[0]"),
        ([-1], "prompt[0]"),
        ([[1], 2], "prompt[1]"),
    ],
)
def test_a_bad_prompt_is_refused_naming_the_element(prompt: Any, param: str) -> None:
    with pytest.raises(InvalidField) as refused:
        shape.check_completion({"prompt": prompt})
    assert refused.value.param == param


def test_every_other_field_is_bounded_in_entries_at_any_depth() -> None:
    """Past 65,536 entries a field is refused whatever its values (a field vLLM checks
    element by element costs an error per bad one); a schema or ``logit_bias`` of
    ordinary size passes."""
    fine = {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1000)},
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                "type": "object", "properties": {f"p{i}": {"type": "string"}
                                                 for i in range(500)}}}}}  # fmt: skip
    shape.check_completion(fine)
    for body, param in (
        ({"stop_token_ids": [1] * 100_000}, "stop_token_ids"),
        ({"logit_bias": {str(i): 1 for i in range(70_000)}}, "logit_bias"),
        ({"structured_outputs": {"choice": [None] * 70_000}}, "structured_outputs"),
        ({"a": [1] * 40_000, "b": [[1] * 30_000]}, "b"),  # counted over the whole body
    ):
        for check in (shape.check_completion, shape.check_chat):
            with pytest.raises(InvalidField) as refused:
                check({"prompt": "x", **body} if check is shape.check_completion else body)
            assert refused.value.param == param
        with pytest.raises(InvalidField):
            shape.check_responses({"input": "x", **body})


def test_the_sampling_lists_vllm_checks_per_element_are_checked_in_full() -> None:
    """Each of these, 100,000 long, was 100,000 vLLM errors (1.6 s to 2.8 s of its
    validation alone): refused at the first bad element, while a good one passes and is
    one vLLM accepts."""
    good = {"prompt": "x", "stop": ["a", "b"], "stop_token_ids": [1, 2],
            "allowed_token_ids": [3], "bad_words": ["c"], "logit_bias": {"5": -1.5, "6": 2}}
    shape.check_completion(good)
    protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    protocol.CompletionRequest.model_validate(good)
    for field, value, param in (
        ("stop", ["a", None], "stop[1]"),
        ("stop", 5, "stop"),
        ("stop_token_ids", [1, None], "stop_token_ids[1]"),
        ("allowed_token_ids", ["1"], "allowed_token_ids[0]"),
        ("bad_words", ["c", None], "bad_words[1]"),
        ("logit_bias", {"5": None}, "logit_bias.5"),
        ("logit_bias", [1], "logit_bias"),
    ):
        with pytest.raises(InvalidField) as refused:
            shape.check_chat({field: value})
        assert refused.value.param == param, field


def test_tool_calls_and_detokenize_tokens_are_checked() -> None:
    bad_call = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": 5, "arguments": "{}"}}]}  # fmt: skip
    with pytest.raises(InvalidField) as refused:
        shape.check_chat({"messages": [bad_call]})
    assert refused.value.param == "messages[0].tool_calls[0].function.name"
    with pytest.raises(InvalidField) as refused:
        shape.check_detokenize({"tokens": [1, None]})
    assert refused.value.param == "tokens[1]"
    shape.check_detokenize({"tokens": [1, 2]})
