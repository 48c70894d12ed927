"""``auto``: the job measures itself and picks a method per bucket.

GRACE's lesson (Xu et al., Section 6) is that no compressor wins everywhere: whether one pays off
depends on the model, the network and the compression overhead. ``gradpress advise`` answers that before
a run, on this machine; ``gradpress.register(model, "auto")`` (or ``ddp_comm_hook("auto")``,
``Communicator("auto")``) answers it inside the run, with the run's own link, compute and gradients:

1. **Measure** (``settle_steps`` steps, then ``measure_steps`` steps, exchanged uncompressed with
   ``none``). Each bucket's layout (keys, size), when it reached the hook (seconds after the step's first
   bucket, less the hook's own time on the buckets before it), the compute between the end of a step's
   exchange and the next step's first bucket (the optimizer, the forward pass and the backward pass up to
   the first bucket), and every round of collectives: from its issue, or the end of the round before it
   (one link: rounds queue), to its arrival. The link's α (seconds per message) and β (bits/s) are fitted
   to the fastest arrival of each size (:func:`gradpress.costmodel.fit_alpha_beta`).
2. **Decide** (rank 0, at the first bucket of step ``settle_steps + measure_steps``). Each candidate's
   compress and decompress times, packet bytes and collectives on the last measured step's real bucket
   gradients (:func:`gradpress.costmodel.measure_method`), then the step each assignment of methods
   to buckets would take (:func:`gradpress.costmodel.predict`: the bucketed α–β model of ``advise``
   and ``gradpress sim cost``). :func:`choose` starts from the best single method and improves bucket by
   bucket; a change must be predicted to shorten the step by more than ``margin``. Rank 0 broadcasts
   the choice (one small collective at decision points only; a steady-state step pays none) and every
   rank follows it from this bucket on. The others wait in that broadcast while rank 0 measures, on the
   process group gradpress was given, under its own timeout: the ``timeout`` option bounds a wait for
   a peer that should be there within it, not this one-off work (:class:`gradpress.exchange.protocol.Round`).
3. **Re-check** every ``recheck_every`` steps: the link and compute from the latest steps' running
   records, the candidates' costs measured once (again after a resume or a change of buckets), and the
   same rule. Switches happen only there, at the same step on every rank.

On a switch a key's error-feedback residual e (what compression dropped and has not been sent yet) is
not lost: a new method with a residual memory takes e over; one without adds e to the key's gradient at
its next exchange, once, so the sum of what is sent over the steps equals the sum of the gradients.
Memories whose state is not such a residual (DGC's momentum, ScaleCom's filter) restart.

``stats()["auto"]`` says what was chosen and why (per bucket: the spec and the predicted step with it
and with the bucket uncompressed; the link's time per byte and latency; the compute; the step of the
last decision); ``state_dict()`` keeps the choice, every method's memory and when to re-check, so a
resumed run continues with the same choice without measuring again until then.
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
    NEED_GRADIENTS,
    UNCOMPRESSED,
    AutoOptions,
    is_auto,
)
from gradpress.auto.pipeline import AutoPipeline

__all__ = ["AUTO", "UNCOMPRESSED", "DEFAULT_CANDIDATES", "FALLBACK_LATENCY", "KEPT_ARRIVALS", "NEED_GRADIENTS",
           "DECIDED", "KEPT", "is_auto", "AutoOptions", "Decision", "choose", "phases_of", "fit_link",
           "AutoPipeline"]
