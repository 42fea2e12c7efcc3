"""The offline model factory: seeded random-weight llama-architecture GGUF files.

Random weights talk nonsense but give real speed, memory and KV-cache behaviour, so tests,
benchmarks and users without a network all get a model that llama.cpp really runs. The
tokenizer is real, in one of the kinds in ``TOKENIZERS``: a SentencePiece-style vocabulary
(byte fallback, BOS/EOS, ChatML control tokens) without or with the space prefix, or a GPT-2
style byte-level BPE vocabulary with merges under the GPT-2, Llama 3 or Qwen2 pre-tokenizer.
Every kind carries the ChatML control tokens and chat template, so tests can check prompt
tokenization against llama.cpp for each kind. Quantized variants come from llama.cpp's own
quantizer. The same shape, quant, seed and tokenizer always give the same bytes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.gguf_writer import WriterState

from localchat.errors import UsageError
from localchat.models.demo_shapes import ADDED_TOKENS, QUANTS, SHAPES, TOKENIZERS, ModelShape
from localchat.models.demo_vocab import (
    build_bpe_vocab,
    build_vocab,
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ``tokenizer.ggml.pre`` of each BPE kind: the names llama.cpp's loader knows. It spells GPT-2's
# "gpt-2" ("gpt2" is refused as an unknown pre-tokenizer) and Llama 3's "llama-bpe" (what
# convert_hf_to_gguf.py writes for Llama 3 models).
_BPE_PRE: dict[str, str] = {"gpt2": "gpt-2", "llama3": "llama-bpe", "qwen2": "qwen2"}

# BOS of each BPE kind and whether prompts start with it, as in the real models: Llama 3 adds
# <|begin_of_text|>; GPT-2 and Qwen2 name <|endoftext|> (which llama.cpp also counts as an
# end-of-generation token) and add nothing.
_BPE_BOS: dict[str, tuple[str, bool]] = {
    "gpt2": ("<|endoftext|>", False),
    "llama3": ("<|begin_of_text|>", True),
    "qwen2": ("<|endoftext|>", False),
}


# The generated model the app and ``ask`` fall back to when the starter model cannot be had
# (offline, quick to make).
APP_DEMO_SHAPE, APP_DEMO_QUANT = "small", "Q4_K_M"


def _check_tokenizer(tokenizer: str) -> None:
    """Refuse an unknown kind in one line before any file or cache path is made for it."""
    if tokenizer not in TOKENIZERS:
        raise UsageError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")


def _add_spm_tokenizer(
    writer: GGUFWriter, n_vocab: int, space_prefix: bool, added: tuple[str, ...] = ()
) -> None:
    """The SentencePiece vocabulary ("llama" model) with BOS added to every prompt, and the
    ``added`` tokens whole."""
    tokens, scores, types = build_vocab(n_vocab, added)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    # Without the prefix (like Qwen's and Llama 3's tokenizers) no space is invented after
    # control tokens, so the rendered template and the tokens say exactly the same thing;
    # with it (Llama 2, Mistral) llama.cpp starts the text after every control token, and
    # the prompt's first text, with a space.
    writer.add_add_space_prefix(space_prefix)


def _add_bpe_tokenizer(writer: GGUFWriter, n_vocab: int, tokenizer: str) -> None:
    """The byte-level BPE vocabulary ("gpt2" model) under this kind's pre-tokenizer."""
    tokens, types, merges = build_bpe_vocab(n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_BPE_PRE[tokenizer])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    bos, add_bos = _BPE_BOS[tokenizer]
    writer.add_bos_token_id(tokens.index(bos))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(False)


# Where a block of each weight type keeps its f16 scales (ggml-common.h's block layouts): a
# speed model's random blocks get sane scales there, so its numbers stay finite.
_SCALE_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
    "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82),
    # What llama.cpp's quantizer falls back to where rows do not divide into k-quant blocks
    # (Q5_K_M's Q5_1, older versions' IQ4_NL) and IQ4_XS: a mix model may hold them.
    "Q4_1": (0, 2), "Q5_1": (0, 2), "IQ4_NL": (0,), "IQ4_XS": (0,),
}  # fmt: skip
SPEED_TYPES: tuple[str, ...] = ("F16", *_SCALE_OFFSETS)
# What a file's matrices hold: None, normal F16 weights (a model that runs); a type name,
# random blocks of that type in every matrix; a mapping, each tensor's type by its name.
WeightTypes = str | Mapping[str, str] | None


def _random_blocks(rng: np.random.Generator, weights: int, weight_type: str) -> np.ndarray:
    """``weights`` weights of ``weight_type`` as random block bytes, flat: what llama.cpp
    reads and how fast does not depend on the values, so no quantizer needs to run."""
    if weight_type == "F16":  # random halves, the top exponent bit cleared: finite, under 2
        bits = _random_bytes(rng, weights * 2).view(np.uint16)
        bits &= np.uint16(0xBFFF)  # in place: fresh memory costs a fault per page in a VM
        return bits.view(np.float16)
    kind = GGMLQuantizationType[weight_type]
    block_weights, block_bytes = GGML_QUANT_SIZES[kind]
    n_blocks = weights // block_weights
    blocks = _random_bytes(rng, n_blocks * block_bytes).reshape(n_blocks, block_bytes)
    scale = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[weight_type]:
        blocks[:, offset : offset + 2] = scale
    return blocks.reshape(-1)


def _block_matrix(pool: np.ndarray, rows: int, cols: int, weight_type: str) -> np.ndarray:
    """The first ``rows`` x ``cols`` weights of a ``_random_blocks`` pool, as a matrix."""
    if weight_type == "F16":
        return pool[: rows * cols].reshape(rows, cols)
    block_weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[weight_type]]
    row_bytes = cols // block_weights * block_bytes
    return pool[: rows * row_bytes].reshape(rows, row_bytes)


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` random bytes, straight from the generator's 64-bit words (twice as fast as
    drawing bytes one by one: a 1B-shaped file's gigabyte is made in a second less)."""
    words = rng.bit_generator.random_raw(-(-n // 8))
    return np.asarray(words, dtype=np.uint64).view(np.uint8)[:n]


def write_staged(
    out: Path,
    shape: ModelShape,
    seed: int,
    tokenizer: str = "spm",
    weight_types: WeightTypes = None,
    file_type: LlamaFileType | None = LlamaFileType.MOSTLY_F16,
) -> None:
    """``_write_model`` into a hidden file beside ``out``, renamed in once whole."""
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        _write_model(shape, seed, tmp, tokenizer, weight_types, file_type)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half file behind
        raise
    tmp.replace(out)


def write_gguf_staged(out: Path, architecture: str, fill: Callable[[GGUFWriter], None]) -> Path:
    """A GGUF of ``architecture`` whose metadata and tensors ``fill`` adds, written into a
    hidden file beside ``out`` and renamed in once whole (the generated embedder and
    projectors); returns ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    writer = GGUFWriter(str(tmp), architecture)
    try:
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)  # a full disk leaves no half file behind
        raise
    writer.close()
    tmp.replace(out)
    return out


def write_over(
    out: Path, shape: ModelShape, weight_types: WeightTypes, file_type: LlamaFileType | None
) -> None:
    """``_write_model`` over the bytes of the file at ``out`` (made if missing), in place: its
    pages are rewritten, not freed and taken anew. The calibration writes each of its files
    into one this way: fresh memory costs a fault per page in a virtual machine (nine fresh
    files of 200 MB took 12 s to write there, each rewritten one 0.08 s). Not atomic: for
    scratch files only."""
    _write_model(shape, 0, out, weight_types=weight_types, file_type=file_type, in_place=True)


def write_header_only(
    out: Path, shape: ModelShape, weight_types: WeightTypes, file_type: LlamaFileType | None
) -> None:
    """A file of ``shape`` in ``weight_types`` whose tensor data is a hole (a sparse file of
    the full length): what a header reader sees of the model, made in no time and no disk.
    For figures read off a header (what a token reads, what a plan predicts), never to run."""
    _write_model(shape, 0, out, weight_types=weight_types, file_type=file_type, header_only=True)


class _InPlaceWriter(GGUFWriter):
    """A GGUF writer that opens its file without truncating it, and cuts it to the length
    written when it closes."""

    def open_output_file(self, path: Path | None = None) -> None:
        if self.state is WriterState.EMPTY and self.fout is not None:
            return
        self.path = path or self.path
        assert self.path is not None
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.fout = [os.fdopen(descriptor, "wb")]  # no truncation: the fd is open
        self.state = WriterState.EMPTY

    def close(self) -> None:
        for fout in self.fout or []:
            try:
                fout.truncate(fout.tell())
            finally:
                fout.close()
        self.fout = None


def _write_model(
    shape: ModelShape,
    seed: int,
    out: Path,
    tokenizer: str = "spm",
    weight_types: WeightTypes = None,
    file_type: LlamaFileType | None = LlamaFileType.MOSTLY_F16,
    in_place: bool = False,
    header_only: bool = False,
) -> None:
    """Seeded random weights: normal F16 matrices (a model that runs), or with
    ``weight_types`` random blocks of those types (a model that is only timed or measured);
    ``header_only``: no weights at all (``write_header_only``)."""
    writer = (_InPlaceWriter if in_place else GGUFWriter)(str(out), shape.architecture)
    _add_metadata(writer, shape, tokenizer, file_type)
    tensors = _TensorAdder(writer, shape, np.random.default_rng(seed), weight_types, header_only)
    _add_tensors(tensors)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        if header_only:
            _write_tensor_hole(writer)
        else:
            writer.write_tensors_to_file()
    finally:  # a full disk does not keep the file open (its space would come back late)
        writer.close()


def _add_metadata(
    writer: GGUFWriter, shape: ModelShape, tokenizer: str, file_type: LlamaFileType | None
) -> None:
    """The header's keys: the shape llama.cpp builds the model from, the tokenizer and the
    chat template."""
    suffix = "" if tokenizer == "spm" else f"-{tokenizer}"
    writer.add_name(f"localchat-demo-{shape.name}{suffix}")
    if file_type is not None:  # one quantized type throughout has no llama.cpp file type name
        writer.add_file_type(file_type)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_vocab_size(shape.n_vocab)
    if shape.architecture == "qwen2vl":  # M-RoPE's sections of the rotated half, as Qwen2-VL's
        third = shape.head_dim // 2 // 8  # [16, 24, 24, 0] of 64: here 2/8, 3/8, 3/8 of it
        writer.add_rope_dimension_sections([2 * third, 3 * third, 3 * third, 0])
    if shape.architecture == "gemma3":
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_sliding_window(shape.sliding_window)
    if tokenizer in _BPE_PRE:
        _add_bpe_tokenizer(writer, shape.n_vocab, tokenizer)
    else:
        _add_spm_tokenizer(
            writer,
            shape.n_vocab,
            space_prefix=tokenizer == "spm-space",
            added=ADDED_TOKENS.get(tokenizer, ()),
        )
    writer.add_chat_template(CHATML_TEMPLATE)


@dataclass
class _TensorAdder:
    """Adds a file's tensors to its writer: each matrix in its weight type, from the seeded
    generator (the order of the calls is the order of the draws: the same file each time);
    ``header_only``, each tensor's description without data."""

    writer: GGUFWriter
    shape: ModelShape
    rng: np.random.Generator
    weight_types: WeightTypes
    header_only: bool
    # Random blocks are made once per type, as many as the largest matrix holds, and every
    # matrix of that type is written from them: each is still read from its own place in
    # the file (the same bytes cost the same), and a gigabyte file is not a gigabyte of
    # fresh memory to fault in first (an F16 calibration file's 86 MB of blocks, one per
    # shape, took 0.5 s of its 0.8 s to make on a virtual machine).
    pools: dict[str, np.ndarray] = field(default_factory=dict)

    def type_of(self, name: str) -> str | None:
        if isinstance(self.weight_types, str) or self.weight_types is None:
            return self.weight_types
        return self.weight_types[name]

    def matrix(self, rows: int, cols: int, weight_type: str | None) -> np.ndarray:
        if weight_type is not None:
            if weight_type not in self.pools:
                s = self.shape  # as many weights as the largest matrix holds
                largest = s.n_embd * max(s.n_vocab, s.n_ff, s.n_head * s.head_dim)
                self.pools[weight_type] = _random_blocks(self.rng, largest, weight_type)
            return _block_matrix(self.pools[weight_type], rows, cols, weight_type)
        # Scaled by fan-in so every layer moves the residual stream and replies vary with
        # the context (std 0.02 leaves the embedding dominant and the model echoes its input).
        std = np.float32(1.0 / np.sqrt(cols))
        return (self.rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float16)

    def add_norm(self, name: str, size: int | None = None) -> None:
        size = self.shape.n_embd if size is None else size
        if self.header_only:
            self.writer.add_tensor_info(name, (size,), np.dtype(np.float32), 4 * size)
        else:
            self.writer.add_tensor(name, np.ones(size, dtype=np.float32))

    def add_matrix(self, name: str, rows: int, cols: int) -> None:
        weight_type = self.type_of(name)
        if self.header_only:
            kind = GGMLQuantizationType[weight_type or "F16"]
            block_weights, block_bytes = GGML_QUANT_SIZES[kind]
            row = cols // block_weights * block_bytes
            self.writer.add_tensor_info(name, (rows, row), np.dtype(np.uint8), rows * row, kind)
            return
        data = self.matrix(rows, cols, weight_type)
        if weight_type in (None, "F16"):
            self.writer.add_tensor(name, data)
        else:
            kind = GGMLQuantizationType[weight_type]
            self.writer.add_tensor(name, data, raw_dtype=kind)  # rows x block bytes


def _add_tensors(tensors: _TensorAdder) -> None:
    """A llama-architecture model's tensors (and Gemma 3's extra norms), in file order."""
    shape = tensors.shape
    hd = shape.head_dim
    tensors.add_matrix("token_embd.weight", shape.n_vocab, shape.n_embd)
    tensors.add_norm("output_norm.weight")
    # A separate output matrix: tied embeddings on random weights make the model repeat its
    # last input token, which would let a wrong KV cache go unnoticed in tests.
    tensors.add_matrix("output.weight", shape.n_vocab, shape.n_embd)
    for i in range(shape.n_layer):
        tensors.add_norm(f"blk.{i}.attn_norm.weight")
        tensors.add_matrix(f"blk.{i}.attn_q.weight", shape.n_head * hd, shape.n_embd)
        tensors.add_matrix(f"blk.{i}.attn_k.weight", shape.n_head_kv * hd, shape.n_embd)
        tensors.add_matrix(f"blk.{i}.attn_v.weight", shape.n_head_kv * hd, shape.n_embd)
        tensors.add_matrix(f"blk.{i}.attn_output.weight", shape.n_embd, shape.n_head * hd)
        tensors.add_norm(f"blk.{i}.ffn_norm.weight")
        tensors.add_matrix(f"blk.{i}.ffn_gate.weight", shape.n_ff, shape.n_embd)
        tensors.add_matrix(f"blk.{i}.ffn_up.weight", shape.n_ff, shape.n_embd)
        tensors.add_matrix(f"blk.{i}.ffn_down.weight", shape.n_embd, shape.n_ff)
        if shape.architecture == "gemma3":  # per-head q/k norms, after attention and the FFN
            tensors.add_norm(f"blk.{i}.attn_q_norm.weight", hd)
            tensors.add_norm(f"blk.{i}.attn_k_norm.weight", hd)
            tensors.add_norm(f"blk.{i}.post_attention_norm.weight")
            tensors.add_norm(f"blk.{i}.post_ffw_norm.weight")


def _write_tensor_hole(writer: GGUFWriter) -> None:
    """The tensor descriptions, then the data's full length as a hole: the file is as long
    as the model's, and no byte of its weights is written."""
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    fout = writer.fout[0]
    writer.write_padding(fout, fout.tell())
    data = sum(writer.ggml_pad(t.nbytes, writer.data_alignment) for t in writer.tensors[0].values())
    fout.truncate(fout.tell() + data)


def make_demo_model(
    out: Path,
    shape: str = "tiny",
    quant: str = "Q4_K_M",
    seed: int = 0,
    *,
    tokenizer: str = "spm",
) -> Path:
    """Write a demo model to ``out``; returns ``out``. Same arguments, same bytes."""
    if shape not in SHAPES:
        raise UsageError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if quant not in QUANTS:
        raise UsageError(f"unknown quant {quant!r}; choose one of {', '.join(QUANTS)}")
    _check_tokenizer(tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    model_shape = SHAPES[shape]
    if quant == "F16":
        write_staged(out, model_shape, seed, tokenizer)
        return out
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp_dir:
        f16 = Path(tmp_dir) / "f16.gguf"
        _write_model(model_shape, seed, f16, tokenizer)
        quantize_into(f16, out, quant)
    return out


def quantize_into(f16: Path, out: Path, quant: str) -> None:
    """llama.cpp's quantizer from ``f16`` to ``out``, staged beside it and renamed in."""
    # Imported here: the quantizer lives in the engine, the one module that touches llama_cpp.
    from localchat.backends.llama.tools import quantize_model

    with tempfile.TemporaryDirectory(dir=out.parent) as tmp_dir:
        staged = Path(tmp_dir) / out.name
        quantize_model(f16, staged, quant)
        staged.replace(out)


def demo_model_path(
    directory: Path,
    shape: str = "tiny",
    quant: str = "Q4_K_M",
    seed: int = 0,
    *,
    tokenizer: str = "spm",
) -> Path:
    """Where the cached demo model of these arguments lives (the default tokenizer keeps the
    name it always had, so caches made before tokenizer kinds existed stay valid)."""
    _check_tokenizer(tokenizer)
    suffix = "" if tokenizer == "spm" else f"-{tokenizer}"
    return directory / f"demo-{shape}-{quant}-s{seed}{suffix}.gguf"


def ensure_demo_model(
    directory: Path,
    shape: str = "tiny",
    quant: str = "Q4_K_M",
    seed: int = 0,
    *,
    tokenizer: str = "spm",
) -> Path:
    """The cached demo model, generated on first use."""
    path = demo_model_path(directory, shape, quant, seed, tokenizer=tokenizer)
    if path.exists():
        return path
    f16 = demo_model_path(directory, shape, "F16", seed, tokenizer=tokenizer)
    if quant != "F16" and f16.exists() and quant in QUANTS:
        quantize_into(f16, path, quant)  # the same weights, written once already
        return path
    make_demo_model(path, shape, quant, seed, tokenizer=tokenizer)
    return path


def app_demo_path(directory: Path) -> Path:
    """Where the generated fallback model lives (made or not)."""
    return demo_model_path(directory, APP_DEMO_SHAPE, APP_DEMO_QUANT)


def ensure_app_demo(directory: Path) -> Path:
    """The generated fallback model, made on first use."""
    return ensure_demo_model(directory, APP_DEMO_SHAPE, APP_DEMO_QUANT)
