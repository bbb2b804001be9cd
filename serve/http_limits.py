"""What one client may hold of an HTTP front (serve/http_server.py: the router's and the node's), and its flags.

Its own module: the server and each of its connections (serve/http_connection.py) read these limits.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """What one client may hold of the router. The defaults suit clients on a trusted network
    behind a load balancer; the timeouts are per phase, from the phase's start (a slow drip of
    bytes does not extend them)."""

    max_body_bytes: int = 1 << 20
    max_head_bytes: int = 16 << 10
    max_connections: int = 10_000  # beyond it: 503 and close (keep under the process's file limit)
    header_timeout_s: float = 10.0  # from a request's first byte to the end of its head
    body_timeout_s: float = 30.0  # from the end of the head to the end of the body
    keep_alive_timeout_s: float = 30.0  # idle between requests (and before the first)
    # While a request is being answered, reading pauses once this many requests, or bytes of their
    # bodies, wait behind it. Read-ahead only: a large body still arrives once its turn comes. A
    # connection holds at most this plus one socket read (256 KiB) beyond the request in hand.
    max_pipelined: int = 32
    max_buffered_bytes: int = 64 << 10
    # Request bodies held at once across all connections (serve/http_budget.py): past it, a new
    # request's body is not read until answered requests free enough.
    max_held_body_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_head_bytes", "max_connections", "max_pipelined", "max_buffered_bytes",
                     "max_held_body_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The `ServerLimits` flags, with its defaults (router and node)."""
    parser.add_argument("--max_connections", type=int, default=ServerLimits.max_connections,
                        help="client connections held at once; beyond it 503 and close (keep under `ulimit -n`)")
    parser.add_argument("--header_timeout_s", type=float, default=ServerLimits.header_timeout_s)
    parser.add_argument("--body_timeout_s", type=float, default=ServerLimits.body_timeout_s)
    parser.add_argument("--keep_alive_timeout_s", type=float, default=ServerLimits.keep_alive_timeout_s)
    parser.add_argument("--max_held_body_bytes", type=int, default=ServerLimits.max_held_body_bytes,
                        help="request bodies held at once over all connections; past it new bodies wait unread")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    """ServerLimits from `add_limit_arguments`' flags; ValueError for an impossible one."""
    return ServerLimits(max_connections=args.max_connections, header_timeout_s=args.header_timeout_s,
                        body_timeout_s=args.body_timeout_s, keep_alive_timeout_s=args.keep_alive_timeout_s,
                        max_held_body_bytes=args.max_held_body_bytes)
