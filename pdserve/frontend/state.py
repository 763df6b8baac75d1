"""The server's state between requests: the engine client, the input processor, admission.

`ServerState` is what every route reads: which model is served, how prompts become token ids
(`InputProcessor`), the engine (`EngineClient`) and the count of requests waiting for their first
token, which `--max-waiting-requests` bounds (`admit`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from pdserve.config import DisaggConfig, EngineArgs, ModelConfig, ServerConfig, worker_specs
from pdserve.frontend import openai_format as fmt
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

    # ---- input ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.engine_args.model):
            raise APIError(
                404,
                f"model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def admit(self, num_requests: int) -> Admission:
        """Reserve room for requests in the waiting queue, or raise 503."""
        if not self.client.healthy:
            raise APIError(503, f"engine unavailable: {self.client.dead_reason}")
        limit = self.config.max_waiting_requests
        if limit is not None and self.num_unstarted >= limit:
            raise APIError(
                503,
                f"server overloaded: {self.num_unstarted} requests waiting "
                f"(--max-waiting-requests {limit}); retry later",
                code="overloaded",
            )
        return Admission(self, num_requests)

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
                    admission.started_one()
                yield out
        except RequestRejected as e:
            if e.code == "queue_timeout":
                raise APIError(503, f"request not served: {e}", code="queue_timeout") from None
            raise APIError(400, str(e), param=e.param, code=e.code) from None
        except EngineDeadError as e:
            raise APIError(503, f"engine unavailable: {e}") from None


class Admission:
    """Requests counted as waiting from admission until their first token (or their end)."""

    def __init__(self, state: ServerState, num_requests: int) -> None:
        self.state, self.remaining = state, num_requests
        state.num_unstarted += num_requests

    def started_one(self) -> None:
        if self.remaining > 0:
            self.remaining -= 1
            self.state.num_unstarted -= 1

    def close(self) -> None:
        self.state.num_unstarted -= self.remaining
        self.remaining = 0


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
