"""The event stores: how fast they ingest, and live traffic through a router checked against the offline replay."""
