"""Errors raised by the KV cache.

Every refused request raises a subclass of `KVCacheRequestError` (itself a `ValueError`)
before anything is mutated, so a caller can catch one type, fix its input and retry.
"""


class KVCacheRequestError(ValueError):
    """The request is inconsistent with the cache state or the input; nothing changed."""


class KVCacheCapacityError(KVCacheRequestError):
    """The batch needs more device pages than the pool can free for it."""


class KVCacheStaleError(KVCacheRequestError):
    """The request continues cached data that was evicted after it was last reported.

    The caller planned its tokens with an answer of `get_user_kvdata_info` that is no
    longer true; it must ask again and recompute from what is cached now.
    """
