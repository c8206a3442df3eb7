"""Storage tiers behind one interface (``base.Tier``): dram, nvme, hbm.

A tier never decides which chunk lives in it: the index does.
"""
