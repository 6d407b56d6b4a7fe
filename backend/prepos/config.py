"""Configuration: one frozen dataclass per area, read once.

The only reader is :func:`read_config`. Its sources, later ones winning:
dataclass defaults, the model's ``config.pbtxt`` parameters (keys
``<area>.<field>``, e.g. ``gate.threshold``), and environment variables
``PREPOS_<AREA>_<FIELD>`` (e.g. ``PREPOS_GATE_THRESHOLD=0.8``) so a launcher can
override a value without editing the model repository.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar


class ConfigError(ValueError):
    """A configuration value is missing or out of range; the message says which and why."""


def check_setting(condition: bool, key: str, message: str) -> None:
    """A setting's check in its dataclass's ``__post_init__``: :class:`ConfigError` ``<key>: <message>`` unless
    ``condition``."""
    if not condition:
        raise ConfigError(f"{key}: {message}")


SCAN_NAMES = ("auto", "torch", "cpu", "triton", "numpy", "onnxruntime", "tensorrt")


@dataclass(frozen=True)
class EngineConfig:
    name: str = "torch"
    """Engine implementation: ``torch`` (CPU/CUDA) or ``trtllm``."""
    dir: str = "../../engines/smollm2-135m-instruct"
    """Engine directory from ``build_engines``; a relative path is relative to the model's directory."""
    device: str = "cpu"
    """Torch device for the torch engine: ``cpu``, ``cuda``, ``cuda:N``."""
    dtype: str = "float32"
    """Weight and KV dtype: ``float32``, ``bfloat16`` or ``float16``."""
    num_threads: int = 0
    """Torch intra-op threads; 0 leaves torch's default."""
    scan: str = "auto"
    """Vocabulary scan implementation: ``auto`` (``triton`` on a CUDA device; on CPU ``cpu`` where the CPU kernels
    are on and built, else ``torch``), ``torch`` (on the logits' device), ``cpu`` (greedy whole-vocabulary scans
    as one call of the compiled CPU kernels, the rest through ``torch``), ``triton`` (the OpenAI Triton kernel;
    CUDA only), ``numpy`` (the reference),
    ``onnxruntime`` (the scan's ONNX graph on CPU) or ``tensorrt`` (a scan engine with our plugin; CUDA only)."""
    scan_engine: str = ""
    """Scan engine file from ``python -m prepos_build.scan_tensorrt`` (relative: to the model's directory);
    required when ``scan`` is ``tensorrt``."""
    page_tokens: int = 64
    """KV block size in tokens of the torch engine (a power of two). On CUDA the page of its KV pool, which is
    ``memory.kv_budget_bytes``, or half the GPU memory free after the weights when that is 0. On CPU the step
    a session's KV grows by (at least; by an eighth of what it holds once that is more): a session holds at most
    one block it does not use."""
    cuda_graph: bool = True
    """Torch engine on CUDA: capture the decode step once as a CUDA graph (off: eager decode, for debugging)."""
    cpu_kernels: bool = True
    """Torch engine on CPU in float32: the decode step's layers (GEMVs, attention) through prepos's CPU kernels,
    compiled with the system C compiler on first load and cached in ``$PREPOS_CACHE_DIR`` (default
    ``~/.cache/prepos``); where they cannot be built, and when off, torch's ops."""
    share_prefixes: bool = True
    """Torch engine: a prefill copies the KV of the longest prefix its tokens share with another resident session
    (a system prompt or tool list many sessions open with) instead of computing it. The TensorRT-LLM engine's
    block reuse shares prefixes across sessions by itself."""
    kept_prefixes: int = 32
    """Torch engine, with ``share_prefixes``: closed sessions whose opening turn (their first; a system prompt)
    stays behind as a donor for later sessions, at most; the least recently copied goes first, and all of
    them before any session's state when the KV budget (or pool) is full. 0: none."""
    trtllm_free_gpu_memory_fraction: float = 0.85
    """TensorRT-LLM engine: share of the free GPU memory its executor takes for the KV block pool."""
    trtllm_retention_priority: int = 80
    """TensorRT-LLM engine: KV retention priority (0-100; TensorRT-LLM's default is 35) of a session's blocks, held
    for ``scheduler.session_idle_timeout_s`` after each request, so session prefixes outlive other traffic."""

    def __post_init__(self) -> None:
        check_setting(self.name in ("torch", "trtllm"), "engine.name",
                      f"unknown engine {self.name!r}; use torch or trtllm")
        check_setting(self.dtype in ("float32", "bfloat16", "float16"), "engine.dtype", f"unknown dtype {self.dtype!r}")
        check_setting(self.num_threads >= 0, "engine.num_threads", "must be >= 0")
        check_setting(self.kept_prefixes >= 0, "engine.kept_prefixes", "must be >= 0")
        check_setting(0.0 < self.trtllm_free_gpu_memory_fraction <= 1.0, "engine.trtllm_free_gpu_memory_fraction",
                      "must lie in (0, 1]")
        check_setting(0 <= self.trtllm_retention_priority <= 100, "engine.trtllm_retention_priority",
                      "must lie in [0, 100]")
        check_setting(re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None, "engine.device",
                      f"unknown device {self.device!r}; use cpu, cuda or cuda:N")
        check_setting(self.name != "trtllm" or self.device.startswith("cuda"), "engine.device",
                      f"the trtllm engine runs on CUDA; engine.device is {self.device!r}")
        check_setting(1 <= self.page_tokens <= 4096 and not self.page_tokens & (self.page_tokens - 1),
                      "engine.page_tokens", f"must be a power of two in [1, 4096], got {self.page_tokens}")
        check_setting(self.scan in SCAN_NAMES, "engine.scan",
                      f"unknown scan {self.scan!r}; use {', '.join(SCAN_NAMES)}")
        check_setting(self.scan != "triton" or self.device.startswith("cuda"), "engine.scan",
                      f"triton runs on CUDA only; engine.device is {self.device!r} (use auto or torch)")
        check_setting(self.scan != "tensorrt" or bool(self.scan_engine), "engine.scan_engine",
                      "required with engine.scan = tensorrt (build one with python -m prepos_build.scan_tensorrt)")


IDLE_POLICY_NAMES = ("most_recent", "least_recent")  # prepos.policies.IDLE_POLICIES
EVICTION_POLICY_NAMES = ("lru", "next_use")  # prepos.memory.EVICTION_POLICIES


@dataclass(frozen=True)
class SchedulerConfig:
    preposition: bool = True
    """Run pre-positioning in idle windows. Off gives the prefix-cache baseline."""
    retain_kv: bool = True
    """Keep a session's KV between requests. Off gives the stateless baseline (every request prefills the log)."""
    chunk_tokens: int = 32
    """Most tokens one pre-positioning chunk prefills; a foreground request waits at most one chunk."""
    background_delay_ms: float = 10.0
    """Background work waits this long after each foreground step, so a response just sent is not slowed by it."""
    idle_policy: str = "most_recent"
    """Which idle session to pre-position first: ``most_recent`` or ``least_recent``."""
    session_idle_timeout_s: float = 600.0
    """Sessions idle longer are closed; set from the model's ``max_sequence_idle_microseconds``."""
    max_decode_batch: int = 32
    """Most sessions one decode step takes: requests decoding at the same time run their steps as one batch
    (the weights are read once for all of them). 1 decodes one session at a time."""
    max_prefill_batch: int = 16
    """Most sessions one foreground prefill takes: requests that must prefill at the same time (their turns, or
    a rebuild) run as one forward pass, the weights read once for all of them. 1 prefills one at a time."""
    max_prefill_batch_tokens: int = 512
    """Most new tokens one prefill step takes; prefills are taken in arrival order, batched up to this, and one
    longer than this goes in pieces of at most this many tokens, one step each, taking turns with the other
    sessions' decode steps. Short turns that arrive together share a batch, while a long one (a rebuild, say)
    neither holds up the short ones that came before it nor stalls the answers streaming meanwhile for more than
    one piece; its deadline and cancellation are checked before each piece. On a GPU, where a batch of a few
    thousand tokens costs little more than one of a few hundred, raise it."""
    stream_interval: int = 1
    """Tokens per streamed response after an answer's first: the first token always goes out at once, later ones
    in responses of this many (the last response may hold fewer). Each response costs the engine loop a send
    (about 0.5 ms on a CPU host), paid per session per decode step; sending fewer when many sessions decode
    together gives that time back to the decode. 1 streams every token."""
    default_max_tokens: int = 64
    """``max_tokens`` when a request with a delta or ``choices`` does not send it (a bare START or END: 0)."""
    drain_file: str = ""
    """A file whose appearance drains the server before a stop (:mod:`prepos.drain`): STARTs are refused and every
    session is ended with its journal kept, so that Triton need not wait its exit timeout for them;
    ``<file>.drained`` says when that is done. Empty = no drain. Relative = to the model's directory. The launcher
    sets it (``PREPOS_SCHEDULER_DRAIN_FILE``) and writes it on Ctrl-C or SIGTERM; the image sets it, and
    ``prepos.supervise`` writes it on SIGTERM."""
    context_overflow: str = "reject"
    """When a turn would not fit the session's log: ``reject`` (error naming the input, nothing changes) or
    ``drop_oldest`` (drop the oldest turns after the first, the system turn, until the turn and its answer fit)."""

    def __post_init__(self) -> None:
        check_setting(self.chunk_tokens >= 1, "scheduler.chunk_tokens", "must be >= 1")
        check_setting(self.idle_policy in IDLE_POLICY_NAMES, "scheduler.idle_policy",
                      f"unknown policy {self.idle_policy!r}; use {' or '.join(IDLE_POLICY_NAMES)}")
        check_setting(self.context_overflow in ("reject", "drop_oldest"), "scheduler.context_overflow",
                      f"unknown policy {self.context_overflow!r}; use reject or drop_oldest")
        check_setting(0 <= self.background_delay_ms <= 10_000, "scheduler.background_delay_ms", "must be in [0, 10000]")
        check_setting(math.isfinite(self.session_idle_timeout_s) and self.session_idle_timeout_s > 0,
                      "scheduler.session_idle_timeout_s", "must be a finite number of seconds > 0")
        check_setting(self.default_max_tokens >= 0, "scheduler.default_max_tokens", "must be >= 0")
        check_setting(1 <= self.max_decode_batch <= 1024, "scheduler.max_decode_batch", "must be in [1, 1024]")
        check_setting(1 <= self.max_prefill_batch <= 1024, "scheduler.max_prefill_batch", "must be in [1, 1024]")
        check_setting(1 <= self.stream_interval <= 1024, "scheduler.stream_interval", "must be in [1, 1024]")
        check_setting(self.max_prefill_batch_tokens >= 1, "scheduler.max_prefill_batch_tokens", "must be >= 1")


@dataclass(frozen=True)
class GateConfig:
    speculate: bool = True
    """Default for a request's ``speculate`` input: may a non-empty delta be answered by the gate?"""
    threshold: float = 0.9
    """Gate fires when the score of the speculative distribution is at least this."""
    score: str = "p_max"
    """Gate score: ``p_max``, ``margin`` or ``certainty`` (1 - entropy / log(number of allowed tokens)); all in [0, 1]."""
    speculative_delta: str = ""
    """Text pre-positioning puts where the delta will go: empty (the default) or a neutral placeholder."""
    epsilon: float = 0.0
    """False-accept rate ``prepos calibrate`` certified for ``threshold`` (0 = threshold not calibrated); a record."""
    confidence: float = 0.0
    """Confidence (1 - delta) of that certificate; 0 when not calibrated. A record."""
    calibrated_coverage: float = 0.0
    """Share of calibration decision points the threshold accepted; a record."""
    watch_fraction: float = 0.0
    """Share of gated answers audited against the full path in the background (0 = none). With ``epsilon`` set,
    the gate is suspended once the audits' upper bound on the false-accept rate passes it."""

    def __post_init__(self) -> None:
        check_setting(0.0 <= self.threshold <= 1.0, "gate.threshold", "must lie in [0, 1] (every score does)")
        check_setting(self.score in ("p_max", "margin", "certainty"), "gate.score", f"unknown score {self.score!r}")
        check_setting(0.0 <= self.epsilon < 1.0, "gate.epsilon", "must lie in [0, 1); 0 = not calibrated")
        check_setting(0.0 <= self.watch_fraction <= 1.0, "gate.watch_fraction", "must lie in [0, 1]")
        check_setting(0.0 <= self.confidence < 1.0, "gate.confidence", "must lie in [0, 1); 0 = not calibrated")
        check_setting(0.0 <= self.calibrated_coverage <= 1.0, "gate.calibrated_coverage", "must lie in [0, 1]")


@dataclass(frozen=True)
class MemoryConfig:
    kv_budget_bytes: int = 0
    """KV bytes all sessions may hold; over it, idle sessions' KV is evicted (``eviction_policy``). 0 = a quarter
    of physical memory (on CUDA: what the engine's KV pool holds, less one full context of headroom)."""
    max_sessions: int = 4096
    """Open sessions at most; a START beyond it is rejected."""
    eviction_policy: str = "lru"
    """Which idle session's KV goes first over the budget: ``lru`` (least recently active) or ``next_use`` (the
    one whose next request is predicted farthest away, from its own past idle gaps; see ``prepos.memory``)."""
    max_log_tokens: int = 0
    """Most tokens one session's log may hold; 0 = the model's context length (a larger value is capped to it)."""

    def __post_init__(self) -> None:
        check_setting(self.kv_budget_bytes >= 0, "memory.kv_budget_bytes", "must be >= 0")
        check_setting(self.max_log_tokens >= 0, "memory.max_log_tokens", "must be >= 0")
        check_setting(self.eviction_policy in EVICTION_POLICY_NAMES, "memory.eviction_policy",
                      f"unknown policy {self.eviction_policy!r}; use {' or '.join(EVICTION_POLICY_NAMES)}")
        check_setting(self.max_sessions >= 1, "memory.max_sessions", "must be >= 1")

    def resolved_budget(self) -> int:
        if self.kv_budget_bytes:
            return self.kv_budget_bytes
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages // 4


@dataclass(frozen=True)
class LimitsConfig:
    max_tokens: int = 4096
    """Largest ``max_tokens`` a request may ask for."""
    max_delta_bytes: int = 1 << 20
    """Largest ``text_input`` in bytes."""
    max_delta_tokens: int = 1 << 18
    """Most ``input_ids`` in one request (the context length bounds the session's log further, later)."""
    max_role_bytes: int = 64
    """Largest ``role`` in bytes (the template's roles are short names)."""
    max_choices: int = 256
    """Most ``choices`` entries."""
    max_choice_bytes: int = 256
    """Largest ``choices`` entry in bytes."""
    max_stops: int = 16
    """Most ``stop`` strings."""
    max_stop_bytes: int = 256
    """Largest ``stop`` string in bytes."""
    max_top_k: int = 1 << 20
    """Largest ``top_k`` (any value at or above the vocabulary size means no cut)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_setting(1 <= getattr(self, f.name) <= INT32_MAX, f"limits.{f.name}", f"must be in [1, {INT32_MAX}]")


@dataclass(frozen=True)
class JournalConfig:
    dir: str = ""
    """Directory of the session journals (every accepted turn is written there before it is acknowledged; a
    restarted server or another replica reopens a session from it). Empty = no journal. Relative = to the model's
    directory. Replicas taking over each other's sessions share it (a volume)."""
    fsync: bool = False
    """fsync each journal write: survives a machine crash, not only a server crash, at a cost per turn."""
    expire_s: float = 86400.0
    """A journal of a session this server does not hold, not written for this long, is deleted (at start, then
    hourly): a session drained before a stop, or left by a crash, whose client never came back to resume it.
    0 = never. Must exceed the session idle timeout."""

    def __post_init__(self) -> None:
        check_setting(self.expire_s >= 0, "journal.expire_s", "must be >= 0 (0: never)")


@dataclass(frozen=True)
class PreposConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)

    def __post_init__(self) -> None:
        idle_s = self.scheduler.session_idle_timeout_s
        check_setting(self.journal.expire_s == 0 or self.journal.expire_s > idle_s, "journal.expire_s",
                      f"must exceed the session idle timeout ({idle_s:g} s; a journal is written only at accepted "
                      "turns), or be 0 (never)")
        check_setting(self.scheduler.default_max_tokens <= self.limits.max_tokens, "scheduler.default_max_tokens",
                      f"{self.scheduler.default_max_tokens} is above limits.max_tokens ({self.limits.max_tokens}), "
                      "so every request that leaves max_tokens out would be refused")

    def engine_dir(self, model_dir: str | Path) -> Path:
        return _in_model_dir(self.engine.dir, model_dir)

    def drain_file(self, model_dir: str | Path) -> Path | None:
        return _in_model_dir(self.scheduler.drain_file, model_dir) if self.scheduler.drain_file else None

    def journal_dir(self, model_dir: str | Path) -> Path | None:
        return _in_model_dir(self.journal.dir, model_dir) if self.journal.dir else None


def _in_model_dir(value: str, model_dir: str | Path) -> Path:
    """A path setting: absolute as it is, else relative to the model's directory."""
    path = Path(value)
    return path if path.is_absolute() else (Path(model_dir) / path).resolve()


_AREAS = {f.name: f.type for f in dataclasses.fields(PreposConfig)}
_T = TypeVar("_T")


def _parse_value(key: str, raw: str, kind: Any) -> Any:
    text = raw.strip()
    try:
        if kind in (bool, "bool"):
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if kind in (int, "int"):
            return int(text)
        if kind in (float, "float"):
            return float(text)
    except ValueError:
        raise ConfigError(f"{key}: cannot read {raw!r} as {getattr(kind, '__name__', kind)}") from None
    return text


def read_config(parameters: Mapping[str, str], environ: Mapping[str, str] | None = None) -> PreposConfig:
    """Build the configuration from model parameters and environment overrides.

    Raises :class:`ConfigError` naming the key for an unknown key or a bad value.
    """
    environ = os.environ if environ is None else environ
    classes = {area: globals()[_AREAS[area]] if isinstance(_AREAS[area], str) else _AREAS[area] for area in _AREAS}
    return read_settings(classes, parameters, environ, PreposConfig)


def environment_variable(key: str) -> str:
    """The environment variable that overrides the setting ``key`` (``memory.max_sessions``:
    ``PREPOS_MEMORY_MAX_SESSIONS``)."""
    return "PREPOS_" + key.replace(".", "_").upper()


INT32_MAX = 2**31 - 1  # the request inputs' counts (max_tokens, top_k) are INT32

TRITON_DEFAULT_IDLE_US = 1_000_000
"""Triton's ``max_sequence_idle_microseconds`` where config.pbtxt leaves it out."""


def setting_error(key: str, problem: str, environ: Mapping[str, str] | None = None) -> ConfigError:
    """:class:`ConfigError` ``<key>: <problem>``, naming the environment variable that set the value where one did."""
    environ = os.environ if environ is None else environ
    error = ConfigError(f"{key}: {problem}")
    variable = environment_variable(key)
    return _set_by(error, variable) if variable in environ else error


def check_model_config(model_config: Mapping[str, Any], parameters: Mapping[str, str],
                       environ: Mapping[str, str] | None = None) -> None:
    """What of the model's Triton configuration (config.pbtxt, as Triton hands it over) prepos cannot run with:
    more than one instance (each would load its own engine and write the same journals), or the sequence idle
    timeout Triton uses where config.pbtxt leaves it out (1 s: every session idle a second would end), unless
    the session idle timeout is set to it as well. Raises :class:`ConfigError` naming the setting."""
    environ = os.environ if environ is None else environ
    num_instances = sum(int(group.get("count", 1)) * max(1, len(group.get("gpus", [])))  # count is per GPU listed
                        for group in model_config.get("instance_group", []))
    if num_instances > 1:
        raise ConfigError(f"instance_group: {num_instances} instances; prepos runs one (it owns the engine and the "
                          "session journals): set count: 1")
    idle_us = model_config.get("sequence_batching", {}).get("max_sequence_idle_microseconds")
    said = environ.get(environment_variable("scheduler.session_idle_timeout_s"),
                       parameters.get("scheduler.session_idle_timeout_s"))
    try:
        meant = said is not None and float(said) == TRITON_DEFAULT_IDLE_US / 1e6
    except ValueError:
        return  # not a number: read_config names the bad value (blaming the idle default here misled)
    if idle_us is not None and int(idle_us) == TRITON_DEFAULT_IDLE_US and not meant:
        raise ConfigError("sequence_batching.max_sequence_idle_microseconds: 1 s, Triton's default where config.pbtxt "
                          "leaves it out: every session idle for a second would be ended; set it (600000000 for 10 "
                          "minutes), or set scheduler.session_idle_timeout_s to 1 as well to mean it")


def _set_by(error: ConfigError, variable: str) -> ConfigError:
    """``error`` saying which environment variable set its value: config.pbtxt does not show it."""
    return ConfigError(f"{error} (set by the environment variable {variable})")


def read_settings(classes: Mapping[str, type], parameters: Mapping[str, str], environ: Mapping[str, str],
                  combine: Callable[..., _T]) -> _T:
    """``combine`` of one settings dataclass per area (``classes``), from model parameters ``<area>.<field>`` and
    the environment variables ``PREPOS_<AREA>_<FIELD>``, which win. Raises :class:`ConfigError` naming the key of
    an unknown parameter or a bad value (and the environment variable, where one set it)."""
    values: dict[str, dict[str, Any]] = {area: {} for area in classes}
    for key, raw in parameters.items():
        area, _, name = key.partition(".")
        if area not in classes or name not in {f.name for f in dataclasses.fields(classes[area])}:
            known = (f"{area}.{f.name}" for area, cls in classes.items() for f in dataclasses.fields(cls))
            raise ConfigError(f"{key}: unknown parameter; known: {', '.join(sorted(known))}")
        values[area][name] = raw
    from_environ = {}  # key -> the environment variable that set it
    for area, cls in classes.items():
        variables = {environment_variable(f"{area}.{f.name}"): f.name for f in dataclasses.fields(cls)}
        for env_key in environ:
            if env_key.startswith(f"PREPOS_{area}_".upper()) and env_key not in variables:
                # a misspelt variable would otherwise change nothing, silently
                raise ConfigError(f"{env_key}: unknown environment variable for the {area} settings; known: "
                                  f"{', '.join(sorted(variables))}")
        for env_key, name in variables.items():
            if env_key in environ:
                values[area][name] = environ[env_key]
                from_environ[f"{area}.{name}"] = env_key
    try:
        built = {}
        for area, cls in classes.items():
            kinds = {f.name: f.type for f in dataclasses.fields(cls)}
            parsed = {name: _parse_value(f"{area}.{name}", raw, kinds[name]) for name, raw in values[area].items()}
            built[area] = cls(**parsed)
        return combine(**built)
    except ConfigError as err:  # say where a value from the environment came from
        key = str(err).partition(":")[0]
        if key in from_environ:
            raise _set_by(err, from_environ[key]) from None
        raise


def sequence_slots(model_config: Mapping[str, Any]) -> int | None:
    """Triton's sequence slots for the model (``sequence_batching.oldest.max_candidate_sequences``), or None
    where the model configuration sets none."""
    oldest = model_config.get("sequence_batching", {}).get("oldest", {})
    slots = oldest.get("max_candidate_sequences")
    return int(slots) if slots else None


def check_sequence_slots(memory: MemoryConfig, slots: int | None, environ: Mapping[str, str] | None = None) -> None:
    """Triton holds a START past its sequence slots in a backlog until a slot frees, where prepos could not
    answer it, so ``memory.max_sessions`` must stay below them: the START past it is then rejected at once
    (RESOURCE_EXHAUSTED), and the slots left over hold rejected STARTs until their END or idle timeout."""
    if slots is not None and memory.max_sessions >= slots:
        raise setting_error(
            "memory.max_sessions", f"{memory.max_sessions} must be below Triton's sequence slots "
            f"(sequence_batching.oldest.max_candidate_sequences = {slots}); past them Triton queues a new START "
            "instead of passing it on, so it would wait rather than be rejected", environ)


def idle_timeout_mismatch(scheduler: SchedulerConfig, sequence_idle_s: float | None) -> str | None:
    """What goes wrong when prepos's session idle timeout is not Triton's (``max_sequence_idle_microseconds``, in
    seconds; None: not set), else None."""
    if not sequence_idle_s or scheduler.session_idle_timeout_s == sequence_idle_s:
        return None
    ours = f"scheduler.session_idle_timeout_s ({scheduler.session_idle_timeout_s:g} s)"
    theirs = f"Triton's sequence_batching.max_sequence_idle_microseconds ({sequence_idle_s:g} s)"
    if scheduler.session_idle_timeout_s < sequence_idle_s:
        return (f"{ours} is shorter than {theirs}: a session prepos closes when idle keeps its Triton sequence, a "
                "sequence slot, until Triton's timeout, and a stop meanwhile waits for it; set both alike")
    return (f"{ours} is longer than {theirs}: Triton ends an idle session's sequence first, and refuses its next "
            "request without START (the Python client sends it again with START and resume, which continues it); "
            "set both alike")


def known_keys() -> list[str]:
    keys = []
    for area, cls in _AREAS.items():
        cls = globals()[cls] if isinstance(cls, str) else cls
        keys += [f"{area}.{f.name}" for f in dataclasses.fields(cls)]
    return keys
