"""Hostile networks and hostile clients against real multi-process jobs.

- Faults on the wire (a TCP reset, a frame cut after its header or half its payload, a
  garbled header), put between two ranks by ``tests/workers/hostile_proxy.py``: every rank
  raises promptly, none hangs, none returns the damaged collective as a success.
- Hostile clients (``tests/workers/hostile_client.py``) hitting rank 0's rendezvous port
  while a job with a secret assembles: nothing hostile gets in, nothing leaks out but a
  handshake challenge, rank 0 logs every rejection, and the job's results stay correct.
- Two concurrent jobs sharing a socket directory, or on adjacent ports: no cross-talk.
- Recovery: after a fault, the same processes open a new communicator at the same address.

Ranks run ``tests/workers/hostile_worker.py``, which checks every collective's result against
numpy itself and reports each call (error, timestamps) in its JSON report. Synchronisation is
by marker files polled with deadlines (``conftest.poll_until``), and by watching ``/proc`` for
rank 0's listening socket; the ``worlds`` fixture kills and reaps every process at teardown.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

from conftest import free_tcp_port, poll_until
from trioring import _auth
from trioring._collectives._decision import SMALL_ALLREDUCE_BYTES
from trioring._communicator import DEFAULT_CHUNK_BYTES
from trioring.transports import Connection, StreamConnection

if TYPE_CHECKING:
    from pathlib import Path

    from conftest import Worker, Worlds

WORKER = "hostile_worker.py"
#: A collective's failure must reach every rank within this long of the fault (goal G1).
SPREAD_S = 2.0
#: rank 0's handshake deadline (trioring._auth.HANDSHAKE_SECONDS).
HANDSHAKE_S = _auth.HANDSHAKE_SECONDS
#: How many times the two-jobs tests run (each start of two jobs is one repetition).
JOB_REPS = int(os.environ.get("HOSTILE_JOB_REPS", "5"))
SECRET = "3f1c9a7e5b2d4086a1e0c7f9b3d5e2a4c6b8d0f1e3a5c7b9d1f3e5a7c9b1d3f5"


# -- helpers ---------------------------------------------------------------------------------


def ops(report: dict[str, Any], round_: int = 0) -> list[dict[str, Any]]:
    return [op for op in report["ops"] if op["round"] == round_]


def assert_all_correct(report: dict[str, Any], rounds: int, count: int) -> None:
    for round_ in range(rounds):
        done = ops(report, round_)
        assert len(done) == count, (report["index"], round_, done)
        for op in done:
            assert op["error"] is None, (report["index"], op)
            assert op["correct"], (report["index"], op)


def assert_no_fd_leak(report: dict[str, Any]) -> None:
    """Every count after a communicator closed equals the count before the first one."""
    start, *later = report["fds"]
    for entry in later:
        assert entry["fds"] == start["fds"], (report["index"], entry["when"], start, entry)


def finish(workers: list[Worker], timeout: float = 40.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    for worker in workers:
        code = worker.wait(max(0.1, deadline - time.monotonic()))
        assert code == 0, f"worker {worker.index} exited with {code}:\n{worker.log_text()}"
    return [worker.report() for worker in workers]


def job_env(
    worlds: Worlds,
    *,
    rank: int,
    world_size: int,
    port: int | None = None,
    socket_dir: str | None = None,
    job_id: str = "hostile-job",
    secret: str = SECRET,
    seed: int = 1,
) -> dict[str, str]:
    mode = "unix-dir" if socket_dir is not None else "tcp"
    env = worlds.world_env(mode, world_size, rank, port=port, socket_dir=socket_dir)
    env.update(TRIORING_JOB_ID=job_id, TRIORING_SECRET=secret, HOSTILE_SEED=str(seed))
    return env


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` has a TCP socket listening on ``port`` (from /proc)."""
    inodes = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for name in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as file:
            for line in file.readlines()[1:]:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                if fields[3] == "0A" and local_port == port and fields[9] in inodes:
                    return True
    return False


def start_rank0(
    worlds: Worlds, out_dir: Path, args: list[str], world_size: int, **env: str
) -> tuple[Worker, int]:
    """Start rank 0 alone and wait until it listens for the rendezvous (retrying on another
    port if something else took the one it was given)."""
    for _ in range(3):
        port = free_tcp_port()
        rank_env = job_env(worlds, rank=0, world_size=world_size, port=port)
        rank_env.update(env)
        rank0 = worlds.spawn(WORKER, ["run", str(out_dir), "0", *args], rank_env)

        def listening(rank0: Worker = rank0, port: int = port) -> bool:
            return listens_on(rank0.popen.pid, port) or rank0.popen.poll() is not None

        poll_until(listening, "rank 0 to listen")
        if rank0.popen.poll() is None:
            return rank0, port
        error = rank0.report()["steps"]["open0"]["error"]
        assert error is not None
        assert error["address_in_use"], rank0.log_text()
        for path in out_dir.iterdir():
            path.unlink()
    raise AssertionError("could not find a free port three times")


def start_ranks(
    worlds: Worlds, out_dir: Path, args: list[str], world_size: int, port: int, ranks: range
) -> list[Worker]:
    return [
        worlds.spawn(
            WORKER,
            ["run", str(out_dir), str(rank), *args],
            job_env(worlds, rank=rank, world_size=world_size, port=port),
        )
        for rank in ranks
    ]


def wait_for_file(path: Path, watched: list[Worker]) -> None:
    def ready() -> bool:
        for worker in watched:
            if worker.popen.poll() is not None and not path.exists():
                pytest.fail(
                    f"worker {worker.index} exited before {path.name}:\n{worker.log_text()}"
                )
        return path.exists()

    poll_until(ready, str(path.name))


def rejections(log: Path, where: str = "rendezvous") -> list[str]:
    """The reasons rank 0 logged for the connections it rejected."""
    pattern = re.compile(rf"rejected a connection during the {where}: (.*?)(?: \[job [^]]*\])?$")
    return [m.group(1) for line in log.read_text().splitlines() if (m := pattern.search(line))]


def record_handshake(
    secret: str, job_id: str, *, rank: int, world_size: int
) -> tuple[bytes, bytes]:
    """The bytes a genuine rank ``rank`` sends in its rendezvous handshake with rank 0 (HELLO,
    PROOF), as a sniffer on the network would capture them."""
    credentials = _auth.Credentials(secret.encode(), job_id)
    sent: list[bytes] = []

    class Recording(Connection):
        def __init__(self, inner: Connection) -> None:
            self.inner = inner

        async def send_all(self, *buffers: bytes | bytearray | memoryview) -> None:
            sent.append(b"".join(bytes(b) for b in buffers))
            await self.inner.send_all(*buffers)

        async def recv_into(self, buffer: memoryview) -> int:
            return await self.inner.recv_into(buffer)

        async def aclose(self) -> None:
            await self.inner.aclose()

    async def main() -> None:
        a, b = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: _auth.initiate(
                    Recording(StreamConnection(a)),
                    credentials,
                    role=_auth.Role.RENDEZVOUS,
                    rank=rank,
                    peer=0,
                    world_size=world_size,
                )
            )
            await _auth.accept(StreamConnection(b), credentials, role=_auth.Role.RENDEZVOUS, rank=0)

    trio.run(main)
    hello, proof = sent
    return hello, proof


# -- 5. faults on the wire, from a proxy between two ranks ----------------------------------


def start_proxy(worlds: Worlds, fault: dict[str, Any]) -> tuple[Path, str]:
    """Start hostile_proxy.py; return its output directory and its address."""
    out_dir = worlds.out_dir()
    proxy = worlds.spawn(
        "hostile_proxy.py", ["proxy", str(out_dir), "0", json.dumps(fault)], worlds.base_env()
    )
    wait_for_file(out_dir / "w0.port", [proxy])
    return out_dir, f"127.0.0.1:{(out_dir / 'w0.port').read_text()}"


#: (world size, fault, sender, receiver): the receiver is the sender's right-hand neighbour
#: in the ring, so the faulted link carries allreduce data (the arrays are large enough for
#: the ring algorithm; smaller ones take other paths).
WIRE_FAULTS = [
    (3, "rst", 1, 2),
    (3, "header", 0, 1),
    (3, "half", 2, 0),
    (4, "rst-half", 2, 3),
    (4, "half", 1, 2),
    (3, "garbage", 1, 2),
    (4, "garbage", 3, 0),
]
#: Collectives each rank runs, int64 elements per array (1.92 MB: above SMALL_ALLREDUCE_BYTES,
#: so a ring allreduce, and one frame per step); the fault strikes the first frame of the third
#: collective on the faulted link.
WIRE_OPS = 6
WIRE_LENGTH = 240_000
FAULTED_SEQ = 3
assert SMALL_ALLREDUCE_BYTES < WIRE_LENGTH * 8
assert WIRE_LENGTH // 2 * 8 <= DEFAULT_CHUNK_BYTES


def run_through_proxy(
    worlds: Worlds, world_size: int, fault: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run WIRE_OPS allreduces over the ``proxied`` transport with ``fault``; return the
    ranks' reports and what the proxy did."""
    proxy_dir, proxy = start_proxy(worlds, fault)
    world = worlds.start(
        WORKER,
        "run",
        world_size=world_size,
        mode="tcp",
        args=["1", str(WIRE_OPS), "allreduce", str(WIRE_LENGTH)],
        env_overrides={
            i: {"TRIORING_TRANSPORT": "proxied", "HOSTILE_PROXY": proxy, "HOSTILE_SEED": "7"}
            for i in range(world_size)
        },
    )
    reports = world.finish()
    record = proxy_dir / "w0.fault.json"
    assert record.exists(), (
        f"the proxy saw no frame of collective #{fault.get('seq')} from rank {fault['src']} "
        f"to rank {fault['dst']} (did the allreduce algorithm change?)"
    )
    return reports, json.loads(record.read_text())


@pytest.mark.parametrize(("world_size", "kind", "sender", "receiver"), WIRE_FAULTS)
def test_wire_fault_fails_every_rank_promptly(
    worlds: Worlds, world_size: int, kind: str, sender: int, receiver: int
) -> None:
    """A ring allreduce over the ``proxied`` transport; the proxy damages one data frame from
    ``sender`` to ``receiver``. Both ends, and then every other rank, raise in that very
    collective within SPREAD_S of the fault: PeerFailedError (the receiver naming the
    sender), or for a garbled header ProtocolError at the receiver and ProtocolError (relayed)
    or PeerFailedError elsewhere (a rank that broke in the middle of a send cannot add an
    abort frame, so its neighbour sees only the connection close: the same race the killed-peer
    tests accept). Nobody returns the damaged collective as a success; the next call finds the
    communicator broken. The collectives before it were correct."""
    reports, fault = run_through_proxy(
        worlds, world_size, {"kind": kind, "src": sender, "dst": receiver, "seq": FAULTED_SEQ}
    )
    assert fault["seq"] == FAULTED_SEQ, fault
    payload = fault["nbytes"]
    assert payload == WIRE_LENGTH // world_size * 8, fault
    forwarded = {"rst": 0, "header": 48, "half": 48 + payload // 2, "rst-half": 48 + payload // 2}
    assert fault["forwarded"] == forwarded.get(kind, 48 + payload), fault

    cause = "ProtocolError" if kind == "garbage" else "PeerFailedError"
    for rank, report in enumerate(reports):
        calls = ops(report)
        assert [op["seq"] for op in calls[:-1]] == list(range(1, FAULTED_SEQ + 1)), calls
        for op in calls[: FAULTED_SEQ - 1]:
            assert op["error"] is None, (rank, op)
            assert op["correct"], (rank, op)
        failed, after = calls[FAULTED_SEQ - 1], calls[FAULTED_SEQ]
        error = failed["error"]
        assert error is not None, f"rank {rank} returned the damaged collective: {failed}"
        assert not failed["correct"]
        assert error["type"] in {cause, "PeerFailedError"}, (rank, error)
        assert (error["rank"], error["seq"], error["collective"]) == (rank, 3, "allreduce")
        assert error["peer"] is not None, error
        assert failed["ended"] - fault["t"] < SPREAD_S, (rank, failed, fault)
        assert after["kind"] == "after", after
        assert after["error"]["type"] == "CommunicatorBrokenError", (rank, after)

    # The receiving end names the sender, and says what it saw on the wire.
    error = ops(reports[receiver])[FAULTED_SEQ - 1]["error"]
    assert (error["type"], error["peer"]) == (cause, sender), error
    if kind == "header":
        assert "after 0 of" in error["message"], error
        assert "bytes of a payload" in error["message"], error
    elif kind == "half":
        assert f"after {payload // 2} of {payload} bytes of a payload" in error["message"]
    elif kind == "garbage":
        assert "bad frame header" in error["message"], error
    else:
        assert "reset" in error["message"].lower() or "closed by the peer" in error["message"]


def test_a_cut_link_never_makes_a_live_rank_blame_itself(worlds: Worlds) -> None:
    """The proxy cuts one frame from rank 0 to rank 1 after its header (FIN both ways), with
    both ranks alive. Rank 1 rightly reports rank 0's connection lost; but no rank, rank 0
    least of all, may raise an error that names *itself* as the failed peer ("rank 0: ...
    rank 0 failed"): the existing suite holds every PeerFailedError to ``peer != rank``."""
    reports, _ = run_through_proxy(
        worlds, 3, {"kind": "header", "src": 0, "dst": 1, "seq": FAULTED_SEQ}
    )
    for rank, report in enumerate(reports):
        error = ops(report)[FAULTED_SEQ - 1]["error"]
        assert error["type"] == "PeerFailedError", error
        assert error["peer"] != rank, f"rank {rank} blames itself: {error['message']}"


def test_reset_during_mesh_handshake(worlds: Worlds) -> None:
    """The proxy resets rank 2's data connection to rank 1 as soon as its HELLO arrives.
    Rank 2 (the connecting side) raises RendezvousError naming rank 1 at once. Rank 1 cannot
    tell a genuine rank whose handshake broke from a stranger: it logs the rejection. Rank 2
    then reports its failure over the set-up's control channel, so ranks 0 and 1 raise
    RendezvousError naming rank 2 promptly, long before their deadline (HOSTILE_OPEN_S):
    nobody waits for a world that can no longer form."""
    give_up_s = 30.0
    proxy_dir, proxy = start_proxy(worlds, {"kind": "handshake-rst", "src": 2, "dst": 1})
    env = {"TRIORING_TRANSPORT": "proxied", "HOSTILE_PROXY": proxy}
    world = worlds.start(
        WORKER,
        "run",
        world_size=3,
        mode="tcp",
        args=["1", "2", "allreduce", "300"],
        env_overrides={i: {**env, "HOSTILE_OPEN_S": str(give_up_s)} for i in range(3)},
    )
    reports = world.finish()
    fault = json.loads((proxy_dir / "w0.fault.json").read_text())
    assert (fault["hello_from"], fault["hello_to"]) == (2, 1)

    opened = [report["steps"]["open0"] for report in reports]
    error = opened[2]["error"]
    assert error is not None
    assert (error["type"], error["peer"]) == ("RendezvousError", 1), error
    assert "handshake with rank 1" in error["message"], error
    # From the reset, not from each rank's start: a rank's open also waits for its peers'
    # interpreters to start, which on two busy cores may take most of SPREAD_S.
    assert opened[2]["ended"] - fault["t"] < SPREAD_S, (opened[2], fault)
    for rank in (0, 1):
        error = opened[rank]["error"]
        assert error is not None, opened[rank]
        assert (error["type"], error["peer"]) == ("RendezvousError", 2), error
        assert "rank 2 failed" in error["message"], error
        assert "handshake with rank 1" in error["message"], error
        assert opened[rank]["ended"] - fault["t"] < SPREAD_S, (opened[rank], fault)
    log = (world.out_dir / "w1.trioring.log").read_text()
    # Rank 2 connects to rank 1 twice (collectives and point-to-point): both are reset.
    assert len(rejections(world.out_dir / "w1.trioring.log", "connection set-up")) == 2, log


# -- 8. hostile clients against a live job --------------------------------------------------

QUICK_ATTACKS = [
    "random",
    "random-short",
    "http",
    "tls",
    "nmap-lines",
    "oversized",
    "wrong-job",
    "wrong-role",
    "wrong-rank",
    "half-hello-close",
    "rst",
    "wrong-secret",
    "wrong-world",
    "spoof-rank",
    "replay",
    "reflect",
]
SLOW_ATTACKS = ["silent", "half-hello", "hello-no-proof"]
#: Why rank 0 rejects each quick attack (the reason it logs).
REASONS = {
    "random": "not a trioring handshake",
    "http": "not a trioring handshake",
    "tls": "not a trioring handshake",
    "oversized": "not a trioring handshake",
    "random-short": "the peer closed the connection during the handshake",
    "nmap-lines": "the peer closed the connection during the handshake",
    "half-hello-close": "the peer closed the connection during the handshake",
    "wrong-job": "the client belongs to another job",
    "wrong-role": "the client wanted role 2, rank 0",
    "wrong-rank": "the client wanted role 1, rank 1",
    "rst": "connection broke during the handshake",
    "wrong-secret": "the client failed to prove it knows the job's secret",
    "wrong-world": "the client failed to prove it knows the job's secret",
    "spoof-rank": "the client failed to prove it knows the job's secret",
    "replay": "the client failed to prove it knows the job's secret",
    "reflect": "the client failed to prove it knows the job's secret",
}
JOB_ARGS = ["1", "6", "mix", "5000"]


def classify(reason: str) -> str:
    """The entry of REASONS (or "handshake took too long") that a logged reason starts
    with; the reason itself if none does."""
    known = [*REASONS.values(), "handshake took too long"]
    return next((start for start in known if reason.startswith(start)), reason)


def attack(worlds: Worlds, out_dir: Path, port: int, world_size: int, **config: Any) -> Worker:
    hello, proof = record_handshake(SECRET, "hostile-job", rank=1, world_size=world_size)
    settings = {
        "address": f"127.0.0.1:{port}",
        "job_id": "hostile-job",
        "world_size": world_size,
        "kinds": QUICK_ATTACKS,
        "slow": SLOW_ATTACKS,
        "concurrency": 8,
        "attempt_s": HANDSHAKE_S + 3,
        "hold_s": HANDSHAKE_S + 3,
        "max_s": 40,
        "replay": {"hello": hello.hex(), "proof": proof.hex()},
        **config,
    }
    return worlds.spawn(
        "hostile_client.py", ["flood", str(out_dir), "9", json.dumps(settings)], worlds.base_env()
    )


def check_attack_report(report: dict[str, Any]) -> None:
    """Nothing but a handshake CHALLENGE ever reached the attacker, and the server closed
    every connection, the slow ones within its handshake deadline."""
    assert report["violations"] == [], report["violations"]
    assert report["max_received"] <= 72, report
    for slow in report["slow"]:
        assert slow["connected"], slow
        assert slow["outcome"] in ("eof", "reset"), slow
        assert slow["seconds"] < HANDSHAKE_S + 2, slow
        assert slow["received"] == (72 if slow["kind"] == "hello-no-proof" else 0), slow
    for kind, counts in report["kinds"].items():
        assert "timeout" not in counts, (kind, counts)


def test_hostile_clients_during_a_live_rendezvous(worlds: Worlds) -> None:
    """Rank 0 of a 4-rank job starts; a hostile client floods its rendezvous port with every
    quick attack (random bytes, HTTP, a TLS ClientHello, a replayed genuine handshake, wrong
    secret, job, role, rank, world, ...) and holds three never-finishing handshakes; once 64
    attempts are over, ranks 1-3 start while the flood goes on. The job's results are
    correct; the attacker never got more than a handshake CHALLENGE; rank 0 logged every
    attempt made before the other ranks started as rejected, for the right reason."""
    gate = 64
    out_dir = worlds.out_dir()
    rank0, port = start_rank0(worlds, out_dir, JOB_ARGS, 4)
    attacker = attack(
        worlds, out_dir, port, 4, gate_after=gate, attempts=100_000, until_refused=True
    )
    wait_for_file(out_dir / "w9.flooding", [attacker, rank0])
    others = start_ranks(worlds, out_dir, JOB_ARGS, 4, port, range(1, 4))
    reports = finish([rank0, *others])
    (out_dir / "stop").touch()
    assert attacker.wait() == 0, attacker.log_text()
    report = json.loads((out_dir / "w9.json").read_text())

    for rank_report in reports:
        assert_all_correct(rank_report, 1, 6)
    check_attack_report(report)
    assert report["connected"] >= gate, report
    # The flood went on until the rendezvous was over and rank 0 stopped listening.
    assert any("refused" in counts for counts in report["kinds"].values()), report["kinds"]
    reasons = rejections(out_dir / "w0.trioring.log")
    # Every attempt over before the gate was rejected and logged; later ones may have found
    # the rendezvous over (refused, or reset in the listen backlog).
    assert gate <= len(reasons) <= report["connected"] + len(SLOW_ATTACKS), (len(reasons), report)
    assert {REASONS[kind] for kind in QUICK_ATTACKS} <= {classify(r) for r in reasons}, reasons


def test_a_thousand_hostile_connections_then_the_job_completes(worlds: Worlds) -> None:
    """1,000 quick hostile attempts (16 at a time, every kind) and three never-finishing
    handshakes against a rank 0 waiting for its 3 peers. Zero accepted: the attacker got at
    most a CHALLENGE, rank 0 logged exactly one rejection per connection, for the reason that
    fits its kind, and closed the slow ones at its 5 s handshake deadline. Then the real ranks
    join and the job is correct."""
    total = 1000
    out_dir = worlds.out_dir()
    rank0, port = start_rank0(worlds, out_dir, JOB_ARGS, 4)
    attacker = attack(worlds, out_dir, port, 4, attempts=total, concurrency=16)
    assert attacker.wait(timeout=60) == 0, attacker.log_text()
    report = json.loads((out_dir / "w9.json").read_text())
    check_attack_report(report)
    assert (report["attempts"], report["connected"]) == (total, total), report
    for slow in report["slow"]:
        assert slow["seconds"] >= HANDSHAKE_S - 0.1, slow  # closed by the deadline, not before
    reasons = rejections(out_dir / "w0.trioring.log")
    assert len(reasons) == total + len(SLOW_ATTACKS), (len(reasons), report)
    expected: dict[str, int] = {"handshake took too long": len(SLOW_ATTACKS)}
    for kind, counts in report["kinds"].items():
        expected[REASONS[kind]] = expected.get(REASONS[kind], 0) + sum(
            n for outcome, n in counts.items() if outcome != "challenges"
        )
    got: dict[str, int] = {}
    for reason in reasons:
        got[classify(reason)] = got.get(classify(reason), 0) + 1
    assert got == expected

    others = start_ranks(worlds, out_dir, JOB_ARGS, 4, port, range(1, 4))
    for rank_report in finish([rank0, *others]):
        assert_all_correct(rank_report, 1, 6)
    print(
        f"\n{total} hostile attempts in {report['flood_seconds']} s "
        f"({total / report['flood_seconds']:.0f}/s) + {len(SLOW_ATTACKS)} slow: "
        f"{len(reasons)} rejections logged, 0 accepted, at most {report['max_received']} "
        f"bytes (a CHALLENGE) returned to the attacker; per reason: {got}"
    )


def test_idle_connection_flood_beyond_the_handshake_cap_does_not_fail_the_job(
    worlds: Worlds,
) -> None:
    """An attacker without the secret holds 200 idle connections to rank 0's rendezvous port
    (more than the 128 handshakes rank 0 admits at once) while rank 1 of a 2-rank job starts.
    Rank 0 closes the excess at once and the rest at its 5 s handshake deadline, so the job
    must still assemble and run correctly (row 21: the real job's results stay correct)."""
    out_dir = worlds.out_dir()
    rank0, port = start_rank0(worlds, out_dir, JOB_ARGS, 2, HOSTILE_OPEN_S="10")
    attacker = attack(worlds, out_dir, port, 2, attempts=0, slow=["silent"] * 200, kinds=["random"])
    wait_for_file(out_dir / "w9.held", [attacker, rank0])
    others = start_ranks(worlds, out_dir, JOB_ARGS, 2, port, range(1, 2))
    reports = finish([rank0, *others])
    assert attacker.wait() == 0, attacker.log_text()
    for rank_report in reports:
        assert rank_report["steps"]["open0"]["error"] is None, rank_report["steps"]
        assert_all_correct(rank_report, 1, 6)


def test_handshakes_in_progress_are_closed_when_the_rendezvous_completes(
    worlds: Worlds,
) -> None:
    """Three never-finishing handshakes are in progress at rank 0 when the real ranks
    complete the rendezvous. Rank 0 must close them itself (not leave them to the garbage
    collector: no ResourceWarning) and log them as rejected like every other stranger."""
    out_dir = worlds.out_dir()
    rank0, port = start_rank0(
        worlds, out_dir, JOB_ARGS, 2, PYTHONWARNINGS="always::ResourceWarning"
    )
    attacker = attack(worlds, out_dir, port, 2, attempts=0, kinds=["random"])
    wait_for_file(out_dir / "w9.held", [attacker, rank0])
    others = start_ranks(worlds, out_dir, JOB_ARGS, 2, port, range(1, 2))
    reports = finish([rank0, *others])
    assert attacker.wait() == 0, attacker.log_text()
    for rank_report in reports:
        assert_all_correct(rank_report, 1, 6)
    report = json.loads((out_dir / "w9.json").read_text())
    check_attack_report(report)
    assert "ResourceWarning" not in rank0.log_text(), rank0.log_text()
    assert len(rejections(out_dir / "w0.trioring.log")) == len(SLOW_ATTACKS)


# -- 10. two concurrent jobs on one host ----------------------------------------------------


def adjacent_free_ports() -> int:
    """A port p such that p and p + 1 were both free a moment ago."""
    for _ in range(50):
        port = free_tcp_port()
        if port >= 65535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two adjacent free ports")


def _port_taken(jobs: list[tuple[Path, list[Worker]]], base_port: int) -> bool:
    """Wait until each job's rank 0 listens on its port, or has exited; whether one of them
    found its port taken."""
    rank0s = [(workers[0], base_port + job) for job, (_, workers) in enumerate(jobs)]

    def settled() -> bool:
        return all(
            listens_on(w.popen.pid, port) or w.popen.poll() is not None for w, port in rank0s
        )

    poll_until(settled, "both rank 0s to listen")
    for worker, _ in rank0s:
        if worker.popen.poll() is not None and worker.has("json"):
            error = worker.report()["steps"].get("open0", {}).get("error")
            if error is not None and error["address_in_use"]:
                return True
    return False


@pytest.mark.parametrize("rep", range(JOB_REPS))
@pytest.mark.parametrize("layout", ["shared-socket-dir", "adjacent-ports"])
def test_two_concurrent_jobs_do_not_cross_talk(worlds: Worlds, layout: str, rep: int) -> None:
    """Jobs A and B, 3 ranks each, own job id, secret and inputs, start at the same time:
    over Unix sockets in one shared TRIORING_SOCKET_DIR, or over TCP on adjacent
    MASTER_PORTs. Each rank runs two rounds (open, 6 checked collectives, close) at the same
    address. Every result matches the rank's own job's inputs; no rank ever saw a connection
    it rejected (nothing knocked at the wrong door); the socket directory ends empty; no fd
    leaked."""
    world_size, rounds, count = 3, 2, 6
    socket_dir = worlds.socket_dir() if layout == "shared-socket-dir" else None
    for _ in range(3):
        base_port = adjacent_free_ports() if socket_dir is None else None
        jobs = []
        for job in range(2):
            out_dir = worlds.out_dir()
            workers = []
            for rank in range(world_size):
                env = job_env(
                    worlds,
                    rank=rank,
                    world_size=world_size,
                    port=None if base_port is None else base_port + job,
                    socket_dir=socket_dir,
                    job_id=f"job-{'ab'[job]}-{rep}",
                    secret=f"{SECRET[:-1]}{job}",
                    seed=100 * rep + job,
                )
                args = ["run", str(out_dir), str(rank), str(rounds), str(count), "mix", "2000"]
                workers.append(worlds.spawn(WORKER, args, env))
            jobs.append((out_dir, workers))
        if base_port is None or not _port_taken(jobs, base_port):
            break
        # Another process took one of the two ports after adjacent_free_ports found them
        # free (this machine may be shared): start both jobs again, elsewhere.
        for _, workers in jobs:
            for worker in workers:
                worker.kill()
    else:
        raise AssertionError("the ports were taken three times")
    for out_dir, workers in jobs:
        for report in finish(workers):
            assert_all_correct(report, rounds, count)
            assert_no_fd_leak(report)
        for rank in range(world_size):
            log = out_dir / f"w{rank}.trioring.log"
            assert rejections(log) == [], log.read_text()
            assert rejections(log, "connection set-up") == [], log.read_text()
    if socket_dir is not None:
        assert os.listdir(socket_dir) == []


# -- recovery --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["tcp", "unix-dir"])
@pytest.mark.parametrize("fault", ["cancel", "close"])
def test_recovery_on_the_same_address_after_a_fault(worlds: Worlds, fault: str, mode: str) -> None:
    """Rank 1 abandons a collective (cancel) or closes its communicator (close); the others'
    collective (or the next one) fails. Then the same processes open a new communicator at the same address
    (MASTER_PORT, or socket directory) and run checked collectives correctly, and every
    process ends with the file descriptors it started with."""
    world = worlds.start(
        WORKER,
        "recover",
        world_size=3,
        mode=mode,
        args=[fault],
        env_overrides={i: {"HOSTILE_SEED": "5"} for i in range(3)},
    )
    reports = world.finish()
    for rank, report in enumerate(reports):
        first = ops(report)
        assert first[0]["error"] is None, first
        assert first[0]["correct"], first
        if rank == 1:
            if fault == "cancel":
                assert report["cancelled_caught"], report
                assert report["broken"], report
        else:
            # The collective rank 1 left raises, or, if rank 1 had already sent all it had to
            # contribute (as in a small allreduce), completes and the next call raises: the
            # documented "current or next collective".
            current, following = first[1]["error"], first[2]["error"]
            error = current or following
            assert error is not None, first
            assert error["type"] in ("PeerAbortedError", "PeerFailedError"), error
            assert error["peer"] != rank, error
            if error["type"] == "PeerAbortedError":
                assert (error["peer"], error["reason"]) == (1, "cancelled"), error
            if current is not None:
                assert following["type"] == "CommunicatorBrokenError", first
        assert report["steps"]["open1"]["error"] is None, report["steps"]
        recovered = ops(report, 1)
        assert len(recovered) == 6, recovered
        assert all(op["error"] is None and op["correct"] for op in recovered), recovered
        assert_no_fd_leak(report)
