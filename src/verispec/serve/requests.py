"""From an HTTP request to a Sequence, with every request's work bounded before it is admitted.

A server is shared, so each request is checked against the server's limits (`ServeConfig`) before it may cost
anything: its prompt and max_tokens against the context window and the per-request token budget, its stop strings
in count and length, its speculation (K, tree nodes and depth; a tree's top_k is at most its budget, `TreeConfig`),
its sampling settings in ranges (`protocol`; sampling is NaN-safe for any of them anyway), and what its key/value
cache will cost against the running requests' budget (checked by the scheduler at submission). Whatever fails is
a 4xx naming the field, never a traceback.

The work is ordered cheapest first, so a request that will be refused costs little: `check` (fields alone, on the
event loop), then the prompt (`completion_prompt`, `chat_prompt`: its size in characters first, then templating and
tokenizing, on a worker thread), then `sequence` (lengths against the window; a structured-output constraint measured
against the bounds and compiled, on the compile pool: `serve.compile`).
"""

from __future__ import annotations

import json

from verispec.api import SpeculativeDecoder
from verispec.chat import chat_text, chat_text_ids
from verispec.config import Constraint, SamplingConfig, SpecConfig
from verispec.serve.config import ServeConfig
from verispec.core.sequence import Sequence
from verispec.drafters.registry import NO_DRAFT
from verispec.errors import ConstraintError, VerispecError
from verispec.serve import protocol as wire
from verispec.serve.protocol import APIError, ChatRequest, CompletionRequest, GenerationRequest
from verispec.serve.tools import call_grammar, has_tool_syntax, markers


class RequestBuilder:
    """Checks requests against the server's limits and turns them into sequences of `decoder.engine`."""

    def __init__(self, decoder: SpeculativeDecoder, config: ServeConfig, model_name: str) -> None:
        self.decoder, self.config, self.model_name = decoder, config, model_name
        self.engine = decoder.engine
        window = self.engine.context_window
        self.context_window = window
        self.max_prompt = min(config.max_prompt_tokens or window - 1, window - 1)
        self.max_request = min(config.max_request_tokens or window, window)
        self.drafter_name = wire.public_drafter_name(decoder.draft_name)
        self.drafter_names = {decoder.draft_name, self.drafter_name} | (
            {decoder.drafter.name} if not decoder.drafter.traits.plain else set())
        self._longest_token: int | None = None

    # --- sizes -----------------------------------------------------------------------------------------
    def longest_token(self) -> int:
        """Characters of the longest token text (so a prompt of more than max_prompt times this many characters has
        too many tokens, without tokenizing it); 0 where the vocabulary cannot be read."""
        if self._longest_token is None:
            try:
                vocab = self.decoder.target.tokenizer.get_vocab()
                self._longest_token = max((len(t) for t in vocab), default=0)
            except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: no early check
                self._longest_token = 0
        return self._longest_token

    def check_chars(self, chars: int, param: str) -> None:
        """Refuse text that has more characters than the longest prompt could, before tokenizing it."""
        longest = self.longest_token()
        if longest and chars > self.max_prompt * longest:
            raise APIError(400, f"the prompt has {chars} characters, more than {self.max_prompt} tokens could hold; "
                           f"this server accepts at most {self.max_prompt} tokens", param=param,
                           code="context_length_exceeded")

    def check_model(self, model: str | None) -> None:
        """A request that names a model names this server's (404 otherwise)."""
        if model is not None and model not in (self.model_name, self.decoder.target.name):
            raise APIError(404, f"model '{model}' is not served here; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def tokenize(self, text: str, special: bool = True, param: str = "prompt") -> list[int]:
        """A text's token ids (`special`: with the tokenizer's own special tokens, as a completion prompt gets them),
        its size checked first; `param` names the field in a refusal."""
        self.check_chars(len(text), param)
        try:
            return list(self.decoder.target.tokenizer(text, add_special_tokens=special)["input_ids"])
        except Exception as err:  # the tokenizer's own failures (e.g. a lone surrogate)
            raise APIError(400, f"the {param} cannot be tokenized: {type(err).__name__}", param=param) from None

    # --- prompts -------------------------------------------------------------------------------------
    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (send several requests: the server batches them)",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            self.check_chars(len(prompt), "prompt")
            try:
                return self.decoder.encode(prompt, chat=False)
            except VerispecError as err:
                raise APIError(400, str(err), param="prompt") from None
            except Exception as err:  # the tokenizer's own failures (e.g. a lone surrogate)
                raise APIError(400, f"the prompt cannot be tokenized: {type(err).__name__}", param="prompt") from None
        return list(prompt)

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        if not self.decoder.has_chat_template:
            raise APIError(400, f"model '{self.model_name}' has no chat template; use /v1/completions", param="messages")
        tok = self.decoder.target.tokenizer
        messages = [m.template_dict() for m in body.messages]
        tools = body.tool_dicts() if isinstance(body, ChatRequest) else None
        self.check_chars(sum(len(m["content"]) for m in messages) + len(json.dumps(tools or [])), "messages")
        try:
            text = chat_text(tok, messages, tools)
        except Exception as err:  # the template's own checks (e.g. role order) fail with its own errors
            raise APIError(400, f"the chat template rejected the messages: {err}", param="messages") from None
        try:
            return chat_text_ids(tok, text)
        except Exception as err:
            raise APIError(400, f"the messages cannot be tokenized: {type(err).__name__}", param="messages") from None

    def prediction(self, body: GenerationRequest) -> list[int] | None:
        """The request's predicted output as token ids (no special tokens), checked like a prompt: at most as many
        characters, then tokens, as a prompt may have; None without one (or with empty content)."""
        if body.prediction is None:
            return None
        text = body.prediction.text()
        if not text:
            return None
        ids = self.tokenize(text, special=False, param="prediction")
        if len(ids) > self.max_prompt:
            raise APIError(400, f"the prediction has {len(ids)} tokens; this server accepts at most {self.max_prompt}",
                           param="prediction")
        return ids

    def prediction_depth(self) -> int:
        """The longest chain a prediction drafts in one step here (SpecConfig's, within the server's K limit)."""
        return min(SpecConfig().prediction_depth, self.config.max_draft_tokens)

    # --- the sequence --------------------------------------------------------------------------------
    def check(self, body: GenerationRequest, max_tokens: int | None) -> None:
        """The checks a request's fields allow alone (no prompt read, nothing compiled): cheap, on the event loop."""
        config = self.config
        self.check_model(body.model)
        if not 1 <= body.n <= config.max_n:
            raise APIError(400, f"n may be from 1 to {config.max_n}", param="n")
        stops = body.stop_strings()
        if len(stops) > config.max_stop_strings:
            raise APIError(400, f"at most {config.max_stop_strings} stop strings, got {len(stops)}", param="stop")
        if any(len(s) > config.max_stop_length for s in stops):
            raise APIError(400, f"a stop string may be at most {config.max_stop_length} characters", param="stop")
        spec_options = body.speculative or wire.SpeculativeOptions()
        self._tree(spec_options, self._drafting(spec_options))
        if spec_options.K is not None and spec_options.K > config.max_draft_tokens:
            raise APIError(400, f"speculative.K may be at most {config.max_draft_tokens}", param="speculative.K")
        if max_tokens is not None and config.max_tokens_limit is not None and max_tokens > config.max_tokens_limit:
            raise APIError(400, f"max_tokens may be at most {config.max_tokens_limit}", param="max_tokens")
        if body.response_format is not None:
            body.response_format.constraint()  # a missing or misplaced part is a 400 now
        body.sampling_fields(self.engine.target.vocab_size)  # logit_bias's ids and values are checked now
        if body.top_logprobs_asked() is not None and getattr(body, "echo", False) and body.logprobs_mode == "processed":
            raise APIError(400, "the prompt's log-probabilities (echo with logprobs) are raw: logprobs_mode 'processed' "
                           "applies to generated tokens only", param="logprobs_mode")
        if body.logprobs_mode is not None and body.top_logprobs_asked() is None:
            raise APIError(400, "logprobs_mode needs logprobs", param="logprobs_mode")
        if isinstance(body, ChatRequest):
            self._check_tools(body)

    def sequence(self, body: GenerationRequest, prompt: list[int], max_tokens: int | None, tenant: str = "",
                 prediction: list[int] | None = None) -> Sequence:
        """The request's (first) Sequence: see `sequences`."""
        return self.sequences(body, prompt, max_tokens, tenant, prediction)[0]

    def sequences(self, body: GenerationRequest, prompt: list[int], max_tokens: int | None, tenant: str = "",
                  prediction: list[int] | None = None) -> list[Sequence]:
        """The request's sequences, one per choice (`n`; choice i seeded `seed + i`), after `check`: their lengths
        checked, their constraint compiled (once per content: `Grammars.compile`), their tenant's scope set where the
        server keeps keys' outputs apart. (It runs `check` again: microseconds, and a caller that skipped it gets the
        same answers.)"""
        self.check(body, max_tokens)
        stops = body.stop_strings()
        spec_options = body.speculative or wire.SpeculativeOptions()
        drafting = self._drafting(spec_options)
        tree = self._tree(spec_options, drafting)
        self._check_length(len(prompt), max_tokens)
        spec_fields = {"stop": stops, "stop_at_eos": not body.ignore_eos, "prediction_depth": self.prediction_depth(),
                       "logprobs": body.top_logprobs_asked(), "logprobs_mode": body.logprobs_mode or "raw",
                       "prompt_logprobs": bool(getattr(body, "echo", False)) and body.top_logprobs_asked() is not None}
        if max_tokens is not None:
            spec_fields["max_new_tokens"] = max_tokens
        if spec_options.K is not None:
            spec_fields["num_draft_tokens"] = spec_options.K
        if spec_options.draft_stop is not None:
            spec_fields["draft_stop"] = spec_options.draft_stop
        if tree is not None:
            spec_fields["tree"] = tree
        constraint, constraint_param = self.constraint(body)
        try:
            sampling = SamplingConfig(**body.sampling_fields(self.engine.target.vocab_size), constraint=constraint)
            spec = SpecConfig(**spec_fields)
            # the server's tuner (ServeConfig.auto_k) sizes a request's drafts unless it names K or a tree (a seeded
            # sampled request's draws follow K: naming K is how it gets the same tokens alone or batched)
            seeds = [None if body.seed is None else (body.seed + i) % 2**64 for i in range(body.n)]
            seqs = self.engine.make_sequences([prompt] * body.n, sampling, spec, seeds, drafting=drafting,
                                              tuned=spec_options.K is None and tree is None,
                                              scope=tenant if self.config.scope_by_key else None,
                                              predictions=[prediction] * body.n)
        except ConstraintError as err:
            raise APIError(400, f"the tools' schemas: {err}" if constraint_param == "tools" else str(err),
                           param=constraint_param) from None
        except VerispecError as err:
            field = str(err).split(" ", 1)[0]
            if constraint is not None and ("constraint" in str(err) or "schema" in str(err)):
                field = constraint_param
            raise APIError(400, str(err), param=field if field in GenerationRequest.model_fields else None) from None
        return seqs

    def _check_tools(self, body: ChatRequest) -> None:
        """Tools need a template with a tool-call syntax; a tool_choice needs tools, a named one one of them; a
        required call is a constraint of its own, so not beside a response_format."""
        if body.tool_choice is not None and not body.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if not body.tools:
            return
        if not has_tool_syntax(self.decoder.target.tokenizer):
            raise APIError(400, f"model '{self.model_name}' has no tool-call syntax verispec reads in its chat template "
                           "(Hermes <tool_call> blocks)", param="tools")
        names = [t.function.name for t in body.tools]
        if len(set(names)) != len(names):
            raise APIError(400, "tools have the same name twice", param="tools")
        required = body.required_call()
        if required is not None and required[1] is not None and required[1] not in names:
            raise APIError(400, f"tool_choice names '{required[1]}', which is not among the tools", param="tool_choice")
        if required is not None and body.response_format is not None and body.response_format.type != "text":
            raise APIError(400, "a required tool call and a response_format cannot both constrain the answer",
                           param="tool_choice")

    def constraint(self, body: GenerationRequest) -> tuple[Constraint | None, str]:
        """What the answer is constrained to, and the field a refusal of it points at: a required tool call (its tools'
        schemas, "tools"), else the response_format ("response_format"), else with tools and tool_choice "auto" the
        calls the answer opens after its free text (their tools' schemas, "tools"). Decided here only."""
        required = body.required_call() if isinstance(body, ChatRequest) else None
        if required is not None:
            parallel, name = required
            marks = markers(self.decoder.target.tokenizer)
            return Constraint("grammar", call_grammar(body.tool_dicts(), name, parallel, marks)), "tools"
        constraint = body.response_format.constraint() if body.response_format is not None else None
        if constraint is None and isinstance(body, ChatRequest) and body.calls_parsed():
            # "auto": free text, then the calls the answer opens, each valid against its tool's parameters
            marks = markers(self.decoder.target.tokenizer)
            return Constraint("grammar", call_grammar(body.tool_dicts(), None, body.parallel_tool_calls, marks,
                                                      text_first=True)), "tools"
        return constraint, "response_format"

    def _drafting(self, options: wire.SpeculativeOptions) -> bool:
        if options.drafter is None:
            return not self.decoder.drafter.traits.plain
        if options.drafter in NO_DRAFT:
            return False
        if options.drafter not in self.drafter_names:
            raise APIError(400, f"this server drafts with '{self.drafter_name}'; speculative.drafter may be "
                           f"'{self.drafter_name}' or 'none'", param="speculative.drafter")
        return not self.decoder.drafter.traits.plain

    def _tree(self, options: wire.SpeculativeOptions, drafting: bool):
        tree = wire.tree_config(options.tree)
        if tree is None:
            return None
        config = self.config
        try:
            self.engine.check_tree_request(tree, drafting)
        except VerispecError as err:
            raise APIError(400, str(err), param="speculative.tree") from None
        depth = tree.depth(options.K or SpecConfig().num_draft_tokens)
        if tree.size_upper_bound(depth) > config.max_tree_nodes or depth > config.max_draft_tokens:
            raise APIError(400, f"speculative.tree may have at most {config.max_tree_nodes} nodes and depth "
                           f"{config.max_draft_tokens}", param="speculative.tree")
        return tree

    def worst_case_tokens(self, body: GenerationRequest, prompt: int, max_tokens: int | None) -> int:
        """Positions the request may hold at once: its prompt, max_tokens and one step's drafts (a tree's upper bound),
        as the scheduler reserves them (checked against the budget and the key's share before compiling anything)."""
        self._check_length(prompt, max_tokens)
        options = body.speculative or wire.SpeculativeOptions()
        k = options.K or SpecConfig().num_draft_tokens
        tree = wire.tree_config(options.tree)
        drafts = tree.size_upper_bound(tree.depth(k)) if tree is not None else k
        if body.prediction is not None:  # a prediction's chain may be longer than the drafter's
            drafts = max(drafts, self.prediction_depth())
        new = max_tokens if max_tokens is not None else min(SpecConfig().max_new_tokens, self.context_window - prompt)
        return prompt + new + drafts + 1

    def _check_length(self, prompt: int, max_tokens: int | None) -> None:
        config = self.config
        if prompt > self.max_prompt:
            raise APIError(400, f"the prompt has {prompt} tokens; this server accepts at most {self.max_prompt}",
                           param="prompt", code="context_length_exceeded")
        if max_tokens is not None and config.max_tokens_limit is not None and max_tokens > config.max_tokens_limit:
            raise APIError(400, f"max_tokens may be at most {config.max_tokens_limit}", param="max_tokens")
        new = max_tokens if max_tokens is not None else min(SpecConfig().max_new_tokens, self.context_window - prompt)
        if prompt + new > self.context_window:
            raise APIError(400, f"the prompt ({prompt} tokens) plus max_tokens ({new}) exceeds the context window of "
                           f"{self.context_window} tokens", param="max_tokens", code="context_length_exceeded")
        if prompt + new > self.max_request:
            raise APIError(400, f"the prompt ({prompt} tokens) plus max_tokens ({new}) exceeds this server's limit of "
                           f"{self.max_request} tokens per request", param="max_tokens", code="context_length_exceeded")
