"""A node refuses to start over a store whose retention keeps fewer events than its model's window reads."""
from __future__ import annotations

import pytest

from history.bootstrap import bootstrap_from_output
from history.retention import Retention
from history.sqlite_store import SQLiteHistoryStore
from serve.engine import EngineConfig, open_engine


def test_a_node_over_a_store_that_folds_inside_its_window_is_refused_at_start(serving_artifacts, tmp_path):
    data_dir, checkpoint = serving_artifacts
    path = tmp_path / "history.sqlite"
    with SQLiteHistoryStore(path) as store:
        bootstrap_from_output(store, data_dir, progress=False)
        store.set_retention(Retention(keep_events=8, window_events=4))
    config = EngineConfig(data_dir=None, checkpoint=str(checkpoint), history_store=f"sqlite://{path}")
    with pytest.raises(ValueError, match="retention keeps a window of 4 events, the model reads up to"):
        open_engine(config)
