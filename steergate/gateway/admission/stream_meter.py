"""What a relayed stream generated, for the streams that end without the engine's
final ``usage`` chunk: the client disconnected, or the engine broke mid-stream.

Such a stream used to keep its reservation as the charge (prompt estimate + 256
without ``max_tokens``), so a client could read 1,500 tokens, hang up before the
usage chunk, and be charged 257. Now it is charged the prompt plus what the relay saw
generated:

* exact, where the engine reports usage on every chunk (vLLM's
  ``stream_options.continuous_usage_stats``: per choice, completion tokens so far).
  The gateway asks for it on every chat and completions stream (and removes it from
  the chunks of a client that did not ask), so these are exact;
* else exact where a chunk carries per-token logprobs;
* else (the Responses API's text deltas, an engine that ignores the option) estimated
  per choice from its text at the prompt estimate's rate (one token per 4 characters
  of the whole text, not of each chunk: rounding each chunk up charged 1.5 times what
  was generated, found from outside), and never less than one token per chunk with
  content. Counting chunks alone is not enough: an engine started with
  ``--stream-interval`` N puts up to N tokens in each chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from steergate.gateway.admission.limits import estimate_tokens, text_tokens

_TEXT_FIELDS = ("content", "reasoning", "reasoning_content", "refusal")


class StreamMeter:
    __slots__ = ("chars", "final", "generated", "pieces", "prompt")

    def __init__(self) -> None:
        self.final = -1  # total_tokens of the engine's final usage chunk, once seen
        self.prompt = -1  # prompt tokens reported by per-chunk usage, if any
        # choice index -> completion tokens so far, counted (usage, logprobs) ...
        self.generated: dict[int, int] = {}
        # ... and the text of the chunks that carried neither: characters, chunks
        self.chars: dict[int, int] = {}
        self.pieces: dict[int, int] = {}

    def _text(self, i: int, chars: int) -> None:
        if chars:
            self.chars[i] = self.chars.get(i, 0) + chars
            self.pieces[i] = self.pieces.get(i, 0) + 1

    def observe(self, doc: Any) -> None:
        """Account one parsed SSE ``data:`` document."""
        if not isinstance(doc, dict):
            return
        kind = doc.get("type")
        if isinstance(kind, str) and kind.startswith("response."):
            self._observe_response_event(kind, doc)
            return
        choices = doc.get("choices")
        usage = doc.get("usage")
        usage = usage if isinstance(usage, dict) else None
        if not choices:
            if usage is not None and _int(usage.get("total_tokens")) >= 0:
                self.final = _int(usage["total_tokens"])
                self.prompt = max(self.prompt, _int(usage.get("prompt_tokens")))
            return
        if not isinstance(choices, list):
            return
        if usage is not None and len(choices) == 1 and isinstance(choices[0], dict):
            # continuous_usage_stats: this choice's completion tokens so far (exact).
            i = _index(choices[0])
            completion = _int(usage.get("completion_tokens"))
            if completion >= 0:
                self.generated[i] = max(completion, self.generated.get(i, 0))
                self.chars.pop(i, None)
                self.pieces.pop(i, None)
                self.prompt = max(self.prompt, _int(usage.get("prompt_tokens")))
                return
        for choice in choices:
            if isinstance(choice, dict):
                i = _index(choice)
                listed = _listed_tokens(choice)
                if listed:
                    self.generated[i] = self.generated.get(i, 0) + listed
                else:
                    self._text(i, _chars_in(choice))

    def _observe_response_event(self, kind: str, doc: dict[str, Any]) -> None:
        """The Responses API: text deltas while it runs, the usage in its last event."""
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            response = doc.get("response")
            usage = response.get("usage") if isinstance(response, dict) else None
            if isinstance(usage, dict) and _int(usage.get("total_tokens")) >= 0:
                self.final = _int(usage["total_tokens"])
                self.prompt = max(self.prompt, _int(usage.get("input_tokens")))
        elif kind.endswith(".delta") and isinstance(doc.get("delta"), str):
            self._text(max(0, _int(doc.get("output_index"))), len(doc["delta"]))

    def tokens(self, prompt_estimate: Callable[[], int]) -> int:
        """The charge: the engine's final usage if it came, else prompt + generated."""
        return self.split(prompt_estimate)[0]

    def split(self, prompt_estimate: Callable[[], int]) -> tuple[int, int]:
        """(the charge, its prompt part)."""
        if self.final >= 0:
            return self.final, min(self.final, self.prompt) if self.prompt >= 0 else -1
        prompt = self.prompt if self.prompt >= 0 else prompt_estimate()
        estimated = sum(
            max(self.pieces[i], text_tokens(chars))
            for i, chars in self.chars.items()
        )
        return prompt + sum(self.generated.values()) + estimated, prompt


def prompt_estimate(content: bytes) -> int:
    """The prompt part of the admission estimate, from the forwarded body."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return 0
    if not isinstance(body, dict):
        return 0
    return estimate_tokens(
        {**body, "max_tokens": 0, "max_completion_tokens": 0, "max_output_tokens": 0}
    )


def _listed_tokens(choice: dict[str, Any]) -> int:
    """The tokens a chunk's per-token logprobs list (0 without them)."""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        listed = logprobs.get("content")  # chat: one entry per token
        if not isinstance(listed, list):
            listed = logprobs.get("tokens")  # completions
        if isinstance(listed, list):
            return len(listed)
    return 0


def _chars_in(choice: dict[str, Any]) -> int:
    """The characters of generated text a chunk carries."""
    chars = 0
    delta = choice.get("delta")
    if isinstance(delta, dict):
        for field in _TEXT_FIELDS:
            value = delta.get(field)
            if isinstance(value, str):
                chars += len(value)
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            function = call.get("function") if isinstance(call, dict) else None
            for value in function.values() if isinstance(function, dict) else []:
                if isinstance(value, str):  # name, arguments
                    chars += len(value)
    text = choice.get("text")
    if isinstance(text, str):
        chars += len(text)
    return chars


def _index(choice: dict[str, Any]) -> int:
    return max(0, _int(choice.get("index")))


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1
