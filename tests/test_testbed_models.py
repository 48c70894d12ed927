"""The testbed's models and metrics: shapes, registry, learning on a tiny batch, metrics on hand-made
cases, the LSTM's sparse embedding gradient, evaluate() on the fixture datasets."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradpress.testbed import data as D
from gradpress.testbed import models as M
from numerics import gamma

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def images() -> D.ImageData:
    return D.load_fashion_mnist(FIXTURES / "fashion-mnist")


@pytest.fixture(scope="module")
def text() -> D.TextData:
    return D.load_fortunes(FIXTURES / "fortunes", vocab_size=6, bptt=3)


@pytest.fixture(scope="module")
def ratings() -> D.RecData:
    return D.load_movielens(FIXTURES / "recbole-fixture.whl", test_negatives=3)


SMALL = {  # spec -> (input, output shape): small widths keep the test fast
    "mlp:hidden=16,depth=2": (torch.randn(5, 1, 28, 28), (5, 10)),
    "mlp-wide:width=64": (torch.randn(5, 1, 28, 28), (5, 10)),
    "resnet:width=4,blocks=2": (torch.randn(5, 1, 28, 28), (5, 10)),
    "lstm:vocab_size=50,embedding=8,hidden=8": (torch.randint(50, (4, 7)), (4, 7, 50)),
    "ncf:num_users=6,num_items=9": (torch.tensor([[0, 1], [5, 8], [2, 2]]), (3,)),
    "ncf:num_users=6,num_items=9,arch=gmf": (torch.randint(6, (2, 4, 2)), (2, 4)),
    "ncf:num_users=6,num_items=9,arch=mlp": (torch.randint(6, (2, 4, 2)), (2, 4)),
}


@pytest.mark.parametrize("spec", SMALL)
def test_forward_shapes(spec):
    x, shape = SMALL[spec]
    assert M.make_model(spec)(x).shape == shape


def test_every_registered_model_is_covered():
    assert {spec.split(":")[0] for spec in SMALL} == set(M.model_names())


def test_registry_specs_and_data_sizes(images, text, ratings):
    wide = M.make_model("mlp-wide:width=128")
    assert wide.net[1].weight.shape == (128, 784) and wide.spec == "mlp-wide:width=128"
    assert wide.task == "classification"
    assert M.make_model("mlp-wide", width=96).net[1].weight.shape == (96, 784)
    lm = M.make_model("lstm:embedding=8,hidden=8", data=text)
    assert lm.embedding.num_embeddings == 6 and lm.decoder.out_features == 6
    ncf = M.make_model("ncf", data=ratings)
    assert ncf.gmf_user.num_embeddings == 4 and ncf.gmf_item.num_embeddings == 8
    assert M.make_model("resnet:width=4", data=images)(images.test.x).shape == (4, 10)
    with pytest.raises(ValueError, match="classification data"):
        M.make_model("lstm", data=images)
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        M.make_model("vgg")
    with pytest.raises(ValueError, match="no parameter 'depth'"):
        M.make_model("resnet:depth=3")
    with pytest.raises(ValueError, match="width must be at least 1"):
        M.make_model("mlp-wide:width=0")


def test_ncf_follows_the_paper_layout():
    """He et al. 2017: GMF factors 8; MLP tower halving to the factors (64 -> 32 -> 16 -> 8); h over both."""
    model = M.make_model("ncf:factors=8,layers=3")
    assert model.gmf_user.embedding_dim == 8 and model.mlp_user.embedding_dim == 32
    linear = [m for m in model.tower if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(64, 32), (32, 16), (16, 8)]
    assert model.predict.in_features == 16
    assert float(model.gmf_user.weight.detach().std()) < 0.02  # N(0, 0.01²) start


def test_resnet_downsamples_twice():
    model = M.make_model("resnet:width=4,blocks=1")
    shapes = []
    hooks = [b.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape))) for b in model.stages]
    model(torch.randn(2, 1, 28, 28))
    for hook in hooks:
        hook.remove()
    assert shapes == [(2, 4, 28, 28), (2, 8, 14, 14), (2, 16, 7, 7)]


LEARN = {  # spec -> learning rate of the optimizer its config recommends (SGD, Adam for NCF)
    "mlp:hidden=32": 0.1,
    "mlp-wide:width=128": 0.1,
    "resnet:width=4": 0.05,
    "lstm:vocab_size=30,embedding=32,hidden=32,layers=1": 10.0,
    "ncf:num_users=10,num_items=20": 0.01,
}


def tiny_batch(task: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if task == "classification":
        return torch.randn(16, 1, 28, 28, generator=generator), torch.randint(10, (16,), generator=generator)
    if task == "language-model":  # a learnable stream: each token is followed by the next id (mod 30)
        stream = (torch.randint(30, (4, 1), generator=generator) + torch.arange(9)) % 30
        return stream[:, :-1], stream[:, 1:]
    pairs = torch.stack([torch.randint(10, (32,), generator=generator),
                         torch.randint(20, (32,), generator=generator)], 1)
    return pairs, (torch.rand(32, generator=generator) < 0.5).float()


@pytest.mark.parametrize("spec", LEARN)
def test_training_steps_reduce_loss(spec):
    config, model = M.model_config(spec), M.make_model(spec)
    x, y = tiny_batch(config.task, torch.Generator().manual_seed(0))
    loss_fn = M.criterion(config.task)
    make = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[config.optimizer]
    optimizer = make(model.parameters(), lr=LEARN[spec])
    losses = []
    for _ in range(25):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_lstm_embedding_gradient_has_zero_rows_for_unseen_tokens():
    model = M.make_model("lstm:vocab_size=40,embedding=8,hidden=8")
    tokens = torch.tensor([[3, 5, 7, 5], [11, 3, 2, 7]])
    M.criterion("language-model")(model(tokens), torch.roll(tokens, -1, 1)).backward()
    grad = model.embedding.weight.grad
    nonzero = set(grad.abs().sum(1).nonzero().squeeze(1).tolist())
    assert nonzero == {2, 3, 5, 7, 11}
    # tying the decoder to the embedding makes that gradient dense: why it is off by default
    tied = M.make_model("lstm:vocab_size=40,embedding=8,hidden=8,tie_weights=true")
    M.criterion("language-model")(tied(tokens), torch.roll(tokens, -1, 1)).backward()
    assert bool((tied.embedding.weight.grad.abs().sum(1) > 0).all())


# ------------------------------------------------------------------------------ metrics
def test_accuracy_and_perplexity():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 5.0], [4.0, 0.0, 0.0]])
    assert M.accuracy(logits, torch.tensor([0, 1, 2, 2])) == 0.75
    assert M.perplexity(math.log(50.0)) == pytest.approx(50.0)


def test_hit_rate_and_ndcg_by_rank():
    first = torch.tensor([[99.0] + list(range(99))])  # positive (column 0) scores highest
    last = torch.tensor([[-1.0] + list(range(99))])  # below all 99 negatives
    assert M.hit_rate_at_k(first) == 1.0 and M.ndcg_at_k(first) == 1.0
    assert M.hit_rate_at_k(last) == 0.0 and M.ndcg_at_k(last) == 0.0
    tenth = torch.tensor([[5.0, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0, 1, 2]])  # 9 above it: rank 9, still a hit
    eleventh = torch.tensor([[5.0, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 1, 2]])  # 10 above: a miss
    assert M.positive_rank(tenth).tolist() == [9] and M.hit_rate_at_k(tenth) == 1.0
    assert M.ndcg_at_k(tenth) == pytest.approx(1 / math.log2(11))
    assert M.hit_rate_at_k(eleventh) == 0.0
    second = torch.tensor([[1.0, 2.0, 0.0], [3.0, 2.0, 1.0]])
    assert M.hit_rate_at_k(second, k=1) == 0.5
    assert M.ndcg_at_k(second, k=2) == pytest.approx((1 / math.log2(3) + 1) / 2)
    ties = torch.zeros(4, 100)  # a constant model: ties count against the positive
    assert M.hit_rate_at_k(ties) == 0.0


# ------------------------------------------------------------------------------ evaluate
class Fixed(nn.Module):
    """Returns the given outputs, recording whether it ran in eval mode."""

    def __init__(self, outputs: torch.Tensor) -> None:
        super().__init__()
        self.outputs, self.modes = outputs, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        return self.outputs[: len(x)]


def test_evaluate_classification(images):
    logits = F.one_hot(torch.tensor([2, 6, 0, 3]), 10).float() * 5  # test labels are 2, 6, 5, 3
    model = Fixed(logits)
    result = M.evaluate(model, images)
    assert result["accuracy"] == 0.75
    # the same per-sample losses, summed then divided vs averaged in float32: n positive terms, γ_{n+1}
    # each way (tests/numerics.py)
    n = len(images.test.y)
    assert result["loss"] == pytest.approx(float(F.cross_entropy(logits, images.test.y)), rel=2 * gamma(n + 1))
    assert model.modes == [False] and model.training  # evaluated in eval mode, handed back in train mode


def test_evaluate_language_model_uniform_is_vocab_size(text):
    result = M.evaluate(Fixed(torch.zeros(2, 3, 6)), text)
    assert result["perplexity"] == pytest.approx(6.0) and result["loss"] == pytest.approx(math.log(6))


def test_evaluate_recommendation(ratings):
    held_out = torch.zeros(4, 8)
    held_out[ratings.test.x[:, 0, 0], ratings.test.x[:, 0, 1]] = 1.0

    class Oracle(nn.Module):
        def forward(self, pairs: torch.Tensor) -> torch.Tensor:
            return held_out[pairs[..., 0], pairs[..., 1]]

    result = M.evaluate(Oracle(), ratings)
    assert result["hit_rate@10"] == 1.0 and result["ndcg@10"] == 1.0
    hr = M.evaluate(M.make_model("ncf", data=ratings), ratings)["hit_rate@10"]
    assert hr == 1.0  # 4 candidates: always in the top 10


def test_evaluate_real_models_on_real_data_batch():
    """Each default model builds from its real dataset and runs a training step (skipped without the data)."""
    loaded: dict[str, D.Dataset] = {}
    for spec in M.model_names():
        name = M.model_config(spec).dataset
        try:
            data = loaded[name] = loaded.get(name) or D.load(name)
        except D.DataUnavailable as error:
            pytest.skip(f"real data absent (run `gradpress data`): {error}")
        model = M.make_model(spec, data=data)
        x, y = next(data.training_set(torch.Generator().manual_seed(0)).batches(8))
        loss = M.criterion(data)(model(x), y)
        loss.backward()
        assert math.isfinite(loss.item())
