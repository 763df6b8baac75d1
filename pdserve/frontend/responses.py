"""The choices of a response, whole or as stream chunks, for each OpenAI endpoint.

A responder is made per request. `final(i, out)` gives the choices of prompt `i`'s finished
output; `chunk(i, out)` the stream choices of one step's new output (none when there is nothing
to send). Completions add echo (the prompt in front of the text, and its logprobs in front of
the output's), chat adds tool calls (`pdserve.frontend.tools`).
"""

from __future__ import annotations

from pdserve.frontend import openai_format as fmt
from pdserve.frontend import tools
from pdserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.types import CompletionOutput, RequestOutput


class CompletionResponder:
    kind = "text_completion"
    chunk_kind = "text_completion"

    def __init__(self, body: CompletionRequest, n: int, text_of: fmt.TokenText, tokenizer):
        self.body, self.n, self.text_of, self.tokenizer = body, n, text_of, tokenizer
        self.started: set[int] = set()  # choices whose first chunk went out

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    def _logprobs(self, out: RequestOutput, lps, echo_prompt: bool) -> dict | None:
        if self.body.logprobs is None:
            return None
        prompt = None
        if echo_prompt:
            prompt = (
                out.prompt_token_ids,
                out.prompt_logprobs or [None] * len(out.prompt_token_ids),
            )
        if not lps and prompt is None:
            return None
        return fmt.completion_logprobs(lps or [], self.text_of, 0, prompt)

    def _choice(self, i: int, out: RequestOutput, c: CompletionOutput, text: str, lps) -> dict:
        choice = fmt.completion_choice(i * self.n + c.index, c, text, lps)
        if self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = fmt.prompt_logprobs(out.prompt_logprobs, self.text_of)
        return choice

    def final(self, i: int, out: RequestOutput) -> list[dict]:
        echo = self.body.echo
        prefix = self._prompt_text(out) if echo else ""
        return [
            self._choice(i, out, c, prefix + c.text, self._logprobs(out, c.logprobs, echo))
            for c in out.outputs
        ]

    def chunk(self, i: int, out: RequestOutput) -> list[dict]:
        choices = []
        for c in out.outputs:
            index = i * self.n + c.index
            first = index not in self.started
            if not (first or c.new_token_ids or c.new_text or c.finish_reason):
                continue
            self.started.add(index)
            echo = first and self.body.echo
            text = (self._prompt_text(out) if echo else "") + c.new_text
            new_lps = c.logprobs[-len(c.new_token_ids) :] if c.logprobs and c.new_token_ids else []
            lps = self._logprobs(out, new_lps, echo)
            choice = fmt.completion_choice(index, c, text, lps)
            if first and self.body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = fmt.prompt_logprobs(out.prompt_logprobs, self.text_of)
            if text or lps or c.finish_reason or choice.get("prompt_logprobs"):
                choices.append(choice)
        return choices

    def extra(self, outs: list[RequestOutput]) -> dict:
        return {}


class ChatResponder:
    kind = "chat.completion"
    chunk_kind = "chat.completion.chunk"

    def __init__(
        self, body: ChatCompletionRequest, text_of: fmt.TokenText, parser: tools.ToolParser
    ):
        self.body, self.text_of, self.parser = body, text_of, parser
        self.streams: dict[int, tools.ToolStream] = {}

    def _logprobs(self, lps) -> dict | None:
        return fmt.chat_logprobs(lps, self.text_of) if self.body.logprobs and lps else None

    def final(self, i: int, out: RequestOutput) -> list[dict]:
        choices = []
        for c in out.outputs:
            content, calls = tools.split(self.body, self.parser, c.text)
            tool_calls = [call.to_openai() for call in calls] if calls else None
            choices.append(
                fmt.chat_choice(c.index, c, self._logprobs(c.logprobs), content, tool_calls)
            )
        return choices

    def chunk(self, i: int, out: RequestOutput) -> list[dict]:
        choices = []
        for c in out.outputs:
            if not c.new_token_ids and not c.new_text and c.finish_reason is None:
                continue
            stream = self.streams.get(c.index)
            delta = {}
            if stream is None:  # the first chunk of this choice names the role
                stream = self.streams[c.index] = tools.ToolStream(self.body, self.parser)
                delta["role"] = "assistant"
            delta["content"] = stream.feed(c.new_text)
            finish_reason = c.finish_reason
            if c.finish_reason is not None:
                rest, calls = stream.finish()
                delta["content"] += rest
                if calls:
                    delta["tool_calls"] = [call.to_openai(k) for k, call in enumerate(calls)]
                    finish_reason = "tool_calls" if c.finish_reason == "stop" else finish_reason
            new_lps = c.logprobs[-len(c.new_token_ids) :] if c.logprobs and c.new_token_ids else []
            logprobs = self._logprobs(new_lps)
            if delta == {"content": ""} and finish_reason is None and logprobs is None:
                continue  # held back (a tool call may be starting): nothing to say yet
            choices.append(
                {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            )
        return choices

    def extra(self, outs: list[RequestOutput]) -> dict:
        if self.body.prompt_logprobs is None or not outs:
            return {}
        return {"prompt_logprobs": fmt.prompt_logprobs(outs[0].prompt_logprobs, self.text_of)}
