"""Bearer tokens and events quotas, in process: the router's gate over a fake node that checks the
routers' token as a real node does (serve/auth.py's middleware), token files rotated under a running
router, and per-client token buckets on a clock the test moves."""
from __future__ import annotations

import asyncio
import json
import os

import pytest

import serve.auth_tokens as auth_tokens
from benchmark.harness.launch import free_port
from serve.auth import RouterGate, node_guard, router_gate
from serve.auth_tokens import ClientTokens, NodeTokens, TokenFileError
from serve.http_routes import Request, Response, Routes
from serve.http_server import HttpServer
from serve.node_pool import NodePool
from serve.policies import make_policy
from serve.quota import EventQuota
from serve.router import Router, build_parser

SCORER, WRITER, BOTH, ROUTERS = "s" * 20 + "-scorer", "w" * 20 + "-writer", "b" * 20 + "-both", "r" * 24
CLIENTS = (f"# name scopes token\ncheckout score {SCORER}\nlogger events {WRITER}  # the event pipeline\n"
           f"backfill score,events {BOTH}\n")
VISIT = {"user_id": 7, "request_time_ms": 1_650_000_000_000, "candidate_video_ids": [1, 2]}
EVENT = {"user_id": 7, "video_id": 3, "time_ms": 1_650_000_000_000}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def write(path, text: str) -> None:
    """Replace the file as a Kubernetes Secret update does: a new file swapped in (a new inode)."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture()
def token_files(tmp_path):
    clients, node = tmp_path / "clients.tokens", tmp_path / "node.token"
    write(clients, CLIENTS)
    write(node, ROUTERS + "\n")
    return clients, node


def through_router(gate: RouterGate, requests: list[tuple[str, str, dict, object]], node_tokens: NodeTokens | None):
    """Each (method, path, headers, body) through a router with `gate` to one fake node (the node's
    guard over `node_tokens`) -> ([(status, body, headers)], [(path, authorization) the node got])."""
    port, seen = free_port(), []

    async def echo(request: Request) -> Response:
        seen.append((request.path, request.headers.get("authorization")))
        return Response.json({"ok": True})

    async def main():
        node_routes = Routes()
        node_routes.add("POST", "/score", node_guard(node_tokens, echo))
        node_routes.add("POST", "/events", node_guard(node_tokens, echo))
        node = HttpServer(node_routes)
        await node.start("127.0.0.1", port)
        pool = NodePool([f"127.0.0.1:{port}"])
        pool.nodes[0].up = True
        router = Router(pool, make_policy("round-robin"), forward_timeout_s=5.0, gate=gate)
        routes, out = router.routes(), []
        try:
            for method, path, headers, body in requests:
                handler, tail, refusal = routes.resolve(method, path)
                response = refusal or await handler(Request(method, path, headers, json.dumps(body).encode(), tail))
                out.append((response.status, json.loads(response.body), dict(response.headers)))
        finally:
            for conns in router._connections.values():
                conns.close()
            await node.stop(timeout_s=1.0)
        return out

    return asyncio.run(main()), seen


def bearer(token: str) -> dict:
    return {"authorization": f"Bearer {token}"}


def test_tokens_scopes_and_the_routers_token_to_the_node(token_files):
    clients, node = token_files
    gate = RouterGate(ClientTokens(clients), None, NodeTokens(node))
    answers, seen = through_router(gate, [
        ("POST", "/score", {}, VISIT),                                   # no token
        ("POST", "/score", {"authorization": f"Basic {SCORER}"}, VISIT),  # not a bearer token
        ("POST", "/score", bearer("x" * 30), VISIT),                      # unknown
        ("POST", "/events", bearer(SCORER), {"events": [EVENT]}),         # the wrong scope
        ("POST", "/score", bearer(WRITER), VISIT),                        # the wrong scope
        ("POST", "/score", bearer(SCORER), {**VISIT, "events": [EVENT]}),  # inline events need 'events' too
        ("GET", "/route/7", {}, None),
        ("POST", "/score", bearer(SCORER), VISIT),
        ("POST", "/events", bearer(WRITER), {"events": [EVENT]}),
        ("POST", "/score", bearer(BOTH), {**VISIT, "events": [EVENT]}),
    ], NodeTokens(node))
    codes = [(status, body.get("error", {}).get("code")) for status, body, _ in answers]
    assert codes == [(401, "unauthorized")] * 3 + [(403, "forbidden")] * 3 + [(401, "unauthorized")] + [(200, None)] * 3
    assert all(headers["WWW-Authenticate"].startswith("Bearer") for status, _, headers in answers if status == 401)
    assert "'checkout'" in answers[3][1]["error"]["message"] and "'events' scope" in answers[3][1]["error"]["message"]
    # only the admitted three reached the node, each with the routers' token (never the client's)
    assert seen == [("/score", f"Bearer {ROUTERS}"), ("/events", f"Bearer {ROUTERS}"), ("/score", f"Bearer {ROUTERS}")]


def test_a_node_refuses_anyone_but_the_routers(token_files):
    _, node = token_files
    answers, seen = through_router(RouterGate(None, None, None), [("POST", "/score", {}, VISIT)], NodeTokens(node))
    assert answers[0][0] == 401 and answers[0][1]["error"]["code"] == "unauthorized" and seen == []
    wrong = node.with_name("other.token")
    write(wrong, "z" * 24)
    answers, seen = through_router(RouterGate(None, None, NodeTokens(wrong)), [("POST", "/events", {}, {"events": [EVENT]})],
                                   NodeTokens(node))
    assert answers[0][0] == 401 and "not the routers'" in answers[0][1]["error"]["message"] and seen == []


def test_without_token_files_everything_is_open_as_before():
    answers, seen = through_router(RouterGate(None, None, None), [("POST", "/score", {}, {**VISIT, "events": [EVENT]}),
                                                                  ("POST", "/events", {}, {"events": [EVENT]})], None)
    assert [a[0] for a in answers] == [200, 200] and [s[1] for s in seen] == [None, None]


def test_a_rotated_token_file_is_taken_without_a_restart(token_files):
    clients, node = token_files
    tokens, routers = ClientTokens(clients), NodeTokens(node)
    new = "n" * 30
    assert tokens.client(SCORER.encode()).name == "checkout" and tokens.client(new.encode()) is None
    write(clients, f"checkout score {SCORER}\ncheckout score {new}\n")  # both during the rotation
    assert tokens.client(SCORER.encode()).name == tokens.client(new.encode()).name == "checkout"
    write(clients, f"checkout score {new}\n")
    assert tokens.client(SCORER.encode()) is None and tokens.client(new.encode()).scopes == {"score"}
    write(node, f"{new}\n{ROUTERS}\n")  # routers send the new one; nodes accept both until the old is gone
    assert routers.token == new.encode() and routers.accepts(ROUTERS.encode())
    write(clients, "checkout score short\n")  # a broken update keeps the last good tokens
    assert tokens.client(new.encode()).name == "checkout"
    os.remove(clients)
    assert tokens.client(new.encode()).name == "checkout"


def test_every_token_is_compared_in_constant_time(token_files, monkeypatch):
    clients, _ = token_files
    tokens, compared = ClientTokens(clients), []
    real = auth_tokens.hmac.compare_digest
    monkeypatch.setattr(auth_tokens.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    assert tokens.client(SCORER.encode()).name == "checkout"  # the first line's
    assert compared == [SCORER.encode(), WRITER.encode(), BOTH.encode()]  # and still every other one


@pytest.mark.parametrize("text, problem", [
    ("", "no token in it"),
    ("checkout score\n", "expected NAME SCOPES TOKEN"),
    (f"checkout admin {SCORER}\n", "unknown scope(s) ['admin']"),
    ("checkout score short\n", "line 1: a token is 16 to 512"),
    (f"# ok\nche/ckout score {SCORER}\n", "line 2: a client name"),
])
def test_a_malformed_token_file_is_refused_at_start_naming_the_line(tmp_path, text, problem):
    path = tmp_path / "clients.tokens"
    path.write_text(text)
    with pytest.raises(TokenFileError, match=problem.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        ClientTokens(path)
    with pytest.raises(TokenFileError, match="No such file"):
        NodeTokens(tmp_path / "missing.token")


def test_a_client_over_its_events_rate_gets_429_with_retry_after_and_nothing_forwarded(token_files):
    clients, _ = token_files
    clock = FakeClock()
    gate = RouterGate(ClientTokens(clients), EventQuota(events_per_s=2.0, burst=3, clock=clock), None)
    events = {"events": [EVENT, {**EVENT, "video_id": 4}]}
    answers, seen = through_router(gate, [
        ("POST", "/events", bearer(WRITER), events),   # 2 of 3 taken
        ("POST", "/events", bearer(WRITER), events),   # 1 left: refused, 0.5 s short
        ("POST", "/score", bearer(BOTH), {**VISIT, "events": [EVENT]}),  # another client's bucket
        ("POST", "/score", bearer(BOTH), VISIT),      # no events: not charged
    ], None)
    assert [a[0] for a in answers] == [200, 429, 200, 200] and len(seen) == 3
    _, body, headers = answers[1]
    assert body["error"]["code"] == "rate_limited" and "'logger'" in body["error"]["message"]
    assert headers["Retry-After"] == "1"


def test_the_token_bucket_refills_at_its_rate_and_takes_all_or_nothing():
    clock = FakeClock()
    quota = EventQuota(events_per_s=10.0, burst=50, clock=clock)
    assert quota.take("a", 50) == 0.0
    assert quota.take("a", 20) == pytest.approx(2.0)  # refused: nothing taken
    assert quota.take("b", 50) == 0.0  # buckets are per client
    clock.now += 1.0
    assert quota.take("a", 10) == 0.0 and quota.take("a", 1) == pytest.approx(0.1)
    clock.now += 100.0
    assert quota.take("a", 50) == 0.0 and quota.take("a", 1) > 0  # refilled to the burst, not past it
    with pytest.raises(ValueError, match="exceed the burst"):
        quota.take("a", 51)


def test_the_routers_flags(token_files):
    clients, node = token_files
    parser = build_parser()
    args = parser.parse_args(["--nodes", "h:1", "--port", "1", "--client_tokens", str(clients),
                              "--node_token_file", str(node), "--events_per_s", "100"])
    gate = router_gate(args, max_events=500)
    assert gate.quota.burst == 500 and gate.node_authorization() == f"Authorization: Bearer {ROUTERS}\r\n".encode()
    with pytest.raises(ValueError, match="--events_burst 10 is under the 500 events"):
        router_gate(parser.parse_args(["--nodes", "h:1", "--port", "1", "--events_per_s", "1", "--events_burst", "10"]), 500)
    with pytest.raises(ValueError, match="--events_burst needs --events_per_s"):
        router_gate(parser.parse_args(["--nodes", "h:1", "--port", "1", "--events_burst", "10"]), 500)
