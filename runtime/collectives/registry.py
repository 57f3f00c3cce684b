"""The runtime's implementations of the collectives' variants, per instruction kind and variant
(instruction_set.kinds): each family module (gather.py, scatter.py) registers its variants;
the autograd pairing of a collective with its adjoint (adjoint.py) and SFB look them up here."""

from __future__ import annotations

from typing import Callable

import torch

from hetsynth.instruction_set.kinds import Implementations
from hetsynth.runtime.collectives.span import Span

Impl = Callable[[torch.Tensor, Span], torch.Tensor]
COLLECTIVE_VARIANTS: Implementations[Impl] = Implementations("collective implementation")
