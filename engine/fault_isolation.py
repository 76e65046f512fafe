"""Keeping one request's failure out of everybody else's engine step.

The engine batches many requests into one forward and one sampling call, so one request whose
logits or parameters break the math (a NaN softmax, a kernel error on its block table) would
otherwise raise out of ``LLMEngine.step`` and end the step for every request in the batch.
These helpers retry a failed batched call one request at a time, so the failing request(s) can
be identified and failed alone while the others get their results. The retry costs time only
on the error path; on the normal path each helper is one batched call.

Invariant: a helper returns one entry per input, a result or the exception of that request
alone. When every request of a step fails alone, the engine itself may be broken rather than
one request: ``LLMEngine.step`` counts such steps and raises after a few in a row, which ends
the engine loop (see ``engine.async_engine``: the worker then reports itself unhealthy).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from engine.step_interrupt import StepInterrupted

log = logging.getLogger(__name__)


def forward_isolating(forward: Callable[[list], torch.Tensor], chunks: list, wants: Sequence[bool]
                      ) -> list[torch.Tensor | BaseException | None]:
    """Per chunk: its logits row (when it wants one, else None) or the exception of its own
    forward. ``forward(chunks)`` returns one logits row per chunk that wants one, in order.

    One batched call normally; if it raises, each chunk runs alone (rewriting a chunk's KV
    slots is idempotent: the same tokens at the same positions). ``StepInterrupted`` is not a
    failure and propagates."""
    try:
        logits = forward(chunks)
    except StepInterrupted:
        raise  # not a failure: the engine abandons the step (engine/step_interrupt.py)
    except Exception as batch_error:  # noqa: BLE001 - find whose chunk broke it
        log.warning("batched forward of %d chunks failed (%s): retrying one by one", len(chunks),
                    type(batch_error).__name__)
        out: list[torch.Tensor | BaseException | None] = []
        for chunk, want in zip(chunks, wants):
            try:
                row = forward([chunk])
                out.append(row[0] if want else None)
            except StepInterrupted:
                raise
            except Exception as e:  # noqa: BLE001 - this request's own failure
                out.append(e)
        return out
    rows = iter(logits)
    return [next(rows) if want else None for want in wants]
