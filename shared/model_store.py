"""A model's tokenizer files served from the bus (a NATS JetStream object store).

A worker publishes its model directory's tokenizer files (the vocabulary, the
tokenizer config, the chat template...) as one object named
`<model>/<revision>`, the revision being a hash of the files' content. Its
registration names that object, so an ingress on another host, without the
model directory, fetches the files into a cache directory of its own and
tokenizes exactly as the worker's engine does. The same content always has
the same name: a worker that restarts publishes nothing new, and a cached
copy never goes stale.

The pure parts (`content_revision`, `pack`, `unpack`, `cache_entry`) need no
I/O; `ModelFilePublisher` and `ModelFileCache` talk to JetStream.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.js.api import ObjectStoreConfig
from nats.js.object_store import ObjectStore

from contracts.messages import WorkerRegistration
from contracts.model_files import MODEL_FILES_BUCKET, TokenizerFiles
from shared.tokenizer import HF_PREFIX, Tokenizer
from shared.tokenizer_spec import load_tokenizer

log = structlog.get_logger("kvlane.model_store")

# What shared/tokenizer.py reads, and what a client of the model may want beside it.
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
REQUIRED_FILE = "tokenizer.json"
# Far above any real tokenizer (tens of MB at most), far below what would hurt a host.
MAX_BUNDLE_BYTES = 256 * 1024 * 1024
_SLUG_RE = re.compile(r"[^A-Za-z0-9._-]+")
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(TokenizerFiles)


class ModelFilesError(ValueError):
    """Tokenizer files that cannot be published, fetched or trusted (the message says which and why)."""


def content_revision(files: Mapping[str, bytes]) -> str:
    """A hash of the files' names and bytes, whatever order they come in."""
    digest = hashlib.sha256()
    for name in sorted(files):
        content = files[name]
        digest.update(f"{name}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()[:32]


def object_name(model: str, revision: str) -> str:
    return f"{model}/{revision}"


def pack(model: str, files: Mapping[str, bytes]) -> tuple[str, bytes]:
    """The object's name and bytes for `files` of `model`."""
    _check_files(files)
    revision = content_revision(files)
    return object_name(model, revision), _ENCODER.encode(TokenizerFiles(model=model, revision=revision, files=dict(files)))


def unpack(name: str, data: bytes) -> dict[str, bytes]:
    """The files an object holds, checked: the names a tokenizer uses only, and the content its name promises."""
    if len(data) > MAX_BUNDLE_BYTES:
        raise ModelFilesError(f"{name}: {len(data)} bytes, more than a tokenizer's files ever take ({MAX_BUNDLE_BYTES})")
    try:
        bundle = _DECODER.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # msgspec lets a bad UTF-8 string through as the latter
        raise ModelFilesError(f"{name}: not a tokenizer file set: {exc}") from exc
    _check_files(bundle.files)
    if object_name(bundle.model, bundle.revision) != name:
        raise ModelFilesError(f"{name}: the object holds {object_name(bundle.model, bundle.revision)} instead")
    if content_revision(bundle.files) != bundle.revision:
        raise ModelFilesError(f"{name}: the files do not match their revision")
    return dict(bundle.files)


def _check_files(files: Mapping[str, bytes]) -> None:
    # Only known plain names: a file set must never write outside its own directory.
    unknown = sorted(set(files) - set(TOKENIZER_FILE_NAMES))
    if unknown:
        raise ModelFilesError(f"unexpected tokenizer files {unknown} (known: {', '.join(TOKENIZER_FILE_NAMES)})")
    if REQUIRED_FILE not in files:
        raise ModelFilesError(f"no {REQUIRED_FILE} among the tokenizer files")


def cache_entry(name: str) -> str:
    """The cache directory's entry for an object: readable, and distinct for distinct names."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return f"{_SLUG_RE.sub('_', name)[:80]}-{digest}"


def read_tokenizer_files(directory: str | Path) -> dict[str, bytes]:
    """The tokenizer files a model directory has (`ModelFilesError` without a tokenizer.json)."""
    path = Path(directory)
    files = {name: (path / name).read_bytes() for name in TOKENIZER_FILE_NAMES if (path / name).is_file()}
    if REQUIRED_FILE not in files:
        raise ModelFilesError(f"{path} has no {REQUIRED_FILE}")
    return files


async def open_bucket(nc: NatsClient, create: bool) -> ObjectStore:
    """The model-files bucket; `create`: made if missing, replicated on three servers where the cluster has them."""
    js = nc.jetstream()
    try:
        return await js.object_store(MODEL_FILES_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        if not create:
            raise
    last_error: Exception | None = None
    # A single server refuses three replicas, a cluster of fewer than three cannot place them.
    for replicas in (3, 1):
        try:
            return await js.create_object_store(MODEL_FILES_BUCKET, ObjectStoreConfig(
                description="kvlane model files (tokenizers, chat templates) by model and revision", replicas=replicas))
        except nats.js.errors.ServiceUnavailableError:
            raise  # a cluster still electing its leader: try again later, with three replicas
        except nats.js.errors.APIError as exc:
            last_error = exc
    # Another worker may have created it meanwhile, with the replicas that worked for it.
    try:
        return await js.object_store(MODEL_FILES_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        raise ModelFilesError(f"cannot create the {MODEL_FILES_BUCKET} object store: {last_error}") from last_error


async def publish_tokenizer(nc: NatsClient, model: str, directory: str | Path, timeout_s: float = 30.0) -> str:
    """Put `directory`'s tokenizer files in the bucket (unless there already); returns the object's name.

    Retries until `timeout_s`: a JetStream cluster that has just started
    answers "unavailable" until it has elected its leader.
    """
    # The server says in its INFO whether it runs JetStream: without it, there is nothing to retry.
    # `_server_info` is nats-py's private copy of that INFO: tests/unit/test_dependency_internals.py pins it.
    if not (getattr(nc, "_server_info", None) or {}).get("jetstream"):
        raise ModelFilesError(f"cannot publish the tokenizer of {model}: JetStream is not enabled on the NATS server")
    files = await asyncio.to_thread(read_tokenizer_files, directory)
    name, data = pack(model, files)
    deadline = time.monotonic() + timeout_s
    delay = 0.2
    while True:
        try:
            store = await open_bucket(nc, create=True)
            try:
                await store.get_info(name)
                return name  # the same content is there already
            except nats.js.errors.ObjectNotFoundError:
                pass
            await store.put(name, data)
            log.info("tokenizer_published", model=model, object=name, bytes=len(data))
            return name
        except (nats.errors.Error, asyncio.TimeoutError, ModelFilesError) as exc:
            if isinstance(exc, nats.js.errors.ServiceUnavailableError) and exc.code is None:
                # Nobody answers the JetStream API at all (a 503 with a code is a cluster still electing).
                raise ModelFilesError(f"cannot publish the tokenizer of {model}: JetStream is not enabled on the NATS server") from exc
            if time.monotonic() + delay > deadline:
                raise ModelFilesError(f"cannot publish the tokenizer of {model} to the bus: {type(exc).__name__}: {exc}") from exc
            log.info("tokenizer_publish_retry", model=model, error=f"{type(exc).__name__}: {exc}", retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def with_published_tokenizer(nc: NatsClient, registration: WorkerRegistration) -> WorkerRegistration:
    """`registration` naming its tokenizer's files on the bus, once published there.

    A worker whose tokenizer is a model directory's publishes it before it
    registers, so an ingress never sees the worker without the files. Where
    that fails (JetStream off, or not permitted), the worker still serves:
    an ingress that reads the directory itself needs no files on the bus.
    """
    if not registration.tokenizer.startswith(HF_PREFIX):
        return registration
    directory = registration.tokenizer[len(HF_PREFIX):]
    try:
        name = await publish_tokenizer(nc, registration.model, directory)
    except ModelFilesError as exc:
        log.warning("tokenizer_not_on_bus", model=registration.model, error=str(exc),
                    consequence="only an ingress that can read the model directory serves this model")
        return registration
    except OSError as exc:
        log.warning("tokenizer_not_on_bus", model=registration.model, error=f"cannot read {directory}: {exc}")
        return registration
    return msgspec.structs.replace(registration, tokenizer_files=name)


class ModelFileCache:
    """Tokenizer files fetched from the bus into a local directory, one subdirectory per object."""

    def __init__(self, nc: NatsClient, directory: str | Path) -> None:
        self._nc = nc
        self.directory = Path(directory)

    async def fetch(self, name: str) -> Path:
        """The local directory holding object `name`'s files, fetched unless cached already."""
        target = self.directory / cache_entry(name)
        if (target / REQUIRED_FILE).is_file():
            return target
        try:
            store = await open_bucket(self._nc, create=False)
            result = await store.get(name)
        except nats.js.errors.BucketNotFoundError as exc:
            raise ModelFilesError(f"no {MODEL_FILES_BUCKET} object store on the bus (is JetStream on?)") from exc
        except nats.js.errors.ObjectNotFoundError as exc:
            raise ModelFilesError(f"no object {name} in the {MODEL_FILES_BUCKET} object store") from exc
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise ModelFilesError(f"cannot fetch {name} from the bus: {type(exc).__name__}: {exc}") from exc
        files = unpack(name, result.data)
        try:
            await asyncio.to_thread(write_file_set, target, files, REQUIRED_FILE)
        except OSError as exc:
            raise ModelFilesError(f"cannot write {name}'s files under {self.directory}: {exc}") from exc
        log.info("tokenizer_fetched", object=name, directory=str(target), bytes=len(result.data))
        return target


def write_file_set(target: Path, files: Mapping[str, bytes], marker: str) -> None:
    """Write `files` as directory `target`, whose file `marker` says a set is there (one that is, stays)."""
    # Written beside and renamed: a reader (or a second process sharing the
    # cache) sees the whole set or nothing.
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for file_name, content in files.items():
            (staging / file_name).write_bytes(content)
        try:
            staging.rename(target)
        except OSError:
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvlane" / "model-files"


async def load_served_tokenizer(spec: str, files: str, cache: ModelFileCache | None) -> Tokenizer:
    """The tokenizer a worker advertises (`spec`, and `files`: the object it published, if any).

    From the model directory where this host can read it, else from the
    files on the bus. `ValueError` when neither works.
    """
    if spec.startswith(HF_PREFIX) and files and cache is not None:
        directory = spec[len(HF_PREFIX):]
        if not os.access(Path(directory) / REQUIRED_FILE, os.R_OK):
            local = await cache.fetch(files)
            return await asyncio.to_thread(load_tokenizer, HF_PREFIX + str(local))
    return await asyncio.to_thread(load_tokenizer, spec)
