"""Prompt logprobs: the logprob of every prompt token given the tokens before it, reduced chunk
by chunk from final hidden states so that a long prompt never holds [prompt_len, vocab] logits.

Memory per step is bounded by ``chunk_rows`` x vocab floats, whatever the prompt length.
"""

from __future__ import annotations

import torch

from engine.sequence import TokenLogprob


@torch.inference_mode()
def reduce_prompt_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: list[int], k: int,
                           chunk_rows: int = 64) -> list[TokenLogprob]:
    """``hidden`` [R, H] (after the final norm): row r predicts ``targets[r]``. Returns, per row,
    the target's raw logprob (log_softmax of the logits) and the top-``k`` alternatives."""
    out: list[TokenLogprob] = []
    tgt = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    for a in range(0, hidden.shape[0], chunk_rows):
        lp = torch.log_softmax(lm_head(hidden[a : a + chunk_rows]).float(), dim=-1)
        chosen = lp.gather(1, tgt[a : a + chunk_rows, None]).flatten().tolist()
        if k:
            tv, ti = lp.topk(k, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(ti.tolist(), tv.tolist())]
        else:
            tops = [()] * len(chosen)
        out.extend(TokenLogprob(t, c, top) for t, c, top in zip(targets[a : a + chunk_rows], chosen, tops))
    return out
