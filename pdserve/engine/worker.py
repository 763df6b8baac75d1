"""The engine worker process: one EngineCore stepped in a loop, driven over ZMQ.

Started by the frontend as `python -m pdserve.engine.worker` with its engine arguments as JSON;
it connects to the frontend's sockets (it binds nothing), reports `WorkerInfo` when the model is
loaded, then alternates between draining control messages and stepping. It blocks on its input
socket only when it has no work. A fatal error is reported, then the process exits non-zero.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback

import msgspec
import zmq

from pdserve.config import EngineArgs
from pdserve.ipc.channel import Decoder, Encoder, make_socket
from pdserve.ipc.messages import (
    AddRequest,
    FinishRequests,
    Shutdown,
    StepOutputs,
    StepStatsMsg,
    ToWorker,
    WorkerError,
    WorkerInfo,
    WorkerState,
)
from pdserve.types import EngineCoreOutput

logger = logging.getLogger("pdserve.worker")

IDLE_POLL_MS = 100


class Worker:
    def __init__(
        self, args: EngineArgs, input_addr: str, output_addr: str, role: str, worker_id: int
    ):
        self.args = args
        self.role = role
        self.worker_id = worker_id
        self.ctx = zmq.Context()
        self.out_sock = make_socket(self.ctx, zmq.PUSH, output_addr, bind=False)
        self.in_sock = make_socket(self.ctx, zmq.PULL, input_addr, bind=False)
        self.encode = Encoder()
        self.decode = Decoder(ToWorker)
        self.core = None
        self.running = True

    def send(self, msg) -> None:
        self.out_sock.send(self.encode(msg), copy=False)

    def start(self) -> None:
        from pdserve.engine.core import EngineCore

        self.core = EngineCore(self.args)
        runner = self.core.runner
        self.send(
            WorkerInfo(
                worker_id=self.worker_id,
                role=self.role,
                model=self.args.model,
                max_model_len=self.core.max_model_len,
                vocab_size=self.core.model_config.vocab_size,
                num_kv_blocks=runner.num_blocks,
                block_size=runner.block_size,
                kv_bytes_per_block=runner.kv_bytes_per_block,
                dtype=str(runner.dtype).removeprefix("torch."),
                pid=os.getpid(),
            )
        )

    def handle(self, msg) -> list[EngineCoreOutput]:
        """Apply one control message; returns outputs to report (rejections, aborts)."""
        core = self.core
        if isinstance(msg, AddRequest):
            try:
                req = core.make_request(msg.request_id, msg.prompt_token_ids, msg.params)
                if msg.queue_timeout_s is not None:
                    req.queue_deadline = req.arrival_time + msg.queue_timeout_s
                core.add_request(req)
            except ValueError as e:
                return [EngineCoreOutput(msg.request_id, [], finish_reason="abort", error=str(e))]
        elif isinstance(msg, FinishRequests):
            if msg.reason == "stop":
                core.stop_requests(msg.request_ids)
            else:
                core.abort_requests(msg.request_ids)
        elif isinstance(msg, Shutdown):
            self.running = False
        return []

    def drain(self, timeout_ms: int) -> tuple[list[EngineCoreOutput], bool]:
        """Apply every pending control message; returns their outputs and whether any came."""
        outputs: list[EngineCoreOutput] = []
        got = False
        while self.running and self.in_sock.poll(timeout_ms):
            outputs += self.handle(self.decode(self.in_sock.recv(copy=False).buffer))
            got = True
            timeout_ms = 0
        return outputs, got

    def expire(self) -> list[EngineCoreOutput]:
        return [
            EngineCoreOutput(
                r.request_id,
                [],
                finish_reason="abort",
                error="the request waited in the queue longer than the queue timeout",
            )
            for r in self.core.scheduler.expire_waiting(time.perf_counter())
        ]

    def loop(self) -> None:
        core = self.core
        while self.running:
            outputs, changed = self.drain(0 if core.has_unfinished else IDLE_POLL_MS)
            if not self.running:
                break
            outputs += self.expire()
            steps = []
            if core.has_unfinished:
                prev = core.last_step
                outputs += core.step()
                s = core.last_step
                if s is not None and s is not prev:
                    steps.append(
                        StepStatsMsg(
                            s.phase,
                            s.step_time_s,
                            s.num_prefill_tokens,
                            s.num_decode_seqs,
                            s.mfu,
                            s.mbu,
                        )
                    )
            if outputs or steps or changed:  # the frontend's gauges follow every change
                st = core.scheduler.stats()
                state = WorkerState(
                    st.num_running,
                    st.num_waiting,
                    st.kv_usage,
                    st.num_preemptions,
                    st.prefix_queries,
                    st.prefix_hits,
                )
                self.send(StepOutputs(self.worker_id, outputs, steps, state))

    def close(self) -> None:
        if self.core is not None:
            # End every request: blocks back to the pool before the process goes.
            ids = list(self.core.scheduler.requests)
            self.core.abort_requests(ids)
        self.in_sock.close()
        self.out_sock.close()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="pdserve engine worker (started by the frontend)")
    p.add_argument("--engine-args", required=True, help="EngineArgs as JSON")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    p.add_argument("--worker-id", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s worker{a.worker_id} %(levelname)s %(message)s"
    )
    args = msgspec.json.decode(a.engine_args, type=EngineArgs)
    worker = Worker(args, a.input, a.output, a.role, a.worker_id)
    try:
        worker.start()
        worker.loop()
        return 0
    except Exception as e:  # report, then exit: the frontend fails in-flight requests clearly
        traceback.print_exc()
        worker.send(
            WorkerError(a.worker_id, f"worker {a.worker_id} failed: {type(e).__name__}: {e}")
        )
        return 1
    finally:
        worker.close()


if __name__ == "__main__":
    sys.exit(main())
