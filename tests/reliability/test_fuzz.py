"""Schema-driven fuzzing (schemathesis) of a real server over the OpenAPI document it serves: every operation,
bodies that fit the schema and bodies that do not, a bounded number of examples each, and not one server error.

The server runs with a small context (--context-length 64), so that no fuzzed request can ask for long work.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.reliability.harness import record, start_server

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 80  # per operation and generation mode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("fuzz"), "--context-length", "64", "--max-running-requests", "64")
    yield srv
    srv.stop()


def test_fuzz_the_documented_api_finds_no_server_error(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    cases = 0
    by_status: dict[int, int] = {}
    server_errors: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal cases
                response = case.call(base_url=server.url, timeout=60)
                cases += 1
                by_status[response.status_code] = by_status.get(response.status_code, 0) + 1
                if response.status_code >= 500:
                    server_errors.append(f"{case.method} {case.path} {response.status_code}: {response.text[:300]} "
                                         f"<- {str(case.body)[:300]}")

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (an operation with no parameters)
                assert mode is GenerationMode.NEGATIVE
    record("fuzz_operations", len(operations))
    record("fuzz_cases", cases)
    record("fuzz_statuses", dict(sorted(by_status.items())))
    record("fuzz_5xx", len(server_errors))
    assert not server_errors, server_errors[:5]
    assert "Traceback" not in server.log_text()
