"""DeepSpeed's ``deepspeed.runtime.sparse_tensor.SparseTensor``: a row-sparse 2-D tensor (the gradient
of an ``nn.Embedding`` / ``nn.EmbeddingBag`` built with ``sparse=True``) held as the indices of its
non-zero rows and those rows' values - the form in which such gradients are exchanged between ranks
(each rank contributes its rows; the receiver concatenates them, and rows named twice add up).
"""
from __future__ import annotations

import torch


class SparseTensor:
    """Row-sparse view of a 2-D tensor: ``indices`` (1-D, one row index per entry), ``values``
    (``len(indices)`` x row width) and ``dense_size``. Built from a sparse COO tensor (its rows, after
    coalescing) or from a dense one (its rows holding any non-zero). An index may appear more than once
    after :meth:`add`; :meth:`to_dense` sums such rows."""

    def __init__(self, dense_tensor: torch.Tensor = None):
        self.orig_dense_tensor = dense_tensor
        self.indices = self.values = self.dense_size = None
        if dense_tensor is None:
            return
        if dense_tensor.dim() != 2:
            raise ValueError(f"SparseTensor holds 2-D (row-sparse) tensors, got shape {tuple(dense_tensor.shape)}")
        self.is_sparse = dense_tensor.is_sparse
        self.dtype = dense_tensor.dtype
        if dense_tensor.is_sparse:
            coalesced = dense_tensor.coalesce()
            if coalesced.sparse_dim() != 1:
                raise ValueError("SparseTensor: a sparse COO tensor must be sparse in its rows only "
                                 f"(sparse_dim 1, as an embedding gradient is), got sparse_dim {coalesced.sparse_dim()}")
            self.indices = coalesced.indices().reshape(-1)
            self.values = coalesced.values()
        else:
            self.indices = (dense_tensor != 0).any(dim=1).nonzero().reshape(-1)
            self.values = dense_tensor[self.indices]
        self.dense_size = list(dense_tensor.shape)

    @staticmethod
    def type() -> str:
        return "deepspeed.SparseTensor"

    def to_coo_tensor(self) -> torch.Tensor:
        """A ``torch.sparse_coo_tensor`` of the dense size (rows named twice are summed when coalesced)."""
        return torch.sparse_coo_tensor(self.indices.unsqueeze(0), self.values, self.dense_size)

    def to_dense(self) -> torch.Tensor:
        return self.values.new_zeros(self.dense_size).index_add_(0, self.indices, self.values)

    def sparse_size(self):
        """(elements held: indices + values, elements of the dense tensor)."""
        held = self.indices.numel() + self.values.numel()
        return held, self.dense_size[0] * self.dense_size[1]

    def add(self, b: "SparseTensor") -> None:
        """Add ``b`` in place (its rows are appended; the dense view sums them)."""
        if self.dense_size != b.dense_size:
            raise ValueError(f"SparseTensor.add: dense sizes differ ({self.dense_size} vs {b.dense_size})")
        self.indices = torch.cat([self.indices, b.indices])
        self.values = torch.cat([self.values, b.values])

    def __str__(self) -> str:
        held, dense = self.sparse_size()
        return (f"DeepSpeed.SparseTensor(indices_size={tuple(self.indices.shape)}, values_size="
                f"{tuple(self.values.shape)}, dense_size={self.dense_size}, device={self.indices.device}, "
                f"reduction_factor={dense / max(held, 1)})")

    __repr__ = __str__


__all__ = ["SparseTensor"]
