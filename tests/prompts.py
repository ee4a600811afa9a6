"""Real prompts of mixed kinds and lengths for tests on the embedded target."""

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]
PLAIN_TEXT = "def fib(n):"


def mixed_prompts(tokenizer) -> list[list[int]]:
    """Three chat-templated questions and one plain (non-chat) code prompt: four lengths."""
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return chat + [tokenizer.encode(PLAIN_TEXT)]


def random_drafter(target_cfg, block_size: int = 7, tap_layers=(1, 8, 15, 22, 28)):
    """An untrained DSpark drafter for the embedded target (or a truncated copy, with
    ``tap_layers`` it has): its drafts are (almost) all rejected, so every round exercises
    rejection, rollback and a full-width verify."""
    import numpy as np

    from dspark_jax.checkpoints.drafter import build_drafter
    from dspark_jax.config import DrafterConfig

    cfg = DrafterConfig.for_target(
        target_cfg, num_layers=1, tap_layers=tap_layers, mask_token_id=0,
        block_size=block_size, draft_vocab_size=4096,
    )
    return build_drafter(cfg, seed=0, draft_vocab_ids=np.arange(4096))
