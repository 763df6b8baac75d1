"""Response bodies in OpenAI's shapes (completions, chat, streaming chunks, usage, logprobs),
plus pdserve's `timings` extension: per-request phase durations in milliseconds."""

from __future__ import annotations

import time

from pdserve.types import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def timings(m: RequestMetrics | None) -> dict | None:
    """queue, prefill, TTFT, decode, E2E and TPOT of one request, as the frontend saw them."""
    if m is None:
        return None
    return {
        "queue_ms": _ms(m.queue_time),
        "prefill_ms": _ms(m.prefill_time),
        "ttft_ms": _ms(m.ttft),
        "decode_ms": _ms(m.decode_time),
        "e2e_ms": _ms(m.e2e),
        "tpot_ms": _ms(m.tpot),
        "cached_prompt_tokens": m.num_cached_tokens,
        # speculative decoding (0 / null without it): tokens proposed, accepted by the model,
        # the steps that verified them, accepted / proposed, and accepted per verifying step
        "spec_proposed_tokens": m.num_spec_proposed,
        "spec_accepted_tokens": m.num_spec_accepted,
        "spec_steps": m.num_spec_steps,
        "spec_acceptance_rate": m.spec_acceptance_rate,
        "spec_mean_accepted_length": m.spec_mean_accepted_length,
    }


def timing_headers(m: RequestMetrics | None) -> dict[str, str]:
    t = timings(m) or {}
    return {
        f"x-pdserve-{k.removesuffix('_ms').replace('_', '-')}-ms": f"{v:.3f}"
        for k, v in t.items()
        if k.endswith("_ms") and v is not None
    }


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0, truncated: int = 0) -> dict:
    """OpenAI's usage object; `truncated_tokens` (prompt tokens dropped to fit the context, see
    --truncate-prompt) appears only when some were."""
    details = {"cached_tokens": cached}
    if truncated:
        details["truncated_tokens"] = truncated
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }


class TokenText:
    """Token id -> its text piece, for logprobs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        text = self.tokenizer.convert_tokens_to_string([piece])
        # SentencePiece decoders strip a word's leading space when it stands alone; keep it.
        if piece.startswith("\u2581") and not text.startswith(" "):
            text = " " + text
        return text


def completion_logprobs(
    lps: list[Logprob],
    text_of: TokenText,
    offset: int = 0,
    prompt: tuple[list[int], list[Logprob | None]] | None = None,
) -> dict:
    """The completions API's logprobs of the output tokens; with `prompt` (echo: its token ids
    and their logprobs), the prompt's tokens first, the very first one without a logprob."""
    ids = [lp.token_id for lp in lps]
    values: list[float | None] = [lp.logprob for lp in lps]
    tops: list[dict | None] = [{text_of(t): v for t, v in lp.top} for lp in lps]
    if prompt is not None:
        prompt_ids, prompt_lps = prompt
        ids = [*prompt_ids, *ids]
        values = [lp.logprob if lp else None for lp in prompt_lps] + values
        tops = [{text_of(t): v for t, v in lp.top} if lp else None for lp in prompt_lps] + tops
    tokens = [text_of(t) for t in ids]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def prompt_logprobs(lps: list[Logprob | None] | None, text_of: TokenText) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} for
    the token itself and the top alternatives (None for the first token)."""
    if lps is None:
        return None
    out: list[dict | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(t): {"logprob": v, "rank": None, "decoded_token": text_of(t)} for t, v in lp.top
        }
        entry[str(lp.token_id)] = {
            "logprob": lp.logprob,
            "rank": lp.rank,
            "decoded_token": text_of(lp.token_id),
        }
        out.append(entry)
    return out


def chat_logprobs(lps: list[Logprob], text_of: TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]
    }


def completion_choice(index: int, c: CompletionOutput, text: str, logprobs: dict | None) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def chat_choice(
    index: int,
    c: CompletionOutput,
    logprobs: dict | None,
    content: str | None = None,
    tool_calls: list[dict] | None = None,
) -> dict:
    """A chat choice; with tool calls, `content` is the text around them (or None)."""
    message = {"role": "assistant", "content": c.text if tool_calls is None else content}
    finish_reason = c.finish_reason
    if tool_calls:
        message["tool_calls"] = tool_calls
        finish_reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": c.stop_reason,
    }


def envelope(kind: str, request_id: str, model: str, choices: list[dict], **extra) -> dict:
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


def first_metrics(outputs: list[RequestOutput]) -> RequestMetrics | None:
    return outputs[0].outputs[0].metrics if outputs and outputs[0].outputs else None
