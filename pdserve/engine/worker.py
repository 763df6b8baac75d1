"""The engine worker process: one EngineCore stepped in a loop, driven over ZMQ.

Started by the frontend as `python -m pdserve.engine.worker` with its engine arguments as JSON;
it binds its control channel (`--input`), connects to the frontend's output channel, reports
`WorkerInfo` (with where its control channel listens) when the model is loaded, then
alternates between draining control messages and stepping; it blocks on its sockets only when it
has no work. A fatal error is reported, then the process exits non-zero.

The loop is the same for every role: what a role changes is the KV connector the engine is built
with (`pdserve.disagg.connector.make_connector`), whose hooks the step already calls, and the
channel it adds to the loop's poll (a decode worker's KV channel).
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
from pdserve.engine.cpu_placement import parse_cpu_set, run_on
from pdserve.heap import freeze_startup_heap
from pdserve.ipc import sched_slice
from pdserve.ipc.channel import (
    BadFrame,
    Decoder,
    Encoder,
    RuntimeDirs,
    bound_address,
    make_socket,
    secret_from_env,
)
from pdserve.ipc.messages import (
    AddRequest,
    FinishRequests,
    PeerInfo,
    ReleaseKV,
    ResumeLocally,
    SetCPUs,
    Shutdown,
    StepOutputs,
    StepStatsMsg,
    ToWorker,
    WorkerError,
    WorkerInfo,
    WorkerState,
)
from pdserve.types import EngineCoreOutput, KVRole, KVTransportKind, RequestStatus, Role

logger = logging.getLogger("pdserve.worker")

IDLE_POLL_MS = 100
COMPILE_POLL_MS = 2


def rejection(request_id: str, error: ValueError) -> EngineCoreOutput:
    """The output that ends a request this engine refused (the frontend answers 400)."""
    return EngineCoreOutput(
        request_id,
        [],
        finish_reason="abort",
        error=str(error),
        error_code=getattr(error, "code", "invalid_value"),
        error_param=getattr(error, "param", None),
    )


class Worker:
    def __init__(
        self,
        args: EngineArgs,
        input_addr: str,
        output_addr: str,
        role: Role,
        worker_id: int,
        kv_transport: KVTransportKind = KVTransportKind.SHM,
        kv_address: str | None = None,
        key: bytes = b"",
        switchable: bool = False,
    ):
        from pdserve.disagg.connector import make_connector

        self.args = args
        self.role = Role(role)
        self.worker_id = worker_id
        self.connector = make_connector(
            self.role, worker_id, key, KVTransportKind(kv_transport), kv_address, switchable
        )
        self.ctx = zmq.Context()
        self.out_sock = make_socket(self.ctx, zmq.PUSH, output_addr, bind=False)
        self.in_sock = make_socket(self.ctx, zmq.PULL, input_addr, bind=True)
        self.encode = Encoder(key)  # the deployment secret authenticates every channel
        self.decode = Decoder(ToWorker, key)
        self.num_bad_frames = 0
        self.core = None
        self.running = True
        self.orphaned = False  # the frontend died first

    def send(self, msg) -> None:
        self.out_sock.send(self.encode(msg), copy=False)

    # ---- startup -------------------------------------------------------------------------
    def start(self) -> None:
        from pdserve.disagg.connector import layout_of
        from pdserve.engine.core import EngineCore

        self.core = core = EngineCore(self.args, connector=self.connector)
        runner, mc = core.runner, core.model_config
        # The engine lives as long as the process: out of the collector's walks, and the one
        # full collection that takes (~200 ms) done before the frontend counts this worker in.
        freeze_startup_heap()
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
                dtype=str(runner.dtype).removeprefix("torch."),
                pid=os.getpid(),
                layout=layout_of(core),
                kv_endpoint=self.connector.endpoint(),
                input_endpoint=bound_address(self.in_sock),
            )
        )

    # ---- control messages ----------------------------------------------------------------
    def handle(self, msg) -> list[EngineCoreOutput]:
        """Apply one control message; returns outputs to report (rejections)."""
        core = self.core
        if isinstance(msg, AddRequest):
            try:
                req = core.make_request(msg.request_id, msg.prompt_token_ids, msg.params)
                waits = (msg.queue_timeout_s, msg.params.deadline_s)
                if any(w is not None for w in waits):
                    req.queue_deadline = req.arrival_time + min(w for w in waits if w is not None)
                req.kv_role = msg.kv_role
                if msg.kv_role == KVRole.SEND:
                    req.kv_dest = msg.kv_dest
                    self.connector.add_request(req)
                core.add_request(req)
            except ValueError as e:  # InvalidRequest, or a grammar or id the engine refuses
                return [rejection(msg.request_id, e)]
        elif isinstance(msg, FinishRequests):
            status = (
                RequestStatus.FINISHED_STOPPED
                if msg.reason == "stop"
                else RequestStatus.FINISHED_ABORTED
            )
            core.finish_requests(msg.request_ids, status, release_kv=msg.release_kv)
        elif isinstance(msg, ResumeLocally):
            core.scheduler.remote.resume_locally(
                msg.request_id, msg.output_token_ids, msg.release_kv
            )
        elif isinstance(msg, ReleaseKV):
            core.scheduler.remote.release_quarantine(msg.request_ids)
        elif isinstance(msg, PeerInfo):
            self.connector.add_peer(msg.endpoint)
        elif isinstance(msg, SetCPUs):  # between steps: the next one runs on the new set
            try:
                run_on(set(msg.cpus))
            except (ValueError, OSError) as e:  # a CPU this process may not use
                logger.error("cannot run on CPUs %s: %s", msg.cpus, e)
            else:
                logger.info("running on CPUs %s (%d threads)", msg.cpus, len(msg.cpus))
        elif isinstance(msg, Shutdown):
            self.running = False
        return []

    def drain(self, timeout_ms: int) -> tuple[list[EngineCoreOutput], bool]:
        """Apply pending control messages and KV signals; returns outputs and whether any came."""
        outputs: list[EngineCoreOutput] = []
        got = False
        poller = zmq.Poller()
        for sock in (self.in_sock, *self.connector.sockets):
            poller.register(sock, zmq.POLLIN)
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
            outs, changed = self.connector.poll(self.core.scheduler.remote)
            outputs += outs
            got = got or changed
        return outputs, got

    def expire(self) -> list[EngineCoreOutput]:
        return [
            EngineCoreOutput(
                r.request_id,
                [],
                finish_reason="abort",
                error="the request was not scheduled within its queue timeout or deadline",
                error_code="queue_timeout",
            )
            for r in self.core.scheduler.expire_waiting(time.perf_counter())
        ]

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> tuple[list[EngineCoreOutput], list[StepStatsMsg]]:
        core = self.core
        prev = core.last_step
        outputs = core.step()
        s = core.last_step
        if s is prev:  # nothing was computed
            return outputs, []
        msg = StepStatsMsg(
            s.phase, s.step_time_s, s.num_prefill_tokens, s.num_decode_seqs, s.mfu, s.mbu
        )
        return outputs, [msg] * s.num_steps  # a burst: its steps, each as long as their mean

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
            report = self.connector.report(core.scheduler.remote)
            if outputs or steps or changed or report:
                self.send(
                    StepOutputs(
                        self.worker_id,
                        outputs,
                        steps,
                        self._state(),
                        report.reservations,
                        report.kv_received,
                        report.transfers,
                        self.connector.exposed_s,
                    )
                )

    def _state(self) -> WorkerState:
        import torch  # loaded by the engine; not before this process is pinned (`main`)

        sched = self.core.scheduler
        st = sched.stats()
        queued = sched.queued_prefill_tokens()
        return WorkerState(
            st.num_running,
            st.num_waiting + len(sched.remote.waiting),
            st.kv_usage,
            st.num_preemptions,
            st.prefix_queries,
            st.prefix_hits,
            self.core.kv.num_free_blocks(),
            queued,
            self._dropped_frames(),
            None if self.core.kv.tier is None else self.core.kv.tier.state(),
            torch.get_num_threads(),
        )

    def _dropped_frames(self) -> dict[str, int]:
        dropped = self.connector.dropped()
        if self.num_bad_frames:
            dropped["control"] = self.num_bad_frames
        return dropped

    def close(self) -> None:
        if self.core is not None:
            # End every request: blocks back to the pool before the process goes.
            self.core.abort_requests(list(self.core.scheduler.requests))
        self.connector.close()
        self.in_sock.close()
        self.out_sock.close()
        self.ctx.term()
        if self.orphaned:  # nobody else will remove the deployment's sockets and files
            RuntimeDirs.remove_from_env()


def pin_cpus(cpus: str) -> int:
    """Restrict this process to a CPU set ("0", "0-3", "0,2"); returns its size.

    torch (and so its OpenMP runtime) is loaded first: the runtime counts the CPUs it may use
    when it loads, and with more threads than that count its idle threads sleep at once instead
    of spinning briefly, which made every parallel region of a worker that later grows onto a
    parked worker's CPUs (`SetCPUs`) wait for them to wake: 15% slower decode steps."""
    import torch  # noqa: F401

    ids = parse_cpu_set(cpus)
    run_on(ids)
    return len(ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="pdserve engine worker (started by the frontend)")
    p.add_argument("--engine-args", required=True, help="EngineArgs as JSON")
    p.add_argument("--input", required=True, help="where to bind the control channel")
    p.add_argument("--output", required=True)
    p.add_argument(
        "--role", default=Role.BOTH, type=Role, choices=[r for r in Role if r != Role.PARKED]
    )
    p.add_argument("--worker-id", type=int, default=0)
    p.add_argument(
        "--kv-transport",
        default=KVTransportKind.SHM,
        type=KVTransportKind,
        choices=list(KVTransportKind),
    )
    p.add_argument("--kv-address", help="where to bind the KV channel (a worker that receives KV)")
    p.add_argument(
        "--switchable",
        action="store_true",
        help="send and receive KV whatever the role, so the frontend can change it",
    )
    p.add_argument("--cpus", help="CPU set to pin this worker to, e.g. 0 or 2-3")
    a = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s worker{a.worker_id} %(levelname)s %(message)s"
    )
    # started by a frontend whose threads asked for short time slices: the compute threads keep
    # the kernel's default, the message threads ask for their own once they exist (`start`)
    sched_slice.restore_process()
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
        switchable=a.switchable,
    )
    # The frontend coordinates shutdown: a terminal's Ctrl-C reaches the whole process group,
    # so ignore it here; SIGTERM stops the loop cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: setattr(worker, "running", False))
    try:
        worker.start()
        sched_slice.shorten_threads(sched_slice.ZMQ_THREADS)
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
