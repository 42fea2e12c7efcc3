"""A loaded model's vocabulary: text to token ids and back, a token's bytes, which tokens are
control tokens or end a reply. A part of the engine (``Engine.vocab``) that a generation
reads a reply's text through, without the rest of the engine."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp

from localchat.backends.llama.image_positions import placeholder_bytes
from localchat.backends.llama.internals import vocab_of


class Vocabulary:
    """The tokenizer of ``llm``'s model. ``add_space_prefix``: SentencePiece vocabularies
    that start every text after a control token with a space (the file says so)."""

    def __init__(self, llm: llama_cpp.Llama, add_space_prefix: bool) -> None:
        self._llm = llm
        self._vocab = vocab_of(llm)  # the same pointer for the model's life
        self.add_space_prefix = add_space_prefix

    @property
    def pointer(self) -> llama_cpp.llama_vocab_p:
        """llama.cpp's vocabulary, for what takes it whole (a grammar's check)."""
        return self._vocab

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``special`` parses control tokens such as ``<|im_end|>``."""
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        """Text of ``tokens``; ``special`` spells control tokens out."""
        data = self._llm.detokenize([t for t in tokens if t >= 0], special=special)
        return bytes(data).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        """A token's text as the model sees it, specials included (for templates and debugging)."""
        if token < 0:
            return placeholder_bytes(token).decode()
        return bytes(self._llm.detokenize([token], special=True)).decode("utf-8", errors="replace")

    def reply_bytes(self, token: int) -> bytes:
        """A reply token's bytes, control tokens silent (a character may span tokens: join
        them before decoding)."""
        if token < 0:
            return b""
        return bytes(self._llm.detokenize([token]))

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for, control tokens spelled out: the prompt builder
        compares token sequences by what they say (an image's placeholders by which image)."""
        if token < 0:
            return placeholder_bytes(token)
        size = 64
        while True:
            buffer = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, size, 0, True)
            if n >= 0:
                return buffer.raw[:n]
            size = -n

    def is_end_of_generation(self, token: int) -> bool:
        return token >= 0 and bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def has_control_token(self, text: str) -> bool:
        """Whether ``text`` is one control token of this vocabulary."""
        ids = self.tokenize(text, special=True)
        return len(ids) == 1 and bool(llama_cpp.llama_vocab_is_control(self._vocab, ids[0]))

    def strips_reply_space(self, last_prompt_token: int) -> bool:
        """Whether a reply's first space is the tokenizer's own (after a control token)."""
        return (
            self.add_space_prefix
            and last_prompt_token >= 0
            and bool(llama_cpp.llama_vocab_is_control(self._vocab, last_prompt_token))
        )

    def spelled_tokens(self, texts: Sequence[str]) -> frozenset[int]:
        """The tokens that are each of ``texts`` whole (a tool call's markers, often control
        tokens a reply's text leaves out): a reply keeps them, so its calls can be read."""
        tokens = (self.tokenize(text, special=True) for text in texts)
        return frozenset(ids[0] for ids in tokens if len(ids) == 1)
