"""The ``kvstore`` command: ``serve``, ``stats``, ``explain``, ``ping``, ``keys``.

Client commands talk to ``--address`` (default: ``$KVSTORE_SERVER_LISTEN`` or
127.0.0.1:50051). Every failure prints one readable line and exits non-zero.
``stats --watch [SECONDS]`` refreshes the view with rates per second until Ctrl-C
(or ``--count`` refreshes). A client command never loads the server's config or store
code, and never takes a token as an argument (only ``--token-file``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Sequence

from kvstore import __version__
from kvstore.core.types import KVStoreError

DEFAULT_ADDRESS = "127.0.0.1:50051"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def stats_dict(resp) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(
        resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def format_stats(resp, address: str) -> str:
    lines = [
        f"kvstore {resp.version} at {address}  up {_duration(resp.uptime_s)}  "
        f"write policy {resp.write_policy}",
        "",
    ]
    head = (
        "tier",
        "capacity",
        "used",
        "occupancy",
        "chunks",
        "hits",
        "bytes in",
        "bytes out",
        "evictions",
        "corrupt",
    )
    rows = [head]
    for t in resp.tiers:
        occ = t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
        rows.append(
            (
                t.name,
                _human(t.capacity_bytes),
                _human(t.used_bytes),
                f"{occ:.1%}",
                str(t.chunks),
                str(t.hits),
                _human(t.bytes_in),
                _human(t.bytes_out),
                str(t.evictions),
                str(t.corrupt),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            ).rstrip()
        )
    rate = resp.lookup_hit_keys / resp.lookup_keys if resp.lookup_keys else 0.0
    lines += [
        "",
        f"chunks      {resp.chunks}",
        f"lookups     {resp.lookups} ({resp.lookup_keys} keys, hit rate {rate:.1%})",
        f"puts        {resp.put_chunks} chunks stored, {resp.put_duplicates} duplicates",
        f"leases      {resp.active_leases} active, {resp.expired_leases} expired",
    ]
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(resp.rejected.items())) or "none"
    lines.append(f"rejected    {rejected}")
    ns = sorted(resp.namespaces.items(), key=lambda kv: -kv[1])
    lines.append(f"namespaces  {len(ns)}")
    lines += [f"  {digest[:16]}…  {n} chunks" for digest, n in ns[:10]]
    if len(ns) > 10:
        lines.append(f"  … and {len(ns) - 10} more")
    return "\n".join(lines)


def rates(prev, cur) -> dict | None:
    """Per-second rates between two Stats answers of one server, timed by the server's
    own uptime; None when there is no interval (the first answer, or a restart)."""
    if prev is None or cur.uptime_s <= prev.uptime_s:
        return None
    dt = cur.uptime_s - prev.uptime_s

    def rate(now: int, before: int) -> float:
        return max(0, now - before) / dt

    before = {t.name: t for t in prev.tiers}
    tiers = {}
    for t in cur.tiers:
        b = before.get(t.name)
        tiers[t.name] = {
            f: rate(getattr(t, f), getattr(b, f) if b else 0)
            for f in ("hits", "bytes_in", "bytes_out", "evictions")
        }
    out = {
        "interval_s": dt,
        **{f: rate(getattr(cur, f), getattr(prev, f)) for f in _STORE_RATES},
        "tiers": tiers,
    }
    for f in ("hits", "bytes_in", "bytes_out"):
        out[f] = sum(t[f] for t in tiers.values())
    return out


_STORE_RATES = ("lookups", "lookup_keys", "lookup_hit_keys", "put_chunks", "put_duplicates")


def format_rates(r: dict | None) -> str:
    if r is None:
        return "rates: from the next refresh"
    rows = [("tier", "hits/s", "bytes in/s", "bytes out/s", "evictions/s")]
    for name, t in r["tiers"].items():
        rows.append(
            (
                name,
                f"{t['hits']:.1f}",
                _human(t["bytes_in"]),
                _human(t["bytes_out"]),
                f"{t['evictions']:.1f}",
            )
        )
    rows.append(("all", f"{r['hits']:.1f}", _human(r["bytes_in"]), _human(r["bytes_out"]), ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"rates per second over the last {r['interval_s']:.2f} s"]
    for row in rows:
        cells = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        lines.append("  ".join(cells).rstrip())
    hit = r["lookup_hit_keys"] / r["lookup_keys"] if r["lookup_keys"] else 0.0
    lines += [
        f"lookups/s   {r['lookups']:.1f} ({r['lookup_keys']:.1f} keys/s, hit rate {hit:.1%})",
        f"puts/s      {r['put_chunks']:.1f} chunks stored ({r['put_duplicates']:.1f} duplicates)",
    ]
    return "\n".join(lines)


def _client(args):
    from kvstore.client import ClientOptions, KVStoreClient
    from kvstore.rpc.tls import ClientAuth

    auth = ClientAuth.from_env().with_files(
        ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, token_file=args.token_file
    )
    return KVStoreClient(args.address, ClientOptions(timeout_s=args.timeout, retries=1, auth=auth))


def cmd_serve(args) -> int:
    from kvstore.server.app import serve
    from kvstore.server.config import load_config
    from kvstore.server.config_cli import overrides_from_args

    config = load_config(args.config, overrides=overrides_from_args(args))
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    return serve(config)


def cmd_stats(args) -> int:
    if args.count is not None and (args.watch is None or args.count < 1):
        raise KVStoreError("--count N needs --watch and N >= 1")
    if "," in args.address or args.address.startswith("dns:"):
        return _shard_stats(args)
    with _client(args) as client:
        if args.watch is not None:
            return _watch(client, args)
        resp = client.stats()
    if args.json:
        print(json.dumps(stats_dict(resp), indent=2, sort_keys=True))
    else:
        print(format_stats(resp, args.address))
    return 0


def _shard_stats(args) -> int:
    """Every shard of a sharded deployment (``--address a:1,b:2`` or ``dns:NAME:PORT``)."""
    from kvstore.client import ClientOptions
    from kvstore.client.shards import ShardedClient
    from kvstore.rpc.tls import ClientAuth

    if args.watch is not None:
        raise KVStoreError("--watch takes one store; name one shard's address")
    auth = ClientAuth.from_env().with_files(
        ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, token_file=args.token_file
    )
    opts = ClientOptions(timeout_s=args.timeout, retries=1, auth=auth)
    with ShardedClient(args.address, opts) as shards:
        answers = shards.stats()
    down = 0
    for target, resp in answers:
        if isinstance(resp, KVStoreError):
            down += 1
            print(
                json.dumps({"shard": target, "error": str(resp)})
                if args.json
                else f"{target}: DOWN ({resp})\n"
            )
        elif args.json:
            print(json.dumps({"shard": target, **stats_dict(resp)}, sort_keys=True))
        else:
            print(format_stats(resp, target) + "\n")
    if not args.json:
        print(f"{len(answers) - down} of {len(answers)} shards up")
    return 1 if down else 0


def _watch(client, args) -> int:
    """Refresh every ``args.watch`` seconds: with ``--json`` one JSON line per refresh,
    else the table and rates (redrawn in place on a terminal). Ctrl-C ends it cleanly."""
    redraw = sys.stdout.isatty() and not args.json
    prev = None
    shown = 0
    # Ctrl-C sets a flag instead of raising: a KeyboardInterrupt raised inside a gRPC call
    # can leave the channel unable to shut down, and the watch then never exits
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        while not stop.is_set():
            resp = client.stats()
            r = rates(prev, resp)
            if args.json:
                print(json.dumps({"stats": stats_dict(resp), "rates": r}, sort_keys=True))
            else:
                view = format_stats(resp, args.address) + "\n\n" + format_rates(r)
                print("\x1b[H\x1b[2J" + view if redraw else view + "\n")
            sys.stdout.flush()
            prev, shown = resp, shown + 1
            if args.count is not None and shown >= args.count:
                return 0
            stop.wait(args.watch)
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _hex_keys(values: Sequence[str], what: str) -> list[bytes]:
    out = []
    for v in values:
        try:
            out.append(bytes.fromhex(v))
        except ValueError:
            raise KVStoreError(f"{what} {v!r} is not hex") from None
    return out


def cmd_explain(args) -> int:
    keys = _hex_keys(args.keys, "key")
    ns = _hex_keys([args.namespace], "namespace")[0] if args.namespace else None
    with _client(args) as client:
        resp = client.explain(keys, namespace=ns, lease_id=args.lease)
    if args.json:
        print(json.dumps(stats_dict(resp), indent=2, sort_keys=True))
    else:
        print(f"{resp.matched}/{len(keys)} chunks stored: {resp.reason}")
        print(resp.detail)
    return 0 if resp.reason == "complete" else 3


def cmd_ping(args) -> int:
    with _client(args) as client:
        ok = client.ping()
    print(f"{args.address}: {'SERVING' if ok else 'NOT_SERVING'}")
    return 0 if ok else 1


def cmd_keys(args) -> int:
    from kvstore.core.keys import Namespace, chunk_keys

    try:
        fields = json.loads(args.namespace_json)
    except json.JSONDecodeError as exc:
        raise KVStoreError(f"--namespace-json is not JSON: {exc}") from None
    try:
        ns = Namespace(**fields)
    except TypeError as exc:
        raise KVStoreError(f"--namespace-json: {exc}") from None
    try:
        tokens = [int(t) for t in args.tokens.replace(",", " ").split()]
    except ValueError:
        raise KVStoreError("--tokens must be integers separated by commas or spaces") from None
    print(f"namespace {ns.digest().hex()}")
    for i, key in enumerate(chunk_keys(ns.digest(), tokens, ns.chunk_tokens)):
        print(f"chunk {i} {key.hex()}")
    return 0


def build_parser(serve_flags: bool = True) -> argparse.ArgumentParser:
    """The parser; without ``serve_flags``, ``serve`` lacks its config flags, and the
    config (with pydantic and the store, ~0.1 s of imports) is never loaded."""
    parser = argparse.ArgumentParser(prog="kvstore", description="Tiered KV-cache block store")
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the store (gRPC + /metrics)")
    if serve_flags:
        from kvstore.server.config_cli import add_cli_flags

        add_cli_flags(serve)
    serve.add_argument("--print-config", action="store_true", help="print the merged config")
    serve.set_defaults(fn=cmd_serve)

    def client_cmd(name: str, help: str, fn):
        p = sub.add_parser(name, help=help)
        p.add_argument(
            "--address",
            default=os.environ.get("KVSTORE_SERVER_LISTEN", DEFAULT_ADDRESS),
            help="store address host:port (default $KVSTORE_SERVER_LISTEN or %(default)s)",
        )
        p.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
        tls = p.add_argument_group(
            "TLS and token (default from $KVSTORE_TLS_* / $KVSTORE_TOKEN_FILE)"
        )
        tls.add_argument("--tls-ca", default="", help="PEM of the CA that signed the server")
        tls.add_argument("--tls-cert", default="", help="client certificate, for mutual TLS")
        tls.add_argument("--tls-key", default="", help="client key, for mutual TLS")
        tls.add_argument(
            "--token-file", default="", help="file holding the bearer token (never the token)"
        )
        p.set_defaults(fn=fn)
        return p

    stats = client_cmd("stats", "capacity, usage, hit rates and counters", cmd_stats)
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        type=_positive,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) with rates per second, until Ctrl-C",
    )
    stats.add_argument(
        "--count", type=int, metavar="N", help="with --watch: stop after N refreshes"
    )
    explain = client_cmd("explain", "where and why a key chain breaks", cmd_explain)
    explain.add_argument("keys", nargs="+", help="chunk keys in chain order, hex")
    explain.add_argument("--namespace", help="namespace digest, hex")
    explain.add_argument("--lease", type=int, help="a lease id to check for expiry")
    explain.add_argument("--json", action="store_true")
    client_cmd("ping", "health check", cmd_ping)

    keys = sub.add_parser("keys", help="compute chunk keys for token ids (no server)")
    keys.add_argument("--namespace-json", required=True, help="namespace fields as JSON")
    keys.add_argument("--tokens", required=True, help="token ids, comma or space separated")
    keys.set_defaults(fn=cmd_keys)
    return parser


def _reader_gone() -> bool:
    """Whether stdout is a pipe whose reader went away (poll reports an error on the
    write end); if so stdout is pointed at /dev/null, so that the exit's own flush
    cannot fail again."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no poll, or no real stdout
        return False
    if gone:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    return gone


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    # A client command (ping, stats: health probes run them often) never pays for the config.
    args = build_parser(serve_flags="serve" in argv).parse_args(argv)
    try:
        return args.fn(args)
    except KVStoreError as exc:
        code = getattr(getattr(exc, "code", None), "name", "")
        if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            exc = f"cannot reach the store at {args.address} ({code}); is it running?"
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
    except OSError as exc:
        if isinstance(exc, BrokenPipeError) and _reader_gone():
            return 0  # ``kvstore stats --watch | head``: the reader had what it wanted
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"kvstore {args.command}: interrupted", file=sys.stderr)
    return 2 if args.command != "explain" else 4


if __name__ == "__main__":
    sys.exit(main())
