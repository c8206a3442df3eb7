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
from kvstore.server import local_channel
from kvstore.server.auth import Tenants
from kvstore.server.grpc_server import StoreServer
from kvstore.server.metrics import Metrics
from kvstore.server.service import Limits
from kvstore.server.service_calls import client_of, is_local
from tests.chunks import chain
from tests.service.conftest import keys_of, payloads_of
from tests.service.test_disconnect import wait_until
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


def greet(sock: socket.socket, token: bytes = b"") -> None:
    send_frame(sock, HELLO, token)
    assert recv_frame(sock) == (grpc.StatusCode.OK.value[0], b"")  # the store's welcome


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


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
    greet(sock)
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
    greet(sock)
    sock.sendall(HEADER.pack(MAX_FRAME + 1, TAGS["ReserveShm"]))
    assert closed_by_peer(sock)
    # a frame cut short
    sock = connect(served)
    greet(sock)
    sock.sendall(HEADER.pack(100, TAGS["ReserveShm"]) + b"x" * 10)
    sock.shutdown(socket.SHUT_WR)
    assert closed_by_peer(sock)
    # a method it does not serve, and a request that does not parse: told so, may go on
    sock = connect(served)
    greet(sock)
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
    wait_until(lambda: not local._conns, 10.0)  # every connection's thread has ended
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
                mine = c._local._socket(c._local._address, time.monotonic() + 5.0)
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


def test_a_call_interrupted_before_its_answer_never_hands_that_answer_to_the_next(
    served, monkeypatch
):
    chains = [chain(n, seed=60 + n) for n in (1, 2, 3)]
    with KVStoreClient(served.address, ClientOptions(**QUICK)) as c:
        for records in chains:
            assert c.put(records).stored == len(records)
        assert c.lookup(keys_of(chains[0])).matched == 1  # connected and greeted
        real = local_calls.recv_frame

        def interrupted(sock, within_s=None):  # a signal lands while the answer is awaited
            monkeypatch.setattr(local_calls, "recv_frame", real)
            raise KeyboardInterrupt

        monkeypatch.setattr(local_calls, "recv_frame", interrupted)
        with pytest.raises(KeyboardInterrupt):
            c.lookup(keys_of(chains[0]))
        for _ in range(2):
            assert [c.lookup(keys_of(r)).matched for r in chains] == [1, 2, 3]
        assert local_of(served).calls["Lookup"] == 8  # the interrupted one reached the store


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_a_name_taken_by_another_user_after_the_store_let_it_go_gets_no_token(serve, tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": [{"name": "a", "tokens": ["tok-secret-9"]}]}))
    served = serve(tenants=Tenants.load(str(path)))
    auth = ClientOptions(auth=ClientAuth(token="tok-secret-9"), **QUICK)
    with KVStoreClient(served.address, auth) as c:
        assert c.put(chain(1, seed=70), shm=True).stored == 1  # the socket's name is known
        address = local_of(served).address
        local_of(served).stop(2.0)  # the name is free: anyone may bind it now
        read, write = os.pipe()
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the squatter: nobody, on the store's old name
            got = b""
            try:
                os.setgid(65534)
                os.setuid(65534)
                squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                squat.bind(address)
                squat.listen(4)
                os.write(ready_w, b"r")
                squat.settimeout(10.0)
                conn, _ = squat.accept()
                conn.settimeout(2.0)
                with contextlib.suppress(OSError):
                    got = conn.recv(4096)
            finally:
                os.write(write, b"G" if got else b"-")
                os._exit(0)
        assert os.read(ready_r, 1) == b"r"
        out: dict[str, object] = {}

        def fresh_thread() -> None:  # a thread with no connection yet makes one
            out["stored"] = c.put(chain(2, seed=71), shm=True).stored

        t = threading.Thread(target=fresh_thread)
        t.start()
        t.join(30)
        assert out["stored"] == 2  # over gRPC
        os.waitpid(pid, 0)
        assert os.read(read, 1) == b"-"  # the squatter read nothing: no hello, no token


def test_on_ipv6_loopback_leases_cross_transports_and_grpc_callers_are_local(open_store):
    server = StoreServer(
        open_store(), "[::1]:0", limits=Limits(max_leases_per_client=2), grace_s=1.0
    )
    port = server.start()
    try:
        records = chain(2, seed=80)
        keys = keys_of(records)
        with (
            KVStoreClient(f"[::1]:{port}", ClientOptions(**QUICK)) as local,
            KVStoreClient(f"[::1]:{port}", ClientOptions(local_calls=False, **QUICK)) as remote,
        ):
            assert local.put(records).stored == 2
            leases = [local.lookup(keys, lease_ttl_s=60).lease_id for _ in range(2)]
            assert server._local.calls["Lookup"] == 2
            remote.release(leases[0])
            assert local.lookup(keys, lease_ttl_s=60).lease_id
            # gRPC writes this peer as ipv6:%5B::1%5D:port: it is local all the same
            remote.release(leases[1])  # room for the GetShm's lease
            dests = [bytearray(len(p)) for p in payloads_of(records)]
            assert remote.get_shm_into(keys[:1], dests[:1]) == 1
            assert bytes(dests[0]) == payloads_of(records)[0]
    finally:
        server.stop()


def test_a_client_over_the_connection_limit_is_told_at_once_and_uses_grpc(served, monkeypatch):
    monkeypatch.setattr(local_channel, "MAX_CLIENTS", 1)
    first = connect(served)
    greet(first)  # the one connection the store takes now
    second = connect(served)  # told before it sends a thing, so no call is ever lost
    code, body = recv_frame(second)
    assert code == grpc.StatusCode.UNAVAILABLE.value[0] and b"too many" in body
    assert closed_by_peer(second)
    with KVStoreClient(served.address, ClientOptions(**QUICK)) as c:
        for seed in range(90, 95):  # each put's commit among them: none lost
            assert c.put(chain(2, seed=seed), shm=True).stored == 2
    assert local_of(served).calls == {}
    first.close()


def test_a_peer_that_trickles_its_frames_is_hung_up_on(served, monkeypatch):
    monkeypatch.setattr(local_channel, "HELLO_TIMEOUT_S", 0.5)
    monkeypatch.setattr(local_channel, "FRAME_TIMEOUT_S", 0.5)
    slow_hello = connect(served)
    slow_hello.sendall(HEADER.pack(0, HELLO)[:2])  # a hello begun, never finished
    slow_call = connect(served)
    greet(slow_call)
    slow_call.sendall(HEADER.pack(MAX_FRAME, TAGS["ReserveShm"]) + b"x")  # 16 MiB promised
    for sock in (slow_hello, slow_call):
        sock.settimeout(5.0)
        assert closed_by_peer(sock)  # within the 5 s: the limits are 0.5 s here
    wait_until(lambda: not local_of(served)._conns, 10.0)


def test_a_client_without_a_deadline_and_a_request_too_large_for_the_socket(served):
    with KVStoreClient(served.address, ClientOptions(timeout_s=None, retries=0)) as c:
        records = chain(2, seed=96)
        assert c.put(records, shm=True).stored == 2
        assert c.lookup(keys_of(records)).matched == 2
        assert local_of(served).calls["Lookup"] == 1
        with pytest.raises(ClientError) as err:  # 18 MB of keys: over gRPC, refused there
            c.lookup([bytes(16)] * 1_000_000)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert local_of(served).calls["Lookup"] == 1


def test_a_call_still_running_when_the_store_stops_is_answered_unavailable(serve):
    served = serve(grace_s=0.5)
    records = chain(2, seed=97)
    with KVStoreClient(served.address, ClientOptions(**QUICK)) as c:
        assert c.put(records).stored == 2
        lookup = served.store.lookup

        def slow_lookup(*a, **kw):  # a lookup that outlasts the stop's grace
            time.sleep(2.0)
            return lookup(*a, **kw)

        served.store.lookup = slow_lookup
        out: dict[str, object] = {}

        def call() -> None:
            try:
                out["matched"] = c.lookup(keys_of(records), lease_ttl_s=5).matched
            except ClientError as exc:
                out["code"] = exc.code

        t = threading.Thread(target=call)
        t.start()
        wait_until(lambda: local_of(served).calls["Lookup"] == 1, 10.0)
        served.server.stop()
        t.join(10)
        assert out == {"code": grpc.StatusCode.UNAVAILABLE}


@pytest.mark.parametrize(
    ("peer", "client"),
    [
        ("ipv4:127.0.0.1:5555", "peer:local"),
        ("ipv6:%5B::1%5D:5555", "peer:local"),  # as gRPC writes it
        ("unix:/tmp/kv.sock", "peer:local"),
        (local_channel.LOCAL_PEER, "peer:local"),
        ("ipv4:10.0.0.7:5555", "peer:10.0.0.7"),
        ("ipv6:%5B2001:db8::1%5D:5555", "peer:[2001:db8::1]"),
    ],
)
def test_callers_of_this_host_are_one_client_and_others_one_per_host(peer, client):
    assert client_of(peer) == client
    assert is_local(peer) is (client == "peer:local")
