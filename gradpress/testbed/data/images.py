"""Image classification on Fashion-MNIST (Xiao, Rasul & Vollgraf 2017), from Debian's
``dataset-fashion-mnist`` (see :mod:`gradpress.testbed.data`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from gradpress.testbed.data.dataset import DataUnavailable, Dataset, Say, Split, quiet
from gradpress.testbed.data.fetching import check_sha256, ensure_debian_package
from gradpress.testbed.data.idx import parse_idx, read_idx_bytes

FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
#: file stem -> sha256 of the decompressed IDX file (the same bytes as Zalando's release)
FASHION_MNIST_SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}


@dataclass
class ImageData(Dataset):
    """Images ``x`` (N, C, H, W) float32, labels ``y`` (N,) int64 in ``range(len(classes))``."""

    classes: tuple[str, ...] = ()
    task: ClassVar[str] = "classification"

    def model_kwargs(self) -> dict[str, int]:
        _, channels, height, width = self.train.x.shape
        if height != width:
            raise ValueError(f"{self.name}: the models take square images, got {height}×{width}")
        return {"in_channels": channels, "image_size": height, "num_classes": len(self.classes)}

    def summary(self) -> str:
        shape = "×".join(map(str, self.train.x.shape[1:]))
        return (f"train {len(self.train)} images of {shape}, test {len(self.test)}, "
                f"{len(self.classes)} classes ({', '.join(self.classes)})")


def _fashion_mnist_paths(root: Path) -> dict[str, Path]:
    paths = {stem: root / f"{stem}.gz" for stem in FASHION_MNIST_SHA256}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
        raise DataUnavailable(f"Fashion-MNIST is missing ({', '.join(missing)}): it comes with Debian's "
                              f"{FASHION_MNIST_PACKAGE!r} package; run `gradpress data` as root or "
                              f"`sudo apt-get install -y {FASHION_MNIST_PACKAGE}`")
    return paths


def fetch_fashion_mnist(install: bool = True, say: Say = quiet, root: Path = FASHION_MNIST_DIR) -> str:
    """Install Debian's ``dataset-fashion-mnist`` if needed and check the decompressed files' sha256."""
    ensure_debian_package(FASHION_MNIST_PACKAGE, root, install, say)
    for stem, path in _fashion_mnist_paths(root).items():
        check_sha256(read_idx_bytes(path), FASHION_MNIST_SHA256[stem], str(path))
    return f"{root} (4 IDX files, sha256 checked)"


def load_fashion_mnist(root: Path | str = FASHION_MNIST_DIR, normalize: bool = True) -> ImageData:
    """Fashion-MNIST's official split; pixels scaled to [0, 1], then (``normalize``) standardized by the
    training set's mean and standard deviation."""
    paths = _fashion_mnist_paths(Path(root))
    arrays = {stem: parse_idx(read_idx_bytes(path), str(path)) for stem, path in paths.items()}
    splits = []
    for part in ("train", "t10k"):
        images, labels = arrays[f"{part}-images-idx3-ubyte"], arrays[f"{part}-labels-idx1-ubyte"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(f"{root}: {part} images {images.shape} do not match labels {labels.shape}")
        if labels.size and labels.max() >= len(FASHION_MNIST_CLASSES):
            raise ValueError(f"{root}: {part} label {labels.max()} is not a Fashion-MNIST class")
        x = torch.from_numpy(images).unsqueeze(1).float().div_(255.0)
        splits.append(Split(x, torch.from_numpy(labels).long()))
    train, test = splits
    if normalize:
        mean, std = train.x.mean(), train.x.std()
        train.x.sub_(mean).div_(std)
        test.x.sub_(mean).div_(std)
    return ImageData("fashion-mnist", train, test, FASHION_MNIST_CLASSES)
