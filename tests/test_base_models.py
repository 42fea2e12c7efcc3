"""Base or chat-tuned, from what a template-less file says (issue 27): a base model gets the
plain transcript even when its vocabulary has a chat format's control tokens.

The demo vocabulary carries ChatML's control tokens, a ChatML template and ``<|im_end|>`` as
its end token; the tests strip the template and set the end token and name fields as base
and instruct conversions write them.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from localchat.backends.llama.engine import Engine, LoadOptions
from localchat.chat.formats import PLAIN, Tuning, classify_model, name_parts
from localchat.chat.template import ChatMessage
from localchat.conversation.local import Conversation
from localchat.state.kvstate import StateStore
from localchat.state.store import Store
from tests.conftest import GREEDY

EOS_S = 2  # "</s>" in the demo's SentencePiece vocabulary ("<|im_end|>" is its end token)
PLAIN_PROMPT = b"<s>User: hi\nAssistant:"
CHATML_PROMPT = b"<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _copy(
    source: Path,
    dest: Path,
    strings: dict[str, str] | None = None,
    eos: int | None = None,
    remove: tuple[str, ...] = ("tokenizer.chat_template",),
) -> Path:
    """A copy of ``source`` without its template (by default), with name fields and the end
    token set: what a converter would have written for another model."""
    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    assert arch is not None
    writer = gguf.GGUFWriter(dest, arch=arch.contents(), endianess=reader.endianess)
    changes = {
        key: MetadataDetails(gguf.GGUFValueType.STRING, value)
        for key, value in (strings or {}).items()
    }
    if eos is not None:
        changes["tokenizer.ggml.eos_token_id"] = MetadataDetails(gguf.GGUFValueType.UINT32, eos)
    copy_with_new_metadata(reader, writer, changes, list(remove))
    return dest


def _spelled(engine: Engine) -> bytes:
    prompt = engine.prompt_tokens([ChatMessage("user", "hi")])
    return b"".join(engine.token_bytes(t) for t in prompt)


# -- the rule, on metadata as real conversions write it ----------------------------------


@pytest.mark.parametrize(
    ("metadata", "eos", "file_name", "chat", "evidence"),
    [
        # Qwen2.5-0.5B: base, <|im_start|> in its vocabulary, <|endoftext|> its end token.
        (
            {"general.name": "Qwen2.5 0.5B", "general.basename": "Qwen2.5"},
            "<|endoftext|>",
            "qwen2.5-0.5b-q8_0.gguf",
            False,
            "end token `<|endoftext|>`",
        ),
        (
            {"general.name": "Qwen2.5 0.5B Instruct", "general.finetune": "Instruct"},
            "<|im_end|>",
            "qwen2.5-0.5b-instruct-q8_0.gguf",
            True,
            "end token `<|im_end|>`",
        ),
        # Gemma: instruct files keep <eos> too; only the name tells them apart.
        (
            {"general.name": "Gemma 2 2b", "general.size_label": "2.6B"},
            "<eos>",
            "gemma-2-2b.Q4_K_M.gguf",
            False,
            "end token `<eos>`",
        ),
        (
            {"general.name": "Gemma 2 2b It", "general.finetune": "it"},
            "<eos>",
            "gemma-2-2b-it.Q4_K_M.gguf",
            True,
            "general.finetune part 'it'",
        ),
        (
            {"general.name": "Gemma 3 1b Pt", "general.finetune": "pt"},
            "<eos>",
            "gemma-3-1b-pt.gguf",
            False,
            "general.finetune part 'pt'",
        ),
        # SmolLM2-135M-Instruct as the registry ships it: its name says nothing of Instruct.
        (
            {
                "general.type": "model",
                "general.name": "Smollm2 135M 8k Lc100K Mix1 Ep2",
                "general.finetune": "8k-lc100k-mix1-ep2",
                "general.basename": "smollm2",
                "general.size_label": "135M",
            },
            "<|im_end|>",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            True,
            "end token `<|im_end|>`",
        ),
        (
            {"general.name": "Smollm2 135M 8k Lc100K Mix1 Ep2", "general.basename": "smollm2"},
            "<|endoftext|>",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            True,
            "file name part 'Instruct'",
        ),
        # Llama 3.x: <|eot_id|> ends an instruct conversion, <|end_of_text|> a base one.
        ({"general.name": "Meta Llama 3.1 8B"}, "<|end_of_text|>", "m.gguf", False, None),
        ({"general.name": "Llama 3.2 1B"}, "<|eot_id|>", "m.gguf", True, "end token `<|eot_id|>`"),
        # Mistral: </s> either way, and [/INST] is never an end token.
        ({"general.name": "Mistral 7B v0.1"}, "</s>", "mistral-7b-v0.1.gguf", False, None),
        ({"general.name": "Mistral 7B v0.1"}, "[/INST]", "mistral-7b-v0.1.gguf", False, None),
        (
            {"general.name": "Mistral 7B Instruct v0.3", "general.finetune": "Instruct"},
            "</s>",
            "m.gguf",
            True,
            "general.finetune part 'Instruct'",
        ),
        ({"general.name": "Phi 3 Mini 4k"}, "<|end|>", "m.gguf", True, "end token `<|end|>`"),
        (
            {"general.name": "Llama 2 7b Chat Hf"},
            "</s>",
            "m.gguf",
            True,
            "general.name part 'Chat'",
        ),
        ({"general.name": "Llama 2 7b Hf"}, "</s>", "llama-2-7b.gguf", False, None),
        ({"general.name": "Zephyr 7B"}, "</s>", "zephyr-7b-sft-full.gguf", True, None),
        ({"general.name": "Tulu"}, "</s>", "tulu_2_dpo_70b.gguf", True, None),
        # A base part wins over an instruct part and over a chat end token.
        (
            {"general.name": "Qwen3 8B Base", "general.finetune": "Base"},
            "<|im_end|>",
            "Qwen3-8B-Base-Instruct-merge.gguf",
            False,
            "general.finetune part 'Base'",
        ),
        ({}, "<|im_end|>", "my-instruct-base.gguf", False, "file name part 'base'"),
        ({}, "</s>", "model.pretrain.Q8_0.gguf", False, "file name part 'pretrain'"),
        # Whole parts only.
        ({}, "</s>", "Quantit-7B.gguf", False, "end token `</s>`"),
        ({}, "</s>", "chatterbox-1b.gguf", False, None),
        ({}, "</s>", "instructor-base.gguf", False, "file name part 'base'"),
        ({"general.name": "Ptolemy 1B"}, "<|im_end|>", "basement.gguf", True, None),
        ({}, "</s>", "some model IT.gguf", True, "file name part 'IT'"),
        # "pt" is a base part ("gemma-3-1b-pt") only where no chat part says otherwise:
        # it is also Portuguese ("…-Instruct-pt-br").
        (
            {"general.finetune": "pt"},
            "<eos>",
            "gemma-3-1b-pt.gguf",
            False,
            "general.finetune part 'pt'",
        ),
        ({}, "</s>", "Llama-3-8B-Instruct-pt-br.gguf", True, "file name part 'Instruct'"),
        ({}, "<|end_of_turn|>", "openchat-3.5.gguf", True, "end token `<|end_of_turn|>`"),
        # Nothing to go by.
        ({}, "", "model.gguf", False, "no end token"),
        # Values that are not text are not names.
        ({"general.finetune": 3, "general.name": ["Instruct"]}, "</s>", "m.gguf", False, None),
    ],
)
def test_classify_model(
    metadata: dict[str, object],
    eos: str,
    file_name: str,
    chat: bool,
    evidence: str | None,
) -> None:
    tuning = classify_model(metadata, eos, file_name)
    assert tuning.chat is chat
    if evidence is not None:
        assert tuning.evidence == evidence
    assert tuning.reason.startswith("chat-tuned: " if chat else "base model: ")


def test_the_reason_says_which_and_why() -> None:
    assert Tuning(True, "end token `<|im_end|>`").reason == "chat-tuned: end token `<|im_end|>`"
    assert Tuning(False, "end token `<eos>`").reason == "base model: end token `<eos>`"
    assert name_parts("Qwen2.5 0.5B-Instruct_v1") == ["Qwen2", "5", "0", "5B", "Instruct", "v1"]
    # general.type is "model" for every file: it says nothing.
    assert not classify_model({"general.type": "model"}, "<eos>", "m.gguf").chat


def test_a_path_s_folders_are_not_the_file_name() -> None:
    assert not classify_model({}, "</s>", "/models/chat/instruct/model.gguf").chat
    assert classify_model({}, "</s>", "/models/base/model-it.gguf").chat


# -- on a loaded model -------------------------------------------------------------------


def test_a_base_model_with_chatml_control_tokens_gets_the_plain_transcript(
    tmp_path: Path, tiny_model: Path
) -> None:
    bare = _copy(tiny_model, tmp_path / "demo.gguf", eos=EOS_S)
    engine = Engine(bare, LoadOptions(n_ctx=256))
    assert engine.has_control_token("<|im_start|>") and engine.has_control_token("<|im_end|>")
    assert engine.template.name == "plain (base model: no template in the file, end token `</s>`)"
    assert engine.template.stop == PLAIN.stop
    assert _spelled(engine) == PLAIN_PROMPT
    engine.close()


def test_a_chat_end_token_makes_it_a_chat_model(tmp_path: Path, tiny_model: Path) -> None:
    bare = _copy(tiny_model, tmp_path / "demo.gguf")
    engine = Engine(bare, LoadOptions(n_ctx=256))
    expected = "chatml (no template in the file; chat-tuned: end token `<|im_end|>`)"
    assert engine.template.name == expected
    assert engine.template.stop == ()
    assert _spelled(engine) == CHATML_PROMPT
    engine.close()


@pytest.mark.parametrize(
    ("strings", "file_name", "expected"),
    [
        ({"general.finetune": "Instruct"}, "demo.gguf", "general.finetune part 'Instruct'"),
        ({"general.name": "Qwen2.5-0.5B-Instruct"}, "demo.gguf", "general.name part 'Instruct'"),
        ({}, "demo-0.5B-Instruct.Q4_K_M.gguf", "file name part 'Instruct'"),
        ({}, "gemma-2-2b-it.gguf", "file name part 'it'"),
    ],
)
def test_a_chat_name_part_makes_it_a_chat_model(
    tmp_path: Path, tiny_model: Path, strings: dict[str, str], file_name: str, expected: str
) -> None:
    bare = _copy(tiny_model, tmp_path / file_name, strings, eos=EOS_S)
    engine = Engine(bare, LoadOptions(n_ctx=256))
    assert engine.template.name == f"chatml (no template in the file; chat-tuned: {expected})"
    assert _spelled(engine) == CHATML_PROMPT
    engine.close()


@pytest.mark.parametrize(
    ("strings", "file_name", "eos", "expected"),
    [
        ({}, "Quantit-7B.gguf", EOS_S, "end token `</s>`"),
        (
            {"general.finetune": "Instruct", "general.name": "Demo Base"},
            "demo.gguf",
            None,
            "general.name part 'Base'",
        ),
        ({}, "demo-1b-pt.gguf", None, "file name part 'pt'"),
    ],
)
def test_a_base_part_or_no_chat_signal_is_a_base_model(
    tmp_path: Path,
    tiny_model: Path,
    strings: dict[str, str],
    file_name: str,
    eos: int | None,
    expected: str,
) -> None:
    bare = _copy(tiny_model, tmp_path / file_name, strings, eos=eos)
    engine = Engine(bare, LoadOptions(n_ctx=256))
    assert engine.template.name == f"plain (base model: no template in the file, {expected})"
    assert _spelled(engine) == PLAIN_PROMPT
    engine.close()


def test_a_template_in_the_file_is_used_whatever_its_names_say(
    tmp_path: Path, tiny_model: Path
) -> None:
    copy = _copy(tiny_model, tmp_path / "demo-base.gguf", {"general.finetune": "Base"}, EOS_S, ())
    engine = Engine(copy, LoadOptions(n_ctx=256))
    assert engine.template.name == "the model's own"
    assert _spelled(engine) == CHATML_PROMPT
    engine.close()


def test_template_overrides_a_base_model(tmp_path: Path, tiny_model: Path, capsys) -> None:
    from localchat.cli.main import main

    bare = _copy(tiny_model, tmp_path / "demo-base.gguf", eos=EOS_S)
    engine = Engine(bare, LoadOptions(n_ctx=256, template="chatml"))
    assert engine.template.name == "chatml (chosen)"
    assert _spelled(engine) == CHATML_PROMPT
    engine.close()
    args = ["ask", "hi", "--model-path", str(bare), "--max-tokens", "2", "--json"]
    assert main(args) == 0
    reported = json.loads(capsys.readouterr().out)["template"]
    assert reported == "plain (base model: no template in the file, file name part 'base')"
    assert main([*args, "--template", "chatml"]) == 0
    assert json.loads(capsys.readouterr().out)["template"] == "chatml (chosen)"


# -- on a real model ---------------------------------------------------------------------


def test_smollm2_without_its_template_is_still_a_chat_model(tmp_path: Path, smollm2: Path) -> None:
    """Its name fields say nothing of Instruct; its end token and its file name do."""
    bare = _copy(smollm2, tmp_path / smollm2.name)
    engine = Engine(bare, LoadOptions(n_ctx=512))
    expected = "chatml (no template in the file; chat-tuned: end token `<|im_end|>`)"
    assert engine.template.name == expected
    reply = engine.stream([ChatMessage("user", "What is the capital of France?")], GREEDY, 40)
    text = "".join(delta.text for delta in reply)
    assert reply.stats.stop_reason == "eos"
    assert "Paris" in text
    engine.close()


def test_smollm2_converted_as_a_base_model_gets_the_plain_transcript(
    tmp_path: Path, smollm2: Path
) -> None:
    """The same weights with what a base conversion writes (``<|endoftext|>`` its end token,
    no Instruct anywhere): the plain transcript, and replies that stop at the user's turn."""
    bare = _copy(smollm2, tmp_path / "smollm2-135m.Q4_1.gguf", eos=0)
    engine = Engine(bare, LoadOptions(n_ctx=1024))
    assert engine.token_text(0) == "<|endoftext|>"
    expected = "plain (base model: no template in the file, end token `<|endoftext|>`)"
    assert engine.template.name == expected
    store = Store(tmp_path / "db.sqlite3")
    conversation = Conversation.open(store, StateStore(tmp_path / "states"), "c", engine, None)
    reasons = []
    for question in ("Hi!", "What is 2+2?", "And 3+3?", "Thanks. What is 5+5?"):
        turn = conversation.send(question, GREEDY, 100)
        for _ in turn:
            pass
        assert "\nUser:" not in turn.generation.text
        reasons.append(turn.stats.stop_reason)
    assert "stop" in reasons, reasons
    conversation.close()
    store.close()
