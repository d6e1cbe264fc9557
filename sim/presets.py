"""Calibrated replica presets: engine speed, KV capacity, block size and price.

Every figure names its source; derived numbers show their arithmetic in the comment beside them.
``qwen3-32b-h100-tp2`` reproduces llm-d's calibration (8,192-token chunk at 15,928 tok/s) and its
KV capacity (307,328 tokens per pod); ``llama-3.1-8b-a100`` is the SGLang v0.4 blog's fleet;
``cpu-llamacpp-34m`` is a tiny llama.cpp model measured with xllamacpp on a 2-core VM. ``llamacpp`` is the bench's
llama.cpp replica as a whole engine (``engine="llamacpp"``): the CI tiny model on one thread, one slot and llama.cpp's
host prompt cache of whole prompts (``LlamaCppSpec``); a fleet of it runs ``sim/replica_llamacpp.py`` replicas and
kvroute's prompt index, as a deployment with ``engine: llamacpp`` does. The other presets are vLLM-style engines.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from decimal import Decimal

from kvroute.policies.errors import ConfigError
from kvroute.sim.costmodel import CostModel


@dataclass(frozen=True, slots=True)
class LlamaCppSpec:
    """What a llama.cpp server adds to the step-time model: its host prompt cache's cost per cached token (the
    sequence state ``--cache-ram`` is charged: K and V of every layer plus cell metadata) and the fixed time between
    a request's arrival and its first token that holds no slot (HTTP, chat template, tokenizing, streaming)."""

    state_bytes_per_token: float
    response_s: float
    tokens_per_byte: float  # the model's tokenizer on the bench's English-like prompts (the fake engine counts so)


@dataclass(frozen=True, slots=True)
class Preset:
    """One replica kind: its engine speed, KV cache (tokens, block size), GPUs and price per GPU-hour.

    ``engine`` is the deployment's ``engine`` (``vllm`` or ``llamacpp``); for ``llamacpp`` ``kv_tokens`` is the host
    prompt cache's budget in tokens (``--cache-ram`` / ``llamacpp.state_bytes_per_token``), ``cost.max_running`` its
    slots (``--parallel``) and ``block_tokens`` only the router's key granularity (the engine reuses any token
    prefix)."""

    name: str
    description: str
    cost: CostModel
    kv_tokens: int
    block_tokens: int
    gpus: int
    usd_per_gpu_hour: Decimal
    max_model_len: int
    sources: tuple[str, ...] = ()
    engine: str = "vllm"
    llamacpp: LlamaCppSpec | None = None

    @property
    def kv_blocks(self) -> int:
        return self.kv_tokens // self.block_tokens

    def slower(self, factor: float) -> Preset:
        """This preset's engine on a host ``factor`` times slower (``CostModel.slower``); 1: itself."""
        return self if factor == 1 else replace(self, cost=self.cost.slower(factor))


def _qwen3_32b_h100_tp2() -> Preset:
    # Qwen3-32B: 64 layers, 64 query heads, 8 KV heads, head dim 128, bf16.
    # Attention per (new token × context token): 4·64·64·128 = 2.1 MFLOP; 2·32.8 GFLOP/token of GEMMs.
    # llm-d's peakPrefillThroughput 15,928 tok/s is for an 8,192-token chunk, which implies ~1.04 PFLOP/s
    # effective on 2×H100; attention then costs 2.1e6 / 1.04e15 ≈ 2.0e-9 s per token·context.
    attn = 2.0e-9
    overhead = 0.014  # decode step floor: 65.6 GB of weights / (2 × 3.35 TB/s × 0.70)
    chunk = 8192
    # one 8,192-token chunk from an empty context must take 8192 / 15928 = 0.5143 s
    linear = chunk / (chunk / 15_928 - overhead - attn * chunk * chunk / 2)
    return Preset(
        name="qwen3-32b-h100-tp2",
        description="Qwen3-32B bf16, vLLM, TP=2 on 2×H100-80GB (llm-d 73%-capacity benchmark pods)",
        cost=CostModel(
            prefill_tok_s=linear,
            attn_s=attn,
            step_overhead_s=overhead,
            decode_s_per_seq=1.0e-4,
            # KV per token 64 layers · 8 heads · 128 · 2 (K,V) · 2 B = 262,144 B, read at 4.69 TB/s
            kv_read_s_per_token=262_144 / 4.69e12,
            chunk_tokens=chunk,
            max_running=256,
        ),
        kv_tokens=307_328,
        block_tokens=64,
        gpus=2,
        usd_per_gpu_hour=Decimal("2.50"),
        max_model_len=131_072,
        sources=(
            "llm-d prefix-cache-affinity-filter peakPrefillThroughput 15,928 tok/s (Qwen 32B, 2×H100 TP=2)",
            "llm-d-kv-cache benchmarking/73-capacity: 307,328 KV tokens per pod, vLLM block size 64",
            "not matched: llm-d blog's single-instance 10k-token TTFT 4.3 s cold / 0.6 s warm (end to end, load "
            "unknown); this preset gives 0.66 s cold on an idle replica, as 15,928 tok/s implies",
        ),
    )


def _llama31_8b_a100() -> Preset:
    # Llama-3.1-8B: 32 layers, 32 query heads, 8 KV heads, head dim 128, bf16.
    # GEMMs 2·8.03 GFLOP/token at 312 TFLOP/s × 55% MFU → ~10,700 tok/s; attention 4·32·32·128 = 524 kFLOP
    # per token·context → 3.05e-9 s. KV per token 32·8·128·2·2 B = 131,072 B; 80 GB × 0.88 − 16 GB
    # weights − ~4 GB activations ≈ 50 GB → ~400k tokens.
    return Preset(
        name="llama-3.1-8b-a100",
        description="Llama-3.1-8B-Instruct bf16, one A100-80GB per replica (SGLang v0.4 blog, --dp-size 8)",
        cost=CostModel(
            prefill_tok_s=10_700.0,
            attn_s=3.05e-9,
            step_overhead_s=0.0107,  # 16 GB weights / (2.0 TB/s × 0.75)
            decode_s_per_seq=1.0e-4,
            kv_read_s_per_token=131_072 / 1.5e12,
            chunk_tokens=8192,
            max_running=256,
        ),
        kv_tokens=400_000,
        block_tokens=16,
        gpus=1,
        usd_per_gpu_hour=Decimal("1.60"),
        max_model_len=131_072,
        sources=("lm-sys blog 2024-12-04 sglang-v0-4: 8×A100-80GB, Llama-3.1-8B-Instruct",),
    )


def _cpu_llamacpp_34m() -> Preset:
    # measured: xllamacpp, 34M model, 1 replica × 2 threads, cold prefill medians:
    # 1013 tok → 1.30 s, 4013 tok → 6.97 s. Fit t = a·n + b·n²: a = 1.130e-3 s/token, b = 1.513e-7
    # (our attention term is attn·n²/2 for one chunk, so attn = 2b). Cached 2013-token prefix: 0.077 s.
    return Preset(
        name="cpu-llamacpp-34m",
        description="tiny 34M Llama on llama.cpp (xllamacpp), 2 threads, 1 slot, 256 MiB prompt cache",
        cost=CostModel(
            prefill_tok_s=1 / 1.130e-3,
            attn_s=2 * 1.513e-7,
            step_overhead_s=0.02,
            decode_s_per_seq=0.002,
            kv_read_s_per_token=1.6e-6,  # 16 KiB of KV per token at ~10 GB/s
            chunk_tokens=2048,  # llama.cpp n_batch
            max_running=1,  # --parallel 1
        ),
        kv_tokens=16_384,  # 256 MiB / 16 KiB per token (8 layers · 512 · 2 · 2 B)
        block_tokens=64,
        gpus=1,  # "GPU" here means the 2-core VM that runs the replica
        usd_per_gpu_hour=Decimal("0.10"),
        max_model_len=8192,
        sources=("xllamacpp measurement, 34M model, 2 threads (cold prefill medians above)",),
    )


def _cpu_llamacpp_ci() -> Preset:
    # measured: xllamacpp, CI preset (7.4M model), 1 replica: cold 1013 tok → 0.177 s, 4013 tok → 1.42 s.
    # Fit t = a·n + b·n²: a = 1.142e-4 s/token (8,760 tok/s), b = 5.97e-8 → attn = 2b (checks: 2013 tok → 0.47 s,
    # measured 0.452). Decode per token not in the README: 2 ms, as the fake engine's default.
    return Preset(
        name="cpu-llamacpp-ci",
        description="tiny 7.4M Llama on llama.cpp (xllamacpp), 1 thread, 1 slot (the CI and demo model)",
        cost=CostModel(
            prefill_tok_s=1 / 1.142e-4,
            attn_s=2 * 5.97e-8,
            step_overhead_s=0.002,
            decode_s_per_seq=0.0002,
            kv_read_s_per_token=0.0,
            chunk_tokens=2048,
            max_running=1,
        ),
        kv_tokens=16_384,
        block_tokens=16,
        gpus=1,
        usd_per_gpu_hour=Decimal("0.10"),
        max_model_len=8192,
        sources=("xllamacpp measurement, 7.4M CI model, 1 thread (cold prefill above)",),
    )


def _llamacpp() -> Preset:
    # measured: xllamacpp 2026.10, CI tiny model (4 layers, 256 hidden, f16), 1 thread, 1 slot, the server's own
    # timings.prompt_ms (medians of 3): cold 263 tok → 43 ms, 990 → 193 ms, 1,929 → 490 ms, 3,880 → 1,380 ms; fit
    # t = a·n + b·n² with a = 1.40e-4 s/token (7,140 tok/s), b = 5.56e-8 (attn = 2b). Checks with a cached prefix:
    # 1,950 cached + 480 new → 190 ms (model 184), 1,960 + 1,450 → 640 ms (model 635). Decode per token 0.9 ms +
    # 0.99 µs per context token (8 tokens: 9.4 ms at 263 context, 38 ms at 3,880). Client TTFT − prompt_ms, streamed
    # straight to a replica (bench/llamacpp_host.py, 2026-12-07, medians of 5): 3.5 ms for a 19-token prompt, 6.0 ms
    # cold 1,829, 6.1 ms 2,124 held by the slot (response_s 6 ms; the 22 ms measured earlier held no more).
    # State: "saving prompt with length 2955, total state size = 11.577 MiB" → 4,108 B per token (4 layers · 2 ·
    # 256 · 2 B of K and V + 12 B of cell metadata). Tokenizer: 0.45 tokens per byte of the bench's prompts (1,255
    # tokens for 2,790 bytes).
    spec = LlamaCppSpec(state_bytes_per_token=4108.0, response_s=0.006, tokens_per_byte=0.45)
    return Preset(
        name="llamacpp",
        description="llama.cpp server (xllamacpp), CI tiny model, 1 thread, 1 slot, 9 MiB host prompt cache",
        cost=CostModel(
            prefill_tok_s=1 / 1.40e-4,
            attn_s=2 * 5.56e-8,
            step_overhead_s=0.0005,
            decode_s_per_seq=0.0004,
            kv_read_s_per_token=0.99e-6,
            chunk_tokens=2048,  # n_batch
            max_running=1,  # --parallel 1
        ),
        kv_tokens=int(9 * 1024 * 1024 // spec.state_bytes_per_token),  # --cache-ram 9 (bench/peers.py's size)
        block_tokens=16,
        gpus=1,
        usd_per_gpu_hour=Decimal("0.10"),
        max_model_len=8192,  # --ctx
        sources=("xllamacpp 2026.10 measurement, CI tiny model, 1 thread (figures above)",
                 "llama.cpp tools/server server_prompt_cache alloc/load/update (save, restore, trim rules)"),
        engine="llamacpp",
        llamacpp=spec,
    )


PRESETS: dict[str, Preset] = {p.name: p for p in (_qwen3_32b_h100_tp2(), _llama31_8b_a100(), _cpu_llamacpp_34m(),
                                                  _cpu_llamacpp_ci(), _llamacpp())}
DEFAULT_PRESET = "qwen3-32b-h100-tp2"


def get_preset(name: str) -> Preset:
    """The preset called ``name``; unknown names raise ``ConfigError`` listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError("preset", f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
