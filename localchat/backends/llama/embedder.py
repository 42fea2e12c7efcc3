"""Embeddings from a GGUF: a llama.cpp context of its own with embeddings on, pooled as the
file says (``<arch>.pooling_type``: BERT-family and Qwen3-Embedding files name theirs) or,
for a decoder that names none, mean-pooled over its tokens (what ``llama-server --pooling
mean`` gives). Vectors are L2-normalized, as llama-server does by default
(``embd_normalize`` 2 in ``send_embedding``): a pooled sentence embedder's vectors are
compared by cosine, and a unit vector makes that a dot product. Every llama.cpp call runs
on the compute thread.

``reference_embeddings`` is llama-cpp-python's own ``Llama(embedding=True).embed`` of the
same file, for the tests and the bench to hold this one to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import numpy.typing as npt

from localchat.backends.compute_thread import run_compute
from localchat.backends.llama.runtime import last_error_line, prepare, start_capture, watch_abort
from localchat.cpu import physical_cores
from localchat.errors import LocalchatError, ModelLoadError
from localchat.gguf.info import GGUFInfo, read_gguf

POOLING_NAMES = {
    llama_cpp.LLAMA_POOLING_TYPE_NONE: "none",
    llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean",
    llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls",
    llama_cpp.LLAMA_POOLING_TYPE_LAST: "last",
    llama_cpp.LLAMA_POOLING_TYPE_RANK: "rank",
}
# A non-causal model sees a whole input in one step (llama.cpp asks n_ubatch >= its tokens),
# and the step's attention scores grow with the square of it: 2,048 tokens keep that in the
# hundreds of megabytes for a 12-head model. A file trained on less gets its own length.
EMBED_CTX_CAP = 2048

Inputs = Sequence[str | Sequence[int]]  # texts, or token-id lists


class BadEmbeddingInput(LocalchatError):
    """An input that cannot be embedded: empty, too long, or a token id the vocabulary
    lacks (an HTTP 400: the request's fault, not the server's)."""


class EmbeddingInputTooLong(BadEmbeddingInput):
    """An input with more tokens than the embedding context holds."""

    def __init__(self, index: int, tokens: int, limit: int) -> None:
        super().__init__(
            f"input {index} is {tokens} tokens; this embedding model takes at most {limit}"
        )
        self.index, self.tokens, self.limit = index, tokens, limit


@dataclass(frozen=True)
class Embeddings:
    """One vector per input (unit length), and how many tokens each input was."""

    vectors: list[npt.NDArray[np.float32]]
    token_counts: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.token_counts)


def pooling_of(info: GGUFInfo) -> int:
    """The pooling a file asks for; a file that names none (or "none": per-token vectors,
    which no embeddings API returns) is mean-pooled, as a decoder asked for embeddings is."""
    pooling = info.arch_value("pooling_type")
    if pooling is None or int(pooling) == llama_cpp.LLAMA_POOLING_TYPE_NONE:
        return llama_cpp.LLAMA_POOLING_TYPE_MEAN
    return int(pooling)


def embedding_ctx(info: GGUFInfo, n_ctx: int | None = None) -> int:
    """The context an embedder of this file gets: what it was trained on, capped."""
    trained = info.context_length or EMBED_CTX_CAP
    return min(trained, n_ctx or EMBED_CTX_CAP)


class Embedder:
    """A GGUF loaded for embeddings. ``embed`` takes texts or token-id lists and returns
    one normalized vector per input; an input longer than ``n_ctx`` is refused
    (``EmbeddingInputTooLong``) unless ``truncate`` cuts it there."""

    def __init__(self, path: Path, n_ctx: int | None = None, n_threads: int | None = None):
        self.path = Path(path)
        self.info = read_gguf(self.path)
        self.pooling = pooling_of(self.info)
        if self.pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK:
            raise ModelLoadError(f"{self.path}: a reranker (rank pooling), not an embedding model")
        self.n_ctx = embedding_ctx(self.info, n_ctx)
        self.n_threads = n_threads or physical_cores()
        self.llm: llama_cpp.Llama = run_compute(self._load)
        self.n_embd = llama_cpp.llama_model_n_embd_out(self.llm.model)
        self.n_seq_max = llama_cpp.llama_n_seq_max(self.llm.ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_ctx, 0, 1)

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def pooling_name(self) -> str:
        return POOLING_NAMES.get(self.pooling, str(self.pooling))

    def _load(self) -> llama_cpp.Llama:
        prepare()
        start_capture()
        try:
            llm = _open(self.path, self.n_ctx, self.pooling, self.n_threads)
        except Exception as exc:  # llama-cpp-python raises ValueError/RuntimeError
            raise ModelLoadError(
                f"{self.path}: llama.cpp could not load it for embeddings: {last_error_line()}"
            ) from exc
        watch_abort(llm.ctx)
        return llm

    def tokenize(self, text: str) -> list[int]:
        """As llama-cpp-python's ``embed`` does: the vocabulary's own specials (BOS, or
        BERT's [CLS] … [SEP]) added, control-token text in the input kept as text."""
        return run_compute(self.llm.tokenize, text.encode("utf-8"), add_bos=True, special=False)

    def embed(self, inputs: Inputs, truncate: bool = False) -> Embeddings:
        """One unit vector per input, in order."""
        token_lists = [self._tokens(i, item, truncate) for i, item in enumerate(inputs)]
        vectors = run_compute(self._embed_all, token_lists)
        return Embeddings(vectors, [len(tokens) for tokens in token_lists])

    def _tokens(self, index: int, item: str | Sequence[int], truncate: bool) -> list[int]:
        tokens = self.tokenize(item) if isinstance(item, str) else [int(t) for t in item]
        if not tokens:
            raise BadEmbeddingInput(f"input {index} is empty: there is nothing to embed")
        if len(tokens) > self.n_ctx:
            if not truncate:
                raise EmbeddingInputTooLong(index, len(tokens), self.n_ctx)
            tokens = tokens[: self.n_ctx]
        n_vocab = self.llm.n_vocab()
        if any(t < 0 or t >= n_vocab for t in tokens):
            raise BadEmbeddingInput(f"input {index} has a token id outside 0..{n_vocab - 1}")
        return tokens

    def _embed_all(self, token_lists: list[list[int]]) -> list[npt.NDArray[np.float32]]:
        """Inputs packed into as few decodes as the context and its sequences allow."""
        vectors: list[npt.NDArray[np.float32]] = []
        group: list[list[int]] = []
        for tokens in token_lists:
            if group and (
                sum(map(len, group)) + len(tokens) > self.n_ctx or len(group) >= self.n_seq_max
            ):
                vectors += self._decode_group(group)
                group = []
            group.append(tokens)
        if group:
            vectors += self._decode_group(group)
        return vectors

    def _decode_group(self, group: list[list[int]]) -> list[npt.NDArray[np.float32]]:
        """Each input its own sequence in one batch, every token an output (pooling reads
        them all); the cache cleared first, as the inputs share nothing."""
        batch = self._batch
        n = 0
        for seq, tokens in enumerate(group):
            for pos, token in enumerate(tokens):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
                batch.seq_id[n][0], batch.logits[n] = seq, True
                n += 1
        batch.n_tokens = n
        ctx = self.llm.ctx
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        code = llama_cpp.llama_decode(ctx, batch)
        if code != 0:
            raise LocalchatError(f"llama.cpp could not embed ({code}): {last_error_line()}")
        out = []
        for seq in range(len(group)):
            pointer = llama_cpp.llama_get_embeddings_seq(ctx, seq)
            if not pointer:
                raise LocalchatError("llama.cpp gave no pooled embedding for the input")
            vector = np.ctypeslib.as_array(pointer, shape=(self.n_embd,)).astype(np.float32)
            out.append(l2_normalized(vector))
        return out

    def close(self) -> None:
        run_compute(self._close)

    def _close(self) -> None:
        with contextlib.suppress(Exception):
            llama_cpp.llama_batch_free(self._batch)
        with contextlib.suppress(Exception):
            self.llm.close()


def l2_normalized(vector: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``common_embd_normalize(…, 2)``: the vector over its Euclidean norm (a zero vector
    stays zero), summed in double precision as llama.cpp sums it."""
    norm = float(np.sqrt(np.sum(vector.astype(np.float64) ** 2)))
    scaled: npt.NDArray[np.float32] = (vector * (1.0 / norm if norm > 0 else 0.0)).astype(
        np.float32
    )
    return scaled


def _open(path: Path, n_ctx: int, pooling: int, n_threads: int | None = None) -> llama_cpp.Llama:
    """What both this embedder and the reference load: the whole context one batch and one
    step, embeddings on, the pooling named (threads: llama-cpp-python's default unless
    given)."""
    return llama_cpp.Llama(
        model_path=str(path),
        embedding=True,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        pooling_type=pooling,
        n_threads=n_threads,
        n_threads_batch=n_threads,
        verbose=False,
    )


def reference_embeddings(
    path: Path, texts: Sequence[str], n_ctx: int | None = None
) -> list[npt.NDArray[np.float32]]:
    """llama-cpp-python's own ``Llama(embedding=True).embed(texts)`` of ``path`` (the same
    context and pooling as an ``Embedder``), normalized: what the server's vectors are
    measured against. Loaded and freed on the compute thread."""
    info = read_gguf(Path(path))

    def compute() -> list[npt.NDArray[np.float32]]:
        prepare()
        llm = _open(Path(path), embedding_ctx(info, n_ctx), pooling_of(info))
        try:
            rows = llm.embed(list(texts), normalize=False, truncate=False)
        finally:
            llm.close()
        return [l2_normalized(np.asarray(row, dtype=np.float32)) for row in rows]

    return run_compute(compute)
