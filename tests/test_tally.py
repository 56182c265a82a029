"""`Tally`: counts added in eager and compiled forwards, no recompilation as the count grows."""

import torch

from hf_cpt.nn.tally import Tally


def test_a_tally_counts_eager_and_compiled_additions_and_drains_to_zero():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    tally = Tally()

    def forward(x: torch.Tensor) -> torch.Tensor:
        tally.add(x.numel())
        return x * 2

    compiled = torch.compile(forward, backend="eager")
    for n in (3, 3, 3):
        compiled(torch.ones(n))
    forward(torch.ones(5))
    assert counters["frames"]["total"] == 1, dict(counters["frames"])  # the growing count is no guard
    assert tally.count == 14
    assert tally.drain() == 14 and tally.count == 0
    compiled(torch.ones(3))
    assert tally.drain() == 3
    torch._dynamo.reset()
