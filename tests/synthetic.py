"""Small synthetic data sets for the tests that train (``sim quality``, ``advise --quality-steps``)."""
from __future__ import annotations

import torch

from gradpress.testbed.data import ImageData, Split


def synthetic_images(n_train: int = 512, n_test: int = 128, classes: int = 4, size: int = 8) -> ImageData:
    """Four classes, each a fixed random pattern plus noise: learnable in a few dozen steps."""
    generator = torch.Generator().manual_seed(7)
    patterns = torch.randn(classes, 1, size, size, generator=generator)

    def split(n: int) -> Split:
        y = torch.randint(classes, (n,), generator=generator)
        return Split(patterns[y] + 0.8 * torch.randn(n, 1, size, size, generator=generator), y)

    return ImageData("synthetic", split(n_train), split(n_test), classes=tuple("abcd"[:classes]))
