#!/usr/bin/env python3
"""Write a small Qwen3-architecture model whose greedy output depends on its history.

vLLM's ``--load-format dummy`` fills weights with tiny uniform values: attention is then nearly
uniform and the output ignores what the history says (on the H200 a changed history token left the
first token's top-5 logprobs unchanged to 4 decimals). This writes real random weights instead, scaled so that

* attention is sharp: Qwen3 normalises q and k per head (``q_norm``, ``k_norm``), so the sharpness is
  set by those norms' weights (``--qk-gain``; logits have a standard deviation of about gain²);
* what attention brings in is as large as the token's own embedding (unit-variance projections);
* logits are far apart (``--logit-std``), so bf16 rounding rarely flips the greedy choice.

Only numpy is needed (no torch, no safetensors package): the weights are written as a bf16
safetensors file by hand. The tokenizer and chat template are copied from a folder written by
gpu/make_model.py (``model-1b-keep`` or ``-strip``), so prompts tokenize as on the other model folders.
``forward`` is a numpy reference of the same network, used by ``--check`` here and by gpu/correctness.py
on the GPU host to confirm vLLM loaded these weights.

usage: make_sharp_model.py OUT --tokenizer-from DIR [--check] [shape and scale options]
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass(frozen=True)
class Shape:
    """A Qwen3 shape. The default keeps the 8b model's KV block layout (8 KV heads of 128): one block of
    one layer is 32 KiB, as on the 8b model, so NIXL sees descriptors of the same size."""

    hidden: int = 1024
    inter: int = 3072
    layers: int = 4
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 32000


@dataclass(frozen=True)
class Scales:
    qk_gain: float = 2.5  # q_norm and k_norm weights: attention logits have std of about qk_gain**2
    logit_std: float = 8.0  # standard deviation of the output logits
    mlp_gain: float = 0.5  # MLP output relative to the attention output
    seed: int = 0


def qwen3_config(shape: Shape) -> dict[str, object]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.inter,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "vocab_size": shape.vocab,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def make_weights(shape: Shape, scales: Scales) -> dict[str, np.ndarray]:
    """All tensors, float32, in the names and layouts vLLM's Qwen3 loader expects."""
    rng = np.random.default_rng(scales.seed)

    def normal(rows: int, cols: int, std: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)).astype(np.float32)

    h, hd = shape.hidden, shape.head_dim
    q_out, kv_out = shape.heads * hd, shape.kv_heads * hd
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(shape.vocab, h, 1.0)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "self_attn.q_proj.weight"] = normal(q_out, h, h**-0.5)
        w[p + "self_attn.k_proj.weight"] = normal(kv_out, h, h**-0.5)
        w[p + "self_attn.v_proj.weight"] = normal(kv_out, h, h**-0.5)
        w[p + "self_attn.o_proj.weight"] = normal(h, q_out, q_out**-0.5)
        w[p + "self_attn.q_norm.weight"] = np.full(hd, scales.qk_gain, np.float32)
        w[p + "self_attn.k_norm.weight"] = np.full(hd, scales.qk_gain, np.float32)
        w[p + "mlp.gate_proj.weight"] = normal(shape.inter, h, h**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(shape.inter, h, h**-0.5)
        # silu(g)*u has a standard deviation of about 0.6 for unit-variance g and u
        w[p + "mlp.down_proj.weight"] = normal(h, shape.inter, scales.mlp_gain / (0.6 * shape.inter**0.5))
    w["model.norm.weight"] = np.ones(h, np.float32)
    w["lm_head.weight"] = normal(shape.vocab, h, scales.logit_std * h**-0.5)
    return w


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), rounding to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> int:
    """Write bf16 safetensors by hand (8-byte header length, JSON header, raw little-endian data)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        n = t.size * 2
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            f.write(to_bf16(t).tobytes())
    return 8 + len(raw) + offset


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Read back a bf16 file written by ``write_safetensors`` (as float32)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out: dict[str, np.ndarray] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        bits = np.frombuffer(data[base + a : base + b], dtype=np.uint16).reshape(meta["shape"])
        out[name] = from_bf16(bits)
    return out


# -- numpy reference forward ------------------------------------------------------------------


def _rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, theta: float = 1e6) -> np.ndarray:
    """Neox-style rotary embedding (rotate_half), as vLLM's default for Qwen3. x: [T, H, D]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    cos, sin = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def forward(w: dict[str, np.ndarray], shape: Shape, ids: list[int]) -> np.ndarray:
    """Logits (float32) of the last position for the prompt ``ids``."""
    t = len(ids)
    hd, nh, nkv = shape.head_dim, shape.heads, shape.kv_heads
    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    pos = np.arange(t)
    mask = np.triu(np.full((t, t), -np.inf, np.float32), 1)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        hdn = _rms(x, w[p + "input_layernorm.weight"])
        q = (hdn @ w[p + "self_attn.q_proj.weight"].T).reshape(t, nh, hd)
        k = (hdn @ w[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, hd)
        v = (hdn @ w[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, hd)
        q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"]), pos)
        k = _rope(_rms(k, w[p + "self_attn.k_norm.weight"]), pos)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.float32(hd**0.5) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = np.einsum("hts,shd->thd", s, v).reshape(t, nh * hd)
        x = x + a @ w[p + "self_attn.o_proj.weight"].T
        hdn = _rms(x, w[p + "post_attention_layernorm.weight"])
        g = hdn @ w[p + "mlp.gate_proj.weight"].T
        u = hdn @ w[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    last = _rms(x[-1], w["model.norm.weight"])
    return (w["lm_head.weight"] @ last).astype(np.float32)


def load(folder: Path) -> tuple[dict[str, np.ndarray], Shape]:
    """The weights (as bf16 rounded them) and shape of a folder this script wrote."""
    meta = json.loads((folder / "turnkv_sharp.json").read_text())
    return read_safetensors(folder / "model.safetensors"), Shape(**meta["shape"])


def sensitivity(
    w: dict[str, np.ndarray], shape: Shape, *, trials: int, length: int, seed: int, allowed: list[int] | None = None
) -> dict[str, float]:
    """How often changing one early history token changes the greedy next token (restricted to
    ``allowed`` when given), and the median gap between the two best logits."""
    rng = np.random.default_rng(seed)
    cand = np.asarray(allowed) if allowed else np.arange(100, shape.vocab)
    changed, gaps = 0, []
    for _ in range(trials):
        ids = [int(i) for i in rng.choice(np.arange(100, shape.vocab), size=length)]
        base = forward(w, shape, ids)[cand]
        top2 = np.sort(base)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        alt = list(ids)
        j = int(rng.integers(1, length // 2))
        alt[j] = int(rng.integers(100, shape.vocab))
        changed += int(np.argmax(forward(w, shape, alt)[cand]) != np.argmax(base))
    return {"changed_fraction": changed / trials, "median_top2_gap": float(np.median(gaps))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--tokenizer-from",
        type=Path,
        required=True,
        help="a make_model.py folder (tokenizer.json, tokenizer_config.json, generation_config.json)",
    )
    for f in Shape.__dataclass_fields__:
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(Shape(), f))
    ap.add_argument("--qk-gain", type=float, default=Scales.qk_gain)
    ap.add_argument("--logit-std", type=float, default=Scales.logit_std)
    ap.add_argument("--mlp-gain", type=float, default=Scales.mlp_gain)
    ap.add_argument("--seed", type=int, default=Scales.seed)
    ap.add_argument(
        "--check",
        action="store_true",
        help="read the file back and measure history sensitivity with the numpy reference",
    )
    a = ap.parse_args(argv)
    shape = Shape(**{f: getattr(a, f) for f in Shape.__dataclass_fields__})
    scales = Scales(qk_gain=a.qk_gain, logit_std=a.logit_std, mlp_gain=a.mlp_gain, seed=a.seed)
    missing = [f for f in TOKENIZER_FILES if not (a.tokenizer_from / f).is_file()]
    if missing:
        print(f"make_sharp_model: {a.tokenizer_from} lacks {missing}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(a.tokenizer_from / f, a.out / f)
    (a.out / "config.json").write_text(json.dumps(qwen3_config(shape), indent=1))
    (a.out / "turnkv_sharp.json").write_text(json.dumps({"shape": asdict(shape), "scales": asdict(scales)}, indent=1))
    size = write_safetensors(a.out / "model.safetensors", make_weights(shape, scales))
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2
    print(
        f"wrote {a.out}: {size / 2**20:.0f} MiB of bf16 weights, KV {kv // 1024} KiB per token, "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    if a.check:
        w, _ = load(a.out)
        print(json.dumps(sensitivity(w, shape, trials=20, length=200, seed=1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
