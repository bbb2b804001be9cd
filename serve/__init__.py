"""Serving across nodes: a scoring node with dynamic batching, a Redis locality index, a KV-aware router.

    python -m serve.node   --data_dir DIR --checkpoint DIR --port 8001 --redis_url redis://127.0.0.1:6379/0
    python -m serve.router --nodes 127.0.0.1:8001,127.0.0.1:8002 --policy kv-aware --redis_url ... --port 8000

One concept per module (docs/serving.md draws how they fit):

* `protocol`: the HTTP API's values (a score request parsed and checked, the JSON answered, errors);
* `batcher`: dynamic batching (a maximum batch size and wait; a user's requests in order);
* `engine`: a node's scoring over `InferenceSession`, with per-visit cache accounting;
* `locality_index` / `index_publisher`: which node holds which user's K/V, in Redis, and its writer;
* `policies`: how the router picks a node; `node_pool`: the router's view of its nodes' health;
* `metrics`: Prometheus metrics (prometheus-client); `client`: a client that retries on another router;
* `node` / `router`: the two HTTP processes, thin layers over the above.

The package root imports nothing heavy: the router never imports torch.
"""
