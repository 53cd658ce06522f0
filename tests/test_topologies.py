"""RedisStore unchanged on Redis Cluster, Sentinel and TLS (rediss://), on private servers.

Each topology is started here from the redis-server binary on free ports and torn down after;
a machine without the binary (or a build without TLS) skips with the reason.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from harness import wait_for
from redis_server import PrivateRedis, find_redis_server_binary
from taskdedup import Deduplicator, Heartbeat, Policy, RedisStore, Settings
from taskdedup.stores.base import Confirm, Inspect, Lease, Scan
from taskdedup.stores.base import Heartbeat as HeartbeatOp


def build(commit: str) -> None: ...


POLICY = Policy("until_executed", lease=5).bind("ci.build", build)


def exercise(store: RedisStore) -> None:
    """Every primitive once, including the batched ones, through the core."""
    dedup = Deduplicator(store, Settings(grace=30))
    tickets = [dedup.enqueue(POLICY, (f"sha{i}",), job_id=f"job-{i}") for i in range(12)]
    assert all(t.acquired for t in tickets)
    keys = [t.key for t in tickets]
    assert None not in keys
    assert store.run(Confirm(tuple((t.key, t.job_id) for t in tickets if t.key))) == 12
    assert dedup.enqueue(POLICY, ("sha0",)).job_id == "job-0"
    runs = [dedup.claim(POLICY, t.job_id, key=t.key) for t in tickets]
    leases = [r.lease for r in runs if r.lease]
    assert dedup.heartbeat(leases) == (True,) * 12
    assert {i.job_id for i in store.run(Scan())} >= {t.job_id for t in tickets}
    for t in tickets:
        assert t.key
        assert dedup.finish(POLICY, t.key, t.job_id).released
        assert store.run(Inspect(t.key)) is None

    async def from_asyncio() -> None:
        t = await dedup.aenqueue(POLICY, ("async",), job_id="a-1")
        assert t.acquired and t.key
        run = await dedup.aclaim(POLICY, "a-1", key=t.key)
        assert run.lease
        assert await store.arun(HeartbeatOp((run.lease, Lease(t.key, "other", 5000)))) == (
            True,
            False,
        )
        assert (await dedup.afinish(POLICY, t.key, "a-1")).released
        await store.aclose()

    asyncio.run(from_asyncio())


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[str]:
    if find_redis_server_binary() is None:
        pytest.skip("no redis-server binary")
    nodes = [
        PrivateRedis(
            extra_args=[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(tmp_path / f"nodes-{i}.conf"),
            ]
        )
        for i in range(3)
    ]
    try:
        for node in nodes:
            node.start()
        clients = [redis.Redis.from_url(n.url) for n in nodes]
        per = 16384 // 3
        for i, c in enumerate(clients):
            last = 16383 if i == 2 else (i + 1) * per - 1
            c.execute_command("CLUSTER", "ADDSLOTS", *range(i * per, last + 1))
        host, port = clients[0].connection_pool.connection_kwargs["host"], nodes[0].port
        for c in clients[1:]:
            c.execute_command("CLUSTER", "MEET", host, port)
        for c in clients:
            wait_for(
                lambda c=c: c.cluster("info")["cluster_state"] == "ok",
                what="cluster ok",
                ignore=(redis.RedisError, OSError),
            )
            c.close()
        yield f"redis+cluster://127.0.0.1:{nodes[0].port}"
    finally:
        for node in nodes:
            node.stop()


def test_cluster(cluster: str, key_prefix: str) -> None:
    store = RedisStore.from_url(cluster, key_prefix=key_prefix)
    assert isinstance(store.client, RedisCluster)
    exercise(store)
    store.close()


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[str]:
    binary = find_redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server binary")
    with PrivateRedis() as master, PrivateRedis() as spare:
        port = spare.port
        spare.stop()  # we only wanted a free port for the sentinel
        conf = tmp_path / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
            f"sentinel monitor tdmaster 127.0.0.1 {master.port} 1\n"
        )
        proc = subprocess.Popen(
            [binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        try:
            probe = redis.Redis(port=port)
            wait_for(
                lambda: probe.execute_command("SENTINEL", "get-master-addr-by-name", "tdmaster"),
                what="sentinel",
                ignore=(redis.RedisError, OSError),
            )
            probe.close()
            yield f"redis+sentinel://127.0.0.1:{port}/tdmaster/0"
        finally:
            proc.terminate()
            proc.wait(10)


def test_sentinel(sentinel: str, key_prefix: str) -> None:
    store = RedisStore.from_url(sentinel, key_prefix=key_prefix)
    exercise(store)
    store.close()


@pytest.fixture
def tls(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    if find_redis_server_binary() is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server and openssl")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    server = PrivateRedis(
        extra_args=[
            "--port",
            "0",
            "--tls-port",
            "{port}",
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-auth-clients",
            "no",
        ],
        tls_ca=str(cert),
    )
    try:
        server.start()
    except RuntimeError as exc:
        pytest.skip(f"redis-server without TLS support: {exc}")
    try:
        yield f"rediss://127.0.0.1:{server.port}/0", cert
    finally:
        server.stop()


def test_tls(tls: tuple[str, Path], key_prefix: str) -> None:
    url, cert = tls
    store = RedisStore.from_url(url, key_prefix=key_prefix, ssl_ca_certs=str(cert))
    exercise(store)
    store.close()


def test_heartbeat_thread_on_cluster(cluster: str, key_prefix: str) -> None:
    store = RedisStore.from_url(cluster, key_prefix=key_prefix)
    dedup = Deduplicator(store)
    policy = Policy("until_executed", lease=0.6).bind("ci.build", build)
    t = dedup.enqueue(policy, ("x",), job_id="A")
    assert t.key
    run = dedup.claim(policy, "A", key=t.key)
    assert run.lease
    beat = Heartbeat(dedup)
    beat.add(run.lease)
    try:
        wait_for(lambda: dedup.stats["heartbeat.renewed"] >= 4, what="4 beats")
        assert dedup.enqueue(policy, ("x",)).job_id == "A"
    finally:
        beat.stop()
    store.close()


def test_asyncio_on_sentinel_moves_past_a_silent_sentinel(sentinel: str, key_prefix: str) -> None:
    """The first sentinel listed accepts connections but never answers (stopped, overloaded):
    every asyncio operation still gets through, via the next sentinel, after socket_timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = sentinel.replace(
            "redis+sentinel://", f"redis+sentinel://127.0.0.1:{silent.getsockname()[1]},"
        )
        store = RedisStore.from_url(url, key_prefix=key_prefix, socket_timeout=1)
        dedup = Deduplicator(store, Settings(on_store_error="raise"))

        async def three() -> list[bool]:
            return [(await dedup.aenqueue(POLICY, (f"s{i}",))).acquired for i in range(3)]

        assert asyncio.run(three()) == [True, True, True]
        store.close()


def test_a_store_built_on_a_sync_client_serves_asyncio_calls_too(
    redis_url: str, sentinel: str, key_prefix: str
) -> None:
    """RedisStore(client): the asyncio side is derived from the client's connection settings,
    or, where they do not name the server (Sentinel), runs the sync client in a thread."""
    plain = redis.Redis.from_url(redis_url)
    parts = sentinel.removeprefix("redis+sentinel://").split("/")
    host, port = parts[0].rsplit(":", 1)
    managed = redis.Sentinel([(host, int(port))]).master_for(parts[1])
    for client in (plain, managed):
        dedup = Deduplicator(
            RedisStore(client, key_prefix=key_prefix), Settings(on_store_error="raise")
        )

        async def twice(dedup: Deduplicator) -> tuple[Any, Any]:
            first = await dedup.aenqueue(POLICY, ("x",))
            dedup.published(first)
            return first, await dedup.aenqueue(POLICY, ("x",))

        first, again = asyncio.run(twice(dedup))
        assert first.acquired and again.deduplicated and again.job_id == first.job_id
        client.close()
