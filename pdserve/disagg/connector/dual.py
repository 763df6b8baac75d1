"""A worker that can take either side of a handoff: its role is the router's to change.

With `--pd-ratio auto` every worker runs this connector: it ships the KV of the requests it
prefills for others (`SendingConnector`) and receives the KV of the requests it decodes for
others (`ReceivingConnector`), both at once if need be. A role switch then moves no state: the
router stops sending the worker work of its old role, the requests it holds finish in place, and
its prefix cache stays where it is.
"""

from __future__ import annotations

from pdserve.disagg.connector.base import CacheFactory, ConnectorReport, KVConnector
from pdserve.disagg.connector.receiver import ReceivingConnector
from pdserve.disagg.connector.sender import SendingConnector
from pdserve.disagg.protocol import PeerEndpoint
from pdserve.request import Request
from pdserve.types import EngineCoreOutput


class DualConnector(KVConnector):
    moves_kv = True

    def __init__(self, sender: SendingConnector, receiver: ReceivingConnector) -> None:
        self.sender, self.receiver = sender, receiver

    @property
    def exposed_s(self) -> float:
        return self.sender.exposed_s

    def kv_cache_factory(self) -> CacheFactory | None:
        return self.receiver.kv_cache_factory()  # where peers can write into it

    def attach(self, core) -> None:
        self.sender.attach(core)
        self.receiver.attach(core)

    def endpoint(self) -> PeerEndpoint:
        return self.receiver.endpoint()

    @property
    def sockets(self) -> tuple:
        return self.receiver.sockets

    def add_peer(self, endpoint: PeerEndpoint) -> None:
        self.sender.add_peer(endpoint)

    def add_request(self, request: Request) -> None:
        self.sender.add_request(request)

    def begin_step(self, plan, block_tables: dict[str, list[int]]) -> None:
        self.sender.begin_step(plan, block_tables)

    def end_step(self, handed_off: list[Request], outputs: list[EngineCoreOutput]) -> None:
        self.sender.end_step(handed_off, outputs)

    def forget(self, request_ids: list[str]) -> None:
        self.sender.forget(request_ids)

    def poll(self, remote) -> tuple[list[EngineCoreOutput], bool]:
        return self.receiver.poll(remote)

    def report(self, remote) -> ConnectorReport:
        sent, received = self.sender.report(remote), self.receiver.report(remote)
        return ConnectorReport(received.reservations, received.kv_received, sent.transfers)

    def dropped(self) -> dict[str, int]:
        return self.receiver.dropped()

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
