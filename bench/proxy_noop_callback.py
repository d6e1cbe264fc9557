"""A LiteLLM callback with kvroute's hook methods, each doing nothing: what LiteLLM itself spends on calling them.

``bench/proxy_cpu.py`` runs a proxy with it (``litellm_settings.callbacks: ["proxy_noop_callback.noop_callback"]``,
``bench/`` on ``PYTHONPATH``) between the plain proxy and kvroute's, so kvroute's own cost and LiteLLM's cost of
dispatching to any callback show apart.
"""

from __future__ import annotations

from typing import Any

from litellm.integrations.custom_logger import CustomLogger


class NoopCallback(CustomLogger):
    """The hooks ``kvroute.plugin.adapter.litellm_hooks.KvrouteCallback`` implements, with no work in them."""

    async def async_filter_deployments(self, model: str, healthy_deployments: list, messages: Any,
                                       request_kwargs: dict | None = None, parent_otel_span: Any = None) -> list:
        return healthy_deployments

    async def async_pre_call_deployment_hook(self, kwargs: dict, call_type: Any) -> dict | None:
        return None

    async def async_post_call_streaming_deployment_hook(self, request_data: dict, response_chunk: Any,
                                                        call_type: Any) -> Any:
        return None

    async def async_post_call_streaming_iterator_hook(self, user_api_key_dict: Any, response: Any,
                                                      request_data: dict) -> Any:
        async for item in response:
            yield item

    async def async_log_success_event(self, kwargs: dict, response_obj: Any, start_time: Any, end_time: Any) -> None:
        return None

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict, call_type: Any) -> None:
        return None

    async def async_post_call_success_deployment_hook(self, request_data: dict, response: Any,
                                                      call_type: Any) -> Any:
        return None

    async def async_post_call_success_hook(self, data: dict, user_api_key_dict: Any, response: Any) -> Any:
        return None

    async def async_post_call_failure_hook(self, request_data: dict, original_exception: Exception,
                                           user_api_key_dict: Any, traceback_str: str | None = None) -> Any:
        return None

    async def async_post_call_failure_deployment_hook(self, request_data: dict, exception: Exception,
                                                      call_type: Any, fallback_depth: int | None = None) -> None:
        return None

    async def async_log_failure_event(self, kwargs: dict, response_obj: Any, start_time: Any, end_time: Any) -> None:
        return None

    async def log_success_fallback_event(self, original_model_group: str, kwargs: dict,
                                         original_exception: Exception) -> None:
        return None


noop_callback = NoopCallback()


def _only(*hooks: str) -> CustomLogger:
    """A callback overriding just ``hooks`` (each doing nothing), to price LiteLLM's dispatch hook by hook."""
    cls = type("NoopOnly_" + "_".join(hooks), (CustomLogger,), {h: getattr(NoopCallback, h) for h in hooks})
    return cls()


noop_filter = _only("async_filter_deployments")
noop_pre_call = _only("async_pre_call_deployment_hook")
noop_success = _only("async_log_success_event")
noop_failure = _only("async_post_call_failure_deployment_hook", "async_log_failure_event")
noop_stream = _only("async_post_call_streaming_deployment_hook", "async_post_call_streaming_iterator_hook")
