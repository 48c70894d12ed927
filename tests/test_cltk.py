"""ScaleCom's cyclic local top-k, CLT-k (App. D, E, Figure A2), and its low-pass filtered memory."""
from __future__ import annotations

import pytest
import torch

import gradpress
from dist_utils import run_workers
from gradpress.compressors.cltk import chunk_kept, chunk_top
from gradpress.compressors.sparsify import topk_indices
from gradpress.core.rng import Context
from numerics import mean_error

# Figure A2: the first 8 error-feedback gradients of the four workers at iteration 0 (leader cuda:1)
A2 = [[0.0206, 0.0182, 0.0094, -0.0039, -0.0102, 0.0315, 0.0220, 0.0063],
      [0.0138, 0.0161, 0.0210, 0.0238, 0.0211, 0.0233, 0.0245, 0.0242],
      [-0.0124, -0.0032, -0.0058, -0.0007, 0.0036, -0.0089, -0.0066, -0.0037],
      [0.0065, 0.0184, 0.0227, 0.0099, 0.0005, 0.0132, 0.0096, 0.0111]]
A2_SELECTED = [0, 5]  # "index 0 of the first chunk and index 1 of the second chunk"


def a2_expected() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The averaged gradient and every worker's residual printed in Figure A2 (exactly, not rounded)."""
    xs = [torch.tensor(row) for row in A2]
    mask = torch.zeros(8, dtype=torch.bool)
    mask[A2_SELECTED] = True
    average = torch.where(mask, sum(xs) / 4, torch.zeros(8))
    return average, [torch.where(mask, torch.zeros(8), x) for x in xs]


def assert_a2_average(out: torch.Tensor) -> None:
    """The selected values' mean, up to the rounding of a float32 mean of 4 values in any order (the
    all-reduce's, tests/numerics.py); zero elsewhere."""
    xs = [torch.tensor(row) for row in A2]
    mask = torch.zeros(8, dtype=torch.bool)
    mask[A2_SELECTED] = True
    exact = torch.where(mask, sum(x.double() for x in xs) / 4, 0.0)
    assert ((out.double() - exact).abs() <= torch.where(mask, mean_error(xs), 0.0)).all(), out - exact


def test_figure_a2_four_workers():
    """The leader (rank 0 at step 0) picks one index per chunk of 4 from its own gradient; all four
    workers send their values there; the average is the same everywhere; the residuals are the values
    that were not selected."""
    c = gradpress.make("cltk")
    assert (c.chunk, c.per_chunk, c.select) == (4, 1, "chunk")
    leader = c.prepare(torch.tensor(A2[0]), Context(step=0, rank=0), 4)
    assert leader.op == "broadcast" and leader.src == 0 and leader.values.tolist() == A2_SELECTED
    sim = gradpress.Simulator("cltk", 4)
    out = sim.step([torch.tensor(row) for row in A2])
    _, residuals = a2_expected()
    assert_a2_average(out)
    assert torch.allclose(out[A2_SELECTED], torch.tensor([0.0071, 0.0148]), rtol=0, atol=5e-5)  # as printed
    for pipeline, residual in zip(sim.pipelines, residuals, strict=True):
        assert torch.equal(pipeline.feedback.memory(""), residual)


def test_the_leader_rotates_and_its_indices_are_used():
    """At step t the leader is rank t mod n: the support of the average is its chunk-wise selection."""
    n = 3
    sim = gradpress.Simulator("cltk:chunk=8", n, feedback="none")
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        workers = [torch.randn(64, generator=g) for _ in range(n)]
        out = sim.step(workers)
        chosen = chunk_top(workers[step % n], 8, 1)
        assert torch.equal(out.nonzero().squeeze(1), chosen)
        exact = sum(w.double() for w in workers) / n
        assert ((out[chosen].double() - exact[chosen]).abs() <= mean_error(workers)[chosen]).all()


def test_chunk_wise_quasi_sorting():
    x = torch.tensor([1.0, -3.0, 3.0, 2.0, 0.0, 0.0, 0.0, 0.0, 5.0, -6.0])
    assert chunk_top(x, 4, 1).tolist() == [1, 4, 9]  # ties to the lower index; a short last chunk
    assert chunk_top(x, 4, 2).tolist() == [1, 2, 4, 5, 8, 9]
    assert chunk_top(x, 4, 3).tolist() == [1, 2, 3, 4, 5, 6, 8, 9]  # the last chunk has only 2
    assert chunk_top(x, 4, 4).tolist() == list(range(10))
    assert chunk_top(x.half(), 4, 2).tolist() == [1, 2, 4, 5, 8, 9]
    for numel in (1, 7, 8, 9, 1000):
        assert chunk_top(torch.randn(numel), 4, 3).numel() == chunk_kept(numel, 4, 3)
    assert chunk_kept(10, 4, 3) == 3 + 3 + 2
    y = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    exact = gradpress.make("cltk:chunk=10,select=exact")
    assert torch.equal(exact.indices(y), topk_indices(y, 100))
    assert exact.expected_nbytes(1000) == 400 and exact.expected_nbytes(1000, torch.bfloat16) == 200


@pytest.mark.parametrize("spec",
                         ["cltk:chunk=0", "cltk:per_chunk=0", "cltk:chunk=2,per_chunk=3", "cltk:select=sort"])
def test_bad_parameters_raise(spec):
    with pytest.raises(ValueError):
        gradpress.make(spec)


def test_lowpass_memory():
    """m ← (1 − β)·m + β·(x − C(x)), x = m + g (App. D); β = 1 is plain error feedback."""
    assert gradpress.make("cltk").default_feedback == "lowpass"
    with pytest.raises(ValueError, match="beta"):
        gradpress.make_feedback("lowpass:beta=1.5")
    beta, fb = 0.25, gradpress.make_feedback("lowpass:beta=0.25")
    m = torch.zeros(4)
    for g in (torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([-1.0, 0.5, 0.0, 2.0])):
        x = fb.compensate("w", g)
        assert torch.equal(x, m + g)
        sent = torch.where(x.abs() >= x.abs().max(), x, torch.zeros(4))
        fb.update("w", x, sent)
        m = (1 - beta) * m + beta * (x - sent)
        assert torch.allclose(fb.memory("w"), m)
    restored = gradpress.make_feedback("lowpass:beta=0.25")
    restored.load_state_dict(fb.state_dict())
    assert torch.equal(restored.memory("w"), fb.memory("w"))
    steps = [[torch.randn(40, generator=torch.Generator().manual_seed(10 * s + r)) for r in range(2)]
             for s in range(3)]
    plain, residual = gradpress.Simulator("cltk", 2), gradpress.Simulator("cltk", 2, feedback="residual")
    for workers in steps:
        assert torch.equal(plain.step(workers), residual.step(workers))


def test_warm_up_with_the_runtime_option():
    """App. E's compression warm-up is the runtime's ``warmup_steps``: those steps are exact and leave
    the memory empty; compression starts with leader (step mod n) at the first compressed step."""
    sim = gradpress.Simulator("cltk:chunk=8", 2, warmup_steps=2)
    for step in range(3):
        workers = [torch.randn(32, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(2)]
        out = sim.step(workers)
        if step < 2:
            assert torch.equal(out, (workers[0] + workers[1]) / 2)
            assert sim.pipelines[0].feedback.memory("") is None
        else:
            assert torch.equal(out.nonzero().squeeze(1), chunk_top(workers[0], 8, 1))


# -- several processes --------------------------------------------------------------------------------------
NUMEL, CHUNK = 4096, 8


def _gradient(rank: int, step: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * rank + step))


def _ranks(rank: int, world_size: int) -> dict:
    """Figure A2 on four Gloo ranks; then, on sub-groups of 2, 3 and 4 ranks, one full leader cycle."""
    import torch.distributed as dist

    comm = gradpress.Communicator("cltk")
    out: dict = {"a2": comm.reduce(torch.tensor(A2[rank]), "w"),
                 "a2_memory": comm.state_dict()["feedback"]["memory"]["w"]}
    for n in (2, 3, 4):
        group = dist.new_group(list(range(n)))  # every rank takes part in creating it
        if rank < n:
            comm = gradpress.Communicator(f"cltk:chunk={CHUNK}", process_group=group)
            averaged = [comm.reduce(_gradient(rank, step), "g") for step in range(n)]
            out[n] = {"sent": comm.stats()["total"]["sent_bytes"], "averaged": averaged}
    return out


def test_four_processes_figure_a2_and_bytes_do_not_grow_with_n():
    results = run_workers(_ranks, 4, timeout=180)
    _, residuals = a2_expected()
    for rank, result in enumerate(results):
        assert torch.equal(result["a2"], results[0]["a2"])  # identical on every worker
        assert_a2_average(result["a2"])
        assert torch.equal(result["a2_memory"], residuals[rank])
    k = chunk_kept(NUMEL, CHUNK, 1)
    values, indices = 4 * k, 4 * k  # float32 values all-reduced, int32 indices broadcast by the leader
    for n in (2, 3, 4):
        sim = gradpress.Simulator(f"cltk:chunk={CHUNK}", n)
        for step in range(n):
            expected = sim.step([_gradient(r, step) for r in range(n)])
            for rank in range(n):
                assert torch.equal(results[rank][n]["averaged"][step], expected)
        sent = [results[rank][n]["sent"] for rank in range(n)]
        assert sent == [s["total"]["sent_bytes"] for s in sim.stats()]
        # over one cycle every rank leads once, so all send the same; per step at most 2·values +
        # indices whatever n (an all-gather of local top-k sends (n − 1)·(values + indices))
        assert len(set(sent)) == 1
        assert values <= sent[0] / n <= 2 * values + indices
