"""Images in messages, on real Pillow-made files and real SQLite: what is refused before it
is stored or decoded, the private content-addressed store and its ids that are never
reused, messages that show images (forks too), deleting what nothing shows, exports."""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
import time
import zlib
from io import BytesIO
from pathlib import Path

import pytest
from PIL import Image

from localchat.chat.image_files import (
    MAX_IMAGE_BYTES,
    ImageRejected,
    inspect_image,
    is_image_path,
    looks_like_image,
    read_image_file,
)
from localchat.paths import app_paths
from localchat.state.export import export_json, export_markdown
from localchat.state.images import (
    FIRST_ID_SPAN,
    ImageMissing,
    ImageStore,
    delete_unreferenced,
    image_key,
)
from localchat.state.store import Store


def _image(fmt: str, size: tuple[int, int] = (32, 24), mode: str = "RGB", **save: object) -> bytes:
    """A real image file: a gradient (so a compressed file is not all one run)."""
    image = Image.new(mode, size)
    image.putdata([((x * 7) % 256, (y * 11) % 256, (x + y) % 256) for y in range(size[1])
                   for x in range(size[0])] if mode == "RGB" else [0] * (size[0] * size[1]))  # fmt: skip
    out = BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A real 1x1 PNG whose header says ``width`` x ``height`` (its checksum made right):
    what a decompression bomb looks like before anything is decoded."""
    data = bytearray(_image("PNG", (1, 1)))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


# -- checking a file -------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "mime"), [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                           ("GIF", "image/gif"), ("BMP", "image/bmp")])  # fmt: skip
def test_formats_libmtmd_reads_are_kept_as_given(fmt: str, mime: str) -> None:
    data = _image(fmt)
    facts = inspect_image(data, f"photo.{fmt.lower()}")
    assert (facts.mime, facts.width, facts.height) == (mime, 32, 24)
    assert facts.data == data and facts.size_bytes == len(data)
    assert looks_like_image(data)


def test_webp_and_tiff_are_kept_as_png() -> None:
    for fmt in ("WEBP", "TIFF"):
        data = _image(fmt, (40, 30))
        assert looks_like_image(data)
        facts = inspect_image(data, "pic")
        assert (facts.mime, facts.width, facts.height) == ("image/png", 40, 30)
        assert facts.data.startswith(b"\x89PNG") and facts.size_bytes == len(facts.data)
        assert Image.open(BytesIO(facts.data)).size == (40, 30)


def test_a_file_that_is_not_an_image_is_refused_saying_what_it_is() -> None:
    with pytest.raises(ImageRejected, match=r"notes\.txt is not an image \(PNG, JPEG, GIF"):
        inspect_image(b"just some text\n", "notes.txt")
    with pytest.raises(ImageRejected, match=r"paper\.pdf is a PDF.*convert it to PNG or JPEG"):
        inspect_image(b"%PDF-1.7\n...", "paper.pdf")
    assert not looks_like_image(b"just some text")


def test_an_empty_file_is_refused() -> None:
    with pytest.raises(ImageRejected, match=r"empty\.png is empty"):
        inspect_image(b"", "empty.png")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_file_cut_short_is_refused(fmt: str) -> None:
    data = _image(fmt, (64, 64))
    with pytest.raises(ImageRejected, match=r"cut.* is damaged or cut short"):
        inspect_image(data[: len(data) // 2], f"cut.{fmt.lower()}")


def test_a_png_with_a_damaged_chunk_is_refused() -> None:
    data = bytearray(_image("PNG", (16, 16)))
    data[-20] ^= 0xFF  # inside IDAT: its checksum no longer matches
    with pytest.raises(ImageRejected, match="is damaged or cut short"):
        inspect_image(bytes(data), "bad.png")


def test_too_many_bytes_is_refused_before_pillow_reads_it(tmp_path: Path) -> None:
    big = _image("PNG", (2, 2)) + b"\x00" * MAX_IMAGE_BYTES
    with pytest.raises(ImageRejected, match=r"big\.png is 20\.0 MiB.*larger than the 20"):
        inspect_image(big, "big.png")
    path = tmp_path / "huge.png"
    path.write_bytes(big)
    with pytest.raises(ImageRejected, match=r"huge\.png is .*larger than"):
        read_image_file(path)


@pytest.mark.parametrize("side", [8000, 20000])  # under and over Pillow's own guard
def test_a_header_claiming_too_many_pixels_is_refused_before_decoding(side: int) -> None:
    bomb = _png_claiming(side, side)
    start = time.perf_counter()
    with pytest.raises(ImageRejected) as refused:
        inspect_image(bomb, "bomb.png")
    assert time.perf_counter() - start < 0.5
    # Refused for its pixels, from the header: a decode would have said "cut short".
    assert "megapixels an image may have; scale it down" in str(refused.value)
    assert "cut short" not in str(refused.value)
    if side == 8000:
        assert "8000x8000 pixels" in str(refused.value)


def test_a_zero_sized_header_is_refused() -> None:
    with pytest.raises(ImageRejected, match=r"zero\.png opens like an image but cannot be read"):
        inspect_image(_png_claiming(0, 5), "zero.png")


def test_image_paths_are_told_from_text_by_their_first_bytes(tmp_path: Path) -> None:
    (tmp_path / "a.webp").write_bytes(_image("WEBP"))
    (tmp_path / "a.txt").write_text("hello")
    assert is_image_path(tmp_path / "a.webp")
    assert not is_image_path(tmp_path / "a.txt")
    assert not is_image_path(tmp_path / "missing.png")
    assert not is_image_path(tmp_path)
    with pytest.raises(ImageRejected, match=r"missing\.png: no such file"):
        read_image_file(tmp_path / "missing.png")
    assert read_image_file(tmp_path / "a.webp").mime == "image/png"


# -- the store ---------------------------------------------------------------------------
def test_an_image_is_stored_once_privately_under_its_hash(tmp_path: Path) -> None:
    images = ImageStore(tmp_path / "images")
    facts = inspect_image(_image("PNG"), "a.png")
    stored = images.put(facts)
    assert stored.key == image_key(facts.data) == images.put(facts).key
    assert stored.path == tmp_path / "images" / stored.key[:2] / stored.key
    assert images.get(stored.key) == facts.data
    assert images.facts(stored.key) == stored
    assert (stored.mime, stored.width, stored.height) == ("image/png", 32, 24)
    assert images.keys() == [stored.key]
    assert stat.S_IMODE(stored.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(stored.path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "images").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "images" / "ids.sqlite").stat().st_mode) == 0o600
    assert len(list(stored.path.parent.iterdir())) == 2  # the file and its note, no temp
    assert images.delete(stored.key) and not images.delete(stored.key)
    with pytest.raises(ImageMissing, match=f"image {stored.key[:12]} is not in"):
        images.get(stored.key)
    with pytest.raises(ValueError, match="not an image key"):
        images.path("../../etc/passwd")


def test_ids_are_never_reused_and_the_same_image_keeps_its_own(tmp_path: Path) -> None:
    images = ImageStore(tmp_path / "images")
    first = images.put(inspect_image(_image("PNG", (5, 5)), "a.png"))
    first_id = images.image_id(first.key)
    images.delete(first.key)
    second = images.put(inspect_image(_image("PNG", (6, 6)), "b.png"))
    assert images.image_id(second.key) > first_id
    assert (
        images.image_id(images.put(inspect_image(_image("PNG", (5, 5)), "a.png")).key) == first_id
    )
    other = ImageStore(tmp_path / "images")  # another store on the same folder
    assert other.image_id(second.key) == images.image_id(second.key)
    assert other.name_of_id(first_id) == (first.key, "")
    assert other.name_of_id(other.image_id(first.key, "ab12")) == (first.key, "ab12")
    third = "c" * 64
    assert other.image_id(third) > images.image_id(second.key)
    assert images.image_id(third) == other.image_id(third)
    with pytest.raises(ImageMissing, match="no image has id 999"):
        images.name_of_id(999)
    images.close()
    other.close()


def test_processes_asking_together_get_the_same_ids(tmp_path: Path) -> None:
    keys = [f"{n:064x}" for n in range(30)]
    code = (
        "import json, sys; from pathlib import Path; from localchat.state.images import ImageStore;"
        "s = ImageStore(Path(sys.argv[1])); keys = json.loads(sys.argv[2]);"
        "print(json.dumps({k: s.image_id(k) for k in keys}))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "images"), json.dumps(order)],
            stdout=subprocess.PIPE,
            env=env,
        )
        for order in (keys, keys[::-1], keys[10:] + keys[:10])
    ]
    results = [json.loads(run.communicate(timeout=30)[0]) for run in runs]
    assert results[0] == results[1] == results[2]
    first = min(results[0].values())
    assert sorted(results[0].values()) == list(range(first, first + 30))  # none skipped
    assert 0 < first <= FIRST_ID_SPAN  # from a random start: a lost table starts elsewhere


# -- messages that show images -------------------------------------------------------------
@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "data" / "db.sqlite3")


def _put(images: ImageStore, size: tuple[int, int]) -> str:
    return images.put(inspect_image(_image("PNG", size), "x.png")).key


def test_a_messages_images_are_kept_in_order_and_forked_along(store: Store, tmp_path: Path) -> None:
    images = ImageStore(tmp_path / "images")
    a, b = _put(images, (3, 3)), _put(images, (4, 4))
    conv = store.create_conversation("pics")
    store.add_message(conv.id, "user", "what are these?", images=[b, a])
    store.add_message(conv.id, "assistant", "two squares")
    shown = store.messages(conv.id)
    assert [m.images for m in shown] == [(b, a), ()]
    assert shown[0].chat_message.images == (b, a)
    assert store.db.execute("SELECT images FROM messages WHERE seq = 1").fetchone()[0] is None
    fork = store.fork_conversation(conv, shown, "pics-2")
    assert [m.images for m in store.messages(fork.id)] == [(b, a), ()]
    assert store.image_references() == {a, b}


def test_deleting_a_conversation_deletes_only_the_images_nothing_else_shows(
    store: Store, tmp_path: Path
) -> None:
    images = ImageStore(tmp_path / "images")
    shared, own, loose = _put(images, (3, 3)), _put(images, (4, 4)), _put(images, (5, 5))
    gone = store.create_conversation("gone")
    kept = store.create_conversation("kept")
    store.add_message(gone.id, "user", "both", images=[shared, own])
    store.add_message(kept.id, "user", "one", images=[shared])
    lost = store.delete_conversation(gone.id)
    assert lost == [own]
    assert delete_unreferenced(store, images, lost, keep_recent_s=0) == [own]
    assert images.keys() == sorted([shared, loose])
    # A sweep (no keys) keeps what was stored just now: its message may not be written yet.
    assert delete_unreferenced(store, images) == []
    assert delete_unreferenced(store, images, keep_recent_s=0) == [loose]
    assert images.keys() == [shared]


def test_an_image_a_kept_response_shows_is_referenced_and_never_swept(
    store: Store, tmp_path: Path
) -> None:
    """A Responses API client may continue a kept response: its images stay."""
    from localchat.chat.template import ChatMessage
    from localchat.state.responses import ResponseStore

    images = ImageStore(tmp_path / "images")
    shown, loose = _put(images, (3, 3)), _put(images, (4, 4))
    message = ChatMessage("user", "what is it?", images=(shown,), image_at=(5,))
    ResponseStore(store).save("resp_1", [message, ChatMessage("assistant", "a square")], {})
    kept = ResponseStore(store).get("resp_1")
    assert kept is not None and kept.messages[0] == message  # its image where it was sent
    assert store.image_references() == {shown}
    assert delete_unreferenced(store, images, keep_recent_s=0) == [loose]
    assert images.keys() == [shown]


def test_a_sweep_deletes_only_what_was_not_stored_again_since(tmp_path: Path) -> None:
    """The check and the delete are one step under the store's lock; a put of an image whose
    file went meanwhile writes it again rather than failing."""
    images = ImageStore(tmp_path / "images")
    key = _put(images, (3, 3))
    now = time.time()
    assert not images.delete_if_unsent(key, since=now - 60)  # stored since then: kept
    assert images.delete_if_unsent(key, since=now + 60)
    assert images.find(key) is None and not images.delete_if_unsent(key, since=now + 60)
    assert _put(images, (3, 3)) == key and images.find(key) is not None
    images.path(key).unlink()  # gone under a put that found its note
    assert _put(images, (3, 3)) == key and images.get(key)


# -- exports ---------------------------------------------------------------------------------
def test_exports_name_each_image_by_its_stored_file(store: Store) -> None:
    images = ImageStore(app_paths().images_dir)  # the isolated data folder's
    key = _put(images, (7, 5))
    conv = store.create_conversation("exported")
    store.add_message(conv.id, "user", "look at this", images=[key])
    store.add_message(conv.id, "assistant", "a picture")
    record, messages = store.get("exported"), store.messages(conv.id)
    markdown = export_markdown(record, messages)
    link = f"![{key[:12]}]({images.path(key).as_uri()})"
    assert f"## user\n\n{link}\n\nlook at this" in markdown
    payload = json.loads(export_json(record, messages, tree=store.all_messages(conv.id)))
    row = {"key": key, "path": str(images.path(key)), "mime": "image/png", "width": 7,
           "height": 5}  # fmt: skip
    assert payload["messages"][0]["images"] == [row]
    assert "images" not in payload["messages"][1]
    assert payload["tree"][0]["images"] == [row]
    images.delete(key)  # a missing file is still named, without what it held
    again = json.loads(export_json(record, messages, images=images))
    assert again["messages"][0]["images"] == [{"key": key, "path": str(images.path(key))}]


def test_rm_conversation_deletes_the_images_only_it_showed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from localchat.cli.main import main

    paths = app_paths()
    images = ImageStore(paths.images_dir)
    shared, own = _put(images, (3, 3)), _put(images, (4, 4))
    for key in (shared, own):  # stored long enough ago for a sweep to take
        old = time.time() - 3600
        os.utime(images.path(key), (old, old))
    store = Store(paths.database)
    gone, kept = store.create_conversation("gone"), store.create_conversation("kept")
    store.add_message(gone.id, "user", "both", images=[shared, own])
    store.add_message(kept.id, "user", "one", images=[shared])
    store.close()
    assert main(["rm-conversation", "gone"]) == 0
    assert "deleted conversation 'gone'" in capsys.readouterr().out
    assert images.keys() == [shared]
