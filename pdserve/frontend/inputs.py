"""From a request body to the token ids the engine will see: prompts, chat templates, checks.

Tokenization and templates run off the event loop (`PromptTokenizer`). A prompt is checked
against the model before anything is queued: token ids inside the vocabulary, room for at least
one output token in the context, `max_tokens` within what is left. Every failure is an
`APIError(400)` naming the field.
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
    def __init__(self, tokenizer, tokenizer_path: str | None, chat_template: str | None) -> None:
        self.tokenizer = tokenizer
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
    ) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) of each prompt of a /v1/completions body."""
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
                out.append((p, await self._encode(p, True, truncate)))
            else:
                out.append((None, list(p)))
        return out

    async def _encode(self, text: str, add_special_tokens: bool, truncate: int | None) -> list[int]:
        enc = await self.prompt_tokenizer.encode(
            text, add_special_tokens, truncate, self.limits.max_model_len - 1
        )
        if enc.ids is None:
            raise self._too_long(enc.num_tokens)
        return enc.ids

    # ---- chat ---------------------------------------------------------------------------------
    async def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        text = await self.prompt_tokenizer.run(self._render_chat, body)
        ids = await self._encode(text, False, body.truncate_prompt_tokens)
        bos, bos_text = self.tokenizer.bos_token_id, self.tokenizer.bos_token
        if bos is not None and bos_text and not text.startswith(bos_text):
            ids = [bos, *ids]  # the template did not add the BOS the model was trained with
        return ids

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
    def check(self, ids: list[int], params: SamplingParams, truncate: int | None) -> list[int]:
        """The prompt the engine gets (cut to `truncate` tokens), or a 400 saying why not."""
        if truncate is not None:
            ids = ids[-truncate:]
        try:
            self.limits.check(ids, params.max_tokens)
        except InvalidRequest as e:
            raise APIError(400, str(e), param=e.param, code=e.code) from None
        return ids

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
