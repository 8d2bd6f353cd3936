"""An offline mean-difference steering vector on the default model, with ``transformers``.

What ``POST /v1/steering/vectors/{name}/from-examples`` computes with
``method: mean_difference, position: mean``, done outside steergate: the residual
stream at ``post_block`` l (the output of decoder layer l, HF ``hidden_states[l + 1]``)
is averaged over each example's tokens, and the vector at layer l is the mean over
the positive examples minus the mean over the negative ones. Used to produce the
README tour's text and to check the route's answer independently.

    python scripts/offline_vector.py --positive docs/examples/ocean.txt \\
        --negative docs/examples/city.txt --layers 8-15 > ocean.json
    curl -X PUT $URL/v1/steering/vectors/ocean -H "Authorization: Bearer $KEY" \\
        -H 'Content-Type: application/json' -d @ocean.json

``--try PROMPT`` instead prints greedy answers (chat-templated) at a few scales, steered
in ``transformers`` by forward hooks, to choose a scale before uploading.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def read_examples(path: Path) -> list[str]:
    """One text per line (blank lines skipped)."""
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]


def parse_layers(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def load(model_dir: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return tok, model


def mean_activations(tok: Any, model: Any, texts: list[str], layers: list[int]) -> np.ndarray:
    """[examples, layers, hidden]: each example's post_block rows averaged over its tokens."""
    import torch

    rows = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt")["input_ids"]
            hs = model(ids, output_hidden_states=True).hidden_states
            rows.append(np.stack([hs[layer + 1][0].mean(0).numpy() for layer in layers]))
    return np.stack(rows).astype(np.float32)


def mean_difference(tok: Any, model: Any, pos: list[str], neg: list[str],
                    layers: list[int]) -> dict[int, np.ndarray]:
    diff = (mean_activations(tok, model, pos, layers).mean(0)
            - mean_activations(tok, model, neg, layers).mean(0))
    return {layer: diff[i] for i, layer in enumerate(layers)}


def steered_answer(tok: Any, model: Any, prompt: str, vectors: dict[int, np.ndarray],
                   scale: float, max_tokens: int) -> str:
    """Greedy chat answer with ``scale * vector`` added at post_block of each layer."""
    import torch

    handles = []
    for layer, vec in vectors.items():
        add = torch.as_tensor(vec * scale)

        def hook(mod: Any, args: Any, out: Any, add: torch.Tensor = add) -> Any:
            return (out[0] + add, *out[1:]) if isinstance(out, tuple) else out + add

        handles.append(model.model.layers[layer].register_forward_hook(hook))
    try:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False)
        return str(tok.decode(out[0][ids["input_ids"].shape[1]:], skip_special_tokens=True))
    finally:
        for h in handles:
            h.remove()


def main(argv: list[str] | None = None) -> int:
    from steergate.engine.real_model import ensure_real_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positive", type=Path, required=True)
    p.add_argument("--negative", type=Path, required=True)
    p.add_argument("--layers", default="8-15", help="e.g. 8-15 or 4,6,8 (default 8-15)")
    p.add_argument("--model", type=Path, help="default: the converted SmolLM2-135M-Instruct")
    p.add_argument("--try", dest="prompts", action="append", default=[],
                   help="print greedy answers to this prompt at --scales instead of the JSON")
    p.add_argument("--scales", default="0,1,2,4")
    p.add_argument("--max-tokens", type=int, default=40)
    args = p.parse_args(argv)
    tok, model = load(args.model or ensure_real_model())
    layers = parse_layers(args.layers)
    vectors = mean_difference(tok, model, read_examples(args.positive),
                              read_examples(args.negative), layers)
    if args.prompts:
        for prompt in args.prompts:
            for scale in (float(s) for s in args.scales.split(",")):
                answer = steered_answer(tok, model, prompt, vectors, scale, args.max_tokens)
                print(f"[scale {scale:g}] {prompt!r} -> {answer!r}", flush=True)
        return 0
    body = {"hook": "post_block",
            "layers": {str(layer): [float(x) for x in v] for layer, v in vectors.items()},
            "description": f"offline mean difference, {args.positive.name} - "
                           f"{args.negative.name}, post_block {args.layers}"}
    json.dump(body, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
