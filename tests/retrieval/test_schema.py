"""The /retrieve wire format: validation of every kind of bad input, and the response round trip."""

import json

import pytest

from retrieval.schema import Limits, RequestError, format_result, parse_result, parse_retrieve_request

L = Limits(max_queries=4, max_query_chars=20, max_topk=10, default_topk=3, max_body_bytes=300)


def parse(obj):
    return parse_retrieve_request(obj if isinstance(obj, bytes) else json.dumps(obj).encode(), L)


def test_valid_request_and_defaults():
    r = parse({"queries": ["a", "b"], "topk": 5, "return_scores": True})
    assert (r.queries, r.topk, r.return_scores) == (["a", "b"], 5, True)
    r = parse({"queries": ["a"]})  # Search-R1 defaults: server topk, no scores
    assert (r.topk, r.return_scores) == (3, False)
    assert parse({"queries": ["a"], "topk": None, "extra": 1}).topk == 3  # unknown keys ignored, like pydantic


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "malformed JSON"),
    (b"\xff\xfe", 400, "malformed JSON"),
    ([1, 2], 422, "JSON object"),
    ({"topk": 3}, 422, "missing field 'queries'"),
    ({"queries": "one string"}, 422, "must be a list"),
    ({"queries": ["a"] * 5}, 422, "limit is 4"),
    ({"queries": ["ok", 7]}, 422, "queries[1] is int"),
    ({"queries": ["ok", None]}, 422, "queries[1] is NoneType"),
    ({"queries": ["  "]}, 422, "queries[0] is empty"),
    ({"queries": ["x" * 21]}, 422, "21 characters"),
    ({"queries": ["a"], "topk": 0}, 422, "between 1 and 10"),
    ({"queries": ["a"], "topk": -2}, 422, "between 1 and 10"),
    ({"queries": ["a"], "topk": 11}, 422, "between 1 and 10"),
    ({"queries": ["a"], "topk": 2.5}, 422, "must be an integer"),
    ({"queries": ["a"], "topk": "3"}, 422, "must be an integer"),
    ({"queries": ["a"], "topk": True}, 422, "must be an integer"),
    ({"queries": ["a"], "return_scores": "yes"}, 422, "true or false"),
    (b"{" + b" " * 400 + b"}", 413, "limit is 300"),
    (b'{"queries": ["ok", "a\\ud800b"]}', 422, "queries[1] holds a lone surrogate"),
    (b'{"queries": ["\\udfff"]}', 422, "queries[0] holds a lone surrogate"),
])
def test_bad_requests_get_4xx_with_a_message(body, status, needle):
    with pytest.raises(RequestError) as e:
        parse(body)
    assert e.value.status == status
    assert needle in e.value.message


def test_empty_queries_is_a_valid_request():
    # Search-R1's trainer sends {"queries": []} on a step where no rollout searched
    r = parse({"queries": [], "topk": 3, "return_scores": True})
    assert (r.queries, r.topk, r.return_scores) == ([], 3, True)


def test_default_limits_take_a_searchr1_step_in_one_request():
    # Search-R1 sends every search of a step at once: 512 prompts x 5 samples
    d = Limits()
    assert d.max_queries >= 4096
    step = json.dumps({"queries": ["x" * d.max_query_chars] * 2560, "topk": 3, "return_scores": True})
    assert len(step.encode()) <= d.max_body_bytes


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"queries": ["a"], "topk": ' + b"{\"k\": " * 50_000])
def test_deeply_nested_json_is_a_400_not_a_recursion_error(body):
    with pytest.raises(RequestError) as e:
        parse_retrieve_request(body, Limits(max_body_bytes=1 << 20))
    assert e.value.status == 400 and "nested too deeply" in e.value.message


def test_a_surrogate_pair_is_fine_and_messages_stay_short():
    assert parse(b'{"queries": ["\\ud83c\\udfb5"]}').queries == ["\U0001f3b5"]  # a valid pair decodes to one char
    big = Limits(max_body_bytes=1 << 20)
    with pytest.raises(RequestError) as e:
        parse_retrieve_request(json.dumps({"queries": ["a"], "topk": "9" * 100_000}).encode(), big)
    assert e.value.status == 422 and len(e.value.message) < 300  # names the value without echoing 100 kB


def test_response_round_trip_with_and_without_scores():
    docs = [[{"id": "1", "contents": "T\nx", "score": 0.5}, {"id": "2", "contents": "U\ny", "score": 0.25}], []]
    with_scores = format_result(docs, True)
    assert with_scores == {"result": [[{"document": {"id": "1", "contents": "T\nx"}, "score": 0.5},
                                       {"document": {"id": "2", "contents": "U\ny"}, "score": 0.25}], []]}
    assert parse_result(json.loads(json.dumps(with_scores)), 2) == docs
    without = format_result(docs, False)
    assert without == {"result": [[{"id": "1", "contents": "T\nx"}, {"id": "2", "contents": "U\ny"}], []]}
    assert [[d["id"] for d in row] for row in parse_result(without, 2)] == [["1", "2"], []]


def test_parse_result_accepts_flashrag_rows_and_rejects_misaligned():
    payload = {"result": [[{"document": {"id": 7, "title": "T", "text": "body"}, "score": 1}]]}
    assert parse_result(payload, 1) == [[{"id": "7", "contents": "T\nbody", "score": 1.0}]]
    with pytest.raises(ValueError, match="2 queries"):
        parse_result(payload, 2)
    with pytest.raises(ValueError, match="no 'result'"):
        parse_result({"detail": "x"}, 1)
