"""The zstd contexts of the codecs that use Zstandard (`zstd`, `zstd-channel`), imported when such a
codec is made: a machine without the `zstandard` package (a bare GPU image) still imports the cache
and serves every other codec, and asking for a zstd codec there names the missing package."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ZstdContexts:
    compressor: Any  # zstandard.ZstdCompressor: reused, since a context costs more than a small page
    decompressor: Any  # zstandard.ZstdDecompressor
    error: type[Exception]  # zstandard.ZstdError: what a damaged frame raises


def zstd_contexts(codec: str, level: int) -> ZstdContexts:
    try:
        import zstandard
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f"Codec {codec} needs the zstandard package, which is not installed "
                                  f"(pip install zstandard; requirements.txt pins it).", name="zstandard") from None
    return ZstdContexts(zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor(), zstandard.ZstdError)
