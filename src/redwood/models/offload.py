"""Layer offloading: decoder-layer weights live in host memory and stream to the device just in time.

`offload_layers(model, device, prefetch)` moves every `DecoderLayer`'s weights (its seven projections,
their biases and its two norms) into one flat host buffer per layer — page-locked (pinned) when the
device is a CUDA GPU, so that host-to-device copies run asynchronously by DMA. Everything else stays on
the device: embeddings, the final norm, the LM head, the rotary tables and the KV cache.

**Host RAM.** The host must hold all layer weights in the model dtype, pinned: about 2 bytes per
parameter in float16 / bfloat16 (a 70B model: about 140 GB of page-locked RAM, which the OS cannot
swap), 4 in float32. While the buffers are filled, the loaded weights are released layer by layer, so
loading needs about one extra layer on top of that. **Device memory**: the embeddings, norm and LM head,
the KV cache, and `prefetch` layer-sized buffers.

**Ring.** The device holds a ring of `prefetch` slots, each one flat buffer the size of one layer with
a view per parameter (allocated once: no allocation per step). Layers are copied into the slots in
forward order, cyclically (after the last layer come the first ones of the next forward), so while
layer i computes, layers i+1 … i+prefetch-1 are already being copied. Forward pre/post hooks on each
`DecoderLayer` point the layer's parameters (`param.data = view`) at its slot's views for its forward
only; at every other time they point at the layer's host buffer (so `state_dict()` still returns the
weights, on the host).

**Ordering, with CUDA events (never a device-wide synchronize).** Copies run on a side stream with
`non_blocking=True`:
- the copy into a slot waits (on the GPU) for `compute_done[slot]`, recorded on the compute stream
  after the layer that last read that slot;
- a layer's compute waits (on the GPU) for `copy_done[slot]`, recorded on the copy stream after its
  copy.
The host never blocks: the whole forward is queued ahead of the GPU as usual.

On the CPU the same code runs with no-op stand-ins for streams and events (every copy and kernel has
finished when its call returns): the "device" slots are ordinary tensors and copies are plain `copy_`,
which keeps the ring and prefetch logic under test on machines with no GPU.

If the layers run out of order (a forward that raised midway, a layer called on its own), the ring
restarts from the layer asked for. `restore_layers(model)` makes the model resident again.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from redwood.errors import ConfigError
from redwood.models.transformer import OFFLOAD_ATTR, Transformer

_ALIGN_BYTES = 256  # each parameter's view starts on this boundary inside a flat buffer
_ATTR = OFFLOAD_ATTR


# ---------------------------------------------------------------------------------------------- sync


class _NullEvent:
    """A CPU stand-in for `torch.cuda.Event`: the work before it is always complete."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _NullStream:
    """A CPU stand-in for `torch.cuda.Stream`: work runs when it is issued, so waits are no-ops."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Sync:
    """Streams and events of one device: CUDA's, or the no-op stand-ins on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def new_stream(self):
        return torch.cuda.Stream(device=self.device) if self.cuda else _NullStream()

    def new_event(self):
        return torch.cuda.Event() if self.cuda else _NullEvent()

    def current_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else _NullStream()

    def on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------- manager


@dataclass(frozen=True)
class _Entry:
    name: str  # e.g. "self_attn.q_proj.weight"
    shape: tuple[int, ...]
    offset: int  # in elements, into the flat buffer
    numel: int


@dataclass
class OffloadStats:
    copies: int = 0  # host-to-device layer copies issued
    skipped: int = 0  # copies not needed: the slot already held that layer (prefetch >= layers)
    bytes: int = 0  # bytes copied host-to-device
    restarts: int = 0  # the layers ran out of order and the ring restarted
    trace: list | None = field(default=None, repr=False)  # ("copy"|"compute"|"release", layer, slot)


class OffloadManager:
    """The host buffers, the device ring and the hooks of one offloaded model (see the module doc).

    State worth inspecting: `slots` (the ring: `num_slots` flat device buffers), `slot_layer[s]` (the
    layer last copied into slot s, or None), `queue` (layers copied or being copied, not yet computed,
    in forward order, with their slots), `active` ((layer, slot) while a layer computes, else None),
    `host[i]` (layer i's flat host buffer), `stats`.
    """

    def __init__(self, model: Transformer, device: torch.device, prefetch: int, trace: bool = False):
        self.device = device
        self.sync = _Sync(device)
        self.layers: list[nn.Module] = list(model.layers)
        self.num_layers = len(self.layers)
        self.num_slots = min(prefetch, self.num_layers)
        self.stats = OffloadStats(trace=[] if trace else None)

        # One layout for every layer (they are identical), parameters in registration order.
        first = list(self.layers[0].named_parameters())
        self.dtype = first[0][1].dtype
        align = max(1, _ALIGN_BYTES // first[0][1].element_size())
        entries, offset = [], 0
        for name, p in first:
            entries.append(_Entry(name, tuple(p.shape), offset, p.numel()))
            offset += -(-p.numel() // align) * align
        self.layout: tuple[_Entry, ...] = tuple(entries)
        self.layer_numel = offset
        self.params: list[list[nn.Parameter]] = []
        for i, layer in enumerate(self.layers):
            named = list(layer.named_parameters())
            got = [(n, tuple(p.shape), p.dtype) for n, p in named]
            want = [(e.name, e.shape, self.dtype) for e in self.layout]
            if got != want:
                raise ConfigError(f"cannot offload: decoder layer {i} differs from layer 0 in its parameters")
            self.params.append([p for _, p in named])

        pin = self.sync.cuda
        self.copy_stream = self.sync.new_stream()
        self._registered: list[torch.Tensor] = []  # host buffers pinned by cudaHostRegister
        self._finalizer = weakref.finalize(self, _unregister, self._registered, self.copy_stream)
        with torch.inference_mode(False), torch.no_grad():
            # Layer weights → flat host buffers; each parameter is released as soon as it is copied.
            self.host: list[torch.Tensor] = []
            self.host_views: list[list[torch.Tensor]] = []
            for i, layer in enumerate(self.layers):
                buf = self._host_buffer(pin)
                views = self._views(buf)
                for p, v in zip(self.params[i], views):
                    v.copy_(p.data)
                    p.data = v
                for b in layer.buffers():  # none in today's DecoderLayer; small if any: keep resident
                    b.data = b.data.to(device)
                self.host.append(buf)
                self.host_views.append(views)
            self.slots = [torch.empty(self.layer_numel, dtype=self.dtype, device=device) for _ in range(self.num_slots)]
            self.slot_views = [self._views(s) for s in self.slots]

        self.copy_done = [self.sync.new_event() for _ in range(self.num_slots)]
        self.compute_done = [self.sync.new_event() for _ in range(self.num_slots)]
        self.slot_layer: list[int | None] = [None] * self.num_slots
        self.queue: deque[tuple[int, int]] = deque()
        self.active: tuple[int, int] | None = None
        self.next_layer = 0
        self.layer_bytes = self.layer_numel * self.slots[0].element_size()

        self.handles = []
        for i, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre_hook(i), prepend=True))
            self.handles.append(layer.register_forward_hook(self._post_hook(i), always_call=True))
        for s in range(self.num_slots):  # the first layers of the first forward
            self._issue(s)

    def _host_buffer(self, pin: bool) -> torch.Tensor:
        """One layer's flat host buffer. Pinned by registering ordinary memory with CUDA: the caching
        pinned allocator (`pin_memory=True`) rounds every block up to a power of two, which could
        nearly double the host RAM needed; it is the fallback where registration fails."""
        buf = torch.empty(self.layer_numel, dtype=self.dtype, device="cpu")
        if not pin:
            return buf
        cudart = torch.cuda.cudart()
        if cudart.cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0) == cudart.cudaError.success:
            self._registered.append(buf)
            return buf
        return torch.empty(self.layer_numel, dtype=self.dtype, device="cpu", pin_memory=True)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.layout]

    # ------------------------------------------------------------------ schedule
    def _issue(self, s: int) -> None:
        """Copy the next layer (in cyclic forward order) into slot s, once its last reader is done."""
        j = self.next_layer
        self.next_layer = (j + 1) % self.num_layers
        if self.slot_layer[s] == j:
            self.stats.skipped += 1  # already there (host weights never change)
        else:
            with self.sync.on(self.copy_stream), torch.inference_mode(False), torch.no_grad():
                self.copy_stream.wait_event(self.compute_done[s])
                self.slots[s].copy_(self.host[j], non_blocking=True)
                self.copy_done[s].record(self.copy_stream)
            self.slot_layer[s] = j
            self.stats.copies += 1
            self.stats.bytes += self.layer_bytes
            if self.stats.trace is not None:
                self.stats.trace.append(("copy", j, s))
        self.queue.append((j, s))

    def _restart(self, i: int) -> None:
        """The layers ran out of order: drop the queue and refill the ring starting at layer i."""
        self.stats.restarts += 1
        if self.active is not None:
            self._release(*self.active)
        stream = self.sync.current_stream()
        for ev in self.compute_done:  # whatever the compute stream did with a slot finishes first
            ev.record(stream)
        self.queue.clear()
        self.next_layer = i
        for s in range(self.num_slots):
            self._issue(s)

    def _release(self, i: int, s: int) -> None:
        for p, h in zip(self.params[i], self.host_views[i]):
            p.data = h
        self.active = None
        if self.stats.trace is not None:
            self.stats.trace.append(("release", i, s))

    def _pre_hook(self, i: int):
        def hook(module, args):
            if self.active is not None or not self.queue or self.queue[0][0] != i:
                self._restart(i)
            _, s = self.queue.popleft()
            self.sync.current_stream().wait_event(self.copy_done[s])
            for p, v in zip(self.params[i], self.slot_views[s]):
                p.data = v
            self.active = (i, s)
            if self.stats.trace is not None:
                self.stats.trace.append(("compute", i, s))

        return hook

    def _post_hook(self, i: int):
        def hook(module, args, output):
            if self.active is None or self.active[0] != i:
                return  # not ours to finish (the pre-hook did not run for this call)
            _, s = self.active
            self.compute_done[s].record(self.sync.current_stream())
            self._release(i, s)
            self._issue(s)

        return hook

    # ------------------------------------------------------------------ inspection / undo
    def layers_on_device(self) -> list[int]:
        """Layers whose parameters point into the ring right now (one while it computes, else none)."""
        ptrs = {s.untyped_storage().data_ptr() for s in self.slots}
        return [i for i, ps in enumerate(self.params) if any(p.untyped_storage().data_ptr() in ptrs for p in ps)]

    def remove(self) -> None:
        """Remove the hooks and give each layer resident parameters on the device again."""
        for h in self.handles:
            h.remove()
        self.handles = []
        self.sync.current_stream().wait_stream(self.copy_stream)  # no copy still writes a freed slot
        with torch.inference_mode(False), torch.no_grad():
            for ps, hs in zip(self.params, self.host_views):
                for p, h in zip(ps, hs):
                    p.data = h.to(self.device, copy=True)
        self.active = None
        self.queue.clear()
        self.slots, self.slot_views, self.host, self.host_views = [], [], [], []
        self._finalizer()  # unregister the host buffers; they are freed once nothing refers to them


def _unregister(buffers: list[torch.Tensor], copy_stream) -> None:
    """Unpin host buffers registered with cudaHostRegister (holding them alive until now), once the
    copies still reading them are done (teardown only: it waits on the copy stream)."""
    if buffers and torch.cuda.is_initialized():
        copy_stream.synchronize()
        cudart = torch.cuda.cudart()
        for buf in buffers:
            cudart.cudaHostUnregister(buf.data_ptr())
    buffers.clear()


def check_prefetch(prefetch) -> int:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ConfigError(f"offload prefetch must be an integer >= 1 (layers in the device ring), got {prefetch!r}")
    return prefetch


def offload_layers(
    model: Transformer, device: torch.device | str | None = None, prefetch: int = 2, trace: bool = False
) -> OffloadManager:
    """Keep `model`'s decoder-layer weights in host memory and stream them to `device` layer by layer.

    device: the compute device (default: where the embeddings are). The embeddings, final norm, LM
    head and rotary tables are moved there; the layers' weights go to (pinned, on CUDA) host buffers.
    prefetch: the ring's depth, in layers (>= 1; capped at the number of layers): at most this many
    layers are on the device at a time, and copies run up to prefetch - 1 layers ahead of compute.
    trace: record ("copy"/"compute"/"release", layer, slot) in `manager.stats.trace` (for tests).

    Host RAM needed: all layer weights in the model dtype, page-locked on CUDA — about 2 bytes per
    parameter in 16-bit dtypes (≈ 140 GB for a 70B model), 4 in float32. Device memory: embeddings,
    norm, LM head, the KV cache and `prefetch` layers. Returns the manager (also `get_offload(model)`).
    """
    from redwood.devices import parse_device

    check_prefetch(prefetch)
    if get_offload(model) is not None:
        raise ConfigError("this model's layers are already offloaded")
    dev = parse_device(model.device if device is None else device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with torch.inference_mode(False), torch.no_grad():
        for child in model.children():
            if child is not model.layers:
                child.to(dev)
    manager = OffloadManager(model, dev, prefetch, trace=trace)
    object.__setattr__(model, _ATTR, manager)  # a plain attribute, not a submodule
    if getattr(model.backend, "megakernel", None) is not None:  # it reads resident weights (megakernel.misfit says why)
        model.backend.set_megakernel(None)
    return manager


def get_offload(model: Transformer) -> OffloadManager | None:
    """The model's OffloadManager, or None when its layers are resident."""
    return getattr(model, _ATTR, None)


def restore_layers(model: Transformer) -> None:
    """Undo `offload_layers`: every layer's weights resident on the compute device again, no hooks."""
    manager = get_offload(model)
    if manager is None:
        return
    manager.remove()
    object.__delattr__(model, _ATTR)
