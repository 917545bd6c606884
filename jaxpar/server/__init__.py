"""The OpenAI-compatible HTTP server over a :class:`~jaxpar.engine.ContinuousBatcher`.

:func:`create_app` builds the FastAPI app of a :class:`Service` (a batcher and the
:class:`ServedModel` it runs: name, tokenizer, chat template, EOS, default sampling);
``jaxpar serve`` runs it with uvicorn. ``GET /metrics`` serves Prometheus metrics
(:mod:`jaxpar.server._metrics`, and again under vLLM's names), ``GET /health`` readiness
and ``GET /live`` liveness (:mod:`jaxpar.server._health`); ``--kv-events-config``
publishes the prefix cache's pages as vLLM's KV events (:class:`KVEventPublisher`).
:class:`TextStream` is the incremental detokeniser with stop strings that streaming uses.
Tool calling and reasoning parsers (``--tool-call-parser``, ``--reasoning-parser``):
:mod:`jaxpar.server._tools` (:func:`tool_settings` checks the flags against a checkpoint);
GPT-OSS through ``openai-harmony``: :mod:`jaxpar.server._harmony` (:func:`uses_harmony`).
"""

from jaxpar.server._app import create_app
from jaxpar.server._detokenize import TextStream
from jaxpar.server._efficiency import Efficiency, resolve_hardware
from jaxpar.server._errors import APIError
from jaxpar.server._harmony import uses_harmony
from jaxpar.server._kv_events import (
    KVEventPublisher,
    KVEventsConfig,
    event_types,
    parse_kv_events_config,
)
from jaxpar.server._service import Job, ServedModel, Service, ServiceStats
from jaxpar.server._tools import ToolSettings, tool_settings

__all__ = [
    "APIError",
    "KVEventPublisher",
    "KVEventsConfig",
    "event_types",
    "parse_kv_events_config",
    "Efficiency",
    "Job",
    "ServedModel",
    "Service",
    "ServiceStats",
    "TextStream",
    "ToolSettings",
    "create_app",
    "resolve_hardware",
    "tool_settings",
    "uses_harmony",
]
