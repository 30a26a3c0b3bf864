"""Models from the bus: a worker publishes its tokenizer to a JetStream object
store, and an ingress that cannot read the model directory fetches it from
there and tokenizes exactly as the model's own tokenizer does."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from contracts.messages import WorkerRegistration
from contracts.openai_api import ChatMessage
from launch.fleet import Fleet, with_overrides
from launch.launcher import Launcher, free_port, wait_ready, wait_services_ready
from shared.model_store import ModelFileCache, ModelFilesError, load_served_tokenizer, publish_tokenizer, with_published_tokenizer
from shared.hf_tokenizer import HfTokenizer
from shared.tokenizer import SimTokenizer
from tests.integration.conftest import fleet_config

pytestmark = pytest.mark.integration
MODEL = "tiny-sim"
TEXTS = ["Hello there, how are you?", "Tha brock stean 1234: the cat sat on a mat!", "  spaces\nand\tnewlines  ", "ünïcödé ✓"]
CHATS = [
    [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="What is the pa of chan?")],
    [ChatMessage(role="user", content="one"), ChatMessage(role="assistant", content="two"), ChatMessage(role="user", content="three")],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test model's tokenizer files alone (vocabulary, config, chat template)."""
    from launch.tiny_model import build_tokenizer

    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(seed=0).save_pretrained(directory)
    return directory


def hidden_copy(source: Path, tmp_path: Path) -> Path:
    """A copy of the model directory the test removes once the worker has published it."""
    directory = tmp_path / "worker-only" / "model"
    shutil.copytree(source, directory)
    return directory


@pytest.fixture
def jetstream_nats(tmp_path: Path) -> Iterator[str]:
    launcher = Launcher(tmp_path / "logs")
    port = free_port()
    launcher.start_nats(port, extra_args=["-js", "-sd", str(tmp_path / "jetstream")])
    yield f"nats://127.0.0.1:{port}"
    launcher.stop_all()


async def test_tokenizer_published_then_fetched_where_the_directory_is_gone(
    jetstream_nats: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    directory = hidden_copy(tokenizer_dir, tmp_path)
    reference = HfTokenizer(str(tokenizer_dir))
    registration = WorkerRegistration("w0", "aggregated", MODEL, "sim", "kvlane.v1.worker.w0", 16, 4096, f"hf:{directory}", 0.0)
    nc = await nats.connect(jetstream_nats)
    try:
        published = await with_published_tokenizer(nc, registration)
        assert published.tokenizer_files.startswith(f"{MODEL}/")
        # Again, as a restarted worker would: the same content keeps the same name.
        assert (await with_published_tokenizer(nc, registration)).tokenizer_files == published.tokenizer_files
        shutil.rmtree(directory)
        cache = ModelFileCache(nc, tmp_path / "cache")
        served = await load_served_tokenizer(published.tokenizer, published.tokenizer_files, cache)
        assert Path(served.directory).is_relative_to(tmp_path / "cache")
        for text in TEXTS:
            assert served.encode(text) == reference.encode(text)
        for chat in CHATS:
            assert served.apply_chat_template(chat) == reference.apply_chat_template(chat)
            assert served.encode(served.apply_chat_template(chat)) == reference.encode(reference.apply_chat_template(chat))
        # Without the files on the bus the same registration cannot be served here.
        with pytest.raises(ValueError, match="cannot load tokenizer"):
            await load_served_tokenizer(published.tokenizer, "", cache)
        with pytest.raises(ModelFilesError, match="no object"):
            await cache.fetch(f"{MODEL}/0000")
    finally:
        await nc.close()


async def test_without_jetstream_the_worker_still_registers_with_its_directory(tmp_path: Path, tokenizer_dir: Path) -> None:
    launcher = Launcher(tmp_path / "logs")
    port = free_port()
    launcher.start_nats(port)  # no -js
    nc = await nats.connect(f"nats://127.0.0.1:{port}")
    try:
        registration = WorkerRegistration("w0", "aggregated", MODEL, "sim", "kvlane.v1.worker.w0", 16, 4096, f"hf:{tokenizer_dir}", 0.0)
        assert await asyncio.wait_for(with_published_tokenizer(nc, registration), 10) == registration
        with pytest.raises(ModelFilesError, match="JetStream is not enabled"):
            await publish_tokenizer(nc, MODEL, tokenizer_dir)
    finally:
        await nc.close()
        launcher.stop_all()


async def test_an_ingress_without_the_model_directory_serves_with_the_tokenizer_from_the_bus(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    directory = hidden_copy(tokenizer_dir, tmp_path)
    reference = HfTokenizer(str(tokenizer_dir))
    launcher = Launcher(tmp_path / "logs")
    nats_port, redis_port = free_port(), free_port()
    cache_dir = tmp_path / "ingress-cache"
    fleet = None
    try:
        launcher.start_nats(nats_port, extra_args=["-js", "-sd", str(tmp_path / "jetstream")])
        launcher.start_redis(redis_port)
        config = with_overrides(
            fleet_config(nats_port, redis_port), worker={"model": MODEL}, **{"worker.sim": {"tokenizer": f"hf:{directory}"}},
            ingress={"model_cache_dir": str(cache_dir)},
        )
        fleet = Fleet(launcher, config, f"http://127.0.0.1:{config.ingress.port}")
        fleet.add_balancer()
        fleet.add_cache_manager()
        worker = fleet.add_worker("w0")
        # Ready means registered, and a worker registers once its tokenizer is on the bus.
        wait_services_ready([*fleet.balancers, *fleet.cache_managers, worker], 60)
        shutil.rmtree(directory.parent)
        fleet.ingress = launcher.start_service("ingress", fleet.service_env("ingress", "i0"))
        ready = await asyncio.to_thread(wait_ready, fleet.base_url, 60, fleet.services(), 1)
        assert ready["workers"] == 1
        assert "tokenizer_fetched" in fleet.ingress.log_path.read_text()
        assert any(cache_dir.iterdir())

        client = openai.AsyncOpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
        sim = SimTokenizer()
        for text in TEXTS:
            completion = await client.completions.create(model=MODEL, prompt=text, max_tokens=2)
            assert completion.usage.prompt_tokens == len(reference.encode(text))
        for chat in CHATS:
            messages = [msgspec.to_builtins(message) for message in chat]
            reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
            expected = reference.encode(reference.apply_chat_template(chat))
            assert reply.usage.prompt_tokens == len(expected)
            # The sim's own tokenizer would count otherwise: the figure above is the model's.
            assert len(sim.encode(sim.apply_chat_template(chat))) != len(expected)
    finally:
        if fleet is not None:
            fleet.stop()
        launcher.stop_all()


async def test_a_chat_template_override_reaches_an_ingress_through_the_bus(
    jetstream_nats: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """`worker.vllm.chat_template`: the served tokenizer directory is what goes on the bus, override included."""
    from services.worker.served_tokenizer import served_tokenizer

    override = "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n{% endfor %}"
    model = hidden_copy(tokenizer_dir, tmp_path)
    spec = served_tokenizer(f"hf:{model}", override, root=tmp_path / "worker-only" / "served")
    registration = WorkerRegistration("w0", "aggregated", MODEL, "vllm", "kvlane.v1.worker.w0", 16, 4096, spec, 0.0)
    nc = await nats.connect(jetstream_nats)
    try:
        published = await with_published_tokenizer(nc, registration)
        assert published.tokenizer == spec and published.tokenizer_files.startswith(f"{MODEL}/")
        # The object is the served directory's content, named as the directory is.
        assert published.tokenizer_files == f"{MODEL}/{Path(spec[len('hf:'):]).name}"
        shutil.rmtree(tmp_path / "worker-only")  # neither the model nor the served directory is on the ingress's host
        served = await load_served_tokenizer(published.tokenizer, published.tokenizer_files, ModelFileCache(nc, tmp_path / "cache"))
        assert Path(served.directory).is_relative_to(tmp_path / "cache")
        reference = HfTokenizer(str(tokenizer_dir))
        for chat in CHATS:
            expected = "".join(f"<{message.role}>{message.content}\n" for message in chat)
            assert served.apply_chat_template(chat) == expected != reference.apply_chat_template(chat)
        for text in TEXTS:
            assert served.encode(text) == reference.encode(text)
    finally:
        await nc.close()
