"""The flags of `python -m serve.node`, the checks that refuse impossible settings before the slow start, and
the engine's settings they give.

The engine's flags default to None, "the engine's default": `EngineConfig` (and, for the cache's settings,
`KVCacheConfig`) is their one home, and importing it here would make --help import torch.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from serve.http_limits import add_limit_arguments, limits_from_args
from serve.protocol import DEFAULT_MAX_EVENTS

if TYPE_CHECKING:
    from serve.engine import EngineConfig


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history_store", default=None,
                   help="history store URL: sqlite:///path (this machine) or redis://host:port/db (shared); "
                        "fill it with python -m history.bootstrap")
    p.add_argument("--data_dir", default=None, help="without --history_store: a preprocessed dataset served read-only")
    p.add_argument("--checkpoint", required=True, help="model checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--node_id", default=None, help="id in the locality index (default HOST:PORT)")
    p.add_argument("--redis_url", default=None, help="shared KV tier and locality index (default: none, a lone node)")
    p.add_argument("--device", default=None, help="torch device (default: the engine's, the CPU)")
    p.add_argument("--kv_pages", type=int, default=None, help="device pool pages (default: the engine's)")
    p.add_argument("--page_size", type=int, default=None, help="tokens per page (default: the model's)")
    p.add_argument("--host_capacity_mb", type=int, default=None, help="host-memory tier capacity (default: the engine's)")
    p.add_argument("--redis_capacity_mb", type=int, default=None,
                   help="shared tier capacity, for this model (default: the engine's)")
    p.add_argument("--kv_codec", default=None,
                   help="how host memory, disk and Redis store K/V pages: raw (exact, the default), zstd-channel (exact, "
                        "~1.2x fewer bytes, ~1.7x for a windowed model), bf16, int8 (lossy: 2x, 4x); "
                        "kvcache/codecs/registry.py")
    p.add_argument("--sync_offload", action="store_true", help="offload on the compute thread (default: a worker)")
    p.add_argument("--no_offload_each_visit", action="store_true",
                   help="keep K/V on the device between visits; offload on eviction and shutdown only")
    p.add_argument("--cuda_graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each batch bucket's CUDA graph (default: on with --device cuda and the triton backend)")
    p.add_argument("--max_batch_size", type=int, default=8)
    p.add_argument("--max_wait_ms", type=float, default=2.0, help="the oldest request waits at most this for a batch")
    p.add_argument("--max_queue", type=int, default=256, help="requests queued before answering 503")
    p.add_argument("--max_candidates", type=int, default=None, help="per /score (default: the engine's)")
    p.add_argument("--max_events", type=int, default=DEFAULT_MAX_EVENTS, help="events per POST /events or /score")
    p.add_argument("--torch_threads", type=int, default=1)
    p.add_argument("--heartbeat_s", type=float, default=1.0)
    p.add_argument("--index_ttl_s", type=float, default=3.0,
                   help="a node's index entries expire this long after its last heartbeat")
    add_limit_arguments(p)  # what a client may hold of the node, as of a router (serve/http_server.py)
    p.add_argument("--router_token_file", default=None,
                   help="accept only requests bearing a token of this file (one a line: the routers'); /health and "
                        "/metrics stay open. Re-read when it changes. Default: no authentication")
    p.add_argument("--admin", action="store_true", help="serve POST /admin/reset_cache (benchmarks only)")
    p.add_argument("--log_level", default="INFO")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse impossible settings before the slow start (argparse-style: exit 2 with one message)."""
    positive = ("max_batch_size", "max_queue", "max_candidates", "torch_threads", "kv_pages", "host_capacity_mb", "max_events")
    if (args.history_store is None) == (args.data_dir is None):
        parser.error("give exactly one of --history_store (live events) and --data_dir (a fixed dataset)")
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.cuda_graphs and not (args.device or "").startswith("cuda"):  # None: the engine's device, the CPU
        parser.error(f"--cuda_graphs needs a CUDA --device, got {args.device or 'the default (cpu)'}")
    if args.kv_codec is not None:
        from kvcache.codecs import get_codec  # here: --help answers without importing torch

        try:
            args.kv_codec = get_codec(args.kv_codec).spec
        except ValueError as err:
            parser.error(f"--kv_codec: {err}")
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in [1, 65535], got {args.port}")
    if args.max_wait_ms < 0:
        parser.error(f"--max_wait_ms must be >= 0, got {args.max_wait_ms}")
    try:
        limits_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    if not 0 < args.heartbeat_s < args.index_ttl_s:
        parser.error(f"need 0 < --heartbeat_s < --index_ttl_s, got {args.heartbeat_s} and {args.index_ttl_s}")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's settings from checked flags; a flag left out takes `EngineConfig`'s default."""
    from serve.engine import EngineConfig  # after parsing: it imports torch and the model

    megabytes = {"host_capacity_bytes": args.host_capacity_mb, "redis_capacity_bytes": args.redis_capacity_mb}
    given = {"device": args.device, "kv_pages": args.kv_pages, "kv_codec": args.kv_codec,
             "max_candidates": args.max_candidates, **{name: mb << 20 for name, mb in megabytes.items() if mb is not None}}
    return EngineConfig(
        data_dir=args.data_dir, checkpoint=args.checkpoint, history_store=args.history_store, page_size=args.page_size,
        redis_url=args.redis_url, async_offload=not args.sync_offload, offload_each_visit=not args.no_offload_each_visit,
        cuda_graphs=args.cuda_graphs, **{name: value for name, value in given.items() if value is not None},
    )
