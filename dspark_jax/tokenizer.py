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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors
from tokenizers.decoders import DecodeStream

from dspark_jax.config import read_json


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which transformers' templates use to mark the
    assistant's tokens for training masks: here its body is simply rendered."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class ChatTemplateError(ValueError, jinja2.TemplateError):
    """A chat template refused the conversation (``raise_exception``) or does not parse: a
    ``ValueError`` as every bad input here, and the ``jinja2.TemplateError`` transformers'
    ``apply_chat_template`` raises, so code written for either catches it."""


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def _chat_templates(directory: Path, config: dict) -> tuple[str | None, list[str]]:
    """(the default chat template or None, the names of the others), where transformers 5 finds
    them: ``chat_template.jinja`` and ``additional_chat_templates/<name>.jinja`` (what its
    ``save_pretrained`` writes), else ``chat_template`` in ``tokenizer_config.json``."""
    extra = directory / "additional_chat_templates"
    named = sorted(p.stem for p in extra.glob("*.jinja")) if extra.is_dir() else []
    if (directory / "chat_template.jinja").exists():
        return (directory / "chat_template.jinja").read_text(), named
    template = config.get("chat_template")
    if isinstance(template, list):
        by_name = {entry["name"]: entry["template"] for entry in template}
        return by_name.pop("default", None), sorted(set(named) | set(by_name))
    return template, named


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with its special-token ids and chat template.

    What plain text gets around it (a BOS token, say) is the backend's post-processor, as in
    transformers 5: ``encode`` applies it, ``apply_chat_template`` does not (the template writes
    its own special tokens)."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
        named_chat_templates: Sequence[str] = (),
        add_bos_token: bool = False,
        end_of_turn_ids: Sequence[int] = (),
    ):
        self.backend = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        # Tokens besides EOS that end a model's answer (generation_config.json's eos_token_id list,
        # a GGUF's end-of-turn token): a model whose EOS is <|endoftext|> ends a chat turn with
        # <|im_end|>, and decoding past it runs on into an invented next turn.
        self.end_of_turn_ids = tuple(int(i) for i in end_of_turn_ids if i != eos_token_id)
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        # Names of templates other than the default one (e.g. "tool_use"), for the error when
        # there is no default to render with.
        self.named_chat_templates = tuple(named_chat_templates)
        if add_bos_token:  # where the post-processor does not already
            self._add_bos_to_plain_text()

    @property
    def stop_ids(self) -> list[int]:
        """The tokens that end an answer: EOS and the model's end-of-turn tokens."""
        return ([] if self.eos_token_id is None else [self.eos_token_id]) + list(self.end_of_turn_ids)

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> Tokenizer:
        """Read an HF tokenizer directory the way transformers does: ``tokenizer.json``; the
        special tokens of ``tokenizer_config.json``, overridden by ``special_tokens_map.json`` only
        in a config without ``added_tokens_decoder`` (one older than transformers 4.34, whose
        special tokens lived in the map); the chat template from ``chat_template.jinja``, else
        ``tokenizer_config.json`` (a string, or a list of named templates of which "default" is
        used); and the stop tokens of ``generation_config.json`` (``eos_token_id``, an id or a
        list), which ``generate`` stops at as transformers' does. ``add_bos_token: true`` in the
        config adds BOS to plain text where the post-processor does not already, as the Llama
        tokenizers of transformers do (its generic tokenizer class follows the post-processor
        alone)."""
        directory = Path(directory)
        if not (directory / "tokenizer.json").exists():
            raise ValueError(f"{directory} has no tokenizer.json; cannot turn text into tokens")
        config = read_json(directory / "tokenizer_config.json", default={})
        special = config if "added_tokens_decoder" in config else {
            **config, **read_json(directory / "special_tokens_map.json", default={})}
        try:
            backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as error:  # the tokenizers library raises a bare Exception for a damaged file
            raise ValueError(f"{directory / 'tokenizer.json'} is not a tokenizer the tokenizers library reads "
                             f"({error})") from None

        def token_id(name):
            token = special.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            return None if token is None else backend.token_to_id(token)

        template, named = _chat_templates(directory, config)
        generation = read_json(directory / "generation_config.json", default={})
        stops = generation.get("eos_token_id") if isinstance(generation, dict) else None
        stops = [stops] if isinstance(stops, int) else stops or []
        if not (isinstance(stops, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                and 0 <= i < backend.get_vocab_size() for i in stops)):
            raise ValueError(f"{directory / 'generation_config.json'}: eos_token_id must be a token id or a list "
                             f"of them, got {generation.get('eos_token_id')!r}")
        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            pad_token_id=token_id("pad_token"),
            unk_token_id=token_id("unk_token"),
            chat_template=template,
            named_chat_templates=named,
            add_bos_token=bool(config.get("add_bos_token", False)),
            end_of_turn_ids=stops,
        )

    def _add_bos_to_plain_text(self) -> None:
        """Make ``encode`` start plain text with BOS (a no-op where it already does)."""
        if self.add_bos_token:
            return
        if self.bos_token_id is None:
            raise ValueError("add_bos_token is set but the tokenizer names no BOS token")
        bos = self.token(self.bos_token_id)
        prepend = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, self.bos_token_id)])
        current = self.backend.post_processor
        self.backend.post_processor = prepend if current is None else processors.Sequence([current, prepend])

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode`` starts plain text with BOS."""
        ids = self.backend.encode("", add_special_tokens=True).ids
        return self.bos_token_id is not None and ids[:1] == [self.bos_token_id]

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and, where there are stop tokens
        besides EOS, ``generation_config.json``: what ``from_directory`` reads."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        # add_bos_token is what the post-processor in tokenizer.json does, written for readers
        # that go by the config (transformers 4's Llama tokenizers).
        config = {**self.special_tokens_map, "chat_template": self.chat_template, "add_bos_token": self.add_bos_token}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        if self.end_of_turn_ids:  # where transformers' generate finds the stop tokens too
            (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": self.stop_ids}, indent=2))

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
        """Token ids of plain text: with what the post-processor adds (None, as transformers'
        ``encode``), with nothing added (False), or with BOS alone in front (True)."""
        if add_bos is None:
            return self.backend.encode(text, add_special_tokens=True).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id] + ids if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, *, skip_special_tokens: bool = True) -> Callable[[Sequence[int]], str]:
        """For streaming output: a function given each next piece of a token list that returns the
        text the piece completes. A character split over tokens (a byte-level BPE token may hold
        part of one) comes out with the token that completes it, so the pieces join to ``decode``
        of the whole list (tokenizers' ``DecodeStream``)."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)

        def text_of(ids: Sequence[int]) -> str:
            return "".join(piece for i in ids if (piece := stream.step(self.backend, int(i))) is not None)

        return text_of

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            named = f" (only named ones: {', '.join(self.named_chat_templates)})" if self.named_chat_templates else ""
            raise ValueError(f"this tokenizer has no default chat template{named}; pass a plain prompt instead")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        for m in messages:
            if not isinstance(m, Mapping) or "role" not in m:
                raise ValueError(f"chat messages are mappings with a 'role' key, got {m!r}")
        try:
            return _compile_template(self.chat_template).render(
                # Keys set to None are left out (JSON's null, an absent field): a template testing
                # ``message.content is defined`` sees a tool-call turn without content as such,
                # where the None would render as the text "None".
                messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens_map,
            )
        except jinja2.TemplateError as error:  # the template refused the conversation, or does not parse
            raise ChatTemplateError(f"the chat template: {error}") from None

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered conversation (special tokens in the text are parsed as such)."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt), add_bos=False)
