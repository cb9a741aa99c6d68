"""Matrix-vector kernels for decoding on a CPU: `Linear`, a drop-in `nn.Linear` that model.py uses.

Decoding multiplies a handful of token vectors by each weight matrix, so a step should cost about
as much as reading the weights once, whatever the handful. PyTorch's stock CPU GEMM (MKL) does not
manage that on an AVX2 machine. Measured on 2 AMD EPYC cores (docs/constants.md):
- 1 row (vanilla decoding): W split into blocks of `BLOCK_ROWS` rows (a free view), all multiplied by
  x in one `torch.bmm`, keeping each block in cache: 30 layers' matrices in 17 ms (F.linear: 28 ms);
- 2-`MAX_PACKED_ROWS` rows (a tree of guesses): oneDNN's GEMM on a copy of W re-laid out once for it
  (`mkldnn._reorder_linear_weight`; made by `prepare_tree_kernels` or on first use): 30 ms for 8 rows,
  44 for 16 (blocked bmm: 37 / 48; F.linear: 46 / 58). In the whole model this beat blocked bmm
  already at 2-4 rows (a step over 2 tokens: 50 vs 62 ms). It costs a second copy of the weights.
Prefill, other dtypes, GPUs, CPUs without oneDNN and inputs that need gradients use F.linear, so the
result is the same computation either way; only its speed differs.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """y = x W^T, with the kernel picked by how many rows x has (see the module docstring)."""

    BLOCK_ROWS = 64
    MAX_BLOCKED_ROWS = 1
    MAX_PACKED_ROWS = 64

    def forward(self, x):
        rows = x.numel() // x.shape[-1]
        if (x.device.type != "cpu" or x.dtype != torch.float32 or rows > self.MAX_PACKED_ROWS
                or x.requires_grad):  # training (train_prompt.py) needs kernels autograd knows
            return F.linear(x, self.weight)
        if rows <= self.MAX_BLOCKED_ROWS and self.weight.shape[0] % self.BLOCK_ROWS == 0:
            return self.blocked_matmul(x, rows)
        packed = self.onednn_weight()
        if packed is None:
            return F.linear(x, self.weight)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, -1), packed, None, "none", [], "")
        return y.view(*x.shape[:-1], -1)

    def blocked_matmul(self, x, rows):
        out_features, in_features = self.weight.shape
        blocks = self.weight.view(-1, self.BLOCK_ROWS, in_features)  # [O/64, 64, I]
        x_columns = x.reshape(rows, in_features).T.expand(len(blocks), in_features, rows)
        y = torch.bmm(blocks, x_columns)  # [O/64, 64, rows]
        return y.view(out_features, rows).T.reshape(*x.shape[:-1], out_features)

    def onednn_weight(self):
        """W re-laid out for oneDNN, made once and remade if W changes (None without oneDNN)."""
        if not torch.backends.mkldnn.is_available():
            return None
        weight = self.weight
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version)  # inference tensors
        # (loaded under torch.inference_mode) cannot change in place, so they need no version
        if getattr(self, "_onednn_key", None) != key:
            self._onednn_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
            self._onednn_key = key
        return self._onednn_weight


def prepare_tree_kernels(model) -> None:
    """Lay out a float32 CPU model's weights for multi-row matmuls now rather than on the first tree
    pass (about half a second for the default model), so that pass's timing is not skewed."""
    if model.device.type == "cpu" and model.dtype == torch.float32:
        for module in model.modules():
            if isinstance(module, Linear):
                module.onednn_weight()
