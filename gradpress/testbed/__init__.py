"""The testbed: real models on real offline data (GRACE, Xu et al., Section 5's evaluation method).

* :mod:`gradpress.testbed.data` — Fashion-MNIST, MovieLens-100k and English text (Debian's fortunes),
  fetched offline, with fixed train/test splits and equal, disjoint shards per worker.
* :mod:`gradpress.testbed.models` — the models trained on them (MLP, residual CNN, LSTM language model,
  NCF), their losses and quality metrics (accuracy, perplexity, hit rate@10).
"""
from gradpress.testbed.data import (
    DataUnavailable,
    Dataset,
    ImageData,
    RecData,
    Split,
    TextData,
    dataset_names,
    fetch,
    load,
    shard_indices,
)
from gradpress.testbed.models import criterion, evaluate, make_model, model_names

__all__ = [
    "DataUnavailable", "Dataset", "ImageData", "RecData", "Split", "TextData", "criterion", "dataset_names",
    "evaluate", "fetch", "load", "make_model", "model_names", "shard_indices",
]
