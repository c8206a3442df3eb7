"""One step's synchronous loads, written into the paged cache a layer at a time while the
forward runs (``load_layerwise``): the forward starts at once (what comes before the
first attention runs while the chunks are fetched and decoded), and before each layer's
attention it waits only for that layer, so the copies into later layers overlap the
compute of earlier ones.

Offers ``LayerLoads(num_layers, blocks)``: the loader thread calls ``write(fn)``, which
runs ``fn(layer)`` for each layer in order and marks it written, and ``finish()`` when it
is done (written or not); the engine's thread calls ``wait(layers, timeout_s)`` before a
layer and ``result(timeout_s)`` (the blocks not filled) at the step's end.
``blocks`` are every block the step's loads would fill. A wait that runs out cancels the
job: the loader writes no layer after that (a layer being written is finished first:
cancelling takes the lock the loader writes under, which no waiter needs), and all of
``blocks`` go to ``errors`` for vLLM to recompute, since nobody can say which layers of
them hold what. Pure threading; no torch, no I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


class LayerLoads:
    def __init__(self, num_layers: int, blocks: Iterable[int]) -> None:
        self.num_layers = num_layers
        self.blocks = set(blocks)
        self.errors: set[int] = set()  # blocks not filled; complete once ``done``
        self.written = 0  # layers 0 .. written-1 are in the cache
        self.done = False
        self.cancelled = False
        self._cond = threading.Condition()  # written, done, errors
        self._writing = threading.Lock()  # held while a layer is written; cancel takes it

    def write(self, write_layer: Callable[[int], None]) -> bool:
        """Loader side: every layer in order, each marked written as it lands; False when
        the job was cancelled first (nothing more is written then)."""
        for layer in range(self.num_layers):
            with self._writing:
                if self.cancelled:
                    return False
                write_layer(layer)
            with self._cond:
                self.written = layer + 1
                self._cond.notify_all()
        return True

    def fail(self, blocks: Iterable[int]) -> None:
        """Loader side: ``blocks`` could not be filled."""
        with self._cond:
            self.errors.update(blocks)

    def finish(self) -> None:
        """Loader side, always last: waiters stop waiting for layers never written."""
        with self._cond:
            self.done = True
            self._cond.notify_all()

    def wait(self, layers: int, timeout_s: float) -> bool:
        """Engine side: until the first ``layers`` layers are written or the loader gave up;
        False (and the job cancelled, every block an error) when ``timeout_s`` ran out."""
        with self._cond:
            if self._cond.wait_for(lambda: self.written >= layers or self.done, timeout_s):
                return True
            self._cancel()
            return False

    def result(self, timeout_s: float) -> set[int]:
        """Engine side, at the step's end: the blocks not filled, once the loader is done
        (or ``timeout_s`` ran out: cancelled, every block)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout_s):
                self._cancel()
            return set(self.errors)

    def _cancel(self) -> None:
        with self._writing:  # the loader never holds this and waits for ``_cond``
            self.cancelled = True
        self.errors.update(self.blocks)
