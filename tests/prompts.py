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
