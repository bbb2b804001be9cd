"""The codecs by name: `codec_names()`, `get_codec(spec)`, `register_codec(name, factory)`.

Specs (`name` or `name:key=value,...`; `get_codec(s).spec` is the canonical form a tier stores):

| spec | codec | bytes per fp32 value | exact |
| --- | --- | --- | --- |
| `raw` | the page blob as it is (the default) | 4 | yes |
| `zstd[:level=3,shuffle=1]` | byte-plane shuffle (`shuffle=0`: none), then zstd at `level` (1..19) | ~3.2 (trained) | yes |
| `zstd-channel` | fp32 / bf16: sign and exponent against each channel's, then zstd (`channel_zstd.py`) | ~3.05 (trained) | yes |
| `zstd:values=bf16` (or `fp16`) | the cast, then the same: exact on top of the cast | ~1.2 (trained) | no |
| `bf16`, `fp16` | a down-cast (fp16 clamps at +-65504) | 2 | no |
| `int8[:mode=sym]` | 8-bit codes, a float32 scale per page, layer, K/V and head; `mode=affine` adds a minimum | ~1 | no |
| `int8:group=token` | 8-bit codes, a float32 scale and minimum per token, layer, K/V and head (fbgemm rowwise) | ~1.06 | no |
| `mixed[:shallow=bf16,shallow_layers=1,deep=int8]` | layers `[0, shallow_layers)` as `shallow`, others `deep` | between | no |
| `sparse[:keep=50,merge=1,recent=1,score=vnorm,values=raw]` | per page the `keep`% top-scoring tokens (see below) | ~keep% | no |

`mixed`'s `shallow` and `deep`, and `sparse`'s `values`, are each `raw` (the layout's dtype), `bf16`,
`fp16`, `int8`, `int8affine` or `int8token`. `sparse` stores the kept tokens' K/V as `values` and drops the others
(decoded as zero K/V, a removed key for HSTU's attention); the last `recent` pages of each write are
kept whole; `score` is `vnorm`, `knorm`, `kvnorm` or `stride`; `merge=g` folds the dropped tokens
of a page into g stored tokens (`codecs/sparse.py`).

Times are exact under every codec. Lossy codecs bound their error per element (`max_abs_error`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .base import CodecSpec, CodecSpecError, KVCodec
from .channel_zstd import ChannelZstdCodec
from .fixed_width import FixedWidthCodec
from .int8 import Int8Values
from .int8_rows import Int8RowValues
from .lossless import CASTS, ZstdCodec
from .raw import RawCodec
from .sparse import SCORES, SparseCodec, SparseParams
from .values import CastValues, ValueCodec

DEFAULT_CODEC = "raw"

# A factory takes the spec's parameters (unknown keys already refused) and returns the codec.
CodecFactory = Callable[[dict[str, str]], KVCodec]
_FACTORIES: dict[str, tuple[CodecFactory, frozenset[str]]] = {}


def register_codec(name: str, factory: CodecFactory, params: frozenset[str] = frozenset()) -> None:
    """Make `name` a spec name; `params`: the parameter keys its factory takes."""
    if name in _FACTORIES:
        raise ValueError(f"A codec named {name!r} is already registered.")
    _FACTORIES[name] = (factory, frozenset(params))


def codec_names() -> list[str]:
    """The registered codec names, sorted."""
    return sorted(_FACTORIES)


def get_codec(spec: str) -> KVCodec:
    """A fresh codec for `spec`; `CodecSpecError` (a ValueError) naming the problem for a bad one."""
    parsed = CodecSpec.parse(spec)
    if parsed.name not in _FACTORIES:
        raise CodecSpecError(f"Unknown KV codec {parsed.name!r} in spec {spec!r}; known: {', '.join(codec_names())}.")
    factory, allowed = _FACTORIES[parsed.name]
    params = dict(parsed.params)
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise CodecSpecError(f"Codec {parsed.name!r} takes parameters {sorted(allowed) or 'none'}, got {unknown} in {spec!r}.")
    return factory(params)


def _int_param(params: dict[str, str], key: str, default: int, low: int, high: int) -> int:
    text = params.get(key, str(default))
    try:
        value = int(text)
    except ValueError:
        raise CodecSpecError(f"Codec parameter {key} must be an integer, got {text!r}.") from None
    if not low <= value <= high:
        raise CodecSpecError(f"Codec parameter {key} must be in [{low}, {high}], got {value}.")
    return value


def _choice(params: dict[str, str], key: str, default: str, choices: tuple[str, ...]) -> str:
    value = params.get(key, default)
    if value not in choices:
        raise CodecSpecError(f"Codec parameter {key} must be one of {list(choices)}, got {value!r}.")
    return value


_VALUE_CODECS: dict[str, Callable[[], ValueCodec]] = {
    "bf16": lambda: CastValues("bf16", torch.bfloat16),
    "fp16": lambda: CastValues("fp16", torch.float16),
    "int8": lambda: Int8Values(affine=False),
    "int8affine": lambda: Int8Values(affine=True),
    "int8token": Int8RowValues,
}


_VALUE_NAMES = ("raw", *_VALUE_CODECS)


def _value_codec(name: str) -> ValueCodec:
    """A value codec by name (`raw`: the layout's own dtype, exact)."""
    return CastValues("raw", None) if name == "raw" else _VALUE_CODECS[name]()


def _mixed(params: dict[str, str]) -> KVCodec:
    shallow = _choice(params, "shallow", "bf16", _VALUE_NAMES)
    deep = _choice(params, "deep", "int8", _VALUE_NAMES)
    layers = _int_param(params, "shallow_layers", 1, 0, 1 << 16)
    spec = f"mixed:deep={deep},shallow={shallow},shallow_layers={layers}"
    runs = [(0, _value_codec(deep))] if layers == 0 else [(0, _value_codec(shallow)), (layers, _value_codec(deep))]
    return FixedWidthCodec(spec, runs)


def _sparse(params: dict[str, str]) -> KVCodec:
    keep = _int_param(params, "keep", 50, 1, 100)
    recent = _int_param(params, "recent", 1, 0, 1 << 16)
    score = _choice(params, "score", "vnorm", SCORES)
    values = _choice(params, "values", "raw", _VALUE_NAMES)
    merge = _int_param(params, "merge", 1, 0, 1 << 15)
    try:
        params = SparseParams(keep, merge, recent, score, values)
    except ValueError as exc:
        raise CodecSpecError(str(exc)) from None
    return SparseCodec(params, _value_codec(values))


def _int8(params: dict[str, str]) -> KVCodec:
    if _choice(params, "group", "page", ("page", "token")) == "token":
        if "mode" in params:
            raise CodecSpecError("Codec int8:group=token is affine (a scale and a minimum per row); it takes no mode.")
        return FixedWidthCodec("int8:group=token", [(0, Int8RowValues())])
    mode = _choice(params, "mode", "sym", ("sym", "affine"))
    return FixedWidthCodec(f"int8:mode={mode}", [(0, Int8Values(affine=mode == "affine"))])


def _zstd(params: dict[str, str]) -> KVCodec:
    level = _int_param(params, "level", 3, 1, 19)
    shuffle = _int_param(params, "shuffle", 1, 0, 1)
    return ZstdCodec(level, bool(shuffle), _choice(params, "values", "raw", ("raw", *CASTS)))


register_codec("raw", lambda params: RawCodec())
register_codec("zstd", _zstd, frozenset({"level", "shuffle", "values"}))
register_codec("zstd-channel", lambda params: ChannelZstdCodec())
register_codec("bf16", lambda params: FixedWidthCodec("bf16", [(0, _VALUE_CODECS["bf16"]())]))
register_codec("fp16", lambda params: FixedWidthCodec("fp16", [(0, _VALUE_CODECS["fp16"]())]))
register_codec("int8", _int8, frozenset({"group", "mode"}))
register_codec("mixed", _mixed, frozenset({"deep", "shallow", "shallow_layers"}))
register_codec("sparse", _sparse, frozenset({"keep", "merge", "recent", "score", "values"}))
