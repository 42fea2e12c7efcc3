"""Images through libmtmd on generated models: the demo LM with a generated LLaVA-style
projector (``models/demo_vision.py``). Skipped where llama-cpp-python was built without
libmtmd (the README's build has it: ``test_project`` fails without it)."""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from localchat.backends.llama.vision import (
    CHUNK_IMAGE,
    CHUNK_TEXT,
    MEDIA_MARKER,
    Image,
    Projector,
    mtmd_unavailable,
)
from localchat.errors import ModelLoadError
from localchat.models.demo_vision import PROJECTOR_SHAPES, make_projector
from tests.image_helpers import vision_model_with

pytestmark = pytest.mark.skipif(
    mtmd_unavailable() is not None, reason=mtmd_unavailable() or "libmtmd loads"
)

PROMPT = f"<|im_start|>user\nLook: {MEDIA_MARKER} what is it?<|im_end|>\n<|im_start|>assistant\n"
FOLLOW = "A cat.<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def projector_file(models_dir: Path) -> Path:
    return make_projector(models_dir / "mmproj-vit-tiny.gguf", "tiny", "vit-tiny")


def _llm(model: Path, n_ubatch: int = 256) -> llama_cpp.Llama:
    return llama_cpp.Llama(
        model_path=str(model),
        n_ctx=512,
        n_batch=256,
        n_ubatch=n_ubatch,
        n_threads=2,
        verbose=False,
    )


@pytest.fixture
def opened(tiny_model: Path, projector_file: Path) -> Iterator[tuple[llama_cpp.Llama, Projector]]:
    llm = _llm(tiny_model)
    with Projector(projector_file, llm) as projector:
        yield llm, projector


def _pixels(seed: int, width: int = 40, height: int = 30) -> Image:
    """Random RGB pixels, not square and not the projector's size: libmtmd resizes them."""
    data = np.random.default_rng(seed).integers(0, 256, width * height * 3, dtype=np.uint8)
    return Image(data.tobytes(), width, height)


def _bmp(width: int, height: int) -> bytes:
    """A 24-bit BMP file (stb_image reads it; no imaging package needed)."""
    row = b"".join(bytes((x * 7 % 256, x * 3 % 256, 128)) for x in range(width))
    row += b"\0" * (-len(row) % 4)
    pixels = row * height
    header = struct.pack("<2sIHHI", b"BM", 54 + len(pixels), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, len(pixels), 2835, 2835, 0, 0)
    return header + info + pixels


class Images:
    """A store of a few images for a reader (``ImageSource``): ids by key and variant."""

    def __init__(self, *images: Image) -> None:
        self.data = {image.key: image.data for image in images}
        self.ids: dict[str, int] = {}

    def get(self, key: str) -> bytes:
        return self.data[key]

    def image_id(self, key: str, variant: str = "") -> int:
        return self.ids.setdefault(f"{key}@{variant}", len(self.ids) + 1)

    def name_of_id(self, image_id: int) -> tuple[str, str]:
        key, _, variant = next(n for n, i in self.ids.items() if i == image_id).partition("@")
        return key, variant


def _last_logits(llm: llama_cpp.Llama) -> np.ndarray:
    n_vocab = llm.n_vocab()
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), (n_vocab,)).copy()


def _save(llm: llama_cpp.Llama) -> bytes:
    size = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
    buffer = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(llm.ctx, buffer, size, 0)
    return bytes(memoryview(buffer)[:written])


def _load(llm: llama_cpp.Llama, data: bytes) -> int:
    buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    return int(llama_cpp.llama_state_seq_set_data(llm.ctx, buffer, len(data), 0))


def test_libmtmds_own_marker_typed_in_a_message_is_text(
    opened: tuple[llama_cpp.Llama, Projector],
) -> None:
    import llama_cpp.mtmd_cpp as mtmd

    _, projector = opened
    typed = mtmd.mtmd_default_marker().decode()  # <__media__>
    assert typed != MEDIA_MARKER
    chunks = projector.chunks(f"What does {typed} mean?")
    assert [c.kind for c in chunks] == [CHUNK_TEXT]


def test_an_image_is_one_chunk_at_its_marker(opened: tuple[llama_cpp.Llama, Projector]) -> None:
    llm, projector = opened
    image = _pixels(1)
    chunks = projector.chunks(PROMPT, [image])
    assert [c.kind for c in chunks] == [CHUNK_TEXT, CHUNK_IMAGE, CHUNK_TEXT]
    before, _, after = PROMPT.partition(MEDIA_MARKER)
    assert list(chunks[0].tokens) == llm.tokenize(before.encode(), add_bos=True, special=True)
    assert list(chunks[2].tokens) == llm.tokenize(after.encode(), add_bos=False, special=True)
    expected = PROJECTOR_SHAPES["vit-tiny"].image_tokens
    assert chunks[1].n_tokens == chunks[1].n_pos == expected == projector.image_tokens(image)
    assert chunks[1].image_key == image.key
    assert not projector.mrope and not projector.non_causal and projector.vision


def test_an_encoded_file_is_read_and_keyed_by_its_hash(
    opened: tuple[llama_cpp.Llama, Projector],
) -> None:
    _, projector = opened
    data = _bmp(20, 12)
    bos, image = projector.chunks(MEDIA_MARKER, [Image(data)])  # BOS: the vocabulary adds it
    assert bos.kind == CHUNK_TEXT and bos.tokens == (1,)
    assert image.kind == CHUNK_IMAGE and image.image_key == hashlib.sha256(data).hexdigest()


def test_a_projector_for_another_width_is_refused_with_libmtmds_reason(
    tiny_model: Path, tmp_path: Path
) -> None:
    wrong = make_projector(tmp_path / "mmproj-small.gguf", "small", "vit-tiny")
    with pytest.raises(ModelLoadError, match="mismatch between text model"):
        Projector(wrong, _llm(tiny_model))


def test_markers_and_images_must_pair_up(opened: tuple[llama_cpp.Llama, Projector]) -> None:
    _, projector = opened
    with pytest.raises(ValueError, match="tokenize"):
        projector.chunks(PROMPT, [])


def test_a_restored_state_continues_exactly(
    tiny_model: Path, projector_file: Path, opened: tuple[llama_cpp.Llama, Projector]
) -> None:
    """Text, image, text evaluated and the sequence's state saved; restored into a fresh
    context, the next turn's logits are the fresh evaluation's, bit for bit: the state holds
    the image (no projector needed to resume), and a different image changes them."""
    llm, projector = opened
    starts = projector.evaluate(PROMPT, [_pixels(1)], 0)
    state = _save(llm)
    follow = llm.tokenize(FOLLOW.encode(), add_bos=False, special=True)

    restored = _llm(tiny_model)
    assert _load(restored, state) == len(state)
    restored.n_tokens = starts[-1]
    restored.eval(follow)
    fresh = _llm(tiny_model)
    with Projector(projector_file, fresh) as again:
        assert again.evaluate(PROMPT, [_pixels(1)], 0) == starts
    fresh.n_tokens = starts[-1]
    fresh.eval(follow)
    assert np.array_equal(_last_logits(restored), _last_logits(fresh))

    other = _llm(tiny_model)
    with Projector(projector_file, other) as again:
        again.evaluate(PROMPT, [_pixels(2)], 0)
    other.n_tokens = starts[-1]
    other.eval(follow)
    assert not np.array_equal(_last_logits(other), _last_logits(fresh))


def test_a_non_causal_image_is_decoded_whole(tiny_model: Path, tmp_path: Path) -> None:
    """Gemma 3's projector decodes an image with non-causal attention: a small batch size
    does not split it (the logits are those of one batch), and a context whose ubatch
    cannot hold it is refused rather than split."""
    projector = make_projector(tmp_path / "mmproj-gemma3.gguf", "tiny", "gemma3-tiny")
    logits = []
    for n_batch in (4, 256):
        llm = _llm(tiny_model)
        with Projector(projector, llm) as opened:
            assert opened.non_causal and not opened.mrope
            image = [c for c in opened.chunks(PROMPT, [_pixels(1)]) if c.kind == CHUNK_IMAGE]
            assert image[0].n_tokens == PROJECTOR_SHAPES["gemma3-tiny"].image_tokens
            opened.evaluate(PROMPT, [_pixels(1)], 0, n_batch=n_batch)
        logits.append(_last_logits(llm))
    assert np.array_equal(logits[0], logits[1])
    with (
        Projector(projector, _llm(tiny_model, n_ubatch=8)) as opened,
        pytest.raises(ValueError, match="in one micro-batch"),
    ):
        opened.evaluate(PROMPT, [_pixels(1)], 0)


@pytest.mark.parametrize("shape", sorted(PROJECTOR_SHAPES))
def test_the_reader_tokenizes_as_libmtmd_does_the_whole_prompt(
    models_dir: Path, shape: str
) -> None:
    """The reader lays each image out once and tokenizes the text between images itself:
    the same ids libmtmd gives the whole prompt, begin/end-of-image tokens included, and
    the text libmtmd writes between a sliced image's overview and slices (Idefics3's), each
    slice a run of its own."""
    from localchat.backends.llama.image_positions import image_id_of, image_starts
    from localchat.backends.llama.image_reader import EmbeddingStore, ImageReader
    from localchat.chat.images import image_keys, image_marker

    model = vision_model_with(models_dir, shape)
    llm = _llm(model)
    source = Images(_bmp_image(5, 4), _bmp_image(9, 7))
    one, two = sorted(source.data)
    with Projector(model.parent / "mmproj-tiny-vision-F16.gguf", llm) as projector:
        reader = ImageReader(projector, source, EmbeddingStore(None, ""))
        pictures = {key: projector.pixels(Image(source.get(key))) for key in (one, two)}
        slices = {key: len(_image_chunks(projector, image)) for key, image in pictures.items()}
        assert slices[one] == (5 if shape.startswith("idefics3") else 1)

        def plain(text: str) -> list[int]:
            return list(llm.tokenize(text.encode(), add_bos=False, special=True))

        for text in (
            f"<|im_start|>user\n{image_marker(one)}\nWhat is it?<|im_end|>\n",
            f"Compare {image_marker(one)} with{image_marker(two)}, then {image_marker(one)}.",
            f"{image_marker(two)}{image_marker(two)}\n\n  tail",
        ):
            whole = text.replace(image_marker(one), MEDIA_MARKER).replace(
                image_marker(two), MEDIA_MARKER
            )
            expected: list[int] = []
            seen = 0  # image chunks of the prompt so far
            order = [key for key in image_keys(text) for _ in range(slices[key])]
            images = [pictures[key] for key in image_keys(text)]
            for chunk in projector.chunks(whole, images, add_special=False):
                if chunk.kind == CHUNK_TEXT:
                    expected.extend(chunk.tokens)
                    continue
                key = order[seen]
                index = sum(1 for k in order[:seen] if k == key) % slices[key]
                variant = f"{index:04x}" if index else ""
                image_id = source.image_id(key, variant)
                expected.extend([-2 * image_id] + [-(2 * image_id + 1)] * (chunk.n_tokens - 1))
                seen += 1
            assert reader.tokens(text, plain) == expected
        # A reader that never laid the image out (another process's) finds each run's image
        # and chunk from the store's name of its id, and nothing of another projector's.
        fresh = ImageReader(projector, source, EmbeddingStore(None, ""))
        alone = reader.tokens(image_marker(one), plain)
        for start in image_starts(alone):
            run_id = image_id_of(alone[start])
            key, index = fresh._slice_of(run_id)
            assert key == one and source.image_id(one, f"{index:04x}" if index else "") == run_id
        other = ImageReader(projector, source, EmbeddingStore(None, "ab" * 16))
        with pytest.raises(ValueError, match="names no image chunk this projector reads"):
            other._slice_of(source.image_id(one))


@pytest.mark.parametrize("shape", sorted(set(PROJECTOR_SHAPES) - {"vit-bench"}))  # 576 cells
def test_the_engine_places_an_image_as_libmtmds_helper_does(models_dir: Path, shape: str) -> None:
    """Text, an image, text: evaluated by the engine's own path (the reader's tokens, each
    image decoded at its run, text by ``RecordingLlama``) and by libmtmd's helper
    (``mtmd_helper_eval_chunk_single``, as llama-server evaluates a prompt), the logits are
    the same, then too after a follow-up turn. Qwen2-VL's projector places an image with
    M-RoPE, its cells sharing positions and the text after it coming after its longer side:
    the engine's text positions follow it, not the cells' count."""
    from localchat.backends.llama.image_positions import image_starts
    from localchat.backends.llama.image_reader import open_reader
    from localchat.backends.llama.recording import RecordingLlama
    from localchat.chat.images import image_marker

    model = vision_model_with(models_dir, shape)
    projector_file = model.parent / "mmproj-tiny-vision-F16.gguf"
    picture = _bmp_image(40, 30)
    helper = _llm(model)
    with Projector(projector_file, helper) as libmtmd:
        starts = libmtmd.evaluate(PROMPT, [picture], 0)
    expected = _last_logits(helper)

    engine_llm = RecordingLlama(model_path=str(model), n_ctx=512, n_batch=256, n_ubatch=256,
                                n_threads=2, verbose=False)  # fmt: skip
    reader = open_reader(projector_file, engine_llm, Images(picture), None, 2)
    try:

        def plain(text: str) -> list[int]:
            return list(engine_llm.tokenize(text.encode(), add_bos=False, special=True))

        bos = [engine_llm.token_bos()]
        tokens = bos + reader.tokens(PROMPT.replace(MEDIA_MARKER, image_marker(picture.key)), plain)
        engine_llm.eval(tokens)
        assert np.array_equal(_last_logits(engine_llm), expected)
        behind = reader.positions_behind(tokens)
        assert (behind > 0) == reader.mrope == shape.startswith("qwen2vl")
        first = image_starts(tokens)[0]  # a cell inside an image is at the image's start
        assert engine_llm.position(first + 2) == engine_llm.position(first) == first
        assert starts[-1] == len(tokens) - behind  # where libmtmd's helper ended

        follow = plain(FOLLOW)
        engine_llm.eval(follow)
        helper.n_tokens = starts[-1]  # its token record is not kept by libmtmd's helper
        helper.eval(follow)  # positions from n_tokens: the helper's own, past the image
        assert np.array_equal(_last_logits(engine_llm), _last_logits(helper))
    finally:
        reader.close()
        engine_llm.close()
        helper.close()


def _image_chunks(projector: Projector, image: Image) -> list[object]:
    chunks = projector.chunks(MEDIA_MARKER, [image], add_special=False)
    return [chunk for chunk in chunks if chunk.kind == CHUNK_IMAGE]


def _bmp_image(width: int, height: int) -> Image:
    return Image(_bmp(width, height))
