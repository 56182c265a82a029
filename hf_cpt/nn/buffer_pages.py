"""When the quantized layers' reused buffers leave memory (docs/method.md §2, "Reused buffers").

The reused CPU buffers (`hf_cpt.numerics.scratch`) serve the quantized layers' products alone, yet they stay
mapped for the whole run. A backward pass goes on after its last quantized layer: a language model's embedding
gradients (vocabulary-sized) come there, then the optimizer step, and a training step's peak falls in one of those
two (docs/benchmarks.md, peak phases). So once a pass's last quantized backward has run, the buffers' pages go back
to the system, and the next forward writes them in again. Which layer runs last is learnt from the pass before (a
model's graph repeats from step to step); the end of each pass hands back whatever the guess missed.
"""

from __future__ import annotations

import threading

import torch

from ..numerics import scratch

_pass = threading.local()  # this thread's backward pass: its task, its latest quantized layer, the previous pass's last


def backward_starts() -> None:
    """Called by each quantized layer's backward on the CPU: at a pass's first, queue the hand-back at its end."""
    task = getattr(torch._C, "_current_graph_task_id", lambda: -1)()
    if task < 0 or getattr(_pass, "task", None) == task:  # outside an engine's pass, or queued already
        return
    _pass.task, _pass.latest = task, None
    state, hand_back = _pass.__dict__, scratch.hand_back_later()

    def pass_ended() -> None:
        state["last"] = state["latest"]
        hand_back()

    torch.autograd.Variable._execution_engine.queue_callback(pass_ended)


def backward_ended(layer: torch.nn.Module) -> None:
    """Called when ``layer``'s backward is done: if it ran last in the previous pass, hand the buffers back now."""
    if getattr(_pass, "task", None) is None:
        return
    _pass.latest = id(layer)
    if getattr(_pass, "last", None) == id(layer):
        scratch.hand_back_later()()
