"""Who may call the router and the nodes, and how many events a client may write.

Router (`RouterGate`): a client sends `Authorization: Bearer TOKEN`; the token file says its name and
scopes (serve/auth_tokens.py). POST /score and GET /route/... need `score`, POST /events needs
`events`, and a /score that carries inline events needs both (those events are written like
/events'). Node (`node_guard`): every route but /health and /metrics needs the routers'
token, so a client that reaches a node directly can do nothing with it.

    401 {"error": {"code": "unauthorized", ...}}   no token, not a Bearer token, or an unknown one
                                                   (with WWW-Authenticate: Bearer)
    403 {"error": {"code": "forbidden", ...}}      a known client without the route's scope
    429 {"error": {"code": "rate_limited", ...}}   over the client's events rate (Retry-After: seconds)

/health and /metrics stay open: Kubernetes probes and Prometheus call them without credentials,
they carry no user's data, and the NetworkPolicy keeps them inside the cluster. Without a token
file everything is open as before (tests, `make demo`); the quota then keeps one bucket for all.
"""
from __future__ import annotations

import argparse
import contextvars

from serve.auth_tokens import SCOPES, Client, ClientTokens, NodeTokens
from serve.http_routes import Handler, Request, Response, error_response
from serve.quota import EventQuota, retry_after_header

OPEN_PATHS = ("/health", "/metrics")
ANONYMOUS = Client("anonymous", frozenset(SCOPES))
_caller: contextvars.ContextVar[Client] = contextvars.ContextVar("caller", default=ANONYMOUS)


def bearer_token(authorization: str | None) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header (None: absent or another scheme)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or not token.isascii():
        return None
    return token.encode("ascii")


def unauthorized(message: str) -> Response:
    refusal = error_response(401, "unauthorized", message)
    return Response(refusal.status, refusal.body, headers=(("WWW-Authenticate", 'Bearer realm="hstu"'),))


class RouterGate:
    """The router's checks: `guard` wraps a route's handler, `admit_events` charges a request's events."""

    def __init__(self, tokens: ClientTokens | None, quota: EventQuota | None, node_tokens: NodeTokens | None) -> None:
        self.tokens = tokens
        self.quota = quota
        self.node_tokens = node_tokens

    def guard(self, scope: str, handler: Handler) -> Handler:
        if self.tokens is None:
            return handler

        async def guarded(request: Request) -> Response:
            presented = bearer_token(request.headers.get("authorization"))
            if presented is None:
                return unauthorized(f"{request.path[:200]} needs an `Authorization: Bearer TOKEN` header")
            client = self.tokens.client(presented)
            if client is None:
                return unauthorized("the bearer token is not one of this service's")
            if scope not in client.scopes:
                return error_response(403, "forbidden", f"client {client.name!r} may not {_DOING[scope]}: "
                                                        f"its token lacks the {scope!r} scope")
            _caller.set(client)  # the handler runs in this task: admit_events reads it
            return await handler(request)

        return guarded

    def admit_events(self, events: int) -> Response | None:
        """None when the caller may write `events` events now (and they are charged), else the refusal."""
        if events == 0:
            return None
        client = _caller.get()
        if "events" not in client.scopes:
            return error_response(403, "forbidden", f"client {client.name!r} may not {_DOING['events']}: its "
                                                    "token lacks the 'events' scope (inline events of a /score too)")
        if self.quota is None:
            return None
        wait_s = self.quota.take(client.name, events)
        if wait_s == 0.0:
            return None
        refusal = error_response(429, "rate_limited", f"client {client.name!r} is over its events rate "
                                 f"({self.quota.events_per_s:g}/s, bursts of {self.quota.burst}); nothing was stored, "
                                 f"retry in {wait_s:.1f} s")
        return Response(refusal.status, refusal.body, headers=(("Retry-After", retry_after_header(wait_s)),))

    def node_authorization(self) -> bytes:
        """The header line a router sends each node (empty without a node token file)."""
        if self.node_tokens is None:
            return b""
        return b"Authorization: Bearer " + self.node_tokens.token + b"\r\n"


_DOING = {"score": "score visits", "events": "write events"}


def node_guard(tokens: NodeTokens | None, handler: Handler) -> Handler:
    """A node's route that answers only requests bearing a token of `tokens` (the routers'; None: anyone)."""
    if tokens is None:
        return handler

    async def routers_only(request: Request) -> Response:
        presented = bearer_token(request.headers.get("authorization"))
        if presented is None or not tokens.accepts(presented):
            problem = "no bearer token" if presented is None else "a token that is not the routers'"
            refusal = error_response(401, "unauthorized", f"nodes answer only routers: {problem}")
            return Response(refusal.status, refusal.body, headers=(("WWW-Authenticate", 'Bearer realm="hstu-node"'),))
        return await handler(request)

    return routers_only


# ---------------------------------------------------------------- flags
def add_router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--client_tokens", default=None,
                   help="clients' bearer tokens, a line each: NAME SCOPES TOKEN (scopes: score, events); "
                        "re-read when the file changes. Default: no authentication")
    p.add_argument("--node_token_file", default=None, help="the token the router sends to nodes (first line)")
    p.add_argument("--events_per_s", type=float, default=None,
                   help="each client's sustained events rate on /events and inline in /score (default: unlimited)")
    p.add_argument("--events_burst", type=int, default=None,
                   help="events a client may send at once above its rate (default: --max_events per request)")


def router_gate(args: argparse.Namespace, max_events: int) -> RouterGate:
    """The gate the router's flags describe; ValueError naming the flag when they cannot work."""
    tokens = None if args.client_tokens is None else ClientTokens(args.client_tokens)
    node_tokens = None if args.node_token_file is None else NodeTokens(args.node_token_file)
    quota = None
    if args.events_per_s is not None:
        burst = max_events if args.events_burst is None else args.events_burst
        if burst < max_events:
            raise ValueError(f"--events_burst {burst} is under the {max_events} events a request may carry: "
                             "such a request could never be admitted")
        quota = EventQuota(args.events_per_s, burst)
    elif args.events_burst is not None:
        raise ValueError("--events_burst needs --events_per_s")
    return RouterGate(tokens, quota, node_tokens)
