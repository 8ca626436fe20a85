"""The digest of a model's weights: what the calibration caches are keyed by and what a cluster worker checks its
own copy of the model against (one module that both the stage and the cluster read)."""

from __future__ import annotations

import torch
from torch import nn


def weights_hash(model: nn.Module) -> str:
    """BLAKE3 of every parameter's and buffer's name, shape, dtype and bytes.

    >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> _ = b.load_state_dict(a.state_dict())
    >>> weights_hash(a) == weights_hash(b), len(weights_hash(a))
    (True, 64)
    """
    from blake3 import blake3

    h = blake3()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        c = t.detach().contiguous().cpu()
        h.update(f"{name}:{tuple(c.shape)}:{c.dtype};".encode())
        if c.numel():
            h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
