"""A captured graph's per-step inputs: one static device buffer of packed metadata (input_builder.py), cut into
views per padded size once, and refilled before each replay through pinned host buffers used in turn (the host
reuses one only after its copy has left it, so it may queue up to ``num_staging`` steps ahead of the device without
waiting). Shared by the full graphs (graph_runner.py) and the piecewise ones (piecewise_graphs.py)."""

import torch

from truespec.worker.input_builder import ContextRow, StepInputs, build_step, packed_size, split_packed


class StaticInputs:
    def __init__(self, sizes: list[int], width: int, block_size: int, device: torch.device, num_staging: int,
                 num_reqs: int | None = None) -> None:  # fmt: skip
        """``sizes``: the padded token counts; a step of size S has S request rows, or ``num_reqs`` for every size;
        ``width``: block-table columns; ``num_staging`` 0: plain copies (no pinned memory, e.g. on CPU)."""
        self.width, self.block_size, self.device, self.num_reqs = width, block_size, device, num_reqs
        top = max(sizes)
        length = packed_size(top, num_reqs or top, width)
        self.buffer = torch.zeros(length, dtype=torch.int64, device=device)
        self.views = {size: split_packed(self.buffer, size, num_reqs or size, width) for size in sizes}
        self._staging = [torch.zeros(length, dtype=torch.int64, pin_memory=True) for _ in range(num_staging)]
        self._copy_done = [torch.cuda.Event() for _ in range(num_staging)]
        self._turn = 0

    def build(self, rows: list[ContextRow], input_ids: list[int], positions: list[int], size: int,
              staged: bool = True) -> StepInputs:  # fmt: skip
        """The step's inputs in the views of ``size``, copied through the next staging buffer (``staged``) or
        synchronously (a capture's inputs)."""
        if not (staged and self._staging):
            return self._build(rows, input_ids, positions, size, None)
        turn, self._turn = self._turn, (self._turn + 1) % len(self._staging)
        self._copy_done[turn].synchronize()  # this staging buffer's last copy has left it
        inputs = self._build(rows, input_ids, positions, size, self._staging[turn])
        self._copy_done[turn].record()
        return inputs

    def _build(self, rows: list[ContextRow], input_ids: list[int], positions: list[int], size: int,
               staging: torch.Tensor | None) -> StepInputs:  # fmt: skip
        return build_step(rows, input_ids, positions, self.block_size, self.device, pad_to=size, width=self.width,
                          out=self.buffer, staging=staging, views=self.views[size], pad_reqs_to=self.num_reqs)
