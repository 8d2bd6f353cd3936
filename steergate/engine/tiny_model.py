"""``steergate tiny-model DIR``: a small, deterministic, random Llama.

The weights are random but fixed by a seed, so every machine that generates the
model gets byte-identical files; tests compare vLLM against a ``transformers``
reference on the same weights, so the model does not need to be any good, only
well-conditioned: the output head is scaled so that logits are spread out (no
near-ties that float rounding could flip) and the steering vectors used by tests
clearly change the greedy tokens.

The tokenizer is a byte-level BPE trained on a small built-in corpus, so it is
also deterministic and needs no download.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path

SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
BOS, EOS = "<s>", "</s>"
VOCAB_SIZE = 768
MAX_POSITIONS = 2048

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A fixed corpus: enough distinct English to give BPE a few hundred merges.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
To be or not to be, that is the question. All that glitters is not gold.
Steering vectors add a direction to the residual stream of a transformer at a chosen layer.
The gateway checks the tenant's key, counts tokens per minute, and forwards the request to the engine.
Hello, how are you today? I am fine, thank you. What would you like to talk about?
Once upon a time there was a small model that lived on a computer with two cores.
It could not write poems, but it could repeat numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15.
The weather is calm and the sea is quiet; the wind is gentle and the sky is clear.
Redis keeps counters, latches and vectors; the engine keeps tables of steering rows.
Please summarize the following text in one sentence. Translate this sentence into French.
def add(a, b): return a + b  # a function that adds two numbers
{"role": "user", "content": "hi"} [1, 2, 3] (x + y) * z = w; if x > 0 then y else z.
Cats, dogs, birds, fish, horses, cows, sheep and goats live on the farm near the river.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June.
"""  # noqa: E501  (changing the corpus changes the tokenizer)


def _train_tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so merge counts are not all 1 (keeps merges meaningful).
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        token_id = tok.token_to_id(t)
        assert token_id is not None, t  # special tokens are always in the vocabulary
        ids[t] = token_id
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": None,
        "pad_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}, indent=2) + "\n"
    )
    return {"vocab_size": tok.get_vocab_size(), **ids}


def generate(
    path: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    seed: int = 0,
) -> Path:
    """Write config.json, model.safetensors and the tokenizer files into ``path``."""
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(out)
    vocab = int(tok["vocab_size"])
    head_dim = hidden_size // num_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "bos_token_id": tok[BOS],
        "eos_token_id": tok[EOS],
        "pad_token_id": tok[EOS],
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tok[BOS], "eos_token_id": tok[EOS]}, indent=2) + "\n"
    )

    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * std).contiguous()

    kv_dim = num_kv_heads * head_dim
    # Projections scaled ~1/sqrt(fan_in) keep activations O(1) through the layers;
    # a larger head spreads logits (std ~1), so greedy choices are not near-ties.
    proj = hidden_size**-0.5
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, hidden_size, std=1.0)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden_size)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden_size)
        w[p + "self_attn.q_proj.weight"] = normal(num_heads * head_dim, hidden_size, std=proj)
        w[p + "self_attn.k_proj.weight"] = normal(kv_dim, hidden_size, std=proj)
        w[p + "self_attn.v_proj.weight"] = normal(kv_dim, hidden_size, std=proj)
        w[p + "self_attn.o_proj.weight"] = normal(hidden_size, num_heads * head_dim, std=proj)
        w[p + "mlp.gate_proj.weight"] = normal(intermediate_size, hidden_size, std=proj)
        w[p + "mlp.up_proj.weight"] = normal(intermediate_size, hidden_size, std=proj)
        w[p + "mlp.down_proj.weight"] = normal(
            hidden_size, intermediate_size, std=intermediate_size**-0.5
        )
    w["model.norm.weight"] = torch.ones(hidden_size)
    w["lm_head.weight"] = normal(vocab, hidden_size, std=proj * 2.0)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---- other architectures ---------------------------------------------------------

#: ``config.json`` fields per architecture, on top of the common shape (hidden 128,
#: 4 layers, 2 query heads of 64 and 1 KV head: head_dim 64 suits vLLM's CPU backend).
#: Each architecture's own features are kept (biases, q/k norms, sandwich norms,
#: Granite's multipliers, experts); what would make a tiny model ill-conditioned or
#: slow to compare is tamed (sliding windows wider than any test prompt).
ARCHITECTURES: dict[str, dict[str, object]] = {
    "LlamaForCausalLM": {"model_type": "llama"},
    "Qwen2ForCausalLM": {"model_type": "qwen2", "use_sliding_window": False},
    "Qwen3ForCausalLM": {"model_type": "qwen3", "use_sliding_window": False},
    "MistralForCausalLM": {"model_type": "mistral", "sliding_window": None},
    "Phi3ForCausalLM": {"model_type": "phi3"},
    "Gemma2ForCausalLM": {
        "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 64, "sliding_window": 1024,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    },
    "Gemma3ForCausalLM": {
        "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 64, "sliding_window": 1024, "sliding_window_pattern": 2,
        "tie_word_embeddings": True,
    },
    "GraniteForCausalLM": {
        "model_type": "granite", "embedding_multiplier": 2.0, "residual_multiplier": 0.22,
        "attention_multiplier": 1 / 64, "logits_scaling": 1.0,
    },
    "Olmo2ForCausalLM": {"model_type": "olmo2"},
    # Gemma 1: served natively by vLLM, but no verified steering convention (the tests'
    # example of an architecture the engine refuses to steer).
    "GemmaForCausalLM": {
        "model_type": "gemma", "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    "MixtralForCausalLM": {
        "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": None,
    },
    "Qwen2MoeForCausalLM": {
        "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256,
        "decoder_sparse_step": 1, "norm_topk_prob": False, "use_sliding_window": False,
    },
    "Qwen3MoeForCausalLM": {
        "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 128, "decoder_sparse_step": 1, "norm_topk_prob": True,
        "use_sliding_window": False,
    },
}

#: Embedding std per architecture where the model scales its embeddings, so the stream
#: entering layer 0 has entries of std ~1 as in the Llama model (Gemma multiplies by
#: sqrt(hidden); Granite by its embedding_multiplier).
_EMBED_STD = {"GemmaForCausalLM": 0.03, "Gemma2ForCausalLM": 0.03, "Gemma3ForCausalLM": 0.03,
              "GraniteForCausalLM": 0.5}


#: Constant vectors set per architecture. Gemma ties its output head to the embedding
#: and norms every sublayer's output to sqrt(hidden) before adding it: with embeddings
#: small against the stream (else the logits just repeat the current token: its own
#: row dominates h . E), the final norm's gain (1 + w) spreads the logits again.
_VECTORS: dict[str, dict[str, float]] = {
    "GemmaForCausalLM": {"model.norm.weight": 3.0},
    "Gemma2ForCausalLM": {"model.norm.weight": 3.0},
    "Gemma3ForCausalLM": {"model.norm.weight": 3.0},
}


def generate_architecture(path: str | Path, architecture: str, *, seed: int = 0) -> Path:
    """A tiny random ``architecture`` model in ``path``: the shape of :func:`generate`'s
    Llama, built by ``transformers`` from a config and saved with ``save_pretrained``
    (so the checkpoint has the layout vLLM loads, e.g. per-expert MoE weights). Every
    matrix is drawn again from a seeded generator: same seed, same weights. Vectors
    (norm weights, biases) keep ``transformers``' constant initialisation."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(out)
    fields = dict(ARCHITECTURES[architecture])
    model_type = str(fields.pop("model_type"))
    hidden = 128
    config = AutoConfig.for_model(
        model_type, architectures=[architecture], hidden_size=hidden, intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=MAX_POSITIONS, vocab_size=int(tok["vocab_size"]),
        bos_token_id=tok[BOS], eos_token_id=tok[EOS], pad_token_id=tok[EOS],
        tie_word_embeddings=bool(fields.pop("tie_word_embeddings", False)),
        **fields,
    )
    config.dtype = torch.float32
    torch.manual_seed(seed)  # transformers' own init (overwritten below for matrices)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Each architecture draws its own weights (not the Llama's under another name).
    gen = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(architecture.encode()))
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights appear once
            if name in _VECTORS.get(architecture, {}):
                param.fill_(_VECTORS[architecture][name])
            if param.dim() < 2:
                if name.endswith(".bias"):  # small, so biases are exercised, not dominant
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
                continue
            if name.endswith("embed_tokens.weight"):
                std = _EMBED_STD.get(architecture, 1.0)
            elif name.startswith("lm_head"):
                std = 2.0 * hidden**-0.5  # spread logits: no near-ties
            else:
                std = param.shape[-1] ** -0.5  # ~1/sqrt(fan_in) keeps activations O(1)
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)
    model.save_pretrained(str(out))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tok[BOS], "eos_token_id": tok[EOS]}, indent=2) + "\n"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="steergate tiny-model", description=__doc__.splitlines()[0]
    )
    parser.add_argument("dir", help="output folder (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--architecture", default=None, choices=sorted(ARCHITECTURES),
        help="build this architecture with transformers (default: the hand-built Llama)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if Path(args.dir).exists() and not Path(args.dir).is_dir():
        print(f"steergate tiny-model: {args.dir} exists and is not a folder", file=sys.stderr)
        return 2
    if args.architecture is None:
        out = generate(args.dir, seed=args.seed)
        print(f"wrote tiny Llama to {out}")
    else:
        out = generate_architecture(args.dir, args.architecture, seed=args.seed)
        print(f"wrote tiny {args.architecture} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
