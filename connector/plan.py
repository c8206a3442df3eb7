"""What the scheduler half tells the worker half each step (pickled by vLLM).

Offers ``LoadSpec``, ``SaveSpec`` and ``KVStoreMetadata``: plain records, no
I/O, so the plan can be built and checked without an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.core.types import ShmGrant

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # plans are plain data; vLLM only supplies the base class

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass


@dataclass
class LoadSpec:
    """Load ``keys`` (chunk keys, in chain order) into ``block_ids``.

    A ``background`` load (``load_async``) runs off the forward: the request waits in
    vLLM (``WAITING_FOR_REMOTE_KVS``) until the worker reports it finished.

    Blocks before ``first_block`` already hold this request's KV (vLLM's own
    prefix cache) and are shared with other requests: they are never written.
    ``block_ids`` may end inside the last chunk (vLLM took fewer external tokens
    than offered): only the blocks listed are written.
    """

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    first_block: int
    background: bool = False  # vLLM waits for it (get_finished), not the forward
    # per tensor-parallel rank, where the leased lookup found its parts in the store's
    # shared memory (same host): that rank's worker reads them with no GetShm of its own
    shm: tuple[ShmGrant | None, ...] = ()


@dataclass
class SaveSpec:
    """Save the chunks ``keys`` (whose chain continues ``parent``) from ``block_ids``.

    ``root`` is the chain's first key (it places the chain on a shard); None when
    ``keys`` start the chain.
    """

    req_id: str
    keys: list[bytes]
    parent: bytes | None
    block_ids: list[int]
    root: bytes | None = None


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    scheduled_tokens: int = 0  # tokens the step computes (the load planner times them)
