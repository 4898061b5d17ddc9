"""Write a tiny llama-architecture GGUF with random weights, for a real llama-server.

Run with the bench venv's python (it has ``gguf`` and numpy):
``python bench/llama_model.py OUT.gguf``. The model is meaningless (random weights,
seeded) but real to llama.cpp: its prompt processing, slots and prompt cache behave as
they would with any model, so what the server reports it reused is real. The vocabulary
is SentencePiece-style with byte fallback only (one token per byte of prompt), which
tokenizes any text; the chat template is ChatML.
"""

from __future__ import annotations

import sys

import gguf  # type: ignore[import-not-found]
import numpy as np

EMBED = 128
LAYERS = 2
HEADS = 4
FEED_FORWARD = 256
CONTEXT = 32768
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vocabulary() -> tuple[list[bytes], list[float], list[int]]:
    tokens = [b"<unk>", b"<s>", b"</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>".encode())
        types.append(gguf.TokenType.BYTE)
    # A few printable pieces so that generated text is readable.
    for piece in "abcdefghijklmnopqrstuvwxyz ":
        tokens.append(("\u2581" if piece == " " else piece).encode())
        types.append(gguf.TokenType.NORMAL)
    scores = [0.0] * len(tokens)
    return tokens, scores, [int(t) for t in types]


def write(path: str, seed: int = 7) -> None:
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocabulary()
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("modelrelay-bench-tiny")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(EMBED)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(EMBED // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)

    def tensor(name: str, *shape: int, scale: float = 0.05) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    tensor("token_embd.weight", len(tokens), EMBED)
    writer.add_tensor("output_norm.weight", np.ones(EMBED, dtype=np.float32))
    tensor("output.weight", len(tokens), EMBED)
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(EMBED, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(EMBED, dtype=np.float32))
        for part in ("q", "k", "v", "output"):
            tensor(f"blk.{i}.attn_{part}.weight", EMBED, EMBED)
        tensor(f"blk.{i}.ffn_gate.weight", FEED_FORWARD, EMBED)
        tensor(f"blk.{i}.ffn_up.weight", FEED_FORWARD, EMBED)
        tensor(f"blk.{i}.ffn_down.weight", EMBED, FEED_FORWARD)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    write(sys.argv[1])
