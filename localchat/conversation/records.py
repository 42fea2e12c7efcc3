"""Conversations as whole records: deleted with their saved states, or forked (a new
conversation holding the first messages of another, its saved caches copied along)."""

from __future__ import annotations

from localchat.errors import UsageError
from localchat.state.images import ImageStore, delete_unreferenced
from localchat.state.kvstate import StateStore
from localchat.state.locks import ConversationLock
from localchat.state.store import ConversationRecord, Store

# An image stored this recently is kept though no message shows it: another process may
# have just stored it for a message it is about to write.
JUST_STORED_S = 60.0


def delete_conversation(store: Store, states: StateStore, images: ImageStore, name: str) -> str:
    """Delete a conversation, its messages and its saved states (refused while it is open),
    and the images it showed that no other conversation shows."""
    record = store.get(name)
    lock = ConversationLock(states.directory, record.id, record.name)
    try:
        lost = store.delete_conversation(record.id)
        states.delete_conversation(record.id)
        delete_unreferenced(store, images, lost, keep_recent_s=JUST_STORED_S)
    finally:
        lock.release(remove=True)
    return record.name


def fork_conversation(
    store: Store, states: StateStore, name: str, at: int, new_name: str | None = None
) -> tuple[ConversationRecord, int]:
    """``localchat branch``: a new conversation holding the first ``at`` messages of ``name``'s
    branch in view (and its system prompt), whose first turn restores the shared part from
    the source's saved cache. Returns it and how many models' caches came along."""
    record = store.get(name)
    messages = store.messages(record.id)
    if not 0 <= at <= len(messages):
        raise UsageError(
            f"--at {at}: {record.name!r} has {len(messages)} messages; give 0 to {len(messages)}"
        )
    if at and messages[at - 1].role == "user":
        raise UsageError(
            f"--at {at}: message {at} is a question without its reply in the branch; branch"
            f" at {at - 1} (before it) or {at + 1} (after its reply)"
        )
    target = new_name or store.free_name(f"{record.name}-at-{at}")
    fork = store.fork_conversation(record, messages[:at], target)
    copied = sum(
        states.copy(record.id, fork.id, fingerprint)
        for fingerprint in store.model_fingerprints(record.id)
    )
    return fork, copied
