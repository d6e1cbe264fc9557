"""One simulated engine replica: block-granular prefix cache, scheduler and KV accounting (vLLM V1 style).

KV cache: ``capacity`` blocks. Blocks in use are either *pinned* cached blocks (a computed prompt block
with a key, shared by reference count) or *private* (being computed, or holding generated tokens).
Unreferenced cached blocks stay reusable in an LRU (``evictable``) until space is needed; a request
frees its blocks tail-first, so a prompt's last blocks are evicted before its first ones.

Scheduler, once per step: running decodes first (one token each; a decode that cannot get a block
preempts the most recently admitted request, which is recomputed later), then running prefills, then
waiting requests in FIFO order while the token budget, ``max_running`` and free blocks allow. A prefix
hit is matched at admission against the cached blocks. A chunk's full blocks enter the cache when its step is
scheduled, before it runs, as vLLM V1's ``KVCacheManager.allocate_slots`` commits them: a request admitted
later in the same step reuses what an earlier one computes in it; a sibling's chunks not yet scheduled are
no hit.

Decoding requests are tracked in aggregate so a step costs O(1) however many sequences decode: a decode
clock ``D`` (steps run so far) gives each decoder's generated count as ``gen_base + D``, a heap orders
completions, and a histogram of context lengths modulo the block size counts new decode blocks.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import islice

from kvroute.sim.costmodel import CostModel


@dataclass(slots=True, eq=False)
class Live:
    """Runtime state of one request inside a replica (``generated`` is exact unless it is decoding)."""

    idx: int
    rid: str
    prompt: int
    output: int
    keys: list[int]
    arrival: float
    target: int = 0
    computed: int = 0
    generated: int = 0
    pins: int = 0
    private: int = 0
    hit_tokens: int = -1
    first_token_at: float = -1.0
    done_at: float = -1.0
    preemptions: int = 0
    admitted_at: float = -1.0
    decoding: bool = False
    gen_base: int = 0
    epoch: int = 0
    held_elsewhere: int = 0  # prefix tokens another replica had computed when it arrived (wasted-prefill figure)
    floor_s: float = -1.0  # its TTFT floor: prefill of what no replica held at arrival, alone, no wait
    tokens: tuple[int, ...] | None = None  # token ids of the prompt (llama.cpp replicas reuse token prefixes)
    answer_tokens: tuple[int, ...] = ()  # token ids it generates, where known (they stay in a llama.cpp slot)
    time_factor: float = 1.0  # its steps' time over the model's (``SimRequest.time_factor``; llama.cpp replicas)


@dataclass(slots=True)
class Step:
    """What the step in flight will complete: prefill chunks and ``decode_steps`` steps of ``decoders``."""

    start: float
    end: float
    chunks: list[tuple[Live, int]] = field(default_factory=list)
    decoders: int = 0
    decode_steps: int = 1
    context: int = 0


class Replica:
    """A replica's cache, queues and clock; the fleet calls ``plan``/``finish`` at its step boundaries."""

    def __init__(self, name: str, cost: CostModel, capacity_blocks: int, block_tokens: int,
                 watermark: float = 0.01) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.name = name
        self.cost = cost
        self.capacity = capacity_blocks
        self.block_tokens = block_tokens
        self.watermark = int(capacity_blocks * watermark)
        self.waiting: deque[Live] = deque()
        self.admitted: OrderedDict[int, Live] = OrderedDict()  # running requests in admission order
        self.prefilling: OrderedDict[int, Live] = OrderedDict()
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.pinned: dict[int, int] = {}
        self.private = 0
        self.step: Step | None = None
        self.version = 0
        self.busy_time = 0.0
        self.steps = 0
        self.preemptions = 0
        self.evictions = 0
        self.scheduled: dict[int, int] | None = None  # keys of queued/running requests (oracle only)
        self.events: list[tuple[bool, int]] | None = None  # (stored?, key) KV events, when someone listens
        # decoders in aggregate
        self.clock_d = 0
        self.dec_n = 0
        self.dec_ctx_base = 0
        self.hist = [0] * block_tokens
        self.dec_heap: list[tuple[int, int, int, Live]] = []

    # --- views ----------------------------------------------------------------------------------
    @property
    def running(self) -> list[Live]:
        return list(self.admitted.values())

    def generated(self, r: Live) -> int:
        return r.gen_base + self.clock_d if r.decoding else r.generated

    def used_blocks(self) -> int:
        """Blocks held by requests (what vLLM reports as KV usage; evictable cache excluded)."""
        return len(self.pinned) + self.private

    def kv_usage(self) -> float:
        return min(1.0, self.used_blocks() / self.capacity)

    def cached_blocks(self, keys: list[int], limit: int | None = None) -> int:
        """Leading blocks of ``keys[:limit]`` in this replica's prefix cache (pinned or evictable): computed, or
        being computed by the step running now."""
        pinned, ev = self.pinned, self.evictable
        n = 0
        for k in keys if limit is None else islice(keys, limit):
            if k in pinned or k in ev:
                n += 1
            else:
                break
        return n

    def held_tokens(self, live: Live) -> int:
        """Tokens of ``live``'s prompt cached here, in whole blocks and never its last token."""
        bt = self.block_tokens
        return self.cached_blocks(live.keys, (live.prompt - 1) // bt) * bt

    def block_state(self) -> tuple[int, int, int]:
        """(pinned, private, evictable) blocks: the replica's end state."""
        return (len(self.pinned), self.private, len(self.evictable))

    def known_blocks(self, keys: list[int]) -> int:
        """Leading blocks of ``keys`` cached here or about to be computed by a request already here."""
        pinned, ev, sched = self.pinned, self.evictable, self.scheduled or {}
        n = 0
        for k in keys:
            if k in pinned or k in ev or k in sched:
                n += 1
            else:
                break
        return n

    def queued_prefill_s(self) -> float:
        """Exact seconds of prefill ahead of a new arrival: running prefills' rest + the waiting queue's misses."""
        cost, bt = self.cost, self.block_tokens
        total = 0.0
        for r in self.prefilling.values():
            left = r.target - r.computed
            total += left / cost.prefill_tok_s + cost.chunk_attention(r.computed, left)
        for r in self.waiting:
            hit = min(self.cached_blocks(r.keys) * bt, r.prompt - 1)
            left = r.prompt - hit
            total += left / cost.prefill_tok_s + cost.chunk_attention(hit, left)
        steps = -(-int(sum(r.target - r.computed for r in self.prefilling.values())
                       + sum(r.prompt for r in self.waiting)) // cost.chunk_tokens)
        return total + steps * (cost.step_overhead_s + cost.decode_s_per_seq * self.dec_n)

    def track_scheduled(self) -> None:
        """Keep a count of the keys of every queued or running request (what an exact observer knows)."""
        if self.scheduled is None:
            self.scheduled = {}

    # --- block helpers --------------------------------------------------------------------------
    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def _evict_to_fit(self) -> None:
        over = len(self.pinned) + self.private + len(self.evictable) - self.capacity
        ev = self.evictable
        events = self.events
        while over > 0 and ev:
            k, _ = ev.popitem(last=False)
            self.evictions += 1
            over -= 1
            if events is not None:
                events.append((False, k))

    def _free_blocks(self) -> int:
        return self.capacity - len(self.pinned) - self.private

    def _decode_extra(self, k: int) -> int:
        """New blocks all decoders need to run ``k`` more steps (each holds blocks for its context now)."""
        if k <= 0 or self.dec_n == 0:
            return 0
        # a decoder whose context is ≡ ρ (mod bt) needs (ρ + k − 1) // bt + [ρ = 0] new blocks for k tokens;
        # with q, r = divmod(k − 1, bt) that is q + [ρ ≥ bt − r] + [ρ = 0]. Bucket j holds ρ = (j + D) mod bt.
        bt = self.block_tokens
        hist = self.hist
        d = self.clock_d % bt
        at_zero = hist[(-d) % bt]
        q, r = divmod(k - 1, bt)
        if r == 0:
            return q * self.dec_n + at_zero
        start = (bt - r - d) % bt
        end = start + r
        tail = sum(hist[start:end]) if end <= bt else sum(hist[start:]) + sum(hist[: end - bt])
        return q * self.dec_n + tail + at_zero

    # --- admission and release ------------------------------------------------------------------
    def _try_admit(self, r: Live, now: float) -> bool:
        bt = self.block_tokens
        target = r.prompt + r.generated
        keys = r.keys
        pinned, ev = self.pinned, self.evictable
        max_hit = (target - 1) // bt
        hit = 0
        from_ev = 0
        for k in keys:
            if hit >= max_hit:
                break
            if k in pinned:
                hit += 1
            elif k in ev:
                hit += 1
                from_ev += 1
            else:
                break
        need = self._blocks(target) - hit
        if len(pinned) + from_ev + self.private + need > self.capacity - self.watermark:
            return False
        for k in keys[:hit]:
            if k in pinned:
                pinned[k] += 1
            else:
                del ev[k]
                pinned[k] = 1
        r.pins = hit
        r.private = need
        self.private += need
        r.target = target
        r.computed = hit * bt
        if r.hit_tokens < 0:
            r.hit_tokens = hit * bt
            r.admitted_at = now
        self._evict_to_fit()
        return True

    def _start_decode(self, r: Live) -> None:
        """Move a request whose prefill finished into the aggregate decode set."""
        held = self._blocks(r.prompt + r.generated)
        add = held - (r.pins + r.private)
        if add > 0:
            r.private += add
            self.private += add
        r.decoding = True
        r.gen_base = r.generated - self.clock_d
        r.epoch += 1
        self.dec_n += 1
        base = r.prompt + r.gen_base
        self.dec_ctx_base += base
        self.hist[base % self.block_tokens] += 1
        heapq.heappush(self.dec_heap, (r.output - r.gen_base, r.idx, r.epoch, r))

    def _stop_decode(self, r: Live) -> None:
        """Take a decoder out of the aggregate set, materialising its counts (heap entry goes stale)."""
        r.generated = r.gen_base + self.clock_d
        held = self._blocks(r.prompt + r.generated)
        r.private = held - r.pins
        base = r.prompt + r.gen_base
        self.dec_n -= 1
        self.dec_ctx_base -= base
        self.hist[base % self.block_tokens] -= 1
        r.decoding = False
        r.epoch += 1

    def _release(self, r: Live) -> None:
        """Free a request's blocks; its cached blocks become evictable, tail first."""
        if r.decoding:
            self._stop_decode(r)
        self.admitted.pop(id(r), None)
        self.prefilling.pop(id(r), None)
        pinned, ev = self.pinned, self.evictable
        for k in reversed(r.keys[: r.pins]):
            c = pinned[k] - 1
            if c:
                pinned[k] = c
            else:
                del pinned[k]
                ev[k] = None
        self.private -= r.private
        r.pins = 0
        r.private = 0

    def _preempt(self) -> Live | None:
        """Push the most recently admitted running request back to the head of the queue."""
        if not self.admitted:
            return None
        _, victim = self.admitted.popitem(last=True)
        self._release(victim)
        victim.computed = 0
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _commit(self, r: Live, tokens: int) -> None:
        """Enter the full blocks of ``r``'s first ``tokens`` into the cache (the step computing them is scheduled)."""
        full = min(tokens // self.block_tokens, len(r.keys))
        pinned, ev = self.pinned, self.evictable
        keys = r.keys
        while r.pins < full:
            k = keys[r.pins]
            if k in pinned:
                pinned[k] += 1
            elif k in ev:
                del ev[k]
                pinned[k] = 1
            else:
                pinned[k] = 1
                if self.events is not None:
                    self.events.append((True, k))
            r.pins += 1
            r.private -= 1
            self.private -= 1

    # --- stepping -------------------------------------------------------------------------------
    def enqueue(self, r: Live) -> None:
        self.waiting.append(r)
        sched = self.scheduled
        if sched is not None:
            for k in r.keys:
                sched[k] = sched.get(k, 0) + 1

    def idle(self) -> bool:
        return self.step is None

    def _next_completion(self) -> int:
        heap = self.dec_heap
        while heap and (heap[0][3].epoch != heap[0][2] or not heap[0][3].decoding):
            heapq.heappop(heap)
        return heap[0][0] - self.clock_d if heap else 1

    def plan(self, now: float) -> Step | None:
        """Schedule the next step starting at ``now``; None when there is nothing to run."""
        cost = self.cost
        # decode blocks for one step; preempt from the tail until they fit
        while self.dec_n and self._decode_extra(1) > self._free_blocks():
            if self._preempt() is None:
                break
        budget = cost.chunk_tokens - self.dec_n
        chunks: list[tuple[Live, int]] = []
        attn = 0.0
        for r in self.prefilling.values():
            if budget <= 0:
                break
            c = min(budget, r.target - r.computed)
            chunks.append((r, c))
            attn += cost.chunk_attention(r.computed, c)
            budget -= c
            self._commit(r, r.computed + c)
        while self.waiting and budget > 0 and len(self.admitted) < cost.max_running:
            r = self.waiting[0]
            if not self._try_admit(r, now):
                break
            self.waiting.popleft()
            self.admitted[id(r)] = r
            c = min(budget, r.target - r.computed)
            self.prefilling[id(r)] = r
            chunks.append((r, c))
            attn += cost.chunk_attention(r.computed, c)
            budget -= c
            self._commit(r, r.computed + c)
        n = self.dec_n
        if not chunks and not n:
            self.step = None
            return None
        context = self.dec_ctx_base + n * self.clock_d
        if chunks:
            k = 1
        else:
            k = max(1, self._next_completion())
            free = self._free_blocks()
            if k > 1 and n * (-(-k // self.block_tokens) + 1) > free and self._decode_extra(k) > free:
                lo, hi = 1, k
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if self._decode_extra(mid) <= free:
                        lo = mid
                    else:
                        hi = mid - 1
                k = lo
        extra = self._decode_extra(k)
        self.private += extra
        self._evict_to_fit()
        if chunks:
            prefill = sum(c for _, c in chunks)
            dur = cost.step_time(prefill, attn, n, context)
        else:
            dur = cost.decode_run(k, n, context)
        step = Step(now, now + dur, chunks, n, k, context)
        self.step = step
        self.version += 1
        self.steps += k
        return step

    def interrupt(self, now: float) -> bool:
        """Cut a multi-step decode run at the step boundary after ``now``; True if the end moved."""
        step = self.step
        if step is None or step.chunks or step.decode_steps <= 1:
            return False
        j = self.cost.decode_steps_before(now - step.start, step.decoders, step.context)
        if j >= step.decode_steps:
            return False
        # give back the blocks reserved for the steps that will not run
        self.private -= self._decode_extra(step.decode_steps) - self._decode_extra(j)
        self.steps -= step.decode_steps - j
        step.decode_steps = j
        step.end = step.start + self.cost.decode_run(j, step.decoders, step.context)
        self.version += 1
        return True

    def finish(self, now: float) -> tuple[list[Live], list[Live]]:
        """Apply the finished step: returns (requests that got their first token, requests completed)."""
        step = self.step
        assert step is not None
        self.step = None
        self.busy_time += step.end - step.start
        first: list[Live] = []
        done: list[Live] = []
        if step.decoders:
            self.clock_d += step.decode_steps
            heap = self.dec_heap
            d = self.clock_d
            while heap and heap[0][0] <= d:
                _, _, epoch, r = heapq.heappop(heap)
                if r.epoch == epoch and r.decoding:
                    done.append(r)
        entering: list[Live] = []
        for r, c in step.chunks:
            r.computed += c
            if r.computed >= r.target:
                self.prefilling.pop(id(r), None)
                if r.first_token_at < 0:
                    r.first_token_at = now
                    first.append(r)
                r.generated = max(r.generated, 1)
                if r.generated >= r.output:
                    done.append(r)
                else:
                    entering.append(r)
        sched = self.scheduled
        for r in done:
            r.done_at = now
            self._release(r)
            if sched is not None:
                for k in r.keys:
                    c = sched[k] - 1
                    if c:
                        sched[k] = c
                    else:
                        del sched[k]
        for r in entering:
            self._start_decode(r)
        self._evict_to_fit()
        return first, done
