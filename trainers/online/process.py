"""`run_trainer(cfg)`: the `dvi train --online` process set-up around `TrainerLoop`.

Its own module so what is process-wide (logging, torch threads, CPU priority, seed, the
accelerator, the metrics logger) is set in one place and never by the library parts.

CPU: the process uses `trainer.num_threads` torch threads and lowers its priority by
`trainer.nice`, so on a shared machine the server's engine thread wins any contended core.
Accelerate: one process on CPU; under `accelerate launch`, one per rank (DDP averages gradients).
Losses and α go to `<run_dir>/trainer/metrics.jsonl` and wandb.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from dvi import metrics as M
from dvi.config import DviConfig, dump_config
from dvi.memory import cap_onednn_cache
from dvi.rundir import RunDir
from trainers.online.loop import TrainerLoop
from trainers.online.trainer import OnlineTrainer, make_accelerator

log = logging.getLogger("dvi.trainer")


def run_trainer(cfg: DviConfig) -> int:
    """`dvi train --online`: the trainer process. Returns the exit code (0 on SIGTERM)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(cfg.trainer.num_threads)
    cap_onednn_cache(cfg.serve.onednn_primitive_cache)  # before any forward (a server's trainer inherits its cap)
    if cfg.trainer.nice and hasattr(os, "nice"):
        try:
            os.nice(cfg.trainer.nice)  # serving never waits on training: lose every contended core to it
        except OSError:
            log.warning("cannot lower the trainer's CPU priority")
    from accelerate.utils import set_seed

    set_seed(cfg.trainer.seed)
    accelerator = make_accelerator(cfg)
    if not accelerator.is_main_process:
        logging.getLogger().setLevel(logging.WARNING)  # rank 0 reports the rounds; the others would repeat them
    rundir = RunDir.of(cfg).make()
    metrics = None
    if accelerator.is_main_process:
        metrics = M.MetricsLogger(rundir.trainer_dir, wandb_mode=cfg.wandb.mode, project=cfg.wandb.project,
                                  entity=cfg.wandb.entity, config=dump_config(cfg),
                                  name=f"trainer-{int(time.time())}", access=cfg.files.access,
                                  rotation=rundir.rotation)
    try:
        trainer = OnlineTrainer.from_config(cfg, accelerator=accelerator, metrics=metrics)
        return TrainerLoop(trainer, cfg).run()
    finally:
        if metrics is not None:
            metrics.close()

