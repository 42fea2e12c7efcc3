"""A generated sentence embedder: a BERT-shaped GGUF (llama.cpp's ``bert`` architecture,
bidirectional attention, mean pooling, a WordPiece vocabulary) with seeded random weights.

No small embedding GGUF ships in a package on the registry this project can reach, so the
embeddings API, its tests and its bench run on this one: llama.cpp loads it as it loads
all-MiniLM or bge-small (the same tensors, keys and tokenizer kind), so the load, the
pooling, the batching of inputs and the context limit are real; the vectors mean nothing.
The same shape and seed always give the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType, PoolingType, TokenType

from localchat.models.demo import write_gguf_staged
from localchat.models.demo_vocab import build_vocab


@dataclass(frozen=True)
class BertShape:
    """Architecture numbers of a generated BERT."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_ff: int
    n_vocab: int
    context_length: int


# MiniLM-L6's depth at a quarter of its width, and a context short enough that a test's
# over-long input is a few hundred words.
EMBEDDING_SHAPES: dict[str, BertShape] = {
    "bert-tiny": BertShape("bert-tiny", 2, 128, 4, 512, 1024, 256),
    "bert-minilm": BertShape("bert-minilm", 6, 384, 12, 1536, 8192, 512),
}
# WordPiece's specials, first (their ids written to the header as well).
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PHANTOM_SPACE = "\u2581"  # a word's first piece: how llama.cpp's WPM vocabulary spells it


def bert_vocab(n_vocab: int) -> tuple[list[str], list[int]]:
    """The demo's SentencePiece pieces as a WordPiece vocabulary in llama.cpp's spelling
    (what convert_hf_to_gguf.py writes: a word's first piece with the phantom space, a
    continuation bare), behind BERT's specials; byte and control tokens left out."""
    pieces, _, types = build_vocab(n_vocab)
    kept = [p for p, t in zip(pieces, types, strict=True) if t == TokenType.NORMAL]
    tokens = list(BERT_SPECIALS) + [p for p in kept if p not in BERT_SPECIALS]
    tokens = tokens[:n_vocab]
    while len(tokens) < n_vocab:  # the header's vocabulary size is exact
        tokens.append(f"[unused{len(tokens)}]")
    kinds = [TokenType.CONTROL] * len(BERT_SPECIALS) + [TokenType.NORMAL] * (
        n_vocab - len(BERT_SPECIALS)
    )
    kinds[BERT_SPECIALS.index("[UNK]")] = TokenType.UNKNOWN
    return tokens, [int(k) for k in kinds]


def _add_metadata(writer: GGUFWriter, shape: BertShape) -> None:
    writer.add_name(f"localchat-demo-{shape.name}")
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(PoolingType.MEAN)
    tokens, kinds = bert_vocab(shape.n_vocab)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_token_type_count(2)
    for special, add in zip(
        BERT_SPECIALS,
        (writer.add_pad_token_id, writer.add_unk_token_id, writer.add_bos_token_id,
         writer.add_sep_token_id, writer.add_mask_token_id),
        strict=True,
    ):  # fmt: skip
        add(BERT_SPECIALS.index(special))


def _add_tensors(writer: GGUFWriter, shape: BertShape, rng: np.random.Generator) -> None:
    """BERT's tensors in llama.cpp's names: embeddings (token, type, position) and their
    norm, then per layer Q/K/V/output with biases, the FFN and two layer norms."""
    e = shape.n_embd

    def matrix(name: str, rows: int, cols: int, dtype: type = np.float16) -> None:
        std = np.float32(1.0 / np.sqrt(cols))  # fan-in scaled: every layer moves the stream
        writer.add_tensor(name, (rng.standard_normal((rows, cols), np.float32) * std).astype(dtype))

    def vector(name: str, size: int, fill: float | None = None) -> None:
        if fill is None:
            writer.add_tensor(
                name, (rng.standard_normal(size, np.float32) * 0.02).astype(np.float32)
            )
        else:
            writer.add_tensor(name, np.full(size, fill, dtype=np.float32))

    matrix("token_embd.weight", shape.n_vocab, e)
    # Added to the input as they are (no row lookup into F16): F32, as the converter keeps.
    matrix("token_types.weight", 2, e, np.float32)
    matrix("position_embd.weight", shape.context_length, e, np.float32)
    vector("token_embd_norm.weight", e, 1.0)
    vector("token_embd_norm.bias", e, 0.0)
    for i in range(shape.n_layer):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            matrix(f"blk.{i}.{part}.weight", e, e)
            vector(f"blk.{i}.{part}.bias", e)
        vector(f"blk.{i}.attn_output_norm.weight", e, 1.0)
        vector(f"blk.{i}.attn_output_norm.bias", e, 0.0)
        matrix(f"blk.{i}.ffn_up.weight", shape.n_ff, e)
        vector(f"blk.{i}.ffn_up.bias", shape.n_ff)
        matrix(f"blk.{i}.ffn_down.weight", e, shape.n_ff)
        vector(f"blk.{i}.ffn_down.bias", e)
        vector(f"blk.{i}.layer_output_norm.weight", e, 1.0)
        vector(f"blk.{i}.layer_output_norm.bias", e, 0.0)


def make_embedding_model(out: Path, shape: str = "bert-tiny", seed: int = 0) -> Path:
    """Write a generated BERT embedder (F16) to ``out``, staged beside it; returns ``out``."""
    dims = EMBEDDING_SHAPES[shape]

    def fill(writer: GGUFWriter) -> None:
        _add_metadata(writer, dims)
        _add_tensors(writer, dims, np.random.default_rng(seed))

    return write_gguf_staged(out, "bert", fill)


def ensure_embedding_model(directory: Path, shape: str = "bert-tiny", seed: int = 0) -> Path:
    """The cached generated embedder, made on first use."""
    path = directory / f"demo-{shape}-F16-s{seed}.gguf"
    return path if path.exists() else make_embedding_model(path, shape, seed)
