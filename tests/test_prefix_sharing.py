"""The prefix cache is no cross-tenant oracle (issue 32, item 4).

The review's attack: a client sends a prompt another client may have sent and reads the
answer's own ``timings.prefix_cached_tokens`` (704 of 711 positions when it had been sent; a
guessed PIN showed 128 cached tokens when right and 64 when wrong). Each test runs the attack
against the HTTP app on loopback (hypercorn, real sockets, a real one-stage pipeline of the
tiny model): a second client is another source address (127.0.0.2) when the server has no
API keys, or another key when it has several (one per line of the key file, as
``stagerun serve --api-key-file`` reads it). By default a request shares cached prefixes only
within its client's domain; ``prefix_share="global"`` (``--prefix-share global``) shares
them with everyone, as before.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from _live_server import LiveServer
from _served_app import served_app

from stagerun import _proto, open_pipeline
from stagerun._cli._options import build_parser
from stagerun._cli._serve import options_from_args
from stagerun.server import HttpConfig
from stagerun.testing import write_tiny_model

CONTEXT = 1024
# The review's secret: 711 tokens, of which the whole blocks before the last token can be
# restored (708 in blocks of 4).
SECRET = [(7 * i) % 250 + 3 for i in range(711)]


def restorable(prompt_tokens: int) -> int:
    """The positions of a prompt that whole cached blocks can give: all blocks before its last
    token's."""
    return (prompt_tokens - 1) // _proto.PREFIX_BLOCK * _proto.PREFIX_BLOCK


RESTORABLE = restorable(len(SECRET))
ALICE, BOB = "alice-key-0123456789", "bob-key-9876543210"
OTHER_ADDRESS = "127.0.0.2"  # Linux routes all of 127/8 to loopback


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sharing")
    return write_tiny_model(folder / "tiny.gguf", n_layers=2, context_length=CONTEXT)


@asynccontextmanager
async def served(model: Path, **settings: Any) -> AsyncIterator[str]:
    """The app of ``settings`` over a one-stage pipeline of ``model``, on 127.0.0.1."""
    async with open_pipeline(model, stages=1) as pipeline, served_app(pipeline, **settings) as url:
        yield url


def client(url: str, *, key: str | None = None, address: str = "127.0.0.1") -> httpx.AsyncClient:
    """A client from ``address`` presenting ``key``."""
    transport = httpx.AsyncHTTPTransport(local_address=address)
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    return httpx.AsyncClient(base_url=url, transport=transport, headers=headers, timeout=60)


async def cached(http: httpx.AsyncClient, prompt: list[int], **fields: Any) -> int:
    """The positions of ``prompt`` the answer says were restored from the prefix cache."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **fields}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    restored = int(answer["timings"]["prefix_cached_tokens"])
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == restored
    return restored


async def test_a_second_client_sees_nothing_of_the_first_clients_prompt(tiny: Path) -> None:
    """No API keys: clients are told apart by their address; each keeps its own hits.

    Then the review's PIN guess: the PIN ends at position 127, so shared, a right guess would
    restore 128 positions and a wrong one fewer (112 in blocks of 16, 124 in blocks of 4).
    Each guess comes from an address of its own.
    """
    common = [(11 * i) % 200 + 20 for i in range(124)]
    async with (
        served(tiny) as url,
        client(url) as alice,
        client(url, address=OTHER_ADDRESS) as bob,
        client(url, address="127.0.0.3") as carol,
    ):
        assert await cached(alice, SECRET) == 0
        bob_sees = await cached(bob, SECRET)
        alice_again = await cached(alice, SECRET)
        print(f"\nanother client's prompt: {bob_sees} cached; the same client's: {alice_again}")
        assert bob_sees == 0
        assert alice_again == RESTORABLE  # the same client still gets its cache hits
        await cached(alice, [*common, 4, 7, 1, 1, *SECRET[:100]])
        right = await cached(bob, [*common, 4, 7, 1, 1, *[9] * 12])
        wrong = await cached(carol, [*common, 4, 7, 1, 2, *[9] * 12])
        print(f"PIN guessed right: {right} cached, wrong: {wrong}")
        assert right == wrong


async def test_clients_with_different_keys_share_nothing_even_with_one_cache_salt(
    tiny: Path,
) -> None:
    """Several keys, one per line: a key is a domain; an equal salt does not join two."""
    async with (
        served(tiny, api_key=f"{ALICE}\n{BOB}\n") as url,
        client(url, key=ALICE) as alice,
        client(url, key=BOB) as bob,
        client(url, key=ALICE, address=OTHER_ADDRESS) as alice_elsewhere,
    ):
        assert await cached(alice, SECRET) == 0
        assert await cached(bob, SECRET) == 0
        assert await cached(alice_elsewhere, SECRET) == RESTORABLE  # the key, not the address
        salted = SECRET[:400]
        assert await cached(alice, salted, cache_salt="shared") == 0
        bob_salted = await cached(bob, salted, cache_salt="shared")
        print(f"\nanother key, the same cache_salt: {bob_salted} cached")
        assert bob_salted == 0
        assert await cached(alice, salted, cache_salt="shared") == restorable(400)
        assert await cached(alice, salted, cache_salt="other") == 0  # salts still split a key
        async with client(url, key="nobody") as stranger:
            assert (await stranger.get("/v1/models")).status_code == 401


async def test_prefix_share_global_shares_across_clients(tiny: Path) -> None:
    """``prefix_share="global"``: today's behaviour, for one trusted tenant."""
    async with (
        served(tiny, prefix_share="global") as url,
        client(url) as alice,
        client(url, address=OTHER_ADDRESS) as bob,
    ):
        assert await cached(alice, SECRET) == 0
        assert await cached(bob, SECRET) == RESTORABLE
        assert await cached(alice, SECRET[:400], cache_salt="s") == 0
        # a salt is a domain
        assert await cached(bob, SECRET[:400], cache_salt="s") == restorable(400)


def test_the_sharing_option_is_checked_and_reaches_the_server() -> None:
    assert HttpConfig().prefix_share == "client"
    with pytest.raises(ValueError, match="--prefix-share"):
        HttpConfig(prefix_share="everyone")  # type: ignore[arg-type]
    args = build_parser().parse_args(["serve", "--prefix-share", "global"])
    assert options_from_args(args).http.prefix_share == "global"
    assert options_from_args(build_parser().parse_args(["serve"])).prefix_share == "client"


def test_a_key_file_holds_one_key_per_line(tiny: Path, tmp_path: Path) -> None:
    """``stagerun serve --api-key-file``: every line is a key (``#`` lines are comments),
    and each key is a domain of its own."""
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# tenants\n{ALICE}\n\n{BOB}\n")
    keys.chmod(0o600)
    args = ["--model", str(tiny), "--stages", "1", "--api-key-file", str(keys)]
    live = LiveServer(args, tmp_path / "serve.log")
    try:
        live.wait_ready()

        def restored(key: str) -> int:
            body = {"model": "tiny", "prompt": SECRET, "max_tokens": 1}
            auth = {"authorization": f"Bearer {key}"}
            answer = httpx.post(live.url + "/v1/completions", json=body, headers=auth, timeout=60)
            assert answer.status_code == 200, answer.text
            return int(answer.json()["timings"]["prefix_cached_tokens"])

        assert [restored(ALICE), restored(BOB), restored(ALICE)] == [0, 0, RESTORABLE]
        comment = {"authorization": "Bearer # tenants"}
        assert httpx.get(live.url + "/v1/models", headers=comment).status_code == 401
    finally:
        live.stop()
