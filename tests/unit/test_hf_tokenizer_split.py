"""A Hugging Face tokenizer is tokenised incrementally only where that provably gives the
ids a whole `encode` gives: the split points its load-time probe accepts.

Each case builds a real `tokenizers` tokenizer (trained in a moment on a small corpus) in the
shapes real models ship: byte-level BPE (GPT-2, Llama 3, Qwen), SentencePiece-style Metaspace
that prepends a space to the first piece only (Llama 2), and a special token that strips the
whitespace beside it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from appliance.services.sessions.chat_tokens import encode_chat_text
from appliance.tokenization.tokenizer import HfTokenizer

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = ["hello world, this is text.\n    indented line\n", "alpha beta gamma é ü 42"] * 40
PIECES = ["alpha", " beta", "\n", "  ", "<s>", "</s>", "<pad>", "é", "hello", " ", "\t", "42"]


def _byte_level(core: Tokenizer) -> None:
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()


def _metaspace_first(core: Tokenizer) -> None:
    core.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    core.decoder = decoders.Metaspace(prepend_scheme="first")


def _stripping_eos(core: Tokenizer) -> None:
    _byte_level(core)
    core.add_special_tokens([AddedToken("</s>", lstrip=True, rstrip=True, special=True)])


def _model_dir(tmp: Path, shape: Callable[[Tokenizer], None]) -> Path:
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    shape(core)
    alphabet = pre_tokenizers.ByteLevel.alphabet() if shape is not _metaspace_first else []
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False
    )
    core.train_from_iterator(CORPUS, trainer=trainer)
    if shape is _stripping_eos:
        shape(core)  # re-declare after training, as a tokenizer_config.json can
    core.save(str(tmp / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (tmp / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    (tmp / "config.json").write_text(json.dumps({"vocab_size": 400}))
    return tmp


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    return HfTokenizer(_model_dir(tmp_path_factory.mktemp("bpe"), _byte_level))


def test_byte_level_bpe_splits_at_the_templates_special_tokens(byte_level: HfTokenizer) -> None:
    assert byte_level.split_before == ("</s>", "<s>")  # <unk>, <pad>: not in the template


def test_a_token_that_strips_whitespace_is_never_a_split_point(tmp_path: Path) -> None:
    tok = HfTokenizer(_model_dir(tmp_path, _stripping_eos))
    assert "</s>" not in tok.split_before


def _growing_chat_matches_whole_encode(tok: HfTokenizer, seed: int) -> None:
    rng = random.Random(seed)

    def text(n: int) -> str:
        return "".join(rng.choice(PIECES) for _ in range(n))

    def encode(piece: str) -> list[int]:
        return tok.encode(piece, add_special_tokens=False)

    messages = [{"role": "system", "content": text(20)}]
    previous = None
    for _ in range(5):
        if rng.random() < 0.2 and len(messages) > 1:  # the client rewrites history
            messages[rng.randrange(len(messages))]["content"] = text(6)
        messages.append({"role": "user", "content": text(10)})
        rendered = tok.render_chat(messages, add_generation_prompt=True)
        chat = encode_chat_text(rendered, encode, tok.split_before, previous)
        assert list(chat.ids) == tok.encode_chat(messages, add_generation_prompt=True)
        messages.append({"role": "assistant", "content": text(5)})
        previous = chat


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_byte_level_incremental_ids_are_the_whole_encodes(
    byte_level: HfTokenizer, seed: int
) -> None:
    _growing_chat_matches_whole_encode(byte_level, seed)


@pytest.mark.parametrize("shape", [_metaspace_first, _stripping_eos])
def test_whatever_the_probe_accepts_gives_the_whole_encodes_ids(
    tmp_path: Path, shape: Callable[[Tokenizer], None]
) -> None:
    tok = HfTokenizer(_model_dir(tmp_path, shape))
    for seed in range(30):
        _growing_chat_matches_whole_encode(tok, seed)
