"""The simulated server's pure parts: request validation, error bodies, response shapes,
Prometheus formatting and the tokenizer's rendering, against values written out by hand
from vLLM 0.32's observed answers (never computed by the code under test)."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.sim.core.engine_stats import EngineStats
from appliance.sim.entrypoints import protocol as P
from appliance.sim.entrypoints.api_errors import ApiError, model_not_found, request_validation_error
from appliance.sim.entrypoints.detokenizer import IncrementalDecoder
from appliance.sim.entrypoints.metric_families import FAMILIES, token_buckets
from appliance.sim.entrypoints.metrics import FinishedRequest, Histogram, SimMetrics, go_float
from appliance.sim.entrypoints.responses import final_usage_chunk, prompt_details, usage_info
from appliance.tokenization.chat_template import ChatTemplateError
from appliance.tokenization.tokenizer import FallbackTokenizer, ModelTokenizer

JSON = "application/json"


def error_of(fn: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    return info.value


# --- reading and validating bodies ---


@pytest.mark.parametrize(
    ("raw", "content_type", "status", "err_type", "param"),
    [
        (b'{"model": ', JSON, 400, "Bad Request", "body.10"),
        (b'{"prompt": "x"}', "text/plain", 400, "Bad Request", None),
        (b'{"prompt": "x"}', None, 400, "Bad Request", None),
    ],
    ids=["malformed", "wrong-type", "no-type"],
)
def test_read_json_body_errors(
    raw: bytes, content_type: str | None, status: int, err_type: str, param: str | None
) -> None:
    err = error_of(P.read_json_body, raw, content_type)
    assert (err.status, err.err_type, err.param) == (status, err_type, param)
    assert err.message.startswith("1 validation error:\n  ")


def test_json_decode_error_is_described_like_fastapi() -> None:
    err = error_of(P.read_json_body, b'{"model": "tiny", "messages": [', JSON)
    assert err.message == (
        "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.31', "
        "'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
        "'ctx': {'error': 'Expecting value'}}"
    )


def test_json_with_charset_is_accepted() -> None:
    assert P.read_json_body(b'{"a": 1}', "application/json; charset=utf-8") == {"a": 1}


@pytest.mark.parametrize(
    ("data", "err_type", "param", "message_start"),
    [
        (None, "Bad Request", "body", "1 validation error:"),
        ([1, 2], "Bad Request", "body", "1 validation error:"),
        ({"max_tokens": 1}, "BadRequestError", "prompt", "Either prompt or prompt_embeds"),
        ({"prompt": "x", "cache_salt": ""}, "BadRequestError", "cache_salt", "Parameter"),
        ({"prompt": "x", "cache_salt": 5}, "BadRequestError", "cache_salt", "Parameter"),
        (
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "BadRequestError",
            "stream_options",
            "Stream options can only",
        ),
        ({"prompt": [5, "a"]}, "Bad Request", "body.prompt.1", "5 validation errors:"),
        ({"prompt": 5}, "Bad Request", "body.prompt", "4 validation errors:"),
        ({"prompt": "x", "max_tokens": 2.5}, "Bad Request", "body.max_tokens", "1 validation"),
        ({"prompt": "x", "priority": "high"}, "Bad Request", "body.priority", "1 validation"),
        ({"prompt": "x", "vllm_xargs": {"a": {}}}, "Bad Request", "body.vllm_xargs.a", "4 "),
    ],
)
def test_completion_request_validation(
    data: Any, err_type: str, param: str, message_start: str
) -> None:
    err = error_of(P.validate_body, data, P.CompletionRequest)
    assert (err.status, err.err_type, err.param) == (400, err_type, param)
    assert err.message.startswith(message_start)


def test_union_branches_are_dropped_from_error_locations() -> None:
    err = error_of(P.validate_body, {"prompt": [5, -1]}, P.CompletionRequest)
    first = err.message.splitlines()[1]
    assert first == (
        "  {'type': 'greater_than_equal', 'loc': 'body.prompt.1', 'msg': "
        "'Input should be greater than or equal to 0', 'input': '-1', 'ctx': {'ge': 0}}"
    )


def test_many_errors_are_cut_at_ten() -> None:
    err = request_validation_error([{"loc": ("body", i), "msg": "m"} for i in range(13)])
    assert err.message.splitlines()[0] == "13 validation errors:"
    assert err.message.endswith("  ...and 3 more errors")
    assert len(err.message.splitlines()) == 12


def test_valid_requests_keep_vllm_defaults_and_extras() -> None:
    cmpl = P.validate_body({"prompt": [1, 2], "max_tokens": None, "x": 1}, P.CompletionRequest)
    assert cmpl.max_tokens == 16 and cmpl.n == 1 and not cmpl.ignore_eos
    assert len(cmpl.request_id) == 16 and int(cmpl.request_id, 16) >= 0
    chat = P.validate_body(
        {"messages": [{"role": "user"}], "max_tokens": 9, "max_completion_tokens": 0},
        P.ChatCompletionRequest,
    )
    assert chat.requested_max_tokens == 0  # max_completion_tokens wins even when 0
    assert P.validate_body({"messages": []}, P.ChatCompletionRequest).requested_max_tokens is None


def test_tokenize_forms_report_both_when_neither_fits() -> None:
    err = error_of(
        P.validate_body, {"model": "m"}, P.TokenizeCompletionRequest, P.TokenizeChatRequest
    )
    assert err.param == "body.prompt" and err.message.startswith("2 validation errors:")
    assert "'loc': 'body.messages'" in err.message


# --- checks after validation ---


@pytest.mark.parametrize(
    ("ids", "from_text", "param", "message"),
    [
        ([], False, None, "You must pass at least one prompt"),
        ([5, 2048], False, None, "Token id 2048 is out of vocabulary"),
        ([5] * 5000, False, "input_tokens", "your prompt contains 5000 input tokens"),
        ([5] * 5000, True, "input_tokens", "your prompt contains at least 4097 input tokens"),
    ],
)
def test_prompt_checks(ids: list[int], from_text: bool, param: str | None, message: str) -> None:
    err = error_of(
        P.check_prompt_tokens, ids, max_model_len=4096, max_token_id=2047, from_text=from_text
    )
    assert (err.status, err.err_type, err.param) == (400, "BadRequestError", param)
    assert message in err.message


def test_prompt_length_error_names_parameter_and_value() -> None:
    err = error_of(
        P.check_prompt_tokens, [5] * 5000, max_model_len=4096, max_token_id=9, from_text=False
    )
    assert err.message.endswith("(parameter=input_tokens, value=5000)")


@pytest.mark.parametrize(
    ("requested", "prompt_len", "expected"),
    [(16, 10, 16), (None, 10, 4086), (10, 4090, 6), (1, 4095, 1)],
)
def test_max_tokens_are_clamped_to_the_context(
    requested: int | None, prompt_len: int, expected: int
) -> None:
    assert P.effective_max_tokens(requested, prompt_len, 4096) == expected


@pytest.mark.parametrize(("requested", "prompt_len", "got"), [(0, 5, 0), (-1, 5, -1), (5, 4096, 0)])
def test_max_tokens_below_one_are_rejected(requested: int, prompt_len: int, got: int) -> None:
    err = error_of(P.effective_max_tokens, requested, prompt_len, 4096)
    assert (
        err.message
        == f"max_tokens must be at least 1, got {got}. (parameter=max_tokens, value={got})"
    )
    assert err.param == "max_tokens"


@pytest.mark.parametrize(
    ("body", "headers", "expected"),
    [
        ({"session_id": "b"}, {"x-session-id": "h"}, "b"),
        ({}, {"x-session-id": "h"}, "h"),
        ({"vllm_xargs": {"session_id": "x"}}, {}, "x"),
        ({}, {}, None),
    ],
)
def test_session_id_precedence(body: dict, headers: dict, expected: str | None) -> None:
    req = P.validate_body({"prompt": "p", **body}, P.CompletionRequest)
    assert P.session_id_of(req, headers) == expected


def test_request_id_header_overrides_the_body() -> None:
    req = P.validate_body({"prompt": "p", "request_id": "body-id"}, P.CompletionRequest)
    assert P.base_request_id(req, {}) == "body-id"
    assert P.base_request_id(req, {"x-request-id": "hdr"}) == "hdr"


def test_error_body_and_not_found_message() -> None:
    err = model_not_found("nope", ["tiny"])
    assert err.body() == {
        "error": {
            "message": "The model `nope` does not exist. Valid aliases: tiny.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


# --- response shapes ---


def test_usage_and_final_usage_chunk() -> None:
    usage = usage_info(10, 3, prompt_details(8, None))
    assert list(usage) == [
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "completion_tokens_details",
    ]
    assert usage["total_tokens"] == 13
    chunk = final_usage_chunk({"id": "x"}, usage, "fp")
    assert chunk == {
        "id": "x",
        "choices": [],
        "usage": {
            "prompt_tokens": 10,
            "total_tokens": 13,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
        "system_fingerprint": "fp",
    }


# --- Prometheus text ---


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0.0"),
        (8398, "8398.0"),
        (1.2268178462982178, "1.2268178462982178"),
        (1795996470.175285, "1.795996470175285e+09"),
        (1.7959964701757762e09, "1.7959964701757762e+09"),
        (float("inf"), "+Inf"),
        (0.001, "0.001"),
    ],
)
def test_values_are_written_like_prometheus_client(value: float, text: str) -> None:
    assert go_float(value) == text


def test_token_buckets_follow_1_2_5_up_to_max_model_len() -> None:
    assert token_buckets(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert token_buckets(1000)[-1] == 1000


def test_histogram_bucket_upper_bounds_are_inclusive() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.1, 0.5, 1.0, 2.0):
        h.observe(v)
    assert (h.counts, h.count, h.total) == ([1, 2, 1], 4, 3.6)


def stats(**overrides: Any) -> EngineStats:
    base: dict[str, Any] = {
        "num_running": 2,
        "num_waiting": 1,
        "kv_cache_usage": 0.25,
        "prefix_cache_queries": 300,
        "prefix_cache_hits": 96,
        "prompt_tokens_total": 300,
        "prompt_tokens_by_source": {"local_cache_hit": 96, "local_compute": 204},
        "generation_tokens_total": 12,
        "num_preemptions_total": 0,
        "request_success_total": {"stop": 0, "length": 3, "abort": 1},
    }
    return EngineStats(**{**base, **overrides})


def test_metrics_text_layout() -> None:
    m = SimMetrics(model_name="tiny", max_model_len=4096, cache_config={"block_size": "32"})
    m.observe_request(
        FinishedRequest(
            prompt_tokens=100,
            generation_tokens=4,
            max_tokens=4,
            n=1,
            num_preemptions=0,
            prefill_computed_tokens=100,
            queue_s=0.0,
            ttft_s=0.02,
            e2e_s=0.05,
            prefill_s=0.02,
            decode_s=0.03,
            inter_token_s=(0.01, 0.01, 0.01),
        )
    )
    lines = m.render(stats()).splitlines()
    assert lines[:3] == [
        "# HELP vllm:estimated_flops_per_gpu_total Estimated number of floating point operations "
        "per GPU (for Model Flops Utilization calculations).",
        "# TYPE vllm:estimated_flops_per_gpu_total counter",
        'vllm:estimated_flops_per_gpu_total{engine="0",model_name="tiny"} 0.0',
    ]
    assert lines[3].startswith("# HELP vllm:estimated_flops_per_gpu_created ")
    assert "# TYPE vllm:estimated_flops_per_gpu_created gauge" in lines
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 96.0' in lines
    assert 'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0' in lines
    assert (
        'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 1.0'
        in lines
    )
    cached = 'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="tiny",source='
    assert cached + '"device"} 96.0' in lines
    assert (
        'vllm:admission_rejections_total{model_name="tiny",reason="max_num_queued_reqs"} 0.0'
        in lines
    )
    assert (
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="tiny"} 1.0'
        in lines
    )
    assert (
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="tiny"} 0.0'
        in lines
    )
    assert 'vllm:inter_token_latency_seconds_count{engine="0",model_name="tiny"} 3.0' in lines
    assert lines[-1] == 'vllm:cache_config_info{block_size="32",engine="0"} 1.0'
    helps = [line.split()[2] for line in lines if line.startswith("# HELP ")]
    assert len(helps) == len(set(helps)) == 2 * len(FAMILIES) - 5 + 1  # 5 gauges lack _created


def test_families_table_is_complete() -> None:
    by_name = {f.name: f for f in FAMILIES}
    assert by_name["vllm:request_success"].values == (
        "stop",
        "length",
        "abort",
        "error",
        "repetition",
    )
    assert by_name["vllm:e2e_request_latency_seconds"].kind == "histogram"
    assert by_name["vllm:kv_cache_usage_perc"].help == "KV-cache usage. 1 means 100 percent usage."
    assert sum(f.kind == "gauge" for f in FAMILIES) == 5


# --- tokenizer ---


def test_fallback_tokenizer_is_deterministic() -> None:
    a, b = FallbackTokenizer(), FallbackTokenizer()
    text = "the quick brown fox, the quick"
    assert a.encode(text) == b.encode(text)
    ids = a.encode(text)
    # BOS, "the", " quick", " brown", " fox", ",", " the", " quick"
    assert ids[0] == 1 and ids[2] == ids[7] and ids[1] != ids[6] and len(ids) == 8
    assert a.encode("<s>hi</s>", add_special_tokens=False)[::2] == [1, 2]
    assert all(4 <= i < 32000 for i in a.word_token_ids)


def test_chat_template_renders_like_transformers() -> None:
    tok = FallbackTokenizer()
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert tok.render_chat(messages) == "<s><|user|>\na\nb</s>\n<|assistant|>\n"
    assert tok.render_chat([{"role": "user"}], add_generation_prompt=False) == "<s><|user|>\n</s>\n"
    cont = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial"}]
    rendered = tok.render_chat(cont, add_generation_prompt=False, continue_final_message=True)
    assert rendered == "<s><|user|>\nq</s>\n<|assistant|>\npartial"
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        tok.render_chat([])


class _Bytes(ModelTokenizer):
    """Token i is byte i: a two-byte UTF-8 character decodes only once both are in."""

    def decode(self, ids: Any, *, skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_decoder_holds_back_partial_characters() -> None:
    dec = IncrementalDecoder(_Bytes())
    e_acute = "é".encode()
    assert [dec.push([ord("a")]), dec.push([e_acute[0]]), dec.push([e_acute[1]])] == ["a", "", "é"]
