"""The one configuration schema for every runnable part of dvi.

Every YAML file under ``configs/`` is validated here, and every default lives here: a key the
schema does not know is an error, not a silent no-op. Errors name the file and the dotted key. The `serve`
section lives in `dvi.config_serve`, the pieces every section is built from in `dvi.config_base`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from dvi.config_base import ConfigError, Secret, _Strict
from dvi.config_serve import DEFAULT_CONTROL_SHARE, ServeConfig, VllmConfig
from dvi.engine.options import default_tree_width

__all__ = ["ConfigError", "DEFAULT_CONTROL_SHARE", "DviConfig", "Secret", "ServeConfig", "VllmConfig", "dump_config",
           "load_config"]

PRESETS = ("tiny", "smollm2")


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
            self.speculation.tree_width = default_tree_width(self.serve.engine == "dvi" and self.speculation.adaptive)
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
