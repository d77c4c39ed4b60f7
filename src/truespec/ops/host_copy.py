"""Step metadata from host lists to the device: one asynchronous copy, views that Triton takes as aligned.

A copy from pageable host memory waits for everything queued on the GPU before it, so a step's metadata goes
through pinned memory without a wait (``to_device_async``). Triton compiles a kernel apart for a pointer that is not
16-byte aligned, so int64 segments packed into one buffer each take an even number of elements
(``aligned_spans``): otherwise a step of another token or request count would compile kernels again mid-run.
"""

import torch


def to_device_async(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """int64 ``values`` (a list, or a host tensor as is) on ``device`` in one host-to-device copy that does not wait
    for the device (pinned memory on CUDA), queued in stream order."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def aligned_spans(lengths: list[int]) -> list[int]:
    """The room each int64 segment of ``lengths`` takes in a packed buffer: its length rounded up to an even count,
    so that every segment starts 16-byte aligned."""
    return [n + n % 2 for n in lengths]


def columns_to_device(columns: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 ``columns`` on ``device`` in one ``to_device_async`` copy, as views each starting 16-byte aligned."""
    spans = aligned_spans([len(c) for c in columns])
    values = [x for c, span in zip(columns, spans, strict=True) for x in c + [0] * (span - len(c))]
    parts = to_device_async(values, device).split(spans)
    return [part[:len(c)] for part, c in zip(parts, columns, strict=True)]
