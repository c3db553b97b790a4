"""`dlm-lsp http` under hostile clients (docs/reliability.md): a real process on a tiny checkpoint
under an open-file limit of 1,024 (soft and hard), with 2-second head and body deadlines and a
4-second idle one.
Attackers connect from other loopback addresses (127.0.0.2 and up), the well-behaved client from
127.0.0.1. The checks are on answers and on answering before generous deadlines, never on exact
timings: a slow head is answered 408 and closed, a slow body 408 and closed while holding no slot, an
idle connection closed, one address's connections capped; and under every attack of `dlm-lsp
loadtest --hostile` (slow bodies, slow heads, 1,100 idle connections, a flood) the well-behaved
clients get nothing but 200s, each within its deadline's reach."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from dlm_lsp.http.guard import ConnectionGuard, GuardLimits, client_key
from dlm_lsp.measure import loadtest
from tests.http_helpers import http_process
from tests.test_http import PROMPT, SUFFIX, read_answer
from tests.tiny import make_tiny_checkpoint

DEADLINE_S = 2  # --head-timeout, --body-timeout
IDLE_S = 4  # --idle-timeout: the per-address test holds its connections idle for a moment
GENEROUS_S = 15  # what "answered in time" means here: a 2-core machine shared with other work
# `dlm-lsp http` as `python -c ...`: the same CLI under an open-file limit of 1,024 it cannot raise
UNDER_1024_FILES = (
    "import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)); "
    "from dlm_lsp.cli import main; sys.exit(main())"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("hostile") / "tiny", printable=True)
    timeouts = ("--head-timeout", str(DEADLINE_S), "--body-timeout", str(DEADLINE_S), "--idle-timeout", str(IDLE_S))
    proc = http_process(model, *timeouts, "--max-inflight", "4")
    assert proc.cmd[1:3] == ["-m", "dlm_lsp"]
    proc.cmd[1:3] = ["-c", UNDER_1024_FILES]
    with proc as url:
        yield proc, url


class FakeConnection:
    """What ConnectionGuard asks of a connection: whose it is, whether it is idle, to close."""

    def __init__(self, guard: ConnectionGuard, key: str, idle: bool = True):
        self.guard, self.client_key, self.is_idle, self.closed = guard, key, idle, False

    def idle(self) -> bool:
        return self.is_idle

    def close_for_room(self) -> None:
        self.closed = True
        self.guard.release(self)


def test_the_guard_caps_each_address_and_makes_room_from_the_biggest_holders_idle_connections():
    g = ConnectionGuard(GuardLimits(max_connections=6, max_per_client=4))
    mine = FakeConnection(g, "127.0.0.1")
    theirs = [FakeConnection(g, "127.0.0.2", idle=i > 0) for i in range(4)]  # the oldest is busy
    other = FakeConnection(g, "127.0.0.3", idle=False)
    assert all(g.admit(c) is None for c in [mine, *theirs, other])
    assert g.admit(FakeConnection(g, "127.0.0.2")) is not None  # its 5th: refused
    new = FakeConnection(g, "127.0.0.4")
    assert g.admit(new) is None
    assert [c.closed for c in theirs] == [False, True, False, False] and not mine.closed  # oldest idle of the most
    assert g.open == 6 and g.stats()["evicted"] == 1 and g.stats()["refused_client_cap"] == 1
    for c in [mine, *theirs[2:], new]:
        c.is_idle = False
    assert g.admit(FakeConnection(g, "127.0.0.5")) is not None  # nothing idle: refused
    assert g.stats()["refused_total_cap"] == 1
    assert client_key("2001:db8::1") == client_key("2001:db8::2") == "2001:db8::/64"  # one host's share
    assert client_key("::ffff:10.0.0.1") == "10.0.0.1" and client_key("127.0.0.2") == "127.0.0.2"


def connect(url: str, source: str) -> socket.socket:
    port = int(url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S, source_address=(source, 0))


def fill(url: str) -> httpx.Response:
    body = {"prompt": PROMPT, "suffix": SUFFIX, "deadline_ms": 1000}
    return httpx.post(url + "/v1/completions", json=body, timeout=GENEROUS_S)


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=GENEROUS_S).json()


def test_a_slow_head_is_answered_408_and_closed(server):
    _, url = server
    c = connect(url, "127.0.0.2")
    t0 = time.monotonic()
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a")
    for _ in range(3):  # a byte now and then does not extend the head's deadline
        time.sleep(0.5)
        c.sendall(b"a")
    answer = read_answer(c, GENEROUS_S)
    assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer, answer
    assert time.monotonic() - t0 < GENEROUS_S
    assert health(url)["connections"]["head_timeouts"] >= 1


def test_slow_bodies_are_answered_408_and_hold_no_slot(server):
    _, url = server
    slow = [connect(url, "127.0.0.2") for _ in range(8)]  # twice --max-inflight
    for c in slow:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
    r = fill(url)
    assert r.status_code == 200, r.text
    for c in slow:
        answer = read_answer(c, GENEROUS_S)
        assert answer.startswith(b"HTTP/1.1 408") and b"connection: close" in answer.lower(), answer
        c.close()


def test_an_idle_connection_is_closed(server):
    _, url = server
    c = connect(url, "127.0.0.2")
    t0 = time.monotonic()
    assert read_answer(c, GENEROUS_S) == b""  # closed without a word: it asked nothing
    assert time.monotonic() - t0 < GENEROUS_S
    assert health(url)["connections"]["idle_closed"] >= 1


def test_one_address_gets_at_most_its_share_of_connections(server):
    _, url = server
    held = [connect(url, "127.0.0.5") for _ in range(128)]  # --max-client-connections' default
    try:
        extra = connect(url, "127.0.0.5")
        answer = read_answer(extra, GENEROUS_S)
        assert answer.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in answer, answer
        r = fill(url)  # another address is not held back
        assert r.status_code == 200, r.text
    finally:
        for c in held:
            c.close()


def test_well_behaved_clients_get_200s_under_every_attack(server):
    """`dlm-lsp loadtest --hostile`'s attacks, one after another, each beside two well-behaved clients
    that open new connections while it runs."""
    proc, url = server
    # each fill's own deadline is generous: what is asserted is that the guard lets them through, and
    # a 1 s deadline was answered 504 on a busy 2-core AMD EPYC with no attack at all (issue 44)
    report = asyncio.run(loadtest.run_hostile(url, clients=2, seconds=3, deadline_ms=10_000))
    phases = {ph["attack"]: ph for ph in report["phases"]}
    assert list(phases) == ["none", *loadtest.ATTACKS]
    for name, ph in phases.items():
        wb = ph["well_behaved"]
        assert wb["ok"] > 0 and wb["statuses"] == {"200": wb["ok"]}, (name, wb)
        assert wb["latency_ms"]["max"] < GENEROUS_S * 1000, (name, wb)
    seen = {name: ph.get("attackers", {}) for name, ph in phases.items()}
    assert seen["slow-body"].get("408", 0) > 0 and seen["slow-head"].get("408", 0) > 0, seen
    assert seen["idle"].get("closed", 0) > 0, seen  # 1,100 > what 1,024 files hold: the oldest idle make room
    assert seen["flood"].get("503", 0) > 0, seen  # one address past its cap
    conns = health(url)["connections"]
    assert conns["evicted"] > 0 and conns["refused_client_cap"] > 0 and conns["head_timeouts"] > 0, conns
    # (unguarded, the idle phase's 1,100 connections took every descriptor: each well-behaved request failed)
    assert proc.proc.poll() is None and fill(url).status_code == 200
