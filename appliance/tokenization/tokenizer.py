"""Text <-> token ids, identical to vLLM's for the same model directory: the simulated
engine's tokenizer, and the one the router tokenises sessions with.

Model of the world: vLLM tokenises a completion prompt with the model's Hugging Face fast
tokenizer (`tokenizer.json`; BOS comes from its post-processor when `add_special_tokens`),
and a chat by rendering the model's Jinja chat template to text (`chat_template.py`; the
special tokens are variables) and tokenising that text without adding special tokens.
Given the same model directory, `HfTokenizer` therefore yields vLLM's token ids, which is
what makes the simulated block hashes equal real ones. Without a model directory,
`FallbackTokenizer` gives deterministic ids (each word hashed into the vocabulary) and a
built-in template; its ids match nothing real, but they are stable across processes, so
hashes still agree between simulated workers and the router.

Generated text: `word_token_ids` lists tokens that decode to a short lower-case word, from
which the engine front end draws lorem-like output that decodes cleanly token by token.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2

from appliance.tokenization.chat_template import (
    FALLBACK_CHAT_TEMPLATE,
    ChatTemplateError,
    compile_chat_template,
    normalize_messages,
)

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_WORD = re.compile(r"^ ?[a-z]{2,12}$")


class ModelTokenizer:
    """What the simulated server and the router need of a tokenizer; subclasses fill in the
    codec."""

    bos_token: str = "<s>"
    eos_token: str = "</s>"
    unk_token: str = "<unk>"
    pad_token: str = "<pad>"
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    max_token_id: int = 0
    """Largest id accepted in a token prompt (vLLM: the tokenizer's or the model's vocab)."""
    chat_template: str = FALLBACK_CHAT_TEMPLATE
    split_before: tuple[str, ...] = ()
    """Strings before which `encode` cuts the text and tokenises the pieces on their own:
    `encode(a + b, add_special_tokens=False) == encode(a, ...) + encode(b, ...)` whenever
    `b` starts with one of them. A router may then tokenise a growing chat incrementally.
    Empty: no such promise. A Hugging Face tokenizer promises it for the special tokens
    its chat template uses, when a probe at load time confirms it (see `HfTokenizer`)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str:
        raise NotImplementedError

    def special_ids(self) -> frozenset[int]:
        raise NotImplementedError

    def vocab_ids(self) -> range:
        return range(self.max_token_id + 1)

    @cached_property
    def _template(self) -> jinja2.Template:
        return compile_chat_template(self.chat_template)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat rendered to text, as transformers' `apply_chat_template` does."""
        if not messages:
            raise ChatTemplateError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        chat = normalize_messages(messages)
        if continue_final_message:
            chat[-1]["content"] = str(chat[-1]["content"]) + _CONTINUE_TAG
        kwargs = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
            **dict(template_kwargs or {}),
        }
        try:
            rendered = self._template.render(
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
        if continue_final_message:
            tag = rendered.rfind(_CONTINUE_TAG.strip())
            if tag < 0:
                raise ChatTemplateError(
                    "continue_final_message is set but the final message does not appear in "
                    "the chat after applying the chat template!"
                )
            if rendered[tag : tag + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
                rendered = rendered[:tag]
            else:
                rendered = rendered[:tag].rstrip()
        return rendered

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of a rendered chat (no special tokens added beyond the template's)."""
        add_special = bool(kwargs.pop("add_special_tokens", False))
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=add_special)

    @cached_property
    def word_token_ids(self) -> tuple[int, ...]:
        """Tokens that decode on their own to a short lower-case word (lorem output)."""
        special = self.special_ids()
        words = tuple(
            i
            for i in self.vocab_ids()
            if i not in special and _WORD.match(self.decode([i], skip_special_tokens=True))
        )
        return words or tuple(i for i in self.vocab_ids() if i not in special)


class HfTokenizer(ModelTokenizer):
    """A model directory's `tokenizer.json`, `tokenizer_config.json` and chat template."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer  # a dependency; imported where it is used

        root = Path(model_dir)
        self.model_dir = root
        self._tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(name)
            if isinstance(value, Mapping):
                value = value.get("content")
            if isinstance(value, str):
                setattr(self, name, value)
        self.bos_token_id = self._tok.token_to_id(self.bos_token)
        self.eos_token_id = self._tok.token_to_id(self.eos_token)
        vocab_max = max(self._tok.get_vocab(with_added_tokens=True).values(), default=0)
        model_vocab = _read_json(root / "config.json").get("vocab_size")
        self.max_token_id = max(vocab_max, int(model_vocab) - 1 if model_vocab else 0)
        template_file = root / "chat_template.jinja"
        if template_file.is_file():
            self.chat_template = template_file.read_text()
        elif isinstance(config.get("chat_template"), str):
            self.chat_template = config["chat_template"]
        self._special = _added_specials(self._tok.get_added_tokens_decoder())
        self.split_before = self._split_points()

    def _split_points(self) -> tuple[str, ...]:
        """The special tokens of the chat template at which `encode` provably cuts.

        Hugging Face tokenizers split the input at added tokens and tokenise the pieces
        between them on their own, which is the promise, unless the token strips the
        whitespace beside it or the normaliser or pre-tokeniser treats the start of the
        input differently (SentencePiece's "prepend a space to the first piece"). Rather
        than trusting configuration, each candidate is probed with texts that end and
        start in every way a chat does; one mismatch and it is not a split point."""
        try:
            chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
            rendered = self.render_chat(chat) + self.chat_template
        except ChatTemplateError:
            rendered = self.chat_template
        candidates = [
            t.content
            for t in self._tok.get_added_tokens_decoder().values()
            if t.special and not (t.lstrip or t.rstrip or t.single_word)
            if t.content and t.content in rendered
        ]
        heads = ("", "x", "hello world", "a\n", "b ", " \n\t", "é.")
        tails = ("", "\n", "user\nhi there", " x", "\n\n", "é")

        def encode(text: str) -> list[int]:
            return list(self._tok.encode(text, add_special_tokens=False).ids)

        def splits(token: str) -> bool:
            return all(
                encode(head + token + tail) == encode(head) + encode(token + tail)
                for head in heads
                for tail in tails
            )

        return tuple(sorted(t for t in candidates if splits(t)))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        known = [i for i in ids if 0 <= i <= self.max_token_id]
        return str(self._tok.decode(known, skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def special_ids(self) -> frozenset[int]:
        return self._special


def _added_specials(decoder: Mapping[int, Any]) -> frozenset[int]:
    return frozenset(i for i, t in decoder.items() if getattr(t, "special", False))


class FallbackTokenizer(ModelTokenizer):
    """Deterministic ids without a model: each word (with its leading space) or run of
    punctuation hashes (CRC-32) into the vocabulary above the four special tokens."""

    _PIECE = re.compile(r" ?\w+| ?[^\w\s]+|\s+")
    _SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
    split_before = _SPECIALS  # encode tokenises the text between specials piece by piece
    _SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "da", "pe", "qui", "zo")

    def __init__(self, vocab_size: int = 32_000) -> None:
        self.vocab_size = vocab_size
        self.max_token_id = vocab_size - 1
        self.bos_token_id, self.eos_token_id = 1, 2

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = [1] if add_special_tokens else []
        pos = 0
        for special in re.finditer("|".join(map(re.escape, self._SPECIALS)), text):
            ids += self._encode_plain(text[pos : special.start()])
            ids.append(self._SPECIALS.index(special.group()))
            pos = special.end()
        return ids + self._encode_plain(text[pos:])

    def _encode_plain(self, text: str) -> list[int]:
        span = self.vocab_size - len(self._SPECIALS)
        return [
            len(self._SPECIALS) + zlib.crc32(piece.encode()) % span
            for piece in self._PIECE.findall(text)
        ]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return "".join(
            self.id_to_token(i)
            for i in ids
            if 0 <= i <= self.max_token_id and not (skip_special_tokens and i < 4)
        )

    def id_to_token(self, token_id: int) -> str:
        if token_id < len(self._SPECIALS):
            return self._SPECIALS[token_id]
        n, parts = token_id, []
        for _ in range(2 + token_id % 2):
            n, r = divmod(n, len(self._SYLLABLES))
            parts.append(self._SYLLABLES[r])
        return " " + "".join(parts)

    def special_ids(self) -> frozenset[int]:
        return frozenset(range(len(self._SPECIALS)))

    def vocab_ids(self) -> range:
        return range(len(self._SPECIALS), min(self.vocab_size, 4096))


def load_tokenizer(model_dir: str | Path | None) -> ModelTokenizer:
    """The model directory's tokenizer, or the fallback when there is none (None, or a
    name that is not a directory holding `tokenizer.json`)."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return HfTokenizer(model_dir)
    return FallbackTokenizer()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
