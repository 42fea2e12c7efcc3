"""A conversation switched to another model and back: each model's saved KV state stays on
disk, so the return restores it and reads only what the other model added."""

from __future__ import annotations

from pathlib import Path

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.conversation.base import ConversationTurn
from localchat.conversation.local import Conversation
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from localchat.tui.messages import ConversationRestored, ModelChosen, ModelLoaded
from tests.conftest import GREEDY
from tests.tui_helpers import chat_app


def _turn(store: Store, states: StateStore, model: Path, text: str) -> ConversationTurn:
    """One turn of conversation "x" on a freshly loaded ``model`` (as the app loads a model it
    switches to: nothing in memory), its state on disk when it returns."""
    engine = Engine(model, LoadOptions(n_ctx=1024))
    conversation = Conversation.open(store, states, "x", engine, "You are terse.")
    try:
        turn = conversation.send(text, GREEDY, 12)
        for _ in turn:
            pass
        conversation.wait_saved()
        return turn
    finally:
        conversation.close()
        engine.close()


def test_switching_to_another_model_and_back_restores_the_first_models_state(
    tmp_path: Path, tiny_model: Path, tiny_model_other_seed: Path
) -> None:
    store = Store(tmp_path / "db.sqlite3")
    states = StateStore(tmp_path / "states")
    _turn(store, states, tiny_model, "hello there")
    second = _turn(store, states, tiny_model, "tell me more")
    held_on_a = len(second.prompt.tokens) + len(second.generation.tokens)
    on_b = _turn(store, states, tiny_model_other_seed, "and now?")
    assert not on_b.restore.restored  # another model: the history is read once
    back = _turn(store, states, tiny_model, "back again")
    assert back.restore.restored, back.restore
    assert back.restore.tokens == held_on_a
    assert back.restore.replayed == 0
    # Evaluated on the return: only what A has not read (B's exchange, the new message).
    evaluated = back.stats.prompt_tokens_evaluated
    assert evaluated == len(back.prompt.tokens) - held_on_a
    print("restored", back.restore.tokens, "evaluated", evaluated, "of", len(back.prompt.tokens))
    assert len(list(states.directory.glob("*.lckv"))) == 2
    store.close()


async def test_the_app_switched_to_another_model_and_back_reads_nothing_again(
    tiny_model: Path, tiny_model_other_seed: Path
) -> None:
    async with chat_app(
        tiny_model, size=(120, 36), n_ctx=1024, max_tokens=8, conversation_name="sw"
    ) as ui:
        app = ui.app
        await ui.say("hello there")
        second = await ui.say("tell me more")
        held_on_a = len(second.turn.prompt_tokens) + second.turn.stats.generated_tokens
        for model in (tiny_model_other_seed, tiny_model):
            before, mark = app.conversation, len(ui.seen)
            app.post_message(ModelChosen(model))
            await ui.wait_for(ModelLoaded, after=mark)
            await ui.opened(before)
            if model == tiny_model_other_seed:
                on_b = await ui.say("and now?")
                assert not on_b.turn.restore.restored  # another model reads the history once
        # Back on the first model: its state is read from disk as the conversation opens.
        restored = await ui.wait_for(ConversationRestored, after=mark)
        assert restored.tokens == held_on_a
        back = (await ui.say("back again")).turn
        stats = back.stats_dict()
        # Read (as the message was typed, then at Enter): B's exchange and the new message.
        evaluated = stats["prompt_tokens_evaluated"] + back.restore.read_ahead
        assert evaluated == stats["prompt_tokens"] - held_on_a
        assert back.restore.replayed == 0
        assert app.backend is not None and app.backend.model_path == tiny_model
        print(
            "app: restored", restored.tokens, "evaluated", evaluated, "of", stats["prompt_tokens"]
        )


async def test_the_models_screen_marks_the_model_loaded_now(
    tiny_model: Path, tiny_model_other_seed: Path
) -> None:
    from textual.widgets import DataTable

    from localchat.models.hardware import Hardware
    from localchat.models.library import Library
    from localchat.paths import app_paths
    from localchat.tui.screens.models import LOADED, ModelsScreen, RowsLoaded

    library = Library(app_paths(), Hardware(16 * 1024**3, 12 * 1024**3, 8))
    for name, path in (("mine", tiny_model), ("other", tiny_model_other_seed)):
        library.add_local(path, name)
    async with chat_app(tiny_model, size=(120, 36), n_ctx=1024, max_tokens=8) as ui:
        mark = len(ui.seen)
        await ui.pilot.press("ctrl+o")
        listed = await ui.wait_for(RowsLoaded, after=mark)
        screen = ui.app.screen
        assert isinstance(screen, ModelsScreen)
        assert listed.loaded is not None and listed.rows[listed.loaded].model == "mine"
        table = screen.query_one(DataTable)
        await ui.until(lambda: table.row_count >= len(listed.rows), "the rows drawn")
        on_disk = {row.model: str(table.get_row(str(i))[-1]) for i, row in enumerate(listed.rows)}
        assert (on_disk["mine"], on_disk["other"]) == (LOADED, "added")
        assert list(on_disk.values()).count(LOADED) == 1
