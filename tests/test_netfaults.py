"""A peer whose host goes silent: it crashed, lost its network, or a partition drops its
packets. Nothing tells the survivors (no FIN, no RST), so only TRIORING_PEER_TIMEOUT does:
every survivor must raise PeerFailedError naming the silent rank within the timeout and one
check interval (see transports/_liveness.py), and never for a peer that is merely stopped.

The worlds run in network namespaces on one bridge (tests/netns.py: needs root, iproute2 and
iptables), one rank per namespace, over TCP, with a timeout of PEER_TIMEOUT seconds so that
the tests stay short. The unit tests at the end need none of that.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import pytest
import trio

from netns import Hosts, open_hosts
from trioring import _rendezvous
from trioring._config import peer_timeout
from trioring._errors import ConfigurationError
from trioring.transports import TcpTransport, TransportContext
from trioring.transports._liveness import check_interval, keepalive_settings, unanswered_seconds

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

WORKER = os.path.join(os.path.dirname(__file__), "workers", "netfault_worker.py")
#: The TRIORING_PEER_TIMEOUT of the worlds below, in seconds.
PEER_TIMEOUT = 3
#: The documented bound (transports/_liveness.py) plus slack for a loaded test machine and
#: for the abort frames that carry the news to the ranks that do not notice themselves.
DETECTION_BOUND = PEER_TIMEOUT + check_interval(PEER_TIMEOUT) + 1.0
#: Bound on any wait for a worker's marker file or exit.
WAIT_S = 30.0
ELEMENTS_1MIB = 1 << 18  # float32s
#: With the stopped rank's receive buffers capped at SMALL_RMEM, far more than they hold.
ELEMENTS_32MIB = 1 << 23
SMALL_RMEM = 1 << 20
MASTER_PORT = "29791"


class Ranks:
    """The worker processes of one test, each in its host's namespace, and their files."""

    def __init__(self, hosts: Hosts, out_dir: Path) -> None:
        self.hosts = hosts
        self.out_dir = out_dir
        self.processes: dict[int, subprocess.Popen[str]] = {}
        self.secret = secrets.token_hex(32)

    def env(self, rank: int, world_size: int, **extra: str) -> dict[str, str]:
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("TRIORING_", "MASTER_", "OMPI_", "PMI", "SLURM_"))
            and key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        }
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR=self.hosts.address(0),
            MASTER_PORT=MASTER_PORT,
            TRIORING_TRANSPORT="tcp",
            TRIORING_SECRET=self.secret,
            TRIORING_PEER_TIMEOUT=str(PEER_TIMEOUT),
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    def start(self, index: int, scenario: str, *args: str, env: dict[str, str]) -> None:
        log = (self.out_dir / f"w{index}.log").open("w")
        with log:
            self.processes[index] = self.hosts.popen(
                index,
                [sys.executable, WORKER, scenario, str(self.out_dir), str(index), *args],
                env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def start_world(self, size: int, scenario: str, *args: str, **extra: str) -> None:
        for rank in range(size):
            self.start(rank, scenario, *args, env=self.env(rank, size, **extra))

    def log(self, index: int) -> str:
        """The end of worker ``index``'s output, and its report."""
        texts = []
        for name in (f"w{index}.log", f"w{index}.json"):
            try:
                texts.append((self.out_dir / name).read_text(errors="replace")[-4000:])
            except FileNotFoundError:
                texts.append(f"(no {name})")
        return "\n".join(texts)

    def wait_for(self, marker: str, indices: list[int]) -> None:
        """Wait until every worker in ``indices`` has created ``marker``; fail if one exits
        first or after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while True:
            missing = [i for i in indices if not (self.out_dir / f"w{i}.{marker}").exists()]
            if not missing:
                return
            for index in missing:
                if self.processes[index].poll() is not None:
                    pytest.fail(f"worker {index} exited before {marker!r}:\n{self.log(index)}")
            if time.monotonic() > deadline:
                pytest.fail(f"workers {missing} did not create {marker!r} within {WAIT_S} s")
            time.sleep(0.01)

    def finish(self, indices: list[int], timeout: float = WAIT_S) -> list[dict[str, Any]]:
        """Wait for the workers in ``indices`` to exit with status 0; their reports."""
        deadline = time.monotonic() + timeout
        reports = []
        for index in indices:
            try:
                code = self.processes[index].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {index} still running after {timeout} s:\n{self.log(index)}")
            assert code == 0, f"worker {index} exited with {code}:\n{self.log(index)}"
            report: dict[str, Any] = json.loads((self.out_dir / f"w{index}.json").read_text())
            reports.append(report)
        return reports

    def signal(self, index: int, signum: int) -> None:
        self.processes[index].send_signal(signum)

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()  # SIGKILL ends a stopped process too
            process.wait(WAIT_S)


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Ranks]:
    with open_hosts(3) as hosts:
        world = Ranks(hosts, tmp_path)
        try:
            yield world
        finally:
            world.close()


def failure(report: dict[str, Any], step: str, fault_at: float) -> tuple[dict[str, Any], float]:
    """The error that ``step`` raised and how many seconds after the fault it did."""
    record = report["steps"][step]
    error = record["error"]
    assert error is not None, f"rank {report['index']}: {step} raised nothing: {record}"
    return error, record["t1"] - fault_at


def in_namespace(hosts: Hosts, index: int, *argv: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", hosts.names[index], *argv],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout


def queues(hosts: Hosts, index: int) -> list[tuple[int, int, str]]:
    """(Recv-Q, Send-Q, peer address) of every established TCP socket in host ``index``."""
    out = in_namespace(hosts, index, "ss", "-Htn", "state", "established")
    # With one state asked for, ss leaves the State column out.
    rows = [line.split() for line in out.splitlines() if line.strip()]
    return [(int(row[0]), int(row[1]), row[-1]) for row in rows]


def established_to(hosts: Hosts, index: int, address: str) -> bool:
    return any(peer == address for _, _, peer in queues(hosts, index))


def window_closed(hosts: Hosts, index: int) -> bool:
    """Whether host ``index`` holds a full receive buffer while a peer has data queued for
    it that its window does not admit: the peer's kernel is sending it window probes."""
    held = max((recv for recv, _, _ in queues(hosts, index)), default=0)
    address = hosts.address(index)
    waiting = [
        send
        for other in range(len(hosts.names))
        if other != index
        for _, send, peer in queues(hosts, other)
        if peer.startswith(f"{address}:")
    ]
    return held >= SMALL_RMEM // 2 and max(waiting, default=0) > 0


def poll(condition: Any, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def assert_names(error: dict[str, Any], peers: set[int]) -> None:
    assert error["type"] == "PeerFailedError", error
    assert error["peer"] in peers, error
    # Worded as what happened, directly or in the news relayed by a peer.
    assert "unreachable" in error["message"], error
    assert "TRIORING_PEER_TIMEOUT" in error["message"], error


# -- the host of a rank crashes ---------------------------------------------------------------


def test_host_crash_every_survivor_names_the_dead_rank(ranks: Ranks) -> None:
    ranks.start_world(3, "loop", str(ELEMENTS_1MIB))
    ranks.wait_for("looping", [0, 1, 2])
    fault_at = time.monotonic()
    # Power lost: the network first (its kernel can send nothing more), then the process.
    ranks.hosts.link_down(2)
    ranks.signal(2, signal.SIGKILL)
    for report in ranks.finish([0, 1], timeout=DETECTION_BOUND + WAIT_S):
        error, after = failure(report, "loop", fault_at)
        assert_names(error, {2})
        print(f"rank {report['index']} raised {after:.2f} s after the crash: {error['message']}")
        assert after <= DETECTION_BOUND, (after, error)


def test_host_crash_during_messages_every_survivor_raises(ranks: Ranks) -> None:
    """Ranks pass messages round a ring (sendrecv) when rank 2's host crashes: rank 0,
    whose receive waits on rank 2, raises PeerFailedError naming rank 2 within the bound
    (the connection's reader notices the silence, not a collective); rank 1, whose sends
    go to rank 2, raises within it too, naming rank 2 or rank 0 (which left once it
    raised). Nobody hangs."""
    ranks.start_world(3, "messages")
    ranks.wait_for("looping", [0, 1, 2])
    fault_at = time.monotonic()
    ranks.hosts.link_down(2)
    ranks.signal(2, signal.SIGKILL)
    reports = {
        report["index"]: report for report in ranks.finish([0, 1], timeout=DETECTION_BOUND + WAIT_S)
    }
    error, after = failure(reports[0], "messages", fault_at)
    assert_names(error, {2})
    assert after <= DETECTION_BOUND, (after, error)
    error, after = failure(reports[1], "messages", fault_at)
    assert error["type"] == "PeerFailedError", error
    assert error["peer"] in (0, 2), error
    assert after <= DETECTION_BOUND, (after, error)


# -- a partition: rank 2's host drops every packet, both ways ------------------------------


def test_partition_every_rank_names_one_on_the_other_side(ranks: Ranks) -> None:
    ranks.start_world(3, "loop", str(ELEMENTS_1MIB))
    ranks.wait_for("looping", [0, 1, 2])
    fault_at = time.monotonic()
    ranks.hosts.partition(2)
    reports = ranks.finish([0, 1, 2], timeout=DETECTION_BOUND + WAIT_S)
    for report in reports:
        error, after = failure(report, "loop", fault_at)
        assert_names(error, {2} if report["index"] < 2 else {0, 1})
        print(f"rank {report['index']} raised {after:.2f} s after the partition")
        assert after <= DETECTION_BOUND, (after, error)


# -- a stopped rank is alive: its kernel answers ------------------------------------------------


@pytest.mark.parametrize(
    "elements", [ELEMENTS_1MIB, ELEMENTS_32MIB], ids=["1MiB", "32MiB-receive-buffer-full"]
)
def test_stopped_rank_is_waited_for(ranks: Ranks, elements: int) -> None:
    # Receive buffers as small as many systems have (this one's grow to 32 MiB).
    in_namespace(ranks.hosts, 2, "sysctl", "-qw", f"net.ipv4.tcp_rmem=4096 131072 {SMALL_RMEM}")
    ranks.start_world(3, "loop", str(elements))
    ranks.wait_for("looping", [0, 1, 2])
    stopped_at = time.monotonic()
    ranks.signal(2, signal.SIGSTOP)
    if elements == ELEMENTS_32MIB:
        # The point of this case: the peers' data fills rank 2's receive buffers, so that its
        # kernel answers their window probes with a closed window until it reads again.
        poll(lambda: window_closed(ranks.hosts, 2), "rank 2's receive window to close", 10)
    # The fault itself is a duration: well past the timeout, then the rank goes on.
    time.sleep(max(0.0, stopped_at + 2.5 * PEER_TIMEOUT - time.monotonic()))
    if elements == ELEMENTS_32MIB:
        assert window_closed(ranks.hosts, 2)
    ranks.signal(2, signal.SIGCONT)
    (ranks.out_dir / "finish").touch()
    reports = ranks.finish([0, 1, 2])
    for report in reports:
        assert report["steps"]["loop"]["error"] is None, report
    assert len({report["iterations"] for report in reports}) == 1, reports


# -- rendezvous ---------------------------------------------------------------------------------


def test_connect_to_a_silent_host_is_bounded(ranks: Ranks) -> None:
    ranks.hosts.iptables(1, "-A", "INPUT", "-j", "DROP")  # every SYN vanishes
    address = f"{ranks.hosts.address(1)}:{MASTER_PORT}"
    env = ranks.env(0, 1, NETFAULT_HANG_S="20")
    ranks.start(0, "connect", address, str(PEER_TIMEOUT), env=env)
    (report,) = ranks.finish([0])
    record = report["steps"]["connect"]
    assert record["error"] is not None
    assert record["error"]["type"] == "TimeoutError", record
    assert "TRIORING_PEER_TIMEOUT" in record["error"]["message"]
    print(f"connect gave up after {record['elapsed']:.2f} s")
    assert PEER_TIMEOUT <= record["elapsed"] <= PEER_TIMEOUT + 1.0, record


def test_rendezvous_host_crash_while_a_rank_waits_for_the_table(ranks: Ranks) -> None:
    # Rank 2 never comes: rank 1 has said hello and waits for rank 0's address table when
    # rank 0's host dies.
    for rank in (0, 1):
        ranks.start(rank, "open", env=ranks.env(rank, 3))
    master = f"{ranks.hosts.address(0)}:{MASTER_PORT}"
    poll(lambda: established_to(ranks.hosts, 1, master), "rank 1's connection to rank 0")
    fault_at = time.monotonic()
    ranks.hosts.link_down(0)
    ranks.signal(0, signal.SIGKILL)
    (report,) = ranks.finish([1], timeout=DETECTION_BOUND + WAIT_S)
    error, after = failure(report, "open", fault_at)
    assert error["type"] == "RendezvousError", error
    assert error["peer"] == 0, error
    assert "TRIORING_PEER_TIMEOUT" in error["message"], error
    print(f"rank 1 raised {after:.2f} s after rank 0's host crashed")
    assert after <= DETECTION_BOUND, (after, error)


# -- units: the setting and the socket options it leads to -----------------------------------


def test_peer_timeout_setting() -> None:
    assert peer_timeout({}) == 30.0
    assert peer_timeout({"TRIORING_PEER_TIMEOUT": " 45 "}) == 45.0
    assert peer_timeout({"TRIORING_PEER_TIMEOUT": "0"}) is None
    for bad in ("abc", "1", "-3", "2.5", "86401", "1e3"):
        with pytest.raises(ConfigurationError, match="TRIORING_PEER_TIMEOUT"):
            peer_timeout({"TRIORING_PEER_TIMEOUT": bad})


@pytest.mark.parametrize("timeout", [2, 3, 5, 10, 29, 30, 31, 100, 3600, 86400])
def test_keepalive_adds_up_to_the_timeout(timeout: int) -> None:
    idle, interval, count = keepalive_settings(timeout)
    # The kernel's limits.
    assert idle >= 1
    assert interval >= 1
    assert 1 <= count <= 127
    assert timeout - interval < idle + count * interval <= timeout
    assert check_interval(timeout) <= min(timeout / 10, 1.0)


async def connected_pair(seconds: float | None) -> tuple[Any, Any, Any]:
    """A listener and both ends of a loopback connection, with a peer timeout of ``seconds``."""
    transport = TcpTransport(TransportContext(rank=0, world_size=2, peer_timeout=seconds))
    listener = await transport.listen()
    async with trio.open_nursery() as nursery:
        accepted: list[Any] = []

        async def accept() -> None:
            accepted.append(await listener.accept())

        nursery.start_soon(accept)
        connected = await transport.connect(listener.address)
    return listener, connected, accepted[0]


def options(sock: Any) -> dict[str, int]:
    tcp = socket.IPPROTO_TCP
    return {
        "keepalive": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        "idle": sock.getsockopt(tcp, socket.TCP_KEEPIDLE),
        "interval": sock.getsockopt(tcp, socket.TCP_KEEPINTVL),
        "count": sock.getsockopt(tcp, socket.TCP_KEEPCNT),
        "user_timeout": sock.getsockopt(tcp, socket.TCP_USER_TIMEOUT),
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux socket options")
async def test_socket_options_with_the_default_timeout() -> None:
    listener, connected, accepted = await connected_pair(30.0)
    try:
        for connection in (connected, accepted):
            assert connection.peer_timeout == 30.0
            # TCP_USER_TIMEOUT stays unset: it would fail a connection to a stopped peer.
            assert options(connection.socket) == {
                "keepalive": 1,
                "idle": 10,
                "interval": 2,
                "count": 10,
                "user_timeout": 0,
            }
            # Healthy and idle: nothing outstanding, nothing unanswered.
            assert unanswered_seconds(connection.socket) is None
    finally:
        for resource in (connected, accepted, listener):
            await resource.aclose()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux socket options")
async def test_socket_options_when_turned_off() -> None:
    listener, connected, accepted = await connected_pair(None)
    default = {"idle": 7200, "interval": 75, "count": 9}  # the kernel's, in a fresh socket
    with socket.socket() as fresh:
        default = {k: v for k, v in options(fresh).items() if k in default}
    try:
        for connection in (connected, accepted):
            assert connection.peer_timeout is None
            found = options(connection.socket)
            assert found["keepalive"] == 0
            assert found["user_timeout"] == 0
            assert {k: found[k] for k in default} == default
    finally:
        for resource in (connected, accepted, listener):
            await resource.aclose()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux socket options")
async def test_the_launchers_listening_socket_gets_keepalive_too() -> None:
    """Under ``trioring run --transport tcp`` rank 0 accepts the rendezvous on a socket the
    launcher bound (TRIORING_LISTEN_FD): its connections are watched like any other."""
    with socket.socket() as inherited:
        inherited.bind(("127.0.0.1", 0))
        inherited.listen()
        port = inherited.getsockname()[1]
        listener = _rendezvous._inherited_listener(inherited.fileno(), f"127.0.0.1:{port}", 30.0)
        transport = TcpTransport(TransportContext(rank=1, world_size=2, peer_timeout=30.0))
        try:
            async with trio.open_nursery() as nursery:
                accepted: list[Any] = []

                async def accept() -> None:
                    accepted.append(await listener.accept())

                nursery.start_soon(accept)
                connected = await transport.connect(f"127.0.0.1:{port}")
            assert accepted[0].peer_timeout == 30.0
            assert options(accepted[0].socket)["keepalive"] == 1
            assert options(accepted[0].socket)["idle"] == 10
            await connected.aclose()
            await accepted[0].aclose()
        finally:
            await listener.aclose()
