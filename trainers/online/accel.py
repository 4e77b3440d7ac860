"""The trainer's `Accelerator`: one process group per launch, on the configured device."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dvi.config import DviConfig

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["make_accelerator"]


def make_accelerator(cfg: DviConfig) -> Accelerator:
    """The `Accelerator` of the configured device (`models.device`, "auto" resolved as the models
    resolve it). Under `accelerate launch` / torchrun every rank must join one process group: a
    CPU-only machine with `device: auto` used to leave each rank alone, and every rank then trained,
    committed and published every record as if it were the only one.

    Autocast stays off: accelerate keeps one process-wide state, and a trainer created earlier in the
    process (TRL's GRPOConfig defaults to bf16) would otherwise make this one train under bf16 autocast
    silently. The drafter trains in its own dtype, whoever else shares the process."""
    from accelerate import Accelerator
    from accelerate.utils import AutocastKwargs

    from dvi.models.loading import resolve_device

    accelerator = Accelerator(cpu=resolve_device(cfg.models.device).type == "cpu",
                              kwargs_handlers=[AutocastKwargs(enabled=False)])
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if accelerator.num_processes != world:
        raise RuntimeError(f"launched as {world} processes but accelerate formed a group of "
                           f"{accelerator.num_processes} ({accelerator.distributed_type}); refusing to train twice")
    return accelerator
