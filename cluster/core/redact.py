"""The one redaction: what of a job's config and of a message may be written anywhere (storage, events,
trackers, the export sidecar, notifications, command lines, the console).

What is hidden (key names stay, values become ``***``; docs/cluster.md, "Security"):

- every value of ``scaling.env`` except the harmless names of :data:`HARMLESS_ENV` (thread counts, NCCL and
  gloo tuning, ...), and even those when the name looks secret;
- every value of ``storage.options``, at any depth;
- the value of any key that looks secret (:func:`secret_key`: token, secret, password, key, credential,
  auth, ...) at any depth of ``task_args`` (and anywhere else in the config);
- in every URL anywhere in the config: its user and password, the values of its query string;
  ``tracking.notify_url``'s path too (a webhook's path is its secret);
- in free text: every value hidden above (remembered for the life of the process), URLs as above,
  ``name=value`` / ``name: value`` where the name looks secret, and ``Bearer <token>``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import Any

MASK = "***"

HARMLESS_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "NCCL_*",
    "TORCH_NCCL_*",
    "GLOO_*",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_CPP_LOG_LEVEL",
    "TORCH_SHOW_CPP_STACKTRACES",
    "TORCH_LOGS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUBLAS_WORKSPACE_CONFIG",
    "PYTHONHASHSEED",
    "PYTHONUNBUFFERED",
    "PYTHONFAULTHANDLER",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "WANDB_MODE",
    "LOGLEVEL",
)
"""``scaling.env`` names whose values are shown (``*``: any ending). Any other name's value is hidden, and so
is a listed one whose name looks secret (``NCCL_..._TOKEN``)."""

_SECRET_WORDS = r"token|secret|passw|pwd|key|credential|auth|signature|cookie|connection_?string"
_SECRET_KEY = re.compile(_SECRET_WORDS, re.IGNORECASE)
_PAIR_RE = re.compile(
    rf"(?i)\b([\w.-]*(?:{_SECRET_WORDS})[\w.-]*)(\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^\s,;&\"']+)"
)
_BEARER_RE = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{4,}")
_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")
_MIN_LEN = 4  # a value passed to redact_text explicitly (a storage's options) is hidden from this length
_MIN_KNOWN = 6  # a remembered value, in every message: shorter ones ("true", "mnist") would mask too much

_known: set[str] = set()
_lock = threading.Lock()


def secret_key(name: str) -> bool:
    """A key whose value is a secret by its name (``HF_TOKEN``, ``aws_secret_access_key``, ``password``)."""
    return bool(_SECRET_KEY.search(name))


def harmless_env(name: str) -> bool:
    """An environment variable of :data:`HARMLESS_ENV` whose value may be shown."""
    listed = any(name == h or (h.endswith("*") and name.startswith(h[:-1])) for h in HARMLESS_ENV)
    return listed and not secret_key(name)


def redact_url(url: str) -> str:
    """``url`` without its user and password (``***@``) and with each query value ``***`` (names stay)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, tail = _split_authority(rest)
    if "@" in authority:
        authority = MASK + "@" + authority.rpartition("@")[2]
    path, q, query = tail.partition("?")
    query, h, fragment = query.partition("#")
    if q:
        query = "&".join(
            p.partition("=")[0] + "=" + MASK if "=" in p else (MASK if p else p) for p in query.split("&")
        )
    if h:
        fragment = MASK
    return f"{scheme}://{authority}{slash}{path}{q}{query}{h}{fragment}"


def _split_authority(rest: str) -> tuple[str, str, str]:
    """(authority, the character that ends it or "", the rest from there on)."""
    ends = [i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0]
    if not ends:
        return rest, "", ""
    i = min(ends)
    return (rest[:i], "/", rest[i + 1 :]) if rest[i] == "/" else (rest[:i], "", rest[i:])


def _url_secrets(url: str) -> list[str]:
    """The parts of ``url`` that :func:`redact_url` hides (to find them again in free text)."""
    _, sep, rest = url.partition("://")
    if not sep:
        return []
    authority, _, tail = _split_authority(rest)
    found = []
    if "@" in authority:
        found += authority.rpartition("@")[0].split(":")
    query = tail.partition("?")[2].partition("#")[0]
    found += [p.partition("=")[2] for p in query.split("&")]
    return [s for s in found if len(s) >= _MIN_LEN]


def redact_tree(data: Any, everything: bool = False, known: bool = True) -> Any:
    """A copy of a JSON-like value (an event's record, a config) with every secret value ``***``: the value
    of a key that looks secret (a dict or list under it keeps its keys, its leaves ``***``) and each string
    as :func:`redact_text` (``known``: with the remembered values). ``everything``: every leaf is ``***``."""
    if isinstance(data, dict):
        return {k: redact_tree(v, everything or secret_key(str(k)), known) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_tree(v, everything, known) for v in data]
    if everything and data is not None:
        return MASK
    return redact_text(data, known=known) if isinstance(data, str) else data


def redact_config(data: dict[str, Any]) -> dict[str, Any]:
    """The redacted copy of a job's config (``dataclasses.asdict`` of a ``JobConfig``), as the module
    docstring says. The values it hides are remembered (:func:`remember`): a message that quotes one later
    is masked too."""
    remember(secret_values(data))
    out = redact_tree(data, known=False)  # by structure: a remembered "mnist" must not hide a dataset name
    scaling, storage, tracking = out.get("scaling"), out.get("storage"), out.get("tracking")
    if isinstance(scaling, dict) and isinstance(scaling.get("env"), dict):
        scaling["env"] = {k: v if harmless_env(k) else MASK for k, v in data["scaling"]["env"].items()}
    if isinstance(storage, dict) and isinstance(storage.get("options"), dict):
        storage["options"] = redact_tree(data["storage"]["options"], everything=True)
    if isinstance(tracking, dict):
        url = tracking.get("notify_url")
        if isinstance(url, str) and "://" in url:  # a webhook's path is its secret (env:NAME stays)
            scheme, _, rest = url.partition("://")
            tracking["notify_url"] = f"{scheme}://{_split_authority(rest)[0].rpartition('@')[2]}/{MASK}"
    return out


def secret_values(data: dict[str, Any]) -> list[str]:
    """Every value :func:`redact_config` hides in ``data`` (strings of at least 4 characters)."""
    found: list[str] = []

    def walk(value: Any, hide: bool) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, hide or secret_key(str(k)))
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, hide)
        elif isinstance(value, str):  # numbers and flags under a secret key are not worth a search
            if hide:
                found.append(value)
            found.extend(s for m in _URL_RE.finditer(value) for s in _url_secrets(m.group(0)))

    walk(data, False)
    scaling, storage = data.get("scaling") or {}, data.get("storage") or {}
    walk({k: v for k, v in (scaling.get("env") or {}).items() if not harmless_env(k)}, True)
    walk(storage.get("options") or {}, True)
    url = (data.get("tracking") or {}).get("notify_url")
    if isinstance(url, str) and "://" in url:
        walk(url, True)
        found.append(url.partition("://")[2].partition("/")[2])
    return [s for s in found if len(s) >= _MIN_LEN]


def remember(values: Iterable[str]) -> None:
    """Hide these values in every later :func:`redact_text` of this process (a job's secrets: once its
    config was redacted, no message of the process shows them)."""
    with _lock:
        _known.update(v for v in values if isinstance(v, str) and len(v) >= _MIN_KNOWN)


def redact_text(text: str, values: Iterable[Any] = (), known: bool = True) -> str:
    """``text`` with every secret hidden: ``values`` (strings, or dicts of them at any depth, e.g. a
    storage's options), the remembered values (:func:`remember`; unless not ``known``), URLs' users,
    passwords and query values, ``name=value`` / ``name: value`` where the name looks secret,
    ``Bearer <token>``."""
    hide: set[str] = set(_known) if known else set()
    _collect(values, hide)
    for value in sorted(hide, key=len, reverse=True):  # longest first: a value may contain another
        text = text.replace(value, MASK)
    text = _URL_RE.sub(lambda m: redact_url(m.group(0)), text)
    text = _BEARER_RE.sub(lambda m: f"{m.group(1)} {MASK}", text)
    return _PAIR_RE.sub(lambda m: f"{m.group(1)}={MASK}" if m.group(3) != MASK else m.group(0), text)


def _collect(values: Any, into: set[str]) -> None:
    if isinstance(values, dict):
        values = values.values()
    if isinstance(values, str):
        if len(values) >= _MIN_LEN:
            into.add(values)
        return
    if isinstance(values, Iterable):
        for v in values:
            _collect(v, into)
