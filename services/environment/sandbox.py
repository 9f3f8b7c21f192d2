"""Python code from a model's turn, run where it can do no harm.

Two isolations (``environment.sandbox.isolation``):

- **bwrap** (Debian's ``bubblewrap``, used where it is installed and works): the code runs in new user, PID,
  network, IPC and UTS namespaces, with the whole file system mounted read-only but for its scratch folder and a
  private ``/tmp``; no network device at all; killing the sandbox kills every process in it.
- **rlimits** (the fallback): no namespaces. The code runs as its own process group in a scratch folder, and a
  Python audit hook installed before it runs refuses sockets, new processes, ``ctypes`` and any open for writing
  outside the scratch folder. That is a refusal inside the interpreter, not a kernel boundary: code that finds a way
  around Python's audit events is held only by the limits below.

Both apply the kernel's resource limits to every process of the sandbox: CPU seconds (``RLIMIT_CPU``), address space
(``RLIMIT_AS``), bytes written to any file, its output included (``RLIMIT_FSIZE``: a write past
``output_bytes`` fails), open files, and, where the service runs as root and so can run the code as the
unprivileged ``nobody``, processes (``RLIMIT_NPROC``, which the kernel does not apply to root). A wall-clock limit
kills what is left. Whatever happens, the caller gets a :class:`RunResult` that says it; nothing raises.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from common.config import SandboxSection

log = logging.getLogger(__name__)

__all__ = ["RunResult", "Sandbox", "bwrap_available"]

NOBODY = 65534
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
    """The interpreter that runs the code: the configured one, else the system's (readable by ``nobody``, which a
    virtual environment under /root is not), else this one."""
    if configured:
        return configured
    return "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


def _limits(cfg: SandboxSection, drop_to_nobody: bool):
    """The child's setup between fork and exec: its own session, the resource limits, then (as root) ``nobody``."""

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
        if drop_to_nobody:
            resource.setrlimit(resource.RLIMIT_NPROC, (cfg.processes, cfg.processes))
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)

    return apply


def _bwrap_command(scratch: Path, python: str, script: str) -> list[str]:
    return [
        "bwrap",
        "--ro-bind", "/", "/",
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


@cache
def bwrap_available() -> str | None:
    """None where ``bwrap`` is installed and can make its namespaces here (as this user, and as ``nobody`` when
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
        try:
            done = subprocess.run(
                _bwrap_command(scratch, _python(None), str(script)),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=probe.wall_seconds,
                preexec_fn=_limits(probe, os.geteuid() == 0),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return f"bwrap did not start: {exc}"
    if done.returncode != 0 or done.stdout.strip() != b"ok":
        return f"bwrap cannot make its namespaces here: {done.stderr.decode(errors='replace').strip()[:300]}"
    return None


class Sandbox:
    """Runs Python code under ``cfg``'s limits, in ``cfg.isolation`` (auto: bwrap where it works)."""

    def __init__(self, cfg: SandboxSection):
        self.cfg = cfg
        self.python = _python(cfg.python)
        self.as_nobody = os.geteuid() == 0
        if cfg.isolation == "rlimits":
            self.isolation = "rlimits"
        else:
            why = bwrap_available()
            if why is not None and cfg.isolation == "bwrap":
                raise RuntimeError(f"environment.sandbox.isolation is bwrap, but {why}")
            if why is not None:
                log.warning("sandbox: %s; Python code runs with resource limits and an audit hook only", why)
            self.isolation = "bwrap" if why is None else "rlimits"

    def run_python(self, code: str) -> RunResult:
        """Run ``code`` as a script; its output and how it ended."""
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="streamppo-sandbox-") as folder:
            scratch, output = Path(folder) / "scratch", Path(folder) / "output"
            Path(folder).chmod(0o711)  # nobody may pass through to its scratch folder, and see nothing else
            scratch.mkdir()
            script = scratch / "main.py"
            guard = _GUARD if self.isolation == "rlimits" else ""
            script.write_text(guard + "\n" + code)
            if self.as_nobody:
                os.chown(scratch, NOBODY, NOBODY)
                os.chown(script, NOBODY, NOBODY)
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
                        preexec_fn=_limits(self.cfg, self.as_nobody),
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
