"""``auto``: the job measures itself and picks a method per bucket.

GRACE's lesson (Xu et al., Section 6) is that no compressor wins everywhere: whether one pays off
depends on the model, the network and the compression overhead. ``gradpress advise`` answers that before
a run, on this machine; ``gradpress.register(model, "auto")`` (or ``ddp_comm_hook("auto")``,
``Communicator("auto")``) answers it inside the run, with the run's own link, compute and gradients:

1. **Measure** (``settle_steps`` steps, then ``measure_steps`` steps, by default steps 2 to 6, all exchanged
   with ``measure_with``, PowerSGD at rank 4 by default, so that a slow link pays the measurement little;
   the last measured step also all-reduces an eighth of each bucket's values uncompressed, a probe whose
   time tells the link's sustained rate, which packets within a token bucket's burst do not, and whose sum
   the signal fraction reads). Each bucket's layout (keys, size), when it reached the hook (seconds after
   the step's first bucket, less the hook's own time on the buckets before it), the compute between the end
   of a step's exchange and the next step's first bucket (the optimizer, the forward pass and the backward
   pass up to the first bucket), and every round of collectives: from its issue, or the end of the round
   before it (one link: rounds queue), to its arrival. The link's α (seconds per message) and β (bits/s) are
   fitted to the fastest arrival of each size (:func:`gradpress.costmodel.fit_alpha_beta`).
2. **Decide** (rank 0, at the first bucket of step ``settle_steps + measure_steps``). Each candidate's
   compress and decompress times, packet bytes and collectives on the last measured step's real bucket
   gradients, each candidate in one pass (:func:`gradpress.costmodel.measure_with_errors`), then the step
   each assignment of methods to buckets would take (:func:`gradpress.costmodel.predict_levels`: the
   bucketed α–β model of ``advise`` and ``gradpress sim cost``). With ``rank_by="quality"`` (the default) an
   assignment is ranked by its predicted time to a quality target: the step times a steps factor from each
   candidate's relative compression error ‖g − C(g)‖²/‖g‖² on each bucket's same gradients
   (:mod:`gradpress.costmodel.quality`: 1/δ, δ = 1 − error, for biased or error-feedback methods, Stich &
   Karimireddy 2019 and Karimireddy et al. 2019; 1 + ω/(1 − ρ) for unbiased methods without memory, Alistarh
   et al. 2017, ρ the gradient's signal fraction read on rank 0 from two consecutive steps' gradients and
   from its gradient of the last measured step against the ranks' exact average (the probed eighth's,
   scaled, or the whole with ``measure_with="none"``); worst-case factors, so it errs towards gentler
   methods); ``rank_by="step"`` ranks by the step alone. :func:`choose` starts from the best single method
   and improves bucket by bucket; a change must be predicted to shorten the objective by more than
   ``margin``. Rank 0 broadcasts the choice (one small collective at decision points only; a steady-state
   step pays none) and every rank follows it from this bucket on. The others wait in that broadcast while
   rank 0 measures, on the process group gradpress was given, under its own timeout: the ``timeout`` option
   bounds a wait for a peer that should be there within it, not this one-off work
   (:class:`gradpress.exchange.protocol.Round`).
3. **Re-check** every ``recheck_every`` steps: the link and compute from the latest steps' running
   records, the candidates' costs measured once (again after a resume or a change of buckets), and the
   same rule. Switches happen only there, at the same step on every rank.

**Several nodes** (:mod:`gradpress.exchange.hierarchy`'s layout: torchrun's ``LOCAL_WORLD_SIZE``, or
``hierarchy="node", local_size=k``; N > 1 nodes of k > 1 ranks): every candidate is priced flat and in two
levels (``spec@node``: reduce-scatter inside the node, the method on a 1/k shard between nodes, all-gather
inside; :mod:`gradpress.costmodel.nodes`), and each bucket runs the best of them, levels mixed per bucket.
The node link's rate is fitted to the flat rounds; the rate inside a node to the all-gathers inside the node
of the measurement steps, which alternate ``measure_with`` flat and in two levels (or the
``intra_bandwidth`` option; the residuals of both go to the chosen method). With ``hierarchy="node"`` only
two-level candidates are chosen (the measurement still alternates). The ranks' agreement covers the levels
and the layout, so ranks that see other nodes raise together. On one node (or without a layout) nothing
changes. A node size that does not divide the world raises ``ValueError`` with ``hierarchy="node"``; without
it, such a layout is ignored (one level).

On a switch a key's error-feedback residual e (what compression dropped and has not been sent yet) is
not lost: a new method with a residual memory takes e over; one without adds e to the key's gradient at
its next exchange, once, so the sum of what is sent over the steps equals the sum of the gradients.
Memories whose state is not such a residual (DGC's momentum, ScaleCom's filter) restart. Between
levels: a two-level memory holds local rank j's residual e of its node's mean shard j; between two-level
methods it moves as it is, otherwise it becomes this rank's share k·e on shard j (the node's
reduce-scatter divides by k), carried into a one-level memory or sent once; a one-level residual
entering two levels is sent once (a shard's memory holds a node's sum, which no rank has alone).

``stats()["auto"]`` says what was chosen and why (per bucket: the spec and the predicted step with it
and with the bucket uncompressed, and on several nodes its ``level`` and ``levels_s``, the predicted
step with its method flat and in two levels; ``rank_by`` and ``steps_factor``; the link's time per byte
and latency, and the rate inside a node; the compute; the step of the last decision); ``state_dict()``
keeps the choice, every method's memory and when to re-check, so a resumed run continues with the same
choice without measuring again until then.
"""
from gradpress.auto.decision import Decision, choose
from gradpress.auto.measure import fit_link, phases_of
from gradpress.auto.options import (
    AUTO,
    DECIDED,
    DEFAULT_CANDIDATES,
    FALLBACK_LATENCY,
    KEPT,
    KEPT_ARRIVALS,
    MEASURE_WITH,
    NEED_GRADIENTS,
    UNCOMPRESSED,
    AutoOptions,
    is_auto,
)
from gradpress.auto.pipeline import AutoPipeline

__all__ = ["AUTO", "UNCOMPRESSED", "MEASURE_WITH", "DEFAULT_CANDIDATES", "FALLBACK_LATENCY", "KEPT_ARRIVALS",
           "NEED_GRADIENTS", "DECIDED", "KEPT", "is_auto", "AutoOptions", "Decision", "choose", "phases_of", "fit_link",
           "AutoPipeline"]
