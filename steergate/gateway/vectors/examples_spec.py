"""The ``from-examples`` request body, validated in full before any work (admission,
tokenisation, capture). Pure: no FastAPI, no Redis.

``{"hook", "layers": [int, ...] | "all", "positive": [example, ...], "negative":
[example, ...], "method", "position", "normalize", "description"}``, where an example
is a text (a raw prompt) or a messages list (``[{"role", "content"}, ...]``, chat-
templated by the engine). Every fault is a 400 naming the field (``positive[3]``,
``negative[0][1].content``, ``layers[2]``); limits are module constants, listed in
docs/api.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from steergate.gateway.admission.limits import template_tokens, text_tokens
from steergate.gateway.vectors.contrast import METHODS, MIN_PER_SIDE
from steergate.shared.errors import InvalidField, reject_unknown
from steergate.shared.steering import HOOKS, ModelShape

FIELDS = frozenset(
    {"hook", "layers", "positive", "negative", "method", "position", "normalize", "description"}
)
POSITIONS = ("mean", "last")
ROLES = ("system", "user", "assistant")
#: Examples per side: enough for a stable mean; past it a caller wants an offline tool.
MAX_PER_SIDE = 256
#: Characters in one example (all of a messages list's contents together).
MAX_EXAMPLE_CHARS = 8_000
#: Characters over all examples: about 100,000 tokens, the most one request may cost.
MAX_TOTAL_CHARS = 400_000
#: Messages in one example.
MAX_MESSAGES = 32
MAX_DESCRIPTION = 1024

Example = str | list[dict[str, str]]


@dataclass(frozen=True)
class ExamplesSpec:
    hook: str
    layers: tuple[int, ...]
    positive: tuple[Example, ...]
    negative: tuple[Example, ...]
    method: str = "mean_difference"
    position: str = "mean"
    normalize: bool = False
    description: str | None = None

    @property
    def chars(self) -> int:
        return sum(_chars(e) for e in (*self.positive, *self.negative))

    def activation_bytes(self, hidden_size: int) -> int:
        """What the job holds in the gateway once captured: one float32 row per
        example and layer."""
        return 4 * hidden_size * len(self.layers) * (len(self.positive) + len(self.negative))

    @property
    def token_estimate(self) -> int:
        """What admission reserves: the prompts (the gateway's usual estimate), what a
        chat template adds to each messages example (``template_tokens``), plus the one
        token each capture request generates per example. Settlement then charges what
        the engine counted."""
        examples = (*self.positive, *self.negative)
        templated = [e for e in examples if not isinstance(e, str)]
        return (
            text_tokens(self.chars)
            + sum(template_tokens(len(e)) for e in templated)
            + len(examples)
        )


def parse_examples_body(body: dict[str, Any], shape: ModelShape) -> ExamplesSpec:
    reject_unknown(body, FIELDS)
    hook = body.get("hook", "post_block")
    if hook not in HOOKS:
        raise InvalidField("hook", f"'hook' must be one of {', '.join(HOOKS)}")
    method = body.get("method", "mean_difference")
    if method not in METHODS:
        raise InvalidField("method", f"'method' must be one of {', '.join(METHODS)}")
    position = body.get("position", "mean")
    if position not in POSITIONS:
        raise InvalidField("position", f"'position' must be one of {', '.join(POSITIONS)}")
    normalize = body.get("normalize", False)
    if not isinstance(normalize, bool):
        raise InvalidField("normalize", "'normalize' must be true or false")
    description = body.get("description")
    if description is not None and (
        not isinstance(description, str) or len(description) > MAX_DESCRIPTION
    ):
        raise InvalidField(
            "description", f"'description' must be a string of at most {MAX_DESCRIPTION} characters"
        )
    layers = _layers(body.get("layers", "all"), shape)
    positive = _examples(body.get("positive"), "positive")
    negative = _examples(body.get("negative"), "negative")
    if method == "pca" and len(positive) != len(negative):
        raise InvalidField(
            "negative",
            f"'pca' pairs positive[i] with negative[i]: the lists must be the same length "
            f"(got {len(positive)} and {len(negative)})",
        )
    if sorted(map(_identity, positive)) == sorted(map(_identity, negative)):
        # Then mean(positive) == mean(negative) at every layer (and pca's class-mean gap
        # is 0): the vector would be all zeros, stored with 201 and steering nothing.
        raise InvalidField(
            "negative",
            "'positive' and 'negative' hold the same examples: their difference is zero at "
            "every layer, so there is no direction to make a vector from",
            code="examples_indistinguishable",
        )
    spec = ExamplesSpec(hook, layers, positive, negative, method, position, normalize, description)
    if spec.chars > MAX_TOTAL_CHARS:
        # Named: the side holding more of them (the one to shorten).
        pos = sum(_chars(e) for e in positive)
        side = "positive" if pos >= spec.chars - pos else "negative"
        raise InvalidField(
            side,
            f"the examples hold {spec.chars} characters; at most {MAX_TOTAL_CHARS} in all",
            code="examples_too_large",
        )
    return spec


def _layers(value: Any, shape: ModelShape) -> tuple[int, ...]:
    if value == "all":
        return tuple(range(shape.num_layers))
    if not isinstance(value, list) or not value:
        raise InvalidField("layers", "'layers' must be \"all\" or a non-empty array of layers")
    if len(value) > shape.num_layers:
        raise InvalidField(
            "layers", f"'layers' has more entries than the model's {shape.num_layers} layers"
        )
    seen: set[int] = set()
    for i, layer in enumerate(value):
        p = f"layers[{i}]"
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise InvalidField(p, f"'{p}' must be an integer")
        if not 0 <= layer < shape.num_layers:
            raise InvalidField(
                p, f"'{p}' is {layer}; the model's layers are 0..{shape.num_layers - 1}"
            )
        if layer in seen:
            raise InvalidField(p, f"'{p}' repeats layer {layer}")
        seen.add(layer)
    return tuple(sorted(seen))


def _examples(value: Any, side: str) -> tuple[Example, ...]:
    if not isinstance(value, list):
        raise InvalidField(side, f"'{side}' must be an array of texts or messages lists")
    if len(value) < MIN_PER_SIDE:
        raise InvalidField(side, f"'{side}' needs at least {MIN_PER_SIDE} examples")
    if len(value) > MAX_PER_SIDE:  # before looking inside any
        raise InvalidField(
            side,
            f"'{side}' has {len(value)} examples; at most {MAX_PER_SIDE}",
            code="examples_too_large",
        )
    return tuple(_example(item, f"{side}[{i}]") for i, item in enumerate(value))


def _example(item: Any, p: str) -> Example:
    if isinstance(item, str):
        if not item:
            raise InvalidField(p, f"'{p}' is empty")
        if len(item) > MAX_EXAMPLE_CHARS:
            raise InvalidField(
                p,
                f"'{p}' has {len(item)} characters; at most {MAX_EXAMPLE_CHARS}",
                code="examples_too_large",
            )
        return item
    if not isinstance(item, list) or not item:
        raise InvalidField(p, f"'{p}' must be a text or a non-empty messages list")
    if len(item) > MAX_MESSAGES:
        raise InvalidField(p, f"'{p}' has {len(item)} messages; at most {MAX_MESSAGES}")
    out: list[dict[str, str]] = []
    for j, msg in enumerate(item):
        q = f"{p}[{j}]"
        if not isinstance(msg, dict):
            raise InvalidField(q, f"'{q}' must be an object with 'role' and 'content'")
        reject_unknown(msg, ("role", "content"), q)
        if msg.get("role") not in ROLES:
            raise InvalidField(f"{q}.role", f"'{q}.role' must be one of {', '.join(ROLES)}")
        if not isinstance(msg.get("content"), str):
            raise InvalidField(f"{q}.content", f"'{q}.content' must be a string")
        out.append({"role": msg["role"], "content": msg["content"]})
    if _chars(out) > MAX_EXAMPLE_CHARS:
        raise InvalidField(
            p,
            f"'{p}' has {_chars(out)} characters; at most {MAX_EXAMPLE_CHARS}",
            code="examples_too_large",
        )
    return out


def _identity(example: Example) -> tuple[str, ...]:
    """What makes two examples the same prompt (a text and a messages list never are)."""
    if isinstance(example, str):
        return ("text", example)
    return ("messages", *(f"{m['role']}\0{m['content']}" for m in example))


def _chars(example: Example) -> int:
    return len(example) if isinstance(example, str) else sum(len(m["content"]) for m in example)
