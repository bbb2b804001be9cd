"""The dataset's visits as score requests: the stream a benchmark replays and the tests send.

A visit (a row of the dataset's request table) becomes the request a client would send: the user,
the visit's time and the videos shown (the visit's candidates). The node then reads the user's
events before that time, exactly the history `InferenceSession.serve` gives the same visit.
"""
from __future__ import annotations

import json

import numpy as np

from data.dataset import InferenceDataset
from serve.protocol import ScoreQuery


def visit_queries(dataset: InferenceDataset, indices: np.ndarray) -> list[ScoreQuery]:
    """One query per request index, in the given order; request_id = the index."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    req = dataset.requests
    return [ScoreQuery(int(req.user_id[i]), int(req.time_ms[i]), tuple(videos.tolist()), request_id=str(i))
            for i, videos in zip(idx.tolist(), dataset.candidate_video_ids(idx))]


def query_body(query: ScoreQuery) -> bytes:
    """The JSON body of POST /score for `query`."""
    doc = {"user_id": query.user_id, "request_time_ms": query.request_time_ms,
           "candidate_video_ids": list(query.candidate_video_ids)}
    if query.request_id is not None:
        doc["request_id"] = query.request_id
    return json.dumps(doc, separators=(",", ":")).encode()
