"""Frames between tapdraft and its vLLM worker: a 12-byte prefix (header length, payload length), a
JSON header, then ``payload`` raw bytes (a C-contiguous tensor's memory, dtype and shape in the header).

Standard library only: tapdraft's side and the worker's side (another venv, another torch) both import it.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

PREFIX = struct.Struct("<IQ")
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Tensor dtypes a frame may carry, with their item size."""


class Closed(ConnectionError):
    """The peer closed the connection (it exited, or was killed)."""


def send(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    payload = memoryview(payload).cast("B")  # bytes, however the buffer is shaped
    head = json.dumps(header).encode()
    sock.sendall(PREFIX.pack(len(head), len(payload)) + head)
    if len(payload):
        sock.sendall(payload)


def _exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise Closed("connection closed")
        got += k
    return buf


def recv(sock: socket.socket) -> tuple[dict[str, Any], bytearray]:
    """The next (header, payload); :class:`Closed` at a clean end of stream."""
    nh, npay = PREFIX.unpack(_exact(sock, PREFIX.size))
    header = json.loads(bytes(_exact(sock, nh)))
    return header, _exact(sock, npay) if npay else bytearray()


def connect(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(address)
    return s
