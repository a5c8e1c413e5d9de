"""Bytes for wire-level fuzzing: protobuf fields by hand, and HTTP/2 frames and gRPC
calls by hand (HPACK literals only), to send what no well-behaved client would.

`JUNK` names the payloads `test_fuzz.py` writes on raw TCP connections; `send_junk`
writes one and returns what the server said back; `frames` lists (type, stream) of the
HTTP/2 frames in that reply.
"""

from __future__ import annotations

import socket
import struct
import time


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


def send_junk(address: str, payload: bytes, window_s: float = 15.0) -> bytes:
    """Write `payload` on a fresh TCP connection; return what came back before the server
    hung up, answered stream 1 (a HEADERS or RST_STREAM frame) or `window_s` passed.

    Why a long window that usually ends early: on a host busy with other suites, a
    server took over 3 s (the old fixed window) to answer, and the test read silence."""
    host, port = address.rsplit(":", 1)
    got = b""
    deadline = time.monotonic() + window_s
    with socket.create_connection((host, int(port)), timeout=window_s) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while not {(1, 1), (3, 1)} & set(frames(got)):
                sock.settimeout(max(deadline - time.monotonic(), 0.01))
                if not (chunk := sock.recv(65536)):
                    break
                got += chunk
        except (TimeoutError, OSError):  # hung up on us mid-way: a fine answer to junk
            pass
    return got


def frames(data: bytes) -> list[tuple[int, int]]:
    """(type, stream id) of each HTTP/2 frame in a server's reply whose 9-byte header has
    arrived (its payload may still be on the way)."""
    out, i = [], 0
    while i + 9 <= len(data):
        length = int.from_bytes(data[i : i + 3], "big")
        out.append((data[i + 3], int.from_bytes(data[i + 5 : i + 9], "big") & 0x7FFFFFFF))
        i += 9 + length
    return out
