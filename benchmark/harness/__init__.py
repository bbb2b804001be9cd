"""What the tests and the benchmarks drive the library with: local clusters, load, visit and live-traffic streams.

Not library: nothing in data, kvcache, model, history or serve imports it.
"""
