"""A loaded model and its context: the load (as ``context_plan`` decided it), the chat
template, grammars, drafting, and generations. Its parts are objects of their own: the KV
cache (``cache.py``: surgery, sequence state, whose tokens it holds) and the vocabulary
(``vocab.py``); a generation is handed those parts, not the engine (``generation.py``).
With the rest of ``backends/llama`` the only code that touches llama_cpp:
everything above works with token ids, dataclasses and plain bytes, so the rest of
localchat (and its tests) never depend on llama-cpp-python's objects.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import llama_cpp

from localchat.backends.base import BackendView, CacheView, Sampling
from localchat.backends.compute_thread import run_compute
from localchat.backends.llama.buffers import parse_buffers
from localchat.backends.llama.cache import KVCache
from localchat.backends.llama.context_plan import DEFAULT_CTX as DEFAULT_CTX
from localchat.backends.llama.context_plan import KV_TYPES as KV_TYPES
from localchat.backends.llama.context_plan import MIN_CTX as MIN_CTX
from localchat.backends.llama.context_plan import ContextPlan, LoadOptions, plan_context
from localchat.backends.llama.draft_model import DraftModel
from localchat.backends.llama.drafting import Drafter, DraftPolicy
from localchat.backends.llama.generation import Generation, GenerationParts, ReplyText
from localchat.backends.llama.grammar import (
    GrammarError,
    checked_grammar,
    format_grammar,
    tool_call_grammar,
)
from localchat.backends.llama.image_reader import ImageReader, no_projector, open_reader
from localchat.backends.llama.recording import RecordingLlama
from localchat.backends.llama.runtime import (
    abort_requested,
    buffer_lines,
    last_error_line,
    prepare,
    start_capture,
    watch_abort,
)
from localchat.backends.llama.vocab import Vocabulary
from localchat.chat.formats import (
    PLAIN,
    ChatFormat,
    classify_model,
    detect_format,
    format_from_override,
)
from localchat.chat.images import has_image_markers
from localchat.chat.prompt import PromptBuilder
from localchat.chat.reasoning import CLOSE, opens_reasoning
from localchat.chat.template import ChatMessage, ChatTemplate
from localchat.chat.tools import ToolSpec, ToolUse
from localchat.errors import LocalchatError, ModelFileError, ModelLoadError, UsageError
from localchat.gguf.estimate import ModelDims, kv_bytes_per_token
from localchat.gguf.info import file_fingerprint, read_gguf
from localchat.gguf.quants import tag_of_file
from localchat.state.kvstate import StateKey
from localchat.units import format_bytes

LLAMA_CPP_VERSION: str = llama_cpp.__version__


class Engine:
    """A loaded model with its context: the only owner of llama.cpp objects. Its parts: the
    KV cache (``cache``, leased to one conversation at a time) and the vocabulary
    (``vocab``); a generation is handed those, not the engine."""

    def __init__(self, model_path: Path, options: LoadOptions | None = None) -> None:
        self.options = options or LoadOptions()
        self.model_path = Path(model_path)
        self.info = read_gguf(self.model_path)
        plan = plan_context(self.options, self.info, self.model_path)
        self.planned_ctx = plan.n_ctx  # the context the plan is for (``own_cells`` aside)
        # How many threads generate: the app sizes its own CPU budget by it.
        self.threads = plan.threads
        self.kv_type_id = plan.kv_type_id  # llama.cpp's ggml type
        self.flash_attn = plan.flash_attn
        self.batch_invariant = plan.batch_invariant
        # Whether generations draft; switched off between turns, the same engine runs plain
        # (the bench compares the two that way: the same weights and caches on both sides).
        self.drafting = plan.drafting
        self._draft_policy = self._new_draft_policy()
        self.draft_model: DraftModel | None = None
        self._draft_refused: str | None = None  # why an optional draft model was left out
        self._llm = self._load(plan)
        self._measure_cache()
        self.cache = KVCache(self._llm, self.n_swa, self.windowed)
        self.vocab = Vocabulary(self._llm, self.add_space_prefix)
        self.template = self._load_template()
        self._load_draft_model(plan)
        self.image_reader = self._load_projector(plan)
        self._fingerprint: str | None = None
        self._warm_up()

    def _new_draft_policy(self) -> DraftPolicy:
        """The drafting policy, starting from this machine's calibration where there is one."""
        policy = DraftPolicy()
        if self.options.step_costs is not None:
            policy.prior_costs = dict(self.options.step_costs)
        if self.options.draft_step_cost is not None:
            policy.prior_model_step = self.options.draft_step_cost
        return policy

    def _load(self, plan: ContextPlan) -> RecordingLlama:
        """Load the model and its context as ``plan`` says; a model whose state is recurrent
        stops drafting. An interrupt stays one; any other failure names llama.cpp's cause."""
        prepare()
        start_capture()
        try:
            llm = RecordingLlama(
                model_path=str(self.model_path),
                n_ctx=plan.own_cells,
                n_batch=min(self.options.n_batch, plan.own_cells),
                n_threads=plan.threads,
                n_threads_batch=plan.threads,
                n_gpu_layers=self.options.n_gpu_layers,
                type_k=plan.kv_type_id,
                type_v=plan.kv_type_id,
                flash_attn=plan.flash_attn,
                n_ubatch=self.options.n_ubatch,
                # Sliding-window layers keep only their window (as llama-server runs them):
                # a fraction of the full-size cache that llama.cpp's library default is.
                swa_full=self.options.swa_cache == "full",
                verbose=False,
            )
            watch_abort(llm.ctx)  # decodes stop midway on request (the warm-up's too)
            llm.batch_invariant = self.batch_invariant
            # A recurrent state cannot drop rejected drafts (llama.cpp's partial removal
            # fails there): Mamba, RWKV and hybrids such as LFM2 or Jamba never draft.
            model = llm.model
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
        return llm

    def _measure_cache(self) -> None:
        """What the loaded cache takes (from llama.cpp's log of its buffers) and how it can
        be cut: its sliding window, and whether a step's tokens can leave it exactly."""
        # K and V bytes one token occupies across all layers: the KV cache's unit of growth.
        self.kv_bytes_per_token = kv_bytes_per_token(
            ModelDims.from_gguf(self.info), self.options.kv_type
        )
        lines = buffer_lines()
        # The cells and layers of each cache llama.cpp made, times what one cell of one
        # layer takes (its log rounds sizes to 0.01 MiB).
        self.buffers = parse_buffers(lines, self.kv_bytes_per_token // max(1, self.info.n_layer))
        # Positions a sliding-window layer looks back; its cache keeps only those when the
        # window cache is in use, so the cache cannot be cut back far (``KVCache.keeps``).
        self.n_swa = int(llama_cpp.llama_model_n_swa(self._llm.model))
        self.windowed = self.n_swa > 0 and self.options.swa_cache == "window"
        # Whether a step's tokens can leave a sequence's cache exactly (a rejected draft, a
        # step given up midway): not a recurrent state, nor a window that dropped old cells.
        self.cuts_back = not self.recurrent and not self.windowed

    def _load_template(self) -> ChatTemplate:
        """The chat template in use; one that does not compile (or runs away probed) frees
        the model and names the file."""
        try:
            template = self._chat_template()
        except ModelFileError as exc:
            self.close()
            raise type(exc)(f"{self.model_path}: {exc}") from None  # a runaway stays one
        template.model = str(self.model_path)  # a turn's runaway names the file too
        return template

    def _load_draft_model(self, plan: ContextPlan) -> None:
        """Load the draft model where this engine drafts with one; one that cannot draft
        here is an error where it was required, else left out with the reason."""
        mode = self.options.speculative
        if not (self.drafting and mode in ("auto", "draft") and self.options.draft_model):
            return
        try:  # after the buffers were read from the log: the draft's would join them
            self.draft_model = DraftModel(
                self.options.draft_model, self._llm, plan.n_ctx, plan.threads
            )
        except LocalchatError as exc:
            if self.options.draft_required:
                self.close()
                raise
            self._draft_refused = str(exc)
        except BaseException:  # Ctrl+C while it loads: the model is freed all the same
            self.close()
            raise

    def _load_projector(self, plan: ContextPlan) -> ImageReader | None:
        """The projector that reads images, where one is given (after the buffers were read
        from the log: clip's compute buffer is not the model's)."""
        options = self.options
        if options.projector is None:
            return None
        try:
            return open_reader(
                options.projector, self._llm, options.images, options.embeddings_dir, plan.threads
            )
        except BaseException:
            self.close()
            raise

    def images_refused(self) -> str | None:
        """Why this model cannot be shown images, in one line (None: it can)."""
        return None if self.image_reader is not None else no_projector(self.model_name)

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
    def frees_with_process(self) -> bool:
        """Its memory is this process's: a quitting app leaves it to the exit."""
        return True

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
        return self.vocab.has_control_token(text)

    def strips_reply_space(self, last_prompt_token: int) -> bool:
        """Whether a reply's first space is the tokenizer's own (after a control token)."""
        return self.vocab.strips_reply_space(last_prompt_token)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for, control tokens spelled out (``Vocabulary``)."""
        return self.vocab.token_bytes(token)

    def prompt_builder(
        self, now: datetime | None = None, tools: list[ToolSpec] | None = None
    ) -> PromptBuilder:
        """Builds prompts for this model: its template, its tokenizer, its BOS rule.
        ``now`` is the date the template may write (a conversation's start); ``tools``
        the functions it may call."""
        return PromptBuilder(
            self.template,
            self._prompt_tokens_of,
            [self.bos_token] if self.add_bos else [],
            self.vocab.token_bytes,
            now,
            tools,
        )

    def _prompt_tokens_of(self, text: str) -> list[int]:
        """A rendered prompt's ids (no BOS): images as their placeholder runs; a model
        without a projector refuses images in one line."""
        plain = lambda piece: self.vocab.tokenize(piece, special=True)  # noqa: E731
        if self.image_reader is not None:
            return self.image_reader.tokens(text, plain)
        if has_image_markers(text):
            raise UsageError(self.images_refused() or "")
        return plain(text)

    def prompt_tokens(
        self, messages: list[ChatMessage], tools: list[ToolSpec] | None = None
    ) -> list[int]:
        """The token ids asking for a reply to ``messages`` (a one-off exchange)."""
        return self.prompt_builder(tools=tools).build(messages).tokens

    def spelled_tokens(self, texts: Sequence[str]) -> frozenset[int]:
        """The tokens that are each of ``texts`` whole (a tool call's markers)."""
        return self.vocab.spelled_tokens(texts)

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes, by the model's tokenizer on the compute thread (llama.cpp
        runs there alone), so any thread may ask."""
        return run_compute(lambda: len(self.tokenize(text)))

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
        return self.vocab.is_end_of_generation(token)

    def token_text(self, token: int) -> str:
        """A token's text as the model sees it, specials included (for templates and debugging)."""
        return self.vocab.token_text(token)

    # -- tokens ------------------------------------------------------------------------
    def reply_bytes(self, token: int) -> bytes:
        """A reply token's bytes, control tokens silent."""
        return self.vocab.reply_bytes(token)

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``special`` parses control tokens such as ``<|im_end|>``."""
        return self.vocab.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        """Text of ``tokens``; ``special`` spells control tokens out."""
        return self.vocab.detokenize(tokens, special)

    # -- the KV cache's bytes (its operations: ``self.cache``) ---------------------------
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
        """The model panel's lines: the name users know the model by, its type, the cache, the
        context, GPU layers, the template and what llama.cpp allocated."""
        buffers = self.buffers_summary()
        name = self.info.display_name
        panel = (
            f"{name}\n{self.info.file_type} · KV {self.options.kv_type} ·"
            f" ctx {self.n_ctx}\nGPU layers {self.options.n_gpu_layers}"
            f"\ntemplate: {self.template.name}" + (f"\n{buffers}" if buffers else "")
        )
        if self.draft_model is not None:
            panel += f"\ndraft model: {self.draft_model.name}"
        if self.image_reader is not None:
            panel += f"\nimages: {self.image_reader.projector.path.name}"
        # The name holds the quant where the file's name does (SmolLM2-135M-Instruct Q4_1).
        title = name if tag_of_file(name) else f"{name} · {self.info.file_type}"
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
        if not tokens or tokens[-1] < 0:  # an image asks for no logits to sample from
            raise UsageError("empty prompt" if not tokens else "a prompt cannot end with an image")
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
        calls = tool_use if tool_use is not None and tool_use.reads_calls else None
        return Generation(
            self._generation_parts(),
            tokens,
            sampling or Sampling(),
            min(max_tokens, room),
            cancel,
            _tool_use=calls,
            _grammar=self.call_grammar(calls) if calls is not None and calls.forced else None,
        )

    def reply_text(self, prompt: Sequence[int], spelled: frozenset[int] = frozenset()) -> ReplyText:
        """What turns a reply to ``prompt`` into text deltas, with this model's vocabulary and
        template (a server's sequences read their replies with it)."""
        return ReplyText(self.vocab, self.template.stop, prompt, spelled)

    def _generation_parts(self) -> GenerationParts:
        """What a generation is handed: the context, the cache, the vocabulary, the template
        in use, and the figures its stats need."""
        return GenerationParts(
            llm=self._llm,
            cache=self.cache,
            vocab=self.vocab,
            template=self.template,
            threads=self.threads,
            drafter=self.drafter,
            kv_bytes_for=self.kv_bytes_for,
            kv_bytes_allocated=self.kv_bytes_allocated,
        )

    def call_grammar(self, tool_use: ToolUse) -> str:
        """The grammar that holds a reply to one call of ``tool_use``'s tools, in this
        model's format; a schema llama.cpp cannot follow is a one-line error."""
        family = self.template.tool_family
        try:
            rules = tool_call_grammar(family, list(tool_use.tools), tool_use.forced_name)
            checked_grammar(self.vocab.pointer, rules)
        except GrammarError as exc:
            raise UsageError(str(exc)) from None
        return rules

    def format_grammar(self, schema: dict[str, Any]) -> str:
        """The grammar that holds a reply to one JSON value after ``schema``; a schema
        llama.cpp cannot follow is a one-line error."""
        try:
            rules = format_grammar(schema)
            checked_grammar(self.vocab.pointer, rules)
        except GrammarError as exc:
            raise UsageError(str(exc)) from None
        return rules

    def given_grammar(self, rules: str) -> str:
        """A client's own GBNF, where llama.cpp parses it; else a one-line error."""
        try:
            checked_grammar(self.vocab.pointer, rules)
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
        reader = getattr(self, "image_reader", None)
        if reader is not None:
            self._llm.images = None
            with contextlib.suppress(Exception):
                reader.close()
        if self.draft_model is not None:
            with contextlib.suppress(Exception):
                self.draft_model.close()
        with contextlib.suppress(Exception):
            self._llm.close()
