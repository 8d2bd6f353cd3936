"""What keeps a steered answer exact on vLLM's request paths (pure; used by rewrite.py).

* :func:`refuse_inexact`: request shapes vLLM would serve without the steering, or
  with a prefix cache that could hand one prompt's steered KV to another, get a 400
  naming the field instead.
* :func:`prompt_key`: a digest of everything in a request that can shape its prompt
  tokens; the cache salt of ``prefill``/``decode`` steering includes it.

Why the prompt key: vLLM caches full KV blocks of generated tokens too, and a later
request whose prompt is an earlier prompt plus its answer (any continuation; a
bridged latch turn is exactly that) would reuse blocks computed as generated
positions as if they were prompt positions. Under ``prefill`` or ``decode`` steering
the same position is steered in one role and not in the other, so that KV is wrong.
With the prompt in the salt, requests can only share blocks with requests of the
same prompt, whose prompt/generated split is the same at every position a cache hit
can cover (hits only cover whole blocks of the new request's prompt). ``all``
steers every position alike, so it keeps one salt per steering and shares across
turns. See docs/steering-op.md, "Prefix-cache isolation".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from steergate.shared.errors import InvalidField

# Request fields that only change sampling or the shape of the response, never the
# prompt's tokens. Every other field (messages, prompt, prompt_embeds, chat_template*,
# tools, add_generation_prompt, truncate_prompt_tokens, ...) is part of the key, so
# a field this list does not know errs on the side of not sharing.
NOT_PROMPT_FIELDS = frozenset({
    "cache_salt", "vllm_xargs", "stream", "stream_options", "n", "best_of",
    "max_tokens", "max_completion_tokens", "min_tokens", "ignore_eos",
    "temperature", "top_p", "top_k", "min_p", "seed", "logit_bias",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty",
    "stop", "stop_token_ids", "include_stop_str_in_output",
    "logprobs", "top_logprobs", "prompt_logprobs", "return_tokens_as_token_ids",
    "return_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
    "echo", "user", "request_id", "priority",
})
_FALSE_STRINGS = frozenset({"false", "0", "no", "off", "f", "n"})


def prompt_key(request: Mapping[str, Any]) -> str:
    shaping = {k: v for k, v in request.items() if k not in NOT_PROMPT_FIELDS}
    text = json.dumps(shaping, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # surrogatepass: json.loads accepts a lone surrogate ("\ud800"), which UTF-8 cannot
    # encode; the key must still be a key, not a 500.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def refuse_inexact(request: Mapping[str, Any], phase: str) -> None:
    """Raise a 400 naming the field if vLLM cannot serve this steered request exactly."""
    if _truthy(request.get("use_beam_search")):
        # vLLM's beam search re-submits each step as a new request with fresh
        # SamplingParams (no extra_args) but the same cache_salt: the answer would be
        # unsteered while reported as steered, and its KV cached under the steered salt.
        raise InvalidField(
            "use_beam_search",
            "'use_beam_search' cannot be combined with steering (vLLM's beam search drops "
            "the steering); send the request without steering or without beam search",
        )
    if phase != "all":
        for field in ("prompt", "prompt_embeds"):
            if _several(request.get(field)):
                # All prompts of one request share its cache salt; one could continue
                # another across a block boundary (see the module doc).
                raise InvalidField(
                    field,
                    f"steering with {_selection(phase)} takes one prompt per request; "
                    f"send the prompts as separate requests, or steer every token "
                    f"(phase 'all')",
                )


def _truthy(value: Any) -> bool:
    """Whether vLLM's (pydantic, lax) bool would read ``value`` as true; anything it
    would not accept as false counts as true here (the request is refused either way)."""
    if value is None or value is False:
        return False
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value != 0
    if isinstance(value, str):
        return value.strip().lower() not in _FALSE_STRINGS
    return True


def _several(value: Any) -> bool:
    """A list of more than one prompt (a list of token ids is one prompt)."""
    return (
        isinstance(value, list)
        and len(value) > 1
        and not all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    )


def _selection(phase: str) -> str:
    """How the client wrote the selection: a phase, or steering.tokens."""
    return "steering.tokens" if phase.startswith("tokens:") else f"phase '{phase}'"
