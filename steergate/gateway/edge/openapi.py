"""The gateway's OpenAPI document: admin-only, and complete for the raw-body routes.

* ``GET /openapi.json`` needs the admin key. The document names every route and
  parameter; it is an operator's tool, not something to hand the internet. There is
  no ``/docs`` or ``/redoc``: FastAPI's versions load Swagger UI and ReDoc from a CDN,
  which a gateway holding API keys must never make a browser do.
* The inference routes, ``PUT /v1/steering/vectors/{name}`` and ``from-examples``
  read their bodies by hand (speed, and OpenAI-shaped 400s), so FastAPI cannot see
  what they take.
  ``RAW_BODIES`` documents those bodies, so clients and schema-driven tests
  (Schemathesis) see and exercise them like any other route's.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from steergate.gateway.tenancy.auth import require_admin
from steergate.shared.scoping import CONVERSATION_ID_RE, TENANT_ID_RE, VECTOR_NAME_RE


def _pattern(rx: re.Pattern[str]) -> str:
    """A validator's regex as a JSON Schema (ECMA-262) pattern: ``^...$``, where ``$``
    never matches before a final newline (unlike Python's)."""
    body = rx.pattern.removeprefix("\\A").removeprefix("^")
    body = body.removesuffix("\\Z").removesuffix("$")
    return f"^{body}$"


_CONVERSATION_ID = {
    "type": "string",
    "pattern": _pattern(CONVERSATION_ID_RE),
    "description": "The client's conversation name, scoped to the tenant.",
}
#: Path parameters by name -> their alphabet, added to FastAPI's bare ``string``.
PATH_PATTERNS = {
    "name": _pattern(VECTOR_NAME_RE),
    "conversation_id": _pattern(CONVERSATION_ID_RE),
    "tenant_id": _pattern(TENANT_ID_RE),
}
_LAYERS = {
    "type": "object",
    "description": '{"<0-based layer>": [hidden_size floats]}',
    "propertyNames": {"pattern": "^(0|[1-9][0-9]*)$"},
    "additionalProperties": {"type": "array", "items": {"type": "number"}},
}
_PACKED = {
    "type": "object",
    "required": ["dtype", "shape", "layer_indices", "data"],
    "properties": {
        "dtype": {"enum": ["float32", "float16", "bfloat16"]},
        "shape": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
        "layer_indices": {"type": "array", "items": {"type": "integer"}},
        "data": {"type": "string", "description": "base64, little-endian"},
    },
}
_HOOK = {"enum": ["pre_attn", "post_attn", "post_block"]}
_TERM = {
    "type": "object",
    "description": "A named vector (`name`) or an inline one (`hook` + `layers` | `packed`).",
    "properties": {
        "name": {"type": "string"},
        "hook": _HOOK,
        "layers": _LAYERS,
        "packed": _PACKED,
        "scale": {"type": "number"},
        "op": {"enum": ["add", "clamp", "ablate"]},
        "min": {"type": "number"},
        "max": {"type": "number"},
        "value": {"type": "number"},
        "strength": {"type": "number", "minimum": 0, "maximum": 1},
    },
}
_COUNT = {"type": "integer", "minimum": 0}
_TOKENS = {
    "type": "object",
    "description": "Token positions to steer; `phase` is its shorthand (not both).",
    "properties": {
        "prompt": {"oneOf": [
            {"enum": ["all", "none"]},
            {"type": "object", "properties": {"last": _COUNT}, "required": ["last"]},
        ]},
        "generated": {"oneOf": [
            {"enum": ["all", "none"]},
            {"type": "object", "properties": {"first": _COUNT}, "required": ["first"]},
            {"type": "object", "properties": {"from": _COUNT}, "required": ["from"]},
        ]},
    },
}
_STEERING = {
    "type": "object",
    "properties": {
        "vectors": {"type": "array", "items": _TERM, "maxItems": 256},
        "phase": {"enum": ["all", "prefill", "decode"]},
        "tokens": _TOKENS,
        "latch": {"type": "boolean"},
        "compare": {"type": "boolean", "description": "choice 0..n-1 steered, n..2n-1 not"},
    },
}
_INFERENCE_COMMON: dict[str, Any] = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "stream": {"type": "boolean"},
    "conversation_id": _CONVERSATION_ID,
    "steering": _STEERING,
}


def _json_body(schema: dict[str, Any], **other: dict[str, Any]) -> dict[str, Any]:
    content = {"application/json": {"schema": schema}, **other}
    return {"required": True, "content": content}


#: (method, path) -> requestBody, for the routes that parse their bodies themselves.
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "additionalProperties": False,
    "properties": {
        "role": {"enum": ["system", "user", "assistant"]},
        "content": {"type": "string"},
    },
}
#: A from-examples side: texts (raw prompts) or messages lists (chat-templated).
_EXAMPLES = {
    "type": "array",
    "minItems": 2,
    "maxItems": 256,
    "items": {
        "oneOf": [
            {"type": "string", "minLength": 1, "maxLength": 8000},
            {"type": "array", "minItems": 1, "maxItems": 32, "items": _MESSAGE},
        ]
    },
}

RAW_BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/chat/completions"): _json_body(
        {
            "type": "object",
            "description": "The OpenAI request, plus `conversation_id` and `steering`.",
            "required": ["model", "messages"],
            "properties": {
                **_INFERENCE_COMMON,
                "messages": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["role", "content"],
                        "properties": {
                            "role": {"enum": ["system", "user", "assistant"]},
                            "content": {"type": "string"},
                        },
                    },
                },
            },
        }
    ),
    ("post", "/v1/completions"): _json_body(
        {
            "type": "object",
            "description": "The OpenAI request, plus `conversation_id` and `steering`.",
            "required": ["model", "prompt"],
            "properties": {**_INFERENCE_COMMON, "prompt": {"type": "string"}},
        }
    ),
    ("post", "/v1/responses"): _json_body(
        {
            "type": "object",
            "description": "The Responses API request, plus `conversation_id` and `steering` "
            "(`previous_response_id` and `background` are refused; nothing is stored).",
            "required": ["input"],
            "properties": {
                "model": {"type": "string"},
                "input": {"type": "string"},
                "instructions": {"type": "string"},
                "max_output_tokens": {"type": "integer", "minimum": 1},
                "stream": {"type": "boolean"},
                "conversation_id": _CONVERSATION_ID,
                "steering": _STEERING,
            },
        }
    ),
    ("post", "/v1/tokenize"): _json_body(
        {
            "type": "object",
            "description": "vLLM's tokenize request: `prompt`, or chat `messages`.",
            "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
            "properties": {
                "model": {"type": "string"},
                "prompt": {"type": "string"},
                "messages": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["role", "content"],
                        "properties": {
                            "role": {"enum": ["system", "user", "assistant"]},
                            "content": {"type": "string"},
                        },
                    },
                },
                "return_token_strs": {"type": "boolean"},
            },
        }
    ),
    ("post", "/v1/detokenize"): _json_body(
        {
            "type": "object",
            "required": ["tokens"],
            "properties": {
                "model": {"type": "string"},
                "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            },
        }
    ),
    ("post", "/v1/steering/vectors/{name}/from-examples"): _json_body(
        {
            "type": "object",
            "required": ["positive", "negative"],
            "additionalProperties": False,
            "properties": {
                "hook": _HOOK,
                "layers": {
                    "oneOf": [
                        {"const": "all"},
                        {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    ]
                },
                "positive": _EXAMPLES,
                "negative": _EXAMPLES,
                "method": {"enum": ["mean_difference", "pca"]},
                "position": {"enum": ["mean", "last"]},
                "normalize": {"type": "boolean"},
                "description": {"type": "string", "maxLength": 1024},
            },
        }
    ),
    ("put", "/v1/steering/vectors/{name}"): _json_body(
        {
            "type": "object",
            "required": ["hook"],
            "oneOf": [{"required": ["layers"]}, {"required": ["packed"]}],
            "additionalProperties": False,
            "properties": {
                "hook": _HOOK,
                "layers": _LAYERS,
                "packed": _PACKED,
                "description": {"type": "string", "maxLength": 1024},
            },
        },
        **{
            "application/octet-stream": {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": "A GGUF control vector (llama.cpp / repeng).",
                }
            }
        },
    ),
}


def build_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document with ``RAW_BODIES`` filled in (a route that documents its
    own body keeps it) and the id alphabets on path parameters and the tenant id."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        paths = schema.get("paths", {})
        for (method, path), body in RAW_BODIES.items():
            op = paths.get(path, {}).get(method)
            if op is not None:
                op.setdefault("requestBody", body)
        for ops in paths.values():
            for op in ops.values():
                for param in op.get("parameters", []):
                    pattern = PATH_PATTERNS.get(param["name"])
                    if param.get("in") == "path" and pattern:
                        param.setdefault("schema", {}).setdefault("pattern", pattern)
        create = paths.get("/admin/tenants", {}).get("post", {})
        body_schema = create.get("requestBody", {}).get("content", {}).get("application/json", {})
        tenant_id = body_schema.get("schema", {}).get("properties", {}).get("id")
        if tenant_id is not None:
            tenant_id.setdefault("pattern", _pattern(TENANT_ID_RE))
        app.openapi_schema = schema
    return app.openapi_schema


def install(app: FastAPI) -> None:
    """Serve the document at ``/openapi.json`` behind the admin key. ``app`` must be
    built with ``openapi_url=None, docs_url=None, redoc_url=None``."""

    def openapi() -> dict[str, Any]:
        return build_schema(app)

    app.openapi = openapi  # type: ignore[method-assign]

    async def openapi_json() -> JSONResponse:
        return JSONResponse(app.openapi())

    app.add_api_route(
        "/openapi.json",
        openapi_json,
        methods=["GET"],
        include_in_schema=False,
        dependencies=[Depends(require_admin)],
    )
