"""What a provider bills for a call its client walked away from, and the usage kvroute books for it.

=========  ==================================================================================================
mode       the provider bills
=========  ==================================================================================================
``relayed``  the prompt and the output generated up to the cut (kvroute books the output it relayed): Anthropic,
             OpenAI, OpenRouter (``cancelled`` with its ``total_cost``), and self-hosted engines, which stop on a
             disconnect
``full``     the prompt and the whole answer, since it keeps generating (Bedrock): the request's ``max_tokens``
             when it set one (an upper bound, marked as an estimate), else the output relayed
``none``     nothing
=========  ==================================================================================================

A price file declares the mode per provider (``cancel_billing:``) or per backend; an undeclared provider gets
``KNOWN_CANCEL_BILLING``'s mode, else ``relayed`` (what most providers bill). The booked usage says where its
prompt count came from: the provider's own early usage (``reported``), the deployment's tokenizer (``counted``)
or four characters a token (``estimated``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvroute.policies.errors import InputError

CANCEL_BILLING = ("relayed", "full", "none")
DEFAULT_CANCEL_BILLING = "relayed"
#: The mode of providers whose cancel billing is documented (LiteLLM's provider names).
KNOWN_CANCEL_BILLING: Mapping[str, str] = {
    "anthropic": "relayed", "openai": "relayed", "azure": "relayed", "openrouter": "relayed",
    "vertex_ai": "relayed", "gemini": "relayed", "bedrock": "full", "bedrock_converse": "full",
}
PROMPT_SOURCES = ("reported", "counted", "estimated")
#: The ``kvroute_estimate`` of a cancelled attempt's usage (the reports' ``cancelled`` cause reads the status).
CANCELLED_ESTIMATE = "cancelled"
#: The ``error_type`` of a request its client left (final) and of a hedge's losing attempt (non-final).
CLIENT_LEFT = "client_disconnected"
HEDGE_LOST = "hedge_lost"


def check_cancel_billing(value: Any, where: str = "cancel_billing") -> str:
    """``value`` as a cancel-billing mode; anything else raises ``InputError`` naming ``where``."""
    if value not in CANCEL_BILLING:
        raise InputError(where, f"must be one of {', '.join(CANCEL_BILLING)}, got {value!r}")
    return str(value)


def cancel_billing_for(provider: str | None, declared: str | None = None) -> str:
    """The mode a cancelled call of ``provider`` is billed under: ``declared`` when given, else the known mode of
    the provider (``bedrock/…`` reads as ``bedrock``), else ``relayed``."""
    if declared:
        return check_cancel_billing(declared)
    name = (provider or "").split("/", 1)[0].lower()
    return KNOWN_CANCEL_BILLING.get(name, DEFAULT_CANCEL_BILLING)


def cancelled_usage(mode: str, *, prompt_tokens: int, cached_tokens: int = 0, relayed: int,
                    max_tokens: int | None = None, prompt_source: str = "counted") -> dict[str, Any]:
    """The usage booked for a cancelled attempt under ``mode``: the tokens the provider bills, with what was
    observed beside them (``kvroute_*`` keys, kept in the event's ``raw_usage``)."""
    check_cancel_billing(mode)
    if prompt_source not in PROMPT_SOURCES:
        raise InputError("prompt_source", f"must be one of {', '.join(PROMPT_SOURCES)}, got {prompt_source!r}")
    observed, relayed = max(int(prompt_tokens), 0), max(int(relayed), 0)
    prompt, cached = observed, min(max(int(cached_tokens), 0), observed)
    output, bounded = relayed, False
    if mode == "full" and max_tokens is not None and int(max_tokens) > relayed:
        output, bounded = int(max_tokens), True
    if mode == "none":
        prompt = cached = output = 0
    usage: dict[str, Any] = {
        "prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
        "kvroute_estimate": CANCELLED_ESTIMATE, "kvroute_cancel_billing": mode,
        "kvroute_prompt_source": prompt_source, "kvroute_prompt_observed": observed,
        "kvroute_relayed_output": relayed}
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    if bounded:
        usage["kvroute_output_bound"] = "max_tokens"
    return usage
