"""The shapes of the Llama-style decoders :mod:`workers.torch.model` builds: a configuration's
dimensions, the named ones with random weights, and a Hugging Face ``config.json`` read into
one. No PyTorch here, so the benchmarks' arithmetic (:mod:`bench.gpu.flops`) and the CPU-only
tests read a shape without importing it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CONFIGS", "ModelConfig", "config_from_folder"]


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-style decoder.

    Attributes:
        name: the configuration's name, or the folder it was read from.
        rope_scaling: Llama 3 frequency scaling as sorted (key, value) pairs (``factor``,
            ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``);
            empty for plain RoPE.
        init_std: standard deviation of random weights (norms start at one).
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    rope_scaling: tuple[tuple[str, float], ...] = field(default=())
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: {self.num_heads} heads do not group over {self.num_kv_heads} "
                f"KV heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"{self.name}: rotary positions need an even head_dim")

    @property
    def num_params(self) -> int:
        """Parameters, the output projection counted once when tied."""
        h, d, q, kv = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
        attn = h * d * (2 * q + 2 * kv) + (d * (q + 2 * kv) if self.attention_bias else 0)
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head


#: Named configurations with random weights: ``tiny`` for tests, ``llama-1b`` the calibrated shape.
CONFIGS: dict[str, ModelConfig] = {
    # A larger init std than a real model's spreads the logits, so greedy argmax is not decided
    # by rounding between the paged and the dense forward.
    "tiny": ModelConfig(
        "tiny",
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        init_std=0.2,
    ),
    "llama-1b": ModelConfig(
        "llama-1b",
        vocab_size=32000,
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=8192,
    ),
}


def config_from_folder(path: Path) -> ModelConfig:
    """Read a Hugging Face ``config.json`` (Llama or Qwen2 layout).

    Raises:
        ValueError: no ``config.json``, or an architecture this decoder does not implement.
    """
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"{path} has no config.json: not a model folder")
    raw = json.loads(file.read_text())
    kind = raw.get("model_type", "llama")
    if kind not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"{file}: model_type {kind!r} is not a Llama-style decoder")
    scaling = raw.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if scaling and rope_type != "llama3":
        raise ValueError(f"{file}: rope_scaling {rope_type!r} is not supported (only llama3)")
    heads = raw["num_attention_heads"]
    return ModelConfig(
        name=str(path),
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads", heads),
        intermediate_size=raw["intermediate_size"],
        head_dim=raw.get("head_dim") or 0,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        attention_bias=bool(raw.get("attention_bias", kind == "qwen2")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_scaling=tuple(
            sorted((k, float(v)) for k, v in scaling.items() if k not in ("rope_type", "type"))
        ),
    )
