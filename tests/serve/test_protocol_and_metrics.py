"""The API's request checks (status, code, message) and the Prometheus text exposition."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data.schema import TIME_MS_RANGE
from serve.metrics import Registry, histogram_quantile, parse_samples
from serve.protocol import ScoreQuery, parse_score_request

GOOD = {"user_id": 3, "request_time_ms": 1_650_000_000_000, "candidate_video_ids": [5, 7]}


def body(**changes) -> bytes:
    doc = {**GOOD, **changes}
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


def test_a_good_request_parses():
    assert parse_score_request(body(request_id="r1")) == ScoreQuery(3, 1_650_000_000_000, (5, 7), "r1")


@pytest.mark.parametrize("raw, status, code, message", [
    (b"{not json", 400, "malformed_json", "not valid JSON"),
    (b"\xff\xfe", 400, "malformed_json", "not valid JSON"),
    (b"[1, 2]", 400, "malformed_request", "must be a JSON object, got list"),
    (body(user_id=...), 400, "missing_field", "['user_id']"),
    (body(extra=1), 400, "unknown_field", "['extra']"),
    (body(user_id="3"), 400, "invalid_field", 'user_id must be an integer in [0, 2**63), got "3"'),
    (body(user_id=True), 400, "invalid_field", "user_id must be an integer"),
    (body(request_time_ms=-1), 400, "invalid_field", "request_time_ms must be epoch milliseconds in [946684800000, "),
    (body(request_time_ms=2**42), 400, "invalid_field", f"got {2**42}"),
    (body(request_time_ms=1.5e12), 400, "invalid_field", "request_time_ms must be epoch milliseconds"),
    (b'{"user_id": 3, "request_time_ms": 1650000000000, "candidate_video_ids": [5], "request_id": "\\ud800"}',
     400, "invalid_field", "request_id holds a lone surrogate"),
    (body(candidate_video_ids=5), 400, "invalid_field", "candidate_video_ids must be a list"),
    (body(candidate_video_ids=[]), 400, "invalid_field", "user 3: candidate_video_ids is empty"),
    (body(candidate_video_ids=[1, 2.5]), 400, "invalid_field", "candidate_video_ids[1] must be an integer"),
    (body(candidate_video_ids=[2**63]), 400, "invalid_field", "candidate_video_ids[0]"),
    (body(candidate_video_ids=list(range(5))), 422, "too_many_candidates", "user 3: 5 candidate_video_ids, at most 4"),
    (body(request_id=7), 400, "invalid_field", "request_id must be a string"),
])
def test_bad_requests_are_refused_with_status_code_and_message(raw, status, code, message):
    from serve.protocol import RequestError

    with pytest.raises(RequestError) as caught:
        parse_score_request(raw, max_candidates=4)
    err = caught.value
    assert (err.status, err.code) == (status, code)
    assert message in err.message
    assert err.to_json() == {"error": {"code": code, "message": err.message}}


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.integers(), st.integers(*TIME_MS_RANGE), st.sampled_from([TIME_MS_RANGE[0] - 1, TIME_MS_RANGE[1] + 1])))
def test_a_request_time_is_taken_only_where_the_model_can_stamp_it(time_ms):
    """What the protocol takes, a token stamp holds (the packing raises past its 42 bits, failing the batch)."""
    import numpy as np

    from model.attention.token_stamp import token_stamps
    from serve.protocol import RequestError

    if TIME_MS_RANGE[0] <= time_ms <= TIME_MS_RANGE[1]:
        assert parse_score_request(body(request_time_ms=time_ms)).request_time_ms == time_ms
        assert token_stamps(np.array([time_ms]), np.array([1])).tolist() != [-1]
    else:
        with pytest.raises(RequestError) as caught:
            parse_score_request(body(request_time_ms=time_ms))
        assert (caught.value.status, caught.value.code) == (400, "invalid_field")
        assert caught.value.message.startswith(f"request_time_ms must be epoch milliseconds in {list(TIME_MS_RANGE)}")


def test_exposition_format_and_round_trip():
    registry = Registry()
    requests = registry.counter("x_requests_total", "Requests.", ("code",))
    requests.inc(code="200")
    requests.inc(2, code="400")
    latency = registry.histogram("x_seconds", "Latency.", buckets=(0.1, 1.0))
    for value in (0.05, 0.5, 5.0):
        latency.observe(value)
    registry.gauge_callback("x_depth", "Depth.", lambda: 3)
    registry.gauge_callback("x_stat", "Stats.", lambda: {("hits",): 4}, ("stat",))
    text = registry.render()
    assert "# TYPE x_requests_total counter" in text and "# TYPE x_seconds histogram" in text
    assert "_created" not in text  # no timestamp series beside every counter and histogram
    samples = parse_samples(text)
    assert samples['x_requests_total{code="200"}'] == 1 and samples['x_requests_total{code="400"}'] == 2
    assert samples['x_seconds_bucket{le="0.1"}'] == 1 and samples['x_seconds_bucket{le="1.0"}'] == 2
    assert samples['x_seconds_bucket{le="+Inf"}'] == 3 and samples["x_seconds_count"] == 3
    assert samples["x_seconds_sum"] == pytest.approx(5.55)
    assert samples["x_depth"] == 3 and samples['x_stat{stat="hits"}'] == 4
    assert histogram_quantile(0.5, samples, "x_seconds") == pytest.approx(0.55)  # 2nd of 3 in (0.1, 1]
    with pytest.raises(ValueError, match="label names"):
        requests.inc(node="a")
    with pytest.raises(ValueError, match="non-negative"):
        requests.inc(-1, code="200")
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.gauge_callback("x_depth", "Again.", lambda: 1)


def test_registries_are_per_process_part():
    """Two routers (or nodes) in one process count apart: neither writes the global default registry."""
    first, second = Registry(), Registry()
    first.counter("x_total", "X.").inc(3)
    second.counter("x_total", "X.").inc()
    assert parse_samples(first.render())["x_total"] == 3 and parse_samples(second.render())["x_total"] == 1


@pytest.mark.parametrize("raw, message", [
    (b'{"events": [], "batch_id": "a\\ud800b"}', "batch_id holds a lone surrogate at character 1"),
    (b'{"events": [], "batch_id": ""}', "batch_id must be a non-empty string"),
])
def test_a_batch_id_that_no_store_can_hold_is_refused(raw, message):
    from serve.protocol import RequestError, parse_events_request

    with pytest.raises(RequestError) as caught:
        parse_events_request(raw)
    assert (caught.value.status, caught.value.code) == (400, "invalid_field")
    assert message in caught.value.message
