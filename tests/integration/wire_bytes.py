"""Bytes for wire-level fuzzing: protobuf fields by hand, and HTTP/2 frames and gRPC
calls by hand (HPACK literals only), to send what no well-behaved client would.

`JUNK` names the payloads `test_fuzz.py` writes on raw TCP connections; `send_junk`
writes one and returns what the server said back (a `Reply`); `frames` lists (type,
stream) of the HTTP/2 frames in that reply.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass


def varint(n: int) -> bytes:
    """A protobuf base-128 varint."""
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def flip(body: bytes, at: int, value: int) -> bytes:
    """`body` with the byte at `at` (mod its length) replaced by `value`."""
    i = at % len(body)
    return body[:i] + bytes([value]) + body[i + 1 :]


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def grpc_headers(path: str) -> bytes:
    """A HEADERS block in HPACK literals (never indexed, no Huffman): enough for gRPC."""
    fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
              (b":authority", b"127.0.0.1"), (b"content-type", b"application/grpc"),
              (b"te", b"trailers")]  # fmt: skip
    return b"".join(b"\x00" + bytes([len(k)]) + k + bytes([len(v)]) + v for k, v in fields)


def grpc_call(path: str, declared: int, body: bytes) -> bytes:
    """A connection with one gRPC call whose message declares `declared` bytes."""
    message = b"\x00" + struct.pack(">I", declared) + body
    return (PREFACE + frame(4, 0, 0) + frame(1, 0x4, 1, grpc_headers(path))
            + frame(0, 0x1, 1, message))  # fmt: skip


JUNK = {
    "random": bytes(range(256)) * 16,
    "http1": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "preface-then-noise": PREFACE + bytes(range(255, -1, -1)) * 4,
    "frame-claims-16mib": PREFACE + frame(4, 0, 0) + b"\xff\xff\xff\x00\x00\x00\x00\x00\x01",
    "zeros": b"\x00" * 65536,
    "truncated-message": grpc_call("/pdserve.v1.Gateway/Generate", 1000, b"\x12\x05hello"),
    "message-past-limit": grpc_call("/pdserve.v1.Gateway/Generate", 2**31 - 1, b"\x12"),
    "unknown-method": grpc_call("/pdserve.v1.Gateway/Nope", 2, b"\x08\x01"),
}

# Whole gRPC calls the server can parse: it owes each a status (HEADERS) or a reset on
# stream 1 while the client stays connected. Not "truncated-message": grpc-python's
# asyncio server never runs a handler whose request message is cut short and sends
# no status for it, so that call ends only when the connection does.
OWED_A_STATUS = frozenset({"message-past-limit", "unknown-method"})


@dataclass(frozen=True)
class Reply:
    """What a server sent back on one junk connection."""

    data: bytes
    ended: bool  # it answered stream 1 or hung up before the window passed

    @property
    def answered(self) -> bool:
        """Whether it ended stream 1 with a status (HEADERS) or a reset (RST_STREAM)."""
        return bool({(1, 1), (3, 1)} & set(frames(self.data)))


def send_junk(
    address: str, payload: bytes, *, half_close: bool = True, window_s: float = 15.0
) -> Reply:
    """Write `payload` on a fresh TCP connection; return what came back before the server
    hung up, answered stream 1 or `window_s` passed.

    With `half_close` we shut our write side after the payload, so a server waiting for
    more junk sees the end at once. Without it we stay a polite HTTP/2 peer while we
    wait, acknowledging the server's SETTINGS and PINGs: use that for a call the server
    owes a status (`OWED_A_STATUS`). gRPC treats a half-closed TCP connection as closed,
    and a server that reads that EOF before it has parsed the call drops the connection
    without the status (CI saw the gateway do so once, with a message past the size
    limit).

    Why a long window that usually ends early: on a host busy with other suites, a
    server took over 3 s (the old fixed window) to answer, and the test read silence."""
    host, port = address.rsplit(":", 1)
    got = b""
    answered = 0
    deadline = time.monotonic() + window_s
    with socket.create_connection((host, int(port)), timeout=window_s) as sock:
        try:
            sock.sendall(payload)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            while not Reply(got, ended=False).answered:
                sock.settimeout(max(deadline - time.monotonic(), 0.01))
                if not (chunk := sock.recv(65536)):
                    return Reply(got, ended=True)
                got += chunk
                if not half_close:
                    whole = whole_frames(got)
                    sock.sendall(b"".join(acks(whole[answered:])))
                    answered = len(whole)
        except TimeoutError:
            return Reply(got, ended=False)
        except OSError:  # reset mid-way: a fine answer to junk
            return Reply(got, ended=True)
    return Reply(got, ended=True)


def whole_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of each HTTP/2 frame in `data` that has arrived
    whole."""
    out, i = [], 0
    while i + 9 <= len(data):
        length = int.from_bytes(data[i : i + 3], "big")
        if i + 9 + length > len(data):
            break
        stream = int.from_bytes(data[i + 5 : i + 9], "big") & 0x7FFFFFFF
        out.append((data[i + 3], data[i + 4], stream, data[i + 9 : i + 9 + length]))
        i += 9 + length
    return out


def acks(received: list[tuple[int, int, int, bytes]]) -> list[bytes]:
    """The acknowledgements an HTTP/2 client owes for `received`: one per SETTINGS
    (type 4) and PING (type 6) frame that is not itself an acknowledgement (flag 0x1)."""
    return [
        frame(kind, 0x1, 0, body if kind == 6 else b"")
        for kind, flags, _, body in received
        if kind in (4, 6) and not flags & 0x1
    ]


def frames(data: bytes) -> list[tuple[int, int]]:
    """(type, stream id) of each HTTP/2 frame in a server's reply whose 9-byte header has
    arrived (its payload may still be on the way)."""
    out, i = [], 0
    while i + 9 <= len(data):
        length = int.from_bytes(data[i : i + 3], "big")
        out.append((data[i + 3], int.from_bytes(data[i + 5 : i + 9], "big") & 0x7FFFFFFF))
        i += 9 + length
    return out
