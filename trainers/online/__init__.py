"""The online drafter trainer: tail the feedback log, train the drafter, publish versions.

Two layers, so the same training can run as a process or inside another loop:

* `OnlineTrainer` (in-process core, `trainer.py`): `train_on_records(records)` trains on
  feedback records with replay, held-out records and stale-target handling (a `RoundStats`);
  `maybe_publish()` publishes a version only if it passes the publish gate against the served version on the
  held-out set (`dvi.feedback.verdict.compare`; a `PublishDecision`). The drift benchmark and `trainers.rl` drive it directly.
* `run_trainer(cfg)` (the `dvi train --online` process, `process.py`): a thin loop around it
  (`TrainerLoop`, `loop.py`) that tails the shards with a `FeedbackReader` cursor, honours
  `<run_dir>/trainer.pause` and SIGTERM, and checkpoints so that a killed trainer resumes
  without training a record twice or skipping one.

The parts, in the order a record meets them:

| module | job |
|---|---|
| `collate.py` | `is_heldout`, `Batch` / `build_batch` (compact `FeedbackRecord`s to tensors for the loss) |
| `screen.py` | `RecordScreen`: which records this drafter can train on; the others quarantined one by one |
| `trainables.py` | the drafter kinds (separate in the lora or full format, early_exit, eagle) behind `Trainable`; `load_drafter_for_training` |
| `trainer.py` | `OnlineTrainer`: steps, replay, the held-out set (`dvi.feedback.heldout.HeldOutSet`); `RoundStats` (one round) |
| `publishing.py` | the publish gate (`Publisher`, owned by `OnlineTrainer`, which hands it what it needs): shadow estimates, `maybe_publish` and its `PublishDecision`, what it remembers between checks, `PublishBackoff` (a publish the registry refused is retried later, never fatal) |
| `checkpoint.py` | the trainer's checkpoint (trained tensors, optimizer, counters), written atomically |
| `accel.py` | the `Accelerator` (one process group per launch, or it refuses to start) |
| `loop.py` | `TrainerLoop`: shard choice, the exactly-once flush order, pause/stop, status heartbeat |
| `process.py` | `run_trainer`: logging, threads, priority, accelerator, metrics, then the loop |

The run-dir files the trainer shares with the server, the supervisor and RL loops (pause flag,
target version, status heartbeat, checkpoint, consumed log, cursor) are `dvi.rundir.RunDir`'s.

Callers import from the module that defines a name.
"""
