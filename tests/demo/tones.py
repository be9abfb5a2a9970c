"""Audio whose content does not matter, for the real targets' tests."""

from __future__ import annotations

import numpy as np


def waves(n: int) -> list[np.ndarray]:
    """``n`` short tones of growing length."""
    return [(0.1 * np.sin(np.arange(4000 + 1500 * i) / (3 + i))).astype(np.float32) for i in range(n)]
