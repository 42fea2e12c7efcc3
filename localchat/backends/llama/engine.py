"""A loaded model and its context: load, tokenize, the chat template, KV cache surgery and
sequence state. With the rest of ``backends/llama`` the only code that touches llama_cpp:
everything above works with token ids, dataclasses and plain bytes, so the rest of
localchat (and its tests) never depend on llama-cpp-python's objects.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import llama_cpp

from localchat.backends.base import SPECULATIVE_MODES, BackendView, CacheView, Sampling
from localchat.backends.llama.buffers import parse_buffers
from localchat.backends.llama.cache import KVCache
from localchat.backends.llama.draft_model import DraftModel
from localchat.backends.llama.drafting import Drafter, DraftPolicy
from localchat.backends.llama.generation import Generation
from localchat.backends.llama.grammar import (
    GrammarError,
    checked_grammar,
    format_grammar,
    tool_call_grammar,
)
from localchat.backends.llama.internals import vocab_of
from localchat.backends.llama.recording import RecordingLlama
from localchat.backends.llama.runtime import (
    abort_requested,
    buffer_lines,
    last_error_line,
    prepare,
    start_capture,
    watch_abort,
)
from localchat.chat.formats import (
    PLAIN,
    ChatFormat,
    classify_model,
    detect_format,
    format_from_override,
)
from localchat.chat.prompt import PromptBuilder
from localchat.chat.reasoning import CLOSE, opens_reasoning
from localchat.chat.template import ChatMessage, ChatTemplate
from localchat.chat.tools import ToolSpec, ToolUse
from localchat.cpu import physical_cores
from localchat.errors import LocalchatError, ModelFileError, ModelLoadError, UsageError
from localchat.gguf.estimate import ModelDims, kv_bytes_per_token, preferred_flash_attn
from localchat.gguf.info import file_fingerprint, read_gguf
from localchat.gguf.quants import SWA_CACHE_MODES
from localchat.state.kvstate import StateKey
from localchat.units import format_bytes

LLAMA_CPP_VERSION: str = llama_cpp.__version__

KV_TYPES: dict[str, int] = {
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}

MIN_CTX = 32
# The context used when none is asked for (capped at the model's trained context).
DEFAULT_CTX = 4096


@dataclass(frozen=True)
class LoadOptions:
    """How to load a model: context size, threads, GPU layers, the KV cache type, and the
    chat template (``None``: the model's own, else one chosen from what the file says)."""

    n_ctx: int | None = None  # None: DEFAULT_CTX, capped at the model's trained context
    n_threads: int | None = None
    n_gpu_layers: int = 0
    kv_type: str = "f16"
    n_batch: int = 512
    template: str | None = None  # a built-in format name or a .jinja file
    swa_cache: str = "window"  # sliding-window layers: "window" (their window) or "full"
    flash_attn: bool | None = None  # None: where it costs nothing (``preferred_flash_attn``)
    n_ubatch: int = 512  # the micro-batch: the compute buffer grows with it
    # Speculative decoding (drafting.py): "auto" drafts by prompt lookup and with the draft
    # model, if one is given, where a batch's logits equal single steps'
    # (``Engine.batch_invariant``), so replies stay exactly the same; "ngram" (prompt
    # lookup) and "draft" (the draft model) draft anyway, accepting llama.cpp's batch
    # rounding; "off" never.
    speculative: str = "auto"
    draft_model: Path | None = None  # a smaller model of the same family (draft_model.py)
    # False: a draft model that cannot draft for this one (another vocabulary, a file
    # llama.cpp refuses) is left out with the reason in ``draft_model_unused``, not an error.
    draft_required: bool = True
    # This machine's calibration, where there is one: what a step of n tokens costs this
    # model (in single steps, by n: ``SpeedModel.step_costs``) and a draft model's step
    # against the model's; the drafting policy starts from these until it has timed steps
    # of its own.
    step_costs: dict[int, float] | None = None
    draft_step_cost: float | None = None
    # Where another context on these weights does the work (serve's sequences): the cells
    # of the engine's own, which then only warms the model up. The plan (flash attention,
    # ``planned_ctx``) is still made for ``n_ctx``.
    own_cells: int | None = None


class Engine:
    """A loaded model with its context: the only owner of llama.cpp objects. Its KV cache
    is a part it holds (``cache``), leased to one conversation at a time."""

    def __init__(self, model_path: Path, options: LoadOptions | None = None) -> None:
        self.options = options or LoadOptions()
        self.model_path = Path(model_path)
        self.info = read_gguf(self.model_path)
        if self.options.kv_type not in KV_TYPES:
            raise UsageError(
                f"unknown KV cache type {self.options.kv_type!r}; choose one of {', '.join(KV_TYPES)}"
            )
        trained = self.info.context_length
        n_ctx = self.options.n_ctx or (min(DEFAULT_CTX, trained) if trained else DEFAULT_CTX)
        if n_ctx < MIN_CTX:
            raise UsageError(f"context size {n_ctx} is too small; use at least {MIN_CTX}")
        if trained and n_ctx > trained:
            raise UsageError(
                f"{self.model_path}: context size {n_ctx} is larger than the model's trained"
                f" context {trained}; use --ctx {trained} or less"
            )
        self.planned_ctx = n_ctx  # the context the plan is for (``own_cells`` aside)
        own = min(self.options.own_cells or n_ctx, n_ctx)
        threads = self.options.n_threads or physical_cores()
        # How many threads generate: the app sizes its own CPU budget by it.
        self.threads = threads
        kv_id = self.kv_type_id = KV_TYPES[self.options.kv_type]  # llama.cpp's ggml type
        # Quantized V caches need flash attention in llama.cpp; elsewhere the plan's rule.
        self.flash_attn = self.options.kv_type != "f16" or (
            self.options.flash_attn
            if self.options.flash_attn is not None
            else preferred_flash_attn(n_ctx, self.options.kv_type, self.options.n_gpu_layers > 0)
        )
        if self.options.speculative not in SPECULATIVE_MODES:
            raise UsageError(
                f"unknown speculative mode {self.options.speculative!r}; choose one of"
                f" {', '.join(SPECULATIVE_MODES)}"
            )
        # Drafts verified in batches change nothing where the kernels give a batch the
        # logits single steps would. On llama.cpp's CPU backend that holds with flash
        # attention over a quantized KV cache (one kernel for any batch: measured
        # bit-identical at 700 cached tokens). With an F16 cache a single token past 512
        # cells takes a split-KV path of its own, and without flash attention the KQ
        # products differ by batch size: a logit moves by up to ~1.2, enough to flip a
        # greedy pick. GPU kernels also differ by batch size (not measured here).
        self.batch_invariant = (
            self.flash_attn and self.options.kv_type != "f16" and not self.options.n_gpu_layers
        )
        mode = self.options.speculative
        if mode == "draft" and self.options.draft_model is None:
            raise UsageError(
                "speculative mode 'draft' needs a draft model: give --draft-model NAME|FILE"
                " (a smaller model of the same family)"
            )
        # Whether generations draft; switched off between turns, the same engine runs plain
        # (the bench compares the two that way: the same weights and caches on both sides).
        self.drafting = mode in ("ngram", "draft") or (mode == "auto" and self.batch_invariant)
        self._draft_policy = DraftPolicy()
        if self.options.step_costs is not None:
            self._draft_policy.prior_costs = dict(self.options.step_costs)
        if self.options.draft_step_cost is not None:
            self._draft_policy.prior_model_step = self.options.draft_step_cost
        self.draft_model: DraftModel | None = None
        self._draft_refused: str | None = None  # why an optional draft model was left out
        if self.options.swa_cache not in SWA_CACHE_MODES:
            raise UsageError(
                f"unknown swa_cache {self.options.swa_cache!r}; choose one of"
                f" {', '.join(SWA_CACHE_MODES)}"
            )
        prepare()
        start_capture()
        try:
            self._llm = RecordingLlama(
                model_path=str(self.model_path),
                n_ctx=own,
                n_batch=min(self.options.n_batch, own),
                n_threads=threads,
                n_threads_batch=threads,
                n_gpu_layers=self.options.n_gpu_layers,
                type_k=kv_id,
                type_v=kv_id,
                flash_attn=self.flash_attn,
                n_ubatch=self.options.n_ubatch,
                # Sliding-window layers keep only their window (as llama-server runs them):
                # a fraction of the full-size cache that llama.cpp's library default is.
                swa_full=self.options.swa_cache == "full",
                verbose=False,
            )
            watch_abort(self._llm.ctx)  # decodes stop midway on request (the warm-up's too)
            self._llm.batch_invariant = self.batch_invariant
            # A recurrent state cannot drop rejected drafts (llama.cpp's partial removal
            # fails there): Mamba, RWKV and hybrids such as LFM2 or Jamba never draft.
            model = self._llm.model
            self.recurrent = bool(
                llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model)
            )
            if self.recurrent:
                self.drafting = False
        except Exception as exc:  # llama-cpp-python raises ValueError/RuntimeError
            if abort_requested():  # stopped between two tensors: an interrupt, not a failure
                raise KeyboardInterrupt from None
            raise ModelLoadError(
                f"{self.model_path}: llama.cpp could not load it: {last_error_line()}"
            ) from exc
        # K and V bytes one token occupies across all layers: the KV cache's unit of growth.
        self.kv_bytes_per_token = kv_bytes_per_token(
            ModelDims.from_gguf(self.info), self.options.kv_type
        )
        lines = buffer_lines()
        # The cells and layers of each cache llama.cpp made, times what one cell of one
        # layer takes (its log rounds sizes to 0.01 MiB).
        self.buffers = parse_buffers(lines, self.kv_bytes_per_token // max(1, self.info.n_layer))
        # Positions a sliding-window layer looks back; its cache keeps only those when the
        # window cache is in use, so the cache cannot be cut back far (see ``keeps``).
        self.n_swa = int(llama_cpp.llama_model_n_swa(self._llm.model))
        self.windowed = self.n_swa > 0 and self.options.swa_cache == "window"
        # Whether a step's tokens can leave a sequence's cache exactly (a rejected draft, a
        # step given up midway): not a recurrent state, nor a window that dropped old cells.
        self.cuts_back = not self.recurrent and not self.windowed
        self.cache = KVCache(self._llm, self.n_swa, self.windowed)
        try:
            self.template = self._chat_template()
        except ModelFileError as exc:  # a template that does not compile, or runs away probed
            self.close()
            raise type(exc)(f"{self.model_path}: {exc}") from None  # a runaway stays one
        self.template.model = str(self.model_path)  # a turn's runaway names the file too
        if self.drafting and mode in ("auto", "draft") and self.options.draft_model:
            try:  # after the buffers were read from the log: the draft's would join them
                self.draft_model = DraftModel(self.options.draft_model, self._llm, n_ctx, threads)
            except LocalchatError as exc:
                if self.options.draft_required:
                    self.close()
                    raise
                self._draft_refused = str(exc)
            except BaseException:  # Ctrl+C while it loads: the model is freed all the same
                self.close()
                raise
        self._warm_up()

    @property
    def draft_model_unused(self) -> str | None:
        """Why a draft model that was given does not draft, in one line (None: it drafts,
        or none was given)."""
        given = self.options.draft_model
        if given is None or self.draft_model is not None:
            return None
        if self._draft_refused is not None:
            return f"the draft model is not used: {self._draft_refused}"
        mode = self.options.speculative
        if mode == "auto" and self.options.n_gpu_layers:
            why = "GPU kernels round a batch differently from single steps, so replies could change; --speculative draft uses it anyway"
        elif mode == "auto" and not self.batch_invariant:
            why = (
                "drafts verified in batches could change replies with this KV cache (a q8_0"
                " cache keeps them exact); --speculative draft uses it anyway"
            )
        elif mode in ("auto", "draft"):
            why = "this model's state cannot drop rejected drafts"
        else:
            why = f"speculative is {mode!r}"
        return f"the draft model {given.name} is not used: {why}"

    def _warm_up(self) -> None:
        """One throwaway decode at load, as llama.cpp's own tools do: it faults in the mapped
        weights and sets up compute buffers, so the first real turn does not pay for that."""
        self._llm.eval([self.bos_token])
        self.cache.reset()
        self._fingerprint: str | None = None

    @property
    def fingerprint(self) -> str:
        """Identity of the model file: keys saved states and per-model token ids."""
        if self._fingerprint is None:
            self._fingerprint = file_fingerprint(self.model_path)
        return self._fingerprint

    # -- model facts -------------------------------------------------------------------
    @property
    def state_key(self) -> StateKey:
        """What a saved state of this model's cache depends on (file, context, KV type, build)."""
        return StateKey(self.fingerprint, self.n_ctx, self.options.kv_type, LLAMA_CPP_VERSION)

    @property
    def llm(self) -> RecordingLlama:
        """llama-cpp-python's model and context, for this package's generation loop (and
        the bench's look at its buffers): callers outside use the engine's own methods."""
        return self._llm

    @property
    def model_name(self) -> str:
        """The file's name: what the transcript records as the model that answered."""
        return self.model_path.name

    @property
    def context_size(self) -> int:
        return self.n_ctx

    @property
    def n_ctx(self) -> int:
        """The context size asked for: how many tokens a prompt plus reply may hold."""
        return self.cache.n_ctx

    @property
    def n_batch(self) -> int:
        """Tokens one evaluation batch holds: a cold prompt is read in batches of this."""
        return self.cache.n_batch

    @property
    def kv_cells(self) -> int:
        """Cells llama.cpp really allocated for the KV cache (it pads the context size up)."""
        return int(self._llm.n_ctx())

    @property
    def n_vocab(self) -> int:
        return int(self._llm.n_vocab())

    @property
    def bos_token(self) -> int:
        return int(self._llm.token_bos())

    @property
    def add_bos(self) -> bool:
        return bool(self.info.metadata.get("tokenizer.ggml.add_bos_token", True))

    @property
    def add_space_prefix(self) -> bool:
        """SentencePiece vocabularies that start every text after a control token with a space."""
        default = self.info.metadata.get("tokenizer.ggml.model") == "llama"
        return bool(self.info.metadata.get("tokenizer.ggml.add_space_prefix", default))

    def _chat_template(self) -> ChatTemplate:
        """The template in use: ``--template``, else the model's own; without one, a base
        model gets a plain transcript with stop strings and a chat-tuned one the format its
        vocabulary's control tokens name (``classify_model``: a vocabulary alone cannot say)."""
        eos = int(self._llm.token_eos())
        eos_text = self.token_text(eos) if eos >= 0 else ""
        chosen: ChatFormat
        if self.options.template:
            chosen = format_from_override(self.options.template)
            name = f"{chosen.name} (chosen)"
        elif self.info.chat_template:
            chosen = ChatFormat("the model's own", self.info.chat_template)
            name = chosen.name
        else:
            tuning = classify_model(self.info.metadata, eos_text, self.model_path.name)
            chosen = detect_format(self.has_control_token) if tuning.chat else PLAIN
            if not tuning.chat:
                name = f"plain (base model: no template in the file, {tuning.evidence})"
            elif chosen.markers:
                name = f"{chosen.name} (no template in the file; {tuning.reason})"
            else:
                name = (
                    f"plain (no template in the file; {tuning.reason}, but its vocabulary"
                    " has no known chat format's control tokens)"
                )
        return ChatTemplate(
            chosen.source,
            bos_token=self.token_text(self.bos_token),
            eos_token=eos_text,
            name=name,
            stop=chosen.stop,
        )

    def has_control_token(self, text: str) -> bool:
        """Whether ``text`` is one control token of this vocabulary."""
        ids = self.tokenize(text, special=True)
        vocab = vocab_of(self._llm)
        return len(ids) == 1 and bool(llama_cpp.llama_vocab_is_control(vocab, ids[0]))

    def strips_reply_space(self, last_prompt_token: int) -> bool:
        """Whether a reply's first space is the tokenizer's own (after a control token)."""
        vocab = vocab_of(self._llm)
        return self.add_space_prefix and bool(
            llama_cpp.llama_vocab_is_control(vocab, last_prompt_token)
        )

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for, control tokens spelled out: the prompt builder
        compares token sequences by what they say."""
        vocab = vocab_of(self._llm)
        size = 64
        while True:
            buffer = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, True)
            if n >= 0:
                return buffer.raw[:n]
            size = -n

    def prompt_builder(
        self, now: datetime | None = None, tools: list[ToolSpec] | None = None
    ) -> PromptBuilder:
        """Builds prompts for this model: its template, its tokenizer, its BOS rule.
        ``now`` is the date the template may write (a conversation's start); ``tools``
        the functions it may call."""
        return PromptBuilder(
            self.template,
            lambda text: self.tokenize(text, special=True),
            [self.bos_token] if self.add_bos else [],
            self.token_bytes,
            now,
            tools,
        )

    def prompt_tokens(
        self, messages: list[ChatMessage], tools: list[ToolSpec] | None = None
    ) -> list[int]:
        """The token ids asking for a reply to ``messages`` (a one-off exchange)."""
        return self.prompt_builder(tools=tools).build(messages).tokens

    def spelled_tokens(self, texts: Sequence[str]) -> frozenset[int]:
        """The tokens that are each of ``texts`` whole (a tool call's markers, often control
        tokens a reply's text leaves out): a reply keeps them, so its calls can be read."""
        tokens = (self.tokenize(text, special=True) for text in texts)
        return frozenset(ids[0] for ids in tokens if len(ids) == 1)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    def stream(
        self,
        messages: Sequence[ChatMessage],
        sampling: Sampling | None = None,
        max_tokens: int = 512,
        cancel: threading.Event | None = None,
        tool_use: ToolUse | None = None,
    ) -> Generation:
        """A one-off reply to ``messages``, rendered with the model's template (and the
        tools offered, where there are)."""
        tools = list(tool_use.tools) if tool_use is not None and tool_use.tools else None
        tokens = self.prompt_tokens(list(messages), tools)
        return self.generate(tokens, sampling, max_tokens, cancel, tool_use)

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(vocab_of(self._llm), token))

    def token_text(self, token: int) -> str:
        """A token's text as the model sees it, specials included (for templates and debugging)."""
        return bytes(self._llm.detokenize([token], special=True)).decode("utf-8", errors="replace")

    # -- tokens ------------------------------------------------------------------------
    def reply_bytes(self, token: int) -> bytes:
        """A reply token's bytes, control tokens silent (a character may span tokens: join
        them before decoding)."""
        return bytes(self._llm.detokenize([token]))

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``special`` parses control tokens such as ``<|im_end|>``."""
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        """Text of ``tokens``; ``special`` spells control tokens out."""
        data = self._llm.detokenize(list(tokens), special=special)
        return bytes(data).decode("utf-8", errors="replace")

    # -- the KV cache ------------------------------------------------------------------
    @property
    def kv_bytes_used(self) -> int:
        return self.kv_bytes_for(int(self._llm.n_tokens))

    def kv_bytes_for(self, n_tokens: int) -> int:
        """What the caches llama.cpp allocated hold for ``n_tokens`` positions."""
        if self.buffers.kv:
            return self.buffers.kv_bytes_for(n_tokens)
        return n_tokens * self.kv_bytes_per_token

    @property
    def kv_bytes_allocated(self) -> int:
        """The KV caches llama.cpp allocated (both caches of a sliding-window model)."""
        return self.buffers.kv_bytes or self.kv_cells * self.kv_bytes_per_token

    def describe(self) -> BackendView:
        """The model panel's lines: the file's name for itself, its type, the cache, the
        context, GPU layers, the template and what llama.cpp allocated."""
        buffers = self.buffers_summary()
        panel = (
            f"{self.info.name}\n{self.info.file_type} · KV {self.options.kv_type} ·"
            f" ctx {self.n_ctx}\nGPU layers {self.options.n_gpu_layers}"
            f"\ntemplate: {self.template.name}" + (f"\n{buffers}" if buffers else "")
        )
        if self.draft_model is not None:
            panel += f"\ndraft model: {self.draft_model.name}"
        title = f"{self.info.name} · {self.info.file_type}"
        return BackendView(title, panel, self.model_name, self.template.name, None)

    def cache_view(self, tokens: int, server_usage: float | None = None) -> CacheView:
        return CacheView(tokens, self.n_ctx, self.kv_bytes_for(tokens), self.kv_bytes_allocated)

    def buffers_summary(self) -> str:
        """llama.cpp's own buffers in a line or two: weights, compute, the attention kernel,
        and the window cache of a sliding-window model."""
        weights = sum(self.buffers.weights.values())
        compute = sum(self.buffers.compute.values())
        kernel = "flash attention" if self.flash_attn else "no flash attention"
        line = f"weights {format_bytes(weights)} · compute {format_bytes(compute)} · {kernel}"
        window = [c for c in self.buffers.kv if c.cells < self.kv_cells]
        if self.windowed and window:
            line += f"\nwindow cache: {window[0].layers} layers keep {window[0].cells} cells"
        return line

    # -- generation --------------------------------------------------------------------
    def generate(
        self,
        prompt_tokens: Sequence[int],
        sampling: Sampling | None = None,
        max_tokens: int = 256,
        cancel: threading.Event | None = None,
        tool_use: ToolUse | None = None,
    ) -> Generation:
        """Stream a reply to ``prompt_tokens``, reusing the cached prefix they share;
        ``tool_use``: the tools the prompt offers (the reply is read for calls, and held to
        one by a grammar where a call is required)."""
        tokens = list(prompt_tokens)
        if not tokens:
            raise UsageError("empty prompt")
        forced = tool_use is not None and tool_use.forced
        if forced and opens_reasoning(self.detokenize(tokens[-8:], special=True)):
            # A call is required now: the reasoning block the template opened is closed
            # first (as llama.cpp's server does), so the call is the answer, and read.
            tokens += self.tokenize(CLOSE + "\n\n", special=True)
        if len(tokens) >= self.n_ctx:
            raise UsageError(
                f"the prompt is {len(tokens)} tokens but the context holds {self.n_ctx};"
                " use a larger --ctx or a shorter message"
            )
        room = self.n_ctx - len(tokens)
        generation = Generation(self, tokens, sampling or Sampling(), min(max_tokens, room), cancel)
        if tool_use is not None and tool_use.reads_calls:
            generation._tool_use = tool_use
            if tool_use.forced:
                generation._grammar = self.call_grammar(tool_use)
        return generation

    def call_grammar(self, tool_use: ToolUse) -> str:
        """The grammar that holds a reply to one call of ``tool_use``'s tools, in this
        model's format; a schema llama.cpp cannot follow is a one-line error."""
        family = self.template.tool_family
        try:
            rules = tool_call_grammar(family, list(tool_use.tools), tool_use.forced_name)
            checked_grammar(vocab_of(self._llm), rules)
        except GrammarError as exc:
            raise UsageError(str(exc)) from None
        return rules

    def format_grammar(self, schema: dict[str, Any]) -> str:
        """The grammar that holds a reply to one JSON value after ``schema``; a schema
        llama.cpp cannot follow is a one-line error."""
        try:
            rules = format_grammar(schema)
            checked_grammar(vocab_of(self._llm), rules)
        except GrammarError as exc:
            raise UsageError(str(exc)) from None
        return rules

    def given_grammar(self, rules: str) -> str:
        """A client's own GBNF, where llama.cpp parses it; else a one-line error."""
        try:
            checked_grammar(vocab_of(self._llm), rules)
        except GrammarError as exc:
            raise UsageError(f"grammar: {exc}") from None
        return rules

    def drafter(self, end: int) -> Drafter | None:
        """The draft model for a generation that must stop at context length ``end``, where
        this engine drafts (the step costs it measured carry over; the acceptance starts
        from its prior, as each reply repeats its context more or less)."""
        if not self.drafting:
            return None
        self._draft_policy.reset_acceptance()
        lookup = self.options.speculative != "draft"
        return Drafter(self._llm, self._draft_policy, end, lookup, self.draft_model)

    def step_costs(self) -> dict[int, float]:
        """What a generation step of n tokens costs here, in single steps, for every size a
        draft may take (measured where steps of that size ran, else interpolated): what
        decides how long a draft pays."""
        policy = self._draft_policy
        return {n: policy.cost(n) for n in range(1, policy.max_draft + 2)}

    def close(self) -> None:
        if self.draft_model is not None:
            with contextlib.suppress(Exception):
                self.draft_model.close()
        with contextlib.suppress(Exception):
            self._llm.close()
