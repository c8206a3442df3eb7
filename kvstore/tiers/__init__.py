"""Storage tiers behind one interface (``base.Tier``): dram, nvme, hbm."""
