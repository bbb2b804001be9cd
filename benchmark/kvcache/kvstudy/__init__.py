"""The KV-reuse study (`benchmark/kvcache/study.py`): what the cache saves a visit, what it costs in memory,
and when reloading a user's K/V from a tier stops paying, one section a module.

`visits.py` times a visit with the cache, by full recompute and the history alone, and measures
each one's peak memory; `onload.py` times a returning user's reload from each tier (and codec);
`footprint.py` derives bytes per user, device pages per batch and the batch limits; `plots.py`
draws the figures and `report.py` writes the Markdown report.
"""
