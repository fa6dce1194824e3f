"""vLLM 0.32's prefix-cache block hashes, recomputed outside the engine.

Model of the world: a prompt is cut into blocks of `block_size` tokens and only full blocks
are hashed. Block i's hash is `H((parent, tuple(tokens_i), extra_keys_or_None))`, where
`parent` is block i-1's raw digest (NONE_HASH for block 0) and H is SHA-256 over either
pickle protocol 5 (`sha256`, vLLM's default) or canonical CBOR (`sha256_cbor`). NONE_HASH is
H(seed): the seed is PYTHONHASHSEED's value when the engine runs with one, else the fixed
string "vllm-none-hash". Extra keys are LoRA `("lora", name, path)` on every block and
`("cache_salt", salt)` on the first block only; with neither, the third element is None.
KV events carry the last 8 bytes of a digest as a big-endian uint64 (`event_block_hash`).

Source of truth: vllm/v1/core/kv_cache_utils.py (`hash_block_tokens`,
`get_request_block_hasher`, `init_none_hash`, `generate_block_hash_extra_keys`,
`to_event_extra_keys`) and vllm/utils/hashing.py. Multimodal and prompt-embeds keys and the
xxhash algorithms are not supported (xxhash is not in the standard library, and without
PYTHONHASHSEED its seed is random per process anyway).

Everything here is a pure function of explicit arguments; nothing reads the environment.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import NewType, TypeAlias

BlockHash = NewType("BlockHash", bytes)
"""A raw block digest (32 bytes for SHA-256), as vLLM keeps it internally."""

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""The NONE_HASH seed of vLLM 0.32 for sha256 / sha256_cbor when PYTHONHASHSEED is unset."""

_PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL on the Pythons vLLM 0.32 supports
_UINT64_MASK = (1 << 64) - 1

# What a hashed tuple may hold: digests, token ids, the LoRA and salt keys, None.
CborValue: TypeAlias = "bool | int | bytes | str | tuple[CborValue, ...] | list[CborValue] | None"
ExtraKeys: TypeAlias = tuple[tuple[str, ...], ...]


class HashAlgo(StrEnum):
    """`--prefix-caching-hash-algo` values whose hashes can be recomputed with the stdlib."""

    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"


def resolve_none_hash_seed(pythonhashseed: str | None) -> str:
    """The NONE_HASH seed an engine uses, given its PYTHONHASHSEED value (None if unset).

    vLLM: PYTHONHASHSEED wins when set (even ""), else the fixed default for the
    cryptographic algorithms, the only ones supported here.
    """
    return pythonhashseed if pythonhashseed is not None else DEFAULT_NONE_HASH_SEED


def cacheable_blocks(prompt_tokens: int, block_size: int) -> int:
    """The most whole blocks of a prompt vLLM serves from its prefix cache: never the block
    holding the last token, which it computes to get the first output's logits
    (`KVCacheManager.get_computed_blocks`)."""
    return max(0, prompt_tokens - 1) // block_size


def cacheable_tokens(prompt_tokens: int, block_size: int) -> int:
    """`cacheable_blocks` in tokens: the cap on any prediction of a prompt's cached tokens."""
    return cacheable_blocks(prompt_tokens, block_size) * block_size


def shared_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items `a` and `b` share (compared a slice at a time, in C)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:  # the usual case: one is a prefix of the other
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def event_block_hash(digest: bytes) -> int:
    """A digest as KV events carry it: its last 8 bytes as a big-endian uint64."""
    return int.from_bytes(digest, "big") & _UINT64_MASK


# --- canonical CBOR (the subset of cbor2.dumps(obj, canonical=True) vLLM's tuples use) ---


def _cbor_head(major: int, arg: int) -> bytes:
    m = major << 5
    if arg < 24:
        return bytes((m | arg,))
    if arg < 0x100:
        return bytes((m | 24, arg))
    if arg < 0x10000:
        return struct.pack(">BH", m | 25, arg)
    if arg < 0x100000000:
        return struct.pack(">BI", m | 26, arg)
    return struct.pack(">BQ", m | 27, arg)


def _cbor_int(value: int) -> bytes:
    major, arg = (0, value) if value >= 0 else (1, -1 - value)
    if arg <= _UINT64_MASK:
        return _cbor_head(major, arg)
    # Bignum: tag 2 (positive) or 3 (negative) around the minimal big-endian bytes.
    payload = arg.to_bytes((arg.bit_length() + 7) // 8, "big")
    return _cbor_head(6, 2 + major) + _cbor_head(2, len(payload)) + payload


_cbor_token = lru_cache(maxsize=1 << 18)(_cbor_int)
"""Token ids repeat within a vocabulary, so their encodings are memoised."""


def encode_cbor_canonical(obj: CborValue) -> bytes:
    """Canonical CBOR of None, bools, ints, bytes, str, tuples and lists, byte-identical to
    `cbor2.dumps(obj, canonical=True)` for these types. Anything else is a TypeError."""
    if obj is None:
        return b"\xf6"
    if obj is True:
        return b"\xf5"
    if obj is False:
        return b"\xf4"
    if isinstance(obj, int):
        return _cbor_int(obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return _cbor_head(3, len(raw)) + raw
    if isinstance(obj, tuple | list):
        return _cbor_head(4, len(obj)) + b"".join(encode_cbor_canonical(x) for x in obj)
    raise TypeError(f"cannot CBOR-encode a {type(obj).__name__} for a block hash")


def hash_object(algo: HashAlgo, obj: CborValue) -> BlockHash:
    """vLLM's hash function `algo` applied to one Python object (utils/hashing.py)."""
    if algo is HashAlgo.SHA256:
        raw = pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)
    else:
        raw = encode_cbor_canonical(obj)
    return BlockHash(hashlib.sha256(raw).digest())


def none_hash(algo: HashAlgo, seed: str) -> BlockHash:
    """NONE_HASH, the parent of every chain's first block: `H(seed)`."""
    return hash_object(algo, seed)


# --- extra keys ---


@dataclass(frozen=True, slots=True)
class LoraKey:
    """The LoRA adapter of a request as the block hash sees it (name and path)."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class RequestKeys:
    """What besides tokens enters a request's block hashes."""

    cache_salt: str | None = None
    lora: LoraKey | None = None

    def for_block(self, block_index: int) -> ExtraKeys | None:
        """The tagged extra keys hashed into block `block_index`, or None (vLLM order:
        LoRA, multimodal, cache_salt, prompt embeds; salt only on block 0, and only if
        non-empty)."""
        keys: list[tuple[str, ...]] = []
        if self.lora is not None:
            keys.append(("lora", self.lora.name, self.lora.path))
        if block_index == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) if keys else None


NO_KEYS = RequestKeys()


def event_extra_keys(keys: ExtraKeys | None) -> tuple[str, ...] | None:
    """One block's extra keys in the untagged form KV events publish
    (`to_event_extra_keys`): LoRA becomes the bare name, the salt the bare string."""
    if keys is None:
        return None
    return tuple(key[1] for key in keys)


# --- hashing ---


@dataclass(frozen=True, slots=True)
class BlockHashChain:
    """The hashes of a token sequence's full blocks plus the tokens after the last one.

    Extend it with `BlockHasher.extend` as a session's turns and generated tokens arrive;
    only the newly completed blocks are hashed.
    """

    block_size: int
    hashes: tuple[BlockHash, ...]
    tail: tuple[int, ...]
    keys: RequestKeys = NO_KEYS

    @property
    def num_tokens(self) -> int:
        """Tokens covered: the full blocks plus the partial tail."""
        return len(self.hashes) * self.block_size + len(self.tail)

    event_hashes: tuple[int, ...] = ()
    """The chain's hashes as KV events carry them (filled in when not given; `extend`
    passes them on so a growing session converts only its new blocks)."""

    def __post_init__(self) -> None:
        if len(self.event_hashes) != len(self.hashes):
            events = tuple(event_block_hash(h) for h in self.hashes)
            object.__setattr__(self, "event_hashes", events)

    def prefix(self, n_blocks: int) -> BlockHashChain:
        """The chain of its first `n_blocks` full blocks (no tail)."""
        return BlockHashChain(
            self.block_size,
            self.hashes[:n_blocks],
            (),
            self.keys,
            self.event_hashes[:n_blocks],
        )


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Hashes token blocks exactly as a vLLM 0.32 engine with these settings does.

    `seed` is the resolved NONE_HASH seed (see `resolve_none_hash_seed` and `for_engine`).
    Token ids must be Python ints: other integer types pickle differently.
    """

    algo: HashAlgo
    block_size: int
    seed: str = DEFAULT_NONE_HASH_SEED
    none_hash: BlockHash = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        object.__setattr__(self, "algo", HashAlgo(self.algo))
        object.__setattr__(self, "none_hash", none_hash(self.algo, self.seed))

    @classmethod
    def for_engine(
        cls, algo: HashAlgo | str, block_size: int, pythonhashseed: str | None
    ) -> BlockHasher:
        """The hasher of an engine started with this algorithm, block size and
        PYTHONHASHSEED value (None when the engine's environment does not set it)."""
        return cls(HashAlgo(algo), block_size, resolve_none_hash_seed(pythonhashseed))

    def hash_block(
        self,
        parent: BlockHash | None,
        tokens: Sequence[int],
        extra_keys: ExtraKeys | None = None,
    ) -> BlockHash:
        """One block's hash (`hash_block_tokens`); parent None means the first block."""
        return hash_object(self.algo, (parent or self.none_hash, tuple(tokens), extra_keys))

    def hash_blocks(
        self,
        tokens: Sequence[int],
        *,
        keys: RequestKeys = NO_KEYS,
        start_block: int = 0,
        parent: BlockHash | None = None,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of `tokens` (the whole sequence from token 0) from
        block `start_block` on. `parent` is the hash of block `start_block - 1`, required
        when `start_block > 0`. A trailing partial block is not hashed."""
        if start_block > 0 and parent is None:
            raise ValueError("extending a chain needs the hash of its last full block")
        return self._hash_run(tokens[start_block * self.block_size :], start_block, parent, keys)

    def hash_after(
        self,
        run: Sequence[int],
        *,
        first_block: int,
        parent: BlockHash | None,
        keys: RequestKeys = NO_KEYS,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of `run`, whose first token starts block `first_block`
        of a sequence whose block `first_block - 1` hashed to `parent` (None at block 0):
        a chain extended by a run of tokens that are not kept."""
        if first_block > 0 and parent is None:
            raise ValueError("extending a chain needs the hash of its last full block")
        return self._hash_run(run, first_block, parent, keys)

    def chain(self, tokens: Sequence[int], *, keys: RequestKeys = NO_KEYS) -> BlockHashChain:
        """The chain of a whole token sequence."""
        return self.extend(BlockHashChain(self.block_size, (), (), keys), tokens)

    def extend(self, chain: BlockHashChain, tokens: Sequence[int]) -> BlockHashChain:
        """`chain` with `tokens` appended: hashes only the blocks the new tokens complete."""
        if chain.block_size != self.block_size:
            raise ValueError(
                f"chain of block size {chain.block_size} extended by a hasher of "
                f"block size {self.block_size}"
            )
        pending = (*chain.tail, *tokens)
        parent = chain.hashes[-1] if chain.hashes else None
        new = self._hash_run(pending, len(chain.hashes), parent, chain.keys)
        if not new:
            return BlockHashChain(
                self.block_size, chain.hashes, pending, chain.keys, chain.event_hashes
            )
        cut = len(new) * self.block_size
        events = (*chain.event_hashes, *(event_block_hash(h) for h in new))
        return BlockHashChain(
            self.block_size, (*chain.hashes, *new), pending[cut:], chain.keys, events
        )

    def _hash_run(
        self,
        run: Sequence[int],
        first_block: int,
        parent: BlockHash | None,
        keys: RequestKeys,
    ) -> list[BlockHash]:
        """Hash the full blocks of `run`, whose first token starts block `first_block`."""
        bs = self.block_size
        n_blocks = len(run) // bs
        if n_blocks == 0:
            return []
        # Only block 0 differs (the salt); every later block has the same extra keys.
        extra_first = keys.for_block(first_block)
        extra_rest = keys.for_block(first_block + 1)
        prev = parent or self.none_hash
        out: list[BlockHash] = []
        sha256 = hashlib.sha256
        if self.algo is HashAlgo.SHA256:
            dumps = pickle.dumps
            for i in range(n_blocks):
                s = i * bs
                extra = extra_first if i == 0 else extra_rest
                raw = dumps((prev, tuple(run[s : s + bs]), extra), _PICKLE_PROTOCOL)
                prev = BlockHash(sha256(raw).digest())
                out.append(prev)
            return out
        # CBOR: array(3) [bstr parent, array(bs) [tokens...], extra]; each token encoded once.
        enc = list(map(_cbor_token, run[: n_blocks * bs]))
        tokens_head = _cbor_head(4, bs)
        extra_enc = (encode_cbor_canonical(extra_first), encode_cbor_canonical(extra_rest))
        for i in range(n_blocks):
            s = i * bs
            raw = b"".join(
                (
                    b"\x83",
                    _cbor_head(2, len(prev)),
                    prev,
                    tokens_head,
                    *enc[s : s + bs],
                    extra_enc[0] if i == 0 else extra_enc[1],
                )
            )
            prev = BlockHash(sha256(raw).digest())
            out.append(prev)
        return out
