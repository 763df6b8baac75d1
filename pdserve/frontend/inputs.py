"""From a request body to the token ids the engine will see: prompts, chat templates, checks.

Tokenization and templates run off the event loop (`PromptTokenizer`). A prompt is checked
against the model before anything is queued: token ids inside the vocabulary, room for at least
one output token in the context, `max_tokens` within what is left. Every failure is an
`APIError(400)` naming the field.

With `--truncate-prompt left`, a prompt that leaves no room for its output is cut instead: its
most recent tokens are kept (after the BOS token, when it starts with one), as many as leave room
for `max_tokens` (or one token) in the context and the KV cache. The methods return how many
tokens were dropped, which the response reports in `usage`.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from pdserve.frontend import tools
from pdserve.frontend.errors import APIError
from pdserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.frontend.tokenize import PromptTokenizer
from pdserve.structured import spec
from pdserve.types import SamplingParams
from pdserve.validation import EngineLimits, InvalidRequest


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        tokenizer_path: str | None,
        chat_template: str | None,
        truncate_left: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.truncate_left = truncate_left
        self.prompt_tokenizer = PromptTokenizer(tokenizer, tokenizer_path)
        self.chat_template = Path(chat_template).read_text() if chat_template else None
        self.limits = EngineLimits(0, 0)  # set once the workers report (`set_model_limits`)
        # Grammars are checked in a thread of their own: an expensive one never holds up
        # tokenization. The llguidance tokenizer is built on first use (~1 s).
        self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
        self._llg_tokenizer = None

    def set_model_limits(self, max_model_len: int, vocab_size: int) -> None:
        self.limits = EngineLimits(max_model_len, vocab_size)

    def close(self) -> None:
        self.prompt_tokenizer.close()
        self._grammar_thread.shutdown(wait=False, cancel_futures=True)

    # ---- completions -------------------------------------------------------------------------
    async def completion_prompts(
        self, prompt, truncate: int | None
    ) -> list[tuple[str | None, list[int], int]]:
        """(text or None, token ids, tokens dropped) of each prompt of a /v1/completions body."""
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompts = [list(prompt)]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "invalid prompt: it is empty", param="prompt")
        out = []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise APIError(400, "invalid prompt: it is empty", param="prompt")
                out.append((p, *await self._encode(p, True, truncate)))
            else:
                out.append((None, list(p), 0))
        return out

    async def _encode(
        self, text: str, add_special_tokens: bool, truncate: int | None
    ) -> tuple[list[int], int]:
        """The ids of `text` (cut to `truncate`, or with --truncate-prompt left to the context)
        and how many were dropped; a 400 when it is too long and may not be cut."""
        max_len = self.limits.max_model_len - 1
        keep = truncate if truncate is not None or not self.truncate_left else max_len
        enc = await self.prompt_tokenizer.encode(text, add_special_tokens, keep, max_len)
        if enc.ids is None:
            raise self._too_long(enc.num_tokens)
        return enc.ids, enc.num_tokens - len(enc.ids)

    # ---- chat ---------------------------------------------------------------------------------
    async def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], int]:
        """The prompt's token ids and how many were dropped."""
        text = await self.prompt_tokenizer.run(self._render_chat, body)
        ids, dropped = await self._encode(text, False, body.truncate_prompt_tokens)
        bos, bos_text = self.tokenizer.bos_token_id, self.tokenizer.bos_token
        if bos is not None and bos_text and not text.startswith(bos_text):
            ids = [bos, *ids]  # the template did not add the BOS the model was trained with
        return ids, dropped

    def _render_chat(self, body: ChatCompletionRequest) -> str:
        try:
            messages = [_template_message(m) for m in body.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        extra = {}
        if body.tools:
            extra["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise APIError(
                400,
                "this model has no chat template; start the server with "
                "--chat-template FILE or use /v1/completions",
                param="messages",
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                **extra,
            )
        except Exception as e:  # a template error is the request's or the template's fault
            raise APIError(400, f"chat template failed: {e}", param="messages") from None

    # ---- structured output -------------------------------------------------------------------
    async def constrain(
        self, body: CompletionRequest | ChatCompletionRequest, params: SamplingParams
    ) -> SamplingParams:
        """`params` with the grammar the body asks for (checked: a 400 if it does not compile)."""
        try:
            found = requested_grammar(body)
            if found is None:
                return params
            field, grammar = found
            await asyncio.get_running_loop().run_in_executor(
                self._grammar_thread, self._check_grammar, grammar, field
            )
        except spec.SpecError as e:
            raise APIError(400, str(e), param=e.field, code="invalid_value") from None
        return msgspec.structs.replace(params, grammar=grammar)

    def _check_grammar(self, grammar: str, field: str) -> None:
        if self._llg_tokenizer is None:
            import llguidance.hf

            self._llg_tokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.limits.vocab_size
            )
        spec.check(grammar, field, self._llg_tokenizer)

    # ---- checks --------------------------------------------------------------------------------
    def check(
        self, ids: list[int], params: SamplingParams, truncate: int | None
    ) -> tuple[list[int], int]:
        """The prompt the engine gets (cut to `truncate` tokens, or with --truncate-prompt left
        to what leaves room for the output) and how many tokens were cut here; a 400 saying why
        not."""
        num_given = len(ids)
        if truncate is not None:
            ids = ids[-truncate:]
        if self.truncate_left:
            ids = self._keep_last(ids, self._room_for_prompt(params.max_tokens))
        try:
            self.limits.check(ids, params.max_tokens)
        except InvalidRequest as e:
            raise APIError(400, str(e), param=e.param, code=e.code) from None
        return ids, num_given - len(ids)

    def _room_for_prompt(self, max_tokens: int | None) -> int:
        limits = self.limits
        room = limits.max_model_len
        if limits.kv_capacity is not None:
            room = min(room, limits.kv_capacity)
        return room - max(max_tokens or 1, 1)

    def _keep_last(self, ids: list[int], keep: int) -> list[int]:
        """The last `keep` ids (at least one), after the BOS token when the prompt starts with
        it."""
        if len(ids) <= keep:
            return ids
        keep = max(keep, 1)
        bos = self.tokenizer.bos_token_id
        if bos is not None and ids and ids[0] == bos and keep > 1:
            return [bos, *ids[len(ids) - keep + 1 :]]
        return ids[len(ids) - keep :]

    def _too_long(self, num_tokens: int) -> APIError:
        e = self.limits.too_long(num_tokens)
        return APIError(400, str(e), param=e.param, code=e.code)


def _template_message(message) -> dict:
    """A chat message as templates expect it: text content, and tool calls with their
    arguments as objects (OpenAI sends them as JSON text)."""
    out = {"role": message.role, "content": message.text(), **(message.model_extra or {})}
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_with_object_arguments(c) for c in calls]
    return out


def _with_object_arguments(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def requested_grammar(body) -> tuple[str, str] | None:
    """(field, grammar) of the one output constraint a body asks for, or None."""
    found = []
    response_format = spec.response_format_grammar(body.response_format)
    if response_format is not None:
        found.append(("response_format", response_format))
    if body.guided_json is not None:
        found.append(("guided_json", spec.json_schema_grammar(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        found.append(("guided_regex", spec.regex_grammar(body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", spec.choice_grammar(body.guided_choice)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", spec.lark_grammar(body.guided_grammar)))
    if isinstance(body, ChatCompletionRequest):
        forced = tools.forced_grammar(body)
        if forced is not None:
            found.append(("tool_choice", forced))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise spec.SpecError(found[1][0], f"one output constraint per request (got {names})")
    return found[0] if found else None
