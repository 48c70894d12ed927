"""``gradpress advise``: which compression method pays off for this model on that network, in a minute.

GRACE's lesson (Xu et al., Section 6) is that no compressor wins everywhere: whether one pays off
depends on the model, the network and the compression overhead, so profile first. ``advise`` profiles
on this machine, without training across processes, and prices every candidate with the α–β model of
:mod:`gradpress.costmodel` (the model ``gradpress sim cost`` checks against ``compare``'s runs):

**Compute** (:func:`profile_compute`). The model is wrapped in a real
:class:`~torch.nn.parallel.DistributedDataParallel` over a one-process Gloo group with a hook that returns
each bucket as it is (the testbed's ``noop`` row: no communication), and trained on the workload's
batches (``--batch-size`` per worker, ``--threads`` torch threads as each testbed worker has) for
``--repeats`` timed steps after two warm-up steps: the medians of the forward pass, of ``backward()``
and of the optimizer step are the compute of a step. The hook records when DDP hands it each bucket:
the bucket's *ready time* into the backward pass, and, from its parameters, **DDP's bucket layout** —
after DDP's rebuild at the second step, which orders parameters by when their gradients became
ready and caps buckets at 1 MiB (the first) and ``--bucket-cap-mb`` (25 MB). Why a real DDP rather than
a replica of its rule: the rebuilt order follows the autograd graph, not ``parameters()``, and the caps
and rules are whatever the installed PyTorch does; ``torch.distributed._compute_bucket_assignment_by_size``
is a private binding whose signature has changed between versions. Where no such group can be made (a
process group already exists, Gloo is missing, DDP refuses the model) the layout is replicated instead
(:func:`assign_buckets`: gradient-ready order from per-parameter hooks, the same caps), and the output
says so.

**Each candidate** (:func:`measure_method`). The runtime's own pipeline, :class:`gradpress.Simulator`
with 2 workers (1 if ``--workers 1``) and the method's default error-feedback memory, exchanges the real
gradients of two of the profiled batches (one per simulated worker), bucket by bucket in DDP's order,
for ``--repeats`` steps after a warm-up step (memory carried over, as in training); worker 0's
statistics give each bucket's median **compress** time (feedback, preliminary values, compression,
feedback update), **decompress** time (decoding and averaging) and ``Packet.nbytes``. Decoding an
all-gather handles one packet per worker, so its time is scaled by n / 2 (an all-reduce decodes one sum
whatever n). The **bytes each rank sends** per bucket are the strategy's collectives: the summands of
an all-reduce (integers widened to hold n workers' sums, as the strategy widens them — THC's 4-bit
indices travel as 8-bit table values), the packed packets of an all-gather (after a sizes header
where packet sizes vary), and a preliminary exchange (THC's norm, PowerSGD's P, CLT-k's leader indices)
before it; they are priced among n workers by :data:`~gradpress.costmodel.STRATEGIES` (ring
all-reduce, ring all-gather, binomial broadcast). The reference row ``torch-allreduce`` (DDP's own hook)
compresses nothing and all-reduces each bucket's fp32 bytes; every speed-up is relative to it.

**Prediction** (:func:`predict`, :func:`rank`): :func:`~gradpress.costmodel.predict_bucketed_step`
— compression on the backward thread as the hook runs it, each bucket's exchange starting when its hook
returns and the link is free, decoding when it arrives, ``backward()`` returning when both the
gradients and the last decoding are done — at every ``--bandwidth`` for ``--workers`` n (1–1024) and
latency α per message, through links with a token bucket of ``--burst`` bytes (tc tbf's) and
``--efficiency`` per collective where given (:mod:`~gradpress.costmodel`). :func:`rank` is a pure function of the profile and the candidates' measured
per-bucket costs (``auto`` can call it with costs measured in a running job). Where a method stops
paying is :func:`~gradpress.costmodel.bandwidth_crossing` of the same model against
``torch-allreduce``.

**Several nodes** (``--nodes N``, ``--local-size k``, ``--intra-bandwidth``): the n = N·k workers on N
nodes of k ranks, a link of ``--bandwidth`` per node and a faster rate inside it
(:mod:`gradpress.costmodel.nodes`); every candidate is ranked flat and in two levels (``SPEC@node``,
``hierarchy="node"``: each rank compresses 1/k of a bucket, priced in proportion, and the bucket's bytes
cross inside the node; :func:`variants`), ``torch-allreduce`` flat, with the bytes per step through a
node's link.

**Quality** (``--quality-steps K``, :func:`quality_curve`). Each candidate, and ``none`` (the exact mean,
what ``torch-allreduce`` computes), trains the model for K steps of synchronous SGD with
``--quality-workers`` simulated workers (default min(n, 4)) on the testbed's real data
(``gradpress sim quality``'s loop), or on the user's ``--batch`` factory; quality is evaluated at about ten
checkpoints. The target is ``none``'s best quality minus the report's tolerance (1 point of accuracy or
hit rate, 5 of perplexity; 1 % of the loss for a factory model's held-out loss), as ``compare``'s report
sets it; a method's *steps to target* is the first crossing of its curve, interpolated between
checkpoints. The ranking is then by predicted **time to target** = steps to target × predicted step
time; a method that does not reach it in K steps is ranked after those that do.

**Workers sharing a machine** (``--local-workers K``, :func:`measure_local_steps`). What is measured above
runs alone on an idle core; ``compare``'s workers, and any job with several workers per machine, share the
cores, caches and memory bandwidth, and the hook adds work of its own (threads, hand-offs) that the
Simulator does not. With K ≥ 2, each candidate, ``torch-allreduce`` and ``noop`` also train a few steps in
a real DDP among K processes of this machine over loopback, timed as ``compare`` times its steps, and
:func:`calibrated` prices each method with its own local step: the compute and the sum of compression and
decoding as measured there (the profile's and the buckets' proportions kept), and the rest of the local
step outside compute, compression and the loopback's collectives added once per step; only the link is
modelled.

The checks against measurement (``gradpress compare`` on the emulated network beside ``advise`` with the
same link) are commands in the README.

The package holds one part each: :mod:`~gradpress.testbed.advise.workload` (what is profiled: a testbed
model or a factory), :mod:`~gradpress.testbed.advise.profile` (compute and DDP's buckets),
:mod:`~gradpress.testbed.advise.local` (real steps among local workers),
:mod:`~gradpress.testbed.advise.ranking` (prediction, ranking, crossings),
:mod:`~gradpress.testbed.advise.quality` (quality runs, steps to target),
:mod:`~gradpress.testbed.advise.advice` (the whole advice), :mod:`~gradpress.testbed.advise.output` (table,
JSON, plot), :mod:`~gradpress.testbed.advise.check` (``--check``) and
:mod:`~gradpress.testbed.advise.command` (the command line). Every name is importable from the package.
"""
from __future__ import annotations

from gradpress.costmodel import (
    BASELINE,
    FIRST_BUCKET_BYTES,
    Bucket,
    BucketCost,
    ComputeProfile,
    LocalStep,
    MethodCost,
    Transfer,
    assign_buckets,
    baseline_cost,
    calibrated,
    link_phases,
    measure_method,
    predict,
    transfers_of,
)
from gradpress.testbed.advise.advice import (
    DEMO,
    RATIO_VARIANTS,
    Advice,
    Progress,
    advise,
    candidates,
    default_candidates,
)
from gradpress.testbed.advise.check import (
    Checked,
    RunsLink,
    check_against,
    link_from_runs,
    render_checks,
    runs_link,
    scaled,
    scaled_cost,
)
from gradpress.testbed.advise.command import DEFAULT_BANDWIDTHS, add_parser
from gradpress.testbed.advise.local import measure_local_steps
from gradpress.testbed.advise.output import (
    NEAR,
    PLOTTED,
    PLOT_RANGE,
    describe_profile,
    plot,
    render,
    summary_lines,
    to_json,
)
from gradpress.testbed.advise.profile import profile_compute
from gradpress.testbed.advise.quality import (
    QUALITY_REFERENCE,
    QualityCurve,
    checkpoints,
    default_tolerance,
    quality_curve,
    quality_target,
    steps_to_reach,
)
from gradpress.testbed.advise.ranking import (
    CROSSING_RANGE,
    NODE,
    Ranked,
    crossover,
    rank,
    register_line,
    spec_of,
    speedup_at,
    variants,
)
from gradpress.testbed.advise.workload import (
    Workload,
    factory_workload,
    is_factory,
    load_object,
    testbed_workload,
)

__all__ = ["Advice", "BASELINE", "Bucket", "BucketCost", "CROSSING_RANGE", "Checked", "ComputeProfile",
           "DEFAULT_BANDWIDTHS", "DEMO", "FIRST_BUCKET_BYTES", "LocalStep", "MethodCost", "NEAR", "NODE",
           "PLOTTED", "PLOT_RANGE", "Progress", "QUALITY_REFERENCE", "QualityCurve", "RATIO_VARIANTS", "Ranked",
           "RunsLink", "Transfer", "Workload", "add_parser", "advise", "assign_buckets", "baseline_cost",
           "calibrated", "candidates", "check_against", "checkpoints", "crossover", "default_candidates",
           "default_tolerance", "describe_profile", "factory_workload", "is_factory", "link_from_runs",
           "link_phases", "load_object", "measure_local_steps", "measure_method", "plot", "predict",
           "profile_compute", "quality_curve", "quality_target", "rank", "register_line", "render",
           "render_checks", "runs_link", "scaled", "scaled_cost", "spec_of", "speedup_at", "steps_to_reach",
           "summary_lines", "testbed_workload", "to_json", "transfers_of", "variants"]
