"""Tokenizer + chat template, rendered the way HF transformers' ``apply_chat_template`` does.

The template runs in the same Jinja set-up transformers uses (sandboxed, ``trim_blocks``,
``lstrip_blocks``, loop controls, a ``tojson`` that does not HTML-escape, ``raise_exception``,
``strftime_now``) and sees the same variables (``messages``, ``add_generation_prompt``, ``tools``,
``documents`` and the special-token strings), so a prompt means the same thing here and there.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with its special-token ids and chat template."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ):
        self.backend = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> Tokenizer:
        """Read an HF tokenizer directory: ``tokenizer.json`` and, if present,
        ``tokenizer_config.json`` (special tokens, ``chat_template``, ``add_bos_token``)."""
        directory = Path(directory)
        if not (directory / "tokenizer.json").exists():
            raise ValueError(f"{directory} has no tokenizer.json; cannot turn text into tokens")
        config = {}
        if (directory / "tokenizer_config.json").exists():
            config = json.loads((directory / "tokenizer_config.json").read_text())
        backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))

        def token_id(name):
            token = config.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            return None if token is None else backend.token_to_id(token)

        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            pad_token_id=token_id("pad_token"),
            unk_token_id=token_id("unk_token"),
            chat_template=config.get("chat_template"),
            add_bos_token=bool(config.get("add_bos_token", False)),
        )

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json``, what ``from_directory`` reads."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {**self.special_tokens_map, "chat_template": self.chat_template, "add_bos_token": self.add_bos_token}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        tokens = {
            "bos_token": self.token(self.bos_token_id),
            "eos_token": self.token(self.eos_token_id),
            "unk_token": self.token(self.unk_token_id),
            "pad_token": self.token(self.pad_token_id),
        }
        return {k: v for k, v in tokens.items() if v is not None}

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos_token if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; pass a plain prompt instead")
        for m in messages:
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"chat messages need 'role' and 'content' keys, got {m!r}")
        return _compile_template(self.chat_template).render(
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered conversation (special tokens in the text are parsed as such)."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt), add_bos=False)
