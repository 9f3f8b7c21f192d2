"""Python code from a model's turn, run where it can do no harm.

Two isolations (``environment.sandbox.isolation``):

- **bwrap** (Debian's ``bubblewrap``, used where it is installed and works): the code runs in new user, PID,
  network, IPC and UTS namespaces, with the whole file system mounted read-only but for its scratch folder and a
  private ``/tmp``; no network device at all; killing the sandbox kills every process in it.
- **rlimits** (only when chosen: ``isolation: rlimits``): no namespaces. The code runs as its own process group in
  a scratch folder, and a Python audit hook installed before it runs refuses sockets, new processes, ``ctypes``, the
  modules that start processes without an audit event (``_posixsubprocess``) and any open for writing outside the
  scratch folder. That is a refusal inside the interpreter, not a kernel boundary: the host's files are readable, its
  processes visible, and code that finds a way around Python's audit events is held only by the limits below. It is
  for code you trust (your own tests, a model on a machine of its own), never chosen for you: ``auto`` without a
  working bwrap refuses to start, with one line that says why.

Both apply the kernel's resource limits to every process of the sandbox: CPU seconds (``RLIMIT_CPU``), address space
(``RLIMIT_AS``), bytes written to any file, its output included (``RLIMIT_FSIZE``: a write past
``output_bytes`` fails), open files, and, where the service runs as root, processes: each run then runs as an
unprivileged user of its own (one uid per run in flight, :class:`_RunUsers`), so that ``RLIMIT_NPROC``, which the
kernel counts per user, bounds that run alone, and one run's fork bomb cannot starve the runs beside it. A wall-clock
limit kills what is left; after each run every process of its user is killed, and what it leaves is reaped: the
service is its processes' subreaper, as a container's init may not reap (``bwrap``'s own child outlives it as a
zombie, one per run, which counted against the user's processes until none could start). Whatever happens, the
caller gets a :class:`RunResult` that says it; nothing raises.

What the code sees under bwrap: the interpreter and the system's libraries (``/usr`` and its links, read-only), its
own scratch folder (its working directory and home), an empty ``/tmp``, ``/dev`` and its own ``/proc``; nothing else
of the host: not the service's files, the run directories, other users' homes or ``/etc``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from common.config import SandboxSection

log = logging.getLogger(__name__)

__all__ = ["RunResult", "Sandbox", "bwrap_available"]

PR_SET_CHILD_SUBREAPER = 36  # prctl(2)
Status = Literal["ok", "error", "timeout", "cpu_limit", "output_limit", "killed", "unavailable"]


@dataclass(frozen=True)
class RunResult:
    """What a sandboxed run gave: its output (stdout and stderr as one, cut at the limit) and how it ended."""

    status: Status
    output: str
    exit_code: int | None
    seconds: float

    def observation(self) -> str:
        """What the model reads back: the output, and a line that says why the run ended when it did not end well."""
        why = {
            "ok": "",
            "error": f"[exit code {self.exit_code}]",
            "timeout": "[stopped: wall-clock limit]",
            "cpu_limit": "[stopped: CPU time limit]",
            "output_limit": "[output cut: output limit]",
            "killed": f"[killed by signal {self.exit_code}]",
            "unavailable": "[the sandbox could not start]",
        }[self.status]
        return "\n".join(part for part in (self.output.rstrip("\n"), why) if part)


# The fallback's guard, run before the code in the same interpreter: Python's audit events for what the sandbox
# refuses. An audit hook cannot be removed once added.
_GUARD = textwrap.dedent(
    """
    import os, sys
    _scratch = os.path.realpath(os.getcwd())
    _refused = ("socket.", "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                "os.kill", "os.killpg", "subprocess.", "ctypes.", "pty.", "os.chdir", "os.chroot", "os.setuid")
    _write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def _inside(path):
        if isinstance(path, int):
            return True
        full = os.path.realpath(os.path.join(_scratch, os.fsdecode(path)))
        return full == _scratch or full.startswith(_scratch + os.sep)

    def _guard(event, args):
        if event.startswith(_refused) and event not in ("socket.getaddrinfo", "socket.gethostname"):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in ("_posixsubprocess", "_ctypes", "_socket"):
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & _write_flags)
            if writes and not _inside(path):
                raise PermissionError(f"sandbox: writing outside the scratch folder ({path!r}) is not allowed")
        if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.truncate",
                     "os.chmod", "os.chown", "shutil.rmtree") and not all(_inside(a) for a in args[:2]
                                                                             if isinstance(a, (str, bytes))):
            raise PermissionError(f"sandbox: {event} outside the scratch folder is not allowed")

    sys.addaudithook(_guard)
    del _guard
    """
)


def _python(configured: str | None) -> str:
    """The interpreter that runs the code: the configured one, else the system's (readable by a run's user, which a
    virtual environment under /root is not), else this one."""
    if configured:
        return configured
    return "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


def _limits(cfg: SandboxSection, uid: int | None):
    """The child's setup between fork and exec: its own session, the resource limits, then (as root) the run's own
    unprivileged user, ``uid``, whose processes RLIMIT_NPROC counts."""

    def apply() -> None:
        os.setsid()
        cpu = max(1, int(cfg.cpu_seconds))
        for limit, value in (
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_AS, (cfg.memory_mb << 20,) * 2),
            (resource.RLIMIT_FSIZE, (cfg.output_bytes,) * 2),
            (resource.RLIMIT_NOFILE, (64, 64)),
            (resource.RLIMIT_CORE, (0, 0)),
        ):
            resource.setrlimit(limit, value)
        if uid is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (cfg.processes, cfg.processes))
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return apply


# The system's files an interpreter needs, read-only: /usr (and where /bin, /lib... link into it, or are folders).
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def _bwrap_command(scratch: Path, python: str, script: str) -> list[str]:
    system = []
    for path in _SYSTEM:
        if os.path.islink(path):
            system += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            system += ["--ro-bind", path, path]
    prefix = Path(os.path.realpath(python)).parent.parent  # an interpreter installed elsewhere: its whole prefix
    if not str(prefix).startswith(tuple(p + "/" for p in _SYSTEM)) and str(prefix) not in _SYSTEM:
        system += ["--ro-bind", str(prefix), str(prefix)]
    return [
        "bwrap",
        *system,
        "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
        "--dev", "/dev",
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        "--bind", str(scratch), str(scratch),
        "--chdir", str(scratch),
        "--unshare-all",  # user, pid, net, ipc, uts, cgroup: no network device but loopback, which is down
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--setenv", "PATH", "/usr/bin:/bin",
        "--setenv", "HOME", str(scratch),
        "--",
        python, "-I", "-S", script,
    ]  # fmt: skip


class _RunUsers:
    """Unprivileged users for the runs in flight, one each (as root): a run's processes are its user's alone, so that
    RLIMIT_NPROC bounds the run, and every process left of it can be found and killed. Each process of the machine
    takes its own block of 64 (by its pid), so that replicas on one machine do not share users."""

    BASE, BLOCK = 200_000, 64

    def __init__(self):
        self.lock = threading.Lock()
        self.free = list(range(self.BLOCK - 1))  # the block's last is the probe's (probe_uid)
        self.first = self.BASE + (os.getpid() % 1000) * self.BLOCK

    @classmethod
    def probe_uid(cls) -> int:
        """The user bwrap_available's probe runs as: this process's own (two processes probing at once, with one
        user between them, each killed the other's probe as it ended its own, and one found bwrap not working)."""
        return cls.BASE + (os.getpid() % 1000) * cls.BLOCK + cls.BLOCK - 1

    def take(self) -> int | None:
        with self.lock:
            return self.first + self.free.pop(0) if self.free else None

    def give_back(self, uid: int) -> None:
        _end_processes_of(uid)
        with self.lock:
            self.free.append(uid - self.first)


def _end_processes_of(uid: int) -> None:
    """Kill every process of ``uid`` (what a run left), and reap those that are this process's children (orphans
    reparented to it, its subreaper)."""
    me = os.getpid()
    for stat in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in stat.read_text().splitlines() if ":\t" in line)
        except OSError:  # it ended meanwhile
            continue
        if int(fields.get("Uid", "-1").split()[0]) != uid:
            continue
        pid = int(stat.parent.name)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        if int(fields.get("PPid", "0")) == me:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _become_subreaper() -> None:
    """Orphans of this process's descendants come to it, not to the machine's init (which in a container may reap
    nothing): it reaps what its sandbox runs leave (``_end_processes_of``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError) as exc:  # not Linux: nothing to reap by hand there
        log.debug("sandbox: not a subreaper: %s", exc)


@cache
def bwrap_available() -> str | None:
    """None where ``bwrap`` is installed and can make its namespaces here (as this user, and as a run's user when
    this is root); else why not."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed"
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        script = scratch / "probe.py"
        script.write_text("print('ok')")
        scratch.chmod(0o755)
        script.chmod(0o644)
        probe = SandboxSection(isolation="bwrap", cpu_seconds=5, wall_seconds=20)
        uid = _RunUsers.probe_uid() if os.geteuid() == 0 else None  # a user of its own, as runs have
        try:
            done = subprocess.run(
                _bwrap_command(scratch, _python(None), str(script)),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=probe.wall_seconds,
                preexec_fn=_limits(probe, uid),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return f"bwrap did not start: {exc}"
        finally:
            if uid is not None:
                _end_processes_of(uid)
    if done.returncode != 0 or done.stdout.strip() != b"ok":
        return f"bwrap cannot make its namespaces here: {done.stderr.decode(errors='replace').strip()[:300]}"
    return None


class Sandbox:
    """Runs Python code under ``cfg``'s limits, in ``cfg.isolation`` (auto: bwrap where it works)."""

    def __init__(self, cfg: SandboxSection):
        self.cfg = cfg
        self.python = _python(cfg.python)
        self.users = _RunUsers() if os.geteuid() == 0 else None  # as root: each run a user of its own
        if self.users is not None:
            _become_subreaper()
        if cfg.isolation == "rlimits":
            self.isolation = "rlimits"
        else:
            why = bwrap_available()
            if why is not None:
                # Never the escapable fallback unasked: code from a model is untrusted.
                raise RuntimeError(
                    f"environment.sandbox.isolation is {cfg.isolation}, but {why}: a model's Python code is not run "
                    "without namespaces. Install Debian's bubblewrap (make setup does, as root), or choose "
                    "isolation: rlimits on purpose (resource limits and an audit hook only: docs/episodes.md)"
                )
            self.isolation = "bwrap"

    def run_python(self, code: str) -> RunResult:
        """Run ``code`` as a script; its output and how it ended."""
        started = time.monotonic()
        uid = self.users.take() if self.users is not None else None
        if self.users is not None and uid is None:
            return RunResult("unavailable", "every sandbox user is busy", None, 0.0)
        try:
            return self._run(code, uid, started)
        finally:
            if uid is not None:
                self.users.give_back(uid)  # every process it left killed and reaped

    def _run(self, code: str, uid: int | None, started: float) -> RunResult:
        with tempfile.TemporaryDirectory(prefix="streamppo-sandbox-") as folder:
            scratch, output = Path(folder) / "scratch", Path(folder) / "output"
            Path(folder).chmod(0o711)  # the run's user may pass through to its scratch folder, and see nothing else
            scratch.mkdir()
            script = scratch / "main.py"
            guard = _GUARD if self.isolation == "rlimits" else ""
            script.write_text(guard + "\n" + code)
            if uid is not None:
                os.chown(scratch, uid, uid)
                os.chown(script, uid, uid)
            if self.isolation == "bwrap":
                command = _bwrap_command(scratch, self.python, str(script))
            else:
                command = [self.python, "-I", "-S", str(script)]
            with output.open("wb") as sink:
                try:
                    process = subprocess.Popen(
                        command,
                        stdin=subprocess.DEVNULL,
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        cwd=scratch,
                        env={"PATH": "/usr/bin:/bin", "HOME": str(scratch)},
                        preexec_fn=_limits(self.cfg, uid),
                    )
                except OSError as exc:
                    return RunResult("unavailable", str(exc), None, time.monotonic() - started)
                timed_out = False
                try:
                    code_ = process.wait(timeout=self.cfg.wall_seconds)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _kill_group(process)
                    code_ = process.wait()
            with output.open("rb") as produced:
                text = produced.read(self.cfg.output_bytes).decode(errors="replace")
            # Python ignores SIGXFSZ: a write past the limit fails (EFBIG) and the code ends as it handles that.
            full = output.stat().st_size >= self.cfg.output_bytes
        seconds = time.monotonic() - started
        return RunResult("output_limit" if full else self._status(code_, timed_out), text, code_, seconds)

    def _status(self, code: int, timed_out: bool) -> Status:
        if timed_out:
            return "timeout"
        # A signal: negative from Popen; bwrap passes a signalled child on as 128 + the signal.
        signalled = -code if code < 0 else code - 128 if self.isolation == "bwrap" and code > 128 else None
        if signalled == signal.SIGXCPU:
            return "cpu_limit"
        if signalled == signal.SIGXFSZ:
            return "output_limit"
        if signalled is not None:
            return "killed"
        return "ok" if code == 0 else "error"


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the sandbox's process group (bwrap: its PID namespace dies with it)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
