"""Embeddings through ``localchat serve``'s endpoints, read by the official ``openai`` and
``ollama`` clients against a real uvicorn server: a generated BERT embedder (llama.cpp's
``bert`` architecture, mean pooling) and SmolLM2's own file mean-pooled, each held to
llama-cpp-python's own ``Llama(embedding=True).embed`` of the same input, and the refusals
(an input past the context, ``dimensions``, an unknown model, no embedding model)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ollama
import openai
import pytest

from localchat.backends.llama.context_plan import LoadOptions
from localchat.backends.llama.embedder import Embedder, reference_embeddings
from localchat.backends.llama.engine import Engine
from localchat.models.demo_bert import make_embedding_model
from localchat.server.app import BackgroundServer
from localchat.server.library_embeddings import LibraryEmbeddings
from localchat.server.router import Router, ServedEntry
from localchat.server.runner import ModelRunner
from localchat.state.kvstate import StateStore

BERT = "demo-bert"
CHAT = "smol-chat"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "local cache memory"]
MIN_COSINE = 0.999


@dataclass
class EmbedServer:
    root: str
    bert_path: Path
    chat_path: Path
    bert: Embedder
    bare_root: str  # the same chat model served without embedding models


@pytest.fixture(scope="module")
def served(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbedServer]:
    tmp = tmp_path_factory.mktemp("embed")
    bert_path = make_embedding_model(tmp / "bert.gguf", "bert-tiny", seed=3)
    engine = Engine(smollm2, LoadOptions(n_ctx=512, n_threads=2))
    runner = ModelRunner(engine, StateStore(tmp / "states"), CHAT)
    bert = Embedder(bert_path, n_threads=2)  # the reference the served vectors are held to
    router = Router.of_one(runner)
    models = LibraryEmbeddings([ServedEntry(BERT, bert_path)], router)  # as serve has it
    server = BackgroundServer(router, embeddings=models)
    bare = BackgroundServer(Router.of_one(runner))
    try:
        yield EmbedServer(server.root, bert_path, smollm2, bert, bare.root)
    finally:
        server.close()
        bare.close()
        models.close()
        bert.close()
        runner.close()
        engine.close()


def _client(root: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{root}/v1", api_key="none", max_retries=0)


def _cosines(got: list[list[float]], expected: list[np.ndarray]) -> list[float]:
    assert len(got) == len(expected)
    return [float(np.dot(np.asarray(g, dtype=np.float64), e)) / float(
        np.linalg.norm(g) * np.linalg.norm(e)) for g, e in zip(got, expected, strict=True)]  # fmt: skip


def _decoded(embedding: list[float] | str) -> list[float]:
    if isinstance(embedding, str):
        return [float(x) for x in np.frombuffer(base64.b64decode(embedding), dtype="<f4")]
    return embedding


def _unit(vectors: list[list[float]]) -> None:
    for vector in vectors:
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-4


def test_the_generated_bert_loads_as_a_pooled_bert(served: EmbedServer) -> None:
    assert served.bert.info.architecture == "bert"
    assert served.bert.pooling_name == "mean"
    assert served.bert.n_ctx == served.bert.info.context_length
    tokens = served.bert.tokenize("hello world")
    assert tokens[0] != tokens[-1] and len(tokens) >= 4  # [CLS] … [SEP]


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_openai_client_gets_llama_cpp_pythons_own_vectors(
    served: EmbedServer, encoding: str
) -> None:
    reply = _client(served.root).embeddings.create(
        model=BERT,
        input=TEXTS,
        encoding_format=encoding,  # type: ignore[arg-type]
    )
    # Asked for by name, base64 comes back as it is sent: little-endian float32 bytes.
    vectors = [_decoded(d.embedding) for d in sorted(reply.data, key=lambda d: d.index)]
    assert min(_cosines(vectors, reference_embeddings(served.bert_path, TEXTS))) >= MIN_COSINE
    _unit(vectors)
    assert reply.model == BERT
    expected_tokens = sum(len(served.bert.tokenize(t)) for t in TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == expected_tokens
    # Different texts give different vectors (the model is not a constant).
    assert float(np.dot(vectors[0], vectors[1])) < 0.9999


def test_openai_clients_default_and_token_ids(served: EmbedServer) -> None:
    """The client's default (base64, decoded by it), one string, and the same text sent as
    its token ids: one vector, the same."""
    client = _client(served.root)
    text = client.embeddings.create(model=BERT, input=TEXTS[1]).data[0].embedding
    ids = served.bert.tokenize(TEXTS[1])
    by_ids = client.embeddings.create(model=BERT, input=ids).data[0].embedding
    assert min(_cosines([text], [np.asarray(by_ids)])) >= MIN_COSINE


def test_a_chat_model_is_mean_pooled_as_llama_cpp_python_pools_it(served: EmbedServer) -> None:
    reply = _client(served.root).embeddings.create(model=CHAT, input=TEXTS, encoding_format="float")
    vectors = [d.embedding for d in reply.data]
    assert min(_cosines(vectors, reference_embeddings(served.chat_path, TEXTS))) >= MIN_COSINE
    _unit(vectors)
    assert len(vectors[0]) != served.bert.n_embd  # SmolLM2's width, not the embedder's


def test_ollama_client_embed_and_the_older_embeddings(served: EmbedServer) -> None:
    client = ollama.Client(host=served.root)
    reply = client.embed(model=BERT, input=TEXTS)
    expected = reference_embeddings(served.bert_path, TEXTS)
    assert min(_cosines([list(v) for v in reply.embeddings], expected)) >= MIN_COSINE
    assert reply.prompt_eval_count == sum(len(served.bert.tokenize(t)) for t in TEXTS)
    assert reply.total_duration is not None and reply.total_duration > 0
    older = client.embeddings(model=BERT, prompt=TEXTS[2])
    assert min(_cosines([list(older.embedding)], expected[2:])) >= MIN_COSINE


def test_an_input_past_the_context_is_a_400_naming_the_limit(served: EmbedServer) -> None:
    limit = served.bert.n_ctx
    long_text = " ".join(["hello world"] * limit)
    with pytest.raises(openai.BadRequestError) as refused:
        _client(served.root).embeddings.create(model=BERT, input=["hello", long_text])
    assert refused.value.status_code == 400
    assert f"at most {limit}" in str(refused.value)
    client = ollama.Client(host=served.root)
    with pytest.raises(ollama.ResponseError) as too_long:
        client.embed(model=BERT, input=long_text, truncate=False)
    assert too_long.value.status_code == 400 and str(limit) in str(too_long.value)
    cut = client.embed(model=BERT, input=long_text)  # Ollama's default: cut to the context
    assert cut.prompt_eval_count == limit


def test_dimensions_and_an_unknown_model_are_refused(served: EmbedServer) -> None:
    client = _client(served.root)
    with pytest.raises(openai.BadRequestError) as cut:
        client.embeddings.create(model=BERT, input="hello", dimensions=16)
    assert "dimensions" in str(cut.value)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.embeddings.create(model="text-embedding-3-small", input="hello")
    assert BERT in str(unknown.value) and CHAT in str(unknown.value)
    with pytest.raises(ollama.ResponseError) as missing:
        ollama.Client(host=served.root).embed(model="nomic-embed-text", input="hello")
    assert missing.value.status_code == 404


def test_a_server_without_embedding_models_says_so(served: EmbedServer) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        _client(served.bare_root).embeddings.create(model=BERT, input="hello")
    assert refused.value.status_code == 501 and "--embedding-model" in str(refused.value)
