"""The server's state between requests: the engine client, the input processor, admission.

`ServerState` is what every route reads: which model is served, how prompts become token ids
(`InputProcessor`), the engine (`EngineClient`), and admission (`admit`): the count of requests
waiting for their first token, which `--max-waiting-requests` bounds, and the TTFT prediction of
SLO-aware admission (`pdserve.frontend.admission`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from pdserve.config import DisaggConfig, EngineArgs, ModelConfig, ServerConfig, worker_specs
from pdserve.frontend import openai_format as fmt
from pdserve.frontend.admission import TTFTPredictor
from pdserve.frontend.engine_client import (
    EngineClient,
    EngineDeadError,
    RequestRejected,
    WorkerSpec,
)
from pdserve.frontend.errors import APIError
from pdserve.frontend.inputs import InputProcessor
from pdserve.frontend.metrics import ServerMetrics
from pdserve.frontend.tools import PARSERS, parser_for
from pdserve.types import RequestOutput, SamplingParams


class ServerState:
    def __init__(
        self, engine_args: EngineArgs, config: ServerConfig, tokenizer, client: EngineClient
    ) -> None:
        self.engine_args = engine_args
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = config.served_model_name or default_model_name(engine_args.model)
        self.inputs = InputProcessor(
            tokenizer,
            getattr(tokenizer, "name_or_path", None) or engine_args.tokenizer or engine_args.model,
            config.chat_template,
            truncate_left=config.truncate_prompt == "left",
        )
        self.client = client
        self.metrics = client.metrics
        client.set_tokenizer(tokenizer)
        self.text_of = fmt.TokenText(tokenizer)
        if config.tool_call_parser == "auto":
            architecture = ModelConfig.from_pretrained(engine_args.model).architecture
            template = self.inputs.chat_template or getattr(tokenizer, "chat_template", None)
            self.tool_parser = parser_for(architecture, template)
        else:
            self.tool_parser = PARSERS[config.tool_call_parser]
        self.num_unstarted = 0  # requests sent that have produced no token yet
        slo_s = client.deployment.slo.ttft_s if config.slo_admission else None
        self.ttft = TTFTPredictor(slo_s, config.admission_margin)

    def deployment_facts(self) -> dict:
        """The SLO and the engine settings the advisor reads (GET /deployment)."""
        slo = self.client.deployment.slo
        e = self.engine_args
        return {
            "slo": {"ttft_ms": slo.ttft_s * 1e3, "tpot_ms": slo.tpot_s * 1e3},
            "settings": {
                "max_num_batched_tokens": e.max_num_batched_tokens,
                "max_num_seqs": e.max_num_seqs,
                "enable_chunked_prefill": e.enable_chunked_prefill,
            },
        }

    # ---- input ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.engine_args.model):
            raise APIError(
                404,
                f"model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def admit(self, jobs: list[tuple[str, str | None, list[int], SamplingParams]]) -> Admission:
        """Admit a request's jobs (one per prompt: id, text, token ids, params), or raise 503:
        the engine is down, too many requests wait, or the first token would come too late."""
        if not self.client.healthy:
            raise APIError(503, f"engine unavailable: {self.client.dead_reason}")
        limit = self.config.max_waiting_requests
        if limit is not None and self.num_unstarted >= limit:
            self.metrics.rejected.labels("overloaded").inc()
            raise APIError(
                503,
                f"server overloaded: {self.num_unstarted} requests waiting "
                f"(--max-waiting-requests {limit}); retry later",
                code="overloaded",
            )
        params = jobs[0][3]
        rate = self.client.deployment.current_prefill_rate()
        num_tokens = sum(len(ids) for _, _, ids, _ in jobs)
        verdict = self.ttft.check(num_tokens, params.priority, params.deadline_s, rate)
        if not verdict.admit:
            self.metrics.rejected.labels("slo").inc()
            raise APIError(
                503,
                f"server too busy to meet the time to first token: predicted "
                f"{verdict.predicted_s:.2f} s against a target of {verdict.target_s:.2f} s "
                f"({num_tokens} prompt tokens at {rate:.0f} prompt tokens/s behind the queue); "
                "retry later",
                code="ttft_slo_unattainable",
                retry_after=verdict.retry_after_s,
            )
        return Admission(self, jobs)

    # ---- running --------------------------------------------------------------------------
    async def stream(
        self,
        admission: Admission,
        rid: str,
        prompt: str | None,
        ids: list[int],
        params: SamplingParams,
    ) -> AsyncIterator[RequestOutput]:
        started = False
        try:
            async for out in self.client.generate(rid, prompt, ids, params):
                if not started:
                    started = True
                    admission.started(rid)
                yield out
        except RequestRejected as e:
            if e.code == "queue_timeout":
                raise APIError(503, f"request not served: {e}", code="queue_timeout") from None
            raise APIError(400, str(e), param=e.param, code=e.code) from None
        except EngineDeadError as e:
            raise APIError(503, f"engine unavailable: {e}") from None


class Admission:
    """A request's jobs, counted as waiting (and as queued prompt tokens for the TTFT
    prediction) from admission until their first token or their end."""

    def __init__(self, state: ServerState, jobs) -> None:
        self.state = state
        self.waiting = {rid for rid, _, _, _ in jobs}
        state.num_unstarted += len(self.waiting)
        for rid, _, ids, params in jobs:
            state.ttft.add(rid, len(ids), params.priority)

    def started(self, rid: str) -> None:
        if rid in self.waiting:
            self.waiting.discard(rid)
            self.state.num_unstarted -= 1
            self.state.ttft.remove(rid)

    def close(self) -> None:
        for rid in list(self.waiting):
            self.started(rid)


def engine_client(engine_args: EngineArgs, config: ServerConfig, disagg: DisaggConfig):
    specs = [
        WorkerSpec(role, args, cpus, switchable=disagg.switchable)
        for role, args, cpus in worker_specs(engine_args, disagg)
    ]
    return EngineClient(
        specs,
        queue_timeout_s=config.queue_timeout_s,
        disagg=disagg,
        metrics=ServerMetrics(),
    )


def default_model_name(model_path: str) -> str:
    """The id a model is served under by default: its folder's name."""
    return Path(model_path).resolve().name or model_path
