"""vLLM's token endpoints for the fake engine: ``/tokenize``, ``/detokenize`` and the render endpoints.

The fake tokenizer cuts the UTF-8 prompt into 4-byte tokens (``fake_cache.BYTES_PER_TOKEN``); a token's id is its
bytes read as a little-endian unsigned 32-bit integer (a short last token is zero-padded), so ids are stable,
a prompt's ids start with the ids of every prefix cut at a token boundary, and ``/detokenize`` inverts them.

Request and response shapes follow vLLM's OpenAI-compatible server (0.11–0.13 era), which routers such as
vllm-router 0.1.17 call before choosing a replica:

- ``POST /tokenize`` ``{"model", "prompt"}`` or ``{"model", "messages", "add_generation_prompt"?,
  "continue_final_message"?}`` → ``{"count", "max_model_len", "tokens", "token_strs": null}``
  (``"return_token_strs": true`` fills ``token_strs``);
- ``POST /detokenize`` ``{"model", "tokens"}`` → ``{"prompt"}``;
- ``POST /v1/chat/completions/render`` (a chat request body) → one ``GenerateRequest``-shaped object
  ``{"request_id", "token_ids", "features": null, "sampling_params", "model", "stream", "cache_salt"}``;
- ``POST /v1/completions/render`` (a completion body) → a list of such objects, one per prompt.

Bad input gets vLLM's 400 error shape. Nothing here touches the prefix cache or the engine's timing.
"""

from __future__ import annotations

import uuid

from kvroute.plugin.dev.fake_cache import BYTES_PER_TOKEN

_ERROR_TYPE = "BadRequestError"


class TokenRequestError(ValueError):
    """A token-endpoint request vLLM would answer with 400."""


def token_ids(text: str) -> list[int]:
    """The fake tokenizer's ids of ``text`` (one per 4 UTF-8 bytes, the last one zero-padded)."""
    data = text.encode("utf-8", "surrogatepass")
    return [int.from_bytes(data[i:i + BYTES_PER_TOKEN].ljust(BYTES_PER_TOKEN, b"\0"), "little")
            for i in range(0, len(data), BYTES_PER_TOKEN)]


def detokenize(ids: list[int]) -> str:
    """The text of ``ids`` (inverse of ``token_ids``; padding bytes dropped, broken UTF-8 replaced)."""
    data = b"".join(int(i).to_bytes(BYTES_PER_TOKEN, "little") for i in ids)
    return data.rstrip(b"\0").decode("utf-8", "replace")


def error_body(message: str) -> dict:
    """vLLM's error response body for a 400."""
    return {"error": {"message": message, "type": _ERROR_TYPE, "param": None, "code": 400}}


def _chat_text(body: dict, render_chat) -> str:
    """The prompt a chat body renders to; ``continue_final_message`` leaves the last message open, as vLLM does."""
    text = render_chat(body.get("messages"))
    if body.get("continue_final_message"):
        return text.removesuffix("<|assistant|>\n").removesuffix("\n")
    if body.get("add_generation_prompt") is False:
        return text.removesuffix("<|assistant|>\n")
    return text


def tokenize(body: object, render_chat, max_model_len: int) -> dict:
    """``/tokenize``: ``render_chat`` turns ``messages`` into the prompt text (the engine's chat template)."""
    if not isinstance(body, dict):
        raise TokenRequestError("body must be a JSON object")
    if "messages" in body:
        text = _chat_text(body, render_chat)
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        raise TokenRequestError("either prompt (a string) or messages is required")
    ids = token_ids(text)
    strs = [detokenize([i]) for i in ids] if body.get("return_token_strs") else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize_body(body: object) -> dict:
    """``/detokenize``."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < 2 ** 32 for t in tokens):
        raise TokenRequestError("tokens must be a list of token ids")
    return {"prompt": detokenize(tokens)}


def _generate_request(prefix: str, ids: list[int], body: dict, model: str) -> dict:
    sampling = {k: body[k] for k in ("max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed")
                if body.get(k) is not None}
    return {"request_id": prefix + uuid.uuid4().hex[:24], "token_ids": ids, "features": None,
            "sampling_params": sampling, "model": str(body.get("model") or model),
            "stream": bool(body.get("stream")), "cache_salt": body.get("cache_salt")}


def render_chat_body(body: object, render_chat, model: str) -> dict:
    """``/v1/chat/completions/render``: the token ids the chat request would be prefilled with."""
    if not isinstance(body, dict):
        raise TokenRequestError("body must be a JSON object")
    return _generate_request("chatcmpl-", token_ids(_chat_text(body, render_chat)), body, model)


def render_completion_body(body: object, model: str) -> list[dict]:
    """``/v1/completions/render``: one object per prompt (a string or a list of strings)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise TokenRequestError("prompt must be a string or a non-empty list of strings")
    return [_generate_request("cmpl-", token_ids(p), body, model) for p in prompts]
