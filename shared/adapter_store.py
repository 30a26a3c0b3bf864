"""LoRA adapters served from the bus (the JetStream object store that carries tokenizers).

An operator publishes an adapter once (`kvlane adapters add NAME PATH --base
MODEL`): its PEFT files become one object, `adapters/<name>/<revision>`, the
revision a hash of the files' content, with the base model and the adapter's
size in the object's description so that a listing needs no download. An
ingress resolves a request's `model` to an adapter from that listing; a
worker fetches the object on the adapter's first use, checks it against its
revision and its own base model's shapes, and loads it. No host needs a
shared filesystem, and a worker that never serves an adapter never fetches it.

The pure parts (`pack_adapter`, `unpack_adapter`, `check_adapter_files`,
`check_against_base`) need no I/O; the rest talks to JetStream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import struct
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import msgspec
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.js.api import ObjectMeta

from contracts.model_files import ADAPTER_PREFIX, AdapterFiles, AdapterRef
from shared.config import NatsSettings
from shared.credentials import nats_options
from shared.model_store import ModelFilesError, cache_entry, content_revision, open_bucket, write_file_set

log = structlog.get_logger("kvlane.adapter_store")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILE_NAMES = (CONFIG_FILE, WEIGHTS_FILE)
# Far above a LoRA adapter of a 70B model at rank 64 (about 1 GB is the largest seen in practice).
MAX_ADAPTER_BYTES = 2 * 1024 * 1024 * 1024
# What a client may name as `model`: no path separators beyond the object's own, nothing a URL would mangle.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(AdapterFiles)
# safetensors dtypes' item sizes, for checking that the header's offsets match the tensors' shapes.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}
# vLLM's projection names in a decoder layer, with (input, output) sizes as functions of the base's config.
_PROJECTIONS = {
    "q_proj": lambda c: (c.hidden, c.heads * c.head_dim),
    "k_proj": lambda c: (c.hidden, c.kv_heads * c.head_dim),
    "v_proj": lambda c: (c.hidden, c.kv_heads * c.head_dim),
    "o_proj": lambda c: (c.heads * c.head_dim, c.hidden),
    "gate_proj": lambda c: (c.hidden, c.intermediate),
    "up_proj": lambda c: (c.hidden, c.intermediate),
    "down_proj": lambda c: (c.intermediate, c.hidden),
}
_MLP = frozenset({"gate_proj", "up_proj", "down_proj"})
_LORA_TENSOR = re.compile(r"\.layers\.(\d+)\.[A-Za-z_]+\.([A-Za-z_]+)\.lora_([AB])\.weight$")


class AdapterError(ModelFilesError):
    """An adapter that cannot be published, fetched or loaded (the message says which and why)."""

    status = 422  # what a request for it is answered with: the adapter exists, but cannot be served


class NoObjectStore(AdapterError):
    """The bus runs no JetStream, so no adapter can be published or served."""


class AdapterGone(AdapterError):
    """An adapter removed from the bus after a request for it was routed."""

    status = 404


class AdapterFacts(msgspec.Struct, frozen=True):
    """What a checked adapter is: its rank, the modules it adapts, its tensors' bytes."""

    rank: int
    target_modules: tuple[str, ...]
    tensor_bytes: int


class AdapterInfo(msgspec.Struct, frozen=True):
    """One adapter as a listing shows it (without its files)."""

    name: str
    base: str
    revision: str
    rank: int
    tensor_bytes: int
    created: int = 0

    @property
    def object(self) -> str:
        return adapter_object_name(self.name, self.revision)

    @property
    def ref(self) -> AdapterRef:
        return AdapterRef(self.name, self.object)


def check_adapter_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise AdapterError(f"adapter name {name!r} is not allowed: 1-128 letters, digits, '.', '_', ':' or '-', "
                           "starting with a letter or digit")
    return name


def adapter_object_name(name: str, revision: str) -> str:
    return f"{ADAPTER_PREFIX}{name}/{revision}"


def _safetensors_header(data: bytes) -> dict:
    """The safetensors header, checked: every tensor's byte range matches its shape and lies in the file."""
    if len(data) < 8:
        raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file: {len(data)} bytes")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise AdapterError(f"{WEIGHTS_FILE} is truncated: its header claims {length} bytes")
    try:
        header = json.loads(data[8:8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE} has an unreadable header: {exc}") from exc
    if not isinstance(header, dict):
        raise AdapterError(f"{WEIGHTS_FILE} has an unreadable header")
    body = len(data) - 8 - length
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            size = _DTYPE_BYTES[dtype] * math.prod(shape)
        except (KeyError, TypeError, ValueError) as exc:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {tensor} has a malformed entry") from exc
        if not 0 <= start <= end <= body or end - start != size:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {tensor} ({dtype} {shape}) does not match its bytes")
    return header


def _config(files: Mapping[str, bytes]) -> dict:
    try:
        config = json.loads(files[CONFIG_FILE])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    return config


def check_adapter_files(files: Mapping[str, bytes]) -> AdapterFacts:
    """A PEFT LoRA adapter's files, checked on their own: the config, the tensors, A and B of one rank."""
    unknown = sorted(set(files) - set(ADAPTER_FILE_NAMES))
    if unknown:
        raise AdapterError(f"unexpected adapter files {unknown} (an adapter is {' and '.join(ADAPTER_FILE_NAMES)})")
    missing = [name for name in ADAPTER_FILE_NAMES if name not in files]
    if missing:
        raise AdapterError(f"the adapter has no {' and no '.join(missing)}")
    config = _config(files)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type {config.get('peft_type')!r} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{CONFIG_FILE}: r (the rank) must be a positive integer, not {rank!r}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{CONFIG_FILE}: target_modules must name the modules adapted")
    header = _safetensors_header(files[WEIGHTS_FILE])
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    if not tensors:
        raise AdapterError(f"{WEIGHTS_FILE} holds no tensor")
    total = 0
    for tensor, entry in tensors.items():
        match = _LORA_TENSOR.search(tensor)
        if match is None:
            raise AdapterError(f"{WEIGHTS_FILE}: {tensor} is not a LoRA A or B weight of a decoder layer")
        shape = entry["shape"]
        if len(shape) != 2 or shape[0 if match[3] == "A" else 1] != rank:
            raise AdapterError(f"{WEIGHTS_FILE}: {tensor} has shape {shape}, not of rank {rank}")
        partner = tensor[: match.start(3)] + ("B" if match[3] == "A" else "A") + tensor[match.end(3):]
        if partner not in tensors:
            raise AdapterError(f"{WEIGHTS_FILE}: {tensor} has no {partner}")
        total += entry["data_offsets"][1] - entry["data_offsets"][0]
    return AdapterFacts(rank, tuple(sorted(targets)), total)


class BaseShape(msgspec.Struct, frozen=True):
    """The sizes of a decoder's projections, from its config.json."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @classmethod
    def of_config(cls, config: Mapping) -> BaseShape:
        text = config.get("text_config", config)  # a multimodal model's decoder
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        return cls(layers=int(text["num_hidden_layers"]), hidden=hidden, heads=heads,
                   kv_heads=int(text.get("num_key_value_heads") or heads),
                   head_dim=int(text.get("head_dim") or hidden // heads), intermediate=int(text.get("intermediate_size", 0)))


def projection_sizes(base: BaseShape) -> dict[str, tuple[int, int]]:
    """(input, output) width of each projection of a decoder layer that a LoRA adapter may target."""
    # A config without an intermediate size (no MLP projections known) offers the attention ones only.
    return {module: sizes(base) for module, sizes in _PROJECTIONS.items() if base.intermediate or module not in _MLP}


def check_against_base(files: Mapping[str, bytes], base: BaseShape) -> None:
    """The adapter's tensors fit the base model: each layer exists, each A reads and each B writes the right width."""
    header = _safetensors_header(files[WEIGHTS_FILE])
    for tensor, entry in header.items():
        match = _LORA_TENSOR.search(tensor)
        if match is None:
            continue
        layer, module, side = int(match[1]), match[2], match[3]
        if layer >= base.layers:
            raise AdapterError(f"{tensor}: the base model has {base.layers} layers")
        widths = projection_sizes(base).get(module)
        if widths is None:
            raise AdapterError(f"{tensor}: the base model has no {module} to adapt (known: {', '.join(projection_sizes(base))})")
        width_in, width_out = widths
        shape = entry["shape"]
        expected = shape[1] == width_in if side == "A" else shape[0] == width_out
        if not expected:
            raise AdapterError(f"{tensor} has shape {shape}, which does not fit the base model's {module} "
                               f"({width_in} in, {width_out} out): an adapter of another base model?")


def pack_adapter(name: str, base: str, files: Mapping[str, bytes]) -> tuple[str, bytes, AdapterFacts]:
    """The object's name and bytes for adapter `name` of `base`, and what the check found."""
    check_adapter_name(name)
    facts = check_adapter_files(files)
    revision = content_revision(files)
    bundle = AdapterFiles(name=name, base=base, revision=revision, files=dict(files), tensor_bytes=facts.tensor_bytes,
                          rank=facts.rank)
    return adapter_object_name(name, revision), _ENCODER.encode(bundle), facts


def unpack_adapter(object_name: str, data: bytes) -> AdapterFiles:
    """The adapter an object holds, checked: the files it should hold, and the content its name promises."""
    if len(data) > MAX_ADAPTER_BYTES:
        raise AdapterError(f"{object_name}: {len(data)} bytes, more than an adapter may take ({MAX_ADAPTER_BYTES})")
    try:
        bundle = _DECODER.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{object_name}: not an adapter: {exc}") from exc
    if adapter_object_name(bundle.name, bundle.revision) != object_name:
        raise AdapterError(f"{object_name}: the object holds {adapter_object_name(bundle.name, bundle.revision)} instead")
    if content_revision(bundle.files) != bundle.revision:
        raise AdapterError(f"{object_name}: the files do not match their revision (corrupt object)")
    facts = check_adapter_files(bundle.files)
    if (facts.rank, facts.tensor_bytes) != (bundle.rank, bundle.tensor_bytes):
        raise AdapterError(f"{object_name}: the object's rank and size do not match its files (corrupt object)")
    return bundle


def read_adapter_files(directory: str | Path) -> dict[str, bytes]:
    """The adapter files of a PEFT adapter directory (`AdapterError` if one is missing)."""
    path = Path(directory)
    if not path.is_dir():
        raise AdapterError(f"{path} is not a directory")
    missing = [name for name in ADAPTER_FILE_NAMES if not (path / name).is_file()]
    if missing:
        raise AdapterError(f"{path} has no {' and no '.join(missing)} (kvlane loads PEFT adapters saved as safetensors)")
    return {name: (path / name).read_bytes() for name in ADAPTER_FILE_NAMES}


def _description(base: str, facts: AdapterFacts, created: int) -> str:
    return json.dumps({"base": base, "rank": facts.rank, "tensor_bytes": facts.tensor_bytes, "created": created})


def _info(entry) -> AdapterInfo | None:
    """The listing's entry for one object of the bucket; None for anything but a live adapter."""
    if entry.deleted or not entry.name.startswith(ADAPTER_PREFIX):
        return None
    name, _, revision = entry.name[len(ADAPTER_PREFIX):].rpartition("/")
    try:
        described = json.loads(entry.description or "")
        return AdapterInfo(name=name, base=str(described["base"]), revision=revision, rank=int(described["rank"]),
                           tensor_bytes=int(described["tensor_bytes"]), created=int(described.get("created", 0)))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # not one kvlane published


class AdapterStore:
    """Adapters in the bus's object store: publish, list, remove, fetch."""

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc

    async def _bucket(self, create: bool):
        if not (getattr(self._nc, "_server_info", None) or {}).get("jetstream"):
            raise NoObjectStore("adapters live in the bus's object store, and JetStream is not enabled on the NATS server")
        try:
            return await open_bucket(self._nc, create=create)
        except nats.js.errors.BucketNotFoundError as exc:
            raise AdapterError("no adapter has been published (the object store does not exist yet)") from exc
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise AdapterError(f"cannot reach the object store: {type(exc).__name__}: {exc}") from exc

    async def publish(self, name: str, base: str, directory: str | Path) -> AdapterInfo:
        """Publish the adapter in `directory` as `name` for `base`; an earlier revision of `name` is removed after."""
        files = await asyncio.to_thread(read_adapter_files, directory)
        object_name, data, facts = pack_adapter(name, base, files)
        store = await self._bucket(create=True)
        earlier = [info for info in await self.list() if info.name == name and info.object != object_name]
        created = int(time.time())
        try:
            await store.put(object_name, data, meta=ObjectMeta(name=object_name, description=_description(base, facts, created)))
            for info in earlier:
                await store.delete(info.object)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise AdapterError(f"cannot publish adapter {name}: {type(exc).__name__}: {exc}") from exc
        log.info("adapter_published", adapter=name, base=base, object=object_name, bytes=len(data))
        return AdapterInfo(name=name, base=base, revision=object_name.rpartition("/")[2], rank=facts.rank,
                           tensor_bytes=facts.tensor_bytes, created=created)

    async def list(self) -> list[AdapterInfo]:
        """Every published adapter, by name; the newest revision where a name has two (a publish in progress)."""
        try:
            store = await self._bucket(create=False)
        except AdapterError as exc:
            if isinstance(exc.__cause__, nats.js.errors.BucketNotFoundError):
                return []
            raise
        try:
            entries = await store.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise AdapterError(f"cannot list adapters: {type(exc).__name__}: {exc}") from exc
        newest: dict[str, AdapterInfo] = {}
        for entry in entries:
            info = _info(entry)
            if info is not None and (info.name not in newest or info.created >= newest[info.name].created):
                newest[info.name] = info
        return sorted(newest.values(), key=lambda info: info.name)

    async def remove(self, name: str) -> int:
        """Remove every revision of adapter `name`; how many there were (0: no such adapter)."""
        store = await self._bucket(create=False)
        removed = 0
        try:
            for info in await self.list():
                if info.name == name:
                    await store.delete(info.object)
                    removed += 1
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise AdapterError(f"cannot remove adapter {name}: {type(exc).__name__}: {exc}") from exc
        return removed

    async def fetch(self, ref: AdapterRef) -> AdapterFiles:
        store = await self._bucket(create=False)
        try:
            result = await store.get(ref.object)
        except nats.js.errors.ObjectNotFoundError as exc:
            raise AdapterGone(f"adapter {ref.name} is no longer on the bus ({ref.object} was removed)") from exc
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise AdapterError(f"cannot fetch adapter {ref.name}: {type(exc).__name__}: {exc}") from exc
        return unpack_adapter(ref.object, result.data)


@contextlib.asynccontextmanager
async def adapter_store_at(settings: NatsSettings) -> AsyncIterator[AdapterStore]:
    """The adapter store of the bus at `settings`, on a connection of its own (`AdapterError` when it does not answer)."""
    try:
        nc = await nats.connect(**nats_options(settings), connect_timeout=5, allow_reconnect=False)
    except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
        raise AdapterError(f"cannot reach NATS at {settings.url}: {exc!r}") from exc
    try:
        yield AdapterStore(nc)
    finally:
        await nc.close()


def default_adapter_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvlane" / "adapters"


class AdapterCache:
    """Adapters fetched from the bus into a local directory (one subdirectory per object), checked against the base."""

    def __init__(self, store: AdapterStore, directory: str | Path, base: BaseShape | None) -> None:
        self._store = store
        self.directory = Path(directory)
        self._base = base
        # One fetch per object however many requests ask for it at once.
        self._fetching: dict[str, asyncio.Future[Path]] = {}

    async def local(self, ref: AdapterRef) -> Path:
        """The directory holding `ref`'s files, fetched and checked unless done before (`AdapterError`)."""
        target = self.directory / cache_entry(ref.object)
        if (target / CONFIG_FILE).is_file():
            return target
        fetching = self._fetching.get(ref.object)
        if fetching is None:
            fetching = self._fetching[ref.object] = asyncio.ensure_future(self._fetch(ref, target))
            fetching.add_done_callback(lambda done: self._fetching.pop(ref.object, None))
        return await asyncio.shield(fetching)

    async def _fetch(self, ref: AdapterRef, target: Path) -> Path:
        bundle = await self._store.fetch(ref)
        if bundle.name != ref.name:
            raise AdapterError(f"{ref.object} holds adapter {bundle.name}, not {ref.name}")
        if self._base is not None:
            check_against_base(bundle.files, self._base)
        try:
            await asyncio.to_thread(write_file_set, target, bundle.files, CONFIG_FILE)
        except OSError as exc:
            raise AdapterError(f"cannot write adapter {ref.name} under {self.directory}: {exc}") from exc
        log.info("adapter_fetched", adapter=ref.name, object=ref.object, directory=str(target))
        return target
