"""``POST /v1/steering/vectors/{name}/from-examples``: a named vector made from
contrastive examples on the served model, stored like an uploaded one.

Downhill: the body is validated in full (``examples_spec``), then admitted like
inference (its token estimate against requests/min, tokens/min and the budget),
then each side's examples are run through activation capture on an engine
(``/v1/completions``, ``max_tokens: 1``, a batch of prompts per request, the
tenant's cache salt), the vector is computed per layer (``contrast``, in a worker
thread), stored in Redis with its provenance and report (``vectors.store_vector``:
the same keys and quota as a PUT) and offered to the engines. Settlement charges
what the engine reported it used.

A messages example is chat-templated by the engine's ``/tokenize`` (with
``add_generation_prompt`` when it does not end with an assistant turn) and sent as
token ids; a text is sent as it is, so the engine adds the model's usual special
tokens. See docs/api.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response

from steergate.gateway.admission.limits import text_tokens
from steergate.gateway.admission.metered import admitted
from steergate.gateway.admission.request_scoping import combined_salt
from steergate.gateway.admission.units import format_bytes
from steergate.gateway.deps import Services, ServicesDep
from steergate.gateway.engines.upstream import EngineUnreachable, UpstreamResponse
from steergate.gateway.routes.inference import (
    CLIENT_CLOSED,
    read_json_object,
    unless_client_leaves,
)
from steergate.gateway.routes.vectors import precheck_quota, store_vector
from steergate.gateway.tenancy.auth import TenantDep, caller_key
from steergate.gateway.tenancy.records import Tenant
from steergate.gateway.vectors.contrast import compute
from steergate.gateway.vectors.examples_spec import Example, ExamplesSpec, parse_examples_body
from steergate.shared import engine_api
from steergate.shared.capture import MAX_BYTES, decode_capture
from steergate.shared.errors import APIError, InvalidField
from steergate.shared.scoping import check_vector_name
from steergate.shared.steering import FLOAT32_BYTES, ModelShape

router = APIRouter(tags=["vectors"])
T = TypeVar("T")

#: Examples per engine request: one batch the engine schedules together; with every
#: layer of a 30-layer, 576-wide model that is 2.2 MB of captured float32. Fewer on a
#: model whose batch would pass the engine's capture bound (:func:`batch_size`).
BATCH = 32
#: ... and at most about this many prompt tokens (4 characters or one id each): the
#: engine serves other tenants between one request and the next, so this bounds how long
#: a job holds them up. One request of 32 examples of 8,000 characters held another
#: tenant's 8-token chat for 70 s on a 2-core CPU engine (found from outside).
BATCH_TOKENS = 4096
#: Messages examples templated at once (one ``/tokenize`` call each).
TOKENIZE_CONCURRENCY = 8
#: An engine request of BATCH examples on a busy CPU engine may take minutes.
ENGINE_TIMEOUT_S = 600.0

Prompt = str | list[int]


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    by_side: dict[str, int] = field(default_factory=lambda: {"positive": 0, "negative": 0})
    model: str | None = None

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, side: str, doc: dict[str, Any]) -> None:
        usage = doc.get("usage") if isinstance(doc.get("usage"), dict) else {}
        prompt = int(usage.get("prompt_tokens") or 0)
        self.prompt_tokens += prompt
        self.completion_tokens += int(usage.get("completion_tokens") or 0)
        self.by_side[side] += prompt
        if isinstance(doc.get("model"), str):
            self.model = doc["model"]


@router.post("/v1/steering/vectors/{name}/from-examples")
async def from_examples(
    name: str, request: Request, tenant: TenantDep, svc: ServicesDep
) -> Response:
    check_vector_name(name)
    body = await read_json_object(request)
    shape = await svc.engines.known_shape()
    spec = parse_examples_body(body, shape)  # every 400 before any work
    held = spec.activation_bytes(shape.hidden_size)
    if held > svc.contrast.memory.limit:
        raise InvalidField(
            "layers",
            f"this job would hold {format_bytes(held)} of activations ({len(spec.layers)} "
            f"layers x {len(spec.positive) + len(spec.negative)} examples x hidden size "
            f"{shape.hidden_size} x 4 bytes); the gateway allows "
            f"{format_bytes(svc.contrast.memory.limit)}: ask for fewer layers or examples",
            code="examples_too_large",
        )
    nbytes = 4 * shape.hidden_size * len(spec.layers)
    await precheck_quota(svc, tenant.id, tenant.limits, name, nbytes)  # no tokens spent in vain
    admission = svc.limiter.admit(
        tenant,
        tokens=spec.token_estimate,
        conversation_id=None,
        latch=False,
        latch_bytes=0,
        latch_kind="ref",
        api_key=caller_key(request),
    )
    async with admitted(svc.settler, admission) as call:
        usage = Usage()

        async def job() -> tuple[dict[str, Any], bool]:
            # Again once the tenant's turn is held: a job of the same tenant that ran
            # meanwhile may have taken the room (nothing charged when refused here).
            await precheck_quota(svc, tenant.id, tenant.limits, name, nbytes)
            return await _make(name, spec, tenant, svc, shape, usage)

        try:
            # A client that leaves stops the job: its engine request is cancelled (vLLM
            # aborts it) and no later batch, vector or store runs for nobody.
            made = await unless_client_leaves(_held(svc, tenant.id, held, job), request.receive)
        finally:
            # What the engine did is charged even when a later step failed.
            call.tokens, call.prompt_tokens = usage.total, usage.prompt_tokens
        if made is None:
            return Response(status_code=CLIENT_CLOSED)  # settled on the way out
        doc, created = made
        status = 201 if created else 200
        call.settle(status)
        return Response(
            orjson.dumps(doc),
            status_code=status,
            headers=call.headers,
            media_type="application/json",
        )


async def _held(
    svc: Services, tenant_id: str, nbytes: int, job: Callable[[], Awaitable[T]]
) -> T:
    """``job()`` once its activations have room (``contrast_jobs.ActivationMemory``)."""
    async with svc.contrast.memory.hold(tenant_id, nbytes):
        return await job()


def _not_finite(spec: ExamplesSpec, layer: int) -> APIError:
    """Never stored: a vector that is not finite would turn every steered token of
    every later request that names it into NaN."""
    return APIError(
        "engine_unavailable",
        f"The engine's activations at {spec.hook} layer {layer} were not finite.",
    )


async def _make(
    name: str, spec: ExamplesSpec, tenant: Tenant, svc: Services, shape: ModelShape, usage: Usage
) -> tuple[dict[str, Any], bool]:
    salt = combined_salt(svc.tenants.salt_secret(tenant), None)
    acts = {}
    for side, examples in (("positive", spec.positive), ("negative", spec.negative)):
        prompts = await _prompts(svc, examples, side)
        acts[side] = await _activations(
            svc, spec, prompts, side, salt, usage, shape.hidden_size
        )
    for layer in spec.layers:
        if not all(np.isfinite(acts[side][layer]).all() for side in acts):
            raise _not_finite(spec, layer)  # refused before any arithmetic runs on them
    results = await svc.contrast.run(
        tenant.id,
        lambda: {
            layer: compute(
                acts["positive"][layer], acts["negative"][layer], spec.method, spec.normalize
            )
            for layer in spec.layers
        },
    )
    for layer, r in results.items():
        if not np.isfinite(r.vector).all():  # finite activations, too large to combine
            raise _not_finite(spec, layer)
    for layer in spec.layers:
        if not results[layer].norm > 0:
            # Different texts the engine saw as the same prompt (or whose activations
            # agree exactly here): an all-zero vector would be stored and steer nothing.
            raise InvalidField(
                "layers",
                f"the positive and negative examples' activations at {spec.hook} layer "
                f"{layer} are identical: their difference has no direction",
                code="examples_indistinguishable",
            )
    report = {
        "layers": {str(layer): r.report() for layer, r in results.items()},
        "examples": {
            "positive": len(spec.positive),
            "negative": len(spec.negative),
            "positive_tokens": usage.by_side["positive"],
            "negative_tokens": usage.by_side["negative"],
        },
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total,
        },
    }
    provenance = {
        "source": "from-examples",
        "method": spec.method,
        "position": spec.position,
        "normalize": spec.normalize,
        "model": usage.model,
        "counts": {"positive": len(spec.positive), "negative": len(spec.negative)},
        "created": time.time(),
    }
    meta, replaced = await store_vector(
        svc,
        tenant,
        name,
        spec.hook,
        {layer: r.vector for layer, r in results.items()},
        spec.description,
        {"provenance": provenance, "report": report},
    )
    out = {k: meta[k] for k in ("name", "digest", "bytes", "layers", "hook", "description")}
    return {**out, "provenance": provenance, "report": report}, not replaced


async def _prompts(svc: Services, examples: tuple[Example, ...], side: str) -> list[Prompt]:
    """Texts as they are; messages lists templated into token ids by the engine."""
    gate = asyncio.Semaphore(TOKENIZE_CONCURRENCY)

    async def one(i: int, example: Example) -> Prompt:
        if isinstance(example, str):
            return example
        async with gate:
            return await _template(svc, example, f"{side}[{i}]")

    return list(await asyncio.gather(*(one(i, e) for i, e in enumerate(examples))))


async def _template(svc: Services, messages: list[dict[str, str]], param: str) -> list[int]:
    request = {
        "messages": messages,
        "add_generation_prompt": messages[-1]["role"] != "assistant",
    }
    r = await svc.engines.tokenize(orjson.dumps(request))
    doc = _answer(r, param)
    tokens = doc.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise APIError("engine_unavailable", "The engine's tokenizer gave no token ids.")
    return tokens


def batch_size(hidden_size: int, layers: int) -> int:
    """Examples per engine request: :data:`BATCH`, or as many as fit the engine's
    bound on one request's capture (``capture.MAX_BYTES``; one reduced row per example
    and layer). An 80-layer, 8192-wide model fits 25: 32 were 80 MiB, refused."""
    per_example = FLOAT32_BYTES * hidden_size * max(1, layers)
    return max(1, min(BATCH, MAX_BYTES // per_example))


def batches(order: list[int], prompts: list[Prompt], most: int) -> list[list[int]]:
    """``order`` cut into engine requests of at most ``most`` examples and about
    :data:`BATCH_TOKENS` prompt tokens (an example longer than that goes alone)."""
    out: list[list[int]] = []
    tokens = 0
    for i in order:
        prompt = prompts[i]
        n = len(prompt) if isinstance(prompt, list) else text_tokens(len(prompt))
        if out and len(out[-1]) < most and tokens + n <= BATCH_TOKENS:
            out[-1].append(i)
            tokens += n
        else:
            out.append([i])
            tokens = n
    return out


async def _activations(
    svc: Services,
    spec: ExamplesSpec,
    prompts: list[Prompt],
    side: str,
    salt: str,
    usage: Usage,
    hidden_size: int,
) -> dict[int, np.ndarray]:
    """``{layer: [examples, hidden]}`` for one side, in example order."""
    rows: dict[int, list[np.ndarray]] = {layer: [] for layer in spec.layers}
    # vLLM takes a list of texts or a list of token-id lists, not both in one request.
    order = sorted(range(len(prompts)), key=lambda i: isinstance(prompts[i], list))
    by_example: dict[int, dict[int, np.ndarray]] = {}
    for chunk in batches(order, prompts, batch_size(hidden_size, len(spec.layers))):
        kinds = {isinstance(prompts[i], list) for i in chunk}
        for kind in kinds:
            part = [i for i in chunk if isinstance(prompts[i], list) == kind]
            got = await _capture(svc, spec, [prompts[i] for i in part], side, salt, usage)
            by_example.update({i: got[k] for k, i in enumerate(part)})
    for i in range(len(prompts)):
        for layer in spec.layers:
            rows[layer].append(by_example[i][layer])
    return {layer: np.stack(r) for layer, r in rows.items()}


async def _capture(
    svc: Services,
    spec: ExamplesSpec,
    prompts: list[Prompt],
    side: str,
    salt: str,
    usage: Usage,
) -> list[dict[int, np.ndarray]]:
    """One engine request: per prompt, ``{layer: [hidden]}``."""
    body = {
        "prompt": prompts,
        "max_tokens": 1,
        "temperature": 0,
        "cache_salt": salt,
        "capture": {
            "sites": [{"hook": spec.hook, "layers": list(spec.layers)}],
            "tokens": "prompt",
            "reduce": spec.position,
        },
    }
    content = orjson.dumps(body)
    engine = svc.engines.pick()
    try:
        r = await svc.engines.complete(engine, engine_api.COMPLETIONS, content, ENGINE_TIMEOUT_S)
    except EngineUnreachable:  # nothing was sent: the next engine may take it
        nxt = svc.engines.pick()
        if nxt is engine:
            raise
        r = await svc.engines.complete(nxt, engine_api.COMPLETIONS, content, ENGINE_TIMEOUT_S)
    doc = _answer(r, side)
    usage.add(side, doc)
    try:
        sites = decode_capture(doc.get("capture"))
    except ValueError as exc:
        raise APIError("engine_unavailable", f"The engine's capture was unreadable: {exc}") from exc
    out: list[dict[int, np.ndarray]] = []
    for index in range(len(prompts)):
        per_layer: dict[int, np.ndarray] = {}
        for layer in spec.layers:
            rows = sites.get((index, spec.hook, layer))
            if rows is None or rows.shape[0] != 1:
                raise APIError(
                    "engine_unavailable",
                    f"The engine's capture lacks {spec.hook} layer {layer} of example {index}.",
                )
            per_layer[layer] = rows[0]
        out.append(per_layer)
    return out


def _answer(r: UpstreamResponse, param: str) -> dict[str, Any]:
    """The engine's JSON answer, or the error the client gets, by what the engine said:
    a refusal of the examples (too long for the model, say) is the caller's 400 naming
    them; a feature this engine lacks (capture on an engine that replays CUDA graphs) is
    501 ``not_implemented`` with the engine's reason, not a retryable 502; a full queue
    is 503; anything else is the engine failing, 502."""
    try:
        doc = r.json()
    except orjson.JSONDecodeError:
        doc = None
    if r.status == 200 and isinstance(doc, dict):
        return doc
    err = doc.get("error") if isinstance(doc, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    message = message if isinstance(message, str) else None
    if r.status in (400, 413, 422):
        raise InvalidField(param, f"the engine refused '{param}': {message or 'bad request'}")
    if r.status == 501:
        raise APIError(
            "not_implemented",
            f"this engine cannot make vectors from examples: {message or 'not implemented'}",
        )
    if r.status in (429, 503):
        raise APIError("engine_overloaded", "The inference engine is overloaded; try again.")
    raise APIError("engine_unavailable", "The inference engine is unavailable.")
