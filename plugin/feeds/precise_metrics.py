"""Prometheus metrics of precise mode, on one module-level registry the plugin can expose.

Names: ``kvroute_kv_events_*`` (the event feed), ``kvroute_tokenizer_*`` (tokenizing like the engine),
``kvroute_engine_metrics_*`` (scraper) and ``kvroute_precise_decisions_total`` (precise vs fallback).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

REGISTRY = CollectorRegistry(auto_describe=True)

KV_EVENT_BATCHES = Counter("kvroute_kv_events_batches", "KV-event batches applied", ["source"], registry=REGISTRY)
KV_EVENT_BLOCKS_STORED = Counter("kvroute_kv_events_blocks_stored", "Blocks stored by engine events",
                                 ["source"], registry=REGISTRY)
KV_EVENT_BLOCKS_REMOVED = Counter("kvroute_kv_events_blocks_removed", "Blocks removed by engine events",
                                  ["source"], registry=REGISTRY)
KV_EVENT_CLEARS = Counter("kvroute_kv_events_clears", "Source states dropped (AllBlocksCleared, reset, reconnect)",
                          ["source", "reason"], registry=REGISTRY)
KV_EVENT_GAPS = Counter("kvroute_kv_events_gaps", "Sequence gaps seen", ["source"], registry=REGISTRY)
KV_EVENT_REPLAYS = Counter("kvroute_kv_events_replays", "Replays completed through the replay socket",
                           ["source", "outcome"], registry=REGISTRY)
KV_EVENT_DECODE_ERRORS = Counter("kvroute_kv_events_decode_errors", "Payloads or events that could not be decoded",
                                 ["source"], registry=REGISTRY)
KV_EVENT_DUPLICATES = Counter("kvroute_kv_events_duplicates", "Batches skipped as already applied",
                              ["source"], registry=REGISTRY)
KV_EVENT_INDEX_BLOCKS = Gauge("kvroute_kv_events_index_blocks", "Engine-confirmed blocks held per source",
                              ["source"], registry=REGISTRY)
KV_EVENT_LAG = Gauge("kvroute_kv_events_lag_seconds", "Age of the last applied batch when it was applied",
                     ["source"], registry=REGISTRY)

TOKENIZER_REQUESTS = Counter("kvroute_tokenizer_requests", "Tokenizations by outcome (warm, cold, error)",
                             ["group", "outcome"], registry=REGISTRY)
TOKENIZER_CACHE_TOKENS = Counter("kvroute_tokenizer_cache_tokens", "Prompt tokens served from / missed by the "
                                 "prefix cache", ["group", "result"], registry=REGISTRY)

ENGINE_SCRAPES = Counter("kvroute_engine_metrics_scrapes", "Engine /metrics scrapes by outcome",
                         ["backend", "outcome"], registry=REGISTRY)

PRECISE_DECISIONS = Counter("kvroute_precise_decisions", "Requests fingerprinted precisely or falling back to "
                            "approximate mode", ["group", "mode", "reason"], registry=REGISTRY)
