"""Golden usage shapes of each provider, normalised into disjoint buckets (streaming included)."""

from __future__ import annotations

import pytest

from kvroute.billing.usage import TokenBuckets, normalize_usage, usage_from_stream
from kvroute.policies.errors import InputError

GOLDEN = {
    "openai_chat": (
        {"prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
         "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0},
         "completion_tokens_details": {"reasoning_tokens": 128, "audio_tokens": 0}},
        None, TokenBuckets(86, 1920, 0, 0, 300, 128)),
    "openai_chat_cache_write_gpt56": (
        {"prompt_tokens": 5000, "completion_tokens": 10,
         "prompt_tokens_details": {"cached_tokens": 1024, "cache_write_tokens": 2048}},
        None, TokenBuckets(1928, 1024, 2048, 0, 10, 0)),
    "openai_responses": (
        {"input_tokens": 1500, "input_tokens_details": {"cached_tokens": 1024}, "output_tokens": 50,
         "output_tokens_details": {"reasoning_tokens": 20}, "total_tokens": 1550},
        "openai", TokenBuckets(476, 1024, 0, 0, 50, 20)),
    # Anthropic Messages: input_tokens EXCLUDES cache reads and writes (they are additive)
    "anthropic": (
        {"input_tokens": 21, "cache_creation_input_tokens": 188086, "cache_read_input_tokens": 0,
         "output_tokens": 393},
        "anthropic", TokenBuckets(21, 0, 188086, 0, 393, 0)),
    "anthropic_ttl_split": (
        {"input_tokens": 50, "cache_read_input_tokens": 100000, "cache_creation_input_tokens": 3000,
         "cache_creation": {"ephemeral_5m_input_tokens": 1000, "ephemeral_1h_input_tokens": 2000},
         "output_tokens": 7},
        "anthropic", TokenBuckets(50, 100000, 1000, 2000, 7, 0)),
    # LiteLLM's Usage for Anthropic: prompt_tokens already includes reads and writes
    "litellm_anthropic": (
        {"prompt_tokens": 103050, "completion_tokens": 7, "cache_read_input_tokens": 100000,
         "cache_creation_input_tokens": 3000,
         "prompt_tokens_details": {"cached_tokens": 100000, "cache_write_tokens": 3000,
                                   "cache_creation_token_details": {"ephemeral_5m_input_tokens": 1000,
                                                                    "ephemeral_1h_input_tokens": 2000}}},
        "anthropic", TokenBuckets(50, 100000, 1000, 2000, 7, 0)),
    "gemini_rest": (
        {"usageMetadata": {"promptTokenCount": 12000, "cachedContentTokenCount": 8000,
                           "candidatesTokenCount": 200, "thoughtsTokenCount": 300, "totalTokenCount": 12500}},
        "gemini", TokenBuckets(4000, 8000, 0, 0, 500, 300)),
    "gemini_python": (
        {"usage_metadata": {"prompt_token_count": 1200, "cached_content_token_count": 1024,
                            "candidates_token_count": 20}},
        "gemini", TokenBuckets(176, 1024, 0, 0, 20, 0)),
    "deepseek": (
        {"prompt_tokens": 1500, "completion_tokens": 80, "prompt_cache_hit_tokens": 1280,
         "prompt_cache_miss_tokens": 220, "completion_tokens_details": {"reasoning_tokens": 60}},
        "deepseek", TokenBuckets(220, 1280, 0, 0, 80, 60)),
    "openrouter": (
        {"prompt_tokens": 10339, "completion_tokens": 60, "total_tokens": 10399, "cost": 0.00492,
         "prompt_tokens_details": {"cached_tokens": 10318, "cache_write_tokens": 0, "audio_tokens": 0},
         "completion_tokens_details": {"reasoning_tokens": 0},
         "cost_details": {"upstream_inference_cost": 0.0041}},
        "openrouter", TokenBuckets(21, 10318, 0, 0, 60, 0)),
    "vllm": (
        {"prompt_tokens": 4096, "completion_tokens": 64, "total_tokens": 4160,
         "prompt_tokens_details": {"cached_tokens": 3968}},
        "hosted_vllm", TokenBuckets(128, 3968, 0, 0, 64, 0)),
    "vllm_no_prefix_caching": (
        {"prompt_tokens": 4096, "completion_tokens": 64, "total_tokens": 4160, "prompt_tokens_details": None},
        "hosted_vllm", TokenBuckets(4096, 0, 0, 0, 64, 0)),
    "llamacpp_timings": (
        {"prompt_tokens": 530, "completion_tokens": 16, "total_tokens": 546,
         "timings": {"cache_n": 512, "prompt_n": 18, "predicted_n": 16, "prompt_ms": 12.1}},
        "llamacpp", TokenBuckets(18, 512, 0, 0, 16, 0)),
    "llamacpp_details": (
        {"prompt_tokens": 530, "completion_tokens": 16, "prompt_tokens_details": {"cached_tokens": 512}},
        "llamacpp", TokenBuckets(18, 512, 0, 0, 16, 0)),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_shapes(name: str) -> None:
    usage, provider, expected = GOLDEN[name]
    got = normalize_usage(usage, provider)
    assert got == expected
    assert got.reasoning <= got.output


def test_usage_objects_are_read_like_dicts() -> None:
    class Details:
        cached_tokens = 3968

    class Usage:
        def __init__(self) -> None:
            self.prompt_tokens = 4096
            self.completion_tokens = 64
            self.prompt_tokens_details = Details()

    # plain objects: attributes are read, private ones ignored
    usage = Usage()
    usage.prompt_tokens_details = {"cached_tokens": 3968}
    assert normalize_usage(usage) == TokenBuckets(128, 3968, 0, 0, 64, 0)


def test_litellm_usage_object() -> None:
    from litellm.types.utils import Usage
    u = Usage(prompt_tokens=103050, completion_tokens=7, cache_read_input_tokens=100000,
              cache_creation_input_tokens=3000)
    got = normalize_usage(u, "anthropic")
    assert got.cache_read == 100000 and got.cache_write_5m == 3000 and got.input_uncached == 50


def test_inconsistent_usage_is_an_input_error() -> None:
    with pytest.raises(InputError, match="exceed prompt tokens"):
        normalize_usage({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 20}})
    with pytest.raises(InputError, match="unrecognised usage shape"):
        normalize_usage({"tokens": 5})


def test_stream_openai_include_usage() -> None:
    chunks = [{"choices": [{"delta": {"content": "Hel"}}], "usage": None},
              {"choices": [{"delta": {"content": "lo"}}], "usage": None},
              {"choices": [], "usage": {"prompt_tokens": 2006, "completion_tokens": 2,
                                        "prompt_tokens_details": {"cached_tokens": 1920}}}]
    assert usage_from_stream(chunks) == TokenBuckets(86, 1920, 0, 0, 2, 0)


def test_stream_anthropic_events() -> None:
    events = [
        {"type": "message_start", "message": {"usage": {"input_tokens": 25, "cache_read_input_tokens": 5000,
                                                        "cache_creation_input_tokens": 700, "output_tokens": 1}}},
        {"type": "content_block_delta", "delta": {"text": "hi"}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 15}},
        {"type": "message_delta", "usage": {"output_tokens": 42}},
        {"type": "message_stop"},
    ]
    assert usage_from_stream(events, "anthropic") == TokenBuckets(25, 5000, 700, 0, 42, 0)


def test_stream_gemini_cumulative_metadata() -> None:
    chunks = [{"usageMetadata": {"promptTokenCount": 1200, "cachedContentTokenCount": 1024,
                                 "candidatesTokenCount": 5}},
              {"usageMetadata": {"promptTokenCount": 1200, "cachedContentTokenCount": 1024,
                                 "candidatesTokenCount": 30, "thoughtsTokenCount": 10}}]
    assert usage_from_stream(chunks, "gemini") == TokenBuckets(176, 1024, 0, 0, 40, 10)


def test_stream_llamacpp_final_timings() -> None:
    chunks = [{"choices": [{"delta": {"content": "x"}}]},
              {"choices": [{"delta": {}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 530, "completion_tokens": 16},
               "timings": {"cache_n": 512, "prompt_n": 18, "predicted_n": 16}}]
    assert usage_from_stream(chunks) == TokenBuckets(18, 512, 0, 0, 16, 0)


def test_stream_deepseek_final_chunk() -> None:
    chunks = [{"choices": [{"delta": {"content": "x"}}], "usage": None},
              {"choices": [], "usage": {"prompt_tokens": 1500, "completion_tokens": 80,
                                        "prompt_cache_hit_tokens": 1280, "prompt_cache_miss_tokens": 220}}]
    assert usage_from_stream(chunks, "deepseek") == TokenBuckets(220, 1280, 0, 0, 80, 0)
