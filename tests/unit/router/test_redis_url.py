"""Redis AUTH and TLS come through the URL, as an operator configures an external Redis.

The embedded redis-server is built without TLS, so the TLS test puts a real TLS endpoint
in front of it: a small TLS-terminating relay in this process (what stunnel or a cloud
Redis's TLS front end does), with certificates made by the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from services.router.embedded_redis import EmbeddedRedis
from services.router.keyspace import Keyspace
from services.router.redis_client import connect
from services.router.registry import Registry
from tests.certs import TestCA
from tests.unit.router.conftest import worker

PASSWORD = "s3cret/with:odd@chars"


@pytest.fixture(scope="module")
def locked() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tcp=True, password=PASSWORD) as server:
        yield server


def _roundtrip(client: redis.Redis) -> None:
    registry = Registry(client, Keyspace("url-test"), ttl_s=30)
    registry.register(worker("w0"))
    assert [w.worker_id for w in registry.list()] == ["w0"]
    registry.deregister("w0")


def test_password_in_the_url(locked: EmbeddedRedis) -> None:
    client = connect(locked.url, timeout_s=2.0)
    _roundtrip(client)
    client.close()
    anonymous = connect(locked.url.replace(f":{quote(PASSWORD, safe='')}@", ""), timeout_s=2.0)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()


class TlsRelay:
    """Accepts TLS (requiring a client certificate) and relays bytes to a TCP address."""

    def __init__(self, context: ssl.SSLContext, target: tuple[str, int]) -> None:
        self.context, self.target = context, target
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(5)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=self.context)
        )
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()
        server.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_tls_and_client_certificate_in_the_url(locked: EmbeddedRedis, tmp_path: Path) -> None:
    ca = TestCA(tmp_path)
    server, client = ca.issue("redis"), ca.issue("router")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca.ca_file))
    context.load_cert_chain(server.cert, server.key)
    context.verify_mode = ssl.CERT_REQUIRED
    port = int(locked.url.rsplit(":", 1)[1].split("/")[0])
    relay = TlsRelay(context, ("127.0.0.1", port))
    try:
        base = f"rediss://:{quote(PASSWORD, safe='')}@127.0.0.1:{relay.port}/0"
        query = f"ssl_ca_certs={ca.ca_file}&ssl_cert_reqs=required"
        with_cert = f"{query}&ssl_certfile={client.cert}&ssl_keyfile={client.key}"
        secure = connect(f"{base}?{with_cert}", timeout_s=5.0)
        _roundtrip(secure)
        secure.close()
        no_cert = connect(f"{base}?{query}", timeout_s=5.0)
        with pytest.raises(redis.ConnectionError):
            no_cert.ping()  # the relay demands a client certificate
        no_cert.close()
    finally:
        relay.close()
