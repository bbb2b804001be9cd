"""Per-layer readiness of onloads: the events compute waits on before it reads a layer's pages.

An onload copies a user's pages layer by layer on the onload stream and records one event after
each layer. Onloads are issued in order on that one stream, so the latest event of layer `l`
covers layer `l` of every onload before it: compute waits for that event alone before layer `l`
reads or appends its pages, and layer 0 starts while the later layers are still copying. The
host memory an onload reads is busy until its last event. No-ops on devices other than CUDA,
where copies are done when issued.
"""
from __future__ import annotations

import torch


class OnloadEvents:
    """The latest onload event of each layer, and which of them compute has not waited for yet."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._unwaited: list[torch.cuda.Event | None] = [None] * num_layers
        self._last: torch.cuda.Event | None = None  # the latest onload's last event: its host memory is busy

    @property
    def last(self) -> torch.cuda.Event | None:
        """The event after the latest onload's last layer (None when none is running)."""
        return self._last

    def record(self, layer: int, stream: torch.cuda.Stream) -> None:
        """Layer `layer` of the onload just issued on `stream` is ready once `stream` gets here."""
        if not self._cuda:
            return
        event = torch.cuda.Event()
        event.record(stream)
        self._unwaited[layer] = event
        self._last = event

    def wait_for_layer(self, layer: int) -> None:
        """Make the current stream wait (on the device) for layer `layer` of the onloads issued so far.

        Not while capturing a CUDA graph: a graph replay waits for every layer before it starts.
        """
        event = self._unwaited[layer]
        if event is not None and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self._device).wait_event(event)
            if self._unwaited[layer] is event:  # not replaced by an onload issued meanwhile
                self._unwaited[layer] = None

    def wait_for_all(self) -> None:
        """Make the current stream wait for every layer of the onloads issued so far."""
        for layer in range(len(self._unwaited)):
            self.wait_for_layer(layer)

    def unwaited_layers(self) -> list[int]:
        """Layers with an onload event the compute stream has not waited for (introspection, tests)."""
        return [layer for layer, event in enumerate(self._unwaited) if event is not None]

    def synchronize(self) -> None:
        """Block the host until the onloads issued so far have read their host memory."""
        if self._last is not None:
            self._last.synchronize()
            self._last = None
