"""A command kvmem starts with its agent injected, and the agent's connection: what serve mode
(`harness.run.server_engine`) and `kvmem record` (`harness.record.recording`) share.

kvmem puts the agent (`harness.agent`) on the command's `PYTHONPATH` with the address and key of
a local listener; the agent connects back, says hello and answers commands with the rows it
sampled. The process gets its own session (so a Ctrl-C in kvmem's terminal reaches kvmem, which
decides), dies with the process that started it on Linux (`PR_SET_PDEATHSIG`), and `stop` ends
its whole process group, gently and then by force. Whatever goes wrong becomes a `ServerError`
with the tail of the process's output.

Where the command's children are followed (`kvmem record`), the listener stays open: the agent
of every other Python process the command starts connects to it too (`Followers`), each with
its own hello, and is closed with the command (a child that left the process group then kills
itself, its agent's connection gone).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from ..agent import kvmem_agent
from ..common.child import how
from ..common.lifeline import die_with_parent
from ..components.registry import SHIPPED
from .engines import RunFailure

AGENT_DIR = Path(kvmem_agent.__file__).parent
HOST = "127.0.0.1"
LOG_TAIL_LINES = 20
STOP_GRACE = 10.0  # seconds a process has to exit on SIGTERM before it is killed
HELLO_TIMEOUT = 10.0  # seconds a follower's agent has to say hello once connected


class ServerError(RunFailure):
    """The process did not start, died, or stopped answering; the message says how, with the
    tail of its output."""


@dataclass(frozen=True)
class AgentSettings:
    """What the agent inside reads: its period, the logical size and cap, plugins to import, and
    whether it follows the command's children."""

    period: float = 0.1
    logical: str | None = None
    cap: str | None = None
    plugins: tuple[str, ...] = ()
    follow: bool = False


class Agented:
    """One process started with the agent injected: `start` launches it and waits for the
    agent's hello, `ask` sends a command and returns the answer, `stop` ends it."""

    def __init__(self, command: list[str], env: dict[str, str], settings: AgentSettings,
                 log: Path, what: str = "the server"):
        self.command = command
        self.env = env
        self.settings = settings
        self.log = log
        self.what = what  # how messages name the process
        self.process: subprocess.Popen | None = None
        self.connection: Connection | None = None
        self.hello: dict[str, Any] = {}  # what the first agent said of its process
        self.followers: Followers | None = None  # the other processes' agents, where followed

    # -- starting ---------------------------------------------------------------------------

    def _environment(self, address: tuple[str, int], key: bytes) -> dict[str, str]:
        env = dict(self.env)
        paths = [str(AGENT_DIR)]
        if self.settings.plugins:  # resolved as components are: the current directory, then
            paths += [os.getcwd(), SHIPPED]  # the examples kvmem ships
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env.update({
            "PYTHONPATH": os.pathsep.join(paths),
            "KVMEM_AGENT": f"{address[0]}:{address[1]}",
            "KVMEM_AGENT_KEY": key.hex(),
            "KVMEM_AGENT_PERIOD": repr(self.settings.period),
            "KVMEM_AGENT_LOGICAL": self.settings.logical or "",
            "KVMEM_AGENT_CAP": self.settings.cap or "",
            "KVMEM_AGENT_PLUGINS": ",".join(self.settings.plugins),
            "KVMEM_AGENT_FOLLOW": "1" if self.settings.follow else "",  # kvmem_follow's FOLLOW
        })
        return env

    def start(self, deadline: float, timeout: float) -> None:
        """Launch the command and wait (until `deadline`, on the monotonic clock; `timeout` is
        how long that was, for messages) for its agent to connect and say hello."""
        key = os.urandom(32)
        listener = Listener((HOST, 0), authkey=key)
        try:
            with open(self.log, "wb") as log:
                try:
                    self.process = subprocess.Popen(
                        self.command, env=self._environment(listener.address, key),
                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=functools.partial(die_with_parent, os.getpid()))
                except OSError as exc:
                    raise ServerError(f"cannot start {self.what} {self.command[0]!r}: "
                                      f"{exc.strerror or exc}") from None
            self.connection = self._accept(listener, deadline, timeout)
        except BaseException:
            listener.close()
            raise
        if self.settings.follow:
            self.followers = Followers(listener)
        else:
            listener.close()

    def _accept(self, listener: Listener, deadline: float, timeout: float) -> Connection:
        """The agent's connection and its hello, while watching the process and the clock."""
        accepted: dict[str, Any] = {}

        def accept() -> None:
            with contextlib.suppress(OSError, EOFError):
                accepted["connection"] = listener.accept()

        waiter = threading.Thread(target=accept, name="kvmem-accept", daemon=True)
        waiter.start()
        while waiter.is_alive():
            waiter.join(0.1)
            self.check_alive("before its agent connected")
            if time.monotonic() > deadline:
                raise self.failure(
                    f"{self.what}'s agent did not connect within {timeout:g} s (kvmem samples "
                    "inside a Python process: is the command one, and does it keep the "
                    "environment kvmem gives it?)")
        if "connection" not in accepted:
            # A process that exits while its agent connects cuts the handshake short: say how
            # it exited, as for one that exited before connecting.
            self.check_alive("before its agent connected", wait=2.0)
            raise self.failure(f"{self.what}'s agent could not connect")
        connection: Connection = accepted["connection"]
        hello = self._receive(connection, deadline, "before its agent said hello")
        if hello.get("hello") != kvmem_agent.PROTOCOL:
            raise ServerError(f"{self.what}'s agent speaks protocol "
                              f"{hello.get('hello')!r}, not {kvmem_agent.PROTOCOL}")
        if hello.get("errors"):
            raise self.failure(f"the agent in {self.what} could not set up: "
                               + "; ".join(hello["errors"]))
        self.hello = hello
        return connection

    # -- talking to the agent -----------------------------------------------------------------

    def _receive(self, connection: Connection, deadline: float, when: str) -> dict:
        while not connection.poll(0.1):
            self.check_alive(when)
            if time.monotonic() > deadline:
                raise self.failure(f"{self.what}'s agent did not answer {when}")
        try:
            return connection.recv()
        except (EOFError, OSError):
            self.check_alive(when)
            raise self.failure(f"{self.what}'s agent hung up {when}") from None

    def ask(self, command: dict, when: str, timeout: float) -> dict:
        """One command to the agent and its answer (the rows it sampled since the last)."""
        assert self.connection is not None
        try:
            self.connection.send(command)
        except OSError:
            self.check_alive(when)
            raise self.failure(f"{self.what}'s agent hung up {when}") from None
        return self._receive(self.connection, time.monotonic() + timeout, when)

    # -- watching -----------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        assert self.process is not None, "started by start()"
        return self.process.pid

    def tail(self) -> str:
        """The last lines the process wrote (stdout and stderr together)."""
        try:
            lines = self.log.read_text("utf-8", "replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def failure(self, what: str) -> ServerError:
        tail = self.tail()
        return ServerError(f"{what}" + (f"; {self.what}'s last output:\n{tail}" if tail else
                                        f"; {self.what} wrote nothing"))

    def exited(self, wait: float = 0.0) -> int | None:
        """The process's exit status, waiting up to `wait` seconds for it; None while it runs."""
        assert self.process is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(wait)
        return self.process.poll()

    def check_alive(self, when: str, wait: float = 0.0) -> None:
        """Fail if the process has exited, waiting up to `wait` seconds for it to (a request
        cut short may be the first sign of a server on its way out)."""
        code = self.exited(wait)
        if code is not None:
            raise self.failure(f"{self.what} {how(code)} {when}")

    def stop(self) -> None:
        """Stop the agent and the process's whole group."""
        if self.connection is not None:
            with contextlib.suppress(OSError, EOFError):
                self.connection.send({"op": "stop"})
            self.connection.close()
        if self.process is not None:
            stop_group(self.process)
        if self.followers is not None:
            self.followers.close()


class Followers:
    """The agents of a followed command's other processes, accepted as they connect: `joined`
    hands over those new since it was last asked, each with its hello."""

    def __init__(self, listener: Listener):
        self.listener = listener
        self._lock = threading.Lock()
        self._new: list[tuple[Connection, dict[str, Any]]] = []
        self._all: list[Connection] = []
        self._closing = False
        self._thread = threading.Thread(target=self._accept, name="kvmem-followers", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                connection = self.listener.accept()
            except (OSError, EOFError, AuthenticationError):
                continue  # a caller that hung up or had the wrong key; or closing
            hello = None
            with contextlib.suppress(OSError, EOFError):
                if not self._closing and connection.poll(HELLO_TIMEOUT):
                    hello = connection.recv()
            with self._lock:
                self._all.append(connection)
                if isinstance(hello, dict) and hello.get("hello") == kvmem_agent.PROTOCOL:
                    self._new.append((connection, hello))

    def joined(self) -> list[tuple[Connection, dict[str, Any]]]:
        with self._lock:
            new, self._new = self._new, []
        return new

    def close(self) -> None:
        """Stop accepting (a connection of its own wakes the waiting `accept`) and hang up on
        every follower."""
        self._closing = True
        with contextlib.suppress(OSError):
            socket.create_connection(self.listener.address, timeout=1.0).close()
        self._thread.join(STOP_GRACE)
        self.listener.close()
        with self._lock:
            for connection in self._all:
                connection.close()
            self._all.clear()


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL after STOP_GRACE, and reap its leader."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        try:
            process.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    # The group may outlive its leader: whatever is left of it goes too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
