"""Which copy backend the worker uses, and the CUDA events that order stores after compute.

The Rust engine copies on its own low-priority CUDA stream. A store reads GPU blocks that
vLLM's forward pass (on PyTorch's current stream) may still be writing, so every CUDA
store carries an event recorded on that stream: the engine's stream waits for it
(``cuStreamWaitEvent``) before copying. PyTorch's ``torch.cuda.Event`` exposes the raw
``cudaEvent_t`` as ``event.cuda_event`` (an int; ``THCPEvent_get_cuda_event`` in
``torch/csrc/cuda/Event.cpp``), which is the same handle as the driver's ``CUevent``.

Two rules for callers:

- Record the event *after* the work the store must follow has been enqueued on the
  current stream (the event captures the stream's work at ``record()`` time).
- Keep the ``torch.cuda.Event`` object alive until the store's completion arrives:
  dropping it destroys the CUDA event, and the engine may not have enqueued its wait yet.

torch is imported lazily: importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Literal

if TYPE_CHECKING:
    import torch

#: The transfer engine's backend names (``TransferEngine(backend=...)``).
Backend = Literal["host", "cuda"]
HOST: Final = "host"
CUDA: Final = "cuda"


def engine_backend(kv_caches: dict[str, Any]) -> tuple[Backend, int]:
    """``("cuda", device ordinal)`` when the registered KV tensors live on a CUDA device,
    else ``("host", 0)``.

    ``kv_caches`` maps layer names to tensors (or lists of tensors), as vLLM passes them to
    ``register_kv_caches``. All tensors of one worker live on one device; the first decides.
    """
    for value in kv_caches.values():
        tensors = value if isinstance(value, (list, tuple)) else [value]
        for tensor in tensors:
            if not tensor.is_cuda:
                return HOST, 0
            index = tensor.device.index
            if index is None:  # pragma: no cover - vLLM always allocates on an indexed device
                import torch

                index = torch.cuda.current_device()
            return CUDA, int(index)
    return HOST, 0


def record_compute_event() -> tuple[torch.cuda.Event, int]:
    """Records an event on the current CUDA stream; returns it and its raw handle.

    Pass the handle as ``wait_event`` to ``TransferEngine.submit`` and keep the returned
    event referenced until that transfer completes. The event is created without timing
    (``cudaEventDisableTiming``), the cheapest kind.
    """
    import torch

    event = torch.cuda.Event(enable_timing=False)
    event.record()  # on torch.cuda.current_stream(): where the forward pass runs
    handle = int(event.cuda_event)
    if handle == 0:  # pragma: no cover - record() always creates the event
        raise RuntimeError("torch.cuda.Event.record() did not create a CUDA event")
    return event, handle
