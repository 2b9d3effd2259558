"""Code run in child processes by the storage tests (``python -m tests.storage_workers ...``)."""

from __future__ import annotations

import sys
import time

from storage_adapters import RollingSegment, open_storage


def pattern(offset: int, length: int) -> bytes:
    """The bytes ``churn`` writes at ``[offset, offset + length)``: each byte names its offset."""
    return bytes((offset + i) % 251 for i in range(length))


def churn(root: str, name: str, seconds: float, rolling_size: int) -> None:
    """Append pattern bytes and truncate close behind the end, in a loop, for ``seconds``."""
    seg = RollingSegment(open_storage(root), name, rolling_size=rolling_size)
    deadline, step = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        length = seg.length
        seg.append(pattern(length, 5 + step % 23), expected_offset=length)
        if step % 3 == 0:
            seg.truncate(max(seg.start_offset, seg.length - 8))
        step += 1
    print(step, flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "churn":
        churn(args[0], args[1], float(args[2]), int(args[3]))
    else:
        raise SystemExit(f"unknown command {command!r}")
