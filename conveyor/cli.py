"""The ``conveyor`` command line: ``list`` (chat templates) and ``chat`` (terminal chat, in-process)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from conveyor.services.chat_template import list_chat_templates


def _cmd_list(args: argparse.Namespace) -> int:
    """Print the built-in chat template names, one per line."""
    for name in list_chat_templates():
        print(name)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    """Multi-turn chat in the terminal; the session's history stays in the engine's KV cache."""
    import sys

    from conveyor import EngineConfig, GenerationConfig, pipeline
    from conveyor.default_model import fetch
    from conveyor.services.chat_template import ChatTemplateConfig

    model = args.model or str(fetch())
    config = EngineConfig(session_len=args.session_len, cache_max_entry_count=args.cache_max_entry_count,
                          enable_prefix_caching=True, device=args.device)
    template = ChatTemplateConfig(model_name=args.chat_template) if args.chat_template else None
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, top_k=args.top_k, top_p=args.top_p,
                           temperature=args.temperature)
    interactive = sys.stdin.isatty()
    with pipeline(model, config, chat_template_config=template) as pipe:
        session = pipe.session()
        while True:
            if interactive:
                print("\ndouble enter to send, 'exit' to quit, 'end' to start over")
            prompt = _read_prompt(interactive)
            if prompt is None or prompt.strip() == "exit":
                break
            if prompt.strip() == "end":
                session.close()
                session = pipe.session()
                continue
            if not prompt.strip():
                continue
            stream = pipe.chat(prompt, session=session, gen_config=gen, stream_response=True)
            for chunk in stream:
                print(chunk.text, end="", flush=True)
            print()
    return 0


def _read_prompt(interactive: bool) -> str | None:
    """One prompt: up to a blank line when typing, one line per prompt when piped."""
    import sys

    if not interactive:
        line = sys.stdin.readline()
        return None if not line else line.rstrip("\n")
    lines = []
    while True:
        try:
            line = input("> " if not lines else "")
        except EOFError:
            return "\n".join(lines) if lines else None
        if not line and lines:
            return "\n".join(lines)
        lines.append(line)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand sets ``func`` to its handler (args -> exit code)."""
    parser = argparse.ArgumentParser(prog="conveyor", description="Serve large language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p_list = sub.add_parser("list", help="list the built-in chat template names")
    p_list.set_defaults(func=_cmd_list)
    p_chat = sub.add_parser("chat", help="chat with a model in the terminal (in-process engine)")
    p_chat.add_argument("model", nargs="?", default=None,
                        help="model directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    p_chat.add_argument("--session-len", type=int, default=None)
    p_chat.add_argument("--cache-max-entry-count", type=float, default=0.2)
    p_chat.add_argument("--chat-template", default=None, help="a built-in template name (see conveyor list)")
    p_chat.add_argument("--max-new-tokens", type=int, default=512)
    p_chat.add_argument("--temperature", type=float, default=0.8)
    p_chat.add_argument("--top-k", type=int, default=40)
    p_chat.add_argument("--top-p", type=float, default=0.8)
    p_chat.add_argument("--device", default="auto")
    p_chat.set_defaults(func=_cmd_chat)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``conveyor`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
