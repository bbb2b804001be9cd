"""Visits served end to end: the replay (cached against full recompute), a cluster behind a router, the router alone."""
