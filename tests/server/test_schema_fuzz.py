"""Property-based requests generated from the server's own /openapi.json never get a 5xx.

Schemathesis draws bodies, paths and values from the published schema, both valid ones (positive:
they run real generations) and schema-violating ones (negative). The server gets a small token
limit so that every valid request finishes in a few steps; the run is sized to stay under a minute
on two cores.
"""

from __future__ import annotations

import time

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

EXAMPLES = 200


def test_no_server_errors_from_schema_driven_requests(make_server):
    live = make_server(max_prompt_tokens=64, max_new_tokens=16)
    schema = schemathesis.openapi.from_dict(httpx.get(live.url + "/openapi.json").json())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} >= {("POST", "/v1/completions"),
                                                                   ("POST", "/v1/chat/completions")}
    cases = st.one_of([op.as_strategy(generation_mode=mode) for op in operations
                       for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    statuses: dict[int, int] = {}
    started = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case):
        response = case.call(base_url=live.url, headers=live.headers, timeout=30)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, f"{case.as_curl_command()}\n-> {response.status_code} {response.text}"

    check()
    assert time.monotonic() - started < 60
    assert statuses.get(200, 0) > 0 and any(400 <= s < 500 for s in statuses), statuses
    assert live.wait_idle()
    assert httpx.get(live.url + "/health").status_code == 200
