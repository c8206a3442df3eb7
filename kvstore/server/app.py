"""Wiring from a ``Config`` to a running service: store, gRPC server, /metrics.

Offers ``start(config) -> Running`` (everything started, ports bound) and
``serve(config)`` (start, print where it listens, block until SIGTERM/SIGINT,
then shut down gracefully). Never reads flags or the environment: the ``Config`` it
is given (``kvstore.server.config.load_config``) is all it goes by.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

from kvstore.rpc.tls import server_credentials
from kvstore.server.auth import Tenants
from kvstore.server.config import Config
from kvstore.server.factory import build_store
from kvstore.server.grpc_server import StoreServer
from kvstore.server.metrics import Metrics, MetricsEndpoint
from kvstore.server.put_process import PutProcess
from kvstore.server.service import Limits
from kvstore.server.store import TieredStore

log = logging.getLogger("kvstore")


@dataclass
class Running:
    server: StoreServer
    metrics: MetricsEndpoint | None
    address: str
    put_process: PutProcess | None = None

    def stop(self) -> None:
        """Stop the put process, refuse new calls, finish in-flight ones, flush
        write-behind, close LMDB."""
        try:
            if self.put_process is not None:
                self.put_process.stop()
            self.server.stop()
        finally:
            if self.metrics is not None:
                self.metrics.close()


def limits_of(config: Config) -> Limits:
    """The service limits a config asks for."""
    s = config.server
    return Limits(
        max_keys_per_request=s.max_keys_per_request,
        max_chunk_bytes=s.max_chunk_bytes,
        default_lease_ttl_s=config.store.lease_ttl_s,
        max_lease_ttl_s=config.store.max_lease_ttl_s,
        shm=s.shm,
        max_leases_per_client=s.max_leases_per_client,
        max_streams_per_client=s.max_streams_per_client,
        max_inflight_bytes_per_client=s.max_inflight_bytes_per_client,
    )


def start(config: Config) -> Running:
    store = build_store(config)
    try:
        metrics = Metrics(store.stats)
        s = config.server
        limits = limits_of(config)
        server = StoreServer(
            store,
            s.listen,
            limits=limits,
            max_message_bytes=s.max_message_bytes,
            workers=s.workers,
            grace_s=s.grace_s,
            metrics=metrics,
            credentials=server_credentials(s.tls_cert, s.tls_key, s.tls_client_ca)
            if s.tls_cert
            else None,
            tenants=Tenants.load(s.tenants_file) if s.tenants_file else None,
            # mTLS asks every caller for a certificate; the socket could not
            local_channel=s.local_channel and not s.tls_client_ca,
        )
        port = server.start()
    except BaseException:
        store.close()
        raise
    host = s.listen.rsplit(":", 1)[0] if not s.listen.startswith("unix:") else s.listen
    address = s.listen if s.listen.startswith("unix:") else f"{host}:{port}"
    endpoint = None
    if s.metrics_listen:
        try:
            endpoint = metrics.serve_http(s.metrics_listen)
        except OSError:
            server.stop()
            raise
    puts = None
    if s.put_process and _put_process_fits(config, store):
        service = server.service
        puts = PutProcess(
            store, put_spec(config, store), lambda p: setattr(service, "put_port", p), metrics
        )
        metrics.watch_put_process(lambda: float(bool(service.put_port)), lambda: puts.restarts)
        puts.start()
    return Running(server, endpoint, address, puts)


def _put_process_fits(config: Config, store: TieredStore) -> bool:
    """The put process fills room in a shared DRAM region, and clients reach it by TCP."""
    if config.server.listen.startswith("unix:"):
        log.info("no put process: it needs a TCP listen address; Put is served here")
        return False
    if not hasattr(store.tiers[0], "stage"):
        log.info("no put process: its first tier is not dram; Put is served here")
        return False
    return True


def put_spec(config: Config, store: TieredStore) -> dict:
    """What the put process needs to know (``kvstore.server.put_worker``)."""
    s, n = config.server, config.nvme
    # by default a free port: clients learn it from Routes, and a fixed one (listen's + 1,
    # say) would collide with a second store on the next port of the same host
    listen = s.put_listen or s.listen.rsplit(":", 1)[0] + ":0"
    limits = limits_of(config)
    return {
        "listen": listen,
        "workers": s.workers,
        "max_message_bytes": s.max_message_bytes,
        "limits": dataclasses.asdict(limits),
        "tls": [s.tls_cert, s.tls_key, s.tls_client_ca] if s.tls_cert else None,
        "tenants_file": s.tenants_file,
        "nvme": {
            "path": n.path,
            "map_size": store.tiers[-1].capacity_bytes,  # as the store opened it
            "compression": n.compression,
            "zstd_level": n.zstd_level,
            "sync": n.sync,
        }
        if store.tiers[-1].persistent
        else None,
    }


def serve(config: Config) -> int:
    """Run until SIGTERM or SIGINT; returns the process exit code."""
    running = start(config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    tiers = ", ".join(t.name for t in running.server.store.tiers)
    metrics = (
        f"http://{config.server.metrics_listen.rsplit(':', 1)[0]}:{running.metrics.port}/metrics"
        if running.metrics
        else "off"
    )
    try:
        _say(
            f"kvstore listening on {running.address} (tiers: {tiers}; "
            f"{len(running.server.store.index)} chunks loaded)\n"
            f"  metrics: {metrics}\n"
            f"  try:     kvstore stats --address {running.address}",
            sys.stdout,
        )
        while not stop.wait(0.5):
            pass
        _say("kvstore: shutting down (finishing in-flight calls, flushing)", sys.stderr)
    finally:
        running.stop()
    return 0


def _say(text: str, stream) -> None:
    """Print a status line. A stream nobody reads any more (its supervisor died, the
    pipe closed) must not keep the store from stopping cleanly: it flushes the nvme
    writer's queue and unlinks its shared memory on the way out. Such a stream is sent
    to /dev/null from then on, so that exiting does not fail on it either."""
    try:
        print(text, file=stream, flush=True)
    except (OSError, ValueError):  # a broken pipe; a stream already closed
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, stream.fileno())
            os.close(null)
