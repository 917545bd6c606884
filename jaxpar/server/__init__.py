"""The OpenAI-compatible HTTP server over a :class:`~jaxpar.engine.ContinuousBatcher`.

:func:`create_app` builds the FastAPI app of a :class:`Service` (a batcher and the
:class:`ServedModel` it runs: name, tokenizer, chat template, EOS, default sampling);
``jaxpar serve`` runs it with uvicorn. ``GET /metrics`` serves Prometheus metrics
(:mod:`jaxpar.server._metrics`). :class:`TextStream` is the incremental detokeniser with
stop strings that streaming uses.
"""

from jaxpar.server._app import create_app
from jaxpar.server._detokenize import TextStream
from jaxpar.server._efficiency import Efficiency, resolve_hardware
from jaxpar.server._errors import APIError
from jaxpar.server._service import Job, ServedModel, Service, ServiceStats

__all__ = [
    "APIError",
    "Efficiency",
    "Job",
    "ServedModel",
    "Service",
    "ServiceStats",
    "TextStream",
    "create_app",
    "resolve_hardware",
]
