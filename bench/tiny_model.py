"""A tiny random-weight Llama written from scratch, for running a stock engine in tests.

:func:`write_tiny_llama` fills a folder the way a Hugging Face model repository is laid out:
``config.json`` (``LlamaForCausalLM``), ``model.safetensors`` (float32 weights drawn from a
seeded normal distribution), ``tokenizer.json`` (a byte-level BPE trained here with the
``tokenizers`` library on generated text, with a post-processor that writes BOS) and
``tokenizer_config.json`` (BOS/EOS and a chat template). Nothing is downloaded. The same seed
gives the same bytes.

The shape suits vLLM's CPU backend: head dimension 64 (its attention needs at least 64), two
layers, 128 hidden units; about 600 thousand parameters, 2.4 MB.

Run ``python -m bench.tiny_model FOLDER`` to write one by hand.
"""

from __future__ import annotations

import array
import json
import random
import struct
import sys
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

__all__ = ["CHAT_TEMPLATE", "MODEL_CONFIG", "write_tiny_llama"]

#: Writes BOS itself, so chat prompts are encoded without special tokens (as vLLM does).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_SPECIALS = ("<unk>", "<s>", "</s>")
_VOCAB_SIZE = 1024

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": _VOCAB_SIZE,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def write_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """Write the model and its tokenizer into ``folder`` (created if missing).

    Args:
        folder: where to write.
        seed: seeds the training text and the weights.

    Returns:
        ``folder``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(seed)
    assert tokenizer.get_vocab_size() <= _VOCAB_SIZE, "tokenizer outgrew the embedding table"
    tokenizer.save(str(folder / "tokenizer.json"))
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    config = {**MODEL_CONFIG, "bos_token_id": bos, "eos_token_id": eos}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos}))
    _write_safetensors(folder / "model.safetensors", _weights(config, seed))
    return folder


def _train_tokenizer(seed: int) -> tokenizers.Tokenizer:
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(600)]
    lines = [" ".join(rng.choices(words, k=rng.randint(4, 16))).capitalize() + "."
             for _ in range(3000)]
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_VOCAB_SIZE, special_tokens=list(_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tokenizer


def _weights(config: dict[str, int], seed: int) -> dict[str, tuple[list[int], array.array]]:
    rng = random.Random(seed + 1)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads, head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                 config["head_dim"])

    def normal(*shape: int) -> tuple[list[int], array.array]:
        count = 1
        for n in shape:
            count *= n
        return list(shape), array.array("f", (rng.gauss(0.0, 0.02) for _ in range(count)))

    def ones(n: int) -> tuple[list[int], array.array]:
        return [n], array.array("f", [1.0] * n)

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden),
               "model.norm.weight": ones(hidden), "lm_head.weight": normal(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
            p + "input_layernorm.weight": ones(hidden),
            p + "post_attention_layernorm.weight": ones(hidden),
        }
    return tensors


def _write_safetensors(path: Path, tensors: dict[str, tuple[list[int], array.array]]) -> None:
    """The safetensors layout: an 8-byte little-endian header length, a JSON header giving
    each tensor's dtype, shape and byte range, then the raw little-endian data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        shape, values = tensors[name]
        if sys.byteorder != "little":
            values.byteswap()
        blob = values.tobytes()
        header[name] = {"dtype": "F32", "shape": shape,
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for blob in blobs:
            out.write(blob)


if __name__ == "__main__":
    print(write_tiny_llama(Path(sys.argv[1])))
