"""The testbed's models, their losses and quality metrics (GRACE, Xu et al., Section 5's workloads).

``make_model("resnet:width=32", data=dataset)`` builds a registered model from a spec string (the same
syntax as compressors, :mod:`gradpress.core.registry`), taking the sizes it needs (classes, vocabulary,
users, items) from the dataset. ``evaluate(model, dataset)`` measures quality on the test split.

=============  ==============  ===========================================================================
name           dataset         model
=============  ==============  ===========================================================================
``mlp``        fashion-mnist   multi-layer perceptron, ``depth`` hidden ReLU layers of ``hidden`` units
``mlp-wide``   fashion-mnist   one hidden layer of ``width`` units: 784·width weights in the first layer,
                               little compute per byte of gradient (the communication-bound workload)
``resnet``     fashion-mnist   residual CNN, He et al. 2016 (Section 4.2's 6n+2 network, n = ``blocks``)
``lstm``       fortunes        word-level LSTM language model, Zaremba et al. 2014 (their "small" model);
                               a batch touches few embedding rows, so the embedding gradient is mostly
                               zero rows (S2 Reducer's sparse case, Ge et al.)
``ncf``        movielens-100k  neural collaborative filtering, He et al. 2017: GMF, MLP or NeuMF (Eq. 12)
=============  ==============  ===========================================================================

Quality: accuracy (classification), perplexity = exp(mean per-token negative log-likelihood) (language
model), hit rate@10 and NDCG@10 of the held-out item among 1 + 99 sampled candidates (NCF Section 4.1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, ClassVar, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gradpress.core.registry import Registry, format_spec, parse_spec, spec_fields
from gradpress.testbed.data import Dataset

models: Registry = Registry("model")


class ModelConfig:
    """A registered model: dataclass fields are its spec keys; ``build()`` returns the ``nn.Module``.

    Class facts: ``task`` (the dataset task it fits), ``dataset`` (its default dataset) and a training
    setting that suits it, the paper's where it gives one (``optimizer``, ``lr``, ``batch_size``,
    ``grad_clip``).
    """

    name: ClassVar[str] = ""
    task: ClassVar[str] = ""
    dataset: ClassVar[str] = ""
    optimizer: ClassVar[str] = "sgd"
    lr: ClassVar[float] = 0.1
    batch_size: ClassVar[int] = 64
    grad_clip: ClassVar[float | None] = None

    def build(self) -> nn.Module:
        """The module, after checking that every size (each integer field) is at least 1."""
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise ValueError(f"{self.name}: {f.name} must be at least 1, got {value}")
        return self.module()

    def module(self) -> nn.Module:
        raise NotImplementedError


def model_names() -> list[str]:
    return models.names()


def model_config(spec: str, data: Dataset | None = None, **kwargs) -> ModelConfig:
    """The configuration ``spec`` names; sizes from ``data`` (``data.model_kwargs()``) override the spec's."""
    cls = models.get(parse_spec(spec)[0])
    if data is not None:
        if data.task != cls.task:
            raise ValueError(f"model {cls.name!r} is for {cls.task} data; {data.name!r} is {data.task} data")
        fields = spec_fields(cls)
        kwargs = {**{k: v for k, v in data.model_kwargs().items() if k in fields}, **kwargs}
    return models.make(spec, **kwargs)


def make_model(spec: str, data: Dataset | None = None, **kwargs) -> nn.Module:
    """Build model ``spec`` (e.g. ``"mlp-wide:width=8192"``); ``module.spec`` and ``module.task``
    record what it is."""
    config = model_config(spec, data, **kwargs)
    module = config.build()
    # (torch's stubs type Module.__setattr__ for tensors and modules; any attribute can be set)
    module.spec, module.task = format_spec(config), config.task  # type: ignore[assignment]
    return module


# ---------------------------------------------------------------------------------------------------
# Fashion-MNIST: MLP and residual CNN
# ---------------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """Flatten, then ``Linear -> ReLU`` per hidden width, then a linear classifier (logits)."""

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for units in hidden:
            layers += [nn.Linear(width, units), nn.ReLU()]
            width = units
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(repr=False)
class ImageConfig(ModelConfig):
    """A classifier of square images (Fashion-MNIST by default): what the image models share."""

    in_channels: int = 1
    image_size: int = 28
    num_classes: int = 10
    task: ClassVar[str] = "classification"
    dataset: ClassVar[str] = "fashion-mnist"

    @property
    def pixels(self) -> int:
        return self.in_channels * self.image_size ** 2


@models.register("mlp")
@dataclass(repr=False)
class MLPConfig(ImageConfig):
    """Multi-layer perceptron on flattened images."""

    hidden: int = 256
    depth: int = 2

    def module(self) -> nn.Module:
        return MLP(self.pixels, [self.hidden] * self.depth, self.num_classes)


@models.register("mlp-wide")
@dataclass(repr=False)
class WideMLPConfig(ImageConfig):
    """One hidden layer of ``width`` units: a large gradient for little compute (communication-bound)."""

    width: int = 4096

    def module(self) -> nn.Module:
        return MLP(self.pixels, [self.width], self.num_classes)


class BasicBlock(nn.Module):
    """He et al. 2016's basic residual block (Figure 2): relu(bn(conv(relu(bn(conv(x))))) + shortcut(x)),
    the shortcut a strided 1×1 convolution where the shape changes (their option B)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """He et al. 2016, Section 4.2: a 3×3 stem, three stages of ``blocks`` basic blocks with ``width``,
    2·``width``, 4·``width`` channels (the last two halve the resolution), global average pooling, linear."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 16, blocks: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        stages: list[nn.Module] = []
        channels = width
        for stage in range(3):
            out = width * 2 ** stage
            for block in range(blocks):
                stages.append(BasicBlock(channels, out, 2 if stage > 0 and block == 0 else 1))
                channels = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))


@models.register("resnet")
@dataclass(repr=False)
class ResNetConfig(ImageConfig):
    """Small residual CNN (ResNet-(6·blocks+2), He et al. 2016); any image size (global pooling)."""

    width: int = 16
    blocks: int = 1

    def module(self) -> nn.Module:
        return ResNet(self.in_channels, self.num_classes, self.width, self.blocks)


# ---------------------------------------------------------------------------------------------------
# Fortunes: word-level LSTM language model
# ---------------------------------------------------------------------------------------------------
class LSTMLanguageModel(nn.Module):
    """Zaremba, Sutskever & Vinyals 2014: embedding, stacked LSTM, linear decoder to next-word logits.

    Input (B, T) token ids, output (B, T, vocab) logits. The embedding is dense (``sparse=False``): its
    gradient is a (vocab, embedding) tensor whose rows are zero for every token absent from the batch.
    Tying decoder and embedding weights (Press & Wolf 2017) would make that gradient dense, so it is off
    by default. Weights start uniform in [−0.1, 0.1] as in Zaremba et al.
    """

    def __init__(self, vocab_size: int, embedding: int = 200, hidden: int = 200, layers: int = 2,
                 dropout: float = 0.0, tie_weights: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(embedding, hidden, layers, batch_first=True,
                            dropout=dropout if layers > 1 else 0.0)
        self.decoder = nn.Linear(hidden, vocab_size)
        for parameter in self.parameters():
            nn.init.uniform_(parameter, -0.1, 0.1)
        if tie_weights:
            if hidden != embedding:
                raise ValueError(f"tied weights need hidden == embedding, got {hidden} and {embedding}")
            self.decoder.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.drop(self.embedding(tokens)))
        return self.decoder(self.drop(out))


@models.register("lstm")
@dataclass(repr=False)
class LSTMConfig(ModelConfig):
    """Word-level LSTM language model (Zaremba et al. 2014's small model: 2×200, SGD lr 1, clip 5)."""

    vocab_size: int = 10_000
    embedding: int = 200
    hidden: int = 200
    layers: int = 2
    dropout: float = 0.0
    tie_weights: bool = False
    task: ClassVar[str] = "language-model"
    dataset: ClassVar[str] = "fortunes"
    lr: ClassVar[float] = 1.0
    batch_size: ClassVar[int] = 20
    grad_clip: ClassVar[float | None] = 5.0

    def module(self) -> nn.Module:
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lstm: dropout must be in [0, 1), got {self.dropout}")
        return LSTMLanguageModel(self.vocab_size, self.embedding, self.hidden, self.layers, self.dropout,
                                 self.tie_weights)


# ---------------------------------------------------------------------------------------------------
# MovieLens-100k: neural collaborative filtering
# ---------------------------------------------------------------------------------------------------
class NCF(nn.Module):
    """Neural collaborative filtering (He et al. 2017) on (user, item) pairs; output: one logit per pair.

    * GMF (Eq. 9–10): φ = p_u ⊙ q_i with ``factors``-dimensional embeddings.
    * MLP (Eq. 5): its own embeddings of ``factors``·2^(layers−1) each, concatenated, through a tower of
      ``layers`` ReLU layers halving the width down to ``factors`` (Section 4.1's "tower pattern").
    * NeuMF (Eq. 11–12): h^T [φ_GMF ; φ_MLP], the two towers side by side (trained from scratch here,
      without the paper's optional pre-training).

    The logit feeds the pointwise log loss of Eq. 7 (``binary_cross_entropy_with_logits``). Embeddings
    start from N(0, 0.01²) as in Section 4.1.
    """

    def __init__(self, num_users: int, num_items: int, factors: int = 8, layers: int = 3,
                 arch: Literal["neumf", "gmf", "mlp"] = "neumf") -> None:
        super().__init__()
        self.arch = arch
        width = 0
        if arch in ("neumf", "gmf"):
            self.gmf_user, self.gmf_item = nn.Embedding(num_users, factors), nn.Embedding(num_items, factors)
            width += factors
        if arch in ("neumf", "mlp"):
            size = factors * 2 ** (layers - 1)
            self.mlp_user, self.mlp_item = nn.Embedding(num_users, size), nn.Embedding(num_items, size)
            tower: list[nn.Module] = []
            for k in range(layers):
                tower += [nn.Linear(2 * size >> k, size >> k), nn.ReLU()]
            self.tower = nn.Sequential(*tower)
            width += factors
        self.predict = nn.Linear(width, 1)
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.01)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        users, items = pairs[..., 0], pairs[..., 1]
        parts = []
        if self.arch in ("neumf", "gmf"):
            parts.append(self.gmf_user(users) * self.gmf_item(items))
        if self.arch in ("neumf", "mlp"):
            parts.append(self.tower(torch.cat([self.mlp_user(users), self.mlp_item(items)], -1)))
        return self.predict(torch.cat(parts, -1)).squeeze(-1)


@models.register("ncf")
@dataclass(repr=False)
class NCFConfig(ModelConfig):
    """Neural collaborative filtering (He et al. 2017): NeuMF by default, Adam lr 0.001, batch 256."""

    num_users: int = 943
    num_items: int = 1682
    factors: int = 8
    layers: int = 3
    arch: Literal["neumf", "gmf", "mlp"] = "neumf"
    task: ClassVar[str] = "recommendation"
    dataset: ClassVar[str] = "movielens-100k"
    optimizer: ClassVar[str] = "adam"
    lr: ClassVar[float] = 0.001
    batch_size: ClassVar[int] = 256

    def module(self) -> nn.Module:
        return NCF(self.num_users, self.num_items, self.factors, self.layers, self.arch)


# ---------------------------------------------------------------------------------------------------
# Losses and quality metrics
# ---------------------------------------------------------------------------------------------------
def _lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "classification": F.cross_entropy,
    "language-model": _lm_loss,
    "recommendation": F.binary_cross_entropy_with_logits,  # NCF's pointwise log loss, Eq. 7
}
#: samples per evaluation batch (a language model's are windows of bptt tokens × vocabulary logits)
EVAL_BATCH = {"classification": 1000, "language-model": 64, "recommendation": 256}
#: task -> (its headline quality metric, whether higher is better)
QUALITY: dict[str, tuple[str, bool]] = {
    "classification": ("accuracy", True),
    "language-model": ("perplexity", False),
    "recommendation": ("hit_rate@10", True),
}


def criterion(data: Dataset | str) -> Callable[..., torch.Tensor]:
    """The training loss of a dataset's task: ``criterion(data)(model(x), y)``."""
    task = data if isinstance(data, str) else data.task
    if task not in LOSSES:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(LOSSES)}")
    return LOSSES[task]


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """The fraction of rows whose largest logit is at the target class."""
    return float((logits.argmax(dim=-1) == targets).float().mean())


def perplexity(mean_nll: float) -> float:
    """exp of the mean per-token negative log-likelihood (nats)."""
    return math.exp(mean_nll)


def positive_rank(scores: torch.Tensor) -> torch.Tensor:
    """Per row, the 0-based rank of column 0 (the held-out item) among the row's candidates.

    Ties count against it (a candidate scoring equal ranks ahead), so a constant model earns nothing.
    """
    return (scores[:, 1:] >= scores[:, :1]).sum(dim=1)


def hit_rate_at_k(scores: torch.Tensor, k: int = 10) -> float:
    """HR@k (NCF Section 4.1): the fraction of users whose held-out item (column 0) ranks in the top k."""
    return float((positive_rank(scores) < k).float().mean())


def ndcg_at_k(scores: torch.Tensor, k: int = 10) -> float:
    """NDCG@k with one relevant item: 1/log2(rank + 2) when it ranks in the top k, else 0 (averaged)."""
    rank = positive_rank(scores).double()
    return float(torch.where(rank < k, 1.0 / torch.log2(rank + 2.0), torch.zeros_like(rank)).mean())


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, batch_size: int | None = None) -> dict[str, float]:
    """Quality of ``model`` on ``data``'s test split: the mean ``loss`` and the task's metrics (module doc).

    Batch by batch (a language model's logits over a whole test set would not fit in memory); the model
    is put in eval mode for the measurement and returned to its previous mode.
    """
    if len(data.test) == 0:
        raise ValueError(f"{data.name}: the test split is empty")
    loss_fn = criterion(data)
    batch_size = batch_size or EVAL_BATCH[data.task]
    loss_sum, count, correct, scores = 0.0, 0, 0, []
    was_training = model.training
    model.eval()
    try:
        for x, y in data.test.batches(batch_size):
            out = model(x).float()
            loss_sum += float(loss_fn(out, y, reduction="sum"))
            count += y.numel()
            if data.task == "classification":
                correct += int((out.argmax(dim=-1) == y).sum())
            elif data.task == "recommendation":
                scores.append(out)
    finally:
        model.train(was_training)
    loss = loss_sum / count
    if data.task == "classification":
        return {"loss": loss, "accuracy": correct / count}
    if data.task == "language-model":
        return {"loss": loss, "perplexity": perplexity(loss)}
    scores_all = torch.cat(scores)
    return {"loss": loss, "hit_rate@10": hit_rate_at_k(scores_all, 10), "ndcg@10": ndcg_at_k(scores_all, 10)}
