"""What the KV cache costs and saves: its ops, reload from each tier, the codecs, the KV-reuse study."""
