"""The OpenAI-compatible HTTP frontend (FastAPI). `build_app` wires routes to an EngineClient.

The event loop never waits on a model step: engine workers run in their own processes and their
outputs arrive on a ZMQ socket read by a background task. Tokenization (prompts, chat templates)
and detokenization happen here, in the frontend, so the workers spend their time on steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

import pdserve
from pdserve.config import DisaggConfig, EngineArgs, ModelConfig, ServerConfig
from pdserve.frontend import openai_format as fmt
from pdserve.frontend.dashboard import Timeline
from pdserve.frontend.dashboard import add_routes as add_dashboard_routes
from pdserve.frontend.errors import (
    APIError,
    SafeJSONResponse,
    api_error_handler,
    error_body,
    from_value_error,
    http_error_handler,
    internal_error_handler,
    validation_handler,
)
from pdserve.frontend.guard import GuardMiddleware
from pdserve.frontend.limits import check_request
from pdserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.frontend.responses import ChatResponder, CompletionResponder
from pdserve.frontend.state import Admission, ServerState, engine_client
from pdserve.types import RequestOutput, SamplingParams

logger = logging.getLogger("pdserve.frontend")


def _sampling_params(body) -> SamplingParams:
    for name in ("suffix",):
        if getattr(body, name, None):
            raise APIError(400, f"'{name}' is not supported", param=name)
    if getattr(body, "logit_bias", None):
        raise APIError(400, "'logit_bias' is not supported", param="logit_bias")
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != body.n:
        raise APIError(400, "'best_of' other than n is not supported", param="best_of")
    try:
        return body.to_sampling_params()
    except ValueError as e:
        raise from_value_error(e) from None


async def _until_disconnect(request: Request, coro):
    """Run `coro`; if the client goes away first, cancel it (its requests are then aborted)."""
    task = asyncio.ensure_future(coro)
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.05)
            if not done and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, APIError):
                    await task
                return None
        return task.result()
    finally:
        if not task.done():
            task.cancel()


async def _collect(state: ServerState, adm: Admission, jobs) -> list[RequestOutput]:
    async def last(agen) -> RequestOutput:
        final = None
        async for out in agen:
            final = out
        return final

    tasks = [asyncio.ensure_future(last(state.stream(adm, *job))) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _merged(
    state: ServerState, adm: Admission, jobs
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, job) -> None:
        try:
            async for out in state.stream(adm, *job):
                await queue.put((i, out))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def build_app(
    engine_args: EngineArgs,
    config: ServerConfig,
    tokenizer=None,
    disagg: DisaggConfig | None = None,
) -> FastAPI:
    ModelConfig.from_pretrained(engine_args.model)  # a missing or bad folder: say so first
    client = engine_client(engine_args, config, disagg or DisaggConfig())
    client.spawn()  # the workers import torch and load the model while the tokenizer loads here
    try:
        if tokenizer is None:
            from pdserve.frontend.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(engine_args.tokenizer or engine_args.model)
        state = ServerState(engine_args, config, tokenizer, client)
        state.timeline = Timeline(state.metrics.registry)
    except BaseException:
        client.kill()
        raise

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.client.start()
        state.inputs.set_model_limits(state.client.info.max_model_len, state.client.info.vocab_size)
        for w in state.client.workers:
            state.metrics.set_worker_up(w, True)
        sampler = asyncio.create_task(state.timeline.run(), name="pdserve-dashboard")
        try:
            yield
        finally:
            sampler.cancel()
            await state.client.shutdown()
            state.inputs.close()

    app = FastAPI(
        title="pdserve",
        version=pdserve.__version__,
        lifespan=lifespan,
        default_response_class=SafeJSONResponse,
    )
    app.state.pdserve = state
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)

    app.add_middleware(
        GuardMiddleware,
        api_key=config.api_key,
        max_body_bytes=config.max_body_bytes,
        public_metrics=config.public_metrics,
    )

    @app.get("/health")
    async def health():
        client = state.client
        workers = [{"id": w.worker_id, "role": w.role, "alive": w.alive} for w in client.workers]
        if not client.healthy:
            return SafeJSONResponse(
                {**error_body(503, f"unhealthy: {client.dead_reason}"), "workers": workers},
                status_code=503,
            )
        return {"status": "degraded" if client.degraded else "ok", "workers": workers}

    @app.get("/deployment")
    async def deployment():
        """Workers, their roles, the last role switches with their reasons, the SLO and the
        engine settings (what `pdserve advise` needs to be concrete)."""
        return {**state.client.deployment.report(), **state.deployment_facts()}

    @app.post("/deployment")
    async def set_deployment(request: Request):
        """`{"prefill_workers": P}`: P live workers prefill, the rest decode (0: colocated);
        `{"prefill_workers": 0, "merge": true}` (`--pd-merge`): one worker on every worker's
        CPUs, the others parked."""
        try:
            body = json.loads(await request.body())
            p = body["prefill_workers"]
            if type(p) is not int:
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise APIError(
                400,
                "expected a JSON object with an integer prefill_workers",
                param="prefill_workers",
            ) from None
        merge = body.get("merge", False)
        if type(merge) is not bool:
            raise APIError(400, "merge must be true or false", param="merge")
        try:
            return state.client.deployment.set_split(p, merge=merge)
        except ValueError as e:
            param = "merge" if merge else "prefill_workers"
            raise APIError(400, str(e), param=param) from None

    add_dashboard_routes(app, state)

    @app.get("/version")
    async def version():
        return {"version": pdserve.__version__}

    @app.get("/metrics")
    async def metrics():
        for w in state.client.workers:
            state.metrics.set_worker_up(w, w.alive)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        info = state.client.info
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pdserve",
                    "root": engine_args.model,
                    "max_model_len": info.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_request(body, await request.body(), config.limits)
        state.check_model(body.model)
        params = await state.inputs.constrain(body, _sampling_params(body))
        prompts = await state.inputs.completion_prompts(body.prompt, body.truncate_prompt_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs, truncated = [], 0
        for i, (text, ids, dropped) in enumerate(prompts):
            ids, cut = state.inputs.check(ids, params, body.truncate_prompt_tokens)
            jobs.append((f"{rid}-{i}", text, ids, params))
            truncated += dropped + cut
        responder = CompletionResponder(body, params.n, state.text_of, state.tokenizer)
        return await _run(state, request, rid, jobs, body, responder, truncated)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_request(body, await request.body(), config.limits)
        state.check_model(body.model)
        params = await state.inputs.constrain(body, _sampling_params(body))
        ids, dropped = await state.inputs.chat_prompt(body)
        ids, cut = state.inputs.check(ids, params, body.truncate_prompt_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        responder = ChatResponder(body, state.text_of, state.tool_parser)
        jobs = [(rid, None, ids, params)]
        return await _run(state, request, rid, jobs, body, responder, dropped + cut)

    return app


async def _run(
    state: ServerState, request: Request, rid: str, jobs, body, responder, truncated: int
) -> Response:
    """Admit the jobs, then stream them, or wait for all of them and answer. `truncated`: the
    prompt tokens dropped to fit the context (reported in `usage`)."""
    adm = state.admit(jobs)
    if body.stream:
        return _stream_response(state, adm, rid, jobs, body, responder, truncated)
    try:
        outs = await _until_disconnect(request, _collect(state, adm, jobs))
    finally:
        adm.close()
    if outs is None:  # the client left
        return Response(status_code=499)
    choices = [choice for i, out in enumerate(outs) for choice in responder.final(i, out)]
    n_out = sum(len(c.token_ids) for out in outs for c in out.outputs)
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.metrics.num_cached_tokens for o in outs if o.metrics)
    m = fmt.first_metrics(outs)
    response = fmt.envelope(
        responder.kind,
        rid,
        state.model_name,
        choices,
        usage=fmt.usage(n_prompt, n_out, cached, truncated),
        timings=fmt.timings(m),
        **responder.extra(outs),
    )
    return SafeJSONResponse(response, headers=fmt.timing_headers(m))


def _stream_response(
    state: ServerState, adm: Admission, rid: str, jobs, body, responder, truncated: int
) -> StreamingResponse:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        n_prompt = sum(len(j[2]) for j in jobs)
        n_out = 0
        last: RequestOutput | None = None
        cached: dict[int, int] = {}  # per prompt: tokens served from the prefix cache
        try:
            async for i, out in _merged(state, adm, jobs):
                last = out
                if out.metrics is not None:
                    cached[i] = out.metrics.num_cached_tokens
                n_out += sum(len(c.new_token_ids) for c in out.outputs)
                choices = responder.chunk(i, out)
                if choices:
                    chunk = fmt.envelope(responder.chunk_kind, rid, state.model_name, choices)
                    if out.finished:
                        chunk.update(responder.extra([out]))
                    yield _sse(chunk)
            if include_usage:  # the usage chunk also carries the phase timings
                yield _sse(
                    fmt.envelope(
                        responder.chunk_kind,
                        rid,
                        state.model_name,
                        [],
                        usage=fmt.usage(n_prompt, n_out, sum(cached.values()), truncated),
                        timings=fmt.timings(last.metrics if last else None),
                    )
                )
        except APIError as e:
            yield _sse(error_body(e.status, e.message, e.param, e.code))
        except Exception as e:  # a bug: the client still gets an error event and the end
            logger.exception("stream %s failed", rid)
            yield _sse(error_body(500, f"internal error: {type(e).__name__}"))
        yield "data: [DONE]\n\n"

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events():
                yield event
        finally:
            adm.close()

    return StreamingResponse(
        guarded(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
        background=BackgroundTask(adm.close),  # in case the body is never iterated
    )
