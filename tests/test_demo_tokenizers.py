"""Demo models of every tokenizer kind load in llama.cpp and tokenize the way they should.

Each kind stands for a family of real models (SentencePiece with and without the space
prefix, byte-level BPE under the GPT-2, Llama 3 and Qwen2 pre-tokenizers), so prompt code can
be checked against llama.cpp's own tokenizer for each without downloading anything.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.cli.main import main
from localchat.errors import UsageError
from localchat.gguf.info import read_gguf
from localchat.models.demo import (
    SHAPES,
    TOKENIZERS,
    demo_model_path,
    ensure_demo_model,
    make_demo_model,
)
from localchat.models.demo_shapes import ADDED_TOKENS
from localchat.models.demo_vocab import bpe_split, build_bpe_vocab, bytes_to_unicode
from tests.conftest import GREEDY

BPE_KINDS = ("gpt2", "llama3", "qwen2")

# What llama.cpp must read back: tokenizer model, pre-tokenizer (None: not written), BOS text,
# whether BOS starts prompts, whether text after a control token gets a space.
EXPECTED: dict[str, tuple[str, str | None, str, bool, bool]] = {
    "spm": ("llama", None, "<s>", True, False),
    "spm-space": ("llama", None, "<s>", True, True),
    "gpt2": ("gpt2", "gpt-2", "<|endoftext|>", False, False),
    "llama3": ("gpt2", "llama-bpe", "<|begin_of_text|>", True, False),
    "qwen2": ("gpt2", "qwen2", "<|endoftext|>", False, False),
    "idefics3": ("llama", None, "<s>", True, False),
}

# " 2024" under each pre-tokenizer: GPT-2 keeps the space on the number and runs of digits
# together, Llama 3 splits the space off and groups digits by three, Qwen2 splits every
# digit. The BPE vocabulary has digit-pair merges, so the three kinds give three answers.
DIGITS: dict[str, list[bytes]] = {
    "spm": [b" 2", b"0", b"2", b"4"],
    "spm-space": [b" ", b" 2", b"0", b"2", b"4"],
    "gpt2": [b" 2", b"02", b"4"],
    "llama3": [b" ", b"2", b"02", b"4"],
    "qwen2": [b" ", b"2", b"0", b"2", b"4"],
    "idefics3": [b" 2", b"0", b"2", b"4"],
}

ASCII_TEXTS = (
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "it's   spaced\n\n\tand tabbed: (x+y)*2 = 42; done!",
    "user\nWhat is 1234567 + 89?",
)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def tokenizer_models(models_dir: Path) -> dict[str, Path]:
    """The tiny shape at Q4_K_M in every tokenizer kind (llama.cpp's quantizer rewrites the
    metadata, so what the tests read back is what llama.cpp wrote)."""
    return {
        kind: make_demo_model(
            models_dir / f"tiny-Q4_K_M-{kind}.gguf", "tiny", "Q4_K_M", tokenizer=kind
        )
        for kind in TOKENIZERS
    }


@pytest.fixture(scope="module", params=TOKENIZERS)
def kind_engine(
    request: pytest.FixtureRequest, tokenizer_models: dict[str, Path]
) -> Iterator[tuple[str, Engine]]:
    """One loaded engine per kind, shared by this module's tests (loading is the slow part)."""
    kind: str = request.param
    engine = Engine(tokenizer_models[kind], LoadOptions(n_ctx=512))
    yield kind, engine
    engine.close()


def _said(engine: Engine, text: str) -> bytes:
    return b"".join(engine.token_bytes(t) for t in engine.tokenize(text, special=True))


def test_llama_cpp_reads_the_kinds_tokenizer(kind_engine: tuple[str, Engine]) -> None:
    kind, engine = kind_engine
    model, pre, bos, add_bos, space_prefix = EXPECTED[kind]
    meta = engine.info.metadata
    assert engine.n_vocab == SHAPES["tiny"].n_vocab
    assert meta["tokenizer.ggml.model"] == model
    assert meta.get("tokenizer.ggml.pre") == pre
    assert engine.token_text(engine.bos_token) == bos
    assert engine.add_bos is add_bos
    assert engine.add_space_prefix is space_prefix
    assert engine.token_text(meta["tokenizer.ggml.eos_token_id"]) == "<|im_end|>"
    # Big arrays are counted, not kept; the SPM kinds have scores, the BPE kinds merges.
    has_merges = engine.info.array_lengths.get("tokenizer.ggml.merges", 0) > 0
    assert has_merges is (model == "gpt2")
    assert engine.info.chat_template and "<|im_start|>" in engine.info.chat_template


def test_a_kinds_added_tokens_are_read_whole(kind_engine: tuple[str, Engine]) -> None:
    """libmtmd looks Idefics3's image tokens up by their text: each must be one token."""
    kind, engine = kind_engine
    for text in ADDED_TOKENS.get(kind, ()):
        (token,) = engine.tokenize(text, special=True)
        assert engine.token_bytes(token) == text.encode()


def test_pre_tokenizer_is_the_kinds_own(kind_engine: tuple[str, Engine]) -> None:
    kind, engine = kind_engine
    tokens = engine.tokenize(" 2024", special=True)
    assert [engine.token_bytes(t) for t in tokens] == DIGITS[kind]


@pytest.mark.parametrize("text", ASCII_TEXTS)
def test_ascii_text_round_trips_through_the_tokens(
    kind_engine: tuple[str, Engine], text: str
) -> None:
    kind, engine = kind_engine
    # With the space prefix llama.cpp starts the text with a space of its own.
    expected = (" " + text if kind == "spm-space" else text).encode()
    assert _said(engine, text) == expected


def test_text_after_a_control_token_gets_a_space_only_with_the_prefix(
    kind_engine: tuple[str, Engine],
) -> None:
    kind, engine = kind_engine
    expected = b"<|im_start|> hi" if kind == "spm-space" else b"<|im_start|>hi"
    assert _said(engine, "<|im_start|>hi") == expected


def test_chatml_markers_are_single_control_tokens(kind_engine: tuple[str, Engine]) -> None:
    _kind, engine = kind_engine
    for marker in ("<|im_start|>", "<|im_end|>"):
        (token,) = engine.tokenize(marker, special=True)
        assert engine.has_control_token(marker)
        assert engine.token_bytes(token) == marker.encode()
        # Typed by a user (special=False) the marker is plain text, never the control token.
        assert token not in engine.tokenize(marker, special=False)
    (im_end,) = engine.tokenize("<|im_end|>", special=True)
    assert engine.is_end_of_generation(im_end)
    assert not engine.is_end_of_generation(engine.tokenize("<|im_start|>", special=True)[0])


@pytest.mark.parametrize("word", ["the", "hello", "world", "model", "people", "water"])
def test_common_words_are_single_tokens(kind_engine: tuple[str, Engine], word: str) -> None:
    kind, engine = kind_engine
    # The space prefix supplies the space itself; elsewhere the text carries it.
    text = word if kind == "spm-space" else " " + word
    tokens = engine.tokenize(text, special=True)
    assert len(tokens) == 1
    assert engine.token_bytes(tokens[0]) == f" {word}".encode()
    if kind in BPE_KINDS:
        # BPE merges the bare word too (SPM never starts a word without its "▁").
        assert len(engine.tokenize(word, special=True)) == 1


@pytest.mark.parametrize("kind_engine", BPE_KINDS, indirect=True)
@pytest.mark.parametrize("word", ["Hello", "question", "together", "xylophone", "hellos"])
def test_llama_cpp_merges_as_the_factory_planned(
    kind_engine: tuple[str, Engine], word: str
) -> None:
    """Words not in the vocabulary exercise the merges themselves: llama.cpp's BPE and the
    factory's ``bpe_split`` must agree piece for piece."""
    _kind, engine = kind_engine
    tokens, _types, merges = build_bpe_vocab(SHAPES["tiny"].n_vocab)
    ranks = {(m.split(" ")[0], m.split(" ")[1]): i for i, m in enumerate(merges)}
    planned = bpe_split(word, ranks)
    assert len(planned) > 1, "the word should need several merges"
    assert engine.tokenize(word, special=True) == [tokens.index(p) for p in planned]


def test_greedy_generation_runs_and_repeats(kind_engine: tuple[str, Engine]) -> None:
    _kind, engine = kind_engine
    prompt = engine.tokenize(
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", special=True
    )
    if engine.add_bos:
        prompt = [engine.bos_token, *prompt]
    replies: list[list[int]] = []
    for _ in range(2):
        engine.cache.reset()
        deltas = engine.generate(prompt, GREEDY, 8)
        # A None token is held-back text released at the end, not a generated token.
        replies.append([d.token for d in deltas if d.token is not None])
    assert 0 < len(replies[0]) <= 8
    assert replies[0] == replies[1]
    assert all(0 <= t < engine.n_vocab for t in replies[0])


def test_bpe_vocabulary_is_complete_and_consistent() -> None:
    for n_vocab in (SHAPES["tiny"].n_vocab, SHAPES["small"].n_vocab):
        tokens, types, merges = build_bpe_vocab(n_vocab)
        assert len(tokens) == len(types) == n_vocab
        assert len(set(tokens)) == n_vocab
        assert set(bytes_to_unicode().values()) <= set(tokens), "every byte has a token"
        index = {t: i for i, t in enumerate(tokens)}
        results = []
        for merge in merges:
            left, right = merge.split(" ")
            assert left in index and right in index and left + right in index
            results.append(index[left + right])
        # Merge results join the vocabulary in merge order, after the control and byte tokens.
        first_seen = list(dict.fromkeys(results))
        assert first_seen == list(range(len(tokens) - len(first_seen), len(tokens)))
        assert tokens[len(tokens) - len(first_seen) - 1] == bytes_to_unicode()[255]
    assert bytes_to_unicode()[ord(" ")] == "Ġ"
    assert merges[:2] == ["Ġ a", "Ġ b"]
    assert {"t h", "th e", "Ġt h", "Ġth e"} <= set(merges)


def test_same_arguments_same_bytes_and_kinds_differ(tmp_path: Path) -> None:
    digests = {}
    for kind in TOKENIZERS:
        a = make_demo_model(tmp_path / f"{kind}-a.gguf", "tiny", "F16", seed=3, tokenizer=kind)
        b = make_demo_model(tmp_path / f"{kind}-b.gguf", "tiny", "F16", seed=3, tokenizer=kind)
        assert _digest(a) == _digest(b)
        digests[kind] = _digest(a)
    assert len(set(digests.values())) == len(TOKENIZERS)
    default = make_demo_model(tmp_path / "default.gguf", "tiny", "F16", seed=3)
    assert _digest(default) == digests["spm"]


def test_quantized_bpe_model_is_deterministic(
    tmp_path: Path, tokenizer_models: dict[str, Path]
) -> None:
    again = make_demo_model(tmp_path / "again.gguf", "tiny", "Q4_K_M", tokenizer="qwen2")
    assert _digest(again) == _digest(tokenizer_models["qwen2"])


def test_unknown_tokenizer_is_a_one_line_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="choose one of") as raised:
        make_demo_model(tmp_path / "x.gguf", "tiny", "F16", tokenizer="wordpiece")
    message = str(raised.value)
    assert "\n" not in message
    assert "wordpiece" in message
    assert all(kind in message for kind in TOKENIZERS)
    assert not (tmp_path / "x.gguf").exists()
    with pytest.raises(UsageError, match="choose one of"):
        demo_model_path(tmp_path, tokenizer="bpe")


def test_cache_path_names_the_tokenizer_unless_default(tmp_path: Path) -> None:
    assert demo_model_path(tmp_path, "tiny", "Q4_K_M", 0).name == "demo-tiny-Q4_K_M-s0.gguf"
    assert demo_model_path(tmp_path, tokenizer="spm") == demo_model_path(tmp_path)
    names = {demo_model_path(tmp_path, "tiny", "F16", tokenizer=k).name for k in TOKENIZERS}
    assert len(names) == len(TOKENIZERS)
    path = ensure_demo_model(tmp_path, "tiny", "F16", tokenizer="llama3")
    assert path.name == "demo-tiny-F16-s0-llama3.gguf"
    assert read_gguf(path).metadata["tokenizer.ggml.pre"] == "llama-bpe"


def test_demo_model_command_takes_a_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.gguf"
    assert main(["demo-model", str(out), "--quant", "F16", "--tokenizer", "qwen2"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert read_gguf(out).metadata["tokenizer.ggml.pre"] == "qwen2"
    with pytest.raises(SystemExit):
        main(["demo-model", str(out), "--tokenizer", "wordpiece"])
    assert "invalid choice" in capsys.readouterr().err
