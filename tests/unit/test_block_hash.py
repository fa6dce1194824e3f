"""Block hashing: vLLM 0.32's test vectors, the CBOR and pickle routes, chains, speed."""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.domain.block_hash import (
    DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    HashAlgo,
    LoraKey,
    RequestKeys,
    cacheable_blocks,
    cacheable_tokens,
    encode_cbor_canonical,
    event_block_hash,
    event_extra_keys,
    hash_object,
    none_hash,
    resolve_none_hash_seed,
)

# reference/vllm-0.32-protocols.md §2.6: vLLM's own utils/hashing.py, seed "vllm-none-hash",
# tokens 1..32, block size 16, no extra keys. (algo, NONE_HASH, block0 digest, event ints)
VECTORS = [
    (
        HashAlgo.SHA256,
        ("066b1e89", "d71198"),
        ("7b255da4", "547f4caf"),
        [1403909460543360175, 1643945449041937783],
    ),
    (
        HashAlgo.SHA256_CBOR,
        ("9bd96a48", "9581eef0"),
        ("cd7c51bc", "7fd01682"),
        [8866452693264111234, 807986237951177663],
    ),
]


@pytest.mark.parametrize(("algo", "none", "block0", "events"), VECTORS)
def test_vllm_vectors(
    algo: HashAlgo, none: tuple[str, str], block0: tuple[str, str], events: list[int]
) -> None:
    hasher = BlockHasher(algo, 16)
    assert hasher.none_hash.hex().startswith(none[0])
    assert hasher.none_hash.hex().endswith(none[1])
    hashes = hasher.hash_blocks(list(range(1, 33)))
    assert hashes[0].hex().startswith(block0[0])
    assert hashes[0].hex().endswith(block0[1])
    assert [event_block_hash(h) for h in hashes] == events


@pytest.mark.parametrize(
    ("env_value", "seed"),
    [(None, DEFAULT_NONE_HASH_SEED), ("0", "0"), ("42", "42"), ("", "")],
)
def test_none_hash_seed_resolution(env_value: str | None, seed: str) -> None:
    assert resolve_none_hash_seed(env_value) == seed
    hasher = BlockHasher.for_engine("sha256_cbor", 16, env_value)
    assert hasher.seed == seed
    assert hasher.none_hash == none_hash(HashAlgo.SHA256_CBOR, seed)


def test_seed_changes_every_hash() -> None:
    tokens = list(range(64))
    a = BlockHasher(HashAlgo.SHA256, 16).hash_blocks(tokens)
    b = BlockHasher(HashAlgo.SHA256, 16, "0").hash_blocks(tokens)
    assert all(x != y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("digest", "expected"),
    [
        (bytes(32), 0),
        (bytes(24) + b"\x00\x00\x00\x00\x00\x00\x01\x00", 256),
        (b"\xff" * 24 + bytes(8), 0),
        (bytes(24) + b"\xff" * 8, 2**64 - 1),
        (bytes(range(32)), int.from_bytes(bytes(range(24, 32)), "big")),
    ],
)
def test_event_hash_is_last_8_bytes_big_endian(digest: bytes, expected: int) -> None:
    assert event_block_hash(digest) == expected


cbor_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.binary(max_size=300)
    | st.text(max_size=300),
    lambda inner: st.lists(inner, max_size=30) | st.lists(inner, max_size=30).map(tuple),
    max_leaves=60,
)


@given(cbor_values)
def test_cbor_encoding_equals_cbor2_canonical(value: object) -> None:
    assert encode_cbor_canonical(value) == cbor2.dumps(value, canonical=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [1.5, {"a": 1}, {1}, object()])
def test_cbor_rejects_types_vllm_never_hashes(bad: object) -> None:
    with pytest.raises(TypeError):
        encode_cbor_canonical(bad)  # type: ignore[arg-type]


@given(cbor_values)
def test_hash_object_matches_vllm_hash_functions(value: object) -> None:
    pickled = hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert hash_object(HashAlgo.SHA256, value) == pickled  # type: ignore[arg-type]
    cbor = hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()
    assert hash_object(HashAlgo.SHA256_CBOR, value) == cbor  # type: ignore[arg-type]


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_block_is_hash_of_parent_tokens_extra_tuple(algo: HashAlgo) -> None:
    hasher = BlockHasher(algo, 4)
    keys = RequestKeys(cache_salt="salt", lora=LoraKey("ad", "/p"))
    got = hasher.hash_blocks([5, 6, 7, 8, 9, 10, 11, 12, 13], keys=keys)
    assert len(got) == 2  # the partial third block is not hashed
    b0 = hash_object(
        algo,
        (hasher.none_hash, (5, 6, 7, 8), (("lora", "ad", "/p"), ("cache_salt", "salt"))),
    )
    b1 = hash_object(algo, (b0, (9, 10, 11, 12), (("lora", "ad", "/p"),)))
    assert got == [b0, b1]
    assert hasher.hash_block(None, [5, 6, 7, 8], keys.for_block(0)) == b0


@pytest.mark.parametrize(
    ("keys", "block", "tagged", "event"),
    [
        (RequestKeys(), 0, None, None),
        (RequestKeys(cache_salt="s"), 0, (("cache_salt", "s"),), ("s",)),
        (RequestKeys(cache_salt="s"), 1, None, None),
        (RequestKeys(cache_salt=""), 0, None, None),  # an empty salt is no salt
        (RequestKeys(lora=LoraKey("n", "/p")), 3, (("lora", "n", "/p"),), ("n",)),
        (
            RequestKeys(cache_salt="s", lora=LoraKey("n", "/p")),
            0,
            (("lora", "n", "/p"), ("cache_salt", "s")),
            ("n", "s"),
        ),
    ],
)
def test_extra_keys_per_block(
    keys: RequestKeys,
    block: int,
    tagged: tuple[tuple[str, ...], ...] | None,
    event: tuple[str, ...] | None,
) -> None:
    assert keys.for_block(block) == tagged
    assert event_extra_keys(keys.for_block(block)) == event


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_salt_reaches_later_blocks_through_the_parent_only(algo: HashAlgo) -> None:
    hasher = BlockHasher(algo, 8)
    tokens = list(range(40))
    plain = hasher.hash_blocks(tokens)
    salted = hasher.hash_blocks(tokens, keys=RequestKeys(cache_salt="x"))
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert salted[1] == hasher.hash_block(salted[0], tokens[8:16], None)


@given(
    algo=st.sampled_from(list(HashAlgo)),
    block_size=st.integers(1, 20),
    tokens=st.lists(st.integers(0, 2**20), max_size=120),
    cuts=st.lists(st.integers(0, 120), max_size=6),
    salt=st.none() | st.text(max_size=5),
)
def test_incremental_chain_equals_hashing_everything(
    algo: HashAlgo, block_size: int, tokens: list[int], cuts: list[int], salt: str | None
) -> None:
    hasher = BlockHasher(algo, block_size)
    keys = RequestKeys(cache_salt=salt)
    chain = hasher.chain([], keys=keys)
    prev = 0
    for cut in [*sorted(c for c in cuts if c <= len(tokens)), len(tokens)]:
        chain = hasher.extend(chain, tokens[prev:cut])
        prev = cut
    assert list(chain.hashes) == hasher.hash_blocks(tokens, keys=keys)
    assert chain.num_tokens == len(tokens)
    assert chain.tail == tuple(tokens[len(chain.hashes) * block_size :])
    # Resuming from any block with its parent gives the same suffix.
    for start in range(1, len(chain.hashes)):
        rest = hasher.hash_blocks(
            tokens, keys=keys, start_block=start, parent=chain.hashes[start - 1]
        )
        assert rest == list(chain.hashes[start:])


def test_chain_rejects_a_hasher_of_another_block_size() -> None:
    chain = BlockHasher(HashAlgo.SHA256, 16).chain(list(range(20)))
    with pytest.raises(ValueError, match="block size"):
        BlockHasher(HashAlgo.SHA256, 32).extend(chain, [1])


def test_resuming_needs_the_parent() -> None:
    with pytest.raises(ValueError, match="last full block"):
        BlockHasher(HashAlgo.SHA256, 16).hash_blocks(list(range(64)), start_block=2)


@pytest.mark.parametrize("block_size", [0, -16])
def test_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        BlockHasher(HashAlgo.SHA256, block_size)


def test_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError):
        BlockHasher.for_engine("xxhash", 16, None)


@pytest.mark.parametrize(
    ("prompt", "blocks"),
    [(0, 0), (1, 0), (16, 0), (17, 1), (32, 1), (33, 2), (100, 6)],
)
def test_the_last_token_is_never_served_from_cache(prompt: int, blocks: int) -> None:
    """vLLM computes the last prompt token itself: a prompt of exactly k blocks can reuse
    k - 1 of them, one token more reuses all k."""
    assert cacheable_blocks(prompt, 16) == blocks
    assert cacheable_tokens(prompt, 16) == blocks * 16
