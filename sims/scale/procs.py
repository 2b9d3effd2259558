"""Memory and write accounting of a process tree, sampled from outside it.

A ``TreeSampler`` thread (in the parent, so the measured process pays nothing) reads every
``interval`` the resident set size and the bytes written of the root process and all its
descendants (an index's merge worker among them): through psutil when installed, else from
``/proc``. It keeps, per phase (set by the caller as the child announces them), the peak RSS of
the whole tree and of each process, and each process's bytes written (``write_bytes`` of
``/proc/PID/io``: bytes this process caused to be sent to the block device, page-cache writes
included when they are dirtied). Sampling misses spikes shorter than ``interval``: the child
also reports its own ``ru_maxrss`` (exact for itself; a forked child's starts at its parent's RSS
at the fork, before its exec, so the children's ``ru_maxrss`` is only an upper bound).

With ``cap_bytes`` set, the tree is killed (SIGKILL, by pid, descendants first) when its RSS
passes the cap, so a run on a shared machine can never take the memory of others: the run
records that it died over the cap, and in which phase.
"""

from __future__ import annotations

import os
import signal
import threading
import time

try:
    import psutil
except ImportError:  # pragma: no cover - /proc fallback
    psutil = None

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _descendants_proc(root: int) -> list[int]:
    """Pids below ``root``, from /proc (each process's parent in its stat line)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _sample_proc(pid: int) -> tuple[int, int] | None:
    """(rss bytes, write_bytes) of ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            rss = int(f.read().split()[1]) * _PAGE
        written = 0
        with open(f"/proc/{pid}/io", "rb") as f:
            for line in f:
                if line.startswith(b"write_bytes:"):
                    written = int(line.split()[1])
        return rss, written
    except (OSError, IndexError, ValueError):
        return None


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants (psutil if installed, else /proc)."""
    if psutil is not None:
        try:
            return [root, *(p.pid for p in psutil.Process(root).children(recursive=True))]
        except psutil.Error:
            return []
    return [root, *_descendants_proc(root)]


def sample(pid: int) -> tuple[int, int] | None:
    """(rss bytes, write_bytes) of one process, or None if it is gone."""
    if psutil is not None:
        try:
            process = psutil.Process(pid)
            with process.oneshot():
                return process.memory_info().rss, process.io_counters().write_bytes
        except psutil.Error:
            return None
    return _sample_proc(pid)


def kill_tree(root: int) -> None:
    """SIGKILL ``root``'s descendants, then ``root`` (all started by this run), by pid."""
    for pid in reversed(tree_pids(root)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class TreeSampler(threading.Thread):
    """Samples the process tree under ``root`` until ``stop()``; see the module docstring."""

    def __init__(self, root: int, interval: float = 0.05, cap_bytes: int | None = None):
        super().__init__(daemon=True, name="tree-sampler")
        self.root = root
        self.interval = interval
        self.cap_bytes = cap_bytes
        self.phase = "start"
        self.peak = 0  #: the whole tree's peak RSS over the run
        self.phase_peak: dict[str, int] = {}  #: phase -> the tree's peak RSS in it
        self.phase_process_peak: dict[str, dict[str, int]] = {}  #: phase -> role -> peak RSS
        self.process_peak: dict[str, int] = {}  #: role ("main", "child 1", ...) -> peak RSS over the run
        self.written: dict[int, int] = {}  #: pid -> the latest write_bytes seen
        self.phase_written: dict[str, int] = {}  #: phase -> bytes written by the tree in it (while sampled)
        self.killed_over_cap: str | None = None  #: the phase in which the tree passed the cap
        self._roles: dict[int, str] = {root: "main"}
        self._halt = threading.Event()

    def role(self, pid: int) -> str:
        """The main process is "main"; its descendants "worker 1", "worker 2"... in order of first sight."""
        role = self._roles.get(pid)
        if role is None:
            role = self._roles[pid] = f"worker {len(self._roles)}"
        return role

    def set_phase(self, phase: str) -> None:
        self.sample_once()  # close the previous phase with a fresh sample
        self.phase = phase

    def sample_once(self) -> int:
        phase, total, roles = self.phase, 0, {}
        written_delta = 0
        for pid in tree_pids(self.root):
            seen = sample(pid)
            if seen is None:
                continue
            rss, written = seen
            total += rss
            role = self.role(pid)
            roles[role] = roles.get(role, 0) + rss
            written_delta += max(0, written - self.written.get(pid, 0))
            self.written[pid] = written
        self.phase_written[phase] = self.phase_written.get(phase, 0) + written_delta
        self.peak = max(self.peak, total)
        self.phase_peak[phase] = max(self.phase_peak.get(phase, 0), total)
        per = self.phase_process_peak.setdefault(phase, {})
        for role, rss in roles.items():
            per[role] = max(per.get(role, 0), rss)
            self.process_peak[role] = max(self.process_peak.get(role, 0), rss)
        return total

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            total = self.sample_once()
            if self.cap_bytes is not None and total > self.cap_bytes and self.killed_over_cap is None:
                self.killed_over_cap = self.phase
                kill_tree(self.root)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)
