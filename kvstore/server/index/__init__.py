"""The pure chunk index: a radix tree with per-tier LRU, leases and eviction plans.

It never touches a byte: tiers move them, the index only decides.
"""

from kvstore.server.index.policy import POLICIES, EvictionPolicy
from kvstore.server.index.radix import EvictionPlan, Node, RadixIndex, Step, TierSpec

__all__ = ["POLICIES", "EvictionPlan", "EvictionPolicy", "Node", "RadixIndex", "Step", "TierSpec"]
