"""The appliance's settings: one typed tree, built once in bootstrap and passed down
(appliance/config/settings_load.py builds it from its sources).

Sources, strongest first: explicit values (CLI flags), environment variables
(`APPLIANCE_` prefix, `__` between nested keys, e.g. `APPLIANCE_SERVER__PORT=9000`), the YAML
file (`--config PATH` or `$APPLIANCE_CONFIG`), then the defaults below. Every field carries a
docstring; `configs/appliance.yaml` documents the same keys with their defaults
(appliance/config/settings_yaml.py writes it), and a test keeps the two in step.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveFloat, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from appliance.config.settings_api import ApiSettings, ServerSettings
from appliance.config.settings_escalation import EscalationSettings
from appliance.config.settings_section import Section
from appliance.perf.agent_batching import AGENT_BATCH_TOKENS, AGENT_PREFILL_CAP_TOKENS

__all__ = ["ApiSettings", "EngineKind", "Section", "ServerSettings", "Settings"]

ENV_PREFIX = "APPLIANCE_"


class EngineKind(StrEnum):
    AUTO = "auto"
    VLLM = "vllm"
    SIM = "sim"
    EXTERNAL = "external"


PORT_OFFSETS = {"base_port": 20, "kv_events_base_port": -2523, "kv_retention_base_port": -2423}
"""Where an engine port left unset sits from server.port: 8100, 5557 and 5657 for 8080."""


class EngineSettings(Section):
    kind: EngineKind = EngineKind.AUTO
    """auto | vllm | sim | external. auto = vLLM on NVIDIA GPUs when both are present, else sim."""
    model: str | None = None
    """Model path or name served by every worker (vllm); the sim engine serves it by name."""
    python: str | None = None
    """Python interpreter that has vLLM installed; None = the appliance's own."""
    served_model_name: str | None = None
    """Name clients use in `model`; defaults to the model's directory or repo name."""
    workers: int = Field(1, ge=1, le=64)
    """Number of engine workers (one per GPU group)."""
    gpus_per_worker: int = Field(1, ge=1, le=16)
    """GPUs given to each worker through CUDA_VISIBLE_DEVICES (its tensor-parallel size)."""
    gpus: list[int] | None = None
    """GPU indices (nvidia-smi's, PCI bus order) the workers share out in order,
    gpus_per_worker each (`up --gpus 0,1,2,3`); without workers set, one worker per
    gpus_per_worker of them. None: the appliance's own CUDA_VISIBLE_DEVICES when it lists
    indices, else 0, 1, ... Simulated workers carry the ids only."""
    base_port: int | None = Field(None, ge=1, le=65535)
    """HTTP port of worker 0; worker i listens on base_port + i. None: server.port + 20 (8100
    for 8080), or free ports chosen at start when those are taken."""
    kv_events_base_port: int | None = Field(None, ge=1, le=65535)
    """ZMQ port on 127.0.0.1 the appliance binds for worker 0's KV events; worker i uses +i.
    None: server.port - 2523 (5557 for 8080), or free ports chosen at start when taken."""
    kv_retention: bool = True
    """Give every worker the appliance starts (vLLM or simulated) its retention connector, so
    a waiting session's KV can be held in the worker; false starts plain workers."""
    kv_retention_base_port: int | None = Field(None, ge=1, le=65535)
    """ZMQ port on 127.0.0.1 the appliance binds for worker 0's retention control channel;
    worker i uses +i. None: server.port - 2423 (5657 for 8080), or free ports chosen at start
    when taken."""
    block_size: int = Field(32, ge=1, le=1024)
    """KV block size in tokens, pinned on every worker so the router's block hashes match
    (a multiple of 32 on vLLM's CPU build)."""
    hash_algo: Literal["sha256", "sha256_cbor"] = "sha256_cbor"
    """vLLM --prefix-caching-hash-algo; the router recomputes the same hashes."""
    python_hash_seed: str = "0"
    """PYTHONHASHSEED given to every worker and used as the router's NONE_HASH seed."""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Fraction of each GPU's memory a worker may take (weights + KV cache)."""
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    """KV cache size per worker in bytes (a simulated worker: at its profile's bytes per token);
    None: from gpu_memory_utilization (GPU), or 40 % of free memory (CPU build, <= 4 GiB)."""
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """KV cache dtype (vLLM's --kv-cache-dtype): auto stores KV at the model's dtype (bf16 or
    fp16: 2 bytes per element); fp8 takes 1 byte and halves the KV bytes per token that
    every held session is priced at. vLLM's CPU build stores auto or fp8 only. The simulated
    workers keep the GPU profile's model and its dtype."""
    kv_host_bytes: int = Field(0, ge=0)
    """Host memory per worker for KV in bytes, where the reaper may demote KV; 0: none. vLLM
    workers: vLLM's offloading connector (CPU build: the appliance's copies); the sim models it."""
    max_model_len: int | None = Field(None, ge=16)
    """Longest prompt + output in tokens; None lets vLLM use the model's own limit (the API
    takes the limit each worker reports)."""
    max_num_batched_tokens: int | None = Field(AGENT_BATCH_TOKENS, ge=1)
    """vLLM --max-num-batched-tokens on GPU and simulated workers (the CPU build keeps vLLM's):
    the tokens a step computes (perf/agent_batching.py: why 16384); None: vLLM's (8192, H200)."""
    long_prefill_token_threshold: int = Field(AGENT_PREFILL_CAP_TOKENS, ge=0)
    """vLLM --long-prefill-token-threshold: the most tokens one prompt computes in a step while
    other requests run or wait, cut to max_model_len (a model's own window under it: set it
    lower); 0: no cap, vLLM's default."""
    tool_call_parser: str | None = "hermes"
    """vLLM --tool-call-parser: how a worker reads tool calls out of the model's text
    (hermes: Qwen 2.5/3, Hermes and most `<tool_call>` templates; llama3_json: Llama 3.1+;
    mistral; pythonic: Llama 4; `vllm serve --help` lists them). None: no parser, and only
    tool_choice "none" is accepted. The simulated engine writes hermes-style calls."""
    enable_auto_tool_choice: bool = True
    """vLLM --enable-auto-tool-choice: the model decides whether to call a tool (tool_choice
    "auto", the default when tools are given); needs tool_call_parser."""
    structured_outputs_backend: Literal[
        "auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"
    ] = "xgrammar"
    """vLLM's structured-output backend (response_format json_schema / json_object, and the
    required and named tool choices): xgrammar, auto's first choice, can write compact JSON
    (guidance can too, but refuses the structural tags of tool_choice required and named);
    auto is vLLM's own choice per request."""
    compact_json: bool = True
    """Structured output without free whitespace (vLLM's disable_any_whitespace; needs the
    xgrammar or guidance backend). Else a model may pad JSON with whitespace until
    max_tokens (a random-weight model always does)."""
    sleep_mode: bool = False
    """vLLM's sleep mode (--enable-sleep-mode, with its development endpoints): idle workers
    can then sleep (level 1 keeps the weights in host memory, level 2 drops them) rather
    than stop. vLLM's CUDA build only; on CUDA it also turns on vLLM's cumem allocator."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments passed verbatim to every `vllm serve`."""
    external_urls: list[str] = Field(default_factory=list)
    """Base URLs of vLLM servers the appliance did not start (engine kind `external`)."""
    external_kv_event_endpoints: list[str] = Field(default_factory=list)
    """ZMQ endpoints of those servers' KV events, in the same order as external_urls."""
    external_keepalive_s: float = Field(5.0, gt=0)
    """Seconds those servers keep an idle connection open (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
    default 5). The appliance reuses a connection only while it is surely open; a longer
    keep-alive spares turns the cost of opening connections."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Seconds a worker may send nothing on a model request it took: no answer's head, or
    no next piece of a stream (a non-streamed answer comes whole, so for it this bounds the
    whole generation). Then the request is closed there (the worker aborts it) and the turn
    is a failed attempt answered 504 `worker_timeout`, not retried elsewhere; a stream that
    keeps sending is never cut."""
    sim_time_scale: float = Field(1.0, gt=0)
    """Simulated engine only: 2.0 makes every modelled GPU step take twice as long."""
    gpu_profile: Path | None = None
    """GPU profile JSON (`appliance profile` writes one for this box): the latency model of
    the router, admission, the reaper and the simulated workers; None = the bundled H200
    profile. Byte figures take the served model's KV bytes per token whatever the profile."""

    def port_base(self, key: str, api_port: int = 8080) -> int:
        """The engine port `key` as set, else where it follows `api_port` (`appliance up`
        sets each before a worker starts: appliance/engines/supervision/port_plan.py)."""
        value: int | None = getattr(self, key)
        return value if value is not None else api_port + PORT_OFFSETS[key]

    @model_validator(mode="after")
    def _gpus_for_every_worker(self) -> EngineSettings:
        if self.gpus is None:
            return self
        if any(g < 0 for g in self.gpus) or len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"engine.gpus={self.gpus}: list each GPU index (>= 0) once")
        if "workers" not in self.model_fields_set:
            self.workers = max(1, len(self.gpus) // self.gpus_per_worker)
        need = self.workers * self.gpus_per_worker
        if len(self.gpus) < need:
            raise ValueError(
                f"engine.workers={self.workers} x engine.gpus_per_worker={self.gpus_per_worker}"
                f" needs {need} GPUs but engine.gpus lists {len(self.gpus)}; list more GPUs or "
                "lower one of them"
            )
        return self

    @model_validator(mode="after")
    def _tool_and_json_flags_fit(self) -> EngineSettings:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError(
                "engine.enable_auto_tool_choice needs engine.tool_call_parser (e.g. hermes); "
                "set one or set enable_auto_tool_choice: false"
            )
        if self.compact_json and self.structured_outputs_backend not in ("xgrammar", "guidance"):
            raise ValueError(
                "engine.compact_json needs engine.structured_outputs_backend xgrammar or "
                "guidance; choose one or set compact_json: false"
            )
        return self

    @model_validator(mode="after")
    def _external_needs_urls(self) -> EngineSettings:
        if self.kind == EngineKind.EXTERNAL and not self.external_urls:
            raise ValueError(
                "engine.kind=external needs engine.external_urls: set the vLLM base URLs"
            )
        if self.external_kv_event_endpoints and len(self.external_kv_event_endpoints) != len(
            self.external_urls
        ):
            raise ValueError(
                "engine.external_kv_event_endpoints must have one entry per engine.external_urls"
            )
        return self


class RoutingSettings(Section):
    reuse_weight: float = Field(2.0, ge=0)
    """Weight of the prefill seconds a worker's resident prefix saves (scaled to 0..1). Twice
    the queue's: a turn moved off its prefix prefills it again, which the turns queued behind
    it there wait for too, and leaves a second copy in KV; so a session moves only when the
    queue it leaves costs more than twice the prefill it would redo."""
    queue_weight: float = Field(1.0, ge=0)
    """Weight of the queued prefill seconds ahead of the turn (scaled to 0..1). Equal reuse
    and queue weights make the router minimise the turn's own estimated time to first
    token."""
    kv_pressure_weight: float = Field(0.1, ge=0)
    """Weight of free KV cache room (a tie-breaker: do not evict others' hot prefixes)."""
    affinity_weight: float = Field(0.05, ge=0)
    """Weight of staying on the session's previous worker (a tie-breaker)."""
    affinity_max_share: float = Field(0.5, ge=0, le=1)
    """Affinity counts only while that worker holds at most this share of all queued work."""
    failures_weight: float = Field(0.2, ge=0)
    """Weight of a worker's recent failures (fewer is better)."""


class LedgerSettings(Section):
    path: Path | None = None
    """SQLite file of the ledger; None = ledger.db in the data dir."""
    batch_max: int = Field(1024, ge=1, le=100_000)
    """Most writes the writer thread commits in one transaction."""
    synchronous: Literal["normal", "full"] = "full"
    """SQLite synchronous mode: full survives power loss, normal survives a process crash."""
    busy_timeout_s: float = Field(5.0, gt=0)
    """How long a connection waits on a lock before it reports the ledger busy."""
    usage_period_s: float = Field(60.0, ge=0.5, le=3600)
    """Seconds of each usage period the router records (its workers' awake and busy
    GPU-seconds and energy, the box's overhead): one row per worker per period, and what a
    crash can lose of them."""


class CostSettings(Section):
    mode: Literal["tokens", "gpu_seconds"] = "tokens"
    """How turns are priced: per token (an API-like price list) or per GPU-second (self-hosted)."""
    currency: str = "USD"
    """Currency label shown beside every cost."""
    fresh_per_mtok: float = Field(3.0, ge=0)
    """Price of one million fresh (uncached) prompt tokens, tokens mode."""
    cached_per_mtok: float = Field(0.3, ge=0)
    """Price of one million cached prompt tokens, tokens mode."""
    output_per_mtok: float = Field(15.0, ge=0)
    """Price of one million output tokens, tokens mode."""
    reasoning_per_mtok: float = Field(15.0, ge=0)
    """Price of one million reasoning tokens (a part of the output tokens, priced at this
    rate instead of the output price), tokens mode."""
    gpu_second: float = Field(0.0011, ge=0)
    """Price of one GPU-second, gpu_seconds mode (about 4 USD per GPU-hour): busy ones are
    the turns', idle awake ones the box's overhead, spread over the work."""
    energy_per_kwh: float = Field(0.0, ge=0)
    """Price of one kWh the workers' GPUs drew (NVML's power readings, or the simulated
    GPUs' model), gpu_seconds mode, charged as overhead; 0: gpu_second includes it."""
    box_per_hour: float = Field(0.0, ge=0)
    """Price of the box per hour the appliance runs (capacity bought: the hardware or the
    reservation, asleep or awake), gpu_seconds mode, charged as overhead."""


class AdmissionSettings(Section):
    """Which tasks and turns enter the box (appliance/policy/admission.py states the model)."""

    turns_per_worker: int = Field(64, ge=1)
    """In-flight turns per healthy worker at which the box counts as saturated; then, when
    another tenant has work on the box, a tenant at or above its weighted share of them is
    refused (429 tenant_over_share). A tenant alone is never refused for fairness."""
    max_open_tasks: int = Field(1024, ge=1)
    """Open tasks at which the box counts as saturated for new tasks (shared by weight too)."""
    default_weight: float = Field(1.0, gt=0)
    """Fair-share weight of a tenant not named in tenant_weights."""
    tenant_weights: dict[str, PositiveFloat] = Field(default_factory=dict)
    """Fair-share weight by tenant (its key name); a tenant with weight 2 gets twice the
    share of one with weight 1 when the box is saturated. A tenant alone may use it all."""
    max_children_per_task: int = Field(64, ge=0)
    """Open children a task may have when it sets no max_children, and the most a task's own
    max_children may allow (429 children_cap)."""
    max_depth: int = Field(8, ge=0)
    """Deepest a task may sit below its root task (a root is depth 0; 429 depth_cap)."""
    max_queue_s: float = Field(30.0, gt=0)
    """When every healthy worker's estimated queue exceeds this at priority 0, new work is
    refused early (503 overloaded)."""
    queue_s_per_priority: float = Field(10.0, ge=0)
    """Seconds of queue each priority level adds to (or, below 0, takes from) max_queue_s:
    higher priority tolerates a longer queue."""
    default_priority_ceiling: int = 0
    """Highest X-Priority a tenant not named in priority_ceilings may use (higher is clipped)."""
    priority_ceilings: dict[str, int] = Field(default_factory=dict)
    """Highest X-Priority by tenant (its key name); higher requests are clipped to it."""
    retry_after_s: float = Field(1.0, gt=0)
    """Retry-After sent with a refusal whose wait cannot be estimated (at least 1 s is sent)."""
    task_idle_s: float = Field(600.0, gt=0)
    """An open task with no turn and no new child for this long stops counting toward its
    tenant's open tasks and its parent's children (clients that never close tasks)."""

    @model_validator(mode="after")
    def _consistent(self) -> AdmissionSettings:
        if self.max_children_per_task > self.max_open_tasks:
            raise ValueError(
                f"admission.max_children_per_task={self.max_children_per_task} exceeds "
                f"admission.max_open_tasks={self.max_open_tasks}: lower the first or raise "
                "the second"
            )
        ceilings = {"default_priority_ceiling": self.default_priority_ceiling}
        ceilings |= {f"priority_ceilings.{t}": c for t, c in self.priority_ceilings.items()}
        for name, ceiling in ceilings.items():
            if self.max_queue_s + ceiling * self.queue_s_per_priority <= 0:
                raise ValueError(
                    f"admission.{name}={ceiling} leaves a queue bound of 0 s (max_queue_s + "
                    "ceiling * queue_s_per_priority), so that tenant is refused whenever any "
                    "work is queued: raise the ceiling or max_queue_s, or lower "
                    "queue_s_per_priority"
                )
        return self


class ResidencySettings(Section):
    """The idle reaper (appliance/policy/reaper.py; appliance/services/residency/reaper_loop.py)."""

    reaper: bool = True
    """Run the idle reaper: decisions recorded, sent where workers have engine.kv_retention."""
    policy: Literal["reaper", "lru", "ttl-pin", "mori"] = "reaper"
    """The residency policy it runs: reaper (the appliance's own), or an anchor: lru (vLLM's
    prefix cache as shipped), ttl-pin (Continuum's 60 s pin), mori (MORI's idleness ranks)."""
    max_residency_s: float = Field(1800.0, gt=0)
    """No hold past this many seconds idle: the session is evicted and counts as abandoned."""
    pressure_from: float = Field(0.8, ge=0, lt=1)
    """KV usage (0..1) under which a hold costs nothing; above, what it would push out."""
    tenant_cap_bytes: int | None = Field(None, gt=0)
    """The most KV bytes one tenant's waiting sessions may hold in a worker's HBM (the
    reaper); None: no cap."""
    restore_ahead: bool = False
    """Restore a demoted session when the wait model says its turn is likely, not only on
    its client's tool_finished (off: no gain on recorded agent sessions, docs/benchmarks.md)."""


class WorkerReaperSettings(Section):
    """The worker reaper (appliance/policy/worker_power.py; services/workers/worker_reaper.py): idle
    workers sleep or stop, and a turn wakes one. Its key was `reaper:` (still read, with a
    warning); the idle session reaper is `residency.reaper`."""

    worker_idle_s: float | None = Field(None, ge=0)
    """Seconds a worker has had no running, waiting or held turn before it sleeps or stops;
    None: workers stay awake."""
    max_wake_s: float | None = Field(None, ge=0)
    """The longest wake a worker may need: the cheapest state whose wake fits (None: any)."""
    min_awake: int = Field(0, ge=0)
    """Workers kept awake however idle."""


class Settings(BaseSettings):
    """The whole configuration of one appliance."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )

    data_dir: Path = Field(default_factory=lambda: Path.home() / ".local/share/appliance")
    """Directory for ledger.db, api-keys.toml and logs ($APPLIANCE_DATA_DIR)."""
    debug: bool = False
    """Print tracebacks for known errors ($APPLIANCE_DEBUG=1)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Level of the appliance's own log lines (stderr and appliance.log; a reload applies it)."""
    log_dir: Path | None = None
    """Directory of appliance.log (rotated at 10 MiB, 5 kept) and the workers' logs; None =
    logs/ in the data dir."""
    server: ServerSettings = ServerSettings()
    api: ApiSettings = ApiSettings()
    engine: EngineSettings = EngineSettings()
    routing: RoutingSettings = RoutingSettings()
    ledger: LedgerSettings = LedgerSettings()
    costs: CostSettings = CostSettings()
    admission: AdmissionSettings = AdmissionSettings()
    residency: ResidencySettings = ResidencySettings()
    worker_reaper: WorkerReaperSettings = WorkerReaperSettings()
    escalation: EscalationSettings = EscalationSettings()

    @property
    def ledger_path(self) -> Path:
        return self.ledger.path or self.data_dir / "ledger.db"

    @property
    def log_path(self) -> Path:
        return (self.log_dir or self.data_dir / "logs").expanduser()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # settings_load.load() merges file, environment and flags, in that order of strength.
        return (init_settings,)
