"""Hub downloads through the real huggingface-hub client against a local hub server."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import hf_hub_download

from localchat.cli.main import main
from localchat.errors import ModelFileError, UsageError, WorldError
from localchat.models.demo import make_demo_model
from localchat.models.hardware import Hardware
from localchat.models.hub import DownloadCancelled, HubError
from localchat.models.library import Library
from localchat.paths import app_paths
from localchat.progress import Progress

from .hubserver import HubServer, HubState

GIB = 1024**3
REPO = "demo/small-GGUF"
# A repo laid out like unsloth's and bartowski's: vendor tags, BF16 beside F16, a projector.
ZOO = "acme/zoo-GGUF"
ZOO_FILES = (
    "zoo-UD-Q4_K_XL.gguf",
    "zoo-F16.gguf",
    "zoo-BF16.gguf",
    "zoo-IQ4_XS.gguf",
    "zoo-Q5_0.gguf",
    "zoo.i1-Q4_K_M.gguf",
    "mmproj-zoo-F16.gguf",
)


@pytest.fixture
def hub(
    tmp_path: Path, small_model: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[HubState]:
    repo_dir = tmp_path / "hub" / REPO
    repo_dir.mkdir(parents=True)
    shutil.copy(small_model, repo_dir / "small-Q4_K_M.gguf")
    make_demo_model(repo_dir / "small-Q8_0.gguf", "small", "Q8_0")
    (repo_dir / "README.md").write_text("a demo repo")
    empty = tmp_path / "hub" / "demo" / "no-gguf"
    empty.mkdir(parents=True)
    (empty / "README.md").write_text("nothing to run here")
    split = tmp_path / "hub" / "demo" / "split-GGUF"
    split.mkdir(parents=True)
    shutil.copy(tiny_model, split / "tiny-Q4_K_M-00001-of-00002.gguf")
    make_demo_model(split / "tiny-Q4_K_M-00002-of-00002.gguf", "tiny", "Q4_K_M", seed=5)
    zoo = tmp_path / "hub" / ZOO
    zoo.mkdir(parents=True)
    for seed, name in enumerate(ZOO_FILES, start=10):
        make_demo_model(zoo / name, "tiny", "F16", seed=seed)
    shutil.copy(zoo / "zoo-Q5_0.gguf", zoo / "zoo-Q4_0.gguf")  # the same bytes: one blob
    repos = {REPO: repo_dir, "demo/no-gguf": empty, "demo/split-GGUF": split, ZOO: zoo}
    state = HubState(repos)
    server = HubServer(state).start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    yield state
    server.stop()


def _library() -> Library:
    return Library(app_paths(), Hardware(16 * GIB, 16 * GIB, 4))


def test_fresh_download_lands_in_the_standard_hub_cache(hub: HubState) -> None:
    events: list[tuple[str, int, int]] = []
    path = _pull(
        _library(),
        f"{REPO}:Q4_K_M",
        lambda p: events.append((p.state, p.bytes_done, p.bytes_total)),
    )
    source = hub.repos[REPO] / "small-Q4_K_M.gguf"
    assert path.read_bytes() == source.read_bytes()
    # The real hub client finds it offline: the cache layout is huggingface-hub's own.
    cached = hf_hub_download(
        REPO, "small-Q4_K_M.gguf", cache_dir=app_paths().hub_cache, local_files_only=True
    )
    assert Path(cached).read_bytes() == source.read_bytes()
    states = [state for state, _, _ in events]
    assert states[0] == "downloading" and "verifying" in states and states[-1] == "done"
    assert events[-1][1] == events[-1][2] == source.stat().st_size


def test_a_transfer_cut_mid_file_is_resumed_to_identical_bytes(hub: HubState) -> None:
    hub.cut_after_bytes = 3_000_000
    path = _pull(_library(), f"{REPO}:Q4_K_M")
    assert path.read_bytes() == (hub.repos[REPO] / "small-Q4_K_M.gguf").read_bytes()
    ranges = [
        r for method, p, r in hub.requests if method == "GET" and p.endswith("small-Q4_K_M.gguf")
    ]
    assert ranges[0] == "bytes=0-" and len(ranges) == 2
    resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= 3_000_000, "the retry continues from the bytes already on disk"


def test_cancel_leaves_a_partial_file_that_the_next_pull_resumes(hub: HubState) -> None:
    cancel = threading.Event()

    def stop_after_first_chunk(progress: Progress) -> None:
        if progress.state == "downloading" and progress.bytes_done > 0:
            cancel.set()

    library = _library()
    with pytest.raises(DownloadCancelled, match="run the pull again to resume"):
        library.pull(library.request(f"{REPO}:Q8_0"), stop_after_first_chunk, cancel)
    partials = list(app_paths().hub_cache.rglob("*.incomplete"))
    assert len(partials) == 1
    kept = partials[0].stat().st_size
    assert 0 < kept < (hub.repos[REPO] / "small-Q8_0.gguf").stat().st_size
    assert library.path_of(library.request(f"{REPO}:Q8_0")) is None, (
        "a partial file is never offered for loading"
    )
    hub.requests.clear()
    resumed: list[Progress] = []
    path = library.pull(library.request(f"{REPO}:Q8_0"), resumed.append)
    assert path.read_bytes() == (hub.repos[REPO] / "small-Q8_0.gguf").read_bytes()
    assert any(r == f"bytes={kept}-" for _, _, r in hub.requests)
    # The speed and time left count only this run's bytes, not those the partial file had.
    progress = resumed[-1]
    assert progress.bytes_at_start == kept
    progress.started_at -= 100.0  # as if this run took 100 s more
    expected = (progress.bytes_done - kept) / 100.0
    assert expected * 0.99 <= progress.speed <= expected * 1.01


def test_corrupted_bytes_are_detected_and_never_loaded(hub: HubState) -> None:
    hub.corrupt.add("small-Q4_K_M.gguf")
    with pytest.raises(
        ModelFileError, match=r"arrived damaged .*sha256.* it was deleted, not loaded"
    ):
        _pull(_library(), f"{REPO}:Q4_K_M")
    assert not list(app_paths().hub_cache.rglob("small-Q4_K_M.gguf"))
    assert not list(app_paths().hub_cache.rglob("*.incomplete"))


def test_planner_picks_the_quant_when_none_is_given(hub: HubState) -> None:
    library = _library()
    repo, filename, quant = library.resolve(library.request(REPO))
    assert (repo, quant) == (REPO, "Q8_0")  # the best quality that fits 16 GB
    # The choice came from reading only the smaller file's header, by range requests.
    assert any(r.startswith("bytes=0-") for _, _, r in hub.requests)
    assert filename == "small-Q8_0.gguf"


def test_split_files_are_fetched_as_a_set(hub: HubState) -> None:
    path = _pull(_library(), "demo/split-GGUF:Q4_K_M")
    assert path.name == "tiny-Q4_K_M-00001-of-00002.gguf"
    assert (path.parent / "tiny-Q4_K_M-00002-of-00002.gguf").exists()


def test_bad_names_and_quants_are_clear(hub: HubState) -> None:
    library = _library()
    with pytest.raises(UsageError, match=r"no Q6_K file in demo/small-GGUF; it has Q8_0, Q4_K_M"):
        library.pull(library.request(f"{REPO}:Q6_K"))
    with pytest.raises(UsageError, match="has no GGUF files"):
        library.pull(library.request("demo/no-gguf"))
    with pytest.raises(HubError, match="no such repository"):
        library.pull(library.request("demo/nothing-here"))
    with pytest.raises(UsageError, match=r"did you mean qwen2\.5-0\.5b-instruct"):
        library.pull(library.request("qwen2.5-0.5b-instuct"))


def test_a_file_missing_on_the_hub(hub: HubState) -> None:
    from localchat.models.hub import Downloader, HubCache

    with pytest.raises(HubError, match="no such file on the hub"):
        Downloader(HubCache(app_paths().hub_cache)).pull(REPO, "gone-Q4_K_M.gguf")


def test_server_down_names_the_endpoint_and_suggests_model_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(
        HubError, match=r"cannot reach the hub at http://127.0.0.1:9 .*--model-path"
    ):
        _pull(_library(), "demo/anything:Q4_K_M")
    # Exit codes: the world failing is 1, the user's mistakes are 2.
    assert main(["pull", "demo/anything:Q4_K_M"]) == 1
    assert main(["pull", "no-such-catalog-name"]) == 2


def test_disk_too_small_refuses_before_downloading(
    hub: HubState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mount_point = tmp_path / f"small-disk-{uuid.uuid4().hex[:6]}"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small filesystem here (needs root)")
    try:
        monkeypatch.setenv("LOCALCHAT_HOME", str(mount_point))
        with pytest.raises(
            WorldError, match=r"not enough disk space for small-Q4_K_M.gguf: it needs .* free"
        ):
            _pull(_library(), f"{REPO}:Q4_K_M")
        assert main(["pull", f"{REPO}:Q4_K_M"]) == 1  # the disk, not the user: exit code 1
        assert not [
            path for method, path, _ in hub.requests if method == "GET" and "resolve" in path
        ]
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_models_lists_downloads_and_rm_removes_them(
    hub: HubState, small_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pull", f"{REPO}:Q4_K_M"]) == 0
    assert main(["add", str(small_model), "--name", "by-hand"]) == 0
    capsys.readouterr()
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    catalog = [r for r in rows if r["source"] == "catalog"]
    assert {r["fit"] for r in catalog} <= {"GPU", "RAM", "too big"}
    assert all(r["estimated_bytes"] > r["size_bytes"] for r in catalog)
    cached = [r for r in rows if r["source"] == "hub cache"]
    assert [(r["model"], r["quant"], r["downloaded"]) for r in cached] == [(REPO, "Q4_K_M", True)]
    assert [r["model"] for r in rows if r["source"] == "local"] == ["by-hand"]
    assert main(["rm", f"{REPO}:Q4_K_M"]) == 0
    assert main(["rm", "by-hand"]) == 0
    capsys.readouterr()
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert not [r for r in rows if r["source"] != "catalog"]
    assert main(["rm", f"{REPO}:Q4_K_M"]) == 2


def test_each_tag_pulls_exactly_its_file(hub: HubState) -> None:
    library = _library()
    for asked, name in [
        ("F16", "zoo-F16.gguf"),
        ("bf16", "zoo-BF16.gguf"),
        ("ud-q4_k_xl", "zoo-UD-Q4_K_XL.gguf"),
        ("IQ4_XS", "zoo-IQ4_XS.gguf"),
        ("Q5_0", "zoo-Q5_0.gguf"),
        ("i1-Q4_K_M", "zoo.i1-Q4_K_M.gguf"),
    ]:
        assert library.pull(library.request(f"{ZOO}:{asked}")).name == name
    snapshot = next((app_paths().hub_cache).glob("models--acme--zoo-GGUF/snapshots/*"))
    assert not (snapshot / "mmproj-zoo-F16.gguf").exists()  # the projector is not a chat model
    with pytest.raises(
        UsageError, match=r"it has BF16, F16, Q5_0, UD-Q4_K_XL, i1-Q4_K_M, IQ4_XS, Q4_0$"
    ):
        library.pull(library.request(f"{ZOO}:Q6_K"))


def test_the_listing_shows_tags_and_never_the_projector(hub: HubState) -> None:
    from localchat.models.hub import list_gguf_files

    files = list_gguf_files(ZOO)
    assert sorted(f.quant for f in files) == sorted(
        ["UD-Q4_K_XL", "F16", "BF16", "IQ4_XS", "Q5_0", "i1-Q4_K_M", "Q4_0"]
    )
    assert not [f for f in files if "mmproj" in f.filename]


def test_rm_removes_exactly_the_named_file_and_keeps_shared_blobs(hub: HubState) -> None:
    library = _library()
    for tag in ("F16", "BF16", "Q5_0", "Q4_0"):
        library.pull(library.request(f"{ZOO}:{tag}"))
    library.remove(f"{ZOO}:f16")
    left = {Path(name).name for _repo, name, _path in library.cache.downloaded()}
    assert left == {"zoo-BF16.gguf", "zoo-Q5_0.gguf", "zoo-Q4_0.gguf"}
    library.remove(f"{ZOO}:Q5_0")
    kept = [p for _r, name, p in library.cache.downloaded() if name == "zoo-Q4_0.gguf"]
    assert kept and kept[0].read_bytes()[:4] == b"GGUF"  # its blob was shared and stays


def test_pull_json_prints_progress_events_and_plain_progress_has_no_carriage_returns(
    hub: HubState, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pull", f"{REPO}:Q8_0", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["event"] == "downloading" and lines[0]["bytes_total"] > 0
    assert {"verifying", "done"} <= {e["event"] for e in lines}
    assert lines[-1]["path"].endswith("small-Q8_0.gguf")
    assert main(["pull", f"{REPO}:Q4_K_M"]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "downloading" in captured.err  # stderr is no terminal
    assert captured.out.strip().endswith("small-Q4_K_M.gguf")


def test_ask_takes_a_model_name_and_pulls_it(
    hub: HubState, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["ask", "hi", "--model", f"{REPO}:Q4_K_M", "--max-tokens", "3", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["model"] == "small-Q4_K_M.gguf"
    # Downloaded now: the second ask reads it from the cache without a transfer.
    before = len(hub.requests)
    assert main(args) == 0
    assert not [r for r in hub.requests[before:] if ".gguf" in r[1]]


def test_two_pulls_of_one_file_at_once_write_it_once(hub: HubState) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def pull() -> None:
        try:
            results.append(_pull(_library(), f"{REPO}:Q8_0"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=pull) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert results[0].read_bytes() == (hub.repos[REPO] / "small-Q8_0.gguf").read_bytes()
    full = [r for m, p, r in hub.requests if m == "GET" and p.endswith("small-Q8_0.gguf")]
    assert len(full) == 1, "the second waited for the first and found the file done"
    locks = list((app_paths().hub_cache / ".locks" / "models--demo--small-GGUF").glob("*.lock"))
    assert locks


def test_listing_shows_tags_split_sets_once_and_projectors_as_such(
    hub: HubState, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    library = _library()
    library.pull(library.request("demo/split-GGUF:Q4_K_M"))
    library.pull(library.request(f"{ZOO}:UD-Q4_K_XL"))
    library.pull(library.request(f"{ZOO}:F16"))
    snapshot = next(app_paths().hub_cache.glob("models--acme--zoo-GGUF/snapshots/*"))
    shutil.copy(tiny_model, snapshot / "mmproj-zoo-F16.gguf")  # as another tool might leave it
    capsys.readouterr()
    assert main(["models", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["source"] == "hub cache"]
    split = [r for r in rows if r["model"] == "demo/split-GGUF"]
    assert [r["file"] for r in split] == ["tiny-Q4_K_M-00001-of-00002.gguf"]
    zoo = {r["file"]: r for r in rows if r["model"] == ZOO}
    assert (zoo["zoo-UD-Q4_K_XL.gguf"]["quant"], zoo["zoo-UD-Q4_K_XL.gguf"]["file_type"]) == (
        "UD-Q4_K_XL",
        "F16",  # the demo file behind the tag holds F16 weights: the listing says both
    )
    projector = zoo["mmproj-zoo-F16.gguf"]
    assert projector["fit"] == "projector" and "vision projector" in projector["problem"]
    # A name that fits several downloads is refused with the candidates.
    assert main(["rm", ZOO]) == 2
    err = capsys.readouterr().err
    assert f"{ZOO}:UD-Q4_K_XL" in err and f"{ZOO}:F16" in err and "say which" in err
    assert main(["rm", "demo/split-GGUF"]) == 0  # one download: no doubt
    assert not [p for _r, n, p in library.cache.downloaded() if n.startswith("tiny-Q4_K_M-0000")]


def test_a_hostile_hub_cannot_write_outside_the_cache(hub: HubState, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    escape = "../../../../../../../../" + str(outside).lstrip("/") + "/escaped-Q5_K_S.gguf"
    hub.aliases[escape] = (REPO, "small-Q4_K_M.gguf")
    library = _library()
    with pytest.raises(
        HubError, match=rf"{REPO}: the hub listed a file name that leaves the cache"
    ):
        library.pull(library.request(f"{REPO}:Q5_K_S"))
    del hub.aliases[escape]
    hub.forged_etag = "../../../../" + str(outside).lstrip("/") + "/blob"
    with pytest.raises(HubError, match=rf"{REPO}: the hub sent an ETag that is not a checksum"):
        library.pull(library.request(f"{REPO}:Q4_K_M"))
    assert not outside.exists()
    cache = app_paths().hub_cache.resolve()
    for path in cache.rglob("*"):
        assert path.resolve().is_relative_to(cache) or not path.exists()


def test_a_stopped_download_is_listed_and_rm_deletes_it(
    hub: HubState, capsys: pytest.CaptureFixture[str]
) -> None:
    cancel = threading.Event()

    def stop_after_first_chunk(progress: Progress) -> None:
        if progress.state == "downloading" and progress.bytes_done > 0:
            cancel.set()

    library = _library()
    library.pull(library.request(f"{REPO}:Q4_K_M"))
    with pytest.raises(DownloadCancelled):
        library.pull(library.request(f"{REPO}:Q8_0"), stop_after_first_chunk, cancel)
    capsys.readouterr()
    assert main(["models", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["model"] == REPO]
    partial = next(r for r in rows if r["file"] == "small-Q8_0.gguf")
    assert partial["fit"] == "partial" and not partial["downloaded"]
    assert f"localchat pull {REPO}:Q8_0` resumes it" in partial["problem"]
    assert main(["rm", f"{REPO}:Q8_0"]) == 0
    assert not list(app_paths().hub_cache.rglob("*.incomplete"))
    assert not library.cache.partials()
    # The finished download beside it is untouched.
    assert library.path_of(library.request(f"{REPO}:Q4_K_M")) is not None


def test_rm_of_a_finished_file_takes_its_leftover_partial_too(hub: HubState) -> None:
    library = _library()
    path = library.pull(library.request(f"{REPO}:Q8_0"))
    blob = path.resolve()
    leftover = blob.with_name(blob.name + ".incomplete")  # a crash during a re-download
    leftover.write_bytes(b"GGUF")
    library.cache.note_partial(REPO, blob.name, "small-Q8_0.gguf")
    library.remove(f"{REPO}:Q8_0")
    assert not blob.exists() and not leftover.exists()


def test_a_vision_models_projector_comes_with_it_and_is_removed_apart(
    hub: HubState, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pull", f"{ZOO}:BF16", "--no-mmproj"]) == 0
    assert [Path(p).name for p in capsys.readouterr().out.split()] == ["zoo-BF16.gguf"]
    # By default: the model's own tag has no projector, so the F16 one (what vision repos
    # ship) comes along.
    assert main(["pull", f"{ZOO}:BF16"]) == 0
    out = capsys.readouterr().out.split()
    assert [Path(p).name for p in out] == ["zoo-BF16.gguf", "mmproj-zoo-F16.gguf"]
    library = _library()
    names = {Path(n).name for _r, n, _p in library.cache.downloaded()}
    assert names == {"zoo-BF16.gguf", "mmproj-zoo-F16.gguf"}
    # `rm ZOO:F16` names no model (the F16 file is a projector's); --mmproj names it.
    assert main(["rm", f"{ZOO}:F16"]) == 2
    assert "is not downloaded" in capsys.readouterr().err
    assert main(["rm", ZOO, "--mmproj"]) == 0
    names = {Path(n).name for _r, n, _p in library.cache.downloaded()}
    assert names == {"zoo-BF16.gguf"}
    assert main(["pull", f"{REPO}:Q8_0", "--mmproj"]) == 2
    assert f"{REPO} has no vision projector" in capsys.readouterr().err
    assert library.path_of(library.request(f"{REPO}:Q8_0")) is None, (
        "refused before the model was fetched"
    )


def test_a_catalog_vision_model_brings_the_projector_the_catalog_names(
    hub: HubState, capsys: pytest.CaptureFixture[str]
) -> None:
    zoo = hub.repos[ZOO]
    model, projector = zoo / "zoo-F16.gguf", zoo / "mmproj-zoo-F16.gguf"
    app_paths().user_catalog.parent.mkdir(parents=True, exist_ok=True)
    app_paths().user_catalog.write_text(
        f"""
[[model]]
name = "zoo-vision"
repo = "{ZOO}"
architecture = "llama"
n_layer = 2
n_embd = 64
n_head = 4
n_head_kv = 4
head_dim = 16
n_vocab = 512
context_length = 2048
[model.files]
F16 = {{ file = "zoo-F16.gguf", size = {model.stat().st_size} }}
[model.mmproj]
F16 = {{ file = "mmproj-zoo-F16.gguf", size = {projector.stat().st_size} }}
[model.vision]
image_size = 32
patch_size = 8
n_embd = 64
n_ff = 128
n_head = 4
"""
    )
    assert main(["pull", "zoo-vision"]) == 0
    out = capsys.readouterr().out.split()
    assert [Path(p).name for p in out] == ["zoo-F16.gguf", "mmproj-zoo-F16.gguf"]
    assert Path(out[1]).read_bytes() == projector.read_bytes()
    # Chosen from the catalog: the repo was never listed for its projectors.
    assert not [p for _m, p, _r in hub.requests if p.startswith("/api/models")]
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    assert "zoo-vision" in listing and "(vision)" in listing
    assert main(["pull", "zoo-vision", "--no-mmproj"]) == 0
    assert [Path(p).name for p in capsys.readouterr().out.split()] == ["zoo-F16.gguf"]


def _pull(library: Library, text: str, *args: Any) -> Path:
    """``localchat pull TEXT`` through the library: the name parsed once, then fetched."""
    return library.pull(library.request(text), *args)


def test_a_name_is_parsed_once_and_the_hub_asked_once_per_start(
    hub: HubState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start with a model name: on disk? can it be fetched? which file? fetch it — one
    parse of the name, one listing of the repo, however many questions are asked of it."""
    import localchat.models.library as library_module

    parsed: list[str] = []
    real_parse = library_module.parse_spec

    def counting_parse(text: str, catalog: Any) -> Any:
        parsed.append(text)
        return real_parse(text, catalog)

    monkeypatch.setattr(library_module, "parse_spec", counting_parse)
    library = _library()
    request = library.request(REPO)  # no quant: the planner picks from the remote header
    assert library.path_of(request) is None
    assert library.hub_problem(request) is None
    path = library.pull(request)
    assert path.name == library.resolve(request)[1]
    assert parsed == [REPO]
    listings = [r for r in hub.requests if r[1].startswith(f"/api/models/{REPO}")]
    assert len(listings) == 1, listings
