"""Rendezvous (highest-random-weight) hashing with bounded load.

A backend joining or leaving moves only the keys it wins or held (about 1/n of them); with a load cap,
a key whose first choice is full walks to its next choice in a fixed, key-specific order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest


def backend_seed(backend: str) -> int:
    return _xxh3(backend.encode("utf-8", "surrogatepass"))


class Rendezvous:
    """Per-key preference order over backends; backend seeds are cached."""

    def __init__(self) -> None:
        self._seeds: dict[str, int] = {}

    def _seed(self, backend: str) -> int:
        seed = self._seeds.get(backend)
        if seed is None:
            if len(self._seeds) > 65536:
                self._seeds.clear()
            seed = self._seeds[backend] = backend_seed(backend)
        return seed

    def weight(self, key: int | str, backend: str) -> int:
        data = key.to_bytes(8, "little") if isinstance(key, int) else key.encode("utf-8", "surrogatepass")
        return _xxh3(data, self._seed(backend))

    def order(self, key: int | str, backends: Sequence[str]) -> list[str]:
        """Backends in this key's preference order (highest weight first; ties by name)."""
        data = key.to_bytes(8, "little") if isinstance(key, int) else key.encode("utf-8", "surrogatepass")
        return sorted(backends, key=lambda b: (-_xxh3(data, self._seed(b)), b))

    def pick(self, key: int | str, backends: Sequence[str], fits: Callable[[str], bool] | None = None) -> str:
        """First backend in preference order that ``fits`` (the load cap); the top one if none does."""
        ordered = self.order(key, backends)
        if fits is not None:
            for backend in ordered:
                if fits(backend):
                    return backend
        return ordered[0]


def bounded_load_cap(total_inflight: int, backends: int, epsilon: float, min_cap: int) -> int:
    """Max in-flight a backend may hold after taking one more request: ceil((1+ε)·(total+1)/n)."""
    if backends <= 0:
        return min_cap
    fair = (1.0 + epsilon) * (total_inflight + 1) / backends
    cap = int(fair) if fair == int(fair) else int(fair) + 1
    return max(cap, min_cap)
