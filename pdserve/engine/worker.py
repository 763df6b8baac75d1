"""The engine worker process: one EngineCore stepped in a loop, driven over ZMQ.

Started by the frontend as `python -m pdserve.engine.worker` with its engine arguments as JSON;
it connects to the frontend's sockets, reports `WorkerInfo` when the model is loaded, then
alternates between draining control messages and stepping; it blocks on its sockets only when it
has no work. A fatal error is reported, then the process exits non-zero.

Roles change only what the connector does around the same loop:
- `both`: a colocated worker, no connector.
- `prefill`: a `KVSender` ships each layer's KV of "send" requests to their decode worker while
  the step computes; a handed-off request ends here after its first token.
- `decode`: the KV cache lives where prefill workers can reach it (shared memory, or a TCP
  channel); "receive" requests hold blocks until their `KVDone` arrives, then decode on.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from pdserve.config import EngineArgs
from pdserve.ipc.channel import (
    BadFrame,
    Decoder,
    Encoder,
    RuntimeDirs,
    make_socket,
    secret_from_env,
)
from pdserve.ipc.messages import (
    AddRequest,
    FinishRequests,
    KVReceived,
    KVReservation,
    PeerInfo,
    ReleaseKV,
    ResumeLocally,
    Shutdown,
    StepOutputs,
    StepStatsMsg,
    ToWorker,
    TransferStat,
    WorkerError,
    WorkerInfo,
    WorkerState,
)
from pdserve.types import EngineCoreOutput, RequestStatus

logger = logging.getLogger("pdserve.worker")

IDLE_POLL_MS = 100
COMPILE_POLL_MS = 2
# Fault injection for tests: seconds a prefill worker sleeps after each step (a slow prefill).
PREFILL_STEP_DELAY_S = float(os.environ.get("PDSERVE_TEST_PREFILL_STEP_DELAY_S", "0"))


class Worker:
    def __init__(
        self,
        args: EngineArgs,
        input_addr: str,
        output_addr: str,
        role: str,
        worker_id: int,
        kv_transport: str = "shm",
        kv_address: str | None = None,
        key: bytes = b"",
    ):
        self.args = args
        self.key = key  # the deployment secret: authenticates every channel
        self.role = role
        self.worker_id = worker_id
        self.kv_transport = kv_transport
        self.kv_address = kv_address
        self.ctx = zmq.Context()
        self.out_sock = make_socket(self.ctx, zmq.PUSH, output_addr, bind=False)
        self.in_sock = make_socket(self.ctx, zmq.PULL, input_addr, bind=False)
        self.encode = Encoder(key)
        self.decode = Decoder(ToWorker, key)
        self.num_bad_frames = 0
        self.core = None
        self.sender = None  # prefill role
        self.receiver = None  # decode role
        self.running = True
        self.orphaned = False  # the frontend died first
        self.kv_received: list[KVReceived] = []
        self.transfers: list[TransferStat] = []

    def send(self, msg) -> None:
        self.out_sock.send(self.encode(msg), copy=False)

    # ---- startup -------------------------------------------------------------------------
    def start(self) -> None:
        from pdserve.disagg.protocol import KVLayout, model_identity
        from pdserve.engine.core import EngineCore

        shm_paths: list[str] = []
        factory = None
        if self.role == "decode" and self.kv_transport == "shm":
            from pdserve.disagg.connector import shm_cache_factory

            factory = shm_cache_factory(shm_paths)
        self.core = core = EngineCore(self.args, kv_cache_factory=factory)
        runner = core.runner
        dtype = str(runner.dtype).removeprefix("torch.")
        mc = core.model_config
        layout = KVLayout(
            model_identity(mc),
            dtype,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            runner.block_size,
        )
        endpoint = None
        if self.role == "prefill":
            from pdserve.disagg.connector import KVSender

            self.sender = KVSender(
                self.worker_id, runner.kv_caches, runner.block_size, layout, self.key
            )
            runner.add_layer_hook(self.sender.on_layer)
        elif self.role == "decode":
            from pdserve.disagg.connector import KVReceiver

            sched = core.scheduler
            self.receiver = KVReceiver(
                self.worker_id,
                runner.kv_caches,
                self.kv_transport,
                self.kv_address,
                shm_paths[0] if shm_paths else None,
                layout,
                reservation=sched.remote_block_ids,
                key=self.key,
                max_tokens=core.max_model_len,
            )
            endpoint = self.receiver.endpoint()
        self.send(
            WorkerInfo(
                worker_id=self.worker_id,
                role=self.role,
                model=self.args.model,
                max_model_len=core.max_model_len,
                vocab_size=mc.vocab_size,
                num_kv_blocks=runner.num_blocks,
                block_size=runner.block_size,
                kv_bytes_per_block=runner.kv_bytes_per_block,
                dtype=dtype,
                pid=os.getpid(),
                layout=layout,
                kv_endpoint=endpoint,
            )
        )

    # ---- control messages ----------------------------------------------------------------
    def handle(self, msg) -> list[EngineCoreOutput]:
        """Apply one control message; returns outputs to report (rejections)."""
        core = self.core
        sched = core.scheduler
        if isinstance(msg, AddRequest):
            try:
                req = core.make_request(msg.request_id, msg.prompt_token_ids, msg.params)
                if msg.queue_timeout_s is not None:
                    req.queue_deadline = req.arrival_time + msg.queue_timeout_s
                req.kv_role = msg.kv_role
                if msg.kv_role == "send":
                    if self.sender is None:
                        raise ValueError(f"worker {self.worker_id} ({self.role}) cannot send KV")
                    req.kv_dest = msg.kv_dest
                    self.sender.add_request(req.request_id, msg.kv_dest)
                core.add_request(req)
            except ValueError as e:
                return [EngineCoreOutput(msg.request_id, [], finish_reason="abort", error=str(e))]
        elif isinstance(msg, FinishRequests):
            status = (
                RequestStatus.FINISHED_STOPPED
                if msg.reason == "stop"
                else RequestStatus.FINISHED_ABORTED
            )
            core.finish_requests(msg.request_ids, status, release_kv=msg.release_kv)
            if self.sender is not None:
                for rid in msg.request_ids:
                    self.sender.abort(rid)
        elif isinstance(msg, ResumeLocally):
            sched.resume_locally(msg.request_id, msg.output_token_ids, msg.release_kv)
        elif isinstance(msg, ReleaseKV):
            sched.release_quarantine(msg.request_ids)
        elif isinstance(msg, PeerInfo):
            if self.sender is not None:
                self.sender.add_peer(msg.endpoint)
        elif isinstance(msg, Shutdown):
            self.running = False
        return []

    def drain(self, timeout_ms: int) -> tuple[list[EngineCoreOutput], bool]:
        """Apply pending control messages and KV signals; returns outputs and whether any came."""
        outputs: list[EngineCoreOutput] = []
        got = False
        poller = zmq.Poller()
        poller.register(self.in_sock, zmq.POLLIN)
        if self.receiver is not None:
            poller.register(self.receiver.sock, zmq.POLLIN)
        while self.running and poller.poll(timeout_ms):
            timeout_ms = 0
            while self.running and self.in_sock.poll(0):
                frame = self.in_sock.recv(copy=False).buffer
                try:
                    msg = self.decode(frame)
                except BadFrame as e:  # not from this deployment's frontend: never fatal
                    self.num_bad_frames += 1
                    logger.warning("dropped a control frame: %s", e)
                    continue
                outputs += self.handle(msg)
                got = True
            if self.receiver is not None:
                outs, changed = self._poll_kv()
                outputs += outs
                got = got or changed
        return outputs, got

    def _poll_kv(self) -> tuple[list[EngineCoreOutput], bool]:
        sched = self.core.scheduler
        num_dropped = self.receiver.dropped.total()
        done, aborted = self.receiver.poll()
        outputs = []
        vocab = self.core.model_config.vocab_size
        for msg in done:
            if msg.request_id in sched.remote_waiting and 0 <= msg.first_token < vocab:
                out = sched.finish_remote_kv(msg.request_id, msg.first_token)
                self.kv_received.append(KVReceived(msg.request_id, msg.first_token))
                if out is not None:
                    outputs.append(out)
        # The prefill worker gave the request up (it ended there, or the frontend aborted it):
        # it will not write again, so nothing here waits for it.
        sched.finish_requests(
            [m.request_id for m in aborted if m.request_id in sched.remote_waiting],
            RequestStatus.FINISHED_ABORTED,
        )
        sched.release_quarantine([m.request_id for m in done] + [m.request_id for m in aborted])
        return outputs, bool(done or aborted) or self.receiver.dropped.total() != num_dropped

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

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> tuple[list[EngineCoreOutput], list[StepStatsMsg]]:
        core = self.core
        sched = core.scheduler
        if self.sender is not None:
            outputs = core.admit_compiled()
            plan = sched.schedule()
            if plan.is_empty:
                return outputs, []
            self.sender.begin_step(plan, core.kv.req_block_ids)
            outputs += core.execute(plan)
            for req in sched.handed_off:  # flush their KV, then hand them to the decode worker
                res = self.sender.finish(req.request_id, req.output_token_ids[0])
                if res is not None:
                    self.transfers.append(TransferStat(req.request_id, *res))
            sched.handed_off.clear()
            for out in outputs:  # ended on the prefill worker (EOS, stop, length): no handoff
                if out.finish_reason is not None:
                    self.sender.abort(out.request_id)
            if PREFILL_STEP_DELAY_S:
                time.sleep(PREFILL_STEP_DELAY_S)
        else:
            prev = core.last_step
            outputs = core.step()
            if core.last_step is prev:
                return outputs, []
        s = core.last_step
        return outputs, [
            StepStatsMsg(
                s.phase, s.step_time_s, s.num_prefill_tokens, s.num_decode_seqs, s.mfu, s.mbu
            )
        ]

    def loop(self) -> None:
        core = self.core
        parent = os.getppid()
        while self.running:
            if os.getppid() != parent:  # the frontend is gone (even killed): do not linger
                logger.warning("frontend exited; worker %d stops", self.worker_id)
                self.orphaned = True
                break
            busy = core.has_unfinished and (core.scheduler.running or core.scheduler.waiting)
            if busy:
                timeout_ms = 0
            elif core.compiling:  # a grammar is compiling: look again soon
                timeout_ms = COMPILE_POLL_MS
            else:
                core.on_idle()
                timeout_ms = IDLE_POLL_MS
            outputs, changed = self.drain(timeout_ms)
            if not self.running:
                break
            outputs += self.expire()
            steps = []
            if core.has_unfinished:
                outs, steps = self.step()
                outputs += outs
            sched = core.scheduler
            reservations = [
                KVReservation(
                    r.request_id, list(core.kv.block_ids(r.request_id)), r.num_cached_tokens
                )
                for r in sched.new_reservations
            ]
            sched.new_reservations.clear()
            if outputs or steps or changed or reservations or self.kv_received or self.transfers:
                self.send(
                    StepOutputs(
                        self.worker_id,
                        outputs,
                        steps,
                        self._state(),
                        reservations,
                        self.kv_received,
                        self.transfers,
                        self.sender.exposed_s if self.sender is not None else 0.0,
                    )
                )
                self.kv_received, self.transfers = [], []

    def _state(self) -> WorkerState:
        sched = self.core.scheduler
        st = sched.stats()
        queued = sum(
            r.num_tokens - r.num_computed_tokens
            for r in (*sched.waiting, *sched.running)
            if r.num_output_tokens == 0
        )
        return WorkerState(
            st.num_running,
            st.num_waiting + len(sched.remote_waiting),
            st.kv_usage,
            st.num_preemptions,
            st.prefix_queries,
            st.prefix_hits,
            self.core.kv.num_free_blocks(),
            queued,
            self._dropped_frames(),
        )

    def _dropped_frames(self) -> dict[str, int]:
        dropped = dict(self.receiver.dropped) if self.receiver is not None else {}
        if self.num_bad_frames:
            dropped["control"] = self.num_bad_frames
        return dropped

    def close(self) -> None:
        if self.core is not None:
            # End every request: blocks back to the pool before the process goes.
            self.core.abort_requests(list(self.core.scheduler.requests))
        if self.receiver is not None:
            self.receiver.close()
        self.in_sock.close()
        self.out_sock.close()
        self.ctx.term()
        if self.orphaned:  # nobody else will remove the deployment's sockets and files
            RuntimeDirs.remove_from_env()


def pin_cpus(cpus: str) -> int:
    """Restrict this process to a CPU set ("0", "0-3", "0,2"); returns its size."""
    ids: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        ids.update(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, ids)
    return len(ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="pdserve engine worker (started by the frontend)")
    p.add_argument("--engine-args", required=True, help="EngineArgs as JSON")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    p.add_argument("--worker-id", type=int, default=0)
    p.add_argument("--kv-transport", default="shm", choices=["shm", "tcp"])
    p.add_argument("--kv-address", help="decode role: where to bind the KV channel")
    p.add_argument("--cpus", help="CPU set to pin this worker to, e.g. 0 or 2-3")
    a = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s worker{a.worker_id} %(levelname)s %(message)s"
    )
    args = msgspec.json.decode(a.engine_args, type=EngineArgs)
    if a.cpus:  # placed by the user: one thread per CPU of the set, unless told otherwise
        num_cpus = pin_cpus(a.cpus)
        args = dataclasses.replace(args, num_threads=args.num_threads or num_cpus)
    worker = Worker(
        args,
        a.input,
        a.output,
        a.role,
        a.worker_id,
        a.kv_transport,
        a.kv_address,
        key=secret_from_env(),
    )
    # The frontend coordinates shutdown: a terminal's Ctrl-C reaches the whole process group,
    # so ignore it here; SIGTERM stops the loop cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: setattr(worker, "running", False))
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
