"""DeepSpeed's ``deepspeed.runtime.zero.tiling``: a linear layer cut into a grid of smaller linears.

``TiledLinear(in_features, out_features, in_splits=I, out_splits=O)`` holds ``O x I`` linear tiles:
tile ``[o][i]`` maps input columns ``in_parts[i]:in_parts[i+1]`` to output rows
``out_parts[o]:out_parts[o+1]`` (near-equal runs, :func:`deepspeed.runtime.utils.partition_uniform`).
Output part ``o`` is the sum of its row of tiles over the input parts; the parts are concatenated.
Only the last tile of each row carries a bias, so the layer computes exactly ``x @ W.T + b``.
Under ZeRO-3 each tile is its own module, so a forward gathers one tile's weights at a time instead
of the whole matrix.
"""
from __future__ import annotations

import torch

from ..utils import partition_uniform


def split_tensor_along_last_dim(tensor: torch.Tensor, partitions, contiguous_split_chunks: bool = False):
    """``tensor`` split along its last dimension into pieces of the sizes in ``partitions``."""
    pieces = torch.split(tensor, list(partitions), dim=-1)
    return tuple(p.contiguous() for p in pieces) if contiguous_split_chunks else pieces


class TiledLinear(torch.nn.Module):
    """A ``linear_cls(in_features, out_features, bias)`` computed as ``out_splits x in_splits`` tiles.

    ``input_is_already_split``: forward takes the list of ``in_splits`` input parts instead of one tensor.
    ``combine_out_splits``: False returns the list of output parts instead of their concatenation.
    ``init_linear``: a layer of the full shape whose weights (and bias) are copied into the tiles.
    ``kwargs`` go to ``linear_cls``. Split counts outside ``[1, features]`` raise a ``RuntimeError``."""

    def __init__(self, in_features, out_features, bias=True, in_splits=1, out_splits=1,
                 input_is_already_split=False, combine_out_splits=True, linear_cls=torch.nn.Linear,
                 init_linear=None, **kwargs):
        super().__init__()
        if not 1 <= in_splits <= in_features:
            raise RuntimeError(f"TiledLinear: in splits must be in range [1, in_features={in_features}], "
                               f"got {in_splits}")
        if not 1 <= out_splits <= out_features:
            raise RuntimeError(f"TiledLinear: out splits must be in range [1, out_features={out_features}], "
                               f"got {out_splits}")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split, self.combine_out_splits = input_is_already_split, combine_out_splits
        self.in_parts = partition_uniform(num_items=in_features, num_parts=in_splits)
        self.out_parts = partition_uniform(num_items=out_features, num_parts=out_splits)
        self.linears = torch.nn.ModuleList()
        for o in range(out_splits):
            rows = self.out_parts[o + 1] - self.out_parts[o]
            self.linears.append(torch.nn.ModuleList(
                linear_cls(self.in_parts[i + 1] - self.in_parts[i], rows, bias=bias if i == in_splits - 1 else False,
                           **kwargs)
                for i in range(in_splits)))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_):
        if self.in_splits == 1:
            inputs = [input_]
        elif self.input_is_already_split:
            inputs = input_
            if len(inputs) != self.in_splits:
                raise ValueError(f"TiledLinear: {len(inputs)} input parts given, in_splits is {self.in_splits}")
        else:
            bounds = partition_uniform(input_.shape[-1], self.in_splits)
            inputs = self._split_global_input(input_, [bounds[p + 1] - bounds[p] for p in range(self.in_splits)])
        outputs = []
        for o in range(self.out_splits):
            acc = None
            for i in range(self.in_splits):
                acc = self._reduce_local_output(i, o, acc, self.linears[o][i](inputs[i]))
            outputs.append(acc)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input, split_sizes):
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        """Add one tile's output into its row's running sum (the first one is copied)."""
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs):
        assert len(outputs) == self.out_splits
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other) -> None:
        """Copy a full-shape linear's weight (and bias) into the tiles (under ZeRO-3 a collective:
        rank 0's values are kept, as with ``GatheredParameters(modifier_rank=0)``)."""
        from .partition_parameters import GatheredParameters
        if tuple(other.weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"TiledLinear.copy_params_from: weight shape {tuple(other.weight.shape)} != "
                             f"{(self.out_features, self.in_features)}")
        if self.use_bias and (getattr(other, "bias", None) is None or tuple(other.bias.shape) != (self.out_features,)):
            raise ValueError(f"TiledLinear.copy_params_from: a bias of shape ({self.out_features},) is needed")
        if not self.use_bias and getattr(other, "bias", None) is not None:
            raise ValueError("TiledLinear.copy_params_from: this layer has no bias, the source has one")
        for o in range(self.out_splits):
            r0, r1 = self.out_parts[o], self.out_parts[o + 1]
            for i in range(self.in_splits):
                tile = self.linears[o][i]
                with GatheredParameters(tile.weight, modifier_rank=0):
                    tile.weight.copy_(other.weight[r0:r1, self.in_parts[i]:self.in_parts[i + 1]])
                if tile.bias is not None:
                    with GatheredParameters(tile.bias, modifier_rank=0):
                        tile.bias.copy_(other.bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """For ``linear_cls`` layers that return ``(output, bias)`` (Megatron-LM style): outputs are summed
    and concatenated as above, and the returned biases (the last tile of each row) concatenated."""

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        if not (isinstance(new_out, tuple) and len(new_out) == 2):
            raise TypeError("TiledLinearReturnBias: each tile must return (output, bias)")
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        tensor, bias = new_out
        tensor = super()._reduce_local_output(in_id, out_id, old_tensor, tensor)
        return tensor, (bias if bias is not None else old_bias)

    def _combine_output_splits(self, outputs):
        tensor = super()._combine_output_splits([o[0] for o in outputs])
        biases = [o[1] for o in outputs if o[1] is not None]
        return tensor, (torch.cat(biases, dim=-1) if biases else None)


__all__ = ["TiledLinear", "TiledLinearReturnBias", "split_tensor_along_last_dim"]
