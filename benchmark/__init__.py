"""The lab around the library: benchmarks, reports and the harness the tests share.

Each script runs as a module from the repository root, `python -m benchmark.<group>.<name> --help`:

    model/     the forward pass on the device: the HSTU block, kernel launches per batch
    kvcache/   the cache: its ops, reload from each tier, codecs, the K/V's entropy, the KV-reuse study
    serving/   visits served end to end: the replay (cached against full recompute), a cluster, the router
    history/   the event stores: ingest, and live traffic checked against the offline replay
    quality/   ranking quality: the model against baselines, the order ablation, what the data allows
    data/      preprocessing cost
    harness/   local clusters, load generation and visit streams, for the tests and the benchmarks

`cli` and `report` are the flags and the result files every script shares; `inference_end2end_example.py`
is the replay's entry point under its published name; `gpu_report` runs a GPU machine's first report.
The library (data, kvcache, model, history, serve) never imports anything here.
"""
