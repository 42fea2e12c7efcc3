"""Hardware-aware planning: estimates, plans on simulated machines, the catalog, `hw`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.cli.main import main
from localchat.errors import UsageError
from localchat.gguf.estimate import (
    LayerWeights,
    ModelDims,
    VisionTower,
    compute_buffer_bytes,
    estimate_memory,
    kv_cache_bytes,
)
from localchat.gguf.info import read_gguf
from localchat.gguf.quants import is_good_enough
from localchat.models.catalog import CatalogError, chat_models, load_catalog, load_catalog_file
from localchat.models.catalog_vision import catalog_projector
from localchat.models.hardware import GPU_APPLE, GPU_NONE, GPU_NVIDIA, Hardware, detect_hardware
from localchat.models.hub import HubError, list_gguf_files, remote_gguf_header
from localchat.models.planner import plan_catalog
from localchat.units import count, parse_size

from .hubserver import HubServer, HubState

GIB = 1024**3
MACHINES = {
    "4 GB, no GPU": Hardware(4 * GIB, 4 * GIB, 4),
    "8 GB, no GPU": Hardware(8 * GIB, 8 * GIB, 4),
    "16 GB + 6 GB VRAM": Hardware(16 * GIB, 16 * GIB, 8, 6 * GIB, 6 * GIB, GPU_NVIDIA, "RTX", True),
    "16 GB + 4 GB VRAM": Hardware(16 * GIB, 16 * GIB, 8, 4 * GIB, 4 * GIB, GPU_NVIDIA, "GTX", True),
    "16 GB Apple unified": Hardware(
        16 * GIB, 16 * GIB, 8, 12 * GIB, 12 * GIB, GPU_APPLE, "M2", True
    ),
    "32 GB + 24 GB VRAM": Hardware(
        32 * GIB, 32 * GIB, 8, 24 * GIB, 24 * GIB, GPU_NVIDIA, "4090", True
    ),
}

# machine -> model -> (quant, GPU layers: "all" | "partial" | "none", or None for "too big")
# F16 is never planned where the model has Q8_0: it buys nothing measurable over it.
EXPECTED = {
    "4 GB, no GPU": {
        "qwen2.5-0.5b-instruct": ("Q8_0", "none"),
        "qwen2.5-3b-instruct": ("Q6_K", "none"),
        # Flash attention, a q8_0 cache and a smaller micro-batch make a better quant fit.
        "llama-3.2-3b-instruct": ("Q6_K", "none"),
        "phi-3.5-mini-instruct": ("Q5_K_M", "none"),  # at ctx 2048: shrunk before Q3
        "qwen2.5-7b-instruct": ("Q2_K", "none"),
        "mistral-7b-instruct-v0.3": ("Q2_K", "none"),
    },
    "8 GB, no GPU": {
        "qwen2.5-3b-instruct": ("Q8_0", "none"),
        "qwen2.5-7b-instruct": ("Q6_K", "none"),
        "mistral-7b-instruct-v0.3": ("Q6_K", "none"),
    },
    "16 GB + 6 GB VRAM": {
        "qwen2.5-1.5b-instruct": ("Q8_0", "all"),
        "qwen2.5-3b-instruct": ("Q8_0", "all"),
        "qwen2.5-7b-instruct": ("Q5_K_M", "all"),
        "mistral-7b-instruct-v0.3": ("Q5_K_M", "all"),
    },
    "16 GB + 4 GB VRAM": {
        "qwen2.5-7b-instruct": ("Q8_0", "partial"),
        "llama-3.2-1b-instruct": ("Q8_0", "all"),
    },
    "16 GB Apple unified": {
        "qwen2.5-7b-instruct": ("Q8_0", "all"),
        "phi-3.5-mini-instruct": ("Q8_0", "all"),
    },
    "32 GB + 24 GB VRAM": {
        "qwen2.5-7b-instruct": ("Q8_0", "all"),
        "mistral-7b-instruct-v0.3": ("Q8_0", "all"),
    },
}


def _placement(plan) -> str:
    if plan.n_gpu_layers == 0:
        return "none"
    return "all" if plan.n_gpu_layers > plan.n_layers else "partial"


@pytest.mark.parametrize("machine", list(EXPECTED))
def test_plans_on_simulated_machines(machine: str) -> None:
    hardware = MACHINES[machine]
    plans = {p.model: p for p in plan_catalog(load_catalog(), hardware, 8192)}
    for model, expected in EXPECTED[machine].items():
        plan = plans[model]
        if expected is None:
            assert not plan.fits and plan.explanation.startswith("too big: the smallest option")
            continue
        assert plan.fits, plan.explanation
        assert (plan.quant, _placement(plan)) == expected, f"{model}: {plan.explanation}"
    for plan in plans.values():
        if plan.fits:  # never a plan over budget
            assert plan.estimate is not None
            assert plan.estimate.ram_required <= hardware.ram_available_bytes * 0.9
            assert plan.estimate.vram <= max(0, hardware.vram_free_bytes - 512 * 1024**2)
            assert (
                plan.explanation.startswith(plan.quant) and f"ctx {plan.n_ctx}" in plan.explanation
            )


def test_context_shrinks_before_quality_drops_below_q4() -> None:
    plans = {p.model: p for p in plan_catalog(load_catalog(), MACHINES["4 GB, no GPU"], 8192)}
    phi = plans["phi-3.5-mini-instruct"]
    assert phi.n_ctx == 2048 and is_good_enough(phi.quant), phi.explanation
    mistral = plans["mistral-7b-instruct-v0.3"]  # nothing >= Q4_K_M fits even at the floor
    assert mistral.quant == "Q2_K"


def test_quantized_kv_cache_is_chosen_when_that_makes_it_fit() -> None:
    plans = {p.model: p for p in plan_catalog(load_catalog(), MACHINES["4 GB, no GPU"], 8192)}
    assert plans["llama-3.2-3b-instruct"].kv_type == "q8_0"
    assert "KV q8_0" in plans["llama-3.2-3b-instruct"].explanation


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_estimate_parts_match_what_llama_cpp_allocates(small_model: Path, kv_type: str) -> None:
    info = read_gguf(small_model)
    dims = ModelDims.from_gguf(info)
    for n_ctx in (512, 2048):
        engine = Engine(small_model, LoadOptions(n_ctx=n_ctx, kv_type=kv_type))
        reported = sum(engine.buffers.compute.values())  # as llama.cpp logged it
        assert kv_cache_bytes(dims, n_ctx, kv_type) == engine.kv_bytes_allocated
        assert reported > 0
        assert abs(compute_buffer_bytes(dims, n_ctx, kv_type) - reported) <= 0.1 * reported
        engine.close()
    weights = LayerWeights.from_gguf(info)
    assert weights.total == info.weights_bytes
    estimate = estimate_memory(dims, weights, 2048, kv_type)
    assert estimate.vram == 0 and estimate.ram == estimate.total > weights.total


def test_offloaded_layers_move_weights_and_cache_to_vram(small_model: Path) -> None:
    info = read_gguf(small_model)
    dims, weights = ModelDims.from_gguf(info), LayerWeights.from_gguf(info)
    cpu = estimate_memory(dims, weights, 2048, "f16", 0)
    half = estimate_memory(dims, weights, 2048, "f16", dims.n_layer // 2)
    full = estimate_memory(dims, weights, 2048, "f16", dims.n_layer + 1)
    assert 0 == cpu.vram < half.vram < full.vram
    assert half.kv_vram == half.kv_ram
    assert full.weights_ram == weights.embeddings


def test_remote_header_read_uses_range_requests(
    tmp_path: Path, small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "org" / "repo"
    repo.mkdir(parents=True)
    (repo / "model.gguf").write_bytes(small_model.read_bytes())
    state = HubState({"org/repo": repo})
    server = HubServer(state).start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    try:
        info = remote_gguf_header("org/repo", "model.gguf")
        local = read_gguf(small_model)
        assert info.metadata == local.metadata and info.tensors == local.tensors
        ranges = [r for _, _, r in state.requests]
        assert ranges and all(r.startswith("bytes=") for r in ranges)
        fetched = sum(int(r.split("-")[1]) - int(r.split("=")[1].split("-")[0]) + 1 for r in ranges)
        assert fetched < small_model.stat().st_size / 4, "only the header is read"
        # Through huggingface_hub's session: the user's token goes with every request.
        assert state.authorizations and set(state.authorizations) == {"Bearer hf_test_token"}
        with pytest.raises(HubError, match="no such file on the hub"):
            remote_gguf_header("org/repo", "missing.gguf")
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        state.requests.clear()
        with pytest.raises(HubError, match=r"offline mode is on \(HF_HUB_OFFLINE=1\)"):
            remote_gguf_header("org/repo", "model.gguf")
        with pytest.raises(HubError, match="offline mode is on"):
            list_gguf_files("org/repo")
        assert state.requests == []
    finally:
        server.stop()


def test_catalog_has_the_required_models() -> None:
    names = {m.name for m in load_catalog()}
    for required in (
        "qwen2.5-0.5b-instruct",
        "qwen2.5-1.5b-instruct",
        "qwen2.5-3b-instruct",
        "qwen2.5-7b-instruct",
        "llama-3.2-1b-instruct",
        "llama-3.2-3b-instruct",
        "phi-3.5-mini-instruct",
        "gemma-2-2b-it",
        "mistral-7b-instruct-v0.3",
    ):
        assert required in names
    for model in chat_models(load_catalog()):
        if model.vision:  # only the quants whose exact sizes are published (see models.toml)
            continue
        assert model.quants == ["F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K"]
        sizes = [f.size for f in model.files]
        assert sizes == sorted(sizes, reverse=True), model.name
    # One small embedding model, never planned or offered as a chat.
    embedders = [m for m in load_catalog() if m.kind == "embedding"]
    assert [m.name for m in embedders] == ["nomic-embed-text-v1.5"]
    plans = plan_catalog(load_catalog(), detect_hardware())
    assert "nomic-embed-text-v1.5" not in {p.model for p in plans}


def test_user_catalog_adds_and_overrides(tmp_path: Path) -> None:
    user = tmp_path / "models.toml"
    user.write_text(
        """
[[model]]
name = "qwen2.5-0.5b-instruct"
repo = "me/my-qwen"
architecture = "qwen2"
n_layer = 24
n_embd = 896
n_head = 14
n_head_kv = 2
head_dim = 64
n_vocab = 151936
context_length = 32768
[model.files]
Q4_K_M = { file = "mine.gguf", size = 400000000 }
"""
    )
    models = {m.name: m for m in load_catalog(user)}
    assert models["qwen2.5-0.5b-instruct"].repo == "me/my-qwen"
    assert "llama-3.2-1b-instruct" in models


VISION_ENTRY = """
[[model]]
name = "eyes"
repo = "me/eyes-GGUF"
architecture = "llama"
n_layer = 30
n_embd = 576
n_head = 9
n_head_kv = 3
head_dim = 64
n_vocab = 49280
context_length = 8192
[model.files]
Q8_0 = { file = "eyes-Q8_0.gguf", size = 175054528 }
F16 = { file = "eyes-f16.gguf", size = 350000000 }
"""


TOWER = (
    "[model.vision]\nimage_size = 512\npatch_size = 16\nn_embd = 768\nn_ff = 3072\nn_head = 12\n"
)


def test_a_vision_entry_names_its_projectors_and_its_plan_counts_them(tmp_path: Path) -> None:
    user = tmp_path / "models.toml"
    user.write_text(
        VISION_ENTRY
        + "[model.mmproj]\n"
        + 'Q8_0 = { file = "mmproj-eyes-Q8_0.gguf", size = 103769856 }\n'
        + 'F16 = { file = "mmproj-eyes-f16.gguf", size = 190031616 }\n'
        + TOWER
    )
    models = {m.name: m for m in load_catalog(user)}
    eyes = models["eyes"]
    assert eyes.vision and not models["qwen2.5-0.5b-instruct"].vision
    assert [(p.quant, p.file, p.size) for p in eyes.projectors] == [
        ("F16", "mmproj-eyes-f16.gguf", 190031616),
        ("Q8_0", "mmproj-eyes-Q8_0.gguf", 103769856),
    ]
    # The projector a pull brings: the model's own tag where one is published.
    brought = {q: catalog_projector(eyes, q) for q in eyes.quants}
    assert {q: p.filename for q, p in brought.items() if p} == {
        "F16": "mmproj-eyes-f16.gguf",
        "Q8_0": "mmproj-eyes-Q8_0.gguf",
    }
    # Planned before any download: the largest projector its quants may bring, in RAM.
    machine = MACHINES["4 GB, no GPU"]
    with_it = {p.model: p for p in plan_catalog(list(models.values()), machine, 8192)}["eyes"]
    alone = plan_catalog([replace(eyes, projectors=())], machine, 8192)[0]
    # The largest projector file and one encode's buffer, as for a downloaded projector.
    assert eyes.tower == VisionTower(512, 16, 768, 3072, 12)
    patches = (512 // 16) ** 2
    buffer = 4 * patches * (4 * 768 + 3072) + 4 * 12 * patches**2
    assert with_it.fits and with_it.estimated_bytes == alone.estimated_bytes + 190031616 + buffer
    assert "with the vision projector" in with_it.explanation
    assert "vision projector" not in alone.explanation


def test_the_catalogs_vision_models_plan_with_their_projectors() -> None:
    vision = {m.name: m for m in load_catalog() if m.vision}
    assert set(vision) >= {"smolvlm-256m-instruct", "smolvlm-500m-instruct", "gemma-3-4b-it"}
    for model in vision.values():
        assert all(p.file.startswith("mmproj") and p.size > 0 for p in model.projectors)
    plans = {p.model: p for p in plan_catalog(load_catalog(), MACHINES["4 GB, no GPU"], 8192)}
    assert "with the vision projector" in plans["smolvlm-256m-instruct"].explanation
    gemma = catalog_projector(vision["gemma-3-4b-it"], "Q4_K_M")
    assert gemma is not None and gemma.filename == "mmproj-model-f16.gguf"


@pytest.mark.parametrize(
    ("mmproj", "message"),
    [
        ('mmproj = "mmproj-eyes.gguf"', "field 'mmproj' must be a table"),
        ('[model.mmproj]\nQ8_0 = { file = "eyes-Q8_0.gguf", size = 10 }', "not a vision projector"),
        ('[model.mmproj]\nF16 = { file = "mmproj-eyes-f16.gguf" }', "field 'mmproj.F16.size'"),
        ('[model.mmproj]\nQ9_Z = { file = "mmproj-eyes.gguf", size = 10 }', "'mmproj.Q9_Z'"),
        ('[model.mmproj]\nF16 = { file = "mmproj-eyes-f16.gguf", size = 10 }', "field 'vision'"),
        (
            '[model.mmproj]\nF16 = { file = "mmproj-eyes-f16.gguf", size = 10 }\n'
            + TOWER.replace("n_head = 12", "n_head = 0"),
            "field 'vision.n_head' must be a positive integer",
        ),
    ],
)
def test_a_bad_projector_entry_names_the_field(tmp_path: Path, mmproj: str, message: str) -> None:
    path = tmp_path / "models.toml"
    if mmproj.startswith("["):  # a table of its own, after the files
        body = VISION_ENTRY + mmproj + "\n"
    else:  # a plain key belongs to the entry, before its tables
        head, files = VISION_ENTRY.split("[model.files]")
        body = f"{head}{mmproj}\n[model.files]{files}"
    path.write_text(body)
    with pytest.raises(CatalogError, match=message) as err:
        load_catalog_file(path)
    assert str(path) in str(err.value) and "'eyes'" in str(err.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            '[[model]]\nname = "x"\nrepo = "a/b"\narchitecture = "llama"\nn_layer = "many"',
            "field 'n_layer'",
        ),
        ("[[model]\n", "not valid TOML"),
        (
            '[[model]]\nname = "x"\nrepo = "a/b"\narchitecture = "llama"\nn_layer = 2\nn_embd = 8\n'
            "n_head = 2\nn_head_kv = 2\nhead_dim = 4\nn_vocab = 10\ncontext_length = 64\n"
            '[model.files]\nQ9_Z = { file = "f.gguf", size = 10 }',
            "field 'files.Q9_Z'",
        ),
    ],
)
def test_malformed_catalog_names_file_entry_and_field(
    tmp_path: Path, body: str, message: str
) -> None:
    path = tmp_path / "models.toml"
    path.write_text(body)
    with pytest.raises(CatalogError, match=message) as err:
        load_catalog_file(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * GIB),
        ("8G", 8 * GIB),
        ("8192MiB", 8 * GIB),
        ("8000000000", 8_000_000_000),
        ("8GB", 8 * 10**9),
    ],
)
def test_sizes_parse(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["eight", "8XB", "", "-1G"])
def test_bad_sizes_are_clear_errors(text: str) -> None:
    with pytest.raises(UsageError, match="is not a size"):
        parse_size(text)


def test_counts_read_as_english() -> None:
    assert count(1, "token") == "1 token"
    assert count(0, "token") == "0 tokens"
    assert count(2013, "token") == "2,013 tokens"


def test_detection_never_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    hardware = detect_hardware()
    assert hardware.ram_total_bytes > 0 and hardware.cores >= 1
    assert hardware.gpu == GPU_NONE and not hardware.gpu_offload
    assert any("no NVIDIA GPU" in note for note in hardware.notes)


def test_hw_json_for_a_given_machine(
    capsys: pytest.CaptureFixture[str], calibrated: object
) -> None:
    assert main(["hw", "--json", "--ram", "16GiB", "--vram", "6GiB", "--ctx", "4096"]) == 0
    payload = json.loads(capsys.readouterr().out)
    hardware = payload["hardware"]
    assert hardware["ram_total_bytes"] == hardware["ram_available_bytes"] == 16 * GIB
    assert hardware["vram_free_bytes"] == 6 * GIB and hardware["gpu_offload"] is True
    plan = payload["plans"][0]
    assert set(plan) == {
        "model", "quant", "file", "n_gpu_layers", "n_layers", "n_ctx", "kv_type", "estimated_bytes",
        "required_bytes", "required_vram_bytes", "fits", "explanation", "predicted_gen_tps",
        "predicted_prompt_tps", "flash_attn", "n_ubatch", "draft", "draft_predicted_gain",
    }  # fmt: skip
    assert all(p["n_ctx"] <= 4096 for p in payload["plans"])


def test_hw_for_a_local_file(
    small_model: Path, capsys: pytest.CaptureFixture[str], calibrated: object
) -> None:
    assert main(["hw", "--json", "--model-path", str(small_model)]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert len(plans) == 1 and plans[0]["quant"] == "Q4_K_M" and plans[0]["fits"]


def test_hw_rejects_a_bad_size() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["hw", "--ram", "lots"])
    assert exit_info.value.code == 2


def test_no_weights_count_as_repacked_where_the_extra_buffers_are_off(
    monkeypatch: pytest.MonkeyPatch, small_model: Path
) -> None:
    """Repacked copies live in llama.cpp's extra buffers: where those are off (they crashed
    the machine's AMX kernel), the estimate counts no copy."""
    from localchat.backends.llama.runtime import EXTRA_BUFFERS_ENV
    from localchat.gguf.estimate import LayerWeights
    from localchat.models.hardware import repacked_weight_types

    monkeypatch.setenv(EXTRA_BUFFERS_ENV, "0")
    assert repacked_weight_types() == frozenset()
    weights = LayerWeights.from_gguf(read_gguf(small_model), repacked_weight_types())
    assert sum(weights.repacked_per_layer) == weights.repacked_output == 0
    monkeypatch.setenv(EXTRA_BUFFERS_ENV, "1")
    assert repacked_weight_types() <= {"Q4_0", "Q4_K", "IQ4_NL", "Q2_K"}
