"""The model factory: deterministic bytes, real tokenizer metadata, quant sizes in order."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.errors import UsageError
from localchat.gguf.info import read_gguf
from localchat.models.demo import QUANTS, SHAPES, make_demo_model
from localchat.models.demo_vocab import build_vocab


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    a = make_demo_model(tmp_path / "a.gguf", "tiny", "Q4_K_M", seed=7)
    b = make_demo_model(tmp_path / "b.gguf", "tiny", "Q4_K_M", seed=7)
    c = make_demo_model(tmp_path / "c.gguf", "tiny", "Q4_K_M", seed=8)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)


def test_quantized_variants_shrink_in_quality_order_and_load(tmp_path: Path) -> None:
    sizes = {}
    for quant in QUANTS:
        path = make_demo_model(tmp_path / f"tiny-{quant}.gguf", "tiny", quant)
        info = read_gguf(path)
        assert info.file_type == quant
        sizes[quant] = path.stat().st_size
        engine = Engine(path, LoadOptions(n_ctx=64))
        assert engine.n_vocab == SHAPES["tiny"].n_vocab
        engine.close()
    k_quants = [sizes[q] for q in ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K")]
    assert k_quants == sorted(k_quants, reverse=True)
    assert sizes["Q5_0"] > sizes["Q4_0"]
    sizes = list(sizes.values())
    assert len(set(sizes)) == len(sizes)
    assert max(sizes) < 2 * 1024 * 1024, "tiny must stay under 2 MB"


def test_tokenizer_metadata_is_sentencepiece_with_byte_fallback(tiny_model: Path) -> None:
    info = read_gguf(tiny_model)
    meta = info.metadata
    assert meta["tokenizer.ggml.model"] == "llama"
    assert info.n_vocab == SHAPES["tiny"].n_vocab
    assert meta["tokenizer.ggml.bos_token_id"] == 1
    assert info.chat_template and "<|im_start|>" in info.chat_template
    tokens, _scores, _types = build_vocab(SHAPES["tiny"].n_vocab)
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert meta["tokenizer.ggml.eos_token_id"] == tokens.index("<|im_end|>")


def test_byte_fallback_round_trips_any_text(tiny_model: Path) -> None:
    engine = Engine(tiny_model, LoadOptions(n_ctx=128))
    text = "naïve café — 日本語 🙂 tabs\tand\nnewlines"
    tokens = engine.tokenize(text)
    assert len(tokens) > len(text) // 4
    assert engine.detokenize(tokens) == text


@pytest.mark.parametrize(("shape", "quant"), [("huge", "Q4_K_M"), ("tiny", "Q9")])
def test_unknown_shape_or_quant_is_a_usage_error(tmp_path: Path, shape: str, quant: str) -> None:
    with pytest.raises(UsageError, match="choose one of"):
        make_demo_model(tmp_path / "x.gguf", shape, quant)


def test_realistic_shapes_match_the_models_they_stand_for() -> None:
    qwen = SHAPES["0.5b"]
    assert (qwen.n_layer, qwen.n_embd, qwen.n_head, qwen.n_head_kv, qwen.n_ff) == (
        24,
        896,
        14,
        2,
        4864,
    )
    llama = SHAPES["1b"]
    assert (llama.n_layer, llama.n_embd, llama.n_head, llama.n_head_kv, llama.n_ff) == (
        16,
        2048,
        32,
        8,
        8192,
    )


def test_a_header_only_model_reads_as_the_whole_one_and_takes_no_disk(tmp_path: Path) -> None:
    from gguf import LlamaFileType

    from localchat.models.demo import SHAPES, write_header_only, write_staged
    from localchat.models.timing_models import quant_mix

    mix = quant_mix(SHAPES["small"], "Q4_K_M")
    whole, header = tmp_path / "whole.gguf", tmp_path / "header.gguf"
    write_staged(whole, SHAPES["small"], 0, weight_types=mix, file_type=LlamaFileType.MOSTLY_Q4_K_M)
    write_header_only(header, SHAPES["small"], mix, LlamaFileType.MOSTLY_Q4_K_M)
    assert read_gguf(header).tensors == read_gguf(whole).tensors
    assert header.stat().st_size == whole.stat().st_size
    assert header.stat().st_blocks * 512 < whole.stat().st_size // 10  # a hole, not weights
