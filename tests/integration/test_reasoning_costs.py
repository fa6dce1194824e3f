"""A reasoning model's usage, in every API's shape the router reads (the chat API's answer and
stream, the Responses API's answer and its `response.completed` event), counts each
generated token once: vLLM's completion/output tokens include the reasoning ones, so a turn
row keeps 400 output tokens of which 300 reasoning (not 700), prices the 300 at the
reasoning price and the other 100 at the output price, the GPU meter gives it the decode
steps of 400 tokens, a cost report sums each row once, and what the Anthropic API tells the
client is 400 output tokens too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.api.turns.anthropic_reply import usage as anthropic_usage
from appliance.domain.records import (
    CostMode,
    Price,
    TaskEvent,
    TaskEventType,
    TaskId,
    TaskRecord,
    TenantId,
    TurnId,
    TurnOutcome,
    WorkerId,
)
from appliance.ledger import LedgerWriter
from appliance.ledger.reports import cost_report
from appliance.policy.routing import RouteDecision, RouteKind
from appliance.services.turns.forwarder import UsageScanner, usage_in
from appliance.services.turns.turn import Attempt, TurnRequest
from appliance.services.turns.turn_records import TurnRecords
from appliance.services.workers.gpu_meter import GpuMeter
from tests.fakes import ManualClock

CHAT = {
    "prompt_tokens": 1000,
    "completion_tokens": 400,
    "total_tokens": 1400,
    "prompt_tokens_details": {"cached_tokens": 200},
    "completion_tokens_details": {"reasoning_tokens": 300},
}
RESPONSES = {
    "input_tokens": 1000,
    "input_tokens_details": {"cached_tokens": 200},
    "output_tokens": 400,
    "output_tokens_details": {"reasoning_tokens": 300},
    "total_tokens": 1400,
}


def chat_answer() -> dict[str, Any] | None:
    return usage_in({"id": "c", "choices": [{"message": {"content": "42"}}], "usage": CHAT})


def chat_stream() -> dict[str, Any] | None:
    scanner = UsageScanner()
    chunk = {"choices": [{"delta": {"content": "42"}}]}
    scanner.feed(f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(chunk)[:20]}".encode())
    last = {"choices": [], "usage": CHAT}
    scanner.feed(f"{json.dumps(chunk)[20:]}\n\ndata: {json.dumps(last)}\n\n".encode())
    scanner.feed(b"data: [DONE]\n\n")
    return scanner.last


def responses_answer() -> dict[str, Any] | None:
    return usage_in({"object": "response", "output": [], "usage": RESPONSES})


def responses_stream() -> dict[str, Any] | None:
    scanner = UsageScanner()
    done = {"type": "response.completed", "response": {"id": "r", "usage": RESPONSES}}
    scanner.feed(f"event: response.completed\ndata: {json.dumps(done)}\n\n".encode())
    return scanner.last


SHAPES = [chat_answer, chat_stream, responses_answer, responses_stream]
# Per million: fresh 2, cached 1, output 10, reasoning 30.
PRICE = Price(CostMode.TOKENS, 0.0, "USD", 2.0, 1.0, 10.0, 30.0)
# 800 fresh * 2 + 200 cached * 1 + 100 other output * 10 + 300 reasoning * 30 = 11,800 / 1M
COST = 0.0118


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[LedgerWriter]:
    with LedgerWriter.open(tmp_path / "ledger.db") as writer:
        writer.set_price(PRICE).result()
        yield writer


def attempt(n: int, usage: dict[str, Any]) -> Attempt:
    # The router's estimate of its prefill: 800 fresh tokens at 1 ms (StepCost).
    return Attempt(TurnId(f"{n:032x}"), WorkerId("w0"), 0, 100.0, 0.8, usage=usage)


def request() -> TurnRequest:
    prompt = list(range(1000))
    return TurnRequest(TenantId("a"), "/v1/chat/completions", {}, prompt, TaskId("a/t"))


class StepCost:
    """1 ms per fresh prompt token and 10 ms per decode step."""

    def prefill_s(self, fresh: int, reused: int = 0) -> float:
        return fresh * 1e-3

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        return 0.01


@pytest.mark.parametrize("shape", SHAPES, ids=lambda f: f.__name__)
def test_every_apis_usage_gives_one_row_of_400_output_tokens_300_of_them_reasoning(
    shape: Any,
) -> None:
    usage = shape()
    assert usage is not None
    assert usage["completion_tokens"] == 400
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 300}
    assert anthropic_usage(usage)["output_tokens"] == 400  # the Anthropic API's client


def test_reasoning_tokens_are_priced_once_and_a_report_sums_each_row_once(
    ledger: LedgerWriter,
) -> None:
    clock = ManualClock(100.0)
    records = TurnRecords(ledger, model="m")
    ledger.record_task(TaskRecord(TaskId("a/t"), TenantId("a"), 99.0, task_class="c")).result()
    costs = []
    for n, shape in enumerate(SHAPES):
        a = attempt(n, shape() or {})
        records.placed(a, RouteDecision(WorkerId("w0"), RouteKind.ONLY_ELIGIBLE, "test"), 1000)
        clock.advance(1.0)
        costs.append(records.ended(request(), a, TurnOutcome.OK, None, clock.now()).result())
    ledger.record_task_event(
        TaskEvent(TaskId("a/t"), TaskEventType.SUCCEEDED, clock.now(), verified=True)
    ).result()
    assert costs == [pytest.approx(COST)] * 4
    with ledger.reader() as conn:
        rows = conn.execute("SELECT output_tokens, reasoning_tokens, cost FROM turns").fetchall()
    assert [tuple(r[:2]) for r in rows] == [(400, 300)] * 4
    (group,) = cost_report(ledger.path)
    assert group["attempts"] == 4 and group["succeeded"] == 1
    assert group["cost"] == pytest.approx(4 * COST)
    assert group["cost_per_success"] == pytest.approx(4 * COST)


def test_the_gpu_meter_counts_a_reasoning_turns_decode_steps_once() -> None:
    """Two attempts of the same prompt in flight together on one worker, one of a reasoning
    model (400 completion tokens, 300 of them reasoning), one plain (400): the same compute
    (0.8 s of prefill and 400 steps of 10 ms), so each takes half of the 10 busy seconds;
    counting the reasoning tokens again would give the first 7.8 / 12.6 of them."""
    clock = ManualClock(100.0)
    meter = GpuMeter(clock, StepCost(), lambda w: 1.0)
    reasoning = attempt(1, usage_in({"usage": CHAT}) or {})
    plain = attempt(2, {"prompt_tokens": 1000, "completion_tokens": 400})
    plain.usage["prompt_tokens_details"] = {"cached_tokens": 200}
    meter.began(reasoning, 1000)
    meter.began(plain, 1000)
    clock.advance(10.0)
    plain.chunks = 400  # the plain one's stream relayed its 400 tokens
    first = meter.ended(reasoning)
    second = meter.ended(plain)
    assert first == pytest.approx(5.0) and second == pytest.approx(5.0)
    assert meter.charged_s == pytest.approx(10.0)
