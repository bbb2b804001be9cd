"""Codecs for K/V pages kept off the device: the contract (`base.py`) and the registry (`registry.py`).

Stable API: `codec_names() -> list[str]`, `get_codec(spec) -> KVCodec`, `KVCodec.encode/decode/spec`,
`EncodedPages`. Spec names: `raw` (default), `zstd`, `bf16`, `fp16`, `int8`, `mixed`, `sparse` (parameters:
`registry.py`).
"""
from .base import CodecSpec, CodecSpecError, EncodedPages, KVCodec
from .registry import DEFAULT_CODEC, codec_names, get_codec, register_codec

__all__ = [
    "DEFAULT_CODEC",
    "CodecSpec",
    "CodecSpecError",
    "EncodedPages",
    "KVCodec",
    "codec_names",
    "get_codec",
    "register_codec",
]
