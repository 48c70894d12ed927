"""A DDP bucket's exchange formed once, where every step is one in-place all-reduce of the bucket
divided by n (:class:`FlatAllReduce`, planned by :meth:`gradpress.exchange.pipeline.Pipeline.flat_allreduce`)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from gradpress.core.compressor import NonFiniteError, divide_counting_nonfinite
from gradpress.core.packet import Packet
from gradpress.exchange.protocol import AllReduce, Round, flagged_ranks, raise_flagged
from gradpress.exchange.steps import named

if TYPE_CHECKING:
    from gradpress.exchange.pipeline import Pipeline


class FlatAllReduce:
    """A DDP bucket's exchange formed once (:meth:`Pipeline.flat_allreduce`): each step divides the bucket
    by n in place in the pass that checks it (a rank whose gradient holds NaN/Inf sends zeros with a NaN
    at its own position, as :mod:`gradpress.exchange.strategy.allreduce` carries the flag), all-reduces it in
    place, reads the n flags and decodes the sum (``none``'s :meth:`~gradpress.core.compressor.Compressor.
    decode_sum`: the mean as summed, checked for overflow over three or more workers) — the steps of
    :meth:`Pipeline._protocol` for this case, the same bits, statistics and errors, without forming the
    per-step keys, groups, contexts, packets and protocol around them (about 0.4 ms of Python per bucket,
    which a small model's step feels: the hook's own cost)."""

    def __init__(self, pipeline: Pipeline, keys: tuple[str, ...], flat: torch.Tensor) -> None:
        self.pipeline, self.keys, self.flat = pipeline, keys, flat
        self.pointer, self.nbytes = flat.data_ptr(), flat.numel() * flat.element_size()
        self.packet = Packet({"values": flat}, flat.shape, flat.dtype, meta={"divided": pipeline.world_size})

    def fits(self, bucket: torch.Tensor) -> bool:
        """Whether ``bucket`` is the buffer this plan was formed for (DDP keeps a bucket's buffer)."""
        return bucket.data_ptr() == self.pointer and bucket.numel() == self.flat.numel() and bucket.dtype == self.flat.dtype

    def start(self, driver: Any, then: Any) -> torch.futures.Future:
        """Start this step's exchange on ``driver``; a future of ``then(the bucket's mean)``."""
        p, flat, n = self.pipeline, self.flat, self.pipeline.world_size
        steps = p.steps
        step = max(steps.get(key, 0) for key in self.keys)
        for key in self.keys:
            steps[key] = steps.get(key, 0) + 1
        started = time.perf_counter()
        faulty = divide_counting_nonfinite(flat, n) > 0
        if faulty:  # the step's packet is of zeros; the flag travels as a NaN at this rank's position
            flat.zero_()
            flat[p.rank] = float("nan")
        p.stats.add(step, compress_s=time.perf_counter() - started, raw_bytes=self.nbytes, packet_bytes=self.nbytes)

        def finish(results: list) -> Any:
            (summed,) = results
            try:
                raise_flagged(flagged_ranks(summed[:n], "nan"))
            except NonFiniteError as error:
                raise named(error, self.keys) from None
            with p.stats.timer(step, "decompress_s"):
                return then(p.strategy.compressor.decode_sum(self.packet, [summed], n))

        return driver.start_round(Round([AllReduce(flat)], final=True), step, finish)
