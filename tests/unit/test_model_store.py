"""The pure parts of the model-files store (shared/model_store.py): names, revisions, packing and its checks."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from contracts.messages import EngineStats, Heartbeat, WorkerRegistration
from contracts.model_files import TokenizerFiles
from services.ingress.completions import Completions
from shared.cluster import ClusterView
from shared.config import IngressSettings
from shared.model_store import (
    REQUIRED_FILE,
    TOKENIZER_FILE_NAMES,
    ModelFilesError,
    cache_entry,
    content_revision,
    load_served_tokenizer,
    object_name,
    pack,
    unpack,
)
from shared.tokenizer import SimTokenizer

OPTIONAL_FILES = [name for name in TOKENIZER_FILE_NAMES if name != REQUIRED_FILE]
model_names = st.text(min_size=1, max_size=40)
file_sets = st.builds(
    lambda required, optional: {REQUIRED_FILE: required, **optional},
    st.binary(max_size=200),
    st.dictionaries(st.sampled_from(OPTIONAL_FILES), st.binary(max_size=200)),
)


@given(model_names, file_sets)
def test_unpack_gives_back_what_was_packed(model: str, files: dict[str, bytes]) -> None:
    name, data = pack(model, files)
    assert name == object_name(model, content_revision(files))
    assert unpack(name, data) == files


@given(file_sets)
def test_the_revision_depends_on_content_not_order(files: dict[str, bytes]) -> None:
    assert content_revision(dict(reversed(list(files.items())))) == content_revision(files)
    changed = {**files, REQUIRED_FILE: files[REQUIRED_FILE] + b"x"}
    assert content_revision(changed) != content_revision(files)
    # The same bytes under another file name are other content.
    content = files[REQUIRED_FILE]
    assert (content_revision({REQUIRED_FILE: b"", "tokenizer_config.json": content})
            != content_revision({REQUIRED_FILE: b"", "special_tokens_map.json": content}))


@pytest.mark.parametrize("bad_name", ["../tokenizer.json", "/etc/passwd", "model.safetensors", "sub/tokenizer.json", ""])
def test_a_file_name_a_tokenizer_does_not_use_is_refused(bad_name: str) -> None:
    files = {REQUIRED_FILE: b"{}", bad_name: b"x"}
    with pytest.raises(ModelFilesError, match="unexpected tokenizer files"):
        pack("m", files)
    # ...and refused when someone else packed it.
    revision = content_revision(files)
    data = msgspec.msgpack.encode(TokenizerFiles(model="m", revision=revision, files=files))
    with pytest.raises(ModelFilesError, match="unexpected tokenizer files"):
        unpack(object_name("m", revision), data)


def test_a_set_without_tokenizer_json_is_refused() -> None:
    with pytest.raises(ModelFilesError, match="no tokenizer.json"):
        pack("m", {"tokenizer_config.json": b"{}"})


def test_files_that_do_not_match_their_revision_are_refused() -> None:
    name, _ = pack("m", {REQUIRED_FILE: b"original"})
    revision = name.rsplit("/", 1)[1]
    tampered = msgspec.msgpack.encode(TokenizerFiles(model="m", revision=revision, files={REQUIRED_FILE: b"changed"}))
    with pytest.raises(ModelFilesError, match="do not match their revision"):
        unpack(name, tampered)


def test_an_object_under_another_name_is_refused() -> None:
    _, data = pack("m", {REQUIRED_FILE: b"one"})
    other_name, _ = pack("other", {REQUIRED_FILE: b"one"})
    with pytest.raises(ModelFilesError, match="holds"):
        unpack(other_name, data)


@given(st.binary(max_size=300))
def test_garbage_is_a_clear_error_never_a_crash(data: bytes) -> None:
    try:
        unpack("m/r", data)
    except ModelFilesError:
        pass


@given(st.text(max_size=120), st.text(max_size=120))
def test_cache_entries_are_plain_names_distinct_for_distinct_objects(first: str, second: str) -> None:
    entry = cache_entry(first)
    assert "/" not in entry and "\0" not in entry and entry not in (".", "..")
    assert entry == cache_entry(first)
    if first != second:
        assert cache_entry(second) != entry


def test_a_tokenizer_that_needs_no_files_loads_without_the_bus() -> None:
    tokenizer = asyncio.run(load_served_tokenizer("sim", "", None))
    assert isinstance(tokenizer, SimTokenizer)


def test_without_files_on_the_bus_an_unreadable_directory_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        asyncio.run(load_served_tokenizer(f"hf:{tmp_path / 'absent'}", "", None))


class FlakyBus:
    """A model-file cache whose first fetch fails, as one does while JetStream elects its leader."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.fetches = 0

    async def fetch(self, name: str):
        self.fetches += 1
        if self.fetches == 1:
            raise ModelFilesError(f"cannot fetch {name} from the bus: unavailable")
        return self.directory


async def test_the_ingress_tries_a_failed_fetch_again_until_the_model_is_servable(tmp_path) -> None:
    tokenizer_dir = tmp_path / "fetched"
    tokenizer_dir.mkdir()
    Tokenizer(WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]")).save(str(tokenizer_dir / REQUIRED_FILE))
    registration = WorkerRegistration(
        worker_id="w0", role="aggregated", model="m", engine="vllm", inbox="inbox.w0", block_size=16, max_model_len=4096,
        tokenizer=f"hf:{tmp_path / 'not-here'}", started_at=0.0, tokenizer_files="m/abc",
    )
    view = ClusterView(1e9)
    view.observe(Heartbeat(registration=registration, stats=EngineStats(), sent_at=0.0, seq=1), 0.0)
    bus = FlakyBus(str(tokenizer_dir))
    completions = Completions(IngressSettings(), view, None, None, clock=lambda: 0.0, model_files=bus)  # type: ignore[arg-type]

    async def settle() -> None:
        await completions.preload_tokenizers()
        await asyncio.gather(*completions._tokenizers.values(), return_exceptions=True)

    await settle()
    assert completions.tokenizers_missing() == ["tokenizer:m"]
    await settle()  # the next round tries again
    assert completions.tokenizers_missing() == [] and bus.fetches == 2
