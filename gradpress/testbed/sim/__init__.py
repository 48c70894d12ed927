"""``gradpress sim``: many workers in one process (:func:`gradpress.simulate`), and an α–β cost model.

Three questions the multi-process testbed cannot afford to ask at scale:

``gradpress sim nmse``
    How far is the aggregate from the true mean as the number of workers n grows (THC Section 8.4 and
    Figure 10's question, asked of the aggregate directly)? Every worker holds its own vector,
    x_i = s + σ·ξ_i: a signal s shared by all (``normal`` N(0, 1) or ``lognormal`` LogNormal(0, 1), THC
    App. D.4's stand-in for a gradient) plus private noise ξ_i ~ N(0, 1) (σ = ``spread``), as the
    mini-batch gradients of data-parallel workers differ around the full gradient. The NMSE
    ‖x̂ − x̄‖² / ‖x̄‖² (THC Section 2's definition) of what :func:`gradpress.simulate` returns, against
    the exact mean x̄ = (1/n)·Σ x_i, is averaged over ``trials`` draws with fixed seeds. An unbiased
    compressor whose workers round with private randomness (invariant: explicit randomness, docs/design.md)
    has independent errors
    of variance ω‖x_i‖², so NMSE ≈ ω(1 + σ²)/(n + σ²): it falls like 1/n (slope −1 on the log-log
    plot). A biased one (top-k) keeps its bias however many workers average (slope ≈ 0), and so does an
    unbiased one whose errors are shared: random-k with ``scale=true`` draws its indices from the
    shared stream to stay summable, so every worker drops the same coordinates and
    NMSE = d/k − 1 for every n. ``none`` is exact up to fp32 rounding of the sum (≈ 1e-13).

``gradpress sim quality``
    Synchronous data-parallel SGD with n simulated workers: at every step each worker computes the
    gradient of its own mini-batch from its shard (``dataset.shard(rank, n)``), a
    :class:`gradpress.Simulator` exchanges them (keyed by parameter name, feedback memory carried over
    steps) and the optimizer applies the aggregate; the test-set quality
    (:func:`gradpress.testbed.models.evaluate`) before and after, against n. The learning rate is the
    model's and is not scaled with n (the global batch is n times the per-worker batch). Buffers
    (batch-norm statistics) follow rank 0's batches, as DDP's ``broadcast_buffers`` makes them.

``gradpress sim cost``
    The α–β model of :mod:`gradpress.costmodel` checked against measured runs
    (``gradpress compare``'s ``results.json``): a run's step is predicted as its compute time, plus its
    compression time, plus the exchange of its bytes per step by its strategy (summable → ring
    all-reduce, else all-gather; ``ps``/``switch`` modes → gather and broadcast; the reference rows
    ``torch-*`` → all-reduce, ``noop`` → nothing) over the run's link rate. The compute time is the
    ``noop`` run's mean step (same model, data, workers and batch: compute, data loading and optimizer
    without any communication), because a communicating run's own compute time includes waiting for
    the network; without a ``noop`` run it is estimated as step − compression − communication. Each
    run is checked at its own n and link rate, and carried to the setting of every other run of the
    same compressor and model (``--results DIR_N2 DIR_N4``: predicted at n = 4 from the n = 2 run and
    back). Then the same breakdown at other n and link rates ("what if I had 16 workers on
    1 Gbit/s?", ``--workers 16 --bandwidth 1gbit``). The latency α is a parameter (default
    :data:`~gradpress.costmodel.DEFAULT_LATENCY`) or fitted to the runs' exposed communication
    (step − compute − compression) by least squares (:func:`~gradpress.costmodel.fit_latency`,
    ``--latency fit``).

    How well it matches: ``gradpress compare --model mlp-wide --bandwidth 100mbit --compressors
    torch-allreduce,topk:ratio=0.01,noop`` with 2 workers (30 steps) and with 4 (20 steps), then
    ``gradpress sim cost --results DIR2 DIR4``, on a 2-core machine shared with other jobs:

    ==================================  ======  =========  ========  =======
    run                                 n       predicted  measured  error
    ==================================  ======  =========  ========  =======
    torch-allreduce (13 MB, ring)       2       1174 ms    1165 ms   +0.8 %
    torch-allreduce                     4       1648 ms    1834 ms   −10.1 %
    topk:ratio=0.01 (261 kB, gather)    2       266 ms     238 ms    +11.4 %
    topk:ratio=0.01                     4       265 ms     268 ms    −1.3 %
    torch-allreduce                     2 → 4   1696 ms    1834 ms   −7.5 %
    topk:ratio=0.01                     2 → 4   307 ms     268 ms    +14.6 %
    ==================================  ======  =========  ========  =======

    So within about ±15 %, mostly under-predicting the communication-bound step: the all-reduce's
    measured communication is 7–11 % above the α–β figure, about half of it the TCP/IP and Ethernet
    headers that tc's rate counts and ``Packet.nbytes`` does not (≈ 4.5 % at a 1500-byte MTU), the
    rest Gloo and the 4 workers' scheduling on 2 cores. The compute-bound top-k step is as good as the
    compute time it is given: the same ``noop`` step measured 132 ms in one run and 84 ms in the
    other. α is not identifiable at this scale: ``--latency fit`` gives 0 on the 2-worker runs and
    21.7 ms with the 4-worker ones, where it only soaks up the all-reduce's shortfall (all-reduce
    errors −3 % … +5 %) and overcharges the all-gather (top-k +20 % … +39 %); keep the default α here.

    **Several nodes** (``--nodes N``, ``--local-size k``, ``--intra-bandwidth``;
    :mod:`gradpress.costmodel.nodes`): every run predicted on N nodes of k ranks (k: the run's own ranks
    a node, 1 for a run on one node), a link of the run's rate per node and ``--intra-bandwidth``
    inside it, flat and in two levels (``SPEC@node``) side by side, with the bytes per step through a
    node's link. A rank's packet bytes and compression are the run's in proportion to what it
    compresses (all of its gradient flat, 1/k in two levels); the two-level rows also need the
    uncompressed gradient's bytes, which a run does not record: those of a ``torch-allreduce`` or
    ``none`` run of the same model, else a two-level run's own bytes inside its node
    (:func:`~gradpress.testbed.sim.cost.raw_bytes`). A run measured on several nodes is checked on its
    own nodes, flat or in two levels as it ran (:func:`~gradpress.testbed.sim.cost.topology_of`); it is
    left out of ``--latency fit``.

    Known limits: the all-gather decodes n packets, so its decompression time grows with n, but a run
    records compression and decompression as one time, which the prediction keeps fixed at other n
    (an underestimate for all-gather methods at large n); bytes are those on the link by the rule
    ``advise`` prices with (:func:`~gradpress.testbed.sim.cost.link_phases`: an all-reduce's summands
    widened for n workers' sums, so THC's 4-bit packet counts twice, as 8-bit table sums), not TCP/IP
    headers; the links are the runs' own, with the token bucket of their tbf
    (:func:`~gradpress.testbed.sim.cost.burst_of`, :mod:`~gradpress.costmodel`); the table above
    predates both.

The package holds one mode each: :mod:`~gradpress.testbed.sim.aggregate` (``nmse``),
:mod:`~gradpress.testbed.sim.quality` (``quality``), :mod:`~gradpress.testbed.sim.cost` (``cost``), their
shared pieces in :mod:`~gradpress.testbed.sim.common`, and the command line in
:mod:`~gradpress.testbed.sim.command`. Every name is importable from the package.
"""
from __future__ import annotations

from gradpress.testbed.sim.aggregate import (
    DEFAULT_WORKERS,
    DISTRIBUTIONS,
    ROUNDING,
    NMSEPoint,
    exact_mean,
    loglog_slope,
    nmse,
    nmse_vs_workers,
    plot_nmse,
    render_nmse,
    worker_vectors,
)
from gradpress.testbed.sim.command import add_parser
from gradpress.testbed.sim.common import Progress
from gradpress.testbed.sim.cost import (
    REFERENCE_STRATEGIES,
    Check,
    Crossover,
    Prediction,
    UnknownGradientSize,
    burst_of,
    check_runs,
    compute_time,
    cross_checks,
    crossovers,
    fit_run_latency,
    kinds,
    link_phases,
    load_results,
    predict,
    raw_bytes,
    render_checks,
    render_crossovers,
    render_what_if,
    strategy_of,
    topology_of,
    two_level,
    what_if,
)
from gradpress.testbed.sim.quality import (
    QualityPoint,
    plot_quality,
    render_quality,
    train_simulated,
)

__all__ = ["Check", "Crossover", "DEFAULT_WORKERS", "DISTRIBUTIONS", "NMSEPoint", "Prediction", "Progress",
           "QualityPoint", "REFERENCE_STRATEGIES", "ROUNDING", "UnknownGradientSize", "add_parser", "burst_of",
           "check_runs", "compute_time", "cross_checks", "crossovers", "exact_mean", "fit_run_latency", "kinds",
           "link_phases", "load_results", "loglog_slope", "nmse", "nmse_vs_workers", "plot_nmse", "plot_quality",
           "predict", "raw_bytes", "render_checks", "render_crossovers", "render_nmse", "render_quality",
           "render_what_if", "strategy_of", "topology_of", "train_simulated", "two_level", "what_if",
           "worker_vectors"]
