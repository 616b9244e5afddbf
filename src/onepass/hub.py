"""Whether the Hugging Face hub may be reached: one reading of the offline variables.

Why this module exists: ``HF_HUB_OFFLINE`` means no network for every HF
library, and each library has its own switch as well (``TRANSFORMERS_OFFLINE``
for models and tokenizers, ``HF_DATASETS_OFFLINE`` for data sets), each true
when set to ``1``, ``true``, ``yes`` or ``on`` (any case), as huggingface_hub
reads them. Every place that decides whether to try the hub asks here, so a
tokenizer, a model and a data set agree, and an error can say which variable
is set. The variables are read at each call (a test or a script may set them
late).

    >>> hub_offline(environ={"HF_HUB_OFFLINE": "true"})
    True
    >>> hub_offline("datasets", environ={"TRANSFORMERS_OFFLINE": "1"})
    False
    >>> offline_reason(environ={"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "yes"})
    'TRANSFORMERS_OFFLINE=yes'
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TRUE_VALUES = ("1", "true", "yes", "on")
OFFLINE_VARIABLES: dict[str, tuple[str, ...]] = {
    "models": ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"),  # models, tokenizers, configs
    "datasets": ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"),
}


def _set(kind: str, environ: Mapping[str, str] | None) -> list[str]:
    """The offline variables of ``kind`` set to a true value, as ``NAME=value``."""
    if kind not in OFFLINE_VARIABLES:
        raise ValueError(f"unknown hub kind {kind!r}; have {', '.join(OFFLINE_VARIABLES)}")
    env = os.environ if environ is None else environ
    return [f"{k}={env[k]}" for k in OFFLINE_VARIABLES[kind] if env.get(k, "").strip().lower() in TRUE_VALUES]


def hub_offline(kind: str = "models", *, environ: Mapping[str, str] | None = None) -> bool:
    """True when the hub must not be used for ``kind`` (``models`` or ``datasets``)."""
    return bool(_set(kind, environ))


def offline_reason(kind: str = "models", *, environ: Mapping[str, str] | None = None) -> str:
    """Which variables make the hub offline (``HF_HUB_OFFLINE=1``), for an error message; "" if none."""
    return ", ".join(_set(kind, environ))
