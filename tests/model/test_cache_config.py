"""The one translation of a model's config into its KV cache's config, and the defaults the node reads from it."""
from __future__ import annotations

import dataclasses

import torch

from kvcache import KVCacheConfig, ReadWindow
from model.cache_config import kv_cache_config, page_layout, window_pages
from model.config import preset

CONFIG = preset("tiny", user_feature_cardinalities=(3, 4))


def test_the_cache_takes_the_models_geometry_and_read_window():
    windowed = CONFIG.replace(attention_window=9)
    config = kv_cache_config(windowed, num_pages=7)
    assert (config.num_layers, config.num_heads, config.head_dim, config.page_size, config.num_pages) == (
        windowed.num_layers, windowed.num_heads, windowed.head_dim, windowed.page_size, 7)
    assert config.read_window == windowed.cache_read_window == ReadWindow(size=9, sink=windowed.num_prefix_tokens)
    assert kv_cache_config(windowed, num_pages=7, keep_unread_kv=True).read_window is None
    assert kv_cache_config(CONFIG, num_pages=7).read_window is None  # every key attended


def test_what_the_caller_leaves_out_is_the_caches_default():
    given = kv_cache_config(CONFIG, num_pages=7, page_size=4, dtype=torch.bfloat16, kv_codec="int8")
    assert (given.page_size, given.dtype, given.kv_codec) == (4, torch.bfloat16, "int8:mode=sym")
    left_out = kv_cache_config(CONFIG, num_pages=7)
    for field in ("host_capacity_bytes", "redis_capacity_bytes", "kv_codec", "eviction_policy", "tier_timeout_s"):
        assert getattr(left_out, field) == getattr(KVCacheConfig, field)


def test_pages_of_one_window_and_one_page():
    assert window_pages(CONFIG) == -(-CONFIG.max_seq_len // CONFIG.page_size)
    assert window_pages(CONFIG, page_size=1) == CONFIG.max_seq_len
    layout = page_layout(CONFIG, torch.float32, page_size=4)
    assert layout == kv_cache_config(CONFIG, num_pages=1, page_size=4).page_layout


def test_the_nodes_flags_default_to_the_engines_and_the_engines_to_the_caches():
    from serve.engine import EngineConfig
    from serve.node import build_parser
    from serve.node_args import check_args, engine_config

    parser = build_parser()
    base = ["--checkpoint", "c", "--port", "8001", "--data_dir", "d"]
    args = parser.parse_args(base)
    check_args(parser, args)
    assert engine_config(args) == EngineConfig(data_dir="d", checkpoint="c")
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert (defaults["kv_pages"], defaults["host_capacity_bytes"], defaults["redis_capacity_bytes"], defaults["kv_codec"]) == (
        KVCacheConfig.num_pages, KVCacheConfig.host_capacity_bytes, KVCacheConfig.redis_capacity_bytes, KVCacheConfig.kv_codec)
    given = parser.parse_args([*base, "--kv_pages", "9", "--host_capacity_mb", "3", "--kv_codec", "int8", "--sync_offload"])
    check_args(parser, given)
    config = engine_config(given)
    assert (config.kv_pages, config.host_capacity_bytes, config.kv_codec) == (9, 3 << 20, "int8:mode=sym")
    assert config.async_offload is False and config.redis_capacity_bytes == KVCacheConfig.redis_capacity_bytes
