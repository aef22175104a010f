"""P-EAGLE drafter training library: model, COD sampling, data, hidden states, trainer, evaluation, export."""

import os as _os

# Torch's CPU allocator asks for transparent huge pages for buffers of 2 MB and more when this is set before
# its first allocation (read once per process). Without them a training step's large buffers (the 113 MB
# embedding gradient) are page-faulted in 4 KB at a time each step: SmolLM2's step on real rows went from
# 1.05 to 0.92 s, and its peak RSS down (docs/decisions.md). `THP_MEM_ALLOC_ENABLE=0` opts out.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
