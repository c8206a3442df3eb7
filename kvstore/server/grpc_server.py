"""The gRPC server around a store: health, reflection, metrics, graceful shutdown.

Offers ``StoreServer(store, listen, limits, ..., credentials, tenants, local_channel)``
(TLS when ``credentials`` are given; bearer tokens per tenant when ``tenants`` are) with
``start()`` (returns the bound port), ``stop()`` (refuse new calls, finish
in-flight ones, flush and close the store) and ``wait()``. A stop never cuts an
in-flight call short before ``grace_s`` has passed. Where it offers shared memory
(``limits.shm``) and ``local_channel`` is on, it also answers same-host calls on a
Unix socket (``kvstore.server.local_channel``), which ``Routes`` names.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.rpc.pb import SERVICE, pb
from kvstore.server.auth import Tenants
from kvstore.server.local_channel import LocalChannel
from kvstore.server.service import KVStoreService, Limits
from kvstore.server.service_handlers import generic_handler
from kvstore.server.store import TieredStore

log = logging.getLogger(__name__)


class StoreServer:
    def __init__(
        self,
        store: TieredStore,
        listen: str = "127.0.0.1:50051",
        *,
        limits: Limits | None = None,
        max_message_bytes: int = 65 << 20,
        workers: int = 16,
        grace_s: float = 10.0,
        metrics=None,
        credentials: grpc.ServerCredentials | None = None,
        tenants: Tenants | None = None,
        local_channel: bool = True,
    ) -> None:
        self.store = store
        self.listen = listen
        self.grace_s = grace_s
        self._credentials = credentials
        self.service = KVStoreService(store, limits or Limits(), metrics, tenants)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-rpc"),
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        self._server.add_generic_rpc_handlers((generic_handler(self.service),))
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        self.port: int | None = None
        self._local_wanted = local_channel and self.service.limits.shm
        self._local: LocalChannel | None = None
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()

    def start(self) -> int:
        try:
            if self._credentials is not None:
                self.port = self._server.add_secure_port(self.listen, self._credentials)
            else:
                self.port = self._server.add_insecure_port(self.listen)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {self.listen}: {exc}") from exc
        if not self.port and not self.listen.startswith("unix:"):
            raise OSError(f"cannot listen on {self.listen}: address in use or invalid")
        self._server.start()
        if self._local_wanted:
            self._local = LocalChannel(self.service)
            self._local.start()
            self.service.local_socket = self._local.address
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    def stop(self) -> None:
        """Stop admitting, let in-flight RPCs finish (up to grace_s), then close the store."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            self._health.enter_graceful_shutdown()
            self.service.drain()
            self._server.stop(self.grace_s).wait()
            if self._local is not None:
                self._local.stop(self.grace_s)
            try:
                self.store.close()
            finally:
                self._stopped.set()
        log.info("kvstore stopped")

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)


__all__ = ["Limits", "StoreServer", "pb"]
