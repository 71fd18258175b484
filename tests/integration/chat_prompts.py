"""The chat prompts the real-model tests compare against transformers (CPU and GPU alike)."""

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is in one sentence.",
    "List three colors.",
    "How do I reverse a list in Python?",
    "What is 12 times 7?",
    "Tell me a fun fact about cats.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for staying focused.",
    "Describe the color blue to someone who cannot see.",
]
