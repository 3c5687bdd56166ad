#!/usr/bin/env python3
"""Times each page of a whole LIST on one raw connection to a broker.

    python3 benches/scale/list_pages.py 127.0.0.1:7401 [SELECTOR]

Sends LIST (PROTOCOL §9.3) page after page, each after the last name of
the one before, and prints how many pages and journals came back and the
median and largest time per page, from the request's send to the whole
reply parsed, in ms. A page's time is mostly the answering shard's work
on it: the broker builds it on the shard the connection reached.
"""
import json
import socket
import struct
import sys
import time

MAGIC = int.from_bytes(b"RT", "little")
HEADER = "<IHBBHHQI"  # body_len, magic, op, flags, status, meta_len, id, reserved
OP_LIST = 0x11
NEXT_PAGE = 1 << 1


def recv_exact(s, n):
    b = bytearray()
    while len(b) < n:
        chunk = s.recv(n - len(b))
        if not chunk:
            raise EOFError("the broker closed the connection")
        b += chunk
    return bytes(b)


def main():
    host, port = sys.argv[1].rsplit(":", 1)
    selector = sys.argv[2] if len(sys.argv) > 2 else ""
    s = socket.create_connection((host, int(port)))
    after, times, total, request = "", [], 0, 1
    while True:
        body = {"selector": selector}
        if after:
            body["after"] = after
        payload = json.dumps(body).encode()
        started = time.perf_counter()
        s.sendall(struct.pack(HEADER, len(payload), MAGIC, OP_LIST, 0, 0, 0, request, 0) + payload)
        body_len, _, _, flags, status, meta_len, _, _ = struct.unpack(HEADER, recv_exact(s, 24))
        reply = recv_exact(s, body_len)
        if status != 0:
            sys.exit(f"LIST answered status {status}: {reply[meta_len:].decode(errors='replace')}")
        entries = json.loads(reply[meta_len:])
        times.append((time.perf_counter() - started) * 1e3)
        total += len(entries)
        request += 1
        if not (flags & NEXT_PAGE and entries):
            break
        after = entries[-1]["spec"]["name"]
    times.sort()
    print(f"pages {len(times)} journals {total} "
          f"median {times[len(times) // 2]:.1f} ms max {times[-1]:.1f} ms")


if __name__ == "__main__":
    main()
