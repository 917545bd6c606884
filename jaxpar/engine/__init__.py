"""The engine: mesh placement, jit-compiled prefill and decode, KV-cache handoff, generate,
and continuous batching over a paged KV cache (``ContinuousBatcher``, sized by ``KVBudget``).

``pipeline`` is the pipeline schedule's module (its stage-local steps, one by one).
"""

from jaxpar.engine import _pipeline as pipeline
from jaxpar.engine._abstract import AbstractEngine, run_form
from jaxpar.engine._admission import Admission, merge_sampling
from jaxpar.engine._batching import BatcherStats, ContinuousBatcher
from jaxpar.engine._cache import KVEventSink
from jaxpar.engine._compile_cache import (
    CompileCount,
    default_compile_cache,
    enable_compile_cache,
)
from jaxpar.engine._distributed import PEER_LOST_EXIT_STATUS, ProcessInfo, peer_failures
from jaxpar.engine._distributed import initialize as initialize_distributed
from jaxpar.engine._efficiency import WINDOW_STEPS, PhaseLog, StepFacts, StepLog
from jaxpar.engine._engine import Generation, InferenceEngine, prompt_bucket
from jaxpar.engine._filters import CANDIDATES as SAMPLING_CANDIDATES
from jaxpar.engine._filters import RADIX_ROUNDS as SAMPLING_RADIX_ROUNDS
from jaxpar.engine._grammar import Constraint, Grammar, Grammars, Matcher, allow_only
from jaxpar.engine._group_transfer import check_groups, moves_globally
from jaxpar.engine._kv_budget import (
    CPU_KV_TOKENS,
    GroupPages,
    KVBudget,
    batch_shards,
    cache_fraction,
    kv_cache_tokens_for,
    pages_per_shard,
    sequence_pages,
)
from jaxpar.engine._kv_budget import MEMORY_FRACTION as KV_MEMORY_FRACTION
from jaxpar.engine._kv_budget import PAGE_SIZE as KV_PAGE_SIZE
from jaxpar.engine._layouts import Layouts
from jaxpar.engine._load import compute_dtype, engine_from_hf
from jaxpar.engine._lockstep import announce_ready, wait_ready
from jaxpar.engine._logprobs import MAX_TOP_LOGPROBS, Logprobs, TokenLogprob
from jaxpar.engine._pages import PagePool, PageTable
from jaxpar.engine._penalties import History, Seen
from jaxpar.engine._placement import put_global, to_host
from jaxpar.engine._pulse import DEFAULT_STALL_S, Pulse
from jaxpar.engine._requests import FINISH_REASONS, Request, RequestStream
from jaxpar.engine._sampling import RowSampling, Sampling, select_rows
from jaxpar.engine._serving_programs import SERVING_PROGRAMS, ServingPrograms, program_phase
from jaxpar.engine._slots import FirstTokens, Inserted, Slots, SlotSteps
from jaxpar.engine._spec_offline import generate_speculative
from jaxpar.engine._speculative import SpecStats, SpeculativeConfig
from jaxpar.engine._steps import Steps
from jaxpar.engine._text import (
    ChatTemplate,
    Encoded,
    GenerationDefaults,
    Tokenizer,
    chat_template,
    encode,
    generation_defaults,
    load_tokenizer,
)
from jaxpar.engine._vocab import mask_padded

__all__ = [
    "Admission",
    "check_groups",
    "moves_globally",
    "CPU_KV_TOKENS",
    "DEFAULT_STALL_S",
    "PEER_LOST_EXIT_STATUS",
    "FINISH_REASONS",
    "KV_MEMORY_FRACTION",
    "KV_PAGE_SIZE",
    "MAX_TOP_LOGPROBS",
    "WINDOW_STEPS",
    "ChatTemplate",
    "Constraint",
    "Grammar",
    "Grammars",
    "Matcher",
    "CompileCount",
    "Encoded",
    "FirstTokens",
    "GenerationDefaults",
    "History",
    "Inserted",
    "SAMPLING_CANDIDATES",
    "SAMPLING_RADIX_ROUNDS",
    "SERVING_PROGRAMS",
    "ServingPrograms",
    "AbstractEngine",
    "BatcherStats",
    "ContinuousBatcher",
    "SpecStats",
    "SpeculativeConfig",
    "generate_speculative",
    "Generation",
    "InferenceEngine",
    "prompt_bucket",
    "KVBudget",
    "KVEventSink",
    "Layouts",
    "Logprobs",
    "PagePool",
    "PhaseLog",
    "PageTable",
    "GroupPages",
    "cache_fraction",
    "kv_cache_tokens_for",
    "sequence_pages",
    "ProcessInfo",
    "Pulse",
    "Request",
    "RequestStream",
    "RowSampling",
    "Sampling",
    "Seen",
    "SlotSteps",
    "Slots",
    "StepFacts",
    "StepLog",
    "Steps",
    "TokenLogprob",
    "Tokenizer",
    "allow_only",
    "batch_shards",
    "chat_template",
    "compute_dtype",
    "default_compile_cache",
    "enable_compile_cache",
    "encode",
    "engine_from_hf",
    "generation_defaults",
    "load_tokenizer",
    "mask_padded",
    "merge_sampling",
    "pages_per_shard",
    "program_phase",
    "select_rows",
    "announce_ready",
    "initialize_distributed",
    "peer_failures",
    "wait_ready",
    "pipeline",
    "put_global",
    "run_form",
    "to_host",
]
