"""The demo models' tokenizers, built without a download: a SentencePiece-style vocabulary
of common words, letter n-grams and byte fallback, and a GPT-2 style byte-level BPE
vocabulary whose merges really produce its tokens (``bpe_split`` checks a plan against
llama.cpp's own tokenizer in the tests)."""

from __future__ import annotations

import math
import string
from collections.abc import Iterator

from gguf import TokenType

from localchat.errors import UsageError

# Control tokens of the BPE vocabulary, ids 0..3; <|im_end|> is EOS so replies end there.
BPE_CONTROL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
)

_COMMON_WORDS = tuple(
    """
the of and to in is you that it he was for on are as with his they at be this have from
or one had by word but not what all were we when your can said there use an each which
she do how their if will up other about out many then them these so some her would make
like him into time has look two more write go see number no way could people my than
first water been call who oil its now find long down day did get come made may part
hello world chat model local cache memory token context window quick brown fox jumps
over lazy dog
""".split()
)


def build_vocab(
    n_vocab: int, added: tuple[str, ...] = ()
) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: specials, 256 byte-fallback tokens, the ``added``
    tokens (control tokens where bracketed, else user-defined: matched whole, as a real
    model's added tokens are), then pieces.

    Every multi-character piece is reachable by SPM merges because all its prefixes are
    in the vocabulary too.
    """
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    tokens += ["<|im_start|>", "<|im_end|>"]
    types += [TokenType.CONTROL, TokenType.CONTROL]
    tokens += added
    types += [TokenType.CONTROL if t.startswith("<") else TokenType.USER_DEFINED for t in added]
    n_special = len(tokens)
    seen = set(tokens)
    pieces: list[str] = []

    def add(piece: str) -> None:
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)

    for piece in _candidate_pieces():
        if n_special + len(pieces) >= n_vocab:
            break
        add(piece)
    if n_special + len(pieces) < n_vocab:
        raise UsageError(f"cannot build a vocabulary of {n_vocab} tokens")
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    scores = [0.0] * n_special + [-float(i) for i in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


def _letter_ngrams(word_start: str) -> Iterator[str]:
    """Letter bigrams then trigrams, each also with the vocabulary's word-start marker."""
    letters = string.ascii_lowercase
    for a in letters:
        for b in letters:
            yield a + b
            yield word_start + a + b
    for a in letters:
        for b in letters:
            for c in letters:
                yield a + b + c
                yield word_start + a + b + c


def _candidate_pieces() -> Iterator[str]:
    """Pieces in merge-priority order: characters, common words with their prefixes, n-grams."""
    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
    yield "▁"
    for ch in chars:
        yield ch
        yield "▁" + ch
    for word in _COMMON_WORDS:
        for end in range(2, len(word) + 1):
            yield word[:end]
            yield "▁" + word[:end]
    yield from _letter_ngrams("▁")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table: printable bytes stand for themselves, the others
    (space, control bytes) for characters from U+0100 on, so every token is visible text and
    every byte has a token ("Ġ" is the space, "Ċ" the newline)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def bpe_split(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Byte-level BPE of one pre-tokenized word (in ``bytes_to_unicode`` characters):
    repeatedly merge the adjacent pair of the lowest rank (leftmost on ties), as llama.cpp
    does; the factory plans its merges with it, tests compare llama.cpp against it."""
    parts = list(word)
    while len(parts) > 1:
        best_rank, best = math.inf, -1
        for i in range(len(parts) - 1):
            rank = ranks.get((parts[i], parts[i + 1]), math.inf)
            if rank < best_rank:
                best_rank, best = rank, i
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def build_bpe_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary: control tokens, the 256 byte tokens (in byte order), then
    merge results in merge order. Returns tokens, token types and merges ("left right").

    Merges come in left-to-right chains ("t h", "th e"; "Ġ t", "Ġt h", "Ġth e"), planned
    with ``bpe_split`` so every common word, bare and with its leading space, really
    becomes one token under BPE (in the tiny vocabulary too); digit pairs follow, then letter
    bigrams and trigrams fill the vocabulary up.
    """
    tokens = list(BPE_CONTROL_TOKENS)
    types = [int(TokenType.CONTROL)] * len(tokens)
    byte_chars = bytes_to_unicode()
    tokens += [byte_chars[b] for b in range(256)]
    types += [int(TokenType.NORMAL)] * 256
    seen = set(tokens)
    merges: list[str] = []
    ranks: dict[tuple[str, str], int] = {}
    for target in _bpe_targets():
        # A merge joins the first two parts BPE leaves; being the newest (highest rank) it
        # fires only after all older merges did, so earlier words keep their single tokens.
        parts = bpe_split(target, ranks)
        while len(parts) > 1 and len(tokens) < n_vocab:
            left, right = parts[0], parts[1]
            ranks[(left, right)] = len(merges)
            merges.append(f"{left} {right}")
            if left + right not in seen:
                seen.add(left + right)
                tokens.append(left + right)
                types.append(int(TokenType.NORMAL))
            parts = bpe_split(target, ranks)
        if len(tokens) >= n_vocab:
            break
    if len(tokens) < n_vocab:
        raise UsageError(f"cannot build a BPE vocabulary of {n_vocab} tokens")
    return tokens, types, merges


def _bpe_targets() -> Iterator[str]:
    """Words the BPE vocabulary makes single tokens, in merge-priority order ("Ġ" is the
    space): each character after a space, common words, digit pairs (so the pre-tokenizers'
    different digit rules give different tokens), then letter bigrams and trigrams."""
    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
    for ch in chars:
        yield "Ġ" + ch
    for word in _COMMON_WORDS:
        yield word
        yield "Ġ" + word
    for a in string.digits:
        for b in string.digits:
            yield a + b
    yield from _letter_ngrams("Ġ")
