"""The put process itself: ``python -m kvstore.server.put_worker``, started by the store.

Reads one JSON line from stdin (the spec ``kvstore.server.put_process`` writes: the
private channel's address and key, its generation, the listen address, TLS and tenant
files, the service limits, and the nvme tier's directory when it writes through), serves
``Put`` there with the store's own servicer over a ``ForwardingStore``, prints
``{"port": N}`` once it listens, and exits when stdin closes: the store stopped or died.
Its calls' metrics go to the store (``kvstore.server.put_metrics``).
Every other method answers UNIMPLEMENTED; clients send those to the store.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from concurrent import futures

import grpc

from kvstore.rpc.tls import server_credentials
from kvstore.server.auth import Tenants
from kvstore.server.put_forward import ForwardingStore, StoreChannel
from kvstore.server.put_metrics import MetricsRelay
from kvstore.server.service import KVStoreService, Limits
from kvstore.server.service_handlers import generic_handler

log = logging.getLogger("kvstore.put_process")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s put-process %(message)s")
    # the store decides when this process stops (it closes our stdin), not a Ctrl-C
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = json.loads(sys.stdin.readline())
    channel = StoreChannel(spec["channel"], bytes.fromhex(spec["authkey"]), spec["generation"])
    nvme = None
    if spec.get("nvme"):
        from kvstore.server.tiers.nvme import NvmeTier

        n = spec["nvme"]
        nvme = NvmeTier(
            n["path"],
            n["map_size"],
            compression=n["compression"],
            zstd_level=n["zstd_level"],
            sync=n["sync"],
            lock_dir=False,  # the store holds the directory's lock and admits us
        )
    limits = Limits(**spec["limits"])
    # counted on the store's /metrics: sent along at the end of every call
    relay = MetricsRelay(lambda batch: channel.call("metrics", batch))
    store = ForwardingStore(channel, nvme, limits.max_chunk_bytes, relay.chunk_refused)
    tenants = Tenants.load(spec["tenants_file"]) if spec.get("tenants_file") else None
    service = KVStoreService(store, limits, relay, tenants)  # type: ignore[arg-type]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=spec["workers"], thread_name_prefix="kvstore-put"),
        options=[
            ("grpc.max_send_message_length", spec["max_message_bytes"]),
            ("grpc.max_receive_message_length", spec["max_message_bytes"]),
            ("grpc.so_reuseport", 0),
        ],
    )
    server.add_generic_rpc_handlers((generic_handler(service, only=("Put",)),))
    tls = spec.get("tls")
    listen = spec["listen"]
    port = (
        server.add_secure_port(listen, server_credentials(*tls))
        if tls
        else server.add_insecure_port(listen)
    )
    if not port:
        log.error("cannot listen on %s", listen)
        return 1
    server.start()
    print(json.dumps({"port": port}), flush=True)
    threading.Thread(target=_exit_with_store, args=(server, service, nvme), daemon=True).start()
    server.wait_for_termination()
    return 0


def _exit_with_store(server, service, nvme) -> None:
    """Wait for stdin to close, then finish in-flight puts briefly and leave."""
    try:
        sys.stdin.buffer.read()
    finally:
        service.drain()
        server.stop(2.0).wait()
        if nvme is not None:
            nvme.close()
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
