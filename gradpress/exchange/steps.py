"""The steps of one group's exchange (:meth:`gradpress.exchange.pipeline.Pipeline._protocol`, GRACE
Algorithm 1 lines 4-14, THC's preliminary stage included), in the order they run:

1. :func:`compensate`: error feedback's φ = β·m + γ·g for each tensor, or its parts where the method
   forms φ in its own first pass;
2. :func:`prepare_all`: each tensor's preliminary values (methods with a preliminary exchange);
3. :func:`compress_all`: the packets, and the feedback memory's update.

A gradient holding NaN/Inf does not end this rank's part: its input becomes zeros, its feedback memory
is left as it was (:attr:`Batch.faulty`), and the exchange carries the rank's fault flag in-band. An
input whose NaN/Inf are φ's own overflow (a finite memory and gradient) is saturated instead
(:func:`saturated`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from gradpress.core.compressor import Compressor, NonFiniteError, any_nonfinite, saturate, scaled_sum
from gradpress.core.feedback import Feedback, SumParts
from gradpress.core.packet import Packet
from gradpress.core.rng import Context
from gradpress.exchange.protocol import Protocol


@dataclass
class Batch:
    """One group's tensors on their way to compression, position by position.

    ``grads``: the gradients; ``sums``: φ's parts where the method forms φ = β·m + γ·g in its first pass
    (None where the memory formed φ itself, or keeps none); ``xs``: φ (float32 where the memory keeps
    one), its ``out`` where the method forms it; ``inputs``: what is compressed (φ in the gradient's
    dtype; saturated or zeros after a fault); ``prepared``: the combined preliminary values;
    ``faulty``: some gradient held NaN/Inf (its input is zeros, and no memory is updated)."""

    keys: list[str]
    ctxs: list[Context]
    grads: list[torch.Tensor]
    sums: list[SumParts | None]
    xs: list[torch.Tensor]
    inputs: list[torch.Tensor]
    prepared: list[torch.Tensor | None]
    faulty: bool = False


def compensate(feedback: Feedback, items: Sequence[tuple[str, torch.Tensor]], steps: Sequence[int],
               seed: int, rank: int) -> Batch:
    """Step 1: each item's context and φ = β·m + γ·g (GRACE Eq. 5), formed by the compressor's first
    pass (its preliminary one, if it has one) where the memory and the method allow it."""
    keys = [key for key, _ in items]
    ctxs = [Context(seed, s, key, rank) for key, s in zip(keys, steps, strict=True)]
    grads = [grad.detach() for _, grad in items]
    sums: list[SumParts | None] = [None] * len(items)
    if feedback.updates:
        sums = [feedback.sum_parts(key, grad) for key, grad in zip(keys, grads, strict=True)]
    xs = [feedback.compensate(key, grad) if parts is None else parts.out
          for key, grad, parts in zip(keys, grads, sums, strict=True)]
    inputs = [x if x.dtype == grad.dtype else x.to(grad.dtype) for x, grad in zip(xs, grads, strict=True)]
    return Batch(keys, ctxs, grads, sums, xs, inputs, [None] * len(items))


def prepare_all(compressor: Compressor, batch: Batch, world_size: int) -> list[Any]:
    """Step 2: this worker's :class:`~gradpress.core.compressor.Preliminary` per tensor (φ formed, so
    ``batch.sums`` is emptied). An input holding NaN/Inf is saturated where φ overflowed, else
    replaced by zeros (``batch.faulty``: the preliminary exchange carries the flag)."""
    prelims = []
    for i, (x, ctx, grad, parts) in enumerate(zip(batch.inputs, batch.ctxs, batch.grads, batch.sums,
                                                  strict=True)):
        pre = _prepare(compressor, x, ctx, world_size, grad, parts)
        if pre is _FAULTY:  # the gradient's NaN/Inf, or φ's own overflow (then saturated)
            replaced = saturated(batch.xs[i], grad)
            pre = _FAULTY if replaced is None else _prepare(compressor, replaced, ctx, world_size)
            if replaced is None or pre is _FAULTY:
                batch.faulty, replaced = True, torch.zeros_like(x)
                pre = _prepare(compressor, replaced, ctx, world_size)
            batch.inputs[i] = replaced
        prelims.append(pre)
    batch.sums = [None] * len(prelims)  # φ is formed
    return prelims


def compress_all(compressor: Compressor, feedback: Feedback, batch: Batch, divided: int | None,
                 writable: bool, carried: bool) -> list[Packet]:
    """Step 3: the packets, then the feedback memory's update (none after a fault). ``divided``: the
    mean's division by n in the pass that checks the input (a bucket this may overwrite where
    ``writable``). ``carried``: the preliminary exchange carried the fault flags (a NaN/Inf not seen
    before it raises now: no flag can travel)."""
    # a method with a preliminary exchange forms the residual in φ's own storage where φ is the
    # memory's (not the gradient) and is what is compressed (no cast): THC
    fuse = feedback.updates and feedback.keeps_residual and compressor.fuses_residual
    packets, formed = [], []  # formed: out holds the residual, not φ
    for i in range(len(batch.inputs)):
        try:
            packet, done = _compress_one(compressor, feedback, batch, i, divided, writable, fuse)
        except NonFiniteError:
            if carried:  # not seen before the preliminary exchange: no flag can travel now
                raise
            packet, done = _compress_instead(compressor, batch, i, divided, writable), False
        packets.append(packet)
        formed.append(done)
    if feedback.updates and not batch.faulty:
        for key, grad, x, packet, done in zip(batch.keys, batch.grads, batch.xs, packets, formed, strict=True):
            if done:
                feedback.update_residual(key, x)
            else:
                feedback.update_from(key, x, packet, compressor, owned=x is not grad)
    return packets


def _compress_one(compressor: Compressor, feedback: Feedback, batch: Batch, i: int, divided: int | None,
                  writable: bool, fuse: bool) -> tuple[Packet, bool]:
    """The packet of the i-th input, and whether its ``out`` now holds the residual in place of φ."""
    given, x, ctx, grad, parts = batch.inputs[i], batch.xs[i], batch.ctxs[i], batch.grads[i], batch.sums[i]
    if parts is not None and feedback.keeps_residual:
        return compressor.compress_residual_sum(parts.memory, grad, parts.out, ctx, parts.beta, parts.gamma)
    if parts is not None:
        return compressor.compress_sum(parts.memory, grad, parts.out, ctx, parts.beta, parts.gamma), False
    target = x if fuse and given is x and x is not grad and x.dtype == torch.float32 else None
    return _compress(compressor, given, ctx, batch.prepared[i], divided, writable, target), False


def _compress_instead(compressor: Compressor, batch: Batch, i: int, divided: int | None,
                      writable: bool) -> Packet:
    """The packet sent in place of the i-th input's, which held NaN/Inf: φ saturated where φ overflowed
    (``out`` holds it after an error), else zeros (``batch.faulty``: a flag then travels, so no rank
    waits for this one)."""
    ctx, ready = batch.ctxs[i], batch.prepared[i]
    replaced = saturated(batch.xs[i], batch.grads[i])
    if replaced is not None:
        try:
            return _compress(compressor, replaced, ctx, ready, divided, writable)
        except NonFiniteError:
            pass
    batch.faulty = True
    return _compress(compressor, torch.zeros_like(batch.inputs[i]), ctx, ready, divided, True)


def names(keys: Sequence[str]) -> str:
    return ", ".join(repr(key) for key in keys)


def named(error: NonFiniteError, keys: Sequence[str]) -> NonFiniteError:
    """``error`` (the ranks whose gradients held NaN/Inf) naming the gradients of the exchange."""
    renamed = NonFiniteError(f"gradients {names(keys)}: {error}")
    renamed.ranks = error.ranks
    return renamed


def saturated(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """What to compress in place of φ = β·m + γ·g (``x``, formed by the feedback memory) when φ, or its
    cast to the gradient's dtype, holds NaN/Inf: None when the finite gradient is not the cause (``x``
    is the gradient itself, or the gradient holds NaN/Inf: a fault the exchange reports), else φ
    saturated. A finite memory and gradient overflow only to ±Inf, with the sign of the exact sum: ``x``
    is clamped in place to its dtype's largest finite value (what lies beyond float32's range is lost:
    the memory cannot hold it), and the input is ``x`` cast to the gradient's dtype saturating at that
    dtype's largest value; the memory's update keeps what this leaves unsent (an fp16/bf16 φ beyond the
    gradient's range stays in the float32 memory for later steps: error feedback, GRACE Eq. 5)."""
    if x is grad or any_nonfinite(grad.reshape(-1).contiguous()):
        return None
    largest = torch.finfo(x.dtype).max
    x.clamp_(-largest, largest)
    if x.dtype == grad.dtype:
        return x
    return saturate(x.reshape(-1), grad.dtype, inplace=False).to(grad.dtype).view(grad.shape)


def unexchanged(tensors: list[torch.Tensor]) -> Protocol:
    """The protocol of empty tensors: no round, their averages empty tensors like them."""
    return [torch.empty_like(t) for t in tensors]
    yield  # (a generator: a protocol that issues no round)


_FAULTY = object()


def _prepare(compressor: Compressor, x: torch.Tensor, ctx: Context, world_size: int,
             grad: torch.Tensor | None = None, parts: SumParts | None = None) -> Any:
    """This worker's :class:`~gradpress.core.compressor.Preliminary` for ``x`` (None for an empty tensor or
    a method that sends none for it), or ``_FAULTY`` when ``x`` holds NaN/Inf: found by a check pass,
    or, for a method that finds them in its own passes, in its preliminary values (a max norm, P = MQ).
    Preliminary values that are not finite although ``x`` is (PowerSGD's P of values near float32's
    largest) travel as they are: every rank then holds the combined values and the method raises its
    ``OverflowError`` (naming this worker or another) on every rank at the same point. ``parts``: x is
    ``parts.out``, where φ = β·m + γ·``grad`` is formed first — by the method's own preliminary pass
    (:meth:`~gradpress.core.compressor.Compressor.prepare_sum`) where it finds NaN/Inf itself."""
    if parts is not None and not compressor.checks_finite:
        assert grad is not None  # (the parts of φ come with its gradient)
        scaled_sum(parts.memory, grad, parts.beta, parts.gamma, x)
        parts = None
    flat = x.reshape(-1).contiguous()
    if flat.numel() == 0:
        return None
    if not compressor.checks_finite and any_nonfinite(flat):
        return _FAULTY
    if parts is None:
        pre = compressor.prepare(flat.view(x.shape), ctx, world_size)
    else:
        assert grad is not None  # (the parts of φ come with its gradient)
        pre = compressor.prepare_sum(parts.memory, grad, x, ctx, world_size, parts.beta, parts.gamma)
    if pre is None and compressor.checks_finite and any_nonfinite(flat):
        return _FAULTY  # (a tensor the method sends as it is: PowerSGD's vectors)
    if (pre is not None and pre.op != "broadcast" and pre.values.is_floating_point()
            and not bool(torch.isfinite(pre.values).all()) and any_nonfinite(flat)):
        return _FAULTY
    return pre


def _compress(compressor: Compressor, x: torch.Tensor, ctx: Context, prepared: torch.Tensor | None,
              divided: int | None = None, writable: bool = False,
              residual: torch.Tensor | None = None) -> Packet:
    if divided is not None:
        return compressor.compress_divided(x, divided, ctx, inplace=writable)
    if not compressor.prepares:
        return compressor.compress(x, ctx)
    if residual is None:  # (a method that overrides compress need not know the argument)
        return compressor.compress(x, ctx, prepared=prepared)
    return compressor.compress(x, ctx, prepared=prepared, residual=residual)
