"""Empty tensors (a zero-size parameter) beside non-empty ones, for every registered method and
composition (the property suite's specs): the runtime passes them by — no compressor, feedback memory
or collective sees them, every rank alike, since the ranks agree on the shapes — and their average is
an empty tensor of their shape and dtype. The other tensors' averages, and the bytes sent, are those
of the same exchange without the empty tensors, bit for bit: in the Simulator (every spec), the
Communicator (2 Gloo processes, every registered method) and the DDP hook (an
``nn.Parameter(torch.zeros(0))``, a method of each exchange: all-gather, all-reduce, preliminary rounds,
the planned flat all-reduce).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gradpress
from dist_utils import run_workers
from specs import SPECS

STEPS = 2
EMPTY = {"first": (0,), "middle": (3, 0)}  # before, between and after the non-empty tensors
# in 2 processes, every registered method once (a fresh process loads each method's compiled kernels:
# the Simulator covers the examples and compositions), and under DDP a method of each exchange
COMMUNICATOR_SPECS = gradpress.compressor_names()
DDP_SPECS = ["topk:ratio=0.1", "randomk:ratio=0.5", "qsgd", "powersgd", "thc", "none"]


def grads(rank: int, step: int, empty: bool = True,
          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One rank's gradients at one step: a vector and a matrix, and the empty tensors among them."""
    g = torch.Generator().manual_seed(100 * rank + step)
    full = {"w": torch.randn(64, generator=g).to(dtype), "m": torch.randn(8, 6, generator=g).to(dtype)}
    if not empty:
        return full
    return {"first": torch.zeros(EMPTY["first"], dtype=dtype), "w": full["w"],
            "middle": torch.zeros(EMPTY["middle"], dtype=dtype), "m": full["m"],
            "last": torch.zeros(0, dtype=dtype)}


def simulated(spec: str, empty: bool, dtype: torch.dtype = torch.float32, **options) -> tuple[list, list]:
    """Every step's averages of 2 simulated workers, and worker 0's sent bytes per step."""
    sim = gradpress.Simulator(spec, 2, seed=0, **options)
    outs, sent = [], []
    for step in range(STEPS):
        outs.append(sim.step([grads(rank, step, empty, dtype) for rank in range(2)]))
        sent.append(sim.stats()[0]["last"]["sent_bytes"])
    return outs, sent


def check_empty(out: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
    for key, shape in [*EMPTY.items(), ("last", (0,))]:
        assert out[key].shape == shape and out[key].dtype == dtype, (key, out[key])


@pytest.mark.parametrize("spec", SPECS)
def test_simulator_passes_empty_tensors_by(spec):
    with_empty, sent = simulated(spec, True)
    without, sent_without = simulated(spec, False)
    for out, ref in zip(with_empty, without, strict=True):
        check_empty(out)
        for key in ref:
            assert torch.equal(out[key], ref[key]), f"{spec}: {key!r} differs beside empty tensors"
    assert sent == sent_without  # nothing on the wire for them
    only = gradpress.Simulator(spec, 2).step([{"e": torch.zeros(0)}] * 2)  # a bucket of nothing
    assert only["e"].shape == (0,) and only["e"].dtype == torch.float32


@pytest.mark.parametrize("spec, options", [
    ("topk:ratio=0.1", {"mode": "ps", "root": 1}),
    ("qsparse", {"dtype": torch.bfloat16}),
    ("powersgd", {"dtype": torch.float16}),
    ("thc", {"mode": "switch"}),
    ("qsgd", {"mode": "ps", "master": "natural"}),
    ("powersgd", {"mode": "ps", "master": "topk:ratio=0.5"}),
    ("randomk", {"mode": "ps", "partial": 0.5}),
    ("none", {"min_numel": 10, "exclude": ["m"]}),
    ("natural", {"warmup_steps": 1}),
])
def test_empty_tensors_under_other_modes_options_and_dtypes(spec, options):
    options = dict(options)
    dtype = options.pop("dtype", torch.float32)
    with_empty, sent = simulated(spec, True, dtype, **options)
    without, sent_without = simulated(spec, False, dtype, **options)
    for out, ref in zip(with_empty, without, strict=True):
        check_empty(out, dtype)
        assert all(torch.equal(out[key], ref[key]) for key in ref)
    assert sent == sent_without


class WithEmpty(nn.Module):
    """A linear layer, with or without a zero-size parameter that the forward pass uses (its gradient is
    an empty tensor, in a DDP bucket beside the layer's)."""

    def __init__(self, empty: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(12, 5)
        self.empty = nn.Parameter(torch.zeros(0)) if empty else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y if self.empty is None else y + self.empty.sum()


def _exchange(rank: int, world_size: int, specs: list[str], ddp_specs: list[str]) -> tuple[dict, dict]:
    """Every spec's averages through a Communicator (reduce_many, STEPS steps) with its sent bytes; and
    3 DDP steps per spec of ``ddp_specs``, with and without the empty parameter: the parameters after
    them and the empty one's gradient (one spawn for both: starting processes is what costs here)."""
    communicated = {}
    for spec in specs:
        comm = gradpress.Communicator(spec, seed=0)
        outs = [comm.reduce_many(grads(rank, step)) for step in range(STEPS)]
        communicated[spec] = (outs, comm.stats()["total"]["sent_bytes"])
    trained = {}
    for spec in ddp_specs:
        for empty in (True, False):
            ddp = nn.parallel.DistributedDataParallel(WithEmpty(empty))
            gradpress.register(ddp, spec, seed=0)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for step in range(3):
                g = torch.Generator().manual_seed(10 * rank + step)
                x = torch.randn(8, 12, generator=g)
                loss = (ddp(x) - x[:, :5]).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            module = ddp.module
            trained[spec, empty] = ({name: p.detach().clone() for name, p in module.named_parameters()},
                                    None if module.empty is None else module.empty.grad)
    return communicated, trained


def test_communicator_and_ddp_hook_pass_empty_tensors_by():
    """2 Gloo processes. Communicator, every registered method: the ranks' averages are bit-identical
    and equal the Simulator's, and so are the bytes sent. DDP hook, a few methods: an empty parameter's
    gradient stays empty, and the other parameters are bit for bit those of the same model without it."""
    expected = {spec: simulated(spec, True) for spec in COMMUNICATOR_SPECS}  # (numba compiles here, once)
    ranks = run_workers(_exchange, 2, COMMUNICATOR_SPECS, DDP_SPECS, timeout=300)
    for spec, (outs, sent) in expected.items():
        for communicated, _ in ranks:
            got, got_sent = communicated[spec]
            assert got_sent == sum(sent), spec
            for out, ref in zip(got, outs, strict=True):
                check_empty(out)
                assert all(torch.equal(out[key], ref[key]) for key in ref), spec
    trained = [rank[1] for rank in ranks]
    for spec in DDP_SPECS:
        params, grad = trained[0][spec, True]
        reference, _ = trained[0][spec, False]
        assert grad is not None and grad.shape == (0,), spec
        assert params["empty"].shape == (0,)
        for name, value in reference.items():
            assert torch.equal(params[name], value), f"{spec}: {name} differs beside an empty parameter"
        other, _ = trained[1][spec, True]
        assert all(torch.equal(other[name], params[name]) for name in params), f"{spec}: ranks differ"
