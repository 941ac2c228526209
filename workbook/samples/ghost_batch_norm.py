"""Ghost batch norm: batch statistics over virtual batches of a fixed size, so the batch size
behind the statistics can be studied apart from the batch size of an update."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class GhostBatchNorm(nn.BatchNorm1d):
    """BatchNorm1d whose training statistics come from virtual batches of
    `virtual_batch_size` examples.

    - batch == virtual size: identical to nn.BatchNorm1d;
    - batch larger: split into chunks of the virtual size, each normalised with its own
      statistics; a last chunk of a single example joins the chunk before it (one example has
      no variance). Running statistics are updated once per chunk, with the module's momentum;
    - batch smaller: one chunk, statistics over the examples there are (fewer than planned);
    - eval: the running statistics, exactly as nn.BatchNorm1d.
    """

    def __init__(self, num_features: int, virtual_batch_size: int, **kwargs):
        super().__init__(num_features, **kwargs)
        if virtual_batch_size < 2:
            raise ValueError("virtual_batch_size must be at least 2 (one example has no "
                             "variance)")
        self.virtual_batch_size = virtual_batch_size

    def chunk_sizes(self, n: int) -> list[int]:
        v = self.virtual_batch_size
        sizes = [v] * (n // v) + ([n % v] if n % v else [])
        if len(sizes) > 1 and sizes[-1] == 1:
            sizes[-2:] = [sizes[-2] + 1]
        return sizes

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or x.shape[0] <= self.virtual_batch_size:
            return super().forward(x)
        return torch.cat([super(GhostBatchNorm, self).forward(c) for c in
                          x.split(self.chunk_sizes(x.shape[0]))])
