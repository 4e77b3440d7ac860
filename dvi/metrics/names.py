"""The metric-name catalogue: the ONE place every dvi metric name, label and spec lives.

Names follow vLLM's spec-decode counters with a `dvi_` prefix, and the four counters that mean
what vLLM's mean are also exported under vLLM v1's own names (`VLLM_METRICS`:
`vllm:spec_decode_num_drafts_total`, ..., labelled by `model_name` only, as vLLM labels them), so
a dashboard built for vLLM reads a dvi server unchanged. Use the constants below everywhere (server, trainer, benchmarks) so a figure
has one name on /metrics, in wandb and in `metrics.jsonl`. The other `dvi.metrics` modules
(stats, prometheus, logger, reporting) only import names from here; none defines its own.
"""

from __future__ import annotations

from dataclasses import dataclass

# -- names ------------------------------------------------------------------------------------
NUM_DRAFTS = "dvi_spec_decode_num_drafts_total"
NUM_DRAFT_TOKENS = "dvi_spec_decode_num_draft_tokens_total"
NUM_ACCEPTED_TOKENS = "dvi_spec_decode_num_accepted_tokens_total"
NUM_ACCEPTED_PER_POS = "dvi_spec_decode_num_accepted_tokens_per_pos_total"
NUM_DRAFTED_PER_POS = "dvi_spec_decode_num_drafted_tokens_per_pos_total"
NUM_ACCEPTED_PER_RANK = "dvi_spec_decode_num_accepted_tokens_per_rank_total"
ACCEPTANCE_RATE = "dvi_spec_decode_acceptance_rate"
MEAN_ACCEPTED_LENGTH = "dvi_spec_decode_mean_accepted_length"
ACCEPTANCE_RATE_PER_POS = "dvi_spec_decode_acceptance_rate_per_pos"
GENERATION_TOKENS = "dvi_generation_tokens_total"
REQUESTS = "dvi_requests_total"
TOKENS_PER_SECOND = "dvi_tokens_per_second"
REQUEST_LATENCY = "dvi_request_latency_seconds"
TIME_TO_FIRST_TOKEN = "dvi_time_to_first_token_seconds"
REQUEST_ACCEPTANCE = "dvi_request_acceptance_rate"
LOW_ACCEPTANCE_REQUESTS = "dvi_requests_low_acceptance_total"
QUEUE_DEPTH = "dvi_queue_depth"
ENGINE_STEPS = "dvi_engine_steps_total"
ENGINE_BUSY_SECONDS = "dvi_engine_busy_seconds_total"
DRAFTER_VERSION = "dvi_drafter_version"
DRAFTER_ADAPTER_VERSION = "dvi_drafter_adapter_version"
TARGET_VERSION = "dvi_target_version"
TRAINER_STATE = "dvi_trainer_state"
DRAFTER_PROMOTIONS = "dvi_drafter_promotions_total"
DRAFTER_REFUSALS = "dvi_drafter_refusals_total"
DRAFTER_ROLLBACKS = "dvi_drafter_rollbacks_total"
DRAFTER_PUBLISH_TO_VERDICT = "dvi_drafter_publish_to_verdict_seconds"
DRAFTER_GATE_GROUPS = "dvi_drafter_gate_groups"
DRAFTER_HELDOUT_RECORDS = "dvi_drafter_heldout_records"
DRAFTER_HELDOUT_UNFIT = "dvi_drafter_heldout_unfit_records"
TRAINER_LOSS = "dvi_trainer_loss"
TRAINER_KL_LOSS = "dvi_trainer_kl_loss"
TRAINER_REWARD_LOSS = "dvi_trainer_reward_loss"
TRAINER_REWARD_WEIGHT = "dvi_trainer_reward_weight"
TRAINER_STEP = "dvi_trainer_step"
TRAINER_RECORDS_SEEN = "dvi_trainer_records_seen"
TRAINER_HELDOUT_ALPHA = "dvi_trainer_heldout_alpha"
TRAINER_LOST_SHARDS = "dvi_trainer_feedback_shards_lost"
TRAINER_RESTARTS = "dvi_trainer_restarts"
REQUESTS_REJECTED = "dvi_requests_rejected_total"
FEEDBACK_WRITE_ERRORS = "dvi_feedback_write_errors_total"
FEEDBACK_DROPPED_RECORDS = "dvi_feedback_dropped_records_total"
FEEDBACK_PENDING_RECORDS = "dvi_feedback_pending_records"
FEEDBACK_FAILING = "dvi_feedback_failing"
FEEDBACK_RECLAIMED_SHARDS = "dvi_feedback_reclaimed_shards_total"
TRAINER_HEARTBEAT_AGE = "dvi_trainer_heartbeat_age_seconds"
TRAINER_STALE_RESTARTS = "dvi_trainer_stale_restarts_total"
TRAINER_QUARANTINED_SHARDS = "dvi_trainer_feedback_shards_quarantined"
TRAINER_SKIPPED_SHARDS = "dvi_trainer_feedback_shards_skipped"
TRAINER_QUARANTINED_RECORDS = "dvi_trainer_feedback_records_quarantined"
TRAINER_PUBLISH_FAILURES = "dvi_trainer_publish_failures"
DISK_BYTES = "dvi_disk_bytes"
HTTP_REQUEST_TIMEOUTS = "dvi_http_request_timeouts_total"
REQUESTS_CUT = "dvi_requests_cut_at_shutdown_total"
# sampled by benchmarks (`benchmarks/soak.py`) from /proc, not exported on /metrics
SERVER_RSS_BYTES = "dvi_server_rss_bytes"
TRAINER_RSS_BYTES = "dvi_trainer_rss_bytes"
SOURCE_DRAFTS = "dvi_spec_decode_source_num_drafts_total"
SOURCE_DRAFT_TOKENS = "dvi_spec_decode_source_num_draft_tokens_total"
SOURCE_ACCEPTED_TOKENS = "dvi_spec_decode_source_num_accepted_tokens_total"
SOURCE_ACCEPTANCE_RATE = "dvi_spec_decode_source_acceptance_rate"
SOURCE_MEAN_ACCEPTED_LENGTH = "dvi_spec_decode_source_mean_accepted_length"
SUFFIX_INDEX_TOKENS = "dvi_suffix_index_tokens"
PREFIX_CACHE_QUERIES = "dvi_prefix_cache_queries_total"
PREFIX_CACHE_HITS = "dvi_prefix_cache_hits_total"
SUFFIX_INDEX_SEQS = "dvi_suffix_index_sequences"
SUFFIX_LOOKUPS = "dvi_suffix_lookups_total"
SUFFIX_HITS = "dvi_suffix_hits_total"
SUFFIX_STEP_SECONDS = "dvi_suffix_step_seconds"
SUFFIX_TAILED_RECORDS = "dvi_suffix_tailed_records_total"
ALPHA_MOVES = "dvi_alpha_moves_total"
CONTROL_SHARE = "dvi_control_share"
CONTROL_REQUESTS = "dvi_control_requests_total"
CONTROL_ACCEPTANCE_RATE = "dvi_control_acceptance_rate"
CONTROL_TOKENS_PER_PASS = "dvi_control_tokens_per_pass"
CONTROL_DECODE_TOKENS_PER_SECOND = "dvi_control_decode_tokens_per_second"
CONTROL_UPLIFT = "dvi_control_uplift"
OTHER_DOMAIN = "other"

# vLLM v1's names of the same counters (vllm/v1/spec_decode/metrics.py; prometheus_client allows ':')
VLLM_NUM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_NUM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

# labels
L_MODEL_NAME = "model_name"
L_DRAFTER_VERSION = "drafter_version"
L_DOMAIN = "domain"
L_POSITION = "position"
L_RANK = "rank"  # a draft tree node's rank among its siblings: 0 (the chain's own draft), 1, 2, 3 (3 or later)
L_REASON = "reason"
L_FINISH = "finish_reason"
L_PART = "part"
L_PHASE = "phase"
L_VERDICT = "verdict"
L_GATE = "gate"
L_JUDGED = "judged"
L_GROUP = "group"  # a traffic group with its own drafter adapter (trainer.adapter_key; at most trainer.max_adapters)
L_ARM = "arm"  # learned (the group's served drafter) or control (the reference drafter): dvi.metrics.uplift.ARMS
L_MEASURE = "measure"  # what an uplift is of: dvi.metrics.uplift.MEASURES
L_BOUND = "bound"  # ratio, low, high: an uplift and its 95% interval
L_CAUSE = "cause"  # why live α moved: serving.drafter.diagnosis.CAUSES

DISK_PARTS = ("feedback", "registry", "logs", "checkpoint", "wandb")
"""The `part` label of `dvi_disk_bytes` (`dvi.rundir.RunDir.disk_usage`)."""
HTTP_PHASES = ("headers", "body")
"""The `phase` label of `dvi_http_request_timeouts_total` (`serving.connection`)."""
L_STAGE = "stage"
L_SOURCE = "source"  # who proposed a draft: one of dvi.decode.sources.SOURCES (model, suffix_request, suffix_global)

TRAINER_STATES = {"stopped": 0, "starting": 1, "running": 2, "backoff": 3, "failed": 4, "paused": 5, "off": 6,
                  "external": 7}
"""Numeric codes of `dvi_trainer_state` (a gauge, so wandb and JSONL can plot it too)."""

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
SUFFIX_STEP_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)
VERDICT_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 15.0, 30.0, 60.0, 300.0, 1800.0)
VERDICTS = ("promoted", "refused")
"""The `verdict` label of `dvi_drafter_publish_to_verdict_seconds`: a version's first one."""
GATES = ("promotion", "watch")
"""The `gate` label of `dvi_drafter_gate_groups` (the server's; the trainer's publish gate logs its own)."""
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ACCEPTANCE_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
REQUEST_ACCEPTANCE_MIN_DRAFTED = 8
"""A request enters `dvi_request_acceptance_rate` once it drafted this many tokens (fewer say little)."""
LOW_ACCEPTANCE = (32, 0.05)
"""(drafted tokens, α): a request that drafted at least that many with acceptance at most that is counted in
`dvi_requests_low_acceptance_total` and logged with its id: a garbled or looping output, or a drafter that does not
fit its traffic group (users' signal, vllm#44487)."""

_DV = (L_DRAFTER_VERSION, L_DOMAIN)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    metric_type: str  # "counter" | "gauge" | "histogram" (its `# TYPE` in the exposition)
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


METRICS: dict[str, MetricSpec] = {
    s.name: s
    for s in [
        MetricSpec(
            NUM_DRAFTS, "counter", "Draft proposals (steps in which the drafter proposed >= 1 token).", _DV
        ),
        MetricSpec(NUM_DRAFT_TOKENS, "counter", "Drafted tokens proposed to the target.", _DV),
        MetricSpec(NUM_ACCEPTED_TOKENS, "counter", "Drafted tokens accepted by the target.", _DV),
        MetricSpec(
            NUM_ACCEPTED_PER_POS, "counter", "Accepted drafted tokens by draft position.", (*_DV, L_POSITION)
        ),
        MetricSpec(NUM_DRAFTED_PER_POS, "counter", "Drafted tokens by draft position.", (*_DV, L_POSITION)),
        MetricSpec(NUM_ACCEPTED_PER_RANK, "counter", "Accepted drafted tokens by their rank among a draft tree's "
                   "siblings (0: the drafter's chain; 1-3: its next candidates, 3 counting later ones too).",
                   (*_DV, L_RANK)),
        MetricSpec(ACCEPTANCE_RATE, "gauge", "Rolling acceptance rate alpha = accepted / drafted.", _DV),
        MetricSpec(MEAN_ACCEPTED_LENGTH, "gauge", "Rolling tokens per step = 1 + accepted / steps.", _DV),
        MetricSpec(
            ACCEPTANCE_RATE_PER_POS, "gauge", "Rolling acceptance rate by draft position.", (*_DV, L_POSITION)
        ),
        MetricSpec(GENERATION_TOKENS, "counter", "Generated (new) tokens.", _DV),
        MetricSpec(REQUESTS, "counter", "Finished requests.", (*_DV, L_FINISH)),
        MetricSpec(TOKENS_PER_SECOND, "gauge", "Generated tokens per second over a recent window."),
        MetricSpec(REQUEST_LATENCY, "histogram", "End-to-end request latency.", (L_DOMAIN,), LATENCY_BUCKETS),
        MetricSpec(
            TIME_TO_FIRST_TOKEN, "histogram", "Time to first generated token.", (L_DOMAIN,), TTFT_BUCKETS
        ),
        MetricSpec(REQUEST_ACCEPTANCE, "histogram", "Per-request acceptance rate (accepted / drafted) of requests that "
                   f"drafted at least {REQUEST_ACCEPTANCE_MIN_DRAFTED} tokens.", (L_DOMAIN,), ACCEPTANCE_BUCKETS),
        MetricSpec(LOW_ACCEPTANCE_REQUESTS, "counter", f"Requests that drafted at least {LOW_ACCEPTANCE[0]} tokens "
                   f"with acceptance at most {LOW_ACCEPTANCE[1]} (each logged with its request id).", (L_DOMAIN,)),
        MetricSpec(QUEUE_DEPTH, "gauge", "Requests waiting for a batch slot."),
        MetricSpec(ENGINE_STEPS, "counter", "Engine steps run (one batched target pass each, drafting or not)."),
        MetricSpec(ENGINE_BUSY_SECONDS, "counter", "Seconds the engine thread spent in steps: its rate is the engine's "
                   "busy share (1: compute-bound, every arm of a comparison must be read at the same share)."),
        MetricSpec(DRAFTER_VERSION, "gauge", "Drafter version serving now."),
        MetricSpec(DRAFTER_ADAPTER_VERSION, "gauge", "Adapter version serving each traffic group's rows "
                   "(trainer.adapter_key; at most trainer.max_adapters groups).", (L_GROUP,)),
        MetricSpec(TARGET_VERSION, "gauge", "Target weights version serving now."),
        MetricSpec(TRAINER_STATE, "gauge", f"Online trainer state code {TRAINER_STATES}."),
        MetricSpec(DRAFTER_PROMOTIONS, "counter", "Drafter versions swapped into serving."),
        MetricSpec(
            DRAFTER_REFUSALS, "counter", "Drafter versions refused (validation / shadow).", (L_REASON,)
        ),
        MetricSpec(DRAFTER_ROLLBACKS, "counter", "Drafter rollbacks after live alpha fell."),
        MetricSpec(DRAFTER_PUBLISH_TO_VERDICT, "histogram", "Seconds from a drafter version's publish (its manifest's "
                   "created_at) to the server's first verdict on it, promoted or refused.", (L_VERDICT,),
                   VERDICT_BUCKETS),
        MetricSpec(DRAFTER_GATE_GROUPS, "gauge", "Groups (domain x temperature class x client) in the last verdict of "
                   f"each gate {GATES}: judged, or with too few records to judge (judged=\"false\").",
                   (L_GATE, L_JUDGED)),
        MetricSpec(DRAFTER_HELDOUT_RECORDS, "gauge", "Records in the server's held-out set (what a promotion is "
                   "judged on)."),
        MetricSpec(DRAFTER_HELDOUT_UNFIT, "gauge", "Held-out records left out as no evidence, by reason (transformed: "
                   "served under a logit_bias or penalty; empty).", (L_REASON,)),
        MetricSpec(TRAINER_LOSS, "gauge", "Online trainer total loss."),
        MetricSpec(TRAINER_KL_LOSS, "gauge", "Online trainer top-k KL loss."),
        MetricSpec(TRAINER_REWARD_LOSS, "gauge", "Online trainer accept/reject reward loss."),
        MetricSpec(TRAINER_REWARD_WEIGHT, "gauge", "Current weight of the reward loss."),
        MetricSpec(TRAINER_STEP, "gauge", "Online trainer optimizer steps."),
        MetricSpec(TRAINER_RECORDS_SEEN, "gauge", "Feedback records the trainer has trained on."),
        MetricSpec(
            TRAINER_HELDOUT_ALPHA, "gauge", "Shadow alpha of the last published drafter on held-out feedback."
        ),
        MetricSpec(
            TRAINER_LOST_SHARDS, "gauge", "Feedback shards deleted by retention before the trainer read them."
        ),
        MetricSpec(TRAINER_SKIPPED_SHARDS, "gauge", "Feedback shards that appeared after the trainer's consumed "
                   "state had passed them (never trained; a writer out of its own order)."),
        MetricSpec(TRAINER_QUARANTINED_RECORDS, "gauge", "Feedback records the trainer could not train on (ids "
                   "outside the vocabulary, collation or forward failed): kept in trainer/quarantined_records.jsonl, "
                   "the rest of their shard trained."),
        MetricSpec(TRAINER_PUBLISH_FAILURES, "gauge", "Publishes the registry could not take (disk full, read-only): "
                   "the trainer trains on and retries with backoff."),
        MetricSpec(TRAINER_RESTARTS, "gauge", "Times the supervisor restarted the trainer process."),
        MetricSpec(REQUESTS_REJECTED, "counter", "Requests refused before decoding, by reason (queue_full, "
                   "invalid_request, body_too_large, unauthorized, ...).", (L_REASON,)),
        MetricSpec(FEEDBACK_WRITE_ERRORS, "counter", "Failed feedback shard writes (records kept and retried)."),
        MetricSpec(FEEDBACK_DROPPED_RECORDS, "counter",
                   "Feedback records dropped because the write buffer hit feedback.max_buffer_bytes."),
        MetricSpec(FEEDBACK_PENDING_RECORDS, "gauge", "Feedback records buffered in memory, not yet in a shard."),
        MetricSpec(FEEDBACK_FAILING, "gauge", "1 while feedback shard writes fail, else 0."),
        MetricSpec(FEEDBACK_RECLAIMED_SHARDS, "counter", "Feedback shards the trainer had consumed, deleted to make "
                   "room because the feedback filesystem was full."),
        MetricSpec(TRAINER_HEARTBEAT_AGE, "gauge", "Seconds since the online trainer's last heartbeat."),
        MetricSpec(TRAINER_STALE_RESTARTS, "counter",
                   "Trainer processes killed and restarted because their heartbeat went stale (stopped or hung)."),
        MetricSpec(REQUESTS_CUT, "counter", "Requests a shutdown ended after serve.drain_timeout_s (stage "
                   "running: decoding, logged with finish_reason shutdown; waiting: never started).", (L_STAGE,)),
        MetricSpec(SOURCE_DRAFTS, "counter", "Draft proposals by who proposed them.", (L_SOURCE,)),
        MetricSpec(SOURCE_DRAFT_TOKENS, "counter", "Drafted tokens by who proposed them.", (L_SOURCE,)),
        MetricSpec(SOURCE_ACCEPTED_TOKENS, "counter", "Accepted drafted tokens by who proposed them.", (L_SOURCE,)),
        MetricSpec(SOURCE_ACCEPTANCE_RATE, "gauge", "Acceptance rate by who proposed the drafts (since start).",
                   (L_SOURCE,)),
        MetricSpec(SOURCE_MEAN_ACCEPTED_LENGTH, "gauge",
                   "Tokens per drafting step = 1 + accepted / drafts, by who proposed them (since start).", (L_SOURCE,)),
        MetricSpec(SUFFIX_INDEX_TOKENS, "gauge", "Tokens in the suffix drafter's global index of finished outputs."),
        MetricSpec(SUFFIX_INDEX_SEQS, "gauge", "Sequences in the suffix drafter's global index."),
        MetricSpec(SUFFIX_LOOKUPS, "counter", "Suffix index lookups (one per row and drafting step)."),
        MetricSpec(SUFFIX_HITS, "counter", "Suffix lookups that proposed tokens, by index.", (L_SOURCE,)),
        MetricSpec(PREFIX_CACHE_QUERIES, "counter", "Prompt tokens looked up in the target's prefix cache "
                   "(serve.prefix_cache_tokens; vLLM's prefix_cache_queries)."),
        MetricSpec(PREFIX_CACHE_HITS, "counter", "Prompt tokens whose keys and values came from the prefix cache or "
                   "from a prompt joining beside them, not from their own prefill (vLLM's prefix_cache_hits)."),
        MetricSpec(SUFFIX_STEP_SECONDS, "histogram",
                   "Host seconds the suffix index spends per engine step (lookups and appends).", (),
                   SUFFIX_STEP_BUCKETS),
        MetricSpec(SUFFIX_TAILED_RECORDS, "counter",
                   "Finished outputs of other replicas (shared feedback dir) added to the suffix index."),
        MetricSpec(TRAINER_QUARANTINED_SHARDS, "gauge",
                   "Unreadable feedback shards the trainer moved to quarantine/ (skipped, not retried)."),
        MetricSpec(DISK_BYTES, "gauge", f"Bytes on disk by part {DISK_PARTS}: feedback shards, the drafter "
                   "registry, the run dir's logs, the trainer's checkpoint, wandb's offline files.", (L_PART,)),
        MetricSpec(ALPHA_MOVES, "counter", "Moves of a lane's live α between two windows of its records, by the cause "
                   "the drafter thread named (serving_disagrees: the engine's drafts are not its weights' own; "
                   "drafter_changed, target_changed, traffic_changed, unexplained); group \"\": the shared drafter.",
                   (L_GROUP, L_CAUSE)),
        MetricSpec(CONTROL_SHARE, "gauge", "Share of each traffic group's requests drafted by the reference "
                   "drafter (the control arm, serve.control_share; 0: no control group)."),
        MetricSpec(CONTROL_REQUESTS, "counter", "Finished requests of traffic groups with a drafter adapter, by arm.",
                   (L_GROUP, L_ARM)),
        MetricSpec(CONTROL_ACCEPTANCE_RATE, "gauge", "Acceptance rate by arm since the group's served adapter "
                   "version went live (pooled over its requests).", (L_GROUP, L_ARM)),
        MetricSpec(CONTROL_TOKENS_PER_PASS, "gauge", "Mean tokens per target pass of a request, by arm, since the "
                   "group's served adapter version went live.", (L_GROUP, L_ARM)),
        MetricSpec(CONTROL_DECODE_TOKENS_PER_SECOND, "gauge", "Mean decode tokens per second of a request as the "
                   "engine measured it (first token to last), by arm, since the group's served adapter version went "
                   "live.", (L_GROUP, L_ARM)),
        MetricSpec(CONTROL_UPLIFT, "gauge", "The learned arm's mean over the control arm's (ratio) and its 95% "
                   "interval (low, high), by measure (tokens_per_pass, decode_tokens_per_s).",
                   (L_GROUP, L_MEASURE, L_BOUND)),
        MetricSpec(HTTP_REQUEST_TIMEOUTS, "counter", "Connections closed with a 408 because a request's headers "
                   "or body did not arrive in time (serve.header_timeout_s / serve.body_timeout_s).", (L_PHASE,)),
    ]
}

VLLM_ALIASES: dict[str, str] = {
    NUM_DRAFTS: VLLM_NUM_DRAFTS,
    NUM_DRAFT_TOKENS: VLLM_NUM_DRAFT_TOKENS,
    NUM_ACCEPTED_TOKENS: VLLM_NUM_ACCEPTED_TOKENS,
    NUM_ACCEPTED_PER_POS: VLLM_NUM_ACCEPTED_PER_POS,
}
"""Our counter -> vLLM's name for the same count. vLLM's carry `model_name` (and `position`) only:
no drafter version or domain, so their series never multiply; ours carry both (bounded)."""

VLLM_METRICS: dict[str, MetricSpec] = {
    vllm: MetricSpec(vllm, "counter", f"{METRICS[ours].help} (vLLM's name of {ours}.)",
                     (L_MODEL_NAME, L_POSITION) if L_POSITION in METRICS[ours].labels else (L_MODEL_NAME,))
    for ours, vllm in VLLM_ALIASES.items()
}

TRAINER_GAUGES = (
    TRAINER_LOSS,
    TRAINER_KL_LOSS,
    TRAINER_REWARD_LOSS,
    TRAINER_REWARD_WEIGHT,
    TRAINER_STEP,
    TRAINER_RECORDS_SEEN,
    TRAINER_HELDOUT_ALPHA,
    TRAINER_LOST_SHARDS,
    TRAINER_SKIPPED_SHARDS,
    TRAINER_QUARANTINED_SHARDS,
    TRAINER_QUARANTINED_RECORDS,
    TRAINER_PUBLISH_FAILURES,
)

__all__ = [name for name in dict(globals()) if name.isupper() and not name.startswith("_")] + ["MetricSpec"]
"""Every public name defined above (constants and `MetricSpec`), so `dvi.metrics` re-exports them
without a second list to keep in step."""
