"""Self-hosted cost in the ledger's unit: a preset's GPU-hour price and modelled throughput as a rate card.

``prefill_tok_s`` is the preset's throughput on one full chunk from an empty context (llm-d's calibration
point); ``decode_tok_s`` is the aggregate output rate of ``decode_batch`` sequences at ``decode_context``
tokens each (one step = overhead + per-sequence + KV-read terms of the cost model). The prices come from
``billing.pricing.GpuRateCard`` (the same function the price file and the hybrid router use).
"""

from __future__ import annotations

from decimal import Decimal

from kvroute.billing.pricing import GpuRateCard
from kvroute.sim.presets import Preset


def replica_rate_card(preset: Preset, *, decode_batch: int = 64, decode_context: int = 2048) -> GpuRateCard:
    """The preset's GPU-hour card (``usd_per_gpu_hour`` × ``gpus`` per replica-hour, USD)."""
    cost = preset.cost
    chunk = cost.chunk_tokens
    prefill = chunk / cost.cold_prefill_s(chunk)
    step = cost.step_time(0, 0.0, decode_batch, decode_batch * decode_context)
    decode = decode_batch / step
    return GpuRateCard(preset.usd_per_gpu_hour, Decimal(f"{prefill:.1f}"), Decimal(f"{decode:.1f}"),
                       gpus=preset.gpus, currency="USD")
