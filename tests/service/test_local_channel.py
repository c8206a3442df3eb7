"""The store's same-host socket (``kvstore.server.local_channel``) against a real server:
a same-host put's two calls go over it and store the same bytes as over gRPC, with the
same tokens, tenants and metrics; hostile frames are refused without harming the
socket; a socket that goes away sends the calls back to gRPC."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import grpc
import pytest
import yaml

from kvstore.client import ClientError, ClientOptions, KVStoreClient, local_calls
from kvstore.rpc.local_wire import HEADER, HELLO, MAX_FRAME, TAGS, recv_frame, send_frame
from kvstore.rpc.pb import pb
from kvstore.rpc.tls import ClientAuth
from kvstore.server.auth import Tenants
from kvstore.server.metrics import Metrics
from kvstore.server.service import Limits
from tests.chunks import chain
from tests.service.conftest import keys_of, payloads_of
from tests.service.test_real_sizes import llama_chains
from tests.service.test_rpc_metrics import samples

MiB = 1 << 20
QUICK = dict(timeout_s=20.0, retries=0)


def local_of(served):
    return served.server._local


def connect(served) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10.0)
    sock.connect(local_of(served).address)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_for(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_real_sized_same_host_puts_go_over_the_socket_and_read_back_as_over_grpc(serve, open_store):
    fp8, raw = llama_chains(2, seed=11)  # 2 x ~16 MiB fp8 and 2 x ~32 MiB bf16
    store = open_store(dram_slots=8192, nvme_bytes=0)  # 256 MiB: room for all of them
    metrics = Metrics(store.stats)
    big = serve(store, metrics=metrics)
    with (
        KVStoreClient(big.address, ClientOptions(**QUICK)) as local,
        KVStoreClient(big.address, ClientOptions(local_calls=False, **QUICK)) as remote,
    ):
        assert local.put(fp8, shm=True).stored == 2
        assert dict(local_of(big).calls) == {"ReserveShm": 1, "CommitShm": 1}
        assert remote.put(raw, shm=True).stored == 2
        assert dict(local_of(big).calls) == {"ReserveShm": 1, "CommitShm": 1}  # not this one
        for records in (fp8, raw):
            got = remote.get(keys_of(records))
            assert [bytes(g) for g in got] == payloads_of(records)
    put_calls = [
        v
        for (name, labels), v in samples(metrics).items()
        if name == "kvstore_rpc_total" and ("method", "Put") in labels
    ]
    assert sum(put_calls) == 0  # every chunk was written in place, none sent over Put


def test_the_socket_refuses_what_grpc_refuses_and_counts_in_the_same_metrics(serve, open_store):
    store = open_store()
    metrics = Metrics(store.stats)
    served = serve(store, metrics=metrics)
    records = chain(3, seed=5)
    sock = connect(served)
    send_frame(sock, HELLO, b"")
    bad = pb.ReserveShmRequest(chunks=[pb.ShmPutChunk(key=b"short", length=10)])
    send_frame(sock, TAGS["ReserveShm"], bad.SerializeToString())
    code, body = recv_frame(sock)
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert b"keys[0] is 5 bytes" in body
    with KVStoreClient(served.address, ClientOptions(**QUICK)) as c:
        assert c.put(records, shm=True).stored == 3
        with pytest.raises(ClientError) as err:
            c._call("CommitShm", c._commit_shm, pb.CommitShmRequest(ticket=999_999))
    assert err.value.code == grpc.StatusCode.NOT_FOUND  # a lapsed ticket, as over gRPC
    got = samples(metrics)

    def calls(method: str, code: str) -> float:
        return got.get(
            ("kvstore_rpc_total", frozenset({"method": method, "code": code}.items())), 0
        )

    assert calls("ReserveShm", "OK") == 1
    assert calls("ReserveShm", "INVALID_ARGUMENT") == 1
    assert calls("CommitShm", "OK") == 1
    assert calls("CommitShm", "NOT_FOUND") == 1
    sock.close()


def test_tokens_and_tenants_hold_over_the_socket(serve, tmp_path):
    tokens = {"team-a": "tok-a-41c0", "team-b": "tok-b-77e2"}
    path = tmp_path / "tenants.yaml"
    path.write_text(
        yaml.safe_dump({"tenants": [{"name": n, "tokens": [t]} for n, t in tokens.items()]})
    )
    served = serve(tenants=Tenants.load(str(path)))
    records = chain(3, seed=8)

    def client(token: str) -> KVStoreClient:
        return KVStoreClient(served.address, ClientOptions(auth=ClientAuth(token=token), **QUICK))

    with client(tokens["team-a"]) as a, client(tokens["team-b"]) as b, client("") as anon:
        assert a.put(records, shm=True).stored == 3
        assert local_of(served).calls["CommitShm"] == 1
        assert a.lookup(keys_of(records)).matched == 3
        assert b.lookup(keys_of(records)).matched == 0  # team-a's chain is not team-b's
        # Routes answers only a caller with a token, so take the socket's name from a's
        anon._local._address, anon._local._next_ask = a._local._address, float("inf")
        with pytest.raises(ClientError) as err:
            anon.put(chain(1, seed=9), shm=True)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert local_of(served).calls["ReserveShm"] == 2  # the anonymous one reached the socket


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_a_process_of_another_user_is_hung_up_on(served):
    address = local_of(served).address
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, then try the socket
        verdict = b"?"
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10.0)
            sock.connect(address)
            with_hello = HEADER.pack(0, HELLO)
            request = pb.ReserveShmRequest(chunks=[pb.ShmPutChunk(key=bytes(16), length=64)])
            body = request.SerializeToString()
            with contextlib.suppress(OSError):  # it may hang up before all is sent
                sock.sendall(with_hello + HEADER.pack(len(body), TAGS["ReserveShm"]) + body)
            verdict = b"c" if closed_by_peer(sock) else b"a"
        finally:
            os.write(write, verdict)
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"c"  # closed without an answer
    os.close(read)
    assert local_of(served).calls == {}
    with KVStoreClient(served.address, ClientOptions(**QUICK)) as c:  # still serves its own
        assert c.put(chain(2, seed=3), shm=True).stored == 2
    assert local_of(served).calls["CommitShm"] == 1


def test_hostile_frames_are_refused_and_the_socket_keeps_serving(served):
    local = local_of(served)
    # no hello first
    sock = connect(served)
    send_frame(sock, TAGS["ReserveShm"], b"")
    assert closed_by_peer(sock)
    # a frame over the limit: hung up on before its body is read
    sock = connect(served)
    send_frame(sock, HELLO, b"")
    sock.sendall(HEADER.pack(MAX_FRAME + 1, TAGS["ReserveShm"]))
    assert closed_by_peer(sock)
    # a frame cut short
    sock = connect(served)
    send_frame(sock, HELLO, b"")
    sock.sendall(HEADER.pack(100, TAGS["ReserveShm"]) + b"x" * 10)
    sock.shutdown(socket.SHUT_WR)
    assert closed_by_peer(sock)
    # a method it does not serve, and a request that does not parse: told so, may go on
    sock = connect(served)
    send_frame(sock, HELLO, b"")
    send_frame(sock, 200, b"")
    code, body = recv_frame(sock)
    assert code == grpc.StatusCode.UNIMPLEMENTED.value[0] and b"tag 200" in body
    send_frame(sock, TAGS["CommitShm"], b"\xff\xff\xff")
    code, body = recv_frame(sock)
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"malformed" in body
    send_frame(sock, TAGS["CommitShm"], pb.CommitShmRequest(ticket=12345).SerializeToString())
    code, _ = recv_frame(sock)
    assert code == grpc.StatusCode.NOT_FOUND.value[0]
    sock.close()
    assert wait_for(lambda: not local._conns)  # every connection's thread has ended
    with KVStoreClient(served.address, ClientOptions(**QUICK)) as c:
        records = chain(3, seed=4)
        assert c.put(records, shm=True).stored == 3
        assert [bytes(g) for g in c.get(keys_of(records))] == payloads_of(records)


def test_many_threads_share_one_client_each_on_its_own_connection(served):
    chains = [chain(4, seed=100 + i) for i in range(8)]
    results: list[object] = [None] * len(chains)
    with KVStoreClient(served.address, ClientOptions(**QUICK)) as c:
        assert c.put(chain(1, seed=99), shm=True).stored == 1  # Routes asked: the socket known

        conns: list[object] = [None] * len(chains)

        def put(i: int) -> None:
            results[i] = c.put(chains[i], shm=True)
            conns[i] = c._local._mine.conn[2]  # held here, so none is freed and reused

        threads = [threading.Thread(target=put, args=(i,)) for i in range(len(chains))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [r.stored for r in results] == [4] * len(chains)
        assert local_of(served).calls == {"ReserveShm": 9, "CommitShm": 9}
        assert len({id(conn) for conn in conns} | {id(c._local._mine.conn[2])}) == 9
        for records in chains:
            assert [bytes(g) for g in c.get(keys_of(records))] == payloads_of(records)


def test_a_socket_that_goes_away_sends_the_calls_back_to_grpc(served, monkeypatch):
    monkeypatch.setattr(local_calls, "REASK_S", 0.2)
    with KVStoreClient(served.address, ClientOptions(**QUICK)) as c:
        assert c.put(chain(2, seed=20), shm=True).stored == 2
        local_of(served).stop(2.0)  # the socket closes; gRPC stays up
        records = chain(3, seed=21)
        assert c.put(records, shm=True).stored == 3  # over gRPC, same-host all the same
        assert dict(local_of(served).calls) == {"ReserveShm": 1, "CommitShm": 1}
        time.sleep(0.3)  # Routes is asked again: it still names the closed socket
        assert c.put(chain(3, seed=22), shm=True).stored == 3
        assert [bytes(g) for g in c.get(keys_of(records))] == payloads_of(records)


def test_a_store_without_the_socket_is_reached_over_grpc(serve):
    served = serve(local_channel=False)
    assert served.server._local is None
    with KVStoreClient(served.address, ClientOptions(**QUICK)) as c:
        records = chain(3, seed=30)
        assert c.put(records, shm=True).stored == 3
        assert c._local._address == ""  # Routes named none
        assert [bytes(g) for g in c.get(keys_of(records))] == payloads_of(records)


def test_a_forked_child_opens_a_connection_of_its_own(served):
    with KVStoreClient(served.address, ClientOptions(**QUICK)) as c:
        assert c.put(chain(2, seed=40), shm=True).stored == 2
        parent = c._local._mine.conn[2]
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            ok = b"n"
            try:
                mine = c._local._socket(c._local._address, 5.0)
                ok = b"y" if mine is not None and mine is not parent else b"n"
            finally:
                os.write(write, ok)
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        assert os.read(read, 1) == b"y"
        os.close(read)
        assert c._local._mine.conn[2] is parent  # the parent's own is untouched


def test_leased_lookups_and_shm_gets_over_the_socket_read_the_stored_bytes(serve, open_store):
    fp8, _ = llama_chains(2, seed=12)
    served = serve(open_store(dram_slots=4096, nvme_bytes=0))  # 128 MiB
    with KVStoreClient(served.address, ClientOptions(**QUICK)) as c:
        assert c.put(fp8, shm=True).stored == 2
        keys = keys_of(fp8)
        found = c.lookup(keys, lease_ttl_s=10.0, shm=True)
        assert (found.matched, found.lease_id is not None, found.shm is not None) == (2, True, True)
        views = c.shm_views(keys, grant=found.shm)
        assert [bytes(v) for v in views.views] == payloads_of(fp8)
        assert views.end() == 2
        dests = [bytearray(len(p)) for p in payloads_of(fp8)]
        assert c.get_shm_into(keys, dests) == 2
        assert [bytes(d) for d in dests] == payloads_of(fp8)
        c.wait_releases()
        assert c.stats().active_leases == 0
    calls = local_of(served).calls
    assert calls["Lookup"] == 1 and calls["GetShm"] == 1


def test_a_lease_taken_over_the_socket_and_released_over_grpc_frees_the_quota(serve):
    served = serve(limits=Limits(max_leases_per_client=2))
    records = chain(2, seed=50)
    keys = keys_of(records)
    grpc_only = ClientOptions(local_calls=False, **QUICK)
    with (
        KVStoreClient(served.address, ClientOptions(**QUICK)) as local,
        KVStoreClient(served.address, grpc_only) as remote,
    ):
        assert local.put(records).stored == 2
        leases = [local.lookup(keys, lease_ttl_s=60).lease_id for _ in range(2)]
        with pytest.raises(ClientError) as err:
            local.lookup(keys, lease_ttl_s=60)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert local_of(served).calls["Lookup"] == 3
        remote.release(leases[0])  # one client of this host, whichever way it calls
        assert local.lookup(keys, lease_ttl_s=60).lease_id
