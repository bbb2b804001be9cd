"""Ranking quality: the model against baselines, the order ablation, tag probes, and what the data allows."""
