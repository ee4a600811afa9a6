"""``dspark`` command line: ``demo``, ``generate``, ``convert``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "A shop sells pencils at 3 for 25 cents. How much do 12 pencils cost?",
    "Give me three tips for staying focused while studying.",
)


def load_target(checkpoint: str | None):
    """The embedded SmolLM2 target, or a GGUF file / HF checkpoint directory."""
    from dspark_jax.checkpoints.gguf import load_embedded_target, load_gguf

    if checkpoint is None:
        return load_embedded_target()
    path = Path(checkpoint)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path)
    if path.is_dir():
        from tokenizers import Tokenizer as HFTokenizer

        from dspark_jax.checkpoints.hf import load_hf_checkpoint
        from dspark_jax.tokenizer import Tokenizer

        target = load_hf_checkpoint(path)
        if not (path / "tokenizer.json").exists():
            raise SystemExit(f"{path} has no tokenizer.json; cannot turn text into tokens")
        config = {}
        if (path / "tokenizer_config.json").exists():
            config = json.loads((path / "tokenizer_config.json").read_text())
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))

        def token_id(name):
            token = config.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            return None if token is None else backend.token_to_id(token)

        tokenizer = Tokenizer(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            pad_token_id=token_id("pad_token"),
            chat_template=config.get("chat_template"),
        )
        return target, tokenizer
    raise SystemExit(f"--checkpoint must be a .gguf file or an HF checkpoint directory: {checkpoint}")


def _encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def cmd_generate(args) -> int:
    from dspark_jax.config import SamplingConfig
    from dspark_jax.decoding.autoregressive import AutoregressiveGenerator

    if not args.prompt:
        raise SystemExit("--prompt is empty")
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    target, tokenizer = load_target(args.checkpoint)
    ids = _encode(tokenizer, args.prompt, args.chat)
    generator = AutoregressiveGenerator(target)
    max_len = generator.cache_len_for([len(ids)], args.max_new_tokens)
    compile_s = generator.warmup(1, len(ids), max_len)
    result = generator.generate(
        [ids],
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seeds=[args.seed],
        stop_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
        max_len=max_len,
    )
    print(tokenizer.decode(result.tokens[0]))
    print(
        f"[{len(result.tokens[0])} tokens, finish={result.finish_reasons[0]}; prompt {len(ids)} tokens; "
        f"prefill {result.prefill_s * 1e3:.0f} ms; decode {result.decode_tokens_per_s:.1f} tokens/s; "
        f"compile {compile_s:.1f} s]",
        file=sys.stderr,
    )
    return 0


def cmd_demo(args) -> int:
    from dspark_jax.decoding.autoregressive import AutoregressiveGenerator

    start = time.perf_counter()
    target, tokenizer = load_target(None)
    print(f"embedded target: SmolLM2-135M-Instruct, {target.num_params / 1e6:.1f}M parameters, "
          f"loaded in {time.perf_counter() - start:.1f} s")
    generator = AutoregressiveGenerator(target)
    prompts = [_encode(tokenizer, p, chat=True) for p in DEMO_PROMPTS]
    stops = [tokenizer.eos_token_id]
    max_len = generator.cache_len_for([len(p) for p in prompts], args.max_new_tokens)

    print(f"\n== target-only greedy decoding, one request at a time (B=1), {args.max_new_tokens} new tokens max")
    generator.warmup(1, max(len(p) for p in prompts), max_len)
    for text, ids in zip(DEMO_PROMPTS, prompts):
        r = generator.generate([ids], max_new_tokens=args.max_new_tokens, stop_ids=stops, max_len=max_len)
        print(f"\n> {text}\n{tokenizer.decode(r.tokens[0]).strip()}")
        print(f"  [{len(r.tokens[0])} tokens, prefill {r.prefill_s * 1e3:.0f} ms, "
              f"{r.decode_tokens_per_s:.1f} tokens/s]")

    print(f"\n== the same {len(prompts)} prompts as one batch (B={len(prompts)})")
    generator.warmup(len(prompts), max(len(p) for p in prompts), max_len)
    r = generator.generate(prompts, max_new_tokens=args.max_new_tokens, stop_ids=stops, max_len=max_len)
    total = r.num_generated
    print(f"  {total} tokens in {r.prefill_s + r.decode_s:.2f} s: "
          f"{total / (r.prefill_s + r.decode_s):.1f} tokens/s overall, {r.steps} decode steps")
    print("\n(DSpark speculative decoding is shown here side by side once a trained drafter ships.)")
    return 0


def cmd_convert(args) -> int:
    from dspark_jax.checkpoints.gguf import embedded_gguf_path, load_gguf
    from dspark_jax.checkpoints.hf import save_hf_checkpoint

    source = Path(args.gguf) if args.gguf else embedded_gguf_path()
    target, tokenizer = load_gguf(source)
    out = save_hf_checkpoint(target.module(), args.out)
    tokenizer.backend.save(str(Path(out) / "tokenizer.json"))
    special = tokenizer.special_tokens_map
    (Path(out) / "tokenizer_config.json").write_text(
        json.dumps({**special, "chat_template": tokenizer.chat_template}, indent=2)
    )
    print(f"wrote HF checkpoint to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a few real prompts on the embedded target")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="generate text from one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--checkpoint", default=None, help="GGUF file or HF directory (default: embedded SmolLM2)")
    gen.set_defaults(func=cmd_generate)

    conv = sub.add_parser("convert", help="write a GGUF model as an HF checkpoint directory")
    conv.add_argument("--gguf", default=None, help="GGUF file (default: the embedded SmolLM2)")
    conv.add_argument("--out", required=True)
    conv.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:  # bad input: a clear message, not a traceback
        print(f"dspark {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
