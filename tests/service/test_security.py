"""TLS, mutual TLS, bearer tokens per tenant and per-client limits, against real servers
on loopback with certificates from a CA the test makes.

Tenants are kept apart even when they know each other's keys: another tenant's chain
reads as a miss, cannot be extended, deleted or explained, and Stats shows each tenant
only its own namespaces."""

from __future__ import annotations

import os
import subprocess
import urllib.request

import grpc
import pytest
import yaml

from kvstore.client import ClientError, ClientOptions, KVStoreClient
from kvstore.core.types import ChunkRecord
from kvstore.rpc.pb import pb
from kvstore.rpc.tls import ClientAuth, server_credentials
from kvstore.server.auth import Tenants
from kvstore.server.metrics import Metrics
from kvstore.server.service import Limits
from tests.certs import make_pki
from tests.chunks import NAMESPACE, chain
from tests.procs import KVSTORE
from tests.service.conftest import keys_of, payloads_of

TOKENS = {"team-a": "tok-a-3f9c2e71", "team-b": "tok-b-8d14aa05", "ops": "tok-ops-55e0c1b2"}
QUICK = dict(timeout_s=10.0, retries=0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    doc = {
        "tenants": [
            {"name": "team-a", "tokens": [TOKENS["team-a"]]},
            {"name": "team-b", "tokens": [TOKENS["team-b"]]},
            {"name": "ops", "admin": True, "tokens": [TOKENS["ops"]]},
        ]
    }
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def token_auth(pki, who: str | None, **kw) -> ClientAuth:
    return ClientAuth(ca=pki.ca, token=TOKENS[who] if who else "", **kw)


@pytest.fixture
def secured(serve, pki, tenants_file):
    """A server with TLS (server certificate only) and the three tenants."""
    return serve(
        credentials=server_credentials(pki.server_cert, pki.server_key),
        tenants=Tenants.load(tenants_file),
    )


def client_for(served, auth: ClientAuth) -> KVStoreClient:
    return KVStoreClient(f"localhost:{served.port}", ClientOptions(auth=auth, **QUICK))


def refused(call, *args, **kwargs) -> ClientError:
    with pytest.raises(ClientError) as err:
        call(*args, **kwargs)
    return err.value


def test_tls_with_a_token_round_trips_and_without_one_is_unauthenticated(secured, pki):
    records = chain(3, seed=1)
    with client_for(secured, token_auth(pki, "team-a")) as a:
        assert a.put(records).stored == 3
        assert [bytes(p) for p in a.get(keys_of(records))] == payloads_of(records)
    with client_for(secured, token_auth(pki, None)) as anonymous:
        err = refused(anonymous.lookup, keys_of(records))
        assert err.code == grpc.StatusCode.UNAUTHENTICATED and "token" in err.details
    bad = ClientAuth(ca=pki.ca, token="not-a-token")
    with client_for(secured, bad) as stranger:
        assert refused(stranger.stats).code == grpc.StatusCode.UNAUTHENTICATED
    with client_for(secured, ClientAuth(token=TOKENS["team-a"])) as plaintext:
        assert refused(plaintext.stats).code == grpc.StatusCode.UNAVAILABLE  # no TLS: no talk
    with client_for(secured, ClientAuth(ca=pki.other_ca, token=TOKENS["team-a"])) as wrong_ca:
        assert refused(wrong_ca.stats).code == grpc.StatusCode.UNAVAILABLE


def test_a_tenant_never_reaches_another_tenants_chunks(secured, pki):
    mine = chain(4, seed=2)
    with client_for(secured, token_auth(pki, "team-a")) as a:
        assert a.put(mine).stored == 4
    keys = keys_of(mine)
    with client_for(secured, token_auth(pki, "team-b")) as b:
        # b knows a's keys and namespace, and still gets misses, never bytes
        assert b.lookup(keys, lease_ttl_s=5).matched == 0
        assert b.get(keys) == [] and b.get(keys, shm=True) == []
        assert b.explain(keys).matched == 0
        assert b.delete(keys) == 0
        err = refused(b.delete, namespace=NAMESPACE.digest())
        assert err.code == grpc.StatusCode.NOT_FOUND  # a's namespace is not b's
        # extending a's chain is refused as if its parent did not exist
        tail = chain(5, seed=2)[4]
        assert b.put([tail]).rejected == [(tail.key, "parent is not stored")]
        # storing under a's key is refused, and a's bytes stay a's
        fake = ChunkRecord(mine[0].key, None, NAMESPACE.digest(), payloads_of(chain(1, seed=9))[0])
        assert b.put([fake]).stored == 0
        assert b.stats().chunks == 0 and dict(b.stats().namespaces) == {}
    with client_for(secured, token_auth(pki, "team-a")) as a:
        assert [bytes(p) for p in a.get(keys)] == payloads_of(mine)
        stats = a.stats()
        assert stats.chunks == 4
        assert list(stats.namespaces) == [NAMESPACE.digest().hex()[:48]]
        assert a.delete(namespace=NAMESPACE.digest()) == 4
    with client_for(secured, token_auth(pki, "ops")) as ops:
        assert len(ops.stats().tiers) == 2  # the admin tenant sees the whole store


def test_mutual_tls_refuses_a_client_without_a_certificate(serve, pki, tenants_file):
    served = serve(
        credentials=server_credentials(pki.server_cert, pki.server_key, pki.ca),
        tenants=Tenants.load(tenants_file),
    )
    records = chain(2, seed=3)
    with_cert = token_auth(pki, "team-a", cert=pki.client_cert, key=pki.client_key)
    with client_for(served, with_cert) as c:
        assert c.put(records).stored == 2
        assert [bytes(p) for p in c.get(keys_of(records), shm=True)] == payloads_of(records)
    with client_for(served, token_auth(pki, "team-a")) as no_cert:
        assert refused(no_cert.stats).code == grpc.StatusCode.UNAVAILABLE


def test_per_client_limits_are_resource_exhausted_with_a_message(serve):
    served = serve(limits=Limits(max_leases_per_client=3))
    records = chain(2, seed=4)
    with KVStoreClient(served.address, ClientOptions(**QUICK)) as c:
        c.put(records)
        leases = [c.lookup(keys_of(records), lease_ttl_s=30).lease_id for _ in range(3)]
        err = refused(c.lookup, keys_of(records), lease_ttl_s=30)
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_leases_per_client" in err.details
        c.release(leases[0])
        assert c.lookup(keys_of(records), lease_ttl_s=30).lease_id  # room again
        assert c.lookup(keys_of(records)).matched == 2  # lookups without a lease go on


def test_too_many_open_streams_are_refused(serve, raw_stub):
    served = serve(limits=Limits(max_streams_per_client=1))
    # 8 MiB: more than flow control lets the server send before the client reads
    records = chain(256, seed=5)
    with KVStoreClient(served.address, ClientOptions(**QUICK)) as c:
        c.put(records)
        stream = raw_stub(served.address).get(pb.GetRequest(keys=keys_of(records)))
        first = next(stream)  # a Get stream stays open until it is drained
        assert first
        err = refused(c.get, keys_of(records))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "streams" in err.details
        list(stream)
        assert len(c.get(keys_of(records))) == 256


def test_metrics_never_show_keys_or_tokens(serve, pki, tenants_file):
    metrics = Metrics(lambda: served.store.stats())
    served = serve(
        credentials=server_credentials(pki.server_cert, pki.server_key),
        tenants=Tenants.load(tenants_file),
        metrics=metrics,
    )
    endpoint = metrics.serve_http("127.0.0.1:0")
    try:
        records = chain(2, seed=6)
        with client_for(served, token_auth(pki, "team-a")) as a:
            a.put(records)
            a.get(keys_of(records))
        with client_for(served, token_auth(pki, None)) as anonymous:
            refused(anonymous.stats)
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        endpoint.close()
    assert 'code="UNAUTHENTICATED"' in text
    for secret in [*TOKENS.values(), *(k.hex() for k in keys_of(records))]:
        assert secret not in text


def test_the_cli_takes_the_ca_and_a_token_file_and_keeps_the_token_off_its_command_line(
    secured, pki, tmp_path
):
    token_file = tmp_path / "token"
    token_file.write_text(TOKENS["team-a"] + "\n")
    with client_for(secured, token_auth(pki, "team-a")) as a:
        a.put(chain(2, seed=7))
    argv = [
        KVSTORE, "stats", "--json", "--address", f"localhost:{secured.port}",
        "--tls-ca", pki.ca, "--token-file", str(token_file),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert '"chunks": "2"' in done.stdout
    assert TOKENS["team-a"] not in " ".join(argv)
    env = {**os.environ, "KVSTORE_TLS_CA": pki.ca, "KVSTORE_TOKEN_FILE": str(token_file)}
    by_env = subprocess.run(
        [KVSTORE, "stats", "--json", "--address", f"localhost:{secured.port}"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert by_env.returncode == 0 and '"chunks": "2"' in by_env.stdout
    no_token = subprocess.run(
        [KVSTORE, "stats", "--address", f"localhost:{secured.port}", "--tls-ca", pki.ca],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_TOKEN")},
    )  # fmt: skip
    assert no_token.returncode != 0 and "UNAUTHENTICATED" in no_token.stderr + no_token.stdout


def test_the_asyncio_client_speaks_tls_with_a_token_too(secured, pki):
    import asyncio

    from kvstore.client import AsyncKVStoreClient

    records = chain(2, seed=8)

    async def run(who: str | None):
        client = AsyncKVStoreClient(
            f"localhost:{secured.port}", ClientOptions(auth=token_auth(pki, who), **QUICK)
        )
        try:
            if who is None:
                return await client.stats()
            await client.put(records)
            return [bytes(p) for p in await client.get(keys_of(records))]
        finally:
            await client.close()

    assert asyncio.run(run("team-a")) == payloads_of(records)
    with pytest.raises(ClientError) as err:
        asyncio.run(run(None))
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
