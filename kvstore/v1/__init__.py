"""Generated gRPC stubs for ``kvstore.v1`` (``make proto`` writes them at install time)."""
