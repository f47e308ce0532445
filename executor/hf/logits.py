"""The logits of a batch under a folded layout (pp = 1, cp = 1), for comparisons with a reference model.

Training never needs them (the output layer and loss are fused, :mod:`executor.parallel.vocab`); checking a
model against ``transformers`` does. Runs the embedding, every decoder layer and the final norm as
``MoEGPT.forward_chunk`` does, then the LM head on the TP-gathered sequence and an all-gather of the
vocabulary shards: every TP rank returns the full [b, s, vocab_size] logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spec.errors import InvalidConfigError
from executor.model import MoEGPT
from executor.parallel.collectives import all_gather_nograd
from executor.parallel.tensor_parallel import enter_tp
from executor.parallel.vocab import embed


@torch.no_grad()
def model_logits(model: MoEGPT, ids_BS: torch.Tensor) -> torch.Tensor:
    """fp32 logits [b, s, vocab_size] of token ids [b, s] (the model's whole sequence length)."""
    state = model.state
    if state["pp"].size > 1 or model.vpp > 1 or state["cp"].size > 1:
        raise InvalidConfigError("model_logits runs the whole model on one pipeline stage without CP")
    s = ids_BS.shape[1]
    x = embed(ids_BS.t(), model.embedding, model.padded_vocab, state)
    rope = (model.rope_cos[:s], model.rope_sin[:s])
    for layer in model.layers:
        x, _ = layer(x, rope)
    x = enter_tp(model.kernels.rms_norm(x, model.final_norm, model.options.norm_epsilon), state)
    weight = model.lm_head if model.lm_head is not None else model.embedding
    logits = F.linear(x, weight).float()  # [s, b, V/tp]
    logits = all_gather_nograd(logits.permute(2, 0, 1), state.tp).permute(1, 2, 0)  # [s, b, V_padded]
    return logits[..., : model.spec.vocab_size].transpose(0, 1).contiguous()
