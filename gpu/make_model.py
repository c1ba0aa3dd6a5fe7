#!/usr/bin/env python3
"""Write a model folder vLLM serves with ``--load-format dummy``: no weights, only the shape.

The folder holds ``config.json`` (a Qwen3 architecture: ``8b`` is the Qwen3-8B shape, 144 KiB of KV per
token in bf16; ``1b``; ``tiny``), a byte-level BPE tokenizer trained on this Python's standard library
sources (deterministic, no download), and a ChatML chat template that either keeps earlier turns'
reasoning (``keep``) or drops it (``strip``, as several reasoning models' templates do). gpu/setup.sh writes
``model-8b-keep``, ``model-8b-strip``, ``model-1b-keep`` and ``model-1b-strip`` into the kit folder; the
engines of gpu/engines.py serve them.

usage: python3 gpu/make_model.py OUT_DIR [--size 8b|1b|tiny] [--template keep|strip]
needs: tokenizers (vLLM brings it)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig
from collections.abc import Iterator

SIZES = {  # hidden, intermediate, layers, heads, kv_heads, head_dim
    "8b": (4096, 12288, 36, 32, 8, 128),  # Qwen3-8B shape: 144 KiB of KV per token in bf16
    "1b": (2048, 6144, 28, 16, 8, 128),
    "tiny": (512, 1536, 4, 8, 4, 64),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
KEEP = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and m.get('reasoning_content') %}"
    "{{- '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- (m['content'] or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
STRIP = (
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and m.get('reasoning_content') and loop.index0 > ns.last %}"
    "{{- '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- (m['content'] or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _sources() -> Iterator[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    for path in sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True))[:3000]:
        try:
            with open(path, encoding="utf-8") as fh:
                yield fh.read()
        except (UnicodeDecodeError, OSError):
            continue


def train_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32000,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_sources(), trainer)
    tok.save(path)


def config(size: str) -> dict[str, object]:
    h, inter, layers, heads, kvh, hd = SIZES[size]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kvh,
        "head_dim": hd,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def write(out: str, size: str, template: str, *, tokenizer: bool = True) -> None:
    os.makedirs(out, exist_ok=True)
    if tokenizer:
        train_tokenizer(os.path.join(out, "tokenizer.json"))
    files = {
        "config.json": config(size),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 40960,
            "add_bos_token": False,
            "chat_template": KEEP if template == "keep" else STRIP,
        },
        "generation_config.json": {"bos_token_id": 0, "eos_token_id": 2},
    }
    for name, body in files.items():
        with open(os.path.join(out, name), "w") as fh:
            json.dump(body, fh, indent=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--size", default="8b", choices=sorted(SIZES))
    ap.add_argument("--template", default="keep", choices=["keep", "strip"])
    a = ap.parse_args(argv)
    write(a.out, a.size, a.template)
    _, _, layers, _, kvh, hd = SIZES[a.size]
    kib = 2 * layers * kvh * hd * 2 // 1024
    print(f"wrote {a.out}: {a.size}, template={a.template}, KV per token {kib} KiB (bf16)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
