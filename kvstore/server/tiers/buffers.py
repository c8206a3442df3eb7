"""Buffer helpers shared by the tiers. Offers ``as_u8(buf)``: a flat uint8 view, no copy."""

from __future__ import annotations

import numpy as np

from kvstore.core.types import InvalidArgument


def as_u8(buf: object, what: str = "payload") -> np.ndarray:
    """A 1-D uint8 numpy view of any C-contiguous buffer (bytes, memoryview, ndarray...)."""
    try:
        return np.frombuffer(buf, dtype=np.uint8)
    except (TypeError, ValueError, BufferError) as e:
        raise InvalidArgument(f"{what} must be a C-contiguous buffer: {e}") from e
