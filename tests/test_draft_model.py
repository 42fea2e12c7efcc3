"""Draft models: a smaller model of the same family drafts, the big one verifies. Replies are
token for token those without drafts (flash attention over a quantized cache), the draft's
cache follows the conversation (a resume rebuilds it from the last tokens only), a model of
another vocabulary is refused in one line, and the planner counts its memory and predicts
its gain from this machine's calibration."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localchat.backends.llama.draft_model import REBUILD_TOKENS
from localchat.backends.llama.draft_policy import DraftPolicy
from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.bench.spec import COPY_PROMPT
from localchat.chat.template import ChatMessage
from localchat.cli.main import main
from localchat.conversation.local import Conversation
from localchat.errors import UsageError
from localchat.models.catalog import CatalogError, catalog_draft, load_catalog
from localchat.models.draft_plan import plan_draft, predicted_gain
from localchat.models.hardware import Hardware
from localchat.models.launch import LaunchOptions
from localchat.models.library import Library
from localchat.models.loader import ModelLoader
from localchat.models.speed import STEP_SIZES, SpeedModel, SpeedPrediction, machine_name
from localchat.paths import app_paths
from localchat.settings import Settings
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from tests.conftest import GREEDY

from .hubserver import HubServer, HubState

GIB = 1024**3
REPLY_TOKENS = 100


@pytest.fixture
def small_draft_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Costs as a GPU running a 7B with a 0.5B draft has them: a draft step a twentieth of
    a step, verifying 8 tokens barely more than one. SmolLM2 drafting for itself on 2 cores
    stands in for such a pair here; at its true costs the policy rightly never drafts."""
    monkeypatch.setattr(DraftPolicy, "model_step_cost", lambda _self, _measured: 0.05)
    monkeypatch.setattr(DraftPolicy, "cost", lambda _self, n_tokens: 1 + 0.05 * (n_tokens - 1))


def _engine(model: Path, speculative: str, draft: Path | None = None) -> Engine:
    """Flash attention over a quantized cache: batches get single steps' logits on a CPU."""
    options = LoadOptions(
        n_ctx=2048, n_threads=2, kv_type="q8_0", speculative=speculative, draft_model=draft
    )
    return Engine(model, options)


def _reply(engine: Engine, text: str = COPY_PROMPT) -> tuple[list[int], int, int]:
    """A greedy reply's tokens, with the tokens drafted and accepted for it."""
    generation = engine.generate(
        engine.prompt_tokens([ChatMessage("user", text)]), GREEDY, REPLY_TOKENS
    )
    for _ in generation:
        pass
    stats = generation.stats
    return generation.tokens, stats.drafted_tokens, stats.accepted_tokens


def test_a_draft_as_slow_as_the_model_is_never_worth_a_step(smollm2: Path) -> None:
    # SmolLM2 drafting for itself at this machine's costs: a draft step costs a step.
    options = LoadOptions(
        n_ctx=2048, kv_type="q8_0", speculative="draft", draft_model=smollm2, draft_step_cost=1.0
    )
    engine = Engine(smollm2, options)
    try:
        tokens, drafted_n, _ = _reply(engine)
        assert len(tokens) == REPLY_TOKENS and drafted_n == 0
    finally:
        engine.close()


@pytest.mark.usefixtures("small_draft_costs")
@pytest.mark.usefixtures("cheap_steps")
def test_a_draft_model_never_changes_a_reply(smollm2: Path) -> None:
    # SmolLM2 drafting for itself (its own cache f16, no flash attention: its numbers are
    # not the big one's, so some drafts fail): a stand-in for a 0.5B drafting for a 7B.
    plain, drafted = _engine(smollm2, "off"), _engine(smollm2, "draft", smollm2)
    try:
        tokens, _, _ = _reply(plain)
        with_drafts, drafted_n, accepted = _reply(drafted)
        assert with_drafts == tokens
        assert drafted_n > 20 and accepted > 0.7 * drafted_n
        prompt = drafted.prompt_tokens([ChatMessage("user", COPY_PROMPT)])
        assert drafted.cache.cached_tokens == prompt + with_drafts  # rejected drafts removed
        assert "draft model: SmolLM2" in drafted.describe().panel
    finally:
        plain.close()
        drafted.close()


def test_a_model_of_another_vocabulary_is_refused_in_one_line(
    tiny_model: Path, small_model: Path
) -> None:
    with pytest.raises(UsageError) as caught:
        _engine(small_model, "draft", tiny_model)
    message = str(caught.value)
    assert "tiny-Q4_K_M.gguf cannot draft for small-Q4_K_M.gguf" in message
    assert "vocabularies have 8192 and 1024 tokens" in message and "\n" not in message
    with pytest.raises(UsageError, match="'draft' needs a draft model: give --draft-model"):
        _engine(tiny_model, "draft")
    with pytest.raises(UsageError, match="no such draft model file"):
        _engine(tiny_model, "draft", tiny_model.with_name("missing.gguf"))


def test_auto_leaves_a_draft_model_unloaded_where_drafts_could_change_replies(
    tiny_model: Path, tiny_model_other_seed: Path
) -> None:
    options = LoadOptions(n_ctx=512, speculative="auto", draft_model=tiny_model_other_seed)
    engine = Engine(tiny_model, options)  # an f16 cache: batches are not single steps
    try:
        assert engine.draft_model is None
        assert engine.draft_model_unused is not None
        assert "not used" in engine.draft_model_unused and "q8_0" in engine.draft_model_unused
    finally:
        engine.close()


@pytest.mark.usefixtures("small_draft_costs")
@pytest.mark.usefixtures("cheap_steps")
def test_random_drafts_change_nothing(tiny_model: Path, tiny_model_other_seed: Path) -> None:
    plain = _engine(tiny_model, "off")
    drafted = _engine(tiny_model, "draft", tiny_model_other_seed)
    try:
        for text in ("hello there", COPY_PROMPT[:200]):
            tokens, _, _ = _reply(plain, text)
            with_drafts, drafted_n, accepted = _reply(drafted, text)
            assert with_drafts == tokens
            assert accepted <= drafted_n
        assert drafted.draft_model is not None and drafted.draft_model.calls > 0
    finally:
        plain.close()
        drafted.close()


def _said(conversation: Conversation, text: str) -> str:
    turn = conversation.send(text, GREEDY, 60)
    for _ in turn:
        pass
    return turn.generation.text


def _turns(model: Path, home: Path, draft: Path | None) -> tuple[list[str], list[tuple[int, int]]]:
    """Two turns (the first attaches a file: past a rebuild's length), the conversation
    reopened on a new engine from its saved state, a third: the replies, and per turn how
    many tokens the draft model evaluated against what the context then held."""
    mode = "draft" if draft else "off"
    replies: list[str] = []
    reads: list[tuple[int, int]] = []
    store, states = Store(home / "db.sqlite3"), StateStore(home / "states")
    turns = ((COPY_PROMPT, "Now rename average_of to mean_column."), ("And load_rows to rows_of.",))
    for texts in turns:
        engine = _engine(model, mode, draft)
        conversation = Conversation.open(store, states, "copy", engine)
        for text in texts:
            before = engine.draft_model.evaluated if engine.draft_model else 0
            replies.append(_said(conversation, text))
            if engine.draft_model is not None:
                reads.append(
                    (engine.draft_model.evaluated - before, len(engine.cache.cached_tokens))
                )
                assert engine.draft_model.rebuilds == 1  # built once per engine, then followed
        conversation.wait_saved()
        conversation.close()
        engine.close()
    store.close()
    return replies, reads


@pytest.mark.usefixtures("small_draft_costs")
def test_the_draft_cache_follows_the_conversation_and_a_resume_rebuilds_it_cheaply(
    smollm2: Path, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with_drafts, reads = _turns(smollm2, tmp_path / "a", smollm2)
    plain, _ = _turns(smollm2, tmp_path / "b", None)
    assert with_drafts == plain
    # The first turn built the draft's cache from the last tokens of a long prompt; the
    # second only extended it; the reopened conversation (restored from its saved state,
    # the draft's cache empty) rebuilt it from the last tokens, not the whole history.
    (first, _), (second, held), (reopened, held_then) = reads
    assert first <= REBUILD_TOKENS + 2 * 60  # the rebuild, the reply and its drafts
    assert second < held / 2
    assert reopened <= REBUILD_TOKENS + 2 * 60 < held_then


def _linear(extra: float) -> dict[int, float]:
    return {n: 1.0 + extra * (n - 1) for n in (1, 2, 3, 5, 9)}


def test_the_gain_is_predicted_from_the_step_cost_curve() -> None:
    draft = SpeedPrediction(60.0, 300.0)
    # A GPU: verifying 8 tokens costs about one step; a draft 12x faster pays well.
    length, gain = predicted_gain(SpeedPrediction(5.0, 20.0, _linear(0.02)), draft)
    assert gain > 1.6 and length >= 4
    # Two CPU cores: each extra token ~0.6 steps; a draft only 2x faster never pays.
    steep = SpeedPrediction(5.0, 20.0, _linear(0.6))
    assert predicted_gain(steep, SpeedPrediction(10.0, 40.0)) == (0, 1.0)
    # A curve flat for a few tokens, then steep (a memory-bound type): drafts stay short.
    knee = SpeedPrediction(5.0, 20.0, {1: 1.0, 2: 1.0, 3: 1.05, 5: 2.5, 9: 5.0})
    length, gain = predicted_gain(knee, draft)
    assert 2 <= length <= 3 and gain > 1.4
    # No curve (no calibration of it): the policy's default, ~0.6 steps a token.
    assert predicted_gain(SpeedPrediction(5.0, 20.0), SpeedPrediction(10.0, 40.0)) == (0, 1.0)


def test_the_plan_counts_the_draft_memory_and_its_gain(
    small_model: Path, tiny_model: Path, speed_calibration: SpeedModel
) -> None:
    roomy = Hardware(16 * GIB, 16 * GIB, 2)
    plan = plan_draft(small_model, tiny_model, roomy, 4096, "f16", speed_calibration)
    assert plan.fits and plan.gain is not None and plan.ram_bytes > tiny_model.stat().st_size
    assert "predicted" in plan.explanation
    tight = Hardware(16 * GIB, 40 * 1024**2, 2)  # the big model's cache leaves no room
    assert not plan_draft(small_model, tiny_model, tight, 4096, "f16", speed_calibration).fits
    unmeasured = plan_draft(small_model, tiny_model, roomy, 4096, "f16", None)
    assert unmeasured.gain is None and not unmeasured.pays


def test_the_catalog_names_drafts_and_refuses_one_it_does_not_have(tmp_path: Path) -> None:
    draft = catalog_draft(Path("Qwen2.5-7B-Instruct-Q4_K_M.gguf"), None)
    assert draft is not None and draft.name == "qwen2.5-0.5b-instruct"
    assert catalog_draft(Path("qwen2.5-0.5b-instruct-q4_k_m.gguf"), None) is None
    user = tmp_path / "models.toml"
    user.write_text(
        '[[model]]\nname = "mine"\nrepo = "me/mine-GGUF"\narchitecture = "llama"\n'
        "n_layer = 2\nn_embd = 64\nn_head = 2\nn_head_kv = 2\nhead_dim = 32\n"
        'n_vocab = 1024\ncontext_length = 4096\ndraft = "nosuch"\n'
        '[model.files]\nQ8_0 = { file = "mine-Q8_0.gguf", size = 1000 }\n'
    )
    with pytest.raises(CatalogError, match="model 'mine': field 'draft' names 'nosuch'"):
        load_catalog(user)


@pytest.fixture
def smol_hub(smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A hub with SmolLM2 as a "big" model and a copy as its draft, and a user catalog
    naming the one the draft of the other."""
    repos = {}
    for repo in ("demo/smol-GGUF", "demo/smol-draft-GGUF"):
        folder = tmp_path / "hub" / repo
        folder.mkdir(parents=True)
        name = repo.split("/")[1].removesuffix("-GGUF")
        shutil.copy(smollm2, folder / f"{name}-Q4_1.gguf")
        repos[repo] = folder
    server = HubServer(HubState(repos)).start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    entry = (
        '[[model]]\nname = "{name}"\nrepo = "demo/{name}-GGUF"\narchitecture = "llama"\n'
        "n_layer = 30\nn_embd = 576\nn_head = 9\nn_head_kv = 3\nhead_dim = 64\n"
        "n_vocab = 49152\ncontext_length = 8192\n{draft}"
        '[model.files]\nQ4_1 = {{ file = "{name}-Q4_1.gguf", size = {size} }}\n'
    )
    size = smollm2.stat().st_size
    catalog = entry.format(name="smol", draft='draft = "smol-draft"\n', size=size)
    catalog += entry.format(name="smol-draft", draft="", size=size)
    app_paths().user_catalog.parent.mkdir(parents=True, exist_ok=True)
    app_paths().user_catalog.write_text(catalog)
    yield
    server.stop()


def test_the_session_takes_the_catalog_draft_once_downloaded_and_where_it_pays(
    isolated_home: Path, smol_hub: None, speed_calibration: SpeedModel, tiny_model: Path
) -> None:
    speed_calibration.save(app_paths().speed_calibration)
    settings, loader = Settings(kv_type="q8_0"), ModelLoader(app_paths())

    def load(settings: Settings = settings, warn: Any = None, **flags: Any) -> Engine:
        launch = settings.launch(LaunchOptions(n_ctx=1024, **flags))
        return loader.load(big, launch, warn, on_this_thread=True)

    library = Library(app_paths(), Hardware(16 * GIB, 16 * GIB, 2))
    big = library.pull(library.request("smol"))
    with pytest.raises(UsageError, match="'draft' needs a draft model"):  # not downloaded yet
        load(speculative="draft")
    with pytest.raises(
        UsageError, match="draft model smol-draft is not downloaded; `localchat pull"
    ):
        library.draft_path("smol-draft")
    library.pull(library.request("smol-draft"))
    engine = load(speculative="draft")
    assert engine.draft_model is not None and engine.draft_model.name == "smol-draft-Q4_1.gguf"
    engine.close()
    # A draft as big as the model never pays: auto does not load it.
    engine = load(speculative="auto")
    assert engine.draft_model is None and engine.drafting  # prompt lookup still drafts
    engine.close()
    warned: list[str] = []
    engine = load(kv_type="f16", draft_model="smol-draft", warn=warned.append)
    assert engine.draft_model is None and "smol-draft-Q4_1.gguf is not used" in warned[0]
    engine.close()
    # The setting's draft model, of another family than the model loaded: left out, said.
    other = Settings(kv_type="q8_0", draft_model=str(tiny_model))
    engine = load(other, warn=warned.append)
    assert engine.draft_model is None and "cannot draft for" in warned[-1]
    engine.close()


@pytest.mark.usefixtures("small_draft_costs")
@pytest.mark.usefixtures("cheap_steps")
def test_ask_drafts_with_a_draft_model_and_refuses_it_for_a_server(
    smollm2: Path, isolated_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [COPY_PROMPT, "--model-path", str(smollm2), "--kv-type", "q8_0", "--json"]
    common += ["--temperature", "0", "--max-tokens", "80"]
    assert main(["ask", *common, "--draft-model", str(smollm2), "--speculative", "draft"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert main(["ask", *common, "--speculative", "off"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert drafted["reply"] == plain["reply"]
    assert drafted["stats"]["drafted_tokens"] > 0 and plain["stats"]["drafted_tokens"] == 0
    assert main(["ask", "hi", "--server", "http://127.0.0.1:9", "--draft-model", "x"]) == 2
    assert "--draft-model choose how a local model runs" in capsys.readouterr().err


def test_hw_plans_name_the_catalog_draft_where_it_would_pay() -> None:
    from localchat.models.catalog import load_catalog
    from localchat.models.draft_plan import with_catalog_drafts
    from localchat.models.planner import plan_catalog

    catalog = load_catalog(None)
    roomy = Hardware(64 * GIB, 64 * GIB, 8)
    costs = {t: 1e-10 for t in ("F16", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K")}

    def drafts(extra: float) -> dict[str, str | None]:
        # Every step size costs its fixed part plus per byte, a share ``extra`` of a single
        # step's per extra token.
        steps = {t: [c * (1 + extra * (n - 1)) for n in STEP_SIZES] for t, c in costs.items()}
        fixed = [1e-4 * (1 + extra * (n - 1)) for n in STEP_SIZES]
        speed = SpeedModel(
            costs, 1e-4, costs, 1e-5, machine_name(), 8, step_s_per_byte=steps,
            step_overhead_s=fixed,
        )  # fmt: skip
        plans = with_catalog_drafts(
            catalog, plan_catalog(catalog, roomy, 8192, speed), roomy, speed
        )
        return {p.model: p.draft for p in plans}

    flat = drafts(0.02)  # verifying a few tokens costs about one: a 0.5B pays for a 7B
    assert flat["qwen2.5-7b-instruct"] == "qwen2.5-0.5b-instruct"
    assert flat["llama-3.2-3b-instruct"] == "llama-3.2-1b-instruct"
    assert flat["qwen2.5-0.5b-instruct"] is None and flat["gemma-2-2b-it"] is None
    steep = drafts(1.0)  # each extra token a whole step: no draft pays
    assert all(draft is None for draft in steep.values())
