#!/usr/bin/env python3
"""Create a randomly initialised Llama model directory of a realistic shape, with the Llama 2 tokenizer, for
benchmarks that must not download anything.

    .venv/bin/python scripts/dev/make_random_model.py --shape 110m --out /tmp/shuttle-models/llama-110m
    python scripts/dev/make_random_model.py --shape 1b --device cuda --dtype bfloat16   # scripts/gpu_check.sh's
    .venv/bin/python scripts/dev/make_random_model.py --draft-of /tmp/shuttle-models/llama-110m --layers 2 \
        --out /tmp/shuttle-models/llama-110m-draft2   # a draft model for --speculative-config's draft_model
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

SHAPES = {
    # The 110M-parameter Llama 2 shape of llama2.c's stories110M.
    "110m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                 intermediate_size=2048, max_position_embeddings=1024),
    # TinyLlama 1.1B's shape (GQA 32 heads over 4 KV heads, untied): scripts/gpu_check.sh's bench model.
    "1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
               intermediate_size=5632, max_position_embeddings=2048, tie_word_embeddings=False),
    # Llama 3 8B's layers (GQA 32 heads over 8 KV heads, head_dim 128, MLP 14336), untied, with the Llama 2
    # tokenizer's 32000-token vocabulary: the GPU check's roofline stage
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=32000, tie_word_embeddings=False),
    # The 1B shape's kind (GQA, the 32000-token vocabulary) at a size a CPU builds in a second: gpu_check --dry-run.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=512),
    # The GPU check's in-process stages (GQA, head_dim 32): stories260K's head_dim 8 is below the 16 that
    # inductor's flex kernels take, so on CUDA flex refuses it.
    "check": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=688, max_position_embeddings=1024),
    "15m": dict(hidden_size=288, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=6,
                intermediate_size=768, max_position_embeddings=256),
}
DEFAULT_TOKENIZER = Path(__file__).resolve().parents[3] / "shared" / "tokenizers" / "llama2"


def make_random_model(out: Path, shape: str = "110m", tokenizer_dir: Path = DEFAULT_TOKENIZER, seed: int = 0,
                      device: str = "cpu", dtype: str = "float32", max_positions: int | None = None) -> Path:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer files into `out`.

    Args:
        device: where the weights are initialised (cuda is much faster at 1B).
        dtype: the dtype the weights are saved in (and config.json's dtype).
        max_positions: max_position_embeddings instead of the shape's (RoPE has no learned positions, so only the
            longest context a server accepts changes).
    Raises:
        KeyError: unknown shape. FileNotFoundError: tokenizer_dir lacks tokenizer.json.
    """
    if not (tokenizer_dir / "tokenizer.json").exists():
        raise FileNotFoundError(f"{tokenizer_dir}/tokenizer.json")
    config = LlamaConfig(**{"vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
                            **SHAPES[shape], **({"max_position_embeddings": max_positions} if max_positions else {})})
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def truncate_model(source: Path, out: Path, num_layers: int) -> Path:
    """Write a draft model for `source` into `out`: its first `num_layers` decoder layers with its embeddings,
    final norm, output head and tokenizer files (a layer-skip draft: same vocabulary, and on a trained model a
    fair guess of its next token at a fraction of its cost).

    Raises:
        ValueError: num_layers is not below the source's layer count.
    """
    model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    layers = model.model.layers
    if not 0 < num_layers < len(layers):
        raise ValueError(f"--layers must be between 1 and {len(layers) - 1}, got {num_layers}")
    model.model.layers = layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for path in source.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(path, out / path.name)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="110m")
    parser.add_argument("--out", type=Path, default=None, help="default: /tmp/shuttle-models/llama-SHAPE")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--device", default="cpu", help="where to initialise the weights")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-position-embeddings", type=int, default=None,
                        help="longest context instead of the shape's (e.g. 4096 for a 2,000-token prompt)")
    parser.add_argument("--draft-of", type=Path, default=None, metavar="MODEL_DIR",
                        help="instead: write a draft model of MODEL_DIR's first --layers layers")
    parser.add_argument("--layers", type=int, default=2, help="--draft-of's decoder layers")
    args = parser.parse_args()
    if args.draft_of is not None:
        out = truncate_model(args.draft_of, args.out or Path(f"{args.draft_of}-draft{args.layers}"), args.layers)
        print(f"wrote {out}")
        return 0
    out = make_random_model(args.out or Path(f"/tmp/shuttle-models/llama-{args.shape}"), args.shape, args.tokenizer,
                            device=args.device, dtype=args.dtype, max_positions=args.max_position_embeddings)
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig.from_pretrained(out)).parameters())
    print(f"wrote {out} ({params / 1e6:.1f}M parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
