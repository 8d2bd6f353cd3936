"""``from-examples`` on the real model (SmolLM2-135M-Instruct, float32, the shared
real-model engine) through the gateway: the vector equals a mean difference of the
same examples' activations computed apart with ``transformers``, and steering with it
at a moderate scale (``openai`` client) brings the concept into answers to neutral
prompts while they stay text."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from steergate.gateway.app import create_app
from steergate.shared.steering import parse_layers_or_packed
from tests.gateway.conftest import gateway_settings, make_tenant
from tests.gateway.contrast_reference import loo_reference
from tests.gateway.servers import ServerThread
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine

OCEAN = [
    "The ocean waves crashed against the rocky shore.",
    "Deep beneath the sea, coral reefs glow with color.",
    "Sailors watched the tide roll in over the beach.",
    "Whales sing to each other across the open ocean.",
    "The salty sea breeze smelled of seaweed and foam.",
    "Fish darted through the warm, clear ocean water.",
    "A lighthouse guided ships across the stormy sea.",
    "Children built sandcastles where the waves met the sand.",
]
CITY = [
    "The traffic crawled through the crowded downtown streets.",
    "Skyscrapers of glass and steel rose above the avenue.",
    "Commuters rushed to catch the subway at rush hour.",
    "Neon signs flickered above the busy city sidewalks.",
    "Taxis honked at the intersection near the office towers.",
    "The apartment overlooked a noisy street full of buses.",
    "Construction cranes loomed over the city's new district.",
    "People queued outside a cafe on the corner of the block.",
]
NEUTRAL = [
    "Tell me about your day.",
    "What should I cook for dinner tonight?",
    "Describe a perfect weekend.",
    "Write the opening line of a story.",
    "What is your favourite place, and why?",
    "Give me one piece of advice for a job interview.",
]
CONCEPT = re.compile(
    r"\b(ocean|oceans|sea|seas|wave|waves|beach|beaches|marine|tide|tides|coral|shore|"
    r"underwater|whale|whales|sailor|sailors|seaside|surf|island)\b",
    re.IGNORECASE,
)
LAYERS = list(range(8, 16))
#: A moderate scale for the last-token vector on this model: 0 concept words on the
#: neutral prompts unsteered, 5 or more at 1 (transformers, same layers), text intact.
SCALE = 1.0


@pytest.fixture()
def gw(real_engine: EngineProcess, redis_url: str) -> Iterator[ServerThread]:
    server = ServerThread(
        create_app(gateway_settings(redis_url, real_engine.url, engine_token=real_engine.token))
    ).start()
    yield server
    server.stop()


def _hf_activations(model_dir: Path, texts: list[str]) -> dict[int, np.ndarray]:
    """Each text's post_block activation at LAYERS, averaged over its tokens, from a
    float32 ``transformers`` forward pass: ``hidden_states[l + 1]`` is layer l's
    output (the residual stream after the block). ``{layer: [texts, hidden]}``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    rows: dict[int, list[np.ndarray]] = {layer: [] for layer in LAYERS}
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt")
            out = model(**ids, output_hidden_states=True)
            for layer in LAYERS:
                rows[layer].append(out.hidden_states[layer + 1][0].mean(0).double().numpy())
    return {layer: np.stack(r) for layer, r in rows.items()}


def _count(texts: list[str]) -> int:
    return sum(len(CONCEPT.findall(t)) for t in texts)


def _is_text(answer: str) -> bool:
    words = re.findall(r"[A-Za-z']+", answer)
    letters = sum(c.isalpha() or c.isspace() for c in answer)
    return len(words) >= 5 and letters >= 0.8 * len(answer) and len(set(words)) >= 0.4 * len(words)


def test_made_vector_matches_transformers_and_steers_toward_the_concept(
    gw: ServerThread, redis_url: str, real_model: Path
) -> None:
    key = make_tenant(redis_url, "acme")
    auth = {"Authorization": f"Bearer {key}"}
    body: dict[str, Any] = {
        "hook": "post_block",
        "layers": LAYERS,
        "positive": OCEAN,
        "negative": CITY,
    }
    r = httpx.post(
        gw.url + "/v1/steering/vectors/ocean/from-examples", json=body, headers=auth, timeout=900
    )
    assert r.status_code == 201, r.text
    doc = r.json()
    assert doc["provenance"]["model"] and doc["report"]["usage"]["prompt_tokens"] > 16 * 5

    # The stored vector equals a mean difference computed apart, and the report equals
    # its definition (loop-by-loop leave-one-out) on those activations.
    stored = httpx.get(
        gw.url + "/v1/steering/vectors/ocean?include=data", headers=auth, timeout=30
    ).json()
    vectors = parse_layers_or_packed({"packed": stored["packed"]}, None, None)
    pos, neg = _hf_activations(real_model, OCEAN), _hf_activations(real_model, CITY)
    for layer in LAYERS:
        want = pos[layer].mean(0) - neg[layer].mean(0)
        got = vectors[layer]
        cos = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
        assert cos >= 0.999, (layer, cos)
        rep = doc["report"]["layers"][str(layer)]
        assert rep["norm"] == pytest.approx(float(np.linalg.norm(want)), rel=1e-3), layer
        # Float32 engine vs float32 transformers: an example sitting on a midpoint may
        # flip, so one example's worth of slack (1/16).
        loo = loo_reference(pos[layer], neg[layer], "mean_difference")
        assert abs(rep["accuracy"] - loo) <= 1 / 16 + 1e-9, (layer, rep, loo)
        unit = want / np.linalg.norm(want)
        pp, pn = pos[layer] @ unit, neg[layer] @ unit
        pooled = np.sqrt((7 * pp.var(ddof=1) + 7 * pn.var(ddof=1)) / 14)
        sep = float((pp.mean() - pn.mean()) / pooled)
        assert rep["separation"] == pytest.approx(sep, rel=1e-2), layer

    # Steering. On this model a position-mean vector carries the first token's massive
    # activations (its norm jumps from ~22 to ~245 at layer 12, as the report shows), and
    # added at 8 layers it breaks the text at any scale that moves the topic; the
    # last-token vector steers cleanly at scale 1 (see docs/api.md). It is made by the
    # same route and used by name through the official client.
    body["position"] = "last"
    r = httpx.post(
        gw.url + "/v1/steering/vectors/ocean-last/from-examples",
        json=body,
        headers=auth,
        timeout=900,
    )
    assert r.status_code == 201, r.text
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, timeout=300)

    def answers(steer: bool) -> list[str]:
        extra = {"steering": {"vectors": [{"name": "ocean-last", "scale": SCALE}]}} if steer else {}
        out = []
        for prompt in NEUTRAL:
            c = client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=48,
                temperature=0,
                extra_body=extra,
            )
            out.append(c.choices[0].message.content or "")
        return out

    plain, steered = answers(False), answers(True)
    print("unsteered:", plain, "\nsteered:", steered)
    assert _count(steered) >= _count(plain) + 4, (plain, steered)
    assert all(_is_text(a) for a in steered), steered


def test_messages_examples_pca_and_last_position_on_the_real_model(
    gw: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    as_chat = [[{"role": "user", "content": t}] for t in (*OCEAN[:4], *CITY[:4])]
    body = {
        "layers": [10, 12],
        "positive": as_chat[:4],
        "negative": as_chat[4:],
        "method": "pca",
        "position": "last",
        "normalize": True,
    }
    r = httpx.post(
        gw.url + "/v1/steering/vectors/sea/from-examples",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=900,
    )
    assert r.status_code == 201, r.text
    report = r.json()["report"]
    assert set(report["layers"]) == {"10", "12"}
    # Templated prompts are longer than their texts (the chat template's tokens).
    assert report["examples"]["positive_tokens"] > 4 * 10
